"""The optimizer, the learning-rate schedule and the checkpoint files every script shares."""

import math
import os

import torch

from common.messages import check, fail


def make_optimizer(params, args):
    """--optim sgd: SGD with momentum 0.9; adamw: AdamW with weight decay 0.01."""
    if args.optim == "sgd":
        return torch.optim.SGD(params, lr=args.lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)


def save_checkpoint(obj, path):
    """torch.save to a temporary file beside `path`, fsync, then rename over it: a reader (or a
    crash part-way) never sees a half-written file, only the old one or the new one."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_state_dict_file(path, reference):
    """Read a plain state_dict written by --save and check it against `reference` (a state_dict
    of the common model, or a {name: shape} dict): same keys, same shapes. Exits with a message
    naming the first mismatch."""
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        fail(
            f"--load {path}: not a checkpoint torch.load can read "
            f"({type(e).__name__}: {str(e).splitlines()[0][:100]})"
        )
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        fail(
            f"--load {path}: not a state_dict (expected a dict of tensors, got {type(sd).__name__})"
        )
    shapes = {k: tuple(v.shape) for k, v in reference.items()}
    for k, shape in shapes.items():
        if k not in sd:
            fail(
                f"--load {path}: missing tensor '{k}' "
                "(was it saved from a model with other --dim/--depth/--heads?)"
            )
        if tuple(sd[k].shape) != shape:
            fail(
                f"--load {path}: tensor '{k}' has shape {tuple(sd[k].shape)}, "
                f"this model needs {shape} (check --dim/--depth/--heads)"
            )
    extra = sorted(set(sd) - set(shapes))
    check(
        not extra,
        f"--load {path}: unexpected tensor '{extra[0] if extra else ''}' (not in this model)",
    )
    return sd


def make_scheduler(optimizer, args, steps):
    """Linear warm-up over the first --warmup fraction of `steps`, then cosine decay towards 0
    (or constant), stepped once per optimizer step. A function of the step count only, so it is
    the same under every technique and world size."""
    warm = int(args.warmup * steps)

    def factor(step):
        if step < warm:
            return (step + 1) / (warm + 1)
        if args.lr_schedule == "constant":
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(steps - warm, 1)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def total_steps(args, batches_per_epoch):
    """Optimizer steps in the whole run: the length the schedule is drawn over."""
    steps = args.epochs * batches_per_epoch
    return min(steps, args.max_steps) if args.max_steps else steps
