"""Run a script's main() with every torch.distributed communication recorded as it is issued, each
rank to DIR/calls-<rank>.json, in the replay's format (tests/test_pipeline.py) with the process
group's ranks added to each collective, since NCCL orders collectives per communicator:

    torchrun --standalone --nproc_per_node=8 tests/record_comm.py DIR SCRIPT [FLAG ...]

    ("p2p", [[global peer, "send" | "recv", numel, dtype], ...])   one batch_isend_irecv (or
                                                                   send, recv)
    (collective, numel, [ranks of its group])     in the order the rank issued them

The communication still happens (Gloo runs it); the replay then asks whether NCCL, where a send
waits for its receive and each communicator runs its operations in order, would get through, and
whether each message is received in the size and dtype it is sent in (NCCL moves bytes: Gloo
may pass a same-size dtype mismatch that NCCL delivers as garbage)."""

import functools
import importlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the scripts

from test_pipeline import RecordedWorld  # noqa: E402 (it imports the scripts)

# the collectives test_pipeline's in-process stand-in records: the same list here
COLLECTIVES = RecordedWorld.COLLECTIVES
calls = []


def numel(args):
    """The elements of the first tensor argument, or None (objects, barrier)."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.numel()
    return None


def recorded_collective(name, original):
    @functools.wraps(original)
    def collective(*args, **kwargs):
        if dist.is_initialized():  # init_device_mesh's own calls come before the recording counts
            group = kwargs.get("group")
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            calls.append((name, numel(args), sorted(ranks)))
        return original(*args, **kwargs)

    return collective


def recorded_batch(original):
    @functools.wraps(original)
    def batch_isend_irecv(ops):
        group = []
        for op in ops:
            direction = "send" if op.op is dist.isend else "recv"
            group.append((op.peer, direction, op.tensor.numel(), str(op.tensor.dtype)))
        calls.append(("p2p", group))
        return original(ops)

    return batch_isend_irecv


def recorded_one(direction, original):
    @functools.wraps(original)
    def point_to_point(tensor, dst_or_src=None, group=None, *args, **kwargs):
        peer = dst_or_src
        group_peer = kwargs.get("group_dst", kwargs.get("group_src"))
        if peer is None and group_peer is not None:
            peer = dist.get_global_rank(group, group_peer)
        calls.append(("p2p", [(peer, direction, tensor.numel(), str(tensor.dtype))]))
        return original(tensor, dst_or_src, group, *args, **kwargs)

    return point_to_point


def main():
    folder = Path(sys.argv[1])
    script = sys.argv[2]
    for name in COLLECTIVES:
        setattr(dist, name, recorded_collective(name, getattr(dist, name)))
    dist.batch_isend_irecv = recorded_batch(dist.batch_isend_irecv)
    dist.send = recorded_one("send", dist.send)
    dist.recv = recorded_one("recv", dist.recv)
    sys.argv = [f"{script}.py", *sys.argv[3:]]
    try:
        importlib.import_module(script).main()
    finally:
        rank = int(os.environ["RANK"])
        (folder / f"calls-{rank}.json").write_text(json.dumps(calls))


if __name__ == "__main__":
    main()
