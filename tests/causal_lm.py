"""The second model, for the copy tests: a small GPT-2-like causal language model, and a token task
made in code. A technique section that trains this model as one process would has been copied into
a project that is not the common ViT.

    tokens --wte + wpe--> blocks: x + attn(ln_1(x)), x + mlp(ln_2(x)) --ln_f--> lm_head = wteᵀ

The layout is what ZeRO's model contract names: `embed` (wte, wpe), `blocks` (an nn.ModuleList),
`head` (ln_f, lm_head), and lm_head.weight IS wte.weight (tied, as in GPT-2). The attention has
one fused q, k, v projection, `c_attn`, as nanoGPT and GPT-2 name it.

Below the model, what every copy case shares: the batches (STEPS optimizer steps of ACCUMULATE
micro-batches), the optimizers (SGD over one group, AdamW over two weight-decay groups) and the
one-process training every case is compared with (`train`, `reference`).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 16
CONTEXT = 16


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        # q, k, v in one matrix. No bias (nanoGPT's bias=False): the key's would get a gradient
        # that is mathematically zero, whose round-off AdamW turns into full-size steps
        self.c_attn = nn.Linear(dim, 3 * dim, bias=False)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x):
        batch, tokens, dim = x.shape
        q, k, v = self.c_attn(x).split(dim, dim=2)
        # (batch, tokens, dim) -> (batch, heads, tokens, dim / heads)
        q = q.view(batch, tokens, self.heads, dim // self.heads).transpose(1, 2)
        k = k.view(batch, tokens, self.heads, dim // self.heads).transpose(1, 2)
        v = v.view(batch, tokens, self.heads, dim // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, tokens, dim)  # the heads side by side again
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.c_proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embed(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, dim)  # token embedding
        self.wpe = nn.Embedding(CONTEXT, dim)  # learned position embedding

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.wte(tokens) + self.wpe(positions)


class Head(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, x):
        return self.lm_head(self.ln_f(x))  # logits over the vocabulary at every position


class CausalLM(nn.Module):
    def __init__(self, dim=32, depth=2, heads=4, seed=0):
        super().__init__()
        torch.manual_seed(seed)  # the same weights in every process that builds it
        self.embed = Embed(dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.head = Head(dim)
        self.head.lm_head.weight = self.embed.wte.weight  # tied: one Parameter, two uses
        self.apply(init_weights)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2: residual projections scaled by depth
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * depth))

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def init_weights(module):
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    if isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)


def lm_loss(logits, tokens):
    """Next-token prediction: position t predicts token t + 1."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def bigram_batches(steps, batch_size, seed=0):
    """`steps` batches of sequences drawn from one fixed random bigram table: each token picks
    its successor among 2 of the VOCAB, so the loss of a model that learns the table falls
    from ln(16) ≈ 2.8 towards ln(2) ≈ 0.7. The same seed gives the same batches anywhere."""
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(VOCAB, (VOCAB, 2), generator=generator)
    batches = []
    for _ in range(steps):
        tokens = torch.empty(batch_size, CONTEXT, dtype=torch.long)
        tokens[:, 0] = torch.randint(VOCAB, (batch_size,), generator=generator)
        for t in range(1, CONTEXT):
            choice = torch.randint(2, (batch_size,), generator=generator)
            tokens[:, t] = successors[tokens[:, t - 1], choice]
        batches.append(tokens)
    return batches


def weight_decay_groups(model, weight_decay):
    """The two parameter groups of every language-model recipe: weight decay on the matrices, none
    on biases, norms and embeddings (the tied wte is an embedding: no decay)."""
    embeddings = {module.weight for module in model.modules() if isinstance(module, nn.Embedding)}
    decay = []
    no_decay = []
    for param in model.parameters():  # each Parameter once, a tied one too
        if param.dim() >= 2 and param not in embeddings:
            decay.append(param)
        else:
            no_decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


# What every copy case trains: STEPS optimizer steps, each of ACCUMULATE backward passes
# (gradient accumulation) on micro-batches of MICRO_BATCH sequences (over all ranks together).
STEPS = 4
ACCUMULATE = 2
MICRO_BATCH = 8
WEIGHT_DECAY = 0.1
OPTIMS = ("sgd", "adamw")


def task():
    """(the STEPS step batches of ACCUMULATE * MICRO_BATCH sequences, MICRO_BATCH held-out
    sequences of the same bigram table that no step trains on)"""
    *batches, held_out = bigram_batches(STEPS + 1, ACCUMULATE * MICRO_BATCH)
    return batches, held_out[:MICRO_BATCH]


def param_groups(model, optim):
    """SGD: one group, every parameter. AdamW: the two weight-decay groups."""
    if optim == "sgd":
        return [{"params": list(model.parameters())}]
    return weight_decay_groups(model, WEIGHT_DECAY)


def make_optimizer(groups, optim):
    """SGD with momentum, or AdamW, over `groups` (a list of parameter groups, or parameters)."""
    if optim == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(groups, lr=1e-2)


def train(model, optimizer, batches, rank=0, world=1, loss_fn=lm_loss):
    """Each step: ACCUMULATE backward passes, each on this rank's slice (rank of world) of a
    micro-batch, the loss divided by ACCUMULATE so that the step sees the mean gradient of the
    step's sequences. rank=0, world=1: every rank (or the one process) feeds the whole batch."""
    losses = []
    for step_batch in batches:
        for micro_batch in step_batch.chunk(ACCUMULATE):
            tokens = micro_batch.chunk(world)[rank]
            loss = loss_fn(model(tokens), tokens) / ACCUMULATE
            loss.backward()
            losses.append(loss.item() * ACCUMULATE)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


@torch.no_grad()
def evaluation_loss(model, tokens):
    """A forward without autograd (ZeRO-3 and FSDP gather and free their units without a
    backward)."""
    return lm_loss(model(tokens), tokens).item()


def reference(optim, batches, test_tokens, model=None):
    """One process training `model` (default: a fresh CausalLM) on the whole of every micro-batch:
    (its state_dict, dict(losses, eval_loss))."""
    model = model or CausalLM()
    optimizer = make_optimizer(param_groups(model, optim), optim)
    losses = train(model, optimizer, batches)
    results = dict(losses=losses, eval_loss=evaluation_loss(model, test_tokens))
    return model.state_dict(), results
