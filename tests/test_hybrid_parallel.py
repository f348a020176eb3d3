"""hybrid_parallel.py: this codebase's own sections composed on one DeviceMesh, each on its
dimension's group — ZeRO over dp, Megatron TP over tp, the 1F1B pipeline over pp; ring attention
over cp beside dp; experts over ep beside dp — end with the parameters of the one-process ddp.py
run (SGD: a sum where a mean belongs; AdamW: the sharded optimizer state); rank 0 holds ZeRO's
bytes of its stage; --clip is the one global norm of one process (3-D and data x expert); the
loss it reports is one process's; the save loads in ddp.py.

One launch per world size runs its layouts one after another (tests/script_cases.py). The quick
suite runs, at W=4, the three (dp, pp, tp) pairs with ZeRO stages 1 and 3 and sequence
parallelism, data x context and data x expert, and at W=8 the 3-D (2, 2, 2) with ZeRO-3,
sequence parallelism and a clip that bites; the full tier adds the 3-D with ZeRO-1 and with
AdamW, and AdamW for each other layout (FULL lists them).

--mixed-precision (zero.py's bf16 recipe over dp, bf16 across the tp and pp boundaries) joins the
same launches: at dp only it ends where zero.py --mixed-precision ends at the same stage, with
zero.py's rows; with pp or tp within bf16 round-off of one process's bf16 recipe (MP_TOL says
how much and why), its bf16 bytes on every dimension equal to the formula. The quick suite runs
the 3-D (2, 2, 2) with ZeRO-3 and sequence parallelism; the full tier the rest (MP_FULL)."""

import json
import math
import sys

import pytest
import torch
from test_nd_parallel import CFG  # the same small ViT, data and steps as nd_parallel.py's tests
from test_pipeline import replay

import common
import hybrid_parallel
from helpers import ddp_references, fork_launch, launch_cases, max_diff, reference_result

EXPERTS = ["--experts", "4"]
TOL = {"sgd": 1e-6, "adamw": 5e-5}
M = 4  # micro-batches with a pipeline


class Layout:
    """One case: the mesh sizes and what else its flags say."""

    def __init__(
        self,
        dp=1,
        pp=1,
        tp=1,
        cp=1,
        ep=1,
        stage=1,
        sp=False,
        optim="sgd",
        clip=None,
        mixed_precision=False,
    ):
        self.sizes = dict(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep)
        self.stage = stage
        self.sp = sp
        self.optim = optim
        self.clip = clip
        self.mixed_precision = mixed_precision

    @property
    def world(self):
        return math.prod(self.sizes.values())

    @property
    def name(self):
        mesh = "".join(f"{dim}{size}" for dim, size in self.sizes.items() if size > 1)
        sp = "-sp" if self.sp else ""
        clip = f"-clip{self.clip}" if self.clip else ""
        bf16 = "-bf16" if self.mixed_precision else ""
        return f"{mesh}-z{self.stage}{sp}{clip}-{self.optim}{bf16}"

    def flags(self):
        argv = [*CFG, "--optim", self.optim]
        if self.sizes["cp"] == self.sizes["ep"] == 1:  # ZeRO is the pp x dp x tp layout's
            argv += ["--zero-stage", self.stage]
        for dim, size in self.sizes.items():
            argv += [f"--{dim}", size]
        argv += ["--microbatches", M]
        if self.sp:
            argv.append("--sequence-parallel")
        if self.sizes["ep"] > 1:
            argv += EXPERTS
        if self.clip:
            argv += ["--clip", self.clip]
        if self.mixed_precision:
            argv.append("--mixed-precision")
        return argv

    def peer(self):
        """[script, flags] of the run to set beside it in the same launch: at dp only, zero.py
        --mixed-precision at the same stage (None for the other layouts)."""
        if not self.mixed_precision or self.world != self.sizes["dp"]:
            return None
        flags = [*CFG, "--optim", self.optim, "--stage", self.stage, "--mixed-precision"]
        return ["zero", flags]

    def reference_cfg(self):
        """ddp.py's flags for the one-process run this layout must end at."""
        cfg = list(CFG)
        if self.sizes["ep"] > 1:
            cfg += EXPERTS
        if self.clip:
            cfg += ["--clip", str(self.clip)]
        return cfg


CLIP = 0.05  # below every step's gradient norm here: each step is clipped
QUICK = [
    Layout(dp=2, tp=2, stage=1, sp=True),
    Layout(dp=2, pp=2, stage=3),
    Layout(pp=2, tp=2, stage=1),
    Layout(dp=2, cp=2),
    Layout(dp=2, ep=2),
    Layout(dp=2, pp=2, tp=2, stage=3, sp=True, clip=CLIP),
]
FULL = [
    Layout(dp=2, pp=2, tp=2, stage=1, optim="sgd"),
    Layout(dp=2, pp=2, tp=2, stage=3, sp=True, optim="adamw"),
    Layout(dp=2, tp=2, stage=3, optim="adamw"),
    Layout(dp=2, pp=2, stage=1, optim="adamw"),
    Layout(pp=2, tp=2, stage=3, sp=True, optim="adamw"),
    Layout(dp=2, cp=2, optim="adamw"),
    Layout(dp=2, ep=2, optim="adamw"),
]
CASES = [pytest.param(layout, id=layout.name) for layout in QUICK]
CASES += [pytest.param(layout, id=layout.name, marks=pytest.mark.full) for layout in FULL]

# --mixed-precision (issue 43): the 3-D layout with ZeRO-3 and sequence parallelism in the quick
# suite (joining the W=8 launch); at dp only, beside zero.py --mixed-precision in the W=4 launch,
# and each pair of pp and tp, in the full tier. SGD where the peer is one process's bf16 recipe
# (MP_TOL says why), AdamW (the sharded state) where it is zero.py's at the same stage.
MP_QUICK = [Layout(dp=2, pp=2, tp=2, stage=3, sp=True, mixed_precision=True)]
MP_FULL = [
    Layout(dp=4, stage=1, mixed_precision=True),
    Layout(dp=4, stage=2, optim="adamw", mixed_precision=True),
    Layout(dp=4, stage=3, optim="adamw", mixed_precision=True),
    Layout(dp=2, pp=2, stage=3, mixed_precision=True),
    Layout(dp=2, tp=2, stage=1, sp=True, mixed_precision=True),
    Layout(pp=2, tp=2, stage=1, mixed_precision=True),
    Layout(dp=2, pp=2, tp=2, stage=1, mixed_precision=True),
]
MP_CASES = [pytest.param(layout, id=layout.name) for layout in MP_QUICK]
MP_CASES += [pytest.param(layout, id=layout.name, marks=pytest.mark.full) for layout in MP_FULL]
PEER = "-zero"  # runs' key of a dp-only --mixed-precision layout's zero.py run: its name + PEER


def selected_layouts(request):
    """The layouts this session's selected tests of this module use."""
    layouts = []
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is request.module and "layout" in params:
            layouts.append(params["layout"])
    return layouts


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """{layout name: (RESULT, saved path)}: one launch per world size, its layouts in turn."""
    folder = tmp_path_factory.mktemp("hybrid")
    layouts = {layout.name: layout for layout in selected_layouts(request)}
    out = {}
    for world in sorted({layout.world for layout in layouts.values()}):
        argv = []
        names = []
        for name, layout in layouts.items():
            if layout.world == world:
                saved = folder / f"{name}.pt"
                argv.append(["hybrid_parallel", [*layout.flags(), "--save", saved]])
                names.append((name, saved))
                peer = layout.peer()
                if peer is not None:  # out[name + PEER]
                    script, flags = peer
                    saved = folder / f"{name}{PEER}.pt"
                    argv.append([script, [*flags, "--save", saved]])
                    names.append((name + PEER, saved))
        results = launch_cases(world, argv, timeout=300 + 150 * len(argv))
        for (name, saved), (result, _) in zip(names, results, strict=True):
            out[name] = (result, saved)
    return out


@pytest.mark.parametrize("layout", CASES)
def test_same_parameters_as_ddp_one_process(layout, runs, tmp_path_factory):
    r, path = runs[layout.name]
    reference = ddp_references(tmp_path_factory, layout.reference_cfg(), (layout.optim,))
    diff = max_diff(reference[layout.optim], path)
    print(f"hybrid_parallel {layout.name}: max |Δparam| vs ddp.py W=1 = {diff:.3g}")
    assert r["world_size"] == layout.world and r["steps"] == 3
    assert r["mesh"] == layout.sizes
    assert diff < TOL[layout.optim]


@pytest.mark.parametrize("layout", CASES + MP_CASES)
def test_save_loads_strictly_into_a_fresh_model(layout, runs):
    """Every layout saves the model's own state_dict(), whole: a strict load_state_dict into a
    fresh model of the same flags accepts it (its keys, and each tensor's shape), and the model
    then holds exactly what was saved. Data x context saves DDP's copy, data x expert its experts
    gathered over ep, the 3-D layouts the stages' ZeRO shards and tp splits put together."""
    _, path = runs[layout.name]
    saved = torch.load(path, weights_only=True)
    args = common.parse_args(common.get_parser("a fresh model"), layout.reference_cfg())
    model = common.build_model(args)
    model.load_state_dict(saved, strict=True)
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[key]), key


def test_clip_bites(tmp_path_factory):
    """The clipped reference is far from the unclipped one: the clip case's equality means the
    clip ran, with one process's norm."""
    clipped = Layout(clip=CLIP).reference_cfg()
    paths = [ddp_references(tmp_path_factory, cfg, ("sgd",))["sgd"] for cfg in (CFG, clipped)]
    assert max_diff(*paths) > 100 * TOL["sgd"]


THREE_D = [param for param in CASES if param.values[0].sizes["cp"] == param.values[0].sizes["ep"]]


@pytest.mark.parametrize("layout", THREE_D + MP_CASES)
def test_measured_next_to_the_formula(layout, runs):
    """Rank 0's parameter, gradient and optimizer bytes are ZeRO's on its stage's tp split, worked
    out from the model's shapes (ZeRO-1's gradient whole, the micro-batches summed in it), and
    each mesh dimension carries what the formula says: every kind, its bytes a step, exactly
    (under sequence parallelism, the norms' partial gradients too, as rank 0's shards cut them).
    Under --mixed-precision the bytes are what tells its dtypes from fp32's: the parameters the
    fp32 master shards (4Ψ_s/N at ZeRO-1 too), the tp all-reduces and gathers and the pp sends
    bf16 activations (half fp32's bytes), dp all-gathers bf16 parameters and reduce-scatters fp32
    gradients."""
    r, _ = runs[layout.name]
    formula = r["formula"]
    for kind in ("param_bytes", "grad_bytes", "optim_bytes"):
        assert r[kind] == formula[kind], (kind, r[kind], formula[kind])
    measured = r["comm_by_dim"]
    if layout.sizes["dp"] == 1:
        # ZeRO at dp 1 still runs its collectives, on dp's one-rank group, which the report keys
        # by its number (it keys mesh dimensions of size > 1 only): they move nothing between
        # ranks, and the formula counts none.
        one_rank = [name for name in measured if name.startswith("group ")]
        assert len(one_rank) == 1, measured
        del measured[one_rank[0]]
    expected = {dim: traffic for dim, traffic in formula["dims"].items() if traffic}
    assert set(measured) == set(expected), (measured, expected)
    for dim, traffic in expected.items():
        assert set(measured[dim]) == set(traffic), (dim, measured[dim], traffic)
        for kind, nbytes in traffic.items():
            assert measured[dim][kind][1] == nbytes, (dim, kind, measured[dim], nbytes)


# The data x expert layout clipped: expert_parallel.py's clip sums the squares of the experts'
# norms over the ep group, where each expert lives once; over the world it would count each
# expert once per dp copy, a larger norm, a smaller step.
EXPERT_CLIP = Layout(dp=2, ep=2, clip=CLIP)


@pytest.mark.parametrize("layout", [pytest.param(EXPERT_CLIP, id=EXPERT_CLIP.name)])
def test_expert_clip_is_one_process_clip(layout, runs, tmp_path_factory):
    """Under data x expert, --clip ends at the parameters of one process that clips its own
    global norm, and there the clip bites (the unclipped run ends far away)."""
    _, path = runs[layout.name]
    clipped = ddp_references(tmp_path_factory, layout.reference_cfg(), ("sgd",))["sgd"]
    unclipped = ddp_references(tmp_path_factory, [*CFG, *EXPERTS], ("sgd",))["sgd"]
    assert max_diff(clipped, unclipped) > 100 * TOL["sgd"]
    assert max_diff(path, clipped) < TOL["sgd"]


@pytest.mark.parametrize("layout", [*CASES, pytest.param(EXPERT_CLIP, id=EXPERT_CLIP.name)])
def test_reported_loss_is_one_process_loss(layout, runs, tmp_path_factory):
    """The train loss in the RESULT is the one-process run's: the last stage's ranks' losses (the
    same on the tp and cp ranks of a dp rank, each ep rank's its own slice's) averaged, not the
    losses of every rank nor of the dp ranks alone. A wrong divisor is off by a factor of 2."""
    r, _ = runs[layout.name]
    reference = ddp_references(tmp_path_factory, layout.reference_cfg(), (layout.optim,))
    expected = reference_result(reference[layout.optim])["loss"]
    assert math.isclose(r["loss"], expected, rel_tol=1e-5), (r["loss"], expected)


# ------------------------------------------------------------ --mixed-precision against its peers

# With pp or tp the hybrid rounds to bf16 where one process does not: each tp rank's row-parallel
# partial sum is rounded before g's all-reduce adds them (one process rounds the whole sum, once),
# and each micro-batch's and dp rank's bf16 gradient before the fp32 sum (one process rounds the
# batch's, once). bf16 keeps 8 significant bits: such a gradient may be off by 2^-8 of itself.
# Three SGD steps on CFG move a parameter by up to 7.6e-3; the layouts end up to 1.3e-4 from one
# process's bf16 recipe (measured: (dp, pp, tp) = (2, 2, 1) ZeRO-3, (2, 2, 2) ZeRO-1, and ZeRO-3
# with SP, 1.28e-4; (1, 2, 2) 1.09e-4; (2, 1, 2) with SP 1.01e-4), 1.7% of it. MP_TOL is
# 4% of it, far below what an error moves a parameter by (a sum where a mean belongs, a lost
# micro-batch, a tp gradient not summed: about the update itself). It cannot tell bf16 from fp32
# (fp32 ddp.py ends 1.4e-4 from the bf16 recipe, round-off's own size): the bytes do, in
# test_measured_next_to_the_formula. AdamW turns the round-off of near-zero gradients into
# full-size steps (measured 5.3e-3 apart, more than its largest update, 4.0e-3): it is compared
# at dp only, where the peer computes the same bf16 values.
MP_TOL = 3e-4
MP_DP_ONLY = [param for param in MP_CASES if param.values[0].peer() is not None]
MP_PP_TP = [param for param in MP_CASES if param.values[0].peer() is None]


@pytest.fixture(scope="module")
def bf16_reference(tmp_path_factory):
    """One process's bf16 recipe, zero.py --mixed-precision at W=1 on CFG with SGD (bf16 forward
    and backward, fp32 master weights, gradient and step, fp32 logits): its saved path."""
    saved = tmp_path_factory.mktemp("bf16") / "zero-mixed-precision-w1-sgd.pt"
    flags = [*CFG, "--optim", "sgd", "--mixed-precision", "--save", saved]
    launch_cases(1, [["zero", flags]], timeout=180)
    return saved


@pytest.mark.parametrize("layout", MP_DP_ONLY)
def test_mixed_precision_at_dp_only_is_zero_mixed_precision(layout, runs):
    """At dp only the hybrid's ZeRO is zero.py's own mixed-precision part on the same units: it
    ends within fp32 round-off (TOL; measured 0.0) of zero.py --mixed-precision at the same stage,
    run in the same launch, and reports zero.py's rows: the fp32 master, gradient and optimizer
    bytes, the bf16 working copy, the bf16 all-gathers and fp32 reduce-scatters."""
    r, path = runs[layout.name]
    peer, peer_path = runs[layout.name + PEER]
    diff = max_diff(path, peer_path)
    print(f"hybrid_parallel {layout.name}: max |Δparam| vs zero.py --mixed-precision = {diff:.3g}")
    assert diff <= TOL[layout.optim]
    for row in ("param_bytes", "grad_bytes", "optim_bytes", "comm"):
        assert r[row] == peer[row], (row, r[row], peer[row])
    for row in ("param_bytes", "grad_bytes", "optim_bytes", "working_bytes", "comm"):
        assert r["formula"][row] == peer["formula"][row], (row, r["formula"], peer["formula"])


@pytest.mark.parametrize("layout", MP_PP_TP)
def test_mixed_precision_with_pp_or_tp_is_one_process_bf16(layout, runs, bf16_reference):
    """With pp or tp, the activations bf16 across their boundaries, the hybrid ends within bf16
    round-off (MP_TOL) of one process's bf16 recipe."""
    _, path = runs[layout.name]
    diff = max_diff(path, bf16_reference)
    print(
        f"hybrid_parallel {layout.name}: max |Δ| against zero.py --mixed-precision W=1: {diff:.3g}"
    )
    assert diff <= MP_TOL


# ------------------------------------------------------------------------ NCCL's rule, at W=8


def test_p2p_and_collectives_are_nccl_safe_at_w8(tmp_path):
    """The 3-D layout at W=8, (dp, pp, tp) = (2, 2, 2) with ZeRO-3, sequence parallelism and
    --clip, recorded as its ranks issue every communication (tests/record_comm.py: the loop past
    logging steps and an epoch boundary, evaluation, the save), replayed under NCCL's rule per
    communicator (tests/test_pipeline.py's replay): no rank waits for ever, every message has a
    partner of its size and dtype, and the ranks of each process group issue the same collectives
    in the same order."""
    flags = [*CFG, "--epochs", 2, "--limit", 64, "--max-steps", 3, "--log-every", 1]
    flags += ["--dp", 2, "--pp", 2, "--tp", 2, "--zero-stage", 3, "--sequence-parallel"]
    flags += ["--microbatches", 2, "--clip", 1.0]
    run = fork_launch("tests/record_comm.py", 8, tmp_path, "hybrid_parallel", *flags, timeout=400)
    assert run.returncode == 0, run.output
    calls = [json.loads((tmp_path / f"calls-{rank}.json").read_text()) for rank in range(8)]
    groups = {tuple(call[2]) for rank_calls in calls for call in rank_calls if call[0] != "p2p"}
    assert {(0, 1), (0, 2), (0, 4)} <= groups, groups  # tp, dp and pp of rank 0 all carry some
    assert replay(calls) is None


# ----------------------------------------------- --simulate W: ZeRO-1 reduces once a step, measured

# One rank of W = 16 = (pp, dp, tp) (2, 4, 2) with sequence parallelism on torch's fake process
# group, every tensor on meta (common/simulate.py): the script's own parallelize, hooks and train
# step, in this process, in about a second. Each stage holds DEPTH/2 blocks and the embedding
# (the first) or the head (the last): ZeRO's units.
DEPTH = 4
SMALL = ["--dim", 32, "--depth", DEPTH, "--heads", 4, "--batch-size", 64, "--no-progress"]
SIMULATED = [*SMALL, "--simulate", 16, "--pp", 2, "--dp", 4, "--tp", 2, "--microbatches", M]
SIMULATED += ["--sequence-parallel"]


def simulated_result(flags, capsys, monkeypatch):
    """hybrid_parallel.py's main() with `flags` (one with --simulate) in this process: its
    RESULT."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        # common.launch sets them: recorded (setenv), then absent, as --simulate wants, and
        # absent again after the test (delenv alone records nothing of an absent variable)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(sys, "argv", ["hybrid_parallel.py", *[str(flag) for flag in flags]])
    assert not torch.distributed.is_initialized()
    capsys.readouterr()
    hybrid_parallel.main()
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def assert_rows_are_the_formula(r):
    """Every row rank 0 measured equals the formula: its bytes, and each mesh dimension's
    traffic, every kind, a step."""
    formula = r["formula"]
    for kind in ("param_bytes", "grad_bytes", "optim_bytes", "comm"):
        assert r[kind] == formula[kind], (kind, r[kind], formula[kind])
    measured = {
        dim: {kind: nbytes for kind, (_, nbytes) in traffic.items()}
        for dim, traffic in r["comm_by_dim"].items()
    }
    expected = {dim: traffic for dim, traffic in formula["dims"].items() if traffic}
    assert measured == expected


@pytest.mark.parametrize(("stage", "rank"), [(1, 0), (2, 0), (1, 15)])
def test_zero1_reduces_once_a_step(stage, rank, capsys, monkeypatch):
    """With m micro-batches ZeRO-1 sums their gradients in each unit's whole flat gradient and
    reduce-scatters once a step, in the last one's backward: one reduce-scatter a unit over dp,
    4Ψ_s in all, not m of each. ZeRO-2 keeps one a micro-batch (its whole gradient lives until
    then only). Measured on rank 0 (the first stage) and rank 15 (the last stage, dp rank 3) of a
    simulated W = 16, every row equal to the formula of that rank."""
    flags = [*SIMULATED, "--zero-stage", stage, "--simulate-rank", rank]
    r = simulated_result(flags, capsys, monkeypatch)
    assert r["simulated"] and r["world_size"] == 16 and r["steps"] == 1
    units = 1 + DEPTH // 2  # the stage's blocks and the embedding or the head
    calls, nbytes = r["comm_by_dim"]["dp"]["reduce_scatter"]
    assert calls == (units if stage == 1 else M * units), calls
    assert_rows_are_the_formula(r)
    if stage == 1:  # the stage's whole parameters, once reduced, once gathered
        assert nbytes == r["param_bytes"] == r["comm_by_dim"]["dp"]["all_gather"][1]


# GPT-3 175B's layout (Brown et al. 2020, Table 2.1: 96 layers of width 12288, 96 heads; Narayanan
# et al. 2021, Table 1: t = 8, p = 16, d = 12 on 1,536 GPUs, batch 1,536), on the common ViT at
# that width and depth: Ψ = 174.0B.
GPT3 = ["--dim", 12288, "--depth", 96, "--heads", 96, "--batch-size", 1536, "--no-progress"]
GPT3 += ["--simulate", 1536, "--tp", 8, "--pp", 16, "--dp", 12, "--microbatches", 16]


@pytest.mark.full
def test_gpt3_layout_reduces_once_a_step(capsys, monkeypatch):
    """At GPT-3 175B's layout (m = 16) ZeRO-1's data-parallel traffic is 2x a rank's parameter
    bytes a step (the gradients reduce-scattered once, the parameters all-gathered once), not the
    17x of a reduce-scatter a micro-batch; every row is the formula. Simulated: rank 0 of 1,536 in
    about 8 s and 0.8 GB."""
    r = simulated_result([*GPT3, "--zero-stage", 1], capsys, monkeypatch)
    assert r["params"] > 170e9 and r["world_size"] == 1536
    assert_rows_are_the_formula(r)
    dp = r["comm_by_dim"]["dp"]
    assert dp["reduce_scatter"][0] == 1 + 96 // 16  # one a unit: the embedding and 6 blocks
    assert dp["reduce_scatter"][1] + dp["all_gather"][1] == 2 * r["param_bytes"]


@pytest.mark.parametrize("other", [["--cp", 2], ["--ep", 2, *EXPERTS]])
def test_simulate_refuses_the_other_layouts(other, capsys, monkeypatch):
    """Data x context's DDP checks the ranks' parameter counts and data x expert routes tokens
    by their values: neither runs on meta, and --simulate says so, once, before anything starts."""
    with pytest.raises(SystemExit) as exit_info:
        simulated_result([*SMALL, "--simulate", 16, *other], capsys, monkeypatch)
    assert exit_info.value.code == 2
    assert "--simulate runs the pp x dp x tp layout" in capsys.readouterr().err
