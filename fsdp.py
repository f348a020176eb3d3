"""FSDP: PyTorch's fully sharded data parallel (FSDP2, `fully_shard`), ZeRO-3 as a library: DDP, but each
rank holds only its shard of every parameter (a DTensor). Each block, then the root (embed + head), is a
unit: all-gathered before its forward and its backward, freed after, its gradients reduce-scattered.

    a parameter's dim 0 in W contiguous chunks of c = ceil(dim0 / W) rows, the last zero-padded:
    rank 0: rows [0, c)    rank 1: rows [c, 2c)    ...    rank W-1: rows [(W-1)c, dim0) + padding

Memory per rank (fp32, AdamW, Ψ parameters): 4Ψ/W params + 4Ψ/W grads + 8Ψ/W optimizer = 16Ψ/W bytes
(dim 0 padded to a multiple of W), plus the units gathered at the time. Communication per step:
Ψ all-gathered for forward, Ψ again for backward (not the root, nor with --no-reshard-after-forward),
Ψ fp32 gradients reduce-scattered; a ring sends (W-1)/W of each. --mixed-precision: bf16 compute and
all-gathers; fp32 reduce-scatter, shards and output (the loss). --dcp DIR: sharded checkpoints DIR/step-N,
the newest resumed at any W; every rank reads and writes DIR, so it must be on a shared file system.

    torchrun --standalone --nproc_per_node=2 fsdp.py --max-steps 100 --dcp ckpt/   # sharded save
    torchrun --standalone --nproc_per_node=4 fsdp.py --max-steps 200 --dcp ckpt/   # resume at W=4
    python fsdp.py --nproc 4 --mixed-precision --offload cpu   # through mp.spawn on a free port

This model has no BatchNorm. A model that does would need
`model = nn.SyncBatchNorm.convert_sync_batchnorm(model)` before wrapping, or each rank
normalises with the statistics of its own batch/W samples only.
"""

import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.utils.data import DataLoader, DistributedSampler

import common

SCRIPT = os.path.splitext(os.path.basename(__file__))[0]


### begin: FSDP
# Model contract: `model.blocks` (a unit each; the rest, embed and head, is the root unit), the same
# weights on every rank, on this rank's device. Build the optimizer after sharding: on the shards.


def parallelize(model, device, mixed_precision=False, offload=False, reshard_after_forward=True):
    """fully_shard each block, then the root, which stays gathered from its forward to its backward (used
    last, then first). Parameters become DTensor shards; hooks gather units and reduce-scatter their grads."""
    kw = dict(
        mesh=init_device_mesh(device.type, (dist.get_world_size(),)),
        offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda")
        if offload
        else OffloadPolicy(),
    )
    mp = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else {}
    for block in model.blocks:
        fully_shard(
            block,
            reshard_after_forward=reshard_after_forward,
            mp_policy=MixedPrecisionPolicy(**mp),
            **kw,
        )
    root = MixedPrecisionPolicy(
        **mp, output_dtype=torch.float32
    )  # fp32 logits: the loss runs in fp32
    return fully_shard(model, reshard_after_forward=False, mp_policy=root, **kw)


def full_state_dict(model):
    """The plain state_dict of the common model on rank 0's CPU, gathered tensor by tensor; {} elsewhere."""
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def dcp_state(model, optimizer, scheduler):
    """A sharded checkpoint: this rank's shards of the model and of the optimizer state, and the schedule."""
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
        "scheduler": scheduler.state_dict(),
    }


def load_dcp(path, model, optimizer, scheduler):
    """Every rank reads its own shards (DCP reshards: the saving world size may differ)."""
    state = dcp_state(model, optimizer, scheduler)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    scheduler.load_state_dict(state["scheduler"])


### end: FSDP


def formula(psi, world, args):
    """The paper's per-rank bytes, which the report sets next to what the Meter measured."""
    k = 8 if args.optim == "adamw" else 4
    shard, gathers = (
        -(-psi // world),
        2 if args.reshard else 1,
    )  # the paper's; FSDP2 pads each dim 0 (a bit more)
    return dict(
        param_bytes=4 * shard,
        grad_bytes=4 * shard,
        optim_bytes=k * shard,
        comm=dict(
            all_gather=gathers * (2 if args.mixed_precision else 4) * psi, reduce_scatter=4 * psi
        ),
        notes=dict(
            param_bytes="4Ψ/W",
            grad_bytes="4Ψ/W",
            optim_bytes=f"{k}Ψ/W",
            all_gather=f"{gathers}Ψ",
            reduce_scatter="Ψ",
        ),
    )


def check_args(args, world):
    common.check(
        args.batch_size % world == 0,
        f"--batch-size {args.batch_size} is not divisible by world size {world}: every rank must get "
        f"the same whole number of samples per step",
    )


def check_dcp(args):
    """Rank 0 only: (why --dcp cannot be resumed, or None; the step of its newest complete checkpoint, or 0)."""
    if not os.path.exists(path := args.dcp) or (os.path.isdir(path) and not os.listdir(path)):
        return None, 0  # a new or empty directory: start fresh
    done = [
        int(n[5:])
        for n in (os.listdir(path) if os.path.isdir(path) else [])
        if n[:5] == "step-"
        and n[5:].isdigit()
        and os.path.isfile(os.path.join(path, n, ".metadata"))
    ]  # .metadata comes last
    if not done:
        return (
            f"--dcp {path}: not a torch.distributed.checkpoint directory (no step-N/.metadata in it)",
            0,
        )
    meta = (
        dcp.FileSystemReader(os.path.join(path, f"step-{max(done)}"))
        .read_metadata()
        .state_dict_metadata
    )
    state = "exp_avg" if args.optim == "adamw" else "momentum_buffer"
    for k, v in common.build_model(args).state_dict().items():
        for key in (f"model.{k}", f"optim.state.{k}.{state}"):
            if (saved := tuple(meta[key].size) if key in meta else "missing") != tuple(v.shape):
                return (
                    f"--dcp {path}: '{key}' is {saved}, this run needs {tuple(v.shape)} (other --dim/--optim?)",
                    0,
                )
    return None, max(done)


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
        done = max(step - epoch * len(loader), 0)  # resumed mid-epoch: batches trained on
        bar = common.progress(loader, args, epoch, skip=done)
        for i, (x, y) in enumerate(bar, start=done):
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
        decision = list(
            check_dcp(args) if args.dcp and rank == 0 else (None, 0)
        )  # rank 0 decides for all
        dist.broadcast_object_list(decision, src=0)
        common.check(decision[0] is None, decision[0])
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
        model = parallelize(
            model.to(device), device, args.mixed_precision, args.offload == "cpu", args.reshard
        )
        optimizer = common.make_optimizer(model.parameters(), args)
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        if decision[1]:
            load_dcp(os.path.join(args.dcp, f"step-{decision[1]}"), model, optimizer, scheduler)
            common.log(f"resumed from {args.dcp} at step {decision[1]}")
        common.log(
            f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data ({len(train_set)} train / "
            f"{len(test_set)} test), batch {args.batch_size} = {dp_world} x {args.batch_size // dp_world}"
        )
        with common.Meter(model, optimizer, args) as meter:
            out = train(model, optimizer, scheduler, loader, sampler, args, device, decision[1])
        acc = evaluate(
            model,
            common.test_loader(test_set, dp_rank, dp_world, pin_memory=device.type == "cuda"),
            device,
        )
        state = full_state_dict(model)  # every rank takes part; rank 0 holds the whole
        if rank == 0 and args.save:
            common.save_checkpoint(state, args.save)
            common.log(f"saved {args.save}")
        if args.dcp and out["steps"] > decision[1]:  # every rank writes its shards, into a new dir
            dcp.save(
                dcp_state(model, optimizer, scheduler),
                checkpoint_id=os.path.join(args.dcp, f"step-{out['steps']}"),
            )
            common.log(f"saved a sharded checkpoint of step {out['steps']} in {args.dcp}")
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
    parser = common.get_parser("FSDP2 (fully_shard) on the common ViT")
    parser.add_argument(
        "--no-reshard-after-forward",
        dest="reshard",
        action="store_false",
        help="blocks stay gathered",
    )
    parser.add_argument(
        "--mixed-precision", action="store_true", help="bf16 compute and all-gathers, fp32 the rest"
    )
    parser.add_argument(
        "--offload", choices=["none", "cpu"], default="none", help="shards and optimizer on the CPU"
    )
    parser.add_argument(
        "--dcp", metavar="DIR", help="sharded checkpoint to resume from and save to (a shared FS)"
    )
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
