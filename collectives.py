"""Collectives: the primitives every other script is built from, each run on small tensors, every
rank's before -> after printed in rank order and checked against its definition; then all-reduce
written out around a ring with send/recv, and naively through one root, both checked against
dist.all_reduce. p ranks; each rank's tensor has N elements (for scatter, reduce-scatter and
all-to-all: p chunks). Bytes each rank sends in the usual bandwidth-optimal algorithm (x4 fp32):

    broadcast(root)  every rank gets the root's x                              ~N
    scatter(root)    rank r gets chunk r of the root's x                       root: (p-1)/p·N
    gather(root)     the root gets [x_0, ..., x_p-1]                           N (root: (p-1)·N)
    reduce(root)     the root gets x_0 + ... + x_p-1                           ~N
    all-gather       every rank gets [x_0, ..., x_p-1]                         (p-1)·N
    all-reduce       every rank gets x_0 + ... + x_p-1 (DDP's gradient sync)   2(p-1)/p·N
    reduce-scatter   rank r gets chunk r of x_0 + ... + x_p-1 (ZeRO-2, FSDP)   (p-1)/p·N
    all-to-all       rank r gets chunk r of every rank's x: a transpose (MoE)  (p-1)/p·N

The ring all-reduce (a reduce-scatter, then an all-gather, p-1 steps each) sends 2(p-1)/p·N per
rank whatever p is; the naive one makes the root send and receive (p-1)·N. Paper: Sergeev and
Del Balso 2018, "Horovod: fast and easy distributed deep learning in TensorFlow",
https://arxiv.org/abs/1802.05799. The ring step by step, missing collectives:
docs/techniques.md#collectives-and-the-ring-all-reduce

    torchrun --standalone --nproc_per_node=4 collectives.py
    torchrun --standalone --nproc_per_node=4 collectives.py --numel 7 --ring-numel 10000019 --root 2
    python collectives.py                                           # one process: world size 1
"""

import argparse
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import common

# How a backend says it lacks a collective (the words differ between backends and versions).
UNSUPPORTED = re.compile(
    r"does not support|not supported|not implemented|unsupported", re.IGNORECASE
)


@dataclass
class Built:
    """A primitive built from other collectives, for backends that lack it."""

    how: str  # the collectives it is built from, in words
    result: torch.Tensor  # what the built version gave this rank


@dataclass
class Outcome:
    """One primitive as this rank saw it. `before` and `after` are None where the rank has no
    input or no result (a non-root rank of scatter's input, of gather's or reduce's result)."""

    name: str
    meaning: str
    before: torch.Tensor | None
    after: torch.Tensor | None  # the backend's result; the built version's where it has none
    expected: torch.Tensor | None  # the definition, worked out on this rank from every input
    built: Built | None = None  # for the primitives a backend may lack
    native: bool = True  # whether the backend ran the primitive itself


def rank_tensor(rank, numel, device):
    """Rank `rank`'s input: 100·rank + [0, 1, ..., numel-1], whole numbers, so any order of
    summation is exact and every rank can work out every other rank's input."""
    return 100.0 * rank + torch.arange(numel, dtype=torch.float32, device=device)


def try_native(name, call, args):
    """Run a collective; False (instead of an exception) if this backend does not have it, or if
    --avoid names it. Whether a backend has a collective is the same on every rank, so every rank
    takes the same branch and issues the same collectives after it."""
    if name in args.avoid:
        return False
    try:
        call()
    except (RuntimeError, NotImplementedError, ValueError) as error:
        if not UNSUPPORTED.search(str(error)):
            raise
        return False
    return True


# ---------------------------------------------------------------- the primitives
# Each function runs one primitive on this rank's input and returns its Outcome. The inputs:
# rank j holds N elements, rank_tensor(j, N), or p chunks of k, rank_tensor(j, p·k).


def show_broadcast(args, device):
    rank = dist.get_rank()
    mine = rank_tensor(rank, args.numel, device)
    received = mine.clone()  # the broadcast overwrites it with the root's
    dist.broadcast(received, src=args.root)
    expected = rank_tensor(args.root, args.numel, device)
    meaning = f"every rank gets rank {args.root}'s tensor"
    return Outcome("broadcast", meaning, mine, received, expected)


def show_scatter(args, device):
    rank = dist.get_rank()
    world = dist.get_world_size()
    root = args.root
    root_tensor = rank_tensor(root, world * args.chunk, device)  # every rank can work it out
    root_chunks = root_tensor.chunk(world)
    received = torch.empty(args.chunk, device=device)
    to_send = None  # scatter reads the chunks on the root only
    if rank == root:
        to_send = list(root_chunks)
    native = try_native("scatter", lambda: dist.scatter(received, to_send, src=root), args)
    # Built: the root broadcasts its whole tensor and each rank keeps its own chunk (p times the
    # bytes). `whole` starts as this rank's own input, so a broadcast that did not overwrite it
    # would fail the check.
    whole = rank_tensor(rank, world * args.chunk, device)
    dist.broadcast(whole, src=root)
    built = Built(
        "broadcast of the whole tensor, each rank keeping its chunk (p times the bytes)",
        whole.chunk(world)[rank],
    )
    before = root_tensor if rank == root else None
    after = received if native else built.result
    meaning = f"rank r gets chunk r of rank {root}'s tensor"
    return Outcome("scatter", meaning, before, after, root_chunks[rank], built, native)


def show_gather(args, device):
    rank = dist.get_rank()
    world = dist.get_world_size()
    root = args.root
    mine = rank_tensor(rank, args.numel, device)
    parts = None
    if rank == root:
        parts = [torch.empty(args.numel, device=device) for _ in range(world)]
    dist.gather(mine, parts, dst=root)
    after = None
    expected = None
    if rank == root:
        after = torch.cat(parts)
        expected = torch.cat([rank_tensor(j, args.numel, device) for j in range(world)])
    meaning = f"rank {root} gets every rank's tensor, in rank order"
    return Outcome("gather", meaning, mine, after, expected)


def show_reduce(args, device):
    rank = dist.get_rank()
    world = dist.get_world_size()
    root = args.root
    mine = rank_tensor(rank, args.numel, device)
    total = mine.clone()
    dist.reduce(total, dst=root)  # on the other ranks `total` is left undefined
    after = None
    expected = None
    if rank == root:
        after = total
        expected = sum(rank_tensor(j, args.numel, device) for j in range(world))
    meaning = f"rank {root} gets the sum of all ranks' tensors"
    return Outcome("reduce", meaning, mine, after, expected)


def show_all_gather(args, device):
    rank = dist.get_rank()
    world = dist.get_world_size()
    mine = rank_tensor(rank, args.numel, device)
    parts = [torch.empty(args.numel, device=device) for _ in range(world)]
    dist.all_gather(parts, mine)
    expected = torch.cat([rank_tensor(j, args.numel, device) for j in range(world)])
    meaning = "every rank gets all ranks' tensors, in rank order"
    return Outcome("all_gather", meaning, mine, torch.cat(parts), expected)


def show_all_reduce(args, device):
    rank = dist.get_rank()
    world = dist.get_world_size()
    mine = rank_tensor(rank, args.numel, device)
    total = mine.clone()
    dist.all_reduce(total)
    expected = sum(rank_tensor(j, args.numel, device) for j in range(world))
    meaning = "every rank gets the sum of all ranks' tensors"
    return Outcome("all_reduce", meaning, mine, total, expected)


def show_reduce_scatter(args, device):
    rank = dist.get_rank()
    world = dist.get_world_size()
    mine = rank_tensor(rank, world * args.chunk, device)
    received = torch.empty(args.chunk, device=device)
    chunks = list(mine.chunk(world))
    native = try_native("reduce_scatter", lambda: dist.reduce_scatter(received, chunks), args)
    # Built: an all-reduce of the whole tensor, each rank keeping its chunk (twice the bytes).
    total = mine.clone()
    dist.all_reduce(total)
    built = Built(
        "all_reduce, each rank keeping its chunk (twice the bytes)",
        total.chunk(world)[rank],
    )
    sum_of_all = sum(rank_tensor(j, world * args.chunk, device) for j in range(world))
    expected = sum_of_all.chunk(world)[rank]
    after = received if native else built.result
    meaning = "rank r gets chunk r of the sum of all ranks' tensors"
    return Outcome("reduce_scatter", meaning, mine, after, expected, built, native)


def show_all_to_all(args, device):
    rank = dist.get_rank()
    world = dist.get_world_size()
    mine = rank_tensor(rank, world * args.chunk, device)
    received = [torch.empty(args.chunk, device=device) for _ in range(world)]
    chunks = list(mine.chunk(world))
    native = try_native("all_to_all", lambda: dist.all_to_all(received, chunks), args)
    # Built: p scatters, each rank the root of one in turn, so chunk r of rank j lands on rank r
    # (Gloo and NCCL both have scatter).
    built_received = [torch.empty(args.chunk, device=device) for _ in range(world)]
    for source in range(world):
        to_send = None
        if rank == source:
            to_send = chunks
        dist.scatter(built_received[source], to_send, src=source)
    built = Built("p scatters, one from each rank (the same bytes)", torch.cat(built_received))
    inputs = [rank_tensor(j, world * args.chunk, device) for j in range(world)]
    expected = torch.cat([tensor.chunk(world)[rank] for tensor in inputs])
    after = torch.cat(received) if native else built.result
    meaning = "rank r gets chunk r of every rank's tensor (a transpose)"
    return Outcome("all_to_all", meaning, mine, after, expected, built, native)


PRIMITIVES = (
    show_broadcast,
    show_scatter,
    show_gather,
    show_reduce,
    show_all_gather,
    show_all_reduce,
    show_reduce_scatter,
    show_all_to_all,
)


# ---------------------------------------------------------------- all-reduce, written out


def exchange(outgoing, right, incoming, left):
    """Send `outgoing` to rank `right` while receiving `incoming` from rank `left`. Both are posted
    in one batch: in a ring where every rank sends first, blocking sends would wait for each other
    forever (on NCCL). An empty chunk (N < p) is neither sent nor received: the sender's chunk
    index is the receiver's, so both sides know it is empty. Returns the bytes sent."""
    ops = []
    if outgoing.numel() > 0:
        ops.append(dist.P2POp(dist.isend, outgoing, right))
    if incoming.numel() > 0:
        ops.append(dist.P2POp(dist.irecv, incoming, left))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return outgoing.numel() * outgoing.element_size()


def ring_all_reduce(x):
    """Sum x over all ranks in place, like dist.all_reduce: a reduce-scatter phase, then an
    all-gather phase. Returns the bytes this rank sent."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    right = (rank + 1) % world
    left = (rank - 1) % world
    # Views into x, so that adding into a chunk sums x in place; when p does not divide N the
    # first chunks are one element larger.
    chunks = x.view(-1).tensor_split(world)
    buffer = torch.empty_like(chunks[0])  # the largest chunk: every incoming one fits
    sent = 0
    # Reduce-scatter: at step s, pass on our partial sum of chunk r-s and add the left
    # neighbour's partial sum of chunk r-s-1 to ours. After p-1 steps rank r holds the full sum
    # of chunk r+1.
    for step in range(world - 1):
        outgoing = chunks[(rank - step) % world]
        accumulating = chunks[(rank - step - 1) % world]
        incoming = buffer[: accumulating.numel()]
        sent += exchange(outgoing, right, incoming, left)
        accumulating += incoming
    # All-gather: at step s, pass on the finished chunk r+1-s; the left neighbour's finished
    # chunk r-s arrives in its place.
    for step in range(world - 1):
        finished = chunks[(rank + 1 - step) % world]
        arriving = chunks[(rank - step) % world]
        sent += exchange(finished, right, arriving, left)
    return sent


def naive_all_reduce(x, root):
    """Sum x over all ranks in place through one root: every rank sends x to the root, which adds
    them up and sends the sum back to each. Returns the bytes this rank sent.

    Plain send and recv, one at a time, are safe here, unlike in the ring: no two ranks send to
    each other at the same time (the root receives from every peer before it sends to any). They
    block only on Gloo, where they return once the message has gone; on NCCL they return once
    queued on the communicator's stream, and it is that stream that waits for the peer (a send
    whose receive is never posted hangs the GPU, not the call)."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    message_bytes = x.numel() * x.element_size()
    if rank != root:
        dist.send(x, root)
        dist.recv(x, root)
        return message_bytes
    total = x.clone()
    incoming = torch.empty_like(x)
    peers = [peer for peer in range(world) if peer != root]
    for peer in peers:
        dist.recv(incoming, peer)
        total += incoming
    for peer in peers:
        dist.send(total, peer)
    x.copy_(total)
    return len(peers) * message_bytes


def formula(world, numel):
    """The docstring's bytes sent in an all-reduce of `numel` fp32 elements: by each rank around
    the ring, and by the root of the naive one (its other ranks send N once)."""
    nbytes = 4 * numel
    return dict(ring=2 * (world - 1) * nbytes / world, naive_root=(world - 1) * nbytes)


def best_time(fn, device, repeats=3):
    """The fastest of `repeats` runs of fn, in seconds: every rank starts together (a barrier),
    and on a GPU the clock stops only when the kernels are done."""
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


# ---------------------------------------------------------------- showing and checking


def printable(tensor):
    """A tensor of whole numbers as a list, '-' for no tensor (the test reads these back)."""
    if tensor is None:
        return "-"
    return str([int(value) for value in tensor.tolist()])


def show_ranks(line):
    """Rank 0 logs one line from every rank, in rank order (gathered, so never interleaved)."""
    rows = None  # gather_object fills a list on the destination only
    if dist.get_rank() == 0:
        rows = [None] * dist.get_world_size()
    dist.gather_object(line, rows, dst=0)
    if rows is None:
        return
    for row in rows:
        common.log(row)


def check_primitives(args, device, backend):
    """Run every primitive, print each rank's before -> after, and check each result and each
    built version against its definition. Returns ({check: passed on this rank}, [the primitives
    shown built, because the backend lacks them or --avoid names them])."""
    rank = dist.get_rank()
    checks = {}
    built_for = []
    for show in PRIMITIVES:
        outcome = show(args, device)
        common.log(f"\n== {outcome.name}: {outcome.meaning}")
        show_ranks(f"  rank {rank}: {printable(outcome.before)} -> {printable(outcome.after)}")
        if outcome.after is None:
            checks[outcome.name] = True  # a rank without a result has nothing to check
        else:
            checks[outcome.name] = torch.equal(outcome.after, outcome.expected)
        built = outcome.built
        if built is None:
            continue
        checks[f"{outcome.name} (built)"] = torch.equal(built.result, outcome.expected)
        if outcome.native:
            common.log(f"  also built from {built.how}")
            continue
        built_for.append(outcome.name)
        if outcome.name in args.avoid:
            common.log(f"  shown: built from {built.how} (--avoid)")
        else:
            missing = f"{backend} in torch {torch.__version__} has no {outcome.name}"
            common.log(f"  shown: built from {built.how}: {missing}")
    return checks, built_for


def check_small_ring(args, device):
    """The ring all-reduce on the small tensors, printed like the primitives. Returns whether it
    gave this rank the sum of every rank's tensor."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    mine = rank_tensor(rank, args.numel, device)
    total = mine.clone()
    ring_all_reduce(total)
    chunk_sizes = [len(chunk) for chunk in mine.tensor_split(world)]
    common.log(f"\n== ring_all_reduce: send/recv around the ring, chunks of {chunk_sizes}")
    show_ranks(f"  rank {rank}: {printable(mine)} -> {printable(total)}")
    expected = sum(rank_tensor(j, args.numel, device) for j in range(world))
    return torch.equal(total, expected)


def compare_all_reduces(args, device):
    """The ring and the naive all-reduce against dist.all_reduce on N = --ring-numel random whole
    numbers (the sums are exact, so all three must agree bit for bit), the bytes each rank sent,
    and the best of 3 times of each. Returns (checks, measured)."""
    rank = dist.get_rank()
    # A different input on every rank, and the same on every run with the same --seed.
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    values = torch.randint(-1000, 1000, (args.ring_numel,), generator=generator)
    x = values.float().to(device)
    expected = x.clone()
    dist.all_reduce(expected)
    ring_total = x.clone()
    ring_bytes = ring_all_reduce(ring_total)
    naive_total = x.clone()
    naive_bytes = naive_all_reduce(naive_total, args.root)
    checks = {
        "ring_all_reduce == dist.all_reduce": torch.equal(ring_total, expected),
        "naive_all_reduce == dist.all_reduce": torch.equal(naive_total, expected),
    }
    # The timed runs work on copies: x stays this rank's input.
    measured = dict(
        ring_bytes=ring_bytes,
        naive_bytes=naive_bytes,
        ring_s=best_time(lambda: ring_all_reduce(x.clone()), device),
        all_reduce_s=best_time(lambda: dist.all_reduce(x.clone()), device),
        naive_s=best_time(lambda: naive_all_reduce(x.clone(), args.root), device),
    )
    return checks, measured


def show_all_reduces(args, measured):
    """The bytes table, one row per rank, next to the formulas, and the times."""
    rank = dist.get_rank()
    expected = formula(dist.get_world_size(), args.ring_numel)
    nbytes = 4 * args.ring_numel
    common.log(
        f"\nall-reduce of N = {args.ring_numel:,} fp32 = {common.fmt_bytes(nbytes)} "
        "(whole numbers: the sums are exact, so all three must agree bit for bit)"
    )
    common.log(f"  {'bytes sent':<12}{'ring':>12}{'2(p-1)/p·N':>12}{'naive':>12}   naive formula")
    naive_formula = "(p-1)·N (root)" if rank == args.root else "N"
    ring_sent = common.fmt_bytes(measured["ring_bytes"])
    ring_expected = common.fmt_bytes(expected["ring"])
    naive_sent = common.fmt_bytes(measured["naive_bytes"])
    row = f"{ring_sent:>12}{ring_expected:>12}{naive_sent:>12}   {naive_formula}"
    show_ranks(f"  rank {rank:<7}{row}")
    common.log(
        f"  time (best of 3): ring {1e3 * measured['ring_s']:.1f} ms, "
        f"dist.all_reduce {1e3 * measured['all_reduce_s']:.1f} ms, "
        f"naive {1e3 * measured['naive_s']:.1f} ms"
    )


def report(args, world, backend, device, checks, built_for, measured):
    """Rank 0 logs the summary and the RESULT line for every rank: a check passes only if it
    passed on every rank. Returns the names of the failed checks (on every rank, so that every
    rank exits alike)."""
    every_rank = [None] * world
    dist.all_gather_object(every_rank, dict(checks=checks, measured=measured))
    checks_by_rank = [seen["checks"] for seen in every_rank]
    measured_by_rank = [seen["measured"] for seen in every_rank]
    passed = {name: all(rank_checks[name] for rank_checks in checks_by_rank) for name in checks}
    failed = [name for name, ok in passed.items() if not ok]
    summary = f"\nchecks: {sum(passed.values())}/{len(passed)} passed"
    if failed:
        summary += f"; FAILED: {failed}"
    if built_for:
        summary += f"; built from other collectives: {built_for}"
    common.log(summary)
    expected = formula(world, args.ring_numel)
    common.result(
        script="collectives",
        world_size=world,
        backend=backend,
        device=device.type,
        checks_passed=sum(passed.values()),
        checks_total=len(passed),
        failed=failed,
        built=built_for,
        ring_numel=args.ring_numel,
        ring_bytes_sent=[rank_measured["ring_bytes"] for rank_measured in measured_by_rank],
        ring_bytes_formula=expected["ring"],
        naive_bytes_sent=[rank_measured["naive_bytes"] for rank_measured in measured_by_rank],
        naive_root_formula=expected["naive_root"],
        ring_s=measured["ring_s"],  # the times: this rank's own (the RESULT line is rank 0's)
        all_reduce_s=measured["all_reduce_s"],
        naive_s=measured["naive_s"],
    )
    return failed


def check_args(args, world):
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


def setup(args):
    """Join the process group. torchrun (or common.launch) put RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT in the environment; LOCAL_RANK picks this process's GPU."""
    backend, device = common.pick_backend(args.backend)  # NCCL and a GPU per rank, else Gloo
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank, world = common.init_process_group(backend, device, args.timeout)
    return rank, world, device, backend


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def run(args):
    """One rank: join the group, show and check every primitive, the ring and the naive
    all-reduce; rank 0 reports what every rank saw; leave the group."""
    rank, world, device, backend = setup(args)
    try:
        common.log(
            f"collectives: {world} ranks, {backend} on {device.type}, "
            f"torch {torch.__version__}; root {args.root}"
        )
        checks, built_for = check_primitives(args, device, backend)
        checks["ring_all_reduce (small)"] = check_small_ring(args, device)
        big_checks, measured = compare_all_reduces(args, device)
        checks.update(big_checks)
        show_all_reduces(args, measured)
        failed = report(args, world, backend, device, checks, built_for, measured)
        if failed:
            raise SystemExit(1)
    finally:
        cleanup()


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
    parser.add_argument("--seed", type=int, default=0, help="seed of the big all-reduce's input")
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
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
