"""Copy cases for deepspeed_zero.py: its section (`ds_config`, `parallelize`, `full_state_dict`)
wraps Llama 3 as torchtitan has it and HF's GPT2LMHeadModel, with their own optimizers, into
DeepSpeed's engine at ZeRO stages 1-3, and each rank trains on its slice of every micro-batch by
the recipe's loop written for the engine, as DeepSpeed's users write it: engine(inputs),
engine.backward(loss), engine.step() after every micro-batch (the engine counts them, and after
the step's last it clips to the recipe's max_norm, steps the optimizer and zeroes the gradients).
Run by tests/copy_cases.py --llama.

Two things differ from the recipe's own loop. The engine averages the gradients over the ranks,
so the loss is the recipe's times W, as for DDP. And engine.backward divides every loss by
gradient_accumulation_steps unless told not to: right for a loss that is its micro-batch's mean
(deepspeed_zero.py's ViT), but these recipes' loss is already over the step's GLOBAL count of
targets (torchtitan's, HF's num_items_in_batch), so divided again the gradients are 1/ACCUMULATE
of one process's (half of them here). The clip, which every step hits, hides that from the
parameters (SGD's within 2.4e-7 of one process), not from the norm, half of one process's: the
mutant deepspeed-loss-divided-twice. The loop passes scale_wrt_gas=False, as HF's Trainer does
under DeepSpeed. Each step's norm is the engine's get_global_grad_norm(), the norm before its
clip. The optimizers are torch's, stepped by DeepSpeed's ZeRO optimizer on each rank's partition:
AdamW ends within 1.4e-6 of one process (stage 3, Llama), inside the copy tests' 5e-5.
"""

from types import SimpleNamespace

import hf_gpt2_model
import llama_model
from causal_lm import OPTIMS

import deepspeed_zero

FAMILIES = {"llama": llama_model, "gpt2": hf_gpt2_model}
STAGES = (1, 2, 3)
LLAMA_CASES = [
    f"{family}-deepspeed{stage}-{optim}"
    for family in FAMILIES
    for stage in STAGES
    for optim in OPTIMS
]


def config(recipe, stage, world):
    """deepspeed_zero.py's ds_config for the recipe: its global batch of MICRO_BATCH sequences
    times ACCUMULATE micro-batches, its clip, no offload."""
    flags = SimpleNamespace(
        stage=stage,
        offload="none",
        offload_dir=None,
        batch_size=recipe.MICRO_BATCH * recipe.ACCUMULATE,
        grad_accum=recipe.ACCUMULATE,
        clip=recipe.CLIP,
        mixed_precision=False,  # fp32: the tolerance is one process's round-off
    )
    return deepspeed_zero.ds_config(flags, world)


def micro_loss(family, engine, inputs, labels, num_items):
    """The recipe's loss of one micro-batch (this rank's slice) over the step's global count of
    targets: torchtitan's loss on the logits, or the loss HF's model returns."""
    if family == "llama":
        return llama_model.loss(engine(inputs), labels, num_items)
    loss, _ = engine(inputs, labels=labels, num_items_in_batch=num_items)
    return loss


def train(family, engine, rank, world):
    """The recipe's steps through the engine. Returns (each step's loss: this rank's share of the
    global mean, each step's gradient norm before the clip), as the recipe's train does."""
    recipe = FAMILIES[family]
    count_targets = {"llama": llama_model.global_targets, "gpt2": hf_gpt2_model.num_items_in_batch}
    losses = []
    norms = []
    for micro_batches in recipe.batches():
        num_items = count_targets[family](micro_batches)
        step_loss = 0.0
        for inputs, labels in micro_batches:
            loss = micro_loss(
                family, engine, inputs.chunk(world)[rank], labels.chunk(world)[rank], num_items
            )
            # times W: the engine averages over the ranks; not divided by ACCUMULATE: the loss is
            # already over the step's global count of targets
            engine.backward(loss * world, scale_wrt_gas=False)
            engine.step()  # at the step's last micro-batch: clip, step, zero the gradients
            step_loss += loss.item()
        losses.append(step_loss)
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms


def run_family_deepspeed(family, stage, optim, rank, world):
    """DeepSpeed takes either model as it is, with the recipe's own optimizer (SGD, AdamW and its
    weight-decay groups): deepspeed_zero.py's ds_config allows a torch optimizer, which the ZeRO
    optimizer steps on this rank's partition of the fp32 parameters."""
    recipe = FAMILIES[family]
    model = recipe.model()
    optimizer = recipe.make_optimizer(model, optim)
    engine, _, _ = deepspeed_zero.parallelize(model, optimizer, None, config(recipe, stage, world))
    losses, norms = train(family, engine, rank, world)
    state = deepspeed_zero.full_state_dict(engine)
    # the elements this rank's parameters hold between steps, and the model's (stage 3 keeps each
    # parameter's in ds_numel, its data empty and its partition in ds_tensor)
    params = list(engine.module.parameters())
    held = sum(param.numel() for param in params)
    numel = sum(getattr(param, "ds_numel", param.numel()) for param in params)
    proof = dict(losses=losses, norms=norms, held=held, numel=numel)
    return engine, state, proof


def llama_cases(rank, world, folder):
    """<family>-deepspeed<stage>-<optim>: (case, its reference, the engine, the model's
    state_dict, proof), each case an engine of its own on the world's process group."""
    deepspeed_zero.import_deepspeed("cpu")
    assert deepspeed_zero.deepspeed is not None, "DeepSpeed is not installed (REQUIRE_DEEPSPEED)"
    for family in FAMILIES:
        for stage in STAGES:
            for optim in OPTIMS:
                case = run_family_deepspeed(family, stage, optim, rank, world)
                yield f"{family}-deepspeed{stage}-{optim}", f"{family}-{optim}", *case
