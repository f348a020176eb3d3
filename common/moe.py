"""The mixture-of-experts layer (router, experts, balance loss) of the ViT built with --experts."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Experts(nn.ModuleList):
    """E expert modules, called as torchtitan's MoE calls its experts: rows [N, D] grouped by
    expert (expert 0's counts[0] rows first, then expert 1's, ...) and counts [E] -> each row's
    expert output, [N, D], in the same order.

    Every expert runs, also on no row, so each always has a gradient (zero if it got no token),
    as DDP and ZeRO expect of every parameter. One host sync (the rows per expert) per call.
    expert_parallel.py's parallelize keeps this rank's E/W of them and routes the rows around
    this forward: it then runs on the rows its experts received, with their E/W counts."""

    def forward(self, rows, counts):
        chunks = rows.split(counts.tolist())  # the one host sync
        return torch.cat([expert(chunk) for expert, chunk in zip(self, chunks, strict=True)])


class AuxLossScaler(torch.autograd.Function):
    """Returns x unchanged; in backward also gives `aux` the gradient `scale` (Megatron-LM's
    MoEAuxLossAutoScaler), as if aux * scale had been added to the loss the loop backpropagates."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_full((), ctx.scale), None


class MoE(nn.Module):
    """Mixture of experts in place of the MLP: a linear router scores the E experts for each token;
    each token goes to its top K, mixed by the softmax over the K chosen scores. The (token, slot)
    rows are sorted by expert and run by `experts` as torchtitan's MoE runs its GroupedExperts
    (rows, counts per expert), the E from the router's width. No capacity limit, no dropped
    token: the output does not depend on how tokens are grouped into batches or ranks.

    Load balance: DeepSeek-V3's sequence-wise auxiliary loss, per sample (an image, a sequence) of
    T tokens: f_i = E/(K*T) * (the sample's tokens routed to expert i; no gradient), P_i = the mean
    over its tokens of the router's full softmax for expert i; aux = coef * sum_i f_i * P_i,
    averaged over the samples. A per-sample mean is what makes it exact across ranks and
    micro-batches: a batch-wise (Switch) loss over the whole batch would make W=2 differ from W=1.
    The loop's loss stays the task's (and so does the printed train loss): the aux term's gradient
    is added in backward by AuxLossScaler, attached to the routing weights, scaled by
    1/forwards_per_step because the loop divides each micro-batch's loss by the micro-batch count
    (gradient accumulation, pipeline micro-batches); averaging the gradients over ranks does the
    rest."""

    def __init__(self, dim, experts, top_k, aux_loss=0.0, forwards_per_step=1):
        super().__init__()
        experts = Experts(experts)
        self.top_k = top_k
        self.aux_loss = aux_loss
        self.forwards_per_step = forwards_per_step
        self.router = nn.Linear(dim, len(experts), bias=False)
        self.experts = experts

    def forward(self, x):
        batch, tokens_per_sample, dim = x.shape
        tokens = x.reshape(batch * tokens_per_sample, dim)
        logits = self.router(tokens)  # [B*T, E]
        top_logits, chosen = logits.topk(self.top_k, dim=-1)
        weights = top_logits.softmax(-1)
        if self.training and self.aux_loss and torch.is_grad_enabled():
            aux = self.balance_loss(logits, chosen, batch, tokens_per_sample)
            weights = AuxLossScaler.apply(weights, aux, 1.0 / self.forwards_per_step)
        num_tokens, top_k = chosen.shape
        slots = chosen.reshape(-1)  # [N * K]: the expert of each (token, slot)
        by_expert = slots.argsort(stable=True)  # slots grouped by expert, token order kept
        # tokens per expert: scatter_add_, not bincount, which waits for the device on CUDA
        counts = torch.zeros(self.router.out_features, dtype=torch.long, device=slots.device)
        counts.scatter_add_(0, slots, torch.ones_like(slots))
        outputs = self.experts(tokens[by_expert // top_k], counts)
        outputs = torch.empty_like(outputs).index_copy(0, by_expert, outputs)  # slot order again
        mixed = (weights.unsqueeze(-1) * outputs.view(num_tokens, top_k, -1)).sum(1)
        return mixed.view(batch, tokens_per_sample, dim)

    def balance_loss(self, logits, chosen, batch, tokens_per_sample):
        """coef * sum_i f_i * P_i per sample, averaged over the samples (the class docstring)."""
        E = logits.shape[-1]
        K = self.top_k
        T = tokens_per_sample
        routed = F.one_hot(chosen, E).view(batch, T * K, E).sum(1)  # [B, E] tokens per expert
        f = routed * (E / (K * T))  # no gradient: counts
        P = logits.softmax(-1).view(batch, T, E).mean(1)
        return self.aux_loss * (f * P).sum(-1).mean()
