"""Copy a technique into Llama 3 as torchtitan has it and into HuggingFace's GPT2LMHeadModel as
transformers 5 has it: each technique section, imported from its script, trains the model of
tests/llama_model.py (RoPE at each token's position, grouped-query attention, a fused wqkv saved as
wq/wk/wv by the model's state_dict hook, a persistent freqs_cis buffer, SwiGLU or stacked experts)
or tests/hf_gpt2_model.py (Conv1D layers stored [in, out], keyword-called blocks returning tuples,
sdpa or eager attention, labels shifted by the model) at W=2, each by its own recipe (padded
labels, the loss over the step's global count of targets, gradient accumulation, clipping that
bites every step), without a line of the model class changed. Each case ends with the parameters
of one process trained by the same recipe (SGD to 1e-6, AdamW to 5e-5), its held-out loss and
every step's gradient norm, and its save is the model's own state_dict(): the same keys and
shapes, and a strict load_state_dict into a fresh, unsplit model accepts it.

Every case a copy module lists in LLAMA_CASES is checked here; one launch runs the cases of the
modules the selected tests need (tests/copy_cases.py --llama).
"""

import importlib
import importlib.util
import json
import math
import os

import hf_gpt2_model
import llama_model
import pytest
import torch

from helpers import fork_launch

# The copy modules (tests/copy_<name>.py) with Llama and GPT-2 cases, each listing them in
# LLAMA_CASES (case names start with the family: "llama-..." or "gpt2-..."). One line a module.
MODULES = [
    "zero",
    "fsdp",
    "amp",
    "tensor_parallel",
    "expert_parallel",
    "context_parallel",
    "pipeline",
    "hybrid",
    "deepspeed",  # last: DeepSpeed's import sets globals of its own in the launch's processes
]
# DeepSpeed is optional (requirements-deepspeed.txt): its cases skip, saying so, where it is not
# installed, except where REQUIRE_DEEPSPEED is set (CI), where they must run.
SKIP_DEEPSPEED = importlib.util.find_spec("deepspeed") is None and not os.environ.get(
    "REQUIRE_DEEPSPEED"
)
needs_deepspeed = pytest.mark.skipif(
    SKIP_DEEPSPEED, reason="DeepSpeed is not installed: pip install -r requirements-deepspeed.txt"
)
MARKS = {"deepspeed": needs_deepspeed}
CASES = [
    pytest.param(module, case, id=f"{module}-{case}", marks=MARKS.get(module, ()))
    for module in MODULES
    for case in importlib.import_module(f"copy_{module}").LLAMA_CASES
]
# The modules whose cases run at another world size than 2: hybrid at (pp, dp, tp) = (2, 2, 2);
# FSDP at 4, which does not divide Llama's 2 kv heads: its save must not run the model's hooks on
# the shards (a DTensor cannot cut wqkv's rows into kv groups there).
WORLDS = {"hybrid": 8, "fsdp": 4}
TOL = {"sgd": 1e-6, "adamw": 5e-5}  # round-off, as the ViT tests allow it
FAMILIES = {"llama": llama_model, "gpt2": hf_gpt2_model}
VARIANTS = {"llama": llama_model.ARGS_BY_PREFIX, "gpt2": hf_gpt2_model.CONFIGS}
VOCAB_KEY = {llama_model: "output.weight", hf_gpt2_model: "lm_head.weight"}  # [vocab, dim]
REFERENCES = [
    f"{family}-{prefix}{optim}"
    for family, variants in VARIANTS.items()
    for prefix in variants
    for optim in ("sgd", "adamw")
]


def needed(request):
    """The copy modules whose cases this session's selected tests read (one, when a single test
    is asked for, as tests/test_mutants.py does), so that the launch runs only those."""
    modules = []
    for item in request.session.items:
        if item.module is not request.module:
            continue
        callspec = getattr(item, "callspec", None)
        module = callspec.params.get("module") if callspec else None
        if module == "deepspeed" and SKIP_DEEPSPEED:
            continue  # its tests skip
        if module in MODULES and module not in modules:
            modules.append(module)
    if modules:
        return modules
    return [module for module in MODULES if not (module == "deepspeed" and SKIP_DEEPSPEED)]


@pytest.fixture(scope="module")
def copies(request, tmp_path_factory):
    """The selected cases in one launch a world size (W=2; WORLDS names the others): (the folder
    of saved state_dicts, the results by case)."""
    folder = tmp_path_factory.mktemp("copy_llama")
    by_world = {}
    for module in needed(request):
        by_world.setdefault(WORLDS.get(module, 2), []).append(module)
    results = {}
    for world, modules in by_world.items():
        launch_folder = folder / f"w{world}"
        launch_folder.mkdir()
        run = fork_launch(
            "tests/copy_cases.py", world, launch_folder, "--llama", *modules, timeout=300
        )
        assert run.returncode == 0, run.output
        with open(launch_folder / "results.json") as f:
            results.update(json.load(f))
        # the cases' files, and the references (every launch trains the same ones)
        for path in launch_folder.glob("*.pt"):
            path.replace(folder / path.name)
    return folder, results


def fresh_model(reference_name):
    """An unsplit model of the reference's family and variant ("llama-moe-sgd": Llama with
    experts), as the recipe builds it."""
    family, _, rest = reference_name.partition("-")
    prefix = rest.removesuffix(rest.split("-")[-1])  # "moe-" of "moe-sgd", "" of "sgd"
    recipe = FAMILIES[family]
    return recipe.model(VARIANTS[family][prefix])


def compared_keys(reference_name, state):
    """What an exactness check compares: every tensor, but with AdamW not GPT-2's key bias (a
    gradient that is mathematically zero: see hf_gpt2_model.KEY_BIAS)."""
    optim = reference_name.split("-")[-1]
    if reference_name.startswith("gpt2"):
        return list(hf_gpt2_model.compared_keys(state, optim))
    return [(key, slice(None)) for key in state]


@pytest.mark.parametrize("reference_name", REFERENCES)
def test_the_reference_learns_and_clips_every_step(copies, reference_name):
    """A test that cannot fail is a defect: one process must learn, and its clip must bite."""
    _, results = copies
    reference = results[f"reference-{reference_name}"]
    recipe = FAMILIES[reference_name.split("-")[0]]
    vocab_size = fresh_model(reference_name).state_dict()[VOCAB_KEY[recipe]].shape[0]
    assert reference["eval_loss"] < math.log(vocab_size) - 0.3
    assert min(reference["norms"]) > recipe.CLIP, reference["norms"]


def test_the_llama_state_dict_is_metas_layout(copies):
    """The model's own state_dict() is what the saves must reproduce: wq, wk, wv (the hook's
    split of the fused wqkv, by kv group), no wqkv, and the persistent freqs_cis buffer."""
    folder, _ = copies
    state = torch.load(folder / "reference-llama-sgd.pt", weights_only=True)
    assert "freqs_cis" in state and state["freqs_cis"].is_complex()
    assert state["layers.0.attention.wq.weight"].shape == (32, 32)  # 4 heads of 8
    assert state["layers.0.attention.wk.weight"].shape == (16, 32)  # 2 kv heads of 8
    assert not any("wqkv" in key for key in state)


@pytest.mark.parametrize("module, case", CASES)
def test_equals_one_process(copies, module, case):
    """The parameters of one process trained by the same recipe (SGD to 1e-6, AdamW to 5e-5), the
    held-out loss, and the global gradient norm one process's clip_grad_norm_ returns at every
    step."""
    folder, results = copies
    reference_name = results[case]["reference"]
    optim = reference_name.split("-")[-1]
    state = torch.load(folder / f"{case}.pt", weights_only=True)
    reference = torch.load(folder / f"reference-{reference_name}.pt", weights_only=True)
    assert state.keys() == reference.keys(), f"{case}: saved keys are not the model's"
    diffs = [
        (state[key][index] - reference[key][index]).abs().max().item()
        for key, index in compared_keys(reference_name, reference)
    ]
    assert max(diffs) < TOL[optim], f"{case}: max |Δparameter| {max(diffs):.2e}"
    reference_results = results[f"reference-{reference_name}"]
    assert results[case]["eval_loss"] == pytest.approx(reference_results["eval_loss"], abs=1e-4)
    assert results[case]["norms"] == pytest.approx(reference_results["norms"], rel=1e-5)


@pytest.mark.parametrize("module, case", CASES)
def test_save_is_the_models_state_dict(copies, module, case):
    """The section's full_state_dict went through the model's own state_dict(): the keys, shapes
    and dtypes of the unsplit model's (Llama's wq/wk/wv from its hook and its freqs_cis buffer),
    a tied weight saved under both names, and a strict load_state_dict into a fresh model accepts
    it and then holds exactly the saved values."""
    folder, results = copies
    reference_name = results[case]["reference"]
    state = torch.load(folder / f"{case}.pt", weights_only=True)
    model = fresh_model(reference_name)
    expected = model.state_dict()
    assert state.keys() == expected.keys(), f"{case}: keys {sorted(state)}"
    for key, tensor in expected.items():
        assert state[key].shape == tensor.shape, f"{case}: {key} {tuple(state[key].shape)}"
        assert state[key].dtype == tensor.dtype, f"{case}: {key} {state[key].dtype}"
    model.load_state_dict(state, strict=True)
    reloaded = model.state_dict()
    assert all(torch.equal(reloaded[key], state[key]) for key in state)
    if reference_name.startswith("gpt2"):
        assert torch.equal(state["transformer.wte.weight"], state["lm_head.weight"])


# pipeline


@pytest.mark.parametrize("module", ["pipeline"])
def test_pipeline_called_each_block_with_the_models_arguments(copies, module):
    """Two stages, one block each, and every block called as the model's forward calls it, which
    equal parameters alone would not show for Llama (the stage could pass its own RoPE table):
    Llama's layers with the stage's freqs_cis [max_seq_len, head_dim/2] and positions None; HF
    GPT-2's blocks by keyword with eager attention's causal 4-D mask [B/m, 1, T, T] and the
    position_ids."""
    _, results = copies
    for case in ("llama-pipeline-sgd", "llama-pipeline-adamw"):
        by_rank = results[case]["block_calls"]
        assert [list(calls) for calls in by_rank] == [["layers.0"], ["layers.1"]]
        for calls in by_rank:
            (call,) = calls.values()
            assert call["arguments"] == [[16, 4], None] and call["keywords"] == []
    for case in ("gpt2-pipeline-eager-sgd", "gpt2-pipeline-eager-adamw"):
        by_rank = results[case]["block_calls"]
        assert [list(calls) for calls in by_rank] == [["transformer.h.0"], ["transformer.h.1"]]
        for calls in by_rank:
            (call,) = calls.values()
            assert call["keywords"] == ["attention_mask", "position_ids"]
            assert call["arguments"] == [[8, 1, 16, 16], [1, 16]] and call["causal"] is True


# deepspeed


@needs_deepspeed
@pytest.mark.parametrize("module", ["deepspeed"])
def test_deepspeed_stage_3_partitioned_every_parameter(copies, module):
    """Stage 3 keeps no parameter whole on a rank outside a forward or backward (their data are
    empty; each rank's partition is in ds_tensor), so the equal parameters above came through
    DeepSpeed's gathers; stages 1 and 2 keep them whole on every rank."""
    _, results = copies
    for family in FAMILIES:
        # the model's parameters, a tied one once
        numel = sum(param.numel() for param in fresh_model(f"{family}-sgd").parameters())
        for stage in (1, 2, 3):
            for optim in ("sgd", "adamw"):
                proof = results[f"{family}-deepspeed{stage}-{optim}"]
                assert proof["numel"] == numel
                assert proof["held"] == (0 if stage == 3 else numel), (stage, proof["held"])


# the copy-test model itself


@pytest.mark.skipif(
    not hasattr(torch.nn.functional, "grouped_mm"),
    reason="this torch has no public grouped_mm: GroupedExperts runs its loop only",
)
def test_grouped_experts_grouped_mm_equals_the_loop():
    """GroupedExperts' two paths (one grouped GEMM over the stacked [E, ...] weights, which it takes
    in bf16 on a GPU; a matmul per expert, which it takes here) give the same outputs and
    gradients, an expert with no token included."""
    experts = llama_model.model(llama_model.MOE_ARGS).layers["0"].moe.experts
    x = torch.randn(20, llama_model.MOE_ARGS.dim, generator=torch.Generator().manual_seed(0))
    x.requires_grad_(True)
    counts = torch.tensor([5, 0, 9, 6])
    inputs = [x, experts.w1, experts.w2, experts.w3]
    loop = experts.run_for_loop(x, counts)
    grouped = experts.run_grouped_mm(x, counts)
    assert torch.allclose(grouped, loop, atol=1e-6)
    loop_grads = torch.autograd.grad(loop.square().sum(), inputs)
    grouped_grads = torch.autograd.grad(grouped.square().sum(), inputs)
    for grouped_grad, loop_grad in zip(grouped_grads, loop_grads, strict=True):
        assert torch.allclose(grouped_grad, loop_grad, atol=1e-6)
