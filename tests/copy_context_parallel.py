"""Copy cases for context_parallel.py on the causal LMs: every rank feeds the whole micro-batch and
keeps its T/W tokens (a contiguous run, or the zig-zag chunks r and 2W-1-r), the model's own
attention runs, its F.scaled_dot_product_attention call swapped for the ring or Ulysses over all T,
and the loss is the mean over every rank's valid targets. What each model needs is what feeds it
this rank's tokens at their own positions: CausalLM, whose embedding counts positions from 0,
an embedding that keeps this rank's tokens (LocalTokenEmbed); nanoGPT's GPT, whose forward does
the same, its forward written out on this rank's part (RankGPT); Llama 3 as torchtitan has it and
HF's GPT2LMHeadModel, whose forward takes positions, nothing: `model(x, positions)` and
`model(x, position_ids=positions)` (llama_cases). Run by tests/copy_cases.py."""

import hf_gpt2_model
import llama_model
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


def run_context_parallel(
    method, zigzag, optim, batches, group=None, data_group=None, rank=0, world=1
):
    """group: the context group (None: the world); data_group: DDP's (None: the world); this
    context group feeds the slice `rank` of `world` of every micro-batch (0 of 1: all of it)."""
    model = CausalLM()
    model.embed = LocalTokenEmbed(model.embed, zigzag, group)
    model = cp.parallelize(model, CPU, method, group=group, data_group=data_group, zigzag=zigzag)
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
    attention = type(model.module.blocks[0].attn).__name__  # the model's own
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
    ("ring", True, "nobias-sgd"),  # the model without a bias anywhere
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
    model = cp.parallelize(RankGPT(gpt, zigzag), CPU, method, zigzag=zigzag)
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


# Llama 3 as torchtitan has it (tests/llama_model.py) and HF's GPT2LMHeadModel
# (tests/hf_gpt2_model.py), not a line of either changed: both forwards take each token's position
# (Llama's `positions` index its RoPE table, GPT-2's `position_ids` its wpe) and both attentions
# call SDPA (Llama after repeating its kv heads, GPT-2 with attn_implementation="sdpa"), so the
# loop is all a user writes.

LLAMA_RUNS = [  # (family, method, zigzag, optim)
    ("llama", "ring", False, "sgd"),
    ("llama", "ring", True, "adamw"),
    ("llama", "ulysses", True, "sgd"),
    ("llama", "ulysses", False, "adamw"),
    ("gpt2", "ring", True, "sgd"),
    ("gpt2", "ulysses", False, "adamw"),
]
LLAMA_CASES = [
    f"{family}-context_parallel-{method}-{'zigzag' if zigzag else 'contiguous'}-{optim}"
    for family, method, zigzag, optim in LLAMA_RUNS
]
FAMILIES = {"llama": llama_model, "gpt2": hf_gpt2_model}


def llama_logits(model, x, positions):
    """torchtitan's Llama: tokens and their positions in, logits out."""
    return model(x, positions)


def gpt2_logits(model, x, positions):
    """HF's GPT2LMHeadModel: (loss, logits) out, the loss None without labels."""
    _, logits = model(x, position_ids=positions)
    return logits


def llama_step_targets(micro_batches):
    """torchtitan's global count of targets, and each micro-batch's (input, y): its labels are
    already the next tokens."""
    return llama_model.global_targets(micro_batches), micro_batches


def gpt2_step_targets(micro_batches):
    """HF's num_items_in_batch, and each micro-batch's (input_ids, y): HF shifts the labels inside
    its loss, a shift that must see the whole sequence, so it is made before the split."""
    split_ready = [(x, cp.next_token_targets(labels)) for x, labels in micro_batches]
    return hf_gpt2_model.num_items_in_batch(micro_batches), split_ready


LOGITS = {"llama": llama_logits, "gpt2": gpt2_logits}
STEP_TARGETS = {"llama": llama_step_targets, "gpt2": gpt2_step_targets}


def train_family(family, model, optimizer, zigzag):
    """The family's recipe (its batches, its clip, its global count of targets) with each
    micro-batch split over the context group: this rank's tokens at their positions through the
    model's own forward, the loss summed over every rank's targets and divided by the step's
    count. Returns (each step's loss, the norm each clip returned)."""
    recipe = FAMILIES[family]
    losses = []
    norms = []
    for micro_batches in recipe.batches():
        num_items, split_ready = STEP_TARGETS[family](micro_batches)
        step_loss = 0.0
        for inputs, targets in split_ready:
            x, y, positions = cp.split_batch(inputs, targets, zigzag=zigzag)
            logits = LOGITS[family](model, x, positions)
            micro_loss = cp.causal_lm_loss(logits, y, num_items=num_items)
            micro_loss.backward()
            step_loss += micro_loss.item()
        losses.append(step_loss)
        # DDP leaves every whole gradient on every rank: torch's clip is one process's
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.CLIP)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, norms


def run_family_context_parallel(family, method, zigzag, optim):
    recipe = FAMILIES[family]
    model = recipe.model()
    optimizer = recipe.make_optimizer(model, optim)
    model = cp.parallelize(model, CPU, method, zigzag=zigzag)
    losses, norms = train_family(family, model, optimizer, zigzag)
    state = cp.full_state_dict(model)
    evaluated = recipe.model()  # one process's forward on whole sequences, with these weights
    evaluated.load_state_dict(state)
    return evaluated, state, dict(losses=losses, norms=norms)


def llama_cases(rank, world, folder):
    """As `cases`, on Llama 3 and HF GPT-2: (case, its reference, model, full state_dict, proof).
    Every rank feeds every whole micro-batch and keeps its part."""
    for case, (family, method, zigzag, optim) in zip(LLAMA_CASES, LLAMA_RUNS, strict=True):
        yield case, f"{family}-{optim}", *run_family_context_parallel(family, method, zigzag, optim)
