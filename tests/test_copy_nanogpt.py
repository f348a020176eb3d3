"""Copy a technique into nanoGPT as it is: each technique section, imported from its script, trains
the model laid out and trained as nanoGPT lays it out and trains it (tests/nanogpt_model.py:
`transformer.wte/wpe/drop/h/ln_f` and a tied `lm_head`, biases, (x, y) batches with
ignore_index=-1, configure_optimizers' two AdamW groups, gradient accumulation and gradient
clipping at a limit that clips every step) at W=2, without a line of the model class changed,
and ends with the parameters of one process training it by the same recipe, its tie intact.

Every case a copy module lists in NANOGPT_CASES is checked here for what every technique promises;
what one technique shows beyond that (its split) has a test of its own below. One launch runs the
cases of the modules the selected tests need (tests/copy_cases.py --nanogpt).
"""

import importlib
import json
import math

import copy_context_parallel
import copy_mixed_precision
import copy_pipeline
import copy_tensor_parallel
import copy_zero
import nanogpt_model
import pytest
import torch

from helpers import fork_launch

# The copy modules (tests/copy_<name>.py) with nanoGPT cases, each listing them in NANOGPT_CASES.
MODULES = [
    "zero",
    "fsdp",
    "amp",
    "expert_parallel",
    "pipeline",
    "context_parallel",
    "tensor_parallel",
    "mixed_precision",
]
CASES = [
    (module, case)
    for module in MODULES
    for case in importlib.import_module(f"copy_{module}").NANOGPT_CASES
]
TOL = {"sgd": 1e-6, "adamw": 5e-5}  # round-off, as the ViT tests allow it


def needed(request):
    """The copy modules whose cases this session's selected tests read (one, when a single test
    is asked for, as tests/test_mutants.py does), so that the launch runs only those."""
    modules = []
    for item in request.session.items:
        if item.module is not request.module:
            continue
        callspec = getattr(item, "callspec", None)
        module = callspec.params.get("module") if callspec else None
        if module is None:
            module = item.name.removeprefix("test_").split("_")[0]
        if module in MODULES and module not in modules:
            modules.append(module)
    return modules or MODULES


@pytest.fixture(scope="module")
def copies(request, tmp_path_factory):
    """The selected cases in one launch: (the folder of saved state_dicts, the results by case)."""
    folder = tmp_path_factory.mktemp("copy_nanogpt")
    run = fork_launch("tests/copy_cases.py", 2, folder, "--nanogpt", *needed(request), timeout=300)
    assert run.returncode == 0, run.output
    with open(folder / "results.json") as f:
        return folder, json.load(f)


def max_parameter_diff(folder, case, reference_name, peer=None):
    """The largest |Δ| between the case's saved parameters and one process's (or, given, the
    peer case's), over what nanogpt_model.compared_keys compares (with AdamW, not the key bias:
    see KEY_BIAS)."""
    optim = reference_name.split("-")[-1]
    state = torch.load(folder / f"{case}.pt", weights_only=True)
    reference_file = f"{peer}.pt" if peer else f"reference-{reference_name}.pt"
    reference = torch.load(folder / reference_file, weights_only=True)
    assert state.keys() == reference.keys()
    diffs = [
        (state[key][index] - reference[key][index]).abs().max().item()
        for key, index in nanogpt_model.compared_keys(reference, optim)
    ]
    return max(diffs)


@pytest.mark.parametrize("optim", nanogpt_model.OPTIMS)
def test_the_reference_learns_and_clips_every_step(copies, optim):
    """A test that cannot fail is a defect: one process must learn, and its clip must bite."""
    _, results = copies
    reference = results[f"reference-{optim}"]
    assert reference["eval_loss"] < math.log(nanogpt_model.CONFIG.vocab_size) - 0.3
    assert min(reference["norms"]) > nanogpt_model.CLIP, reference["norms"]


@pytest.mark.parametrize("module, case", CASES)
def test_equals_one_process(copies, module, case):
    """The parameters of one process (SGD to 1e-6), the tie kept (one tensor under both names in
    the saved state_dict, one Parameter in the trained model), the held-out loss, and the global
    gradient norm that one process's clip_grad_norm_ returns, at every step."""
    folder, results = copies
    reference_name = results[case]["reference"]  # "sgd", "nobias-adamw", or the case's own
    optim = reference_name.split("-")[-1]
    diff = max_parameter_diff(folder, case, reference_name)
    assert diff < TOL[optim], f"{case}: max |Δparameter| {diff:.2e} against one process"
    assert results[case]["tied"], "lm_head.weight is no longer transformer.wte.weight"
    state = torch.load(folder / f"{case}.pt", weights_only=True)
    assert torch.equal(state["transformer.wte.weight"], state["lm_head.weight"]), "tie broken"
    # a case with a reference of its own (a changed model: experts) carries its results
    reference = results.get(f"reference-{reference_name}") or results[case]["reference_results"]
    assert results[case]["eval_loss"] == pytest.approx(reference["eval_loss"], abs=1e-4)
    assert results[case]["norms"] == pytest.approx(reference["norms"], rel=1e-5)


# expert parallel


# `module` as a parameter: `needed` reads it, so that this test alone launches expert_parallel's
# cases only.
@pytest.mark.parametrize("module, optim", [("expert_parallel", o) for o in nanogpt_model.OPTIMS])
def test_expert_parallel_split_the_experts(copies, module, optim):
    """common/moe.py's MoE (E=4 of nanoGPT's MLP, top-2, balance loss) in every block's mlp: each
    rank held 2 of the 4 experts of every block (the split, which equal parameters alone would not
    show), and the one-process reference of that model learned and clipped every step."""
    _, results = copies
    proof = results[f"{module}-{optim}"]
    assert proof["experts_held"] == [[[0, 1], [0, 1]], [[2, 3], [2, 3]]]  # [rank][block]
    reference = proof["reference_results"]
    assert reference["eval_loss"] < math.log(nanogpt_model.CONFIG.vocab_size) - 0.3
    assert min(reference["norms"]) > nanogpt_model.CLIP, reference["norms"]


# pipeline


@pytest.mark.parametrize("module, case", [("pipeline", c) for c in copy_pipeline.NANOGPT_CASES])
def test_pipeline_split_the_model(copies, module, case):
    """Two stages of the model as it is: one of nanoGPT's two blocks each, wte and wpe on the
    first stage only, and a copy of the tied weight on each end (transformer.wte.weight on the
    first, lm_head.weight on the last), which equal parameters alone would not show."""
    _, results = copies
    proof = results[case]
    assert proof["blocks"] == [1, 1]
    assert proof["wpe"] == [True, False]
    assert proof["copies"] == [1, 1]


# context parallel


@pytest.mark.parametrize(
    "module, case", [("context_parallel", c) for c in copy_context_parallel.NANOGPT_CASES]
)
def test_context_parallel_split_the_sequence(copies, module, case):
    """Each rank embedded and attended with its 8 of the 16 tokens at their own positions (rank 0
    holds 0-7, or with the zig-zag split chunks 0 and 3 of 4: 0-3 and 12-15), through the
    model's own attention (its SDPA call swapped), and every rank's loss, with the ignored first
    target on rank 0 only, is one process's mean over the whole micro-batch."""
    _, results = copies
    proof = results[case]
    contiguous = [list(range(0, 8)), list(range(8, 16))]
    zigzag = [[*range(0, 4), *range(12, 16)], list(range(4, 12))]
    expected = zigzag if "zigzag" in case else contiguous
    assert [seen["positions"] for seen in proof["by_rank"]] == expected
    assert [seen["attention_tokens"] for seen in proof["by_rank"]] == [8, 8]
    assert [seen["attention"] for seen in proof["by_rank"]] == ["CausalSelfAttention"] * 2
    reference_losses = results[f"reference-{proof['reference']}"]["losses"]
    for seen in proof["by_rank"]:
        assert seen["losses"] == pytest.approx(reference_losses, abs=1e-5)


# tensor parallel


@pytest.mark.parametrize(
    "module, case", [("tensor_parallel", c) for c in copy_tensor_parallel.NANOGPT_CASES]
)
def test_tensor_parallel_split_the_heads(copies, module, case):
    """Each rank's c_attn held 3D/W = 48 of its 96 rows: whole heads, the same two of q, k and v
    (rank 0 heads 0-1, rank 1 heads 2-3), with or without biases; under sequence parallelism
    block 0's ln_1 ran on T/W = 8 of the 16 tokens, else on all 16; and the replicated parameters
    (embeddings, norms, row biases) ended equal on both ranks, which they do only if both clipped
    by the same global norm."""
    _, results = copies
    proof = results[case]
    assert proof["c_attn_rows"] == [48, 48]
    assert proof["heads"] == [[[0, 1]] * 3, [[2, 3]] * 3]
    assert proof["ln_1_tokens"] == ([8, 8] if "-sp-" in case else [16, 16])
    assert proof["replicated_apart"] == [0.0, 0.0]


# zero


@pytest.mark.parametrize(
    "module, case", [("zero", c) for c in copy_zero.NANOGPT_CASES if c.startswith("zero")]
)
def test_zero_sharded_the_units(copies, module, case):
    """Rank 0's model.parameters() were its shards: half of each of nanoGPT's units, each padded
    to an even count (wte holding the tied weight once), and nothing in lm_head, which holds only
    the tied weight; at stage 3 no unit stayed whole after the step, at stages 1-2 all five did."""
    _, results = copies
    proof = results[case]
    model = nanogpt_model.model()
    transformer = model.transformer
    units = [transformer.wte, transformer.wpe, *transformer.h, transformer.ln_f]
    sizes = [sum(param.numel() for param in unit.parameters()) for unit in units]
    assert sum(sizes) == sum(param.numel() for param in model.parameters())  # lm_head: tied only
    assert proof["held"] == sum(-(-size // 2) for size in sizes)
    assert proof["lm_head_held"] == 0
    assert proof["whole_units"] == (0 if "3-" in case else len(units))


@pytest.mark.parametrize(
    "module, case", [("mixed_precision", c) for c in copy_mixed_precision.NANOGPT_BF16_CASES]
)
def test_zero_mixed_precision_equals_fsdp_mixed_precision(copies, module, case):
    """zero.py's and zero_offload.py's mixed precision on nanoGPT (bf16 compute from the fp32
    master shards, fp32 reduce-scatters, the fp32 step; stage 1 told the accumulation, the disk
    case's masters in its files) ends where fsdp.py's MixedPrecisionPolicy ends on the same
    recipe (AdamW unclipped: see tests/copy_mixed_precision.py), to fp32's round-off, its tie kept,
    with the same losses (and clip norms). Both computed in bf16 and both ended far from one
    process in fp32, so that neither can pass with its mixed precision off."""
    folder, results = copies
    peer = copy_mixed_precision.NANOGPT_BF16_CASES[case]
    optim = case.split("-")[-1]
    diff = max_parameter_diff(folder, case, optim, peer=peer)
    assert diff < TOL[optim], f"{case}: max |Δparameter| {diff:.2e} against {peer}"
    state = torch.load(folder / f"{case}.pt", weights_only=True)
    assert state["transformer.wte.weight"].dtype == torch.float32  # the master, not the copy
    assert torch.equal(state["transformer.wte.weight"], state["lm_head.weight"]), "tie broken"
    assert results[case]["tied"]
    bf16 = {"weight": "torch.bfloat16", "input": "torch.bfloat16"}
    assert results[case]["compute_dtypes"] == results[peer]["compute_dtypes"] == bf16
    assert results[case]["losses"] == pytest.approx(results[peer]["losses"], abs=1e-6)
    assert len(results[case]["norms"]) == (nanogpt_model.STEPS if optim == "sgd" else 0)
    assert results[case]["norms"] == pytest.approx(results[peer]["norms"], rel=1e-6)
    fp32_diff = max_parameter_diff(folder, case, optim)
    assert fp32_diff > 100 * TOL[optim], f"{case}: {fp32_diff:.2e} from fp32, as if it were fp32"
