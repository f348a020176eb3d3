"""Pipeline schedules past 1F1B, written out: pipeline.py's stages and paired point-to-point, with
--schedule interleaved (Megatron-LM, Narayanan et al. 2021): rank s holds V chunks, global chunks s,
s+p, ... of the blocks cut into V·p, so a micro-batch crosses the ranks V times and the fill and drain
cost a V-th; zb-h1 (Zero Bubble, Qi et al. 2024): each backward split into B, the input's gradient
(the previous rank waits for it), and W, the weight gradients (nothing waits), Ws where 1F1B idles.

    rank 0:  F0 F1 .  B0 W0 F2 B1 W1 F3 B2 W2 B3 W3         zb-h1, p=2, m=4: one slot per F, B or W
    rank 1:  .  F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3         (1f1b's whole backward takes two)

Idle: 1f1b (p-1)/(m+p-1) (pipeline.py's); interleaved (p-1)/(V·m+p-1); zb-h1 (p-1)/(3m+p-1): ZB's
(p-1)(F+B-W) per rank next to 3m busy slots, a third of 1f1b's. All synchronous: exact.
Here W goes back through the graph B kept (backward to the parameters): about a whole backward.
Memory per rank (fp32, AdamW): 16Ψ_s bytes for its Ψ_s parameters plus the activations in flight: p-s
micro-batches on stage s (1f1b); 2(p-s-1) + (V-1)·p + 1 chunks of 1/V stage (interleaved); p (zb-h1,
1f1b's peak). Per step, m activations of B/m·T·D fp32 forward and m gradients back over each of the
V·p-1 chunk boundaries (interleaved: V times 1f1b's messages); no collectives.

    torchrun --standalone --nproc_per_node=4 pipeline_schedules.py --schedule interleaved --virtual-stages 2 --depth 8
    torchrun --standalone --nproc_per_node=4 pipeline_schedules.py --schedule zb-h1 --microbatches 8
    diff -u pipeline.py pipeline_schedules.py                 # what the schedules change
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
    """Rank s of p: its chunk v is global chunk c = v·p + s of C = V·p (blocks c·d/C .. (c+1)·d/C - 1),
    the embedding before chunk 0 and the head after chunk C-1. Blocks keep their index in the model."""

    def __init__(self, model, s, p, V=1):
        super().__init__()
        d, C, self.s, self.p, self.V = len(model.blocks), V * p, s, p, V
        self.embed = model.embed if s == 0 else None
        self.chunks = [range(c * d // C, (c + 1) * d // C) for c in range(s, C, p)]
        self.blocks = torch.nn.ModuleDict(
            {str(i): model.blocks[i] for chunk in self.chunks for i in chunk}
        )
        self.head = model.head if s == p - 1 else None
        self.act_shape = tuple(model.embed.pos.shape[1:])  # (T, D): what crosses a chunk boundary

    def forward(self, x, v=0):
        c = v * self.p + self.s
        for layer in [
            self.embed if c == 0 else None,
            *(self.blocks[str(i)] for i in self.chunks[v]),
            self.head if c == self.V * self.p - 1 else None,
        ]:
            x = x if layer is None else layer(x)
        return x


def parallelize(model, device, V=1):
    """Keep this rank's chunks, on its device; the rest of the model is dropped."""
    return Stage(model, dist.get_rank(), dist.get_world_size(), V).to(device)


def schedule(name, m, p, s, V=1):
    """Rank s's (F|B|W, micro-batch, chunk) for one batch, in steps. 1f1b: p-s-1 forwards ahead, then one
    forward one backward, then the rest. zb-h1: 1f1b, W of micro-batch k-s after the k-th B, the rest at
    the end. interleaved (Megatron): the forwards in groups of p micro-batches, chunk by chunk, 2(p-s-1) +
    (V-1)·p of them ahead, then steps of one F and one B (the same order, chunks reversed)."""
    if name == "interleaved":
        fwd = [(k // (p * V) * p + k % p, k % (p * V) // p) for k in range(m * V)]
        bwd, warm = (
            [(i, V - 1 - v) for i, v in fwd],
            m * V if m == p else min(2 * (p - s - 1) + (V - 1) * p, m * V),
        )
        return (
            [[("F", *f)] for f in fwd[:warm]]
            + [[("F", *f), ("B", *b)] for f, b in zip(fwd[warm:], bwd)]
            + [[("B", *b)] for b in bwd[m * V - warm :]]
        )
    warm = min(p - s - 1, m)
    order = [("F", i, 0) for i in range(warm)] + [
        a for i in range(m - warm) for a in (("F", warm + i, 0), ("B", i, 0))
    ]
    order += [("B", i, 0) for i in range(m - warm, m)]
    for j, k in reversed(
        list(enumerate([k for k, a in enumerate(order) if a[0] == "B"][s:]))
        if name == "zb-h1"
        else []
    ):
        order.insert(k + 1, ("W", j, 0))
    return [
        [a] for a in order + ([("W", i, 0) for i in range(m - s, m)] if name == "zb-h1" else [])
    ]


def p2p(ops):
    """One group of [(dist.isend or dist.irecv, tensor, peer)], waited for together. NCCL runs a rank's
    groups in order, and a send holds its stream until the peer reaches the matching receive: two
    neighbours that both send first wait for ever. What must progress together goes in ONE group."""
    for work in (
        dist.batch_isend_irecv([dist.P2POp(op, t, peer) for op, t, peer in ops]) if ops else []
    ):
        work.wait()


def train_step(stage, x, y, name, m):
    """Forward, loss and backward of every micro-batch in the schedule's order: the batch's mean loss on
    the last stage, 0 elsewhere. A step's sends go in one group with the next step's receives (Megatron-
    LM, torch.distributed.pipelining), so no two ranks both wait to send."""
    s, p, V, xs, ys, zb = stage.s, stage.p, stage.V, x.chunk(m), y.chunk(m), name == "zb-h1"
    C, steps, got, held, grads, loss = (
        V * p,
        schedule(name, m, p, s, V),
        {},
        {},
        {},
        torch.zeros((), device=x.device),
    )
    to = lambda a, c: c + 1 if a == "F" else c - 1  # where F's output (B's input gradient) goes

    def receives(step):  # each action's input, from chunk to(B|F, c)
        got.update(
            {
                (a, i, v): torch.empty(len(xs[i]), *stage.act_shape, device=x.device)
                for a, i, v in step
                if a != "W" and 0 <= to("B" if a == "F" else "F", v * p + s) < C
            }
        )
        return [
            (dist.irecv, got[a, i, v], (s - 1 if a == "F" else s + 1) % p)
            for a, i, v in step
            if (a, i, v) in got
        ]

    p2p(receives(steps[0]))
    for k, step in enumerate(steps):
        sends = []
        for a, i, v in step:
            c = v * p + s
            if a == "F":
                inp = xs[i] if c == 0 else got.pop((a, i, v)).requires_grad_()
                out = stage(inp, v)
                if c == C - 1:  # mean over B/m samples, / m: the mean over the batch
                    out = F.cross_entropy(out, ys[i]) / m
                    loss += out.detach()
                held[i, v] = inp, out  # activations kept until micro-batch i's B (zb-h1: W)
            elif a == "B":
                inp, out = held[i, v] if zb else held.pop((i, v))
                grads[i, v] = got.pop((a, i, v)) if c < C - 1 else None
                if not zb or c > 0:  # zb-h1: the input's gradient only, the graph kept for W
                    out.backward(grads[i, v], inputs=[inp] if zb else None, retain_graph=zb)
            else:  # W: the weights' gradients, back through the kept graph
                held.pop((i, v))[1].backward(grads.pop((i, v)), inputs=list(stage.parameters()))
            if a != "W" and 0 <= to(a, c) < C:
                sends.append((dist.isend, out.detach() if a == "F" else inp.grad, to(a, c) % p))
        p2p(sends + (receives(steps[k + 1]) if k + 1 < len(steps) else []))
    return loss


@torch.no_grad()
def infer(stage, x):
    """The whole batch through the chunks in turn: the logits on the last stage, None on the others."""
    s, p, C = stage.s, stage.p, stage.V * stage.p
    for v in range(stage.V):
        x = torch.empty(len(x), *stage.act_shape, device=x.device) if v * p + s > 0 else x
        p2p([(dist.irecv, x, (s - 1) % p)] if v * p + s > 0 else [])
        x = stage(x, v)
        p2p([(dist.isend, x, (s + 1) % p)] if v * p + s < C - 1 else [])
    return x if s == p - 1 else None


def full_state_dict(model):
    """The plain state_dict of the common model, gathered on rank 0 (None elsewhere)."""
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object({k: v.detach().cpu() for k, v in model.state_dict().items()}, parts, dst=0)
    return {k: v for part in parts for k, v in part.items()} if parts else None


### end: Pipeline


def formula(psi, world, args):
    """Rank 0's bytes: its stage's psi parameters; per micro-batch an activation out of each of its V
    chunks and a gradient out of each but the first (2V-1), as many in."""
    k, n = 8 if args.optim == "adamw" else 4, 2 * args.virtual_stages - 1
    act = (
        4 * args.batch_size * (common.IMAGE // args.patch) ** 2 * args.dim * n if world > 1 else 0
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
            send=f"{n}·m tensors of B/m·T·D fp32",
            recv=f"{n}·m tensors of B/m·T·D fp32",
        ),
    )


def check_args(args, world):
    name, m, V = args.schedule, args.microbatches, args.virtual_stages
    common.check(
        m >= world and args.batch_size % m == 0,
        f"--schedule {name} needs --microbatches >= {world} "
        f"stages and dividing --batch-size {args.batch_size}, got {m}",
    )
    common.check(
        args.depth >= world * V >= 1,
        f"--depth {args.depth} blocks cannot fill {world} stages x {V} chunks",
    )
    common.check(
        (name == "interleaved") == (V > 1) and (V == 1 or world >= 2 and m % world == 0),
        "--schedule "
        f"interleaved needs --virtual-stages >= 2, >= 2 stages, --microbatches a multiple of them "
        f"(and the others V = 1): {name}, V={V}, p={world}, m={m}",
    )


def show_schedule(stages, args):
    """Rank 0: the recorded orders replayed in slots (an F, B or W one, a whole backward two): the picture,
    the idle fraction next to its formula, the peak micro-batch chunks in flight."""
    m, V, p, zb = args.microbatches, args.virtual_stages, len(stages), args.schedule == "zb-h1"
    picture, bubble, peaks = common.pipeline_timeline(
        [[tuple(a) for a in st["order"]] for st in stages], dict(F=1, B=1 if zb else 2, W=1), V
    )
    want = (p - 1) / ({"interleaved": V * m, "zb-h1": 3 * m}.get(args.schedule, m) + p - 1)
    common.log(
        f"\nschedule {args.schedule}, {p} stages x {V} chunks, {m} micro-batches, as run (one slot per F, B "
        f"or W of a chunk, a whole backward two; F3' is micro-batch 3 in the rank's next chunk):\n{picture}"
    )
    common.log(
        f"  bubble {bubble:.3f} of the slots (formula {want:.3f}), peak micro-batch chunks in flight {peaks}"
    )
    return dict(
        schedule=args.schedule,
        microbatches=m,
        virtual_stages=V,
        bubble=bubble,
        peak_inflight=peaks,
        stages=stages,
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
        model = parallelize(model, device, args.virtual_stages)  # this rank's chunks, on its device
        optimizer = common.make_optimizer(model.parameters(), args)
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        common.log(
            f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data ({len(train_set)} train / "
            f"{len(test_set)} test), batch {args.batch_size} = {dp_world} x {args.batch_size // dp_world}"
        )
        ran = common.record_pipeline_order(
            model, args.microbatches, weights=args.schedule == "zb-h1"
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
        "Pipeline schedules past 1F1B (interleaved, zero-bubble) on the common ViT"
    )
    parser.add_argument("--schedule", choices=["1f1b", "interleaved", "zb-h1"], default="1f1b")
    parser.add_argument(
        "--virtual-stages", type=int, default=1, help="chunks per rank (V), interleaved"
    )
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per batch (m)")
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
