"""nd_parallel.py: HSDP x TP x PP composed on one DeviceMesh (fully_shard, parallelize_module,
torch.distributed.pipelining) ends with the parameters of the one-process ddp.py run at W=4 in every
layout with two axes > 1 and at W=8 in the 3-D (1,2,2,2) and HSDP x TP (2,2,2,1) layouts; rank 0
holds the bytes worked out here from the model's shapes; each mesh dimension carries the traffic
worked out here from B, T, D and the layout (measured from outside, keyed by process group); the
save loads in ddp.py with the same test accuracy.

One launch per layout (7 launches, + the 2 ddp.py references): the optimizer alternates over the
layouts (SGD in 3, AdamW in 4, both W=8 layouts with AdamW) to keep the suite's time."""

import math

import pytest

import common
from helpers import ok, max_diff, python, torchrun

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

# (R, S, T, P), optimizer, pipeline schedule (used when P > 1)
CASES = [
    ((2, 1, 2, 1), "sgd", None),
    ((1, 2, 2, 1), "adamw", None),
    ((2, 1, 1, 2), "adamw", "gpipe"),
    ((1, 2, 1, 2), "sgd", "1f1b"),
    ((1, 1, 2, 2), "sgd", "gpipe"),
    ((1, 2, 2, 2), "adamw", "1f1b"),
    ((2, 2, 2, 1), "adamw", None),
]
IDS = ["R{}S{}T{}P{}-{}".format(*layout, optim) for layout, optim, _ in CASES]
M = 4  # micro-batches with a pipeline


def flags(layout, schedule):
    R, S, T, P = layout
    return [
        "--dp-replicate",
        R,
        "--dp-shard",
        S,
        "--tp",
        T,
        "--pp",
        P,
        "--microbatches",
        M,
        *(["--schedule", schedule] if schedule else []),
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, initial):
    """One launch per layout, shared by the tests below: (RESULT, path of the saved state_dict).
    The TP x PP run starts from --load of the initial weights (each stage slices a plain state_dict)."""
    done = {}

    def get(layout, optim, schedule):
        if layout not in done:
            path = tmp_path_factory.mktemp("nd") / "nd.pt"
            load = ["--load", initial] if layout == (1, 1, 2, 2) else []
            r = ok(
                torchrun(
                    "nd_parallel.py",
                    math.prod(layout),
                    *CFG,
                    *flags(layout, schedule),
                    "--optim",
                    optim,
                    *load,
                    "--save",
                    path,
                    timeout=400,
                )
            )
            done[layout] = r, path
        return done[layout]

    return get


@pytest.mark.parametrize("layout,optim,schedule", CASES, ids=IDS)
def test_same_parameters_as_ddp_one_process(layout, optim, schedule, runs, refs):
    r, path = runs(layout, optim, schedule)
    diff = max_diff(refs[optim], path)
    print(f"nd_parallel {layout} {optim}: max |Δparam| vs ddp.py W=1 = {diff:.3g}")
    assert r["world_size"] == math.prod(layout) and r["steps"] == 3
    assert r["mesh"] == dict(pp=layout[3], dp_replicate=layout[0], dp_shard=layout[1], tp=layout[2])
    assert diff < TOL[optim]


def rank0_elements(layout):
    """Rank 0's parameters (stage 0, TP shard 0, FSDP shard 0), counted here off the plain model:
    q, k, v, fc1 split by rows and proj, fc2 weights by columns over T; then every tensor's dim 0
    in S pieces (FSDP pads: rank 0 holds the ceiling); blocks and the rest (embedding, head) apart."""
    R, S, T, P = layout
    model = common.build_model(common.parse_args(common.get_parser("test"), CFG))
    depth = len(model.blocks)
    mine = {
        "embed": model.embed,
        **{f"blocks.{i}": model.blocks[i] for i in range(depth // P)},
        **({"head": model.head} if P == 1 else {}),
    }
    blocks = rest = 0
    for prefix, module in mine.items():
        for name, p in module.named_parameters():
            shape = list(p.shape)
            if T > 1 and prefix.startswith("blocks"):
                if name.split(".")[-2] in ("q", "k", "v", "fc1"):
                    shape[0] //= T
                elif name in ("attn.proj.weight", "mlp.fc2.weight"):
                    shape[1] //= T
            shape[0] = -(-shape[0] // S)
            if prefix.startswith("blocks"):
                blocks += math.prod(shape)
            else:
                rest += math.prod(shape)
    return blocks, rest, depth // P


@pytest.mark.parametrize("layout,optim,schedule", CASES, ids=IDS)
def test_per_rank_bytes(layout, optim, schedule, runs):
    r, _ = runs(layout, optim, schedule)
    blocks, rest, _ = rank0_elements(layout)
    own = blocks + rest
    assert (r["param_bytes"], r["grad_bytes"]) == (4 * own, 4 * own), r
    assert r["optim_bytes"] == (8 if optim == "adamw" else 4) * own


@pytest.mark.parametrize("layout,optim,schedule", CASES, ids=IDS)
def test_traffic_per_mesh_dimension(layout, optim, schedule, runs):
    """tp: DTensor's f (q, k, v, fc1 each: 4 in backward) and g (proj, fc2: 2 in forward) all-reduce
    the [B/(R·S)/m, T, D] activation, per block of the stage and micro-batch; a pipeline's first step
    also runs one no-grad forward of a micro-batch to find the shapes (its 2 g's per block).
    dp_shard: one reduce-scatter per FSDP unit (each block, the rest) a step, of S·shard (the
    gradient sync waits for the last micro-batch); without a pipeline one all-gather per block for
    forward and one for backward, the rest once. dp_replicate: one all-reduce of the shard's grads.
    pp: m activations out of stage 0 and m gradients back, plus a small shape handshake in step 1."""
    r, _ = runs(layout, optim, schedule)
    R, S, T, P = layout
    m = M if P > 1 else 1
    blocks, rest, nblocks = rank0_elements(layout)
    act = 4 * 32 // (R * S) * 16 * 32  # bytes of this dp rank's batch: B/(R·S) x 16 tokens x D=32
    dims = r["comm_by_dim"]
    assert set(dims) == {
        d for d, n in zip(("dp_replicate", "dp_shard", "tp", "pp"), layout) if n > 1
    }, dims
    if T > 1:
        shape_pass = 2 * nblocks * (act // m) if P > 1 else 0
        assert dims["tp"] == {
            "all_reduce": [
                WINDOW * 6 * nblocks * m + (2 * nblocks if P > 1 else 0),
                (WINDOW * 6 * nblocks * act + shape_pass) // WINDOW,
            ]
        }, dims
    if S > 1:
        assert dims["dp_shard"]["reduce_scatter"] == [
            WINDOW * (nblocks + 1),
            4 * S * (blocks + rest),
        ], dims
        if P == 1:
            assert dims["dp_shard"]["all_gather"] == [
                WINDOW * (2 * nblocks + 1),
                4 * S * (2 * blocks + rest),
            ], dims
    if R > 1:
        units = nblocks + 1 if R * S > 1 else 0
        assert dims["dp_replicate"] == {"all_reduce": [WINDOW * units, 4 * (blocks + rest)]}, dims
    if P > 1:
        for kind in ("send", "recv"):
            calls, per_step = dims["pp"][kind]
            assert calls >= WINDOW * m and act <= per_step < act + 1024, dims


def test_save_loads_in_ddp(runs, tmp_path):
    """The 3-D save, assembled on rank 0 from TP, FSDP and pipeline pieces, is the plain common model:
    ddp.py loads it (lr 0: nothing moves), saves the same tensors, measures the same test accuracy."""
    r, path = runs((1, 2, 2, 2), "adamw", "1f1b")
    d = ok(
        python(
            "ddp.py",
            *CFG,
            "--load",
            path,
            "--optim",
            "sgd",
            "--lr",
            "0",
            "--max-steps",
            "1",
            "--save",
            tmp_path / "ddp.pt",
            timeout=120,
        )
    )
    assert max_diff(path, tmp_path / "ddp.pt") == 0
    assert d["test_acc"] == r["test_acc"]
