"""Copy cases for fsdp.py: its section (`parallelize`, `full_state_dict`) shards the second model,
each block a unit and the rest (embed and head, the tied wte / lm_head with them) the root unit,
and each rank trains on its slice of every micro-batch. Run by tests/copy_cases.py."""

import torch
import torch.distributed as dist
from causal_lm import OPTIMS, CausalLM, make_optimizer, param_groups, train
from torch.distributed.tensor import DTensor

import fsdp

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
    model = fsdp.parallelize(CausalLM(), CPU)
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
