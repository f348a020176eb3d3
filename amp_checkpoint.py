"""DDP + AMP + activation checkpointing: ddp.py's DDP with levers that trade precision or compute
for memory, and change no communication:
- `--amp bf16|fp16`: torch.autocast runs matmuls and attention in 16 bits; parameters, gradients,
  optimizer state (the "master weights"), LayerNorms and the loss stay fp32. fp16 (CUDA only)
  scales the loss with a GradScaler; bf16 needs no scaling and runs on CPU too.
- `--checkpoint`: each block keeps only its input for backward and recomputes the rest there.
- `--grad-accum k`: k micro-batches per step, all but the last under no_sync() (no all-reduce).

    rank 0: [ full model ]  batch[0::W] --\
    rank 1: [ full model ]  batch[1::W] ---+-- all-reduce(grads) / W --> same step on every rank
    ...                                 --/

Memory per rank (fp32, AdamW, Ψ parameters): 4Ψ params + 4Ψ grads + 8Ψ optimizer = 16Ψ bytes;
activations kept per micro-batch of B samples (T tokens, width D, L blocks, e bytes an element):
at least 16·L·B·T·D·e plain, L·B·T·D·4 checkpointed, plus what the embedding and head keep.
Communication per step: one all-reduce of Ψ gradient elements (bucketed, overlapped with
backward); a ring all-reduce sends 2(W-1)/W · 4Ψ bytes per rank.
Papers: Micikevicius et al. 2018, "Mixed Precision Training", https://arxiv.org/abs/1710.03740;
Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost", https://arxiv.org/abs/1604.06174.
Derivations: docs/techniques.md#amp-and-activation-checkpointing

    torchrun --standalone --nproc_per_node=4 amp_checkpoint.py --amp bf16 --checkpoint
    python amp_checkpoint.py --nproc 4 --amp bf16 --checkpoint --grad-accum 2 --clip 1.0
    python amp_checkpoint.py --amp fp16 --checkpoint           # CUDA only
"""

import contextlib
import functools
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler

import common

SCRIPT = os.path.splitext(os.path.basename(__file__))[0]


### begin: AMP + activation checkpointing
# Model contract: any nn.Module, built with the same weights on every rank (DDP also broadcasts
# rank 0's parameters when it wraps), on this rank's device; `checkpointed`: the modules to
# recompute in backward (a transformer's blocks: the ViT's `model.blocks`, nanoGPT's
# `model.transformer.h`). forward_backward's loss is `loss_fn(model, x, y)`, a classifier's
# cross-entropy by default; nanoGPT passes `lambda model, x, y: model(x, y)[1]`.


def classifier_loss(model, x, y):
    return F.cross_entropy(model(x), y)


def parallelize(model, device, checkpointed=()):
    """Checkpointing replaces each block's forward by checkpoint(forward): it runs without keeping
    what the block computes inside, and runs again in backward to get it back. Replacing the
    forward, not wrapping the block in a new module, keeps the parameter names (and so the saved
    state_dict) those of the plain model.

    DDP hooks every parameter: as backward produces gradients it all-reduces them in ~25 MB
    buckets, overlapped with the rest of backward, and divides by W. Each rank's loss is the mean
    over its batch/W samples, so every rank then holds the gradient of the global batch's mean."""
    for block in checkpointed:
        # use_reentrant=False: the implementation PyTorch recommends, and the one DDP works
        # with without limits (the reentrant one runs a nested backward that DDP supports
        # only partly).
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )  # grads live in DDP's buckets: no second copy


def full_state_dict(model):
    """The model's own state_dict(), hooks and buffers included: every rank holds it whole."""
    return {k: v.detach().cpu() for k, v in model.module.state_dict().items()}


def forward_backward(model, x, y, amp, scaler, grad_accum=1, loss_fn=classifier_loss):
    """Forward and backward of the batch (x, y) as grad_accum micro-batches; returns its loss.

    A micro-batch's loss is loss_fn(model, micro_x, micro_y), a mean over its samples, divided by
    grad_accum, so that the gradients the micro-batches add up to are those of the batch's mean
    loss. `amp` ("bf16", "fp16" or "off") sets autocast, which covers the forward only: backward
    runs each op in the dtype its forward used, and cross_entropy autocasts to fp32. The scaler
    multiplies the loss by S before backward (fp16; else a no-op)."""
    autocast_dtype = torch.float16 if amp == "fp16" else torch.bfloat16
    batch_loss = torch.zeros((), device=x.device)
    micro_batches = zip(x.chunk(grad_accum), y.chunk(grad_accum), strict=True)
    for i, (micro_x, micro_y) in enumerate(micro_batches):
        last = i == grad_accum - 1
        # Under no_sync() DDP's backward only adds into .grad; the last micro-batch's backward,
        # outside it, all-reduces the sum: one all-reduce per step, not per micro-batch.
        gradient_sync = contextlib.nullcontext() if last else model.no_sync()
        with gradient_sync:
            with torch.autocast(x.device.type, dtype=autocast_dtype, enabled=amp != "off"):
                loss = loss_fn(model, micro_x, micro_y) / grad_accum
            scaler.scale(loss).backward()
        batch_loss += loss.detach()
    return batch_loss


def optimizer_step(model, optimizer, scaler, clip=0.0):
    """Unscale (gradients / S) before clipping, so the clip sees the true norm; scaler.step skips
    the step if a gradient is inf/nan (an fp16 overflow), and update() adapts S. Without fp16 the
    scaler is disabled: unscale_ and update do nothing, and step is optimizer.step(). Returns
    the gradient norm the clip measured (None without clipping)."""
    norm = None
    if clip > 0:
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(optimizer)
    scaler.update()
    return norm


### end: AMP + activation checkpointing


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
    samples_per_rank = args.batch_size // world
    common.check(
        args.grad_accum >= 1 and samples_per_rank % args.grad_accum == 0,
        f"--grad-accum {args.grad_accum} must be >= 1 and divide the {samples_per_rank} samples "
        "each rank gets per step",
    )
    # The load-balancing gradient is added inside backward (common/moe.py's AuxLossScaler), where
    # GradScaler's factor S never multiplies it, yet unscale_ divides it by S: it would shrink.
    common.check(
        not args.experts or args.amp != "fp16",
        "--experts with --amp fp16: the load-balancing gradient is added inside backward, "
        "where the GradScaler's loss scale does not reach it (use bf16)",
    )
    # What common.pick_backend will choose in every rank (it runs later, after these checks).
    on_cuda = args.backend != "gloo" and torch.cuda.device_count() > 0 and dist.is_nccl_available()
    common.check(
        args.amp != "fp16" or on_cuda,
        "--amp fp16 needs CUDA (fp16 autocast with a GradScaler); this run "
        "is on the CPU: use --amp bf16 (no loss scaling needed) or --amp off",
    )
    common.check(
        args.amp != "bf16"
        or not on_cuda
        or torch.cuda.is_bf16_supported(including_emulation=False),
        "--amp bf16: this GPU only emulates bf16 (no bf16 tensor cores); use --amp fp16",
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
    # Disabled unless fp16, the scaler passes every call through, so one loop serves every --amp.
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
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
            loss = forward_backward(model, x, y, args.amp, scaler, args.grad_accum)
            optimizer_step(model, optimizer, scaler, args.clip)
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
        # The same seeded weights on every rank. Each micro-batch's loss is divided by
        # --grad-accum: the MoE balance loss (--experts) must be divided the same way.
        model = common.build_model(args, forwards_per_step=args.grad_accum)
        if args.load:
            model.load_state_dict(common.load_state_dict_file(args.load, model.state_dict()))
        psi = sum(p.numel() for p in model.parameters())
        checkpointed = model.blocks if args.checkpoint else []
        model = parallelize(model.to(device), device, checkpointed)
        optimizer = common.make_optimizer(model.parameters(), args)
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        common.log(
            f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data "
            f"({len(train_set)} train / {len(test_set)} test), "
            f"batch {args.batch_size} = {dp_world} x {args.batch_size // dp_world}"
        )
        common.log(
            f"--amp {args.amp}, checkpointing {'on' if args.checkpoint else 'off'}, "
            f"{args.grad_accum} micro-batch(es) per step, --clip {args.clip:g}"
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
        # Free DDP before leaving the group: its reducer holds the group and, freed after it,
        # waits for Gloo's threads while holding the GIL that one of them needs (pytorch#56297).
        del model, meter
        gc.collect()
    finally:
        cleanup()


def main():
    parser = common.get_parser("DDP + AMP + activation checkpointing on the common ViT")
    parser.add_argument(
        "--amp",
        choices=["bf16", "fp16", "off"],
        default="bf16",
        help="autocast dtype of the forward (fp16: CUDA only, with a GradScaler)",
    )
    parser.add_argument(
        "--checkpoint", action="store_true", help="recompute each block's activations in backward"
    )
    parser.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="micro-batches per step (no_sync on all but the last)",
    )
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
