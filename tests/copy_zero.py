"""Copy cases for ddp.py, zero.py (stages 1-3) and zero_offload.py (to CPU, to disk): each rank
trains on its slice of every micro-batch, as data parallelism does. Run by tests/copy_cases.py, on
the world (`cases`, `nanogpt_cases`) and, with --groups, on a data-parallel group of two ranks of
four (`group_cases`)."""

import math

import hf_gpt2_model
import llama_model
import nanogpt_model
import torch
import torch.distributed as dist
from causal_lm import ACCUMULATE, OPTIMS, CausalLM, make_optimizer, param_groups, train
from torch.nn.utils import clip_grad_norm_

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


def run_zero(stage, optim, batches, rank, world, group=None, norms=None, accumulate=1):
    """ZeRO at `stage` over `group` (the world when None), rank and world the group's. `norms`: a
    list to collect each step's gradient norm in, as the section's clip_grad_norm_ takes it.
    `accumulate`: the backward passes a step zero.py is told (1: stage 1 reduces at each)."""
    model = CausalLM()
    units = [model.embed, *model.blocks, model.head]
    model = zero.parallelize(
        model,
        CPU,
        stage,
        param_groups=param_groups(model, optim),
        units=units,
        group=group,
        gradient_accumulation_steps=accumulate,
    )
    optimizer = make_optimizer(model.zero.param_groups, optim)
    zero.hook_optimizer(model, optimizer)
    if norms is not None:
        record_norms(optimizer, lambda: zero.clip_grad_norm_(model, math.inf), norms)
    train(model, optimizer, batches, rank, world)
    tied = model.head.lm_head.weight is model.embed.wte.weight
    return model, zero.full_state_dict(model), dict(tied=tied)


def run_zero_offload(offload, stage, optim, batches, rank, world, folder, group=None, norms=None):
    """zero_offload.py steps each group's pieces of the master (CPU, or the unit files on disk)
    with the group's hyperparameters: AdamW's two weight-decay groups. `group` and `norms`: as
    run_zero's."""
    directory = folder / f"zero_offload-{offload}-{optim}-files"  # --offload disk's unit files
    directory.mkdir(exist_ok=True)
    model = CausalLM()
    units = [model.embed, *model.blocks, model.head]
    # the groups made in the call, not kept in a variable: that would keep the model's original
    # parameters alive, and hook_optimizer warn of it
    model = zero_offload.parallelize(
        model,
        CPU,
        stage,
        param_groups=param_groups(model, optim),
        offload=offload,
        directory=directory,
        units=units,
        group=group,
    )
    optimizer = make_optimizer(model.zero.param_groups, optim)
    zero_offload.hook_optimizer(model, optimizer)
    if norms is not None:
        record_norms(optimizer, lambda: zero_offload.clip_grad_norm_(model, math.inf), norms)
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


# The sections on a process group of their own (tests/copy_cases.py --groups): each pair of ranks
# of a world of four shards the model between its two ranks alone, each rank training on its half
# of every micro-batch. Each case also takes every step's gradient norm through the section's
# clip_grad_norm_ (with no limit, so that nothing is scaled) and checks it against one process's:
# the norm's all-reduce over the world would add the other pair's squares too.

GROUP_CASES = ["group-zero1-sgd", "group-zero3-adamw", "group-zero_offload-cpu2-sgd"]


def record_norms(optimizer, norm, norms):
    """Before each optimizer.step() (after the engine's own pre-hook has finished the backward's
    reduce-scatters), append norm() to `norms`."""
    # torch calls a step hook as hook(optimizer, args, kwargs), with step()'s own arguments
    optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: norms.append(norm()))


def reference_norms(optim, batches):
    """Each step's gradient norm in one process (torch's clip_grad_norm_, no limit), trained as
    causal_lm.reference trains."""
    model = CausalLM()
    optimizer = make_optimizer(param_groups(model, optim), optim)
    norms = []
    record_norms(optimizer, lambda: clip_grad_norm_(model.parameters(), math.inf), norms)
    train(model, optimizer, batches)
    return norms


def check_norms(case, norms, expected):
    """The section's norms are one process's, to float32 round-off."""
    close = torch.allclose(torch.stack(norms), torch.stack(expected), rtol=1e-4)
    assert close, f"{case}: gradient norms {norms}, one process's {expected}"


def group_cases(batches, group, folder):
    """Yield (case name, its reference "sgd" or "adamw", the trained model, its full state_dict on
    the group's first rank ({} on the other), {}), the sections running on `group` alone."""
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    expected = {optim: reference_norms(optim, batches) for optim in OPTIMS}
    norms = []
    # told the loop's backward passes a step: stage 1 reduce-scatters once a step, on the group
    model, state, _ = run_zero(1, "sgd", batches, rank, world, group, norms, ACCUMULATE)
    check_norms("group-zero1-sgd", norms, expected["sgd"])
    yield "group-zero1-sgd", "sgd", model, state, {}
    norms = []
    model, state, _ = run_zero(3, "adamw", batches, rank, world, group, norms)
    check_norms("group-zero3-adamw", norms, expected["adamw"])
    yield "group-zero3-adamw", "adamw", model, state, {}
    norms = []
    model, state, _ = run_zero_offload("cpu", 2, "sgd", batches, rank, world, folder, group, norms)
    check_norms("group-zero_offload-cpu2-sgd", norms, expected["sgd"])
    yield "group-zero_offload-cpu2-sgd", "sgd", model, state, {}


# The model as nanoGPT has it (tests/nanogpt_model.py), trained by its own recipe: (x, y) batches,
# its configure_optimizers, gradient accumulation (zero.py told its count; the causal_lm cases
# above tell it none, so that stage 1 reduce-scatters every backward there), clipping before
# every step.

NANOGPT_CASES = [
    "ddp-sgd",
    "ddp-adamw",
    *(f"zero{stage}-{optim}" for stage in (1, 2, 3) for optim in OPTIMS),
    *(f"zero_offload-{where}-{optim}" for where in ("cpu2", "disk3") for optim in OPTIMS),
]


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


def nanogpt_units(model):
    """ZeRO's units: nanoGPT's modules in the order its forward runs them. `drop` holds no
    parameter; lm_head holds only the tied weight (transformer.wte.weight), yet it must be listed:
    a module left out would keep its parameter whole and untied, and parallelize refuses that."""
    transformer = model.transformer
    return [transformer.wte, transformer.wpe, *transformer.h, transformer.ln_f, model.lm_head]


def run_nanogpt_zero(script, optim, rank, world, clips=True, **zero_args):
    """ZeRO takes nanoGPT as it is: its units listed, its own optimizer (configure_optimizers'
    groups) rebuilt with its own class over the shards and the old one dropped, as ZeRO-3's memory
    needs, and the section's clip_grad_norm_ where nanoGPT clips (torch's would see no gradient:
    the shards get theirs from the section). clips=False: the recipe without clipping."""
    model = nanogpt_model.model()
    optimizer = nanogpt_model.make_optimizer(model, optim)
    units = nanogpt_units(model)
    model = script.parallelize(
        model, CPU, param_groups=optimizer.param_groups, units=units, **zero_args
    )
    optimizer = type(optimizer)(model.zero.param_groups)
    script.hook_optimizer(model, optimizer)

    def clip(parameters, max_norm):  # nanoGPT's call, clip_grad_norm_(model.parameters(), limit)
        return script.clip_grad_norm_(model, max_norm)

    compute_dtypes = nanogpt_model.record_compute_dtypes(model)
    batches = nanogpt_model.batches()
    recipe_clip = clip if clips else None
    losses, norms = nanogpt_model.train(model, optimizer, batches, rank, world, clip=recipe_clip)
    tied = model.lm_head.weight is model.transformer.wte.weight
    # the split: this rank holds 1/W of each unit (padded), and lm_head nothing of its own
    held = sum(param.numel() for param in model.parameters())
    lm_head_held = sum(param.numel() for param in model.lm_head.parameters())
    # stage 3: no unit left whole after the step (the others keep every unit whole)
    whole = sum(unit.is_whole() for unit in model.zero.units if unit.params)
    proof = dict(tied=tied, losses=losses, norms=norms, held=held, lm_head_held=lm_head_held)
    proof.update(whole_units=whole, compute_dtypes=compute_dtypes)
    return model, script.full_state_dict(model), proof


def nanogpt_cases(rank, world, folder):
    """As `cases`, on nanoGPT's model: (case, its reference, model, full state_dict, proof)."""
    for optim in OPTIMS:
        yield f"ddp-{optim}", optim, *run_nanogpt_ddp(optim, rank, world)
    # zero.py told nanoGPT's gradient_accumulation_steps: stage 1 reduce-scatters once a step
    accumulate = nanogpt_model.ACCUMULATE
    for stage in (1, 2, 3):
        for optim in OPTIMS:
            zero_args = dict(stage=stage, gradient_accumulation_steps=accumulate)
            case = run_nanogpt_zero(zero, optim, rank, world, **zero_args)
            yield f"zero{stage}-{optim}", optim, *case
    for offload, stage in (("cpu", 2), ("disk", 3)):
        for optim in OPTIMS:
            directory = folder / f"nanogpt-zero_offload-{offload}-{optim}-files"
            directory.mkdir(exist_ok=True)
            zero_args = dict(stage=stage, offload=offload, directory=directory)
            case = run_nanogpt_zero(zero_offload, optim, rank, world, **zero_args)
            yield f"zero_offload-{offload}{stage}-{optim}", optim, *case


# The models as torchtitan's Llama 3 (tests/llama_model.py) and HuggingFace's GPT2LMHeadModel
# (tests/hf_gpt2_model.py) have them, each trained by its own recipe: padded labels and a loss
# over the step's global count of targets, clipping before every step. Case names start with the
# family; each case's reference is "<family>-<optim>".

FAMILIES = {"llama": llama_model, "gpt2": hf_gpt2_model}
LLAMA_CASES = [
    *(f"{family}-ddp-{optim}" for family in FAMILIES for optim in OPTIMS),
    *(
        f"{family}-zero{stage}-{optim}"
        for family in FAMILIES
        for stage in (1, 2, 3)
        for optim in OPTIMS
    ),
    "llama-zero_offload-cpu2-adamw",
    "gpt2-zero_offload-disk3-sgd",
]


def family_units(family, model):
    """ZeRO's units, in the order the model's forward runs them: Llama's embedding, layers (an
    nn.ModuleDict: its values), norm and output; GPT-2's as nanoGPT's (lm_head holds only the tied
    weight, and must be listed)."""
    if family == "llama":
        return [model.tok_embeddings, *model.layers.values(), model.norm, model.output]
    transformer = model.transformer
    return [transformer.wte, transformer.wpe, *transformer.h, transformer.ln_f, model.lm_head]


def run_family_ddp(family, optim, rank, world):
    """DDP takes either model as it is; the recipe's loss times W undoes DDP's mean over ranks."""
    recipe = FAMILIES[family]
    model = ddp.parallelize(recipe.model(), CPU)
    optimizer = recipe.make_optimizer(model.module, optim)
    losses, norms = recipe.train(model, optimizer, recipe.batches(), rank, world)
    return model.module, ddp.full_state_dict(model), dict(losses=losses, norms=norms)


def run_family_zero(family, script, optim, rank, world, **zero_args):
    """ZeRO takes either model as it is, as run_nanogpt_zero takes nanoGPT's: its units, its own
    optimizer rebuilt over the shards, the section's clip where the recipe clips."""
    recipe = FAMILIES[family]
    model = recipe.model()
    optimizer = recipe.make_optimizer(model, optim)
    units = family_units(family, model)
    model = script.parallelize(
        model, CPU, param_groups=optimizer.param_groups, units=units, **zero_args
    )
    optimizer = type(optimizer)(model.zero.param_groups)
    script.hook_optimizer(model, optimizer)

    def clip(parameters, max_norm):
        return script.clip_grad_norm_(model, max_norm)

    losses, norms = recipe.train(model, optimizer, recipe.batches(), rank, world, clip=clip)
    return model, script.full_state_dict(model), dict(losses=losses, norms=norms)


def llama_cases(rank, world, folder):
    """As `cases`, on Llama 3 and HF GPT-2: (case, its reference, model, full state_dict, proof)."""
    for family in FAMILIES:
        for optim in OPTIMS:
            case = run_family_ddp(family, optim, rank, world)
            yield f"{family}-ddp-{optim}", f"{family}-{optim}", *case
    for family in FAMILIES:
        # told the recipe's backward passes a step: stage 1 reduce-scatters once a step
        zero_args = dict(gradient_accumulation_steps=FAMILIES[family].ACCUMULATE)
        for stage in (1, 2, 3):
            for optim in OPTIMS:
                case = run_family_zero(family, zero, optim, rank, world, stage=stage, **zero_args)
                yield f"{family}-zero{stage}-{optim}", f"{family}-{optim}", *case
    for family, offload, stage, optim in (("llama", "cpu", 2, "adamw"), ("gpt2", "disk", 3, "sgd")):
        directory = folder / f"{family}-zero_offload-{offload}-{optim}-files"
        directory.mkdir(exist_ok=True)
        zero_args = dict(stage=stage, offload=offload, directory=directory)
        case = run_family_zero(family, zero_offload, optim, rank, world, **zero_args)
        yield f"{family}-zero_offload-{offload}{stage}-{optim}", f"{family}-{optim}", *case
