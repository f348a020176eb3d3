"""deepspeed_zero.py: ZeRO through DeepSpeed's engine ends every stage with the parameters of one
ddp.py process and of zero.py at the same stage; --clip, --load/--save, CPU offload and a user's
--ds-config behave as the flags say; the Meter sees DeepSpeed's collectives. Without DeepSpeed the
script exits 2 with one line. DeepSpeed is optional (requirements-deepspeed.txt): without it these
tests skip, saying so, except where REQUIRE_DEEPSPEED is set (CI), where they must run."""

import importlib.util
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from helpers import (
    ROOT,
    SMALL,
    ddp_reference,
    fork_launch,
    kill_group,
    launch_cases,
    launch_env,
    max_diff,
    python,
    run,
    tiered,
)

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(
    not HAVE_DEEPSPEED and not os.environ.get("REQUIRE_DEEPSPEED"),
    reason="DeepSpeed is not installed: pip install -r requirements-deepspeed.txt",
)

# test_zero.py's model: W = 2 and 3 divide no unit evenly, so DeepSpeed pads its partitions
CFG = [*SMALL, *("--limit 1025 --batch-size 24 --dim 33 --heads 3 --patch 14").split()]
TOL = {"sgd": 1e-6, "adamw": 5e-5}  # test_zero.py's: float32 round-off, AdamW's steps on ~0
GRID = [
    (stage, world, optim) for stage in (1, 2, 3) for world in (2, 3) for optim in ("sgd", "adamw")
]
QUICK = [(1, 2, "sgd"), (2, 3, "adamw"), (3, 3, "sgd")]  # every stage, world and optimizer
CASES = tiered(GRID, QUICK)
CLIP = "0.05"  # below every step's gradient norm on CFG: each step is clipped


def selected(request):
    """The (stage, world, optim) cases this session's selected tests of this module read."""
    cases = set()
    for item in request.session.items:
        if item.module is request.module and "launched" in item.fixturenames:
            params = getattr(getattr(item, "callspec", None), "params", {})
            if "world" in params:
                cases.add((params["stage"], params["world"], params["optim"]))
    return [case for case in GRID if case in cases]


def launch_each(world, argv):
    """launch_cases for deepspeed_zero.py's runs: one launch each, as DeepSpeed keeps the first
    process group it sees in globals of its own, which the next case's group would not match."""
    return [launch_cases(world, [case], timeout=300)[0] for case in argv]


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """{(script, stage, world, optim): (RESULT, saved path)}: deepspeed_zero.py and zero.py on the
    selected cases (zero.py's of one world size in one launch)."""
    folder = tmp_path_factory.mktemp("deepspeed")
    runs = {}
    for world in (2, 3):
        for script in ("deepspeed_zero", "zero"):
            group = [(script, *case) for case in selected(request) if case[1] == world]
            if not group:
                continue
            argv = []
            for _, stage, _, optim in group:
                path = folder / f"{script}-{stage}-{world}-{optim}.pt"
                argv.append([script, [*CFG, "--stage", stage, "--optim", optim, "--save", path]])
            if script == "deepspeed_zero":
                results = launch_each(world, argv)
            else:
                results = launch_cases(world, argv, timeout=max(300, 120 * len(argv)))
            for key, (result, _), (_, flags) in zip(group, results, argv, strict=True):
                runs[key] = (result, flags[-1])
    return runs


@needs_deepspeed
@pytest.mark.parametrize("stage,world,optim", CASES)
def test_stage_equals_one_ddp_process_and_zero(stage, world, optim, refs, launched):
    """Exact: DeepSpeed's stage k ends with the parameters of ddp.py at W=1 and of zero.py's
    stage k at the same W (SGD catches a sum where a mean belongs, AdamW the sharded state)."""
    res, path = launched["deepspeed_zero", stage, world, optim]
    _, zero_path = launched["zero", stage, world, optim]
    assert (res["script"], res["world_size"], res["steps"]) == ("deepspeed_zero", world, 6)
    assert max_diff(path, refs[optim]) <= TOL[optim]
    assert max_diff(path, zero_path) <= TOL[optim]


def padded(measured, exact):
    """`measured` is `exact`, or up to 1% above it: DeepSpeed pads each partition (at stage 3,
    each parameter's) to a multiple of W."""
    return exact <= measured <= 1.01 * exact


def every_row_is_the_formula(res, case=""):
    """Each row of the report (a RESULT): the measured per-rank bytes, of memory and of each kind
    of collective a step, equal deepspeed_zero.formula's, DeepSpeed's own layout."""
    formula = res["formula"]
    rows = ("param_bytes", "grad_bytes", "optim_bytes", "working_bytes")
    measured = {row: res.get(row) for row in rows}
    assert measured == {row: formula.get(row) for row in rows}, case
    kinds = set(res["comm"]) | set(formula["comm"])
    measured = {kind: res["comm"].get(kind, 0) for kind in kinds}
    assert measured == {kind: formula["comm"].get(kind) for kind in kinds}, case


@needs_deepspeed
@pytest.mark.parametrize("stage,world,optim", CASES)
def test_meter_sees_deepspeeds_sharding(stage, world, optim, launched):
    """The Meter reads DeepSpeed's storages and counts its collectives from outside, and every row
    is formula()'s (padding, DeepSpeed's fp32 partition beside the model's parameters, the
    all-reduce at stages 1-2, stage 3's persistent parameters); next to it the paper's: the
    sharded optimizer state is the paper's kΨ/W; the gradients travel once (a reduce-scatter, or
    at stages 1-2 an all-reduce) and the updated parameters through all-gathers: Ψ at
    stages 1-2, at stage 3 between Ψ and 2Ψ (DeepSpeed keeps small parameters whole on every
    rank, gathered once after each step)."""
    res, _ = launched["deepspeed_zero", stage, world, optim]
    every_row_is_the_formula(res)
    psi = res["params"]
    k = 8 if optim == "adamw" else 4
    paper = {1: 8 * psi + k * psi / world, 2: 4 * psi + (4 + k) * psi / world}
    assert res["paper"]["model_states"] == pytest.approx(paper.get(stage, (8 + k) * psi / world))
    assert padded(res["optim_bytes"], k * psi / world)
    gradients = res["comm"].get("reduce_scatter", 0) + res["comm"].get("all_reduce", 0)
    assert padded(gradients, 4 * psi)
    gathered = res["comm"]["all_gather"]
    if stage == 3:
        assert 4 * psi < gathered <= 1.01 * 8 * psi
        assert res["param_bytes"] < 4 * psi  # partitioned: no rank holds them all
    else:
        assert padded(gathered, 4 * psi)


@pytest.mark.full  # five launches, 21 s: the engine's options beyond the stage grid
@needs_deepspeed
def test_clip_load_offload_and_config(refs, tmp_path, tmp_path_factory):
    """At W=2: --clip below every step's norm ends where ddp.py --clip ends (the
    engine's gradient_clipping took the global norm over the shards); --load of a ddp.py save at
    stage 3 with lr 0 saves it back bit for bit; --offload cpu at stage 3 (offload_optimizer and
    offload_param, with the torch optimizer) ends where ddp.py ends; a --ds-config of the user's
    that agrees with the flags trains as the flags would; --grad-accum 2 (two micro-batches of 6
    a rank, the loss divided once, by the engine) ends where ddp.py's batches of 24 end, at
    stage 2 (with the user's config) and at stage 3. Every report row is formula()'s: at stage 2
    the gradients all-reduced after each micro-batch, at stage 3 reduce-scattered after each and
    the persistent parameters gathered once more, in the second micro-batch; with --offload cpu
    the gradients' norm (4 B) all-reduced; --load's one-step run (no trace check)."""
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"train_batch_size": 24, "zero_optimization": {"stage": 2}}))
    names = ("clip", "load", "offload", "config", "accum")
    saved = {name: tmp_path / f"{name}.pt" for name in names}
    sgd = [*CFG, "--optim", "sgd"]
    argv = [
        ["deepspeed_zero", [*sgd, "--stage", 3, "--clip", CLIP, "--save", saved["clip"]]],
        [
            "deepspeed_zero",
            [*CFG, "--stage", 3, "--lr", 0, "--max-steps", 1, "--load", refs["adamw"]]
            + ["--save", saved["load"]],
        ],
        ["deepspeed_zero", [*sgd, "--stage", 3, "--offload", "cpu", "--save", saved["offload"]]],
        [
            "deepspeed_zero",
            [*sgd, "--stage", 2, "--grad-accum", 2, "--ds-config", config]
            + ["--save", saved["config"]],
        ],
        ["deepspeed_zero", [*sgd, "--stage", 3, "--grad-accum", 2, "--save", saved["accum"]]],
    ]
    results = dict(zip(names, launch_each(2, argv), strict=True))
    for name in names:
        every_row_is_the_formula(results[name][0], name)
    clipped = ddp_reference(tmp_path_factory, [*CFG, "--clip", CLIP], "sgd")
    assert max_diff(clipped, refs["sgd"]) > 100 * TOL["sgd"]  # the clip bit
    assert max_diff(saved["clip"], clipped) <= TOL["sgd"]
    assert max_diff(saved["load"], refs["adamw"]) == 0
    assert max_diff(saved["offload"], refs["sgd"]) <= TOL["sgd"]
    assert max_diff(saved["config"], refs["sgd"]) <= TOL["sgd"]
    assert max_diff(saved["accum"], refs["sgd"]) <= TOL["sgd"]


@needs_deepspeed
def test_mixed_precision_ends_where_zero_mixed_precision_ends(initial, tmp_path):
    """--mixed-precision is ds_config's bf16 with fp32 gradient reduction: at stage 3, W=2, SGD,
    DeepSpeed ends within the bf16 tolerance measured here of zero.py --mixed-precision --stage 3
    (9.4e-5 apart; fp32 vs bf16 compute is 1.1e-4 on the same run: the bytes below are what tell
    bf16 from fp32). DeepSpeed builds its fp32 master from the bf16 copy of the weights (lr 0
    saved them back 2.4e-4 off the fp32 ones, exactly their bf16 rounding), zero.py from the fp32
    weights: both start here from weights that bf16 holds exactly. The all-gathers move bf16
    (at most 2 bytes a parameter, twice a step: fp32 moved more than 4Ψ), the reduce-scatters
    fp32 (4Ψ: DeepSpeed's default for bf16 would move 2Ψ), and the save is the fp32 master.
    Every row is formula()'s (stages 1-2 and accumulation: test_every_row_is_the_formula)."""
    weights = torch.load(initial, weights_only=True)
    start = tmp_path / "bf16_exact.pt"
    torch.save({k: v.to(torch.bfloat16).float() for k, v in weights.items()}, start)
    saved = {script: tmp_path / f"{script}.pt" for script in ("deepspeed_zero", "zero")}
    flags = [*CFG, "--optim", "sgd", "--stage", 3, "--mixed-precision", "--load", start]
    [(res, _)] = launch_each(2, [["deepspeed_zero", [*flags, "--save", saved["deepspeed_zero"]]]])
    launch_cases(2, [["zero", [*flags, "--save", saved["zero"]]]])
    assert max_diff(saved["deepspeed_zero"], saved["zero"]) <= 2e-4
    saved_tensors = torch.load(saved["deepspeed_zero"], weights_only=True).values()
    assert {tensor.dtype for tensor in saved_tensors} == {torch.float32}
    psi = res["params"]
    assert 2 * psi < res["comm"]["all_gather"] <= 1.01 * 4 * psi
    assert padded(res["comm"]["reduce_scatter"], 4 * psi)
    # the fp32 master and its gradient, 4Ψ/W each, and each parameter's bf16 piece, 2Ψ/W
    assert padded(res["param_bytes"], 4 * psi / 2) and padded(res["grad_bytes"], 4 * psi / 2)
    assert padded(res["working_bytes"], 2 * psi / 2)
    every_row_is_the_formula(res)
    assert res["paper"]["model_states"] == pytest.approx((2 + 2 + 8) * psi / 2)  # SGD: K = 8


# formula()'s grid: stages, W, --mixed-precision, --grad-accum; and stage 3 at a width whose MLP
# weights (160 x 640) exceed stage3_param_persistence_threshold (1e5): gathered in each forward
WIDE = "--dim 160 --heads 2 --limit 480"
FORMULA_GRID = [
    (stage, world, mixed, accum, "")
    for stage in (1, 2, 3)
    for world in (2, 3)
    for mixed in (False, True)
    for accum in (1, 2)
] + [(3, 2, False, 1, WIDE), (3, 2, True, 2, WIDE)]


@needs_deepspeed
@pytest.mark.full  # 26 launches: the quick tests assert the rows on the launches they make
@pytest.mark.parametrize("stage,world,mixed,accum,extra", FORMULA_GRID)
def test_every_row_is_the_formula(stage, world, mixed, accum, extra):
    """Every report row is formula()'s, AdamW, on shapes W does not divide (DeepSpeed's padding):
    fp32 and --mixed-precision (bf16 gathers, fp32 reductions, at stages 1-2 the bf16 overflow
    check's byte), --grad-accum 1 and 2 (stage 1 reduces once a step, stage 2 after each
    micro-batch; stage 3's second micro-batch gathers the persistent parameters once more), and
    stage 3 with parameters over the persistence threshold. Beside it the paper's model states:
    Table 1 under --mixed-precision (2 + 2 + 12), 4 + 4 + 8 in fp32."""
    flags = [*CFG, *extra.split(), "--optim", "adamw", "--stage", stage, "--grad-accum", accum]
    if mixed:
        flags.append("--mixed-precision")
    [(res, _)] = launch_each(world, [["deepspeed_zero", flags]])
    assert (res["world_size"], res["steps"]) == (world, 6)
    every_row_is_the_formula(res)
    psi = res["params"]
    b, k = (2, 12) if mixed else (4, 8)
    paper = {1: 2 * b * psi + k * psi / world, 2: b * psi + (b + k) * psi / world}
    assert res["paper"]["model_states"] == pytest.approx(
        paper.get(stage, (2 * b + k) * psi / world)
    )


@needs_deepspeed
@pytest.mark.parametrize(
    "user_config, disagreement",
    [
        ({"train_batch_size": 64}, "train_batch_size is 64, but the flags mean 24"),
        ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage is 3, but the flags mean 1"),
        # bf16 without --mixed-precision, whose part casts the model's inputs: a dtype error
        ({"bf16": {"enabled": True}}, "bf16.enabled is True, but the flags mean False"),
    ],
)
def test_ds_config_that_disagrees_with_the_flags_is_one_error(user_config, disagreement, tmp_path):
    """A user's config whose batch size is not --batch-size, whose nested ZeRO stage is not
    --stage, or that enables bf16 without --mixed-precision: one line from rank 0 naming the key,
    exit 2, before any process group."""
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(user_config))
    r = fork_launch("deepspeed_zero.py", 2, *CFG, "--ds-config", config)
    assert r.returncode == 2, r.output
    assert r.stderr.count(f"--ds-config {config}: {disagreement}") == 1, r.output


def test_without_deepspeed_one_line_and_exit_2(tmp_path):
    """Where DeepSpeed is not installed (here: an import of it that fails), the script says how to
    install it, once, and exits 2."""
    fake = tmp_path / "deepspeed"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no DeepSpeed here (the test)')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    r = python("deepspeed_zero.py", "--nproc", "2", *SMALL, env=env)
    assert r.returncode == 2, r.output
    message = "deepspeed_zero.py needs DeepSpeed: pip install -r requirements-deepspeed.txt"
    assert r.stderr.count(message) == 1 and "Traceback" not in r.output, r.output


@needs_deepspeed
def test_offload_disk_trains_or_says_what_it_needs(refs, tmp_path):
    """--offload disk is DeepSpeed's NVMe offload, which needs its async_io op (libaio): where it
    can be built, stage 3 ends where ddp.py ends; where not, one line says what is missing and
    the script exits 2 before any process group, not a traceback from each rank."""
    saved = tmp_path / "disk.pt"
    flags = [*CFG, "--optim", "sgd", "--stage", 3, "--offload", "disk", "--offload-dir", tmp_path]
    r = fork_launch("deepspeed_zero.py", 2, *flags, "--save", saved, timeout=300)
    message = "--offload disk needs DeepSpeed's async_io op, which cannot be built here"
    if r.returncode == 2:
        assert r.stderr.count(message) == 1 and "Traceback" not in r.output, r.output
        return
    assert r.returncode == 0, r.output
    assert max_diff(saved, refs["sgd"]) <= TOL["sgd"]


@needs_deepspeed
@pytest.mark.full  # DeepSpeed builds its CPU Adam (C++) at the first run: about 2 minutes here
def test_cpu_adam_with_cpu_offload_equals_one_ddp_process(refs, tmp_path):
    """--offload cpu --cpu-adam: DeepSpeed's own CPU Adam steps the offloaded partitions at stage 3
    and ends where ddp.py's torch AdamW ends (2.4e-7 apart here)."""
    saved = tmp_path / "cpu_adam.pt"
    flags = [*CFG, "--optim", "adamw", "--stage", 3, "--offload", "cpu", "--cpu-adam"]
    launch_each(2, [["deepspeed_zero", [*flags, "--save", saved]]])
    assert max_diff(saved, refs["adamw"]) <= TOL["adamw"]


@needs_deepspeed
def test_cpu_adam_without_cpu_offload_is_one_error():
    r = fork_launch("deepspeed_zero.py", 2, *CFG, "--cpu-adam")
    assert r.returncode == 2, r.output
    message = (
        "--cpu-adam is DeepSpeed's CPU AdamW for --offload cpu: give --offload cpu --optim adamw"
    )
    assert r.stderr.count(message) == 1, r.output


@needs_deepspeed
def test_gloo_on_a_gpu_host_gives_deepspeed_the_cpu():
    """--backend gloo where GPUs are visible (here made to look so) trains on the CPU, and
    DeepSpeed, which picks its accelerator as it loads, is given the CPU's: it used to get CUDA's
    because GPUs were visible, and failed on the device."""
    script = ROOT / "deepspeed_zero.py"
    gpu_host = (
        "import runpy, sys, torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "torch.cuda.device_count = lambda: 1\n"
        "torch.accelerator.current_accelerator = lambda check_available=False: None\n"
        # torch 2.11's optimizers ask a visible CUDA whether it is capturing a graph at each step
        "torch.cuda.is_current_stream_capturing = lambda: False\n"
        f"sys.argv = [{str(script)!r}, *sys.argv[1:]]\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
    )
    flags = [*SMALL, "--max-steps", "2", "--backend", "gloo"]
    r = run([sys.executable, "-c", gpu_host, *flags], timeout=300)
    assert r.returncode == 0, r.output
    assert (r.result["backend"], r.result["device"], r.result["steps"]) == ("gloo", "cpu", 2)


def test_deepspeed_is_told_the_gpu_of_a_process_shown_one(monkeypatch):
    """srun --gpus-per-task=1: local rank 3 sees one GPU, cuda:0, which pick_backend gives it.
    DeepSpeed takes LOCAL_RANK for its GPU's index (set_device, stage 3's parameters): it is told
    0 before deepspeed.initialize, not left to ask for cuda:3 ("invalid device ordinal")."""
    import deepspeed_zero

    monkeypatch.setenv("LOCAL_RANK", "3")
    deepspeed_zero.give_deepspeed_the_device(torch.device("cpu"))
    assert os.environ["LOCAL_RANK"] == "3"  # a CPU run has no GPU index to give
    deepspeed_zero.give_deepspeed_the_device(torch.device("cuda", 0))
    assert os.environ["LOCAL_RANK"] == "0"


def stderr_until(process, text, timeout):
    """The process's stderr up to the first line holding `text`, or what came in `timeout` s."""
    lines = []
    seen = threading.Event()

    def read():
        for line in process.stderr:
            lines.append(line)
            if text in line:
                seen.set()

    threading.Thread(target=read, daemon=True).start()
    seen.wait(timeout)
    return "".join(lines)


@needs_deepspeed
@pytest.mark.full  # waits the script's 15 s before it speaks
def test_a_build_lock_held_elsewhere_is_named_not_slept_on(tmp_path):
    """A CPU run's first deepspeed.initialize builds DeepSpeed's shared-memory op under a lock;
    while another process holds it (here the test; or a killed build's lock file, with an older
    torch), every rank waited without a word. Rank 0 names the lock it waits for, once."""
    import filelock  # the lock torch's build takes (an older torch waits on the file alone)

    folder = tmp_path / "deepspeed_shm_comm"
    folder.mkdir()
    with filelock.FileLock(folder / "lock"):
        process = subprocess.Popen(
            [sys.executable, ROOT / "deepspeed_zero.py", *SMALL],
            env={**launch_env(), "TORCH_EXTENSIONS_DIR": str(tmp_path)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            err = stderr_until(process, "warning: DeepSpeed has waited", timeout=120)
        finally:
            kill_group(process)
    assert err.count("for its shared-memory op") == 1, err
    assert f"under the lock {folder / 'lock'}: if no run is building it now" in err, err
