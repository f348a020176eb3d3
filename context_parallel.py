"""Context parallelism: each of W ranks holds the whole model and T/W tokens of every sample (the whole
batch); only attention needs the others. Ring attention (Liu et al. 2023) passes K/V blocks around a ring,
merged by the online softmax; DeepSpeed-Ulysses (Jacobs et al. 2023) all-to-alls the token split into a
head split for attention, and back. The rest runs on local tokens; gradients are summed.

    ring, W = 4, rank r holds Q_r:   step  0    1    2    3     each step: post the send of K/V to r+1 and
                             rank 0:     KV0  KV3  KV2  KV1     the receive from r-1 (one batch), compute
                             rank 1:     KV1  KV0  KV3  KV2     with the block in hand, then wait
    merge block j (per query, S_j = Q·K_jᵀ/√d):  m' = max(m, rowmax S_j),  l' = l·e^(m-m') + rowsum e^(S_j-m'),
        O' = O·e^(m-m') + e^(S_j-m')·V_j;  at the end out = O / l, and lse = m + log l is kept for backward
    ulysses:  [B, T/W, H, d] --all-to-all--> [B, T, H/W, d] --attention--> --all-to-all--> [B, T/W, H, d]

Memory per rank (fp32): 16Ψ as DDP; activations / W: attention's (4a·B·T·D + 4·B·H·T)/W bytes a block, a = 5
[B, T/W, D] tensors (input, q, k, v, out) for ring, 6 for Ulysses (+ proj input), and lse. Ring never holds
T×T scores: one (T/W)² block a step, recomputed from lse in backward; Ulysses' kernel sees T×T for H/W
heads. Communication per step (K/V block: 2·B·(T/W)·D fp32): ring sends W-1 blocks per attention forward,
2(W-1) backward (K/V again, dK/dV partial sums); Ulysses 4 all-to-alls of B·T·D/W forward, 4 backward;
both all-reduce B·D pooled features (the head) and, as DDP, Ψ gradients.

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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

import common

SCRIPT = os.path.splitext(os.path.basename(__file__))[0]


### begin: Context parallel
# Model contract: `model.embed` (proj on patch² pixels, pos [1, T, D], patch) -> `model.blocks` (attn.q/k/v/
# proj nn.Linear, attn.head_dim) -> `model.head` (fc(norm(x).mean(1))), the same weights on every rank.


def ring_pass(tensors, group):
    """Post, in one batch, the send of `tensors` to the next rank and the receive of as many from the
    previous one (one batch: NCCL blocks a send until its receive is posted). Returns recv(): wait, get them."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nxt, prv = (dist.get_global_rank(group, (rank + i) % world) for i in (1, -1))
    bufs = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors] + [
        dist.P2POp(dist.irecv, b, prv, group) for b in bufs
    ]
    reqs = dist.batch_isend_irecv(ops) if ops else []
    return lambda: ([r.wait() for r in reqs], bufs)[1]


class RingAttention(torch.autograd.Function):
    """softmax(q·kᵀ/√d)·v over the whole sequence; q, k, v, out: [B, H, T/W, d], this rank's tokens."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        world, scale, ctx.group = dist.get_world_size(group), q.shape[-1] ** -0.5, group
        kv, out = (
            torch.stack([k, v]),
            torch.zeros_like(q),
        )  # out in q's layout: proj reads it without a copy
        m, l = q.new_full((*q.shape[:-1], 1), -float("inf")), q.new_zeros((*q.shape[:-1], 1))
        for step in range(world):  # step s: the K/V block of rank - s
            recv = ring_pass(
                [kv] if step + 1 < world else [], group
            )  # post the next block's transfer,
            s = q @ kv[0].transpose(-2, -1) * scale  # compute on this one,
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            p, c = torch.exp(s - m_new), torch.exp(m - m_new)
            l, out, m = l * c + p.sum(-1, keepdim=True), out * c + p @ kv[1], m_new
            kv = recv()[0] if step + 1 < world else kv  # then wait for it
        out = out / l
        ctx.save_for_backward(
            q, k, v, out, m + l.log()
        )  # the log-sum-exp: recomputes p block by block
        return out

    @staticmethod  # flash-attention's backward, one K/V block at a time
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, world, scale = ctx.group, dist.get_world_size(ctx.group), q.shape[-1] ** -0.5
        delta = (dout * out).sum(-1, keepdim=True)  # rowsum(dO ∘ O) = Σ_j p_ij dp_ij
        kv, dq, own, acc = torch.stack([k, v]), torch.zeros_like(q), None, None
        for step in range(
            world
        ):  # post the next K/V block and the last step's dK/dV (to its block)
            recv = ring_pass(
                ([kv] if step + 1 < world else []) + ([acc] if step >= 2 else []), group
            )
            p = torch.exp(q @ kv[0].transpose(-2, -1) * scale - lse)
            ds = p * (dout @ kv[1].transpose(-2, -1) - delta) * scale
            dq += ds @ kv[0]
            dkv = torch.stack([ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ dout])
            bufs = recv()  # own: this rank's block, kept until the rest comes home
            own, acc = (dkv, None) if step == 0 else (own, dkv if step == 1 else dkv + bufs[-1])
            kv = bufs[0] if step + 1 < world else kv
        if world > 1:  # the last partial sum goes home: W - 1 dK/dV hops in all
            own = own + ring_pass([acc], group)()[0]
        return dq, own[0], own[1], None


def all_to_all(x, group, scatter, gather):
    """Chunk j of dim `scatter` goes to rank j; the W chunks received are joined along dim `gather`."""
    x = torch.stack(x.chunk(dist.get_world_size(group), scatter))
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return torch.cat(out.unbind(0), gather)


class AllToAll(torch.autograd.Function):  # the gradient goes back the opposite way
    @staticmethod
    def forward(ctx, x, group, scatter, gather):
        ctx.back = group, gather, scatter
        return all_to_all(x, group, scatter, gather)

    backward = staticmethod(lambda ctx, grad: (all_to_all(grad, *ctx.back), None, None, None))


class ContextParallelAttention(nn.Module):
    """The block's attention on this rank's T/W tokens; the same q, k, v, proj (same state_dict keys)."""

    def __init__(self, attn, method, group):
        super().__init__()
        self.q, self.k, self.v, self.proj, self.head_dim = (
            attn.q,
            attn.k,
            attn.v,
            attn.proj,
            attn.head_dim,
        )
        self.method, self.group = method, group

    def forward(self, x):  # x: [B, T/W, D]
        B, n, D = x.shape
        q, k, v = (lin(x).view(B, n, -1, self.head_dim) for lin in (self.q, self.k, self.v))
        if self.method == "ring":  # [B, H, T/W, d] in, out
            out = RingAttention.apply(
                *(t.transpose(1, 2) for t in (q, k, v)), self.group
            ).transpose(1, 2)
        else:  # [B, T/W, H, d] -> [B, T, H/W, d] and back
            q, k, v = (AllToAll.apply(t, self.group, 2, 1).transpose(1, 2) for t in (q, k, v))
            out = AllToAll.apply(
                F.scaled_dot_product_attention(q, k, v).transpose(1, 2), self.group, 1, 2
            )
        return self.proj(out.reshape(B, n, D))


class LocalPatchEmbed(nn.Module):
    """This rank's T/W tokens only (a contiguous run of patches) and their position embeddings."""

    def __init__(self, embed, mine):
        super().__init__()
        self.proj, self.pos, self.patch, self.mine = embed.proj, embed.pos, embed.patch, mine

    def forward(self, img):
        B, p, n = img.shape[0], self.patch, img.shape[-1] // self.patch
        patches = img.reshape(B, n, p, n, p).transpose(2, 3).reshape(B, n * n, p * p)
        return self.proj(patches[:, self.mine]) + self.pos[:, self.mine]


class SumOverRanks(torch.autograd.Function):
    """All-reduce forward; backward W·grad: the all-reduce of the W ranks' gradients, equal (same loss)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.world, x = dist.get_world_size(group), x.clone()
        dist.all_reduce(x, group=group)
        return x

    backward = staticmethod(lambda ctx, grad: (grad * ctx.world, None))


def parallelize(model, device, method="ring", group=None):
    """Every rank keeps the whole model and runs it on its T/W tokens of every sample."""
    group = group or dist.group.WORLD
    rank, world, T = dist.get_rank(group), dist.get_world_size(group), model.embed.pos.shape[1]
    model.embed = LocalPatchEmbed(model.embed, slice(rank * T // world, (rank + 1) * T // world))
    for block in model.blocks:
        block.attn = ContextParallelAttention(block.attn, method, group)
    # The head's mean over all T tokens: the all-reduced sum of the ranks' means over T/W, / W.
    model.head.fc.register_forward_pre_hook(
        lambda fc, args: SumOverRanks.apply(args[0] / world, group)
    )
    # A weight's gradient is a sum over all tokens; each rank has its tokens' part, times W (SumOverRanks'
    # backward; the classifier's is whole everywhere). DDP's all-reduce / W leaves the whole gradient.
    return DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=group,
        gradient_as_bucket_view=True,
    )


def full_state_dict(model):
    """The plain state_dict of the common model: every rank holds it whole."""
    return {k: v.detach().cpu() for k, v in model.module.state_dict().items()}


### end: Context parallel


def formula(psi, world, args):
    """The paper's per-rank bytes, which the report sets next to what the Meter measured."""
    k, d, B, D, T = (
        (8 if args.optim == "adamw" else 4),
        args.depth,
        args.batch_size,
        args.dim,
        (28 // args.patch) ** 2,
    )
    a, kv = (
        (5 if args.method == "ring" else 6),
        3 * (world - 1) * d * 8 * B * T * D // world,
    )  # K/V: [2, B, T/W, D]
    comm = (
        dict(send=kv, recv=kv)
        if args.method == "ring"
        else dict(all_to_all=32 * d * B * T * D // world)
    )
    return dict(
        param_bytes=4 * psi,
        grad_bytes=4 * psi,
        optim_bytes=k * psi,
        comm={**comm, "all_reduce": 4 * (B * D + psi)},
        act_bytes_attention=d * (4 * a * B * T * D + 4 * B * args.heads * T) // world,
        notes=dict(
            param_bytes="4Ψ replicated",
            grad_bytes="4Ψ replicated",
            optim_bytes=f"{k}Ψ",
            recv="as sent",
            act_bytes_attention=f"depth·({4 * a}·B·T·D + 4·B·H·T)/W",
            all_to_all="8·depth·B·T·D/W",
            send="3(W-1)·depth K/V blocks",
            all_reduce="B·D pooled + Ψ gradients",
        ),
    )


def check_args(args, world):
    common.check(
        not args.experts,
        "--experts: the load-balancing loss of an MoE block needs all of an image's tokens",
    )
    common.check(
        (tokens := (common.IMAGE // args.patch) ** 2) % world == 0,
        f"--patch {args.patch} gives {tokens} tokens: not divisible by {world} ranks",
    )
    common.check(
        args.method == "ring" or args.heads % world == 0,
        f"--method ulysses: --heads {args.heads} is not "
        f"divisible by {world} ranks (each attends with whole heads)",
    )


def setup(args):
    """Join the process group. torchrun (or common.launch) put RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT in the environment; LOCAL_RANK picks this process's GPU."""
    backend, device = common.pick_backend(args.backend)  # NCCL and a GPU per rank, else Gloo
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=args.timeout)
    # torchrun keeps one store across restarts (--max-restarts): prefix it per attempt, or a
    # restarted rank may read the address of a worker that died in the last attempt and hang.
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"attempt_{attempt}", store)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world,
        timeout=timeout,
        # NCCL: bind the communicator to this GPU now (not lazily at the first collective), so
        # that device meshes can split it and the first call is not a point-to-point one.
        device_id=device if device.type == "cuda" else None,
    )
    return rank, world, device, backend


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def train(model, optimizer, scheduler, loader, sampler, args, device, step=0):
    """The loop every script shares: forward, loss, backward, step, schedule, log."""
    stop = args.max_steps or float("inf")
    world = dist.get_world_size()
    loss_sum = torch.zeros((), device=device)  # stays on the device until a logging step
    losses_summed = 0
    last_loss = float("nan")
    for epoch in range(step // len(loader), args.epochs):
        if step >= stop:
            break
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        loader.dataset.set_epoch(epoch)  # and new augmentations (--shift), the same everywhere
        model.train()
        bar = common.progress(loader, args, epoch)
        for i, (x, y) in enumerate(bar):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            loss_sum += loss.detach()
            losses_summed += 1
            if step % args.log_every == 0 or step >= stop or i + 1 == len(loader):
                dist.all_reduce(loss_sum)  # every rank's loss is the whole batch's: W equal values
                last_loss = loss_sum.item() / world / losses_summed
                loss_sum.zero_()
                losses_summed = 0
                common.log_loss(bar, args, epoch, step, last_loss)
            if step >= stop:
                break
        common.log(f"epoch {epoch}: step {step}, train loss {last_loss:.4f}")
    return dict(steps=step, loss=last_loss)


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
        dp_rank, dp_world = 0, 1  # CP: every rank sees the whole batch (its T/W tokens)
        sampler = DistributedSampler(
            train_set,
            num_replicas=dp_world,
            rank=dp_rank,
            shuffle=True,
            seed=args.seed,
            drop_last=True,
        )
        loader = DataLoader(
            train_set,
            batch_size=args.batch_size // dp_world,
            sampler=sampler,
            drop_last=True,
            pin_memory=device.type == "cuda",
        )
        common.check(
            len(loader) > 0,
            f"{len(train_set)} training samples make no full batch of {args.batch_size}",
        )
        model = common.build_model(args)  # the same seeded weights on every rank
        if args.load:
            model.load_state_dict(common.load_state_dict_file(args.load, model.state_dict()))
        psi = sum(p.numel() for p in model.parameters())
        model = parallelize(model.to(device), device, args.method)
        optimizer = common.make_optimizer(model.parameters(), args)
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        common.log(
            f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data ({len(train_set)} train / "
            f"{len(test_set)} test), batch {args.batch_size} = {dp_world} x {args.batch_size // dp_world}"
        )
        with common.Meter(
            model, optimizer, args, parts=dict(attention=[b.attn for b in model.module.blocks])
        ) as meter:
            out = train(model, optimizer, scheduler, loader, sampler, args, device)
        acc = evaluate(
            model,
            common.test_loader(test_set, dp_rank, dp_world, pin_memory=device.type == "cuda"),
            device,
        )
        state = full_state_dict(model)  # every rank takes part; rank 0 holds the whole
        if rank == 0 and args.save:
            common.save_checkpoint(state, args.save)
            common.log(f"saved {args.save}")
        common.report(
            SCRIPT,
            args,
            world,
            backend,
            device,
            source,
            psi,
            out,
            acc,
            meter,
            formula(psi, world, args),
        )
    finally:
        cleanup()


def main():
    parser = common.get_parser(
        "Context parallelism (ring attention, DeepSpeed-Ulysses) on the common ViT, written out"
    )
    parser.add_argument(
        "--method",
        choices=["ring", "ulysses"],
        default="ring",
        help="ring: K/V blocks around a ring; ulysses: all-to-all tokens <-> heads",
    )
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
