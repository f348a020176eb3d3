"""The third copy-test model: a GPT-2 decoder laid out and trained as nanoGPT lays it out and trains
it (github.com/karpathy/nanoGPT, model.py and train.py), written here. The copy modules take this
class as a user's project has it and change none of its lines: where its own forward cannot serve
a technique (positions under context parallelism, a pipeline's stages), they call its parts.

    idx --transformer.wte + transformer.wpe(arange(0, t))--> drop --> transformer.h[0..L-1]
        --> transformer.ln_f --> lm_head (its weight IS transformer.wte.weight)

The training recipe below the model is nanoGPT's too: batches are (x, y) pairs, y being x shifted
by one with -1 where no target exists (ignore_index=-1); AdamW through `configure_optimizers`
(weight decay on every tensor with dim >= 2, the tied embedding included); gradient accumulation;
`clip_grad_norm_(model.parameters(), CLIP)` before every step, at a limit that really clips.
"""

import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------
# The model, as a user's project has it. Nothing below this line up to the recipe may be edited
# to fit a technique: the copy tests prove the sections take it as it is.


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (torch's LayerNorm has bias= only since 2.1)."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, in one matrix
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()  # batch size, sequence length, embedding dimensionality (n_embd)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        dropout_p = self.dropout if self.training else 0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # the heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 16
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True  # True: biases in the Linears and LayerNorms, as GPT-2


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # weight tying: one Parameter, two uses (https://paperswithcode.com/method/weight-tying)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def get_num_params(self):
        return sum(p.numel() for p in self.parameters())

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, f"sequence of {t} > block size {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)  # shape (t)
        tok_emb = self.transformer.wte(idx)  # token embeddings of shape (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # position embeddings of shape (t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
        else:
            # inference: only the last position's logits are needed
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        # every tensor with dim >= 2 decays (matrices, embeddings); biases and norms do not
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        fused_available = "fused" in inspect.signature(torch.optim.AdamW).parameters
        use_fused = fused_available and device_type == "cuda"
        extra_args = dict(fused=True) if use_fused else dict()
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)


# ---------------------------------------------------------------------------------------------
# The training recipe every nanoGPT copy case shares, and the one process it is compared with.

CONFIG = GPTConfig()
STEPS = 4  # optimizer steps
ACCUMULATE = 2  # gradient_accumulation_steps: backward passes a step
MICRO_BATCH = 8  # sequences a backward pass, over all data-parallel ranks together
CLIP = 0.5  # grad_clip: below every step's gradient norm in the reference, so every step clips
OPTIMS = ("sgd", "adamw")
# The key third of c_attn.bias has a gradient that is mathematically zero (softmax does not see a
# key bias: it adds the same number to a query's every score); AdamW divides its round-off by its
# own size and steps it by up to lr, so two correct runs differ there by ~1e-4. An exactness
# check with AdamW leaves it out; SGD checks it to round-off.
KEY_BIAS = ("transformer.h.{}.attn.c_attn.bias", slice(CONFIG.n_embd, 2 * CONFIG.n_embd))


CONFIGS = {"": CONFIG, "nobias-": GPTConfig(bias=False)}  # a reference's prefix -> its model


def model(config=CONFIG):
    torch.manual_seed(0)  # nanoGPT seeds before building: the same weights in every process
    return GPT(config)


def make_optimizer(model, optim):
    """SGD with momentum over every parameter, or nanoGPT's own AdamW (two weight-decay groups)."""
    if optim == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")


def batches(steps=STEPS):
    """`steps` step batches, each ACCUMULATE (x, y) micro-batches of MICRO_BATCH sequences: tokens
    of one fixed random bigram table (each token picks its successor among 2), y = x shifted by
    one. Every sequence's first target is -1, as if a document began there: the loss ignores it,
    so a rank holding a sequence's start has one target fewer than the others."""
    generator = torch.Generator().manual_seed(0)
    vocab = CONFIG.vocab_size
    successors = torch.randint(vocab, (vocab, 2), generator=generator)
    result = []
    for _ in range(steps):
        micro_batches = []
        for _ in range(ACCUMULATE):
            tokens = torch.empty(MICRO_BATCH, CONFIG.block_size + 1, dtype=torch.long)
            tokens[:, 0] = torch.randint(vocab, (MICRO_BATCH,), generator=generator)
            for t in range(1, CONFIG.block_size + 1):
                choice = torch.randint(2, (MICRO_BATCH,), generator=generator)
                tokens[:, t] = successors[tokens[:, t - 1], choice]
            x = tokens[:, :-1].clone()
            y = tokens[:, 1:].clone()
            y[:, 0] = -1
            micro_batches.append((x, y))
        result.append(micro_batches)
    return result


def held_out():
    """An (x, y) micro-batch of the same bigram table that no step trains on: the one after
    the last step's."""
    *_, last_step = batches(STEPS + 1)
    return last_step[0]


def record_compute_dtypes(model):
    """A dict that block 0's c_fc fills at its first forward: the dtypes of the weight it
    multiplies by and of its input, as names ("torch.bfloat16" under mixed precision)."""
    seen = {}

    def hook(module, args):
        seen.setdefault("weight", str(module.weight.dtype))
        seen.setdefault("input", str(args[0].dtype))

    model.transformer.h[0].mlp.c_fc.register_forward_pre_hook(hook)
    return seen


def train(model, optimizer, step_batches, rank=0, world=1, clip=torch.nn.utils.clip_grad_norm_):
    """nanoGPT's loop: per step ACCUMULATE backward passes of loss / ACCUMULATE on this rank's
    slice (rank of world) of each micro-batch, `clip(model.parameters(), CLIP)`, the step.
    Returns (the micro-batches' losses, the gradient norm each clip returned). clip=None: no
    clipping (nanoGPT's grad_clip = 0.0), and no norms."""
    losses = []
    norms = []
    for micro_batches in step_batches:
        for x, y in micro_batches:
            _, loss = model(x.chunk(world)[rank], y.chunk(world)[rank])
            (loss / ACCUMULATE).backward()
            losses.append(loss.item())
        if clip is not None:
            norms.append(float(clip(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, norms


@torch.no_grad()
def evaluation_loss(model):
    x, y = held_out()
    _, loss = model(x, y)
    return loss.item()


def reference(optim, config=CONFIG):
    """One process on the whole of every micro-batch: (its state_dict, dict(losses, norms,
    eval_loss))."""
    gpt = model(config)
    optimizer = make_optimizer(gpt, optim)
    losses, norms = train(gpt, optimizer, batches())
    return gpt.state_dict(), dict(losses=losses, norms=norms, eval_loss=evaluation_loss(gpt))


def compared_keys(state, optim, key_bias=KEY_BIAS, layers=CONFIG.n_layer):
    """(key, index) of what an exactness check compares: every tensor, but with AdamW the key
    third of each c_attn.bias (see KEY_BIAS; tests/hf_gpt2_model.py passes its own)."""
    name, key_slice = key_bias
    key_biases = {name.format(i) for i in range(layers)}
    for key in state:
        if optim == "adamw" and key in key_biases:
            yield key, slice(0, key_slice.start)
            yield key, slice(key_slice.stop, None)
        else:
            yield key, slice(None)
