"""Copy a technique into a project: each technique section, imported from its script and nothing
from common/, trains a second model, a small GPT-2-like causal LM with tied embeddings
(tests/causal_lm.py), at W=2 with gradient accumulation (two backward passes a step), SGD and
AdamW with two parameter groups, and ends with the parameters of one process training the same
model on the same batches, its tie intact. One launch runs every case
(tests/copy_cases.py); each test reads its case's result.
"""

import json
import math

import pytest
import torch
from causal_lm import ACCUMULATE, STEPS, CausalLM, param_groups

from helpers import fork_launch

# round-off, as the ViT tests allow it (AdamW turns it into steps on ~0 gradients)
TOL = {"sgd": 1e-6, "adamw": 5e-5}
OPTIMS = ["sgd", "adamw"]


# The case module (tests/copy_<name>.py) each test reads, by the test's name.
MODULE_OF_TEST = {
    "test_ddp_": "zero",
    "test_zero_": "zero",
    "test_fsdp_": "fsdp",
    "test_amp_": "amp",
    "test_tensor_parallel_": "tensor_parallel",
    "test_context_parallel_": "context_parallel",
    "test_expert_parallel_": "expert_parallel",
    "test_pipeline_": "pipeline",
}


def needed(request):
    """The case modules this session's selected tests read: all of them in a whole run, one when
    a single test is asked for (as tests/test_mutants.py does), so that it launches only that.
    None (the references alone): copy_cases.py runs every module."""
    modules = []
    for item in request.session.items:
        if item.module is not request.module:
            continue
        for prefix, module in MODULE_OF_TEST.items():
            if item.name.startswith(prefix) and module not in modules:
                modules.append(module)
    return modules


@pytest.fixture(scope="module")
def copies(request, tmp_path_factory):
    """The selected cases in one launch: (the folder of saved state_dicts, the results by case)."""
    folder = tmp_path_factory.mktemp("copy")
    run = fork_launch("tests/copy_cases.py", 2, folder, *needed(request), timeout=300)
    assert run.returncode == 0, run.output
    with open(folder / "results.json") as f:
        return folder, json.load(f)


def max_parameter_diff(folder, case, reference_name):
    state = torch.load(folder / f"{case}.pt", weights_only=True)
    reference = torch.load(folder / f"reference-{reference_name}.pt", weights_only=True)
    assert state.keys() == reference.keys()
    return max((state[key] - reference[key]).abs().max().item() for key in reference)


def assert_same_as_one_process(copies, case):
    """Against its reference: "sgd" or "adamw" (the plain CausalLM), or the case module's own
    ("moe-sgd": its model, its optimizer last), whose eval loss the case's results carry."""
    folder, results = copies
    reference_name = results[case]["reference"]
    optim = reference_name.split("-")[-1]
    diff = max_parameter_diff(folder, case, reference_name)
    assert diff < TOL[optim], f"{case}: max |Δparameter| {diff:.2e} against one process"
    assert results[case]["tied"], "lm_head.weight is no longer wte.weight in the trained model"
    state = torch.load(folder / f"{case}.pt", weights_only=True)
    assert torch.equal(state["embed.wte.weight"], state["head.lm_head.weight"]), "tie broken"
    reference_loss = results[case].get("reference_eval_loss")
    if reference_loss is None:
        reference_loss = results[f"reference-{reference_name}"]["eval_loss"]
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


@pytest.mark.parametrize(
    "offload, stage, optim",
    [(offload, stage, optim) for offload, stage in (("cpu", 2), ("disk", 3)) for optim in OPTIMS],
)
def test_zero_offload_equals_one_process(copies, offload, stage, optim):
    """zero_offload.py's engine, shared with zero.py, with the optimizer on CPU or on disk: the
    tie, the gradient of both backward passes of a step added up where the shard lives, and
    AdamW's two weight-decay groups, each stepped with its own hyperparameters."""
    assert_same_as_one_process(copies, f"zero_offload-{offload}{stage}-{optim}")


@pytest.mark.parametrize("case", ["pipeline-sgd", "pipeline-adamw", "pipeline-calls-sgd"])
def test_pipeline_equals_one_process(copies, case):
    """pipeline.py's 1F1B, two stages: the step's two micro-batches are its accumulation (`calls`:
    two train_steps of one micro-batch before the step), the loss a parameter (next-token), the
    last stage's copy of the tied wte.weight summed with the first stage's gradient after each
    step's backward, so that both copies take the tied weight's steps ("tied": the copies equal).
    The split ran: one block a stage, the embedding (wpe) on stage 0 only, a tied copy on each."""
    _, results = copies
    assert_same_as_one_process(copies, case)
    assert results[case]["blocks"] == [1, 1]
    assert results[case]["wpe"] == [True, False]
    assert results[case]["copies"] == [1, 1]


@pytest.mark.parametrize(
    "case, blocks",
    [("pipeline_schedules-zb-h1-adamw", [1, 1]), ("pipeline_schedules-interleaved-sgd", [2, 2])],
)
def test_pipeline_schedules_equals_one_process(copies, case, blocks):
    """pipeline_schedules.py's zero-bubble (zb-h1: B and W apart) and interleaved schedules (two
    chunks a stage, so 4 blocks against a reference of 4 blocks), with pipeline.py's loss_fn,
    activation_shape and tied copies, summed after the step's last backward (zb-h1: its last W)."""
    _, results = copies
    assert_same_as_one_process(copies, case)
    assert results[case]["blocks"] == blocks
    assert results[case]["wpe"] == [True, False]
    assert results[case]["copies"] == [1, 1]


@pytest.fixture(scope="module")
def bf16_pipeline_folder(tmp_path_factory):
    """A folder for the bf16 pipeline cases' launch, which the first of their tests makes."""
    return tmp_path_factory.mktemp("copy_bf16")


@pytest.mark.parametrize("case", ["pipeline-bf16-sgd", "pipeline_schedules-zb-h1-bf16-sgd"])
def test_pipeline_bf16_equals_one_process_bf16(bf16_pipeline_folder, case):
    """pipeline.py's 1F1B and pipeline_schedules.py's zb-h1 on the CausalLM converted to bf16
    (.to(torch.bfloat16)): the receive buffers take the boundary's dtype (activation_dtype, the
    parameters' by default), so stage 1 receives bf16 activations and stage 0 bf16 gradients, and
    the parameters are those of one process training the bf16 model, to bf16's round-off: the
    tied weight's two gradient parts are added in another order, and sums in another order round
    otherwise, so an element may end a bf16 step or two apart (seen: one step at 0.125-0.25 alone,
    one at 1-2 in the whole suite). With fp32 buffers, as before, Gloo took the half-size bf16
    message into the fp32 buffer without a word and stage 1's LayerNorm refused the fp32 input."""
    # The launch is the test's own (copy_pipeline_bf16.py), not the shared fixture's: a stage that
    # dies of a wrong dtype must fail this test.
    folder = bf16_pipeline_folder
    if not (folder / "results.json").exists():
        run = fork_launch("tests/copy_cases.py", 2, folder, "pipeline_bf16", timeout=300)
        assert run.returncode == 0, run.output
    with open(folder / "results.json") as f:
        results = json.load(f)
    assert results[case]["received"] == [[], ["torch.bfloat16"]]
    state = torch.load(folder / f"{case}.pt", weights_only=True)
    # its own reference: copy_amp's reference-bf16-sgd is an fp32 model under bf16 autocast
    reference = torch.load(folder / "reference-bf16-model-sgd.pt", weights_only=True)
    assert all(tensor.dtype == torch.bfloat16 for tensor in state.values())
    for key in state:
        # two bf16 steps (2 * 2^-7 relative) around each element, with a floor near zero
        torch.testing.assert_close(state[key], reference[key], rtol=2 * 2**-7, atol=1e-3)
    assert results[case]["tied"]
    assert results[case]["eval_loss"] == pytest.approx(
        results[case]["reference_eval_loss"], abs=2e-2
    )


def expected_groups(optim):
    """The names in each parameter group of the plain model, as param_groups builds them."""
    model = CausalLM()
    name_of = {param: name for name, param in model.named_parameters()}
    return [
        sorted(name_of[param] for param in group["params"]) for group in param_groups(model, optim)
    ]


@pytest.mark.parametrize("optim", OPTIMS)
def test_fsdp_equals_one_process(copies, optim):
    """fsdp.py's fully_shard, each block a unit and the root (embed and head) another: the tied
    wte / lm_head lives in the root unit and stays one Parameter, in the trained model and in the
    state_dict; each backward pass reduce-scatters, and the shards add both passes of a step up."""
    assert_same_as_one_process(copies, f"fsdp-{optim}")


@pytest.mark.parametrize("optim", OPTIMS)
def test_fsdp_shards_the_blocks_and_groups_the_shards(copies, optim):
    """FSDP ran, not one process's training on each rank: each rank holds half of every block's
    parameters (every block parameter's dim 0 is even: no padding). The groups, built after
    parallelize, hold the DTensor shards, split as the plain model's parameters are."""
    _, results = copies
    proof = results[f"fsdp-{optim}"]
    assert proof["shard_numels"] == [proof["block_numel"] // 2] * 2
    assert proof["groups_hold_shards"]
    assert proof["groups"] == expected_groups(optim)


@pytest.mark.parametrize("optim", OPTIMS)
def test_amp_checkpoint_equals_one_process(copies, optim):
    """amp_checkpoint.py's section in fp32, checkpointing on: forward_backward with the language
    model's next-token loss as loss_fn and both micro-batches of a step in one call (no_sync on
    the first, DDP's all-reduce on the second's backward), then optimizer_step."""
    assert_same_as_one_process(copies, f"amp_checkpoint-{optim}")


@pytest.mark.parametrize(
    "case", ["amp_checkpoint-sgd", "amp_checkpoint-adamw", "amp_checkpoint-bf16-sgd"]
)
def test_amp_checkpointed_blocks_run_forward_twice(copies, case):
    """In every step each checkpointed block runs forward twice per micro-batch: once in forward,
    once more in backward to get back what it did not keep (a plain block: once)."""
    _, results = copies
    blocks = len(CausalLM().blocks)
    assert results[case]["attention_forwards"] == [2 * blocks * ACCUMULATE] * STEPS


def test_amp_bf16_equals_one_process_bf16(copies):
    """--amp bf16 on CPU: the Linear layers compute in bf16, and the parameters are those of one
    process under the same autocast, to bf16's round-off: each rank's weight gradients, rounded to
    bf16 over half the batch, are not those rounded over the whole (~3e-4 apart after 4 steps,
    about as far as bf16 is from fp32 here; training on one rank's half alone is farther)."""
    folder, results = copies
    case = "amp_checkpoint-bf16-sgd"
    assert results[case]["linear_dtypes"] == ["torch.bfloat16"]
    state = torch.load(folder / f"{case}.pt", weights_only=True)
    reference = torch.load(folder / "reference-bf16-sgd.pt", weights_only=True)
    assert state.keys() == reference.keys()
    diff = max((state[key] - reference[key]).abs().max().item() for key in reference)
    assert diff < 1e-3, f"{case}: max |Δparameter| {diff:.2e} against one process in bf16"
    assert results[case]["tied"]


@pytest.mark.parametrize("optim", OPTIMS)
def test_expert_parallel_equals_one_process(copies, optim):
    """common/moe.py's MoE layer (E=4 of CausalLM's MLP, top-2, its balance loss) in place of
    every block's MLP, the experts split over the two ranks, each rank on its slice of every
    micro-batch: the parameters of one process holding every expert; each rank held 2 of the 4
    experts of every block (the split, which one process training alone would not show)."""
    case = f"expert_parallel-{optim}"
    assert_same_as_one_process(copies, case)
    _, results = copies
    assert results[case]["experts_held"] == [[[0, 1], [0, 1]], [[2, 3], [2, 3]]]  # [rank][block]


def test_expert_parallel_accumulation_equals_one_whole_batch(copies):
    """Two backward passes a step, the balance loss divided by the MoE's forwards_per_step as the
    loop divides its loss: the step of one process on each step's whole batch at once (SGD)."""
    folder, _ = copies
    diff = max_parameter_diff(folder, "expert_parallel-sgd", "moe-whole-sgd")
    assert diff < TOL["sgd"], f"max |Δparameter| {diff:.2e} against one whole-batch step"


@pytest.mark.parametrize("sp", ["tp", "sp"])
@pytest.mark.parametrize("optim", OPTIMS)
def test_tensor_parallel_equals_one_process(copies, sp, optim):
    """tensor_parallel.py's section with the model contract's GPT-2 plan (q, k, v fused in c_attn,
    causal attention), with and without sequence parallelism: every rank feeds the whole batch,
    so equal parameters alone would not show a split. Each rank's c_attn holds 3D/W rows, its own
    whole heads in q, in k and in v (rank 1: heads 2 and 3 of each, not rows 48-95 of the fused
    3D), and under sequence parallelism the norms run on T/W tokens."""
    case = f"tensor_parallel-{sp}-{optim}"
    assert_same_as_one_process(copies, case)
    _, results = copies
    proof = results[case]
    assert proof["c_attn_rows"] == [48, 48], proof  # 3D/W of CausalLM's 3D = 96 on each rank
    assert proof["heads"] == [[[0, 1]] * 3, [[2, 3]] * 3], proof  # [rank][q, k, v]: whole heads
    assert proof["ln_1_tokens"] == ([8, 8] if sp == "sp" else [16, 16]), proof  # T/W: SP


CP_CASES = [
    ("ring", "contiguous", "sgd"),
    ("ring", "zigzag", "sgd"),
    ("ring", "zigzag", "adamw"),
    ("ulysses", "contiguous", "sgd"),
    ("ulysses", "zigzag", "adamw"),
]


@pytest.mark.parametrize("method, split, optim", CP_CASES)
def test_context_parallel_equals_one_process(copies, method, split, optim):
    """context_parallel.py's section, causal, on the LM: each rank attends with its 8 of the 16
    tokens (rank 0 holds positions 0-7, or with the zig-zag split chunks 0 and 3 of 4: 0-3 and
    12-15), through the model's own attention (its SDPA call swapped), and the loss each rank
    logs is one process's loss over the whole sequence."""
    case = f"context_parallel-{method}-{split}-{optim}"
    assert_same_as_one_process(copies, case)
    _, results = copies
    result = results[case]
    assert result["attention"] == "CausalSelfAttention"
    assert result["attention_tokens"] == 16 // 2
    zigzag = [*range(0, 4), *range(12, 16)]
    assert result["positions"] == (zigzag if split == "zigzag" else list(range(8)))
    reference_losses = results[f"reference-{optim}"]["losses"]
    assert result["losses"] == pytest.approx(reference_losses, abs=1e-5)
