"""Does the main job run at its model's speed? ddp.py's samples/s at W = 1 (its RESULT: the loop
as it runs, loader, DDP and logging included) as a share of a tight loop of the same model, batch,
optimizer and schedule on the same device, its batches already there: forward, loss, backward,
step and nothing else. On a GPU the target is >= 0.9 (issue 41: 0.60x with the loader in the
training process); on the CPU at a tiny model the share shows the loop's fixed cost a step.

    python benchmarks/bench_main_loop.py                  # ddp.py's model, 1000 steps, best of 3
    python benchmarks/bench_main_loop.py --workers 0      # any shared flag, given to both loops
    python benchmarks/bench_main_loop.py --steps 8 --repeats 1 --dim 16 --depth 1 --limit 512

Both loops are timed as the Meter times ddp.py: from the step after its first 4 to the last one,
the GPU synchronized at both ends. The data is the synthetic digits unless --data says otherwise
(the model's speed does not depend on the images). Prints samples/s of both and the share, and
a RESULT line (benchmarks/check_cuda.py reads it).
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402

UNTIMED_STEPS = 4  # the Meter's window of 3 observed steps and one warm-up step
DISTINCT_BATCHES = 8  # the tight loop cycles through these, on the device from the start


def tight_loop(flags, steps):
    """ddp.py's model, batch, optimizer and schedule with nothing around them: samples/s."""
    args = common.parse_args(common.get_parser("tight loop"), [*flags, "--max-steps", str(steps)])
    backend, device = common.pick_backend(args.backend)  # ddp.py's device and CPU thread count
    if device.type == "cuda":
        torch.cuda.set_device(device)
    train_set, _, _ = common.load_data(args, device)
    batch = args.batch_size
    count = min(DISTINCT_BATCHES, len(train_set) // batch)
    common.check(count > 0, f"{len(train_set)} training samples make no batch of {batch}")
    batches = []
    for i in range(count):
        x, y = train_set.batch(range(i * batch, (i + 1) * batch))
        batches.append((x.to(device), y.to(device)))
    model = common.build_model(args).to(device)
    optimizer = common.make_optimizer(model.parameters(), args)
    scheduler = common.make_scheduler(optimizer, args, steps)
    model.train()
    start = None
    for step in range(steps):
        if step == UNTIMED_STEPS:
            synchronize(device)
            start = time.perf_counter()
        x, y = batches[step % count]
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    return (steps - UNTIMED_STEPS) * batch / (time.perf_counter() - start), device


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main_loop(flags, steps):
    """ddp.py as a user runs it, one process: the samples/s its RESULT line reports."""
    command = [sys.executable, os.path.join(ROOT, "ddp.py"), *flags, "--max-steps", str(steps)]
    run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    results = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode != 0 or not results:
        sys.exit(
            f"ddp.py failed (exit {run.returncode}):\n{run.stdout[-2000:]}{run.stderr[-2000:]}"
        )
    return json.loads(results[-1][len("RESULT ") :])["samples_per_s"]


def main():
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Every other flag is a shared flag (common/launch.py), given to both loops.",
    )
    p.add_argument("--steps", type=int, default=1000, help="steps of each run, 4 of them untimed")
    p.add_argument("--repeats", type=int, default=3, help="runs of each loop, taking turns")
    options, rest = p.parse_known_args()
    common.check(
        options.steps > UNTIMED_STEPS,
        f"--steps must be more than the {UNTIMED_STEPS} untimed ones, got {options.steps}",
    )
    common.check(options.repeats > 0, f"--repeats must be positive, got {options.repeats}")
    flags = ["--data", "synthetic", "--no-progress", *[flag for flag in rest if flag != "--"]]
    args = common.parse_args(common.get_parser("shared flags"), flags)  # a bad flag fails here
    common.check(args.nproc in (None, 1), "the main loop is measured at W = 1: no --nproc")
    tight = []
    ddp = []
    for i in range(options.repeats):  # taking turns, so drift in the machine's load hits both
        samples_per_s, device = tight_loop(flags, options.steps)
        tight.append(samples_per_s)
        ddp.append(main_loop(flags, options.steps))
        print(f"run {i}: tight loop {tight[-1]:9.0f} samples/s   ddp.py {ddp[-1]:9.0f} samples/s")
    share = max(ddp) / max(tight)
    print(
        f"\n{device.type}, --workers {args.workers}, dim {args.dim}, depth {args.depth}, "
        f"batch {args.batch_size}, {args.optim}, best of {options.repeats} x {options.steps} steps"
    )
    print(f"ddp.py / tight loop = {share:.3f}  (target on a GPU: >= 0.9)")
    common.result(
        script="bench_main_loop",
        device=device.type,
        workers=args.workers,
        tight_samples_per_s=max(tight),
        ddp_samples_per_s=max(ddp),
        share=share,
    )


if __name__ == "__main__":
    main()
