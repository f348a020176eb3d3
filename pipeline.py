"""Pipeline parallelism, written out: the model's blocks cut into p = W contiguous stages, one per
rank (the embedding on the first, the head and the loss on the last). Every rank sees the whole
batch, cut into m micro-batches; activations go forward and gradients back with batch_isend_irecv.

    rank 0:  F0 F1 .  B0 F2 B1 F3 B2 .  B3      1F1B, p=2, m=4 (one slot per F or B, '.' idle)
    rank 1:  .  F0 B0 F1 B1 F2 B2 F3 B3 .

--schedule naive: one micro-batch in the pipeline at a time, bubble (p-1)/p; gpipe (Huang et al.
2019): all m forwards, then all m backwards; 1f1b (PipeDream-flush, Narayanan et al. 2021): p-s-1
warm-up forwards, one forward one backward, then the cool-down. Both idle (p-1)/(m+p-1) of the
slots. All are synchronous (one optimizer step per batch, each micro-batch's loss / m): exact.

Memory per rank (fp32, AdamW): 16Ψ_s bytes for its stage's Ψ_s parameters (≈ 16Ψ/p), plus the
activations of the micro-batches in flight: m (gpipe), ≤ p-s on stage s (1f1b), 1 (naive).
Communication per step: m activations of B/m·T·D fp32 forward and m gradients back over each of
the p-1 stage boundaries: 2(p-1)·m messages, 2(p-1)·4·B·T·D bytes; no collectives.

    torchrun --standalone --nproc_per_node=2 pipeline.py --schedule 1f1b --microbatches 4
    python pipeline.py --nproc 4 --schedule gpipe --microbatches 8
    python pipeline.py                                         # a world of one: one stage, the whole model
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


### begin: Pipeline
# Model contract: model.embed (images -> [B, T, D], with a parameter pos [1, T, D]), model.blocks
# (a list of [B, T, D] -> [B, T, D]) and model.head (-> logits), in that order; cross-entropy loss.


class Stage(torch.nn.Module):
    """Rank s of p: blocks s·d/p .. (s+1)·d/p - 1, with the embedding on the first stage and the
    head on the last. Blocks keep their index in the whole model, so the state_dict has its keys."""

    def __init__(self, model, s, p):
        super().__init__()
        d, self.s, self.p = len(model.blocks), s, p
        self.embed = model.embed if s == 0 else None
        self.blocks = torch.nn.ModuleDict(
            {str(i): model.blocks[i] for i in range(s * d // p, (s + 1) * d // p)}
        )
        self.head = model.head if s == p - 1 else None
        self.act_shape = tuple(model.embed.pos.shape[1:])  # (T, D): what crosses a stage boundary

    def forward(self, x):
        for layer in [self.embed, *self.blocks.values(), self.head]:
            x = x if layer is None else layer(x)
        return x


def parallelize(model, device):
    """Keep this rank's stage, on its device; the rest of the model is dropped."""
    return Stage(model, dist.get_rank(), dist.get_world_size()).to(device)


def schedule(name, m, p, s):
    """Stage s's actions for one batch, ("F", i) / ("B", i): `warm` forwards ahead, then one forward
    one backward, then the backwards left. naive runs none ahead, gpipe all m, 1f1b p-s-1."""
    warm = {"naive": 0, "gpipe": m}.get(name, min(p - s - 1, m))
    steady = [a for i in range(m - warm) for a in (("F", warm + i), ("B", i))]
    return [("F", i) for i in range(warm)] + steady + [("B", i) for i in range(m - warm, m)]


def p2p(ops):
    """One group of [(dist.isend or dist.irecv, tensor, peer)], waited for together. NCCL runs a rank's
    groups in order, and a send holds its stream until the peer reaches the matching receive: two
    neighbours that both send first wait for ever. What must progress together goes in ONE group."""
    for work in (
        dist.batch_isend_irecv([dist.P2POp(op, t, peer) for op, t, peer in ops]) if ops else []
    ):
        work.wait()


def train_step(stage, x, y, name, m):
    """Forward, loss and backward of every micro-batch in the schedule's order: the batch's mean loss
    on the last stage, 0 elsewhere. One group carries an action's output with the next one's input,
    as in Megatron-LM and torch.distributed.pipelining (1F1B: send activation i + receive gradient j;
    send gradient j + receive activation i+1), so no two stages ever both wait to send."""
    s, p, xs, ys = stage.s, stage.p, x.chunk(m), y.chunk(m)
    held, loss, sends = {}, torch.zeros((), device=x.device), []
    for a, i in schedule(name, m, p, s):
        if a == "F":
            inp = xs[i] if s == 0 else torch.empty(len(xs[i]), *stage.act_shape, device=x.device)
            p2p(sends + ([(dist.irecv, inp, s - 1)] if s > 0 else []))
            out = stage(inp.requires_grad_() if s > 0 else inp)
            if s == p - 1:  # mean over B/m samples, / m: the mean over the batch
                out = F.cross_entropy(out, ys[i]) / m
                loss += out.detach()
            held[i] = inp, out  # activations kept until micro-batch i's backward
            sends = [(dist.isend, out.detach(), s + 1)] if s < p - 1 else []
        else:
            inp, out = held.pop(i)
            grad = torch.empty_like(out) if s < p - 1 else None
            p2p(sends + ([(dist.irecv, grad, s + 1)] if s < p - 1 else []))
            out.backward(grad)
            sends = [(dist.isend, inp.grad, s - 1)] if s > 0 else []
    p2p(sends)
    return loss


@torch.no_grad()
def infer(stage, x):
    """The whole batch through the stages in turn: the logits on the last stage, None on the others."""
    s, p = stage.s, stage.p
    x = torch.empty(len(x), *stage.act_shape, device=x.device) if s > 0 else x
    p2p([(dist.irecv, x, s - 1)] if s > 0 else [])
    out = stage(x)
    p2p([(dist.isend, out, s + 1)] if s < p - 1 else [])
    return out if s == p - 1 else None


def full_state_dict(model):
    """The plain state_dict of the common model, gathered on rank 0 (None elsewhere)."""
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object({k: v.detach().cpu() for k, v in model.state_dict().items()}, parts, dst=0)
    return {k: v for part in parts for k, v in part.items()} if parts else None


### end: Pipeline


def formula(psi, world, args):
    """Rank 0's bytes: its stage's psi parameters; m activations out and m gradients in per step."""
    k = 8 if args.optim == "adamw" else 4
    act = (
        4 * args.batch_size * (common.IMAGE // args.patch) ** 2 * args.dim if world > 1 else 0
    )  # 4·B·T·D
    return dict(
        param_bytes=4 * psi,
        grad_bytes=4 * psi,
        optim_bytes=k * psi,
        comm=dict(send=act, recv=act),
        notes=dict(
            param_bytes="4Ψ_s: this stage's",
            grad_bytes="4Ψ_s",
            optim_bytes=f"{k}Ψ_s",
            send="m activations of B/m·T·D fp32",
            recv="m gradients of B/m·T·D fp32",
        ),
    )


def check_args(args, world):
    common.check(args.microbatches >= 1, f"--microbatches must be >= 1, got {args.microbatches}")
    common.check(
        args.depth >= world, f"--depth {args.depth} blocks cannot fill {world} pipeline stages"
    )
    common.check(
        args.batch_size % args.microbatches == 0,
        f"--batch-size {args.batch_size} is not divisible by --microbatches {args.microbatches}",
    )
    common.check(
        args.schedule != "1f1b" or args.microbatches >= world,
        f"--schedule 1f1b needs at least as many "
        f"micro-batches as stages: --microbatches {args.microbatches} < {world} stages (or use gpipe)",
    )


def record_order(stage, m):
    """The first step's forwards and backwards on this stage in the order they ran (measured from outside)."""
    ran = []

    def hook(module, inputs, out):
        if out.requires_grad and len(ran) < 2 * m:
            n = sum(a == "F" for a, _ in ran)
            ran.append(("F", n))
            out.register_hook(lambda grad: ran.append(("B", n)))

    stage.register_forward_hook(hook)
    return ran


def show_schedule(stages, args):
    """Rank 0: the recorded orders replayed one slot per F or B, each after its input (F i on stage
    s after F i on s-1, B i after B i on s+1): the picture, the idle fraction, the peak in flight."""
    orders, slot, p, m = [st["order"] for st in stages], {}, len(stages), args.microbatches
    for _ in range(sum(map(len, orders))):  # relax until every slot is its longest path
        for s, o in enumerate(orders):
            for k, (a, i) in enumerate(o):
                dep = slot.get((s - 1 if a == "F" else s + 1, a, i), -1)
                slot[(s, a, i)] = max(dep, slot.get((s, *o[k - 1]), -1) if k else -1) + 1
    cells, total = {(s, t): f"{a}{i}" for (s, a, i), t in slot.items()}, max(slot.values()) + 1
    bubble, want = (
        1 - len(slot) / (p * total),
        (p - 1) / p if args.schedule == "naive" else (p - 1) / (m + p - 1),
    )
    peaks = [
        max(sum(1 if a == "F" else -1 for a, _ in o[: k + 1]) for k in range(len(o)))
        for o in orders
    ]
    common.log(
        f"\nschedule {args.schedule}, {p} stages, {m} micro-batches, as run (one slot per F or B):"
    )
    common.log(
        "\n".join(
            f"  rank {s}:  "
            + "".join(cells.get((s, t), ".").ljust(len(str(m)) + 2) for t in range(total)).rstrip()
            for s in range(p)
        )
    )
    common.log(
        f"  bubble {bubble:.3f} of the slots (formula {want:.3f}), peak micro-batches in flight {peaks}"
    )
    return dict(
        schedule=args.schedule, microbatches=m, bubble=bubble, peak_inflight=peaks, stages=stages
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
            loss = train_step(
                model, x, y, args.schedule, args.microbatches
            )  # forward, loss, backward
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            loss_sum += loss.detach()
            losses_summed += 1
            if step % args.log_every == 0 or step >= stop or i + 1 == len(loader):
                dist.all_reduce(loss_sum)  # only the last stage has the loss; the others add 0
                last_loss = loss_sum.item() / losses_summed
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
        logits = infer(model, x)  # stage to stage: the logits on the last, None elsewhere
        counts += (
            torch.stack([((logits.argmax(1) == y) & keep).sum(), keep.sum()])
            if logits is not None
            else 0
        )
    dist.all_reduce(counts)
    return counts[0].item() / max(counts[1].item(), 1)


def run(args):
    """One rank, in the seeds' order: join the group, deal the data, build the model, wrap it,
    train, evaluate, save on rank 0, leave the group."""
    rank, world, device, backend = setup(args)
    try:
        train_set, test_set, source = common.load_data(args, device)
        dp_rank, dp_world = 0, 1  # every stage sees the whole batch
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
        model = parallelize(model, device)  # this rank's stage only, moved to its device
        optimizer = common.make_optimizer(model.parameters(), args)
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        common.log(
            f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data ({len(train_set)} train / "
            f"{len(test_set)} test), batch {args.batch_size} = {dp_world} x {args.batch_size // dp_world}"
        )
        ran = record_order(model, args.microbatches)
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
        stages = (
            [None] * world if rank == 0 else None
        )  # each stage's measured bytes and order, on rank 0
        dist.gather_object(
            dict(meter.mem, comm=meter.comm()[0], comm_calls=meter.comm()[1], order=ran),
            stages,
            dst=0,
        )
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
            formula(sum(q.numel() for q in model.parameters()), world, args),
            **(show_schedule(stages, args) if rank == 0 else {}),
        )
    finally:
        cleanup()


def main():
    parser = common.get_parser(
        "Pipeline parallelism (naive, GPipe, 1F1B) on the common ViT, written out"
    )
    parser.add_argument("--schedule", choices=["naive", "gpipe", "1f1b"], default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per batch (m)")
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
