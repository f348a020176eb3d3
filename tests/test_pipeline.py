"""pipeline.py: every schedule (naive with m > 1 too) ends with the same parameters as the
one-process ddp.py run, with SGD and AdamW, at p=2 and at p=3 (4 blocks do not split 3 ways); the
order in which each stage's forwards and backwards ran (recorded by the script from outside the
technique) is the schedule, and its bubble and peak in flight are the schedules' formulas; each
stage's parameter, gradient and optimizer bytes and point-to-point bytes, measured by the Meter,
are what this test works out from the model; the saved state_dict loads in ddp.py; every
point-to-point group the training step and the evaluation issue is safe under NCCL's rule (and the
replay that says so does catch the one-op-per-group pairing that deadlocked); bad input is refused."""

import argparse
import json
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import common
import pipeline
from helpers import SMALL, max_diff, torchrun

DEPTH = 4
CFG = [
    *SMALL,
    "--depth",
    str(DEPTH),
]  # the same config as test_tensor_parallel.py: shared references
TOL = {
    "sgd": 1e-6,
    "adamw": 5e-5,
}  # round-off; AdamW turns it into steps on ~0 gradients: up to 1.9e-5 seen
WINDOW = 3  # optimizer steps the Meter counts communication in
SCHEDULES = ("naive", "gpipe", "1f1b")
# (p, schedule, m, optim): every schedule with both optimizers at p=2 and p=3; m > 1 everywhere
CASES = [
    (2, "naive", 4, "sgd"),
    (2, "naive", 2, "adamw"),
    (2, "gpipe", 2, "sgd"),
    (2, "gpipe", 8, "adamw"),
    (2, "1f1b", 4, "sgd"),
    (2, "1f1b", 2, "adamw"),
    (3, "naive", 2, "sgd"),
    (3, "naive", 4, "adamw"),
    (3, "gpipe", 4, "sgd"),
    (3, "gpipe", 8, "adamw"),
    (3, "1f1b", 4, "sgd"),
    (3, "1f1b", 8, "adamw"),
]
IDS = [f"p{p}-{s}-m{m}-{o}" for p, s, m, o in CASES]
LOADED = (3, "gpipe", 4, "sgd")  # this case starts from --load of the initial weights

TIMELINE_1F1B_2x4 = """\
  rank 0:  F0 F1 .  B0 F2 B1 F3 B2 .  B3
  rank 1:  .  F0 B0 F1 B1 F2 B2 F3 B3 ."""


def expected_order(name, m, p, s):
    """The schedules as the docstring defines them, written out here independently."""
    if name == "naive":  # micro-batch i's backward before i+1's forward
        return [x for i in range(m) for x in (("F", i), ("B", i))]
    if name == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    order, f, b = [], 0, 0  # 1f1b: p-s-1 forwards ahead, then F B F B ..., then the Bs
    while b < m:
        if f < m and (f < p - s or order[-1][0] == "B"):
            order.append(("F", f))
            f += 1
        else:
            order.append(("B", b))
            b += 1
    return order


def stage_params(model, p):
    """Parameters per stage, the blocks cut as the script cuts them: s·d/p .. (s+1)·d/p - 1."""
    d, count = (
        len(model.blocks),
        lambda mods: sum(q.numel() for mod in mods for q in mod.parameters()),
    )
    return [
        count(
            [
                *([model.embed] if s == 0 else []),
                *model.blocks[s * d // p : (s + 1) * d // p],
                *([model.head] if s == p - 1 else []),
            ]
        )
        for s in range(p)
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, initial):
    """One launch per world size runs all its cases (tests/pipeline_cases.py), and the p=2 launch
    ends with ddp.py loading one pipeline save with lr 0 and saving it again. Returns
    {case: (RESULT, saved path, this case's output)} and the two paths of the ddp round trip."""
    d, out = tmp_path_factory.mktemp("pp"), {}
    saved = {case: d / f"{i}.pt" for i, case in enumerate(CASES)}
    for world in (2, 3):
        cases = [c for c in CASES if c[0] == world]
        argv = [
            [
                "pipeline",
                [
                    *CFG,
                    "--schedule",
                    s,
                    "--microbatches",
                    m,
                    "--optim",
                    o,
                    "--save",
                    saved[p, s, m, o],
                    *(["--load", initial] if (p, s, m, o) == LOADED else []),
                ],
            ]
            for p, s, m, o in cases
        ]
        if world == 2:
            argv.append(
                [
                    "ddp",
                    [
                        *CFG,
                        "--optim",
                        "sgd",
                        "--lr",
                        0,
                        "--max-steps",
                        1,
                        "--load",
                        saved[CASES[0]],
                        "--save",
                        d / "ddp.pt",
                    ],
                ]
            )
        run = torchrun("tests/pipeline_cases.py", world, json.dumps(argv, default=str), timeout=400)
        assert run.returncode == 0, run.output
        chunks = run.stdout.split(
            "\nRESULT "
        )  # chunk i ends with case i's output, i+1 starts with its RESULT
        assert len(chunks) == len(argv) + 1, run.output
        for i, case in enumerate(cases):
            out[case] = json.loads(chunks[i + 1].splitlines()[0]), saved[case], chunks[i]
    return out, (saved[CASES[0]], d / "ddp.pt")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_same_parameters_as_ddp_one_process(case, runs, refs):
    p, schedule, m, optim = case
    r, path, _ = runs[0][case]
    diff = max_diff(refs[optim], path)
    print(f"pipeline p={p} {schedule} m={m} {optim}: max |Δparam| vs ddp.py W=1 = {diff:.3g}")
    assert (r["world_size"], r["schedule"], r["microbatches"], r["steps"]) == (p, schedule, m, 6)
    assert diff < TOL[optim]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_recorded_order_bubble_and_in_flight(case, runs):
    """What each stage ran, in order, as the script's hooks saw it, is the schedule; replayed one slot
    per F or B, it idles (p-1)/p (naive) or (p-1)/(m+p-1) (gpipe, 1f1b) of the slots; and the most
    micro-batches whose forward ran and backward did not is 1, m, or p-s on stage s."""
    p, schedule, m, _ = case
    r, _, output = runs[0][case]
    ran = [[tuple(a) for a in st["order"]] for st in r["stages"]]
    assert ran == [expected_order(schedule, m, p, s) for s in range(p)]
    assert r["bubble"] == pytest.approx(
        (p - 1) / p if schedule == "naive" else (p - 1) / (m + p - 1)
    )
    assert (
        r["peak_inflight"]
        == {"naive": [1] * p, "gpipe": [m] * p, "1f1b": [p - s for s in range(p)]}[schedule]
    )
    if (p, schedule, m) == (2, "1f1b", 4):
        assert TIMELINE_1F1B_2x4 in output


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_measured_bytes_per_stage(case, runs):
    """Stage s holds its own Ψ_s parameters, gradients and optimizer state (AdamW m, v; SGD momentum),
    counted here off the model cut as the script cuts it (4 blocks over 3 stages: 1, 1, 2). Per step,
    each boundary carries m activations of B/m·T·D fp32 forward and m gradients back: 2(p-1)·m
    messages in all, and nothing else is communicated."""
    p, _, m, optim = case
    r, _, _ = runs[0][case]
    args = common.parse_args(common.get_parser("test"), CFG)
    model = common.build_model(args)
    msg = 4 * (args.batch_size // m) * model.embed.tokens * args.dim
    assert sum(stage_params(model, p)) == r["params"]
    for s, (st, psi) in enumerate(zip(r["stages"], stage_params(model, p))):
        assert (st["param_bytes"], st["grad_bytes"], st["optim_bytes"]) == (
            4 * psi,
            4 * psi,
            (8 if optim == "adamw" else 4) * psi,
        )
        peers = (s > 0) + (s < p - 1)  # neighbours: an activation and a gradient each way per one
        assert st["comm"] == dict(send=peers * m * msg, recv=peers * m * msg), (s, st)
        assert st["comm_calls"] == dict(send=peers * m * WINDOW, recv=peers * m * WINDOW), (s, st)
    assert sum(st["comm_calls"]["send"] for st in r["stages"]) == 2 * (p - 1) * m * WINDOW
    assert (
        r["comm"] == r["stages"][0]["comm"] and r["comm_steps"] == WINDOW
    )  # RESULT's own fields: rank 0's


def test_saved_state_loads_in_ddp(runs):
    """ddp.py --load of a pipeline save, trained with lr 0 and saved again, gives back the same
    tensors: the stages' parts gathered on rank 0 are the common model's state_dict, key for key."""
    pipe, again = runs[1]
    assert max_diff(pipe, again) == 0


# --------------------------------------------------------------------------- NCCL's rule, in-process


def replay(batches):
    """NCCL's rule for point-to-point groups: each rank runs its groups in order; a group completes
    only when the partner of every op in it (the n-th send r->q pairs with the n-th receive on q
    from r) sits in a group its rank has reached. `batches[r]`: rank r's groups, each a list of
    (peer, "send" | "recv", numel). Returns None when every rank gets through, else the group each
    rank is stuck at."""
    ends, seen = {}, Counter()
    for r, groups in enumerate(batches):
        for k, group in enumerate(groups):
            for peer, kind, numel in group:
                link = (r, peer) if kind == "send" else (peer, r)
                ends.setdefault((*link, seen[kind, link]), {})[kind] = (r, k, numel)
                seen[kind, link] += 1
    needs = [[[] for _ in groups] for groups in batches]
    for key, end in ends.items():
        assert end.keys() == {"send", "recv"}, f"message {key} has no partner: {end}"
        (rs, ks, ns), (rr, kr, nr) = end["send"], end["recv"]
        assert ns == nr, f"message {key}: {ns} elements sent, {nr} received"
        needs[rs][ks].append((rr, kr))
        needs[rr][kr].append((rs, ks))
    at, moved = [0] * len(batches), True
    while moved:
        moved = False
        for r, groups in enumerate(batches):
            if at[r] < len(groups) and all(at[q] >= k for q, k in needs[r][at[r]]):
                at[r], moved = at[r] + 1, True
    return None if all(at[r] == len(g) for r, g in enumerate(batches)) else at


def test_replay_itself():
    """The rule on hand-made cases: a send/receive exchange in one group each passes; each rank
    sending first in a group of its own (the old pairing) deadlocks."""
    send, recv = (1, "send", 4), (1, "recv", 4)
    assert replay([[[send, recv]], [[(0, "send", 4), (0, "recv", 4)]]]) is None
    assert replay([[[send], [recv]], [[(0, "send", 4)], [(0, "recv", 4)]]]) == [0, 0]
    assert replay([[[send], [recv]], [[(0, "recv", 4)], [(0, "send", 4)]]]) is None


class FakeOp:
    """Stands in for dist.P2POp (which needs a process group)."""

    def __init__(self, op, tensor, peer):
        self.op, self.tensor, self.peer = op, tensor, peer


def record(monkeypatch, stage, work):
    """The groups `work()` hands to dist.batch_isend_irecv on this stage, in order; received
    tensors are filled with numbers so the stage computes on."""
    groups = []

    def batch_isend_irecv(ops):
        assert ops, "an empty group"
        groups.append(
            [(o.peer, "send" if o.op is dist.isend else "recv", o.tensor.numel()) for o in ops]
        )
        for o in ops:
            if o.op is dist.irecv:
                o.tensor.normal_()
        return []

    monkeypatch.setattr(dist, "P2POp", FakeOp)
    monkeypatch.setattr(dist, "batch_isend_irecv", batch_isend_irecv)
    work()
    return groups


def old_pairing(order, s, p, msg):
    """Today's pipeline.py before this fix (git history): every send and receive a group of its own,
    a forward's receive before it and its send after it, the same for a backward."""
    groups = []
    for a, _ in order:
        prev, nxt = (s - 1, s + 1) if a == "F" else (s + 1, s - 1)
        groups += [[(prev, "recv", msg)]] if 0 <= prev < p else []
        groups += [[(nxt, "send", msg)]] if 0 <= nxt < p else []
    return groups


@pytest.fixture
def one_thread():
    """Tiny matrices: one thread, not a fight over busy cores (100x faster on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_p2p_order_is_nccl_safe(p, monkeypatch, one_thread):
    """For every schedule and m in {p, p+1, 2p}: each stage's own train_step (two steps) and
    evaluation (two batches) run in-process, their groups recorded at dist.batch_isend_irecv, then
    replayed under NCCL's rule: no stage waits for ever, every message has a partner of its size,
    and a step carries 2(p-1)·m messages. The same replay finds the deadlock of the old pairing
    (one op per group) in 1F1B, for every p and m here."""
    torch.manual_seed(0)
    model = common.ViT(dim=8, depth=4, heads=2, patch=14)
    stages = [pipeline.Stage(model, s, p) for s in range(p)]
    msg = 2 * model.embed.tokens * 8  # 2 samples a micro-batch
    for name in SCHEDULES:
        for m in (p, p + 1, 2 * p):
            x, y = torch.randn(2 * m, 1, 28, 28), torch.randint(0, 10, (2 * m,))
            train, test = [], []
            for st in stages:
                train.append(
                    record(
                        monkeypatch,
                        st,
                        lambda: [pipeline.train_step(st, x, y, name, m) for _ in "12"],
                    )
                )
                test.append(record(monkeypatch, st, lambda: [pipeline.infer(st, x) for _ in "12"]))
            monkeypatch.undo()
            assert sum(op[1] == "send" for g in train for b in g for op in b) == 2 * 2 * (p - 1) * m
            assert replay(train) is None, (name, p, m, train)
            assert replay(test) is None, (name, p, m, test)
            assert replay([a + b for a, b in zip(train, test)]) is None, (name, p, m)
            old = replay([old_pairing(expected_order(name, m, p, s), s, p, msg) for s in range(p)])
            assert (old is not None) == (name == "1f1b"), (name, p, m, old)


@pytest.mark.parametrize(
    "world,flags,message",
    [
        (2, dict(depth=1), "--depth 1 blocks cannot fill 2 pipeline stages"),
        (
            1,
            dict(schedule="gpipe", microbatches=5),
            "--batch-size 32 is not divisible by --microbatches 5",
        ),
        (
            4,
            dict(schedule="1f1b", microbatches=2),
            "--schedule 1f1b needs at least as many micro-batches as stages: --microbatches 2 < 4 stages",
        ),
        (2, dict(microbatches=0), "--microbatches must be >= 1, got 0"),
    ],
)
def test_check_args(world, flags, message, capsys):
    """The checks themselves, in-process; the config without the bad flag passes."""
    ok_args = dict(depth=DEPTH, batch_size=32, schedule="1f1b", microbatches=4)
    with pytest.raises(SystemExit) as e:
        pipeline.check_args(argparse.Namespace(**{**ok_args, **flags}), world)
    assert e.value.code == 2 and message in capsys.readouterr().err
    pipeline.check_args(argparse.Namespace(**ok_args), world)
