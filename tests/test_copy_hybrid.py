"""Copy hybrid parallelism into a project: hybrid_parallel.py's section, told a language model
through a Contract (tests/copy_hybrid.py), composes the 1F1B pipeline over pp, Megatron TP with
q, k, v fused over tp and ZeRO over dp at W=8, (pp, dp, tp) = (2, 2, 2), the tied embedding's two
copies on the first and the last stage, and ends with the parameters of one process training the
same model on the same batches, the tie intact (tests/test_copy.py's check). One launch runs the
CausalLM's four cases (tests/copy_cases.py at W=8, the module alone), another nanoGPT's model as
it is, whose clip scales every step (tests/test_copy_nanogpt.py's check)."""

import json
from types import SimpleNamespace

import nanogpt_model
import pytest
import torch
from copy_hybrid import CASES, CAUSAL_LM_PARTS, NANOGPT_CASES
from test_copy import assert_same_as_one_process
from test_copy_nanogpt import TOL, max_parameter_diff

import hybrid_parallel
from helpers import fork_launch


def launch(folder, *flags):
    """tests/copy_cases.py's hybrid cases at W=8 into `folder`: (folder, the results by case)."""
    run = fork_launch("tests/copy_cases.py", 8, folder, *flags, "hybrid", timeout=300)
    assert run.returncode == 0, run.output
    with open(folder / "results.json") as f:
        return folder, json.load(f)


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """The CausalLM cases in one launch."""
    return launch(tmp_path_factory.mktemp("copy_hybrid"))


def assert_split(proof, blocks):
    """The split ran: ranks 0-3 (stage 0) hold the first block and ranks 4-7 the second; every
    rank's c_attn holds 48 of the fused 96 rows (its 2 of 4 heads of q, k and v); on every rank the
    tied weight's copy (the embedding's on stage 0, the head's on stage 1) is a unit of its own,
    256 of its 512 elements in the rank's shard."""
    assert proof["blocks"] == [[blocks[0]]] * 4 + [[blocks[1]]] * 4
    assert proof["c_attn_rows"] == [48] * 8
    assert proof["tied_shard"] == [[256]] * 8


@pytest.mark.parametrize("case", CASES)
def test_hybrid_equals_one_process(copies, case):
    """ZeRO stage 1 or 3 with SGD (a sum where a mean belongs) or AdamW (its two weight-decay
    groups, a piece of each unit's shard per group; the tied copies in the no-decay group on both
    ends): the parameters of one process, both tied keys equal in the saved state_dict, the
    held-out loss through the section's infer; and the split ran."""
    assert_same_as_one_process(copies, case)
    _, results = copies
    assert_split(results[case], ["blocks.0", "blocks.1"])


@pytest.mark.parametrize("case", CASES)
def test_hybrid_clip_norm_is_one_process_norm(copies, case):
    """Every step's gradient norm from the section's clip_grad_norm_ (no limit: nothing scaled) is
    one process's: the dp shards and the tp splits added up, the weights every tp rank holds whole
    once, the tied weight once though both ends hold its summed gradient."""
    _, results = copies
    norms = torch.tensor(results[case]["norms"])
    expected = torch.tensor(results[case]["reference_norms"])
    torch.testing.assert_close(norms, expected, rtol=1e-4, atol=0)


@pytest.fixture(scope="module")
def nanogpt_copies(tmp_path_factory):
    """nanoGPT's cases in one launch."""
    return launch(tmp_path_factory.mktemp("copy_hybrid_nanogpt"), "--nanogpt")


@pytest.mark.parametrize("case", NANOGPT_CASES)
def test_hybrid_nanogpt_equals_one_process(nanogpt_copies, case):
    """nanoGPT's model as it is (its parts named in copy_pipeline's GPT_PARTS, biases or none),
    its configure_optimizers' groups, its loss and its clip, which clips every step: the parameters
    of one process (with AdamW, not the key bias: see nanogpt_model.KEY_BIAS), the tie intact, the
    held-out loss, one process's gradient norm at every step; and the split ran."""
    folder, results = nanogpt_copies
    reference_name = results[case]["reference"]
    optim = reference_name.split("-")[-1]
    diff = max_parameter_diff(folder, case, reference_name)
    assert diff < TOL[optim], f"{case}: max |Δparameter| {diff:.2e} against one process"
    assert results[case]["tied"], "the tie is broken in the saved state_dict"
    reference = results[f"reference-{reference_name}"]
    assert results[case]["eval_loss"] == pytest.approx(reference["eval_loss"], abs=1e-4)
    assert results[case]["norms"] == pytest.approx(reference["norms"], rel=1e-5)
    assert min(reference["norms"]) > nanogpt_model.CLIP  # the clip scaled every step
    assert_split(results[case], ["transformer.h.0", "transformer.h.1"])


def test_a_tied_weight_sharing_its_unit_is_refused():
    """A tied weight whose module holds more (Parts naming the whole embedding) would sit in a
    unit laid out otherwise than the head's copy: each dp rank's shard of it would cover other
    elements on the two ends, and their sum would add unrelated numbers. mark_tied refuses it."""
    embedding_unit = SimpleNamespace(
        params=[("embed.wte.weight", None, 0), ("embed.wpe.weight", None, 512)]
    )
    stage = SimpleNamespace(zero=SimpleNamespace(units=[embedding_unit]), tied=[])
    with pytest.raises(ValueError, match="embed.wte.weight: .* a ZeRO unit of its own"):
        hybrid_parallel.mark_tied(stage, ["embed.wte.weight"])


def test_sequence_parallel_with_parts_of_another_model_is_refused():
    """Sequence parallelism splits the tokens on the ViT's embed and head, which a Parts does not
    name: a Contract with Parts of its own is refused under it, rather than trained wrongly."""
    contract = hybrid_parallel.Contract(parts=CAUSAL_LM_PARTS, activation_shape=(16, 32))
    with pytest.raises(ValueError, match="sequence parallelism splits the tokens"):
        hybrid_parallel.check_contract(contract, sequence_parallel=True)
    hybrid_parallel.check_contract(contract, sequence_parallel=False)
    without_shape = hybrid_parallel.Contract(parts=CAUSAL_LM_PARTS)
    with pytest.raises(ValueError, match="names its activation_shape"):
        hybrid_parallel.check_contract(without_shape, sequence_parallel=False)
