"""The input pipeline alone: samples/s of the scripts' training loader (DistributedSampler,
DataLoader, drop_last) fetching one sample at a time (Digits.__getitem__, as before batched
fetching) against a whole batch at a time (Digits.__getitems__, what the DataLoader uses now).

    python benchmarks/bench_loader.py                      # --shift 1, batch 128, best of 3
    python benchmarks/bench_loader.py --shift 0 --repeats 5

Prints both and the ratio (batched over per-sample).
"""

import argparse
import os
import sys
import time

from torch.utils.data import DataLoader, Dataset, DistributedSampler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402


class PerSample(Dataset):
    """The same dataset without __getitems__: the DataLoader calls __getitem__ once a sample."""

    def __init__(self, digits):
        self.digits = digits

    def __len__(self):
        return len(self.digits)

    def __getitem__(self, i):
        return self.digits[i]


def samples_per_s(dataset, batch, repeats):
    """The best of `repeats` passes over one epoch of the scripts' loader at world size 1."""
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=True)
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        seen = sum(len(y) for _, y in loader)
        best = max(best, seen / (time.perf_counter() - start))
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shift", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--limit", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    args = common.parse_args(
        common.get_parser("bench"),
        ["--data", "synthetic", "--limit", str(a.limit), "--shift", str(a.shift)],
    )
    train_set, _, _ = common.load_data(args)
    train_set.set_epoch(0)
    before = samples_per_s(PerSample(train_set), a.batch_size, a.repeats)
    after = samples_per_s(train_set, a.batch_size, a.repeats)
    print(f"--shift {a.shift}, batch {a.batch_size}, {len(train_set)} samples, best of {a.repeats}")
    print(f"per sample (__getitem__):  {before:10.0f} samples/s")
    print(f"per batch (__getitems__):  {after:10.0f} samples/s")
    print(f"ratio: {after / before:.1f}x")


if __name__ == "__main__":
    main()
