"""The papers' settings, run by the scripts themselves at the papers' sizes (not a test): each row
is one `--simulate W` run (one process as rank 0 of W on torch's fake process group, every tensor
on the meta device; common/simulate.py) whose measured value is set next to the script's formula
and to the number the paper prints. tests/test_papers_scale.py asserts the same rows.

    python benchmarks/bench_papers_scale.py              # the markdown table of docs/measured.md
    python benchmarks/bench_papers_scale.py --only ZeRO  # the rows whose label matches a regex
"""

import argparse
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9  # the papers' gigabyte
# the papers, as the table names them
SOURCES = {
    "ZeRO": "Rajbhandari et al. 2020, https://arxiv.org/abs/1910.02054",
    "Megatron-LM": "Shoeybi et al. 2019, https://arxiv.org/abs/1909.08053",
    "GPipe": "Huang et al. 2019, https://arxiv.org/abs/1811.06965",
    "Narayanan": "Narayanan et al. 2021, https://arxiv.org/abs/2104.04473",
}
ZERO = "ZeRO, Table 1"
MEGATRON = "Megatron-LM, §3"
GPT3 = "Narayanan, Table 1"  # GPT-3 175B on 1,536 GPUs: t = 8, p = 16, d = 12
ZERO_DP = "ZeRO, §7.2.1"  # stage 1 moves 2Ψ a step, as data parallelism does
GPIPE = "GPipe, §2.3"  # (p-1)/(m+p-1)
INTERLEAVED = "Narayanan, §2.2.2"  # (p-1)/(v·m) of the compute time
# ZeRO's Table 1 model: 7.5B parameters, mixed precision, Adam (K = 12); here Ψ = 7.45B
TABLE_1 = [*"--mixed-precision --dim 4096 --depth 37 --heads 32 --batch-size 1024".split()]
# GPT-3 175B's layout (Narayanan et al. 2021, Table 1) on the common ViT at GPT-3's width and depth
GPT3_LAYOUT = [*"--tp 8 --pp 16 --dp 12 --dim 12288 --depth 96 --heads 96".split()]
GPT3_LAYOUT += [*"--zero-stage 1 --microbatches 16 --batch-size 1536".split()]
MEMORY_ROWS = ("param_bytes", "grad_bytes", "optim_bytes", "working_bytes")


def model_states(fields):
    """Parameters, gradients, optimizer state and working copy a rank holds, in GB, the gradients
    counted at the paper's 2 bytes: zero.py's are fp32 (reduced in fp32, as FSDP2's
    reduce_dtype=float32 and torchtitan's default do), 2 bytes more for each one held."""
    held = sum(fields.get(row) or 0 for row in MEMORY_ROWS)
    return (held - fields["grad_bytes"] / 2) / GB


# Megatron's row: T = 8 ranks, a deep stack of layers, the common ViT's 16 tokens (patch 7)
MEGATRON_MODEL = dict(dim=1024, depth=72, heads=16, batch_size=8)
MEGATRON_FLAGS = []  # --dim 1024 --depth 72 ...
for key, value in MEGATRON_MODEL.items():
    MEGATRON_FLAGS += [f"--{key.replace('_', '-')}", str(value)]
TOKENS = 16


def all_reduces_a_layer(fields):
    """Calls a layer in one step, as measured."""
    return fields["comm_calls"].get("all_reduce", 0) / MEGATRON_MODEL["depth"]


def formula_all_reduces_a_layer(fields):
    """The formula's all-reduce bytes in whole [B, T, D] fp32 activations, a layer."""
    depth, batch, dim = (MEGATRON_MODEL[key] for key in ("depth", "batch_size", "dim"))
    return fields["formula"]["comm"]["all_reduce"] / (depth * batch * TOKENS * dim * 4)


def bubble(fields):
    """The idle fraction of the replayed schedules of every stage."""
    return fields["bubble"]


def formula_bubble(fields):
    return fields["formula"]["bubble"]


def billions_of_parameters(fields):
    """Parameters a rank holds (fp32), in billions."""
    return fields["param_bytes"] / 4 / 1e9


def formula_billions_of_parameters(fields):
    return fields["formula"]["param_bytes"] / 4 / 1e9


def data_parallel_traffic(fields):
    """Bytes a rank sends over the data-parallel dimension a step, in its parameter bytes."""
    return sum(size for _, size in fields["comm_by_dim"]["dp"].values()) / fields["param_bytes"]


def formula_data_parallel_traffic(fields):
    """The formula's (here the dp dimension's alone moves reduce-scatters and all-gathers)."""
    comm = fields["formula"]["comm"]
    return (comm["reduce_scatter"] + comm["all_gather"]) / fields["formula"]["param_bytes"]


# label, script, simulated world, flags, what is read from RESULT (measured), from its formula,
# the paper's number, its unit, where the paper says it
ROWS = [
    *[
        (
            f"ZeRO-{stage}, 7.5B, N_d = {world}",
            "zero.py",
            world,
            ["--stage", str(stage), *TABLE_1],
            model_states,
            lambda fields: model_states(fields["formula"]),
            paper,
            "GB a rank, 2-byte gradients",
            ZERO,
        )
        for world, stage, paper in ((64, 1, 31.4), (64, 2, 16.6), (64, 3, 1.88), (1024, 3, 0.12))
    ],
    (
        "Megatron TP, t = 8, 72 layers",
        "tensor_parallel.py",
        8,
        MEGATRON_FLAGS,
        all_reduces_a_layer,
        formula_all_reduces_a_layer,
        4,
        "all-reduces a layer",
        MEGATRON,
    ),
    (
        "1F1B pipeline, p = 8, m = 8",
        "pipeline.py",
        8,
        [*"--schedule 1f1b --microbatches 8 --depth 8 --batch-size 64".split()],
        bubble,
        formula_bubble,
        round(7 / 15, 4),
        "idle fraction",
        GPIPE,
    ),
    (
        "interleaved, p = 8, v = 2, m = 8",
        "pipeline_schedules.py",
        8,
        [*"--schedule interleaved --virtual-stages 2 --microbatches 8 --depth 16".split()]
        + ["--batch-size", "64"],
        bubble,
        formula_bubble,
        round(7 / 23, 4),  # an idle fraction f: f / (1 - f) = (p-1)/(v·m) = 7/16
        "idle fraction",
        INTERLEAVED,
    ),
    (
        "GPT-3 175B, t8 p16 d12",
        "hybrid_parallel.py",
        1536,
        GPT3_LAYOUT,
        billions_of_parameters,
        formula_billions_of_parameters,
        round(175 / (8 * 16), 3),
        "10^9 parameters a rank",
        GPT3,
    ),
    (
        "GPT-3 175B, ZeRO-1 over d",
        "hybrid_parallel.py",
        1536,
        GPT3_LAYOUT,
        data_parallel_traffic,
        formula_data_parallel_traffic,
        2,
        "dp bytes / parameter bytes",
        ZERO_DP,
    ),
]


@functools.cache  # two rows may read one run
def simulate(script, world, flags):
    """The RESULT of `python script --simulate world flags`."""
    command = [sys.executable, str(ROOT / script), "--simulate", str(world), *flags]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{out.stderr[-3000:]}")
    line = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="only the rows whose label matches a regex")
    args = parser.parse_args()
    rows = [row for row in ROWS if args.only is None or re.search(args.only, row[0])]
    print("| setting | measured | formula | paper | unit | paper's |")
    print("|---|---|---|---|---|---|")
    commands = []
    for label, script, world, flags, measured, formula, paper, unit, source in rows:
        fields = simulate(script, world, tuple(flags))
        print(
            f"| {label} | {measured(fields):.3g} | {formula(fields):.3g} | {paper} | {unit} "
            f"| {source} |",
            flush=True,
        )
        commands.append(f"python {script} --simulate {world} {' '.join(flags)}")
    print()
    for name, where in SOURCES.items():
        print(f"- {name}: {where}")
    print("\n```bash")
    for command in dict.fromkeys(commands):  # each once, in the rows' order
        print(wrapped(command))
    print("```")


def wrapped(command, width=96):
    """The command on lines of at most `width` characters, each flag with its value, continued
    by a backslash."""
    lines = [""]
    for flag in re.split(r" (?=--)", command):
        if lines[-1] and len(lines[-1]) + 1 + len(flag) > width:
            lines.append("   ")
        lines[-1] += (" " if lines[-1] else "") + flag
    return " \\\n".join(lines)


if __name__ == "__main__":
    main()
