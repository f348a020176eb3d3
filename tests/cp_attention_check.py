"""Driver for test_context_parallel.py, launched once with torchrun at W=4: on subgroups of 2, 3
and 4 ranks, RingAttention and the Ulysses all-to-alls give F.scaled_dot_product_attention's output
and gradients on random q, k, v (odd head dims), without a mask and causal (is_causal=True) with
the contiguous and the zig-zag token split, and the ring sends what the docstring says, each
step's sends and receives in one batch. Prints one `CHECK {json}` line per case from rank 0.
With --errors (its own launch, at W=2): the inputs that go wrong on one rank only, each rank
printing an `ERRORS {json}` line of the ValueErrors it raised (anything else ends the launch)."""

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


# (name, method, causal, zigzag): each is checked against SDPA with is_causal=causal
VARIANTS = [
    ("ring", "ring", False, False),
    ("ulysses", "ulysses", False, False),
    ("ring-causal", "ring", True, False),
    ("ring-zigzag", "ring", True, True),
    ("ulysses-causal", "ulysses", True, False),
    ("ulysses-zigzag", "ulysses", True, True),
]


def ring(local, dout, group, recorder, causal, zigzag):
    """Forward and backward of the ring on this rank's tokens: the forward's calls and batches."""
    counter = common.CollectiveCounter()
    with counter:
        out = cp.RingAttention.apply(*local, group, causal, zigzag)
        forward = dict(counter.calls)
        forward_batches = len(recorder.batches)
        out.backward(dout)
    return out, counter, forward, forward_batches


def ulysses(local, dout, group, causal, zigzag):
    counter = common.CollectiveCounter()
    with counter:
        out = cp.ulysses_attention(*local, group, causal, zigzag)
        forward = dict(counter.calls)
        out.backward(dout)
    return out, counter, forward


def case(world, head_dim, group, rank):
    torch.manual_seed(world * 100 + head_dim)  # the same full tensors on every rank
    q, k, v, dout = (torch.randn(B, H, T, head_dim) for _ in range(4))
    results = {}
    for name, method, causal, zigzag in VARIANTS:
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*full, is_causal=causal)
        ref.backward(dout)
        mine = cp.token_positions(T, rank, world, zigzag)
        local = [x[:, :, mine].clone().requires_grad_() for x in (q, k, v)]
        recorder = BatchRecorder()
        dist.batch_isend_irecv = recorder
        try:
            if method == "ring":
                out, counter, forward, forward_batches = ring(
                    local, dout[:, :, mine], group, recorder, causal, zigzag
                )
            else:
                out, counter, forward = ulysses(local, dout[:, :, mine], group, causal, zigzag)
                forward_batches = 0
        finally:
            dist.batch_isend_irecv = recorder.original
        total = dict(counter.calls)
        grads = [
            (x.grad - f.grad[:, :, mine]).abs().max().item()
            for x, f in zip(local, full, strict=True)
        ]
        results[name] = dict(
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


def raised(check):
    """The message of the ValueError check() raises on this rank, None if none."""
    try:
        check()
    except ValueError as error:
        return str(error)
    return None


def errors(rank):
    """What each rank raises on (x, y) batches that go wrong on one rank only: every rank must
    raise the same ValueError, or the others would wait in a collective for the one that left."""
    torch.manual_seed(0)  # the same batch on every rank, as context parallelism wants
    vocab = 16
    x = torch.randint(vocab, (2, 16))
    y = x.roll(-1, dims=1)
    y[:, -1] = -100  # the user's "no target", on rank 1 only, where the loss below ignores -1
    logits = torch.zeros(2, 8, vocab)  # this rank's 8 of the 16 tokens, as a forward gives them

    def targets_out_of_range():
        _, targets, _ = cp.split_batch(x, y)
        cp.causal_lm_loss(logits, targets, ignore_index=-1)

    def shapes_differ():  # rank 1 cuts its sequences short
        tokens = 16 - 4 * rank
        cp.split_batch(x[:, :tokens], y[:, :tokens])

    def zigzag_chunks():  # 10 tokens do not cut into 2W = 4 chunks
        cp.split_batch(x[:, :10], y[:, :10], zigzag=True)

    return dict(
        rank=rank,
        targets=raised(targets_out_of_range),
        shapes=raised(shapes_differ),
        zigzag=raised(zigzag_chunks),
    )


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if "--errors" in sys.argv[1:]:
        print("ERRORS " + json.dumps(errors(rank)), flush=True)
        dist.destroy_process_group()
        return
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
