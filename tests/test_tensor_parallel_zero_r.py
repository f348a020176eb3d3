"""tensor_parallel_zero_r.py: tensor parallelism with ZeRO-R's --checkpoint and
--partition-activations (Pa). At W=2 and 4, and under --sequence-parallel, it ends with the
parameters of the one-process ddp.py run; autograd keeps E + L·B·T·D·4 bytes (÷W with Pa or
SP); the recompute's collectives are the ones the formula counts, Pa adding exactly one
all-gather per block and nothing under SP. test_bad_input.py checks that a W not dividing the
tokens is refused."""

import pytest
import torch
import torch.nn.functional as F

import common
from helpers import SMALL, launch_cases, max_diff

DEPTH = 4
CFG = [*SMALL, "--depth", str(DEPTH)]  # test_tensor_parallel.py's: the W=1 references are shared
TOL = {"sgd": 1e-6, "adamw": 5e-5}  # as in test_tensor_parallel.py
WINDOW = 3  # optimizer steps the Meter counts collectives in

# name: (world, flags, optimizer); one launch per world size, shared by the tests below
CASES = {
    "ckpt-W2-sgd": (2, ["--checkpoint"], "sgd"),
    "pa-W2-sgd": (2, ["--partition-activations"], "sgd"),
    "pa-W4-adamw": (4, ["--partition-activations"], "adamw"),
    "pa-sp-W2-adamw": (2, ["--partition-activations", "--sequence-parallel"], "adamw"),
}


def needed(request):
    """The cases this session's selected tests of this module read, in CASES' order: all of them in
    a whole run, one when a single test is asked for (as tests/test_mutants.py does)."""
    names = set()
    for item in request.session.items:
        if item.module is request.module:
            names.add(item.callspec.params["name"])
    return [name for name in CASES if name in names]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """{name: (RESULT, path of the saved state_dict)}: one launch per world size runs the cases the
    selected tests read, shared by the tests below."""
    folder = tmp_path_factory.mktemp("zero_r")
    saved = {name: folder / f"{name}.pt" for name in CASES}
    names = needed(request)
    out = {}
    for world in (2, 4):
        in_world = [name for name in names if CASES[name][0] == world]
        argv = []
        for name in in_world:
            _, flags, optim = CASES[name]
            argv.append(
                ["tensor_parallel_zero_r", [*CFG, "--optim", optim, *flags, "--save", saved[name]]]
            )
        if argv:
            for name, (result, _) in zip(in_world, launch_cases(world, argv), strict=True):
                out[name] = (result, saved[name])
    return out


def cfg_args():
    return common.parse_args(common.get_parser("test"), CFG)


def sizes():
    """B, T, D and L (depth) of CFG."""
    args = cfg_args()
    model = common.build_model(args)
    return args.batch_size, model.embed.tokens, args.dim, len(model.blocks)


def saved_outside_blocks(batch):
    """E, measured here as the Meter measures it (distinct storages autograd keeps, parameters
    left out): one forward and loss of the model without blocks."""
    args = cfg_args()
    model = common.ViT(args.dim, depth=0, heads=args.heads, patch=args.patch)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(tensor):  # note each saved tensor's storage; autograd keeps the tensor as it is
        storage = tensor.untyped_storage()
        kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        images = torch.randn(batch, 1, common.IMAGE, common.IMAGE)
        F.cross_entropy(model(images), torch.randint(0, 10, (batch,)))
    return sum(nbytes for ptr, nbytes in kept.items() if ptr not in params)


@pytest.mark.parametrize("name", CASES)
def test_same_parameters_as_ddp_and_saved_bytes(name, runs, refs):
    """The parameters of ddp.py at W=1; autograd keeps E + L·B·T·D·4 bytes, and with Pa (or SP)
    only each rank's T/W tokens of every block's input: the Meter sees the shard, not the whole."""
    world, flags, optim = CASES[name]
    result, path = runs[name]
    diff = max_diff(refs[optim], path)
    print(f"{name}: max |Δparam| vs ddp.py W=1 = {diff:.3g}, saved {result['act_bytes']} bytes")
    assert result["world_size"] == world
    assert result["steps"] == 6
    assert diff < TOL[optim]
    batch, tokens, dim, depth = sizes()
    outside = saved_outside_blocks(batch)
    assert outside == common.saved_outside_blocks(cfg_args(), batch)  # the formula's E
    input_split = 1 if flags == ["--checkpoint"] else world  # Pa or SP: T/W tokens of each input
    want = outside + depth * batch * tokens * dim * 4 // input_split
    assert result["act_bytes"] == want
    assert result["formula"]["act_bytes"] == want


@pytest.mark.parametrize("name", CASES)
def test_recompute_collectives(name, runs):
    """Backward reruns each block's forward up to its last saved tensor (fc2's input), so the
    attention half's g runs again (SP: its all-gather f, reduce-scatter g and the MLP's all-gather
    f). Pa adds one all-gather of x per block, in the recompute only (none in the forward). Under
    SP, Pa adds nothing: x already is T/W tokens, so the counts are SP --checkpoint's."""
    world, flags, _ = CASES[name]
    result, _ = runs[name]
    batch, tokens, dim, depth = sizes()
    activation_bytes = 4 * batch * tokens * dim
    if "--sequence-parallel" in flags:
        # SP's 4L + 2 all-gathers and 4L reduce-scatters, plus the recompute's 2L and L
        calls = dict(all_gather=6 * depth + 2, reduce_scatter=5 * depth, all_reduce=1)
        moved = {kind: n for kind, n in result["comm"].items() if kind != "all_reduce"}
        assert moved == dict(
            all_gather=(6 * depth + 2) * activation_bytes,
            reduce_scatter=5 * depth * activation_bytes,
        )
    else:
        calls = dict(all_reduce=5 * depth)  # TP's 4L, plus attention's g in the recompute
        if "--partition-activations" in flags:
            calls["all_gather"] = depth
        want = {kind: n * activation_bytes for kind, n in calls.items()}
        assert result["comm"] == want, result["comm"]
    assert result["comm_calls"] == {kind: WINDOW * n for kind, n in calls.items()}, result
    assert result["comm"] == result["formula"]["comm"]
