"""The data: MNIST (or the built-in synthetic digits) as Datasets; the exact evaluation loader."""

import contextlib
import io
import math
import os
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler

from common.messages import env_rank, fail, log
from common.model import IMAGE

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
SYNTHETIC_TRAIN, SYNTHETIC_TEST, SYNTHETIC_SEED = 60_000, 10_000, 20240607
TEST_BATCH = 512


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
    pts = torch.zeros(10, K, 2)
    mix = torch.zeros(10, samples, K)
    step = torch.zeros(10)
    for d, strokes in enumerate(digits):
        segments = []  # (first point, second point) of every straight piece of every stroke
        first = 0  # index of the stroke's first point among the digit's K
        for stroke in strokes:
            for i, point in enumerate(stroke):
                pts[d, first + i] = torch.tensor(point)
            segments += [(first + i, first + i + 1) for i in range(len(stroke) - 1)]
            first += len(stroke)
        lengths = torch.stack([(pts[d, j] - pts[d, i]).norm() for i, j in segments])
        ends = lengths.cumsum(0)  # the arc length at each segment's end
        step[d] = ends[-1] / samples
        for sample, at in enumerate((torch.arange(samples) + 0.5) * step[d]):
            n = int(torch.searchsorted(ends, at))  # the segment the point falls on
            t = float(1 - (ends[n] - at) / lengths[n])  # how far along it, 0..1
            start, end = segments[n]
            mix[d, sample, start] = 1 - t
            mix[d, sample, end] = t
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
        m = chunk  # draws for a whole chunk: the same draws for every n

        def u(low, high, *shape, generator=g, count=m):
            """count draws, uniform in [low, high), in the order they are made here."""
            return low + (high - low) * torch.rand(count, *shape, generator=generator)

        y = torch.randint(0, 10, (m,), generator=g)
        ctrl = (
            pts0[y] + 0.052 * torch.randn(m, pts0.shape[1], 2, generator=g) - 0.5
        )  # jittered, centred
        angle = u(-0.4, 0.4)
        sx = u(0.68, 1.12)  # scale x
        sy = u(0.72, 1.1)  # scale y
        shear = u(-0.4, 0.4)
        cos = angle.cos()
        sin = angle.sin()
        A = torch.stack(
            [
                torch.stack([sx * cos, sy * (shear * cos - sin)], -1),
                torch.stack([sx * sin, sy * (shear * sin + cos)], -1),
            ],
            -2,
        )  # rotate @ shear @ scale
        dots = (mix0[y] @ ctrl) @ A.transpose(1, 2) + 0.5 + u(-0.07, 0.07, 1, 2)  # [m, 64, 2]
        sigma = u(0.022, 0.045).view(m, 1)
        weight = (step0[y].view(m, 1) * sx.view(m, 1) / (sigma * 2.5066)).expand(m, dots.shape[1])
        # distractor: 12 dots on a short random segment, at 0.7 strength, in 65% of the images
        start_point = u(0.1, 0.9, 1, 2)
        direction = u(-0.15, 0.15, 1, 2)
        extra = start_point + direction * torch.linspace(0, 1, 12).view(1, 12, 1)
        on = (torch.rand(m, 1, generator=g) < 0.65).float()
        dots = torch.cat([dots, extra], 1)
        weight = torch.cat(
            [weight, (0.7 * on * direction.norm(dim=-1) / 12 / (sigma * 2.5066)).expand(m, 12)], 1
        )
        # Every draw above is made for the whole chunk, so the samples do not depend on n; the
        # drawing below (the costly part) is done only for the rows that are kept.
        rows = min(m, n - start)
        dots = dots[:rows]
        weight = weight[:rows]
        width = sigma[:rows].view(rows, 1, 1)
        # [rows, dots, 28]: each dot's Gaussian along x, and along y
        gx = torch.exp(-(((grid.view(1, 1, -1) - dots[..., :1]) / width) ** 2) / 2)
        gy = torch.exp(-(((grid.view(1, 1, -1) - dots[..., 1:]) / width) ** 2) / 2)
        ink = (gy * weight.unsqueeze(-1)).transpose(1, 2) @ gx  # [rows, 28 (y), 28 (x)]
        brightness = u(0.75, 1.0)[:rows].view(rows, 1, 1)
        noise = 0.08 * torch.randn(m, IMAGE, IMAGE, generator=g)[:rows]
        img = (1.6 * ink).clamp(0, 1) * brightness + noise
        images.append((img.clamp(0, 1) * 255).round().to(torch.uint8))
        labels.append(y[:rows])
    return torch.cat(images), torch.cat(labels)


def _read_idx(path):
    """An IDX file (MNIST's format): a big-endian header of magic (whose last byte is the number
    of dimensions) and sizes, then the uint8 values."""
    with open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    sizes = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    values = torch.frombuffer(bytearray(data[4 + 4 * dims :]), dtype=torch.uint8)
    return values.view(*sizes)


def _mnist(root, train, download):
    """(images uint8 [N, 28, 28], labels [N]) from root/MNIST/raw, in torchvision's layout. Read
    directly when the files are there (importing torchvision costs every rank over a second);
    through torchvision when they must be downloaded."""
    prefix = "train" if train else "t10k"
    raw = os.path.join(root, "MNIST", "raw")
    images = os.path.join(raw, f"{prefix}-images-idx3-ubyte")
    labels = os.path.join(raw, f"{prefix}-labels-idx1-ubyte")
    if not download or (os.path.exists(images) and os.path.exists(labels)):
        return _read_idx(images), _read_idx(labels)
    from torchvision.datasets import MNIST

    dataset = MNIST(root, train=train, download=download)
    return dataset.data, dataset.targets


def _find_mnist(data_dir, download):
    """'mnist' if MNIST is in data_dir (or, with download, could be downloaded there), else the
    reason it is not."""
    try:
        _mnist(data_dir, True, False)
        _mnist(data_dir, False, False)
        return "mnist"
    except Exception as error:
        reason = f"MNIST is not in {os.path.join(data_dir, 'MNIST', 'raw')}"
        if not download:
            return f"{reason} ({type(error).__name__})"
    old_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(20)
    try:
        quiet = io.StringIO()
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            _mnist(data_dir, True, True)
            _mnist(data_dir, False, True)
        return "mnist"
    except Exception as error:
        lines = str(error).strip().splitlines()
        detail = lines[-1][:120] if lines else type(error).__name__
        return f"{reason} and could not be downloaded ({detail})"
    finally:
        socket.setdefaulttimeout(old_timeout)


def _look_in_background(look, looks, device):
    """Run look() in a thread on the ranks where `looks` holds, while every rank all-reduces a
    "done" flag about once a second: no collective waits on a download, so a slow one cannot trip
    --timeout. Returns look()'s answer on the ranks that looked, None on the others."""
    answer = {}
    if looks:
        thread = threading.Thread(target=lambda: answer.update(found=look()), daemon=True)
        thread.start()
    while True:
        done = torch.tensor([0 if looks and not answer else 1], device=device)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item():
            return answer.get("found")
        time.sleep(0.1)  # a poll is one tiny all-reduce


def _agree_on_mnist(args, device):
    """(True if every node has MNIST in its own --data-dir, rank 0's reason if not).

    Rank 0 alone may download. Only when it is done does each other node's local rank 0 look in
    its own --data-dir, without downloading: on a shared file system it finds rank 0's finished
    files (never half-written ones), on a node-local disk it may find none and says why, once."""
    rank = env_rank()
    local_zero = int(os.environ.get("LOCAL_RANK", "0")) == 0

    def download():
        return _find_mnist(args.data_dir, download=True)

    def look():
        return _find_mnist(args.data_dir, download=False)

    found_by_rank_zero = _look_in_background(download, rank == 0, device)
    found_here = _look_in_background(look, local_zero and rank != 0, device)
    missing_here = (found_by_rank_zero or found_here or "mnist") != "mnist"
    have = torch.tensor([0 if missing_here else 1], device=device)
    dist.all_reduce(have, op=dist.ReduceOp.MIN)
    if missing_here and rank != 0:  # rank 0 gives its own reason with the decision
        kind = "error" if args.data == "mnist" else "warning"
        print(f"{kind} (rank {rank} on {socket.gethostname()}): {found_here}", file=sys.stderr)
    return bool(have.item()), found_by_rank_zero or ""


def _normalise(images):
    """uint8 [N, 28, 28] -> float [N, 1, 28, 28] with MNIST's mean and standard deviation."""
    return ((images.float() / 255 - MNIST_MEAN) / MNIST_STD).unsqueeze(1)


def _choose_source(args, device):
    """'mnist' or 'synthetic', the same on every rank, or one clear error for --data mnist."""
    if args.data == "synthetic":
        return "synthetic"
    if dist.is_available() and dist.is_initialized():
        have, why = _agree_on_mnist(args, device)
    else:
        why = _find_mnist(args.data_dir, download=True)
        have = why == "mnist"
    if have:
        return "mnist"
    if not why or why == "mnist":
        why = "MNIST is missing on another node (see its message)"
    if args.data == "mnist":
        fail(f"--data mnist: {why}. Use --data synthetic, or put the four IDX files there.")
    log(f"warning: {why}; using the built-in synthetic digit set instead (--data synthetic)")
    return "synthetic"


def load_data(args, device=None):
    """(train_set, test_set, name): MNIST when every node has it (or can download it), else the
    built-in synthetic digits, the same choice on every rank. Each set holds normalised float
    images [N, 1, 28, 28] and labels; call with the process group up (or in a single process)."""
    if args.simulate:  # one step of meta batches (common/simulate.py)
        from common.simulate import meta_data

        return (*meta_data(args), "simulated")
    source = _choose_source(args, device if device is not None else torch.device("cpu"))
    limit = args.limit or None
    if source == "mnist":
        train_images, train_labels = _mnist(args.data_dir, True, False)
        test_images, test_labels = _mnist(args.data_dir, False, False)
    else:
        train_size = min(limit or SYNTHETIC_TRAIN, SYNTHETIC_TRAIN)
        test_size = min(limit or SYNTHETIC_TEST, SYNTHETIC_TEST)
        train_images, train_labels = synthetic_digits(train_size, SYNTHETIC_SEED)
        test_images, test_labels = synthetic_digits(test_size, SYNTHETIC_SEED + 1)
    train_set = Digits(
        _normalise(train_images[:limit]), train_labels[:limit].long(), args.shift, args.seed
    )
    test_set = Digits(_normalise(test_images[:limit]), test_labels[:limit].long())
    return train_set, test_set, source


class Digits(Dataset):
    """Images and labels held as two tensors. The DataLoader fetches a whole batch at once through
    __getitems__ (its batched fetch, used when a dataset defines it): one indexing of the tensors
    and one vectorised shift per batch, so the input pipeline costs next to nothing per sample;
    __getitem__ gives the same samples one at a time.

    With shift=s (the training set, --shift), sample i in epoch e is moved by a whole number of
    pixels in [-s, s] along each axis, drawn from (seed, e, i) alone: every world size and every
    technique sees the same augmented batches. set_epoch(e) picks the epoch, as the sampler's
    does, also for DataLoader workers (--workers): each holds a copy of this dataset made when it
    started, and a persistent one lives for the whole run, so the epoch is kept in shared memory,
    where every copy reads the number set_epoch wrote. (A plain attribute would give every epoch
    epoch 0's shifts in the workers, a different run from --workers 0.)"""

    def __init__(self, x, y, shift=0, seed=0):
        self.x = x
        self.y = y
        self.shift = shift
        self.seed = seed
        self.shared_epoch = torch.zeros((), dtype=torch.long).share_memory_()
        self.background = x.amin() if len(x) else 0.0  # the value a shift fills in with

    def set_epoch(self, epoch):
        self.shared_epoch.fill_(epoch)

    @property
    def epoch(self):
        return int(self.shared_epoch)

    def __len__(self):
        return len(self.y)

    def _draw(self, i):
        """Sample i's random 32-bit number this epoch, from (seed, epoch, i) alone."""
        # a hash of a tuple of ints is deterministic (ints hash to themselves), unlike str's
        h = hash((self.seed, self.epoch, int(i))) & 0xFFFFFFFF
        return (h * 2654435761) & 0xFFFFFFFF  # Knuth's multiplicative hash: mixes the bits

    def _move(self, h):
        """The shift (dy, dx), each in [-s, s], that the draw h picks (ints or a tensor of them)."""
        s = self.shift
        choices = 2 * s + 1  # shifts -s..s
        return h % choices - s, (h // choices) % choices - s

    def __getitem__(self, i):
        x = self.x[i]
        s = self.shift
        if s:
            dy, dx = self._move(self._draw(i))
            padded = F.pad(x, (s, s, s, s), value=float(self.background))
            x = padded[:, s - dy : s - dy + IMAGE, s - dx : s - dx + IMAGE]
        return x, self.y[i]

    def batch(self, indices):
        """(images, labels) of the samples at `indices`, stacked: what __getitem__ gives one by
        one, made by gathers over the whole batch."""
        index = torch.as_tensor(indices, dtype=torch.long)
        x = self.x[index]
        s = self.shift
        if s and len(index):
            moves = torch.stack(self._move(torch.tensor([self._draw(i) for i in index.tolist()])))
            moves = moves.t().view(-1, 2, 1)  # [B, (dy, dx), 1]
            # output pixel (r, c) of sample b is padded pixel (s - dy_b + r, s - dx_b + c): two
            # gathers, the rows then the columns (cheaper on CPU than one 4-index gather)
            at = s - moves + torch.arange(IMAGE)  # [B, 2 (rows, columns), 28]
            padded = F.pad(x, (s, s, s, s), value=float(self.background))
            n, c, _, width = padded.shape
            rows = padded.gather(2, at[:, 0].view(n, 1, IMAGE, 1).expand(n, c, IMAGE, width))
            x = rows.gather(3, at[:, 1].view(n, 1, 1, IMAGE).expand(n, c, IMAGE, IMAGE))
        return x, self.y[index]

    def __getitems__(self, indices):
        # The DataLoader collates what this returns as a list of samples: views of one batch,
        # which it stacks in one copy.
        x, y = self.batch(indices)
        return list(zip(x.unbind(0), y.unbind(0), strict=True))


class PaddedShards(Sampler):
    """Evaluation sampler: rank r of W takes samples r, r+W, r+2W, ... and pads its list (with
    index -1, masked out) to ceil(N/W) entries, so every rank runs the same number of batches of
    the same size, and therefore the same collectives, while every sample is counted exactly once.
    (DistributedSampler pads with repeats, which would count them twice.)"""

    def __init__(self, n, rank=0, world=1):
        self.n = n
        self.indices = list(range(rank, n, world))
        per_rank = -(-n // world)  # ceil(n / W)
        self.indices += [-1] * (per_rank - len(self.indices))

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

    def __getitems__(self, indices):
        x, y = self.ds.batch([max(i, 0) for i in indices])
        return list(zip(x.unbind(0), y.unbind(0), [i >= 0 for i in indices], strict=True))


def test_loader(test_set, rank=0, world=1, batch=TEST_BATCH, pin_memory=False):
    """Batches of (images, labels, keep): see PaddedShards. world=1: every rank the whole set."""
    return DataLoader(
        _Masked(test_set),
        batch_size=batch,
        sampler=PaddedShards(len(test_set), rank, world),
        pin_memory=pin_memory,
    )
