"""Step time of zero.py against PyTorch's own versions, side by side in one launch (not a test):

    zero.py stage 1  vs  DDP + torch.distributed.optim.ZeroRedundancyOptimizer   (target <= 1.05x)
    zero.py stage 3  vs  fsdp.py (FSDP2 fully_shard)                              (target <= 1.2x)

Each variant gets its own copy of the same model and trains on the same random batches; the
variants take turns for --rounds rounds of --steps timed steps (after --warmup), so a slow moment
on a shared machine hits all of them alike. The median step time of each is compared.

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_zero.py --dim 256 --depth 8
"""
import os
import gc
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import fsdp  # noqa: E402
import zero  # noqa: E402


def variants(args, device, mesh):
    """name -> (model, optimizer, step function); every model starts from the same seed."""
    out = {}
    model = DDP(common.build_model(args).to(device), device_ids=[device.index] if device.type == "cuda" else None)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr, weight_decay=0.01)
    out["ddp+ZeroRedundancyOptimizer"] = (model, opt, None)
    for stage in (1, 3):
        model = common.build_model(args).to(device)
        z = zero.Zero(model, stage, device, offload=False)
        out[f"zero.py stage {stage}"] = (model, common.make_optimizer(z.masters, args), z)
    model = fsdp.shard_model(common.build_model(args).to(device), mesh, args, device)
    out["fsdp.py (FSDP2)"] = (model, common.make_optimizer(model.parameters(), args), None)
    return out


def step(model, opt, z, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if z is not None:
        z.finish_backward()
    opt.step()
    if z is not None:
        z.after_step()
    else:
        opt.zero_grad(set_to_none=True)


def main():
    common.default_env()
    parser = common.get_parser("zero.py vs DDP+ZeroRedundancyOptimizer and vs FSDP2: step-time ratios")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    args = common.parse_args(parser)
    args.no_reshard_after_forward = args.mixed_precision = args.cpu_offload = False   # fsdp.py's defaults
    backend, device = common.pick_backend(args.backend)
    rank, world, mesh = fsdp.setup(backend, args.timeout, device)
    try:
        common.check(args.batch_size % world == 0, f"--batch-size {args.batch_size} is not divisible by {world}")
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(args.batch_size // world, 1, 28, 28, generator=g).to(device)
        y = torch.randint(0, 10, (args.batch_size // world,), generator=g).to(device)
        runs = variants(args, device, mesh)
        times = {name: [] for name in runs}
        for name, (model, opt, z) in runs.items():
            for _ in range(args.warmup):
                step(model, opt, z, x, y)
        for _ in range(args.rounds):
            for name, (model, opt, z) in runs.items():
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step(model, opt, z, x, y)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dist.barrier()
                times[name].append((time.perf_counter() - t0) / args.steps)
        med = {name: statistics.median(t) for name, t in times.items()}
        psi = sum(p.numel() for p in common.build_model(args).parameters())
        common.log(f"\nW={world}, {backend} on {device.type}, Ψ = {psi:,}, batch {args.batch_size}, "
                   f"median of {args.rounds} rounds x {args.steps} steps")
        for name, t in med.items():
            rounds = ", ".join(f"{1000 * s:.0f}" for s in times[name])
            common.log(f"  {name:<30}{1000 * t:9.1f} ms/step   (rounds: {rounds})")
        r1 = med["zero.py stage 1"] / med["ddp+ZeroRedundancyOptimizer"]
        r3 = med["zero.py stage 3"] / med["fsdp.py (FSDP2)"]
        common.log(f"  stage 1 / (DDP + ZeroRedundancyOptimizer) = {r1:.2f}x   (target <= 1.05x)")
        common.log(f"  stage 3 / FSDP2                          = {r3:.2f}x   (target <= 1.2x)")
        common.result(script="bench_zero", world_size=world, backend=backend, device=device.type, params=psi,
                      ms_per_step={k: 1000 * v for k, v in med.items()}, stage1_vs_ddp_zero=r1, stage3_vs_fsdp=r3)
    finally:
        fsdp.cleanup()
    gc.collect()                                   # see fsdp.main()


if __name__ == "__main__":
    main()
