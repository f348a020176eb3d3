"""DDP under torchrun, with snapshots: the training of ddp.py, plus a snapshot (model, optimizer,
LR schedule, step, RNG state) written after every epoch, from which a restarted run carries on
where the last one stopped: the same steps on the same batches with the same state.

    rank 0: [ full model ]  batch[0::W] --\
    rank 1: [ full model ]  batch[1::W] ---+-- all-reduce(grads) / W --> same step on every rank
    ...                                 --/

Memory per rank (fp32, AdamW, Ψ parameters): 4Ψ params + 4Ψ grads + 8Ψ optimizer = 16Ψ bytes.
Communication per step: one all-reduce of Ψ gradient elements (bucketed, overlapped with
backward); a ring all-reduce sends 2(W-1)/W · 4Ψ bytes per rank.
Paper: Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
https://arxiv.org/abs/2006.15704. How a run resumes: docs/techniques.md#ddp-snapshots-and-restarts

    torchrun --standalone --nproc_per_node=4 --max-restarts=3 ddp_torchrun.py --snapshot snap.pt
        # a crashed worker makes torchrun restart all of them; they resume from snap.pt
    python ddp_torchrun.py --nproc 4 --snapshot snap.pt
        # after a crash, the same command resumes

    # two nodes, 4 processes each; run on every node (node-rank 0 on the first, 1 on the second):
    torchrun --nnodes=2 --nproc_per_node=4 --node-rank=0 --rdzv-backend=c10d --max-restarts=3 \
             --rdzv-endpoint=HOST_OF_NODE0:29500 --rdzv-id=job1 \
             ddp_torchrun.py --snapshot /shared/snap.pt
"""

import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

import common

SCRIPT = os.path.splitext(os.path.basename(__file__))[0]


### begin: DDP
# Model contract: any nn.Module, built with the same weights on every rank (DDP also broadcasts
# rank 0's parameters when it wraps), on this rank's device.


def parallelize(model, device):
    """DDP hooks every parameter: as backward produces gradients it all-reduces them in ~25 MB
    buckets, overlapped with the rest of backward, and divides by W. Each rank's loss is the mean
    over its batch/W samples, so every rank then holds the gradient of the global batch's mean."""
    return DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )  # grads live in DDP's buckets: no second copy


def full_state_dict(model):
    """The model's own state_dict(), hooks and buffers included: every rank holds it whole."""
    return {k: v.detach().cpu() for k, v in model.module.state_dict().items()}


### end: DDP


### begin: Snapshots
# Model contract: any nn.Module, loaded before DDP wraps it; an optimizer and an LR scheduler
# (state_dict() / load_state_dict()). Every rank calls each function, at the same point.


def save_snapshot(path, model, optimizer, scheduler, step, device):
    """All a restarted run needs to go on exactly: the weights, the optimizer state, the schedule's
    position, the step and every rank's RNG state (its CPU generator and its own GPU's), gathered
    to rank 0, which writes them."""
    if not path:
        return
    rng_state = dict(
        cpu=torch.get_rng_state(),
        cuda=torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    )
    # gather_object fills a list of W slots on the destination; the other ranks pass None.
    rng_states = None
    if dist.get_rank() == 0:
        rng_states = [None] * dist.get_world_size()
    dist.gather_object(rng_state, rng_states, dst=0)
    # Every rank calls it: under a sharding technique, gathering the weights is a collective.
    weights = full_state_dict(model)
    if dist.get_rank() == 0:
        snapshot = dict(
            model=weights,
            optimizer=optimizer.state_dict(),
            scheduler=scheduler.state_dict(),
            step=step,
            rng=rng_states,
        )
        write_atomically(snapshot, path)
        print(f"snapshot: step {step} saved to {path}", flush=True)


def write_atomically(snapshot, path):
    """torch.save to a temporary file, flushed to disk, then renamed over `path`: a crash while
    saving leaves the last snapshot whole, and no reader ever sees half a file."""
    temporary = f"{path}.tmp.{os.getpid()}"
    with open(temporary, "wb") as f:
        torch.save(snapshot, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def load_snapshot(path, model, device):
    """Rank 0 alone decides: it looks for `path` and broadcasts the step the snapshot holds (-1:
    none), so that ranks that see different files cannot diverge. Then every other rank reads the
    snapshot too, and each loads its weights into the bare model, before DDP wraps it (DDP's
    start-up broadcast then sends the loaded weights). Returns the snapshot, or None to start
    afresh."""
    if not path:
        return None
    snapshot = None
    # On this rank's device: NCCL broadcasts GPU tensors, Gloo CPU ones.
    step = torch.tensor([-1], device=device)  # -1: no snapshot
    if dist.get_rank() == 0 and os.path.exists(path):
        snapshot = torch.load(path, map_location="cpu", weights_only=True)
        step.fill_(snapshot["step"])
    dist.broadcast(step, src=0)
    if step.item() < 0:
        return None
    if dist.get_rank() != 0:
        snapshot = read_snapshot_of_step(path, step.item())
    model.load_state_dict(snapshot["model"])
    return snapshot


def read_snapshot_of_step(path, step):
    """A rank other than 0 reads `path`, which must hold the step rank 0 found there. A rank that
    cannot see it (no shared file system) must stop, not train from scratch beside the others."""
    snapshot = None
    if os.path.exists(path):
        snapshot = torch.load(path, map_location="cpu", weights_only=True)
    if snapshot is None or snapshot["step"] != step:
        raise RuntimeError(
            f"rank {dist.get_rank()} does not find the snapshot of step {step} that rank 0 "
            f"resumes from in {path}: --snapshot must be on a file system every rank shares"
        )
    return snapshot


def resume(snapshot, optimizer, scheduler, device):
    """Restore the optimizer, the schedule's position and this rank's RNG state; returns the step
    to go on from (0: no snapshot)."""
    if snapshot is None:
        return 0
    optimizer.load_state_dict(snapshot["optimizer"])  # moves the state to the parameters' device
    scheduler.load_state_dict(snapshot["scheduler"])
    # Restarted at another world size, a rank takes some rank's generator state.
    rng_state = snapshot["rng"][dist.get_rank() % len(snapshot["rng"])]
    torch.set_rng_state(rng_state["cpu"])
    if device.type == "cuda" and rng_state["cuda"] is not None:
        torch.cuda.set_rng_state(rng_state["cuda"], device)  # this rank's own GPU only
    if dist.get_rank() == 0:
        print(f"snapshot: resuming at step {snapshot['step']}", flush=True)
    return snapshot["step"]


### end: Snapshots


def formula(psi, world, args):
    """The paper's per-rank bytes, which the report sets next to what the Meter measured."""
    k = 8 if args.optim == "adamw" else 4  # the ZeRO paper's K: optimizer bytes per parameter
    return dict(
        param_bytes=4 * psi,
        grad_bytes=4 * psi,
        optim_bytes=k * psi,
        comm=dict(all_reduce=4 * psi),
        notes=dict(
            param_bytes="4Ψ replicated",
            grad_bytes="4Ψ replicated",
            optim_bytes=f"{k}Ψ " + ("AdamW m, v" if k == 8 else "SGD momentum"),
            all_reduce="Ψ fp32 gradients; a ring sends 2(W-1)/W of it",
        ),
    )


def check_args(args, world):
    common.check(
        args.batch_size % world == 0,
        f"--batch-size {args.batch_size} is not divisible by world size {world}: "
        "every rank must get the same whole number of samples per step",
    )


def setup(args):
    """Join the process group. torchrun (or common.launch) put RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT in the environment; LOCAL_RANK picks this process's GPU."""
    backend, device = common.pick_backend(args.backend)  # NCCL and a GPU per rank, else Gloo
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank, world = common.init_process_group(backend, device, args.timeout)
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
        # Resumed mid-epoch (a snapshot where --max-steps stopped): the epoch's batches trained
        # before are drawn (the sampler's order stays the same) but skipped.
        already_trained = max(step - epoch * len(loader), 0)
        bar = common.progress(loader, args, epoch, skip=already_trained)
        for i, (x, y) in enumerate(bar, start=already_trained):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if args.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
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
        # After every epoch, and where --max-steps stopped: the snapshot holds the last step.
        with common.untimed():  # not training: its gather, save and fsync are not timed
            save_snapshot(args.snapshot, model, optimizer, scheduler, step, device)
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
            num_workers=args.workers,
            persistent_workers=args.workers > 0,  # started once, not every epoch
        )
        common.check(
            len(loader) > 0,
            f"{len(train_set)} training samples make no full batch of {args.batch_size}",
        )
        model = common.build_model(args)  # the same seeded weights on every rank
        if args.load:
            model.load_state_dict(common.load_state_dict_file(args.load, model.state_dict()))
        # The snapshot's weights go into the bare model, before DDP wraps it: DDP's start-up
        # broadcast then sends rank 0's copy to every rank.
        snapshot = load_snapshot(args.snapshot, model, device)
        psi = sum(p.numel() for p in model.parameters())
        model = parallelize(model.to(device), device)
        optimizer = common.make_optimizer(model.parameters(), args)
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        step = resume(snapshot, optimizer, scheduler, device)
        common.log(
            f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data "
            f"({len(train_set)} train / {len(test_set)} test), "
            f"batch {args.batch_size} = {dp_world} x {args.batch_size // dp_world}"
        )
        with common.Meter(model, optimizer, args, device=device) as meter:
            out = train(model, optimizer, scheduler, loader, sampler, args, device, step)
        test_loader = common.test_loader(
            test_set, dp_rank, dp_world, pin_memory=device.type == "cuda"
        )
        acc = evaluate(model, test_loader, device)
        state = full_state_dict(model)  # every rank takes part; rank 0 holds the whole
        if rank == 0 and args.save:
            common.save_checkpoint(state, args.save)
            common.log(f"saved {args.save}")
        common.report(
            SCRIPT,
            args,
            world=world,
            backend=backend,
            device=device,
            data=source,
            params=psi,
            trained=out,
            test_acc=acc,
            meter=meter,
            formula=formula(psi, world, args),
        )
        # Free DDP before leaving the group: its reducer holds the group and, freed after it,
        # waits for Gloo's threads while holding the GIL that one of them needs (pytorch#56297).
        del model, meter
        gc.collect()
    finally:
        cleanup()


def main():
    parser = common.get_parser("DDP under torchrun, with snapshots, on the common ViT")
    parser.add_argument(
        "--snapshot",
        default=None,
        metavar="PATH",
        help="save here every epoch; resume from it if it exists (on a shared file system)",
    )
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
