"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019), written out on torch.distributed:
each of W ranks holds 1/W of every Transformer block's weight matrices and sees the same full
batch. Attention is split by heads (q, k, v column-split: rank r owns heads/W whole heads; the
output projection row-split), the MLP column-then-row (fc1 column-split, fc2 row-split), so
each half-block needs exactly one all-reduce forward (g) and one backward (f).

    column split  W = [W1 … Wp]:   Y = X·W = [X·W1 … X·Wp]       rank r computes Yr, no communication
    row split     W = [W1; …; Wp]:  Z = [Y1 … Yp]·W = Σr Yr·Wr    rank r a partial sum, added up by g

            ┌─ X·[Q1 K1 V1] → heads 1 .. H/W  ─ ·[P1] ─┐
    X ─ f ──┤                 ...                      ├─ g ─ + bias → + X
            └─ X·[Qp Kp Vp] → last H/W heads  ─ ·[Pp] ─┘
    MLP:    X ─ f ─ X·[A1 … Ap] ─ gelu ─ ·[B1; …; Bp] ─ g ─ + bias → + X
    f: identity forward, all-reduce backward;   g: all-reduce forward, identity backward

--sequence-parallel (Korthikanti et al. 2022): LayerNorms and residuals run on T/W of the 16
tokens; f becomes an all-gather of the tokens (reduce-scatter backward), g a reduce-scatter
(all-gather backward). A ring all-reduce is a reduce-scatter then an all-gather, so the bytes
are the same and the activations outside the split layers shrink by W.

Memory per rank (fp32, Ψ = Ψs split + Ψr replicated: norms, row biases, embedding, head):
4(Ψr + Ψs/W) params + as much grads + 8(Ψr + Ψs/W) AdamW; norm/residual activations B·T·D per
block, B·T·D/W with SP. Communication per step: 4·depth all-reduces of B·T·D fp32 elements,
each sending 2(W-1)/W of it per rank; with SP 4·depth all-gathers + 4·depth reduce-scatters
(same bytes), 2 all-gathers where SP begins and ends, 1 all-reduce of the norm/bias grads.

    torchrun --standalone --nproc_per_node=2 tensor_parallel.py
    torchrun --standalone --nproc_per_node=4 tensor_parallel.py --sequence-parallel
    python tensor_parallel.py                                   # W=1: the dense model
"""
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import common

COUNT = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0, "elements": 0}   # collectives this rank issued
# torch 2.14 renamed the *_tensor collectives (the old names warn); torch 2.11 has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
NATIVE_REDUCE_SCATTER = True                     # run() probes it: Gloo before torch 2.3 lacks it


def all_reduce(x):
    COUNT["all_reduce"] += 1
    COUNT["elements"] += x.numel()
    x = x.contiguous()
    dist.all_reduce(x)                           # in place, as Megatron does: x is a fresh partial sum
    return x


def all_gather_tokens(x):
    """[B, T/W, D] -> [B, T, D]. The collectives concatenate along dim 0, so tokens go first
    (Megatron keeps activations as [T, B, D] throughout to avoid these transposes)."""
    COUNT["all_gather"] += 1
    COUNT["elements"] += x.numel() * dist.get_world_size()
    x = x.transpose(0, 1).contiguous()
    out = x.new_empty((x.shape[0] * dist.get_world_size(), *x.shape[1:]))
    _all_gather(out, x)
    return out.transpose(0, 1).contiguous()


def reduce_scatter_tokens(x):
    """[B, T, D] partial sums -> [B, T/W, D] of the full sum, this rank's tokens."""
    COUNT["reduce_scatter"] += 1
    COUNT["elements"] += x.numel()
    W, r = dist.get_world_size(), dist.get_rank()
    if not NATIVE_REDUCE_SCATTER:                # fallback: all-reduce, keep our slice (sends twice the bytes)
        x = x.contiguous()
        dist.all_reduce(x)
        return x.chunk(W, 1)[r].contiguous()
    x = x.transpose(0, 1).contiguous()
    out = x.new_empty((x.shape[0] // W, *x.shape[1:]))
    _reduce_scatter(out, x)
    return out.transpose(0, 1).contiguous()


def my_tokens(x):
    return x.chunk(dist.get_world_size(), 1)[dist.get_rank()].contiguous()


# The conjugate operators as autograd Functions: what forward does, backward does the conjugate of.
class Copy(torch.autograd.Function):
    """f: identity forward, all-reduce backward (each rank's q, k, v / fc1 give part of the grad)."""
    forward = staticmethod(lambda ctx, x: x)
    backward = staticmethod(lambda ctx, grad: all_reduce(grad))


class Reduce(torch.autograd.Function):
    """g: all-reduce forward (sum the row-parallel partial products), identity backward."""
    forward = staticmethod(lambda ctx, x: all_reduce(x))
    backward = staticmethod(lambda ctx, grad: grad)


class GatherTokens(torch.autograd.Function):
    """f under SP: all-gather the tokens forward; reduce-scatter the partial gradients backward."""
    forward = staticmethod(lambda ctx, x: all_gather_tokens(x))
    backward = staticmethod(lambda ctx, grad: reduce_scatter_tokens(grad))


class ReduceScatterTokens(torch.autograd.Function):
    """g under SP: reduce-scatter forward (sum, keep our tokens); all-gather the gradient backward."""
    forward = staticmethod(lambda ctx, x: reduce_scatter_tokens(x))
    backward = staticmethod(lambda ctx, grad: all_gather_tokens(grad))


class ScatterTokens(torch.autograd.Function):
    """Into SP after the replicated embedding: keep our tokens; all-gather the gradient backward."""
    forward = staticmethod(lambda ctx, x: my_tokens(x))
    backward = staticmethod(lambda ctx, grad: all_gather_tokens(grad))


class UnscatterTokens(torch.autograd.Function):
    """Out of SP before the replicated head: all-gather; backward keeps our slice (same grad everywhere)."""
    forward = staticmethod(lambda ctx, x: all_gather_tokens(x))
    backward = staticmethod(lambda ctx, grad: my_tokens(grad))


class ColumnParallelLinear(nn.Module):
    """Y_r = X·A_r: rows r·out/W .. of nn.Linear's [out, in] weight (and bias). Its input is
    f(X), applied once by the block for q, k and v together."""
    split = 0

    def __init__(self, linear, rank, world):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().chunk(world, 0)[rank].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().chunk(world, 0)[rank].clone())

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Z = g(Σ_r Y_r·B_r) + b: columns r·in/W .. of the weight; the full bias is added once,
    after the sum (g is Reduce, or ReduceScatterTokens under SP)."""
    split = 1

    def __init__(self, linear, rank, world, reduce):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().chunk(world, 1)[rank].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone())
        self.reduce = reduce

    def forward(self, x):
        return self.reduce(F.linear(x, self.weight)) + self.bias


class ParallelBlock(nn.Module):
    """common.Block with its linears split; the same attribute names, so the same state_dict keys.
    Attention.forward runs unchanged: it reads the local head count off q's output width."""

    def __init__(self, block, rank, world, sp):
        super().__init__()
        self.enter = GatherTokens.apply if sp else Copy.apply
        exit_ = ReduceScatterTokens.apply if sp else Reduce.apply
        self.norm1, self.attn, self.norm2, self.mlp = block.norm1, block.attn, block.norm2, block.mlp
        a, m = self.attn, self.mlp
        a.q, a.k, a.v = (ColumnParallelLinear(lin, rank, world) for lin in (a.q, a.k, a.v))
        a.proj = RowParallelLinear(a.proj, rank, world, exit_)
        m.fc1, m.fc2 = ColumnParallelLinear(m.fc1, rank, world), RowParallelLinear(m.fc2, rank, world, exit_)

    def forward(self, x):                        # x: [B, T, D], or this rank's [B, T/W, D] under SP
        x = x + self.attn(self.enter(self.norm1(x)))
        return x + self.mlp(self.enter(self.norm2(x)))


def parallelize(model, rank, world, sp):
    """Slice the full, seeded model in place. Under SP, mark the parameters that see only this
    rank's tokens: their gradients are partial sums."""
    for i, block in enumerate(model.blocks):
        model.blocks[i] = ParallelBlock(block, rank, world, sp)
    sp_params = [p for b in model.blocks for p in (*b.norm1.parameters(), *b.norm2.parameters(),
                                                  b.attn.proj.bias, b.mlp.fc2.bias)] if sp else []
    return model, sp_params


def forward(model, img, sp):
    x = model.embed(img)
    x = ScatterTokens.apply(x) if sp else x
    for block in model.blocks:
        x = block(x)
    return model.head(UnscatterTokens.apply(x) if sp else x)


def dense_state_dict(model):
    """Reassemble the plain state_dict: all-gather each split tensor along its split dim."""
    out = {}
    for name, module in model.named_modules():
        for pname, t in module.named_parameters(recurse=False):
            split = getattr(module, "split", None)
            if split == 0 or (split == 1 and pname == "weight"):
                parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
                dist.all_gather(parts, t.detach().contiguous())
                t = torch.cat(parts, split)
            out[f"{name}.{pname}" if name else pname] = t.detach().cpu()
    return {k: out[k] for k in model.state_dict()}


def setup(backend, timeout):
    # MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE come from the environment (torchrun or default_env).
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def train(model, optimizer, loader, sampler, args, device, sp_params):
    steps, t_train, loss_sum, loss_n, last_loss, mem = 0, 0.0, torch.zeros((), device=device), 0, float("nan"), {}
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.perf_counter()
        bar = common.progress(loader, args, desc=f"epoch {epoch}")
        for x, y in bar:                           # the same full batch on every rank: TP does not split data
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(forward(model, x, args.sequence_parallel), y)
            loss.backward()
            if sp_params:                          # norms and row biases saw T/W tokens: sum their grads
                flat = all_reduce(torch.cat([p.grad.flatten() for p in sp_params]))
                for p, g in zip(sp_params, flat.split([p.numel() for p in sp_params])):
                    p.grad.copy_(g.view_as(p))
            optimizer.step()
            if steps == 0:
                mem = dict(param_bytes=common.param_bytes(model.parameters()),
                           grad_bytes=common.grad_bytes(model.parameters()),
                           optim_bytes=common.optimizer_bytes(optimizer))
            optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
            steps, loss_n = steps + 1, loss_n + 1
            if steps % 20 == 0 or steps == args.max_steps or steps % len(loader) == 0:
                last_loss, loss_sum, loss_n = loss_sum.item() / loss_n, loss_sum * 0, 0   # same on every rank
                if bar is not loader:
                    bar.set_postfix(loss=f"{last_loss:.4f}")
            if steps == args.max_steps:
                break
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_train += time.perf_counter() - t0
        common.log(f"epoch {epoch}: steps {steps}, train loss {last_loss:.4f}")
        if steps == args.max_steps:
            break
    return dict(steps=steps, loss=last_loss, train_time=t_train, **mem)


@torch.no_grad()
def evaluate(model, loader, device, sp):
    """Every rank runs the whole test set through its slice; the counts come out the same."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        counts += torch.stack([(forward(model, x, sp).argmax(1) == y).sum(), torch.tensor(len(y), device=device)])
    return counts[0].item() / max(counts[1].item(), 1)


def expected_collectives(args):
    """Per step, and the fp32 elements they move (full tensors: an all-gather's output)."""
    n, d = args.batch_size * common.TOKENS * args.dim, args.depth
    if not args.sequence_parallel:
        return dict(all_reduce=4 * d, all_gather=0, reduce_scatter=0, elements=4 * d * n)
    return dict(all_reduce=1, all_gather=4 * d + 2, reduce_scatter=4 * d, elements=(8 * d + 2) * n + 6 * args.dim * d)


def check_args(args, world):
    common.check(args.heads % world == 0, f"--heads {args.heads} is not divisible by the {world} tensor-parallel "
                                          f"ranks: each rank must own whole attention heads")
    common.check(4 * args.dim % world == 0, f"the MLP width 4 x --dim = {4 * args.dim} is not divisible by the "
                                            f"{world} tensor-parallel ranks")
    common.check(not args.sequence_parallel or common.TOKENS % world == 0,
                 f"--sequence-parallel splits the {common.TOKENS} tokens over ranks: {world} does not divide them")


def run(args):
    global NATIVE_REDUCE_SCATTER
    check_args(args, int(os.environ["WORLD_SIZE"]))
    backend, device = common.pick_backend(args.backend)
    model = common.build_model(args)               # the full, seeded model on every rank; each keeps a slice
    if args.load:
        model.load_state_dict(common.load_state_dict_file(args.load, model.state_dict()))
    psi = sum(p.numel() for p in model.parameters())
    rank, world = setup(backend, args.timeout)
    try:
        if args.sequence_parallel and world > 1:
            # Gloo has reduce_scatter_tensor since torch 2.3 (pytorch#118911; inside, an all-reduce + chunk);
            # older or other CPU backends lack it: probe once, and fall back the same way.
            try:
                _reduce_scatter(torch.empty(1, device=device), torch.zeros(world, device=device))
            except (RuntimeError, NotImplementedError, ValueError):
                NATIVE_REDUCE_SCATTER = False
                common.log(f"note: {backend} has no reduce_scatter_tensor here; using all-reduce + slice")
        xtr, ytr, xte, yte, source = common.load_data(args)
        loader, sampler = common.train_loader(xtr, ytr, args.batch_size, 0, 1, args.seed)   # world=1: all the batch
        common.check(len(loader) > 0, f"{len(ytr)} training samples make no full batch of {args.batch_size}")
        model, sp_params = parallelize(model, rank, world, args.sequence_parallel)
        model = model.to(device)
        optimizer = common.make_optimizer(model.parameters(), args)
        own = sum(p.numel() for p in model.parameters())           # Ψr + Ψs/W
        common.log(f"tensor_parallel: world {world}, Ψ = {psi:,} parameters, {own:,} on each rank, SP "
                   f"{'on' if args.sequence_parallel else 'off'}, {source} data ({len(ytr)} train / {len(yte)} test), "
                   f"batch {args.batch_size} on every rank")
        COUNT.update({k: 0 for k in COUNT})
        out = train(model, optimizer, loader, sampler, args, device, sp_params)
        counted, expected = {k: v // max(out["steps"], 1) for k, v in COUNT.items()}, expected_collectives(args)
        acc = evaluate(model, common.test_loader(xte, yte, 512), device, args.sequence_parallel)
        comm_bytes = 4 * counted["elements"]
        ring = (1 if args.sequence_parallel else 2) * (world - 1) * comm_bytes // world
        common.report([
            ("parameters", out["param_bytes"], 4 * own, "4(Ψr + Ψs/W)"),
            ("gradients", out["grad_bytes"], 4 * own, "4(Ψr + Ψs/W)"),
            ("optimizer state", out["optim_bytes"], (8 if args.optim == "adamw" else 4) * own,
             "8(Ψr + Ψs/W) AdamW m, v" if args.optim == "adamw" else "4(Ψr + Ψs/W) SGD momentum"),
            ("collective data / step", comm_bytes, 4 * expected["elements"],
             "4·depth·4BTD" if not args.sequence_parallel else "(8·depth+2)·4BTD + 4·6D·depth"),
            ("sent per step (ring)", ring, None, "2(W-1)/W per all-reduce" if not args.sequence_parallel
             else "(W-1)/W per all-gather / reduce-scatter"),
        ])
        common.log("  collectives per step   " + ", ".join(f"{k} {counted[k]} (expected {expected[k]})"
                                                        for k in ("all_reduce", "all_gather", "reduce_scatter")))
        if device.type == "cuda":
            common.log(f"  cuda max_memory_allocated: {common.fmt_bytes(torch.cuda.max_memory_allocated(device))}")
        sps = out["steps"] * args.batch_size / max(out["train_time"], 1e-9)
        common.log(f"\ntest accuracy {acc:.4f}, final train loss {out['loss']:.4f}, {sps:.0f} samples/s")
        if args.save:
            state = dense_state_dict(model)         # a collective: every rank takes part
            if rank == 0:
                common.save_checkpoint(state, args.save)
                common.log(f"saved {args.save}")
        ops = ("all_reduce", "all_gather", "reduce_scatter")
        common.result(script="tensor_parallel", world_size=world, backend=backend, device=device.type, data=source,
                      params=psi, steps=out["steps"], loss=out["loss"], test_acc=acc, samples_per_s=sps,
                      param_bytes=out["param_bytes"], grad_bytes=out["grad_bytes"], optim_bytes=out["optim_bytes"],
                      comm_bytes=comm_bytes, sequence_parallel=args.sequence_parallel,
                      collectives={k: counted[k] for k in ops}, collectives_expected={k: expected[k] for k in ops},
                      native_reduce_scatter=NATIVE_REDUCE_SCATTER)
        dist.barrier()        # leave together: a Gloo rank torn down while rank 0 still saves aborted once
    finally:
        cleanup()


def main():
    parser = common.get_parser("Tensor parallelism (Megatron) on the common ViT, written out")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="norms and residuals on T/W tokens: all-gather / reduce-scatter instead of all-reduce")
    common.default_env()
    args = common.parse_args(parser)
    run(args)


if __name__ == "__main__":
    main()
