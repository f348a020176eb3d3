"""pipeline.py: every schedule (naive with m > 1 too) ends with the same parameters as the
one-process ddp.py run, with SGD and AdamW, at p=2 and at p=3 (4 blocks do not split 3 ways); the
order in which each stage's forwards and backwards ran (recorded from outside the technique by
common.record_pipeline_order) is the schedule, and its bubble and peak in flight are the script's
formula; with --clip (p=2 and p=3, a limit that clips) the parameters are ddp.py --clip's at
W=1, so the norm was the one over all stages; each stage's parameter, gradient, optimizer and
point-to-point bytes, measured by the Meter, are what this test works out from the model; the
saved state_dict loads in ddp.py.

NCCL's rule, in-process: every communication each rank's training loop, evaluation and save issue,
collectives included, recorded in order and replayed (`loop_calls` and `replay`, which the other
pipeline tests share): no rank waits for ever; the replay does catch the one-op-per-group pairing
that deadlocked, and a send left open across a collective. Two pipelines side by side in a world
of four, each on its process group (peers are group ranks): each message stays in its pipeline,
the save gathers on the pipeline's group, and the replay per communicator gets through. Bad input
is refused."""

import argparse
import json
import re
import sys
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import common
import pipeline
from helpers import SMALL, ddp_references, launch_cases, max_diff

DEPTH = 4
CFG = [*SMALL, "--depth", str(DEPTH)]  # the same config as test_tensor_parallel.py: shared refs
TOL = {"sgd": 1e-6, "adamw": 5e-5}  # round-off; AdamW turns it into steps on ~0 gradients
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
CLIP = "0.05"  # below every step's gradient norm on CFG: each step is clipped
CLIPPED = [(2, "1f1b", 4, "sgd"), (3, "gpipe", 4, "sgd")]  # also run with --clip, in the launches
F32 = str(torch.float32)  # a message's dtype, as the replay records it

# the docstring's picture: a slot per forward, two per backward
TIMELINE_1F1B_2x4 = """\
  rank 0:  F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 .  B3 B3
  rank 1:  .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .  ."""


def expected_order(name, m, p, s):
    """The schedules as the docstring defines them, written out here independently."""
    if name == "naive":  # micro-batch i's backward before i+1's forward
        return [action for i in range(m) for action in (("F", i), ("B", i))]
    if name == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    order = []  # 1f1b: p-s-1 forwards ahead, then F B F B ..., then the Bs
    forwards = 0
    backwards = 0
    while backwards < m:
        if forwards < m and (forwards < p - s or order[-1][0] == "B"):
            order.append(("F", forwards))
            forwards += 1
        else:
            order.append(("B", backwards))
            backwards += 1
    return order


def stage_params(model, p):
    """Parameters per stage, the blocks cut as the script cuts them: s·d/p .. (s+1)·d/p - 1."""
    depth = len(model.blocks)
    counts = []
    for s in range(p):
        modules = list(model.blocks[s * depth // p : (s + 1) * depth // p])
        if s == 0:
            modules.append(model.embed)
        if s == p - 1:
            modules.append(model.head)
        counts.append(sum(q.numel() for module in modules for q in module.parameters()))
    return counts


@pytest.fixture(scope="module")
def runs(tmp_path_factory, initial):
    """One launch per world size runs all its cases, and the p=2 launch ends with ddp.py loading
    one pipeline save with lr 0 and saving it again. Returns {case: (RESULT, saved path, this
    case's output)} and the two paths of the ddp round trip."""
    folder = tmp_path_factory.mktemp("pp")
    saved = {case: folder / f"{i}.pt" for i, case in enumerate(CASES)}
    out = {}
    for world in (2, 3):
        cases = [case for case in CASES if case[0] == world]
        argv = []
        for case in cases:
            _, schedule, m, optim = case
            flags = [*CFG, "--schedule", schedule, "--microbatches", m, "--optim", optim]
            flags += ["--save", saved[case]]
            if case == LOADED:
                flags += ["--load", initial]
            argv.append(["pipeline", flags])
        clipped = [case for case in CLIPPED if case[0] == world]
        for case in clipped:
            _, schedule, m, optim = case
            flags = [*CFG, "--schedule", schedule, "--microbatches", m, "--optim", optim]
            argv.append(
                ["pipeline", [*flags, "--clip", CLIP, "--save", folder / f"clip-p{world}.pt"]]
            )
        if world == 2:
            round_trip = ["--optim", "sgd", "--lr", 0, "--max-steps", 1]
            round_trip += ["--load", saved[CASES[0]], "--save", folder / "ddp.pt"]
            argv.append(["ddp", [*CFG, *round_trip]])
        results = launch_cases(world, argv)
        for case, (result, output) in zip(cases, results, strict=False):
            out[case] = (result, saved[case], output)
        for case, (result, output) in zip(clipped, results[len(cases) :], strict=False):
            out["clip", case] = (result, folder / f"clip-p{world}.pt", output)
    return out, (saved[CASES[0]], folder / "ddp.pt")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_same_parameters_as_ddp_one_process(case, runs, refs):
    p, schedule, m, optim = case
    result, path, _ = runs[0][case]
    diff = max_diff(refs[optim], path)
    print(f"pipeline p={p} {schedule} m={m} {optim}: max |Δparam| vs ddp.py W=1 = {diff:.3g}")
    assert (result["world_size"], result["steps"]) == (p, 6)
    assert diff < TOL[optim]


@pytest.mark.parametrize("case", CLIPPED, ids=[f"p{p}-{s}-m{m}-{o}" for p, s, m, o in CLIPPED])
def test_clip_equals_one_ddp_process_clip(case, runs, refs, tmp_path_factory):
    """--clip at a limit below every step's gradient norm: the stages end where ddp.py --clip
    ends in one process, so the norm was the global one (each stage's squares summed over the
    stages). Unclipped training ends far from there, so the clip bit."""
    _, schedule, m, optim = case
    result, path, _ = runs[0]["clip", case]
    clipped = ddp_references(tmp_path_factory, [*CFG, "--clip", CLIP], (optim,))[optim]
    assert max_diff(clipped, refs[optim]) > 100 * TOL[optim]
    diff = max_diff(path, clipped)
    print(f"pipeline p={case[0]} {schedule} --clip {CLIP}: {diff:.2e} from ddp.py --clip W=1")
    assert result["steps"] == 6
    assert diff < TOL[optim]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_recorded_order_bubble_and_in_flight(case, runs):
    """What each stage ran, in order, as the instrument's hooks saw it, is the schedule; replayed
    one slot per F and two per B, it idles (p-1)/p (naive) or (p-1)/(m+p-1) (gpipe, 1f1b) of the
    slots, the script's formula; and the most micro-batches whose forward ran and backward did not
    is 1, m, or p-s on stage s."""
    p, schedule, m, _ = case
    result, _, output = runs[0][case]
    ran = [[(action, i) for action, i, _ in stage["order"]] for stage in result["stages"]]
    assert ran == [expected_order(schedule, m, p, s) for s in range(p)]
    bubble = (p - 1) / p if schedule == "naive" else (p - 1) / (m + p - 1)
    assert result["bubble"] == pytest.approx(bubble)
    assert result["formula"]["bubble"] == pytest.approx(bubble)
    in_flight = {"naive": [1] * p, "gpipe": [m] * p, "1f1b": [p - s for s in range(p)]}
    assert result["peak_inflight"] == result["formula"]["peak_inflight"] == in_flight[schedule]
    if (p, schedule, m) == (2, "1f1b", 4):
        assert TIMELINE_1F1B_2x4 in output
        for row in TIMELINE_1F1B_2x4.splitlines():  # the docstring draws what runs
            assert row.strip() in pipeline.__doc__


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_measured_bytes_per_stage(case, runs):
    """Stage s holds its own Ψ_s parameters, gradients and optimizer state (AdamW m, v; SGD
    momentum), counted here off the model cut as the script cuts it (4 blocks over 3 stages: 1, 1,
    2). Per step, each boundary carries m activations of B/m·T·D fp32 forward and m gradients
    back: 2(p-1)·m messages in all, and nothing else is communicated."""
    p, _, m, optim = case
    result, _, _ = runs[0][case]
    args = common.parse_args(common.get_parser("test"), CFG)
    model = common.build_model(args)
    message = 4 * (args.batch_size // m) * model.embed.tokens * args.dim
    optim_per_param = 8 if optim == "adamw" else 4
    assert sum(stage_params(model, p)) == result["params"]
    for s, (stage, psi) in enumerate(zip(result["stages"], stage_params(model, p), strict=True)):
        measured = (stage["param_bytes"], stage["grad_bytes"], stage["optim_bytes"])
        assert measured == (4 * psi, 4 * psi, optim_per_param * psi)
        neighbours = (s > 0) + (s < p - 1)  # an activation and a gradient each way per neighbour
        traffic = neighbours * m * message
        calls = neighbours * m * WINDOW
        assert stage["comm"] == dict(send=traffic, recv=traffic), (s, stage)
        assert stage["comm_calls"] == dict(send=calls, recv=calls), (s, stage)
    sends = sum(stage["comm_calls"]["send"] for stage in result["stages"])
    assert sends == 2 * (p - 1) * m * WINDOW
    assert result["comm"] == result["stages"][0]["comm"]  # RESULT's own fields: rank 0's
    assert result["comm_steps"] == WINDOW


def test_saved_state_loads_in_ddp(runs):
    """ddp.py --load of a pipeline save, trained with lr 0 and saved again, gives back the same
    tensors: the stages' parts gathered on rank 0 are the common model's state_dict, key for key."""
    pipe, again = runs[1]
    assert max_diff(pipe, again) == 0


def simulated(module, flags, monkeypatch, capsys):
    """`python <module>.py --simulate W ...` in this process (one rank of W on the fake group, the
    model on meta: no other process to start), its RESULT. common.launch sets the rank's variables
    in os.environ: set here first, so that monkeypatch takes them away again after the test."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *map(str, flags)])
    capsys.readouterr()
    module.main()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1 and not dist.is_initialized()
    return json.loads(lines[0][len("RESULT ") :])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_simulated_bubble_from_every_stage(schedule, monkeypatch, capsys, one_thread):
    """--simulate 4 at m = 4: the one process runs each of the 4 stages' schedules in turn (the
    fake group's gather has only its own), and what each stage ran, replayed, idles (p-1)/(m+p-1)
    of the slots, the formula; the memory and traffic reported stay rank 0's: its Ψ_0, and m
    activations out and m gradients in, in the one step."""
    p, m = 4, 4
    flags = [*CFG, "--simulate", p, "--schedule", schedule, "--microbatches", m]
    result = simulated(pipeline, flags, monkeypatch, capsys)
    assert result["simulated"] and result["world_size"] == p and "stages" not in result
    ran = [[(action, i) for action, i, _ in order] for order in result["orders"]]
    assert ran == [expected_order(schedule, m, p, s) for s in range(p)]
    assert result["bubble"] == pytest.approx((p - 1) / (m + p - 1))
    assert result["formula"]["bubble"] == pytest.approx((p - 1) / (m + p - 1))
    in_flight = [m] * p if schedule == "gpipe" else [p - s for s in range(p)]
    assert result["peak_inflight"] == result["formula"]["peak_inflight"] == in_flight
    args = common.parse_args(common.get_parser("test"), CFG)
    model = common.build_model(args)
    psi = stage_params(model, p)[0]
    assert (result["param_bytes"], result["optim_bytes"]) == (4 * psi, 8 * psi)
    message = 4 * (args.batch_size // m) * model.embed.tokens * args.dim
    assert result["comm"] == dict(send=m * message, recv=m * message)
    assert result["comm_calls"] == dict(send=m, recv=m) and result["comm_steps"] == 1


# ------------------------------------------------------------------------ NCCL's rule, in-process
# A rank's communications in the order it issued them, each one of
#   ("p2p", [(peer, "send" | "recv", numel, dtype), ...])
#                                                     a group of point-to-point ops, waited for
#                                                     together (a blocking send or receive: one op);
#                                                     peer: the global rank, whatever the group
#   (collective, numel)                               all_reduce, gather_object, ... on the world
#                                                     (numel None for objects)
#   (collective, numel, ranks)                        the same on the process group of those
#                                                     global ranks (tests/record_comm.py always
#                                                     writes them, the world's too)


def replay(calls):
    """NCCL's rule on `calls[r]`, rank r's communications: each rank runs its calls in order, each
    to completion. A point-to-point group completes once the partner of each of its ops (the n-th
    send r->q pairs with the n-th receive on q from r) is in a call its rank has reached; a
    collective once every rank of its process group has reached it (its n-th collective on that
    group: the group's ranks must issue the same ones in the same order). Returns None when every
    rank gets through, else the call each rank is stuck at."""
    waits_for = [[[] for _ in rank_calls] for rank_calls in calls]
    pair_messages(calls, waits_for)
    line_up_collectives(calls, waits_for)
    reached = [0] * len(calls)
    moved = True
    while moved:
        moved = False
        for rank, rank_calls in enumerate(calls):
            at = reached[rank]
            if at < len(rank_calls) and all(reached[q] >= k for q, k in waits_for[rank][at]):
                reached[rank] = at + 1
                moved = True
    if reached == [len(rank_calls) for rank_calls in calls]:
        return None
    return reached


def pair_messages(calls, waits_for):
    """Each send with its receive, and each of their calls waiting for the other's: on a link
    sender -> receiver, the n-th send is the n-th receive's message, of the same size and dtype
    (NCCL moves bytes: a bf16 message received as fp16 arrives as garbage, with no error)."""
    ends = {}  # (sender, receiver, n) -> {"send": (rank, call, numel), "recv": (...)}
    counted = Counter()
    for rank, rank_calls in enumerate(calls):
        for k, call in enumerate(rank_calls):
            if call[0] != "p2p":
                continue
            for peer, direction, numel, dtype in call[1]:
                link = (rank, peer) if direction == "send" else (peer, rank)
                n = counted[direction, link]
                counted[direction, link] += 1
                ends.setdefault((*link, n), {})[direction] = (rank, k, (numel, dtype))
    for message, end in ends.items():
        assert end.keys() == {"send", "recv"}, f"message {message} has no partner: {end}"
        sender, send_call, sent = end["send"]
        receiver, recv_call, expected = end["recv"]
        assert sent == expected, (
            f"message {message}: {sent} sent, {expected} received (elements, dtype)"
        )
        waits_for[sender][send_call].append((receiver, recv_call))
        waits_for[receiver][recv_call].append((sender, send_call))


def line_up_collectives(calls, waits_for):
    """NCCL matches collectives by their order on a communicator, one a process group: on each
    group, every one of its ranks' n-th must be the same collective of the same size, and it
    completes when each rank of the group has reached its n-th."""
    world = tuple(range(len(calls)))
    positions = {}  # a group's ranks -> {rank: where its collectives on the group are in its calls}
    for rank, rank_calls in enumerate(calls):
        for k, call in enumerate(rank_calls):
            if call[0] == "p2p":
                continue
            ranks = tuple(call[2]) if len(call) > 2 else world
            assert rank in ranks, f"rank {rank} issues {call} on a group without it"
            positions.setdefault(ranks, {q: [] for q in ranks})[rank].append(k)
    for ranks, on_group in positions.items():
        issued = [[calls[q][k][:2] for k in on_group[q]] for q in ranks]
        assert all(sequence == issued[0] for sequence in issued), (
            f"the ranks' collectives differ on group {ranks}: {issued}"
        )
        for rank, ks in on_group.items():
            for n, k in enumerate(ks):
                waits_for[rank][k] = [(q, on_group[q][n]) for q in ranks]


def sends(calls):
    """The messages sent, every rank's together."""
    count = 0
    for rank_calls in calls:
        for call in rank_calls:
            if call[0] == "p2p":
                count += sum(direction == "send" for _, direction, _, _ in call[1])
    return count


def collectives(rank_calls):
    """A rank's collectives, in order."""
    return [call for call in rank_calls if call[0] != "p2p"]


def test_replay_itself():
    """The rule on hand-made cases: a send and a receive in one group on each side pass; both
    ranks sending first, each send in a group of its own, deadlock (pipeline.py's old pairing);
    one sending first and the other receiving first pass; a send left open across an all-reduce
    that its receiver reaches first deadlocks (PipeDream's hang, issue 25), and posted after it
    passes; ranks that disagree on their collectives fail. On process groups: a collective waits
    for its group's ranks only; two groups' collectives in crossed orders deadlock (rank 1 waits
    in group (0, 1) for rank 0, which waits in group (0, 2) for rank 2, which waits for rank 1's
    send), as NCCL's communicators would, and in the same order pass. A message sent in bf16 and
    received in fp16, the same size, is caught: NCCL would deliver it as garbage."""
    send = ("p2p", [(1, "send", 4, F32)])
    recv = ("p2p", [(1, "recv", 4, F32)])
    send_back = ("p2p", [(0, "send", 4, F32)])
    recv_back = ("p2p", [(0, "recv", 4, F32)])
    exchange = ("p2p", [(1, "send", 4, F32), (1, "recv", 4, F32)])
    exchange_back = ("p2p", [(0, "send", 4, F32), (0, "recv", 4, F32)])
    all_reduce = ("all_reduce", 1)
    assert replay([[exchange], [exchange_back]]) is None
    assert replay([[send, recv], [send_back, recv_back]]) == [0, 0]
    assert replay([[send, recv], [recv_back, send_back]]) is None
    assert replay([[all_reduce, recv], [send_back, all_reduce]]) == [0, 0]
    assert replay([[all_reduce, recv], [all_reduce, send_back]]) is None
    with pytest.raises(AssertionError, match="collectives differ"):
        replay([[all_reduce], [("gather_object", None)]])
    with pytest.raises(AssertionError, match="has no partner"):
        replay([[send], []])
    bf16_send = ("p2p", [(1, "send", 4, "torch.bfloat16")])
    fp16_recv = ("p2p", [(0, "recv", 4, "torch.float16")])
    with pytest.raises(AssertionError, match="torch.bfloat16.* sent, .*torch.float16.* received"):
        replay([[bf16_send], [fp16_recv]])
    on_01 = ("all_reduce", 1, [0, 1])
    on_02 = ("all_reduce", 1, [0, 2])
    send_1_to_2 = ("p2p", [(2, "send", 4, F32)])
    recv_2_from_1 = ("p2p", [(1, "recv", 4, F32)])
    assert replay([[on_01], [on_01], []]) is None
    assert replay([[on_02, on_01], [on_01, send_1_to_2], [recv_2_from_1, on_02]]) == [0, 0, 0]
    assert replay([[on_02, on_01], [on_01, send_1_to_2], [on_02, recv_2_from_1]]) is None
    with pytest.raises(AssertionError, match="collectives differ on group"):
        replay([[on_01], [("gather_object", None, [0, 1])], []])


class FakeGroup:
    """Stands in for a process group (dist.new_group's): its global ranks, group rank r at r."""

    def __init__(self, ranks):
        self.ranks = sorted(ranks)


class FakeOp:
    """Stands in for dist.P2POp (which needs a process group). Its peer is the global rank, as
    P2POp's is: given as one (peer), or as a rank of `group` (group_peer)."""

    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        self.op = op
        self.tensor = tensor
        if peer is None and group is None:
            peer = group_peer
        elif peer is None:
            peer = group.ranks[group_peer]
        self.peer = peer


class FakeWork:
    def wait(self):
        return True


class RecordedWorld:
    """torch.distributed as rank `rank` of a world of `world` sees it, in this process: every
    communication is appended to `calls` (the format above) and nothing is sent; received tensors
    are filled with random numbers, so the computation goes on. dist.new_group makes a FakeGroup,
    whose ranks get_rank, get_world_size and get_global_rank read; a collective on one is recorded
    with its ranks. A torch.distributed call this does not stand in for finds no process group
    and raises: nothing communicates unrecorded."""

    COLLECTIVES = (
        "all_reduce",
        "reduce",
        "broadcast",
        "barrier",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
        "gather",
        "scatter",
        "gather_object",
        "all_gather_object",
        "broadcast_object_list",
        "scatter_object_list",
    )

    def __init__(self, monkeypatch, world):
        self.world = world
        self.rank = 0
        self.calls = []
        monkeypatch.setattr(dist, "get_rank", self.get_rank)
        monkeypatch.setattr(dist, "get_world_size", self.get_world_size)
        monkeypatch.setattr(dist, "new_group", lambda ranks, **kwargs: FakeGroup(ranks))
        monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: group.ranks[rank])
        monkeypatch.setattr(dist, "P2POp", FakeOp)
        monkeypatch.setattr(dist, "batch_isend_irecv", self.batch_isend_irecv)
        for name in ("isend", "send"):
            monkeypatch.setattr(dist, name, self.one_op("send"))
        for name in ("irecv", "recv"):
            monkeypatch.setattr(dist, name, self.one_op("recv"))
        for name in self.COLLECTIVES:
            monkeypatch.setattr(dist, name, self.collective(name))

    def start(self, rank):
        """From now on, record as rank `rank`, in a fresh list."""
        self.rank = rank
        self.calls = []

    def get_rank(self, group=None):
        if group is None:
            return self.rank
        return group.ranks.index(self.rank)

    def get_world_size(self, group=None):
        if group is None:
            return self.world
        return len(group.ranks)

    def batch_isend_irecv(self, ops):
        assert ops, "an empty group"
        group = []
        for op in ops:
            direction = "send" if op.op is dist.isend else "recv"
            group.append((op.peer, direction, op.tensor.numel(), str(op.tensor.dtype)))
            if direction == "recv":
                op.tensor.normal_()
        self.calls.append(("p2p", group))
        return [FakeWork() for _ in ops]

    def one_op(self, direction):
        """dist.isend / dist.send (direction "send") or dist.irecv / dist.recv: a group of one."""

        def point_to_point(tensor, peer=None, group=None, tag=0, **kwargs):
            if peer is None:  # given as a rank of `group`: recorded as the global rank
                group_peer = kwargs.get("group_dst", kwargs.get("group_src"))
                peer = group_peer if group is None else group.ranks[group_peer]
            self.calls.append(("p2p", [(peer, direction, tensor.numel(), str(tensor.dtype))]))
            if direction == "recv":
                tensor.normal_()
            return FakeWork()

        return point_to_point

    def collective(self, name):
        def issue(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            call = (name, tensors[0].numel() if tensors else None)
            group = kwargs.get("group")  # the sections pass it by name
            if group is not None:
                call = (*call, group.ranks)
            self.calls.append(call)
            if name == "gather_object" and len(args) > 1 and args[1] is not None:
                args[1][:] = [args[0]] * len(args[1])  # every rank's part, as rank 0 gets them
            return FakeWork() if kwargs.get("async_op") else None

        return issue


def script_args(module, flags, world, monkeypatch):
    """The script's args for `flags`, parsed and checked by its own main() for a world of `world`
    (common.launch stood in for: nothing starts)."""
    launched = []
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = [f"{module.__name__}.py", *map(str, flags), "--nproc", str(world)]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(common, "launch", lambda run, args: launched.append(args))
    module.main()
    return launched[0]


# The loop the replay runs: 2 batches an epoch, 3 steps, each with its logged loss (an all-reduce
# between every two steps, and at the epoch boundary), evaluation in 2 batches, the save's gather.
LOOP = [*"--epochs 2 --max-steps 3 --log-every 1 --dim 8 --heads 2 --patch 14".split()]
LOOP += [*"--optim sgd --no-progress".split()]
LOOP_STEPS = 3
EVAL_BATCHES = 2
LOOP_COLLECTIVES = [("all_reduce", 1)] * LOOP_STEPS + [("all_reduce", 2), ("gather_object", None)]


def loop_calls(module, flags, world, monkeypatch, parallelize=None):
    """Every communication `module`'s loop issues on each rank of a world of `world`, in order:
    its train() (past logging steps and an epoch boundary), evaluate() and full_state_dict(),
    run in this process one rank after the other, on random data, the stage, optimizer and loader
    built as the script's run() builds them (`parallelize(model, args)` where the script's
    parallelize takes more than the model and the device)."""
    args = script_args(module, flags, world, monkeypatch)
    world_view = RecordedWorld(monkeypatch, world)
    cpu = torch.device("cpu")
    samples = 2 * args.batch_size
    train_set = common.Digits(torch.randn(samples, 1, 28, 28), torch.randint(0, 10, (samples,)))
    test_set = common.Digits(torch.randn(6, 1, 28, 28), torch.randint(0, 10, (6,)))
    calls = []
    for rank in range(world):
        world_view.start(rank)
        model = common.build_model(args)
        if parallelize is None:
            stage = module.parallelize(model, cpu)
        else:
            stage = parallelize(model, args)
        sampler = DistributedSampler(
            train_set, num_replicas=1, rank=0, shuffle=True, seed=args.seed, drop_last=True
        )
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
        optimizer = common.make_optimizer(stage.parameters(), args)
        steps = common.total_steps(args, len(loader))
        scheduler = common.make_scheduler(optimizer, args, steps)
        module.train(stage, optimizer, scheduler, loader, sampler, args, cpu)
        module.evaluate(stage, common.test_loader(test_set, batch=4), cpu)
        module.full_state_dict(stage)
        calls.append(world_view.calls)
    return calls


def old_pairing(order, s, p, message):
    """pipeline.py before the pairing (git history): every send and receive a group of its own, a
    forward's receive before it and its send after it, the same for a backward."""
    calls = []
    for action, _ in order:
        source, destination = (s - 1, s + 1) if action == "F" else (s + 1, s - 1)
        if 0 <= source < p:
            calls.append(("p2p", [(source, "recv", message, F32)]))
        if 0 <= destination < p:
            calls.append(("p2p", [(destination, "send", message, F32)]))
    return calls


@pytest.fixture
def one_thread():
    """Tiny matrices: one thread, not a fight over busy cores (100x faster on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_p2p_order_is_nccl_safe(p, monkeypatch, one_thread):
    """For every schedule and m in {p, p+1, 2p}: every communication each rank's loop issues
    (loop_calls), replayed under NCCL's rule: no rank waits for ever, every message has a partner
    of its size and dtype, a step carries 2(p-1)·m messages and an evaluation batch p-1, and
    every rank issues the loop's collectives (3 logged losses, evaluation's counts, the save's
    gather) in the same order. The same replay finds the deadlock of the old pairing (one op a
    group) in 1F1B."""
    for name in SCHEDULES:
        for m in (p, p + 1, 2 * p):
            flags = [*LOOP, "--depth", DEPTH, "--batch-size", 2 * m]
            flags += ["--schedule", name, "--microbatches", m]
            calls = loop_calls(pipeline, flags, p, monkeypatch)
            assert sends(calls) == LOOP_STEPS * 2 * (p - 1) * m + EVAL_BATCHES * (p - 1)
            assert [collectives(rank_calls) for rank_calls in calls] == [LOOP_COLLECTIVES] * p
            assert replay(calls) is None, (name, p, m)
            message = 2 * 4 * 8  # 2 samples a micro-batch, 4 tokens, dim 8
            orders = [old_pairing(expected_order(name, m, p, s), s, p, message) for s in range(p)]
            old = replay(orders)
            assert (old is not None) == (name == "1f1b"), (name, p, m, old)


def test_two_pipelines_on_groups_are_nccl_safe(monkeypatch, one_thread):
    """Two pipelines of two stages side by side in a world of four, each on its process group,
    {0, 2} and {1, 3} (hybrid_parallel.py's pp groups, whose ranks are not the world's): every
    communication each rank's loop issues, replayed under NCCL's rule per communicator, gets
    through. Each rank's messages go to its own pipeline's other stage only (the peers are group
    ranks, the recorded peers global ones), each pipeline carries its 2m messages a step and one
    an evaluation batch, and the save gathers on the pipeline's group while the loop's own
    all-reduces stay on the world. A send, receive or gather that forgets the group fails here."""
    m = 4
    cpu = torch.device("cpu")

    def on_pipes(model, args):
        pipes = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank makes both
        return pipeline.parallelize(model, cpu, group=pipes[dist.get_rank() % 2])

    flags = [*LOOP, "--depth", DEPTH, "--batch-size", 2 * m]
    flags += ["--schedule", "1f1b", "--microbatches", m]
    calls = loop_calls(pipeline, flags, 4, monkeypatch, on_pipes)
    for rank, rank_calls in enumerate(calls):
        peers = {peer for call in rank_calls if call[0] == "p2p" for peer, _, _, _ in call[1]}
        assert peers == {(rank + 2) % 4}, (rank, peers)
        pipe = [rank % 2, rank % 2 + 2]
        saved = ("gather_object", None, pipe)
        assert collectives(rank_calls) == [*LOOP_COLLECTIVES[:-1], saved], rank
    assert sends(calls) == 2 * (LOOP_STEPS * 2 * m + EVAL_BATCHES)
    assert replay(calls) is None


# parallelize told another activation than the blocks give: the dtype (a bf16 model, fp16 buffers)
# or the shape (5 tokens where the ViT at --patch 14 has 4)
UNLIKE_RECEIVES = {
    "dtype": (
        dict(activation_dtype=torch.float16),
        "[2, 4, 8] torch.bfloat16 tensor where its peer receives [2, 4, 8] torch.float16",
    ),
    "shape": (
        dict(activation_shape=(5, 8)),
        "[2, 4, 8] torch.float32 tensor where its peer receives [2, 5, 8] torch.float32",
    ),
}


@pytest.mark.parametrize("told, message", UNLIKE_RECEIVES.values(), ids=UNLIKE_RECEIVES)
def test_a_send_unlike_its_receive_stops_the_stage(told, message, monkeypatch, one_thread):
    """Stage 0 of 2 whose activation is not what stage 1's receive buffer holds stops at its first
    send with one clear error, before anything is sent: NCCL would hang on another size, and
    deliver another dtype of the same size (bf16 into fp16) as garbage with no error."""
    world_view = RecordedWorld(monkeypatch, 2)
    world_view.start(0)
    args = common.parse_args(common.get_parser("test"), [*LOOP, "--depth", str(DEPTH)])
    model = common.build_model(args)
    if told.get("activation_dtype") is not None:
        model = model.to(torch.bfloat16)
    stage = pipeline.parallelize(model, torch.device("cpu"), **told)
    x = torch.randn(4, 1, 28, 28, dtype=next(model.parameters()).dtype)
    y = torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match=re.escape(f"pipeline stage 0 sends a {message}")):
        pipeline.train_step(stage, x, y, "1f1b", 2)
    assert world_view.calls == [], "a send went out"


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
            "--schedule 1f1b needs at least as many micro-batches as stages: "
            "--microbatches 2 < 4 stages",
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
