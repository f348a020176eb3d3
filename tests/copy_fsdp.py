"""Copy cases for fsdp.py: its section (`parallelize`, `full_state_dict`) shards the second model,
each block a unit and the rest (embed and head, the tied wte / lm_head with them) the root unit,
and each rank trains on its slice of every micro-batch. Run by tests/copy_cases.py."""

import hf_gpt2_model
import llama_model
import nanogpt_model
import torch
import torch.distributed as dist
from causal_lm import OPTIMS, CausalLM, make_optimizer, param_groups, train
from torch.distributed.tensor import DTensor

import fsdp
import fsdp_resume

CPU = torch.device("cpu")


def group_names(model, groups):
    """The parameter names in each of the optimizer's groups: with AdamW, the weight-decay split
    that weight_decay_groups made of the DTensor shards."""
    name_of = {param: name for name, param in model.named_parameters()}
    return [sorted(name_of[param] for param in group["params"]) for group in groups]


def shard_numels(model):
    """[the block parameters' elements, as many as each rank holds]: FSDP keeps a shard of each,
    about 1/W of it (dim 0 padded to a multiple of W); an unsharded model, all of it."""
    local = 0
    for param in model.blocks.parameters():
        local += param.to_local().numel() if isinstance(param, DTensor) else param.numel()
    per_rank = [torch.zeros((), dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(per_rank, torch.tensor(local))
    return [numel.item() for numel in per_rank]


def run_fsdp(optim, batches, rank, world):
    model = CausalLM()
    model = fsdp.parallelize(model, CPU, model.blocks)
    # after parallelize: the groups must hold the shards that replaced the full parameters
    groups = param_groups(model, optim)
    optimizer = make_optimizer(groups, optim)
    train(model, optimizer, batches, rank, world)
    proof = dict(
        tied=model.head.lm_head.weight is model.embed.wte.weight,
        groups=group_names(model, optimizer.param_groups),
        groups_hold_shards=all(
            isinstance(param, DTensor) for group in groups for param in group["params"]
        ),
        block_numel=sum(param.numel() for param in model.blocks.parameters()),
        shard_numels=shard_numels(model),
    )
    return model, fsdp.full_state_dict(model), proof


def cases(batches, rank, world, folder):
    """fsdp-sgd, fsdp-adamw: (case, reference, model, full state_dict, proof), as copy_zero's."""
    for optim in OPTIMS:
        yield f"fsdp-{optim}", optim, *run_fsdp(optim, batches, rank, world)


# The model as nanoGPT has it (tests/nanogpt_model.py), trained by its own recipe.

NANOGPT_CASES = ["fsdp-sgd", "fsdp-adamw"]


def clip_sharded(parameters, max_norm):
    """torch's clip_grad_norm_ on FSDP's sharded gradients: the norm it returns is a DTensor,
    already reduced over the shards; full_tensor() reads its value."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def run_nanogpt_fsdp(optim, rank, world, mixed_precision=False, clips=True):
    """Each of nanoGPT's blocks a unit; the root holds wte, wpe, ln_f and lm_head, so the tie
    stays in one unit. configure_optimizers runs after parallelize, on the shards.
    `mixed_precision`: fsdp.py's MixedPrecisionPolicy (the peer of zero.py's). clips=False: the
    recipe without clipping."""
    model = nanogpt_model.model()
    model = fsdp.parallelize(model, CPU, model.transformer.h, mixed_precision=mixed_precision)
    optimizer = nanogpt_model.make_optimizer(model, optim)
    batches = nanogpt_model.batches()
    compute_dtypes = nanogpt_model.record_compute_dtypes(model)
    clip = clip_sharded if clips else None
    losses, norms = nanogpt_model.train(model, optimizer, batches, rank, world, clip)
    proof = dict(
        tied=model.lm_head.weight is model.transformer.wte.weight,
        losses=losses,
        norms=norms,
        compute_dtypes=compute_dtypes,
        blocks_sharded=all(
            isinstance(param, DTensor) for param in model.transformer.h.parameters()
        ),
    )
    return model, fsdp.full_state_dict(model), proof


def nanogpt_cases(rank, world, folder):
    """As `cases`, on nanoGPT's model."""
    for optim in OPTIMS:
        yield f"fsdp-{optim}", optim, *run_nanogpt_fsdp(optim, rank, world)


# The models as torchtitan's Llama 3 (tests/llama_model.py) and HuggingFace's GPT2LMHeadModel
# (tests/hf_gpt2_model.py) have them, each trained by its own recipe.

FAMILIES = {"llama": llama_model, "gpt2": hf_gpt2_model}
LLAMA_CASES = [
    *(f"{family}-fsdp-{optim}" for family in FAMILIES for optim in OPTIMS),
    "llama-fsdp_resume-adamw",
]


def family_blocks(family, model):
    """FSDP's units, the transformer blocks: Llama's layers (an nn.ModuleDict: its values), GPT-2's
    transformer.h. The root keeps the rest (GPT-2's tied wte / lm_head together)."""
    if family == "llama":
        return model.layers.values()
    return model.transformer.h


def run_family_fsdp(family, optim, rank, world):
    """Each block a unit, the optimizer built on the shards, torch's clip_grad_norm_ on them."""
    recipe = FAMILIES[family]
    model = recipe.model()
    model = fsdp.parallelize(model, CPU, family_blocks(family, model))
    optimizer = recipe.make_optimizer(model, optim)
    losses, norms = recipe.train(model, optimizer, recipe.batches(), rank, world, clip_sharded)
    return model, fsdp.full_state_dict(model), dict(losses=losses, norms=norms)


def llama_cases(rank, world, folder):
    """As `cases`, on Llama 3 and HF GPT-2; then fsdp_resume.py's save and load on Llama 3."""
    for family in FAMILIES:
        for optim in OPTIMS:
            case = run_family_fsdp(family, optim, rank, world)
            yield f"{family}-fsdp-{optim}", f"{family}-{optim}", *case
    case = llama_fsdp_resume("adamw", rank, world, folder)
    yield "llama-fsdp_resume-adamw", "llama-adamw", *case


# fsdp_resume.py's sharded checkpoints (DCP) on Llama 3: the run stopped after its second step
# and resumed from the files in a new model and optimizer ends as the uninterrupted one.


def llama_fsdp_resume(optim, rank, world, folder):
    """Steps 1-2, save_sharded, then a fresh model, optimizer and schedule, load_sharded, step 3."""
    step_batches = llama_model.batches()
    directory = folder / f"llama-fsdp_resume-{optim}-checkpoint"
    norms = []
    for first, last in ((0, 2), (2, len(step_batches))):
        model = llama_model.model()
        model = fsdp_resume.parallelize(model, CPU, model.layers.values())
        optimizer = llama_model.make_optimizer(model, optim)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        if first > 0:
            fsdp_resume.load_sharded(directory, model, optimizer, scheduler)
        batches = step_batches[first:last]
        _, run_norms = llama_model.train(model, optimizer, batches, rank, world, clip_sharded)
        norms += run_norms
        if first == 0:
            fsdp_resume.save_sharded(directory, model, optimizer, scheduler)
    return model, fsdp_resume.full_state_dict(model), dict(norms=norms)
