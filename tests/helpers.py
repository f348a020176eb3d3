"""Launch the scripts as real processes and read what they report."""

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

# A small, fast configuration: synthetic digits, a 2-block ViT, a few steps.
SMALL = [
    "--data",
    "synthetic",
    "--limit",
    "512",
    "--batch-size",
    "32",
    "--dim",
    "32",
    "--depth",
    "2",
    "--heads",
    "4",
    "--epochs",
    "1",
    "--max-steps",
    "6",
    "--no-progress",
]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    @property
    def result(self):
        """The parsed `RESULT {json}` line (there must be exactly one)."""
        lines = [line for line in self.stdout.splitlines() if line.startswith("RESULT ")]
        assert len(lines) == 1, f"expected one RESULT line, got {len(lines)}\n{self.output}"
        return json.loads(lines[0][len("RESULT ") :])

    @property
    def output(self):
        return f"--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


def run(args, timeout=180, env=None, cwd=ROOT):
    """Run a command; a hang becomes a test failure after `timeout` seconds, not a stuck suite."""
    inherited = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    }
    # One thread a process, as torchrun gives its workers: launches share two cores, and a plain
    # `python X.py` reference then computes like the ranks it is compared with.
    full_env = {**inherited, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    p = subprocess.Popen(
        [str(a) for a in args],
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, so that a kill reaches torchrun's ranks
    )
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(p)
        stdout, stderr = p.communicate()
        raise subprocess.TimeoutExpired(p.args, timeout, stdout, stderr) from None
    kill_group(p)  # a rank that outlived its launcher would load the rest of the suite
    return Run(p.returncode, stdout, stderr)


def kill_group(p):
    """Kill the process group `p` leads (started with start_new_session=True)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)


def python(script, *args, **kw):
    return run([sys.executable, ROOT / script, *args], **kw)


def torchrun(script, nproc, *args, **kw):
    return run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            ROOT / script,
            *args,
        ],
        **kw,
    )


def launch_cases(world, argv, timeout=400, env=None):
    """Run [script, [flag, ...]] cases one after another in ONE torchrun launch of `world` ranks
    (tests/script_cases.py) and return each case's RESULT and its output before it: the launch's
    start-up (interpreters, torch) paid once, not once per case. `env`: for every case."""
    argv_json = json.dumps(argv, default=str)
    run = torchrun("tests/script_cases.py", world, argv_json, timeout=timeout, env=env)
    assert run.returncode == 0, run.output
    chunks = run.stdout.split("\nRESULT ")  # chunk i ends with case i's output, i+1 its RESULT
    assert len(chunks) == len(argv) + 1, run.output
    return [(json.loads(chunks[i + 1].splitlines()[0]), chunks[i]) for i in range(len(argv))]


def ok(r):
    """Assert a launch succeeded and return its RESULT."""
    assert r.returncode == 0, r.output
    return r.result


def ddp_references(tmp_path_factory, cfg, optims=("sgd", "adamw")):
    """ddp.py at W=1 on `cfg`, one run per optimizer in `optims`: the one-process runs every exact
    technique must reproduce, {optim: saved path}. Made once per pytest session and
    configuration (test files with the same cfg share them), the missing ones in ONE plain
    `python` process (tests/script_cases.py: a world of one, no torchrun agent, one start-up)."""
    key = hashlib.sha1(" ".join(map(str, cfg)).encode()).hexdigest()[:12]
    base = tmp_path_factory.getbasetemp()
    paths = {optim: base / f"reference-ddp-w1-{key}-{optim}.pt" for optim in optims}
    missing = [optim for optim, path in paths.items() if not path.exists()]
    if missing:
        argv = [["ddp", [*cfg, "--optim", optim, "--save", paths[optim]]] for optim in missing]
        run = python("tests/script_cases.py", json.dumps(argv, default=str), timeout=180)
        assert run.returncode == 0, run.output
        results = run.stdout.split("\nRESULT ")[1:]  # case i's RESULT line opens chunk i
        for optim, result in zip(missing, results, strict=True):
            paths[optim].with_suffix(".json").write_text(result.splitlines()[0])
    return paths


def reference_result(path):
    """The RESULT of the reference run that saved `path` (ddp_references)."""
    return json.loads(path.with_suffix(".json").read_text())


def ddp_reference(tmp_path_factory, cfg, optim):
    """ddp_references for one optimizer: its saved path."""
    return ddp_references(tmp_path_factory, cfg, (optim,))[optim]


def max_diff(path_a, path_b):
    """Largest absolute difference between two saved state_dicts (with the same keys)."""
    a = torch.load(path_a, weights_only=True)
    b = torch.load(path_b, weights_only=True)
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def tiered(cases, quick):
    """`cases` as pytest parameters: those in `quick` run in the quick suite, the others only in
    the full tier (`python -m pytest -m full`, run by CI). Pick `quick` so that it still covers
    every value of every dimension, and every pair of values of two dimensions where a pair can
    fail on its own: the full grid adds combinations, not properties."""
    missing = [case for case in quick if case not in cases]
    assert not missing, f"quick cases not in the grid: {missing}"
    return [
        case if case in quick else pytest.param(*case, marks=pytest.mark.full) for case in cases
    ]
