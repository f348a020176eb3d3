"""What every technique script shares and no technique changes.

- the data: MNIST through torchvision (or a built-in synthetic digit set), as two Datasets the
  scripts deal out with their own DistributedSampler;
- the model: a small Vision Transformer whose pieces (embed, blocks, head) are what the
  techniques shard, slice and place;
- the shared command-line flags, the learning-rate schedule, seeding, the launcher, device
  choice, checkpoint files;
- the measuring instrument (Meter): collectives counted from outside by a TorchDispatchMode over
  the c10d ops, per-rank memory read off storages, a torch.profiler trace with --profile; and the
  report: measured next to formula, and the RESULT line.

Process groups, samplers, wrapping, sharding, schedules and collectives are NOT here: each
script writes its technique and its skeleton out in full.
"""

import argparse
import contextlib
import io
import json
import math
import os
import socket
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, Dataset, Sampler

IMAGE, CLASSES = 28, 10
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
SYNTHETIC_TRAIN, SYNTHETIC_TEST, SYNTHETIC_SEED = 60_000, 10_000, 20240607
TEST_BATCH = 512

# The one place that knows which torch this is. torch 2.14 renamed all_gather_into_tensor and
# reduce_scatter_tensor to *_single and warns on the old names; 2.11 has only the old ones. The
# scripts use the old names, which every supported torch has, and this silences the rename notice.
warnings.filterwarnings(
    "ignore", message=r".*is deprecated\. Please use `torch\.distributed\.\w+_single`"
)


# --------------------------------------------------------------------------- ranks, messages


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


# --------------------------------------------------------------------------- flags


class Parser(argparse.ArgumentParser):
    """argparse that prints usage errors once, from rank 0, instead of once per process."""

    def error(self, message):
        if env_rank() == 0:
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)

    def print_help(self, file=None):
        if env_rank() == 0:
            super().print_help(file)


def get_parser(description):
    p = Parser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("shared flags (common.py)")
    g.add_argument("--epochs", type=int, default=6)
    g.add_argument(
        "--batch-size",
        type=int,
        default=128,
        help="GLOBAL batch: each of W data-parallel ranks gets batch/W",
    )
    g.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate (default: 2e-3 for adamw, 0.05 for sgd)",
    )
    g.add_argument(
        "--warmup",
        type=float,
        default=0.05,
        help="fraction of the steps spent warming the lr up linearly",
    )
    g.add_argument(
        "--lr-schedule",
        choices=["cosine", "constant"],
        default="cosine",
        help="after warm-up: cosine decay to 0 over the run, or constant",
    )
    g.add_argument("--optim", choices=["adamw", "sgd"], default="adamw")
    g.add_argument(
        "--shift",
        type=int,
        default=1,
        help="augmentation: move each training image by up to N pixels",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--data", choices=["auto", "mnist", "synthetic"], default="auto")
    g.add_argument("--data-dir", default="data")
    g.add_argument(
        "--limit",
        type=int,
        default=0,
        help="use only the first N train and N test samples (0: all)",
    )
    g.add_argument(
        "--max-steps", type=int, default=0, help="stop after N optimizer steps (0: no limit)"
    )
    g.add_argument("--dim", type=int, default=64)
    g.add_argument("--depth", type=int, default=4)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument(
        "--patch", type=int, default=7, help="patch side, a divisor of 28: (28/patch)^2 tokens"
    )
    g.add_argument(
        "--experts",
        type=int,
        default=0,
        help="E > 0: each block's MLP becomes a mixture of E expert MLPs",
    )
    g.add_argument("--top-k", type=int, default=1, help="with --experts: experts per token (K)")
    g.add_argument(
        "--aux-loss",
        type=float,
        default=0.01,
        help="with --experts: load-balancing loss coefficient",
    )
    g.add_argument(
        "--save", default=None, help="write the plain, unsharded state_dict here at the end"
    )
    g.add_argument(
        "--load", default=None, help="start from a state_dict written by any script's --save"
    )
    g.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto")
    g.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a collective may wait before the run fails",
    )
    g.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="without torchrun: processes to spawn on this machine",
    )
    g.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (a log line every --log-every steps)",
    )
    g.add_argument(
        "--log-every", type=int, default=50, help="steps between loss lines when not on a terminal"
    )
    g.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="write a torch.profiler trace of a few training steps per rank to DIR/rank<r>.json",
    )
    return p


def parse_args(parser, argv=None):
    """Parse and check the shared flags; each script checks its own afterwards."""
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "dim", "depth", "heads", "patch", "log_every"):
        check(
            getattr(args, name) > 0,
            f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}",
        )
    for name in ("limit", "max_steps", "shift"):
        check(
            getattr(args, name) >= 0,
            f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}",
        )
    check(args.timeout > 0, f"--timeout must be positive, got {args.timeout}")
    check(0 <= args.warmup < 1, f"--warmup is a fraction of the steps in [0, 1), got {args.warmup}")
    check(args.dim % args.heads == 0, f"--dim {args.dim} is not divisible by --heads {args.heads}")
    check(IMAGE % args.patch == 0, f"--patch {args.patch} does not divide the 28-pixel image side")
    check(args.nproc is None or args.nproc >= 1, f"--nproc must be >= 1, got {args.nproc}")
    check(args.experts >= 0, f"--experts must be >= 0 (0: the dense MLP), got {args.experts}")
    check(
        not args.experts or 1 <= args.top_k <= args.experts,
        f"--top-k {args.top_k} must be between 1 and --experts {args.experts}: each token picks K distinct experts",
    )
    check(args.aux_loss >= 0, f"--aux-loss must be >= 0, got {args.aux_loss}")
    check(
        not args.experts or getattr(args, "amp", None) != "fp16",
        "--experts with --amp fp16: the load-balancing "
        "gradient is added inside backward, where the GradScaler's loss scale does not reach it (use bf16)",
    )
    if args.lr is None:
        args.lr = 2e-3 if args.optim == "adamw" else 0.05
    if args.load is not None:  # a bad file fails now, before any process group or data
        check(os.path.isfile(args.load), f"--load {args.load}: no such file")
        load_state_dict_file(
            args.load,
            ViT(
                args.dim, args.depth, args.heads, args.patch, args.experts, args.top_k
            ).state_dict(),
        )
    return args


def world_size(args):
    """The world size this launch will have, known before any process group exists."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return args.nproc or 1


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- launcher


def _spawned(local_rank, nproc, run, args):
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
    )
    run(args)


def launch(run, args):
    """Start `run(args)` on every rank. Under torchrun (or SLURM's srun with torchrun's variables)
    this process is one rank. Otherwise `python X.py --nproc N` spawns N processes on this machine
    on a free port, and plain `python X.py` is a world of one."""
    import gc
    import torch.multiprocessing as mp

    if "LOCAL_RANK" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if "LOCAL_RANK" in os.environ or (args.nproc or 1) == 1:
        for k, v in (
            ("RANK", "0"),
            ("LOCAL_RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("LOCAL_WORLD_SIZE", "1"),
        ):
            os.environ.setdefault(k, v)
        run(args)
    else:
        try:
            mp.spawn(_spawned, args=(args.nproc, run, args), nprocs=args.nproc)
        except mp.ProcessRaisedException as e:  # the failing rank's traceback once, not a wall
            print(f"error: rank {e.error_index} failed:\n{e}", file=sys.stderr)
            sys.exit(1)
        except mp.ProcessExitedException as e:
            if e.exit_code != 2:  # 2: bad input, which rank 0 has already explained
                print(
                    f"error: rank {e.error_index} exited with code {e.exit_code}", file=sys.stderr
                )
            sys.exit(e.exit_code if e.exit_code and e.exit_code > 0 else 1)
    # Wrappers and hooks form reference cycles that hold tensors Gloo's work touched; free them
    # now, not during interpreter shutdown, where Gloo's threads can abort the exit.
    gc.collect()


# --------------------------------------------------------------------------- backend and device


def pick_backend(requested):
    """'auto' -> NCCL on cuda:(LOCAL_RANK % visible GPUs) when GPUs are visible (a launcher may
    show each process only its own GPU), else Gloo on the CPU. Called before the process group
    exists, so a bad --backend fails before any rendezvous. Returns (backend, device)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "nccl":
        check(
            gpus > 0 and dist.is_nccl_available(),
            "--backend nccl needs a CUDA GPU and a torch built with NCCL"
            + (f" ({gpus} GPUs visible)" if gpus == 0 else ", and this torch has no NCCL"),
        )
    backend = (
        requested
        if requested != "auto"
        else ("nccl" if gpus > 0 and dist.is_nccl_available() else "gloo")
    )
    if backend == "nccl":
        device = torch.device("cuda", local_rank % gpus)
        why = f"{gpus} GPUs visible to {local_world} local ranks"
    else:
        device = torch.device("cpu")
        why = "no GPUs visible" if gpus == 0 else "asked for"
        if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets it; mp.spawn and python do not
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    log(f"backend: {backend} on {device.type} ({why})")
    return backend, device


# --------------------------------------------------------------------------- data


def _digit_strokes():
    """Each digit as strokes (polylines) in the unit square, x right, y down."""

    def arc(cx, cy, rx, ry, a0, a1, n=9):
        return [
            (
                cx + rx * math.cos(math.radians(a0 + (a1 - a0) * i / (n - 1))),
                cy + ry * math.sin(math.radians(a0 + (a1 - a0) * i / (n - 1))),
            )
            for i in range(n)
        ]

    return [
        [arc(0.5, 0.5, 0.26, 0.37, 0, 360, 13)],  # 0
        [[(0.36, 0.28), (0.52, 0.12), (0.52, 0.88)]],  # 1
        [arc(0.5, 0.34, 0.25, 0.21, 195, 390, 8) + [(0.22, 0.88), (0.8, 0.88)]],  # 2
        [arc(0.5, 0.31, 0.23, 0.18, 200, 450, 8), arc(0.5, 0.68, 0.27, 0.2, 270, 520, 9)],  # 3
        [[(0.62, 0.88), (0.62, 0.12), (0.2, 0.62), (0.82, 0.62)]],  # 4
        [[(0.74, 0.14), (0.36, 0.14), (0.32, 0.46)] + arc(0.5, 0.65, 0.25, 0.22, 220, 510, 9)],  # 5
        [[(0.7, 0.12), (0.45, 0.3), (0.3, 0.58)] + arc(0.5, 0.68, 0.21, 0.2, 180, 540, 11)],  # 6
        [[(0.22, 0.14), (0.78, 0.14), (0.42, 0.88)]],  # 7
        [arc(0.5, 0.3, 0.2, 0.18, 0, 360, 11), arc(0.5, 0.68, 0.25, 0.21, 0, 360, 11)],  # 8
        [arc(0.5, 0.34, 0.22, 0.2, 0, 360, 11), [(0.72, 0.36), (0.62, 0.88)]],  # 9
    ]


def _digit_templates(samples=64):
    """Per digit: control points [10, K, 2] and a matrix [10, samples, K] whose rows place
    `samples` points evenly along the strokes (as mixes of two control points), plus the
    spacing between those points."""
    digits = _digit_strokes()
    K = max(sum(len(s) for s in d) for d in digits)
    pts, mix, step = torch.zeros(10, K, 2), torch.zeros(10, samples, K), torch.zeros(10)
    for d, strokes in enumerate(digits):
        segs, k = [], 0
        for stroke in strokes:
            for i, p in enumerate(stroke):
                pts[d, k + i] = torch.tensor(p)
            segs += [(k + i, k + i + 1) for i in range(len(stroke) - 1)]
            k += len(stroke)
        lengths = torch.stack([(pts[d, j] - pts[d, i]).norm() for i, j in segs])
        ends = lengths.cumsum(0)
        step[d] = ends[-1] / samples
        for s, at in enumerate((torch.arange(samples) + 0.5) * step[d]):
            n = int(torch.searchsorted(ends, at))
            t = float(1 - (ends[n] - at) / lengths[n])
            mix[d, s, segs[n][0]], mix[d, s, segs[n][1]] = 1 - t, t
    return pts, mix, step


def synthetic_digits(n, seed, chunk=1000):
    """n MNIST-shaped digits (uint8 [n, 28, 28], labels [n]), deterministic for (seed, n).

    Each digit is drawn from strokes with per-point jitter, a random affine map
    (rotation, scale, shear, shift), random stroke width and brightness, pixel noise
    and, in half the images, a faint distractor stroke: learnable, but a small ViT needs
    real training. A stroke is a row of Gaussian dots, and a sum of Gaussian dots is a
    matrix product (exp(-dx^2) times exp(-dy^2)), so 60,000 digits take a few seconds.
    Made in chunks with their own seeds, so the first n samples do not depend on n.
    """
    pts0, mix0, step0 = _digit_templates()
    grid = (torch.arange(IMAGE, dtype=torch.float32) + 0.5) / IMAGE  # pixel centres
    images, labels = [], []
    for start in range(0, n, chunk):
        g = torch.Generator().manual_seed(seed * 1_000_003 + start)
        m = chunk  # always a whole chunk, cut at the end: the same draws for every n
        u = lambda lo, hi, *shape: lo + (hi - lo) * torch.rand(m, *shape, generator=g)  # noqa: E731
        y = torch.randint(0, 10, (m,), generator=g)
        ctrl = (
            pts0[y] + 0.052 * torch.randn(m, pts0.shape[1], 2, generator=g) - 0.5
        )  # jittered, centred
        ang, sx, sy, sh = u(-0.4, 0.4), u(0.68, 1.12), u(0.72, 1.1), u(-0.4, 0.4)
        cos, sin = ang.cos(), ang.sin()
        A = torch.stack(
            [
                torch.stack([sx * cos, sy * (sh * cos - sin)], -1),
                torch.stack([sx * sin, sy * (sh * sin + cos)], -1),
            ],
            -2,
        )  # rotate @ shear @ scale
        dots = (mix0[y] @ ctrl) @ A.transpose(1, 2) + 0.5 + u(-0.07, 0.07, 1, 2)  # [m, 64, 2]
        sigma = u(0.022, 0.045).view(m, 1)
        weight = (step0[y].view(m, 1) * sx.view(m, 1) / (sigma * 2.5066)).expand(m, dots.shape[1])
        # distractor: 12 dots on a short random segment, at 0.7 strength, in 65% of the images
        a, b = u(0.1, 0.9, 1, 2), u(-0.15, 0.15, 1, 2)
        extra = a + b * torch.linspace(0, 1, 12).view(1, 12, 1)
        on = (torch.rand(m, 1, generator=g) < 0.65).float()
        dots = torch.cat([dots, extra], 1)
        weight = torch.cat(
            [weight, (0.7 * on * b.norm(dim=-1) / 12 / (sigma * 2.5066)).expand(m, 12)], 1
        )
        gx = torch.exp(
            -(((grid.view(1, 1, -1) - dots[..., :1]) / sigma.view(m, 1, 1)) ** 2) / 2
        )  # [m, dots, 28]
        gy = torch.exp(-(((grid.view(1, 1, -1) - dots[..., 1:]) / sigma.view(m, 1, 1)) ** 2) / 2)
        ink = (gy * weight.unsqueeze(-1)).transpose(1, 2) @ gx  # [m, 28 (y), 28 (x)]
        img = (1.6 * ink).clamp(0, 1) * u(0.75, 1.0).view(m, 1, 1) + 0.08 * torch.randn(
            m, IMAGE, IMAGE, generator=g
        )
        images.append((img.clamp(0, 1) * 255).round().to(torch.uint8))
        labels.append(y)
    return torch.cat(images)[:n], torch.cat(labels)[:n]


def _mnist(root, train, download):
    from torchvision.datasets import MNIST

    ds = MNIST(root, train=train, download=download)
    return ds.data, ds.targets


def _find_mnist(data_dir):
    """'mnist' if MNIST is in data_dir (or could be downloaded there), else the reason it is not."""
    try:
        _mnist(data_dir, True, False), _mnist(data_dir, False, False)
        return "mnist"
    except Exception:
        pass
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(20)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            _mnist(data_dir, True, True), _mnist(data_dir, False, True)
        return "mnist"
    except Exception as e:
        return (
            f"MNIST is not in {os.path.join(data_dir, 'MNIST', 'raw')} and could not "
            f"be downloaded ({str(e).strip().splitlines()[-1][:120] if str(e).strip() else type(e).__name__})"
        )
    finally:
        socket.setdefaulttimeout(old)


def _agree_on_mnist(args, device):
    """True if every node has MNIST in its own --data-dir. Local rank 0 of each node looks (and
    downloads) in a thread; meanwhile all ranks all-reduce a "done" flag once a second, so no
    collective waits on the download and a slow one cannot trip --timeout. A node that has no
    MNIST says why, once."""
    local_zero = int(os.environ.get("LOCAL_RANK", "0")) == 0
    found = {}
    if local_zero:
        threading.Thread(
            target=lambda: found.update(source=_find_mnist(args.data_dir)), daemon=True
        ).start()
    while True:
        flags = torch.tensor([0 if local_zero and not found else 1], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        if flags.item():
            break
        time.sleep(0.2 if local_zero and not found else 1.0)
    have = torch.tensor([0 if local_zero and found["source"] != "mnist" else 1], device=device)
    dist.all_reduce(have, op=dist.ReduceOp.MIN)
    if local_zero and found["source"] != "mnist" and env_rank() != 0:  # rank 0 says its own reason
        print(
            f"{'error' if args.data == 'mnist' else 'warning'} (rank {env_rank()} on {socket.gethostname()}): "
            f"{found['source']}",
            file=sys.stderr,
            flush=True,
        )
    return bool(have.item()), found.get("source", "")


def load_data(args, device=torch.device("cpu")):
    """(train_set, test_set, name): MNIST when every node has it (or can download it), else the
    built-in synthetic digits, the same choice on every rank. Each set holds normalised float
    images [N, 1, 28, 28] and labels; call with the process group up (or in a single process)."""
    source = "synthetic"
    if args.data != "synthetic":
        if dist.is_available() and dist.is_initialized():
            have, why = _agree_on_mnist(args, device)
        else:
            why = _find_mnist(args.data_dir)
            have = why == "mnist"
        if have:
            source = "mnist"
        elif args.data == "mnist":
            fail(
                "--data mnist: "
                + (
                    why
                    if why and why != "mnist"
                    else "MNIST is missing on another node (see its message)"
                )
                + ". Use --data synthetic, or put the four IDX files there."
            )
        else:
            log(
                f"warning: {why if why and why != 'mnist' else 'MNIST is missing on another node'}; "
                f"using the built-in synthetic digit set instead (--data synthetic)"
            )
    limit = args.limit or None
    if source == "mnist":
        (xtr, ytr), (xte, yte) = (
            _mnist(args.data_dir, True, False),
            _mnist(args.data_dir, False, False),
        )
        xtr, ytr, xte, yte = xtr[:limit], ytr[:limit], xte[:limit], yte[:limit]
    else:
        xtr, ytr = synthetic_digits(min(limit or SYNTHETIC_TRAIN, SYNTHETIC_TRAIN), SYNTHETIC_SEED)
        xte, yte = synthetic_digits(
            min(limit or SYNTHETIC_TEST, SYNTHETIC_TEST), SYNTHETIC_SEED + 1
        )
    norm = lambda x: ((x.float() / 255 - MNIST_MEAN) / MNIST_STD).unsqueeze(1)  # noqa: E731
    return (
        Digits(norm(xtr), ytr.long(), args.shift, args.seed),
        Digits(norm(xte), yte.long()),
        source,
    )


class Digits(Dataset):
    """Images and labels held as two tensors; indexed one sample at a time like any Dataset.

    With shift=s (the training set, --shift), sample i in epoch e is moved by a whole number of
    pixels in [-s, s] along each axis, drawn from (seed, e, i) alone: every world size and every
    technique sees the same augmented batches. set_epoch(e) picks the epoch, as the sampler's does."""

    def __init__(self, x, y, shift=0, seed=0):
        self.x, self.y, self.shift, self.seed, self.epoch = x, y, shift, seed, 0
        self.background = x.amin() if len(x) else 0.0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x, s = self.x[i], self.shift
        if s:
            h = (
                hash((self.seed, self.epoch, int(i))) & 0xFFFFFFFF
            )  # ints hash to themselves: deterministic
            h = (h * 2654435761) & 0xFFFFFFFF
            dy, dx = h % (2 * s + 1) - s, (h // (2 * s + 1)) % (2 * s + 1) - s
            x = F.pad(x, (s, s, s, s), value=float(self.background))[
                :, s - dy : s - dy + IMAGE, s - dx : s - dx + IMAGE
            ]
        return x, self.y[i]


class PaddedShards(Sampler):
    """Evaluation sampler: rank r of W takes samples r, r+W, r+2W, ... and pads its list (with
    index -1, masked out) to ceil(N/W) entries, so every rank runs the same number of batches of
    the same size, and therefore the same collectives, while every sample is counted exactly once.
    (DistributedSampler pads with repeats, which would count them twice.)"""

    def __init__(self, n, rank=0, world=1):
        self.n, self.indices = n, list(range(rank, n, world))
        self.indices += [-1] * (-(-n // world) - len(self.indices))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


class _Masked(Dataset):
    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        x, y = self.ds[max(i, 0)]
        return x, y, i >= 0


def test_loader(test_set, rank=0, world=1, batch=TEST_BATCH, pin_memory=False):
    """Batches of (images, labels, keep): see PaddedShards. world=1 gives every rank the whole set."""
    return DataLoader(
        _Masked(test_set),
        batch_size=batch,
        sampler=PaddedShards(len(test_set), rank, world),
        pin_memory=pin_memory,
    )


# --------------------------------------------------------------------------- model


class PatchEmbed(nn.Module):
    """Cut the image into patch x patch squares, project each to `dim`, add a learned position
    embedding: [B, 1, 28, 28] -> [B, tokens, dim] with tokens = (28/patch)^2."""

    def __init__(self, dim, patch=7):
        super().__init__()
        self.patch, self.tokens = patch, (IMAGE // patch) ** 2
        self.proj = nn.Linear(patch * patch, dim)
        self.pos = nn.Parameter(torch.zeros(1, self.tokens, dim))

    def forward(self, img):
        B, n, p = img.shape[0], IMAGE // self.patch, self.patch
        patches = img.reshape(B, n, p, n, p).transpose(2, 3).reshape(B, self.tokens, p * p)
        return self.proj(patches) + self.pos


class Attention(nn.Module):
    """Multi-head self-attention with separate q, k, v projections (split by heads under TP).

    The head count is read off q's output width, so a tensor-parallel rank whose q, k, v
    produce only its own heads runs this same code. The key projection has no bias: softmax
    ignores a constant added to every key score, so that bias would get a zero gradient.
    """

    def __init__(self, dim, heads):
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = (
            nn.Linear(dim, dim),
            nn.Linear(dim, dim, bias=False),
            nn.Linear(dim, dim),
        )
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, _ = x.shape
        split = lambda t: t.view(B, T, -1, self.head_dim).transpose(1, 2)  # noqa: E731  [B, heads, T, hd]
        out = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        return self.proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Experts(nn.ModuleList):
    """E expert MLPs, called with the routing: tokens [N, D], the experts each token picked [N, K] and
    their weights [N, K] -> sum_k weights[:, k] * expert_idx[:, k](token), [N, D]. A loop over the
    experts on this process; expert_parallel.py swaps in one with the same call that sends each token
    to the rank that owns its expert. Every expert runs, also on no token, so each always has a
    gradient (zero if it got no token), as DDP and ZeRO expect of every parameter."""

    def forward(self, h, idx, weights):
        N, K = idx.shape
        flat, y = idx.reshape(-1), h.new_zeros(N * K, h.shape[1])  # one row per (token, slot)
        for e, expert in enumerate(self):
            rows = (flat == e).nonzero().squeeze(1)
            y = y.index_copy(0, rows, expert(h[rows // K]))
        return (weights.unsqueeze(-1) * y.view(N, K, -1)).sum(1)


class AuxLossScaler(torch.autograd.Function):
    """Returns x unchanged; in backward also gives `aux` the gradient `scale` (Megatron-LM's
    MoEAuxLossAutoScaler), as if aux * scale had been added to the loss the script backpropagates."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_full((), ctx.scale), None


class MoE(nn.Module):
    """Mixture of experts in place of the MLP: a linear router scores the E experts for each token;
    each token goes to its top K, mixed by the softmax over the K chosen scores. No capacity limit,
    no dropped token: the output does not depend on how tokens are grouped into batches or ranks.

    Load balance: DeepSeek-V3's sequence-wise auxiliary loss, per image (T tokens):
    f_i = E/(K*T) * (tokens of the image routed to expert i; no gradient), P_i = the mean over the
    image's tokens of the router's full softmax for expert i; aux = coef * sum_i f_i * P_i, averaged
    over the images. A per-sample mean is what makes it exact across ranks and micro-batches: a
    batch-wise (Switch) loss over the whole batch would make DDP at W=2 differ from W=1.
    The skeleton's loss stays the cross-entropy (and so does the printed train loss): the aux term's
    gradient is added in backward by AuxLossScaler, attached to the routing weights, scaled by
    1/forwards_per_step because the scripts divide each micro-batch's loss by the micro-batch count
    (pipeline.py --microbatches, amp_checkpoint.py --grad-accum); DDP's average over W does the rest.
    """

    def __init__(self, dim, hidden, experts, top_k, aux_loss=0.0, forwards_per_step=1):
        super().__init__()
        self.top_k, self.aux_loss, self.forwards_per_step = top_k, aux_loss, forwards_per_step
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = Experts(MLP(dim, hidden) for _ in range(experts))

    def forward(self, x):
        B, T, D = x.shape
        h = x.reshape(B * T, D)
        logits = self.router(h)  # [B*T, E]
        top, idx = logits.topk(self.top_k, dim=-1)
        weights = top.softmax(-1)
        if self.training and self.aux_loss and torch.is_grad_enabled():
            E = logits.shape[-1]
            f = F.one_hot(idx, E).view(B, T * self.top_k, E).sum(1) * (
                E / (self.top_k * T)
            )  # [B, E], no grad
            P = logits.softmax(-1).view(B, T, E).mean(1)
            aux = self.aux_loss * (f * P).sum(-1).mean()
            weights = AuxLossScaler.apply(weights, aux, 1.0 / self.forwards_per_step)
        return self.experts(h, idx, weights).view(B, T, D)


class Block(nn.Module):
    """Pre-norm Transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(
        self, dim, heads, mlp_ratio=4, experts=0, top_k=1, aux_loss=0.0, forwards_per_step=1
    ):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = (
            MoE(dim, mlp_ratio * dim, experts, top_k, aux_loss, forwards_per_step)
            if experts
            else MLP(dim, mlp_ratio * dim)
        )

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    """Final norm, mean over tokens, linear classifier."""

    def __init__(self, dim, classes=CLASSES):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x):
        return self.fc(self.norm(x).mean(1))


class ViT(nn.Module):
    """embed -> blocks[0..depth-1] -> head: a plain sequence, so a pipeline can cut it anywhere."""

    def __init__(
        self,
        dim=64,
        depth=4,
        heads=4,
        patch=7,
        experts=0,
        top_k=1,
        aux_loss=0.0,
        forwards_per_step=1,
    ):
        super().__init__()
        self.embed = PatchEmbed(dim, patch)
        self.blocks = nn.ModuleList(
            Block(dim, heads, 4, experts, top_k, aux_loss, forwards_per_step) for _ in range(depth)
        )
        self.head = Head(dim)

    def forward(self, img):
        x = self.embed(img)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(args):
    """The common model with weights that depend only on --seed (built on CPU, same on every rank)."""
    torch.manual_seed(args.seed)
    # each micro-batch's loss is divided by their count (pipeline.py, amp_checkpoint.py): the aux term's too
    forwards = getattr(args, "microbatches", 1) * getattr(args, "grad_accum", 1)
    model = ViT(
        args.dim,
        args.depth,
        args.heads,
        args.patch,
        args.experts,
        args.top_k,
        args.aux_loss,
        forwards,
    )
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    nn.init.trunc_normal_(model.embed.pos, std=0.02)
    return model


def saved_outside_blocks(args, batch):
    """E: the bytes autograd keeps for backward outside the blocks in one fp32 forward and loss of the common ViT on
    `batch` samples: the embedding's patches; the head's norm input, its mean and rstd, the pooled tokens; the
    log-probabilities, the int64 labels and the loss's 4-byte total weight. A checkpointed model keeps E + L·B·T·D·4."""
    tokens = (IMAGE // args.patch) ** 2
    return (
        4 * batch * (tokens * args.patch**2 + tokens * args.dim + 2 * tokens + args.dim + CLASSES)
        + 8 * batch
        + 4
    )


def make_optimizer(params, args):
    if args.optim == "sgd":
        return torch.optim.SGD(params, lr=args.lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)


# --------------------------------------------------------------------------- checkpoints


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
            f"--load {path}: not a checkpoint torch.load can read ({type(e).__name__}: {str(e).splitlines()[0][:100]})"
        )
    if isinstance(sd, dict) and "model" in sd and isinstance(sd["model"], dict):
        sd = sd["model"]  # a ddp_torchrun.py snapshot holds it under "model"
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        fail(
            f"--load {path}: not a state_dict (expected a dict of tensors, got {type(sd).__name__})"
        )
    shapes = {k: tuple(v.shape) for k, v in reference.items()}
    for k, shape in shapes.items():
        if k not in sd:
            fail(
                f"--load {path}: missing tensor '{k}' (was it saved from a model with other --dim/--depth/--heads?)"
            )
        if tuple(sd[k].shape) != shape:
            fail(
                f"--load {path}: tensor '{k}' has shape {tuple(sd[k].shape)}, this model needs {shape} "
                f"(check --dim/--depth/--heads)"
            )
    extra = sorted(set(sd) - set(shapes))
    check(
        not extra,
        f"--load {path}: unexpected tensor '{extra[0] if extra else ''}' (not in this model)",
    )
    return sd


# --------------------------------------------------------------------------- learning rate


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


# --------------------------------------------------------------------------- measurement

COLLECTIVES = {  # c10d op -> (name in the report, which argument holds the bytes that count)
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
    "broadcast_": ("broadcast", 0),
    "reduce_": ("reduce", 0),
    "gather_": ("gather", 1),
    "scatter_": ("scatter", 0),
    "send": ("send", 0),
    "recv_": ("recv", 0),
    # torch.distributed._functional_collectives (DTensor): the output is returned, the input counts
    "all_reduce": ("all_reduce", 0),
    "all_gather_into_tensor": ("all_gather", -1),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "all_to_all_single": ("all_to_all", 0),
    "broadcast": ("broadcast", 0),
}


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


class CollectiveCounter(TorchDispatchMode):
    """Sees every c10d op this rank issues (also DDP's and FSDP's from C++ or from the autograd
    engine) and adds up calls and bytes per kind: for an all-reduce the tensor, for an all-gather
    the gathered output, for a reduce-scatter its input, for send/recv the message. A 0-d tensor
    (the skeleton's logged loss) is bookkeeping, not the technique's traffic, and is left out."""

    def __init__(self):
        super().__init__()
        self.calls, self.bytes, self.sample = {}, {}, None
        self.groups = {}  # {process group name: {kind: [calls, bytes]}}: traffic per mesh dimension

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (
            self.sample is not None
        ):  # the Meter's reading after every op (the optimizer state's peak)
            self.sample()
        if func.namespace in ("c10d", "_c10d_functional"):
            kind, where = COLLECTIVES.get(func._opname, (None, None))
            if kind is not None:
                ts = (
                    _tensors(out)
                    if where == -1
                    else _tensors(args[where] if where < len(args) else [])
                )
                if ts and not all(t.dim() == 0 for t in ts):
                    n = sum(_local(t).numel() * t.element_size() for t in ts)
                    self.calls[kind] = self.calls.get(kind, 0) + 1
                    self.bytes[kind] = self.bytes.get(kind, 0) + n
                    seen = self.groups.setdefault(_group_name(args), {}).setdefault(kind, [0, 0])
                    seen[0], seen[1] = seen[0] + 1, seen[1] + n
        return out


def _group_name(args):
    """The process group a c10d op runs on: a functional collective names it (its last str argument),
    a c10d op passes the ProcessGroup as a script object."""
    names = [a for a in args if isinstance(a, str)]
    if names:
        return names[-1]
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).group_name
            except RuntimeError:  # a ReduceOp
                pass
    return None


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors):
    """Bytes of the distinct storages behind `tensors`: a view adds nothing, a freed buffer is 0,
    a DTensor counts its local shard."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        s = _local(t).untyped_storage()
        seen[s.data_ptr() if s.nbytes() else id(s)] = s.nbytes()
    return sum(seen.values())


def memory(params, optimizer):
    """Per-rank bytes of parameters, gradients and optimizer state (the scalar step counters are
    left out, as the papers do), read off the storages that hold them right now."""
    params = list(params) + [p for g in optimizer.param_groups for p in g["params"]]
    state = [
        v
        for st in optimizer.state.values()
        for k, v in st.items()
        if torch.is_tensor(v) and k != "step"
    ]
    return dict(
        param_bytes=storage_bytes(params),
        grad_bytes=storage_bytes(p.grad for p in params),
        optim_bytes=storage_bytes(state),
    )


class SavedActivations:
    """What autograd keeps for backward during the first forward (until the first backward begins):
    the distinct storages of the saved tensors, parameters left out (also gathered or unsharded
    ones: a leaf that requires grad, or a view of one). A checkpointed block keeps only its input."""

    def __init__(self):
        self.kept, self.counting, self.part, self.parts = {}, True, None, {}

    def pack(self, t):
        if self.counting:
            base = t._base if t._base is not None else t
            if not (base.is_leaf and base.requires_grad):
                s = _local(t).untyped_storage()
                self.kept[s.data_ptr() if s.nbytes() else id(s)] = s.nbytes()
                if (
                    self.part is not None
                ):  # saved while inside one of the modules of Meter's `parts`
                    self.parts.setdefault(self.part, {})[s.data_ptr() if s.nbytes() else id(s)] = (
                        s.nbytes()
                    )
        return t

    def unpack(self, t):
        self.counting = False
        return t

    def bytes(self, params, part=None):
        own = {_local(p).untyped_storage().data_ptr() for p in params}
        return sum(
            n
            for ptr, n in (self.kept if part is None else self.parts.get(part, {})).items()
            if ptr not in own
        )


class Meter:
    """The instrument, attached from outside: `with Meter(model, optimizer, args): train(...)`.

    It counts the collectives of the first `steps` steps of the loop (forward, backward and step;
    a step is a batch drawn through `progress`, whether or not the optimizer stepped, e.g. when
    fp16's GradScaler skips one). After the window the dispatch mode is gone, but the hooks the
    Meter left (a step counter) still run. Throughput is timed from one warm-up step after the
    window to the end of training, so the observed steps do not slow it down.
    reads per-rank memory off the storages right after the first step (activations: what the first
    forward saved for backward; optimizer state also at its peak during that step), and with --profile records
    those steps with torch.profiler, one Chrome/Perfetto trace per rank. Deleting it from a
    script changes nothing the technique does. `parts={"attention": [modules]}` adds a row
    act_bytes_attention: what those modules' forwards saved for backward in the first forward."""

    active = None  # the Meter inside whose `with` block training runs: progress() reports to it

    def __init__(self, model, optimizer, args, steps=3, parts=None):
        self.params, self.optimizer, self.steps, self.profile_dir = (
            list(model.parameters()),
            optimizer,
            steps,
            args.profile,
        )
        self.counter, self.profiler, self.seen, self.mem, self.open = (
            CollectiveCounter(),
            None,
            0,
            {},
            False,
        )
        self.saved, self.packing, self.optim_peak = SavedActivations(), None, 0
        self.loop_steps = 0  # batches drawn through progress() so far
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.clock_start = None  # (time, loop steps done) when the throughput clock started
        self.first_step = None
        self.samples_per_step = args.batch_size
        self.elapsed = (0.0, 0)  # (seconds, loop steps) timed
        self.counter.sample = self._sample_optimizer_state
        self.hook = optimizer.register_step_post_hook(lambda *_: self._after_step())
        self.parts, self.part_hooks = parts or {}, []
        for name, modules in self.parts.items():
            for m in modules:
                self.part_hooks += [
                    m.register_forward_pre_hook(lambda *_, n=name: setattr(self.saved, "part", n)),
                    m.register_forward_hook(lambda *_: setattr(self.saved, "part", None)),
                ]

    def _sample_optimizer_state(self):
        """The optimizer state's bytes after every op until the first step ends: its peak, also where a technique
        brings the state in and out during the step (zero.py --offload disk, one unit at a time)."""
        state = [
            v
            for st in self.optimizer.state.values()
            for k, v in st.items()
            if torch.is_tensor(v) and k != "step"
        ]
        self.optim_peak = max(self.optim_peak, storage_bytes(state))

    def __enter__(self):
        Meter.active = self
        self.counter.__enter__()
        self.packing = torch.autograd.graph.saved_tensors_hooks(self.saved.pack, self.saved.unpack)
        self.packing.__enter__()
        self.open = True
        if self.profile_dir:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + (
                [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            )
            self.profiler = profile(activities=acts, record_shapes=True)
            self.profiler.__enter__()
        return self

    def _now(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # twice a run: at the clock's start and its end
        return time.perf_counter()

    def loop_step_starts(self):
        """Called by progress() as each batch is drawn: closes the window after `steps` steps and
        starts the throughput clock one warm-up step later."""
        if self.loop_steps == 0:
            self.first_step = self._now()
        if self.loop_steps == self.steps:
            self._close()
        if self.loop_steps == self.steps + 1:
            self.clock_start = (self._now(), self.loop_steps)
        self.loop_steps += 1

    def samples_per_s(self):
        """Global samples per second of the steps after the window (of all steps in a run too
        short to have any after it)."""
        seconds, steps = self.elapsed
        return steps * self.samples_per_step / seconds if seconds > 0 else 0.0

    def _after_step(self):
        self.seen += 1
        if self.seen == 1:
            self.mem, self.counter.sample = memory(self.params, self.optimizer), None
            self.mem["optim_peak_bytes"] = max(self.optim_peak, self.mem["optim_bytes"])
            self._stop_packing()
            self.mem["act_bytes"] = self.saved.bytes(self.params)
            for name in self.parts:
                self.mem[f"act_bytes_{name}"] = self.saved.bytes(self.params, name)

    def _stop_packing(self):
        for h in self.part_hooks:
            h.remove()
        self.part_hooks = []
        if self.packing is not None:
            self.packing.__exit__(None, None, None)
            self.packing = None

    def _close(self):
        self._stop_packing()
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            os.makedirs(self.profile_dir, exist_ok=True)
            self.profiler.export_chrome_trace(
                os.path.join(self.profile_dir, f"rank{env_rank()}.json")
            )
            self.profiler = None
        if self.open:
            self.counter.__exit__(None, None, None)
            self.open = False

    def __exit__(self, *exc):
        self._close()
        self.hook.remove()
        Meter.active = None
        if self.loop_steps:
            end = self._now()
            start, steps_before = self.clock_start or (self.first_step, 0)
            self.elapsed = (end - start, self.loop_steps - steps_before)

    def comm(self):
        """({kind: bytes per optimizer step}, {kind: calls in the window}, optimizer steps in the window)."""
        n = max(min(self.loop_steps, self.steps), 1)
        return {k: v // n for k, v in self.counter.bytes.items()}, dict(self.counter.calls), n

    def comm_by_group(self):
        """{process group name: {kind: [calls in the window, bytes per optimizer step]}}."""
        n = max(min(self.loop_steps, self.steps), 1)
        return {
            g: {k: [c, b // n] for k, (c, b) in kinds.items()}
            for g, kinds in self.counter.groups.items()
        }


# --------------------------------------------------------------------------- report


def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


class Progress:
    """What train() iterates: the loader's batches, through tqdm on a terminal (a plain line every
    --log-every steps in a log file, from log_loss). Each batch drawn is one step of the loop,
    which the active Meter counts. The first `skip` batches (trained on before a resume) are drawn,
    so that the sampler's order stays the same, but not yielded."""

    def __init__(self, loader, bar=None, skip=0):
        self.loader = loader
        self.bar = bar
        self.skip = skip

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        batches = self.bar if self.bar is not None else self.loader
        for index, batch in enumerate(batches):
            if index < self.skip:
                continue
            if Meter.active is not None:
                Meter.active.loop_step_starts()
            yield batch


def progress(loader, args, epoch, skip=0):
    if args.no_progress or env_rank() != 0 or not sys.stderr.isatty():
        return Progress(loader, skip=skip)
    from tqdm import tqdm

    bar = tqdm(loader, leave=False, dynamic_ncols=True, desc=f"epoch {epoch}")
    return Progress(loader, bar, skip)


def log_loss(bar, args, epoch, steps, loss):
    """The windowed mean loss: on the bar's tail on a terminal, as a plain line every
    --log-every steps in a log file."""
    if bar.bar is not None:
        bar.bar.set_postfix(loss=f"{loss:.4f}")
    elif steps % args.log_every == 0:
        log(f"epoch {epoch} step {steps}: train loss {loss:.4f}")


def report(
    script, args, world, backend, device, source, model_params, out, acc, meter, formula, **extra
):
    """Rank 0: the measured per-rank memory and communication next to the formula, then the one
    machine-readable line `RESULT {json}` that run_all.sh and the tests read.

    `formula` maps param_bytes / grad_bytes / optim_bytes / comm (a {kind: bytes} dict) to the
    paper's value (None where it makes no promise), and `notes` to the formula's text."""
    notes = formula.pop("notes", {})
    comm, calls, counted = meter.comm()
    rows = [
        (what, meter.mem.get(k, 0), formula.get(k), notes.get(k, ""))
        for what, k in (
            ("parameters", "param_bytes"),
            ("gradients", "grad_bytes"),
            ("optimizer state", "optim_bytes"),
            ("activations (1st forward)", "act_bytes"),
        )
    ]
    rows += [
        (f"  of which {k[10:]}", meter.mem[k], formula.get(k), notes.get(k, ""))
        for k in sorted(meter.mem)
        if k.startswith("act_bytes_")
    ]
    if formula.get("optim_peak_bytes") is not None:
        rows.insert(
            3,
            (
                "optimizer state, peak",
                meter.mem.get("optim_peak_bytes", 0),
                formula["optim_peak_bytes"],
                notes.get("optim_peak_bytes", ""),
            ),
        )
    for kind in sorted(set(comm) | set(formula.get("comm", {}))):
        rows.append(
            (
                f"{kind.replace('_', '-')} per step",
                comm.get(kind, 0),
                formula.get("comm", {}).get(kind),
                notes.get(kind, "") + f" ({calls.get(kind, 0)} calls in {counted} steps)",
            )
        )
    log("\nper-rank memory and communication (measured from outside the technique)")
    log(f"  {'':<26}{'measured':>12}{'formula':>12}   formula")
    for what, measured, expected, text in rows:
        flag = "" if expected is None or measured == expected else "  (differs)"
        log(
            f"  {what:<26}{fmt_bytes(measured):>12}{fmt_bytes(expected) if expected is not None else '':>12}"
            f"   {text}{flag}"
        )
    if device.type == "cuda":
        log(f"  cuda max_memory_allocated: {fmt_bytes(torch.cuda.max_memory_allocated(device))}")
    sps = meter.samples_per_s()
    log(f"\ntest accuracy {acc:.4f}, final train loss {out['loss']:.4f}, {sps:.0f} samples/s")
    fields = dict(
        script=script,
        world_size=world,
        backend=backend,
        device=device.type,
        data=source,
        params=model_params,
        steps=out["steps"],
        loss=out["loss"],
        test_acc=acc,
        samples_per_s=sps,
        **meter.mem,
        comm_bytes=sum(comm.values()),
        comm=comm,
        comm_calls=calls,
        comm_steps=counted,
        formula=formula,
        **extra,
    )
    result(**fields)
    return fields


def result(**fields):
    """The machine-readable last line that run_all.sh and the tests read (rank 0 only)."""
    log("RESULT " + json.dumps(fields))


def record_pipeline_order(stage, m, weights=False):
    """A pipeline stage's first-step actions, (F | B | W, micro-batch, chunk), in the order they ran, seen
    from outside: a forward hook (the chunk is the forward's second argument, 0 without one), a gradient
    hook on each output (B) and, where W is a pass of its own (weights), on the stage's first parameter."""
    ran, count = [], lambda a, v: sum(r[0] == a and r[2] == v for r in ran)

    def hook(module, inputs, out):
        v = inputs[1] if len(inputs) > 1 else 0
        if out.requires_grad and count("F", v) < m:
            ran.append(("F", count("F", v), v))
            out.register_hook(
                lambda grad, b=("B", count("F", v) - 1, v): None if b in ran else ran.append(b)
            )

    stage.register_forward_hook(hook)
    if weights:  # W goes back through the output too: its B counts once
        next(stage.parameters()).register_hook(
            lambda grad: ran.extend([("W", count("W", 0), 0)][: count("W", 0) < m])
        )
    return ran


def pipeline_timeline(orders, cost, V=1):
    """Each rank's recorded actions replayed in slots, `cost` slots each, an action starting after the rank's
    last and after its input (F of global chunk c = v·p + s after F of c-1, B of c after B of c+1). Returns
    the picture (F3' is micro-batch 3 in the rank's chunk v=1), the idle fraction of the slots, and each
    rank's peak of micro-batch chunks in flight (F run, its last backward action not)."""
    end, p, last = {}, len(orders), "W" if any(a == "W" for o in orders for a, _, _ in o) else "B"
    for _ in range(sum(map(len, orders))):  # relax until every action ends at its longest path
        for s, o in enumerate(orders):
            for k, (a, i, v) in enumerate(o):
                c = v * p + s + (-1 if a == "F" else 1)
                dep = end.get((c % p, a, i, c // p), 0) if a != "W" and 0 <= c < V * p else 0
                end[s, a, i, v] = max(dep, end.get((s, *o[k - 1]), 0) if k else 0) + cost[a]
    total, width = max(end.values()), max(len(str(i)) for o in orders for _, i, _ in o) + V + 1
    cells = {
        (s, t): f"{a}{i}" + "'" * v
        for (s, a, i, v), e in end.items()
        for t in range(e - cost[a], e)
    }
    picture = "\n".join(
        f"  rank {s}:  "
        + "".join(cells.get((s, t), ".").ljust(width) for t in range(total)).rstrip()
        for s in range(p)
    )
    peaks = [
        max(sum({"F": 1, last: -1}.get(a, 0) for a, _, _ in o[: k + 1]) for k in range(len(o)))
        for o in orders
    ]
    return picture, 1 - sum(cost[a] for o in orders for a, _, _ in o) / (p * total), peaks
