"""Step time of pipeline_schedules.py's schedules side by side in one run (not a test): 1f1b,
interleaved (V chunks per rank) and zb-h1 on the same model, batch and micro-batches, next to the
bubble each one's formula gives. Variants are timed in interleaved rounds (load on a shared machine
hits all alike); the median step time of each is reported, and each one's time over 1f1b's.

    torchrun --standalone --nproc_per_node=4 benchmarks/bench_pipeline_schedules.py
    torchrun --standalone --nproc_per_node=4 benchmarks/bench_pipeline_schedules.py --dim 256 --heads 8
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import common  # noqa: E402
import pipeline_schedules  # noqa: E402


def build(args, device, name, V):
    stage = pipeline_schedules.parallelize(common.build_model(args), device, V)
    opt = common.make_optimizer(stage.parameters(), args)

    def step(x, y):
        pipeline_schedules.train_step(stage, x, y, name, args.microbatches)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def run(args):
    rank, world, device, backend = pipeline_schedules.setup(args)
    try:
        p, m, V = world, args.microbatches, args.virtual_stages
        variants = {
            "1f1b": ("1f1b", 1),
            f"interleaved V={V}": ("interleaved", V),
            "zb-h1": ("zb-h1", 1),
        }
        bubble = {
            "1f1b": (p - 1) / (m + p - 1),
            f"interleaved V={V}": (p - 1) / (V * m + p - 1),
            "zb-h1": (p - 1) / (3 * m + p - 1),
        }
        g = torch.Generator().manual_seed(0)
        x = torch.randn(args.batch_size, 1, 28, 28, generator=g).to(
            device
        )  # every rank: the whole batch
        y = torch.randint(0, 10, (args.batch_size,), generator=g).to(device)
        steps = {n: build(args, device, *v) for n, v in variants.items()}
        times = {n: [] for n in steps}
        for step in steps.values():  # warm-up
            step(x, y)
        for _ in range(args.rounds):
            for n, step in steps.items():
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step(x, y)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dist.barrier()
                times[n].append((time.perf_counter() - t0) / args.steps)
        med = {n: statistics.median(t) for n, t in times.items()}
        common.log(
            f"\np={p} {backend} on {device.type} ({os.cpu_count()} cores), dim {args.dim}, depth {args.depth}, "
            f"batch {args.batch_size}, m={m}, {args.optim}; median of {args.rounds} rounds x {args.steps} steps"
        )
        for n in steps:
            common.log(
                f"  {n:<16}{1000 * med[n]:9.2f} ms/step  {med[n] / med['1f1b']:.3f}x 1f1b   "
                f"bubble (formula) {bubble[n]:.3f}"
            )
        common.result(
            script="bench_pipeline_schedules",
            world_size=world,
            backend=backend,
            device=device.type,
            ms_per_step={n: 1000 * v for n, v in med.items()},
            bubble=bubble,
        )
    finally:
        pipeline_schedules.cleanup()


def main():
    parser = common.get_parser("pipeline_schedules.py: 1f1b vs interleaved vs zb-h1 step time")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--virtual-stages", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    parser.set_defaults(depth=8, batch_size=64)
    args = common.parse_args(parser)
    world = common.world_size(args)
    for name in ("steps", "rounds"):
        common.check(
            getattr(args, name) > 0, f"--{name} must be positive, got {getattr(args, name)}"
        )
    pipeline_schedules.check_args(
        argparse.Namespace(**{**vars(args), "schedule": "interleaved"}), world
    )
    common.launch(run, args)


if __name__ == "__main__":
    main()
