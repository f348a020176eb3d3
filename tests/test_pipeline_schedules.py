"""pipeline_schedules.py: interleaved 1F1B (V=2) and ZB-H1 end with the parameters of the
one-process ddp.py run, with SGD and AdamW, at p=2 and p=4; what each rank ran (recorded from
outside the technique) is the schedule the docstring defines, its bubble is the formula
((p-1)/(V·m+p-1), (p-1)/(3m+p-1)) and its peak in flight the docstring's; each rank's
point-to-point bytes are the formula's; every communication the loop, the evaluation and the save
issue is safe under NCCL's rule (test_pipeline's replay), each link's n-th send carrying what its
n-th receive waits for; bad input is refused. Two launches (one per world size) and ddp's two."""

import argparse
from collections import defaultdict

import pytest
import torch
from test_pipeline import (
    LOOP,
    LOOP_COLLECTIVES,
    LOOP_STEPS,
    collectives,
    loop_calls,
    replay,
    sends,
    simulated,
)

import common
import pipeline_schedules
from helpers import SMALL, launch_cases, max_diff

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

# the docstring's picture: a slot per F, B and W
TIMELINE_ZB_2x4 = """\
  rank 0:  F0 F1 .  B0 W0 F2 B1 W1 F3 B2 W2 B3 W3
  rank 1:  .  F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3"""


def one_f_one_b(m, p, s):
    """1F1B on stage s: p-s-1 forwards ahead, then F B F B ..., then the Bs."""
    warmup = min(p - s - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def expected_order(name, m, p, s, V):
    """The schedules as the docstring defines them, written out here independently."""
    if name == "interleaved":  # Megatron: rounds of p micro-batches, chunk by chunk
        rounds = range(m // p)
        forwards = [(g * p + j, v) for g in rounds for v in range(V) for j in range(p)]
        backwards = [(g * p + j, V - 1 - v) for g in rounds for v in range(V) for j in range(p)]
        warmup = m * V if m == p else min(2 * (p - s - 1) + (V - 1) * p, m * V)
        order = [("F", *forward) for forward in forwards[:warmup]]
        for k in range(m * V - warmup):
            order += [("F", *forwards[warmup + k]), ("B", *backwards[k])]
        return order + [("B", *backward) for backward in backwards[m * V - warmup :]]
    order = []  # zb-h1: 1f1b's F and B; W i-s right after B i, the last s Ws at the end
    for action, i in one_f_one_b(m, p, s):
        order.append((action, i, 0))
        if action == "B" and i >= s:
            order.append(("W", i - s, 0))
    return order + [("W", i, 0) for i in range(m - s, m)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch per world size runs all its cases. Returns {case: (RESULT, saved path, its
    output)}."""
    folder = tmp_path_factory.mktemp("pps")
    saved = {case: folder / f"{i}.pt" for i, case in enumerate(CASES)}
    out = {}
    for world in (2, 4):
        cases = [case for case in CASES if case[0] == world]
        argv = []
        for case in cases:
            _, name, V, m, optim = case
            flags = [*CFG, "--schedule", name, "--virtual-stages", V, "--microbatches", m]
            flags += ["--optim", optim, "--save", saved[case]]
            argv.append(["pipeline_schedules", flags])
        for case, (result, output) in zip(cases, launch_cases(world, argv), strict=True):
            out[case] = (result, saved[case], output)
    return out


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_same_parameters_as_ddp_one_process(case, runs, refs):
    p, name, V, m, optim = case
    result, path, _ = runs[case]
    diff = max_diff(refs[optim], path)
    print(f"pipeline_schedules p={p} {name} V={V} m={m} {optim}: max |Δparam| vs ddp {diff:.3g}")
    assert (result["world_size"], result["steps"]) == (p, 3)
    assert diff < TOL[optim]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_recorded_order_bubble_and_in_flight(case, runs):
    """What each rank ran is the schedule; replayed in slots (F, B, W one each, a whole backward
    two) it idles (p-1)/(V·m+p-1) (interleaved) or (p-1)/(3m+p-1) (zb-h1) of them, the script's
    formula; the peak of micro-batch chunks in flight is Megatron's warm-up + 1 (interleaved) or
    p on every rank (zb-h1, 1f1b's peak)."""
    p, name, V, m, _ = case
    result, _, output = runs[case]
    ran = [[tuple(action) for action in stage["order"]] for stage in result["stages"]]
    assert ran == [expected_order(name, m, p, s, V) for s in range(p)]
    busy = V * m if name == "interleaved" else 3 * m
    assert result["bubble"] == pytest.approx((p - 1) / (busy + p - 1))
    assert result["formula"]["bubble"] == pytest.approx((p - 1) / (busy + p - 1))
    if name == "interleaved":
        peaks = [min(2 * (p - s - 1) + (V - 1) * p, m * V) + 1 for s in range(p)]
    else:
        peaks = [p] * p
    assert result["peak_inflight"] == result["formula"]["peak_inflight"] == peaks
    if (p, name, m) == (2, "zb-h1", 4):
        assert TIMELINE_ZB_2x4 in output
        for row in TIMELINE_ZB_2x4.splitlines():  # the docstring draws what runs
            assert row.strip() in pipeline_schedules.__doc__


@pytest.mark.parametrize("case", CASES[::2], ids=IDS[::2])
def test_measured_point_to_point_per_rank(case, runs):
    """Each chunk boundary carries m activations of B/m·T·D fp32 forward and m gradients back:
    rank s sends one per micro-batch from each chunk but the last (F) and each but the first (B);
    nothing else."""
    p, _, V, m, _ = case
    result = runs[case][0]
    args = common.parse_args(common.get_parser("test"), CFG)
    message = 4 * (args.batch_size // m) * common.build_model(args).embed.tokens * args.dim
    for s, stage in enumerate(result["stages"]):
        global_chunks = range(s, V * p, p)
        n = m * sum((c < V * p - 1) + (c > 0) for c in global_chunks)
        assert stage["comm"] == dict(send=n * message, recv=n * message), (s, stage["comm"])
        assert stage["comm_calls"] == dict(send=n * WINDOW, recv=n * WINDOW), s
    assert result["comm"] == result["formula"]["comm"]


@pytest.mark.parametrize("name, V, m", [("interleaved", 2, 8), ("zb-h1", 1, 4)])
def test_simulated_bubble_from_every_stage(name, V, m, monkeypatch, capsys, one_thread):
    """--simulate 4: the one process runs each of the 4 stages' schedules in turn (the fake
    group's gather has only its own); what each ran is the schedule, and replayed it idles
    (p-1)/(V·m+p-1) (interleaved) or (p-1)/(3m+p-1) (zb-h1) of the slots, the formula."""
    p = 4
    flags = [*CFG, "--simulate", p, "--schedule", name, "--virtual-stages", V]
    result = simulated(pipeline_schedules, [*flags, "--microbatches", m], monkeypatch, capsys)
    assert result["simulated"] and result["world_size"] == p and "stages" not in result
    ran = [[tuple(action) for action in order] for order in result["orders"]]
    assert ran == [expected_order(name, m, p, s, V) for s in range(p)]
    busy = V * m if name == "interleaved" else 3 * m
    assert result["bubble"] == pytest.approx((p - 1) / (busy + p - 1))
    assert result["formula"]["bubble"] == pytest.approx((p - 1) / (busy + p - 1))
    assert result["peak_inflight"] == result["formula"]["peak_inflight"]
    assert result["comm"] == result["formula"]["comm"]  # rank 0's


def link_messages(name, m, p, V):
    """Per link (sender, receiver): the messages in the order the sender's schedule sends them,
    and in the order the receiver's schedule waits for them, each named (F | B, micro-batch, the
    receiver's chunk). F's output goes to global chunk c+1, B's to c-1; W sends nothing."""
    sent = defaultdict(list)
    wanted = defaultdict(list)
    for s in range(p):
        for step in pipeline_schedules.schedule(name, m, p, s, V):
            for action, i, v in step:
                if action == "W":
                    continue
                here = v * p + s
                there = here + 1 if action == "F" else here - 1
                source = here - 1 if action == "F" else here + 1
                if 0 <= there < V * p:
                    sent[s, there % p].append((action, i, there // p))
                if 0 <= source < V * p:
                    wanted[source % p, s].append((action, i, v))
    return sent, wanted


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_p2p_order_is_nccl_safe(p, monkeypatch, one_thread):
    """Every schedule, m in {p, 2p, 3p}: every communication each rank's loop issues (train past
    logging steps and an epoch boundary, evaluation, the save; test_pipeline.loop_calls),
    replayed under NCCL's rule: no rank waits for ever, every message has a partner of its size
    and dtype, a step carries 2(V·p-1)·m messages and an evaluation batch V·p-1, every rank
    issues the loop's collectives in the same order; and on every link the n-th send is the
    message the n-th receive waits for (NCCL matches by order)."""
    cpu = torch.device("cpu")

    def parallelize(model, args):
        return pipeline_schedules.parallelize(model, cpu, args.virtual_stages)

    for name, V in (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 3)):
        for m in (p, 2 * p, 3 * p):
            flags = [*LOOP, "--depth", p * V, "--batch-size", 2 * m, "--microbatches", m]
            flags += ["--schedule", name, "--virtual-stages", V]
            calls = loop_calls(pipeline_schedules, flags, p, monkeypatch, parallelize)
            boundaries = V * p - 1
            assert sends(calls) == LOOP_STEPS * 2 * boundaries * m + 2 * boundaries
            assert [collectives(rank_calls) for rank_calls in calls] == [LOOP_COLLECTIVES] * p
            assert replay(calls) is None, (name, V, p, m)
            sent, wanted = link_messages(name, m, p, V)
            assert sent == wanted, (name, V, p, m)


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
        pipeline_schedules.check_args(argparse.Namespace(**{**ok_args, **flags}), world)
    assert e.value.code == 2 and message in capsys.readouterr().err
    pipeline_schedules.check_args(argparse.Namespace(**ok_args), world)
    interleaved = {**ok_args, "schedule": "interleaved", "virtual_stages": 2}
    pipeline_schedules.check_args(argparse.Namespace(**interleaved), 2)
