"""What every technique script shares and no technique changes.

- the data: MNIST through torchvision (or a built-in synthetic digit set), held as
  one normalised tensor and dealt out by a DistributedSampler;
- the model: a small Vision Transformer whose pieces (embed, blocks, head) are what
  the techniques shard, slice and place;
- the shared command-line flags, seeding, backend/device choice, checkpoint files;
- measurement and reporting: per-rank bytes, the summary table, the RESULT line.

Process groups, wrapping, sharding, schedules and collectives are NOT here: each
script writes its technique out in full.
"""
import argparse
import contextlib
import io
import json
import math
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, Sampler

IMAGE, PATCH, CLASSES = 28, 7, 10            # 28x28 digits cut into 4x4 = 16 patches of 7x7
TOKENS = (IMAGE // PATCH) ** 2
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
SYNTHETIC_TRAIN, SYNTHETIC_TEST, SYNTHETIC_SEED = 60_000, 10_000, 20240607


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
    g.add_argument("--epochs", type=int, default=3)
    g.add_argument("--batch-size", type=int, default=128, help="GLOBAL batch: each of W data-parallel ranks gets batch/W")
    g.add_argument("--lr", type=float, default=None, help="default: 1e-3 for adamw, 0.05 for sgd")
    g.add_argument("--optim", choices=["adamw", "sgd"], default="adamw")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--data", choices=["auto", "mnist", "synthetic"], default="auto")
    g.add_argument("--data-dir", default="data")
    g.add_argument("--limit", type=int, default=0, help="use only the first N train and N test samples (0: all)")
    g.add_argument("--max-steps", type=int, default=0, help="stop after N optimizer steps (0: no limit)")
    g.add_argument("--dim", type=int, default=64)
    g.add_argument("--depth", type=int, default=4)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--save", default=None, help="write the plain, unsharded state_dict here at the end")
    g.add_argument("--load", default=None, help="start from a state_dict written by any script's --save")
    g.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto")
    g.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait before the run fails")
    g.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return p


def parse_args(parser, argv=None):
    """Parse and check the shared flags; each script checks its own afterwards."""
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "dim", "depth", "heads"):
        check(getattr(args, name) > 0, f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("limit", "max_steps"):
        check(getattr(args, name) >= 0, f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    check(args.timeout > 0, f"--timeout must be positive, got {args.timeout}")
    check(args.dim % args.heads == 0, f"--dim {args.dim} is not divisible by --heads {args.heads}")
    if args.lr is None:
        args.lr = 1e-3 if args.optim == "adamw" else 0.05
    if args.load is not None:
        check(os.path.isfile(args.load), f"--load {args.load}: no such file")
    return args


def seed_everything(seed):
    import random
    random.seed(seed)
    torch.manual_seed(seed)   # also seeds every CUDA device


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_env():
    """Let a plain `python script.py` (no torchrun) run as a world of one process."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def port_is_free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


# --------------------------------------------------------------------------- backend and device

def pick_backend(requested):
    """'auto' -> NCCL when every local rank has its own GPU, else Gloo on CPU.

    Called before the process group exists, so a bad --backend fails before any rendezvous.
    Returns (backend, device) for this process.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    enough = gpus >= local_world and dist.is_nccl_available()
    if requested == "nccl":
        check(enough, f"--backend nccl needs one CUDA GPU per local rank: {local_world} local ranks, {gpus} GPUs visible"
                      + ("" if dist.is_nccl_available() or gpus == 0 else ", and this torch has no NCCL"))
    backend = requested if requested != "auto" else ("nccl" if gpus > 0 and enough else "gloo")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        why = f"{gpus} GPUs for {local_world} local ranks"
    else:
        device = torch.device("cpu")
        why = "no GPUs visible" if gpus == 0 else (f"{gpus} GPUs for {local_world} local ranks" if requested == "auto"
                                                  else "asked for")
        if "OMP_NUM_THREADS" not in os.environ:     # torchrun sets it; mp.spawn and python do not
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    log(f"backend: {backend} on {device.type} ({why})")
    return backend, device


# --------------------------------------------------------------------------- data

def _digit_strokes():
    """Each digit as strokes (polylines) in the unit square, x right, y down."""
    def arc(cx, cy, rx, ry, a0, a1, n=9):
        return [(cx + rx * math.cos(math.radians(a0 + (a1 - a0) * i / (n - 1))),
                 cy + ry * math.sin(math.radians(a0 + (a1 - a0) * i / (n - 1)))) for i in range(n)]
    return [
        [arc(.5, .5, .26, .37, 0, 360, 13)],                                                   # 0
        [[(.36, .28), (.52, .12), (.52, .88)]],                                                # 1
        [arc(.5, .34, .25, .21, 195, 390, 8) + [(.22, .88), (.8, .88)]],                      # 2
        [arc(.5, .31, .23, .18, 200, 450, 8), arc(.5, .68, .27, .2, 270, 520, 9)],            # 3
        [[(.62, .88), (.62, .12), (.2, .62), (.82, .62)]],                                     # 4
        [[(.74, .14), (.36, .14), (.32, .46)] + arc(.5, .65, .25, .22, 220, 510, 9)],         # 5
        [[(.7, .12), (.45, .3), (.3, .58)] + arc(.5, .68, .21, .2, 180, 540, 11)],            # 6
        [[(.22, .14), (.78, .14), (.42, .88)]],                                                # 7
        [arc(.5, .3, .2, .18, 0, 360, 11), arc(.5, .68, .25, .21, 0, 360, 11)],               # 8
        [arc(.5, .34, .22, .2, 0, 360, 11), [(.72, .36), (.62, .88)]],                        # 9
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
    grid = (torch.arange(IMAGE, dtype=torch.float32) + 0.5) / IMAGE                     # pixel centres
    images, labels = [], []
    for start in range(0, n, chunk):
        g = torch.Generator().manual_seed(seed * 1_000_003 + start)
        m = chunk                         # always a whole chunk, cut at the end: the same draws for every n
        u = lambda lo, hi, *shape: lo + (hi - lo) * torch.rand(m, *shape, generator=g)   # noqa: E731
        y = torch.randint(0, 10, (m,), generator=g)
        ctrl = pts0[y] + 0.045 * torch.randn(m, pts0.shape[1], 2, generator=g) - 0.5   # jittered, centred
        ang, sx, sy, sh = u(-0.35, 0.35), u(0.7, 1.1), u(0.75, 1.1), u(-0.35, 0.35)
        cos, sin = ang.cos(), ang.sin()
        A = torch.stack([torch.stack([sx * cos, sy * (sh * cos - sin)], -1),
                         torch.stack([sx * sin, sy * (sh * sin + cos)], -1)], -2)       # rotate @ shear @ scale
        dots = (mix0[y] @ ctrl) @ A.transpose(1, 2) + 0.5 + u(-0.07, 0.07, 1, 2)       # [m, 64, 2]
        sigma = u(0.022, 0.045).view(m, 1)
        weight = (step0[y].view(m, 1) * sx.view(m, 1) / (sigma * 2.5066)).expand(m, dots.shape[1])
        # distractor: 12 dots on a short random segment, at half strength, in half the images
        a, b = u(0.1, 0.9, 1, 2), u(-0.15, 0.15, 1, 2)
        extra = a + b * torch.linspace(0, 1, 12).view(1, 12, 1)
        on = (torch.rand(m, 1, generator=g) < 0.5).float()
        dots = torch.cat([dots, extra], 1)
        weight = torch.cat([weight, (0.5 * on * b.norm(dim=-1) / 12 / (sigma * 2.5066)).expand(m, 12)], 1)
        gx = torch.exp(-((grid.view(1, 1, -1) - dots[..., :1]) / sigma.view(m, 1, 1)) ** 2 / 2)   # [m, dots, 28]
        gy = torch.exp(-((grid.view(1, 1, -1) - dots[..., 1:]) / sigma.view(m, 1, 1)) ** 2 / 2)
        ink = (gy * weight.unsqueeze(-1)).transpose(1, 2) @ gx                          # [m, 28 (y), 28 (x)]
        img = (1.6 * ink).clamp(0, 1) * u(0.75, 1.0).view(m, 1, 1) + 0.08 * torch.randn(m, IMAGE, IMAGE, generator=g)
        images.append((img.clamp(0, 1) * 255).round().to(torch.uint8))
        labels.append(y)
    return torch.cat(images)[:n], torch.cat(labels)[:n]


def _mnist(root, train, download):
    from torchvision.datasets import MNIST
    ds = MNIST(root, train=train, download=download)
    return ds.data, ds.targets


def _find_mnist(args):
    """'mnist' if MNIST is on disk (or could be downloaded), else the reason it is not. Rank 0 only."""
    try:
        _mnist(args.data_dir, True, False), _mnist(args.data_dir, False, False)
        return "mnist"
    except Exception:
        pass
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(20)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            _mnist(args.data_dir, True, True), _mnist(args.data_dir, False, True)
        return "mnist"
    except Exception as e:
        return f"MNIST is not in {os.path.join(args.data_dir, 'MNIST', 'raw')} and could not be downloaded " \
               f"({str(e).strip().splitlines()[-1][:120] if str(e).strip() else type(e).__name__})"
    finally:
        socket.setdefaulttimeout(old)


def load_data(args):
    """(train_x, train_y, test_x, test_y, name): normalised float images [N, 1, 28, 28] and labels.

    Rank 0 looks for MNIST (downloading it if needed) while the others wait; it then tells
    every rank what to load, so all ranks agree on the data even if only rank 0 can see it.
    """
    source = None
    if env_rank() == 0:
        source = "synthetic" if args.data == "synthetic" else _find_mnist(args)
    if dist.is_available() and dist.is_initialized():
        box = [source]
        dist.broadcast_object_list(box, src=0)
        source = box[0]
    if source not in ("mnist", "synthetic"):
        if args.data == "mnist":
            fail(f"--data mnist: {source}. Use --data synthetic, or put the four IDX files there.")
        log(f"warning: {source}; using the built-in synthetic digit set instead (--data synthetic)")
        source = "synthetic"
    limit = args.limit or None
    if source == "mnist":
        (xtr, ytr), (xte, yte) = _mnist(args.data_dir, True, False), _mnist(args.data_dir, False, False)
        xtr, ytr, xte, yte = xtr[:limit], ytr[:limit], xte[:limit], yte[:limit]
    else:
        ntr = min(limit or SYNTHETIC_TRAIN, SYNTHETIC_TRAIN)
        nte = min(limit or SYNTHETIC_TEST, SYNTHETIC_TEST)
        xtr, ytr = synthetic_digits(ntr, SYNTHETIC_SEED)
        xte, yte = synthetic_digits(nte, SYNTHETIC_SEED + 1)
    norm = lambda x: ((x.float() / 255 - MNIST_MEAN) / MNIST_STD).unsqueeze(1)  # noqa: E731
    return norm(xtr), ytr.long(), norm(xte), yte.long(), source


class Batches(Dataset):
    """Indexed by a list of sample indices: one tensor gather per batch, no per-sample work."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, idx):
        idx = torch.as_tensor(idx)
        return self.x[idx], self.y[idx]


def train_loader(x, y, global_batch, rank=0, world=1, seed=0):
    """Rank `rank` of `world` data-parallel ranks gets batch/world samples of each global batch.

    The DistributedSampler shuffles with `seed + epoch` (call sampler.set_epoch every epoch)
    and deals index i to rank i % world, so global batch k holds the same samples at every
    world size. drop_last: every step sees a full batch on every rank.
    Returns (loader, sampler).
    """
    ds = Batches(x, y)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
    return DataLoader(ds, sampler=BatchSampler(sampler, global_batch // world, drop_last=True), batch_size=None), sampler


class ShardSampler(Sampler):
    """Samples rank, rank+world, rank+2*world, ...: no padding, so every sample is counted once.

    (DistributedSampler pads the last round with repeats, which would count them twice.)
    """

    def __init__(self, n, rank=0, world=1):
        self.indices = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def test_loader(x, y, batch, rank=0, world=1):
    return DataLoader(Batches(x, y), sampler=BatchSampler(ShardSampler(len(y), rank, world), batch, False),
                      batch_size=None)


# --------------------------------------------------------------------------- model

class PatchEmbed(nn.Module):
    """Cut the image into 7x7 patches, project each to `dim`, add a learned position embedding."""

    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(PATCH * PATCH, dim)
        self.pos = nn.Parameter(torch.zeros(1, TOKENS, dim))

    def forward(self, img):                                        # [B, 1, 28, 28] -> [B, 16, dim]
        B, n = img.shape[0], IMAGE // PATCH
        patches = img.reshape(B, n, PATCH, n, PATCH).transpose(2, 3).reshape(B, TOKENS, PATCH * PATCH)
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
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, _ = x.shape
        split = lambda t: t.view(B, T, -1, self.head_dim).transpose(1, 2)   # noqa: E731  [B, heads, T, hd]
        out = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        return self.proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm Transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, dim, heads, mlp_ratio=4):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), MLP(dim, mlp_ratio * dim)

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

    def __init__(self, dim=64, depth=4, heads=4):
        super().__init__()
        self.embed = PatchEmbed(dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.head = Head(dim)

    def forward(self, img):
        x = self.embed(img)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(args):
    """The common model with weights that depend only on --seed (built on CPU, same on every rank)."""
    torch.manual_seed(args.seed)
    model = ViT(args.dim, args.depth, args.heads)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    nn.init.trunc_normal_(model.embed.pos, std=0.02)
    return model


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
        fail(f"--load {path}: not a checkpoint torch.load can read ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
    if isinstance(sd, dict) and "model" in sd and isinstance(sd["model"], dict):
        sd = sd["model"]                                    # a ddp_torchrun.py snapshot holds it under "model"
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        fail(f"--load {path}: not a state_dict (expected a dict of tensors, got {type(sd).__name__})")
    shapes = {k: tuple(v.shape) for k, v in reference.items()}
    for k, shape in shapes.items():
        if k not in sd:
            fail(f"--load {path}: missing tensor '{k}' (was it saved from a model with other --dim/--depth/--heads?)")
        if tuple(sd[k].shape) != shape:
            fail(f"--load {path}: tensor '{k}' has shape {tuple(sd[k].shape)}, this model needs {shape} "
                 f"(check --dim/--depth/--heads)")
    extra = sorted(set(sd) - set(shapes))
    check(not extra, f"--load {path}: unexpected tensor '{extra[0] if extra else ''}' (not in this model)")
    return sd


# --------------------------------------------------------------------------- measurement

def local_numel(t):
    """Elements this rank holds for `t` (a DTensor counts only its local shard)."""
    return t.to_local().numel() if hasattr(t, "to_local") else t.numel()


def tensor_bytes(tensors):
    return sum(local_numel(t) * t.element_size() for t in tensors if t is not None)


def param_bytes(params):
    return tensor_bytes(params)


def grad_bytes(params):
    return tensor_bytes(p.grad for p in params)


def optimizer_bytes(optimizer):
    """Bytes of optimizer state on this rank (Adam's exp_avg and exp_avg_sq, SGD's momentum);
    the scalar step counters are left out, as the papers do."""
    return tensor_bytes(v for state in optimizer.state.values() for k, v in state.items()
                        if torch.is_tensor(v) and k != "step")


def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def report(rows, title="per-rank memory and communication"):
    """Print `rows` of (what, measured, formula value, formula text) as a small table on rank 0."""
    log(f"\n{title}")
    log(f"  {'':<24}{'measured':>14}{'formula':>14}   formula")
    for what, measured, expected, text in rows:
        ok = "" if expected is None or measured == expected else "  (differs)"
        log(f"  {what:<24}{fmt_bytes(measured):>14}{fmt_bytes(expected) if expected is not None else '':>14}"
            f"   {text}{ok}")


def result(**fields):
    """The machine-readable last line that run_all.sh and the tests read (rank 0 only)."""
    log("RESULT " + json.dumps(fields, sort_keys=False))


def progress(iterable, args, **kw):
    if args.no_progress or env_rank() != 0:
        return iterable
    from tqdm import tqdm
    return tqdm(iterable, leave=False, dynamic_ncols=True, **kw)
