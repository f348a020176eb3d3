"""DDP: DistributedDataParallel -- every rank holds the whole model and trains on its
slice of each global batch; gradients are averaged with an all-reduce during backward.

    rank 0: [ full model ]  batch[0::W] --\
    rank 1: [ full model ]  batch[1::W] ---+-- all-reduce(grads) / W --> same step on every rank
    ...                                 --/

Memory per rank (fp32, AdamW, Ψ parameters): 4Ψ params + 4Ψ grads + 8Ψ optimizer = 16Ψ bytes.
Communication per step: one all-reduce of Ψ gradient elements (bucketed, overlapped with
backward); a ring all-reduce sends 2(W-1)/W · 4Ψ bytes per rank.

    torchrun --standalone --nproc_per_node=4 ddp.py          # the launcher spawns, env vars tell the rank
    python ddp.py --nproc 4                                    # the same, through mp.spawn on a free port
    python ddp.py --nproc 2 --grad-accum 4 --epochs 1          # gradient accumulation with no_sync()

This model has no BatchNorm. A model that does would need
`model = nn.SyncBatchNorm.convert_sync_batchnorm(model)` before wrapping, or each rank
normalises with the statistics of its own batch/W samples only.
"""
import datetime
import gc
import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import common

SCRIPT = os.path.splitext(os.path.basename(__file__))[0]


def counting_allreduce(state, bucket):
    """DDP comm hook: count the gradient elements each bucket all-reduces, then do DDP's own
    averaging all-reduce. Measures the communication the docstring predicts."""
    state["elements"] += bucket.buffer().numel()
    return default_hooks.allreduce_hook(None, bucket)


def setup(backend, timeout):
    # MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE come from the environment (torchrun or main()).
    # torchrun keeps one store across restarts: without a prefix per attempt, a restarted rank can
    # read the address of a worker that died in the last attempt and wait for it forever.
    store, rank, world = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout)))
    store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def train(model, optimizer, loader, sampler, args, device, comm):
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
                    loss = F.cross_entropy(model(xm), ym) / args.grad_accum
                    loss.backward()
                loss_sum += loss.detach()
            # The gradient needs no extra averaging: each rank's loss is the mean over its
            # batch/W samples and DDP's all-reduce divides the sum by W, so every rank now holds
            # the gradient of the mean loss over the whole global batch.
            optimizer.step()
            if not mem:
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
def evaluate(model, loader, device):
    """Each rank counts its own unpadded shard; one all-reduce of (correct, seen) makes it exact."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        counts += torch.stack([(model(x).argmax(1) == y).sum(), torch.tensor(len(y), device=device)])
    dist.all_reduce(counts)
    return counts[0].item() / max(counts[1].item(), 1)


def check_args(args, world):
    common.check(args.grad_accum >= 1, f"--grad-accum must be >= 1, got {args.grad_accum}")
    common.check(args.batch_size % (world * args.grad_accum) == 0,
                 f"--batch-size {args.batch_size} is not divisible by world size {world} x --grad-accum "
                 f"{args.grad_accum}: every rank must get the same whole number of samples per micro-step")


def run(args):
    """One rank's work; RANK, LOCAL_RANK and WORLD_SIZE are in the environment."""
    check_args(args, int(os.environ["WORLD_SIZE"]))
    backend, device = common.pick_backend(args.backend)
    model = common.build_model(args)               # same seed -> same weights on every rank
    if args.load:
        model.load_state_dict(common.load_state_dict_file(args.load, model.state_dict()))
    rank, world = setup(backend, args.timeout)
    try:
        xtr, ytr, xte, yte, source = common.load_data(args)
        loader, sampler = common.train_loader(xtr, ytr, args.batch_size, rank, world, args.seed)
        common.check(len(loader) > 0, f"{len(ytr)} training samples make no full batch of {args.batch_size}")
        model = DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None,
                    gradient_as_bucket_view=True)   # grads live in DDP's buckets: no second copy
        comm = {"elements": 0}
        model.register_comm_hook(comm, counting_allreduce)
        optimizer = common.make_optimizer(model.parameters(), args)
        psi = sum(p.numel() for p in model.parameters())
        common.log(f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data ({len(ytr)} train / {len(yte)} test), "
                   f"batch {args.batch_size} = {world} x {args.batch_size // world // args.grad_accum} x "
                   f"{args.grad_accum} micro-steps")
        out = train(model, optimizer, loader, sampler, args, device, comm)
        acc = evaluate(model.module, common.test_loader(xte, yte, 512, rank, world), device)
        comm_bytes = 4 * comm["elements"] // max(out["steps"], 1)
        common.report([
            ("parameters", out["param_bytes"], 4 * psi, "4Ψ (replicated)"),
            ("gradients", out["grad_bytes"], 4 * psi, "4Ψ (replicated)"),
            ("optimizer state", out["optim_bytes"], (8 if args.optim == "adamw" else 4) * psi,
             "8Ψ AdamW m, v" if args.optim == "adamw" else "4Ψ SGD momentum"),
            ("all-reduced per step", comm_bytes, 4 * psi, "Ψ fp32 gradient elements"),
            ("sent per step (ring)", 2 * (world - 1) * comm_bytes // world, 2 * (world - 1) * 4 * psi // world,
             "2(W-1)/W · 4Ψ"),
        ])
        if device.type == "cuda":
            common.log(f"  cuda max_memory_allocated: {common.fmt_bytes(torch.cuda.max_memory_allocated(device))}")
        sps = out["steps"] * args.batch_size / max(out["train_time"], 1e-9)
        common.log(f"\ntest accuracy {acc:.4f}, final train loss {out['loss']:.4f}, {sps:.0f} samples/s")
        if rank == 0 and args.save:
            common.save_checkpoint({k: v.cpu() for k, v in model.module.state_dict().items()}, args.save)
            common.log(f"saved {args.save}")
        common.result(script=SCRIPT, world_size=world, backend=backend, device=device.type, data=source,
                      params=psi, steps=out["steps"], loss=out["loss"], test_acc=acc, samples_per_s=sps,
                      param_bytes=out["param_bytes"], grad_bytes=out["grad_bytes"], optim_bytes=out["optim_bytes"],
                      comm_bytes=comm_bytes)
    finally:
        cleanup()


def worker(local_rank, nproc, args):
    """mp.spawn entry: give this process the environment torchrun would have given it."""
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc))
    run(args)
    gc.collect()                                   # see main()


def main():
    parser = common.get_parser("DDP: DistributedDataParallel on the common ViT")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step (no_sync on all but the last)")
    parser.add_argument("--nproc", type=int, default=None, help="without torchrun: processes to spawn (default: GPUs, else 2)")
    parser.add_argument("--port", type=int, default=0, help="without torchrun: rendezvous port (default: a free one)")
    args = common.parse_args(parser)
    if "LOCAL_RANK" in os.environ:                 # started by torchrun: this process is one rank
        run(args)
        # DDP and its comm hook form reference cycles that hold Python callbacks on Gloo work; free
        # them now, not during interpreter shutdown, where Gloo's threads can abort the exit.
        return gc.collect()
    nproc = args.nproc if args.nproc is not None else (torch.cuda.device_count() or 2)
    common.check(nproc >= 1, f"--nproc must be >= 1, got {nproc}")
    check_args(args, nproc)
    port = args.port or common.free_port()
    common.check(common.port_is_free(port), f"--port {port} is already in use; pick another or leave --port out")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        mp.spawn(worker, args=(nproc, args), nprocs=nproc)
    except mp.ProcessRaisedException as e:          # show the failing rank's traceback once, not a wall
        print(f"error: rank {e.error_index} failed:\n{e}", file=sys.stderr)
        sys.exit(1)
    except mp.ProcessExitedException as e:
        if e.exit_code != 2:                        # 2: bad input, which rank 0 has already explained
            print(f"error: rank {e.error_index} exited with code {e.exit_code}", file=sys.stderr)
        sys.exit(e.exit_code if e.exit_code and e.exit_code > 0 else 1)


if __name__ == "__main__":
    main()
