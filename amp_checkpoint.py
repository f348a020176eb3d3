"""DDP + AMP + activation checkpointing: the DDP of ddp.py with two levers that trade precision
or compute for memory and speed, and change no communication.

AMP (`--amp bf16|fp16`): torch.autocast runs matmuls and attention in 16 bits while parameters,
gradients and optimizer state stay fp32 (the "master weights"); norms, softmax and the loss stay
fp32. bf16 has fp32's exponent range, so it needs no loss scaling and works on CPU. fp16 (CUDA
only) would flush small gradients to zero: GradScaler multiplies the loss by S before backward,
divides the gradients by S before clipping and the step (`unscale_`), skips steps whose
gradients hold inf/nan, and adapts S.

Activation checkpointing (`--checkpoint`): each block runs under
torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False), which keeps only the block's
input; backward runs the block's forward again to get its activations back: about one more
forward per step (+1/3 of a step's compute, backward being about two forwards).

    block i:  x_i --[norm, q k v, attention, norm, fc1, gelu, fc2]--> x_i+1
    kept for backward, plain:        x_i and ~15 more B·T·D tensors of activations
    kept for backward, checkpointed: x_i only; the rest is recomputed from it during backward

Memory per rank (Ψ parameters, AdamW): 16Ψ bytes as in DDP (AMP keeps fp32 masters). Activations
held for backward per micro-batch of B samples, T tokens, width D, L blocks, E = what embed and
head keep (the same either way):
    plain:        E + L·(16·B·T·D·e + norm/attention statistics)   e = 4 fp32; under AMP most are 2
    checkpointed: E + L·B·T·D·4                                    (the fp32 residual stream)
Communication per step: as DDP, one all-reduce of Ψ fp32 gradients (2(W-1)/W · 4Ψ bytes per rank
on a ring): autocast's 16-bit copies of the weights get their gradients summed into fp32 ones.

    torchrun --standalone --nproc_per_node=4 amp_checkpoint.py --amp bf16 --checkpoint
    python amp_checkpoint.py --amp off --checkpoint                 # one process: world size 1
    torchrun --standalone --nproc_per_node=4 amp_checkpoint.py --amp fp16 --clip 1.0   # CUDA only
"""
import datetime
import functools
import gc
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import common


def counting_allreduce(state, bucket):
    """DDP comm hook: count the gradient elements each bucket all-reduces, then do DDP's own
    averaging all-reduce. Measures the communication the docstring predicts."""
    state["elements"] += bucket.buffer().numel()
    return default_hooks.allreduce_hook(None, bucket)


def autocast(args, device):
    """The forward's precision: 16-bit matmuls under --amp bf16/fp16, plain fp32 under --amp off."""
    return torch.autocast(device_type=device.type, dtype=torch.float16 if args.amp == "fp16" else torch.bfloat16,
                          enabled=args.amp != "off")


def set_checkpointing(model, on):
    """Run every block under checkpoint() (or not). Overriding each block's forward, rather than
    wrapping the block in a new module, keeps the state_dict keys of the plain model."""
    for block in model.blocks:
        block.__dict__.pop("forward", None)        # back to Block.forward
        if on:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def saved_activation_bytes(model, x, y, args, device):
    """Bytes autograd keeps for backward after one forward: (all, kept outside the blocks).

    A saved-tensor pack hook sees every tensor saved for backward, on any device; each storage is
    counted once (views share it) and parameters are left out. checkpoint() stores its inputs
    through the same hooks, and its own hooks (which take over inside the block) save nothing.
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept, where = {}, ["outside"]

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            kept.setdefault(s.data_ptr(), (s.nbytes(), where[0]))
        return t

    hooks = [h for b in model.blocks for h in (b.register_forward_pre_hook(lambda *_: where.__setitem__(0, "blocks")),
                                               b.register_forward_hook(lambda *_: where.__setitem__(0, "outside")))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(args, device):
            F.cross_entropy(model(x), y)           # the graph (and what it keeps) is freed on return
    finally:
        for h in hooks:
            h.remove()
    return sum(n for n, _ in kept.values()), sum(n for n, w in kept.values() if w == "outside")


def measure_activations(model, x, y, args, device, reps=5):
    """Activation bytes and fwd+bwd time, plain and checkpointed, on one micro-batch (before DDP
    wraps the model: a backward here must not start DDP's all-reduce)."""
    def forward():
        with autocast(args, device):
            return F.cross_entropy(model(x), y)

    def step():
        forward().backward()

    out = {}
    for key in ("plain", "ckpt"):
        set_checkpointing(model, key == "ckpt")
        out[f"bytes_{key}"], out["bytes_outside"] = saved_activation_bytes(model, x, y, args, device)
        model.zero_grad(set_to_none=True)           # both modes allocate the gradients afresh
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        step()                                      # also the warm-up for the timing below
        if device.type == "cuda":
            out[f"cuda_peak_{key}"] = torch.cuda.max_memory_allocated(device) - base
    for _ in range(reps):                           # interleaved, so load from elsewhere slows all alike
        for key in ("plain", "ckpt", "forward"):
            set_checkpointing(model, key == "ckpt")
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step() if key != "forward" else forward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            out[f"time_{key}"] = min(out.get(f"time_{key}", float("inf")), time.perf_counter() - t0)
    set_checkpointing(model, False)
    model.zero_grad(set_to_none=True)
    return out


def setup(backend, timeout):
    # MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE come from the environment (torchrun or default_env()).
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def train(model, optimizer, scaler, loader, sampler, args, device, comm):
    steps, t_train, loss_sum, loss_n, last_loss, mem = 0, 0.0, torch.zeros((), device=device), 0, float("nan"), {}
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)                   # a new shuffle each epoch, the same on every rank
        model.train()
        t0 = time.perf_counter()
        bar = common.progress(loader, args, desc=f"epoch {epoch}")
        for x, y in bar:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            for micro, (xm, ym) in enumerate(zip(x.chunk(args.grad_accum), y.chunk(args.grad_accum))):
                # no_sync(): accumulate locally, all-reduce only on the last micro-step.
                with model.no_sync() if micro < args.grad_accum - 1 else nullcontext():
                    with autocast(args, device):   # the forward only; backward follows the forward's dtypes
                        loss = F.cross_entropy(model(xm), ym) / args.grad_accum
                    scaler.scale(loss).backward()  # fp16: loss x S, so small gradients survive
                loss_sum += loss.detach()
            # The gradient needs no extra averaging: each rank's loss is the mean over its
            # batch/W samples and DDP's all-reduce divides the sum by W, so every rank now holds
            # the gradient of the mean loss over the whole global batch.
            if args.clip > 0:
                scaler.unscale_(optimizer)         # clip the true gradients, not S times them
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)                 # fp16: skipped if a gradient is inf/nan
            scaler.update()
            if not mem.get("optim_bytes"):        # (a skipped fp16 step has no optimizer state yet)
                mem = dict(param_bytes=common.param_bytes(model.parameters()),
                           grad_bytes=common.grad_bytes(model.parameters()),
                           optim_bytes=common.optimizer_bytes(optimizer))
            optimizer.zero_grad(set_to_none=True)
            steps, loss_n = steps + 1, loss_n + 1
            if steps % 20 == 0 or steps == args.max_steps or steps % len(loader) == 0:
                # The loss of this rank's slice only; all-reduce it so the log shows the global batch's.
                dist.all_reduce(loss_sum)
                last_loss, loss_sum, loss_n = loss_sum.item() / dist.get_world_size() / loss_n, loss_sum * 0, 0
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
def evaluate(model, loader, args, device):
    """Each rank counts its own unpadded shard; one all-reduce of (correct, seen) makes it exact."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        with autocast(args, device):
            counts += torch.stack([(model(x).argmax(1) == y).sum(), torch.tensor(len(y), device=device)])
    dist.all_reduce(counts)
    return counts[0].item() / max(counts[1].item(), 1)


def check_args(args, world):
    common.check(args.grad_accum >= 1, f"--grad-accum must be >= 1, got {args.grad_accum}")
    common.check(args.clip >= 0, f"--clip must be >= 0 (0: no clipping), got {args.clip}")
    common.check(args.batch_size % (world * args.grad_accum) == 0,
                 f"--batch-size {args.batch_size} is not divisible by world size {world} x --grad-accum "
                 f"{args.grad_accum}: every rank must get the same whole number of samples per micro-step")


def check_amp(args, device):
    common.check(args.amp != "fp16" or device.type == "cuda",
                 f"--amp fp16 needs CUDA (fp16 autocast with GradScaler('cuda')); this run is on {device.type}: "
                 f"use --amp bf16 (no loss scaling needed) or --amp off")
    common.check(args.amp != "bf16" or device.type != "cuda" or torch.cuda.is_bf16_supported(),
                 "--amp bf16: this GPU does not support bf16 (torch.cuda.is_bf16_supported() is False); use --amp fp16")


def run(args):
    """One rank's work; RANK, LOCAL_RANK and WORLD_SIZE are in the environment."""
    check_args(args, int(os.environ["WORLD_SIZE"]))
    backend, device = common.pick_backend(args.backend)
    check_amp(args, device)                        # before the process group: a clean exit 2, no hang
    model = common.build_model(args)               # same seed -> same weights on every rank
    if args.load:
        model.load_state_dict(common.load_state_dict_file(args.load, model.state_dict()))
    rank, world = setup(backend, args.timeout)
    try:
        xtr, ytr, xte, yte, source = common.load_data(args)
        loader, sampler = common.train_loader(xtr, ytr, args.batch_size, rank, world, args.seed)
        common.check(len(loader) > 0, f"{len(ytr)} training samples make no full batch of {args.batch_size}")
        model = model.to(device)
        mb = args.batch_size // world // args.grad_accum   # the micro-batch each rank's backward holds
        # clone(): a batch of its own, as the loader gives (a slice would keep, and count, the whole set)
        act = measure_activations(model, xtr[:mb].clone().to(device), ytr[:mb].clone().to(device), args, device)
        set_checkpointing(model, args.checkpoint)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    gradient_as_bucket_view=True)   # grads live in DDP's buckets: no second copy
        comm = {"elements": 0}
        model.register_comm_hook(comm, counting_allreduce)
        optimizer = common.make_optimizer(model.parameters(), args)
        scaler = torch.amp.GradScaler("cuda", enabled=args.amp == "fp16")   # a no-op unless fp16
        psi = sum(p.numel() for p in model.parameters())
        common.log(f"amp_checkpoint: world {world}, Ψ = {psi:,} parameters, {source} data ({len(ytr)} train / "
                   f"{len(yte)} test), batch {args.batch_size} = {world} x {mb} x {args.grad_accum} micro-steps, "
                   f"--amp {args.amp}, checkpointing {'on' if args.checkpoint else 'off'}")
        out = train(model, optimizer, scaler, loader, sampler, args, device, comm)
        acc = evaluate(model.module, common.test_loader(xte, yte, 512, rank, world), args, device)
        comm_bytes = 4 * comm["elements"] // max(out["steps"], 1)
        common.report([
            ("parameters", out["param_bytes"], 4 * psi, "4Ψ (replicated, fp32 masters)"),
            ("gradients", out["grad_bytes"], 4 * psi, "4Ψ (replicated, fp32)"),
            ("optimizer state", out["optim_bytes"], (8 if args.optim == "adamw" else 4) * psi,
             "8Ψ AdamW m, v" if args.optim == "adamw" else "4Ψ SGD momentum"),
            ("all-reduced per step", comm_bytes, 4 * psi, "Ψ fp32 gradient elements"),
            ("sent per step (ring)", 2 * (world - 1) * comm_bytes // world, 2 * (world - 1) * 4 * psi // world,
             "2(W-1)/W · 4Ψ"),
        ])
        L, BTD, e = args.depth, mb * common.TOKENS * args.dim, 4 if args.amp == "off" else 2
        plain_min = act["bytes_outside"] + L * 16 * BTD * e
        ckpt_expected = act["bytes_outside"] + L * BTD * 4
        common.report([
            ("kept by embed/head: E", act["bytes_outside"], None, "patches, final norm, loss (either way)"),
            ("plain", act["bytes_plain"], None, f"≥ {common.fmt_bytes(plain_min)} = E + L·16·B·T·D·{e}"),
            ("checkpointed", act["bytes_ckpt"], ckpt_expected, "E + L·B·T·D·4 (each block's input)"),
        ], title=f"activations held for backward, one micro-batch (B={mb}, T={common.TOKENS}, D={args.dim}, L={L}), "
                 f"--amp {args.amp}")
        ratio, ratio_min = act["bytes_plain"] / act["bytes_ckpt"], plain_min / ckpt_expected
        extra = act["time_ckpt"] - act["time_plain"]
        common.log(f"  checkpointing keeps {ratio:.1f}x less (expected ≥ {ratio_min:.1f}x); recompute costs "
                   f"{1e3 * extra:+.1f} ms per micro-step ({100 * extra / act['time_plain']:+.0f}% of "
                   f"{1e3 * act['time_plain']:.1f} ms), expected ≈ one more forward: {1e3 * act['time_forward']:.1f} ms")
        cuda = {}
        if device.type == "cuda":
            cuda = dict(cuda_max_memory=torch.cuda.max_memory_allocated(device),
                        cuda_peak_plain=act["cuda_peak_plain"], cuda_peak_ckpt=act["cuda_peak_ckpt"])
            common.log(f"  cuda peak over one fwd+bwd: {common.fmt_bytes(act['cuda_peak_plain'])} plain, "
                       f"{common.fmt_bytes(act['cuda_peak_ckpt'])} checkpointed; training max_memory_allocated: "
                       f"{common.fmt_bytes(cuda['cuda_max_memory'])}")
        sps = out["steps"] * args.batch_size / max(out["train_time"], 1e-9)
        common.log(f"\ntest accuracy {acc:.4f}, final train loss {out['loss']:.4f}, {sps:.0f} samples/s")
        if rank == 0 and args.save:
            common.save_checkpoint({k: v.cpu() for k, v in model.module.state_dict().items()}, args.save)
            common.log(f"saved {args.save}")
        common.result(script="amp_checkpoint", world_size=world, backend=backend, device=device.type, data=source,
                      params=psi, steps=out["steps"], loss=out["loss"], test_acc=acc, samples_per_s=sps,
                      param_bytes=out["param_bytes"], grad_bytes=out["grad_bytes"], optim_bytes=out["optim_bytes"],
                      comm_bytes=comm_bytes, amp=args.amp, checkpoint=args.checkpoint,
                      act_bytes_plain=act["bytes_plain"], act_bytes_ckpt=act["bytes_ckpt"],
                      act_bytes_outside=act["bytes_outside"], act_bytes_plain_min=plain_min,
                      act_bytes_ckpt_expected=ckpt_expected, act_ratio=ratio, act_ratio_min=ratio_min,
                      step_s_plain=act["time_plain"], step_s_ckpt=act["time_ckpt"], recompute_s=extra,
                      forward_s=act["time_forward"], **cuda)
    finally:
        cleanup()


def main():
    parser = common.get_parser("DDP + AMP + activation checkpointing on the common ViT")
    parser.add_argument("--amp", choices=["bf16", "fp16", "off"], default="bf16",
                        help="autocast dtype of the forward (fp16: CUDA only, with a GradScaler)")
    parser.add_argument("--checkpoint", action="store_true", help="recompute each block's activations in backward")
    parser.add_argument("--clip", type=float, default=0.0, help="clip the gradient norm to this (0: no clipping)")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step (no_sync on all but the last)")
    args = common.parse_args(parser)
    common.default_env()                           # plain `python amp_checkpoint.py`: a world of one
    run(args)
    # DDP and its comm hook form reference cycles that hold Python callbacks on Gloo work; free
    # them now, not during interpreter shutdown, where Gloo's threads can abort the exit.
    gc.collect()


if __name__ == "__main__":
    main()
