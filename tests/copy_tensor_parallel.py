"""Copy cases for tensor_parallel.py, with and without sequence parallelism: every rank feeds the
whole micro-batch, as tensor parallelism does, and holds half of every block's heads and MLP
columns, and the model's own attention runs on them. The change a model needs is its plan: its
layers' names, q, k and v fused in c_attn (thirds) or in wqkv (by kv group), and the attributes
that count its heads or width, each divided by W. CausalLM's and nanoGPT's attention take their
width off their input (`dim` and `C` of x.shape), so each gets its own forward with the width read
off q (`-1` in its views, as torchtitan's and HF's read it): the lines a user of those models
changes. Llama 3 as torchtitan has it and HF's GPT-2 need no such line (llama_cases). With
--groups the section runs on a pair of ranks of four (group_cases), ZeRO-R's variant among them.
Run by tests/copy_cases.py."""

import functools

import hf_gpt2_model
import llama_model
import nanogpt_model
import torch
import torch.distributed as dist
import torch.nn.functional as F
from causal_lm import OPTIMS, CausalLM, make_optimizer, param_groups, train

import tensor_parallel
import tensor_parallel_zero_r
from tensor_parallel import (
    ColumnParallelConv1D,
    ColumnParallelLinear,
    PerRank,
    QKVParallelConv1D,
    QKVParallelLinear,
    RowParallelConv1D,
    RowParallelLinear,
    full_state_dict,
)

CPU = torch.device("cpu")
HEADS = 4  # CausalLM()'s

# GPT-2's plan, in CausalLM's and nanoGPT's names (nn.Linear): q, k, v fused in c_attn as thirds
GPT2_PLAN = {
    "attn.c_attn": QKVParallelLinear,
    "attn.c_proj": RowParallelLinear,
    "mlp.c_fc": ColumnParallelLinear,
    "mlp.c_proj": RowParallelLinear,
}
CAUSAL_LM_PLAN = {**GPT2_PLAN, "attn.heads": PerRank}
NANOGPT_PLAN = {**GPT2_PLAN, "attn.n_head": PerRank, "attn.n_embd": PerRank}
# HF's GPT-2: the same layers, Conv1D ([in, out] weights)
HF_GPT2_PLAN = {
    "attn.c_attn": QKVParallelConv1D,
    "attn.c_proj": RowParallelConv1D,
    "mlp.c_fc": ColumnParallelConv1D,
    "mlp.c_proj": RowParallelConv1D,
    "attn.split_size": PerRank,
}
# torchtitan's Llama: wqkv by kv group (a rank's rows are its whole groups), SwiGLU's w1 and w3
# by columns, w2 by rows; the head counts divided (n_kv_heads refuses a W that does not divide it)
LLAMA_PLAN = {
    "attention.wqkv": ColumnParallelLinear,
    "attention.wo": RowParallelLinear,
    "attention.n_heads": PerRank,
    "attention.n_kv_heads": PerRank,
    "feed_forward.w1": ColumnParallelLinear,
    "feed_forward.w3": ColumnParallelLinear,
    "feed_forward.w2": RowParallelLinear,
}


def split(section, model, sequence_parallel, plan, **where):
    """`section`'s parallelize, or its sequence_parallelize under sequence parallelism, on
    `model` with `plan`; `where`: blocks, head, group (head only under sequence parallelism)."""
    if sequence_parallel:
        return section.sequence_parallelize(model, CPU, plan, **where)
    where.pop("head", None)  # the head stays whole and unhooked: parallelize takes none
    return section.parallelize(model, CPU, plan, **where)


def causal_lm_attention(attention, x):
    """causal_lm.CausalSelfAttention.forward with the width read off q, not off x: what its
    user changes for tensor parallelism (split into thirds, `-1` in the views)."""
    batch, tokens, _ = x.shape
    q, k, v = attention.c_attn(x).chunk(3, dim=2)
    q = q.view(batch, tokens, attention.heads, -1).transpose(1, 2)
    k = k.view(batch, tokens, attention.heads, -1).transpose(1, 2)
    v = v.view(batch, tokens, attention.heads, -1).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y.transpose(1, 2).reshape(batch, tokens, -1)  # the heads side by side again
    return attention.c_proj(y)


def nanogpt_attention(attention, x):
    """nanoGPT's CausalSelfAttention.forward with C // n_head and C, which it reads off x, as `-1`:
    the three lines a nanoGPT user changes in model.py for tensor parallelism."""
    B, T, C = x.size()
    q, k, v = attention.c_attn(x).split(attention.n_embd, dim=2)
    k = k.view(B, T, attention.n_head, -1).transpose(1, 2)
    q = q.view(B, T, attention.n_head, -1).transpose(1, 2)
    v = v.view(B, T, attention.n_head, -1).transpose(1, 2)
    dropout_p = attention.dropout if attention.training else 0
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    y = y.transpose(1, 2).contiguous().view(B, T, -1)
    return attention.resid_dropout(attention.c_proj(y))


def attend_by_width_of_q(blocks, forward):
    """Each block's `attn` runs `forward` (causal_lm_attention or nanogpt_attention)."""
    for block in blocks:
        block.attn.forward = functools.partial(forward, block.attn)


def heads_held(c_attn, whole):
    """Which heads of q, of k and of v the rows of this rank's c_attn weight are, found by
    comparing them with the whole initial weight's rows: [[q heads], [k heads], [v heads]]."""
    head_dim = whole.shape[1] // HEADS
    held = []
    for local, part in zip(c_attn.chunk(3), whole.chunk(3), strict=True):
        heads = part.split(head_dim)  # the whole q (k, v): HEADS blocks of head_dim rows
        found = []
        for rows in local.split(head_dim):
            found += [h for h, head in enumerate(heads) if torch.equal(rows, head)]
        held.append(found)
    return held


def run_tensor_parallel(sequence_parallel, optim, batches):
    model = CausalLM()
    whole = model.blocks[0].attn.c_attn.weight.detach().clone()
    attend_by_width_of_q(model.blocks, causal_lm_attention)
    model = split(tensor_parallel, model, sequence_parallel, CAUSAL_LM_PLAN)
    c_attn = model.blocks[0].attn.c_attn.weight
    seen = {}  # the tokens block 0's first norm runs on: T/W under sequence parallelism

    def note_tokens(module, inputs):
        seen["tokens"] = inputs[0].shape[1]

    model.blocks[0].ln_1.register_forward_pre_hook(note_tokens)
    mine = dict(c_attn_rows=c_attn.shape[0], heads=heads_held(c_attn.detach(), whole))
    optimizer = make_optimizer(param_groups(model, optim), optim)
    train(model, optimizer, batches)  # rank=0, world=1: every rank feeds the whole micro-batch
    mine["ln_1_tokens"] = seen["tokens"]
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, mine)
    proof = {key: [rank[key] for rank in every_rank] for key in mine}
    proof["tied"] = model.head.lm_head.weight is model.embed.wte.weight
    return model, full_state_dict(model), proof


def cases(batches, rank, world, folder):
    """Yield (case name, its reference "sgd" or "adamw", the trained model, its full state_dict,
    what else the case shows: per rank, c_attn's rows and the heads they hold, the tokens the
    norms see), one case at a time."""
    for sequence_parallel in (False, True):
        for optim in OPTIMS:
            name = f"tensor_parallel-{'sp' if sequence_parallel else 'tp'}-{optim}"
            yield name, optim, *run_tensor_parallel(sequence_parallel, optim, batches)


# The section on a process group of its own (tests/copy_cases.py --groups): each pair of ranks of a
# world of four splits the model between its two ranks alone. "pa": ZeRO-R's partitioned
# activations (tensor_parallel_zero_r.py), whose all-gather before each recompute takes the group
# too. Sequence parallelism trains with SGD: its partial gradient sum, run over all four ranks,
# doubles the norms' gradients, which AdamW's steps barely show.

GROUP_CASES = ["group-tp-adamw", "group-tp-sp-sgd", "group-tp-pa-sgd"]


def run_on_group(section, optim, batches, group, sequence_parallel=False, partition=False):
    """CausalLM split by `section` (tensor_parallel or its ZeRO-R variant, whose Pa `partition`
    adds) over `group`, trained with every group rank feeding the whole micro-batch: (model, full
    state_dict on the group's first rank, None on the other)."""
    # GPT2_PLAN in the section's own classes: the variant file defines its own, which its
    # parallelize tells apart by identity.
    plan = {name: getattr(section, style.__name__) for name, style in CAUSAL_LM_PLAN.items()}
    model = CausalLM()
    attend_by_width_of_q(model.blocks, causal_lm_attention)
    model = split(section, model, sequence_parallel, plan, group=group)
    if partition:
        section.checkpoint_blocks(model.blocks, sequence_parallel, partition, group)
    optimizer = make_optimizer(param_groups(model, optim), optim)
    train(model, optimizer, batches)  # rank=0, world=1: every rank feeds the whole micro-batch
    return model, section.full_state_dict(model, group)


def group_cases(batches, group, folder):
    """Yield (case name, its reference "sgd" or "adamw", the trained model, its full state_dict on
    the group's first rank, {}), the section running on `group` alone."""
    model, state = run_on_group(tensor_parallel, "adamw", batches, group)
    yield "group-tp-adamw", "adamw", model, state, {}
    model, state = run_on_group(tensor_parallel, "sgd", batches, group, sequence_parallel=True)
    yield "group-tp-sp-sgd", "sgd", model, state, {}
    model, state = run_on_group(tensor_parallel_zero_r, "sgd", batches, group, partition=True)
    yield "group-tp-pa-sgd", "sgd", model, state, {}


# The model as nanoGPT has it (tests/nanogpt_model.py), trained by its own recipe: (x, y) batches,
# its configure_optimizers, gradient accumulation, clipping before every step.

NANOGPT_CASES = [
    f"tensor_parallel-{split}-{prefix}{optim}"
    for split in ("tp", "sp")
    for prefix in nanogpt_model.CONFIGS
    for optim in nanogpt_model.OPTIMS
]


def replicated_apart(model):
    """The largest |Δ| between this rank's and rank 0's replicated parameters (everything outside
    the parallel linears): 0 when every rank stepped them alike."""
    split = {
        id(param)
        for module in model.modules()
        for name, param in module.named_parameters(recurse=False)
        if name in getattr(module, "shard_dims", {})
    }
    apart = 0.0
    for param in model.parameters():
        if id(param) not in split:
            first = param.detach().clone()
            dist.broadcast(first, src=0)
            apart = max(apart, (param.detach() - first).abs().max().item())
    return apart


def run_nanogpt_tensor_parallel(sequence_parallel, prefix, optim):
    """nanoGPT's model, its attention reading its width off q (nanogpt_attention): its plan is
    GPT2_PLAN (the same layer names) with n_head and n_embd divided, its blocks are
    transformer.h, and under sequence parallelism the tokens are split at the first block's input
    and gathered before transformer.ln_f. The
    optimizer is the model's own (configure_optimizers on the split model: the shards are still
    matrices and vectors); the clip is the section's, over the shards."""
    gpt = nanogpt_model.model(nanogpt_model.CONFIGS[prefix])
    whole = gpt.transformer.h[0].attn.c_attn.weight.detach().clone()
    attend_by_width_of_q(gpt.transformer.h, nanogpt_attention)
    blocks = gpt.transformer.h
    head = gpt.transformer.ln_f
    model = split(tensor_parallel, gpt, sequence_parallel, NANOGPT_PLAN, blocks=blocks, head=head)
    seen = {}  # the tokens block 0's first norm runs on: T/W under sequence parallelism

    def note_tokens(module, inputs):
        seen["tokens"] = inputs[0].shape[1]

    model.transformer.h[0].ln_1.register_forward_pre_hook(note_tokens)
    c_attn = model.transformer.h[0].attn.c_attn.weight.detach()
    mine = dict(c_attn_rows=c_attn.shape[0], heads=heads_held(c_attn, whole))
    optimizer = nanogpt_model.make_optimizer(model, optim)

    def clip(parameters, max_norm):  # where nanoGPT clips model.parameters()
        return tensor_parallel.clip_grad_norm_(model, max_norm)

    # rank=0, world=1: every rank feeds the whole micro-batch
    losses, norms = nanogpt_model.train(model, optimizer, nanogpt_model.batches(), clip=clip)
    mine["ln_1_tokens"] = seen["tokens"]
    mine["replicated_apart"] = replicated_apart(model)
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, mine)
    proof = {key: [rank[key] for rank in every_rank] for key in mine}
    proof.update(
        tied=model.lm_head.weight is model.transformer.wte.weight, losses=losses, norms=norms
    )
    return model, tensor_parallel.full_state_dict(model), proof


def nanogpt_cases(rank, world, folder):
    """As `cases`, on nanoGPT's model, with and without biases: (case, its reference, model, full
    state_dict, proof: per rank, c_attn's rows and heads, the tokens ln_1 saw, how far its
    replicated parameters ended from rank 0's)."""
    for sequence_parallel in (False, True):
        for prefix in nanogpt_model.CONFIGS:
            for optim in nanogpt_model.OPTIMS:
                name = f"tensor_parallel-{'sp' if sequence_parallel else 'tp'}-{prefix}{optim}"
                case = run_nanogpt_tensor_parallel(sequence_parallel, prefix, optim)
                yield name, f"{prefix}{optim}", *case


# Llama 3 as torchtitan has it (tests/llama_model.py) and HF's GPT-2 (tests/hf_gpt2_model.py), each
# trained by its own recipe, with not a line of either changed: each attention reads its heads off
# its projections' width, so the plan (layers and head counts) is all they need.

LLAMA_CASES = [
    *(f"llama-tensor_parallel-{split}-{optim}" for split in ("tp", "sp") for optim in OPTIMS),
    *(f"gpt2-tensor_parallel-{split}-{optim}" for split in ("tp", "sp") for optim in OPTIMS),
    "gpt2-tensor_parallel-sp-eager-adamw",
]
FAMILIES = {"llama": llama_model, "gpt2": hf_gpt2_model}
DEFAULTS = {"llama": llama_model.ARGS, "gpt2": hf_gpt2_model.CONFIG}  # each family's model


def llama_parts(family, model):
    """(plan, blocks, head) of either model: Llama's layers are an nn.ModuleDict, its head the
    final norm; HF GPT-2's blocks are transformer.h, its head transformer.ln_f."""
    if family == "llama":
        return LLAMA_PLAN, list(model.layers.values()), model.norm
    return HF_GPT2_PLAN, model.transformer.h, model.transformer.ln_f


def first_block_parts(family, model):
    """Block 0's fused q, k, v layer, its attention and the norm before it: Llama's wqkv (by kv
    group), attention and attention_norm; GPT-2's c_attn (thirds), attn and ln_1."""
    if family == "llama":
        block = model.layers["0"]
        return block.attention.wqkv, block.attention, block.attention_norm
    block = model.transformer.h[0]
    return block.attn.c_attn, block.attn, block.ln_1


def head_count(family, attention):
    """The heads the model's own attention runs on: Llama's n_heads, GPT-2's split_size (its
    width of q) over head_dim."""
    if family == "llama":
        return int(attention.n_heads)
    return attention.split_size // attention.head_dim


def check_split(family, model, whole, heads):
    """Asserted on every rank right after the split (a failure fails the launch): this rank's
    block 0 fused q, k, v holds exactly its own heads of the whole weight: Llama's wqkv rows of
    kv groups r·G/W to (r+1)·G/W (each group's q heads, k and v), GPT-2's c_attn columns of heads
    r·H/W to (r+1)·H/W of q, of k and of v; and the model's own attention counts H/W heads."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    qkv, attention, _ = first_block_parts(family, model)
    if family == "llama":
        groups = whole.view(attention.n_kv_heads.whole, -1, whole.shape[1])  # [G, rows, D]
        mine = groups.chunk(world)[rank].reshape(-1, whole.shape[1])
    else:
        by_head = whole.view(whole.shape[0], 3, heads, -1)  # Conv1D: [D, q|k|v, H, head_dim]
        mine = by_head.chunk(world, dim=2)[rank].reshape(whole.shape[0], -1)
    assert torch.equal(qkv.weight.detach(), mine), f"{family}: rank {rank} holds other rows"
    assert head_count(family, attention) * world == heads


def run_family_tensor_parallel(family, sequence_parallel, optim, config):
    """The model of `family` split by tensor_parallel (under sequence parallelism the tokens
    split at the first block's input and gathered before the head), the split checked
    (check_split), trained by its own recipe with every rank feeding the whole micro-batch,
    clipped by the section's clip_grad_norm_. The proof adds the tokens block 0's first norm
    saw, T/W under sequence parallelism (asserted), and how far the replicated parameters ended
    from rank 0's."""
    recipe = FAMILIES[family]
    model = recipe.model(config)
    qkv, attention, _ = first_block_parts(family, model)
    whole = qkv.weight.detach().clone()
    heads = head_count(family, attention)
    plan, blocks, head = llama_parts(family, model)
    split(tensor_parallel, model, sequence_parallel, plan, blocks=blocks, head=head)
    check_split(family, model, whole, heads)
    seen = {}

    def note_tokens(module, inputs):
        seen["tokens"] = inputs[0].shape[1]

    first_block_parts(family, model)[2].register_forward_pre_hook(note_tokens)
    optimizer = recipe.make_optimizer(model, optim)

    def clip(parameters, max_norm):  # where the recipe clips model.parameters()
        return tensor_parallel.clip_grad_norm_(model, max_norm)

    # rank=0, world=1: every rank feeds the whole micro-batch
    losses, norms = recipe.train(model, optimizer, recipe.batches(), clip=clip)
    tokens = config.max_seq_len if family == "llama" else config.n_positions
    split_tokens = tokens // dist.get_world_size() if sequence_parallel else tokens
    assert seen["tokens"] == split_tokens, f"{family}: the first norm saw {seen['tokens']} tokens"
    proof = dict(losses=losses, norms=norms, norm_tokens=seen["tokens"])
    proof["replicated_apart"] = replicated_apart(model)
    assert proof["replicated_apart"] == 0.0, f"{family}: the replicated parameters drifted apart"
    return model, full_state_dict(model), proof


def llama_cases(rank, world, folder):
    """As `cases`, on Llama 3 and HF GPT-2 (sdpa, and eager under its 4-D mask): (case, its
    reference, model, full state_dict, proof)."""
    for family in FAMILIES:
        for split in ("tp", "sp"):
            for optim in OPTIMS:
                config = DEFAULTS[family]
                case = run_family_tensor_parallel(family, split == "sp", optim, config)
                yield f"{family}-tensor_parallel-{split}-{optim}", f"{family}-{optim}", *case
    eager = hf_gpt2_model.CONFIGS["eager-"]
    case = run_family_tensor_parallel("gpt2", True, "adamw", eager)
    yield "gpt2-tensor_parallel-sp-eager-adamw", "gpt2-eager-adamw", *case
