"""Messages: a line from rank 0, or one clear error and a non-zero exit instead of a traceback."""

import os
import socket
import sys
import time

import torch.distributed as dist

SILENT_RANK_WAIT = 2.0  # seconds a rank that says nothing waits before it exits (fail)


def env_rank():
    """This process's global rank, also before the process group exists (torchrun sets RANK)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


# --simulate: this process is the only one, whichever rank it plays, and says everything
ALONE = False


def log(*args):
    """print() on rank 0 only (on the one process of a --simulate run)."""
    if env_rank() == 0 or ALONE:
        print(*args, flush=True)


def fail(message, code=2):
    """Bad input: one clear message and a non-zero exit, no traceback.

    Once the process group exists, rank 0 says it. Before that, what is wrong may be wrong on one
    node only (a --load file, a directory missing there), and a node whose ranks all exit in
    silence leaves the others waiting in the rendezvous: so each node's local rank 0 says it, and
    names its host when it is not rank 0's."""
    if dist.is_available() and dist.is_initialized():
        speaks = dist.get_rank() == 0 or ALONE
    else:
        speaks = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if speaks:
        where = "" if env_rank() == 0 else f" (rank {env_rank()} on {socket.gethostname()})"
        print(f"error{where}: {message}", file=sys.stderr, flush=True)
    else:
        # torchrun stops every rank as soon as one exits: a silent rank that exits first could
        # have the speaking one stopped before it has said what is wrong (seen in CI).
        time.sleep(SILENT_RANK_WAIT)
    sys.exit(code)


def check(condition, message):
    """fail(message) unless condition holds."""
    if not condition:
        fail(message)
