"""The fourth copy-test model: a Llama 3 decoder laid out and trained as torchtitan lays it out and
trains it (github.com/pytorch/torchtitan, torchtitan/models/llama3 and its MoE variant), written
here. The copy modules take this class as a user's project has it and change none of its lines.

    tokens --tok_embeddings--> layers["0".."L-1"] (x, freqs_cis, positions) --norm--> output
    layer: h = x + attention(attention_norm(x)),  out = h + feed_forward(ffn_norm(h))  (or moe)
    attention: wqkv (fused, kv-group-major) -> RoPE on q, k at `positions` -> repeat kv heads
               -> F.scaled_dot_product_attention(is_causal=True) -> wo

What makes it Llama and not GPT-2: RoPE (a persistent complex buffer `freqs_cis`, indexed by each
token's position), grouped-query attention (n_kv_heads < n_heads), RMSNorm, SwiGLU (w1, w2, w3),
an untied output head, no biases. Its attention holds q, k and v in ONE Linear, `wqkv`, laid out
by kv group ([q heads of group 0 | k_0 | v_0 | q heads of group 1 | k_1 | v_1 | ...]), and a
state_dict hook saves it as the separate wq, wk, wv of Meta's checkpoints (a load hook joins them
again): a save that bypasses the model's own state_dict() writes keys no Llama loader knows.
With `moe_experts` > 0 every layer's feed-forward is a token-choice top-k MoE, `moe`: a router
`gate` (Linear) and `experts`, whose weights are stacked [E, ...] tensors run by a grouped matmul
(torchtitan's GroupedExperts), not a list of expert modules.

The training recipe below the model is torchtitan's: (input, labels) batches with labels shifted
by one and -100 where a document ended early (padding, unevenly spread over ranks), a loss summed
over the targets and divided by the step's GLOBAL count of targets (every rank's, every
micro-batch's), AdamW over one group, gradient accumulation, clip_grad_norm_ before every step.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------
# The model, as a user's project has it. Nothing below this line up to the recipe may be edited
# to fit a technique: the copy tests prove the sections take it as it is.


@dataclass
class ModelArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: 2 query heads share each key/value head
    vocab_size: int = 16
    multiple_of: int = 32  # the SwiGLU hidden width is rounded up to a multiple of this
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 16
    moe_experts: int = 0  # > 0: every layer's feed-forward is a mixture of this many experts
    moe_top_k: int = 1  # experts each token is routed to


def precompute_freqs_cis(dim, end, theta):
    """RoPE's rotations e^(i t θ_j) for positions t < end, as complex64 [end, dim / 2]
    (https://arxiv.org/abs/2104.09864)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def rotations_at(freqs_cis, positions, seqlen):
    """The rotations of each token, shaped to broadcast over [B, T, heads, head_dim / 2]: the first
    `seqlen` rows when positions is None, else the rows of `positions` ([T] or [B, T])."""
    if positions is None:
        return freqs_cis[:seqlen].view(1, seqlen, 1, -1)
    rotations = freqs_cis[positions]
    if positions.dim() == 1:
        return rotations.view(1, seqlen, 1, -1)
    return rotations.view(positions.shape[0], seqlen, 1, -1)


def apply_rotary_emb(xq, xk, rotations):
    """Rotate each pair of q's and k's channels by its token's angle (in fp32, as torchtitan)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * rotations).flatten(3)
    xk_out = torch.view_as_real(xk_ * rotations).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x, n_rep):
    """[B, T, n_kv_heads, head_dim] -> [B, T, n_kv_heads * n_rep, head_dim]: each kv head serves
    the n_rep query heads of its group."""
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    x = torch.unsqueeze(x, dim=3).expand(bs, slen, n_kv_heads, n_rep, head_dim)
    return x.reshape(bs, slen, n_kv_heads * n_rep, head_dim)


class Attention(nn.Module):
    """Grouped-query attention (https://arxiv.org/abs/2305.13245) with one fused projection laid
    out by kv group: rows [q heads of group g (n_rep of them) | k head g | v head g] for g = 0..
    n_kv_heads - 1. Saved as wq, wk, wv (Meta's layout) by a state_dict hook."""

    def __init__(self, args):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        rows = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.wqkv = nn.Linear(args.dim, rows, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)
        self.register_state_dict_post_hook(split_wqkv)
        self.register_load_state_dict_pre_hook(join_wqkv)

    def forward(self, x, freqs_cis, positions=None):
        bs, seqlen, _ = x.shape
        # [B, T, rows] -> [B, T, kv groups, n_rep + 2, head_dim]: each group's q heads, k and v
        qkv = self.wqkv(x).view(bs, seqlen, -1, self.n_rep + 2, self.head_dim)
        xq = qkv[:, :, :, : self.n_rep].reshape(bs, seqlen, -1, self.head_dim)
        xk = qkv[:, :, :, self.n_rep]
        xv = qkv[:, :, :, self.n_rep + 1]
        rotations = rotations_at(freqs_cis, positions, seqlen)
        xq, xk = apply_rotary_emb(xq, xk, rotations)
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        xq = xq.transpose(1, 2)  # [B, heads, T, head_dim]
        keys = keys.transpose(1, 2)
        values = values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, keys, values, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


def split_wqkv(module, state_dict, prefix, local_metadata):
    """state_dict post-hook: the fused wqkv.weight saved as Meta's wq.weight, wk.weight, wv.weight
    (heads in order, each group's q heads side by side)."""
    fused = state_dict.pop(prefix + "wqkv.weight")
    by_group = fused.view(module.n_kv_heads, module.n_rep + 2, module.head_dim, -1)
    dim = fused.shape[-1]
    state_dict[prefix + "wq.weight"] = by_group[:, : module.n_rep].reshape(-1, dim)
    state_dict[prefix + "wk.weight"] = by_group[:, module.n_rep].reshape(-1, dim)
    state_dict[prefix + "wv.weight"] = by_group[:, module.n_rep + 1].reshape(-1, dim)


def join_wqkv(module, state_dict, prefix, *args):
    """load_state_dict pre-hook: Meta's wq, wk, wv joined into the fused wqkv, by kv group."""
    if prefix + "wq.weight" not in state_dict:
        return
    wq = state_dict.pop(prefix + "wq.weight")
    wk = state_dict.pop(prefix + "wk.weight")
    wv = state_dict.pop(prefix + "wv.weight")
    dim = wq.shape[-1]
    q = wq.view(module.n_kv_heads, module.n_rep, module.head_dim, dim)
    k = wk.view(module.n_kv_heads, 1, module.head_dim, dim)
    v = wv.view(module.n_kv_heads, 1, module.head_dim, dim)
    state_dict[prefix + "wqkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, dim)


def ffn_hidden_dim(args):
    """Llama's SwiGLU width: 2/3 of 4 * dim, rounded up to a multiple of `multiple_of`."""
    hidden_dim = int(2 * (4 * args.dim) / 3)
    return args.multiple_of * ((hidden_dim + args.multiple_of - 1) // args.multiple_of)


class FeedForward(nn.Module):
    """SwiGLU (https://arxiv.org/abs/2002.05202): w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """E SwiGLU experts held as stacked weights: w1, w3 [E, hidden, dim], w2 [E, dim, hidden].
    forward takes the routed tokens sorted by expert and each expert's token count."""

    def __init__(self, dim, hidden_dim, num_experts):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x, num_tokens_per_expert):
        grouped = hasattr(F, "grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
        if grouped:
            return self.run_grouped_mm(x, num_tokens_per_expert)
        return self.run_for_loop(x, num_tokens_per_expert)

    def run_for_loop(self, x, num_tokens_per_expert):
        """One matmul per expert over its tokens: what torchtitan runs without a grouped GEMM."""
        counts = num_tokens_per_expert.tolist()
        outputs = []
        for expert, x_expert in enumerate(torch.split(x, counts, dim=0)):
            h = F.silu(x_expert @ self.w1[expert].transpose(-2, -1))
            h = h * (x_expert @ self.w3[expert].transpose(-2, -1))
            outputs.append(h @ self.w2[expert].transpose(-2, -1))
        return torch.cat(outputs, dim=0)

    def run_grouped_mm(self, x, num_tokens_per_expert):
        """All experts in one grouped GEMM (torch >= 2.14's public F.grouped_mm, bf16 on GPUs)."""
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        h = F.silu(F.grouped_mm(x, self.w1.transpose(-2, -1), offs=offsets))
        h = h * F.grouped_mm(x, self.w3.transpose(-2, -1), offs=offsets)
        return F.grouped_mm(h, self.w2.transpose(-2, -1), offs=offsets)


class MoE(nn.Module):
    """Token-choice top-k routing (https://arxiv.org/abs/2101.03961): the router `gate` scores every
    expert by softmax, each token goes to its top_k, and its outputs are summed weighted by their
    scores. The tokens are sorted by expert so that `experts` runs each expert's tokens together."""

    def __init__(self, args):
        super().__init__()
        self.top_k = args.moe_top_k
        self.gate = nn.Linear(args.dim, args.moe_experts, bias=False)
        self.experts = GroupedExperts(args.dim, ffn_hidden_dim(args), args.moe_experts)

    def forward(self, x):
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        scores = F.softmax(self.gate(x).float(), dim=-1)
        top_scores, selected = torch.topk(scores, k=self.top_k, dim=-1)  # [tokens, top_k]
        num_experts = self.experts.num_experts
        num_tokens_per_expert = torch.bincount(selected.view(-1), minlength=num_experts)
        # each (token, choice) pair in expert order; stable, so tokens keep their order within one
        order = torch.argsort(selected.view(-1), stable=True)
        token_indices = order // self.top_k
        routed_output = self.experts(x[token_indices], num_tokens_per_expert)
        routed_output = routed_output * top_scores.view(-1)[order].unsqueeze(-1).to(x.dtype)
        out = torch.zeros_like(x)
        out = out.scatter_add(0, token_indices.unsqueeze(-1).expand(-1, dim), routed_output)
        return out.view(bs, slen, dim)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id, args):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = args.moe_experts > 0
        if self.moe_enabled:
            self.moe = MoE(args)
        else:
            self.feed_forward = FeedForward(args.dim, ffn_hidden_dim(args))

    def forward(self, x, freqs_cis, positions=None):
        h = x + self.attention(self.attention_norm(x), freqs_cis, positions)
        if self.moe_enabled:
            return h + self.moe(self.ffn_norm(h))
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, init_std):
        """torchtitan's depth-scaled init: the output projections (wo, w2, w3) get a smaller std."""
        nn.init.trunc_normal_(self.attention.wqkv.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.attention.wo.weight, mean=0.0, std=init_std)
        ffn = self.moe.experts if self.moe_enabled else self.feed_forward
        if self.moe_enabled:
            nn.init.trunc_normal_(self.moe.gate.weight, mean=0.0, std=init_std)
            weights = (ffn.w1, ffn.w2, ffn.w3)
        else:
            weights = (ffn.w1.weight, ffn.w2.weight, ffn.w3.weight)
        nn.init.trunc_normal_(weights[0], mean=0.0, std=0.02)
        nn.init.trunc_normal_(weights[1], mean=0.0, std=init_std)
        nn.init.trunc_normal_(weights[2], mean=0.0, std=init_std)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # persistent, as torchtitan keeps it: it is in the state_dict and every checkpoint
        freqs_cis = precompute_freqs_cis(
            args.dim // args.n_heads, args.max_seq_len, args.rope_theta
        )
        self.register_buffer("freqs_cis", freqs_cis, persistent=True)
        self.layers = nn.ModuleDict()
        for layer_id in range(args.n_layers):
            self.layers[str(layer_id)] = TransformerBlock(layer_id, args)
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def init_weights(self):
        """torchtitan builds the model on the meta device and then calls this."""
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights(0.02 / (2 * (layer.layer_id + 1)) ** 0.5)
        self.norm.reset_parameters()
        final_out_std = self.args.dim**-0.5
        cutoff = 3 * final_out_std
        nn.init.trunc_normal_(self.output.weight, 0.0, final_out_std, -cutoff, cutoff)

    def forward(self, tokens, positions=None):
        """tokens [B, T] -> logits [B, T, vocab]; `positions` ([T] or [B, T], default 0..T-1) are
        the rows of freqs_cis each token is rotated by."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis, positions)
        h = self.norm(h)
        return self.output(h)


def loss(logits, targets, num_items=None):
    """Cross entropy over the targets that are not -100 (in fp32): their mean, or, given
    `num_items`, their sum divided by it (a global count of targets, so that ranks holding fewer
    valid targets are not over-weighted)."""
    logits = logits.flatten(0, 1).float()
    targets = targets.flatten(0, 1)
    if num_items is None:
        return F.cross_entropy(logits, targets, ignore_index=-100)
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum") / num_items


# ---------------------------------------------------------------------------------------------
# The training recipe every Llama copy case shares, and the one process it is compared with.

ARGS = ModelArgs()
MOE_ARGS = ModelArgs(moe_experts=4, moe_top_k=2)
STEPS = 3  # optimizer steps
ACCUMULATE = 2  # micro-batches a step
MICRO_BATCH = 8  # sequences a micro-batch, over all data-parallel ranks together
CLIP = 0.5  # max_norm: below every step's gradient norm in the reference, so every step clips
OPTIMS = ("sgd", "adamw")
ARGS_BY_PREFIX = {"": ARGS, "moe-": MOE_ARGS}  # a reference's prefix -> its model


def model(args=ARGS):
    """The model every process builds: the same weights everywhere (seeded), as torchtitan's
    seeded init_weights gives them."""
    torch.manual_seed(0)
    transformer = Transformer(args)
    transformer.init_weights()
    return transformer


def make_optimizer(model, optim):
    """SGD with momentum, or torchtitan's AdamW: one group, weight decay on every parameter."""
    if optim == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return torch.optim.AdamW(
        model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
    )


def batches(steps=STEPS):
    """`steps` step batches, each ACCUMULATE (input, labels) micro-batches of MICRO_BATCH sequences
    of max_seq_len tokens of one fixed random bigram table (each token picks its successor among
    2); labels are the input shifted by one. Each document has a random length: past its end the
    input is 0 (padding) and the labels -100, so that ranks hold different counts of targets."""
    generator = torch.Generator().manual_seed(0)
    vocab = ARGS.vocab_size
    seqlen = ARGS.max_seq_len
    successors = torch.randint(vocab, (vocab, 2), generator=generator)
    result = []
    for _ in range(steps):
        micro_batches = []
        for _ in range(ACCUMULATE):
            tokens = torch.empty(MICRO_BATCH, seqlen + 1, dtype=torch.long)
            tokens[:, 0] = torch.randint(vocab, (MICRO_BATCH,), generator=generator)
            for t in range(1, seqlen + 1):
                choice = torch.randint(2, (MICRO_BATCH,), generator=generator)
                tokens[:, t] = successors[tokens[:, t - 1], choice]
            lengths = torch.randint(seqlen // 4, seqlen + 1, (MICRO_BATCH,), generator=generator)
            inputs = tokens[:, :-1].clone()
            labels = tokens[:, 1:].clone()
            padding = torch.arange(seqlen) >= lengths.unsqueeze(1)
            inputs[padding] = 0
            labels[padding] = -100
            micro_batches.append((inputs, labels))
        result.append(micro_batches)
    return result


def held_out():
    """An (input, labels) micro-batch of the same table that no step trains on."""
    *_, last_step = batches(STEPS + 1)
    return last_step[0]


def global_targets(micro_batches):
    """The step's count of targets: every micro-batch's, every rank's (a user with a data loader
    per rank all-reduces each rank's count; here every rank holds the whole step)."""
    return sum(int((labels != -100).sum()) for _, labels in micro_batches)


def train(model, optimizer, step_batches, rank=0, world=1, clip=torch.nn.utils.clip_grad_norm_):
    """torchtitan's loop: per step ACCUMULATE backward passes on this rank's slice (rank of world)
    of each micro-batch, each of loss(..., num_items=the step's global count of targets) * world
    (the data-parallel sections average gradients over their ranks; HF's Trainer multiplies the
    same way), `clip(model.parameters(), CLIP)`, the step. Returns (each step's loss: this rank's
    share of the global mean, the gradient norm each clip returned)."""
    losses = []
    norms = []
    for micro_batches in step_batches:
        num_items = global_targets(micro_batches)
        step_loss = 0.0
        for inputs, labels in micro_batches:
            logits = model(inputs.chunk(world)[rank])
            micro_loss = loss(logits, labels.chunk(world)[rank], num_items)
            (micro_loss * world).backward()
            step_loss += micro_loss.item()
        losses.append(step_loss)
        norms.append(float(clip(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, norms


@torch.no_grad()
def evaluation_loss(model):
    inputs, labels = held_out()
    return loss(model(inputs), labels).item()


def reference(optim, args=ARGS):
    """One process on the whole of every micro-batch: (its state_dict, dict(losses, norms,
    eval_loss))."""
    transformer = model(args)
    optimizer = make_optimizer(transformer, optim)
    losses, norms = train(transformer, optimizer, batches())
    results = dict(losses=losses, norms=norms, eval_loss=evaluation_loss(transformer))
    return transformer.state_dict(), results
