"""Every training script once on one CUDA GPU (W = 1, NCCL), on run_all.sh's setting: the scripts
that are exact in fp32 must end with ddp.py's parameters on the same GPU; the mixed-precision
ones (AMP fp16 and bf16, FSDP's MixedPrecisionPolicy) and asynchronous PipeDream show their loss,
accuracy and distance from ddp.py beside it; ZeRO's --mixed-precision must end with fsdp.py
--mixed-precision's parameters (the same math), and DeepSpeed's bf16 shows its distance from
them. Also ddp.py on the CPU (Gloo): how far the GPU's round-off alone moves the parameters. Then
benchmarks/bench_main_loop.py: ddp.py at its defaults as a share of a tight loop of its model on
the GPU. Not a test: CI has no GPU; the commands run on the CPU in tests/test_benchmarks.py.

    python benchmarks/check_cuda.py                        # MNIST in --data-dir, else synthetic
    python benchmarks/check_cuda.py --data-dir ../data --logs /tmp/check_cuda

Prints one markdown table, a row as each run ends, and exits 1 if a run failed, ran off the GPU,
an exact script ended more than TOLERANCE away from ddp.py, or the main loop's share is below
MAIN_LOOP_SHARE (not checked with --only). Every run sees only the first GPU.
W = 1 checks the CUDA paths (device placement, pinned copies, autocast, offload) and that the
NCCL process group starts, not NCCL's communication: at W = 1 no message crosses a link. The
split itself, and the order of messages under NCCL's rules, the tests prove on CPU at W > 1."""

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

# run_all.sh's QUICK setting: 48 steps of batch 128 on 4 tokens of 14x14 pixels; the final loss
# is the mean of the last 8 steps, as in its table. It keeps the default --shift 1 (run_all.sh
# turns it off): the augmentation is part of every real run's input pipeline, which the GPU's
# samples/s must include.
SETTING = [
    "--patch", "14", "--depth", "4", "--dim", "64", "--heads", "4", "--limit", "6144",
    "--epochs", "1", "--batch-size", "128", "--lr", "8e-3", "--log-every", "8",
]  # fmt: skip
# run_all.sh's clipping: every script clips the global gradient norm its technique's way (on the
# GPU, torch's clip_grad_norm_ or the section's own norm over its shards). PipeDream refuses it.
CLIP = ["--clip", "1.0"]
MOE = "--experts 4 --top-k 2"

# The tests' bound for AdamW against one process on the CPU. At W = 1 the exact scripts do the same
# math as ddp.py; what is left is round-off where a script sums in another order (its own
# attention, a split it still makes of one rank's work).
TOLERANCE = 5e-5

# the script and its flags (also the row's name) | its reference (a command above) | why its
# parameters may differ from the reference's by more than round-off (None: they must not)
BF16 = "bf16 matmuls"
CASES = [
    ("ddp.py", None, None),
    ("ddp.py --backend gloo", "ddp.py", "the CPU's kernels: round-off alone, over 48 steps"),
    ("dp.py", "ddp.py", None),
    ("ddp_torchrun.py", "ddp.py", None),
    ("amp_checkpoint.py --amp off --checkpoint", "ddp.py", None),
    ("amp_checkpoint.py --amp bf16 --checkpoint", "ddp.py", BF16),
    ("amp_checkpoint.py --amp fp16", "ddp.py", "fp16 matmuls, loss scaling"),
    ("amp_checkpoint.py --amp bf16 --grad-accum 2", "ddp.py", BF16),
    ("zero.py --stage 1", "ddp.py", None),
    ("zero.py --stage 2", "ddp.py", None),
    ("zero.py --stage 3", "ddp.py", None),
    ("zero_offload.py --stage 3 --offload cpu", "ddp.py", None),
    ("zero_offload.py --stage 3 --offload disk", "ddp.py", None),
    ("fsdp.py", "ddp.py", None),
    ("fsdp.py --mixed-precision", "ddp.py", "bf16 compute"),
    # the ZeRO paper's setting (issue 43): the same math as fsdp.py --mixed-precision (bf16 compute
    # from fp32 master shards, fp32 reduction, fp32 step), so they must end where it ends
    ("zero.py --stage 1 --mixed-precision", "fsdp.py --mixed-precision", None),
    ("zero.py --stage 2 --mixed-precision", "fsdp.py --mixed-precision", None),
    ("zero.py --stage 3 --mixed-precision", "fsdp.py --mixed-precision", None),
    (
        "zero_offload.py --stage 3 --offload cpu --mixed-precision",
        "fsdp.py --mixed-precision",
        None,
    ),
    (
        "zero_offload.py --stage 2 --offload disk --mixed-precision",
        "fsdp.py --mixed-precision",
        None,
    ),
    ("fsdp_resume.py", "ddp.py", None),
    ("tensor_parallel.py", "ddp.py", None),
    ("tensor_parallel.py --sequence-parallel", "ddp.py", None),
    ("tensor_parallel_zero_r.py --partition-activations", "ddp.py", None),
    ("context_parallel.py --method ring", "ddp.py", None),
    ("context_parallel.py --method ulysses", "ddp.py", None),
    (f"ddp.py {MOE}", None, None),
    (f"expert_parallel.py {MOE}", f"ddp.py {MOE}", None),
    ("pipeline.py --schedule 1f1b --microbatches 4", "ddp.py", None),
    ("pipeline_schedules.py --schedule zb-h1 --microbatches 4", "ddp.py", None),
    ("pipeline_pipedream.py --microbatches 4", "ddp.py", "asynchronous: a step per micro-batch"),
    ("nd_parallel.py --dp-shard 1", "ddp.py", None),
    ("hybrid_parallel.py --zero-stage 1", "ddp.py", None),
    ("hybrid_parallel.py --zero-stage 3", "ddp.py", None),
    ("deepspeed_zero.py --stage 1", "ddp.py", None),
    ("deepspeed_zero.py --stage 2", "ddp.py", None),
    ("deepspeed_zero.py --stage 3", "ddp.py", None),
    (
        "deepspeed_zero.py --stage 3 --mixed-precision",
        "fsdp.py --mixed-precision",
        "DeepSpeed's fp32 master starts from the bf16 weights",
    ),
]
REFERENCES = {reference for _, reference, _ in CASES if reference}
# DeepSpeed is optional (requirements-deepspeed.txt): without it its rows say so and are not run.
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
# benchmarks/bench_main_loop.py's target: ddp.py at its defaults at least this share of a tight
# loop of the same model, batch and optimizer with the data already on the GPU
MAIN_LOOP_SHARE = 0.9


def slug_of(name):
    return re.sub(r"[^A-Za-z0-9=]+", "_", name).strip("_")


def case_command(name, out_dir, data_dir):
    """The script and its flags for the case `name`: with run_all.sh's setting, --clip (PipeDream
    refuses it), the folders a script writes to, and --save to out_dir/<slug>.pt."""
    cmd = name.split()
    slug = slug_of(name)
    extra = []
    if cmd[0] == "zero_offload.py" and "disk" in cmd:
        extra = ["--offload-dir", os.path.join(out_dir, slug + "_offload")]
        os.makedirs(extra[1], exist_ok=True)
    if cmd[0] == "fsdp_resume.py":
        extra = ["--dcp", os.path.join(out_dir, slug + "_dcp")]
    if cmd[0] == "ddp_torchrun.py":
        extra = ["--snapshot", os.path.join(out_dir, slug + "_snapshot.pt")]
    command = [*cmd, *extra, "--no-progress", "--data-dir", data_dir, *SETTING]
    command += ["--save", os.path.join(out_dir, slug + ".pt")]
    if cmd[0] != "pipeline_pipedream.py":
        command += CLIP
    return command


def run_case(name, out_dir, args):
    """One script at W = 1 with --save; its RESULT, its CUDA peak in training, wall seconds."""
    slug = slug_of(name)
    saved = os.path.join(out_dir, slug + ".pt")
    # no --nproc: one process, this one
    argv = [sys.executable, *case_command(name, out_dir, args.data_dir)]
    start = time.perf_counter()
    first_gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": first_gpu}  # one GPU: dp.py would take them all
    try:
        p = subprocess.run(
            argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired as e:  # keep what it printed: where it stopped
        with open(os.path.join(out_dir, slug + ".log"), "w") as f:
            f.write(" ".join(argv) + "\n" + (e.stdout or b"").decode() + (e.stderr or b"").decode())
        return None, None, args.timeout, f"timed out after {args.timeout:.0f} s"
    seconds = time.perf_counter() - start
    with open(os.path.join(out_dir, slug + ".log"), "w") as f:
        f.write(" ".join(argv) + "\n" + p.stdout + p.stderr)
    results = [line[7:] for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if p.returncode != 0 or not results:
        tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
        return None, None, seconds, f"exit {p.returncode}: " + " | ".join(tail)
    result = json.loads(results[-1])
    # max_memory_allocated from the start of training to its end (reset as training begins), the
    # largest over the ranks: evaluation at its larger batch and the final gathers are left out
    peak = result.get("cuda_peak_bytes")
    if peak is not None:
        peak = f"{peak / 2**20:.1f} MiB"
    return result, peak, seconds, saved


def max_diff(path_a, path_b):
    """Largest absolute difference between two saved state_dicts (with the same keys)."""
    a = torch.load(path_a, weights_only=True, map_location="cpu")
    b = torch.load(path_b, weights_only=True, map_location="cpu")
    if a.keys() != b.keys():
        return float("inf")
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default="data")
    p.add_argument("--logs", default=None, help="keep each run's log and state_dict here")
    p.add_argument("--timeout", type=float, default=180, help="seconds one run may take")
    p.add_argument("--only", default=None, help="only the cases whose name matches this regex")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(
            "check_cuda.py: no CUDA GPU visible; this checks the scripts' GPU paths",
            file=sys.stderr,
        )
        sys.exit(2)
    out_dir = args.logs or tempfile.mkdtemp(prefix="check_cuda.")
    os.makedirs(out_dir, exist_ok=True)
    print(
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}; logs in {out_dir}",
        flush=True,
    )

    # each row printed as soon as its run ends, so that a run cut short still leaves its rows
    print(
        "\n| command (W = 1) | device | backend | final loss | test acc | training CUDA peak "
        "| s | max \\|Δparameter\\| from its reference |"
    )
    print("|---|---|---|---|---|---|---|---|", flush=True)
    saved, failed = {}, []
    for name, reference, why in CASES:
        if args.only and not re.search(args.only, name) and name not in REFERENCES:
            continue
        if name.startswith("deepspeed_zero.py") and not HAVE_DEEPSPEED:
            print(f"| `{name}` | not run: DeepSpeed is not installed | | | | | | |", flush=True)
            continue
        result, peak, seconds, detail = run_case(name, out_dir, args)
        if result is None:
            failed.append(f"{name}: {detail}")
            print(f"| `{name}` | failed | | | | | {seconds:.1f} | |", flush=True)
            continue
        saved[name] = detail
        diff = None
        if reference in saved:
            diff = max_diff(detail, saved[reference])
        expected = ("cuda", "nccl")
        if "--backend gloo" in name:
            expected = ("cpu", "gloo")
        if name.startswith("dp.py"):
            expected = ("cuda", "none")  # one process driving the GPUs: no process group
        if (result["device"], result["backend"]) != expected:
            failed.append(f"{name}: ran on {result['device']} with {result['backend']}")
        if reference is not None and diff is None:
            failed.append(f"{name}: no parameters from {reference} to compare with")
        if why is None and diff is not None and diff > TOLERANCE:
            failed.append(f"{name}: max |Δparameter| {diff:.1e} from {reference} > {TOLERANCE}")
        if reference is None:
            cell = "(the reference)"
        elif diff is None:
            cell = "-"
        else:
            cell = f"{diff:.1e}" + (f" ({why})" if why else "") + f", from `{reference}`"
        print(
            f"| `{name}` | {result['device']} | {result['backend']} | {result['loss']:.4f} "
            f"| {result['test_acc']:.4f} | {peak or '-'} | {seconds:.1f} | {cell} |",
            flush=True,
        )
    if not args.only:
        failed += main_loop_share(args)
    for line in failed:
        print("failed: " + line)
    sys.exit(1 if failed else 0)


def main_loop_share(args):
    """benchmarks/bench_main_loop.py at its defaults on the first GPU: ddp.py's samples/s as a
    share of a tight loop of its model. Prints its line; returns what failed."""
    first_gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": first_gpu}
    argv = [sys.executable, os.path.join("benchmarks", "bench_main_loop.py")]
    try:
        p = subprocess.run(
            argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=4 * args.timeout
        )
    except subprocess.TimeoutExpired:
        return [f"bench_main_loop.py: timed out after {4 * args.timeout:.0f} s"]
    results = [line[7:] for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if p.returncode != 0 or not results:
        tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
        return [f"bench_main_loop.py: exit {p.returncode}: " + " | ".join(tail)]
    result = json.loads(results[-1])
    print(
        f"\nddp.py at its defaults (--workers {result['workers']}): "
        f"{result['ddp_samples_per_s']:.0f} samples/s, a tight loop of its model "
        f"{result['tight_samples_per_s']:.0f}: {result['share']:.3f}x "
        f"(target >= {MAIN_LOOP_SHARE}; benchmarks/bench_main_loop.py)",
        flush=True,
    )
    if result["device"] != "cuda":
        return [f"bench_main_loop.py ran on {result['device']}"]
    if result["share"] < MAIN_LOOP_SHARE:
        return [f"ddp.py at {result['share']:.3f}x its model's speed < {MAIN_LOOP_SHARE}"]
    return []


if __name__ == "__main__":
    main()
