"""Every script's training loop past two logging steps and an epoch boundary.

A logging step all-reduces the windowed loss and an epoch boundary starts a new shuffle: a send left
open across either (a pipeline whose last backward's gradient is received in the next step) hangs
there on NCCL as on Gloo. Three batches an epoch, five steps, a loss line every two steps. Every
script runs in one launch, one after another (tests/script_cases.py): all of them for one start-up.

The loader of that loop, in N worker processes (--workers N), trains the same run for any N.
"""

import re

import pytest
import torch
import torch.distributed as dist

import common
from helpers import launch_cases

LOOP = [
    *("--data synthetic --limit 96 --batch-size 32 --epochs 2 --max-steps 5 --log-every 2").split(),
    *("--dim 16 --depth 4 --heads 2 --no-progress --timeout 30").split(),
]
LAUNCHES = {
    "ddp": ("ddp.py",),
    "ddp_torchrun": ("ddp_torchrun.py",),
    "amp_checkpoint": ("amp_checkpoint.py", "--checkpoint"),
    "zero-3": ("zero.py", "--stage", "3"),
    "fsdp": ("fsdp.py",),
    "tensor_parallel": ("tensor_parallel.py", "--sequence-parallel"),
    "tensor_parallel_zero_r": ("tensor_parallel_zero_r.py", "--partition-activations"),
    "context_parallel": ("context_parallel.py",),
    "expert_parallel": ("expert_parallel.py", "--experts", "2"),
    "pipeline-1f1b": ("pipeline.py", "--schedule", "1f1b"),
    "pipeline_schedules-interleaved": (
        "pipeline_schedules.py",
        *("--schedule interleaved --virtual-stages 2").split(),
    ),
    "pipeline_schedules-zb-h1": ("pipeline_schedules.py", "--schedule", "zb-h1"),
    "pipeline_pipedream": ("pipeline_pipedream.py",),
    "nd_parallel-pp": ("nd_parallel.py", "--dp-shard", "1", "--pp", "2"),
    "hybrid_parallel-pp": ("hybrid_parallel.py", "--dp", "1", "--pp", "2", "--zero-stage", "3"),
}


def needed(request):
    """The configurations this session's selected tests check: every one in a whole run."""
    names = []
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is request.module and "name" in params:
            names.append(params["name"])
    return names


@pytest.fixture(scope="module")
def loops(request, tmp_path_factory):
    """Every configuration, one after another in ONE launch (tests/script_cases.py):
    {name: (RESULT, its output)}. ddp_torchrun snapshots at each epoch's end."""
    snapshot = tmp_path_factory.mktemp("loop") / "snapshot.pt"
    names = needed(request)
    argv = []
    for name in names:
        script, *flags = LAUNCHES[name]
        if name == "ddp_torchrun":
            flags += ["--snapshot", snapshot]
        argv.append([script.removesuffix(".py"), [*LOOP, *flags]])
    return dict(zip(names, launch_cases(2, argv, timeout=400), strict=True))


@pytest.mark.parametrize("name", LAUNCHES)
def test_the_loop_runs_past_logging_steps_and_an_epoch_boundary(loops, name):
    result, output = loops[name]
    assert result["steps"] == 5
    logged = re.findall(r"^epoch (\d) step (\d+): train loss", output, re.M)
    assert logged == [("0", "2"), ("1", "4")], output
    if name == "ddp_torchrun":  # the snapshot at the first epoch's end, and at the run's end
        assert "snapshot: step 3 saved" in output and "snapshot: step 5 saved" in output, output


def test_workers_change_nothing(tmp_path):
    """--workers N loads the batches in N processes per rank, kept across epochs: the run is the
    same bit for bit as loading in the training process. Three epochs with --shift: a worker's
    copy of the dataset must see each epoch's set_epoch, or it repeats epoch 0's shifts."""
    flags = [*LOOP, "--max-steps", "0", "--epochs", "3", "--shift", "2", "--optim", "sgd"]
    argv = [["ddp", [*flags, "--workers", w, "--save", tmp_path / f"w{w}.pt"]] for w in (0, 2)]
    (loading_here, _), (in_workers, _) = launch_cases(2, argv, timeout=180)
    assert loading_here["steps"] == in_workers["steps"] == 3 * 96 // 32
    saved_here = torch.load(tmp_path / "w0.pt", weights_only=True)
    saved_by_workers = torch.load(tmp_path / "w2.pt", weights_only=True)
    for name, tensor in saved_here.items():
        difference = (tensor - saved_by_workers[name]).abs().max().item()
        assert torch.equal(tensor, saved_by_workers[name]), (name, difference)


@pytest.mark.parametrize(
    "gpus,backend,workers", [(0, "auto", 0), (2, "auto", 4), (2, "nccl", 4), (2, "gloo", 0)]
)
def test_workers_default_is_the_devices_fastest(monkeypatch, gpus, backend, workers):
    """Where the run trains on GPUs (pick_backend's choice) 4 workers keep them fed; on the CPU
    the batches cost next to nothing, and workers would take its cores from the training."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    args = common.parse_args(common.get_parser("test"), ["--backend", backend])
    assert args.workers == workers


def test_negative_workers_are_one_clear_error(capsys):
    with pytest.raises(SystemExit) as exit:
        common.parse_args(common.get_parser("test"), ["--workers", "-1"])
    assert exit.value.code == 2
    assert "--workers must be >= 0, got -1" in capsys.readouterr().err
