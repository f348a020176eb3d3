"""Copy cases for expert_parallel.py: common/moe.py's MoE layer (router, experts, balance loss) in
place of each block's MLP of the second model, E=4 experts of CausalLM's own MLP, top-2, and the
experts spread over the W=2 ranks (2 on each) while every rank trains on its slice of each
micro-batch (data parallel over the same ranks); the same on nanoGPT's model (`nanogpt_cases`),
with the section's clip. Run by tests/copy_cases.py.

The one-process references are this module's own, as its model is (saved by rank 0): the same
MoE model with every expert in one process, trained by the same loop (DIR/reference-moe-<optim>.pt),
and with SGD, each step's batch in one forward and one backward (DIR/reference-moe-whole-sgd.pt):
what the accumulation, the balance loss's 1/forwards_per_step included, must come out as.
"""

import math

import llama_model
import nanogpt_model
import torch
import torch.distributed as dist
from causal_lm import (
    ACCUMULATE,
    MLP,
    OPTIMS,
    CausalLM,
    evaluation_loss,
    init_weights,
    lm_loss,
    make_optimizer,
    param_groups,
    task,
    train,
)

import expert_parallel
from common.moe import MoE

CPU = torch.device("cpu")
EXPERTS = 4
TOP_K = 2
AUX_LOSS = 0.05  # the balance loss's coefficient: large enough to move the router in 4 steps


def moe_causal_lm(forwards_per_step):
    """CausalLM with each block's mlp an MoE over EXPERTS copies of CausalLM's MLP. The MoE divides
    its balance loss by `forwards_per_step`, as the loop divides its loss."""
    model = CausalLM()  # seeds the generator: the same experts in every process
    for block in model.blocks:
        dim = block.ln_2.normalized_shape[0]
        experts = [MLP(dim) for _ in range(EXPERTS)]
        block.mlp = MoE(dim, experts, TOP_K, AUX_LOSS, forwards_per_step)
        block.mlp.apply(init_weights)
    return model


def reference(optim, batches, test_tokens):
    """One process, every expert here (the plain layer), the loop every case runs: (its
    state_dict, its evaluation loss)."""
    model = moe_causal_lm(forwards_per_step=ACCUMULATE)
    optimizer = make_optimizer(param_groups(model, optim), optim)
    train(model, optimizer, batches)
    return model.state_dict(), evaluation_loss(model, test_tokens)


def whole_batch_reference(batches):
    """SGD, one process, each step's batch in one forward and one backward (forwards_per_step=1):
    its state_dict. SGD only: AdamW turns the round-off between one batch of 16 sequences and two
    of 8 into steps on near-zero gradients (8e-5 here, above the test's tolerance)."""
    model = moe_causal_lm(forwards_per_step=1)
    optimizer = make_optimizer(param_groups(model, "sgd"), "sgd")
    for step_batch in batches:
        lm_loss(model(step_batch), step_batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.state_dict()


def held_experts(model, whole):
    """Per experts module, the experts of the whole model (`whole`, as built) whose weights this
    rank holds, found by their first weight: what only the split shows, before training."""
    held = []
    for name, experts in expert_parallel.expert_layers(model):
        if isinstance(experts, torch.nn.ModuleList):  # a list: each expert's first parameter
            mine = [next(expert.parameters()) for expert in experts]
            theirs = [next(expert.parameters()) for expert in whole.get_submodule(name)]
        else:  # stacked: the rows of the first stacked parameter
            mine = list(next(experts.parameters()))
            theirs = list(next(whole.get_submodule(name).parameters()))
        held.append([next(i for i, w in enumerate(theirs) if torch.equal(w, m)) for m in mine])
    return held


def run_expert_parallel(optim, batches, rank, world, group=None):
    """The section's two calls; the weight-decay groups built after parallelize (over this rank's
    experts): the router's and the experts' matrices in the decay group. group: the expert group,
    which is also the data-parallel group, of which this is rank `rank` of `world` (None: the
    world)."""
    model = expert_parallel.parallelize(
        moe_causal_lm(forwards_per_step=ACCUMULATE), CPU, group=group
    )
    held = held_experts(model, moe_causal_lm(forwards_per_step=ACCUMULATE))
    optimizer = make_optimizer(param_groups(model, optim), optim)
    expert_parallel.hook_optimizer(model, optimizer, data_group=group, backward_passes=ACCUMULATE)
    train(model, optimizer, batches, rank, world)
    # per rank, per block: the global indices of the experts it holds
    experts_held = [None] * world
    dist.all_gather_object(experts_held, held, group=group)
    tied = model.head.lm_head.weight is model.embed.wte.weight
    proof = dict(tied=tied, experts_held=experts_held)
    return model, expert_parallel.full_state_dict(model, group=group), proof


def cases(batches, rank, world, folder):
    """Yield (case name, its reference "moe-<optim>", the trained model, its full state_dict, what
    else it shows: the experts each rank held, the reference's evaluation loss)."""
    _, test_tokens = task()
    if rank == 0:
        torch.save(whole_batch_reference(batches), folder / "reference-moe-whole-sgd.pt")
    for optim in OPTIMS:
        reference_loss = None
        if rank == 0:
            state, reference_loss = reference(optim, batches, test_tokens)
            torch.save(state, folder / f"reference-moe-{optim}.pt")
        model, state, proof = run_expert_parallel(optim, batches, rank, world)
        proof["reference_eval_loss"] = reference_loss
        yield f"expert_parallel-{optim}", f"moe-{optim}", model, state, proof


GROUP_CASES = ["group-ep-sgd", "group-ep-adamw"]


def group_cases(batches, group, folder):
    """The cases on `group`, a pair of a world of four (tests/copy_cases.py --groups): the experts
    spread over the pair, which is also the data-parallel group (one copy: no replica_group), and
    the full state_dict on the pair's rank 0. The world's rank 0 saves this module's references
    (DIR/reference-moe-<optim>.pt): yields (case, "moe-<optim>", model, full state_dict, {})."""
    _, test_tokens = task()
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    for optim in OPTIMS:
        if dist.get_rank() == 0:
            state, _ = reference(optim, batches, test_tokens)
            torch.save(state, folder / f"reference-moe-{optim}.pt")
        model, state, _ = run_expert_parallel(optim, batches, rank, world, group)
        yield f"group-ep-{optim}", f"moe-{optim}", model, state, {}


# The model as nanoGPT has it (tests/nanogpt_model.py), trained by its own recipe: (x, y) batches,
# its configure_optimizers, gradient accumulation, clipping before every step. Every block's mlp
# is an MoE (common/moe.py's), set from outside as a user would; the class stays as it is.

NANOGPT_CASES = ["expert_parallel-sgd", "expert_parallel-adamw"]


def moe_nanogpt():
    """nanoGPT's GPT with each block's mlp an MoE over EXPERTS copies of nanoGPT's own MLP (its
    Block calls self.mlp(self.ln_2(x)) and adds the one tensor it gets back, which the MoE gives),
    initialised as GPT initialises its own MLP. The MoE divides its balance loss by the backward
    passes a step, as nanoGPT's loop divides its loss."""
    model = nanogpt_model.model()  # seeds the generator: the same experts in every process
    config = model.config
    for block in model.transformer.h:
        experts = [nanogpt_model.MLP(config) for _ in range(EXPERTS)]
        block.mlp = MoE(config.n_embd, experts, TOP_K, AUX_LOSS, nanogpt_model.ACCUMULATE)
        block.mlp.apply(model._init_weights)
        for name, param in block.mlp.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of the residual projections
                torch.nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
    return model


def nanogpt_units(model):
    """The modules holding nanoGPT's dense parameters, in forward order: hook_optimizer's buckets.
    lm_head holds only the tied weight, which wte's bucket already has."""
    transformer = model.transformer
    return [transformer.wte, transformer.wpe, *transformer.h, transformer.ln_f, model.lm_head]


def nanogpt_reference(optim):
    """One process, every expert here (the plain layer), nanoGPT's loop with torch's own clip:
    (its state_dict, dict(eval_loss, norms))."""
    model = moe_nanogpt()
    optimizer = nanogpt_model.make_optimizer(model, optim)
    _, norms = nanogpt_model.train(model, optimizer, nanogpt_model.batches())
    return model.state_dict(), dict(eval_loss=nanogpt_model.evaluation_loss(model), norms=norms)


def run_nanogpt_expert_parallel(optim, rank, world):
    """The section's two calls, then nanoGPT's configure_optimizers over what this rank holds
    (its experts' matrices and the routers' in the decay group), and the section's clip in the
    loop's place for torch's: the loop hands the clip parameters; the section's takes the model."""
    model = expert_parallel.parallelize(moe_nanogpt(), CPU)
    held = held_experts(model, moe_nanogpt())
    optimizer = nanogpt_model.make_optimizer(model, optim)
    expert_parallel.hook_optimizer(
        model, optimizer, units=nanogpt_units(model), backward_passes=nanogpt_model.ACCUMULATE
    )

    def clip(parameters, max_norm):
        return expert_parallel.clip_grad_norm_(model, max_norm)

    step_batches = nanogpt_model.batches()
    losses, norms = nanogpt_model.train(model, optimizer, step_batches, rank, world, clip)
    # per rank, per block: the global indices of the experts it holds
    experts_held = [None] * world
    dist.all_gather_object(experts_held, held)
    tied = model.lm_head.weight is model.transformer.wte.weight
    proof = dict(tied=tied, losses=losses, norms=norms, experts_held=experts_held)
    return model, expert_parallel.full_state_dict(model), proof


def nanogpt_cases(rank, world, folder):
    """As `cases`, on nanoGPT's model, against this module's own reference (rank 0 saves
    DIR/reference-nanogpt-moe-<optim>.pt): (case, its reference, model, full state_dict, proof)."""
    for optim in OPTIMS:
        reference_results = None
        if rank == 0:
            state, reference_results = nanogpt_reference(optim)
            torch.save(state, folder / f"reference-nanogpt-moe-{optim}.pt")
        model, state, proof = run_nanogpt_expert_parallel(optim, rank, world)
        proof["reference_results"] = reference_results
        yield f"expert_parallel-{optim}", f"nanogpt-moe-{optim}", model, state, proof


# Llama 3's MoE variant as torchtitan has it (tests/llama_model.py, MOE_ARGS): every layer's `moe`
# routes with its router `gate` and runs `experts`, a GroupedExperts whose w1, w2, w3 are stacked
# [E, ...] and run by a grouped matmul. The section takes it as it is: style=StackedExperts keeps
# each rank's E/W rows of the stacked weights and routes the model's sorted rows around the
# module's own forward. Trained by the Llama recipe (padded labels, a global count of targets, two
# backward passes a step, the section's clip in the loop's place for torch's).

LLAMA_CASES = ["llama-expert_parallel-sgd", "llama-expert_parallel-adamw"]


def llama_units(model):
    """The modules holding Llama's dense parameters, in forward order: hook_optimizer's buckets."""
    return [model.tok_embeddings, *model.layers.values(), model.norm, model.output]


def run_llama_expert_parallel(optim, rank, world):
    """The section's two calls on the Llama MoE, the recipe's optimizer over what this rank
    holds, and the section's clip: (model, full state_dict, proof)."""
    model = expert_parallel.parallelize(
        llama_model.model(llama_model.MOE_ARGS), CPU, style=expert_parallel.StackedExperts
    )
    held = held_experts(model, llama_model.model(llama_model.MOE_ARGS))
    # per rank, per layer: the global indices of the experts whose rows it holds
    experts_held = [None] * world
    dist.all_gather_object(experts_held, held)
    # The split, which equal parameters alone would not show (test_copy_llama reads no proof of
    # it: checked here, at the source, the same on every rank): each layer's E experts spread over
    # the ranks, E/W rows each. Which rows a rank holds, equal parameters show: the routing sends
    # rank r the tokens of experts r·E/W .. (the mutant ep-stacked-wrong-rank ends elsewhere).
    experts = llama_model.MOE_ARGS.moe_experts
    for layer in range(llama_model.MOE_ARGS.n_layers):
        rows = [rank_held[layer] for rank_held in experts_held]
        every = sorted(index for own in rows for index in own)
        split = all(len(own) == experts // world for own in rows)
        assert split and every == list(range(experts)), experts_held
    optimizer = llama_model.make_optimizer(model, optim)
    expert_parallel.hook_optimizer(
        model, optimizer, units=llama_units(model), backward_passes=llama_model.ACCUMULATE
    )

    def clip(parameters, max_norm):
        return expert_parallel.clip_grad_norm_(model, max_norm)

    step_batches = llama_model.batches()
    losses, norms = llama_model.train(model, optimizer, step_batches, rank, world, clip)
    proof = dict(losses=losses, norms=norms, experts_held=experts_held)
    return model, expert_parallel.full_state_dict(model), proof


def llama_cases(rank, world, folder):
    """As `cases`, on Llama's MoE variant, against one process of it (the reference
    "llama-moe-<optim>" that tests/copy_cases.py --llama writes): (case, its reference, model,
    full state_dict, proof)."""
    for optim in OPTIMS:
        model, state, proof = run_llama_expert_parallel(optim, rank, world)
        yield f"llama-expert_parallel-{optim}", f"llama-moe-{optim}", model, state, proof
