"""Driver for test_context_parallel.py, launched once with torchrun at W=4: on subgroups of 2, 3 and 4
ranks, RingAttention and the Ulysses all-to-alls give F.scaled_dot_product_attention's output and
gradients on random q, k, v (odd head dims), and the ring sends what the docstring says. Prints one
`CHECK {json}` line per case from rank 0."""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import context_parallel as cp  # noqa: E402

B, H, T = 2, 12, 24  # T and H divide by 2, 3 and 4


def case(world, d, group, rank):
    torch.manual_seed(world * 100 + d)  # the same full tensors on every rank
    q, k, v, dout = (torch.randn(B, H, T, d) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full)
    ref.backward(dout)
    t = T // world
    mine = slice(rank * t, (rank + 1) * t)
    out = {}
    for method in ("ring", "ulysses"):
        local = [x[:, :, mine].clone().requires_grad_() for x in (q, k, v)]
        counter = common.CollectiveCounter()
        with counter:
            if method == "ring":
                o = cp.RingAttention.apply(*local, group)
                fwd = dict(counter.calls)
                o.backward(dout[:, :, mine])
            else:
                ql, kl, vl = (x.transpose(1, 2) for x in local)  # [B, T/W, H, d]
                qh, kh, vh = (
                    cp.AllToAll.apply(x, group, 2, 1).transpose(1, 2) for x in (ql, kl, vl)
                )
                o = cp.AllToAll.apply(
                    F.scaled_dot_product_attention(qh, kh, vh).transpose(1, 2), group, 1, 2
                )
                o = o.transpose(1, 2)
                fwd = dict(counter.calls)
                o.backward(dout[:, :, mine])
        total = dict(counter.calls)
        diffs = [(o - ref[:, :, mine]).abs().max().item()] + [
            (x.grad - f.grad[:, :, mine]).abs().max().item() for x, f in zip(local, full)
        ]
        out[method] = dict(
            out=diffs[0],
            dq=diffs[1],
            dk=diffs[2],
            dv=diffs[3],
            fwd_calls=fwd,
            bwd_calls={k2: total[k2] - fwd.get(k2, 0) for k2 in total},
            send_bytes=counter.bytes.get("send", 0),
        )
    return out


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for w in (w for w in (2, 3, 4) if w <= world):
        group = dist.new_group(list(range(w)))
        for d in (5, 7):
            if rank < w:
                res = case(w, d, group, rank)
                if rank == 0:
                    print("CHECK " + json.dumps(dict(world=w, head_dim=d, **res)), flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
