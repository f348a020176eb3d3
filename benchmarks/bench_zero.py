"""Step time of zero.py against PyTorch's own versions and DeepSpeed's, side by side in one launch
(not a test):

    zero.py stage 1  vs  DDP + torch.distributed.optim.ZeroRedundancyOptimizer   (target <= 1.05x)
    zero.py stage 3  vs  fsdp.py (FSDP2 fully_shard)                              (target <= 1.2x)
    zero.py stage k  vs  deepspeed_zero.py stage k, k = 1, 2, 3                   (target <= 1.0x)
    zero.py stage k, the whole model one unit  vs  DeepSpeed stage k, k = 1, 2   (its one bucket)

The DeepSpeed rows need it installed (requirements-deepspeed.txt); without it they are left out,
and the benchmark says so. Per-rank memory is read off the storages after the warm-up, as the
Meter reads it: parameters, gradients and optimizer state (DeepSpeed's fp32 partition counted
with the parameters).

Each variant gets its own copy of the same model and trains on the same random batches; the
variants take turns for --rounds rounds of --steps timed steps (after --warmup untimed ones), so a
slow moment on a shared machine hits all of them alike. The median step time of each is compared.
After the warm-up, each pair's parameters are compared (the same steps from the same seed).

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_zero.py --dim 256 --depth 8
    python benchmarks/bench_zero.py --nproc 2 --dim 256 --depth 8   # through mp.spawn, a free port
"""

import argparse
import gc
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
import deepspeed_zero  # noqa: E402 (deepspeed_zero.deepspeed is None where it is not installed)
import fsdp  # noqa: E402
import zero  # noqa: E402
from common.meter import memory  # noqa: E402

PAIRS = [
    ("zero.py stage 1", "ddp+ZeroRedundancyOptimizer", "1.05"),
    ("zero.py stage 3", "fsdp.py (FSDP2)", "1.2"),
]
if deepspeed_zero.deepspeed is not None:
    PAIRS += [(f"zero.py stage {k}", f"DeepSpeed stage {k}", "1.0") for k in (1, 2, 3)]
    # DeepSpeed's stages 1-2 reduce the whole model's gradients in one bucket: zero.py with the
    # whole model as one unit does the same, one reduce-scatter and one all-gather a step
    PAIRS += [(f"zero.py stage {k}, one unit", f"DeepSpeed stage {k}", "1.0") for k in (1, 2)]


def ddp_state_dict(model):
    return {key: value.detach().cpu() for key, value in model.module.state_dict().items()}


def variants(args, device):
    """name -> (model, optimizer, full_state_dict); every model starts from the same seed. Each
    loop is the skeleton's: forward, loss, backward, optimizer.step(), optimizer.zero_grad(), or
    DeepSpeed's: engine(x), engine.backward(loss), engine.step()."""
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
    for stage in (1, 2, 3):
        model = common.build_model(args).to(device)
        units = [model.embed, *model.blocks, model.head]
        model = zero.parallelize(model, device, stage, units=units)
        optimizer = common.make_optimizer(model.parameters(), args)
        zero.hook_optimizer(model, optimizer)
        out[f"zero.py stage {stage}"] = (model, optimizer, zero.full_state_dict)
    for stage in (1, 2):
        model = common.build_model(args).to(device)
        model = zero.parallelize(model, device, stage, units=[model])
        optimizer = common.make_optimizer(model.parameters(), args)
        zero.hook_optimizer(model, optimizer)
        out[f"zero.py stage {stage}, one unit"] = (model, optimizer, zero.full_state_dict)
    model = common.build_model(args).to(device)
    model = fsdp.parallelize(model, device, model.blocks)  # fsdp.py's units and defaults
    optimizer = common.make_optimizer(model.parameters(), args)
    out["fsdp.py (FSDP2)"] = (model, optimizer, fsdp.full_state_dict)
    if deepspeed_zero.deepspeed is None:
        return out
    for stage in (1, 2, 3):
        model = common.build_model(args).to(device)
        optimizer = common.make_optimizer(model.parameters(), args)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)  # constant
        flags = argparse.Namespace(**{**vars(args), "stage": stage, "offload": "none"})
        config = deepspeed_zero.ds_config(flags, dist.get_world_size())
        model, optimizer, _ = deepspeed_zero.parallelize(model, optimizer, scheduler, config)
        out[f"DeepSpeed stage {stage}"] = (model, optimizer, deepspeed_zero.full_state_dict)
    return out


def snapshot(state):
    """A copy: on the CPU .cpu() returns the tensor itself, which the timed steps go on to change.
    zero.py's full_state_dict is {} on every rank but 0."""
    return {key: value.clone() for key, value in state.items()}


def step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    if is_engine(model):
        model.backward(loss)
        model.step()
        return
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def is_engine(model):
    return deepspeed_zero.deepspeed is not None and isinstance(
        model, deepspeed_zero.deepspeed.DeepSpeedEngine
    )


def bytes_per_rank(model, optimizer):
    """Parameters + gradients + optimizer state this rank holds now: for DeepSpeed and for
    ZeroRedundancyOptimizer, those of the torch optimizer each wraps (DeepSpeed's also holds the
    fp32 partition)."""
    if is_engine(model):
        optimizer = optimizer.optimizer
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer = optimizer.optim
    mem = memory(model.parameters(), optimizer)
    return mem["param_bytes"] + mem["grad_bytes"] + mem["optim_bytes"]


def run(args):
    rank, world, device, backend = zero.setup(args)
    try:
        generator = torch.Generator().manual_seed(rank)
        x = torch.randn(args.batch_size // world, 1, 28, 28, generator=generator).to(device)
        y = torch.randint(0, 10, (args.batch_size // world,), generator=generator).to(device)
        runs = variants(args, device)
        times = {name: [] for name in runs}
        states = {}
        held = {}
        for name, (model, optimizer, state_dict) in runs.items():
            for _ in range(args.warmup_steps):
                step(model, optimizer, x, y)
            held[name] = bytes_per_rank(model, optimizer)
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
        if deepspeed_zero.deepspeed is None:
            common.log("  (DeepSpeed is not installed: its rows are left out)")
        for name, seconds in median.items():
            rounds = ", ".join(f"{1000 * s:.0f}" for s in times[name])
            common.log(
                f"  {name:<30}{1000 * seconds:9.1f} ms/step  {common.fmt_bytes(held[name]):>11}"
                f" per rank   (rounds: {rounds})"
            )
        ratios = {}
        diffs = {}
        for mine, reference, target in PAIRS:
            pair = f"{mine} / {reference}"
            ratios[pair] = median[mine] / median[reference]
            if rank == 0:
                diffs[pair] = max(
                    (states[mine][key].double() - states[reference][key].double())
                    .abs()
                    .max()
                    .item()
                    for key in states[reference]
                )
                common.log(
                    f"  {pair} = {ratios[pair]:.2f}x   (target <= {target}x; "
                    f"parameters after {args.warmup_steps} steps differ by {diffs[pair]:.2g})"
                )
        common.result(
            script="bench_zero",
            world_size=world,
            backend=backend,
            device=device.type,
            params=psi,
            ms_per_step={name: 1000 * seconds for name, seconds in median.items()},
            bytes_per_rank=held,
            ratios=ratios,
            max_param_diff=diffs,
        )
        # Free DDP before leaving the group, as ddp.py does: its reducer holds the group and,
        # freed after it, waits for Gloo's threads while holding the GIL that one of them needs
        # (pytorch#56297).
        del runs, model, optimizer
        gc.collect()
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
