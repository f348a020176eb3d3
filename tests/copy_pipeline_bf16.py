"""Copy cases for pipeline.py and pipeline_schedules.py on the second model converted to bf16
(.to(torch.bfloat16)), so that bf16 activations and gradients cross the stage boundary, against one
process training the same bf16 model. Not among copy_cases.py's default modules: the test that
reads them launches them itself (tests/test_copy.py::test_pipeline_bf16_equals_one_process_bf16),
so that receive buffers of the wrong dtype, which end a stage with an error, fail that test and
not the fixture every copy test shares."""

import torch
from causal_lm import ACCUMULATE, CausalLM, reference, task
from copy_pipeline import run_pipeline


def cases(batches, rank, world, folder):
    """pipeline-bf16-sgd (1F1B) and pipeline_schedules-zb-h1-bf16-sgd, with their reference,
    reference-bf16-model-sgd.pt, as copy_pipeline.cases yields its cases."""
    _, test_tokens = task()
    reference_loss = None
    if rank == 0:
        bf16_model = CausalLM().to(torch.bfloat16)
        state, results = reference("sgd", batches, test_tokens, bf16_model)
        torch.save(state, folder / "reference-bf16-model-sgd.pt")
        reference_loss = results["eval_loss"]
    stage, state, proof = run_pipeline("sgd", batches, ACCUMULATE, dtype=torch.bfloat16)
    proof["reference_eval_loss"] = reference_loss
    yield "pipeline-bf16-sgd", "bf16-model-sgd", stage, state, proof
    stage, state, proof = run_pipeline("sgd", batches, ACCUMULATE, "zb-h1", dtype=torch.bfloat16)
    proof["reference_eval_loss"] = reference_loss
    yield "pipeline_schedules-zb-h1-bf16-sgd", "bf16-model-sgd", stage, state, proof
