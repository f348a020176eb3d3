"""What does DDP cost on one process? ddp.py at world size 1 against a plain training loop
over the same model, data, batches and optimizer (no process group, no wrapper).

    python benchmarks/bench_ddp_overhead.py                 # 200 steps, best of 3 each
    python benchmarks/bench_ddp_overhead.py --steps 500 --repeats 5

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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402


def plain_loop(flags, steps):
    args = common.parse_args(common.get_parser("plain"), flags)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = common.build_model(args).to(device)
    optimizer = common.make_optimizer(model.parameters(), args)
    xtr, ytr, *_ = common.load_data(args)
    loader, sampler = common.train_loader(xtr, ytr, args.batch_size, 0, 1, args.seed)
    sampler.set_epoch(0)
    done, t0 = 0, time.perf_counter()
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done += 1
        if done == steps:
            break
    if device.type == "cuda":
        torch.cuda.synchronize()
    return done * args.batch_size / (time.perf_counter() - t0)


def ddp_w1(flags, steps):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           os.path.join(ROOT, "ddp.py"), *flags, "--max-steps", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])["samples_per_s"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("flags", nargs="*", default=[], help="extra common flags, after --")
    a = p.parse_args()
    flags = ["--data", "synthetic", "--epochs", "1", "--no-progress", *a.flags]
    plain, ddp = [], []
    for i in range(a.repeats):                     # alternate, so drift in machine load hits both
        plain.append(plain_loop(flags, a.steps))
        ddp.append(ddp_w1(flags, a.steps))
        print(f"run {i}: plain {plain[-1]:8.0f} samples/s   ddp.py W=1 {ddp[-1]:8.0f} samples/s", flush=True)
    best_plain, best_ddp = max(plain), max(ddp)
    print(f"\nbest of {a.repeats}: plain loop {best_plain:.0f} samples/s, ddp.py W=1 {best_ddp:.0f} samples/s")
    print(f"ddp.py / plain = {best_ddp / best_plain:.3f}  (overhead {100 * (1 - best_ddp / best_plain):+.1f}%, "
          f"target <= 5%)")


if __name__ == "__main__":
    main()
