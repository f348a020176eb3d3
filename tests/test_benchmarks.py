"""Every benchmark in benchmarks/ runs, at a tiny size: a benchmark nobody runs breaks unseen (the
pipelining rows of bench_model_parallel.py failed once the pipeline took a group). Each asserts
what its benchmark reports: its rows all ran, and where it compares two implementations of the
same steps, that their parameters agree. Nothing here is timed: the numbers are only read. The
slowest (bench_memory, bench_main_loop, bench_ddp_overhead: a launch per row) are in the full
tier, which CI runs too. bench_papers_scale.py's rows are tests/test_papers_scale.py's."""

import importlib.util
import json
import os
import re
import runpy
import sys

import pytest

from helpers import ROOT, fork_launch, launch_cases, max_diff, ok, python, run

sys.path.insert(0, str(ROOT / "benchmarks"))
import check_cuda  # noqa: E402

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(
    not HAVE_DEEPSPEED and not os.environ.get("REQUIRE_DEEPSPEED"),
    reason="DeepSpeed is not installed: pip install -r requirements-deepspeed.txt",
)
TINY = [*("--data synthetic --limit 256 --batch-size 16 --dim 16 --depth 2 --heads 2").split()]
TINY += ["--no-progress"]
# AdamW's bound for two implementations of the same steps (the tests' tolerance).
TOL = 5e-5
# check_cuda.py's cases that need CUDA: the script refuses them on the CPU, saying so
GPU_ONLY = {"amp_checkpoint.py --amp fp16"}
# check_cuda.py's setting made tiny (a later flag wins): two steps of 16 samples, a narrow model
TINY_SETTING = [*("--limit 32 --batch-size 16 --dim 16 --heads 2").split()]


def result_line(output):
    """The one RESULT line's fields."""
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, output
    return json.loads(lines[0][len("RESULT ") :])


def check_cuda_cases(scripts):
    """check_cuda.py's cases of `scripts` that a CPU runs, after the references they need."""
    cases = [
        case
        for case in check_cuda.CASES
        if case[0].split()[0] in scripts and case[0] not in GPU_ONLY
    ]
    needed = {reference for _, reference, _ in cases if reference}
    references = [case for case in check_cuda.CASES if case[0] in needed]
    return [*[case for case in references if case not in cases], *cases]


def run_check_cuda_commands(scripts, out_dir):
    """check_cuda.py's commands, each as check_cuda.py builds it, on the CPU for two steps of a
    tiny model, in one launch of a world of one; the exact ones (no reason given) must end within
    its TOLERANCE of their reference, as on the GPU."""
    cases = check_cuda_cases(scripts)
    argv = []
    for name, _, _ in cases:
        script, *flags = check_cuda.case_command(name, out_dir, str(out_dir / "data"))
        argv.append([script.removesuffix(".py"), [*flags, *TINY_SETTING]])
    if scripts == {"deepspeed_zero.py"}:
        # one launch each: DeepSpeed keeps the first process group it sees in globals of its own
        results = [launch_cases(1, [case], timeout=300)[0] for case in argv]
    else:
        results = launch_cases(1, argv, timeout=300)
    for (name, reference, why), (result, output) in zip(cases, results, strict=True):
        assert result["steps"] == 2, output
        if reference is not None and why is None:
            saved = out_dir / f"{check_cuda.slug_of(name)}.pt"
            referenced = out_dir / f"{check_cuda.slug_of(reference)}.pt"
            assert max_diff(saved, referenced) <= check_cuda.TOLERANCE, name


def test_check_cuda_hybrid_parallel_commands_run_on_the_cpu(tmp_path):
    """The rows added last (issue 41); the full tier runs them all."""
    run_check_cuda_commands({"hybrid_parallel.py"}, tmp_path)


@pytest.mark.full
@needs_deepspeed
def test_check_cuda_deepspeed_commands_run_on_the_cpu(tmp_path):
    """A launch each, for DeepSpeed's globals; tests/test_deepspeed_zero.py proves the stages."""
    run_check_cuda_commands({"deepspeed_zero.py"}, tmp_path)


@pytest.mark.full
def test_check_cuda_commands_run_on_the_cpu(tmp_path):
    scripts = {name.split()[0] for name, _, _ in check_cuda.CASES} - {"deepspeed_zero.py"}
    run_check_cuda_commands(scripts, tmp_path)


@pytest.mark.full  # a benchmark's smoke test: 10-14 s, the quick suite's budget
def test_bench_main_loop():
    r = python("benchmarks/bench_main_loop.py", *TINY, "--steps", "6", "--repeats", "1")
    assert r.returncode == 0, r.output
    result = result_line(r.stdout)
    assert result["device"] == "cpu" and result["workers"] == 0, result
    assert result["share"] == result["ddp_samples_per_s"] / result["tight_samples_per_s"], result
    assert result["share"] > 0, result


def in_this_process(script, *argv):
    """Run a benchmark that starts no process group here, as `python script argv` would."""
    path = str(ROOT / "benchmarks" / script)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [path, *argv])
        runpy.run_path(path, run_name="__main__")


def test_bench_main_loop_refuses_too_few_steps(capsys):
    with pytest.raises(SystemExit) as exit:
        in_this_process("bench_main_loop.py", *TINY, "--steps", "4")
    assert exit.value.code == 2
    assert "--steps must be more than the 4 untimed ones, got 4" in capsys.readouterr().err


@pytest.mark.full  # a benchmark's smoke test: 10-14 s, the quick suite's budget
def test_bench_ddp_overhead():
    r = python("benchmarks/bench_ddp_overhead.py", *TINY, "--steps", "6", "--repeats", "1")
    assert r.returncode == 0, r.output
    assert re.search(r"^ddp\.py / plain = \d+\.\d{3}", r.stdout, re.M), r.output


def test_bench_loader(capsys):
    in_this_process("bench_loader.py", "--limit", "256", "--repeats", "1")
    output = capsys.readouterr().out
    assert re.search(r"^ratio: \d+\.\dx$", output, re.M), output


def test_bench_accuracy():
    result = ok(fork_launch("benchmarks/bench_accuracy.py", 2, *TINY, "--epochs", "2"))
    assert [row["epoch"] for row in result["epochs"]] == [0, 1], result
    assert result["world_size"] == 2, result


@pytest.mark.full  # a benchmark's smoke test: 10-14 s, the quick suite's budget
def test_bench_memory():
    flags = ["--worlds", "2", "--dim", "16", "--depth", "1", "--only", "zero.py --stage 3"]
    r = run([sys.executable, ROOT / "benchmarks" / "bench_memory.py", *flags], timeout=300)
    assert r.returncode == 0, r.output
    rows = [line for line in r.stdout.splitlines() if line.startswith("| 2 |")]
    assert [row.split(" | ")[1] for row in rows] == ["zero.py --stage 3"], r.output


def test_bench_model_parallel():
    flags = [*TINY, "--microbatches", "2", "--rounds", "1", "--steps", "1"]
    result = ok(fork_launch("benchmarks/bench_model_parallel.py", 2, *flags))
    assert result["failed"] == {}, result["failed"]
    assert result["max_param_diff"] and max(result["max_param_diff"].values()) <= TOL, result


def test_bench_pipeline_schedules():
    flags = [*TINY, "--depth", "4", "--microbatches", "4", "--rounds", "1", "--steps", "1"]
    result = ok(fork_launch("benchmarks/bench_pipeline_schedules.py", 2, *flags))
    assert set(result["ms_per_step"]) == {"1f1b", "interleaved V=2", "zb-h1"}, result


def test_bench_zero():
    flags = [*TINY, "--rounds", "1", "--steps", "1", "--warmup", "1"]
    result = ok(fork_launch("benchmarks/bench_zero.py", 2, *flags))
    assert result["max_param_diff"] and max(result["max_param_diff"].values()) <= TOL, result
