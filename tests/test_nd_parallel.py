"""nd_parallel.py: HSDP x TP x PP composed on one DeviceMesh (fully_shard, parallelize_module,
torch.distributed.pipelining) ends with the parameters of the one-process ddp.py run; rank 0
holds the bytes worked out here from the model's shapes; each mesh dimension carries the traffic
worked out here from B, T, D and the layout (measured from outside, keyed by process group); the
save loads in ddp.py with the same test accuracy, and is the model's own state_dict() (a buffer
of the model's own and a state_dict hook's keys, on TP x PP); the evaluation sends each message
between stages as a batch of one.

One launch per world size runs its layouts one after another (tests/script_cases.py), shared by
the tests of each layout. The quick suite runs two layouts at W=4 that between them cover every
kind of mesh dimension: HSDP x TP (2,1,2,1) and FSDP x PP (1,2,1,2), with SGD (a sum where a
mean belongs shows at once). The full tier (`-m full`) adds the other layouts with two axes > 1
at W=4, the 3-D (1,2,2,2) and HSDP x TP (2,2,2,1) at W=8, and AdamW (sharded optimizer state);
the optimizer alternates over the layouts."""

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import common
import nd_parallel
from helpers import ROOT, ddp_references, fork_launch, launch_cases, max_diff

CFG = [
    "--data",
    "synthetic",
    "--limit",
    "256",
    "--batch-size",
    "32",
    "--dim",
    "32",
    "--depth",
    "2",
    "--heads",
    "4",
    "--epochs",
    "1",
    "--max-steps",
    "3",
    "--no-progress",
]
TOL = {"sgd": 1e-6, "adamw": 5e-5}
WINDOW = 3  # optimizer steps the Meter counts collectives in
M = 4  # micro-batches with a pipeline

# (R, S, T, P), optimizer, pipeline schedule (used when P > 1)
QUICK = [
    ((2, 1, 2, 1), "sgd", None),
    ((1, 2, 1, 2), "sgd", "1f1b"),
]
FULL = [
    ((1, 2, 2, 1), "adamw", None),
    ((2, 1, 1, 2), "adamw", "gpipe"),
    ((1, 1, 2, 2), "sgd", "gpipe"),
    ((1, 2, 2, 2), "adamw", "1f1b"),
    ((2, 2, 2, 1), "adamw", None),
]
# Layouts that start from --load of the initial weights (each stage slices a plain state_dict).
LOADED = [(1, 2, 1, 2), (1, 1, 2, 2)]


def case_id(layout, optim, schedule):
    return "R{}S{}T{}P{}-{}".format(*layout, optim)


CASES = [pytest.param(*case, id=case_id(*case)) for case in QUICK]
CASES += [pytest.param(*case, id=case_id(*case), marks=pytest.mark.full) for case in FULL]


def flags(layout, schedule):
    replicas, shards, tp, stages = layout
    mesh = ["--dp-replicate", replicas, "--dp-shard", shards, "--tp", tp, "--pp", stages]
    pipeline = ["--microbatches", M]
    if schedule:
        pipeline += ["--schedule", schedule]
    return [*mesh, *pipeline]


def selected(request):
    """This session's selected tests of this module, as (test function, its parameters): all of
    them in a full run, one when a single test is asked for (as tests/test_mutants.py does). The
    fixtures below launch only what these use."""
    return [
        (item.originalname, getattr(getattr(item, "callspec", None), "params", {}))
        for item in request.session.items
        if item.module is request.module
    ]


@pytest.fixture(scope="module")
def reference(request, tmp_path_factory):
    """The saved parameters of ddp.py at W=1 on CFG, {optimizer: path}, for the optimizers the
    selected tests compare with (the quick suite needs SGD only), made in one process."""
    optimizers = {
        params["optim"]
        for name, params in selected(request)
        if name == "test_same_parameters_as_ddp_one_process"
    }
    return ddp_references(tmp_path_factory, CFG, sorted(optimizers)) if optimizers else {}


def nd_case(layout, optim, schedule, initial, saved):
    load = ["--load", initial] if layout in LOADED else []
    flags_of_case = [*CFG, *flags(layout, schedule), "--optim", optim, *load, "--save", saved]
    return ["nd_parallel", flags_of_case]


def ddp_loads(path, saved):
    """ddp.py loads `path`, takes one step with lr 0 (nothing moves), saves to `saved`."""
    lr_0 = ["--optim", "sgd", "--lr", 0, "--max-steps", 1]
    return ["ddp", [*CFG, "--load", path, *lr_0, "--save", saved]]


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory, initial):
    """One launch per world size runs the layouts the selected tests use, one after another, then
    ddp.py (at that world size) loading the save of each layout whose test_save_loads_in_ddp is
    selected. Returns {"trained": {layout: (RESULT, saved path)}, "loaded": {layout: (ddp.py's
    RESULT, its saved path)}}."""
    folder = tmp_path_factory.mktemp("nd")
    wanted = set()
    loaded = set()
    for name, params in selected(request):
        if "layout" in params:
            wanted.add((params["layout"], params["optim"], params["schedule"]))
        if name == "test_save_loads_in_ddp":
            loaded.add(params["layout"])
    out = dict(trained={}, loaded={})
    cases = [case for case in QUICK + FULL if case in wanted]
    for world in sorted({math.prod(layout) for layout, _, _ in cases}):
        argv = []
        keys = []
        for layout, optim, schedule in cases:
            if math.prod(layout) == world:
                saved = folder / "R{}S{}T{}P{}.pt".format(*layout)
                argv.append(nd_case(layout, optim, schedule, initial, saved))
                keys.append(("trained", layout, saved))
        for _, layout, path in list(keys):
            if layout in loaded:
                saved = path.with_suffix(".ddp.pt")
                argv.append(ddp_loads(path, saved))
                keys.append(("loaded", layout, saved))
        results = launch_cases(world, argv, timeout=300 + 150 * len(argv))
        for (kind, layout, saved), (result, _) in zip(keys, results, strict=True):
            out[kind][layout] = (result, saved)
    return out


@pytest.fixture(scope="module")
def runs(launches):
    """{layout: (RESULT, path of the saved state_dict)}, shared by the tests below."""
    return launches["trained"]


@pytest.mark.parametrize("layout,optim,schedule", CASES)
def test_same_parameters_as_ddp_one_process(layout, optim, schedule, runs, reference):
    r, path = runs[layout]
    diff = max_diff(reference[optim], path)
    print(f"nd_parallel {layout} {optim}: max |Δparam| vs ddp.py W=1 = {diff:.3g}")
    assert r["world_size"] == math.prod(layout) and r["steps"] == 3
    replicas, shards, tp, stages = layout
    assert r["mesh"] == dict(pp=stages, dp_replicate=replicas, dp_shard=shards, tp=tp)
    assert diff < TOL[optim]


def rank0_elements(layout):
    """Rank 0's parameters (stage 0, TP shard 0, FSDP shard 0), counted here off the plain model:
    q, k, v, fc1 split by rows and proj, fc2 weights by columns over T; then every tensor's dim 0
    in S pieces (FSDP pads: rank 0 holds the ceiling). Returns (in the blocks, in the rest:
    embedding and head), and the number of blocks on stage 0."""
    replicas, shards, tp, stages = layout
    model = common.build_model(common.parse_args(common.get_parser("test"), CFG))
    depth = len(model.blocks)
    mine = {"embed": model.embed}
    for i in range(depth // stages):
        mine[f"blocks.{i}"] = model.blocks[i]
    if stages == 1:
        mine["head"] = model.head
    blocks = 0
    rest = 0
    for prefix, module in mine.items():
        for name, p in module.named_parameters():
            shape = list(p.shape)
            if tp > 1 and prefix.startswith("blocks"):
                if name.split(".")[-2] in ("q", "k", "v", "fc1"):
                    shape[0] //= tp
                elif name in ("attn.proj.weight", "mlp.fc2.weight"):
                    shape[1] //= tp
            shape[0] = math.ceil(shape[0] / shards)
            if prefix.startswith("blocks"):
                blocks += math.prod(shape)
            else:
                rest += math.prod(shape)
    return blocks, rest, depth // stages


@pytest.mark.parametrize("layout,optim,schedule", CASES)
def test_per_rank_bytes(layout, optim, schedule, runs):
    r, _ = runs[layout]
    blocks, rest, _ = rank0_elements(layout)
    own = blocks + rest
    assert (r["param_bytes"], r["grad_bytes"]) == (4 * own, 4 * own), r
    assert r["optim_bytes"] == (8 if optim == "adamw" else 4) * own


@pytest.mark.parametrize("layout,optim,schedule", CASES)
def test_traffic_per_mesh_dimension(layout, optim, schedule, runs):
    """tp: DTensor's f (q, k, v, fc1 each: 4 in backward) and g (proj, fc2: 2 in forward)
    all-reduce the [B/(R·S)/m, T, D] activation, per block of the stage and micro-batch; a
    pipeline's first step also runs one no-grad forward of a micro-batch to find the shapes (its
    2 g's per block). dp_shard: one reduce-scatter per FSDP unit (each block, the rest) a step,
    of S·shard (the gradient sync waits for the last micro-batch); without a pipeline one
    all-gather per block for forward and one for backward, the rest once. dp_replicate: one
    all-reduce of the shard's grads. pp: m activations out of stage 0 and m gradients back, plus
    a small shape handshake in step 1."""
    r, _ = runs[layout]
    replicas, shards, tp, stages = layout
    m = M if stages > 1 else 1
    blocks, rest, nblocks = rank0_elements(layout)
    act = 4 * 32 // (replicas * shards) * 16 * 32  # this dp rank's B/(R·S) x 16 tokens x D=32
    dims = r["comm_by_dim"]
    sizes = dict(dp_replicate=replicas, dp_shard=shards, tp=tp, pp=stages)
    assert set(dims) == {dim for dim, size in sizes.items() if size > 1}, dims
    if tp > 1:
        shape_pass = 2 * nblocks * (act // m) if stages > 1 else 0
        shape_pass_calls = 2 * nblocks if stages > 1 else 0
        assert dims["tp"] == {
            "all_reduce": [
                WINDOW * 6 * nblocks * m + shape_pass_calls,
                (WINDOW * 6 * nblocks * act + shape_pass) // WINDOW,
            ]
        }, dims
    if shards > 1:
        assert dims["dp_shard"]["reduce_scatter"] == [
            WINDOW * (nblocks + 1),
            4 * shards * (blocks + rest),
        ], dims
        if stages == 1:
            assert dims["dp_shard"]["all_gather"] == [
                WINDOW * (2 * nblocks + 1),
                4 * shards * (2 * blocks + rest),
            ], dims
    if replicas > 1:
        units = nblocks + 1
        assert dims["dp_replicate"] == {"all_reduce": [WINDOW * units, 4 * (blocks + rest)]}, dims
    if stages > 1:
        for kind in ("send", "recv"):
            calls, per_step = dims["pp"][kind]
            assert calls >= WINDOW * m and act <= per_step < act + 1024, dims


SAVES = [
    pytest.param((1, 2, 1, 2), "sgd", "1f1b", id="R1S2T1P2"),
    pytest.param((1, 2, 2, 2), "adamw", "1f1b", id="R1S2T2P2", marks=pytest.mark.full),
]


@pytest.mark.parametrize("layout,optim,schedule", SAVES)
def test_save_loads_in_ddp(layout, optim, schedule, runs, launches):
    """The save, assembled on rank 0 from the pipeline's stages (and TP and FSDP pieces: the 3-D
    layout in the full tier), is the plain common model: ddp.py (at the layout's world size, in
    its launch) loads it (lr 0: nothing moves), saves the same tensors, measures the same test
    accuracy as the stage-to-stage evaluation."""
    r, path = runs[layout]
    d, saved = launches["loaded"][layout]
    assert max_diff(path, saved) == 0
    assert d["test_acc"] == r["test_acc"]


class OneRankAtATime:
    """Stands in for torch.distributed while the ranks of one pipe run evaluate() in turn, stage 0
    first: records each rank's calls, delivers each message to its receiver in order."""

    def __init__(self):
        self.rank = 0
        self.calls = {}  # {rank: [("batch", ops) | ("all_reduce", shape)]}
        self.in_flight = {}  # {(sender, receiver): [tensors sent, oldest first]}

    def batch_isend_irecv(self, ops):
        self.calls[self.rank].append(("batch", len(ops)))
        for op in ops:
            if op.op is dist.isend:
                self.in_flight.setdefault((self.rank, op.peer), []).append(op.tensor.clone())
            else:
                message = self.in_flight[op.peer, self.rank].pop(0)
                assert message.shape == op.tensor.shape, (message.shape, op.tensor.shape)
                # NCCL's rule: the same count and datatype on both ends
                assert message.dtype == op.tensor.dtype, (message.dtype, op.tensor.dtype)
                op.tensor.copy_(message)
        return []

    def all_reduce(self, tensor, *args, **kwargs):
        self.calls[self.rank].append(("all_reduce", tuple(tensor.shape)))

    def unbatched(self, *args, **kwargs):
        raise AssertionError("a plain dist.send or dist.recv: NCCL makes a two-rank communicator")


class Message:
    """dist.P2POp without a process group behind it: a peer given as a group rank is the rank
    itself (one pipe, its ranks numbered from 0)."""

    def __init__(self, op, tensor, peer=None, group=None, group_peer=None):
        self.op = op
        self.tensor = tensor
        self.peer = group_peer if peer is None else peer


def three_stages_one_at_a_time(model, fake):
    """(index, stage) for the three stages of a pipe over `model`, each built as its rank would
    build it, with `fake` (OneRankAtATime) set to that rank before the caller runs it."""
    for index in range(3):
        stage = nd_parallel.Stage(model, index, 3)
        stage.pp_group = None
        stage.answers = stage.is_last
        fake.rank = index
        fake.calls[index] = []
        yield index, stage


def test_evaluation_sends_each_message_as_a_batch_of_one(monkeypatch):
    """Issue 25, item 8, in one process: evaluate() on the three stages of a pipe, rank by rank.
    Every message between stages is a dist.batch_isend_irecv of one op (on NCCL: the pp group's
    communicator, not a new two-rank one per pair of peers), never a plain send or recv; the n-th
    send of stage s is the n-th receive of stage s+1, of the same shape; every rank runs the same
    collectives; and the last stage's count is the whole model's."""
    args = common.parse_args(common.get_parser("test"), [*CFG, "--depth", "3"])
    model = common.build_model(args).eval()
    generator = torch.Generator().manual_seed(0)
    batches = []
    for size in (8, 8, 5):
        images = torch.randn(size, 1, 28, 28, generator=generator)
        labels = torch.randint(0, 10, (size,), generator=generator)
        keep = torch.arange(size) < size - 1  # the last sample of each batch is padding
        batches.append((images, labels, keep))
    fake = OneRankAtATime()
    monkeypatch.setattr(dist, "batch_isend_irecv", fake.batch_isend_irecv)
    monkeypatch.setattr(dist, "all_reduce", fake.all_reduce)
    monkeypatch.setattr(dist, "send", fake.unbatched)
    monkeypatch.setattr(dist, "recv", fake.unbatched)
    monkeypatch.setattr(dist, "P2POp", Message)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    accuracy = {}
    for index, stage in three_stages_one_at_a_time(model, fake):
        accuracy[index] = nd_parallel.evaluate(stage, batches, torch.device("cpu"))
    assert all(messages == [] for messages in fake.in_flight.values()), "a message never received"
    for index, calls in fake.calls.items():
        batched = [ops for kind, ops in calls if kind == "batch"]
        assert batched == [1] * len(batches) * (1 if index in (0, 2) else 2), calls
        collectives = [call for call in calls if call[0] != "batch"]
        assert collectives == [("all_reduce", (2,))], calls
    with torch.no_grad():
        right = sum(((model(x).argmax(1) == y) & keep).sum().item() for x, y, keep in batches)
    counted = sum(keep.sum().item() for _, _, keep in batches)
    assert accuracy[2] == right / counted


def test_infer_receives_in_the_model_dtype(monkeypatch):
    """Issue 33, item 6, in one process: the model converted to bf16, infer() on the three stages
    of a pipe, rank by rank. Each stage receives into a buffer of the dtype its peer sends, bf16
    (on NCCL an fp32 buffer posts twice the bytes sent: a hang or garbage), and the last stage's
    logits are the whole model's."""
    args = common.parse_args(common.get_parser("test"), [*CFG, "--depth", "3"])
    model = common.build_model(args).eval().to(torch.bfloat16)
    images = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    images = images.to(torch.bfloat16)
    fake = OneRankAtATime()
    monkeypatch.setattr(dist, "batch_isend_irecv", fake.batch_isend_irecv)
    monkeypatch.setattr(dist, "P2POp", Message)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    outputs = []
    for _, stage in three_stages_one_at_a_time(model, fake):
        outputs.append(nd_parallel.infer(stage, images))
    assert all(messages == [] for messages in fake.in_flight.values()), "a message never received"
    with torch.no_grad():
        expected = model(images)
    assert outputs[2].dtype == torch.bfloat16
    assert torch.equal(outputs[2], expected)


CLIP = 0.05  # below every step's gradient norm here: each step is clipped


def test_clip_is_one_process_clip(tmp_path, tmp_path_factory):
    """--clip over a stage whose gradients are DTensors on FSDP's and TP's meshes (1,2,2,1), and
    over two pipeline stages of TP shards (1,1,2,2), ends where ddp.py --clip at W=1 ends: the one
    global norm, each mesh's part reduced over its ranks and the stages' summed. Unclipped
    training ends far from there, so the clip bit."""
    layouts = [((1, 2, 2, 1), None), ((1, 1, 2, 2), "1f1b")]
    argv = []
    for layout, schedule in layouts:
        saved = tmp_path / "R{}S{}T{}P{}.pt".format(*layout)
        clip = ["--clip", CLIP, "--optim", "sgd", "--save", saved]
        argv.append(["nd_parallel", [*CFG, *flags(layout, schedule), *clip]])
    launch_cases(4, argv)
    clipped = ddp_references(tmp_path_factory, [*CFG, "--clip", str(CLIP)], ("sgd",))["sgd"]
    unclipped = ddp_references(tmp_path_factory, CFG, ("sgd",))["sgd"]
    assert max_diff(clipped, unclipped) > 100 * TOL["sgd"]
    for layout, _ in layouts:
        diff = max_diff(tmp_path / "R{}S{}T{}P{}.pt".format(*layout), clipped)
        assert diff < TOL["sgd"], f"{layout}: max |Δparameter| {diff:.2e} against ddp.py --clip"


# The save is the model's own state_dict(): a model with a persistent buffer of its own (outside
# embed, blocks and head) and a state_dict hook in every block, which saves q, k and v as one
# qkv.weight (a load hook splits it again), trained one step on TP x PP at W=4.

HOOKED_LAYOUT = (2, 1, 1, 2)  # (pp, dp_replicate, dp_shard, tp): MESH_DIMS' order
RANK_PROGRAM = """import sys
sys.path[:0] = [{root!r}, {tests!r}]
import test_nd_parallel
test_nd_parallel.train_and_save_hooked_model({path!r})
"""


def fuse_qkv(attention, state_dict, prefix, local_metadata):
    """state_dict post-hook: q, k and v's weights saved as one qkv.weight, [3D, D]."""
    names = [f"{prefix}{name}.weight" for name in ("q", "k", "v")]
    state_dict[f"{prefix}qkv.weight"] = torch.cat([state_dict.pop(name) for name in names])


def split_qkv(attention, state_dict, prefix, *args):
    """load_state_dict pre-hook: qkv.weight split back into q, k and v's weights."""
    fused = state_dict.pop(f"{prefix}qkv.weight")
    for name, weight in zip(("q", "k", "v"), fused.chunk(3), strict=True):
        state_dict[f"{prefix}{name}.weight"] = weight


def hooked_model():
    model = common.build_model(common.parse_args(common.get_parser("test"), CFG))
    model.register_buffer("version", torch.tensor(3))  # persistent, held by the model itself
    for block in model.blocks:
        block.attn.register_state_dict_post_hook(fuse_qkv)
        block.attn.register_load_state_dict_pre_hook(split_qkv)
    return model


def one_batch():
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(8, 1, 28, 28, generator=generator)
    return images, torch.randint(0, 10, (8,), generator=generator)


def train_and_save_hooked_model(path):
    """One rank of test_save_is_the_models_own_state_dict: the hooked model split over
    HOOKED_LAYOUT, one SGD step, full_state_dict; rank 0 saves it next to the state_dict() of the
    same model trained one step in one process."""
    dist.init_process_group("gloo")
    model = hooked_model()
    one_process = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", HOOKED_LAYOUT, mesh_dim_names=nd_parallel.MESH_DIMS)
    stage = nd_parallel.parallelize(model, mesh, torch.device("cpu"), M, "1f1b")
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
    images, labels = one_batch()
    nd_parallel.train_step(stage, images, labels)
    optimizer.step()
    state = nd_parallel.full_state_dict(stage, mesh)
    if dist.get_rank() == 0:
        one_process_optimizer = torch.optim.SGD(one_process.parameters(), lr=0.1)
        F.cross_entropy(one_process(images), labels).backward()
        one_process_optimizer.step()
        torch.save(dict(saved=state, expected=one_process.state_dict()), path)
    dist.destroy_process_group()


def test_save_is_the_models_own_state_dict(tmp_path):
    """full_state_dict on TP x PP is the model's own state_dict(): its persistent buffer (which no
    stage holds) and its hook's qkv.weight (which torch's get_model_state_dict, mapping keys back
    to parameters, raised on), the stages' TP shards joined, one step's values to round-off; a
    strict load_state_dict into a fresh model accepts it."""
    path = tmp_path / "saved.pt"
    program = tmp_path / "rank.py"
    program.write_text(
        RANK_PROGRAM.format(root=str(ROOT), tests=str(ROOT / "tests"), path=str(path))
    )
    r = fork_launch(str(program), 4)
    assert r.returncode == 0, r.output
    result = torch.load(path, weights_only=True)
    saved = result["saved"]
    expected = result["expected"]
    assert saved.keys() == expected.keys(), sorted(saved.keys() ^ expected.keys())
    assert "version" in saved and "blocks.1.attn.qkv.weight" in saved
    diffs = {key: (saved[key] - expected[key]).abs().max().item() for key in expected}
    assert max(diffs.values()) < TOL["sgd"], max(diffs.items(), key=lambda item: item[1])
    assert max_diff_from_initial(saved) > 100 * TOL["sgd"]  # the step moved them
    hooked_model().load_state_dict(saved, strict=True)


def max_diff_from_initial(state):
    initial = hooked_model().state_dict()
    return max((state[key].float() - initial[key].float()).abs().max().item() for key in initial)
