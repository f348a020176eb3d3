"""Step time of zero.py against PyTorch's own versions, side by side in one launch (not a test):

    zero.py stage 1  vs  DDP + torch.distributed.optim.ZeroRedundancyOptimizer   (target <= 1.05x)
    zero.py stage 3  vs  fsdp.py (FSDP2 fully_shard)                              (target <= 1.2x)

Each variant gets its own copy of the same model and trains on the same random batches; the
variants take turns for --rounds rounds of --steps timed steps (after --warmup untimed ones), so a
slow moment on a shared machine hits all of them alike. The median step time of each is compared.
After the warm-up, each pair's parameters are compared (the same steps from the same seed).

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_zero.py --dim 256 --depth 8
    python benchmarks/bench_zero.py --nproc 2 --dim 256 --depth 8   # through mp.spawn, a free port
"""

import os
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

PAIRS = [
    ("zero.py stage 1", "ddp+ZeroRedundancyOptimizer", "1.05"),
    ("zero.py stage 3", "fsdp.py (FSDP2)", "1.2"),
]


def ddp_state_dict(model):
    return {key: value.detach().cpu() for key, value in model.module.state_dict().items()}


def variants(args, device):
    """name -> (model, optimizer, full_state_dict); every model starts from the same seed. Each
    loop is the skeleton's: forward, loss, backward, optimizer.step(), optimizer.zero_grad()."""
    out = {}
    model = DDP(
        common.build_model(args).to(device),
        device_ids=[device.index] if device.type == "cuda" else None,
    )
    if args.optim == "sgd":  # what common.make_optimizer builds
        optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.SGD, lr=args.lr, momentum=0.9
        )
    else:
        optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr, weight_decay=0.01
        )
    out["ddp+ZeroRedundancyOptimizer"] = (model, optimizer, ddp_state_dict)
    for stage in (1, 3):
        model = common.build_model(args).to(device)
        units = [model.embed, *model.blocks, model.head]
        model = zero.parallelize(model, device, stage, units=units)
        optimizer = common.make_optimizer(model.parameters(), args)
        zero.hook_optimizer(model, optimizer)
        out[f"zero.py stage {stage}"] = (model, optimizer, zero.full_state_dict)
    model = common.build_model(args).to(device)
    model = fsdp.parallelize(model, device, model.blocks)  # fsdp.py's units and defaults
    optimizer = common.make_optimizer(model.parameters(), args)
    out["fsdp.py (FSDP2)"] = (model, optimizer, fsdp.full_state_dict)
    return out


def snapshot(state):
    """A copy: on the CPU .cpu() returns the tensor itself, which the timed steps go on to change.
    zero.py's full_state_dict is {} on every rank but 0."""
    return {key: value.clone() for key, value in state.items()}


def step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run(args):
    rank, world, device, backend = zero.setup(args)
    try:
        generator = torch.Generator().manual_seed(rank)
        x = torch.randn(args.batch_size // world, 1, 28, 28, generator=generator).to(device)
        y = torch.randint(0, 10, (args.batch_size // world,), generator=generator).to(device)
        runs = variants(args, device)
        times = {name: [] for name in runs}
        states = {}
        for name, (model, optimizer, state_dict) in runs.items():
            for _ in range(args.warmup_steps):
                step(model, optimizer, x, y)
            states[name] = snapshot(state_dict(model))  # collective; the whole state on rank 0
        for _ in range(args.rounds):
            for name, (model, optimizer, _) in runs.items():
                dist.barrier()
                start = time.perf_counter()
                for _ in range(args.steps):
                    step(model, optimizer, x, y)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dist.barrier()
                times[name].append((time.perf_counter() - start) / args.steps)
        median = {name: statistics.median(seconds) for name, seconds in times.items()}
        psi = sum(p.numel() for p in common.build_model(args).parameters())
        common.log(
            f"\nW={world}, {backend} on {device.type}, Ψ = {psi:,}, batch {args.batch_size}, "
            f"{args.optim}, median of {args.rounds} rounds x {args.steps} steps"
        )
        for name, seconds in median.items():
            rounds = ", ".join(f"{1000 * s:.0f}" for s in times[name])
            common.log(f"  {name:<30}{1000 * seconds:9.1f} ms/step   (rounds: {rounds})")
        ratios = {}
        diffs = {}
        for mine, reference, target in PAIRS:
            ratios[mine] = median[mine] / median[reference]
            if rank == 0:
                diffs[mine] = max(
                    (states[mine][key].double() - states[reference][key].double())
                    .abs()
                    .max()
                    .item()
                    for key in states[reference]
                )
                common.log(
                    f"  {mine} / {reference} = {ratios[mine]:.2f}x   (target <= {target}x; "
                    f"parameters after {args.warmup_steps} steps differ by {diffs[mine]:.2g})"
                )
        common.result(
            script="bench_zero",
            world_size=world,
            backend=backend,
            device=device.type,
            params=psi,
            ms_per_step={name: 1000 * seconds for name, seconds in median.items()},
            stage1_vs_ddp_zero=ratios[PAIRS[0][0]],
            stage3_vs_fsdp=ratios[PAIRS[1][0]],
            max_param_diff=diffs,
        )
    finally:
        zero.cleanup()


def main():
    parser = common.get_parser(
        "zero.py vs DDP+ZeroRedundancyOptimizer and vs FSDP2: step-time ratios"
    )
    parser.conflict_handler = "resolve"  # --warmup here counts untimed steps, not the lr warm-up
    group = parser.add_argument_group("benchmark")
    group.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    group.add_argument("--rounds", type=int, default=5)
    group.add_argument(
        "--warmup", dest="warmup_steps", type=int, default=3, help="untimed steps per variant first"
    )
    parser.set_defaults(warmup=0.0)  # the shared lr warm-up fraction: no schedule is stepped here
    args = common.parse_args(parser)
    world = common.world_size(args)
    common.check(
        args.batch_size % world == 0,
        f"--batch-size {args.batch_size} is not divisible by world size {world}",
    )
    for name in ("steps", "rounds"):
        common.check(
            getattr(args, name) > 0, f"--{name} must be positive, got {getattr(args, name)}"
        )
    common.check(args.warmup_steps >= 0, f"--warmup must be >= 0, got {args.warmup_steps}")
    common.launch(run, args)


if __name__ == "__main__":
    main()
