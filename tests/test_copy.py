"""Copy a technique into a project: each technique section, imported from its script and nothing
from common/, trains a second model, a small GPT-2-like causal LM with tied embeddings
(tests/causal_lm.py), at W=2 with gradient accumulation (two backward passes a step), SGD and
AdamW with two parameter groups, and ends with the parameters of one process training the same
model on the same batches, its tie intact. One torchrun launch runs every case
(tests/copy_cases.py); each test reads its case's result.
"""

import json
import math

import pytest
import torch

from helpers import torchrun

# round-off, as the ViT tests allow it (AdamW turns it into steps on ~0 gradients)
TOL = {"sgd": 1e-6, "adamw": 5e-5}
OPTIMS = ["sgd", "adamw"]


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """Every case in one launch: (the folder of saved state_dicts, the results by case)."""
    folder = tmp_path_factory.mktemp("copy")
    run = torchrun("tests/copy_cases.py", 2, folder, timeout=300)
    assert run.returncode == 0, run.output
    with open(folder / "results.json") as f:
        return folder, json.load(f)


def assert_same_as_one_process(copies, case):
    folder, results = copies
    optim = results[case]["reference"]
    state = torch.load(folder / f"{case}.pt", weights_only=True)
    reference = torch.load(folder / f"reference-{optim}.pt", weights_only=True)
    assert state.keys() == reference.keys()
    diff = max((state[key] - reference[key]).abs().max().item() for key in reference)
    assert diff < TOL[optim], f"{case}: max |Δparameter| {diff:.2e} against one process"
    assert results[case]["tied"], "lm_head.weight is no longer wte.weight in the trained model"
    assert torch.equal(state["embed.wte.weight"], state["head.lm_head.weight"]), "tie broken"
    reference_loss = results[f"reference-{optim}"]["eval_loss"]
    assert results[case]["eval_loss"] == pytest.approx(reference_loss, abs=1e-4)


@pytest.mark.parametrize("optim", OPTIMS)
def test_the_task_is_learned(copies, optim):
    """A test that cannot fail is a defect: the one-process reference must learn something."""
    _, results = copies
    reference = results[f"reference-{optim}"]
    assert reference["losses"][-1] < reference["losses"][0] - 0.3
    assert reference["eval_loss"] < math.log(16) - 0.3  # below guessing among 16 tokens


@pytest.mark.parametrize("optim", OPTIMS)
def test_ddp_equals_one_process(copies, optim):
    assert_same_as_one_process(copies, f"ddp-{optim}")


@pytest.mark.parametrize(
    "stage, optim", [(stage, optim) for stage in (1, 2, 3) for optim in OPTIMS]
)
def test_zero_equals_one_process(copies, stage, optim):
    assert_same_as_one_process(copies, f"zero{stage}-{optim}")


@pytest.mark.parametrize("offload, stage", [("cpu", 2), ("disk", 3)])
def test_zero_offload_equals_one_process(copies, offload, stage):
    """zero_offload.py's engine, shared with zero.py, with the optimizer on CPU or on disk: the
    tie, and the gradient of both backward passes of a step added up where the shard lives."""
    assert_same_as_one_process(copies, f"zero_offload-{offload}{stage}-sgd")
