"""Collectives: the communication primitives every other script is built from, each run on
small tensors with every rank's tensor before -> after printed in rank order, then a ring
all-reduce written out with send/recv and a naive one through a single root.

p ranks; each rank's tensor has N elements (for scatter, reduce-scatter and all-to-all: p chunks).
Bytes each rank sends in the usual bandwidth-optimal algorithm (x4 for fp32):

    broadcast(root)   every rank gets the root's x                                 ~N
    scatter(root)     rank r gets chunk r of the root's x                           root: (p-1)/p·N
    gather(root)      the root gets [x_0, ..., x_p-1]                               N (root receives (p-1)·N)
    reduce(root)      the root gets x_0 + ... + x_p-1                               ~N
    all-gather        every rank gets [x_0, ..., x_p-1]                             (p-1)·N
    all-reduce        every rank gets x_0 + ... + x_p-1  (DDP's gradient sync)      2(p-1)/p·N
    reduce-scatter    rank r gets chunk r of x_0 + ... + x_p-1 (ZeRO-2, FSDP)       (p-1)/p·N
    all-to-all        rank r gets chunk r of every rank's x: a transpose (MoE)      (p-1)/p·N

Ring all-reduce: cut x into p chunks (sizes differing by at most one when p does not divide N).
Reduce-scatter phase: p-1 steps, each rank sends one chunk to its right neighbour and adds the one
from its left; afterwards rank r holds the full sum of chunk r+1. All-gather phase: p-1 more steps
pass the finished chunks around. Each rank sends 2(p-1) chunks, 2(p-1)/p·N in all, whatever p
is: the bandwidth per rank stays flat as the world grows. The naive all-reduce (everyone sends
to the root, the root adds and sends the sum back) makes the root send and receive (p-1)·N.

    torchrun --standalone --nproc_per_node=4 collectives.py
    torchrun --standalone --nproc_per_node=4 collectives.py --numel 7 --ring-numel 10000019 --root 2
    python collectives.py                                           # one process: world size 1

A backend that lacks scatter, reduce-scatter or all-to-all (Gloo in torch 2.11 has no all_to_all) gets
it built from collectives that exist, and says so; the built versions are always checked too.
"""

import argparse
import datetime
import re
import time

import torch
import torch.distributed as dist

import common

UNSUPPORTED = re.compile(
    r"does not support|not supported|not implemented|unsupported", re.IGNORECASE
)


def rank_tensor(r, n, device):
    """Rank r's input: 100·r + [0, 1, ..., n-1], whole numbers, so any summation order is exact."""
    return 100.0 * r + torch.arange(n, dtype=torch.float32, device=device)


def try_native(name, call, args):
    """Run a collective; False (instead of an exception) if this backend does not have it, or if
    --avoid names it. Whether a backend has a collective is the same on every rank."""
    if name in args.avoid:
        return False
    try:
        call()
        return True
    except (RuntimeError, NotImplementedError, ValueError) as e:
        if not UNSUPPORTED.search(str(e)):
            raise
        return False


# --------------------------------------------------------------------------- the primitives


def primitives(args, device):
    """(name, meaning, before, after, expected, built) per primitive on this rank; None where there is no result
    (a non-root rank of gather/reduce); `built` is (how, result of the built version, native exists)."""
    r, p, root, n, k = dist.get_rank(), dist.get_world_size(), args.root, args.numel, args.chunk
    x = lambda j: rank_tensor(j, n, device)  # noqa: E731  rank j's N elements
    xs = lambda j: rank_tensor(j, p * k, device)  # noqa: E731  rank j's p chunks of k
    total, xall, out = sum(x(j) for j in range(p)), torch.cat([x(j) for j in range(p)]), []

    t = x(r)
    dist.broadcast(t, src=root)
    out.append(("broadcast", f"every rank gets rank {root}'s tensor", x(r), t, x(root), None))

    mine = torch.empty(k, device=device)
    chunks = list(xs(root).chunk(p)) if r == root else None
    native = try_native("scatter", lambda: dist.scatter(mine, chunks, src=root), args)
    whole = xs(r)  # built: broadcast all, keep own chunk
    dist.broadcast(whole, src=root)
    built = whole.chunk(p)[r]
    out.append(
        (
            "scatter",
            f"rank r gets chunk r of rank {root}'s tensor",
            xs(r) if r == root else None,
            mine if native else built,
            xs(root).chunk(p)[r],
            (
                "broadcast of the whole tensor, each rank keeping its chunk (p times the bytes)",
                built,
                native,
            ),
        )
    )

    parts = [torch.empty(n, device=device) for _ in range(p)] if r == root else None
    dist.gather(x(r), parts, dst=root)
    out.append(
        (
            "gather",
            f"rank {root} gets every rank's tensor, in rank order",
            x(r),
            torch.cat(parts) if r == root else None,
            xall if r == root else None,
            None,
        )
    )

    t = x(r)
    dist.reduce(t, dst=root)  # other ranks' t is left undefined
    out.append(
        (
            "reduce",
            f"rank {root} gets the sum of all ranks' tensors",
            x(r),
            t if r == root else None,
            total if r == root else None,
            None,
        )
    )

    parts = [torch.empty(n, device=device) for _ in range(p)]
    dist.all_gather(parts, x(r))
    out.append(
        (
            "all_gather",
            "every rank gets all ranks' tensors, in rank order",
            x(r),
            torch.cat(parts),
            xall,
            None,
        )
    )

    t = x(r)
    dist.all_reduce(t)
    out.append(
        ("all_reduce", "every rank gets the sum of all ranks' tensors", x(r), t, total, None)
    )

    mine = torch.empty(k, device=device)
    native = try_native(
        "reduce_scatter", lambda: dist.reduce_scatter(mine, list(xs(r).chunk(p))), args
    )
    built = xs(r)  # built: all-reduce, keep own chunk
    dist.all_reduce(built)
    built = built.chunk(p)[r]
    out.append(
        (
            "reduce_scatter",
            "rank r gets chunk r of the sum of all ranks' tensors",
            xs(r),
            mine if native else built,
            sum(xs(j) for j in range(p)).chunk(p)[r],
            ("all_reduce, each rank keeping its chunk (twice the bytes)", built, native),
        )
    )

    got = [torch.empty(k, device=device) for _ in range(p)]
    native = try_native("all_to_all", lambda: dist.all_to_all(got, list(xs(r).chunk(p))), args)
    pieces = [
        torch.empty(k, device=device) for _ in range(p)
    ]  # built: p scatters, rank j's in turn
    for j in range(p):
        dist.scatter(pieces[j], list(xs(j).chunk(p)) if r == j else None, src=j)
    out.append(
        (
            "all_to_all",
            "rank r gets chunk r of every rank's tensor (a transpose)",
            xs(r),
            torch.cat(got) if native else torch.cat(pieces),
            torch.cat([xs(j).chunk(p)[r] for j in range(p)]),
            ("p scatters, one from each rank (the same bytes)", torch.cat(pieces), native),
        )
    )
    return out


# --------------------------------------------------------------------------- all-reduce, written out


def exchange(send, to, recv, frm, sent):
    """Send `send` to rank `to` while receiving `recv` from rank `frm`. Both posted at once (a
    batch), so a ring of ranks all sending first cannot deadlock. Empty chunks (N < p) are skipped
    on both sides: the receiver's chunk index is the sender's, so both know it is empty."""
    ops = ([dist.P2POp(dist.isend, send, to)] if send.numel() else []) + (
        [dist.P2POp(dist.irecv, recv, frm)] if recv.numel() else []
    )
    for req in dist.batch_isend_irecv(ops) if ops else []:
        req.wait()
    sent[0] += send.numel() * send.element_size()


def ring_all_reduce(x, sent):
    """Sum x over all ranks in place: reduce-scatter phase, then all-gather phase."""
    r, p = dist.get_rank(), dist.get_world_size()
    chunks = x.view(-1).tensor_split(p)  # views into x; the first ones are larger
    right, left = (r + 1) % p, (r - 1) % p
    buf = torch.empty_like(chunks[0])
    for s in range(p - 1):  # reduce-scatter: add the left neighbour's
        send, recv = (
            chunks[(r - s) % p],
            chunks[(r - s - 1) % p],
        )  # partial sum of chunk r-s-1 to ours
        exchange(send, right, buf[: recv.numel()], left, sent)
        recv += buf[: recv.numel()]
    for s in range(p - 1):  # rank r now holds the sum of chunk r+1;
        send, recv = chunks[(r + 1 - s) % p], chunks[(r - s) % p]  # pass the finished chunks around
        exchange(send, right, recv, left, sent)
    return x


def naive_all_reduce(x, root, sent):
    """Every rank sends x to the root, which adds them in rank order and sends the sum back."""
    r, p = dist.get_rank(), dist.get_world_size()
    if r == root:
        total, part = x.clone(), torch.empty_like(x)
        for j in range(p):
            if j != root:
                dist.recv(part, j)
                total += part
        for j in range(p):
            if j != root:
                dist.send(total, j)
                sent[0] += total.numel() * total.element_size()
        x.copy_(total)
    else:
        dist.send(x, root)
        sent[0] += x.numel() * x.element_size()
        dist.recv(x, root)
    return x


def timed(fn, device, reps=3):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(reps):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def fmt(t):
    return "-" if t is None else str([int(v) for v in t.tolist()])


def show_ranks(lines):
    """Rank 0 prints one line from every rank, in rank order (gathered, so never interleaved)."""
    rows = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(lines, rows, dst=0)
    for row in rows or []:
        for line in row:
            common.log(line)


def setup(args):
    """Join the process group. torchrun (or common.launch) put RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT in the environment; LOCAL_RANK picks this process's GPU."""
    backend, device = common.pick_backend(
        args.backend
    )  # NCCL and a GPU per rank, else Gloo on the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, timeout=datetime.timedelta(seconds=args.timeout)
    )  # no restarts here
    return dist.get_rank(), dist.get_world_size(), device, backend


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def main():
    parser = common.Parser(
        description="Collectives on small tensors, and a ring all-reduce written out",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--numel", type=int, default=5, help="N: elements of each rank's small tensor"
    )
    parser.add_argument(
        "--chunk",
        type=int,
        default=2,
        help="elements per chunk in scatter, reduce-scatter, all-to-all",
    )
    parser.add_argument(
        "--ring-numel",
        type=int,
        default=1_000_003,
        help="N of the ring all-reduce timing and bytes",
    )
    parser.add_argument(
        "--root", type=int, default=0, help="root rank of broadcast, scatter, gather, reduce, naive"
    )
    parser.add_argument(
        "--avoid",
        nargs="*",
        default=[],
        choices=["scatter", "reduce_scatter", "all_to_all"],
        help="show these built from other collectives even where the backend has them",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto")
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds a collective may wait before the run fails",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="without torchrun: processes to spawn on this machine",
    )
    args = parser.parse_args()
    world = common.world_size(args)
    for name in ("numel", "chunk", "ring_numel"):
        common.check(
            getattr(args, name) >= 1,
            f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}",
        )
    common.check(
        0 <= args.root < world,
        f"--root {args.root} is not a rank of this world (ranks 0..{world - 1})",
    )
    common.check(args.timeout > 0, f"--timeout must be positive, got {args.timeout}")
    common.launch(run, args)


def run(args):
    rank, p, device, backend = setup(args)
    try:
        checks, built_for = {}, []
        common.log(
            f"collectives: {p} ranks, {backend} on {device.type}, torch {torch.__version__}; root {args.root}"
        )
        for name, meaning, before, after, expected, built in primitives(args, device):
            common.log(f"\n== {name}: {meaning}")
            show_ranks([f"  rank {rank}: {fmt(before)} -> {fmt(after)}"])
            checks[name] = after is None or torch.equal(after, expected)
            if built is not None:
                how, result, native = built
                checks[f"{name} (built)"] = torch.equal(result, expected)
                built_for += [] if native else [name]
                common.log(
                    f"  {'shown: built from' if not native else 'also built from'} {how}"
                    + (
                        ""
                        if native
                        else " (--avoid)"
                        if name in args.avoid
                        else f": {backend} in torch {torch.__version__} has no {name}"
                    )
                )

        x = rank_tensor(rank, args.numel, device)  # the small ring, printed
        after = ring_all_reduce(x.clone(), [0])
        common.log(
            f"\n== ring_all_reduce: send/recv around the ring, chunks of {[len(c) for c in x.tensor_split(p)]}"
        )
        show_ranks([f"  rank {rank}: {fmt(x)} -> {fmt(after)}"])
        checks["ring_all_reduce (small)"] = torch.equal(
            after, sum(rank_tensor(j, args.numel, device) for j in range(p))
        )

        g = torch.Generator().manual_seed(args.seed * 1000 + rank)
        x = torch.randint(-1000, 1000, (args.ring_numel,), generator=g).float().to(device)
        want = x.clone()
        dist.all_reduce(want)
        ring_sent, naive_sent = [0], [0]
        checks["ring_all_reduce == dist.all_reduce"] = torch.equal(
            ring_all_reduce(x.clone(), ring_sent), want
        )
        naive = naive_all_reduce(x.clone(), args.root, naive_sent)
        checks["naive_all_reduce == dist.all_reduce"] = torch.equal(naive, want)
        t_ring = timed(lambda: ring_all_reduce(x.clone(), [0]), device)
        t_lib = timed(lambda: dist.all_reduce(x.clone()), device)
        t_naive = timed(lambda: naive_all_reduce(x.clone(), args.root, [0]), device)
        N = 4 * args.ring_numel
        ring_formula = 2 * (p - 1) * N / p
        common.log(
            f"\nall-reduce of N = {args.ring_numel:,} fp32 = {common.fmt_bytes(N)} (whole numbers: the sums are "
            f"exact, so all three must agree bit for bit)"
        )
        common.log(
            f"  {'bytes sent':<12}{'ring':>12}{'2(p-1)/p·N':>12}{'naive':>12}   naive formula"
        )
        show_ranks(
            [
                f"  rank {rank:<7}{common.fmt_bytes(ring_sent[0]):>12}{common.fmt_bytes(ring_formula):>12}"
                f"{common.fmt_bytes(naive_sent[0]):>12}   {'(p-1)·N (root)' if rank == args.root else 'N'}"
            ]
        )
        common.log(
            f"  time (best of 3): ring {1e3 * t_ring:.1f} ms, dist.all_reduce {1e3 * t_lib:.1f} ms, "
            f"naive {1e3 * t_naive:.1f} ms"
        )

        every = [None] * p  # (ring bytes, naive bytes, checks) of each rank
        dist.all_gather_object(every, (ring_sent[0], naive_sent[0], checks))
        sent, checks = (
            every,
            {k: all(e[2][k] for e in every) for k in checks},
        )  # a check passes only everywhere
        failed = [k for k, v in checks.items() if not v]
        common.log(
            f"\nchecks: {sum(checks.values())}/{len(checks)} passed"
            + (f"; FAILED: {failed}" if failed else "")
            + (f"; built from other collectives: {built_for}" if built_for else "")
        )
        common.result(
            script="collectives",
            world_size=p,
            backend=backend,
            device=device.type,
            checks_passed=sum(checks.values()),
            checks_total=len(checks),
            failed=failed,
            built=built_for,
            ring_numel=args.ring_numel,
            ring_bytes_sent=[s[0] for s in sent],
            ring_bytes_formula=ring_formula,
            naive_bytes_sent=[s[1] for s in sent],
            naive_root_formula=(p - 1) * N,
            ring_s=t_ring,
            all_reduce_s=t_lib,
            naive_s=t_naive,
        )
        if failed:
            raise SystemExit(1)
    finally:
        cleanup()


if __name__ == "__main__":
    main()
