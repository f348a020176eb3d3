"""PipeDream's asynchronous 1F1B with weight stashing (Narayanan et al. 2019), written out: pipeline.py's
stages, with no flush. The micro-batches of all batches are one stream; stage s keeps w = p-s-1 of them
in flight across batch boundaries, and after each backward takes an optimizer step with that one micro-
batch's gradient (its mean loss). Not one process's training, by design: micro-batch j's forward on stage
s uses the weights after j-w updates (version max(0, j-w)), and its backward -- w updates later -- uses
those same weights, stashed at the forward (weight stashing), while the update goes to the current ones.

    rank 0:  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 ..    p=2, m=4: batch 2's F4 F5 .. fill batch 1's
    rank 1:  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 ..    cool-down; an update after every B

Idle: (p-1) slots at the start of training and at its end only; every stage busy in between. Memory per
rank: 16Ψ_s bytes plus p-s stashed weight versions (4Ψ_s each) and the activations of p-s micro-batches.
Per step, m activations of B/m·T·D fp32 forward and m gradients back over each stage boundary.

    torchrun --standalone --nproc_per_node=2 pipeline_pipedream.py --microbatches 4 --optim sgd
    diff -u pipeline.py pipeline_pipedream.py                 # what asynchrony and the stash change
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
        self.seen = 0  # micro-batches fed to the stream so far
        self.pending = []  # the last backward's gradient send, which stage s-1 takes in its next step

    def forward(self, x):
        for layer in [self.embed, *self.blocks.values(), self.head]:
            x = x if layer is None else layer(x)
        return x


def parallelize(model, device):
    """Keep this rank's stage, on its device; the rest of the model is dropped."""
    return Stage(model, dist.get_rank(), dist.get_world_size()).to(device)


def p2p(ops):
    """One group of [(dist.isend or dist.irecv, tensor, peer)], waited for together. NCCL runs a rank's
    groups in order, and a send holds its stream until the peer reaches the matching receive: two
    neighbours that both send first wait for ever. What must progress together goes in ONE group."""
    for work in (
        dist.batch_isend_irecv([dist.P2POp(op, t, peer) for op, t, peer in ops]) if ops else []
    ):
        work.wait()


def train_step(stage, x, y, m, optimizer, final=False):
    """This batch's m micro-batches into the stream: F j then B j-w (w = p-s-1), B on the micro-batches the
    last batches left in flight too; final drains the rest. F j runs on a copy of the weights (the stash);
    B j's gradient, taken on that copy, goes into .grad and the optimizer steps: one update per micro-batch.
    Returns the sum of this batch's micro-batch mean losses / m on the last stage (0 elsewhere)."""
    s, p, xs, ys, w = stage.s, stage.p, x.chunk(m), y.chunk(m), stage.p - stage.s - 1
    held, loss, sends, j0 = (
        stage.__dict__.setdefault("held", {}),
        torch.zeros((), device=x.device),
        stage.pending,
        stage.seen,
    )
    order = [a for j in range(j0, j0 + m) for a in (("F", j), ("B", j - w)) if a[1] >= 0]
    stage.seen += m
    for a, j in order + ([("B", j) for j in range(max(j0 + m - w, 0), j0 + m)] if final else []):
        if a == "F":
            inp = (
                xs[j - j0]
                if s == 0
                else torch.empty(len(xs[j - j0]), *stage.act_shape, device=x.device)
            )
            p2p(sends + ([(dist.irecv, inp, s - 1)] if s > 0 else []))
            stash = {n: q.detach().clone().requires_grad_() for n, q in stage.named_parameters()}
            out = torch.func.functional_call(
                stage, stash, (inp.requires_grad_() if s > 0 else inp,)
            )
            if s == p - 1:  # the mean over the micro-batch's B/m samples: its own step
                out = F.cross_entropy(out, ys[j - j0])
                loss += out.detach() / m
            held[j] = inp, out, stash  # activations and weights kept until micro-batch j's backward
            sends = [(dist.isend, out.detach(), s + 1)] if s < p - 1 else []
        else:
            inp, out, stash = held.pop(j)
            grad = torch.empty_like(out) if s < p - 1 else None
            p2p(sends + ([(dist.irecv, grad, s + 1)] if s < p - 1 else []))
            out.backward(grad)  # through the stashed weights of micro-batch j's forward
            for n, q in stage.named_parameters():
                q.grad = stash[n].grad
            optimizer.step()  # this stage's weights move on; the stash stays as it was
            optimizer.zero_grad(set_to_none=True)
            sends = [(dist.isend, inp.grad, s - 1)] if s > 0 else []
    # Stage s-1 takes the last backward's gradient only in its next step, after its next forward: post
    # that send with this stage's first receive of the next step, so that no send is left waiting while
    # the loop runs a collective between steps (NCCL and Gloo would both hang there).
    stage.pending = sends if a == "B" and not final else []
    p2p([] if stage.pending else sends)
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
    """Rank 0's bytes: its stage's psi parameters (the stashed copies come and go with the micro-batches).
    The Meter's steps are optimizer steps, one per micro-batch here: no per-batch promise for its bytes."""
    k = 8 if args.optim == "adamw" else 4
    return dict(
        param_bytes=4 * psi,
        grad_bytes=4 * psi,
        optim_bytes=k * psi,
        notes=dict(
            param_bytes="4Ψ_s: this stage's",
            grad_bytes="4Ψ_s",
            optim_bytes=f"{k}Ψ_s",
            send="an activation of B/m·T·D fp32 per micro-batch",
            recv="a gradient per micro-batch",
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


def record_versions(stage, optimizer, n):
    """Per micro-batch j < n on this stage, measured from outside: how many optimizer steps the stage had
    taken when j's forward ran (the version stashed) and when j's backward began; and their order."""
    steps, fwd, bwd, ran = [0], {}, {}, []
    optimizer.register_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))

    def hook(module, inputs, out):
        j = len(fwd)
        if out.requires_grad and j < n:
            fwd[j] = steps[0]
            ran.append(("F", j, 0))
            out.register_hook(lambda grad: bwd.__setitem__(j, steps[0]) or ran.append(("B", j, 0)))

    stage.register_forward_hook(hook)
    return lambda: dict(
        fwd=[fwd[j] for j in sorted(fwd)], bwd=[bwd[j] for j in sorted(bwd)], order=ran
    )


def show_schedule(stages, args):
    """Rank 0: the first two batches' forwards and backwards as run, replayed one slot per F, two per B (as
    if training stopped there): no flush between them, so the idle fraction is one 1F1B's over 2m."""
    p, m = len(stages), args.microbatches
    picture, bubble, peaks = common.pipeline_timeline(
        [[tuple(a) for a in st["versions"]["order"]] for st in stages], dict(F=1, B=2)
    )
    common.log(
        f"\nPipeDream, {p} stages, the first two batches of {m} micro-batches as run (one slot per F, two "
        f"per B):\n{picture}\n  bubble {bubble:.3f} of the slots (formula (p-1)/(2m+p-1) = "
        f"{(p - 1) / (2 * m + p - 1):.3f}), peak micro-batches in flight {peaks}"
    )
    return dict(microbatches=m, bubble=bubble, peak_inflight=peaks, stages=stages)


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
            final = step + 1 >= stop or (
                epoch + 1 == args.epochs and i + 1 == len(loader)
            )  # drain the pipeline
            loss = train_step(
                model, x, y, args.microbatches, optimizer, final
            )  # with an update per micro-batch
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
        versions = record_versions(model, optimizer, 2 * args.microbatches)
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
            dict(meter.mem, comm=meter.comm()[0], comm_calls=meter.comm()[1], versions=versions()),
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
        "PipeDream: asynchronous 1F1B with weight stashing on the common ViT, written out"
    )
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per batch (m)")
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
