"""Copy cases for context_parallel.py on the causal LMs: every rank feeds the whole micro-batch and
keeps its T/W tokens (a contiguous run, or the zig-zag chunks r and 2W-1-r), the ring or Ulysses
attends causally over all T, and the loss is the mean over every rank's valid targets. What
CausalLM needs changed, as the section's model contract says: an embedding that keeps this rank's
tokens at their positions (LocalTokenEmbed) and an attention built on the fused c_attn
(FusedQKVAttention). nanoGPT's GPT, unchanged: its (x, y) batches split alike (split_batch), its
forward written out on this rank's part (RankGPT) and the section's GPT2Attention in its blocks.
Run by tests/copy_cases.py."""

import nanogpt_model
import torch
import torch.distributed as dist
import torch.nn as nn
from causal_lm import CausalLM, make_optimizer, param_groups, train

import context_parallel as cp

CPU = torch.device("cpu")


class LocalTokenEmbed(nn.Module):
    """CausalLM's Embed on this rank's tokens of the whole [B, T] batch, each with the position
    embedding of its own place in the sequence (wpe at split_tokens' positions, not 0..T/W)."""

    def __init__(self, embed, zigzag, group=None):
        super().__init__()
        self.wte = embed.wte
        self.wpe = embed.wpe
        self.zigzag = zigzag
        self.group = group  # the context group (None: the world)

    def forward(self, batch):
        tokens, positions = cp.split_tokens(batch, self.group, zigzag=self.zigzag)
        return self.wte(tokens) + self.wpe(positions)


class FusedQKVAttention(nn.Module):
    """CausalSelfAttention with the section's context_attention where it calls SDPA: the same
    c_attn and c_proj modules, so the state_dict keys are the model's."""

    def __init__(self, attn, method, group, causal, zigzag):
        super().__init__()
        self.c_attn = attn.c_attn
        self.c_proj = attn.c_proj
        self.heads = attn.heads
        self.method = method
        self.group = group
        self.causal = causal
        self.zigzag = zigzag

    def forward(self, x):  # x: [B, T/W, D], this rank's tokens
        batch, tokens, dim = x.shape
        shape = (batch, tokens, self.heads, dim // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in self.c_attn(x).split(dim, dim=2))
        y = cp.context_attention(q, k, v, self.method, self.group, self.causal, self.zigzag)
        return self.c_proj(y.transpose(1, 2).reshape(batch, tokens, dim))


def run_context_parallel(
    method, zigzag, optim, batches, group=None, data_group=None, rank=0, world=1
):
    """group: the context group (None: the world); data_group: DDP's (None: the world); this
    context group feeds the slice `rank` of `world` of every micro-batch (0 of 1: all of it)."""
    model = CausalLM()
    model.embed = LocalTokenEmbed(model.embed, zigzag, group)
    model = cp.parallelize(
        model,
        CPU,
        method,
        group=group,
        data_group=data_group,
        causal=True,
        zigzag=zigzag,
        attention=FusedQKVAttention,
    )
    optimizer = make_optimizer(param_groups(model.module, optim), optim)
    seen = {}  # what rank 0's model saw: the proof that the tokens were split

    def record_positions(wpe, inputs, output):
        seen.setdefault("positions", inputs[0].tolist())

    def record_attention_tokens(attn, inputs, output):
        seen.setdefault("attention_tokens", inputs[0].shape[1])

    hooks = [
        model.module.embed.wpe.register_forward_hook(record_positions),
        model.module.blocks[0].attn.register_forward_hook(record_attention_tokens),
    ]

    def loss_fn(logits, batch):
        # CausalLM's tokens are their own targets: shifted on the whole sequence, then split.
        targets = cp.next_token_targets(batch)
        local_targets, _ = cp.split_tokens(targets, group, zigzag=zigzag)
        return cp.causal_lm_loss(logits, local_targets, group)

    # Every rank of the context group feeds its slice of the micro-batch (the whole with rank 0
    # of 1): its embedding keeps its tokens.
    losses = train(model, optimizer, batches, rank, world, loss_fn=loss_fn)
    for hook in hooks:
        hook.remove()
    tied = model.module.head.lm_head.weight is model.module.embed.wte.weight
    attention = type(model.module.blocks[0].attn).__name__  # parallelize put it in
    state = cp.full_state_dict(model)
    # copy_cases evaluates on the whole sequence: one process's CausalLM with these parameters
    evaluated = CausalLM()
    evaluated.load_state_dict(state)
    return evaluated, state, dict(tied=tied, losses=losses, attention=attention, **seen)


CASES = [
    ("ring", False, "sgd"),
    ("ring", True, "sgd"),
    ("ring", True, "adamw"),
    ("ulysses", False, "sgd"),
    ("ulysses", True, "adamw"),
]


def cases(batches, rank, world, folder):
    """Yield (case name, its reference, the trained model, its full state_dict, the proof)."""
    for method, zigzag, optim in CASES:
        split = "zigzag" if zigzag else "contiguous"
        name = f"context_parallel-{method}-{split}-{optim}"
        yield name, optim, *run_context_parallel(method, zigzag, optim, batches)


GROUP_CASES = [
    "group-cp-ring-sgd",
    "group-cp-ring-adamw",
    "group-cp-ulysses-sgd",
    "group-cp-dp-ring-sgd",
]


def group_cases(batches, group, folder):
    """The cases on `group`, a pair of a world of four (tests/copy_cases.py --groups), the tokens
    split zig-zag over the pair. The first three: the pair is also DDP's group, every rank of it
    feeding the whole batch. "dp": the layout data x context, DDP over the world (data_group=None)
    and each pair feeding its half of every micro-batch (the pairs are interleaved: this rank's
    is rank % 2). Yields (case, its reference, the trained model, its full state_dict, {})."""
    for case in GROUP_CASES:
        _, method, optim = case.rsplit("-", 2)
        if "-dp-" in case:
            copies = dist.get_world_size() // dist.get_world_size(group)
            data = dict(data_group=None, rank=dist.get_rank() % copies, world=copies)
        else:
            data = dict(data_group=group)
        model, state, _ = run_context_parallel(method, True, optim, batches, group, **data)
        yield case, optim, model, state, {}


# The model as nanoGPT has it (tests/nanogpt_model.py), trained by its own recipe: (x, y) batches
# with ignore_index=-1, its configure_optimizers, gradient accumulation, torch's clip_grad_norm_
# (DDP over the ranks leaves every whole gradient on every rank). Its forward embeds positions
# arange(0, t), wrong on every rank but the first, so RankGPT calls its parts.

NANOGPT_RUNS = [  # (method, zigzag, reference: a nanogpt_model.CONFIGS prefix and the optimizer)
    ("ring", False, "sgd"),
    ("ring", True, "sgd"),
    ("ulysses", False, "sgd"),
    ("ulysses", True, "sgd"),
    ("ring", True, "adamw"),
    ("ulysses", False, "adamw"),
    ("ring", True, "nobias-sgd"),  # GPT2Attention and the model without a bias anywhere
]
NANOGPT_CASES = [
    f"context_parallel-{method}-{'zigzag' if zigzag else 'contiguous'}-{reference}"
    for method, zigzag, reference in NANOGPT_RUNS
]


class RankGPT(nn.Module):
    """GPT.forward(idx, targets) -> (logits, loss) on this rank's part of the sequence: the (x, y)
    batch split alike, x embedded at its own positions, the loss the mean over every rank's valid
    targets. It holds the model's own transformer and lm_head, so the state_dict keys are the
    model's and the tie stays one Parameter."""

    def __init__(self, gpt, zigzag):
        super().__init__()
        self.transformer = gpt.transformer
        self.lm_head = gpt.lm_head
        self.zigzag = zigzag

    def forward(self, idx, targets):
        idx, targets, positions = cp.split_batch(idx, targets, zigzag=self.zigzag)
        parts = self.transformer
        x = parts.drop(parts.wte(idx) + parts.wpe(positions))
        for block in parts.h:
            x = block(x)
        logits = self.lm_head(parts.ln_f(x))
        return logits, cp.causal_lm_loss(logits, targets, ignore_index=-1)


def run_nanogpt(method, zigzag, reference):
    prefix, _, optim = reference.rpartition("-")
    config = nanogpt_model.CONFIGS[prefix + "-" if prefix else ""]
    gpt = nanogpt_model.model(config)
    optimizer = nanogpt_model.make_optimizer(gpt, optim)  # its groups, on the model as it is
    model = cp.parallelize(
        RankGPT(gpt, zigzag),
        CPU,
        method,
        causal=True,
        zigzag=zigzag,
        attention=cp.GPT2Attention,
        blocks=gpt.transformer.h,
    )
    seen = {}  # what this rank's model saw: the proof that the sequence was split

    def record_positions(wpe, inputs, output):
        seen.setdefault("positions", inputs[0].tolist())

    def record_attention_tokens(attn, inputs, output):
        seen.setdefault("attention_tokens", inputs[0].shape[1])

    hooks = [
        gpt.transformer.wpe.register_forward_hook(record_positions),
        gpt.transformer.h[0].attn.register_forward_hook(record_attention_tokens),
    ]
    # Every rank feeds every whole micro-batch (rank 0 of 1): RankGPT keeps its part.
    losses, norms = nanogpt_model.train(model, optimizer, nanogpt_model.batches())
    for hook in hooks:
        hook.remove()
    seen["losses"] = losses
    seen["attention"] = type(gpt.transformer.h[0].attn).__name__
    by_rank = [None] * dist.get_world_size()
    dist.all_gather_object(by_rank, seen)
    tied = model.module.lm_head.weight is model.module.transformer.wte.weight
    state = cp.full_state_dict(model)
    evaluated = nanogpt_model.GPT(config)  # one process's forward, with these weights
    evaluated.load_state_dict(state)
    proof = dict(tied=tied, losses=losses, norms=norms, by_rank=by_rank)
    return evaluated, state, proof


def nanogpt_cases(rank, world, folder):
    """As `cases`, on nanoGPT's model: (case, its reference, model, full state_dict, proof)."""
    for case, (method, zigzag, reference) in zip(NANOGPT_CASES, NANOGPT_RUNS, strict=True):
        yield case, reference, *run_nanogpt(method, zigzag, reference)
