"""collectives.py: every primitive's printed result equals its definition, recomputed here from
the printed inputs (not from the script's own checks); the ring all-reduce equals dist.all_reduce
for sizes W does not divide, and each rank sends 2(W-1)/W·N bytes."""

import ast
import re
import tempfile

import pytest
import torch
import torch.distributed as dist

from helpers import fork_launch, ok

ROW = re.compile(r"  rank (\d+): (\[[^\]]*\]|-) -> (\[[^\]]*\]|-)$")


def printed_list(text):
    """'[1, 2]' -> [1, 2]; '-' (no tensor on that rank) -> None."""
    if text == "-":
        return None
    return ast.literal_eval(text)


def printed(stdout):
    """{primitive: {rank: (before, after)}} from the '== name:' headers and the
    '  rank r: [..] -> [..]' rows under them."""
    out = {}
    name = None
    for line in stdout.splitlines():
        header = re.match(r"== (\w+):", line)
        if header:
            name = header[1]
            out[name] = {}
            continue
        row = ROW.match(line)
        if name and row:
            out[name][int(row[1])] = (printed_list(row[2]), printed_list(row[3]))
    return out


def check_definitions(stdout, W, root, n, k):
    got = printed(stdout)
    assert set(got) == {
        "broadcast",
        "scatter",
        "gather",
        "reduce",
        "all_gather",
        "all_reduce",
        "reduce_scatter",
        "all_to_all",
        "ring_all_reduce",
    }, stdout
    assert all(sorted(rows) == list(range(W)) for rows in got.values()), stdout
    x = {r: got["all_reduce"][r][0] for r in range(W)}  # each rank's N elements
    xs = {r: got["reduce_scatter"][r][0] for r in range(W)}  # each rank's W chunks of k
    assert all(len(x[r]) == n and len(xs[r]) == W * k for r in range(W))
    assert len(set(map(tuple, x.values()))) == W  # distinct inputs: a mix-up shows

    def cat(parts):
        return [value for part in parts for value in part]

    def chunk(values, i):
        return values[i * k : (i + 1) * k]

    total = [sum(column) for column in zip(*x.values(), strict=True)]
    total_chunks = [sum(column) for column in zip(*xs.values(), strict=True)]
    for r in range(W):
        assert got["broadcast"][r] == (x[r], x[root])
        assert got["scatter"][r][1] == chunk(got["scatter"][root][0], r)
        assert got["gather"][r] == (x[r], cat(x[j] for j in range(W)) if r == root else None)
        assert got["reduce"][r] == (x[r], total if r == root else None)
        assert got["all_gather"][r] == (x[r], cat(x[j] for j in range(W)))
        assert got["all_reduce"][r][1] == total
        assert got["reduce_scatter"][r][1] == chunk(total_chunks, r)
        assert got["all_to_all"][r] == (xs[r], cat(chunk(xs[j], r) for j in range(W)))
        assert got["ring_all_reduce"][r] == (x[r], total)
    assert got["scatter"][root][0] == xs[root]
    assert all(got["scatter"][r][0] is None for r in range(W) if r != root)


def swap_first_two(stdout, name, rank):
    """The output with two elements of one rank's result swapped: a wrong result that the checks
    must catch."""
    lines = stdout.splitlines()
    inside = False
    for i, line in enumerate(lines):
        if line.startswith("== "):
            inside = line.startswith(f"== {name}:")
        if inside and line.startswith(f"  rank {rank}: "):
            before, after = line.split(" -> ")
            values = ast.literal_eval(after)
            swapped = [values[1], values[0], *values[2:]]
            lines[i] = f"{before} -> {swapped}"
    return "\n".join(lines)


def check_bytes(res, W, N):
    sizes = [N // W + (i < N % W) for i in range(W)]  # the ring's chunks (tensor_split)
    # rank r sends every chunk but r+1 in the reduce-scatter phase and every chunk but r+2 in the
    # all-gather phase: 2N - |chunk r+1| - |chunk r+2| elements, 2(W-1)/W·N when W divides N
    assert res["ring_bytes_sent"] == [
        4 * (2 * N - sizes[(r + 1) % W] - sizes[(r + 2) % W]) for r in range(W)
    ]
    assert res["ring_bytes_formula"] == pytest.approx(4 * 2 * (W - 1) / W * N)
    assert all(abs(b - res["ring_bytes_formula"]) <= 8 for b in res["ring_bytes_sent"])
    assert sum(res["ring_bytes_sent"]) == 4 * 2 * (W - 1) * N


def missing_in_gloo():
    """Which of scatter, reduce-scatter and all-to-all this torch's Gloo lacks (2.11 has no list
    all_to_all), asked of the backend in a world of one, as collectives.py asks it."""
    calls = {
        "scatter": lambda: dist.scatter(torch.zeros(1), [torch.ones(1)], src=0),
        "reduce_scatter": lambda: dist.reduce_scatter(torch.zeros(1), [torch.ones(1)]),
        "all_to_all": lambda: dist.all_to_all([torch.zeros(1)], [torch.ones(1)]),
    }
    missing = set()
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            for name, call in calls.items():
                try:
                    call()
                except (RuntimeError, NotImplementedError, ValueError):
                    missing.add(name)
        finally:
            dist.destroy_process_group()
    return missing


CASES = [
    pytest.param(2, 0, 5, 2, 100_001, [], id="W2"),  # W divides neither n nor N
    pytest.param(4, 1, 6, 1, 1_000_003, [], id="W4"),
    # N < W: an empty ring chunk; and every primitive that has one shown built
    pytest.param(3, 2, 2, 2, 2, ["scatter", "reduce_scatter", "all_to_all"], id="W3-built"),
]


@pytest.mark.parametrize("world,root,n,k,N,avoid", CASES)
def test_primitives_equal_their_definitions(world, root, n, k, N, avoid):
    avoided = ["--avoid", *avoid] if avoid else []
    r = fork_launch(
        "collectives.py",
        world,
        *("--root", root, "--numel", n, "--chunk", k, "--ring-numel", N, "--timeout", 60),
        *avoided,
        timeout=120,
    )
    res = ok(r)
    assert res["world_size"] == world and res["backend"] == "gloo"
    assert res["failed"] == [] and res["checks_passed"] == res["checks_total"] == 14, r.output
    check_definitions(r.stdout, world, root, n, k)
    for name in ("all_to_all", "all_gather", "ring_all_reduce"):  # the checks can fail
        with pytest.raises(AssertionError):
            check_definitions(swap_first_two(r.stdout, name, world - 1), world, root, n, k)
    check_bytes(res, world, N)
    naive = [4 * N * ((world - 1) if rank == root else 1) for rank in range(world)]
    assert res["naive_bytes_sent"] == naive and res["naive_root_formula"] == naive[root]
    forced = set(avoid) | missing_in_gloo()  # what --avoid or the backend forces
    assert sorted(res["built"]) == sorted(forced)
    for name in avoid:
        shown_built = rf"== {name}:.*\n(  rank .*\n)+  shown: built from .*\(--avoid\)"
        assert re.search(shown_built, r.stdout), r.output
