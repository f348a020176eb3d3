"""Messages from rank 0: log a line, or fail with one clear error and a non-zero exit."""

import os
import sys

import torch.distributed as dist


def env_rank():
    """This process's global rank, also before the process group exists (torchrun sets RANK)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def log(*args):
    """print() on rank 0 only."""
    if env_rank() == 0:
        print(*args, flush=True)


def fail(message, code=2):
    """Bad input: one clear message (from rank 0 only) and a non-zero exit, no traceback."""
    if env_rank() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def check(condition, message):
    if not condition:
        fail(message)
