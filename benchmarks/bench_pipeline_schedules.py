"""Step time of pipeline_schedules.py's schedules side by side in one run (not a test): 1f1b,
interleaved (V chunks per rank) and zb-h1 on the same model, batch and micro-batches, next to the
bubble each one's formula gives. Variants are timed in interleaved rounds (load on a shared machine
hits all alike); the median step time of each is reported, and each one's time over 1f1b's.

    torchrun --standalone --nproc_per_node=4 benchmarks/bench_pipeline_schedules.py
    torchrun --standalone --nproc_per_node=4 benchmarks/bench_pipeline_schedules.py \\
        --dim 256 --heads 8
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


def build(args, device, name, num_chunks):
    """One training step of schedule `name` on a fresh stage of the common model."""
    model = common.build_model(args)
    stage = pipeline_schedules.parallelize(model, device, num_chunks)
    optimizer = common.make_optimizer(stage.parameters(), args)

    def step(x, y):
        pipeline_schedules.train_step(stage, x, y, name, args.microbatches)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def time_rounds(steps, x, y, args, device):
    """{variant: [seconds per step in each round]}, the variants one after another in each round."""
    times = {variant: [] for variant in steps}
    for _ in range(args.rounds):
        for variant, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(x, y)
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            times[variant].append((time.perf_counter() - start) / args.steps)
    return times


def run(args):
    rank, world, device, backend = pipeline_schedules.setup(args)
    try:
        p = world
        m = args.microbatches
        V = args.virtual_stages
        interleaved = f"interleaved V={V}"
        variants = {"1f1b": ("1f1b", 1), interleaved: ("interleaved", V), "zb-h1": ("zb-h1", 1)}
        bubble = {
            "1f1b": (p - 1) / (m + p - 1),
            interleaved: (p - 1) / (V * m + p - 1),
            "zb-h1": (p - 1) / (3 * m + p - 1),
        }
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(args.batch_size, 1, 28, 28, generator=generator).to(device)  # every rank
        y = torch.randint(0, 10, (args.batch_size,), generator=generator).to(device)
        steps = {variant: build(args, device, *how) for variant, how in variants.items()}
        for step in steps.values():  # warm-up
            step(x, y)
        times = time_rounds(steps, x, y, args, device)
        median = {variant: statistics.median(seconds) for variant, seconds in times.items()}
        common.log(
            f"\np={p} {backend} on {device.type} ({os.cpu_count()} cores), dim {args.dim}, "
            f"depth {args.depth}, batch {args.batch_size}, m={m}, {args.optim}; "
            f"median of {args.rounds} rounds x {args.steps} steps"
        )
        for variant in steps:
            common.log(
                f"  {variant:<16}{1000 * median[variant]:9.2f} ms/step  "
                f"{median[variant] / median['1f1b']:.3f}x 1f1b   "
                f"bubble (formula) {bubble[variant]:.3f}"
            )
        common.result(
            script="bench_pipeline_schedules",
            world_size=world,
            backend=backend,
            device=device.type,
            ms_per_step={variant: 1000 * seconds for variant, seconds in median.items()},
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
        value = getattr(args, name)
        common.check(value > 0, f"--{name} must be positive, got {value}")
    as_interleaved = argparse.Namespace(**{**vars(args), "schedule": "interleaved"})
    pipeline_schedules.check_args(as_interleaved, world)
    common.launch(run, args)


if __name__ == "__main__":
    main()
