"""Expert parallelism: a mixture-of-experts ViT (--experts E --top-k K) whose experts live on
different ranks. Each of W ranks holds the dense part whole and trains on its slice of each batch
(data parallel), and owns E/W whole experts of every MoE block (expert parallel). The router picks
each token's K experts; the token travels to the ranks that own them and its outputs travel back.

    rank 0 (experts 0,1)            rank 1 (experts 2,3)        E=4, W=2, K=1
    tokens a b c d                  tokens e f g h
    router: a->0 b->2 c->1 d->3     e->3 f->0 g->2 h->1
        sort by expert, count, all-to-all the counts, then the tokens (uneven splits):
    experts 0,1 get a c | f h       experts 2,3 get b d | e g
        run the experts, all-to-all the outputs back the same way, unsort:
    a' b' c' d' = weight * out      e' f' g' h'

Memory per rank (fp32, AdamW): 16 bytes for each parameter it holds: the dense part Ψ_d
(attention, norms, routers, embed, head) replicated, the experts' Ψ_e / W: 16(Ψ_d + Ψ_e/W).
Communication per step: per MoE layer, 2 all-to-alls of the routed tokens forward (dispatch,
combine) and 2 backward (their reverses), each k·b·T·D fp32 elements on average over ranks for b =
batch/W images of T tokens (routed evenly, (W-1)/W of them leave the rank), plus one all-to-all of
the E token counts (int64) forward; one all-reduce of the Ψ_d dense gradients (instead of DDP's Ψ).

    torchrun --standalone --nproc_per_node=4 expert_parallel.py --experts 8 --top-k 2
    python expert_parallel.py --nproc 2 --experts 4 --top-k 2
    python expert_parallel.py --experts 4                       # a world of one: every expert here
"""

import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

import common

SCRIPT = os.path.splitext(os.path.basename(__file__))[0]


### begin: Expert parallel
# Model contract: model.blocks[i].mlp.experts is a list of E expert modules, called with the routing
# as experts(tokens [N, D], expert of each (token, slot) [N, K], weights [N, K]) -> [N, D]
# (the sum over slots of weight * expert(token)); every other parameter is dense.


class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits: `send[r]` rows of x go to rank r, `recv[r]` rows come
    from rank r. Its backward is the reverse all-to-all: each gradient row goes back where its row
    came from."""

    @staticmethod
    def forward(ctx, x, send, recv):
        ctx.send, ctx.recv = send, recv
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv)
        return out, None, None


class ExpertParallel(torch.nn.Module):
    """This rank's E/W experts of one block (rank r: experts r·E/W .. (r+1)·E/W - 1, named by their
    global index, so the state_dict has the model's keys), called like the whole list."""

    def __init__(self, experts, rank, world):
        super().__init__()
        self.E, self.world, self.n = len(experts), world, len(experts) // world
        for j in range(rank * self.n, (rank + 1) * self.n):
            self.add_module(str(j), experts[j])

    def forward(self, h, idx, weights):
        (N, K), W, n = idx.shape, self.world, self.n
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert, so by owner
        counts = torch.bincount(flat, minlength=self.E)  # what this rank sends each expert
        received = torch.empty_like(counts)  # [W, n]: from rank s, for my expert j
        dist.all_to_all_single(received, counts)
        self.received = received.view(W, n)
        # split sizes are host integers: one device sync per layer, which every uneven all-to-all needs
        send, recv = counts.view(W, n).sum(1).tolist(), self.received.sum(1).tolist()
        x = AllToAll.apply(h[order // K], send, recv)  # dispatch
        mine = (
            torch.arange(n, device=h.device).repeat(W).repeat_interleave(received)
        )  # my expert of each row
        group = mine.argsort(stable=True)
        chunks = x[group].split(self.received.sum(0).tolist())
        y = torch.cat([expert(c) for expert, c in zip(self.children(), chunks)])[group.argsort()]
        y = AllToAll.apply(y, recv, send)  # combine: back to the token's rank
        return (weights.unsqueeze(-1) * y[order.argsort()].view(N, K, -1)).sum(1)


def parallelize(model, device):
    """Keep this rank's experts of every block, drop the others; move to the device."""
    for block in model.blocks:
        block.mlp.experts = ExpertParallel(
            block.mlp.experts, dist.get_rank(), dist.get_world_size()
        )
    return model.to(device)


def expert_params(model):
    return [p for block in model.blocks for p in block.mlp.experts.parameters()]


def hook_optimizer(model, optimizer):
    """Before each step: the dense gradients are averaged over the W ranks, like DDP (one
    all-reduce of them flattened). The expert gradients need no all-reduce: the all-to-alls already
    brought every token routed to an expert, from every rank, to its one owner. Each rank's loss is
    the mean over its batch/W images, so what the owner accumulated is the sum of W ranks' mean
    gradients, W times the gradient of the global batch's mean: only the scale, 1/W, is missing."""
    world, experts = dist.get_world_size(), {id(p) for p in expert_params(model)}
    dense = [p for p in model.parameters() if id(p) not in experts]

    def hook(*_):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in dense]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        for p, g in zip(dense, flat.div_(world).split([p.numel() for p in dense])):
            p.grad = g.view_as(p)
        for p in expert_params(model):
            if p.grad is not None:
                p.grad.div_(world)

    optimizer.register_step_pre_hook(hook)


def full_state_dict(model):
    """The plain state_dict of the common model, the experts gathered on rank 0 (None elsewhere)."""
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object({k: v.detach().cpu() for k, v in model.state_dict().items()}, parts, dst=0)
    return {k: v for part in parts for k, v in part.items()} if parts else None


### end: Expert parallel


def formula(psi, world, args):
    """Per-rank bytes: the dense Ψ_d whole, the experts' Ψ_e / W. All-to-all bytes per step, the mean
    over ranks (a rank sends its own k·b·T tokens and returns what its experts received, which the
    routing decides; the sum over ranks is exact): per MoE layer, 4 token all-to-alls of k·b·T·D fp32
    elements (2 forward, 2 backward), plus E int64 counts."""
    k, D, E = 8 if args.optim == "adamw" else 4, args.dim, args.experts
    psi_e = args.depth * E * (8 * D * D + 5 * D)  # per expert: fc1 D·4D + 4D, fc2 4D·D + D
    held = psi - psi_e + psi_e // world
    tokens = args.batch_size // world * (common.IMAGE // args.patch) ** 2
    a2a = args.depth * (4 * args.top_k * tokens * D * 4 + 8 * E)
    return dict(
        param_bytes=4 * held,
        grad_bytes=4 * held,
        optim_bytes=k * held,
        comm=dict(all_reduce=4 * (psi - psi_e), all_to_all=a2a),
        notes=dict(
            param_bytes="4(Ψ_d + Ψ_e/W)",
            grad_bytes="4(Ψ_d + Ψ_e/W)",
            optim_bytes=f"{k}(Ψ_d + Ψ_e/W)",
            all_reduce="Ψ_d dense fp32 gradients",
            all_to_all="rank 0's; the mean over ranks: layers·(4·k·b·T·D fp32 + E counts)",
        ),
    )


def check_args(args, world):
    common.check(
        args.experts > 0,
        "expert_parallel.py needs a mixture of experts: give --experts E (and --top-k K)",
    )
    common.check(
        args.experts % world == 0,
        f"--experts {args.experts} is not divisible by world size {world}: "
        f"every rank must own the same number of whole experts",
    )
    common.check(
        args.batch_size % world == 0,
        f"--batch-size {args.batch_size} is not divisible by world size {world}: every rank must get "
        f"the same whole number of samples per step",
    )


def record_load(model):
    """Tokens each expert received in training forwards (from the run, outside the technique)."""
    load = [None] * len(model.blocks)

    def hook(i):
        def add(module, inputs, out):
            if module.training:
                got = module.received.sum(0).cpu()
                load[i] = got if load[i] is None else load[i] + got

        return add

    for i, block in enumerate(model.blocks):
        block.mlp.experts.register_forward_hook(hook(i))
    return load


def show_load(load, steps, meter, world):
    """Rank 0: tokens received per expert per step (every layer), all ranks' all-to-all bytes."""
    per_rank = [None] * world
    window = meter.counter.bytes.get(
        "all_to_all", 0
    )  # this rank's bytes in the Meter's window of steps
    dist.all_gather_object(per_rank, dict(load=[x.tolist() for x in load], a2a=window))
    table = [[v / max(steps, 1) for r in per_rank for v in r["load"][i]] for i in range(len(load))]
    common.log("\ntokens received per expert per step (mean over the run's steps):")
    for i, row in enumerate(table):
        common.log(f"  block {i}: " + " ".join(f"{v:7.1f}" for v in row))
    a2a, n = [r["a2a"] for r in per_rank], meter.comm()[2]
    common.log(
        f"all-to-all per step on each rank: {', '.join(common.fmt_bytes(b / n) for b in a2a)}; "
        f"mean over ranks {common.fmt_bytes(sum(a2a) / n / world)} (the formula's)"
    )
    return dict(tokens_per_expert=table, all_to_all_window=a2a)


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
                dist.all_reduce(loss_sum)  # each rank's loss is its slice's: average them
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
        dp_rank, dp_world = rank, world  # every rank is a data-parallel rank
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
        model = parallelize(model, device)  # this rank's experts only, moved to its device
        optimizer = common.make_optimizer(model.parameters(), args)
        hook_optimizer(model, optimizer)  # dense gradients averaged, expert gradients / W
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        common.log(
            f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data ({len(train_set)} train / "
            f"{len(test_set)} test), batch {args.batch_size} = {dp_world} x {args.batch_size // dp_world}"
        )
        load = record_load(model)
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
        extra = show_load(load, meter.loop_steps, meter, world)
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
            **extra,
        )
    finally:
        cleanup()


def main():
    parser = common.get_parser(
        "Expert parallelism: a mixture-of-experts ViT, experts spread over ranks"
    )
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
