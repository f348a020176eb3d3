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
AdamW, and AdamW for each other layout (FULL lists them)."""

import json
import math

import pytest
import torch
from test_nd_parallel import CFG  # the same small ViT, data and steps as nd_parallel.py's tests
from test_pipeline import replay

import common
from helpers import ddp_references, fork_launch, launch_cases, max_diff, reference_result

EXPERTS = ["--experts", "4"]
TOL = {"sgd": 1e-6, "adamw": 5e-5}
M = 4  # micro-batches with a pipeline


class Layout:
    """One case: the mesh sizes and what else its flags say."""

    def __init__(self, dp=1, pp=1, tp=1, cp=1, ep=1, stage=1, sp=False, optim="sgd", clip=None):
        self.sizes = dict(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep)
        self.stage = stage
        self.sp = sp
        self.optim = optim
        self.clip = clip

    @property
    def world(self):
        return math.prod(self.sizes.values())

    @property
    def name(self):
        mesh = "".join(f"{dim}{size}" for dim, size in self.sizes.items() if size > 1)
        sp = "-sp" if self.sp else ""
        clip = f"-clip{self.clip}" if self.clip else ""
        return f"{mesh}-z{self.stage}{sp}{clip}-{self.optim}"

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
        return argv

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


@pytest.mark.parametrize("layout", CASES)
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


@pytest.mark.parametrize("layout", THREE_D)
def test_measured_next_to_the_formula(layout, runs):
    """Rank 0's parameter, gradient and optimizer bytes are ZeRO's on its stage's tp split, worked
    out from the model's shapes (ZeRO-1 with micro-batches hands the optimizer a shard of the
    gradient: the whole flat one stays in the engine), and each mesh dimension carries what the
    formula says: every kind, its bytes a step, exactly (under sequence parallelism, the norms'
    partial gradients too, as rank 0's shards cut them)."""
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
