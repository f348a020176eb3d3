"""FSDP: PyTorch's fully sharded data parallel (FSDP2, `fully_shard`), ZeRO-3 as a library: DDP,
except that each rank keeps only its shard of every parameter (a DTensor). Each block, then the
root (the rest: embed and head), is a unit: all-gathered before its forward and again before its
backward, freed after each, its gradients reduce-scattered so that each rank gets its shard's mean.

    every parameter's dim 0 in W chunks of c = ceil(dim0 / W) rows, the last chunk zero-padded:
    rank 0: rows [0, c)    rank 1: rows [c, 2c)    ...    rank W-1: rows [(W-1)c, dim0) + padding

    forward:  all-gather block i -> compute -> free        (one unit at a time)
    backward: all-gather block i -> compute grads -> reduce-scatter them -> free

Memory per rank (fp32, AdamW, Ψ parameters): 4Ψ/W params + 4Ψ/W grads + 8Ψ/W optimizer
= 16Ψ/W bytes (dim 0 padded to a multiple of W), plus the units gathered at the time.
Communication per step: about 2Ψ all-gathered, Ψ fp32 gradients reduce-scattered; a ring sends
(W-1)/W of each. fsdp_resume.py adds sharded checkpoints (DCP) to this file.
Paper: Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel",
https://arxiv.org/abs/2304.11277. Gathers, --mixed-precision, BatchNorm: docs/techniques.md#fsdp

    torchrun --standalone --nproc_per_node=4 fsdp.py
    python fsdp.py --nproc 4 --mixed-precision --offload cpu   # through mp.spawn on a free port
    python fsdp.py                                             # a world of one process
"""

import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

import common

SCRIPT = os.path.splitext(os.path.basename(__file__))[0]


### begin: FSDP
# Model contract: `units`, the modules to shard one by one (a transformer's blocks: the ViT's
# `model.blocks`, nanoGPT's `model.transformer.h`); the rest of the model is the root unit. The
# same weights on every rank, on this rank's device. Build the optimizer after sharding, its
# parameter groups too: it must hold the shards, not the full parameters that sharding replaces.
# A weight shared by two modules (an embedding tied to the output head) must be in one unit,
# here the root: keep both modules out of `units` (FSDP refuses a split tie). Clipping needs
# nothing more: torch.nn.utils.clip_grad_norm_ takes the sharded gradients (DTensors) and
# all-reduces the norm itself.


def parallelize(
    model, device, units, mixed_precision=False, offload=False, reshard_after_forward=True
):
    """fully_shard each unit, then the root. Each call replaces the unit's parameters by DTensor
    shards and hooks the unit: all-gather before its forward and its backward, free after, and
    reduce-scatter its gradients, divided by W. The root is not resharded after forward: it is
    used last in forward and first in backward, so freeing it would only gather it again."""
    # fully_shard shards over a device mesh: here one dimension, every rank (a second dimension
    # that replicates the shards would make it HSDP).
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if offload:
        # Shards, gradients and the optimizer step live on the CPU; a unit is copied to the
        # device for its forward and backward. Pinned memory lets those copies run async.
        offload_policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    else:
        offload_policy = OffloadPolicy()  # fully_shard's default: no offload
    if mixed_precision:
        # Gathered parameters and compute in bf16 (half the all-gather bytes); gradients are
        # reduce-scattered in fp32 and the shards the optimizer updates stay fp32.
        block_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # The root returns fp32 logits, so that the loss is computed in fp32.
        root_policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
            output_dtype=torch.float32,
        )
    else:
        block_policy = MixedPrecisionPolicy()  # everything in the parameters' dtype, fp32
        root_policy = MixedPrecisionPolicy()
    for unit in units:
        fully_shard(
            unit,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=block_policy,
            offload_policy=offload_policy,
        )
    # fully_shard changes the module in place (its class becomes an FSDPModule) and returns it.
    return fully_shard(
        model,
        mesh=mesh,
        reshard_after_forward=False,
        mp_policy=root_policy,
        offload_policy=offload_policy,
    )


def full_state_dict(model):
    """The model's own state_dict() on rank 0's CPU, whole: its keys, its persistent buffers, and
    whatever its state_dict hooks make of them (Llama's fused wqkv saved as wq, wk, wv); an empty
    dict on the other ranks, which must call it too. Each sharded parameter is all-gathered in
    turn (a tied one once) and goes to rank 0's CPU, so no rank holds a second whole copy of the
    model on its device; rank 0 then takes the model's state_dict() with the whole parameters in
    place of the shards, so that the hooks see whole tensors, as in one process. (torch's
    get_model_state_dict maps each key back to a parameter by name, and raises on a key a hook
    made; a hook run on the shards cannot cut a dimension W does not divide.)"""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # the shards in the modules, as state_dict()'s own pre-hook wants
    rank = dist.get_rank()
    wholes = {}  # id of a sharded Parameter -> it whole, on rank 0's CPU
    in_place = []  # (module, name, the sharded Parameter): a tied one under each of its modules
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not isinstance(param, DTensor):
                continue
            if id(param) not in wholes:
                whole = gather_whole(param.detach())  # every rank, in the same order
                wholes[id(param)] = torch.nn.Parameter(whole.cpu(), requires_grad=False)
            in_place.append((module, name, param))
    if rank != 0:
        return {}
    try:
        for module, name, param in in_place:
            setattr(module, name, wholes[id(param)])
        return {key: tensor.cpu() for key, tensor in model.state_dict().items()}
    finally:
        for module, name, param in in_place:
            setattr(module, name, param)


def gather_whole(tensor):
    """The whole of a sharded DTensor on every rank: all-gathered on the mesh's device (shards
    offloaded to the CPU are moved there first: NCCL gathers device memory only)."""
    device_type = tensor.device_mesh.device_type
    if tensor.device.type != device_type:
        tensor = tensor.to(device_type)
    return tensor.full_tensor()


### end: FSDP


def formula(psi, world, args):
    """The paper's per-rank bytes, which the report sets next to what the Meter measured."""
    k = 8 if args.optim == "adamw" else 4  # the ZeRO paper's K: optimizer bytes per parameter
    # The paper's Ψ/W; FSDP2 pads each parameter's dim 0 to a multiple of W, a little more.
    shard = math.ceil(psi / world)
    # Each block is gathered for forward and, once freed, again for backward. The root (embed and
    # head, a small part of Ψ) stays gathered, so the measured bytes are a little less.
    gathers = 2 if args.reshard else 1
    gathered_element_bytes = 2 if args.mixed_precision else 4  # bf16 or fp32 all-gathers
    return dict(
        param_bytes=4 * shard,
        grad_bytes=4 * shard,
        optim_bytes=k * shard,
        comm=dict(
            all_gather=gathers * gathered_element_bytes * psi,
            reduce_scatter=4 * psi,
        ),
        notes=dict(
            param_bytes="4Ψ/W",
            grad_bytes="4Ψ/W",
            optim_bytes=f"{k}Ψ/W " + ("AdamW m, v" if k == 8 else "SGD momentum"),
            all_gather=f"{gathers}Ψ " + ("bf16" if args.mixed_precision else "fp32"),
            reduce_scatter="Ψ fp32 gradients",
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
        bar = common.progress(loader, args, epoch)
        for i, (x, y) in enumerate(bar):
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
        psi = sum(p.numel() for p in model.parameters())
        model = parallelize(
            model.to(device),
            device,
            model.blocks,
            mixed_precision=args.mixed_precision,
            offload=args.offload == "cpu",
            reshard_after_forward=args.reshard,
        )
        optimizer = common.make_optimizer(model.parameters(), args)
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        common.log(
            f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data "
            f"({len(train_set)} train / {len(test_set)} test), "
            f"batch {args.batch_size} = {dp_world} x {args.batch_size // dp_world}"
        )
        with common.Meter(model, optimizer, args, device=device) as meter:
            out = train(model, optimizer, scheduler, loader, sampler, args, device)
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
    finally:
        cleanup()


def main():
    parser = common.get_parser("FSDP2 (fully_shard) on the common ViT")
    parser.add_argument(
        "--no-reshard-after-forward",
        dest="reshard",
        action="store_false",
        help="blocks stay gathered from forward to backward: one all-gather each, more memory",
    )
    parser.add_argument(
        "--mixed-precision",
        action="store_true",
        help="bf16 compute and all-gathers; fp32 shards, gradients and loss",
    )
    parser.add_argument(
        "--offload",
        choices=["none", "cpu"],
        default="none",
        help="shards, gradients and the optimizer step on the CPU",
    )
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
