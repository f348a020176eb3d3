"""Driver for test_context_parallel.py, launched once with torchrun at W=4: on subgroups of 2, 3
and 4 ranks, F.scaled_dot_product_attention called inside the section's ContextParallel mode (the
ring, or the Ulysses all-to-alls) gives one process's SDPA output and gradients on random q, k, v
(odd head dims), without a mask and causal (is_causal=True) with the contiguous and the zig-zag
token split, and grouped-query (enable_gqa, 4 K/V heads for 12) with a scale of its own; the ring
sends what the docstring says, each step's sends and receives in one batch. Prints one
`CHECK {json}` line per case from rank 0.
On each subgroup, `BF16 {json}`: the ring's and Ulysses' errors on bf16 q, k, v (and the ring's
under CPU autocast on fp32 ones) against SDPA in fp32 on the whole sequence, next to SDPA's own
error in bf16. Then, on all 4 ranks, rank 0 prints `GROUPS {json}`, the process groups each
kind of c10d op of a DDP ViT's training step ran on, and DDP's group; `INDEX {json}`, the ops
that build index tensors or move tensors between devices in two calls of split_tokens, the
ring, Ulysses and the patch embedding (the second call should make none).
With --errors (its own launch, at W=2): the inputs that go wrong on one rank only and the calls
the swap refuses, each rank printing an `ERRORS {json}` line of the ValueErrors it raised
(anything else ends the launch) and of the CheckpointError a checkpointed SDPA raises; then
`LOSS {json}`: causal_lm_loss on bf16 logits of 4,096 tokens with 4,095 valid targets, next to
one process's loss on the same logits in fp32."""

import gc
import json
import os
import sys

import hf_gpt2_model  # tests/, this script's folder
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointError, checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402  (the repository root is on the path only now)
import context_parallel as cp  # noqa: E402

B, H, T = 2, 12, 24  # T and H divide by 2, 3 and 4
KV_HEADS = 4  # the grouped-query variants: each K/V head serves 3 query heads


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


# (name, method, causal, zigzag, grouped-query): each is checked against SDPA with the same
# arguments on the whole sequence; the grouped-query ones with enable_gqa and scale=0.3
VARIANTS = [
    ("ring", "ring", False, False, False),
    ("ulysses", "ulysses", False, False, False),
    ("ring-causal", "ring", True, False, False),
    ("ring-zigzag", "ring", True, True, False),
    ("ulysses-causal", "ulysses", True, False, False),
    ("ulysses-zigzag", "ulysses", True, True, False),
    ("ring-gqa", "ring", True, True, True),
    ("ulysses-gqa", "ulysses", True, True, True),
]


def positions(rank, world, zigzag):
    """The positions of this rank's T/W tokens: its contiguous run, or its zig-zag chunks."""
    if zigzag:
        return cp.zigzag_positions(T, rank, world)
    return cp.token_positions(T, rank, world)


def sdpa_arguments(causal, gqa):
    """The keyword arguments a model passes to F.scaled_dot_product_attention in a variant."""
    if gqa:
        return dict(is_causal=causal, enable_gqa=True, scale=0.3)
    return dict(is_causal=causal)


def swapped(local, dout, group, recorder, method, zigzag, arguments):
    """SDPA inside ContextParallel on this rank's tokens, forward and backward: the output, the
    collectives of both, those of the forward and the forward's batches of sends and receives."""
    counter = common.CollectiveCounter()
    with counter:
        with cp.ContextParallel(group, method, zigzag):
            out = F.scaled_dot_product_attention(*local, **arguments)
        forward = dict(counter.calls)
        forward_batches = len(recorder.batches)
        out.backward(dout)
    return out, counter, forward, forward_batches


def case(world, head_dim, group, rank):
    torch.manual_seed(world * 100 + head_dim)  # the same full tensors on every rank
    q, k, v, dout = (torch.randn(B, H, T, head_dim) for _ in range(4))
    results = {}
    for name, method, causal, zigzag, gqa in VARIANTS:
        kv_heads = KV_HEADS if gqa else H
        full = [t.clone().requires_grad_() for t in (q, k[:, :kv_heads], v[:, :kv_heads])]
        arguments = sdpa_arguments(causal, gqa)
        ref = F.scaled_dot_product_attention(*full, **arguments)
        ref.backward(dout)
        mine = positions(rank, world, zigzag)
        local = [x.detach()[:, :, mine].clone().requires_grad_() for x in full]
        recorder = BatchRecorder()
        dist.batch_isend_irecv = recorder
        try:
            out, counter, forward, forward_batches = swapped(
                local, dout[:, :, mine], group, recorder, method, zigzag, arguments
            )
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


def errors_against(reference, out, grads):
    """Max |Δ| of the output and of dq, dk, dv against the fp32 reference (out, grads)."""
    ref_out, ref_grads = reference
    errs = dict(out=(out.float() - ref_out).abs().max().item())
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        errs[name] = (grad.float() - ref).abs().max().item()
    return errs


def bf16_case(world, group, rank, causal, zigzag):
    """Attention on bf16 q, k, v (head dim 16, scores of a few units), against SDPA in fp32 on the
    same values over the whole sequence: the ring and Ulysses on this rank's tokens, SDPA in bf16
    on the whole sequence (the bar), and the ring on fp32 q, k, v under CPU autocast to bf16."""
    torch.manual_seed(7 + world)
    q, k, v = (3 * torch.randn(B, H, T, 16).bfloat16() for _ in range(3))
    dout = torch.randn(B, H, T, 16).bfloat16()
    mine = positions(rank, world, zigzag)

    def run(attend, dtype, whole=False, autocast=False):
        inputs = [x.to(dtype) if whole else x[:, :, mine].to(dtype) for x in (q, k, v)]
        inputs = [x.clone().requires_grad_() for x in inputs]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = attend(*inputs)
        out.backward(dout.to(out.dtype) if whole else dout[:, :, mine].to(out.dtype))
        grads = [x.grad for x in inputs]
        if whole:  # this rank's rows, as the context-parallel runs give them
            return out[:, :, mine], [g[:, :, mine] for g in grads]
        return out, grads

    def sdpa(*qkv):
        return F.scaled_dot_product_attention(*qkv, is_causal=causal)

    def ring(*qkv):
        with cp.ContextParallel(group, "ring", zigzag):
            return F.scaled_dot_product_attention(*qkv, is_causal=causal)

    def ulysses(*qkv):
        with cp.ContextParallel(group, "ulysses", zigzag):
            return F.scaled_dot_product_attention(*qkv, is_causal=causal)

    reference = run(sdpa, torch.float32, whole=True)
    return {
        "sdpa-bf16": errors_against(reference, *run(sdpa, torch.bfloat16, whole=True)),
        "ring-bf16": errors_against(reference, *run(ring, torch.bfloat16)),
        "ulysses-bf16": errors_against(reference, *run(ulysses, torch.bfloat16)),
        "ring-autocast": errors_against(reference, *run(ring, torch.float32, autocast=True)),
    }


def worst_over_ranks(errs, group):
    """Each error's maximum over the group's ranks: every rank checks its own tokens' rows."""
    names = [(case, kind) for case in sorted(errs) for kind in sorted(errs[case])]
    values = torch.tensor([errs[case][kind] for case, kind in names], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    worst = {case: {} for case in errs}
    for (case, kind), value in zip(names, values.tolist(), strict=True):
        worst[case][kind] = value
    return worst


def groups_of_a_training_step(method):
    """{kind of c10d op: the process groups it ran on} in a forward and backward of the ViT under
    parallelize (DDP), and the name of DDP's group."""
    args = common.parse_args(
        common.get_parser("t"), ["--dim", "32", "--depth", "2", "--heads", "4", "--patch", "2"]
    )
    model = common.build_model(args)
    cp.split_sequence(model.embed, model.head.fc)
    model = cp.parallelize(model, torch.device("cpu"), method)
    torch.manual_seed(0)
    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    counter = common.CollectiveCounter()
    with counter:
        F.cross_entropy(model(x), y).backward()
    kinds = {}
    for name, per_kind in counter.groups.items():
        for kind in per_kind:
            kinds.setdefault(kind, []).append(name)
    ddp_group = model.process_group.group_name
    del model  # DDP's reducer holds the group: free it while the group is up (see run())
    gc.collect()
    return dict(kinds={kind: sorted(names) for kind, names in kinds.items()}, ddp=ddp_group)


class IndexOps(TorchDispatchMode):
    """Records the ops that build index tensors (positions, masks, their sort) or move a tensor
    between devices."""

    NAMES = ("arange", "sort", "argsort", "ones", "triu", "triu_", "_to_copy", "lift_fresh")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.NAMES:
            self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def index_tensors(group, rank, world):
    """The index ops of two calls each of split_tokens, the causal zig-zag ring and Ulysses
    (forward and backward) and the patch embedding, on a sequence length no other case used (48
    tokens). The embedding's parameters are on the meta device: an index kept on the CPU would be
    copied to them at every call, as it would to a GPU."""
    tokens = 2 * T
    args = common.parse_args(
        common.get_parser("t"), ["--dim", "32", "--depth", "1", "--heads", "4", "--patch", "7"]
    )
    vit = common.build_model(args).to("meta")
    cp.split_sequence(vit.embed, vit.head.fc, group)
    torch.manual_seed(3)
    q, k, v = (torch.randn(B, H, tokens // world, 8, requires_grad=True) for _ in range(3))
    calls = []
    for _ in range(2):
        with IndexOps() as recorder:
            cp.split_tokens(torch.zeros(B, tokens, dtype=torch.long), group, zigzag=True)
            for method in ("ring", "ulysses"):
                with cp.ContextParallel(group, method, zigzag=True):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                out.sum().backward()
            vit.embed(torch.zeros(B, 1, 28, 28, device="meta"))
        calls.append(recorder.seen)
    return calls


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

    def padding_mask():  # a mask of the model's making: it would cover this rank's tokens only
        q = torch.zeros(2, 4, 8, 8)
        with cp.ContextParallel(dist.group.WORLD):
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))

    def heads_for_ulysses():  # 3 heads do not split over W = 2 ranks
        q = torch.zeros(2, 3, 8, 8)
        with cp.ContextParallel(dist.group.WORLD, "ulysses"):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)

    def attention_in_matmuls():  # HF's GPT-2 with "eager" attention: a forward without SDPA
        gpt2 = hf_gpt2_model.model(hf_gpt2_model.CONFIGS["eager-"])
        model = cp.parallelize(gpt2, torch.device("cpu"))
        try:
            with torch.no_grad():  # no backward will follow: DDP must not wait for one
                model(x[:, :8], position_ids=torch.arange(8 * rank, 8 * rank + 8))
        finally:
            del model  # DDP's reducer, freed while the group is up (see context_parallel.run)
            gc.collect()

    def checkpointed_attention():  # torch's checkpoint recomputes SDPA in backward, unswapped
        q = torch.zeros(2, 4, 8, 8, requires_grad=True)
        with cp.ContextParallel(dist.group.WORLD):
            out = checkpoint(F.scaled_dot_product_attention, q, q, q, use_reentrant=False)
        try:
            out.sum().backward()
        except CheckpointError as error:
            return str(error).splitlines()[0]
        return None

    return dict(
        rank=rank,
        checkpoint=checkpointed_attention(),
        targets=raised(targets_out_of_range),
        shapes=raised(shapes_differ),
        zigzag=raised(zigzag_chunks),
        mask=raised(padding_mask),
        ulysses=raised(heads_for_ulysses),
        no_sdpa=raised(attention_in_matmuls),
    )


def bf16_loss():
    """causal_lm_loss on this rank's half of bf16 logits [1, 4096, 8] whose targets are all valid
    but the first (4,095 of them), and one process's cross-entropy on the same logits in fp32."""
    torch.manual_seed(1)  # the same logits and targets on every rank
    logits = (3 * torch.randn(1, 4096, 8)).bfloat16()
    targets = torch.randint(8, (1, 4096))
    targets[0, 0] = -100
    local_logits, _ = cp.split_tokens(logits)
    local_targets, _ = cp.split_tokens(targets)
    loss = cp.causal_lm_loss(local_logits, local_targets)
    reference = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    return dict(loss=loss.item(), dtype=str(loss.dtype), reference=reference.item())


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if "--errors" in sys.argv[1:]:
        # Both ranks print to one pipe: one write() of the whole line (print writes the text
        # and its newline apart, and the other rank's line could land between them).
        sys.stdout.write("ERRORS " + json.dumps(errors(rank)) + "\n")
        sys.stdout.flush()
        loss = bf16_loss()
        if rank == 0:
            print("LOSS " + json.dumps(loss), flush=True)
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
        if rank < w:
            bf16 = {}
            for name, causal, zigzag in (("plain", False, False), ("zigzag", True, True)):
                bf16[name] = worst_over_ranks(bf16_case(w, group, rank, causal, zigzag), group)
            if rank == 0:
                print("BF16 " + json.dumps(dict(world=w, **bf16)), flush=True)
        dist.barrier()
    groups = {method: groups_of_a_training_step(method) for method in ("ring", "ulysses")}
    first, second = index_tensors(dist.group.WORLD, rank, world)
    if rank == 0:
        print("GROUPS " + json.dumps(groups), flush=True)
        print("INDEX " + json.dumps(dict(first=first, second=second)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
