"""Context parallelism: each of W ranks holds the whole model and T/W tokens of every sample of the
whole batch. Only attention needs the other tokens: ring attention (Liu et al. 2023) passes K/V blocks
around a ring and merges them with the online softmax; DeepSpeed-Ulysses (Jacobs et al. 2023) turns
the token split into a head split with an all-to-all for attention, and back. Embedding, norms, MLPs
and head run on the local tokens; the head all-reduces the token sums; gradients are summed.

    ring, W = 4: rank r holds Q_r; at step s it holds the K/V block of rank r - s
        step:    0     1     2     3        each step: post send K/V to r+1 and receive from r-1
        rank 0:  KV0   KV3   KV2   KV1      (one batch), compute with the block in hand, wait
        rank 1:  KV1   KV0   KV3   KV2
    merge block j (per query, S_j = Q·K_jᵀ/√d):  m' = max(m, rowmax S_j),  l' = l·e^(m-m') + rowsum e^(S_j-m'),
        O' = O·e^(m-m') + e^(S_j-m')·V_j;  at the end out = O / l, and lse = m + log l is kept for backward
    ulysses:  [B, T/W, H, d] --all-to-all--> [B, T, H/W, d] --attention--> --all-to-all--> [B, T/W, H, d]

Memory per rank (fp32): 16Ψ (parameters, gradients, AdamW) as DDP; every activation / W, attention's
(24·B·T·D + 4·B·H·T)/W bytes a block (its input, q, k, v, out, proj input; lse). Ring never holds
T×T scores: one (T/W)×(T/W) block a step, recomputed from lse in backward; Ulysses' kernel sees T×T
for H/W heads. Communication per step, a K/V block being 2·B·(T/W)·D fp32: ring sends W-1 blocks a
block forward and 2(W-1) backward (K/V again, dK/dV partial sums), Ulysses 4 all-to-alls of B·T·D/W
forward and 4 backward; both all-reduce B·D pooled features and the Ψ - Ψ_fc summed gradients.

    torchrun --standalone --nproc_per_node=4 context_parallel.py --patch 2 --method ring
    python context_parallel.py --nproc 2 --patch 2 --method ulysses     # through mp.spawn on a free port
"""
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

import common

SCRIPT = os.path.splitext(os.path.basename(__file__))[0]


### begin: Context parallel
# Model contract: `model.embed` (proj: nn.Linear on patch² pixels, pos [1, T, D], patch) -> [B, T, D] ->
# `model.blocks` (x + attn(norm1(x)), x + mlp(norm2(x)); nn.Linear attn.q/k/v/proj, attn.head_dim)
# -> `model.head` (fc(norm(x).mean(1))), the same weights on every rank, on this rank's device.

def ring_pass(tensors, group):
    """Post, in one batch, the send of `tensors` to the next rank and the receive of as many from the
    previous one (one batch: NCCL blocks a send until its receive is posted). Returns (buffers, requests)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nxt, prv = (dist.get_global_rank(group, (rank + i) % world) for i in (1, -1))
    bufs = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors] + \
          [dist.P2POp(dist.irecv, b, prv, group) for b in bufs]
    return bufs, dist.batch_isend_irecv(ops) if ops else []


class RingAttention(torch.autograd.Function):
    """softmax(q·kᵀ/√d)·v over the whole sequence; q, k, v, out: [B, H, T/W, d], this rank's tokens."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        world, scale = dist.get_world_size(group), q.shape[-1] ** -0.5
        kv, out = torch.stack([k, v]), torch.zeros_like(q)    # out in q's layout: proj reads it without a copy
        m, l = q.new_full((*q.shape[:-1], 1), -float("inf")), q.new_zeros((*q.shape[:-1], 1))
        for step in range(world):                # step s: the K/V block of rank - s
            bufs, reqs = ring_pass([kv] if step + 1 < world else [], group)    # post the next block's transfer,
            s = q @ kv[0].transpose(-2, -1) * scale                             # compute on this one,
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            p, c = torch.exp(s - m_new), torch.exp(m - m_new)
            l, out, m = l * c + p.sum(-1, keepdim=True), out * c + p @ kv[1], m_new
            for r in reqs:                                                       # then wait
                r.wait()
            kv = bufs[0] if bufs else kv
        out = out / l
        ctx.save_for_backward(q, k, v, out, m + l.log())     # the log-sum-exp: recomputes p block by block
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, world, scale = ctx.group, dist.get_world_size(ctx.group), q.shape[-1] ** -0.5
        delta = (dout * out).sum(-1, keepdim=True)            # rowsum(dO ∘ O) = Σ_j p_ij dp_ij
        kv, dq, own, acc = torch.stack([k, v]), torch.zeros_like(q), None, None
        for step in range(world):
            # Post the next K/V block, and (from step 2) pass on the dK/dV accumulated at the last step:
            # it belongs to the block the next rank holds now.
            bufs, reqs = ring_pass(([kv] if step + 1 < world else []) + ([acc] if step >= 2 else []), group)
            p = torch.exp(q @ kv[0].transpose(-2, -1) * scale - lse)
            ds = p * (dout @ kv[1].transpose(-2, -1) - delta) * scale
            dq += ds @ kv[0]
            dkv = torch.stack([ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ dout])
            for r in reqs:
                r.wait()
            if step == 0:
                own = dkv                        # this rank's own block: kept until the rest comes home
            else:
                acc = dkv if step == 1 else dkv + bufs[-1]
            kv = bufs[0] if step + 1 < world else kv
        if world > 1:                            # the last partial sum goes home: W - 1 dK/dV hops in all
            (home,), reqs = ring_pass([acc], group)
            for r in reqs:
                r.wait()
            own = own + home
        return dq, own[0], own[1], None


def all_to_all(x, group, scatter, gather):
    """Chunk j of dim `scatter` goes to rank j; the W chunks received are joined along dim `gather`."""
    x = torch.stack(x.chunk(dist.get_world_size(group), scatter))
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return torch.cat(out.unbind(0), gather)


class AllToAll(torch.autograd.Function):          # the gradient goes back the opposite way
    @staticmethod
    def forward(ctx, x, group, scatter, gather):
        ctx.back = group, gather, scatter
        return all_to_all(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, *ctx.back), None, None, None


class ContextParallelAttention(nn.Module):
    """The block's attention on this rank's T/W tokens; the same q, k, v, proj (same state_dict keys)."""

    def __init__(self, attn, method, group):
        super().__init__()
        self.q, self.k, self.v, self.proj, self.head_dim = attn.q, attn.k, attn.v, attn.proj, attn.head_dim
        self.method, self.group = method, group

    def forward(self, x):                        # x: [B, T/W, D]
        B, t, D = x.shape
        q, k, v = (lin(x).view(B, t, -1, self.head_dim) for lin in (self.q, self.k, self.v))
        if self.method == "ring":
            out = RingAttention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.group)
            out = out.transpose(1, 2)
        else:                                    # [B, T/W, H, d] -> [B, T, H/W, d] and back
            q, k, v = (AllToAll.apply(t, self.group, 2, 1).transpose(1, 2) for t in (q, k, v))
            out = AllToAll.apply(F.scaled_dot_product_attention(q, k, v).transpose(1, 2), self.group, 1, 2)
        return self.proj(out.reshape(B, t, D))


class LocalPatchEmbed(nn.Module):
    """This rank's T/W tokens only (a contiguous run of patches) and their position embeddings."""

    def __init__(self, embed, rank, world):
        super().__init__()
        self.proj, self.pos, self.patch, t = embed.proj, embed.pos, embed.patch, embed.pos.shape[1] // world
        self.mine = slice(rank * t, (rank + 1) * t)

    def forward(self, img):
        B, p, n = img.shape[0], self.patch, img.shape[-1] // self.patch
        patches = img.reshape(B, n, p, n, p).transpose(2, 3).reshape(B, n * n, p * p)
        return self.proj(patches[:, self.mine]) + self.pos[:, self.mine]


class SumOverRanks(torch.autograd.Function):
    """All-reduce forward, identity backward: every rank computes the same loss from the sum, so the
    gradient arriving here is dL/d(sum) on every rank, which is also each rank's own term's."""
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ContextParallelHead(nn.Module):
    """fc(mean of norm(x) over all T tokens), the mean being the all-reduced token sums / T."""

    def __init__(self, head, tokens, group):
        super().__init__()
        self.norm, self.fc, self.tokens, self.group = head.norm, head.fc, tokens, group

    def forward(self, x):
        return self.fc(SumOverRanks.apply(self.norm(x).sum(1), self.group) / self.tokens)


def parallelize(model, device, method="ring", group=None):
    """Every rank keeps the whole model and runs it on its T/W tokens of every sample."""
    group = group or dist.group.WORLD
    rank, world, tokens = dist.get_rank(group), dist.get_world_size(group), model.embed.pos.shape[1]
    model.embed = LocalPatchEmbed(model.embed, rank, world)
    for block in model.blocks:
        block.attn = ContextParallelAttention(block.attn, method, group)
    model.head = ContextParallelHead(model.head, tokens, group)
    # Every weight outside the classifier met only this rank's tokens: its gradient is this rank's part
    # of a sum over all T tokens, so the SUM of the W parts (not the mean) is the whole gradient. The
    # classifier saw the all-reduced mean on every rank: its gradient is already whole and the same.
    # When backward has accumulated the last part, all-reduce them in one flat buffer.
    partial, ready = [p for p in model.parameters() if all(p is not q for q in model.head.fc.parameters())], []

    def sum_partial_grads(p):
        ready.append(p)
        if len(ready) == len(partial):
            ready.clear()
            flat = torch.cat([q.grad.flatten() for q in partial])
            dist.all_reduce(flat, group=group)
            for q, g in zip(partial, flat.split([q.numel() for q in partial])):
                q.grad.copy_(g.view_as(q))
    for p in partial:
        p.register_post_accumulate_grad_hook(sum_partial_grads)
    return model


def full_state_dict(model):
    """The plain state_dict of the common model: every rank holds it whole."""
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}
### end: Context parallel


def formula(psi, world, args):
    """The paper's per-rank bytes, which the report sets next to what the Meter measured."""
    k, d, B, D, T = (8 if args.optim == "adamw" else 4), args.depth, args.batch_size, args.dim, (common.IMAGE // args.patch) ** 2
    acts = 5 if args.method == "ring" else 6                    # [B, T/W, D] tensors attention saves
    kv = 8 * B * T * D // world                                 # one K/V block: [2, B, T/W, D] fp32
    comm = dict(send=3 * (world - 1) * d * kv, recv=3 * (world - 1) * d * kv) if args.method == "ring" \
        else dict(all_to_all=8 * d * 4 * B * T * D // world)
    comm = dict({k: v for k, v in comm.items() if v}, all_reduce=4 * (B * D + psi - (D + 1) * common.CLASSES))
    return dict(param_bytes=4 * psi, grad_bytes=4 * psi, optim_bytes=k * psi, comm=comm,
                act_bytes_attention=d * (acts * 4 * B * T * D + 4 * B * args.heads * T) // world,
                notes=dict(param_bytes="4Ψ replicated", grad_bytes="4Ψ replicated", optim_bytes=f"{k}Ψ",
                           act_bytes_attention=f"depth·({4 * acts}·B·T·D + 4·B·H·T)/W", send="3(W-1)·depth K/V blocks",
                           recv="3(W-1)·depth K/V blocks", all_to_all="8·depth x B·T·D/W",
                           all_reduce="B·D pooled + Ψ - Ψ_fc gradients"))


def check_args(args, world):
    tokens = (common.IMAGE // args.patch) ** 2
    common.check(tokens % world == 0, f"--patch {args.patch} gives {tokens} tokens, which the {world} context-parallel "
                                      f"ranks cannot split evenly")
    common.check(args.method == "ring" or args.heads % world == 0,
                 f"--method ulysses: --heads {args.heads} is not divisible by the {world} ranks, each of which "
                 f"attends with whole heads")


def setup(args):
    """Join the process group. torchrun (or common.launch) put RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT in the environment; LOCAL_RANK picks this process's GPU."""
    backend, device = common.pick_backend(args.backend)    # NCCL and a GPU per rank, else Gloo on the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=args.timeout)
    # torchrun keeps one store across restarts (--max-restarts): prefix it per attempt, or a
    # restarted rank may read the address of a worker that died in the last attempt and hang.
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return rank, world, device, backend


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def train(model, optimizer, scheduler, loader, sampler, args, device, step=0):
    """The loop every script shares: forward, loss, backward, step, schedule, log."""
    stop, world = args.max_steps or float("inf"), dist.get_world_size()
    loss_sum, loss_n, last_loss, steps_run, t_train = torch.zeros((), device=device), 0, float("nan"), 0, 0.0
    for epoch in range(step // len(loader), args.epochs):
        if step >= stop:
            break
        sampler.set_epoch(epoch)                   # a new shuffle each epoch, the same on every rank
        loader.dataset.set_epoch(epoch)            # and new augmentations (--shift), the same everywhere
        model.train()
        t0 = time.perf_counter()
        bar = common.progress(loader, args, epoch)
        for i, (x, y) in enumerate(bar):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            loss_sum, loss_n, step, steps_run = loss_sum + loss.detach(), loss_n + 1, step + 1, steps_run + 1
            if step % args.log_every == 0 or step >= stop or i + 1 == len(loader):
                dist.all_reduce(loss_sum)          # every rank's loss is the whole batch's: W equal values
                last_loss, loss_sum, loss_n = loss_sum.item() / world / loss_n, loss_sum * 0, 0
                common.log_loss(bar, args, epoch, step, last_loss)
            if step >= stop:
                break
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_train += time.perf_counter() - t0
        common.log(f"epoch {epoch}: step {step}, train loss {last_loss:.4f}")
    return dict(steps=step, steps_run=steps_run, loss=last_loss, train_time=t_train)


@torch.no_grad()
def evaluate(model, loader, device):
    """Exact: the loader pads every rank to the same number of batches (padding masked out), so
    every rank runs the same forward passes and collectives and each sample counts once."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=device)
    for x, y, keep in loader:
        x, y, keep = x.to(device), y.to(device), keep.to(device)
        counts += torch.stack([((model(x).argmax(1) == y) & keep).sum(), keep.sum()])
    dist.all_reduce(counts)
    return counts[0].item() / max(counts[1].item(), 1)


def run(args):
    """One rank, in the seeds' order: join the group, deal the data, build the model, wrap it,
    train, evaluate, save on rank 0, leave the group."""
    rank, world, device, backend = setup(args)
    try:
        train_set, test_set, source = common.load_data(args, device)
        dp_rank, dp_world = 0, 1                   # CP: every rank sees the whole batch (its T/W tokens)
        sampler = DistributedSampler(train_set, num_replicas=dp_world, rank=dp_rank, shuffle=True,
                                     seed=args.seed, drop_last=True)
        loader = DataLoader(train_set, batch_size=args.batch_size // dp_world, sampler=sampler, drop_last=True,
                            pin_memory=device.type == "cuda")
        common.check(len(loader) > 0, f"{len(train_set)} training samples make no full batch of {args.batch_size}")
        model = common.build_model(args)           # the same seeded weights on every rank
        if args.load:
            model.load_state_dict(common.load_state_dict_file(args.load, model.state_dict()))
        psi = sum(p.numel() for p in model.parameters())
        model = parallelize(model.to(device), device, args.method)
        optimizer = common.make_optimizer(model.parameters(), args)
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        common.log(f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data ({len(train_set)} train / "
                   f"{len(test_set)} test), batch {args.batch_size} = {dp_world} x {args.batch_size // dp_world}")
        with common.Meter(model, optimizer, args, parts=dict(attention=[b.attn for b in model.blocks])) as meter:
            out = train(model, optimizer, scheduler, loader, sampler, args, device)
        acc = evaluate(model, common.test_loader(test_set, dp_rank, dp_world, pin_memory=device.type == "cuda"),
                       device)
        state = full_state_dict(model)             # every rank takes part; rank 0 holds the whole
        if rank == 0 and args.save:
            common.save_checkpoint(state, args.save)
            common.log(f"saved {args.save}")
        common.report(SCRIPT, args, world, backend, device, source, psi, out, acc, meter, formula(psi, world, args))
    finally:
        cleanup()


def main():
    parser = common.get_parser("Context parallelism (ring attention, DeepSpeed-Ulysses) on the common ViT, written out")
    parser.add_argument("--method", choices=["ring", "ulysses"], default="ring",
                        help="ring: K/V blocks around a ring; ulysses: all-to-all tokens <-> heads")
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
