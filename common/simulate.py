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

import torch
import torch.distributed as dist

# torch ships its fake process group for its own tests: importing this module registers the
# "fake" backend, which no public module does (torchtitan's tests import it the same way).
import torch.testing._internal.distributed.fake_pg  # noqa: F401
from torch.utils._python_dispatch import TorchDispatchMode

from common.model import IMAGE

DEVICE = torch.device("meta")


def init_fake_process_group(rank, world):
    """Rank `rank` of `world` on the fake backend, for CPU and meta tensors alike. An in-memory
    HashStore is its store: there is nobody to meet."""
    dist.init_process_group(
        "cpu:fake,meta:fake", store=dist.HashStore(), rank=rank, world_size=world
    )


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
    """A meta tensor has no value to read: `.item()` on one (the skeleton's logged loss) reads NaN
    (0 for an integer) instead of failing, so the script's train() runs as written."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device == DEVICE:
            return float("nan") if args[0].is_floating_point() else 0
        return func(*args, **(kwargs or {}))
