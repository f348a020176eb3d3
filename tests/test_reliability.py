"""Reliability: crashed and hung workers, interrupted saves, torchrun restarts, two 'nodes'.

Faults are injected from outside the scripts: tests/faults/sitecustomize.py is put on the
workers' PYTHONPATH and raises / hangs / exits inside the k-th optimizer step of one rank.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import common
from helpers import ROOT, SMALL, fork_launch, max_diff, ok, python, run, torchrun

FAULTS = str(ROOT / "tests" / "faults")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def faulty(kind, rank=1, step=3):
    return {"PYTHONPATH": FAULTS, "FAULT": kind, "FAULT_RANK": str(rank), "FAULT_STEP": str(step)}


# spawn (9 s) in the full tier: the quick suite keeps torchrun's
@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("spawn", marks=pytest.mark.full)])
def test_a_rank_that_raises_ends_the_run_at_once_with_its_message_once(launcher):
    """The launcher takes the other rank down as soon as one dies: the run ends in the time a clean
    run takes, far inside --timeout 300 (which the survivor would otherwise sit out in its
    all-reduce)."""
    args = [*SMALL, "--max-steps", "0", "--epochs", "2", "--timeout", "300"]
    t0 = time.time()
    r = (
        torchrun("ddp.py", 2, *args, env=faulty("raise"), timeout=150)
        if launcher == "torchrun"
        else python("ddp.py", "--nproc", "2", *args, env=faulty("raise"), timeout=150)
    )
    elapsed = time.time() - t0
    assert r.returncode != 0 and "RESULT" not in r.stdout
    assert r.stderr.count("RuntimeError: injected fault on rank 1 at step 3") == 1, r.output
    assert "Timed out" not in r.output and "timed out" not in r.output, r.output
    assert elapsed < 60, f"took {elapsed:.0f}s to notice a dead rank (--timeout 300)"


@pytest.mark.full  # sits out its --timeout 8 and the teardown: 15 s
def test_a_hung_rank_fails_the_run_by_the_timeout():
    """Rank 1 sleeps forever inside step 3; rank 0 waits in the all-reduce until --timeout 8 and
    fails with the timeout, not earlier and not of something else."""
    t0 = time.time()
    r = torchrun("ddp.py", 2, *SMALL, "--timeout", "8", env=faulty("hang"), timeout=120)
    elapsed = time.time() - t0
    assert r.returncode != 0 and "RESULT" not in r.stdout, r.output
    assert "Timed out" in r.output or "timed out" in r.output, (
        r.output
    )  # Gloo's / NCCL's timeout error
    assert "injected fault" not in r.output, r.output
    assert 8 <= elapsed < 8 + 45, f"a hang took {elapsed:.0f}s to fail with --timeout 8"


def worker_pids(parent, script):
    """Pids of the processes `parent` started that run `script` (torchrun's workers). -ww: ps cuts
    the command line at 80 columns when its output is not a terminal."""
    out = subprocess.run(
        ["ps", "-ww", "-o", "pid=,args=", "--ppid", str(parent)], capture_output=True, text=True
    ).stdout
    return [int(line.split()[0]) for line in out.splitlines() if script in line]


@pytest.mark.full  # a restart and two uninterrupted runs to compare: 20 s
def test_sigkilled_worker_is_restarted_and_resumes_from_the_snapshot(tmp_path):
    """torchrun --max-restarts: SIGKILL one worker mid-epoch; the restarted group resumes from
    the last snapshot and ends with the parameters of an uninterrupted run."""
    # Killed right after the epoch-0 snapshot, so the restart resumes from it. (Before
    # ddp_torchrun.py prefixed its store per attempt, ~1 restart in 4 hung here: a new rank dialled
    # the dead one.)
    cfg = [
        "--data",
        "synthetic",
        "--limit",
        "2048",
        "--batch-size",
        "32",
        "--dim",
        "32",
        "--depth",
        "2",
        "--heads",
        "4",
        "--epochs",
        "3",
        "--optim",
        "adamw",
        "--no-progress",
        "--timeout",
        "20",
    ]
    cmd = [
        *TORCHRUN,
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=3",
        ROOT / "ddp_torchrun.py",
        *cfg,
        "--snapshot",
        tmp_path / "snap.pt",
        "--save",
        tmp_path / "killed.pt",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines, killed, deadline = [], None, time.time() + 300
    reader = threading.Thread(
        target=lambda: lines.extend(p.stdout), daemon=True
    )  # never block on a pipe
    reader.start()
    try:
        while p.poll() is None and time.time() < deadline:
            if killed is None and any(
                line.startswith("snapshot: step 64 saved") for line in list(lines)
            ):
                os.kill(worker_pids(p.pid, "ddp_torchrun.py")[-1], signal.SIGKILL)
                killed = len(lines)
            time.sleep(0.05)
    finally:
        if p.poll() is None:  # timed out: take torchrun's workers down with it
            for pid in worker_pids(p.pid, "ddp_torchrun.py"):
                os.kill(pid, signal.SIGKILL)
            p.kill()
        p.wait()
        reader.join(10)
    out = "".join(lines)
    assert killed is not None and p.returncode == 0, out
    after = "".join(lines[killed:])
    assert "snapshot: resuming at step 64" in after, out  # killed in epoch 1, restarted
    straight = ok(
        fork_launch("ddp_torchrun.py", 2, *cfg, "--save", tmp_path / "straight.pt", timeout=240)
    )
    assert straight["steps"] == 3 * 2048 // 32
    assert max_diff(tmp_path / "killed.pt", tmp_path / "straight.pt") == 0


def test_a_save_killed_part_way_leaves_the_previous_file_intact(tmp_path):
    """save_checkpoint writes a temp file and renames it; kill the process while it writes."""
    path = tmp_path / "ckpt.pt"
    old = {"w": torch.arange(10.0)}
    common.save_checkpoint(old, path)
    killer = f"""
import os, signal, sys, torch
sys.path.insert(0, {str(ROOT)!r})
import common
class Boom:                 # pickled after the big tensor's record is opened: dies mid-write
    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)
common.save_checkpoint({{"w": torch.randn(4_000_000), "boom": Boom()}}, {str(path)!r})
"""
    r = run([sys.executable, "-c", killer], timeout=60)
    assert r.returncode == -signal.SIGKILL
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "ckpt.pt"]
    assert leftovers and all(".tmp." in n for n in leftovers)  # the half-written temp file
    assert torch.equal(torch.load(path, weights_only=True)["w"], old["w"])  # the old file, whole


@pytest.mark.full  # two nodes' torchrun agents: 16 s (tests/test_common.py keeps a two-node test)
def test_two_nodes_on_one_machine_equal_one_node(tmp_path):
    """Two torchrun agents as two 'nodes' (2 processes each, c10d rendezvous) = 4 processes on
    one."""
    port = common.free_port()
    args = [*SMALL, "--optim", "sgd"]
    nodes = []
    for node in (0, 1):
        cmd = [
            *TORCHRUN,
            "--nnodes=2",
            "--nproc_per_node=2",
            f"--node-rank={node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=two-nodes",
            f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}",
            ROOT / "ddp.py",
            *args,
            "--save",
            tmp_path / "two_nodes.pt",
        ]
        nodes.append(
            subprocess.Popen(
                [str(c) for c in cmd],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        )
    outs = []
    try:
        for p in nodes:
            outs.append(p.communicate(timeout=180))
    finally:
        for p in nodes:
            p.kill()
    assert all(p.returncode == 0 for p in nodes), outs
    results = [line for out, _ in outs for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 1 and '"world_size": 4' in results[0]  # one rank 0 across both nodes
    ok(fork_launch("ddp.py", 4, *args, "--save", tmp_path / "one_node.pt"))
    assert max_diff(tmp_path / "two_nodes.pt", tmp_path / "one_node.pt") < 1e-6
