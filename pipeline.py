"""Pipeline parallelism, written out: the model's blocks cut into W contiguous stages, one per
rank (stage 0 also holds the patch embedding, the last stage the head and the loss). Activations
go forward and their gradients back with point-to-point batch_isend_irecv; each batch is cut into
m micro-batches so that stages can work at the same time.

    W = [W1 | W2 | … | Wp] = [embed, blocks 0 .. d/p-1 | … | blocks … d-1, head]   rank s holds W(s+1)
    rank 0:  F0 F1 .  B0 F2 B1 F3 B2 .  B3      1F1B, p=2, m=4 (one slot per F or B, '.' idle)
    rank 1:  .  F0 B0 F1 B1 F2 B2 F3 B3 .

--schedule naive: one micro-batch in flight (the layer-per-device split; bubble (p-1)/p);
gpipe (Huang et al. 2019): all m forwards, then all m backwards; 1f1b (PipeDream-flush,
Narayanan et al. 2021): p-s-1 warm-up forwards, then one-forward-one-backward, then cool-down
backwards. gpipe and 1f1b both idle (p-1)/(m+p-1) of the time; 1F1B holds the activations of
at most p micro-batches per stage instead of m. All three are synchronous: one optimizer step
per batch, with the loss scaled by 1/m, so the result equals plain training.

Memory per rank (fp32): params, grads and optimizer state of its own stage only, about
16Ψ/p bytes with AdamW; activations of the micro-batches in flight (m for gpipe, ≤ p for 1f1b).
Communication per step: m activations of B/m·T·D forward and m gradients back over each of the
p-1 stage boundaries: 2(p-1)·4·B·T·D bytes in all, no collectives.

    torchrun --standalone --nproc_per_node=2 pipeline.py --schedule 1f1b --microbatches 4
    torchrun --standalone --nproc_per_node=4 pipeline.py --schedule gpipe --microbatches 8
    python pipeline.py                                          # W=1: the whole model on one stage
"""
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import common

COUNT = {"sends": 0, "bytes": 0}               # point-to-point sends this rank posted


class Stage(nn.Module):
    """Blocks lo..hi-1 of the common model, plus the embedding on stage 0 and the head on the last."""

    def __init__(self, model, s, p):
        super().__init__()
        depth = len(model.blocks)
        self.lo, self.hi = s * depth // p, (s + 1) * depth // p
        self.embed = model.embed if s == 0 else None
        self.blocks = nn.ModuleList(model.blocks[self.lo:self.hi])
        self.head = model.head if s == p - 1 else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x

    def plain_state_dict(self):
        """This stage's tensors under the common model's keys (blocks.{global index}.…)."""
        sd = {f"embed.{k}": v for k, v in self.embed.state_dict().items()} if self.embed is not None else {}
        for i, block in enumerate(self.blocks):
            sd.update({f"blocks.{self.lo + i}.{k}": v for k, v in block.state_dict().items()})
        if self.head is not None:
            sd.update({f"head.{k}": v for k, v in self.head.state_dict().items()})
        return {k: v.detach().cpu() for k, v in sd.items()}


def schedule(name, m, p, s):
    """Stage s's actions in order: ("F", i) forward / ("B", i) backward of micro-batch i."""
    if name == "naive":
        return [(a, i) for i in range(m) for a in "FB"]
    if name == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(p - s - 1, m)                     # 1f1b: stage s starts p-s-1 micro-batches ahead
    steady = [a for i in range(m - warm) for a in (("F", warm + i), ("B", i))]
    return [("F", i) for i in range(warm)] + steady + [("B", i) for i in range(m - warm, m)]


def timeline(orders):
    """Replay the per-stage orders with one time slot per F or B, each waiting for its input
    (F_i on stage s for F_i on s-1, B_i for B_i on s+1). Returns (slot of each action per stage,
    slots in all)."""
    p, done, slot, pos, free = len(orders), {}, [{} for _ in orders], [0] * len(orders), [0] * len(orders)
    while any(pos[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            if pos[s] == len(orders[s]):
                continue
            a, i = orders[s][pos[s]]
            dep = (s - 1, "F", i) if a == "F" and s > 0 else (s + 1, "B", i) if a == "B" and s < p - 1 else None
            if dep is not None and dep not in done:
                continue
            t = max(free[s], done[dep] if dep else 0)
            slot[s][(a, i)], done[(s, a, i)], free[s], pos[s], moved = t, t + 1, t + 1, pos[s] + 1, True
        if not moved:
            raise RuntimeError("the schedule deadlocks")
    return slot, max(free)


def draw(orders):
    slot, total = timeline(orders)
    w = max(len(f"B{i}") for o in orders for _, i in o) + 1
    rows = []
    for s, o in enumerate(orders):
        cells = ["." for _ in range(total)]
        for a, i in o:
            cells[slot[s][(a, i)]] = f"{a}{i}"
        rows.append(f"  rank {s}:  " + "".join(c.ljust(w) for c in cells).rstrip())
    return "\n".join(rows), 1 - sum(len(o) for o in orders) / (len(orders) * total)


def send(t, peer):
    """Post a send and go on: returns its Work handles (and the tensor, kept alive until they
    finish), waited for at the end of the step. A rank blocks only on receives, so sends posted
    as soon as their tensor exists can never deadlock and never delay the next stage."""
    COUNT["sends"] += 1
    COUNT["bytes"] += t.numel() * t.element_size()
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer)]), t


def recv(t, peer):
    for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, peer)]):
        work.wait()
    return t


def train_step(stage, order, x, y, args, s, p, device, stats):
    """Run this stage's part of one batch; returns the summed (scaled) loss on the last stage."""
    m, last = args.microbatches, s == p - 1
    xs, ys = x.chunk(m), y.chunk(m)
    shape = (x.shape[0] // m, common.TOKENS, args.dim)
    held, pending, loss = {}, [], torch.zeros((), device=device)
    for a, i in order:
        if a == "F":
            inp = xs[i] if s == 0 else recv(torch.empty(shape, device=device), s - 1).requires_grad_()
            t0 = time.perf_counter()
            out = stage(inp)
            if last:                              # mean over B/m samples, / m: the full batch's mean
                out = F.cross_entropy(out, ys[i]) / m
                loss += out.detach()
            held[i] = (inp, out)                  # activations kept until this micro-batch's backward
            stats["peak"] = max(stats["peak"], len(held))
        else:
            inp, out = held.pop(i)
            grad = None if last else recv(torch.empty_like(out), s + 1)
            t0 = time.perf_counter()
            out.backward(grad)
        if device.type == "cuda":
            torch.cuda.synchronize()
        stats["busy"] += time.perf_counter() - t0
        if a == "F" and not last:
            pending.append(send(out.detach(), s + 1))
        if a == "B" and s > 0:
            pending.append(send(inp.grad, s - 1))
    for works, _ in pending:
        for work in works:
            work.wait()
    return loss


def setup(backend, timeout):
    # MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE come from the environment (torchrun or default_env).
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def train(stage, optimizer, loader, sampler, args, device, s, p):
    steps, t_train, loss_sum, loss_n, last_loss, mem = 0, 0.0, torch.zeros((), device=device), 0, float("nan"), {}
    stats = dict(peak=0, busy=0.0, step_time=0.0)
    order = schedule(args.schedule, args.microbatches, p, s)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        stage.train()
        t0 = time.perf_counter()
        bar = common.progress(loader, args, desc=f"epoch {epoch}")
        for x, y in bar:                           # every rank reads the batch: stage 0 uses x, the last y
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            t_step = time.perf_counter()
            loss_sum += train_step(stage, order, x, y, args, s, p, device, stats)
            stats["step_time"] += time.perf_counter() - t_step
            optimizer.step()
            if steps == 0:
                mem = dict(param_bytes=common.param_bytes(stage.parameters()),
                           grad_bytes=common.grad_bytes(stage.parameters()),
                           optim_bytes=common.optimizer_bytes(optimizer))
            optimizer.zero_grad(set_to_none=True)
            steps, loss_n = steps + 1, loss_n + 1
            if steps % 20 == 0 or steps == args.max_steps or steps % len(loader) == 0:
                dist.all_reduce(loss_sum)          # only the last stage has a loss; the others add 0
                last_loss, loss_sum, loss_n = loss_sum.item() / loss_n, loss_sum * 0, 0
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
    return dict(steps=steps, loss=last_loss, train_time=t_train, order=order, **stats, **mem)


@torch.no_grad()
def evaluate(stage, loader, device, s, p, dim):
    """Whole test batches through the stages in turn; the last stage counts, one all-reduce shares it."""
    stage.eval()
    counts = torch.zeros(2, dtype=torch.long, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        if s > 0:
            x = torch.empty(len(y), common.TOKENS, dim, device=device)
            dist.recv(x, s - 1)
        out = stage(x)
        if s < p - 1:
            dist.send(out, s + 1)
        else:
            counts += torch.stack([(out.argmax(1) == y).sum(), torch.tensor(len(y), device=device)])
    dist.all_reduce(counts)
    return counts[0].item() / max(counts[1].item(), 1)


def check_args(args, world):
    if args.microbatches is None:
        args.microbatches = 1 if args.schedule == "naive" else 4
    common.check(args.microbatches >= 1, f"--microbatches must be >= 1, got {args.microbatches}")
    common.check(args.depth >= world, f"--depth {args.depth} blocks cannot fill {world} pipeline stages: "
                                      f"every stage needs at least one block")
    common.check(args.batch_size % args.microbatches == 0,
                 f"--batch-size {args.batch_size} is not divisible by --microbatches {args.microbatches}")
    common.check(args.schedule != "1f1b" or args.microbatches >= world,
                 f"--schedule 1f1b needs at least as many micro-batches as stages: --microbatches "
                 f"{args.microbatches} < {world} stages (use gpipe, or more micro-batches)")


def run(args):
    check_args(args, int(os.environ["WORLD_SIZE"]))
    backend, device = common.pick_backend(args.backend)
    model = common.build_model(args)               # the full, seeded model; each rank keeps its stage
    if args.load:
        model.load_state_dict(common.load_state_dict_file(args.load, model.state_dict()))
    keys, psi = list(model.state_dict()), sum(q.numel() for q in model.parameters())
    s, p = setup(backend, args.timeout)
    try:
        xtr, ytr, xte, yte, source = common.load_data(args)
        loader, sampler = common.train_loader(xtr, ytr, args.batch_size, 0, 1, args.seed)   # world=1: all the batch
        common.check(len(loader) > 0, f"{len(ytr)} training samples make no full batch of {args.batch_size}")
        stage = Stage(model, s, p).to(device)
        del model
        optimizer = common.make_optimizer(stage.parameters(), args)
        psi_stage = sum(q.numel() for q in stage.parameters())
        spans = [None] * p
        dist.all_gather_object(spans, (stage.lo, stage.hi))
        common.log(f"pipeline: {p} stages (blocks " + ", ".join(f"{lo}..{hi - 1}" for lo, hi in spans) +
                   f"), schedule {args.schedule}, {args.microbatches} micro-batches of "
                   f"{args.batch_size // args.microbatches}, Ψ = {psi:,} parameters, {source} data "
                   f"({len(ytr)} train / {len(yte)} test)")
        COUNT.update({k: 0 for k in COUNT})
        out = train(stage, optimizer, loader, sampler, args, device, s, p)
        steps = max(out["steps"], 1)
        acc = evaluate(stage, common.test_loader(xte, yte, 512), device, s, p, args.dim)
        # What every rank did: its order of actions, peak in flight, busy time, sends.
        per_rank = [None] * p
        dist.all_gather_object(per_rank, dict(order=out["order"], peak=out["peak"], busy=out["busy"],
                                              step_time=out["step_time"], sends=COUNT["sends"], bytes=COUNT["bytes"],
                                              psi=psi_stage))
        picture, bubble = draw([r["order"] for r in per_rank])
        m = args.microbatches
        formula = (p - 1) / p if args.schedule == "naive" else (p - 1) / (m + p - 1)
        wall = 1 - sum(r["busy"] / max(r["step_time"], 1e-9) for r in per_rank) / p
        peaks = [r["peak"] for r in per_rank]
        sends, comm_total = sum(r["sends"] for r in per_rank) // steps, sum(r["bytes"] for r in per_rank) // steps
        comm_bytes = COUNT["bytes"] // steps
        common.log(f"\nschedule {args.schedule}, {p} stages, {m} micro-batches (one slot per F or B, '.' idle):")
        common.log(picture)
        common.log(f"  bubble: {bubble:.3f} of the slots above, formula "
                   f"{'(p-1)/p' if args.schedule == 'naive' else '(p-1)/(m+p-1)'} = {formula:.3f}; "
                   f"measured wall clock {wall:.3f} idle (waits and transfers included)")
        common.log(f"  peak micro-batches in flight per stage: {peaks} "
                   f"(gpipe: m = {m}; 1f1b: <= p = {p}; naive: 1)")
        common.log(f"  sends per step {sends} (expected 2(p-1)m = {2 * (p - 1) * m})")
        n = args.batch_size * common.TOKENS * args.dim
        common.report([
            ("parameters", out["param_bytes"], 4 * psi_stage, "4Ψ_stage"),
            ("gradients", out["grad_bytes"], 4 * psi_stage, "4Ψ_stage"),
            ("optimizer state", out["optim_bytes"], (8 if args.optim == "adamw" else 4) * psi_stage,
             "8Ψ_stage AdamW m, v" if args.optim == "adamw" else "4Ψ_stage SGD momentum"),
            ("sent per step (rank 0)", comm_bytes, 4 * n if p > 1 else 0, "4BTD activations"),
            ("sent per step (all)", comm_total, 2 * (p - 1) * 4 * n, "2(p-1)·4BTD"),
        ])
        sps = out["steps"] * args.batch_size / max(out["train_time"], 1e-9)
        common.log(f"\ntest accuracy {acc:.4f}, final train loss {out['loss']:.4f}, {sps:.0f} samples/s")
        if args.save:
            parts = [None] * p
            dist.all_gather_object(parts, stage.plain_state_dict())
            if s == 0:
                merged = {k: v for part in parts for k, v in part.items()}
                common.save_checkpoint({k: merged[k] for k in keys}, args.save)
                common.log(f"saved {args.save}")
        common.result(script="pipeline", world_size=p, backend=backend, device=device.type, data=source,
                      params=psi, steps=out["steps"], loss=out["loss"], test_acc=acc, samples_per_s=sps,
                      param_bytes=out["param_bytes"], grad_bytes=out["grad_bytes"], optim_bytes=out["optim_bytes"],
                      comm_bytes=comm_bytes, schedule=args.schedule, microbatches=m,
                      stage_params=[r["psi"] for r in per_rank],
                      bubble=bubble, bubble_formula=formula, bubble_wall=wall, peak_inflight=peaks,
                      p2p_sends=sends, p2p_sends_expected=2 * (p - 1) * m, p2p_bytes=comm_total)
        dist.barrier()        # leave together: a Gloo rank torn down while rank 0 still saves aborted once
    finally:
        cleanup()


def main():
    parser = common.get_parser("Pipeline parallelism (naive, GPipe, 1F1B) on the common ViT, written out")
    parser.add_argument("--schedule", choices=["naive", "gpipe", "1f1b"], default="1f1b")
    parser.add_argument("--microbatches", type=int, default=None, help="micro-batches per batch (default: 1 for "
                        "naive, 4 otherwise)")
    common.default_env()
    args = common.parse_args(parser)
    run(args)


if __name__ == "__main__":
    main()
