"""The fifth copy-test model: HuggingFace's GPT2LMHeadModel laid out and called as transformers 5
has it (src/transformers/models/gpt2/modeling_gpt2.py), written here so that the copy tests need no
transformers. The copy modules take this class as a user's project has it and change none of its
lines.

    input_ids --transformer.wte + transformer.wpe(position_ids)--> drop
        --> transformer.h[i](hidden_states, attention_mask=..., position_ids=...)[0]
        --> transformer.ln_f --> lm_head (its weight IS transformer.wte.weight)

What makes it HuggingFace's and not nanoGPT's: Conv1D layers, whose weight is stored [in, out]
(the transpose of nn.Linear's); blocks and attention called with keyword arguments and returning
tuples; the attention kernel chosen by `config.attn_implementation` ("sdpa":
F.scaled_dot_product_attention, causal by itself; "eager": a matmul and softmax, under a 4-D
additive causal mask that the model's forward builds once and passes to every block); `labels`
that the model shifts by itself, -100 where ignored, and `num_items_in_batch`: the loss is then the
sum over the targets divided by that global count (HF's fix for padded, accumulated batches).

The training recipe below the model is HF Trainer's: (input_ids, labels) batches, labels -100
past each document's end, num_items_in_batch counted over the step's micro-batches on every rank,
the loss times the data-parallel world (the Trainer's `average_tokens_across_devices`), AdamW with
no weight decay on biases and LayerNorm weights, clipping before every step.
"""

import math
from dataclasses import dataclass

import nanogpt_model
import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------
# The model, as a user's project has it. Nothing below this line up to the recipe may be edited
# to fit a technique: the copy tests prove the sections take it as it is.


@dataclass
class GPT2Config:
    vocab_size: int = 16
    n_positions: int = 16
    n_embd: int = 32
    n_layer: int = 2
    n_head: int = 4
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    resid_pdrop: float = 0.0  # HF's default is 0.1: the copy tests train without dropout
    embd_pdrop: float = 0.0
    attn_pdrop: float = 0.0
    attn_implementation: str = "sdpa"  # or "eager"


class Conv1D(nn.Module):
    """A linear layer whose weight is stored transposed, [in, out] (GPT-2's original TF layout)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.nx = nx
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


def eager_attention_forward(module, query, key, value, attention_mask, dropout=0.0):
    """softmax(q kᵀ / √d + mask) v, the mask additive, [B, 1, T, T]; out: [B, T, heads, d]."""
    attn_weights = torch.matmul(query, key.transpose(-1, -2))
    attn_weights = attn_weights / torch.full(
        [], value.size(-1) ** 0.5, dtype=attn_weights.dtype, device=attn_weights.device
    )
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask[:, :, :, : key.shape[-2]]
    attn_weights = F.softmax(attn_weights, dim=-1).type(value.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value)
    return attn_output.transpose(1, 2), attn_weights


def sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0):
    """F.scaled_dot_product_attention, causal by itself when no mask is given."""
    is_causal = query.shape[2] > 1 and attention_mask is None
    attn_output = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        is_causal=is_causal,
    )
    return attn_output.transpose(1, 2), None


ATTENTION_FUNCTIONS = {"eager": eager_attention_forward, "sdpa": sdpa_attention_forward}


class GPT2Attention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config = config
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.split_size = self.embed_dim
        self.layer_idx = layer_idx
        self.is_causal = True
        self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)  # [q | k | v], thirds
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
        shape = (
            *query.shape[:-1],
            -1,
            self.head_dim,
        )  # -1: the heads this module holds
        query = query.view(shape).transpose(1, 2)
        key = key.view(shape).transpose(1, 2)
        value = value.view(shape).transpose(1, 2)
        attention_interface = ATTENTION_FUNCTIONS[self.config.attn_implementation]
        dropout = self.attn_dropout.p if self.training else 0.0
        attn_output, attn_weights = attention_interface(
            self, query, key, value, attention_mask, dropout=dropout
        )
        attn_output = attn_output.reshape(*attn_output.shape[:-2], -1).contiguous()
        attn_output = self.resid_dropout(self.c_proj(attn_output))
        return attn_output, attn_weights


class GPT2MLP(nn.Module):
    def __init__(self, intermediate_size, config):
        super().__init__()
        self.c_fc = Conv1D(intermediate_size, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, intermediate_size)
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, hidden_states):
        hidden_states = self.c_fc(hidden_states)
        hidden_states = F.gelu(hidden_states, approximate="tanh")  # HF's "gelu_new"
        hidden_states = self.c_proj(hidden_states)
        return self.dropout(hidden_states)


class GPT2Block(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, layer_idx=layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(4 * config.n_embd, config)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, **kwargs):
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_output, _ = self.attn(
            hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **kwargs,
        )
        hidden_states = attn_output + residual
        residual = hidden_states
        hidden_states = self.ln_2(hidden_states)
        hidden_states = residual + self.mlp(hidden_states)
        return (hidden_states,)


class GPT2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList([GPT2Block(config, layer_idx=i) for i in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, position_ids=None, **kwargs):
        seq_length = input_ids.shape[-1]
        if position_ids is None:
            position_ids = torch.arange(seq_length, device=input_ids.device).unsqueeze(0)
        hidden_states = self.wte(input_ids) + self.wpe(position_ids)
        hidden_states = self.drop(hidden_states)
        causal_mask = create_causal_mask(self.config, hidden_states)
        for block in self.h:
            outputs = block(
                hidden_states,
                attention_mask=causal_mask,
                position_ids=position_ids,
                **kwargs,
            )
            hidden_states = outputs[0]
        return (self.ln_f(hidden_states),)


def create_causal_mask(config, hidden_states):
    """None for "sdpa" (the kernel masks causally by itself); for "eager" a [B, 1, T, T] additive
    mask: 0 where a token may attend, the dtype's minimum above the diagonal."""
    if config.attn_implementation == "sdpa":
        return None
    batch, seq_length = hidden_states.shape[:2]
    dtype = hidden_states.dtype
    allowed = torch.ones(seq_length, seq_length, dtype=torch.bool, device=hidden_states.device)
    allowed = allowed.tril()
    mask = torch.zeros(seq_length, seq_length, dtype=dtype, device=hidden_states.device)
    mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
    return mask.expand(batch, 1, seq_length, seq_length)


def causal_lm_loss(logits, labels, num_items_in_batch=None, shift_labels=None):
    """HF's ForCausalLMLoss: the labels shifted left by one (or `shift_labels`, already shifted),
    -100 ignored; the mean, or the sum over num_items_in_batch when it is given."""
    logits = logits.float()
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=-100)
        shift_labels = labels[..., 1:].contiguous()
    logits = logits.view(-1, logits.size(-1))
    shift_labels = shift_labels.view(-1).to(logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits, shift_labels, ignore_index=-100, reduction=reduction)
    if reduction == "sum":
        loss = loss / num_items_in_batch
    return loss


class GPT2LMHeadModel(nn.Module):
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tie_word_embeddings
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                std = config.initializer_range / math.sqrt(2 * config.n_layer)
                nn.init.normal_(param, mean=0.0, std=std)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, Conv1D)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(
        self,
        input_ids,
        position_ids=None,
        labels=None,
        num_items_in_batch=None,
        shift_labels=None,
        **kwargs,
    ):
        """-> (loss, logits); loss is None without labels (or shift_labels)."""
        hidden_states = self.transformer(input_ids, position_ids=position_ids, **kwargs)[0]
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None or shift_labels is not None:
            loss = causal_lm_loss(logits, labels, num_items_in_batch, shift_labels)
        return loss, logits


# ---------------------------------------------------------------------------------------------
# The training recipe every HF GPT-2 copy case shares, and the one process it is compared with.

CONFIG = GPT2Config()
STEPS = 3  # optimizer steps
ACCUMULATE = 2  # gradient_accumulation_steps
MICRO_BATCH = 8  # sequences a micro-batch, over all data-parallel ranks together
CLIP = 0.5  # max_grad_norm: below every step's gradient norm in the reference
OPTIMS = ("sgd", "adamw")
CONFIGS = {"": CONFIG, "eager-": GPT2Config(attn_implementation="eager")}  # prefix -> model
# The key third of c_attn.bias has a gradient that is mathematically zero (softmax does not see a
# key bias: it adds the same number to a query's every score); AdamW divides its round-off by its
# own size and steps it by up to lr, so two correct runs differ there by ~1e-4. An exactness check
# with AdamW leaves it out (compared_keys); SGD checks it to round-off.
KEY_BIAS = ("transformer.h.{}.attn.c_attn.bias", slice(CONFIG.n_embd, 2 * CONFIG.n_embd))


def model(config=CONFIG):
    torch.manual_seed(0)  # the same weights in every process
    return GPT2LMHeadModel(config)


def decay_parameter_names(model):
    """The Trainer's weight-decay rule: every parameter but biases and LayerNorm weights."""
    no_decay = set()
    for module_name, module in model.named_modules():
        if isinstance(module, nn.LayerNorm):
            no_decay.add(f"{module_name}.weight")
    return [
        name
        for name, _ in model.named_parameters()
        if name not in no_decay and not name.endswith("bias")
    ]


def make_optimizer(model, optim):
    """SGD with momentum over every parameter, or the Trainer's AdamW (two weight-decay groups)."""
    if optim == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    decay = set(decay_parameter_names(model))
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if n in decay],
            "weight_decay": 0.1,
        },
        {
            "params": [p for n, p in model.named_parameters() if n not in decay],
            "weight_decay": 0.0,
        },
    ]
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.999), eps=1e-8)


def batches(steps=STEPS):
    """`steps` step batches, each ACCUMULATE (input_ids, labels) micro-batches of MICRO_BATCH
    sequences of n_positions tokens of one fixed random bigram table (each token picks its
    successor among 2). labels are input_ids (the model shifts them), -100 past each document's
    random end, where input_ids are 0 (padding): ranks hold different counts of targets."""
    generator = torch.Generator().manual_seed(0)
    vocab = CONFIG.vocab_size
    seqlen = CONFIG.n_positions
    successors = torch.randint(vocab, (vocab, 2), generator=generator)
    result = []
    for _ in range(steps):
        micro_batches = []
        for _ in range(ACCUMULATE):
            input_ids = torch.empty(MICRO_BATCH, seqlen, dtype=torch.long)
            input_ids[:, 0] = torch.randint(vocab, (MICRO_BATCH,), generator=generator)
            for t in range(1, seqlen):
                choice = torch.randint(2, (MICRO_BATCH,), generator=generator)
                input_ids[:, t] = successors[input_ids[:, t - 1], choice]
            lengths = torch.randint(seqlen // 4, seqlen + 1, (MICRO_BATCH,), generator=generator)
            padding = torch.arange(seqlen) >= lengths.unsqueeze(1)
            input_ids[padding] = 0
            labels = input_ids.clone()
            labels[padding] = -100
            micro_batches.append((input_ids, labels))
        result.append(micro_batches)
    return result


def held_out():
    """An (input_ids, labels) micro-batch of the same table that no step trains on."""
    *_, last_step = batches(STEPS + 1)
    return last_step[0]


def num_items_in_batch(micro_batches):
    """The Trainer's count: the step's targets (labels after the shift, not -100), over every
    micro-batch and every rank (the Trainer gathers each rank's count; here every rank holds the
    whole step)."""
    return sum(int((labels[:, 1:] != -100).sum()) for _, labels in micro_batches)


def train(model, optimizer, step_batches, rank=0, world=1, clip=torch.nn.utils.clip_grad_norm_):
    """The Trainer's loop: per step ACCUMULATE backward passes on this rank's slice (rank of
    world) of each micro-batch, each of the model's loss with num_items_in_batch, times `world`
    (the data-parallel sections average gradients; the Trainer multiplies the same way), then
    `clip(model.parameters(), CLIP)`, the step. Returns (each step's loss: this rank's share of
    the global mean, the gradient norm each clip returned)."""
    losses = []
    norms = []
    for micro_batches in step_batches:
        num_items = num_items_in_batch(micro_batches)
        step_loss = 0.0
        for input_ids, labels in micro_batches:
            micro_loss, _ = model(
                input_ids.chunk(world)[rank],
                labels=labels.chunk(world)[rank],
                num_items_in_batch=num_items,
            )
            (micro_loss * world).backward()
            step_loss += micro_loss.item()
        losses.append(step_loss)
        norms.append(float(clip(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, norms


@torch.no_grad()
def evaluation_loss(model):
    input_ids, labels = held_out()
    loss, _ = model(input_ids, labels=labels)
    return loss.item()


def reference(optim, config=CONFIG):
    """One process on the whole of every micro-batch: (its state_dict, dict(losses, norms,
    eval_loss))."""
    gpt2 = model(config)
    optimizer = make_optimizer(gpt2, optim)
    losses, norms = train(gpt2, optimizer, batches())
    results = dict(losses=losses, norms=norms, eval_loss=evaluation_loss(gpt2))
    return gpt2.state_dict(), results


def compared_keys(state, optim):
    """(key, index) of what an exactness check compares: nanoGPT's choice (every tensor, but with
    AdamW the key third of each c_attn.bias) on this model's layers."""
    return nanogpt_model.compared_keys(state, optim, KEY_BIAS, CONFIG.n_layer)
