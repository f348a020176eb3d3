"""Copy cases for context_parallel.py on the causal LM: every rank feeds the whole micro-batch and
keeps its T/W tokens (a contiguous run, or the zig-zag chunks r and 2W-1-r), the ring or Ulysses
attends causally over all T, and the loss is the mean over every rank's tokens. What CausalLM
needs changed, as the section's model contract says: an embedding that keeps this rank's tokens
at their positions (LocalTokenEmbed) and an attention built on the fused c_attn
(FusedQKVAttention). Run by tests/copy_cases.py."""

import torch
import torch.nn as nn
from causal_lm import CausalLM, make_optimizer, param_groups, train

import context_parallel as cp

CPU = torch.device("cpu")


class LocalTokenEmbed(nn.Module):
    """CausalLM's Embed on this rank's tokens of the whole [B, T] batch, each with the position
    embedding of its own place in the sequence (wpe at split_tokens' positions, not 0..T/W)."""

    def __init__(self, embed, zigzag):
        super().__init__()
        self.wte = embed.wte
        self.wpe = embed.wpe
        self.zigzag = zigzag

    def forward(self, batch):
        tokens, positions = cp.split_tokens(batch, zigzag=self.zigzag)
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


def run_context_parallel(method, zigzag, optim, batches):
    model = CausalLM()
    model.embed = LocalTokenEmbed(model.embed, zigzag)
    model = cp.parallelize(
        model, CPU, method, causal=True, zigzag=zigzag, attention=FusedQKVAttention
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
        labels = cp.split_labels(batch, zigzag=zigzag)
        return cp.causal_lm_loss(logits, labels)

    # Every rank feeds the whole micro-batch (rank 0 of 1): its embedding keeps its tokens.
    losses = train(model, optimizer, batches, loss_fn=loss_fn)
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
