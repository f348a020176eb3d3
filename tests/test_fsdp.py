"""fsdp.py (FSDP2 `fully_shard`) and fsdp_resume.py (the same + torch.distributed.checkpoint)
against ddp.py at W=1.

Every launch is a real multi-process run on CPU/Gloo. What is checked: the parameters after N steps
equal one process's (SGD and AdamW, W=2 and W=3, a model whose dim 0s W=3 does not divide); rank 0
holds exactly its padded dim-0 chunks and moves exactly what FSDP2's units must (counted by the
Meter, computed here from the model's shapes); uneven test shards evaluate exactly, without a hang;
a DCP checkpoint resumes (at another W) to the uninterrupted result, and at its --max-steps trains
nothing; --offload cpu runs on the CPU; --mixed-precision computes in bf16 and hands fp32 logits to
the loss.

Launches: one per world size (tests/script_cases.py; W=2: the EQUAL runs, then
fsdp_resume.py's first 5 steps; W=3: the offload run, then the resume), one ddp.py process for
both references, and 3 one-process fsdp_resume.py runs (the finished checkpoint again and two
refusals, whose exit code and stderr are the test).
"""

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import common
from helpers import ddp_references, fork_launch, launch_cases, max_diff, ok

# --limit 1025: the W=2 test shards hold 513 and 512 samples, 2 batches of 512 against 1 (padded
# to 2). --dim 32 (MLP 128, 10 classes, a 1-row position embedding): W=3 divides no dim 0, W=2 not
# the position embedding's, so padded chunks run at both. 1025 // 168 = 6 steps an epoch: step 7 is
# in epoch 1. A constant lr after int(0.4 * 7) = int(0.4 * 5) = 2 warm-up steps: a run stopped
# after 5 steps follows the 7-step run's schedule, and a resume that forgets the scheduler does not.
CFG = [
    "--data",
    "synthetic",
    "--limit",
    "1025",
    "--batch-size",
    "168",
    "--dim",
    "32",
    "--depth",
    "2",
    "--heads",
    "4",
    "--epochs",
    "2",
    "--max-steps",
    "7",
    "--lr-schedule",
    "constant",
    "--warmup",
    "0.4",
    "--no-progress",
    "--timeout",
    "90",
]
# Round-off; AdamW turns it into steps on ~0 gradients: up to 1.9e-5 seen.
TOL = {"sgd": 1e-6, "adamw": 5e-5}
TIMEOUT = 150  # a hang (uneven evaluation) fails the launch; --timeout 90 ends its workers too


def steps(n):
    """CFG with --max-steps n."""
    i = CFG.index("--max-steps")
    return CFG[: i + 1] + [str(n)] + CFG[i + 2 :]


def model_and_args(argv=CFG):
    args = common.parse_args(common.get_parser("test"), argv)
    return common.build_model(args), args


def expected(world, optim, mixed_precision=False):
    """Rank 0's measured bytes and the bytes per step, computed here from the model's shapes.

    FSDP2 gives rank r the contiguous rows [r*c, (r+1)*c) of every parameter, c = ceil(dim0 / W),
    and keeps each shard (and its gradient) in a c-row buffer, zero-padded on the last ranks: rank
    0's share is exactly sum(c * row) elements. A unit's all-gather output and reduce-scatter input
    are W of those buffers; every block is gathered for forward and again for backward, the root
    (embed + head) once, and every unit's gradients are reduce-scattered once."""
    model, _ = model_and_args()

    def chunk(p):
        """Elements in rank 0's padded chunk of parameter p: ceil(dim0 / W) rows."""
        rows = math.ceil(p.shape[0] / world)
        return rows * (p.numel() // p.shape[0])

    shard = sum(chunk(p) for p in model.parameters())
    blocks = sum(chunk(p) for block in model.blocks for p in block.parameters())
    psi = sum(p.numel() for p in model.parameters())
    rows = sum(p.numel() // p.shape[0] for p in model.parameters())
    assert psi <= world * shard <= psi + (world - 1) * rows  # Ψ/W, up to the padding of dim 0
    memory = dict(
        param_bytes=4 * shard,
        grad_bytes=4 * shard,
        optim_bytes=(8 if optim == "adamw" else 4) * shard,
    )
    comm = dict(
        all_gather=(2 if mixed_precision else 4) * world * (2 * blocks + (shard - blocks)),
        reduce_scatter=4 * world * shard,
    )
    return memory, comm, psi


def check_measured(res, world, optim):
    memory, comm, psi = expected(world, optim)
    assert res["params"] == psi and res["world_size"] == world
    assert {k: res[k] for k in memory} == memory
    assert res["comm"] == comm  # all-gather + reduce-scatter only: no all-reduce
    units = 1 + len(model_and_args()[0].blocks)
    n = res["comm_steps"]
    assert res["comm_calls"] == dict(all_gather=n * (2 * units - 1), reduce_scatter=n * units)


def accuracy(path):
    """The accuracy of saved weights over the whole test set, computed here in one process."""
    model, args = model_and_args()
    model.load_state_dict(torch.load(path, weights_only=True))
    _, test_set, _ = common.load_data(args)
    with torch.no_grad():
        correct = (model(test_set.x).argmax(1) == test_set.y).sum().item()
    return correct / len(test_set)


EQUAL = {  # test id: (world, optimizer, extra flags) of an fsdp.py launch
    "W2-sgd": (2, "sgd", []),
    "W2-adamw": (2, "adamw", []),
    "W3-sgd-offload-cpu": (3, "sgd", ["--offload", "cpu"]),
}


RESUME = {  # name: (world, fsdp_resume.py flags but --dcp): 5 steps at W=2, then on to 7 at W=3
    "resume-5": (2, [*steps(5), "--optim", "adamw"]),
    "resume-7": (3, [*CFG, "--optim", "adamw"]),
}


def needed(request):
    """The runs this session's selected tests read, EQUAL ids and RESUME names (all of them in a
    whole run, one for the single test tests/test_mutants.py asks for)."""
    names = set()
    for item in request.session.items:
        if item.module is not request.module:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "case" in params:
            names.add(params["case"])
        if item.originalname == "test_dcp_resume_at_another_world_size":
            names.update(RESUME)
    return [name for name in [*EQUAL, *RESUME] if name in names]


def case_of(name, folder):
    """Run `name`'s world size and [script, flags] case: an EQUAL id's fsdp.py run, saving its
    weights to folder/<name>.pt, or a RESUME name's fsdp_resume.py run on folder/dcp."""
    saved = folder / f"{name}.pt"
    if name in EQUAL:
        world, optim, extra = EQUAL[name]
        return world, ["fsdp", [*CFG, "--optim", optim, *extra, "--save", saved]]
    world, flags = RESUME[name]
    flags = [*flags, "--dcp", folder / "dcp"]
    if name == "resume-7":
        flags += ["--save", saved]
    return world, ["fsdp_resume", flags]


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    """The runs this session's tests read, each world size's as the cases of ONE launch (W=2: the
    EQUAL ones, then the first 5 steps into DCP; W=3: offload, then the resume), beside the ddp.py
    references (which conftest's `refs` then finds made): {name: (saved weights, RESULT, that
    case's output)}, and the DCP folder under "dcp"."""
    folder = tmp_path_factory.mktemp("fsdp")
    names = needed(request)
    worlds = {}  # world: names of its cases, in order
    cases = {}
    for name in names:
        world, cases[name] = case_of(name, folder)
        worlds.setdefault(world, []).append(name)

    def launch(world):
        argv = [cases[name] for name in worlds[world]]
        return launch_cases(world, argv, timeout=2 * TIMEOUT * len(argv))

    pending = {}
    with ThreadPoolExecutor(2) as pool:
        pool.submit(ddp_references, tmp_path_factory, CFG)
        for world in sorted(worlds):
            if world == 3 and "resume-7" in names:
                pending[2].result()  # the resume at W=3 reads the checkpoint the W=2 launch wrote
            pending[world] = pool.submit(launch, world)
    out = {"dcp": folder / "dcp"}
    for world, names_of_world in worlds.items():
        for name, (result, output) in zip(names_of_world, pending[world].result(), strict=True):
            out[name] = (folder / f"{name}.pt", result, output)
    return out


@pytest.mark.parametrize("case", EQUAL)
def test_equals_ddp_one_process(launches, refs, case):
    world, optim, extra = EQUAL[case]
    saved, res, _ = launches[case]
    assert res["steps"] == 7
    diff = max_diff(saved, refs[optim])
    print(f"fsdp W={world} {optim} {' '.join(extra)}: max |Δ| vs ddp.py W=1 = {diff:.2e}")
    assert diff <= TOL[optim]
    check_measured(res, world, optim)
    # uneven test shards (W=2: 513 and 512 samples) finish, and count every sample once
    assert res["test_acc"] == accuracy(saved)


def test_dcp_resume_at_another_world_size(launches, refs):
    """fsdp_resume.py: 5 steps at W=2 into DCP, then on to step 7 at W=3: the parameters of 7
    uninterrupted steps (the ddp.py W=1 reference), with the model, AdamW state and lr schedule
    resharded and restored. The same command once more resumes at step 7 = --max-steps and trains
    nothing (not the rest of the epochs); a checkpoint of another model or optimizer is refused."""
    ckpt = launches["dcp"]
    _, first, _ = launches["resume-5"]
    assert first["steps"] == 5 and (ckpt / "step-5" / ".metadata").is_file()

    resumed_path, resumed, output = launches["resume-7"]
    assert f"resumed from {ckpt} at step 5" in output
    assert resumed["steps"] == 7 and resumed["comm_steps"] == 2  # steps 6 and 7 ran here
    diff = max_diff(resumed_path, refs["adamw"])
    print(f"fsdp DCP W=2 (5 steps) -> W=3 (7): max |Δ| vs ddp.py W=1 = {diff:.2e}")
    assert diff <= TOL["adamw"]
    check_measured(resumed, 3, "adamw")
    assert (ckpt / "step-7" / ".metadata").is_file()

    # Three one-process runs on the finished checkpoint, side by side: the same command again,
    # and two runs of another model or optimizer, each of which must stop with one message from
    # rank 0, exit 2, before any data.
    refused = {
        "--dim": (["--dim", "48"], "'model.embed.pos' is (1, 16, 32), this run needs (1, 16, 48)"),
        "--optim": (["--optim", "sgd"], "'optim.state.embed.pos.momentum_buffer' is missing"),
    }
    with ThreadPoolExecutor(2) as pool:
        again = pool.submit(
            fork_launch,
            "fsdp_resume.py",
            1,
            *CFG,
            "--optim",
            "adamw",
            "--dcp",
            ckpt,
            timeout=TIMEOUT,
        )
        refusals = {
            flag: pool.submit(
                fork_launch, "fsdp_resume.py", 1, *CFG, *argv, "--dcp", ckpt, timeout=60
            )
            for flag, (argv, _) in refused.items()
        }
        r = again.result()
        for flag, (_, message) in refused.items():
            refusal = refusals[flag].result()
            assert refusal.returncode == 2, refusal.output
            assert message in refusal.stderr and "Traceback" not in refusal.stderr, refusal.output
    again = ok(r)
    assert f"resumed from {ckpt} at step 7" in r.stdout and "epoch 1:" not in r.stdout
    assert again["steps"] == 7 and again["samples_per_s"] == 0 and math.isnan(again["loss"])
    # the loaded weights
    assert again["test_acc"] == resumed["test_acc"] == accuracy(resumed_path)


def test_mixed_precision_policy(tmp_path):
    """In this process, a world of one: --mixed-precision computes the blocks in bf16 (their
    gathered parameters and outputs), keeps fp32 shards and gradients, and the root returns fp32
    logits, so the loss is computed in fp32, not in bf16."""
    import fsdp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model, _ = model_and_args()
        model = fsdp.parallelize(model, torch.device("cpu"), model.blocks, mixed_precision=True)
        seen = {}
        model.blocks[0].attn.q.register_forward_hook(
            lambda m, i, o: seen.update(weight=m.weight.dtype)
        )
        model.blocks[0].register_forward_hook(lambda m, i, o: seen.update(out=o.dtype))
        logits = model(torch.randn(4, 1, 28, 28))
        F.cross_entropy(logits, torch.arange(4)).backward()
        assert seen == dict(weight=torch.bfloat16, out=torch.bfloat16)
        assert logits.dtype == torch.float32
        assert all(
            p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters()
        )
    finally:
        dist.destroy_process_group()
