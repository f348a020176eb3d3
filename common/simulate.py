"""--simulate W: this one process runs as rank r (--simulate-rank, 0 by default) of a world of W
ranks that do not exist, at the papers' sizes, in seconds and a few hundred MB.

Two things of torch's make it possible. Its fake process group answers every collective at once,
leaving the output as it was: rank r issues exactly the calls, of exactly the sizes, that it would
issue among W real ranks. The meta device holds a tensor's shape and dtype but no values, so a
175B-parameter model is never built in memory, and every operation only computes its output's
shape. The script's own parallelize, optimizer hooks and train step run unchanged; the Meter counts
what rank r would hold and send, and report() prints it next to the formula, as in a real run.

What a simulated run cannot have is values: one step on meta batches, its loss read as NaN, no
evaluation, no save, no samples/s. common.parse_args and common.launch choose all of it; a script
offers the flag (`common.get_parser(..., simulates=True)`) and leaves out its evaluation and save
(`if not args.simulate`). FSDP2 refuses meta parameters at its first forward: fsdp.py does not
offer it."""

import contextlib
import os

import torch
import torch.distributed as dist

# torch ships its fake process group for its own tests: importing this module registers the
# "fake" backend, which no public module does (torchtitan's tests import it the same way).
import torch.testing._internal.distributed.fake_pg  # noqa: F401
from torch.utils._python_dispatch import TorchDispatchMode

from common import messages
from common.model import IMAGE

DEVICE = torch.device("meta")
# what torchrun would give rank r of W: env_rank() and init_process_group read them
VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


@contextlib.contextmanager
def simulated_rank(rank, world):
    """This process as rank `rank` of `world` for one run (common.launch): torchrun's variables,
    log() and fail() speaking whichever rank it plays (messages.ALONE), and meta tensors' .item()
    readable (MetaValues). Restored afterwards, so that nothing of the simulated world outlives
    the run: a later launch in this process would wait for W ranks that never come."""
    saved = {name: os.environ.get(name) for name in VARIABLES}
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE="1")
    messages.ALONE = True
    try:
        with MetaValues():
            yield
    finally:
        messages.ALONE = False
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def init_fake_process_group(rank, world):
    """Rank `rank` of `world` on the fake backend, for CPU and meta tensors alike (named for
    meta too: point-to-point ops look their backend up by the tensor's device). An in-memory
    HashStore is its store: there is nobody to meet. (torch 2.11 warns "No backend of type 0
    found" as such a group is destroyed: harmless.)"""
    dist.init_process_group(
        "cpu:fake,meta:fake", store=dist.HashStore(), rank=rank, world_size=world
    )


@contextlib.contextmanager
def playing_rank(rank, world):
    """The fake group restarted as rank `rank` of `world` for the block (its rank is fixed when it
    starts), then as the rank it was: to run another rank's part of a step in this process (the
    pipelines' every_stage_order)."""
    was = dist.get_rank()
    dist.destroy_process_group()
    init_fake_process_group(rank, world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        init_fake_process_group(was, world)


def meta_data(args):
    """(train_set, test_set): one global batch of meta images and labels, so that each
    data-parallel rank draws its batch/dp of them for one step, and no test samples."""
    from common.data import Digits

    n = args.batch_size
    images = torch.empty(n, 1, IMAGE, IMAGE, device=DEVICE)
    labels = torch.empty(n, dtype=torch.long, device=DEVICE)
    train_set = Digits(images, labels)
    test_set = Digits(images[:0], labels[:0])
    return train_set, test_set


class MetaValues(TorchDispatchMode):
    """A meta tensor has no value to read: `.item()` of a floating-point one (the skeleton's
    logged loss) reads NaN instead of failing, so the script's train() runs as written. An integer
    or a bool (a count, a mask's any(), a found-inf check) would steer the run: that fails, saying
    so, rather than take one branch silently."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device == DEVICE:
            if not args[0].is_floating_point():
                raise RuntimeError(
                    "--simulate: this reads the value of a meta tensor, which has none: leave it "
                    "out of the simulated path (`if not args.simulate`)"
                )
            return float("nan")
        return func(*args, **(kwargs or {}))
