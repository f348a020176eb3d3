"""Step time of the written-out model parallelism against PyTorch's own, side by side in one run
(not a test): at W=2 on the same model and batch,

    tensor_parallel.py (f/g, Column/RowParallelLinear)  vs  DTensor parallelize_module with
                                                        the same Colwise / RowwiseParallel plan
    pipeline.py 1F1B and GPipe (batch_isend_irecv)      vs  torch.distributed.pipelining
                                                        PipelineStage + Schedule1F1B / GPipe

Variants are timed in interleaved rounds (so load on a shared machine hits all alike); the
median step time of each is reported, and the ratio written-out / PyTorch (target <= 1.05).

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_model_parallel.py
    torchrun --standalone --nproc_per_node=2 benchmarks/bench_model_parallel.py \
        --dim 256 --depth 8 --heads 8
    python benchmarks/bench_model_parallel.py --nproc 2        # through mp.spawn on a free port
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import common  # noqa: E402
import pipeline  # noqa: E402
import tensor_parallel  # noqa: E402


def tp_mine(args, device, rank, world):
    model = tensor_parallel.parallelize(common.build_model(args).to(device), device)
    opt = common.make_optimizer(model.parameters(), args)

    def step(x, y):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, lambda: tensor_parallel.full_state_dict(model)


def tp_dtensor(args, device, rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = common.build_model(args).to(device)
    mesh = init_device_mesh(device.type, (world,))
    plan = {}
    for i in range(args.depth):
        plan.update({f"blocks.{i}.attn.{n}": ColwiseParallel() for n in ("q", "k", "v")})
        plan.update(
            {
                f"blocks.{i}.attn.proj": RowwiseParallel(),
                f"blocks.{i}.mlp.fc1": ColwiseParallel(),
                f"blocks.{i}.mlp.fc2": RowwiseParallel(),
            }
        )
    parallelize_module(model, mesh, plan)
    opt = common.make_optimizer(model.parameters(), args)

    def step(x, y):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, lambda: {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
        for k, v in model.state_dict().items()
    }


def pp_mine(schedule):
    def build(args, device, rank, world):
        stage = pipeline.parallelize(common.build_model(args), device)
        opt = common.make_optimizer(stage.parameters(), args)

        def step(x, y):
            pipeline.train_step(stage, x, y, schedule, args.microbatches)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step, lambda: pipeline.full_state_dict(stage)

    return build


def pp_torch(schedule):
    def build(args, device, rank, world):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        # the same stage as pipeline.py's (its group, for full_state_dict), run by torch's schedule
        stage_mod = pipeline.parallelize(common.build_model(args), device)
        stage = PipelineStage(stage_mod, rank, world, device)
        loss_fn = lambda out, y: F.cross_entropy(out, y)  # noqa: E731  (the schedule scales by 1/m)
        sched = (Schedule1F1B if schedule == "1f1b" else ScheduleGPipe)(
            stage, args.microbatches, loss_fn=loss_fn
        )
        opt = common.make_optimizer(stage_mod.parameters(), args)

        def step(x, y):
            last = {}  # the last stage's targets (the first stage's too, in a world of one)
            if rank == world - 1:
                last = dict(target=y, losses=[])
            if rank == 0:
                sched.step(x, **last)
            else:
                sched.step(**last)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step, lambda: pipeline.full_state_dict(stage_mod)

    return build


def snapshot(state):
    """A copy: on the CPU .cpu() returns the tensor itself, which the timed steps go on to
    change."""
    return {k: v.clone() for k, v in (state or {}).items()}


VARIANTS = {
    "tp written out": tp_mine,
    "tp DTensor parallelize_module": tp_dtensor,
    "1f1b written out": pp_mine("1f1b"),
    "1f1b torch pipelining": pp_torch("1f1b"),
    "gpipe written out": pp_mine("gpipe"),
    "gpipe torch pipelining": pp_torch("gpipe"),
}
PAIRS = [
    ("tp written out", "tp DTensor parallelize_module"),
    ("1f1b written out", "1f1b torch pipelining"),
    ("gpipe written out", "gpipe torch pipelining"),
]


def run(args):
    rank, world, device, backend = tensor_parallel.setup(args)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(args.batch_size, 1, 28, 28, generator=g).to(
            device
        )  # every rank: the whole batch
        y = torch.randint(0, 10, (args.batch_size,), generator=g).to(device)
        steps, times, failed, states = {}, {name: [] for name in VARIANTS}, {}, {}
        for name, build in VARIANTS.items():
            try:
                steps[name], state = build(args, device, rank, world)
                for _ in range(2):  # warm-up (and the pipelining stages' shape inference)
                    steps[name](x, y)
                states[name] = snapshot(
                    state()
                )  # after the same 2 steps from the same seed; whole on rank 0
            except Exception as e:  # report it and go on with the others
                failed[name] = (
                    f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                )
                steps.pop(name, None)
        dist.barrier()
        for _ in range(args.rounds):
            for name, step in steps.items():
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step(x, y)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dist.barrier()
                times[name].append((time.perf_counter() - t0) / args.steps)
        common.log(
            f"\nW={world} {backend} on {device.type}, "
            f"dim {args.dim}, depth {args.depth}, heads {args.heads}, "
            f"batch {args.batch_size}, {args.microbatches} micro-batches, {args.optim}; "
            f"median of {args.rounds} rounds x {args.steps} steps"
        )
        med = {n: statistics.median(t) for n, t in times.items() if t}
        for n in VARIANTS:
            common.log(
                f"  {n:<32}"
                + (f"{1000 * med[n]:8.2f} ms/step" if n in med else f"  FAILED {failed.get(n)}")
            )
        ratios, diffs = {}, {}
        for mine, ref in PAIRS:
            if mine in med and ref in med:
                key = mine.split()[0]
                ratios[key] = med[mine] / med[ref]
                if rank == 0:  # full_state_dict gathers to rank 0 only
                    diffs[key] = max(
                        (states[mine][k].double() - states[ref][k].double()).abs().max().item()
                        for k in states[ref]
                    )
                    common.log(
                        f"  ratio {mine} / {ref}: {ratios[key]:.3f}   "
                        f"(parameters after 2 steps differ by {diffs[key]:.2g})"
                    )
        common.result(
            script="bench_model_parallel",
            world_size=world,
            backend=backend,
            device=device.type,
            ms_per_step={n: 1000 * v for n, v in med.items()},
            ratios=ratios,
            max_param_diff=diffs,
            failed=failed,
        )
        # a variant that failed is a broken benchmark, not a row to skip: the run fails
        common.check(not failed, f"bench_model_parallel: {len(failed)} variants failed: {failed}")
    finally:
        tensor_parallel.cleanup()


def main():
    parser = common.get_parser(
        "written-out TP / PP against DTensor and torch.distributed.pipelining"
    )
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    args = common.parse_args(parser)
    world = common.world_size(args)
    for name in ("steps", "rounds"):
        common.check(
            getattr(args, name) > 0, f"--{name} must be positive, got {getattr(args, name)}"
        )
    tensor_parallel.check_args(argparse.Namespace(**vars(args), sequence_parallel=False), world)
    pipeline.check_args(
        argparse.Namespace(**vars(args), schedule="1f1b"), world
    )  # 1f1b checks what gpipe does
    common.launch(run, args)


if __name__ == "__main__":
    main()
