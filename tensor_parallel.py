"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): each of W ranks holds 1/W of every block's weight matrices
and sees the whole batch. Attention splits by heads (q, k, v by columns: rank r owns H/W whole heads; the output
projection by rows), the MLP column-then-row, so each half-block needs one all-reduce forward (g) and one backward (f).

            ┌─ X·[Q1 K1 V1] → heads 1 .. H/W  ─ ·[P1] ─┐
    X ─ f ──┤                 ...                      ├─ g ─ + bias → + X          embedding, norms, head:
            └─ X·[Qp Kp Vp] → last H/W heads  ─ ·[Pp] ─┘                            replicated
    MLP:    X ─ f ─ X·[A1 … Ap] ─ gelu ─ ·[B1; …; Bp] ─ g ─ + bias → + X
    f: identity forward, all-reduce backward;   g: all-reduce forward, identity backward

--sequence-parallel (Korthikanti et al. 2022): norms and residuals on T/W tokens; f becomes an all-gather of the tokens
(reduce-scatter backward), g a reduce-scatter (all-gather backward): activations outside the split layers / W.
--checkpoint: autograd keeps each block's input x only (E + L·B·T·D·4 bytes, E: embedding, head, loss). With
--partition-activations (ZeRO-R's Pa, Rajbhandari et al. 2020) x, the same on every rank, is kept as each rank's T/W
tokens (E + L·B·T·D·4/W) and all-gathered just before the recompute. Under SP, x already is split: no change.
Memory per rank (fp32, Ψ = Ψs split + Ψr replicated, Ψs = depth·(12D² + 6D) here): 4(Ψr + Ψs/W) params + as much grads +
8(Ψr + Ψs/W) AdamW. Communication per step, in B·T·D fp32 activations (B the whole batch): 4·depth all-reduces; SP:
4·depth reduce-scatters, 4·depth + 2 all-gathers + an all-reduce of 6·D·depth grads; checkpointing adds the recompute's.

    torchrun --standalone --nproc_per_node=2 tensor_parallel.py [--sequence-parallel] [--partition-activations]
"""

import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler

import common

SCRIPT = os.path.splitext(os.path.basename(__file__))[0]


### begin: Tensor parallel
# Model contract: `model.embed` -> [B, T, D] -> `model.blocks` -> `model.head`, the same weights on
# every rank; a block is x + attn(norm1(x)), x + mlp(norm2(x)) with nn.Linear `attn.q/k/v/proj` and
# `mlp.fc1/fc2`, heads contiguous in q, k, v's outputs, attention reading its head count off q's.


def all_reduce(x):
    dist.all_reduce(x := x.contiguous())  # in place, as Megatron does: x is a fresh partial sum
    return x


# The collectives concatenate along dim 0, so tokens go first (Megatron keeps [T, B, D] throughout).
def all_gather_tokens(x):  # [B, T/W, D] -> [B, T, D]
    out = x.new_empty((x.shape[1] * dist.get_world_size(), x.shape[0], *x.shape[2:]))
    dist.all_gather_into_tensor(out, x.transpose(0, 1).contiguous())
    return out.transpose(0, 1).contiguous()


def reduce_scatter_tokens(x):  # [B, T, D] partial sums -> this rank's [B, T/W, D] of the sum
    out = x.new_empty((x.shape[1] // dist.get_world_size(), x.shape[0], *x.shape[2:]))
    dist.reduce_scatter_tensor(out, x.transpose(0, 1).contiguous())
    return out.transpose(0, 1).contiguous()


def my_tokens(x):  # a copy (a view would keep all of x alive)
    return x.chunk(dist.get_world_size(), 1)[dist.get_rank()].clone(
        memory_format=torch.contiguous_format
    )


def conjugate(name, forward, backward):
    """An autograd Function: `forward` on the activation, its conjugate `backward` on the gradient."""
    return type(
        name,
        (torch.autograd.Function,),
        dict(
            forward=staticmethod(lambda ctx, x: forward(x)),
            backward=staticmethod(lambda ctx, grad: backward(grad)),
        ),
    )


Copy = conjugate(
    "Copy", lambda x: x, all_reduce
)  # f: each rank's q, k, v / fc1 give part of the grad
Reduce = conjugate(
    "Reduce", all_reduce, lambda grad: grad
)  # g: sum the row-parallel partial products
GatherTokens = conjugate("GatherTokens", all_gather_tokens, reduce_scatter_tokens)  # f under SP
ReduceScatterTokens = conjugate(
    "ReduceScatterTokens", reduce_scatter_tokens, all_gather_tokens
)  # g under SP
ScatterTokens = conjugate(
    "ScatterTokens", my_tokens, all_gather_tokens
)  # into SP after the embedding
UnscatterTokens = conjugate(
    "UnscatterTokens", all_gather_tokens, my_tokens
)  # out of SP before the head


class ColumnParallelLinear(nn.Module):
    """Y_r = X·A_r: rows r·out/W .. of nn.Linear's [out, in] weight and bias; its input is f(X)."""

    split = dict(weight=0, bias=0)  # the dim full_state_dict concatenates along

    def __init__(self, linear, rank, world, reduce=None):
        super().__init__()
        cut, b, self.reduce = (
            lambda t, d: t.detach().chunk(world, d)[rank].contiguous().clone(),
            linear.bias,
            reduce,
        )
        self.weight = nn.Parameter(cut(linear.weight, self.split["weight"]))
        self.bias = (
            None
            if b is None
            else nn.Parameter(cut(b, 0) if "bias" in self.split else b.detach().clone())
        )

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(ColumnParallelLinear):
    """Z = g(Σ_r Y_r·B_r) + b: columns r·in/W .. of the weight; the whole bias, added once after g."""

    split = dict(weight=1)

    def forward(self, x):
        return self.reduce(F.linear(x, self.weight)) + self.bias


class ParallelBlock(nn.Module):
    """The block with its linears split; the same attribute names, so the same state_dict keys."""

    def __init__(self, block, rank, world, sp, checkpointing=False, partition=False):
        super().__init__()
        self.enter, exit_ = (
            (GatherTokens.apply, ReduceScatterTokens.apply) if sp else (Copy.apply, Reduce.apply)
        )
        self.checkpointing, self.partition = (
            checkpointing or partition,
            partition and not sp,
        )  # SP: x is split
        self.norm1, self.attn, self.norm2, self.mlp = (
            block.norm1,
            (a := block.attn),
            block.norm2,
            (m := block.mlp),
        )
        a.q, a.k, a.v = (ColumnParallelLinear(lin, rank, world) for lin in (a.q, a.k, a.v))
        a.proj = RowParallelLinear(a.proj, rank, world, exit_)
        m.fc1, m.fc2 = (
            ColumnParallelLinear(m.fc1, rank, world),
            RowParallelLinear(m.fc2, rank, world, exit_),
        )

    def body(self, x):  # x: [B, T, D], or this rank's [B, T/W, D] under SP
        x = x + self.attn(self.enter(self.norm1(x)))
        return x + self.mlp(self.enter(self.norm2(x)))

    def forward(self, x):
        if not self.partition:  # checkpoint() keeps x only and runs the block again in backward
            return (
                checkpoint(self.body, x, use_reentrant=False)
                if self.checkpointing
                else self.body(x)
            )
        # Pa: keep this rank's tokens; run on x (in a list it empties: nothing keeps x), recompute on all tokens
        run = lambda mine, box: self.body(
            box.pop() if box else all_gather_tokens(mine).requires_grad_()
        )  # noqa: E731
        return checkpoint(run, my_tokens(x.detach()), [x], use_reentrant=False)


def parallelize(model, device, sp=False, checkpointing=False, partition=False):
    """Split every block's linears in place; embedding and head stay replicated (same grads everywhere)."""
    model.blocks = nn.ModuleList(
        ParallelBlock(block, dist.get_rank(), dist.get_world_size(), sp, checkpointing, partition)
        for block in model.blocks
    )
    if sp:  # the blocks run on this rank's tokens, embed and head on all
        model.embed.register_forward_hook(lambda module, args, out: ScatterTokens.apply(out))
        model.head.register_forward_pre_hook(lambda module, args: UnscatterTokens.apply(*args))
        # Norms and row biases see T/W tokens: each rank's gradient is a partial sum. When backward
        # has accumulated the last of them, all-reduce them in one flat buffer (as Megatron does).
        partial, ready = (
            [
                p
                for b in model.blocks
                for p in (
                    *b.norm1.parameters(),
                    *b.norm2.parameters(),
                    b.attn.proj.bias,
                    b.mlp.fc2.bias,
                )
            ],
            [],
        )

        def sum_partial_grads(p):
            ready.append(p)
            if len(ready) == len(partial):
                ready.clear()
                flat = all_reduce(torch.cat([q.grad.flatten() for q in partial]))
                for q, g in zip(partial, flat.split([q.numel() for q in partial])):
                    q.grad.copy_(g.view_as(q))

        for p in partial:
            p.register_post_accumulate_grad_hook(sum_partial_grads)
    return model


def full_state_dict(model):
    """The common model's plain state_dict on rank 0 (None elsewhere): split tensors gathered to rank 0."""
    rank, world, out = dist.get_rank(), dist.get_world_size(), {}
    for name, module in model.named_modules():
        for pname, t in module.named_parameters(recurse=False):
            if pname in getattr(module, "split", {}):
                parts = [torch.empty_like(t) for _ in range(world)] if rank == 0 else None
                dist.gather(t.detach().contiguous(), parts, dst=0)
                t = torch.cat(parts, module.split[pname]) if rank == 0 else t
            out[f"{name}.{pname}"] = t.detach().cpu()
    return {k: out[k] for k in model.state_dict()} if rank == 0 else None


### end: Tensor parallel


def formula(psi, world, args):
    """The paper's per-rank bytes, which the report sets next to what the Meter measured."""
    k, d, D, B = 8 if args.optim == "adamw" else 4, args.depth, args.dim, args.batch_size
    T, sp, pa = (
        (common.IMAGE // args.patch) ** 2,
        args.sequence_parallel,
        args.partition_activations,
    )
    own = (
        psi - (split := d * (12 * D**2 + 6 * D)) + split // world
    )  # Ψr + Ψs/W (Ψs: q, k, v, proj, fc1, fc2)
    n, c = (
        4 * B * T * D,
        int(args.checkpoint or pa),
    )  # n: one [B, T, D] fp32 activation; c: blocks recomputed
    comm = (
        dict(
            all_gather=(4 * d + 2 + 2 * c * d) * n,
            reduce_scatter=(4 + c) * d * n,
            all_reduce=4 * 6 * D * d,
        )
        if sp
        else dict(all_reduce=(4 + c) * d * n, **(dict(all_gather=d * n) if pa else {}))
    )
    return dict(
        param_bytes=4 * own,
        grad_bytes=4 * own,
        optim_bytes=k * own,
        comm=comm,
        act_bytes=common.saved_outside_blocks(args, B) + d * n // (world if sp or pa else 1)
        if c
        else None,
        notes=dict(
            param_bytes="4(Ψr + Ψs/W)",
            grad_bytes="4(Ψr + Ψs/W)",
            optim_bytes=f"{k}(Ψr + Ψs/W)",
            all_reduce="6·D·depth norm/bias grads" if sp else f"{4 + c}·depth x B·T·D",
            all_gather=f"{f'{4 + 2 * c}·depth + 2' if sp else 'depth'} x B·T·D",
            reduce_scatter=f"{4 + c}·depth x B·T·D",
            act_bytes=("E + L·B·T·D·4" + "/W" * (sp | pa)) * c,
        ),
    )


def check_args(args, world):
    common.check(
        not args.experts,
        "--experts: tensor_parallel.py splits MLPs by columns, not experts over ranks",
    )
    common.check(
        args.heads % world == 0,
        f"--heads {args.heads} is not divisible by the {world} tensor-parallel "
        f"ranks: each rank must own whole attention heads",
    )  # so D and 4D split too
    flag, tokens = (
        "--sequence-parallel" if args.sequence_parallel else "--partition-activations",
        common.IMAGE**2 // args.patch**2,
    )
    common.check(
        not (args.sequence_parallel or args.partition_activations) or tokens % world == 0,
        f"{flag} splits the {tokens} tokens over ranks: {world} does not divide them",
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
        dp_rank, dp_world = 0, 1  # TP: every rank sees the whole batch
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
        model = parallelize(
            model.to(device),
            device,
            args.sequence_parallel,
            args.checkpoint,
            args.partition_activations,
        )
        optimizer = common.make_optimizer(model.parameters(), args)
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        common.log(
            f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data ({len(train_set)} train / "
            f"{len(test_set)} test), batch {args.batch_size} = {dp_world} x {args.batch_size // dp_world}"
        )
        with common.Meter(model, optimizer, args) as meter:
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
    parser = common.get_parser("Tensor parallelism (Megatron) on the common ViT, written out")
    parser.add_argument(
        "--sequence-parallel", action="store_true", help="norms and residuals on T/W tokens"
    )
    parser.add_argument(
        "--checkpoint", action="store_true", help="keep only each block's input for backward"
    )
    parser.add_argument(
        "--partition-activations",
        action="store_true",
        help="ZeRO-R Pa: --checkpoint, T/W tokens kept",
    )
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
