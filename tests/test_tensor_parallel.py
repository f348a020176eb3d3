"""tensor_parallel.py: Megatron TP, with and without sequence parallelism, ends with the same
parameters as the one-process ddp.py run (SGD and AdamW, W=2, and W=3 with 6 heads); the
collectives the Meter measures from outside equal what this test works out from B, T, D and
depth; each rank holds Ψr + Ψs/W parameters counted here off the model; the dense file it saves
loads in ddp.py with the same test accuracy; SP refuses a W that does not divide the tokens. With --checkpoint
and ZeRO-R's --partition-activations (W=2 and 4, and under SP) it still ends with ddp.py's parameters, autograd
keeps E + L·B·T·D·4 bytes (÷W partitioned) and the recompute's collectives are the ones the formula counts."""

import pytest
import torch
import torch.nn.functional as F

import common
from helpers import SMALL, ddp_reference, max_diff, ok, python, torchrun

DEPTH = 4
CFG = [*SMALL, "--depth", str(DEPTH)]  # the same config as test_pipeline.py: shared references
CFG3 = [
    *SMALL,
    "--dim",
    "48",
    "--heads",
    "6",
]  # W=3: 2 heads a rank; its 16 tokens do not split 3 ways
TOL = {
    "sgd": 1e-6,
    "adamw": 5e-5,
}  # round-off; AdamW turns it into steps on ~0 gradients: up to 1.9e-5 seen
WINDOW = 3  # optimizer steps the Meter counts collectives in

CASES = [
    (2, False, "sgd"),
    (2, False, "adamw"),
    (2, True, "sgd"),
    (2, True, "adamw"),
    (3, False, "sgd"),
    (3, False, "adamw"),
]
IDS = [f"W{w}-{'sp' if sp else 'tp'}-{o}" for w, sp, o in CASES]


def cfg_of(world):
    return CFG if world == 2 else CFG3


def model_of(cfg):
    args = common.parse_args(common.get_parser("test"), cfg)
    return args, common.build_model(args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, initial):
    """One launch per case, shared by the tests below: (RESULT, path of the saved state_dict).
    The W=2 SP SGD run starts from --load of the initial weights (TP slices a plain state_dict)."""
    done = {}

    def get(world, sp, optim):
        if (world, sp, optim) not in done:
            path = tmp_path_factory.mktemp("tp") / "tp.pt"
            load = ["--load", initial] if (world, sp, optim) == (2, True, "sgd") else []
            r = ok(
                torchrun(
                    "tensor_parallel.py",
                    world,
                    *cfg_of(world),
                    "--optim",
                    optim,
                    *load,
                    "--save",
                    path,
                    *(["--sequence-parallel"] if sp else []),
                    timeout=180,
                )
            )
            done[world, sp, optim] = r, path
        return done[world, sp, optim]

    return get


@pytest.mark.parametrize("world,sp,optim", CASES, ids=IDS)
def test_same_parameters_as_ddp_one_process(world, sp, optim, runs, refs, tmp_path_factory):
    r, path = runs(world, sp, optim)
    ref = refs[optim] if world == 2 else ddp_reference(tmp_path_factory, CFG3, optim)
    diff = max_diff(ref, path)
    print(f"tensor_parallel W={world} sp={sp} {optim}: max |Δparam| vs ddp.py W=1 = {diff:.3g}")
    assert r["world_size"] == world and r["steps"] == 6
    assert diff < TOL[optim]


@pytest.mark.parametrize("world,sp,optim", CASES, ids=IDS)
def test_measured_collectives(world, sp, optim, runs):
    """Every rank sees the whole batch B, so each f / g moves one [B, T, D] fp32 activation. The Meter
    counts an all-reduce's tensor, an all-gather's output and a reduce-scatter's input: whole
    activations, whatever W is (a ring then sends 2(W-1)/W resp. (W-1)/W of them)."""
    r, _ = runs(world, sp, optim)
    args, model = model_of(cfg_of(world))
    B, T, D, depth = args.batch_size, model.embed.tokens, args.dim, len(model.blocks)
    act = 4 * B * T * D
    if not sp:  # per block: g after attention and after the MLP forward, f before each backward
        calls = dict(all_reduce=4 * depth)
        want = dict(all_reduce=4 * depth * act)
    else:  # f, g become all-gather / reduce-scatter (swapped backward); entering SP gathers the
        #               gradient backward, leaving it gathers the tokens forward; one all-reduce sums the
        #               gradients of the parameters that saw only this rank's tokens (norms, row biases)
        partial = sum(
            p.numel()
            for b in model.blocks
            for p in (
                *b.norm1.parameters(),
                *b.norm2.parameters(),
                b.attn.proj.bias,
                b.mlp.fc2.bias,
            )
        )
        calls = dict(all_gather=4 * depth + 2, reduce_scatter=4 * depth, all_reduce=1)
        want = dict(
            all_gather=(4 * depth + 2) * act, reduce_scatter=4 * depth * act, all_reduce=4 * partial
        )
    assert r["comm_steps"] == WINDOW
    assert r["comm"] == want, r
    assert r["comm_calls"] == {k: WINDOW * n for k, n in calls.items()}, r


@pytest.mark.parametrize("world,sp,optim", CASES, ids=IDS)
def test_per_rank_parameter_bytes(world, sp, optim, runs):
    """Ψs (q, k, v, fc1 weights and biases; proj, fc2 weights) is split W ways; Ψr (embedding,
    norms, row biases, head) is replicated: 4(Ψr + Ψs/W) bytes of parameters and of gradients."""
    r, _ = runs(world, sp, optim)
    _, model = model_of(cfg_of(world))
    psi = sum(p.numel() for p in model.parameters())
    split = 0
    for b in model.blocks:
        split += sum(
            p.numel() for lin in (b.attn.q, b.attn.k, b.attn.v, b.mlp.fc1) for p in lin.parameters()
        )
        split += b.attn.proj.weight.numel() + b.mlp.fc2.weight.numel()
    assert split % world == 0
    own = psi - split + split // world
    assert r["params"] == psi
    assert (r["param_bytes"], r["grad_bytes"]) == (4 * own, 4 * own)
    assert r["optim_bytes"] == (8 if optim == "adamw" else 4) * own


def test_dense_save_loads_in_ddp(runs, tmp_path):
    """The W=3 save, gathered to rank 0, is the plain common model: ddp.py loads it (lr 0: nothing
    moves), saves the same tensors and measures the same test accuracy TP measured."""
    r, path = runs(3, False, "adamw")
    d = ok(
        python(
            "ddp.py",
            *CFG3,
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


@pytest.mark.parametrize(
    "world,argv,message",
    [
        (
            3,
            ["--sequence-parallel"],
            "--sequence-parallel splits the 16 tokens over ranks: 3 does not divide them",
        ),
        (4, [], "--heads 6 is not divisible by the 4 tensor-parallel ranks"),
    ],
)
def test_refuses_before_any_process_group(world, argv, message):
    r = python("tensor_parallel.py", "--nproc", world, *CFG3, *argv, timeout=60)
    assert r.returncode == 2, r.output
    assert message in r.stderr and r.stderr.count("error:") == 1 and "Traceback" not in r.stderr, (
        r.output
    )


# --checkpoint and ZeRO-R's --partition-activations: four launches on CFG (the W=1 references are shared)
CKPT = {
    "ckpt-W2-sgd": (2, ["--checkpoint"], "sgd"),
    "pa-W2-sgd": (2, ["--partition-activations"], "sgd"),
    "pa-W4-adamw": (4, ["--partition-activations"], "adamw"),
    "pa-sp-W2-adamw": (2, ["--partition-activations", "--sequence-parallel"], "adamw"),
}


@pytest.fixture(scope="module")
def ckpt_runs(tmp_path_factory):
    done = {}

    def get(name):
        if name not in done:
            world, flags, optim = CKPT[name]
            path = tmp_path_factory.mktemp("ckpt") / "tp.pt"
            done[name] = (
                ok(
                    torchrun(
                        "tensor_parallel.py",
                        world,
                        *CFG,
                        "--optim",
                        optim,
                        *flags,
                        "--save",
                        path,
                        timeout=300,
                    )
                ),
                path,
            )
        return done[name]

    return get


def saved_outside_blocks(batch):
    """E, measured here as the Meter measures (distinct storages autograd keeps, parameters left out): one
    forward and loss of the model without blocks."""
    args, _ = model_of(CFG)
    model, kept = common.ViT(args.dim, 0, args.heads, args.patch), {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(model(torch.randn(batch, 1, 28, 28)), torch.randint(0, 10, (batch,)))
    return sum(n for ptr, n in kept.items() if ptr not in params)


@pytest.mark.parametrize("name", CKPT)
def test_checkpointed_same_parameters_and_saved_bytes(name, ckpt_runs, refs):
    """The parameters of ddp.py at W=1; autograd keeps E + L·B·T·D·4 bytes, and with Pa (or SP) only each
    rank's T/W tokens of every block's input: the Meter sees the slice, not the whole input."""
    world, flags, optim = CKPT[name]
    r, path = ckpt_runs(name)
    diff = max_diff(refs[optim], path)
    print(f"{name}: max |Δparam| vs ddp.py W=1 = {diff:.3g}, saved {r['act_bytes']} bytes")
    assert r["world_size"] == world and r["steps"] == 6 and diff < TOL[optim]
    args, model = model_of(CFG)
    B, T, D, L = args.batch_size, model.embed.tokens, args.dim, len(model.blocks)
    E = saved_outside_blocks(B)
    assert E == common.saved_outside_blocks(args, B)
    assert (
        r["act_bytes"]
        == r["formula"]["act_bytes"]
        == E + L * B * T * D * 4 // (1 if flags == ["--checkpoint"] else world)
    )


@pytest.mark.parametrize("name", CKPT)
def test_recompute_collectives(name, ckpt_runs):
    """Backward reruns each block's forward up to its last saved tensor (fc2's input), so the attention half's g
    runs again (SP: its all-gather f, reduce-scatter g and the MLP's all-gather f); Pa adds one all-gather of x per
    block, in the recompute only (none in the forward). Under SP, Pa adds nothing: x already is T/W tokens."""
    world, flags, _ = CKPT[name]
    r, _ = ckpt_runs(name)
    _, model = model_of(CFG)
    L, act = len(model.blocks), 4 * 32 * model.embed.tokens * 32  # SMALL: batch 32, dim 32
    if "--sequence-parallel" in flags:
        calls = dict(all_gather=4 * L + 2 + 2 * L, reduce_scatter=5 * L, all_reduce=1)
        assert {k: v for k, v in r["comm"].items() if k != "all_reduce"} == dict(
            all_gather=(6 * L + 2) * act, reduce_scatter=5 * L * act
        )
    else:
        calls = dict(
            all_reduce=5 * L, **({"all_gather": L} if "--partition-activations" in flags else {})
        )
        assert r["comm"] == {k: n * act for k, n in calls.items()}, r["comm"]
    assert r["comm_calls"] == {k: WINDOW * n for k, n in calls.items()}, r["comm_calls"]
    assert r["comm"] == r["formula"]["comm"]
