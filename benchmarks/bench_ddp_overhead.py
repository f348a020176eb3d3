"""What does DDP cost on one process? ddp.py at world size 1 against a plain training loop
over the same model, data, batches, optimizer and learning-rate schedule (no process group, no
wrapper, no Meter).

    python benchmarks/bench_ddp_overhead.py                 # 200 steps, best of 3 each
    python benchmarks/bench_ddp_overhead.py --steps 500 --repeats 5
    python benchmarks/bench_ddp_overhead.py --dim 128       # any shared flag, given to both

Prints samples/s of both and the ratio; the target is ddp.py >= 0.95x the plain loop.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402

UNTIMED_STEPS = 4  # the Meter's window of 3 observed steps and one warm-up step


def plain_loop(flags, steps):
    """ddp.py's train() with the distributed parts taken out: its data, sampler order, model,
    optimizer, schedule and loop, timed as the Meter times ddp.py: from the step after the first
    UNTIMED_STEPS (the loader's workers start in the first) to the last one."""
    args = common.parse_args(common.get_parser("plain"), [*flags, "--max-steps", str(steps)])
    backend, device = common.pick_backend(args.backend)  # ddp.py's device and CPU thread count
    train_set, _, _ = common.load_data(args, device)
    sampler = DistributedSampler(
        train_set, num_replicas=1, rank=0, shuffle=True, seed=args.seed, drop_last=True
    )
    loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        sampler=sampler,
        drop_last=True,
        pin_memory=device.type == "cuda",
        num_workers=args.workers,
        persistent_workers=args.workers > 0,  # started once, not every epoch
    )
    model = common.build_model(args).to(device)
    optimizer = common.make_optimizer(model.parameters(), args)
    scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
    model.train()
    loss_sum = torch.zeros((), device=device)
    done = 0
    start = None
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        train_set.set_epoch(epoch)
        for x, y in loader:
            if done == UNTIMED_STEPS:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
            done += 1
            if done % args.log_every == 0 or done == steps:
                loss_sum.item()  # ddp.py reads its loss as often (after an all-reduce)
            if done == steps:
                break
        if done == steps:
            break
    common.check(done > UNTIMED_STEPS, f"{done} steps in --epochs {args.epochs}: none timed")
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (done - UNTIMED_STEPS) * args.batch_size / (time.perf_counter() - start)


def ddp_w1(flags, steps):
    # `python ddp.py` is a world of one, as under torchrun, without the launcher's process
    cmd = [sys.executable, os.path.join(ROOT, "ddp.py"), *flags, "--max-steps", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    result = next(line for line in out.splitlines() if line.startswith("RESULT "))
    return json.loads(result[len("RESULT ") :])["samples_per_s"]


def main():
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Every other flag is a shared flag (common.py), given to both sides.",
    )
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    options, rest = p.parse_known_args()
    common.check(
        options.steps > UNTIMED_STEPS,
        f"--steps must be more than the {UNTIMED_STEPS} untimed ones, got {options.steps}",
    )
    shared = [flag for flag in rest if flag != "--"]
    flags = ["--data", "synthetic", "--epochs", "1", "--no-progress", *shared]
    # a bad flag fails now, not in a subprocess
    common.parse_args(common.get_parser("shared flags"), flags)
    plain = []
    ddp = []
    for i in range(options.repeats):  # alternate, so drift in machine load hits both
        plain.append(plain_loop(flags, options.steps))
        ddp.append(ddp_w1(flags, options.steps))
        print(
            f"run {i}: plain {plain[-1]:8.0f} samples/s   ddp.py W=1 {ddp[-1]:8.0f} samples/s",
            flush=True,
        )
    best_plain = max(plain)
    best_ddp = max(ddp)
    ratio = best_ddp / best_plain
    print(
        f"\nbest of {options.repeats}: plain loop {best_plain:.0f} samples/s, "
        f"ddp.py W=1 {best_ddp:.0f} samples/s"
    )
    print(f"ddp.py / plain = {ratio:.3f}  (overhead {100 * (1 - ratio):+.1f}%, target <= 5%)")


if __name__ == "__main__":
    main()
