"""Every script's training loop past two logging steps and an epoch boundary.

A logging step all-reduces the windowed loss and an epoch boundary starts a new shuffle: a send left
open across either (a pipeline whose last backward's gradient is received in the next step) hangs
there on NCCL as on Gloo. Three batches an epoch, five steps, a loss line every two steps."""

import re

import pytest

from helpers import ok, torchrun

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
}


# The quick suite launches the scripts that can leave communication open between steps or across
# an epoch boundary: pipelines (sends to the next stage), ZeRO-3 (the next unit's all-gather is
# prefetched), expert parallelism (the expert gradients' all-reduce overlaps backward),
# ddp_torchrun (a snapshot at each epoch's end) and ddp.py itself. The others finish every
# collective inside the step; the full tier launches them too.
FULL_ONLY = (
    "amp_checkpoint",
    "fsdp",
    "tensor_parallel",
    "tensor_parallel_zero_r",
    "context_parallel",
)
NAMES = [
    pytest.param(name, marks=pytest.mark.full) if name in FULL_ONLY else name for name in LAUNCHES
]


@pytest.mark.parametrize("name", NAMES)
def test_the_loop_runs_past_logging_steps_and_an_epoch_boundary(name):
    script, *flags = LAUNCHES[name]
    run = torchrun(script, 2, *LOOP, *flags, timeout=120)
    result = ok(run)
    assert result["steps"] == 5
    logged = re.findall(r"^epoch (\d) step (\d+): train loss", run.stdout, re.M)
    assert logged == [("0", "2"), ("1", "4")], run.output
