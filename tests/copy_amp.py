"""Copy cases for amp_checkpoint.py: its section (`parallelize` with checkpointing on,
`forward_backward`, `optimizer_step`, `full_state_dict`) trains the second model, each rank on its
slice of every micro-batch, both micro-batches of a step through one forward_backward with the
language model's next-token loss as loss_fn. Run by tests/copy_cases.py."""

import hf_gpt2_model
import llama_model
import nanogpt_model
import torch
import torch.nn as nn
from causal_lm import (
    ACCUMULATE,
    OPTIMS,
    CausalLM,
    lm_loss,
    make_optimizer,
    param_groups,
)

import amp_checkpoint

CPU = torch.device("cpu")


class EveryStep:
    """What each optimizer step computed, seen through hooks: how often the blocks' attention ran
    forward (a checkpointed block runs its forward again in backward), and the dtypes the Linear
    layers computed in."""

    def __init__(self, model, optimizer):
        self.attention_forwards = []  # one entry per optimizer step
        self.linear_dtypes = set()
        self.forwards = 0
        for block in model.blocks:
            block.attn.register_forward_hook(self.attention_ran)
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(self.linear_ran)
        optimizer.register_step_post_hook(self.stepped)

    def attention_ran(self, module, inputs, output):
        if torch.is_grad_enabled():  # not the evaluation's forward: nothing to recompute there
            self.forwards += 1

    def linear_ran(self, module, inputs, output):
        if torch.is_grad_enabled():
            self.linear_dtypes.add(str(output.dtype))

    def stepped(self, optimizer, args, kwargs):
        self.attention_forwards.append(self.forwards)
        self.forwards = 0


def next_token_loss(model, tokens, targets):
    return lm_loss(model(tokens), targets)


def train(model, optimizer, batches, rank, world, amp):
    """causal_lm.train's steps through the section: this rank's slice of each of the step's
    ACCUMULATE micro-batches, one after the other, which forward_backward cuts apart again."""
    scaler = torch.amp.GradScaler(CPU.type, enabled=amp == "fp16")  # a no-op unless fp16
    for step_batch in batches:
        micro_batches = step_batch.chunk(ACCUMULATE)
        tokens = torch.cat([micro_batch.chunk(world)[rank] for micro_batch in micro_batches])
        amp_checkpoint.forward_backward(
            model, tokens, tokens, amp, scaler, ACCUMULATE, loss_fn=next_token_loss
        )
        amp_checkpoint.optimizer_step(model, optimizer, scaler)
        optimizer.zero_grad(set_to_none=True)


def run_amp_checkpoint(optim, amp, batches, rank, world):
    model = CausalLM()
    model = amp_checkpoint.parallelize(model, CPU, checkpointed=model.blocks)
    optimizer = make_optimizer(param_groups(model.module, optim), optim)
    watch = EveryStep(model.module, optimizer)
    train(model, optimizer, batches, rank, world, amp)
    proof = dict(
        tied=model.module.head.lm_head.weight is model.module.embed.wte.weight,
        attention_forwards=watch.attention_forwards,
        linear_dtypes=sorted(watch.linear_dtypes),
    )
    return model, amp_checkpoint.full_state_dict(model), proof


def one_process_bf16(batches):
    """The bf16 case's reference: one process, the whole of every micro-batch, the forward under
    the same bf16 autocast, SGD."""
    model = CausalLM()
    optimizer = make_optimizer(param_groups(model, "sgd"), "sgd")
    for step_batch in batches:
        for tokens in step_batch.chunk(ACCUMULATE):
            with torch.autocast(CPU.type, dtype=torch.bfloat16):
                loss = lm_loss(model(tokens), tokens) / ACCUMULATE
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.state_dict()


def cases(batches, rank, world, folder):
    """amp_checkpoint-{sgd,adamw} in fp32 (checkpointing on) and amp_checkpoint-bf16-sgd, with
    its own reference, reference-bf16-sgd.pt: (case, reference, model, state_dict, proof)."""
    for optim in OPTIMS:
        case = f"amp_checkpoint-{optim}"
        yield case, optim, *run_amp_checkpoint(optim, "off", batches, rank, world)
    if rank == 0:
        torch.save(one_process_bf16(batches), folder / "reference-bf16-sgd.pt")
    yield (
        "amp_checkpoint-bf16-sgd",
        "bf16-sgd",
        *run_amp_checkpoint("sgd", "bf16", batches, rank, world),
    )


# The model as nanoGPT has it (tests/nanogpt_model.py), trained by its own recipe: its forward
# takes (x, y) and returns (logits, loss), which is what loss_fn reads; clipping through
# optimizer_step (after unscale_, where fp16 needs it).

NANOGPT_CASES = ["amp_checkpoint-sgd", "amp_checkpoint-adamw"]


def nanogpt_loss(model, x, y):
    _, loss = model(x, y)
    return loss


def run_nanogpt_amp_checkpoint(optim, rank, world):
    """fp32, every block of nanoGPT's `transformer.h` checkpointed: a step's ACCUMULATE
    micro-batches, this rank's slice of each, through one forward_backward."""
    model = nanogpt_model.model()
    model = amp_checkpoint.parallelize(model, CPU, checkpointed=model.transformer.h)
    raw_model = model.module
    optimizer = nanogpt_model.make_optimizer(raw_model, optim)
    scaler = torch.amp.GradScaler(CPU.type, enabled=False)  # fp32 here: a no-op
    norms = []
    for micro_batches in nanogpt_model.batches():
        x = torch.cat([x.chunk(world)[rank] for x, _ in micro_batches])
        y = torch.cat([y.chunk(world)[rank] for _, y in micro_batches])
        amp_checkpoint.forward_backward(
            model, x, y, "off", scaler, nanogpt_model.ACCUMULATE, loss_fn=nanogpt_loss
        )
        norm = amp_checkpoint.optimizer_step(model, optimizer, scaler, nanogpt_model.CLIP)
        norms.append(norm.item())
        optimizer.zero_grad(set_to_none=True)
    tied = raw_model.lm_head.weight is raw_model.transformer.wte.weight
    return raw_model, amp_checkpoint.full_state_dict(model), dict(tied=tied, norms=norms)


def nanogpt_cases(rank, world, folder):
    """As `cases`, on nanoGPT's model, in fp32."""
    for optim in OPTIMS:
        yield f"amp_checkpoint-{optim}", optim, *run_nanogpt_amp_checkpoint(optim, rank, world)


# The models as torchtitan's Llama 3 (tests/llama_model.py) and HuggingFace's GPT2LMHeadModel
# (tests/hf_gpt2_model.py) have them, each trained by its own recipe, in fp32 with every block
# checkpointed; clipping through optimizer_step.

FAMILIES = {"llama": llama_model, "gpt2": hf_gpt2_model}
LLAMA_CASES = [f"{family}-amp_checkpoint-{optim}" for family in FAMILIES for optim in OPTIMS]


def family_blocks(family, model):
    """The blocks to checkpoint: Llama's layers (an nn.ModuleDict: its values), GPT-2's h."""
    if family == "llama":
        return model.layers.values()
    return model.transformer.h


def step_loss_fn(family, num_items, world):
    """loss_fn(model, x, y) for forward_backward: the recipe's loss over the step's global count
    of targets, times W (DDP averages over ranks) and times ACCUMULATE, because forward_backward
    divides each micro-batch's loss by grad_accum, as for a mean, and this loss is already the
    micro-batch's share of the step's."""
    accumulate = FAMILIES[family].ACCUMULATE
    if family == "llama":

        def loss_fn(model, x, y):
            return llama_model.loss(model(x), y, num_items) * world * accumulate

    else:

        def loss_fn(model, x, y):
            loss, _ = model(x, labels=y, num_items_in_batch=num_items)
            return loss * world * accumulate

    return loss_fn


def run_family_amp_checkpoint(family, optim, rank, world):
    """Each step's ACCUMULATE micro-batches, this rank's slice of each, in one forward_backward."""
    recipe = FAMILIES[family]
    model = recipe.model()
    model = amp_checkpoint.parallelize(model, CPU, checkpointed=family_blocks(family, model))
    raw_model = model.module
    optimizer = recipe.make_optimizer(raw_model, optim)
    scaler = torch.amp.GradScaler(CPU.type, enabled=False)  # fp32 here: a no-op
    norms = []
    for micro_batches in recipe.batches():
        x = torch.cat([x.chunk(world)[rank] for x, _ in micro_batches])
        y = torch.cat([y.chunk(world)[rank] for _, y in micro_batches])
        loss_fn = step_loss_fn(family, targets(family, micro_batches), world)
        amp_checkpoint.forward_backward(
            model, x, y, "off", scaler, recipe.ACCUMULATE, loss_fn=loss_fn
        )
        norm = amp_checkpoint.optimizer_step(model, optimizer, scaler, recipe.CLIP)
        norms.append(norm.item())
        optimizer.zero_grad(set_to_none=True)
    return raw_model, amp_checkpoint.full_state_dict(model), dict(norms=norms)


def targets(family, micro_batches):
    """The step's global count of targets, as each recipe counts it."""
    if family == "llama":
        return llama_model.global_targets(micro_batches)
    return hf_gpt2_model.num_items_in_batch(micro_batches)


def llama_cases(rank, world, folder):
    """As `cases`, on Llama 3 and HF GPT-2, in fp32."""
    for family in FAMILIES:
        for optim in OPTIMS:
            case = run_family_amp_checkpoint(family, optim, rank, world)
            yield f"{family}-amp_checkpoint-{optim}", f"{family}-{optim}", *case
