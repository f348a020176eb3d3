"""Copy cases for hybrid_parallel.py: its section composes pipeline.py, tensor_parallel.py and
zero.py on one DeviceMesh of W=8, (pp, dp, tp) = (2, 2, 2), and trains a language model with a tied
embedding, told the model through a hybrid_parallel.Contract: its Parts (the tied weight's module
named alone on each end, so that its copy there is a ZeRO unit of its own), the GPT-2 plan (q, k,
v fused in c_attn: QKVParallelLinear, the head count divided by PerRank; the attention reading its
width off q, as copy_tensor_parallel gives it), the optimizer's groups built on the stage after
the tp split, its loss. Each pipe (a dp and tp coordinate) runs 1F1B over its two stages;
a step's ACCUMULATE micro-batches are the schedule's micro-batches, each dp rank feeding its slice
of every one of them, as copy_zero's ranks do, and each tp rank of a pipe the same slice. Every
step's gradient norm comes from the section's clip_grad_norm_. Run at W=8 by tests/copy_cases.py
(`hybrid`, alone: tests/test_copy_hybrid.py).

`cases`: the CausalLM (tests/causal_lm.py), ZeRO stages 1 and 3, SGD and AdamW (causal_lm's two
weight-decay groups), the clip with no limit (it scales by 1 and returns the norm, to set next to
one process's). `nanogpt_cases`: nanoGPT's model as it is (tests/nanogpt_model.py), its
configure_optimizers' groups, its (x, y) micro-batches and loss, its clip at a limit that clips."""

import math

import llama_model
import nanogpt_model
import torch
import torch.distributed as dist
from causal_lm import (
    ACCUMULATE,
    CONTEXT,
    OPTIMS,
    CausalLM,
    Embed,
    Head,
    lm_loss,
    make_optimizer,
    task,
)
from copy_pipeline import (
    GPT_PARTS,
    LLAMA_PARTS,
    gpt_loss,
    make_stage_optimizer,
    stage_param_groups,
)
from copy_tensor_parallel import (
    CAUSAL_LM_PLAN,
    LLAMA_PLAN,
    NANOGPT_PLAN,
    attend_by_width_of_q,
    causal_lm_attention,
    nanogpt_attention,
)
from copy_zero import reference_norms
from torch.distributed.device_mesh import init_device_mesh

import hybrid_parallel
import pipeline

CPU = torch.device("cpu")
SIZES = dict(pp=2, dp=2, ep=1, cp=1, tp=2)
DIM = 32  # CausalLM()'s


def embed(stage, tokens):
    """causal_lm.Embed's forward, on the first stage's holder of wte and wpe (the Parts name each
    alone: two units, the tied wte by itself)."""
    return Embed.forward(stage.embed, tokens)


def head(stage, x):
    """causal_lm.Head's forward, on the last stage's holder of ln_f and lm_head (the tied copy by
    itself)."""
    return Head.forward(stage.head, x)


CAUSAL_LM_PARTS = pipeline.Parts(
    blocks="blocks",
    first=("embed.wte", "embed.wpe"),
    embed=embed,
    last=("head.ln_f", "head.lm_head"),
    head=head,
)


def make_mesh(world):
    """The (pp, dp, ep, cp, tp) = (2, 2, 1, 1, 2) mesh, in hybrid_parallel.MESH_DIMS' order."""
    assert world == math.prod(SIZES.values()), f"the hybrid cases run at W=8, not {world}"
    sizes = [SIZES[dim] for dim in hybrid_parallel.MESH_DIMS]
    return init_device_mesh("cpu", sizes, mesh_dim_names=hybrid_parallel.MESH_DIMS)


def train(stage, optimizer, step_batches, loss_fn, max_norm, mesh):
    """Each step: this dp rank's slice of each of the step's (x, y) micro-batches, one after
    another, through the pipeline as its micro-batches (each loss / their count, as the one
    process divides it by ACCUMULATE); the section's clip; the step. Returns the clip's norms."""
    dp_rank = mesh["dp"].get_local_rank()
    dp_world = mesh["dp"].size()
    norms = []
    for micro_batches in step_batches:
        x = torch.cat([x.chunk(dp_world)[dp_rank] for x, _ in micro_batches])
        y = torch.cat([y.chunk(dp_world)[dp_rank] for _, y in micro_batches])
        hybrid_parallel.train_step(stage, x, y, loss_fn)
        norms.append(hybrid_parallel.clip_grad_norm_(stage, max_norm).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return norms


def eval_loss(stage, x, y, loss_fn):
    """The held-out loss through the section's infer, on every rank: the logits are on the ranks
    that answer (the last stage's first tp rank, at each dp rank); their losses averaged."""
    loss_and_count = torch.zeros(2)
    logits = hybrid_parallel.infer(stage, x)
    if logits is not None:
        loss_and_count += torch.stack([loss_fn(logits, y), torch.tensor(1.0)])
    dist.all_reduce(loss_and_count)
    return (loss_and_count[0] / loss_and_count[1]).item()


def held_by_rank(stage):
    """What each rank's stage holds, gathered on every rank: {what: [per rank]}. The composition
    ran: the blocks cut over pp, c_attn's 3D rows over tp (48 of 96: 2 of 4 heads of each of q, k
    and v), the tied copy a unit of its own on both ends, half its elements on each dp rank."""
    c_attn = [module for name, module in stage.named_modules() if name.endswith("attn.c_attn")]
    held = dict(
        blocks=list(stage.block_names),
        c_attn_rows=c_attn[0].weight.shape[0],
        tied_shard=[unit.shard_numel for unit in stage.tied_units],
    )
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, held)
    return {key: [rank_held[key] for rank_held in gathered] for key in held}


def causal_lm_contract(optim):
    """The CausalLM, as hybrid_parallel's Contract names it. AdamW's groups: causal_lm's
    weight-decay split on the stage, the last stage's tied copy (in lm_head, a Linear) moved to the
    group of wte.weight, no decay, as on the first stage (copy_pipeline's stage_param_groups)."""

    def param_groups(stage):
        return stage_param_groups(stage, optim)

    return hybrid_parallel.Contract(
        parts=CAUSAL_LM_PARTS,
        activation_shape=(CONTEXT, DIM),
        plan=CAUSAL_LM_PLAN,
        param_groups=param_groups,
    )


def run_causal_lm(zero_stage, optim, batches, mesh):
    model = CausalLM()
    attend_by_width_of_q(model.blocks, causal_lm_attention)  # copy_tensor_parallel's
    stage = hybrid_parallel.parallelize(
        model,
        mesh,
        CPU,
        zero_stage,
        micro_batches=ACCUMULATE,
        contract=causal_lm_contract(optim),
    )
    optimizer = make_optimizer(stage.zero.param_groups, optim)
    hybrid_parallel.hook_optimizer(stage, optimizer)
    step_batches = [[(micro, micro) for micro in batch.chunk(ACCUMULATE)] for batch in batches]
    norms = train(stage, optimizer, step_batches, lm_loss, math.inf, mesh)
    state = hybrid_parallel.full_state_dict(stage, mesh)
    proof = held_by_rank(stage)
    _, test_tokens = task()
    proof.update(norms=norms, eval_loss=eval_loss(stage, test_tokens, test_tokens, lm_loss))
    if state is not None:  # rank 0, which writes the results
        proof["tied"] = torch.equal(state["embed.wte.weight"], state["head.lm_head.weight"])
        proof["reference_norms"] = [norm.item() for norm in reference_norms(optim, batches)]
    return stage, state, proof


CASES = [f"hybrid-z{stage}-{optim}" for stage in (1, 3) for optim in OPTIMS]


def cases(batches, rank, world, folder):
    """Yield (case name, its reference "sgd" or "adamw", the stage, the full state_dict on rank 0
    (None elsewhere), the proof), as copy_zero.cases does."""
    mesh = make_mesh(world)
    for zero_stage in (1, 3):
        for optim in OPTIMS:
            case = run_causal_lm(zero_stage, optim, batches, mesh)
            yield f"hybrid-z{zero_stage}-{optim}", optim, *case


# The model as nanoGPT has it: copy_pipeline's GPT_PARTS (transformer.wte, transformer.wpe,
# transformer.drop first; transformer.h; transformer.ln_f, lm_head last: the tied weight alone in
# wte and in lm_head), configure_optimizers on the stage (every 2-D tensor decays, both tied copies
# too), its (x, y) micro-batches, its loss with ignore_index=-1, its clip that clips every step.

# case -> (ZeRO stage, the model's configuration in nanogpt_model.CONFIGS, optimizer): with biases
# (the key's, whose gradient is zero, among them) at stage 3 and AdamW, without at stage 1 and SGD
NANOGPT_RUNS = {
    "hybrid-z3-adamw": (3, "", "adamw"),
    "hybrid-z1-nobias-sgd": (1, "nobias-", "sgd"),
}
NANOGPT_CASES = list(NANOGPT_RUNS)
OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


def nanogpt_contract(optim):
    """nanoGPT, as hybrid_parallel's Contract names it. The optimizer's groups are those of
    nanogpt_model.make_optimizer on the stage, their hyperparameters with them."""

    def param_groups(stage):
        return make_stage_optimizer(stage, optim).param_groups

    config = nanogpt_model.CONFIG
    return hybrid_parallel.Contract(
        parts=GPT_PARTS,
        activation_shape=(config.block_size, config.n_embd),
        plan=NANOGPT_PLAN,
        param_groups=param_groups,
    )


def run_nanogpt(zero_stage, prefix, optim, mesh):
    gpt = nanogpt_model.model(nanogpt_model.CONFIGS[prefix])
    attend_by_width_of_q(gpt.transformer.h, nanogpt_attention)  # copy_tensor_parallel's
    contract = nanogpt_contract(optim)
    stage = hybrid_parallel.parallelize(
        gpt, mesh, CPU, zero_stage, micro_batches=ACCUMULATE, contract=contract
    )
    del gpt  # its lm_head (not on the first stage) would keep the tied original alive
    # the user's optimizer class over ZeRO's groups, which keep the groups' hyperparameters
    optimizer = OPTIMIZERS[optim](stage.zero.param_groups)
    hybrid_parallel.hook_optimizer(stage, optimizer)
    clip = nanogpt_model.CLIP
    norms = train(stage, optimizer, nanogpt_model.batches(), gpt_loss, clip, mesh)
    state = hybrid_parallel.full_state_dict(stage, mesh)
    proof = held_by_rank(stage)
    proof.update(norms=norms, eval_loss=eval_loss(stage, *nanogpt_model.held_out(), gpt_loss))
    if state is not None:  # rank 0, which writes the results
        proof["tied"] = torch.equal(state["transformer.wte.weight"], state["lm_head.weight"])
    return stage, state, proof


def nanogpt_cases(rank, world, folder):
    """As `cases`, on nanoGPT's model: (case, its reference, the stage, full state_dict, proof)."""
    mesh = make_mesh(world)
    for case, (zero_stage, prefix, optim) in NANOGPT_RUNS.items():
        yield case, f"{prefix}{optim}", *run_nanogpt(zero_stage, prefix, optim, mesh)


# Llama 3 as torchtitan has it (tests/llama_model.py), trained by its own recipe: copy_pipeline's
# LLAMA_PARTS (every stage holds the freqs_cis buffer and gives it to its layers), copy_tensor_
# parallel's LLAMA_PLAN (wqkv by kv group, W dividing the 2 kv heads; the head counts divided),
# torchtitan's one AdamW group. The save is the model's own state_dict(): wq, wk, wv from its hook
# on the whole (dp-gathered, tp-joined) wqkv with the head counts whole again, and freqs_cis.

LLAMA_CASES = ["llama-hybrid-z3-adamw"]


def llama_train(stage, optimizer, mesh):
    """The recipe's steps through the section: each dp rank's slice of each micro-batch, the loss
    over the step's global count of targets times m (train_step divides each micro-batch's loss
    by m, as for a mean) and times the dp size (ZeRO averages over it), the section's clip."""
    dp_rank = mesh["dp"].get_local_rank()
    dp_world = mesh["dp"].size()
    norms = []
    for micro_batches in llama_model.batches():
        x = torch.cat([x.chunk(dp_world)[dp_rank] for x, _ in micro_batches])
        y = torch.cat([y.chunk(dp_world)[dp_rank] for _, y in micro_batches])
        num_items = llama_model.global_targets(micro_batches)
        scale = len(micro_batches) * dp_world

        def loss_fn(logits, labels, num_items=num_items, scale=scale):
            return llama_model.loss(logits, labels, num_items) * scale

        hybrid_parallel.train_step(stage, x, y, loss_fn)
        norms.append(hybrid_parallel.clip_grad_norm_(stage, llama_model.CLIP).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return norms


def run_llama(zero_stage, optim, mesh):
    def param_groups(stage):
        """torchtitan's optimizer on the stage after the tp split: its one group's settings."""
        return llama_model.make_optimizer(stage, optim).param_groups

    contract = hybrid_parallel.Contract(
        parts=LLAMA_PARTS,
        activation_shape=(llama_model.ARGS.max_seq_len, llama_model.ARGS.dim),
        plan=LLAMA_PLAN,
        param_groups=param_groups,
    )
    stage = hybrid_parallel.parallelize(
        llama_model.model(), mesh, CPU, zero_stage, micro_batches=ACCUMULATE, contract=contract
    )
    # the user's optimizer class over ZeRO's groups, which keep the groups' settings
    optimizer = OPTIMIZERS[optim](stage.zero.param_groups)
    hybrid_parallel.hook_optimizer(stage, optimizer)
    norms = llama_train(stage, optimizer, mesh)
    state = hybrid_parallel.full_state_dict(stage, mesh)
    x, y = llama_model.held_out()
    proof = dict(norms=norms, eval_loss=eval_loss(stage, x, y, llama_model.loss))
    return stage, state, proof


def llama_cases(rank, world, folder):
    """As `cases`, on Llama 3: (case, its reference, the stage, full state_dict, proof)."""
    mesh = make_mesh(world)
    yield "llama-hybrid-z3-adamw", "llama-adamw", *run_llama(3, "adamw", mesh)
