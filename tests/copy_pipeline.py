"""Copy cases for pipeline.py's 1F1B, and pipeline_schedules.py's zb-h1 and interleaved
schedules: two stages, the embedding on rank 0 and the head on rank 1, which holds its own copy of
the tied wte.weight (1f1b, zb-h1: one block a stage; interleaved: two chunks of one block a stage,
so a CausalLM of 4 blocks, against a one-process reference of its own). Every rank feeds the same
batch (the tokens are the first stage's inputs and the last stage's targets). causal_lm.train's
ACCUMULATE backward passes a step, each on a micro-batch of MICRO_BATCH sequences with its loss
/ ACCUMULATE, are the schedule's m = ACCUMULATE micro-batches, each one's loss / m; or, in the
`calls` case, ACCUMULATE train_steps of one micro-batch before the optimizer's step. Run by
tests/copy_cases.py."""

import torch
import torch.distributed as dist
from causal_lm import (
    ACCUMULATE,
    CONTEXT,
    OPTIMS,
    CausalLM,
    lm_loss,
    make_optimizer,
    param_groups,
    reference,
    task,
)

import pipeline
import pipeline_schedules

CPU = torch.device("cpu")


def stage_param_groups(stage, optim):
    """causal_lm's groups over the stage's parameters. The last stage's copy of wte.weight sits in
    lm_head, a Linear, which the weight-decay split decays: it goes where wte.weight is, no decay
    (the Model contract's change for a weight-decay split)."""
    groups = param_groups(stage, optim)
    if optim == "sgd" or not stage.is_last:
        return groups
    decay, no_decay = groups
    copies = set(stage.tied)
    decay["params"] = [param for param in decay["params"] if param not in copies]
    no_decay["params"] = no_decay["params"] + stage.tied
    return groups


def train(technique, schedule, stage, optimizer, batches, micro_batches):
    """Each step's ACCUMULATE micro-batches through the pipeline: `micro_batches` of them a
    train_step, in ACCUMULATE / micro_batches train_steps, each loss divided by their count too, so
    that the step sees the mean gradient of the step's sequences."""
    calls = ACCUMULATE // micro_batches

    def loss_fn(logits, tokens):
        return lm_loss(logits, tokens) / calls

    for step_batch in batches:
        for tokens in step_batch.chunk(calls):
            technique.train_step(stage, tokens, tokens, schedule, micro_batches, loss_fn=loss_fn)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def eval_loss(technique, stage, tokens):
    """The held-out loss, on every rank: infer's logits are on the last stage, the others add 0."""
    loss = torch.zeros(())
    logits = technique.infer(stage, tokens)
    if logits is not None:
        loss += lm_loss(logits, tokens)
    dist.all_reduce(loss)
    return loss.item()


def run_pipeline(optim, batches, micro_batches, schedule="1f1b", depth=2):
    model = CausalLM(depth=depth)
    shape = (CONTEXT, model.embed.wte.embedding_dim)
    if schedule == "1f1b":
        technique = pipeline
        stage = pipeline.parallelize(model, CPU, activation_shape=shape)
    else:
        technique = pipeline_schedules
        chunks = 2 if schedule == "interleaved" else 1
        stage = pipeline_schedules.parallelize(model, CPU, chunks, activation_shape=shape)
    optimizer = make_optimizer(stage_param_groups(stage, optim), optim)
    train(technique, schedule, stage, optimizer, batches, micro_batches)
    state = technique.full_state_dict(stage)
    # the technique ran: what each rank's stage holds
    held = dict(blocks=len(stage.blocks), wpe=stage.embed is not None, copies=len(stage.tied))
    held_by_rank = [None] * dist.get_world_size()
    dist.all_gather_object(held_by_rank, held)
    proof = {key: [rank_held[key] for rank_held in held_by_rank] for key in held}
    # copy_cases evaluates with model(tokens), which a stage cannot run: the case brings its own,
    # on the held-out sequences copy_cases uses
    _, test_tokens = task()
    proof["eval_loss"] = eval_loss(technique, stage, test_tokens)
    if state is not None:  # rank 0, which writes the results
        # the tie, as a pipeline keeps it: the last stage's copy equal to the first stage's weight
        proof["tied"] = torch.equal(state["embed.wte.weight"], state["head.lm_head.weight"])
    return stage, state, proof


def cases(batches, rank, world, folder):
    """Yield (case name, its reference, the stage, the full state_dict, the proof), as
    copy_zero.cases does."""
    for optim in OPTIMS:
        yield f"pipeline-{optim}", optim, *run_pipeline(optim, batches, ACCUMULATE)
    yield "pipeline-calls-sgd", "sgd", *run_pipeline("sgd", batches, 1)
    yield (
        "pipeline_schedules-zb-h1-adamw",
        "adamw",
        *run_pipeline("adamw", batches, ACCUMULATE, "zb-h1"),
    )
    # interleaved: 2 chunks a stage, a block each, so 4 blocks, and a reference of 4 blocks
    _, test_tokens = task()
    reference_loss = None
    if rank == 0:
        state, results = reference("sgd", batches, test_tokens, CausalLM(depth=4))
        torch.save(state, folder / "reference-depth4-sgd.pt")
        reference_loss = results["eval_loss"]
    stage, state, proof = run_pipeline("sgd", batches, ACCUMULATE, "interleaved", depth=4)
    proof["reference_eval_loss"] = reference_loss
    yield "pipeline_schedules-interleaved-sgd", "depth4-sgd", stage, state, proof
