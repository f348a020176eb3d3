"""pipeline_schedules.py: interleaved 1F1B (V=2) and ZB-H1 end with the parameters of the one-process
ddp.py run, with SGD and AdamW, at p=2 and p=4; what each rank ran (recorded from outside the technique)
is the schedule the docstring defines, its bubble is the formula ((p-1)/(V·m+p-1), (p-1)/(3m+p-1)) and
its peak in flight the docstring's; each rank's point-to-point bytes are the formula's; every group the
step and the evaluation issue is safe under NCCL's rule, each link's n-th send meeting its n-th receive;
bad input is refused. Two launches (one per world size, tests/pipeline_cases.py) and ddp's two."""

import argparse
import json

import pytest
import torch
import torch.distributed as dist

import common
import pipeline_schedules as ps
from helpers import SMALL, max_diff, torchrun
from test_pipeline import record, replay

# 8 blocks: 4 ranks x 2 chunks; a small dim and 3 steps keep the two launches cheap
CFG = [*SMALL, "--dim", "16", "--depth", "8", "--heads", "2", "--max-steps", "3"]
TOL = {"sgd": 1e-6, "adamw": 5e-5}
WINDOW = 3  # optimizer steps the Meter counts communication in
# (p, schedule, V, m, optim)
CASES = [
    (p, name, V, 2 * p, optim)
    for p in (2, 4)
    for name, V in (("interleaved", 2), ("zb-h1", 1))
    for optim in ("sgd", "adamw")
]
IDS = [f"p{p}-{name}-V{V}-m{m}-{o}" for p, name, V, m, o in CASES]

TIMELINE_ZB_2x4 = """\
  rank 0:  F0 F1 .  B0 W0 F2 B1 W1 F3 B2 W2 B3 W3
  rank 1:  .  F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3"""


def expected_order(name, m, p, s, V):
    """The schedules as the docstring defines them, written out here independently."""
    if name == "interleaved":  # Megatron: the k-th forward is micro-batch g·p + k % p of chunk v
        fwd = [(g * p + j, v) for g in range(m // p) for v in range(V) for j in range(p)]
        bwd = [(g * p + j, V - 1 - v) for g in range(m // p) for v in range(V) for j in range(p)]
        warm = m * V if m == p else min(2 * (p - s - 1) + (V - 1) * p, m * V)
        order = [("F", *f) for f in fwd[:warm]]
        for k in range(m * V - warm):
            order += [("F", *fwd[warm + k]), ("B", *bwd[k])]
        return order + [("B", *b) for b in bwd[m * V - warm :]]
    order, f, b, w = [], 0, 0, 0  # zb-h1: 1f1b's F and B; after the k-th B (k >= s) W k-s
    while w < m:
        if (
            b < m
            and f < m
            and (f < p - s or order[-1][0] != "F")
            and not (order and order[-1][0] == "B" and b > s)
        ):
            order.append(("F", f, 0))
            f += 1
        elif b < f and (not order or order[-1][0] != "B" or b <= s) and b < m:
            order.append(("B", b, 0))
            b += 1
        else:
            order.append(("W", w, 0))
            w += 1
    return order


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch per world size runs all its cases. Returns {case: (RESULT, saved path, its output)}."""
    d, out = tmp_path_factory.mktemp("pps"), {}
    saved = {case: d / f"{i}.pt" for i, case in enumerate(CASES)}
    for world in (2, 4):
        cases = [c for c in CASES if c[0] == world]
        argv = [
            [
                "pipeline_schedules",
                [
                    *CFG,
                    "--schedule",
                    name,
                    "--virtual-stages",
                    V,
                    "--microbatches",
                    m,
                    "--optim",
                    o,
                    "--save",
                    saved[p, name, V, m, o],
                ],
            ]
            for p, name, V, m, o in cases
        ]
        run = torchrun("tests/pipeline_cases.py", world, json.dumps(argv, default=str), timeout=400)
        assert run.returncode == 0, run.output
        chunks = run.stdout.split("\nRESULT ")
        assert len(chunks) == len(argv) + 1, run.output
        for i, case in enumerate(cases):
            out[case] = json.loads(chunks[i + 1].splitlines()[0]), saved[case], chunks[i]
    return out


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_same_parameters_as_ddp_one_process(case, runs, refs):
    p, name, V, m, optim = case
    r, path, _ = runs[case]
    diff = max_diff(refs[optim], path)
    print(
        f"pipeline_schedules p={p} {name} V={V} m={m} {optim}: max |Δparam| vs ddp.py W=1 = {diff:.3g}"
    )
    assert (r["world_size"], r["schedule"], r["virtual_stages"], r["microbatches"], r["steps"]) == (
        p,
        name,
        V,
        m,
        3,
    )
    assert diff < TOL[optim]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_recorded_order_bubble_and_in_flight(case, runs):
    """What each rank ran is the schedule; replayed in slots (F, B, W one each, a whole backward two) it
    idles (p-1)/(V·m+p-1) (interleaved) or (p-1)/(3m+p-1) (zb-h1) of them; the peak of micro-batch
    chunks in flight is Megatron's warm-up + 1 (interleaved) or p on every rank (zb-h1, 1f1b's peak)."""
    p, name, V, m, _ = case
    r, _, output = runs[case]
    assert [[tuple(a) for a in st["order"]] for st in r["stages"]] == [
        expected_order(name, m, p, s, V) for s in range(p)
    ]
    assert r["bubble"] == pytest.approx(
        (p - 1) / ((V * m if name == "interleaved" else 3 * m) + p - 1)
    )
    assert r["peak_inflight"] == (
        [min(2 * (p - s - 1) + (V - 1) * p, m * V) + 1 for s in range(p)]
        if name == "interleaved"
        else [p] * p
    )
    if (p, name, m) == (2, "zb-h1", 4):
        assert TIMELINE_ZB_2x4 in output


@pytest.mark.parametrize("case", CASES[::2], ids=IDS[::2])
def test_measured_point_to_point_per_rank(case, runs):
    """Each chunk boundary carries m activations of B/m·T·D fp32 forward and m gradients back: rank s
    sends one per micro-batch from each chunk but the last (F) and each but the first (B); nothing else."""
    p, name, V, m, _ = case
    r = runs[case][0]
    args = common.parse_args(common.get_parser("test"), CFG)
    msg = 4 * (args.batch_size // m) * common.build_model(args).embed.tokens * args.dim
    for s, st in enumerate(r["stages"]):
        n = m * sum((c < V * p - 1) + (c > 0) for c in range(s, V * p, p))
        assert st["comm"] == dict(send=n * msg, recv=n * msg), (s, st["comm"])
        assert st["comm_calls"] == dict(send=n * WINDOW, recv=n * WINDOW), (s, st["comm_calls"])
    assert r["comm"] == r["formula"]["comm"]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_p2p_order_is_nccl_safe(p, monkeypatch, one_thread):
    """Every schedule, m in {p, 2p, 3p}: each rank's own train_step (two steps) and evaluation run in-process,
    their groups recorded at dist.batch_isend_irecv and replayed under NCCL's rule (test_pipeline.replay):
    no rank waits for ever, every message has a partner of its size, a step carries 2(V·p-1)·m messages;
    and on every link the n-th send is the message the n-th receive waits for (NCCL matches by order)."""
    for name, V in (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 3)):
        torch.manual_seed(0)
        model = common.ViT(dim=8, depth=p * V, heads=2, patch=14)
        stages = [ps.Stage(model, s, p, V) for s in range(p)]
        for m in (p, 2 * p, 3 * p):
            x, y = torch.randn(2 * m, 1, 28, 28), torch.randint(0, 10, (2 * m,))
            train = [
                record(monkeypatch, st, lambda: [ps.train_step(st, x, y, name, m) for _ in "12"])
                for st in stages
            ]
            test = [
                record(monkeypatch, st, lambda: [ps.infer(st, x) for _ in "12"]) for st in stages
            ]
            monkeypatch.undo()
            assert (
                sum(op[1] == "send" for g in train for b in g for op in b)
                == 2 * 2 * (V * p - 1) * m
            )
            assert replay(train) is None and replay(test) is None, (name, V, p, m)
            assert replay([a + b for a, b in zip(train, test)]) is None, (name, V, p, m)
            steps = [[a for step in ps.schedule(name, m, p, s, V) for a in step] for s in range(p)]
            to = lambda a, c: (
                c + 1 if a == "F" else c - 1
            )  # F's output feeds F on c+1, B's gradient B on c-1
            frm = lambda a, c: c - 1 if a == "F" else c + 1  # where an action's input comes from
            for q in range(p):
                for r in range(p):
                    sent = [
                        (a, i, to(a, v * p + q) // p)
                        for a, i, v in steps[q]
                        if a != "W" and 0 <= to(a, v * p + q) < V * p and to(a, v * p + q) % p == r
                    ]
                    wanted = [
                        (a, i, v)
                        for a, i, v in steps[r]
                        if a != "W"
                        and 0 <= frm(a, v * p + r) < V * p
                        and frm(a, v * p + r) % p == q
                    ]
                    assert sent == wanted, (name, V, p, m, q, r)


@pytest.mark.parametrize(
    "world,flags,message",
    [
        (
            4,
            dict(depth=6, schedule="interleaved", virtual_stages=2),
            "--depth 6 blocks cannot fill 4 stages x 2 chunks",
        ),
        (4, dict(microbatches=2), "--schedule 1f1b needs --microbatches >= 4 stages"),
        (2, dict(microbatches=5), "dividing --batch-size 32, got 5"),
        (
            3,
            dict(schedule="interleaved", virtual_stages=2, microbatches=4),
            "--microbatches a multiple of them",
        ),
        (
            2,
            dict(schedule="interleaved", virtual_stages=1),
            "--schedule interleaved needs --virtual-stages >= 2",
        ),
        (2, dict(schedule="zb-h1", virtual_stages=2), "(and the others V = 1)"),
        (1, dict(schedule="interleaved", virtual_stages=2, microbatches=4), ">= 2 stages"),
    ],
)
def test_check_args(world, flags, message, capsys):
    ok_args = dict(depth=8, batch_size=32, schedule="1f1b", microbatches=4, virtual_stages=1)
    with pytest.raises(SystemExit) as e:
        ps.check_args(argparse.Namespace(**{**ok_args, **flags}), world)
    assert e.value.code == 2 and message in capsys.readouterr().err
    ps.check_args(argparse.Namespace(**ok_args), world)
    ps.check_args(
        argparse.Namespace(**{**ok_args, "schedule": "interleaved", "virtual_stages": 2}), 2
    )
