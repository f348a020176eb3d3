"""A stand-in for torchrun that starts Python and torch once: the launches of the test suite (and
run_all.sh's rows, without GPUs) fork their ranks from this server instead of starting W fresh
interpreters each.

Most of a small test launch is start-up, not training: on 2 CPU cores a torchrun of ddp.py at W=2
spends ~17 s of CPU importing torch in the agent and in each rank (DDP's constructor also imports
torch._dynamo, ~3.5 s a rank) and well under one second training. This server imports all of it
once, and forks only while it is one thread with no process group and no CUDA (a fork copies the
calling thread alone). For each launch it forks a leader, which, as torchrun's agent, serves the
launch's store (`TORCHELASTIC_USE_AGENT_STORE`: it outlives every rank and every case of
tests/script_cases.py) and forks the W ranks with a torchrun worker's variables: RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT 0.
Each rank runs the script as `__main__` (runpy) with its own argv and sys.path and exits through
the interpreter's own shutdown. A failed rank fails the launch, and its peers are killed at once
(torchrun sends SIGTERM first; the scripts handle neither). The launch's `returncode` is the first
non-zero status reaped (negative: killed by that signal), where torchrun exits 1.

What a fork cannot copy: torchrun's ranks each draw their own string-hash seed, forked ranks
share the server's, so a script that ordered its collectives by iterating a set of strings would
agree with itself here and deadlock under torchrun. The tests that are about launching (torchrun's
restarts, `--nproc`, several nodes, a killed or hanging rank, faults read with the rank at
start-up) still start real torchrun processes (helpers.torchrun).

    python tests/fork_server.py SOCKET     # serves until its parent (pytest, run_all.sh) exits

Protocol, one launch per connection on the Unix socket SOCKET: the client sends one JSON line
{"script", "args", "world", "cwd", "stdout", "stderr"}, the last two the paths of files the client
made, which every rank appends its output to (as torchrun's workers share its stdout); the server
answers one line with the launch's process group (kill it to stop the launch), then, when every
rank has ended, one line {"returncode": ...}.
"""

import contextlib
import gc
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
STARTUP_PATH = sys.path[1:]  # what `python script.py` puts after the script's own folder
sys.path[:0] = [str(ROOT), str(TESTS)]  # the scripts, common/, the tests' modules

import common  # noqa: E402 (found through the line above)

# What every launch would import: torch, DDP's torch._dynamo, the distributed packages the scripts
# use, the shared helpers, and the scripts too, as modules (tests/script_cases.py and copy_cases.py
# call their main()). tests/faults/sitecustomize.py patches a module as it is imported (MUTANT), so
# each patch is made here once and every rank inherits it.
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining",
    "torch.nn.parallel",
    "torch.utils.checkpoint",
    "common",
    "causal_lm",
]
# deepspeed_zero.py imports DeepSpeed, an optional dependency that does things as it loads (picks
# an accelerator, sets up its logging): only deepspeed_zero.py's own ranks import it.
SCRIPTS = sorted(path.stem for path in ROOT.glob("*.py") if path.stem != "deepspeed_zero")


def preload():
    for name in [*PRELOAD, *SCRIPTS]:
        __import__(name)
    # A fork copies only the calling thread: any other would be missing from every rank, with any
    # lock it held still locked. threading sees Python's threads only; /proc sees every thread.
    threads = os.listdir("/proc/self/task")
    assert len(threads) == 1, f"{len(threads)} threads after the imports: {threading.enumerate()}"
    assert not torch.cuda.is_initialized(), "a forked child cannot use CUDA its parent initialised"
    # What the imports made stays out of every rank's garbage collections: a collection writes each
    # object's header, so the kernel would copy every page a rank shares with the server (and the
    # walk itself costs ~0.3 s a call).
    gc.freeze()


def run_rank(request, rank, port):
    """In the forked rank: torchrun's environment, the output files, then the script as __main__.
    Returns the exit code."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        WORLD_SIZE=str(request["world"]),
        LOCAL_WORLD_SIZE=str(request["world"]),
        ROLE_WORLD_SIZE=str(request["world"]),
        GROUP_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # the leader serves the store, as torchrun's agent
        TORCHELASTIC_RUN_ID="fork_server",
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
    )
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        # O_APPEND: every rank and the leader write to these; no O_CREAT: the client made them
        out = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(out, fd)
        os.close(out)
    os.chdir(request["cwd"])
    script = str(Path(request["cwd"], request["script"]).resolve())
    sys.argv = [script, *request["args"]]
    sys.path[:] = [str(Path(script).parent), *STARTUP_PATH]  # as `python script.py` starts
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def launch(connection):
    """In a child of the server, leading a process group of its own: one launch, its W ranks."""
    os.setsid()
    # The server left SIGCHLD ignored, so that the kernel reaps its launches; under SIG_IGN,
    # os.wait() fails. Restored for this leader and its ranks (their subprocesses, DataLoaders).
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    request = json.loads(connection.makefile().readline())
    connection.sendall(f"{os.getpgid(0)}\n".encode())
    port = common.free_port()  # picked now, bound below: the same small race as --standalone's
    ranks = {}
    for rank in range(request["world"]):
        pid = os.fork()
        if pid == 0:
            connection.close()
            code = run_rank(request, rank, port)
            sys.stdout.flush()
            sys.stderr.flush()
            # SystemExit unwinds through launch() and serve(), which catch nothing, into the
            # interpreter's own shutdown (atexit, finalizers), as a torchrun worker ends: a hang
            # at exit still fails the test.
            sys.exit(code)
        ranks[pid] = rank
    # As torchrun's agent, this process serves the launch's store, so it outlives every rank and
    # every case. Started after the forks: its server thread must not be copied into the ranks,
    # whose clients retry until it listens.
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    returncode = 0
    while ranks:
        pid, status = os.wait()
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and returncode == 0:
            returncode = code
            with open(request["stderr"], "a") as err:
                print(f"fork_server: rank {rank} exited with code {code}", file=err)
            for other in ranks:  # a failed rank ends the launch, as under torchrun
                os.kill(other, signal.SIGKILL)
    del store
    with contextlib.suppress(BrokenPipeError):  # the client gave up (a timeout, Ctrl-C)
        connection.sendall((json.dumps({"returncode": returncode}) + "\n").encode())


def serve(path):
    parent = os.getppid()
    preload()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps each launch's leader
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # nobody reads the pipe after "ready": nothing may fill it
    os.close(devnull)
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ)
    while os.getppid() == parent:  # the suite has gone: so do we
        if not selector.select(timeout=1.0):
            continue
        connection, _ = server.accept()
        pid = os.fork()
        if pid == 0:
            server.close()
            launch(connection)  # a rank never returns here: it leaves by SystemExit
            os._exit(0)  # the leader: nothing of the server's to shut down
        connection.close()


if __name__ == "__main__":
    serve(sys.argv[1])
