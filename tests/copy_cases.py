"""The copy cases: each technique section, imported from its script and nothing else, trains the
second model (tests/causal_lm.py) in ONE torchrun launch, one case after another in the same
process group, so that tests/test_copy.py pays once for starting the interpreters and torch.

    torchrun --standalone --nproc_per_node=2 tests/copy_cases.py DIR

Every case trains STEPS steps of ACCUMULATE backward passes each (gradient accumulation), rank r
on its slice of every micro-batch, with SGD (one group) or AdamW (two groups: weight decay on the
matrices only). Rank 0 first trains the one-process references on the same batches, then writes
DIR/<case>.pt (the case's full state_dict), DIR/reference-<optim>.pt and DIR/results.json.
"""

import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the scripts

from causal_lm import CausalLM, bigram_batches, lm_loss, weight_decay_groups  # noqa: E402

import ddp  # noqa: E402
import zero  # noqa: E402
import zero_offload  # noqa: E402

STEPS = 4
ACCUMULATE = 2  # backward passes per optimizer step
MICRO_BATCH = 8  # sequences per backward pass, over all ranks
WEIGHT_DECAY = 0.1
CASES = [
    (technique, stage, optim)
    for technique, stage in (("ddp", 0), ("zero", 1), ("zero", 2), ("zero", 3))
    for optim in ("sgd", "adamw")
]
# zero_offload.py steps one parameter group: SGD, the reference's one group
CASES += [("zero_offload-cpu", 2, "sgd"), ("zero_offload-disk", 3, "sgd")]


def case_name(technique, stage, optim):
    return f"{technique}{stage or ''}-{optim}"


def make_optimizer(param_groups, optim):
    """SGD with momentum over one group, or AdamW over the two weight-decay groups."""
    if optim == "sgd":
        return torch.optim.SGD(param_groups, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(param_groups, lr=1e-2)


def train(model, optimizer, batches, rank, world):
    """Each step: ACCUMULATE backward passes, each on this rank's slice of a micro-batch, the loss
    divided by ACCUMULATE so that the step sees the mean gradient of the step's sequences."""
    losses = []
    for step_batch in batches:
        for micro_batch in step_batch.chunk(ACCUMULATE):
            tokens = micro_batch.chunk(world)[rank]
            loss = lm_loss(model(tokens), tokens) / ACCUMULATE
            loss.backward()
            losses.append(loss.item() * ACCUMULATE)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


@torch.no_grad()
def evaluation_loss(model, tokens):
    """A forward without autograd (stage 3 gathers and frees the units without a backward)."""
    return lm_loss(model(tokens), tokens).item()


def reference(optim, batches, test_tokens):
    """One process, the whole of every micro-batch."""
    model = CausalLM()
    groups = weight_decay_groups(model, WEIGHT_DECAY) if optim == "adamw" else model.parameters()
    optimizer = make_optimizer(groups, optim)
    losses = train(model, optimizer, batches, rank=0, world=1)
    state = model.state_dict()
    return state, dict(losses=losses, eval_loss=evaluation_loss(model, test_tokens))


def run_ddp(optim, batches, rank, world):
    model = ddp.parallelize(CausalLM(), torch.device("cpu"))
    groups = weight_decay_groups(model.module, WEIGHT_DECAY) if optim == "adamw" else None
    optimizer = make_optimizer(groups or model.parameters(), optim)
    train(model, optimizer, batches, rank, world)
    tied = model.module.head.lm_head.weight is model.module.embed.wte.weight
    return model, ddp.full_state_dict(model), tied


def run_zero(stage, optim, batches, rank, world):
    model = CausalLM()
    groups = weight_decay_groups(model, WEIGHT_DECAY) if optim == "adamw" else None
    model = zero.parallelize(model, torch.device("cpu"), stage, groups)
    optimizer = make_optimizer(model.zero.param_groups, optim)
    zero.hook_optimizer(model, optimizer)
    train(model, optimizer, batches, rank, world)
    tied = model.head.lm_head.weight is model.embed.wte.weight
    return model, zero.full_state_dict(model), tied


def run_zero_offload(offload, stage, optim, batches, rank, world, directory):
    model = zero_offload.parallelize(CausalLM(), torch.device("cpu"), stage, offload, directory)
    optimizer = make_optimizer(model.parameters(), optim)
    zero_offload.hook_optimizer(model, optimizer)
    train(model, optimizer, batches, rank, world)
    tied = model.head.lm_head.weight is model.embed.wte.weight
    return model, zero_offload.full_state_dict(model), tied


def main():
    folder = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = dist.get_world_size()
    *batches, held_out = bigram_batches(STEPS + 1, ACCUMULATE * MICRO_BATCH)
    test_tokens = held_out[:MICRO_BATCH]  # sequences of the same table that no step trains on
    results = {}
    if rank == 0:
        for optim in ("sgd", "adamw"):
            state, results[f"reference-{optim}"] = reference(optim, batches, test_tokens)
            torch.save(state, folder / f"reference-{optim}.pt")
    for technique, stage, optim in CASES:
        if technique == "ddp":
            model, state, tied = run_ddp(optim, batches, rank, world)
        elif technique == "zero":
            model, state, tied = run_zero(stage, optim, batches, rank, world)
        else:
            offload = technique.split("-")[1]
            directory = folder / f"{technique}-files"  # --offload disk's unit files
            directory.mkdir(exist_ok=True)
            model, state, tied = run_zero_offload(
                offload, stage, optim, batches, rank, world, directory
            )
        eval_loss = evaluation_loss(model, test_tokens)
        if rank == 0:
            name = case_name(technique, stage, optim)
            torch.save(state, folder / f"{name}.pt")
            results[name] = dict(tied=tied, eval_loss=eval_loss)
        # free the case's model (DDP's reducer) now, while every rank is here, not at exit: as
        # ddp.py does, so that no teardown waits on a Gloo thread still finishing its work
        del model
        gc.collect()
        dist.barrier()
    if rank == 0:
        with open(folder / "results.json", "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
