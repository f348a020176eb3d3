"""A stand-in for torchrun that starts Python and torch once: the launches of the test suite fork
their ranks from this server instead of starting W fresh interpreters each.

Most of a small test launch is start-up, not training: on 2 CPU cores a torchrun of ddp.py at W=2
spends ~17 s of CPU importing torch in the agent and in each rank (DDP's constructor also imports
torch._dynamo, ~3.5 s a rank) and well under one second training. This server imports all of it
once, before any thread, process group or tensor computation exists, and then for each launch
forks W ranks that see what a torchrun worker sees: RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (rank 0 hosts the store, `env://`), and
TORCHELASTIC_RESTART_COUNT 0. Each rank runs the script as `__main__` (runpy) with its own argv
and exits through the interpreter's normal shutdown. As under torchrun, a failed rank fails the
launch and the other ranks are then stopped; the launch's exit code is the failed rank's (where
torchrun's is 1).

The tests that are about the launcher itself (torchrun's restarts, `--nproc`, several nodes, a
killed or hanging rank, injected faults) still start real torchrun processes (helpers.torchrun).

    python tests/fork_server.py SOCKET     # serves until its parent (pytest) exits

Protocol, one launch per connection on the Unix socket SOCKET: the client sends one JSON line
{"script", "args", "world", "cwd", "stdout", "stderr"} (the two output files); the server answers
one line with the launch's process group id (kill it to stop the launch), then, when every rank
has ended, one line {"returncode": 0, or the first failed rank's exit code}.
"""

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

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

# What every launch would import: torch, DDP's torch._dynamo, the distributed packages the scripts
# use, the shared helpers and the scripts themselves (as modules: script_cases.py and the copy
# cases import them so). A mutant's patch (tests/faults, MUTANT) is applied here, on import.
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
SCRIPTS = sorted(path.stem for path in ROOT.glob("*.py"))


def preload():
    sys.path[:0] = [str(ROOT), str(TESTS)]
    for name in [*PRELOAD, *SCRIPTS]:
        __import__(name)
    # A thread alive now would be missing from every forked rank, holding whatever lock it held.
    assert threading.active_count() == 1, f"threads after the imports: {threading.enumerate()}"
    # What the imports made stays out of every rank's garbage collections: a collection would
    # walk (and so copy, page by page) the whole inherited heap, ~0.3 s a call in each rank.
    gc.freeze()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
    )
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(out, fd)
        os.close(out)
    os.chdir(request["cwd"])
    script = str(Path(request["cwd"], request["script"]).resolve())
    sys.argv = [script, *request["args"]]
    sys.path[0] = str(Path(script).parent)  # as `python script.py` puts it
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
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server ignores its children; we wait
    request = json.loads(connection.makefile().readline())
    connection.sendall(f"{os.getpgid(0)}\n".encode())
    port = free_port()
    ranks = {}
    for rank in range(request["world"]):
        pid = os.fork()
        if pid == 0:
            connection.close()
            code = run_rank(request, rank, port)
            sys.stdout.flush()
            sys.stderr.flush()
            sys.exit(code)  # the interpreter's own shutdown, as a torchrun worker's
        ranks[pid] = rank
    returncode = 0
    while ranks:
        pid, status = os.wait()
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and returncode == 0:
            returncode = code
            with open(request["stderr"], "a") as err:
                print(f"fork_server: rank {rank} exited with code {code}", file=err)
            for other in ranks:  # as torchrun's agent: a failed rank ends the launch
                os.kill(other, signal.SIGKILL)
    connection.sendall((json.dumps({"returncode": returncode}) + "\n").encode())


def serve(path):
    preload()
    parent = os.getppid()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # launches reap themselves, no zombies here
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # nobody reads the pipe after this line: nothing may fill it
    waiting = selectors.DefaultSelector()
    waiting.register(server, selectors.EVENT_READ)
    while os.getppid() == parent:  # the suite has gone: so do we
        if not waiting.select(timeout=1.0):
            continue
        connection, _ = server.accept()
        if os.fork() == 0:
            server.close()
            launch(connection)
            os._exit(0)  # the launch's leader: nothing of the server's to shut down
        connection.close()


if __name__ == "__main__":
    serve(sys.argv[1])
