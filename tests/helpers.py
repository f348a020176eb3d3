"""Launch the scripts as real processes and read what they report."""

import atexit
import contextlib
import hashlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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


def launch_env():
    """The environment of every launch: this one's, without a rank's variables."""
    inherited = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    }
    # One thread a process, as torchrun gives its workers: launches share two cores, and a plain
    # `python X.py` reference then computes like the ranks it is compared with.
    return {**inherited, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def run(args, timeout=180, env=None, cwd=ROOT):
    """Run a command; a hang becomes a test failure after `timeout` seconds, not a stuck suite."""
    p = subprocess.Popen(
        [str(a) for a in args],
        cwd=cwd,
        env={**launch_env(), **(env or {})},
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


class ForkServer:
    """The client of tests/fork_server.py: started on first use, stopped when the session ends.
    Its launches get launch_env() as it is when the server starts (read once), plus `env`."""

    def __init__(self, env=None):
        self.env = env or {}
        self.process = None
        self.folder = None
        self.socket = None
        self.start_lock = threading.Lock()  # tests launch from thread pools too

    def start(self):
        self.folder = Path(tempfile.mkdtemp(prefix="fork-server-"))
        self.socket = str(self.folder / "socket")
        process = subprocess.Popen(
            [sys.executable, ROOT / "tests" / "fork_server.py", self.socket],
            cwd=ROOT,
            env={**launch_env(), **self.env},
            stdout=subprocess.PIPE,
            text=True,
        )
        said, _, _ = select.select([process.stdout], [], [], 300)  # torch's imports, 2 busy cores
        line = process.stdout.readline() if said else ""
        if line != "ready\n":
            process.kill()
            shutil.rmtree(self.folder, ignore_errors=True)
            raise RuntimeError(f"the fork server did not start (exit {process.wait()}: {line!r})")
        self.process = process
        atexit.register(self.stop)

    def stop(self):
        if self.process is None:
            return
        self.process.kill()
        self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    def launch(self, script, nproc, args, timeout):
        with self.start_lock:
            if self.process is None:
                self.start()
        if self.process.poll() is not None:
            raise RuntimeError(f"the fork server exited ({self.process.returncode})")
        # The ranks are not our children: their output comes through files, not pipes, made here
        # so that they can be read even if no rank ever ran.
        outputs = Path(tempfile.mkdtemp(dir=self.folder))
        stdout = outputs / "stdout"
        stderr = outputs / "stderr"
        stdout.touch()
        stderr.touch()
        request = dict(
            script=str(script),
            args=[str(a) for a in args],
            world=nproc,
            cwd=str(ROOT),
            stdout=str(stdout),
            stderr=str(stderr),
        )
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(timeout)  # one bound on the whole exchange
            connection.connect(self.socket)
            connection.sendall((json.dumps(request) + "\n").encode())
            replies = connection.makefile()
            group = int(replies.readline())  # the leader's process group: it and every rank
            try:
                answer = replies.readline()
            except TimeoutError:
                answer = None
            finally:
                # as run(): nothing of this launch may outlive it and load the rest of the suite
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, signal.SIGKILL)
        output = (stdout.read_text(), stderr.read_text())
        shutil.rmtree(outputs)
        if answer is None:
            raise subprocess.TimeoutExpired(["fork_server", script, *args], timeout, *output)
        if not answer:
            raise RuntimeError(f"the launch's leader died without an answer\n{output}")
        return Run(json.loads(answer)["returncode"], *output)


FORK_SERVER = ForkServer()


def fork_launch(script, nproc, *args, timeout=180, env=None):
    """`torchrun --standalone --nproc_per_node=nproc script args` as its ranks see it, each rank
    forked from tests/fork_server.py, which has imported torch and the scripts once: ddp.py at W=2
    for 6 steps takes 1.4 s instead of 7.9 s. For the tests that are not about the launcher (those
    use torchrun). `env`: some variables are read only as an interpreter starts (tests/faults:
    PROBE, FAULT), and a forked rank starts none, so a launch with `env` gets a server of its own,
    started with it (a few seconds of imports) and stopped after."""
    if env is None:
        return FORK_SERVER.launch(script, nproc, args, timeout)
    # tests/faults compares these with RANK as an interpreter starts, and a server starts with no
    # rank: only torchrun can give them to one rank
    assert "HIDE" not in env and env.get("FAULT") != "exit-in-save", "use torchrun for this env"
    server = ForkServer(env)
    try:
        return server.launch(script, nproc, args, timeout)
    finally:
        server.stop()


def launch_cases(world, argv, timeout=400, env=None):
    """Run [script, [flag, ...]] cases one after another in ONE launch of `world` ranks
    (tests/script_cases.py) and return each case's RESULT and its output before it. The ranks are
    forked from the fork server (`fork_launch`); `env`: for every case."""
    argv_json = json.dumps(argv, default=str)
    run = fork_launch("tests/script_cases.py", world, argv_json, timeout=timeout, env=env)
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
    configuration (test files with the same cfg share them), the missing ones as the cases of ONE
    launch of a world of one (launch_cases)."""
    key = hashlib.sha1(" ".join(map(str, cfg)).encode()).hexdigest()[:12]
    base = tmp_path_factory.getbasetemp()
    paths = {optim: base / f"reference-ddp-w1-{key}-{optim}.pt" for optim in optims}
    missing = [optim for optim, path in paths.items() if not path.exists()]
    if missing:
        argv = [["ddp", [*cfg, "--optim", optim, "--save", paths[optim]]] for optim in missing]
        results = launch_cases(1, argv, timeout=180)
        for optim, (result, _) in zip(missing, results, strict=True):
            paths[optim].with_suffix(".json").write_text(json.dumps(result))
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
