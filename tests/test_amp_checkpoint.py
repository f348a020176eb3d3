"""amp_checkpoint.py: each lever does what it says, in the training run itself.

- fp32 (--amp off) with checkpointing, gradient accumulation or both ends where ddp.py at W=1 ends
  (SGD catches a gradient-scale error such as a missing / grad_accum; AdamW at W=3 with both); so
  does an MoE model accumulated over two micro-batches (its balance loss divided alike).
- Checkpointing is on in training: measured from outside the script, each block's forward runs
  twice per micro-batch in the first step (tests/faults PROBE) and in every later one (hooks on a
  run of the script's main() in this process), and autograd keeps E + L·B·T·D·4 bytes (the
  Meter's act_bytes), with E (what embed and head keep) measured here on a model without blocks.
- no_sync: one all-reduce of Ψ per optimizer step, however many micro-batches.
- --clip under SGD equals a reference trained here in-process with clip_grad_norm_.
- bf16 is active (16-bit queries in attention, fewer bytes kept, weights that differ from fp32's
  by more than round-off; every matmul of every step in bf16) and converges like fp32.
- Bad input: one clear error, exit 2, before any process group.

Launches: the runs as cases of tests/script_cases.py, 4 launches (W=1: accum, then the MoE and
the two 64-step runs; W=2: ckpt, then clip; W=2: bf16; W=3: both; a PROBE run opens a launch, as
the PROBE sees a process's first step only), and 2 ddp.py reference processes (CFG's two
optimizers in one, the MoE model's SGD).
"""

import contextlib
import io
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.module import register_module_forward_hook
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader, DistributedSampler

import amp_checkpoint
import common
from helpers import ROOT, SMALL, ddp_reference, ddp_references, launch_cases, max_diff

CFG = [*SMALL, "--batch-size", "48"]  # 48: W = 1, 2, 3 and two micro-batches all divide it
OFF = [*CFG, "--amp", "off"]
L = 2  # SMALL: depth 2
T = 16  # tokens: (28 / patch 7)^2
D = 32  # dim
# Round-off; AdamW turns it into steps on ~0 gradients: up to 1.9e-5 seen.
TOL = {"sgd": 1e-6, "adamw": 5e-5}
CLIP = 0.01  # far below the gradient norm: every step is clipped
PSI = sum(
    p.numel()
    for p in common.build_model(common.parse_args(common.get_parser("t"), CFG)).parameters()
)

# test_expert_parallel.py's model: a session running both shares the ddp.py reference.
MOE = [*SMALL, "--experts", "4", "--top-k", "2"]
LONG = [  # 64 steps of a 1-block ViT: bf16 against fp32
    "--data",
    "synthetic",
    "--limit",
    "2048",
    "--batch-size",
    "64",
    "--dim",
    "32",
    "--depth",
    "1",
    "--heads",
    "4",
    "--epochs",
    "2",
    "--lr",
    "6e-3",
    "--shift",
    "0",
    "--no-progress",
]

LAUNCHES = {  # name: (world, flags), 6 steps each
    "ckpt": (2, [*OFF, "--optim", "sgd", "--checkpoint"]),
    "accum": (1, [*OFF, "--optim", "sgd", "--grad-accum", "2"]),
    "both": (3, [*OFF, "--optim", "adamw", "--checkpoint", "--grad-accum", "2"]),
    "clip": (2, [*OFF, "--optim", "sgd", "--clip", str(CLIP)]),
    "bf16": (2, [*CFG, "--amp", "bf16", "--optim", "sgd"]),
}
UNPROBED = {  # name: (world, flags) of the runs no test reads a PROBE of
    "moe": (1, [*MOE, "--amp", "off", "--grad-accum", "2", "--optim", "sgd"]),
    "fp32-long": (1, [*LONG, "--amp", "off"]),
    "bf16-long": (1, [*LONG, "--amp", "bf16", "--checkpoint"]),
}


USES = {  # the launches each test without a `name` parameter reads
    "test_checkpointing_keeps_only_each_blocks_input": ["ckpt", "accum"],
    "test_clip_bounds_every_step": ["clip"],
    "test_bf16_is_active": ["bf16", "accum"],
    "test_bf16_trains_like_fp32": ["fp32-long", "bf16-long"],
    "test_moe_accumulated_equals_ddp_one_process": ["moe"],
}
PROBED = ["ckpt", "accum", "both", "bf16"]  # the runs whose first step a test reads (PROBE)


def launches_wanted(request):
    """The launches the tests this session selected read (all of them in a full run, one for the
    single test tests/test_mutants.py asks for)."""
    wanted = set()
    for item in request.session.items:
        if item.module is not request.module:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "name" in params:
            wanted.add(params["name"])
        else:
            wanted.update(USES.get(item.originalname, []))
    return [name for name in {**LAUNCHES, **UNPROBED} if name in wanted]


def launch_probed(world, argv, probe):
    """helpers.launch_cases with the PROBE on (tests/faults): it records the first optimizer step
    of the launch, the first case's, in `probe`/rank<r>.json. The cases' RESULTs."""
    env = {"PYTHONPATH": str(ROOT / "tests" / "faults"), "PROBE": str(probe)}
    return [result for result, _ in launch_cases(world, argv, env=env)]


def group(names):
    """`names` as launches, lists of names of one world size: each PROBED run opens a launch of
    its own (the PROBE sees a launch's first step only), the other runs of its world size join the
    first launch of that size."""
    launches = []
    for name in names:
        world = {**LAUNCHES, **UNPROBED}[name][0]
        same_world = [launch for launch in launches if launch[0] == world]
        if name in PROBED or not same_world:
            launches.append((world, [name]))
        else:
            same_world[0][1].append(name)
    return [launch for _, launch in launches]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The runs this session's tests read, each world size's as the cases of as few launches as
    the PROBE allows (group), two launches at a time, beside the ddp.py references (which
    conftest's `refs` then finds made): {name: (saved weights, RESULT, [probe of each rank], or
    [] for a run not PROBED)}."""
    directory = tmp_path_factory.mktemp("amp")
    every = {**LAUNCHES, **UNPROBED}

    def launch(names):
        world = every[names[0]][0]
        argv = [
            ["amp_checkpoint", [*every[name][1], "--save", directory / f"{name}.pt"]]
            for name in names
        ]
        probe = directory / names[0]
        results = launch_probed(world, argv, probe)
        out = {}
        for name, result in zip(names, results, strict=True):
            probes = []
            if name in PROBED:
                probes = [json.loads((probe / f"rank{r}.json").read_text()) for r in range(world)]
            out[name] = (directory / f"{name}.pt", result, probes)
        return out

    names = launches_wanted(request)
    tests = [item for item in request.session.items if item.module is request.module]
    out = {}
    with ThreadPoolExecutor(2) as pool:  # two launches at a time: one per core
        if any("refs" in item.fixturenames for item in tests):
            pool.submit(ddp_references, tmp_path_factory, CFG)
        if "moe" in names:
            pool.submit(ddp_reference, tmp_path_factory, MOE, "sgd")
        for runs_of_launch in pool.map(launch, group(names)):
            out.update(runs_of_launch)
    for name in LAUNCHES:
        if name in out:
            result = out[name][1]
            assert result["world_size"] == LAUNCHES[name][0] and result["steps"] == 6, name
    return out


def saved_bytes(model, batch):
    """What autograd keeps for backward in one forward and loss of `model`, measured as the Meter
    does."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(model(torch.randn(batch, 1, 28, 28)), torch.randint(0, 10, (batch,)))
    return sum(n for ptr, n in kept.items() if ptr not in params)


@pytest.mark.parametrize("name,optim", [("ckpt", "sgd"), ("accum", "sgd"), ("both", "adamw")])
def test_fp32_equals_ddp_one_process(runs, refs, name, optim):
    """Recomputation and accumulation change no number: the ddp.py W=1 parameters, and the
    formula's bytes."""
    path, res, _ = runs[name]
    diff = max_diff(refs[optim], path)
    print(f"{name}: max |param diff| vs ddp.py W=1 = {diff:.2e}")
    assert diff < TOL[optim]
    k = 8 if optim == "adamw" else 4
    assert (res["param_bytes"], res["grad_bytes"], res["optim_bytes"]) == (
        4 * PSI,
        4 * PSI,
        k * PSI,
    )


@pytest.mark.parametrize("name", ["ckpt", "accum", "both"])
def test_one_all_reduce_per_step_whatever_the_micro_batches(runs, name):
    """no_sync() on all but the last micro-batch: Ψ fp32 all-reduced once per optimizer step."""
    res = runs[name][1]
    assert res["comm"]["all_reduce"] == 4 * PSI
    # Ψ fits in one bucket: one call per step
    assert res["comm_calls"]["all_reduce"] == res["comm_steps"] == 3


@pytest.mark.parametrize("name", ["ckpt", "accum", "both", "bf16"])
def test_checkpointed_blocks_run_forward_twice_in_training(runs, name):
    """In the first optimizer step, attention runs once per block and micro-batch, twice when the
    block is checkpointed (backward recomputes it)."""
    world, args = LAUNCHES[name]
    accum = int(args[args.index("--grad-accum") + 1]) if "--grad-accum" in args else 1
    expected = L * accum * (2 if "--checkpoint" in args else 1)
    for probe in runs[name][2]:
        assert sum(probe["attention"].values()) == expected, probe


def test_checkpointing_keeps_only_each_blocks_input(runs):
    """Micro-batch B = 24 in both runs: checkpointed E + L·B·T·D·4 exactly, plain at least
    E + 16·L·B·T·D·4."""
    B = 24
    E = saved_bytes(common.ViT(D, 0, 4, 7), B)  # embed and head only
    # the Meter's, on rank 0
    ckpt = runs["ckpt"][1]["act_bytes"]
    plain = runs["accum"][1]["act_bytes"]
    print(f"saved for backward: plain {plain}, checkpointed {ckpt}, E {E}")
    assert ckpt == E + L * B * T * D * 4
    assert plain >= E + 16 * L * B * T * D * 4


def reference_with_clip(clip, steps=6):
    """ddp.py's W=1 loop with SGD, written out here, plus clip_grad_norm_ before each step."""
    args = common.parse_args(common.get_parser("t"), [*CFG, "--optim", "sgd"])
    train_set, _, _ = common.load_data(args)
    sampler = DistributedSampler(
        train_set, num_replicas=1, rank=0, shuffle=True, seed=args.seed, drop_last=True
    )
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = common.build_model(args)
    optimizer = common.make_optimizer(model.parameters(), args)
    scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
    sampler.set_epoch(0)
    train_set.set_epoch(0)
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        F.cross_entropy(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return model.state_dict()


def test_clip_bounds_every_step(runs, refs, tmp_path):
    """SGD with --clip 0.01 at W=2 ends where the in-process reference with clip_grad_norm_ ends;
    unclipped steps would move the weights orders of magnitude further."""
    start = common.build_model(common.parse_args(common.get_parser("t"), CFG)).state_dict()
    torch.save(reference_with_clip(0), tmp_path / "plain.pt")
    # the loop written out here is ddp.py's
    assert max_diff(refs["sgd"], tmp_path / "plain.pt") < TOL["sgd"]
    expected = reference_with_clip(CLIP)
    got = torch.load(runs["clip"][0], weights_only=True)
    moved = max((expected[k] - start[k]).abs().max().item() for k in start)
    err = max((got[k] - expected[k]).abs().max().item() for k in start)
    unclipped = max(
        (v - start[k]).abs().max().item()
        for k, v in torch.load(refs["sgd"], weights_only=True).items()
    )
    print(f"clip: moved {moved:.2e} (unclipped {unclipped:.2e}), error {err:.2e}")
    assert 0 < moved < unclipped / 10
    assert err < 1e-3 * moved


def test_bf16_is_active(runs, refs):
    """A no-op autocast fails each: 16-bit queries, fewer bytes kept than fp32 at the same B = 24,
    weights that differ from fp32's by more than round-off (and not by much more)."""
    path, res, probes = runs["bf16"]
    assert all(p["attention"] == {"torch.bfloat16": L} for p in probes), probes
    assert res["act_bytes"] < 0.8 * runs["accum"][1]["act_bytes"]
    diff = max_diff(refs["sgd"], path)
    print(f"bf16 vs fp32: max |param diff| = {diff:.2e}")
    assert 1e-5 < diff < 1e-2
    assert res["comm"]["all_reduce"] == 4 * PSI  # fp32 gradients all the same


def test_bf16_trains_like_fp32(runs):
    """64 steps of a 1-block ViT: bf16 (checkpointed) follows fp32's loss down and reaches its
    accuracy. (The README's settled comparison is a longer run of the same command.)"""
    fp32 = runs["fp32-long"][1]
    bf16 = runs["bf16-long"][1]
    print(
        f"fp32: loss {fp32['loss']:.4f} acc {fp32['test_acc']:.4f}; bf16: loss {bf16['loss']:.4f} "
        f"acc {bf16['test_acc']:.4f}"
    )
    assert bf16["steps"] == fp32["steps"] == 2 * (2048 // 64)
    assert fp32["loss"] < 0.9 * 2.3026  # it has learnt something: well below ln(10) (1.88)
    assert abs(bf16["loss"] - fp32["loss"]) < 0.05
    assert abs(bf16["test_acc"] - fp32["test_acc"]) < 0.05


class EveryStep:
    """What each optimizer step of a run computed, seen from outside through global hooks: how
    many times the blocks' attention ran forward with grad enabled (a checkpointed block runs its
    forward again in backward), and the dtypes the Linear layers computed in."""

    def __init__(self):
        self.steps = []  # one entry per optimizer step: (attention forwards, Linear dtypes)
        self.attention_forwards = 0
        self.linear_dtypes = set()

    def forward_ran(self, module, inputs, output):
        if not torch.is_grad_enabled():  # evaluation: no backward, nothing to recompute
            return
        if isinstance(module, common.Attention):
            self.attention_forwards += 1
        if isinstance(module, nn.Linear):
            self.linear_dtypes.add(str(output.dtype))

    def optimizer_stepped(self, optimizer, args, kwargs):
        self.steps.append((self.attention_forwards, self.linear_dtypes))
        self.attention_forwards = 0
        self.linear_dtypes = set()


def watch_every_step(argv):
    """`python amp_checkpoint.py ARGV` (a world of one), run by its main() in this process with an
    EveryStep watching: (the EveryStep, the RESULT)."""
    watch = EveryStep()
    world_of_one = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["amp_checkpoint.py", *argv])
        for name, value in world_of_one.items():
            patch.setenv(name, value)
        patch.setenv("MASTER_ADDR", "127.0.0.1")
        patch.setenv("MASTER_PORT", str(common.free_port()))
        forward_hook = register_module_forward_hook(watch.forward_ran)
        step_hook = register_optimizer_step_post_hook(watch.optimizer_stepped)
        try:
            with contextlib.redirect_stdout(printed):
                amp_checkpoint.main()
        finally:
            forward_hook.remove()
            step_hook.remove()
    results = [line for line in printed.getvalue().splitlines() if line.startswith("RESULT ")]
    return watch, json.loads(results[0][len("RESULT ") :])


WATCHED = {  # name: flags of a 4-step run, two micro-batches a step
    "bf16-ckpt": [*CFG, "--max-steps", "4", "--grad-accum", "2", "--amp", "bf16", "--checkpoint"],
    "off": [*CFG, "--max-steps", "4", "--grad-accum", "2", "--amp", "off"],
}


@pytest.fixture(scope="module")
def watched():
    """Each of WATCHED run once, every step watched: {name: (EveryStep, RESULT)}."""
    return {name: watch_every_step(argv) for name, argv in WATCHED.items()}


def test_checkpointed_blocks_recompute_in_every_step(watched):
    """Not only in the first step: in each of the 4 steps every checkpointed block runs forward
    twice per micro-batch (once in forward, once more in backward), a plain block once."""
    for name, expected in (("bf16-ckpt", L * 2 * 2), ("off", L * 2)):
        watch, result = watched[name]
        assert result["steps"] == len(watch.steps) == 4, name
        forwards = [attention_forwards for attention_forwards, _ in watch.steps]
        assert forwards == [expected] * 4, (name, forwards)


def test_autocast_in_every_step(watched):
    """Not only in the first step: in each of the 4 steps of the bf16 run every Linear layer
    computes in bf16 (its recomputation in backward too); with --amp off, in fp32."""
    for name, dtype in (("bf16-ckpt", "torch.bfloat16"), ("off", "torch.float32")):
        watch, _ = watched[name]
        dtypes = [linear_dtypes for _, linear_dtypes in watch.steps]
        assert len(dtypes) == 4 and dtypes == [{dtype}] * 4, (name, dtypes)


def test_moe_accumulated_equals_ddp_one_process(runs, tmp_path_factory):
    """--experts with --grad-accum 2: each micro-batch's balance loss is divided by 2 like its
    cross-entropy (build_model's forwards_per_step), so the two halves give the gradient of the
    whole batch and SGD ends where ddp.py ends with the same experts (both at W=1: the scale is
    the accumulation's, which W does not change)."""
    path = runs["moe"][0]
    diff = max_diff(ddp_reference(tmp_path_factory, MOE, "sgd"), path)
    print(f"MoE, 2 micro-batches: max |param diff| vs ddp.py = {diff:.2e}")
    assert diff < TOL["sgd"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--amp", "fp16"],
            "error: --amp fp16 needs CUDA (fp16 autocast with a GradScaler); "
            "this run is on the CPU",
        ),
        (["--clip", "-1"], "error: --clip must be >= 0 (0: no clipping), got -1.0"),
        (
            ["--grad-accum", "0"],
            "error: --grad-accum 0 must be >= 1 and divide the 32 samples each rank gets per step",
        ),
        (
            ["--grad-accum", "3"],
            "error: --grad-accum 3 must be >= 1 and divide the 32 samples each rank gets per step",
        ),
    ],
)
def test_bad_input_one_message(argv, message, monkeypatch, capsys):
    """main() in this process (tests/test_bad_input.py launches one case for real): exit 2 with
    one message, before any process group. --backend gloo: on the CPU even with GPUs."""
    monkeypatch.setattr(sys, "argv", ["amp_checkpoint.py", *SMALL, "--backend", "gloo", *argv])
    with pytest.raises(SystemExit) as exit_status:
        amp_checkpoint.main()
    stderr = capsys.readouterr().err
    assert exit_status.value.code == 2, stderr
    assert message in stderr and stderr.count("error") == 1, stderr
    assert not torch.distributed.is_initialized()
