"""Driver for test_context_parallel.py, launched once with torchrun at W=4: on subgroups of 2, 3
and 4 ranks, RingAttention and the Ulysses all-to-alls give F.scaled_dot_product_attention's output
and gradients on random q, k, v (odd head dims), and the ring sends what the docstring says, each
step's sends and receives in one batch. Prints one `CHECK {json}` line per case from rank 0."""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402  (the repository root is on the path only now)
import context_parallel as cp  # noqa: E402

B, H, T = 2, 12, 24  # T and H divide by 2, 3 and 4


class BatchRecorder:
    """Wraps dist.batch_isend_irecv (the ring looks it up at each call) and records, per batch,
    how many sends and receives it posted."""

    def __init__(self):
        self.batches = []
        self.original = dist.batch_isend_irecv

    def __call__(self, ops):
        sends = sum(1 for op in ops if op.op is dist.isend)
        self.batches.append(dict(sends=sends, recvs=len(ops) - sends))
        return self.original(ops)


def ring(local, dout, group, recorder):
    """Forward and backward of the ring on this rank's tokens: the forward's calls and batches."""
    counter = common.CollectiveCounter()
    with counter:
        out = cp.RingAttention.apply(*local, group)
        forward = dict(counter.calls)
        forward_batches = len(recorder.batches)
        out.backward(dout)
    return out, counter, forward, forward_batches


def ulysses(local, dout, group):
    counter = common.CollectiveCounter()
    with counter:
        q, k, v = (x.transpose(1, 2) for x in local)  # [B, T/W, H, d]
        q, k, v = (cp.AllToAll.apply(x, group, 2, 1).transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        out = cp.AllToAll.apply(out, group, 1, 2).transpose(1, 2)
        forward = dict(counter.calls)
        out.backward(dout)
    return out, counter, forward


def case(world, head_dim, group, rank):
    torch.manual_seed(world * 100 + head_dim)  # the same full tensors on every rank
    q, k, v, dout = (torch.randn(B, H, T, head_dim) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full)
    ref.backward(dout)
    tokens = T // world
    mine = slice(rank * tokens, (rank + 1) * tokens)
    results = {}
    for method in ("ring", "ulysses"):
        local = [x[:, :, mine].clone().requires_grad_() for x in (q, k, v)]
        recorder = BatchRecorder()
        dist.batch_isend_irecv = recorder
        try:
            if method == "ring":
                out, counter, forward, forward_batches = ring(
                    local, dout[:, :, mine], group, recorder
                )
            else:
                out, counter, forward = ulysses(local, dout[:, :, mine], group)
                forward_batches = 0
        finally:
            dist.batch_isend_irecv = recorder.original
        total = dict(counter.calls)
        grads = [
            (x.grad - f.grad[:, :, mine]).abs().max().item()
            for x, f in zip(local, full, strict=True)
        ]
        results[method] = dict(
            out=(out - ref[:, :, mine]).abs().max().item(),
            dq=grads[0],
            dk=grads[1],
            dv=grads[2],
            fwd_calls=forward,
            bwd_calls={kind: total[kind] - forward.get(kind, 0) for kind in total},
            send_bytes=counter.bytes.get("send", 0),
            fwd_batches=forward_batches,
            bwd_batches=len(recorder.batches) - forward_batches,
            paired=all(b["sends"] == b["recvs"] for b in recorder.batches),
        )
    return results


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for w in (w for w in (2, 3, 4) if w <= world):
        group = dist.new_group(list(range(w)))
        for head_dim in (5, 7):
            if rank < w:
                res = case(w, head_dim, group, rank)
                if rank == 0:
                    print(
                        "CHECK " + json.dumps(dict(world=w, head_dim=head_dim, **res)), flush=True
                    )
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
