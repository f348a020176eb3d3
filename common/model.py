"""The model every script trains: a small Vision Transformer, optionally with MoE blocks."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.moe import MoE

IMAGE, CLASSES = 28, 10


class PatchEmbed(nn.Module):
    """Cut the image into patch x patch squares, project each to `dim`, add a learned position
    embedding: [B, 1, 28, 28] -> [B, tokens, dim] with tokens = (28/patch)^2."""

    def __init__(self, dim, patch=7):
        super().__init__()
        self.patch = patch
        self.tokens = (IMAGE // patch) ** 2
        self.proj = nn.Linear(patch * patch, dim)
        self.pos = nn.Parameter(torch.zeros(1, self.tokens, dim))

    def forward(self, img):
        B = img.shape[0]
        p = self.patch
        n = IMAGE // p  # patches along each side
        patches = img.reshape(B, n, p, n, p).transpose(2, 3).reshape(B, self.tokens, p * p)
        return self.proj(patches) + self.pos


class Attention(nn.Module):
    """Multi-head self-attention with separate q, k, v projections (split by heads under TP).

    The head count is read off q's output width, so a tensor-parallel rank whose q, k, v
    produce only its own heads runs this same code. The key projection has no bias: softmax
    ignores a constant added to every key score, so that bias would get a zero gradient.
    """

    def __init__(self, dim, heads):
        super().__init__()
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def split_heads(self, t):
        """[B, T, heads * head_dim] -> [B, heads, T, head_dim]"""
        B, T, _ = t.shape
        return t.view(B, T, -1, self.head_dim).transpose(1, 2)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.split_heads(self.q(x))
        k = self.split_heads(self.k(x))
        v = self.split_heads(self.v(x))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm Transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(
        self, dim, heads, mlp_ratio=4, experts=0, top_k=1, aux_loss=0.0, forwards_per_step=1
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        if experts:
            hidden = mlp_ratio * dim
            self.mlp = MoE(
                dim, [MLP(dim, hidden) for _ in range(experts)], top_k, aux_loss, forwards_per_step
            )
        else:
            self.mlp = MLP(dim, mlp_ratio * dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    """Final norm, mean over tokens, linear classifier."""

    def __init__(self, dim, classes=CLASSES):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, classes)

    def forward(self, x):
        return self.fc(self.norm(x).mean(1))


class ViT(nn.Module):
    """embed -> blocks[0..depth-1] -> head: a plain sequence, so a pipeline can cut it anywhere."""

    def __init__(
        self,
        dim=64,
        depth=4,
        heads=4,
        patch=7,
        experts=0,
        top_k=1,
        aux_loss=0.0,
        forwards_per_step=1,
    ):
        super().__init__()
        self.embed = PatchEmbed(dim, patch)
        self.blocks = nn.ModuleList(
            Block(dim, heads, 4, experts, top_k, aux_loss, forwards_per_step) for _ in range(depth)
        )
        self.head = Head(dim)

    def forward(self, img):
        x = self.embed(img)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(args, forwards_per_step=1):
    """The common model with weights that depend only on --seed (built on CPU, the same on every
    rank; on the meta device under --simulate). `forwards_per_step`: how many forwards one
    optimizer step sums, each with its loss divided by that count (micro-batches, accumulation
    steps); the MoE balance loss is divided the same way. The script that owns the flag passes
    it."""
    if args.simulate:  # shapes only, at any size: never built in memory (common/simulate.py)
        with torch.device("meta"):
            return _build_model(args, forwards_per_step)
    return _build_model(args, forwards_per_step)


def _build_model(args, forwards_per_step):
    torch.manual_seed(args.seed)
    model = ViT(
        args.dim,
        args.depth,
        args.heads,
        args.patch,
        args.experts,
        args.top_k,
        args.aux_loss,
        forwards_per_step,
    )
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    nn.init.trunc_normal_(model.embed.pos, std=0.02)
    return model


def saved_outside_blocks(args, batch):
    """E: the bytes autograd keeps for backward outside the blocks in one fp32 forward and loss of
    the common ViT on `batch` samples: the embedding's patches; the head's norm input, its mean and
    rstd, the pooled tokens; the log-probabilities, the int64 labels and the loss's 4-byte total
    weight. A checkpointed model keeps E + L·B·T·D·4."""
    tokens = (IMAGE // args.patch) ** 2
    return (
        4 * batch * (tokens * args.patch**2 + tokens * args.dim + 2 * tokens + args.dim + CLASSES)
        + 8 * batch
        + 4
    )
