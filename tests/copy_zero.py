"""Copy cases for ddp.py, zero.py (stages 1-3) and zero_offload.py (to CPU, to disk): each rank
trains on its slice of every micro-batch, as data parallelism does. Run by tests/copy_cases.py."""

import nanogpt_model
import torch
from causal_lm import OPTIMS, CausalLM, make_optimizer, param_groups, train

import ddp
import zero
import zero_offload

CPU = torch.device("cpu")


def run_ddp(optim, batches, rank, world):
    model = ddp.parallelize(CausalLM(), CPU)
    optimizer = make_optimizer(param_groups(model.module, optim), optim)
    train(model, optimizer, batches, rank, world)
    tied = model.module.head.lm_head.weight is model.module.embed.wte.weight
    return model, ddp.full_state_dict(model), dict(tied=tied)


def run_zero(stage, optim, batches, rank, world):
    model = CausalLM()
    model = zero.parallelize(model, CPU, stage, param_groups(model, optim))
    optimizer = make_optimizer(model.zero.param_groups, optim)
    zero.hook_optimizer(model, optimizer)
    train(model, optimizer, batches, rank, world)
    tied = model.head.lm_head.weight is model.embed.wte.weight
    return model, zero.full_state_dict(model), dict(tied=tied)


def run_zero_offload(offload, stage, optim, batches, rank, world, folder):
    """zero_offload.py steps each group's pieces of the master (CPU, or the unit files on disk)
    with the group's hyperparameters: AdamW's two weight-decay groups."""
    directory = folder / f"zero_offload-{offload}-{optim}-files"  # --offload disk's unit files
    directory.mkdir(exist_ok=True)
    model = CausalLM()
    groups = param_groups(model, optim)
    model = zero_offload.parallelize(model, CPU, stage, groups, offload, directory)
    optimizer = make_optimizer(model.zero.param_groups, optim)
    zero_offload.hook_optimizer(model, optimizer)
    train(model, optimizer, batches, rank, world)
    tied = model.head.lm_head.weight is model.embed.wte.weight
    return model, zero_offload.full_state_dict(model), dict(tied=tied)


def cases(batches, rank, world, folder):
    """Yield (case name, its reference: the one-process run it must equal, "sgd" or "adamw",
    the trained model, its full state_dict, a dict of what else the case shows), one case at a
    time."""
    for optim in OPTIMS:
        yield f"ddp-{optim}", optim, *run_ddp(optim, batches, rank, world)
    for stage in (1, 2, 3):
        for optim in OPTIMS:
            yield f"zero{stage}-{optim}", optim, *run_zero(stage, optim, batches, rank, world)
    for offload, stage in (("cpu", 2), ("disk", 3)):
        for optim in OPTIMS:
            name = f"zero_offload-{offload}{stage}-{optim}"
            case = run_zero_offload(offload, stage, optim, batches, rank, world, folder)
            yield name, optim, *case


# The model as nanoGPT has it (tests/nanogpt_model.py), trained by its own recipe: (x, y) batches,
# its configure_optimizers, gradient accumulation, clipping before every step.

NANOGPT_CASES = ["ddp-sgd", "ddp-adamw"]


def run_nanogpt_ddp(optim, rank, world):
    """DDP takes nanoGPT as it is: the optimizer over the plain model's parameters (nanoGPT calls
    configure_optimizers on the unwrapped model), torch's own clip_grad_norm_, since every rank
    holds every whole gradient after backward."""
    model = ddp.parallelize(nanogpt_model.model(), CPU)
    raw_model = model.module
    optimizer = nanogpt_model.make_optimizer(raw_model, optim)
    losses, norms = nanogpt_model.train(model, optimizer, nanogpt_model.batches(), rank, world)
    tied = raw_model.lm_head.weight is raw_model.transformer.wte.weight
    return raw_model, ddp.full_state_dict(model), dict(tied=tied, losses=losses, norms=norms)


def nanogpt_cases(rank, world, folder):
    """As `cases`, on nanoGPT's model: (case, its reference, model, full state_dict, proof)."""
    for optim in OPTIMS:
        yield f"ddp-{optim}", optim, *run_nanogpt_ddp(optim, rank, world)
