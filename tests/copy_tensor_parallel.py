"""Copy cases for tensor_parallel.py, with and without sequence parallelism: every rank feeds the
whole micro-batch, as tensor parallelism does, and holds half of every block's heads and MLP
columns. The change a GPT-2-like model needs is the plan below: its layers' names, q, k and v
fused in c_attn, the head count and the causal mask; nanoGPT's model also names its blocks and,
under sequence parallelism, where its tokens enter and leave them. With --groups the section runs
on a pair of ranks of four (group_cases), ZeRO-R's variant among them. Run by
tests/copy_cases.py."""

import nanogpt_model
import torch
import torch.distributed as dist
from causal_lm import OPTIMS, CausalLM, make_optimizer, param_groups, train

import tensor_parallel
import tensor_parallel_zero_r
from tensor_parallel import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    full_state_dict,
    parallelize,
)

CPU = torch.device("cpu")
HEADS = 4  # CausalLM()'s

# the model contract's GPT-2 / nanoGPT plan, in CausalLM's names
GPT2_PLAN = {
    "attn.c_attn": QKVParallelLinear,
    "attn.c_proj": RowParallelLinear,
    "mlp.c_fc": ColumnParallelLinear,
    "mlp.c_proj": RowParallelLinear,
}


def heads_held(c_attn, whole):
    """Which heads of q, of k and of v the rows of this rank's c_attn weight are, found by
    comparing them with the whole initial weight's rows: [[q heads], [k heads], [v heads]]."""
    head_dim = whole.shape[1] // HEADS
    held = []
    for local, part in zip(c_attn.chunk(3), whole.chunk(3), strict=True):
        heads = part.split(head_dim)  # the whole q (k, v): HEADS blocks of head_dim rows
        found = []
        for rows in local.split(head_dim):
            found += [h for h, head in enumerate(heads) if torch.equal(rows, head)]
        held.append(found)
    return held


def run_tensor_parallel(sequence_parallel, optim, batches):
    model = CausalLM()
    whole = model.blocks[0].attn.c_attn.weight.detach().clone()
    model = parallelize(model, CPU, sequence_parallel, GPT2_PLAN, heads=HEADS, causal=True)
    c_attn = model.blocks[0].attn.c_attn.weight
    seen = {}  # the tokens block 0's first norm runs on: T/W under sequence parallelism

    def note_tokens(module, inputs):
        seen["tokens"] = inputs[0].shape[1]

    model.blocks[0].ln_1.register_forward_pre_hook(note_tokens)
    mine = dict(c_attn_rows=c_attn.shape[0], heads=heads_held(c_attn.detach(), whole))
    optimizer = make_optimizer(param_groups(model, optim), optim)
    train(model, optimizer, batches)  # rank=0, world=1: every rank feeds the whole micro-batch
    mine["ln_1_tokens"] = seen["tokens"]
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, mine)
    proof = {key: [rank[key] for rank in every_rank] for key in mine}
    proof["tied"] = model.head.lm_head.weight is model.embed.wte.weight
    return model, full_state_dict(model), proof


def cases(batches, rank, world, folder):
    """Yield (case name, its reference "sgd" or "adamw", the trained model, its full state_dict,
    what else the case shows: per rank, c_attn's rows and the heads they hold, the tokens the
    norms see), one case at a time."""
    for sequence_parallel in (False, True):
        for optim in OPTIMS:
            name = f"tensor_parallel-{'sp' if sequence_parallel else 'tp'}-{optim}"
            yield name, optim, *run_tensor_parallel(sequence_parallel, optim, batches)


# The section on a process group of its own (tests/copy_cases.py --groups): each pair of ranks of a
# world of four splits the model between its two ranks alone. "pa": ZeRO-R's partitioned
# activations (tensor_parallel_zero_r.py), whose all-gather before each recompute takes the group
# too. Sequence parallelism trains with SGD: its partial gradient sum, run over all four ranks,
# doubles the norms' gradients, which AdamW's steps barely show.

GROUP_CASES = ["group-tp-adamw", "group-tp-sp-sgd", "group-tp-pa-sgd"]


def run_on_group(section, optim, batches, group, **options):
    """CausalLM split by `section` (tensor_parallel or its ZeRO-R variant) over `group`, trained
    with every group rank feeding the whole micro-batch: (model, full state_dict on the group's
    first rank, None on the other)."""
    # GPT2_PLAN in the section's own classes: the variant file defines its own, which its
    # parallelize tells apart by identity.
    plan = {name: getattr(section, split.__name__) for name, split in GPT2_PLAN.items()}
    model = section.parallelize(
        CausalLM(), CPU, plan=plan, heads=HEADS, causal=True, group=group, **options
    )
    optimizer = make_optimizer(param_groups(model, optim), optim)
    train(model, optimizer, batches)  # rank=0, world=1: every rank feeds the whole micro-batch
    return model, section.full_state_dict(model, group)


def group_cases(batches, group, folder):
    """Yield (case name, its reference "sgd" or "adamw", the trained model, its full state_dict on
    the group's first rank, {}), the section running on `group` alone."""
    model, state = run_on_group(tensor_parallel, "adamw", batches, group)
    yield "group-tp-adamw", "adamw", model, state, {}
    model, state = run_on_group(tensor_parallel, "sgd", batches, group, sequence_parallel=True)
    yield "group-tp-sp-sgd", "sgd", model, state, {}
    model, state = run_on_group(tensor_parallel_zero_r, "sgd", batches, group, partition=True)
    yield "group-tp-pa-sgd", "sgd", model, state, {}


# The model as nanoGPT has it (tests/nanogpt_model.py), trained by its own recipe: (x, y) batches,
# its configure_optimizers, gradient accumulation, clipping before every step.

NANOGPT_CASES = [
    f"tensor_parallel-{split}-{prefix}{optim}"
    for split in ("tp", "sp")
    for prefix in nanogpt_model.CONFIGS
    for optim in nanogpt_model.OPTIMS
]


def replicated_apart(model):
    """The largest |Δ| between this rank's and rank 0's replicated parameters (everything outside
    the parallel linears): 0 when every rank stepped them alike."""
    split = {
        id(param)
        for module in model.modules()
        for name, param in module.named_parameters(recurse=False)
        if name in getattr(module, "shard_dims", {})
    }
    apart = 0.0
    for param in model.parameters():
        if id(param) not in split:
            first = param.detach().clone()
            dist.broadcast(first, src=0)
            apart = max(apart, (param.detach() - first).abs().max().item())
    return apart


def run_nanogpt_tensor_parallel(sequence_parallel, prefix, optim):
    """nanoGPT's model as it is: its plan is GPT2_PLAN (the same layer names), its blocks are
    transformer.h, and under sequence parallelism the tokens are split after transformer.drop
    (the forward adds wte's and wpe's outputs inline) and gathered before transformer.ln_f. The
    optimizer is the model's own (configure_optimizers on the split model: the shards are still
    matrices and vectors); the clip is the section's, over the shards."""
    gpt = nanogpt_model.model(nanogpt_model.CONFIGS[prefix])
    whole = gpt.transformer.h[0].attn.c_attn.weight.detach().clone()
    model = tensor_parallel.parallelize(
        gpt,
        CPU,
        sequence_parallel,
        GPT2_PLAN,
        heads=gpt.config.n_head,
        causal=True,
        blocks=gpt.transformer.h,
        embed=gpt.transformer.drop,
        head=gpt.transformer.ln_f,
    )
    seen = {}  # the tokens block 0's first norm runs on: T/W under sequence parallelism

    def note_tokens(module, inputs):
        seen["tokens"] = inputs[0].shape[1]

    model.transformer.h[0].ln_1.register_forward_pre_hook(note_tokens)
    c_attn = model.transformer.h[0].attn.c_attn.weight.detach()
    mine = dict(c_attn_rows=c_attn.shape[0], heads=heads_held(c_attn, whole))
    optimizer = nanogpt_model.make_optimizer(model, optim)

    def clip(parameters, max_norm):  # where nanoGPT clips model.parameters()
        return tensor_parallel.clip_grad_norm_(model, max_norm)

    # rank=0, world=1: every rank feeds the whole micro-batch
    losses, norms = nanogpt_model.train(model, optimizer, nanogpt_model.batches(), clip=clip)
    mine["ln_1_tokens"] = seen["tokens"]
    mine["replicated_apart"] = replicated_apart(model)
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, mine)
    proof = {key: [rank[key] for rank in every_rank] for key in mine}
    proof.update(
        tied=model.lm_head.weight is model.transformer.wte.weight, losses=losses, norms=norms
    )
    return model, tensor_parallel.full_state_dict(model), proof


def nanogpt_cases(rank, world, folder):
    """As `cases`, on nanoGPT's model, with and without biases: (case, its reference, model, full
    state_dict, proof: per rank, c_attn's rows and heads, the tokens ln_1 saw, how far its
    replicated parameters ended from rank 0's)."""
    for sequence_parallel in (False, True):
        for prefix in nanogpt_model.CONFIGS:
            for optim in nanogpt_model.OPTIMS:
                name = f"tensor_parallel-{'sp' if sequence_parallel else 'tp'}-{prefix}{optim}"
                case = run_nanogpt_tensor_parallel(sequence_parallel, prefix, optim)
                yield name, f"{prefix}{optim}", *case
