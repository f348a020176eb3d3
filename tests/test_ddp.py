"""The data-parallel family: ddp.py (torchrun and `python ddp.py --nproc N`), ddp_torchrun.py's
snapshots, dp.py.

Each launch is a real multi-process run on CPU/Gloo; the promise checked is that data
parallelism changes nothing about the result: the parameters after N steps equal those of one
process training on the same global batches, and evaluation counts every test sample once.
dp.py, one process for every GPU, refuses to be launched as several.
"""

import gc
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import common
from helpers import (
    ROOT,
    SMALL,
    ddp_references,
    fork_launch,
    launch_cases,
    max_diff,
    ok,
    python,
    reference_result,
    torchrun,
)

# 48: W = 1..4 all divide it; 511 test samples
CFG = [*SMALL, "--limit", "511", "--batch-size", "48"]
# Round-off; AdamW turns it into steps on ~0 gradients: up to 1.9e-5 seen.
TOL = {"sgd": 1e-6, "adamw": 5e-5}
PSI = sum(
    p.numel()
    for p in common.build_model(common.parse_args(common.get_parser("t"), CFG)).parameters()
)
CASES = [
    ("sgd", 2, "torchrun"),
    ("adamw", 2, "spawn"),
    ("sgd", 3, "forked"),
    ("adamw", 4, "forked"),
]
FAULTS = str(ROOT / "tests" / "faults")


def launch(launcher, script, world, *args, **kw):
    """Both of the scripts' launchers (torchrun, `--nproc`: mp.spawn) at W=2; the larger worlds
    forked from the tests' fork server, which starts them in a fraction of the time."""
    if launcher == "torchrun":
        return torchrun(script, world, *args, **kw)
    if launcher == "spawn":
        return python(script, "--nproc", world, *args, **kw)
    return fork_launch(script, world, *args, **kw)


def selected(request):
    """This session's selected tests of this module, as (test function, its parameters): all of
    them in a full run, one when a single test is asked for (as tests/test_mutants.py does). The
    fixtures below launch only what these use."""
    return [
        (item.originalname, getattr(getattr(item, "callspec", None), "params", {}))
        for item in request.session.items
        if item.module is request.module
    ]


def needed(request):
    """The ddp.py launches of CASES that the selected tests use."""
    cases = set()
    for name, params in selected(request):
        if "case" in params:
            cases.add(params["case"])
        elif name == "test_distributed_accuracy_equals_one_process_accuracy":
            cases.add(("adamw", 4, "forked"))
    return [c for c in CASES if c in cases]


@pytest.fixture(scope="module")
def reference(request, tmp_path_factory):
    """One process, per optimizer: the run every data-parallel run must reproduce."""
    # adamw: also for the load tests; sgd: for dp.py's
    optimizers = {optim for optim, _, _ in needed(request)} | {"adamw"}
    names = {name for name, _ in selected(request)}
    if "test_dp_on_cpu_says_so_and_equals_ddp_one_process" in names:
        optimizers.add("sgd")
    paths = ddp_references(tmp_path_factory, CFG, sorted(optimizers))
    return {optim: (path, reference_result(path)) for optim, path in paths.items()}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """ddp.py at W = 2, 3, 4 through both launchers: {case: (saved weights, RESULT)}."""
    directory = tmp_path_factory.mktemp("ddp")

    def one(case):
        optim, world, launcher = case
        saved = directory / f"{optim}-{world}.pt"
        flags = [*CFG, "--optim", optim, "--save", saved]
        return saved, ok(launch(launcher, "ddp.py", world, *flags))

    cases = needed(request)
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(cases, pool.map(one, cases), strict=True))


@pytest.mark.parametrize(
    "case", CASES, ids=[f"{optim}-W{world}-{launcher}" for optim, world, launcher in CASES]
)
def test_ddp_equals_one_process(reference, runs, case):
    optim, world, launcher = case
    ref_path, ref = reference[optim]
    path, res = runs[case]
    assert res["world_size"] == world and res["backend"] == "gloo"
    assert res["steps"] == ref["steps"] == 6
    diff = max_diff(ref_path, path)
    print(f"{optim} W={world} ({launcher}): max |param diff| = {diff:.2e}")
    assert diff < TOL[optim]
    assert res["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    # exact distributed evaluation: the same weights give the same accuracy at every world size
    assert res["test_acc"] == ref["test_acc"]
    # measured from outside: 4Ψ / 4Ψ / 8Ψ (4Ψ SGD) per rank, one all-reduce of Ψ fp32 per step
    assert (res["param_bytes"], res["grad_bytes"]) == (4 * PSI, 4 * PSI)
    assert res["optim_bytes"] == (8 if optim == "adamw" else 4) * PSI
    assert res["comm"]["all_reduce"] == 4 * PSI


def test_distributed_accuracy_equals_one_process_accuracy(runs):
    """The W=4 run's reported accuracy (4 uneven, padded shards) recomputed here, in one process,
    from its saved weights over the whole test set."""
    path, res = runs["adamw", 4, "forked"]
    args = common.parse_args(common.get_parser("t"), CFG)
    model = common.build_model(args)
    model.load_state_dict(torch.load(path, weights_only=True))
    _, test_set, _ = common.load_data(args)
    with torch.no_grad():
        acc = (model(test_set.x).argmax(1) == test_set.y).sum().item() / len(test_set)
    assert len(test_set) == 511 and res["test_acc"] == acc


# ddp_torchrun.py: 8 steps per epoch, a cosine schedule over 16: a crash in epoch 1 (rank 1 exits
# inside step 11, injected from outside by tests/faults), then the same command again.
SNAP = [
    "--data",
    "synthetic",
    "--limit",
    "256",
    "--batch-size",
    "32",
    "--dim",
    "32",
    "--depth",
    "2",
    "--heads",
    "4",
    "--epochs",
    "2",
    "--optim",
    "adamw",
    "--no-progress",
]


AFTER_A_CRASH = (
    "test_snapshot_resume_equals_uninterrupted",
    "test_rerunning_a_finished_run_trains_nothing_and_exits_0",
    "test_a_rank_that_cannot_see_the_snapshot_fails_clearly",
)
MAX_STEPS = "test_resuming_from_where_max_steps_stopped_skips_the_batches_trained"
# --max-steps stops in the middle of epoch 0; a constant learning rate, so that the schedule does
# not depend on --max-steps
CONSTANT = [*SNAP, "--lr-schedule", "constant", "--warmup", "0"]


@pytest.fixture(scope="module")
def snapshots(request, tmp_path_factory):
    """The ddp_torchrun.py runs of the snapshot tests at W=2, those the selected tests use. The
    crash has a launch of its own (the fault's variables reach every case of a launch); the runs
    after it, the uninterrupted one and the --max-steps ones are the cases of one launch, in order
    (a resume reads the snapshot its case before wrote); the finished run's command again is a
    launch of its own too."""
    d = tmp_path_factory.mktemp("snap")
    names = {name for name, _ in selected(request)}
    cmd = [*SNAP, "--snapshot", d / "snap.pt", "--save", d / "resumed.pt"]
    out = dict(dir=d)
    argv = []
    if names & set(AFTER_A_CRASH):
        rank_1_exits_in_step_11 = {
            "PYTHONPATH": FAULTS,
            "FAULT": "exit",
            "FAULT_RANK": "1",
            "FAULT_STEP": "11",
        }
        out["crash"] = fork_launch("ddp_torchrun.py", 2, *cmd, env=rank_1_exits_in_step_11)
        argv.append(["ddp_torchrun", cmd])  # the same command again: it resumes
        argv.append(["ddp_torchrun", [*SNAP, "--save", d / "straight.pt"]])
    if MAX_STEPS in names:
        snap = ["--snapshot", d / "max-steps.pt"]
        argv.append(["ddp_torchrun", [*CONSTANT, "--max-steps", 12, "--save", d / "a.pt"]])
        argv.append(["ddp_torchrun", [*CONSTANT, *snap, "--max-steps", 5]])
        argv.append(["ddp_torchrun", [*CONSTANT, *snap, "--max-steps", 12, "--save", d / "b.pt"]])
    results = iter(launch_cases(2, argv, timeout=400) if argv else [])
    if names & set(AFTER_A_CRASH):
        out["resumed"] = next(results)
        out["straight"] = next(results)[0]
        out["again"] = fork_launch("ddp_torchrun.py", 2, *cmd)  # the same command, once more
    if MAX_STEPS in names:
        out["max-steps"] = [next(results) for _ in range(3)]
    return out


def test_snapshot_resume_equals_uninterrupted(snapshots):
    """Weights, AdamW state, the schedule's position and the step come back: the resumed run ends
    bit for bit where the uninterrupted one ends, and reports this attempt's communication."""
    d = snapshots["dir"]
    crash = snapshots["crash"]
    res, resumed = snapshots["resumed"]
    assert crash.returncode != 0 and "RESULT" not in crash.stdout, crash.output
    assert "snapshot: step 8 saved" in crash.stdout and "snapshot: step 16" not in crash.stdout, (
        crash.output
    )
    assert "snapshot: resuming at step 8" in resumed, resumed
    assert res["steps"] == snapshots["straight"]["steps"] == 16
    assert max_diff(d / "resumed.pt", d / "straight.pt") == 0
    assert res["comm"]["all_reduce"] == 4 * res["params"]  # per step of this attempt, not of all 16


def test_rerunning_a_finished_run_trains_nothing_and_exits_0(snapshots):
    """The snapshot after the last epoch holds step 16: the same command again resumes there,
    trains 0 steps, reports 0 samples/s (this attempt's) and the same accuracy, and saves the
    same weights."""
    again = snapshots["again"]
    d = snapshots["dir"]
    assert "snapshot: resuming at step 16" in again.stdout, again.output
    res = ok(again)
    assert res["steps"] == 16 and res["samples_per_s"] == 0 and res["comm"] == {}
    assert res["test_acc"] == snapshots["straight"]["test_acc"]
    assert max_diff(d / "resumed.pt", d / "straight.pt") == 0


def test_resuming_from_where_max_steps_stopped_skips_the_batches_trained(snapshots):
    """--max-steps 5 leaves a snapshot in the middle of epoch 0 (8 steps an epoch); the same
    command with --max-steps 12 resumes there and must take epoch 0's batches 6-8, not 1-8 again:
    it ends bit for bit where 12 steps in one go end (a constant learning rate, so the schedule
    does not depend on --max-steps)."""
    d = snapshots["dir"]
    (straight, _), (first, _), (resumed, output) = snapshots["max-steps"]
    assert straight["steps"] == 12
    assert first["steps"] == 5
    assert "snapshot: resuming at step 5" in output, output
    assert resumed["steps"] == 12
    assert max_diff(d / "a.pt", d / "b.pt") == 0


def test_a_rank_that_cannot_see_the_snapshot_fails_clearly(snapshots):
    """Rank 0 decides to resume and broadcasts the step; a rank on a node without the shared file
    system (tests/faults HIDE) must stop with that reason, not train from scratch beside it."""
    snap = snapshots["dir"] / "snap.pt"
    r = torchrun(
        "ddp_torchrun.py",
        2,
        *SNAP,
        "--snapshot",
        snap,
        "--timeout",
        "30",
        env={"PYTHONPATH": FAULTS, "HIDE": str(snap), "FAULT_RANK": "1"},
        timeout=120,
    )
    assert r.returncode != 0 and "RESULT" not in r.stdout, r.output
    assert "must be on a file system every rank shares" in r.output, r.output


def test_a_slow_snapshot_does_not_lower_samples_per_s(tmp_path, monkeypatch):
    """ddp_torchrun.py's loop snapshots after every epoch, inside the Meter's timed stretch: a
    snapshot that takes 1000 s to write (a slow shared disk's fsync; 1000 s on the clock the Meter
    reads, none on the wall's) must leave samples/s as it is. In this process, at world 1: 2
    epochs of 6 steps, the clock running from step 4 over both snapshots."""
    import ddp_torchrun

    slow = 1000.0
    stalled = dict(seconds=0.0)
    write = ddp_torchrun.write_atomically

    def slow_write(snapshot, path):
        stalled["seconds"] += slow
        write(snapshot, path)

    class Clock:
        """The Meter's clock: the wall's, plus the time the slow disk took."""

        @staticmethod
        def perf_counter():
            return time.perf_counter() + stalled["seconds"]

    monkeypatch.setattr(ddp_torchrun, "write_atomically", slow_write)
    monkeypatch.setattr(common.meter, "time", Clock)
    argv = ["--data", "synthetic", "--limit", "96", "--dim", "16", "--depth", "1"]
    args = common.parse_args(common.get_parser("t"), [*argv, "--batch-size", "16", "--epochs", "2"])
    args.snapshot = str(tmp_path / "snap.pt")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        device = torch.device("cpu")
        train_set, _, _ = common.load_data(args, device)
        sampler = DistributedSampler(train_set, num_replicas=1, rank=0, seed=args.seed)
        loader = DataLoader(train_set, batch_size=16, sampler=sampler, drop_last=True)
        model = ddp_torchrun.parallelize(common.build_model(args), device)
        optimizer = common.make_optimizer(model.parameters(), args)
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        with common.Meter(model, optimizer, args) as meter:
            out = ddp_torchrun.train(model, optimizer, scheduler, loader, sampler, args, device)
        del model  # DDP's reducer goes while the group is up (see ddp.py's run)
        gc.collect()
    finally:
        dist.destroy_process_group()
    seconds, steps = meter.elapsed
    assert out["steps"] == 12 and steps == 12 - 4
    assert torch.load(args.snapshot, weights_only=True)["step"] == 12
    assert stalled["seconds"] == 2 * slow and seconds < slow, (
        f"{steps} steps timed in {seconds:.2f} s: the snapshots counted"
    )


def test_dp_refuses_to_run_as_several_processes():
    """torchrun --nproc_per_node=2 dp.py would run two DataParallel trainings over the same GPUs:
    one message, from rank 0, before any process group; the run fails."""
    r = torchrun("dp.py", 2, *CFG, timeout=120)
    message = "dp.py is one process driving every GPU, but this launch started 2 (WORLD_SIZE=2)"
    assert r.returncode != 0 and "RESULT" not in r.stdout, r.output
    assert r.stderr.count(message) == 1, r.output
    assert "dp: " not in r.stdout, r.output  # run() never began: no data, no model


LOADERS = ["ddp.py", "dp.py", "ddp_torchrun.py"]


def load_flags(script, path, saved):
    """Load a ddp.py checkpoint, take one SGD step with lr 0, save."""
    flags = [*CFG, "--load", path, "--optim", "sgd", "--lr", "0", "--max-steps", "1"]
    flags += ["--save", saved]
    return [*flags, *(["--nproc", "1"] if script == "ddp.py" else [])]


@pytest.fixture(scope="module")
def one_process(request, reference, tmp_path_factory):
    """The one-process runs of the tests below, those the selected tests use, as the cases of one
    process (`--nproc 1` runs ddp.py in this process too): {"dp": dp.py training,
    script: that script loading the AdamW reference}, each (RESULT, output, saved path)."""
    d = tmp_path_factory.mktemp("one-process")
    argv = {}
    saved = {}
    for name, params in selected(request):
        if name == "test_dp_on_cpu_says_so_and_equals_ddp_one_process":
            saved["dp"] = d / "dp.pt"
            argv["dp"] = ["dp", [*CFG, "--optim", "sgd", "--save", saved["dp"]]]
        elif name == "test_save_of_one_script_loads_in_another":
            script = params["script"]
            saved[script] = d / f"{script}-out.pt"
            flags = load_flags(script, reference["adamw"][0], saved[script])
            argv[script] = [script.removesuffix(".py"), flags]
    results = launch_cases(1, list(argv.values())) if argv else []
    return {
        key: (result, output, saved[key])
        for key, (result, output) in zip(argv, results, strict=True)
    }


def test_dp_on_cpu_says_so_and_equals_ddp_one_process(reference, one_process):
    res, output, saved = one_process["dp"]
    assert "no GPUs visible, training on the CPU as a single device" in output
    assert res["world_size"] == 1 and res["steps"] == 6
    assert max_diff(reference["sgd"][0], saved) < TOL["sgd"]


@pytest.mark.parametrize("script", LOADERS)
def test_save_of_one_script_loads_in_another(reference, one_process, script):
    """Load a ddp.py checkpoint, take one SGD step with lr 0, save: the file must be unchanged."""
    path, res = reference["adamw"]
    result, _, saved = one_process[script]
    assert result["test_acc"] == res["test_acc"]
    assert max_diff(path, saved) == 0
