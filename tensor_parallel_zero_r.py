"""tensor_parallel.py plus ZeRO-R's activation work: --checkpoint keeps only each block's input x
for backward and reruns the block there; --partition-activations (ZeRO-R's Pa, checkpointing too)
keeps only this rank's T/W tokens of x and all-gathers them just before the rerun. The blocks are
split as in tensor_parallel.py (f: backward all-reduce, g: forward all-reduce), W = 2:

                   .- rank 0: Y0 = attn(X·Aq0, X·Ak0, X·Av0) - Y0·P0 -.
    x - norm1 - f -+                                                  +- g - + b + x
                   '- rank 1: Y1 = attn(X·Aq1, X·Ak1, X·Av1) - Y1·P1 -'
    x - norm2 - f -+- rank 0: gelu(X·A0)·B0 -+- g - + b + x        b: the row-parallel bias,
                   '- rank 1: gelu(X·A1)·B1 -'                     whole on every rank

Memory per rank (fp32, AdamW; Ψs = depth·(12D² + 6D) split, Ψr replicated): 16(Ψr + Ψs/W)
bytes. Communication per step, in [B, T, D] fp32 activations: 4·depth all-reduces.
--sequence-parallel keeps T/W tokens a rank outside the split layers (f an all-gather, g a
reduce-scatter): 4·depth reduce-scatters, 4·depth + 2 all-gathers, one all-reduce of the
6·D·depth norm and bias grads. Activations kept: E + L·B·T·D·4 bytes with --checkpoint, E +
L·B·T·D·4/W with Pa or SP (E: the embedding's, head's and loss's; L = depth); the rerun repeats
collectives, Pa adds one all-gather.
Paper: Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", https://arxiv.org/abs/1910.02054; tensor parallelism's papers: see tensor_parallel.py.
docs/techniques.md#zero-rs-activations-checkpointing-and-partitioned-activations

    torchrun --standalone --nproc_per_node=2 tensor_parallel_zero_r.py --checkpoint
    torchrun --standalone --nproc_per_node=2 tensor_parallel_zero_r.py --partition-activations
    python tensor_parallel_zero_r.py --nproc 2 --partition-activations   # through mp.spawn
"""

import contextlib
import functools
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler

import common

SCRIPT = os.path.splitext(os.path.basename(__file__))[0]


### begin: Tensor parallel
# Model contract: [B, T, D] activations through `model.blocks`, the same weights on every rank of
# the group, and each of them fed the same batch. `plan` names each nn.Linear of a block to split
# and how; the block's own forward then runs on the split layers, so its attention must take its
# head count off the width it is given (PLAN is the ViT's, whose attention reads it off q's
# width). The tensor-parallel group is the `group` argument, the world when None: every
# collective runs on it, W is its size and a rank's shard is cut by its rank in it.
# The core ends at the first `### more:` line and trains the ViT alone; each part after it plugs
# in from outside (classes a plan names, a parallelize of its own, a wrapper of operators or
# full_state_dict). Clip with the section's clip_grad_norm_(model, max_norm, group), not torch's.

# Shoeybi et al. 2019, section 3 and Figure 3 (https://arxiv.org/abs/1909.08053): the MLP's first
# weight A split by columns (output features), its second B by rows (input features), so that
# rank r computes Y_r = gelu(X·A_r) alone and only the sum Z = Σ_r Y_r·B_r needs a collective.
# The attention alike: q, k, v by columns (H/W whole heads a rank), its output projection by rows.
#
#              A = [A0 | A1]          B = [B0 ; B1]
#         ┌─ rank 0: Y0 = gelu(X·A0) ─ Y0·B0 ─┐
#   X ─ f ┤                                   ├ g ─ Z
#         └─ rank 1: Y1 = gelu(X·A1) ─ Y1·B1 ─┘
#
# f and g, a conjugate pair:  forward     backward
#                         f   identity    all-reduce
#                         g   all-reduce  identity
#
# f sits where a column-parallel layer's input enters it, g where a row-parallel layer's output
# leaves it, both inside the split layers: whatever the block passes its attention (positions,
# masks, keyword arguments), no path crosses f or g twice. The embedding, the norms and the head
# stay whole on every rank: each rank sees the whole batch and, past g, the whole activations,
# so their gradients are the same everywhere and the ranks' replicas stay equal.


def shard_of(tensor, dim, parts=1, group=None):
    """This rank's 1/W of `tensor` along `dim`, copied (a view would keep the whole alive), W and
    the rank counted in `group`. With parts > 1 (matrices side by side along `dim`), its 1/W of
    each of them, side by side."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    pieces = tensor.detach().chunk(parts, dim)
    return torch.cat([piece.chunk(world, dim)[rank] for piece in pieces], dim)  # a new tensor


def all_reduce(partial, group=None):
    """dist.all_reduce (the sum over the group's ranks) returning the sum, for the Functions below.
    In place, as Megatron does: `partial` is a fresh partial sum that nothing else reads."""
    partial = partial.contiguous()  # collectives need a dense tensor
    dist.all_reduce(partial, group=group)
    return partial


# The Functions take their group first, as torch.distributed.nn's do, so that
# functools.partial(Function.apply, group) is f or g on that group, a callable on a tensor.


class CopyToTensorParallel(torch.autograd.Function):
    """f, before the column-parallel q, k, v (or fc1). Forward: identity, every rank has the whole
    X. Backward: all-reduce over `group`, since rank r's X·A_r gives only its part of dX; the sum
    is dX."""

    @staticmethod
    def forward(ctx, group, x):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return None, all_reduce(grad, ctx.group)  # no gradient for the group


class ReduceFromTensorParallel(torch.autograd.Function):
    """g, after the row-parallel proj (or fc2). Forward: all-reduce over `group`, Z = Σ_r Y_r·B_r.
    Backward: identity, the gradient of a sum is the same for each of its terms."""

    @staticmethod
    def forward(ctx, group, partial):
        return all_reduce(partial, group)

    @staticmethod
    def backward(ctx, grad):
        return None, grad  # no gradient for the group


class ColumnParallelLinear(nn.Module):
    """Y_r = f(X)·A_r: this rank's 1/W of an nn.Linear's output features and of its bias, with f
    on its input; its output stays split. nn.Linear keeps its weight [out, in], so rank r keeps
    its rows, and the state_dict keeps the layer's shapes' order."""

    parts = 1  # matrices side by side in the output features: one
    out_dim = 0  # where the weight keeps the output features: nn.Linear's [out, in]

    def __init__(self, layer, f, g, group=None):
        super().__init__()
        self.shard_dims = {"weight": self.out_dim}  # where full_state_dict joins the shards
        self.weight = nn.Parameter(shard_of(layer.weight, self.out_dim, self.parts, group))
        self.bias = None  # None for the key projection
        if layer.bias is not None:
            self.shard_dims["bias"] = 0
            self.bias = nn.Parameter(shard_of(layer.bias, 0, self.parts, group))
        self.f = f

    def forward(self, x):
        return F.linear(self.f(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Z = g(Y_r·B_r) + b = Σ_r Y_r·B_r + b: this rank's 1/W of an nn.Linear's input features,
    applied to the column-parallel layer's split output Y_r, then g sums the W partial products.
    The bias is whole and added once, after g: added before it, the sum would count it W times.
    That is why g lives here rather than in the block."""

    parts = 1  # full_state_dict reads it off every parallel linear
    in_dim = 1  # where the weight keeps the input features: nn.Linear's [out, in]

    def __init__(self, layer, f, g, group=None):
        super().__init__()
        self.shard_dims = {"weight": self.in_dim}  # where full_state_dict joins; the bias is whole
        self.weight = nn.Parameter(shard_of(layer.weight, self.in_dim, group=group))
        bias = layer.bias  # None with bias=False
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.g = g

    def forward(self, y):
        z = self.g(F.linear(y, self.weight))
        return z if self.bias is None else z + self.bias


# The split of the common ViT's block: q, k, v and fc1 by output features, proj and fc2 by input.
PLAN = {
    "attn.q": ColumnParallelLinear,
    "attn.k": ColumnParallelLinear,
    "attn.v": ColumnParallelLinear,
    "attn.proj": RowParallelLinear,
    "mlp.fc1": ColumnParallelLinear,
    "mlp.fc2": RowParallelLinear,
}


def operators(group=None):
    """Megatron's f and g, each a callable on a tensor that runs its collectives on `group`."""
    f = functools.partial(CopyToTensorParallel.apply, group)
    g = functools.partial(ReduceFromTensorParallel.apply, group)
    return f, g


def split_block(block, plan, f, g, group=None):
    """Put each of the block's layers named in `plan` in place by its split (the same names, so
    the same state_dict keys), each keeping this rank's shard in `group`, with f and g inside."""
    for name, split in plan.items():
        owner_name, _, attribute = name.rpartition(".")
        owner = block.get_submodule(owner_name)
        setattr(owner, attribute, split(getattr(owner, attribute), f, g, group))


def parallelize(model, device, plan=PLAN, blocks=None, group=None):
    """Split every block's layers in place as `plan` says, over the ranks of `group` (None: the
    world); the embedding and the head stay replicated. `blocks`: model.blocks unless given.
    `device` is unused: the model is already on it (the argument keeps every script's call the
    same)."""
    f, g = operators(group)
    blocks = model.blocks if blocks is None else blocks
    for block in blocks:
        split_block(block, plan, f, g, group)
    return model


def join_shards(shards, dim, parts=1):
    """The whole tensor again from the W ranks' shard_of(tensor, dim, parts), in its own order:
    with parts=3, every rank's rows of the first matrix, then of the second, then of the third."""
    pieces = [shard.chunk(parts, dim) for shard in shards]  # pieces[rank][part]
    return torch.cat([by_rank[part] for part in range(parts) for by_rank in pieces], dim)


@contextlib.contextmanager
def swapped(values):
    """Each (module, name, value) of `values` set in place for the length of a `with`, the
    module's own attribute back after."""
    own = [(module, name, getattr(module, name)) for module, name, _ in values]
    try:
        for module, name, value in values:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in own:
            setattr(module, name, value)


def full_state_dict(model, group=None):
    """The unsplit model's state_dict() on the group's rank 0 (None elsewhere): each split tensor
    gathered there and joined as it was cut, then the model's own state_dict() taken with the
    whole tensors in place of the shards, so that its keys, shapes, buffers and hooks are the
    unsplit model's. Every rank walks the modules in the same order, so their gathers pair up."""
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    wholes = []  # (module, name, the whole tensor), on rank 0
    for module in model.modules():
        for name, dim in getattr(module, "shard_dims", {}).items():  # the parallel layers'
            shard = getattr(module, name).detach().contiguous()
            shards = None  # dist.gather fills a list on the destination only
            if rank == 0:
                shards = [torch.empty_like(shard) for _ in range(world)]
            dist.gather(shard, shards, group=group, group_dst=0)
            if rank == 0:
                whole = join_shards(shards, dim, module.parts)
                wholes.append((module, name, nn.Parameter(whole, requires_grad=False)))
    if rank != 0:
        return None
    with swapped(wholes):
        return {key: value.detach().cpu() for key, value in model.state_dict().items()}


### more: ZeRO-R's activation checkpointing and partitioned activations (Pa)
# Rajbhandari et al. 2019, section 6.1 (https://arxiv.org/abs/1910.02054): tensor parallelism
# leaves every rank the same whole activations outside the split layers; checkpointing keeps
# only each block's input, and Pa keeps only this rank's T/W tokens of it.


def checkpoint_blocks(blocks, sequence_parallel=False, partition=False, group=None):
    """ZeRO-R's activation work on each of the split `blocks` (--checkpoint, or Pa with
    `partition`), a CheckpointedForward in place of its forward; Pa's all-gathers on `group`."""
    for block in blocks:
        block.forward = CheckpointedForward(block.forward, sequence_parallel, partition, group)


class CheckpointedForward:
    """ZeRO-R's activation work on a block, put in place of its forward (so the block keeps its
    names, and the state_dict its keys). --checkpoint: autograd keeps only the block's input x;
    backward reruns the forward (up to its last saved tensor) for the rest.
    --partition-activations (Pa): x is the same on every rank, so each keeps only its T/W tokens of
    it, all-gathered over the tensor-parallel `group` just before the recompute. Under
    --sequence-parallel x already is this rank's T/W tokens: Pa changes nothing."""

    def __init__(self, forward, sequence_parallel, partition, group=None):
        self.forward = forward  # the block's own, its layers already split
        self.partition = partition and not sequence_parallel
        self.group = group
        self.whole_input = None  # Pa: x, left by __call__() for forward_from_shard()'s first run

    def __call__(self, x):
        if not self.partition:
            return checkpoint(self.forward, x, use_reentrant=False)
        # checkpoint() keeps the tensors it is passed until backward: pass it only this rank's
        # tokens, and leave the whole x beside it for the forward's own run.
        self.whole_input = x
        shard = shard_of(x, dim=1, group=self.group)
        return checkpoint(self.forward_from_shard, shard, use_reentrant=False)

    def forward_from_shard(self, shard):
        """The block's forward, run by checkpoint() twice: now, on the whole x __call__() left, and
        in backward, that x gone, on the tokens all-gathered from the shard."""
        x = self.whole_input
        self.whole_input = None  # from here on nothing keeps the whole x
        if x is None:  # the recompute in backward
            # The gradient reaches the block's input through the graph the forward built on the
            # whole x; this rerun only refills the tensors saved for backward. Requiring grad as x
            # did, it saves the same tensors the forward saved, which checkpoint() checks.
            x = all_gather_tokens(shard, self.group).requires_grad_()
        return self.forward(x)


### more: one f per input tensor
# Performance: q, k and v read the same normed x (Llama's w1 and w3 too), and the paper's picture
# has one f before all three. With an f in each layer, backward would all-reduce each layer's dX
# apart; entered once per input tensor, f all-reduces their sum once (the same sum, a third of
# the traffic). Plugged in by wrapping the core's operators().


class OncePerInput:
    """f for every column-parallel layer, entered once per input tensor: the layers that read the
    same x share one f(x), so backward all-reduces the sum of their dX once. It keeps the last
    tensor it entered until the next one comes."""

    def __init__(self, f):
        self.f = f
        self.input = None
        self.output = None

    def __call__(self, x):
        if x is not self.input:
            self.input = x
            self.output = self.f(x)
        return self.output


def with_f_once_per_input(operators):
    """`operators` whose f is entered once per input tensor (OncePerInput)."""

    @functools.wraps(operators)
    def f_once_per_input(group=None):
        f, g = operators(group)
        return OncePerInput(f), g

    return f_once_per_input


operators = with_f_once_per_input(operators)


### more: HuggingFace's Conv1D, its weight [in, out]
# GPT-2 in transformers keeps its layers as Conv1D (y = x·W + b, W [in, out]): the transpose of
# nn.Linear's layout. A plan names these classes for them: the same split, along the other
# dimension of the weight, which keeps its layout (and the state_dict its shapes).


class ColumnParallelConv1D(ColumnParallelLinear):
    """ColumnParallelLinear for a Conv1D: rank r keeps its columns of W [in, out]."""

    out_dim = 1

    def forward(self, x):
        return F.linear(self.f(x), self.weight.t(), self.bias)  # F.linear takes [out, in]


class RowParallelConv1D(RowParallelLinear):
    """RowParallelLinear for a Conv1D: rank r keeps its rows of W [in, out]."""

    in_dim = 0

    def forward(self, y):
        z = self.g(F.linear(y, self.weight.t()))  # F.linear takes [out, in]
        return z if self.bias is None else z + self.bias


### more: a language model: q, k and v fused in one layer, head counts, its own names
# GPT-2 and nanoGPT fuse q, k and v in one layer as thirds (c_attn: q, then k, then v):
# QKVParallelLinear keeps this rank's heads of each third. torchtitan's Llama fuses them by kv
# group ([q heads of group 0 | k_0 | v_0 | q heads of group 1 | ...], wqkv): a rank's 1/W of those
# rows are whole groups, a plain ColumnParallelLinear. An attention that counts its heads or width
# in attributes (HF's split_size, torchtitan's n_heads and n_kv_heads) runs on its local heads once
# the plan divides each by W with PerRank (torchtitan's way); on n_kv_heads it refuses a W that
# does not divide them. nanoGPT's attention takes its width off its input (C of x.size()), which
# no split changes: read it off q instead (`-1` in its views), as torchtitan's and HF's do. Plans
# for Llama and HF's GPT-2: docs/copy.md. Under other names give the modules themselves: `blocks`
# (nanoGPT: transformer.h, torchtitan: layers.values()), and for --sequence-parallel the module
# that takes the last block's output, `head` (nanoGPT: transformer.ln_f, torchtitan: norm).
# full_state_dict, wrapped at the end, takes the model's state_dict() with the whole counts.


class QKVParallelLinear(ColumnParallelLinear):
    """A ColumnParallelLinear for q, k and v fused in one layer as thirds (GPT-2's c_attn, 3D
    output features: q, then k, then v): rank r keeps the rows of its H/W heads in each of the
    three, not the r-th 1/W of the 3D rows, which would give rank 0 all of q and part of k. Its
    output is this rank's q, k and v side by side, [B, T, 3D/W]."""

    parts = 3


class QKVParallelConv1D(QKVParallelLinear, ColumnParallelConv1D):
    """QKVParallelLinear for a Conv1D (HF GPT-2's c_attn, W [D, 3D]): its columns, as thirds."""


class PerRank(int):
    """A plan's split of an attribute that counts heads or features (n_heads, split_size): this
    rank's 1/W of `count`, an int in the model's forward, which then runs on its local heads.
    `whole` keeps one process's count for full_state_dict, where the model's hooks may read it."""

    def __new__(cls, count, f, g, group=None):
        world = dist.get_world_size(group)
        if count % world:
            raise ValueError(
                f"a count of {count} heads or features does not split over {world} "
                "tensor-parallel ranks: each rank holds whole heads (under grouped-query "
                "attention, whole kv heads: W must divide n_kv_heads)"
            )
        return per_rank_count(count // world, count)

    def __reduce__(self):
        """copy.deepcopy and pickle rebuild this count as it is, not split it again."""
        return per_rank_count, (int(self), self.whole)


def per_rank_count(local, whole):
    """A PerRank of `local` heads or features, one process holding `whole`."""
    count = int.__new__(PerRank, local)
    count.whole = whole
    return count


def whole_counts(model):
    """(module, name, one process's count) of every count a plan divided, for full_state_dict."""
    counts = []
    for module in model.modules():
        for name, value in vars(module).items():
            if isinstance(value, PerRank):
                counts.append((module, name, value.whole))
    return counts


def with_whole_counts(full_state_dict):
    """`full_state_dict` with one process's count in place of every PerRank while it runs: the
    model's state_dict hooks may read them (Llama's splits wqkv into wq, wk and wv by n_heads and
    n_kv_heads). Every rank swaps them; no forward runs meanwhile."""

    @functools.wraps(full_state_dict)
    def with_counts(model, group=None):
        with swapped(whole_counts(model)):
            return full_state_dict(model, group)

    return with_counts


full_state_dict = with_whole_counts(full_state_dict)


### more: sequence parallelism (Korthikanti et al. 2022)
# https://arxiv.org/abs/2205.05198, section 4.2.2: outside the split layers (norms, residuals)
# every rank would hold the same [B, T, D] activations; each keeps only its T/W tokens of them
# instead. The blocks' input and output are then token shards, so f must gather the tokens the
# split layers need and g must leave each rank its T/W tokens of the sum (Korthikanti et al. call
# the all-gather g and the reduce-scatter ḡ; this file keeps Megatron-LM's f and g for where they
# sit, so f here is the paper's g and g here its ḡ):
#                               forward          backward
#   f under --sequence-parallel all-gather       reduce-scatter
#   g under --sequence-parallel reduce-scatter   all-gather


def all_gather_tokens(shard, group=None):
    """Every rank's [B, T/W, D] tokens -> all [B, T, D] tokens, on every rank of `group`."""
    batch, shard_tokens, dim = shard.shape
    # all_gather_into_tensor concatenates along dim 0, so the tokens go first (Megatron keeps its
    # activations [T, B, D] throughout for this reason).
    gathered = shard.new_empty(shard_tokens * dist.get_world_size(group), batch, dim)
    dist.all_gather_into_tensor(gathered, shard.transpose(0, 1).contiguous(), group=group)
    return gathered.transpose(0, 1).contiguous()


def reduce_scatter_tokens(partial, group=None):
    """[B, T, D] partial sums on every rank of `group` -> this rank's [B, T/W, D] tokens of their
    sum."""
    batch, tokens, dim = partial.shape
    # reduce_scatter_tensor splits along dim 0, so the tokens go first, as in all_gather_tokens.
    shard = partial.new_empty(tokens // dist.get_world_size(group), batch, dim)
    dist.reduce_scatter_tensor(shard, partial.transpose(0, 1).contiguous(), group=group)
    return shard.transpose(0, 1).contiguous()


class GatherToTensorParallel(torch.autograd.Function):
    """f under --sequence-parallel. Forward: all-gather the tokens, the split layers need all T.
    Backward: reduce-scatter, the partial dX of all T summed, each rank keeping its T/W."""

    @staticmethod
    def forward(ctx, group, shard):
        ctx.group = group
        return all_gather_tokens(shard, group)

    @staticmethod
    def backward(ctx, grad):
        return None, reduce_scatter_tokens(grad, ctx.group)  # no gradient for the group


class ReduceScatterFromTensorParallel(torch.autograd.Function):
    """g under --sequence-parallel. Forward: reduce-scatter, the partial products summed, each
    rank keeping its T/W tokens. Backward: all-gather, each partial product needs the gradient of
    all T tokens."""

    @staticmethod
    def forward(ctx, group, partial):
        ctx.group = group
        return reduce_scatter_tokens(partial, group)

    @staticmethod
    def backward(ctx, grad):
        return None, all_gather_tokens(grad, ctx.group)  # no gradient for the group


def tokens_gathered(x):
    """f of the column-parallel layers under --sequence-parallel: nothing to do, since the module
    holding them gathered the tokens of its input already (gather_tokens_into)."""
    return x


def gather_tokens_into(blocks, group=None):
    """f under --sequence-parallel, on the input of each module that holds a column-parallel layer
    (the attention, the MLP), not at the layer: the model's own attention reads the token count
    off its input, which must then be all T tokens."""
    for block in blocks:
        for module in block.modules():
            children = list(module.children())
            if any(isinstance(child, ColumnParallelLinear) for child in children):
                hook_first_argument(module, GatherToTensorParallel, group)


class EnterSequenceParallel(torch.autograd.Function):
    """--sequence-parallel, after the replicated embedding. Forward: keep this rank's T/W tokens.
    Backward: all-gather the gradient, so every rank's embedding gets the same, whole one."""

    @staticmethod
    def forward(ctx, group, x):
        ctx.group = group
        return shard_of(x, dim=1, group=group)

    @staticmethod
    def backward(ctx, grad):
        return None, all_gather_tokens(grad, ctx.group)  # no gradient for the group


class LeaveSequenceParallel(torch.autograd.Function):
    """--sequence-parallel, before the replicated head. Forward: all-gather the tokens. Backward:
    keep this rank's T/W tokens of the gradient. Unlike f's, this gradient needs no sum: the head
    is replicated, so its dX is already whole and the same on every rank."""

    @staticmethod
    def forward(ctx, group, shard):
        ctx.group = group
        return all_gather_tokens(shard, group)

    @staticmethod
    def backward(ctx, grad):
        return None, shard_of(grad, dim=1, group=ctx.group)  # no gradient for the group


def on_first_argument(function, group, module, args, kwargs):
    """A forward pre-hook (function and group bound by functools.partial): function.apply on the
    module's first positional argument, the tokens; the other arguments passed on as they are."""
    if not args:
        raise TypeError(
            f"{type(module).__name__} was called without a positional argument: sequence "
            "parallelism splits or gathers the tokens of the first"
        )
    tokens, *rest = args
    return (function.apply(group, tokens), *rest), kwargs


def hook_first_argument(module, function, group=None):
    """function.apply(group, tokens) on the first positional argument of every call to `module`."""
    hook = functools.partial(on_first_argument, function, group)
    module.register_forward_pre_hook(hook, with_kwargs=True)


def split_tokens(first_block, head, group=None):
    """The way in and out of --sequence-parallel, once the blocks are split with its f and g: the
    blocks run on this rank's T/W tokens from the first block's input on, the embedding (and
    whatever the model's forward builds from its output: positions, masks) and the head on all T.
    `first_block` or `head` None: this rank holds none (a pipeline stage after the first, or
    before the last). The gradients of what the blocks hold whole are not summed here: see
    sum_partial_gradients."""
    if first_block is not None:
        hook_first_argument(first_block, EnterSequenceParallel, group)
    if head is not None:
        hook_first_argument(head, LeaveSequenceParallel, group)


def token_sharded_params(blocks):
    """Under --sequence-parallel, the parameters that see only this rank's T/W tokens: every block
    parameter left whole (the norms, the row-parallel biases added after g's reduce-scatter). The
    embedding and the head see all T tokens, a tied one too: their gradients are whole."""
    params = []
    for block in blocks:
        for module in block.modules():
            split = getattr(module, "shard_dims", {})  # only the parallel linears have them
            for name, param in module.named_parameters(recurse=False):
                if name not in split:
                    params.append(param)
    return params


def sequence_operators(group=None):
    """f and g under --sequence-parallel, on `group`: f nothing (the module holding the
    column-parallel layers gathered its tokens: gather_tokens_into), g a reduce-scatter."""
    g = functools.partial(ReduceScatterFromTensorParallel.apply, group)
    return tokens_gathered, g


def sequence_parallelize(model, device, plan=PLAN, blocks=None, head=None, group=None):
    """parallelize under sequence parallelism: every block's layers split as `plan` says with
    sequence_operators, the blocks on T/W tokens, the embedding and `head` (model.head unless
    given: the module that takes the last block's output) on all T, and the partial gradients of
    what the blocks hold whole summed over `group`."""
    f, g = sequence_operators(group)
    blocks = model.blocks if blocks is None else blocks
    for block in blocks:
        split_block(block, plan, f, g, group)
    gather_tokens_into(blocks, group)
    head = model.head if head is None else head
    split_tokens(next(iter(blocks)), head, group)
    sum_partial_gradients(token_sharded_params(blocks), group)
    return model


### more: the gradient sum of the parameters every rank holds whole, under sequence parallelism
# Each rank's norms and row-parallel biases see only its T/W tokens, so their gradients are
# partial sums that the ranks must add up before the optimizer steps. sequence_parallelize asks for
# it in a line of its own: a caller whose optimizer steps other tensors than these parameters
# (ZeRO's flat shards) sums their gradients its own way instead.


def sum_partial_gradients(params, group=None):
    """A PartialGradientSum over `params` and the ranks of `group`: its hooks on each of them."""
    partial_sum = PartialGradientSum(params, group)
    for param in params:
        param.register_hook(functools.partial(partial_sum.hold, param))
        param.register_post_accumulate_grad_hook(partial_sum.hook)


class PartialGradientSum:
    """A tensor hook on each parameter holds its partial gradient back from .grad (autograd adds
    zeros); after the last has arrived, one flat all-reduce sums them all over the ranks (as
    Megatron does: one collective rather than 6·depth small ones) and adds the sums to .grad. Held
    back rather than summed in .grad: with several backward passes a step (gradient accumulation)
    .grad also holds the earlier passes' sums, counted W times."""

    def __init__(self, params, group=None):
        self.params = params
        self.group = group
        self.partials = {}  # this backward's partial gradients, by parameter
        self.accumulated = 0  # gradients finished in this backward

    def hold(self, param, grad):
        """The tensor hook (param bound by functools.partial), before accumulation."""
        self.partials[param] = grad
        return torch.zeros_like(grad)

    def hook(self, _param):  # which parameter finished does not matter, only how many have
        self.accumulated += 1
        if self.accumulated < len(self.params):
            return
        self.accumulated = 0
        partials = [self.partials.pop(param) for param in self.params]
        flat = all_reduce(torch.cat([partial.flatten() for partial in partials]), self.group)
        summed = flat.split([param.numel() for param in self.params])
        for param, grad in zip(self.params, summed, strict=True):
            param.grad += grad.view_as(param)


### more: gradient clipping over the shards
# torch's clip_grad_norm_(model.parameters()) would clip each rank by the norm of its own shards:
# a different factor on every rank, the replicated weights drifting apart.


def clip_grad_norm_(model, max_norm, group=None):
    """torch.nn.utils.clip_grad_norm_ for a model parallelize split, called where the loop calls
    torch's: the global gradient norm, the split parameters' squares summed over the
    tensor-parallel `group` (None: every rank), the replicated ones' (embedding, norms, row
    biases, head; a tied weight once) counted once, since every rank holds the same whole
    gradient of them (under --sequence-parallel PartialGradientSum summed the norms' and row
    biases' partial ones in backward). Every rank gets the same norm and scales every gradient by
    the same factor, so the replicated weights stay equal. Returns the norm, as one process's
    clip_grad_norm_ would (0 when no parameter has a gradient)."""
    split = set()  # the ids of the parallel linears' shards: only those modules have shard_dims
    for module in model.modules():
        shard_dims = getattr(module, "shard_dims", {})
        for name, param in module.named_parameters(recurse=False):
            if name in shard_dims:
                split.add(id(param))
    params = [param for param in model.parameters() if param.grad is not None]  # a tied weight once
    squares = [torch.linalg.vector_norm(param.grad) ** 2 for param in params]
    device = next(model.parameters()).device  # every rank issues the all-reduce, grads or not
    split_squares = torch.zeros((), device=device)
    replicated_squares = torch.zeros((), device=device)
    for param, square in zip(params, squares, strict=True):
        if id(param) in split:
            split_squares += square
        else:
            replicated_squares += square
    dist.all_reduce(split_squares, group=group)  # one scalar, every rank issuing it
    total = (split_squares + replicated_squares).sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)  # torch's factor, on every rank
    return total


### end: Tensor parallel


def formula(psi, world, args):
    """The paper's per-rank bytes, which the report sets next to what the Meter measured."""
    k = 8 if args.optim == "adamw" else 4  # the ZeRO paper's K: optimizer bytes per parameter
    depth = args.depth
    dim = args.dim
    tokens = (common.IMAGE // args.patch) ** 2
    # Ψs: the q, k, v, proj, fc1 and fc2 weights and the q, v and fc1 biases
    split_params = depth * (12 * dim**2 + 6 * dim)
    per_rank_params = psi - split_params + split_params // world  # Ψr + Ψs/W
    activation_bytes = 4 * args.batch_size * tokens * dim  # one [B, T, D] fp32 activation
    # Per block and step, in attention and in the MLP: g's forward and f's backward all-reduce;
    # under SP, f and g each all-gather one way and reduce-scatter the other.
    if args.sequence_parallel:
        per_block = dict(all_gather=4, reduce_scatter=4)
    else:
        per_block = dict(all_reduce=4)
    recomputed = args.checkpoint or args.partition_activations
    if recomputed:  # backward reruns each block's forward up to fc2's input
        if args.sequence_parallel:
            per_block["all_gather"] += 2  # attention's f and the MLP's f
            per_block["reduce_scatter"] += 1  # attention's g
        else:
            per_block["all_reduce"] += 1  # attention's g (f is the identity forward)
    if args.partition_activations and not args.sequence_parallel:
        per_block["all_gather"] = 1  # each block's input, gathered just before its recompute
    comm = {kind: n * depth * activation_bytes for kind, n in per_block.items()}
    comm_notes = {kind: f"{n}·depth x B·T·D" for kind, n in per_block.items()}
    if args.sequence_parallel:
        # +2 all-gathers: the tokens for the head, the embedding's gradient in backward
        comm["all_gather"] += 2 * activation_bytes
        comm_notes["all_gather"] = f"({per_block['all_gather']}·depth + 2) x B·T·D"
        # fp32 gradients of 6D per block: norm1's and norm2's weight and bias, proj's, fc2's bias
        comm["all_reduce"] = 4 * 6 * dim * depth
        comm_notes["all_reduce"] = "6·D·depth norm and row-bias gradients"
    kept_bytes = None  # without checkpointing no promise: the report shows no formula
    kept_note = ""
    if recomputed:  # each block's input, whole or T/W tokens of it
        input_split = world if args.sequence_parallel or args.partition_activations else 1
        outside = common.saved_outside_blocks(args, args.batch_size)  # E
        kept_bytes = outside + depth * activation_bytes // input_split
        kept_note = "E + L·B·T·D·4" + ("/W" if input_split > 1 else "")
    return dict(
        param_bytes=4 * per_rank_params,
        grad_bytes=4 * per_rank_params,
        optim_bytes=k * per_rank_params,
        comm=comm,
        act_bytes=kept_bytes,
        notes=dict(
            param_bytes="4(Ψr + Ψs/W)",
            grad_bytes="4(Ψr + Ψs/W)",
            optim_bytes=f"{k}(Ψr + Ψs/W)",
            act_bytes=kept_note,
            **comm_notes,
        ),
    )


def check_args(args, world):
    common.check(
        not args.experts,
        f"--experts: {SCRIPT}.py splits MLPs by columns, not experts over ranks",
    )
    common.check(  # whole heads per rank; D = H·hd and the MLP's 4D then split evenly too
        args.heads % world == 0,
        f"--heads {args.heads} is not divisible by the {world} tensor-parallel ranks: "
        "each rank must own whole attention heads",
    )
    tokens = (common.IMAGE // args.patch) ** 2
    if args.sequence_parallel:
        common.check(
            tokens % world == 0,
            f"--sequence-parallel splits the {tokens} tokens over ranks: "
            f"{world} does not divide them",
        )
    if args.partition_activations:
        common.check(
            tokens % world == 0,
            f"--partition-activations splits the {tokens} tokens over ranks: "
            f"{world} does not divide them",
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
                clip_grad_norm_(model, args.clip)
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
        dp_rank, dp_world = 0, 1  # TP: every rank sees the whole batch
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
        if args.sequence_parallel:
            model = sequence_parallelize(model.to(device), device)
        else:
            model = parallelize(model.to(device), device)
        if args.checkpoint or args.partition_activations:  # Pa checkpoints too
            partition = args.partition_activations
            checkpoint_blocks(model.blocks, args.sequence_parallel, partition)
        optimizer = common.make_optimizer(model.parameters(), args)
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        common.log(
            f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data "
            f"({len(train_set)} train / {len(test_set)} test), "
            f"batch {args.batch_size} = {dp_world} x {args.batch_size // dp_world}"
        )
        with common.Meter(model, optimizer, args, device=device) as meter:
            out = train(model, optimizer, scheduler, loader, sampler, args, device)
        acc = None
        if not args.simulate:  # --simulate: meta tensors, no values to test or save
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
    finally:
        cleanup()


def main():
    parser = common.get_parser(
        "Tensor parallelism (Megatron) with ZeRO-R's activation work", simulates=True
    )
    parser.add_argument(
        "--sequence-parallel", action="store_true", help="norms and residuals on T/W tokens"
    )
    parser.add_argument(
        "--checkpoint", action="store_true", help="keep only each block's input for backward"
    )
    parser.add_argument(
        "--partition-activations",
        action="store_true",
        help="ZeRO-R's Pa: --checkpoint, keeping this rank's T/W tokens of each block's input",
    )
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
