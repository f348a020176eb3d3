"""Fault injection for the reliability tests, loaded into every worker through PYTHONPATH.

FAULT=raise|hang|exit  FAULT_RANK=r  FAULT_STEP=k: on global rank r, just before its k-th
optimizer step (1-based), raise an exception, sleep forever, or exit(3). Only on the first
attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT 0), so a restarted group runs clean.
OFFLINE=1: no connection to any host but this one (MNIST cannot be downloaded).
The scripts themselves carry no test hooks.
"""
import os

if os.environ.get("FAULT") and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    import time

    import torch.optim.optimizer as _opt

    _steps = {"n": 0}

    def _inject(optimizer, args, kwargs):
        if os.environ.get("RANK", "0") != os.environ.get("FAULT_RANK", "0"):
            return
        _steps["n"] += 1
        if _steps["n"] == int(os.environ.get("FAULT_STEP", "1")):
            kind = os.environ["FAULT"]
            if kind == "raise":
                raise RuntimeError(f"injected fault on rank {os.environ.get('RANK')} at step {_steps['n']}")
            if kind == "hang":
                time.sleep(3600)
            if kind == "exit":
                os._exit(3)

    _opt.register_optimizer_step_pre_hook(_inject)

if os.environ.get("OFFLINE"):
    # No connection leaves this machine: what a laptop without network (or CI) sees.
    import socket

    _create_connection = socket.create_connection

    def _offline(address, *args, **kwargs):
        if address[0] not in ("127.0.0.1", "localhost", "::1"):
            raise OSError(f"offline (tests/faults): no connection to {address[0]}")
        return _create_connection(address, *args, **kwargs)

    socket.create_connection = _offline
