"""Bad input, every script: one readable message, a non-zero exit, within seconds, no traceback.

World-size checks run before any process group exists, so they are exercised here the way
torchrun would trigger them, by giving one process torchrun's environment (RANK=0,
WORLD_SIZE=W); test_world_size_error_under_real_torchrun shows the real launcher too.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers import ROOT, Run, python, torchrun


def as_rank0_of(world):
    return {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
    }


OFFLINE = {"PYTHONPATH": str(ROOT / "tests" / "faults"), "OFFLINE": "1"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "junk.pt").write_text("this is not a checkpoint")
    torch.save({"a": [1, 2, 3]}, d / "notsd.pt")
    import common

    small = common.build_model(
        common.parse_args(common.get_parser("t"), ["--dim", "32", "--depth", "2"])
    )
    torch.save(small.state_dict(), d / "dim32.pt")
    (d / "notdcp").mkdir()
    (d / "notdcp" / "model.pt").write_text("a directory, but no DCP checkpoint in it")
    (d / "empty").mkdir()
    return d


CASES = [
    # script, argv, env, expected message
    ("ddp.py", ["--nproc", "0"], None, "--nproc must be >= 1, got 0"),
    (
        "ddp.py",
        ["--nproc", "3", "--batch-size", "32"],
        None,
        "--batch-size 32 is not divisible by world size 3",
    ),
    ("ddp.py", ["--data", "foo"], None, "argument --data: invalid choice: 'foo'"),
    ("ddp.py", ["--backend", "nccl", "--nproc", "1"], None, "--backend nccl needs a CUDA GPU"),
    ("ddp.py", ["--patch", "5"], None, "--patch 5 does not divide the 28-pixel image side"),
    ("ddp.py", ["--warmup", "1.5"], None, "--warmup is a fraction of the steps in [0, 1), got 1.5"),
    (
        "dp.py",
        ["--nproc", "2"],
        None,
        "dp.py is one process driving every GPU: --nproc does not apply",
    ),
    ("ddp.py", ["--load", "{d}/missing.pt"], None, "--load {d}/missing.pt: no such file"),
    (
        "ddp_torchrun.py",
        ["--batch-size", "30"],
        as_rank0_of(4),
        "--batch-size 30 is not divisible by world size 4",
    ),
    (
        "ddp_torchrun.py",
        ["--data", "mnist", "--data-dir", "{d}/empty"],
        OFFLINE,
        "--data mnist: MNIST is not in {d}/empty/MNIST/raw and could not be downloaded",
    ),
    (
        "dp.py",
        ["--load", "{d}/junk.pt"],
        None,
        "--load {d}/junk.pt: not a checkpoint torch.load can read",
    ),
    ("dp.py", ["--optim", "lamb"], None, "argument --optim: invalid choice: 'lamb'"),
    ("amp_checkpoint.py", ["--amp", "fp16"], None, "fp16"),
    (
        "amp_checkpoint.py",
        ["--load", "{d}/dim32.pt"],
        None,
        "--load {d}/dim32.pt: tensor 'embed.pos' has shape (1, 16, 32), "
        "this model needs (1, 16, 64)",
    ),
    ("zero.py", ["--stage", "4"], None, "argument --stage: invalid choice: 4"),
    ("zero.py", ["--batch-size", "32"], as_rank0_of(3), "--batch-size 32 is not divisible"),
    ("zero.py", ["--load", "{d}/notsd.pt"], None, "--load {d}/notsd.pt: not a state_dict"),
    (
        "zero_offload.py",
        ["--offload", "disk"],
        None,
        "--offload disk needs --offload-dir DIR, an existing writable directory",
    ),
    (
        "zero_offload.py",
        ["--offload", "disk", "--offload-dir", "{d}/junk.pt"],
        None,
        "--offload disk needs --offload-dir DIR, an existing writable directory (got {d}/junk.pt)",
    ),
    (
        "deepspeed_zero.py",
        ["--stage", "2", "--offload", "disk", "--offload-dir", "{d}"],
        None,
        "--offload disk swaps to NVMe at --stage 3 only: at stage 2 DeepSpeed would keep the "
        "optimizer state in CPU memory instead; give --stage 3, or --offload cpu",
    ),
    (
        "deepspeed_zero.py",
        ["--grad-accum", "5"],
        as_rank0_of(2),
        "--grad-accum 5 must be >= 1 and divide the 64 samples each rank gets per step",
    ),
    (
        "fsdp_resume.py",
        ["--dcp", "{d}/notdcp"],
        None,
        "--dcp {d}/notdcp: not a torch.distributed.checkpoint directory",
    ),
    (
        "fsdp_resume.py",
        ["--dcp", "{d}/junk.pt"],
        None,
        "--dcp {d}/junk.pt: not a torch.distributed.checkpoint directory",
    ),
    (
        "fsdp.py",
        ["--load", "{d}/dim32.pt", "--dim", "32", "--depth", "3"],
        None,
        "--load {d}/dim32.pt: missing tensor 'blocks.2.norm1.weight'",
    ),
    (
        "tensor_parallel.py",
        ["--heads", "4"],
        as_rank0_of(3),
        "--heads 4 is not divisible by the 3 tensor-parallel",
    ),
    (
        "tensor_parallel.py",
        ["--sequence-parallel", "--heads", "6", "--dim", "48"],
        as_rank0_of(3),
        "--sequence-parallel splits the 16 tokens over ranks: 3 does not divide them",
    ),
    (
        "tensor_parallel_zero_r.py",
        ["--partition-activations", "--heads", "6", "--dim", "48"],
        as_rank0_of(3),
        "--partition-activations splits the 16 tokens over ranks: 3 does not divide them",
    ),
    (
        "pipeline.py",
        ["--depth", "2"],
        as_rank0_of(4),
        "--depth 2 blocks cannot fill 4 pipeline stages",
    ),
    (
        "pipeline.py",
        ["--schedule", "gpipe", "--microbatches", "3", "--batch-size", "32"],
        as_rank0_of(2),
        "--batch-size 32 is not divisible",
    ),
    (
        "pipeline.py",
        ["--schedule", "1f1b", "--microbatches", "2"],
        as_rank0_of(4),
        "--microbatches",
    ),
    (
        "context_parallel.py",
        [],
        as_rank0_of(3),
        "--patch 7 gives 16 tokens: not divisible by 3 ranks",
    ),
    (
        "context_parallel.py",
        ["--method", "ulysses", "--patch", "2", "--heads", "2", "--dim", "32"],
        as_rank0_of(4),
        "--method ulysses: --heads 2 is not divisible by 4 ranks",
    ),
    (
        "context_parallel.py",
        ["--patch", "3"],
        None,
        "--patch 3 does not divide the 28-pixel image side",
    ),
    (
        "nd_parallel.py",
        ["--tp", "2", "--pp", "2", "--dp-shard", "2"],
        as_rank0_of(4),
        "--pp 2 x --dp-replicate 1 x --dp-shard 2 x --tp 2 = 8 ranks, but the world size is 4",
    ),
    ("nd_parallel.py", ["--tp", "-1", "--dp-shard", "-1"], as_rank0_of(4), "at most one -1"),
    (
        "nd_parallel.py",
        ["--tp", "3", "--heads", "4", "--dp-shard", "1"],
        as_rank0_of(3),
        "--heads 4 is not divisible by --tp 3",
    ),
    (
        "nd_parallel.py",
        ["--pp", "4", "--depth", "2", "--schedule", "gpipe"],
        as_rank0_of(4),
        "--pp 4 stages is more than --depth 2 blocks",
    ),
    (
        "nd_parallel.py",
        ["--pp", "2", "--microbatches", "3", "--batch-size", "32"],
        as_rank0_of(4),
        "--batch-size 32 is not divisible by the data-parallel size 2 x 3 micro-batches",
    ),
    (
        "nd_parallel.py",
        ["--pp", "4", "--microbatches", "2", "--depth", "4"],
        as_rank0_of(4),
        "--schedule 1f1b needs --microbatches >= --pp: 2 < 4",
    ),
    (
        "hybrid_parallel.py",
        ["--dp", "2", "--tp", "2"],
        as_rank0_of(2),
        "--pp 1 x --dp 2 x --ep 1 x --cp 1 x --tp 2 = 4 ranks, but the world size is 2",
    ),
    (
        "hybrid_parallel.py",
        ["--cp", "2", "--tp", "2", "--dp", "1"],
        as_rank0_of(4),
        "--cp composes with --dp only (the data x context layout)",
    ),
    (
        "hybrid_parallel.py",
        ["--ep", "2", "--dp", "1"],
        as_rank0_of(2),
        "--experts goes with --ep > 1 (the data x expert layout)",
    ),
    (
        "hybrid_parallel.py",
        ["--cp", "2", "--dp", "1", "--zero-stage", "3"],
        as_rank0_of(2),
        "--zero-stage is for the pp x dp x tp layout",
    ),
    (
        "hybrid_parallel.py",
        ["--ep", "2", "--dp", "1", "--experts", "4", "--mixed-precision"],
        as_rank0_of(2),
        "--mixed-precision is ZeRO's (zero.py's recipe) in the pp x dp x tp layout",
    ),
    (
        "hybrid_parallel.py",
        ["--cp", "3", "--dp", "1"],
        as_rank0_of(3),
        "the 16 tokens (--patch 7) are not divisible by the 3 ranks that split them",
    ),
    (
        "expert_parallel.py",
        ["--experts", "6"],
        as_rank0_of(4),
        "--experts 6 is not divisible by world size 4",
    ),
    (
        "expert_parallel.py",
        ["--experts", "4", "--batch-size", "30"],
        as_rank0_of(4),
        "--batch-size 30 is not divisible by world size 4",
    ),
    (
        "expert_parallel.py",
        [],
        None,
        "expert_parallel.py needs a mixture of experts: give --experts E",
    ),
    (
        "ddp.py",
        ["--experts", "2", "--top-k", "3"],
        None,
        "--top-k 3 must be between 1 and --experts 2",
    ),
    ("ddp.py", ["--experts", "-1"], None, "--experts must be >= 0 (0: the dense MLP), got -1"),
    ("zero.py", ["--experts", "4", "--aux-loss", "-1"], None, "--aux-loss must be >= 0, got -1.0"),
    (
        "tensor_parallel.py",
        ["--experts", "4"],
        None,
        "--experts: tensor_parallel.py splits MLPs by columns",
    ),
    ("amp_checkpoint.py", ["--experts", "4", "--amp", "fp16"], None, "--experts with --amp fp16"),
    (
        "context_parallel.py",
        ["--experts", "4"],
        as_rank0_of(2),
        "--experts: the load-balancing loss",
    ),
    (
        "nd_parallel.py",
        ["--experts", "4"],
        as_rank0_of(2),
        "--experts: nd_parallel.py's tensor-parallel plan",
    ),
    (
        "pipeline_schedules.py",
        ["--schedule", "interleaved", "--virtual-stages", "2"],
        as_rank0_of(4),
        "--depth 4 blocks cannot fill 4 stages x 2 chunks",
    ),
    (
        "pipeline_schedules.py",
        ["--schedule", "zb-h1", "--microbatches", "2"],
        as_rank0_of(4),
        "--schedule zb-h1 needs --microbatches >= 4 stages",
    ),
    (
        "pipeline_pipedream.py",
        ["--depth", "2"],
        as_rank0_of(4),
        "--depth 2 blocks cannot fill 4 pipeline stages",
    ),
    ("ddp.py", ["--simulate", "8"], None, "unrecognized arguments: --simulate 8"),
    ("zero.py", ["--simulate", "8", "--save", "x.pt"], None, "--simulate holds no values"),
    ("zero.py", ["--simulate", "8", "--simulate-rank", "8"], None, "must be in [0, 8), got 8"),
    (
        "zero.py",
        ["--simulate", "8"],
        as_rank0_of(2),
        "--simulate runs one process as one rank of its W",
    ),
    (
        "tensor_parallel.py",
        ["--simulate", "6"],
        None,
        "--heads 4 is not divisible by the 6 tensor-parallel ranks",
    ),
    ("collectives.py", ["--root", "5"], as_rank0_of(2), "--root 5 is not a rank of this world"),
    ("collectives.py", ["--backend", "nccl"], None, "--backend nccl needs a CUDA GPU"),
]


IDS = [f"{c[0]}:{' '.join(c[1])}" for c in CASES]


@pytest.fixture(scope="module")
def outcomes(request, files, tmp_path_factory):
    """The selected cases' outcomes. Most run one after another in one process that imports torch
    once (tests/bad_input_runner.py, each case as `__main__` with its argv and environment); a
    case with a fault injected at interpreter start (PYTHONPATH) gets a process of its own."""
    cases = {
        item.callspec.id: item.callspec.params
        for item in request.session.items
        if item.module is request.module and item.originalname == "test_bad_input"
    }
    in_runner = [name for name, case in cases.items() if "PYTHONPATH" not in (case["env"] or {})]
    alone = [name for name in cases if name not in in_runner]
    listing = [
        dict(
            script=cases[name]["script"],
            argv=[arg.format(d=files) for arg in cases[name]["argv"]],
            env=cases[name]["env"],
        )
        for name in in_runner
    ]
    work = tmp_path_factory.mktemp("runner")
    (work / "cases.json").write_text(json.dumps(listing))

    def launch_alone(name):
        case = cases[name]
        argv = [arg.format(d=files) for arg in case["argv"]]
        return python(case["script"], *argv, env=case["env"], timeout=60)

    with ThreadPoolExecutor(2) as pool:
        runner = pool.submit(
            python,
            "tests/bad_input_runner.py",
            work / "cases.json",
            work / "results.json",
            timeout=30 * len(listing) + 60,
        )
        separate = dict(zip(alone, pool.map(launch_alone, alone), strict=True))
        finished = runner.result()
    assert finished.returncode == 0, finished.output
    results = json.loads((work / "results.json").read_text())
    together = {name: Run(**result) for name, result in zip(in_runner, results, strict=True)}
    return {**together, **separate}


@pytest.mark.parametrize("script,argv,env,message", CASES, ids=IDS)
def test_bad_input(files, outcomes, request, script, argv, env, message):
    r = outcomes[request.node.callspec.id]
    err = r.stderr
    assert r.returncode == 2, r.output
    assert message.format(d=files) in err, r.output
    assert err.count("error:") == 1 and "Traceback" not in err, r.output


def test_world_size_error_under_real_torchrun():
    """Every rank sees the bad batch; only rank 0 says so."""
    r = torchrun("zero.py", 2, "--batch-size", "33", timeout=90)
    assert r.returncode != 0
    assert r.stderr.count("--batch-size 33 is not divisible") == 1, r.output
