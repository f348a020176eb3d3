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

import nanogpt_model
import pytest
import torch

from helpers import fork_launch

# The copy modules (tests/copy_<name>.py) with nanoGPT cases, each listing them in NANOGPT_CASES.
MODULES = ["zero", "fsdp", "amp", "expert_parallel"]
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


def max_parameter_diff(folder, case, reference_name):
    """The largest |Δ| between the case's saved parameters and one process's, over what
    nanogpt_model.compared_keys compares (with AdamW, not the key bias: see KEY_BIAS)."""
    optim = reference_name.split("-")[-1]
    state = torch.load(folder / f"{case}.pt", weights_only=True)
    reference = torch.load(folder / f"reference-{reference_name}.pt", weights_only=True)
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
    """The section's MoE (E=4 of nanoGPT's MLP, top-2, balance loss) in every block's mlp: each
    rank held 2 of the 4 experts of every block (the split, which equal parameters alone would not
    show), and the one-process reference of that model learned and clipped every step."""
    _, results = copies
    proof = results[f"{module}-{optim}"]
    assert proof["experts_held"] == [[[0, 1], [0, 1]], [[2, 3], [2, 3]]]  # [rank][block]
    reference = proof["reference_results"]
    assert reference["eval_loss"] < math.log(nanogpt_model.CONFIG.vocab_size) - 0.3
    assert min(reference["norms"]) > nanogpt_model.CLIP, reference["norms"]
