"""Context parallelism: each of W ranks holds the whole model and T/W of the tokens of every
sample; only attention needs the other ranks' tokens, so the model's F.scaled_dot_product_attention
runs over the ranks: ring attention passes the key/value blocks round a ring, merged with the
online softmax; Ulysses all-to-alls the token split into a head split and back. DDP averages the
ranks' gradients, which the loss's SumOverRanks (×W in backward) turns into their sum.

    step      0     1     2     3     Ring, W = 4: rank r keeps its queries Q_r. Each step, in one
    rank 0   KV0   KV3   KV2   KV1    batch_isend_irecv, it sends the K/V block in hand to rank r+1
    rank 1   KV1   KV0   KV3   KV2    and receives the next one from rank r-1, and attends to the
    rank 2   KV2   KV1   KV0   KV3    block in hand while the next one travels: at step s, rank r
    rank 3   KV3   KV2   KV1   KV0    holds rank (r - s) mod W's block.
    Ulysses, W = 2:  q, k, v [B, H, T/2, d]  ==all-to-all==>  [B, H/2, T, d]: SDPA on all tokens,
    (a rank's tokens)  out   [B, H, T/2, d]  <==all-to-all==  [B, H/2, T, d]  half the heads

Memory per rank (fp32, AdamW): 16Ψ, as DDP; attention saves 4·a·B·T·D/W + 4·B·H·T/W bytes a
block (a = 5 for ring, 6 for Ulysses), never the T x T scores. Per step and block, the ring sends
W-1 K/V blocks of 2·B·(T/W)·D fp32 forward and 2(W-1) backward; Ulysses makes 8 all-to-alls of
B·T·D/W fp32. Both all-reduce the B·D pooled features (the head) and, as DDP, the Ψ gradients.
Papers: Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context",
https://arxiv.org/abs/2310.01889; Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for
Enabling Training of Extreme Long Sequence Transformer Models", https://arxiv.org/abs/2309.14509.
The online softmax, causal and zig-zag, the counts: docs/techniques.md#context-parallelism

    torchrun --standalone --nproc_per_node=4 context_parallel.py --patch 2 --method ring
    python context_parallel.py --nproc 2 --patch 2 --method ulysses   # mp.spawn on a free port
"""

import functools
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader, DistributedSampler

import common

SCRIPT = os.path.splitext(os.path.basename(__file__))[0]


### begin: Context parallel
# Model contract: the model's attention calls F.scaled_dot_product_attention on [B, H, T, d]
# q, k, v, as the ViT, nanoGPT, HF's "sdpa" attention and torchtitan's SDPA path do. During the
# model's forward that call runs as ring attention on this rank's T/W tokens, attending to all T.
# Everything else is the model's own: embeddings, positions, norms, losses. Checkpoint no
# attention: torch's checkpoint recomputes it in backward, outside the swap (use_reentrant=False
# then raises CheckpointError; use_reentrant=True would attend to this rank's tokens, silently).
# The model is fed this rank's tokens: the ViT through split_sequence (its embedding's output
# cut, its pooled mean summed over the ranks). The same weights on every rank; every rank feeds
# the same batch. Two groups, None meaning the world for each: the context group, the ranks that
# split each sample's tokens (parallelize's and split_sequence's `group`), and DDP's, every rank
# that holds a copy of the model (parallelize's `data_group`), which holds the context group.


class RingPass:
    """Send each of `blocks` ({name: tensor}) to the next rank of the ring and receive one of each
    from the previous rank; wait() returns the received tensors under the same names. The sends
    and receives go in one batch_isend_irecv: on NCCL a send blocks until its peer posts the
    matching receive, so every rank must post both at once."""

    def __init__(self, blocks, group):
        rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        # The peers are the group's ranks, as group_peer takes them.
        next_rank = (rank + 1) % world
        previous_rank = (rank - 1) % world
        self.received = {name: torch.empty_like(block) for name, block in blocks.items()}
        sends = [
            dist.P2POp(dist.isend, block, group=group, group_peer=next_rank)
            for block in blocks.values()
        ]
        receives = [
            dist.P2POp(dist.irecv, block, group=group, group_peer=previous_rank)
            for block in self.received.values()
        ]
        self.requests = []
        # batch_isend_irecv refuses an empty list, and backward's last step at W = 2 (or any step
        # at W = 1) has nothing to pass.
        if blocks:
            self.requests = dist.batch_isend_irecv(sends + receives)

    def wait(self):
        for request in self.requests:
            request.wait()
        return self.received


def merge_block(q_scaled, kv_block, out, row_max, row_sum, mask=None):
    """Online softmax: fold one K/V block into this rank's running O, m and l, in place. O is the
    unnormalised output sum_j exp(S_j - m) V_j, m each query row's running max score, l its
    running sum_j exp(S_j - m); the attention output is O / l once every block is in. The block's
    scores are never kept beyond this call: [B, H, T/W, T/W], never T x T."""
    key, value = kv_block.float()  # the sums in fp32, whatever q's dtype
    scores = q_scaled @ key.mT  # S_j
    if mask is not None:
        scores.masked_fill_(mask, -float("inf"))
    new_max = torch.maximum(row_max, scores.amax(-1, keepdim=True))  # m'
    # What was summed under the old max is rescaled to the new one, e^(m - m') <= 1: no exponent
    # ever exceeds 0, so nothing overflows however large the scores.
    correction = torch.exp(row_max - new_max)
    # e^(S_j - m'), computed in place: the scores are not needed again.
    exp_scores = scores.sub_(new_max).exp_()
    row_sum.mul_(correction).add_(exp_scores.sum(-1, keepdim=True))
    out.mul_(correction).add_(exp_scores @ value)
    row_max.copy_(new_max)


def block_backward(q_scaled, kv_block, grad_out, log_sum_exp, grad_dot_out, mask=None):
    """Flash attention's backward for one K/V block: this rank's queries' share of the gradient
    of q_scaled = q·scale and the block's [dK, dV] from this rank's queries. The block's softmax
    P = e^(S - lse), S = q_scaled·Kᵀ, as in forward (0 where `mask` hides a key);
    dS = P ∘ (dO·Vᵀ - rowsum(dO ∘ O)); d(q_scaled) = dS·K, dK = dSᵀ·q_scaled,
    dV = Pᵀ·dO."""
    key, value = kv_block.float()
    scores = q_scaled @ key.mT
    if mask is not None:
        scores.masked_fill_(mask, -float("inf"))
    probs = scores.sub_(log_sum_exp).exp_()
    grad_scores = (grad_out @ value.mT).sub_(grad_dot_out).mul_(probs)
    grad_q_scaled = grad_scores @ key
    grad_kv = torch.stack([grad_scores.mT @ q_scaled, probs.mT @ grad_out])
    return grad_q_scaled, grad_kv


class WholeBlocks:
    """What this rank's queries attend to in the K/V block of rank `owner`, forward and backward:
    all of it. The ring takes this as an argument: a causal mask, which sees a part of some
    blocks and none of others, is a subclass."""

    def merge(self, q_scaled, kv_block, out, row_max, row_sum, owner):
        merge_block(q_scaled, kv_block, out, row_max, row_sum)

    def backward(self, q_scaled, kv_block, grad_out, log_sum_exp, grad_dot_out, owner):
        return block_backward(q_scaled, kv_block, grad_out, log_sum_exp, grad_dot_out)


class RingAttention(torch.autograd.Function):
    """Ring attention (Liu et al. 2023, https://arxiv.org/abs/2310.01889): softmax(q kᵀ scale) v
    over the whole sequence for this rank's queries (scale: 1/√d unless given); q, k, v and the
    output: [B, H, T/W, d], this rank's tokens. Forward merges the K/V blocks with the online
    softmax as they come round the ring, each step's block attended to while the next one
    travels; backward is flash attention's, one K/V block at a time, recomputing each block's
    softmax from the saved log-sum-exp. `blocks` says what the queries see of each block."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale, blocks):
        rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        q_scaled = q.float() * scale  # fp32 from here on, as merge_block's sums
        kv_block = torch.stack([k, v])  # the K/V block in hand: one message per step
        out = torch.zeros_like(q_scaled)  # O; q's layout: the model's next reshape reads it as is
        row_max = q_scaled.new_full((*q.shape[:-1], 1), -float("inf"))  # m
        row_sum = q_scaled.new_zeros((*q.shape[:-1], 1))  # l
        for step in range(world):
            owner = (rank - step) % world  # the rank whose K/V block is in hand
            passing_on = step < world - 1  # the last block goes no further
            if passing_on:
                transfer = RingPass({"kv": kv_block}, group)  # the next block travels meanwhile
            blocks.merge(q_scaled, kv_block, out, row_max, row_sum, owner)
            if passing_on:
                kv_block = transfer.wait()["kv"]
        out = (out / row_sum).to(q.dtype)  # the one cast: a no-op in fp32
        log_sum_exp = row_max + row_sum.log()
        ctx.save_for_backward(q, k, v, out, log_sum_exp)
        ctx.group = group
        ctx.scale = scale
        ctx.blocks = blocks
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, log_sum_exp = ctx.saved_tensors
        group = ctx.group
        rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        q_scaled = q.float() * ctx.scale  # fp32, as in forward
        grad_out = grad_out.float()
        # Softmax's backward needs rowsum(P ∘ dP) over the whole row; it equals rowsum(dO ∘ O)
        # (FlashAttention-2's D), known before any block comes by.
        grad_dot_out = (grad_out * out.float()).sum(-1, keepdim=True)
        kv_block = torch.stack([k, v])  # the K/V block in hand, round the ring again
        grad_q_scaled = torch.zeros_like(q_scaled)
        # A block's dK/dV is a sum over every rank's queries. Its owner keeps its own share from
        # step 0; the other shares add up in a sum that follows the block round the ring one step
        # behind it (a rank knows its share only once it has attended to the block), then makes
        # a last hop home. Block 0 at W = 4:
        #     step 1   rank 1 holds KV0: the sum is rank 1's share
        #     step 2   rank 2 holds KV0, receives the sum from rank 1, adds its share
        #     step 3   rank 3 holds KV0, receives the sum from rank 2, adds its share
        #     after    rank 3 sends the sum home: rank 0 adds it to its share from step 0
        grad_kv_own = None  # this rank's share of its own block's dK/dV
        grad_kv_sum = None  # the dK/dV of the block attended to last, summed over its visits
        for step in range(world):
            owner = (rank - step) % world
            sending = {}
            if step < world - 1:  # the last block goes no further
                sending["kv"] = kv_block
            if step >= 2:  # step 1 started the first sum; the next rank now holds its block
                sending["grad_kv"] = grad_kv_sum
            transfer = RingPass(sending, group)
            grad_q_share, grad_kv_share = ctx.blocks.backward(
                q_scaled, kv_block, grad_out, log_sum_exp, grad_dot_out, owner
            )
            grad_q_scaled += grad_q_share
            received = transfer.wait()
            if step == 0:
                grad_kv_own = grad_kv_share
            elif step == 1:
                grad_kv_sum = grad_kv_share  # the first rank the block visits after its owner
            else:  # the previous rank's sum for the same block
                grad_kv_sum = grad_kv_share + received["grad_kv"]
            if "kv" in received:
                kv_block = received["kv"]
        if world > 1:  # the last sum goes home: W - 1 dK/dV hops in all
            grad_kv_own = grad_kv_own + RingPass({"grad_kv": grad_kv_sum}, group).wait()["grad_kv"]
        grad_k, grad_v = grad_kv_own.to(k.dtype)
        grad_q = (grad_q_scaled * ctx.scale).to(q.dtype)  # q_scaled = q·scale
        return grad_q, grad_k, grad_v, None, None, None


class ContextParallel(TorchFunctionMode):
    """While it is on, F.scaled_dot_product_attention on this rank's tokens ([B, H, T/W, d]) attends
    to all T tokens of the group, by ring attention. Every other function runs as it is, after
    one Python call here. (torch's experimental context_parallel swaps the same call by replacing
    the attribute F.scaled_dot_product_attention; a mode, public API, also catches a model that
    imported the function under a name of its own.)"""

    def __init__(self, group, method="ring"):
        super().__init__()
        if method != "ring":
            raise ValueError(f"method {method!r}: this mode attends by the ring alone")
        self.group = group

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # torch turns the mode off while this runs: what it calls is the plain function.
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        return self.attend(*args, **(kwargs or {}))

    def attend(self, q, k, v, scale=None):
        """SDPA's call as the ViT makes it: q, k, v, a scale at most."""
        # Positional: torch 2.11's Function.apply takes no keyword arguments.
        return RingAttention.apply(q, k, v, self.group, scale, WholeBlocks())


def swap_attention(model, mode):
    """Run every forward of `model` inside `mode`: a forward pre-hook turns it on, a forward hook
    turns it off, even when the forward raises."""

    def turn_on(module, inputs):
        mode.__enter__()

    def turn_off(module, inputs, output):
        mode.__exit__(None, None, None)

    model.register_forward_pre_hook(turn_on)
    model.register_forward_hook(turn_off, always_call=True)


def parallelize(model, device, method="ring", group=None, data_group=None, **options):
    """Every rank keeps the whole model and runs it on its T/W tokens of every sample (which ones:
    token_positions), each SDPA call in its forward attending to all T (ContextParallel, which
    takes `method` and `options`). The model is fed this rank's tokens (the ViT's by
    split_sequence). group: the context group, the W ranks that split the tokens (None: the
    world). data_group: DDP's, every rank that holds a copy of the model (None: the world); it
    holds the context group. Beside data parallelism on a DeviceMesh ("dp", "cp") that is the
    world: group=mesh["cp"].get_group(), data_group=None."""
    group = group or dist.group.WORLD
    swap_attention(model, ContextParallel(group, method, **options))
    # Why DDP's average is the whole gradient: every rank computes the same loss from the same
    # all-reduced sum (SumOverRanks), so each rank's weight gradients are its own tokens' share
    # of the whole. SumOverRanks' backward multiplies by W, which turns DDP's average of the W
    # shares into their sum: the whole gradient, on every rank.
    return DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=data_group,  # None: DDP's default, the world
        gradient_as_bucket_view=True,
    )  # grads live in DDP's buckets: no second copy


def full_state_dict(model):
    """The plain state_dict of the model: every rank holds it whole, the group's rank 0 among
    them, so it gathers nothing and takes no group."""
    return {k: v.detach().cpu() for k, v in model.module.state_dict().items()}


def token_positions(tokens, rank, world):
    """The positions, in a sequence of `tokens`, of the T/W tokens `rank` holds: its contiguous
    run."""
    if tokens % world:
        raise ValueError(f"{tokens} tokens do not split into {world} equal chunks")
    size = tokens // world
    return torch.arange(rank * size, (rank + 1) * size)


@functools.lru_cache
def positions_on(device, tokens, rank, world):
    """token_positions on `device`, made once per sequence length and rank: a CPU index moved to
    a GPU at every call would wait for the copy (a host sync)."""
    return token_positions(tokens, rank, world).to(device)


class SumOverRanks(torch.autograd.Function):
    """Forward: the all-reduced sum, the same on every rank. Backward: W·grad, with no
    communication. Every rank computes the same loss from the same sum, so each already holds
    grad, and sends it back through its own tokens only: each rank's weight gradients are its
    tokens' share of the whole. DDP averages the ranks' gradients (÷W); the factor W turns that
    average of the W shares into their sum, the whole gradient. (A weight after the sum, the
    classifier's, gets the same whole gradient on every rank: its average is itself.)"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.world = dist.get_world_size(group)
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.world, None


def split_sequence(embedding, pooled, group=None):
    """The ViT on this rank's tokens, before parallelize: `embedding`'s output, the [B, T, D]
    sequence, is cut to this rank's T/W tokens (token_positions), and `pooled`'s input, the mean
    over this rank's tokens, becomes the mean over all T, summed over the ranks (SumOverRanks).
    group: the context group (None: the world)."""
    group = group or dist.group.WORLD
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)

    def keep_this_ranks_tokens(module, inputs, output):
        # A forward hook that returns a tensor replaces the module's output with it.
        return output[:, positions_on(output.device, output.shape[1], rank, world)]

    def mean_over_all_tokens(module, inputs):
        # A forward pre-hook gets the module's inputs as a tuple and returns what it takes
        # instead. The mean over T tokens is the sum over ranks of each rank's mean over T/W, / W.
        return SumOverRanks.apply(inputs[0] / world, group)

    embedding.register_forward_hook(keep_this_ranks_tokens)
    pooled.register_forward_pre_hook(mean_over_all_tokens)


### more: a language model's SDPA call: causal, grouped-query, Ulysses; what the swap refuses
# A subclass under the core's name, so that parallelize and a user's `with ContextParallel(...)`
# get it. What the ring and Ulysses cannot run raises alike on every rank: a mask, dropout, and a
# forward that called no SDPA at all.


class ContextParallel(ContextParallel):
    """The core's ContextParallel, for a language model's attention too: ring attention or
    Ulysses (`method`), causal when the call says is_causal=True on tokens split contiguously or
    zig-zag (`zigzag`: as split_batch cut them), grouped-query with enable_gqa."""

    def __init__(self, group, method="ring", zigzag=False):
        super().__init__(group)
        self.method = method
        self.zigzag = zigzag
        self.calls = 0  # the SDPA calls it ran since it was last turned on

    def __enter__(self):
        self.calls = 0
        return super().__enter__()

    def __exit__(self, exc_type, exc_value, traceback):
        super().__exit__(exc_type, exc_value, traceback)
        if exc_type is None:
            refuse_forward_without_sdpa(self.calls)

    def attend(
        self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ):
        """SDPA's own arguments, as the model passed them."""
        self.calls += 1
        refuse_mask_and_dropout(attn_mask, dropout_p)
        if enable_gqa:  # grouped-query attention: each K/V head serves H / H_kv query heads
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        if self.method == "ulysses":
            return ulysses_attention(q, k, v, self.group, is_causal, self.zigzag, scale)
        if is_causal:
            blocks = CausalBlocks(dist.get_rank(self.group), self.zigzag)
            return RingAttention.apply(q, k, v, self.group, scale, blocks)
        return super().attend(q, k, v, scale)


def refuse_mask_and_dropout(attn_mask, dropout_p):
    """A mask of the model's making covers this rank's tokens only, and dropout's random pattern
    would differ from one process's: the ring and Ulysses take is_causal alone."""
    if attn_mask is not None or dropout_p:
        raise ValueError(
            "scaled_dot_product_attention with an attn_mask or dropout_p: context parallelism "
            "attends over the ranks with is_causal only (HF: attn_implementation='sdpa')"
        )


def refuse_forward_without_sdpa(calls):
    """A forward that called no SDPA attended, if at all, to this rank's tokens alone."""
    if calls == 0:
        raise ValueError(
            "the model's forward called no F.scaled_dot_product_attention: context parallelism "
            "runs that call over the ranks (HF: attn_implementation='sdpa'; an attention written "
            "out in matmuls would see this rank's tokens only)"
        )


### more: Ulysses, the other method: all-to-all from the token split to a head split and back


def all_to_all(x, group, scatter_dim, gather_dim):
    """Cut x into W chunks along `scatter_dim` and send chunk j to rank j; join the W chunks
    received (chunk j from rank j) along `gather_dim`."""
    world = dist.get_world_size(group)
    sent = torch.stack(x.chunk(world, scatter_dim))
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    return torch.cat(received.unbind(0), gather_dim)


class AllToAll(torch.autograd.Function):
    """Ulysses' all-to-all: a token split becomes a head split, or back. Its gradient goes the
    opposite way: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group = group
        ctx.scatter_dim = scatter_dim
        ctx.gather_dim = gather_dim
        return all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


# Ulysses' tensors are laid out as SDPA takes them, [B, heads, tokens, d]: dimension 1 is the
# heads, 2 the tokens.


def tokens_to_heads(x, group):
    """[B, H, T/W, d], every head of this rank's tokens -> [B, H/W, T, d], all tokens of this
    rank's heads."""
    return AllToAll.apply(x, group, 1, 2)


def heads_to_tokens(x, group):
    """[B, H/W, T, d] -> [B, H, T/W, d]: back to this rank's tokens, every head."""
    return AllToAll.apply(x, group, 2, 1)


def ulysses_attention(q, k, v, group, causal=False, zigzag=False, scale=None):
    """DeepSpeed-Ulysses (Jacobs et al. 2023, https://arxiv.org/abs/2309.14509): [B, H, T/W, d]
    in and out, as SDPA; SDPA sees all T tokens of H/W heads. The all-to-all gathers the tokens
    rank by rank: in sequence order, unless they were split zig-zag."""
    heads = q.shape[1]
    world = dist.get_world_size(group)
    if heads % world:  # the same shapes on every rank: every rank raises alike
        raise ValueError(f"Ulysses: {heads} heads do not split over {world} ranks")
    q, k, v = (tokens_to_heads(x, group) for x in (q, k, v))
    if causal and zigzag:
        out = zigzag_causal_sdpa(q, k, v, world, scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return heads_to_tokens(out, group)


### more: causal masking (a decoder language model) and the zig-zag split that balances it
# A query sees only the keys at or before it. Split contiguously, rank 0's queries see one block
# and rank W-1's all W, so the ring runs at the last rank's pace. Zig-zag gives every rank an
# early chunk and a late one, and every rank the same work.


def zigzag_positions(tokens, rank, world):
    """T cut into 2W chunks: rank r holds chunk r (its early chunk) and chunk 2W-1-r (its late
    chunk), in that order. W = 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2."""
    chunks = 2 * world
    if tokens % chunks:
        raise ValueError(f"{tokens} tokens do not split into {chunks} equal chunks")
    size = tokens // chunks
    late_chunk = chunks - 1 - rank
    early = torch.arange(rank * size, (rank + 1) * size)
    late = torch.arange(late_chunk * size, (late_chunk + 1) * size)
    return torch.cat([early, late])


@functools.lru_cache
def zigzag_positions_on(device, tokens, rank, world):
    """zigzag_positions on `device`, made once per sequence length and rank, as positions_on's."""
    return zigzag_positions(tokens, rank, world).to(device)


def causal_part(rank, owner, local_tokens, zigzag, device):
    """What this rank's queries see of the K/V block of rank `owner`: (query rows, key columns, a
    mask of the scores to hide or None), or None when it lies wholly in their future. A rank's
    tokens are in sequence order, so its own block takes the causal mask within."""
    everything = slice(None)
    if owner == rank:
        return everything, everything, future_mask(device, local_tokens, local_tokens)
    if not zigzag:
        # Split contiguously, an earlier rank's tokens all precede this rank's, and a later
        # rank's all follow them.
        if owner < rank:
            return everything, everything, None
        return None
    # Split zig-zag, each rank holds its early chunk, then its late chunk (zigzag_positions).
    early = slice(0, local_tokens // 2)
    late = slice(local_tokens // 2, None)
    if owner < rank:
        # The owner's early chunk precedes both of this rank's chunks, and its late chunk
        # follows both: all of this rank's queries see the owner's early keys.
        return everything, early, None
    # Both of the owner's chunks follow this rank's early chunk and precede its late one: only
    # this rank's late queries see them, all of them.
    return late, everything, None


@functools.lru_cache
def future_mask(device, queries, keys):
    """True above the diagonal of a rank's own [T/W, T/W] score block: a key after the query.
    Made once per size and device, as positions_on's positions are."""
    return torch.ones(queries, keys, dtype=torch.bool, device=device).triu_(1)


class CausalBlocks(WholeBlocks):
    """What this rank's queries see of each K/V block under a causal mask (causal_part): a part of
    the block, or none of it. A block wholly in this rank's future gets a zero dK/dV share in
    backward, yet its sum still travels: every rank passes the same messages at every step."""

    def __init__(self, rank, zigzag):
        self.rank = rank
        self.zigzag = zigzag

    def merge(self, q_scaled, kv_block, out, row_max, row_sum, owner):
        """merge_block on the part of the block that this rank's queries see."""
        part = causal_part(self.rank, owner, q_scaled.shape[-2], self.zigzag, q_scaled.device)
        if part is None:
            return
        rows, cols, mask = part
        merge_block(
            q_scaled[..., rows, :],
            kv_block[..., cols, :],
            out[..., rows, :],
            row_max[..., rows, :],
            row_sum[..., rows, :],
            mask,
        )

    def backward(self, q_scaled, kv_block, grad_out, log_sum_exp, grad_dot_out, owner):
        """block_backward on the part of the block that this rank's queries see, the shares zero
        elsewhere."""
        grad_q_share = torch.zeros_like(q_scaled)
        grad_kv_share = torch.zeros_like(kv_block, dtype=torch.float32)
        part = causal_part(self.rank, owner, q_scaled.shape[-2], self.zigzag, q_scaled.device)
        if part is not None:
            rows, cols, mask = part
            grad_q_part, grad_kv_part = block_backward(
                q_scaled[..., rows, :],
                kv_block[..., cols, :],
                grad_out[..., rows, :],
                log_sum_exp[..., rows, :],
                grad_dot_out[..., rows, :],
                mask,
            )
            grad_q_share[..., rows, :] = grad_q_part
            grad_kv_share[..., cols, :] = grad_kv_part
        return grad_q_share, grad_kv_share


def zigzag_causal_sdpa(q, k, v, world, scale=None):
    """Causal SDPA on [B, H/W, T, d] tokens that the all-to-all gathered rank by rank from the
    zig-zag split: is_causal needs them in sequence order, so they are put in it and back after."""
    gathered, in_sequence = gathered_order(q.device, q.shape[-2], world)
    q, k, v = (x[..., in_sequence, :] for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out[..., gathered, :]


@functools.lru_cache
def gathered_order(device, tokens, world):
    """(gathered, in_sequence) on `device`, made once per sequence length as positions_on's
    positions are. The all-to-all gathers the zig-zag split rank by rank: `gathered` holds each
    gathered token's position in the sequence, so x_in_sequence[gathered] is in the gathered
    order; `in_sequence` sorts them by position, so x_gathered[in_sequence] is in sequence order."""
    gathered = torch.cat([zigzag_positions(tokens, r, world) for r in range(world)])
    in_sequence = gathered.argsort()
    return gathered.to(device), in_sequence.to(device)


### more: a language model's (x, y) batches, its loss over every rank's tokens, errors alike
# A decoder language model (an output per token) splits each (x, y) batch with
# `x, y, positions = split_batch(x, y, group, zigzag)` and runs its own forward on this rank's x
# at these positions, never 0..T/W (torchtitan's Llama: `model(x, positions)`; HF:
# `model(x, position_ids=positions)`; nanoGPT, whose forward embeds arange(0, t), has its forward
# written out: tests/copy_context_parallel.py's RankGPT), then takes the loss over the whole
# sequence: `causal_lm_loss(logits, y, group, ignore_index, num_items)`. Tokens that are their
# own targets make their y with `next_token_targets(tokens, ignore_index)` first. A rank that
# raises alone would leave the others waiting in the ring until the backend gives up ("Connection
# closed by peer"), so every check here is made alike on every rank, from an all-reduce.


def split_tokens(batch, group=None, zigzag=False):
    """[B, T] -> (this rank's [B, T/W] tokens, their positions [T/W] in the sequence)."""
    group = group or dist.group.WORLD
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    if zigzag:
        positions = zigzag_positions_on(batch.device, batch.shape[1], rank, world)
    else:
        positions = positions_on(batch.device, batch.shape[1], rank, world)
    return batch[:, positions], positions


def next_token_targets(tokens, ignore_index=-100):
    """The y of a batch of tokens that are their own targets, [B, T]: y[:, t] = tokens[:, t + 1],
    shifted on the whole sequence before any split (a rank's last token's successor may live on
    another rank); the last position has none."""
    targets = torch.full_like(tokens, ignore_index)
    targets[:, :-1] = tokens[:, 1:]
    return targets


def check_same_shapes(x, y, group):
    """Raise the same ValueError on every rank unless every rank holds [B, T] inputs and targets
    of one shape, from one all-reduce of the shapes before the ring."""
    sizes = [x.dim(), y.dim(), x.shape[0], x.shape[-1], y.shape[0], y.shape[-1]]
    local = torch.tensor(sizes, device=x.device)
    # One MAX all-reduce gives both bounds: the largest of -size is minus the smallest size.
    bounds = torch.cat([local, -local])
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
    bounds = bounds.tolist()  # the one host sync: the error must be known here
    largest = bounds[:6]
    smallest = [-bound for bound in bounds[6:]]
    if largest != smallest:
        raise ValueError(
            f"the ranks feed batches of different shapes: (x.dim, y.dim, x [B, T], y [B, T]) "
            f"from {smallest} to {largest}; every rank must feed the same [B, T] x and y"
        )
    if sizes[:2] != [2, 2] or sizes[2:4] != sizes[4:]:
        raise ValueError(f"x {list(x.shape)} and y {list(y.shape)}: both must be [B, T]")


def split_batch(x, y, group=None, zigzag=False):
    """(x, y), [B, T] each, y[:, t] the target of x[:, t] (nanoGPT's y: x shifted by one) ->
    this rank's x and y, [B, T/W] each, split alike, and their positions [T/W] in the sequence:
    embed x at these positions."""
    group = group or dist.group.WORLD
    check_same_shapes(x, y, group)
    x, positions = split_tokens(x, group, zigzag)
    return x, y[:, positions], positions


def causal_lm_loss(logits, targets, group=None, ignore_index=-100, num_items=None):
    """The cross-entropy averaged over every rank's valid targets (split_batch's y), the same
    value on every rank: one process's mean over the whole sequence, however unevenly the
    ignored targets fall on the ranks. num_items: divide the sum by this count instead (HF's
    num_items_in_batch, torchtitan's global token count: the valid targets of all of a step's
    micro-batches, so that padded micro-batches weigh as in one process). One all-reduce of
    [sum, count, bad targets per rank], in fp32 whatever the logits' dtype: in bf16 a count of
    4,095 would round to 4,096 and a sum of thousands of losses lose its last units."""
    group = group or dist.group.WORLD
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    vocab = logits.shape[-1]
    valid = targets != ignore_index
    out_of_range = valid & ((targets < 0) | (targets >= vocab))
    # A target out of range (-100 to a model that ignores -1) would raise in cross_entropy on its
    # rank alone: each rank counts its bad targets in the all-reduce instead, and every rank
    # raises the same error.
    bad = torch.zeros(world, device=logits.device)
    bad[rank] = out_of_range.sum()
    safe_targets = targets.masked_fill(out_of_range, ignore_index)
    loss_sum = F.cross_entropy(
        logits.flatten(0, -2).float(),
        safe_targets.flatten(),
        ignore_index=ignore_index,
        reduction="sum",
    )
    count = (valid & ~out_of_range).sum().float()
    total = SumOverRanks.apply(torch.cat([torch.stack([loss_sum, count]), bad]), group)
    bad_per_rank = total[2:].tolist()  # the one host sync: the error must be known here
    bad_ranks = [r for r, bad_count in enumerate(bad_per_rank) if bad_count]
    if bad_ranks:
        raise ValueError(
            f"targets outside [0, {vocab}) that are not ignore_index={ignore_index}, on rank(s) "
            f"{bad_ranks} of the group: pass the ignore_index your targets use"
        )
    count = total[1] if num_items is None else num_items
    return total[0] / count


### more: DDP's group beside data parallelism: it must hold every context rank


def check_data_group(group, data_group):
    """Raise unless DDP's group (data_group, None meaning the world) holds the context group.
    DDP's average over data_group is the whole gradient only when it adds every context rank's
    part: over the data-parallel group alone (one rank of each context group) it would not."""
    context_ranks = set(dist.get_process_group_ranks(group))
    data_ranks = set(dist.get_process_group_ranks(data_group or dist.group.WORLD))
    if not context_ranks <= data_ranks:
        raise ValueError(
            f"data_group {sorted(data_ranks)} does not hold the context group "
            f"{sorted(context_ranks)}: DDP's group is every rank holding a copy of the model"
        )


def checking_data_group(parallelize):
    """parallelize, first refusing a data_group that does not hold the context group."""

    @functools.wraps(parallelize)
    def checked(model, device, method="ring", group=None, data_group=None, **options):
        check_data_group(group or dist.group.WORLD, data_group)
        return parallelize(model, device, method, group, data_group, **options)

    return checked


parallelize = checking_data_group(parallelize)


### more: attention on a process group of its own, apart from DDP's (for NCCL)


def own_group(group):
    """A new process group over group's ranks, for attention's sends and receives (or Ulysses'
    all-to-alls) alone. One NCCL communicator runs its operations in turn: on DDP's, the ring's
    backward transfers would wait behind DDP's bucket all-reduces. new_group must be called by
    every rank of the world for every group, in the same order: a subgroup's ranks are learnt
    from every rank (all_gather_object) and each rank makes them all, keeping its own."""
    mine = dist.get_process_group_ranks(group)
    every = [mine]
    if len(mine) < dist.get_world_size():  # the other ranks' groups, which this rank makes too
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    made = None
    for ranks in sorted({tuple(ranks) for ranks in every}):
        new = dist.new_group(list(ranks))
        if list(ranks) == mine:
            made = new
    return made


def on_own_group(parallelize):
    """parallelize with attention on a process group of its own over the context group's ranks.
    Every rank of the world calls parallelize, in the same order as its other new groups."""

    @functools.wraps(parallelize)
    def on_its_group(model, device, method="ring", group=None, data_group=None, **options):
        attention_group = own_group(group or dist.group.WORLD)
        return parallelize(model, device, method, attention_group, data_group, **options)

    return on_its_group


parallelize = on_own_group(parallelize)


### more: a bf16 model or autocast: the ring's blocks in fp32 eager ops, autocast off
# The merge needs each block's log-sum-exp next to its output. F.scaled_dot_product_attention
# would not materialise the block's scores, but its public API returns only the normalised output:
# its fused kernels compute the log-sum-exp, yet only private aten ops return it (and
# flex_attention's return_lse is fused only under torch.compile). So each block is attended in
# eager ops: each step holds the [B, H, T/W, T/W] scores of every sample and head at once. They,
# the running O, m and l and the gradients are kept in fp32 whatever q's dtype (a bf16 model, or
# autocast, whose bf16 matmuls are turned off here): a sum rounded to bf16 at each of W steps
# loses what fp32 keeps. The K/V blocks travel in their own dtype, the partial dK/dV sums in fp32.
# Ulysses, which needs no merge, calls SDPA.


def without_autocast(block_function):
    """block_function (merge_block, block_backward) with autocast off: its matmuls in fp32, as
    the running sums they add to."""

    @functools.wraps(block_function)
    def in_fp32(q_scaled, *args, **kwargs):
        with torch.autocast(q_scaled.device.type, enabled=False):
            return block_function(q_scaled, *args, **kwargs)

    return in_fp32


merge_block = without_autocast(merge_block)
block_backward = without_autocast(block_backward)


### end: Context parallel


def formula(psi, world, args):
    """The paper's per-rank bytes, which the report sets next to what the Meter measured."""
    k = 8 if args.optim == "adamw" else 4  # the ZeRO paper's K: optimizer bytes per parameter
    depth = args.depth
    B = args.batch_size
    D = args.dim
    T = (common.IMAGE // args.patch) ** 2
    local_bytes = 4 * B * T * D // world  # one [B, T/W, D] fp32 tensor
    if args.method == "ring":
        saved = 5  # [B, T/W, D] tensors attention keeps per block: input, q, k, v, out
        # Per block, [2, B, T/W, D] blocks: W-1 K/V forward, W-1 K/V and W-1 dK/dV backward.
        kv_bytes = depth * 3 * (world - 1) * 2 * local_bytes
        comm = dict(send=kv_bytes, recv=kv_bytes)
    else:
        saved = 6  # the same five and the output brought back to this rank's tokens
        # Per block, q, k, v and the output forward, their gradients backward.
        comm = dict(all_to_all=depth * 8 * local_bytes)
    return dict(
        param_bytes=4 * psi,
        grad_bytes=4 * psi,
        optim_bytes=k * psi,
        comm={**comm, "all_reduce": 4 * (B * D + psi)},
        act_bytes_attention=depth * (4 * saved * B * T * D + 4 * B * args.heads * T) // world,
        notes=dict(
            param_bytes="4Ψ replicated",
            grad_bytes="4Ψ replicated",
            optim_bytes=f"{k}Ψ",
            recv="as sent",
            act_bytes_attention=f"depth·({4 * saved}·B·T·D + 4·B·H·T)/W",
            all_to_all="8·depth·B·T·D/W",
            send="3(W-1)·depth K/V blocks",
            all_reduce="B·D pooled + Ψ gradients",
        ),
    )


def check_args(args, world):
    common.check(
        not args.experts,
        "--experts: the load-balancing loss of an MoE block needs all of an image's tokens",
    )
    tokens = (common.IMAGE // args.patch) ** 2
    common.check(
        tokens % world == 0,
        f"--patch {args.patch} gives {tokens} tokens: not divisible by {world} ranks",
    )
    common.check(
        args.method == "ring" or args.heads % world == 0,
        f"--method ulysses: --heads {args.heads} is not "
        f"divisible by {world} ranks (each attends with whole heads)",
    )


def setup(args):
    """Join the process group. torchrun (or common.launch) put RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT in the environment; LOCAL_RANK picks this process's GPU."""
    backend, device = common.pick_backend(args.backend)  # NCCL and a GPU per rank, else Gloo
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank, world = common.init_process_group(backend, device, args.timeout)
    return rank, world, device, backend


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def train(model, optimizer, scheduler, loader, sampler, args, device, step=0):
    """The loop every script shares: forward, loss, backward, step, schedule, log."""
    stop = args.max_steps or float("inf")
    world = dist.get_world_size()
    loss_sum = torch.zeros((), device=device)  # stays on the device until a logging step
    losses_summed = 0
    last_loss = float("nan")
    for epoch in range(step // len(loader), args.epochs):
        if step >= stop:
            break
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        loader.dataset.set_epoch(epoch)  # and new augmentations (--shift), the same everywhere
        model.train()
        bar = common.progress(loader, args, epoch)
        for i, (x, y) in enumerate(bar):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if args.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            loss_sum += loss.detach()
            losses_summed += 1
            if step % args.log_every == 0 or step >= stop or i + 1 == len(loader):
                dist.all_reduce(loss_sum)  # every rank's loss is the whole batch's: W equal values
                last_loss = loss_sum.item() / world / losses_summed
                loss_sum.zero_()
                losses_summed = 0
                common.log_loss(bar, args, epoch, step, last_loss)
            if step >= stop:
                break
        common.log(f"epoch {epoch}: step {step}, train loss {last_loss:.4f}")
    return dict(steps=step, loss=last_loss)


@torch.no_grad()
def evaluate(model, loader, device):
    """Exact: the loader pads every rank to the same number of batches (padding masked out), so
    every rank runs the same forward passes and collectives and each sample counts once."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=device)
    for x, y, keep in loader:
        x, y, keep = x.to(device), y.to(device), keep.to(device)
        counts += torch.stack([((model(x).argmax(1) == y) & keep).sum(), keep.sum()])
    dist.all_reduce(counts)
    return counts[0].item() / max(counts[1].item(), 1)


def run(args):
    """One rank, in the seeds' order: join the group, deal the data, build the model, wrap it,
    train, evaluate, save on rank 0, leave the group."""
    rank, world, device, backend = setup(args)
    try:
        train_set, test_set, source = common.load_data(args, device)
        dp_rank, dp_world = 0, 1  # CP: every rank sees the whole batch (its T/W tokens)
        sampler = DistributedSampler(
            train_set,
            num_replicas=dp_world,
            rank=dp_rank,
            shuffle=True,
            seed=args.seed,
            drop_last=True,
        )
        loader = DataLoader(
            train_set,
            batch_size=args.batch_size // dp_world,
            sampler=sampler,
            drop_last=True,
            pin_memory=device.type == "cuda",
            num_workers=args.workers,
            persistent_workers=args.workers > 0,  # started once, not every epoch
        )
        common.check(
            len(loader) > 0,
            f"{len(train_set)} training samples make no full batch of {args.batch_size}",
        )
        model = common.build_model(args)  # the same seeded weights on every rank
        if args.load:
            model.load_state_dict(common.load_state_dict_file(args.load, model.state_dict()))
        psi = sum(p.numel() for p in model.parameters())
        split_sequence(model.embed, model.head.fc)  # the ViT's T/W tokens on each rank
        model = parallelize(model.to(device), device, args.method)
        optimizer = common.make_optimizer(model.parameters(), args)
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        common.log(
            f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data "
            f"({len(train_set)} train / {len(test_set)} test), "
            f"batch {args.batch_size} = {dp_world} x {args.batch_size // dp_world}"
        )
        attention = [block.attn for block in model.module.blocks]
        with common.Meter(
            model, optimizer, args, device=device, parts=dict(attention=attention)
        ) as meter:
            out = train(model, optimizer, scheduler, loader, sampler, args, device)
        test_loader = common.test_loader(
            test_set, dp_rank, dp_world, pin_memory=device.type == "cuda"
        )
        acc = evaluate(model, test_loader, device)
        state = full_state_dict(model)  # every rank takes part; rank 0 holds the whole
        if rank == 0 and args.save:
            common.save_checkpoint(state, args.save)
            common.log(f"saved {args.save}")
        common.report(
            SCRIPT,
            args,
            world=world,
            backend=backend,
            device=device,
            data=source,
            params=psi,
            trained=out,
            test_acc=acc,
            meter=meter,
            formula=formula(psi, world, args),
        )
        # Free DDP before leaving the group: its reducer holds the group and, freed after it,
        # waits for Gloo's threads while holding the GIL that one of them needs (pytorch#56297).
        del model, meter
        gc.collect()
    finally:
        cleanup()


def main():
    parser = common.get_parser(
        "Context parallelism (ring attention, DeepSpeed-Ulysses) on the common ViT, written out"
    )
    parser.add_argument(
        "--method",
        choices=["ring", "ulysses"],
        default="ring",
        help="ring: K/V blocks around a ring; ulysses: all-to-all tokens <-> heads",
    )
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
