"""tensor_parallel.py: Megatron TP, with and without sequence parallelism (SP), ends with the same
parameters as the one-process ddp.py run (SGD and AdamW, W=2, and W=3 with 6 heads), and with
--clip (W=2, SP) the parameters of ddp.py --clip in one process; the
collectives the Meter measures from outside equal what this test works out from B, T, D and
depth; each rank holds Ψr + Ψs/W parameters, counted here off the model; the dense file it saves
loads in ddp.py with the same test accuracy; bad sizes are refused before any process group; in
a world of one, each block's input gradient is all-reduced once in Llama and HF's GPT-2, a W not
dividing Llama's kv heads is refused, and the clip takes a model without gradients.
ZeRO-R's --checkpoint and --partition-activations are tested in test_tensor_parallel_zero_r.py."""

import pytest
import torch

import common
from helpers import SMALL, ddp_reference, ddp_references, launch_cases, max_diff, python

DEPTH = 4
CFG = [*SMALL, "--depth", str(DEPTH)]  # the same config as test_pipeline.py: shared references
# W=3: 2 heads a rank; its 16 tokens do not split 3 ways
CFG3 = [*SMALL, "--dim", "48", "--heads", "6"]
# Round-off; AdamW turns it into steps on ~0 gradients: up to 1.9e-5 seen.
TOL = {"sgd": 1e-6, "adamw": 5e-5}
WINDOW = 3  # optimizer steps the Meter counts collectives in

CASES = [
    (2, False, "sgd"),
    (2, False, "adamw"),
    (2, True, "sgd"),
    (2, True, "adamw"),
    (3, False, "sgd"),
    (3, False, "adamw"),
]
DENSE = (3, False, "adamw")  # the case whose save ddp.py loads
IDS = [f"W{world}-{'sp' if sp else 'tp'}-{optim}" for world, sp, optim in CASES]
CLIP = "0.05"  # below every step's gradient norm on CFG (test_pipeline.py's): each step clips
CLIPPED = {"W2-sp-sgd-clip": (2, True, "sgd")}  # --clip runs, in the W=2 launch


def cfg_of(world):
    return CFG if world == 2 else CFG3


def args_and_model(cfg):
    args = common.parse_args(common.get_parser("test"), cfg)
    return args, common.build_model(args)


def selected_tests(request):
    """This session's selected tests of this module: all of them in a whole run, one when a single
    test is asked for (as tests/test_mutants.py does), so that it launches only what it reads."""
    return [item for item in request.session.items if item.module is request.module]


def loads_dense_save(request):
    """Whether test_dense_save_loads_in_ddp is selected: it reads DENSE and ddp.py's load of it."""
    return any(item.name == "test_dense_save_loads_in_ddp" for item in selected_tests(request))


def clipped_needed(request):
    """The CLIPPED cases the selected tests read."""
    names = set()
    for item in selected_tests(request):
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "clipped" in params:
            names.add(params["clipped"])
    return [name for name in CLIPPED if name in names]


def needed(request):
    """The cases the selected tests read, in CASES' order."""
    cases = set()
    for item in selected_tests(request):
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "sp" in params:
            cases.add((params["world"], params["sp"], params["optim"]))
    if loads_dense_save(request):
        cases.add(DENSE)
    return [case for case in CASES if case in cases]


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory, initial):
    """One launch per world size runs the cases the selected tests read, each saving its
    state_dict; the W=2 SP SGD run starts from --load of the initial weights (TP slices a plain
    state_dict). When test_dense_save_loads_in_ddp is selected, the W=2 launch (after the W=3 one:
    ddp.py refuses B=32 at W=3) ends with ddp.py loading DENSE's save with lr 0 and saving it
    again; the selected CLIPPED runs go before it. Returns ({case: (RESULT, saved path)}, ddp.py's
    (RESULT, saved path) or None); a CLIPPED run's key is its name."""
    folder = tmp_path_factory.mktemp("tp")
    saved = {case: folder / f"{i}.pt" for i, case in enumerate(CASES)}
    cases = needed(request)
    clipped = clipped_needed(request)
    out = {}
    loaded = None
    for world in (3, 2):
        in_world = [case for case in cases if case[0] == world]
        argv = []
        for case in in_world:
            _, sp, optim = case
            flags = [*cfg_of(world), "--optim", optim, "--save", saved[case]]
            if sp:
                flags.append("--sequence-parallel")
            if case == (2, True, "sgd"):
                flags += ["--load", initial]
            argv.append(["tensor_parallel", flags])
        in_world_clipped = [name for name in clipped if CLIPPED[name][0] == world]
        for name in in_world_clipped:
            _, sp, optim = CLIPPED[name]
            flags = [*cfg_of(world), "--optim", optim, "--clip", CLIP, "--save", folder / name]
            argv.append(["tensor_parallel", [*flags, *(["--sequence-parallel"] if sp else [])]])
        if world == 2 and loads_dense_save(request):
            round_trip = ["--optim", "sgd", "--lr", 0, "--max-steps", 1]
            round_trip += ["--load", saved[DENSE], "--save", folder / "ddp.pt"]
            argv.append(["ddp", [*CFG3, *round_trip]])
        if not argv:
            continue
        results = launch_cases(world, argv)
        for case, (result, _) in zip(in_world, results, strict=False):
            out[case] = (result, saved[case])
        clipped_results = results[len(in_world) : len(in_world) + len(in_world_clipped)]
        for name, (result, _) in zip(in_world_clipped, clipped_results, strict=True):
            out[name] = (result, folder / name)
        if world == 2 and loads_dense_save(request):
            loaded = (results[-1][0], folder / "ddp.pt")
    return out, loaded


@pytest.fixture(scope="module")
def runs(launched):
    """{(world, sp, optim): (RESULT, path of the saved state_dict)}, shared by the tests below."""
    return launched[0]


@pytest.fixture(scope="module")
def refs3(request, tmp_path_factory):
    """ddp.py at W=1 on CFG3 with the optimizers of the selected W=3 cases, in one process."""
    optims = sorted({optim for world, _, optim in needed(request) if world == 3})
    return ddp_references(tmp_path_factory, CFG3, optims)


@pytest.mark.parametrize("world,sp,optim", CASES, ids=IDS)
def test_same_parameters_as_ddp_one_process(world, sp, optim, runs, refs, refs3):
    result, path = runs[world, sp, optim]
    ref = refs[optim] if world == 2 else refs3[optim]
    diff = max_diff(ref, path)
    print(f"tensor_parallel W={world} sp={sp} {optim}: max |Δparam| vs ddp.py W=1 = {diff:.3g}")
    assert result["world_size"] == world
    assert result["steps"] == 6
    assert diff < TOL[optim]


@pytest.mark.parametrize("clipped", CLIPPED)
def test_clip_equals_one_ddp_process_clip(clipped, runs, refs, tmp_path_factory):
    """--clip at a limit below every step's gradient norm: the split model ends where ddp.py
    --clip ends in one process, so every rank clipped by the global norm (the shards' squares
    summed over the ranks, the replicated parameters' once, the norms' partial gradients summed
    first under SP). Unclipped training ends far from there, so the clip bit."""
    world, _, optim = CLIPPED[clipped]
    result, path = runs[clipped]
    reference = ddp_reference(tmp_path_factory, [*cfg_of(world), "--clip", CLIP], optim)
    assert max_diff(reference, refs[optim]) > 100 * TOL[optim]
    diff = max_diff(path, reference)
    print(f"tensor_parallel {clipped} --clip {CLIP}: max |Δ| vs ddp.py --clip W=1 = {diff:.2e}")
    assert (result["world_size"], result["steps"]) == (world, 6)
    assert diff < TOL[optim]


def partial_gradient_numel(model):
    """Under SP: the norms and row biases, which see only this rank's tokens."""
    numel = 0
    for block in model.blocks:
        for param in (*block.norm1.parameters(), *block.norm2.parameters()):
            numel += param.numel()
        numel += block.attn.proj.bias.numel() + block.mlp.fc2.bias.numel()
    return numel


@pytest.mark.parametrize("world,sp,optim", CASES, ids=IDS)
def test_measured_collectives(world, sp, optim, runs):
    """Every rank sees the whole batch B, so each f / g moves one [B, T, D] fp32 activation. The
    Meter counts an all-reduce's tensor, an all-gather's output and a reduce-scatter's input:
    whole activations, whatever W is (a ring then sends 2(W-1)/W resp. (W-1)/W of them)."""
    result, _ = runs[world, sp, optim]
    args, model = args_and_model(cfg_of(world))
    depth = len(model.blocks)
    activation_bytes = 4 * args.batch_size * model.embed.tokens * args.dim
    if not sp:  # per block: g after attention and after the MLP forward, f before each backward
        calls = dict(all_reduce=4 * depth)
        want = dict(all_reduce=4 * depth * activation_bytes)
    else:
        # f, g become all-gather / reduce-scatter (swapped backward); entering SP gathers the
        # gradient backward, leaving it gathers the tokens forward; one all-reduce sums the
        # gradients of the parameters that saw only this rank's tokens (norms, row biases)
        calls = dict(all_gather=4 * depth + 2, reduce_scatter=4 * depth, all_reduce=1)
        want = dict(
            all_gather=(4 * depth + 2) * activation_bytes,
            reduce_scatter=4 * depth * activation_bytes,
            all_reduce=4 * partial_gradient_numel(model),
        )
    assert result["comm_steps"] == WINDOW
    assert result["comm"] == want, result
    assert result["comm_calls"] == {kind: WINDOW * n for kind, n in calls.items()}, result
    assert result["comm"] == result["formula"]["comm"]


@pytest.mark.parametrize("world,sp,optim", CASES, ids=IDS)
def test_per_rank_parameter_bytes(world, sp, optim, runs):
    """Ψs (q, k, v, fc1 weights and biases; proj, fc2 weights) is split W ways; Ψr (embedding,
    norms, row biases, head) is replicated: 4(Ψr + Ψs/W) bytes of parameters and of gradients."""
    result, _ = runs[world, sp, optim]
    _, model = args_and_model(cfg_of(world))
    psi = sum(p.numel() for p in model.parameters())
    split = 0
    for block in model.blocks:
        for linear in (block.attn.q, block.attn.k, block.attn.v, block.mlp.fc1):
            split += sum(p.numel() for p in linear.parameters())
        split += block.attn.proj.weight.numel() + block.mlp.fc2.weight.numel()
    assert split % world == 0
    own = psi - split + split // world
    assert result["params"] == psi
    assert result["param_bytes"] == 4 * own
    assert result["grad_bytes"] == 4 * own
    assert result["optim_bytes"] == (8 if optim == "adamw" else 4) * own


def test_dense_save_loads_in_ddp(launched):
    """The W=3 save, gathered to rank 0, is the plain common model: ddp.py (at W=2, a case of the
    W=2 launch) loads it (lr 0: nothing moves), saves the same tensors and measures the same test
    accuracy TP measured."""
    runs, (loaded, loaded_path) = launched
    result, path = runs[DENSE]
    assert max_diff(path, loaded_path) == 0
    assert loaded["test_acc"] == result["test_acc"]


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
    launch = python("tensor_parallel.py", "--nproc", world, *CFG3, *argv, timeout=60)
    assert launch.returncode == 2, launch.output
    assert message in launch.stderr, launch.output
    assert launch.stderr.count("error:") == 1, launch.output
    assert "Traceback" not in launch.stderr, launch.output


def test_clip_takes_no_gradients(world_of_one):
    """clip_grad_norm_ before any backward returns 0, as torch's does, instead of failing."""
    import tensor_parallel

    args = common.parse_args(common.get_parser("test"), CFG)
    model = tensor_parallel.parallelize(common.build_model(args), torch.device("cpu"))
    assert isinstance(model.blocks[0].attn.q, tensor_parallel.ColumnParallelLinear)
    assert tensor_parallel.clip_grad_norm_(model, 1.0).item() == 0.0


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_each_block_input_gradient_all_reduced_once(world_of_one, monkeypatch, family):
    """f sits where a column-parallel layer's input enters it, g where a row-parallel layer's
    output leaves it, whatever the block passes its attention (Llama: freqs_cis and positions;
    HF's GPT-2: keyword arguments): per block, forward all-reduces g's two outputs and backward
    f's two inputs (the attention's, the MLP's), each a [B, T, D] activation once. One more on
    a path would sum that gradient twice, W times too large."""
    import copy_tensor_parallel

    import tensor_parallel

    recipe = copy_tensor_parallel.FAMILIES[family]
    model = recipe.model(copy_tensor_parallel.DEFAULTS[family])
    plan, blocks, _ = copy_tensor_parallel.llama_parts(family, model)
    tensor_parallel.parallelize(model, torch.device("cpu"), plan, blocks=blocks)
    reduced = []
    all_reduce = torch.distributed.all_reduce

    def counting(tensor, *args, **kwargs):
        reduced.append(tuple(tensor.shape))
        return all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.distributed, "all_reduce", counting)
    inputs, _ = recipe.held_out()
    logits = model(inputs) if family == "llama" else model(inputs)[1]
    forward = list(reduced)
    reduced.clear()
    logits.sum().backward()
    activation = (*inputs.shape, 32)  # both models' D
    assert forward == [activation] * 2 * len(blocks)
    assert reduced == [activation] * 2 * len(blocks)


def test_grouped_query_attention_refuses_w_not_dividing_kv_heads(world_of_one, monkeypatch):
    """Llama's wqkv is split by kv group: a W that does not divide n_kv_heads (here 2 kv heads
    over W = 4, the group's size as dist reports it) is refused with one clear error."""
    import copy_tensor_parallel
    import llama_model

    import tensor_parallel

    model = llama_model.model()
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    plan = copy_tensor_parallel.LLAMA_PLAN
    with pytest.raises(ValueError, match="W must divide n_kv_heads"):
        tensor_parallel.parallelize(model, None, plan, blocks=list(model.layers.values()))


def test_full_state_dict_keeps_buffers(world_of_one):
    """A model with a persistent buffer (an older nanoGPT's causal mask, BatchNorm's statistics):
    the saved state_dict is the plain model's, buffer included, in model.state_dict()'s order."""
    import tensor_parallel

    args = common.parse_args(common.get_parser("test"), CFG)
    plain = common.build_model(args)
    plain.blocks[0].attn.register_buffer("mask", torch.ones(3, 3).tril())
    expected = {key: value.clone() for key, value in plain.state_dict().items()}
    model = tensor_parallel.parallelize(plain, torch.device("cpu"))
    state = tensor_parallel.full_state_dict(model)
    assert list(state) == list(expected)
    assert all(torch.equal(state[key], expected[key]) for key in expected)
