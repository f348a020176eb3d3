"""Per-rank memory and communication of the data-parallel family on a bigger model (not a test):
ddp.py, zero.py stages 1-3 and fsdp.py at W=2 and W=4, `--dim 256 --depth 8` by default, two
steps each. It launches each script with torchrun and prints one markdown table of what each
RESULT line says the Meter measured (storages after the first step; collective bytes per step),
next to the paper's formula.

    python benchmarks/bench_memory.py
    python benchmarks/bench_memory.py --worlds 2 --dim 512 --depth 12
    python benchmarks/bench_memory.py --worlds 2 --dim 16 --depth 1 --only "zero.py --stage 3"
"""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = [  # label, script and flags, formula of params + grads + optimizer (AdamW)
    ("ddp.py", ["ddp.py"], "16Ψ"),
    ("zero.py --stage 1", ["zero.py", "--stage", "1"], "4Ψ+4Ψ+8Ψ/W"),
    ("zero.py --stage 2", ["zero.py", "--stage", "2"], "4Ψ+12Ψ/W"),
    ("zero.py --stage 3", ["zero.py", "--stage", "3"], "16Ψ/W"),
    ("fsdp.py", ["fsdp.py"], "16Ψ/W"),
]


def mib(n):
    return f"{n / 2**20:.2f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--only", default=None, help="only the rows whose label matches this regex")
    args = p.parse_args()
    runs = [run for run in RUNS if args.only is None or re.search(args.only, run[0])]
    if not runs:
        sys.exit(f"--only {args.only!r} matches none of {[label for label, _, _ in RUNS]}")
    flags = [
        "--dim",
        str(args.dim),
        "--depth",
        str(args.depth),
        "--heads",
        "8",
        "--data",
        "synthetic",
        "--limit",
        "512",
        "--batch-size",
        "32",
        "--max-steps",
        "2",
        "--epochs",
        "1",
        "--no-progress",
    ]
    print(
        "| W | script | params | grads | optimizer | total | formula | collective bytes per step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for world in args.worlds:
        for label, cmd, formula in runs:
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc_per_node={world}",
                    *[str(ROOT / cmd[0]), *cmd[1:]],
                    *flags,
                ],
                capture_output=True,
                text=True,
                cwd=ROOT,
                timeout=900,
            )
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if out.returncode or not lines:
                sys.exit(
                    f"{label} at W={world} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
                )
            r = json.loads(lines[0][len("RESULT ") :])
            total = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
            comm = ", ".join(
                f"{mib(b)} {k.replace('_', '-')}" for k, b in sorted(r["comm"].items()) if b > 1024
            )
            memory = f"{mib(r['param_bytes'])} | {mib(r['grad_bytes'])} | {mib(r['optim_bytes'])}"
            print(
                f"| {world} | {label} | {memory} | {mib(total)} | {formula} | {comm} |",
                flush=True,
            )
    print(f"\nMiB per rank; Ψ = {r['params']:,} parameters ({mib(4 * r['params'])} MiB of fp32).")


if __name__ == "__main__":
    main()
