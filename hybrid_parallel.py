"""Hybrid parallelism: data, tensor and pipeline parallelism composed on one DeviceMesh
(init_device_mesh) from this codebase's own sections, each on its dimension's process group, in
this order: pipeline.py (1F1B or GPipe) over pp, tensor_parallel.py (Megatron, optionally with
sequence parallelism) over tp, zero.py (ZeRO-1, 2 or 3) over dp. W = P·N·T ranks on the mesh
(pp, dp, ep, cp, tp), outermost to innermost, ep = cp = 1; two more layouts: data x context
(context_parallel.py's ring, --cp) and data x expert (expert_parallel.py, --ep). Two nodes of 4
GPUs, --pp 2 --dp 2 --tp 2:

                            dp 0       dp 1
    node 0, stage 0:        [0  1]     [2  3]       [a b]  a tp group: the blocks' heads split
    node 1, stage 1:        [4  5]     [6  7]       0-2, 1-3, 4-6, 5-7: dp (ZeRO) groups
                                                    0-4, 1-5, 2-6, 3-7: pp groups (the pipes)

Memory per rank (fp32, AdamW; Ψ_s the stage's parameters after the tp split, each ZeRO unit
padded to a multiple of N): ZeRO-1 (8 + 8/N)Ψ_s, ZeRO-2 (4 + 12/N)Ψ_s, ZeRO-3 16Ψ_s/N. Per step
(act: B/N samples x L tokens x D fp32, m micro-batches): tp all-reduces 4·act a block; dp
reduce-scatters 4Ψ_s (ZeRO-2, 3: m times) and all-gathers 4Ψ_s (ZeRO-3: 2m times); pp sends and
receives act (act/T under sequence parallelism); --mixed-precision: zero.py's bf16 recipe over
dp, act bf16. Paper: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", https://arxiv.org/abs/2104.04473. More: docs/hybrid_parallel.md

    torchrun --standalone --nproc_per_node=8 hybrid_parallel.py --dp 2 --pp 2 --tp 2 --zero-stage 3
    torchrun --standalone --nproc_per_node=4 hybrid_parallel.py --dp 2 --tp 2 --sequence-parallel
    python hybrid_parallel.py --nproc 4 --dp 2 --cp 2                     # data x context (ring)
    python hybrid_parallel.py --nproc 4 --dp 2 --ep 2 --experts 4         # data x expert
"""

import functools
import math
import os
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, DistributedSampler

import common
import context_parallel
import expert_parallel
import pipeline
import tensor_parallel
import zero

SCRIPT = os.path.splitext(os.path.basename(__file__))[0]


### begin: Hybrid parallel
# Model contract: the three sections' own, each on its mesh dimension's group: pipeline.py's (the
# ViT's embed, blocks and head; a [B/m, L, D] activation crosses each stage boundary),
# tensor_parallel.py's (its PLAN splits each block's linears) and zero.py's (the stage's units in
# forward order: the embedding on the first stage, the stage's blocks, the head on the last).
# `mesh` is a DeviceMesh over the whole world with the dimensions MESH_DIMS. The loss is
# train_step's loss_fn, cross-entropy by default. Build the optimizer over model.zero.param_groups
# after parallelize, then call hook_optimizer. The checkpoint, the clip, sequence parallelism, a
# language model's Contract and the layouts data x context and data x expert: the `### more:`
# parts after the core, each a subclass of Hybrid or a wrapper of a function of the core.

# Why the product is one process's step: each section cuts what the others leave whole. The
# pipeline gives each stage its own blocks; tensor parallelism splits a block's linears among tp
# ranks that see the same micro-batch, its f and g making each layer's output and input gradient
# whole; ZeRO shards what is left over dp ranks that see other samples, and averages. Each talks
# only on its dimension's group, so ZeRO shards a stage's tp split as zero.py shards a whole model.

# The mesh's dimensions, outermost to innermost. The tensor-parallel ranks exchange activations in
# every block, so they are the innermost: the ranks of a node. ep and cp, used beside dp only,
# sit between dp and tp: inside a node too, where their all-to-alls and ring are cheapest.
MESH_DIMS = ("pp", "dp", "ep", "cp", "tp")


class Hybrid:
    """The composition parallelize builds, kept at stage.hybrid: each step a method, so that a
    `### more:` part extends a step with a subclass of its own. Each section is told its group
    and nothing of the others: pipeline.py sends to its pp peers, tensor_parallel.py's f and g
    all-reduce over tp, zero.py reduce-scatters and all-gathers over dp."""

    plan = tensor_parallel.PLAN  # how tensor parallelism splits each block: the ViT's

    def __init__(self, mesh, zero_stage=1, schedule="1f1b", micro_batches=1):
        self.mesh = mesh
        self.zero_stage = zero_stage
        self.schedule = schedule
        self.micro_batches = micro_batches  # the pipeline's, and ZeRO's gradient accumulation

    def parallelize(self, model, device):
        """This rank's part of the model: its pipeline stage, each block split by TP, the stage's
        units sharded by ZeRO over the data-parallel ranks."""
        # 1. The pipeline split over pp: this rank keeps its stage's blocks and nothing else.
        stage = self.split_stages(model, device)
        blocks = [stage.get_submodule(name) for name in stage.block_names]
        # 2. Tensor parallelism over tp inside each of the stage's blocks (at tp 1: none).
        if self.mesh["tp"].size() > 1:
            self.split_blocks(stage, blocks)
        # 3. ZeRO over dp, on what the tp split left.
        self.shard(stage, self.units(stage, blocks), device)
        stage.hybrid = self  # train_step reads it: the skeleton's train() passes only `model`
        # Each test sample's logits are counted on one rank: the last stage's first tp rank. Its tp
        # peers hold the same logits (the head is not split), and would count each sample T times.
        stage.answers = stage.is_last and self.mesh["tp"].get_local_rank() == 0
        return stage

    def activation_shape(self, model):
        """(L, D) of one sample's activation between stages: the ViT's."""
        return tuple(model.embed.pos.shape[1:])

    def split_stages(self, model, device):
        """pipeline.py's split: this rank's stage, on its device."""
        shape = self.activation_shape(model)
        return pipeline.parallelize(model, device, shape, group=self.mesh["pp"].get_group())

    def split_blocks(self, stage, blocks):
        """tensor_parallel.py's split of each block, as the plan says: Megatron's f on the
        column-parallel layers' input, g on the row-parallel ones' output; the block's own
        attention runs on this rank's H/T heads."""
        tp_group = self.mesh["tp"].get_group()
        f, g = self.operators(tp_group)
        for block in blocks:
            tensor_parallel.split_block(block, self.plan, f, g, tp_group)

    def operators(self, tp_group):
        """Megatron's f and g on the tp group."""
        return tensor_parallel.operators(group=tp_group)

    def units(self, stage, blocks):
        """ZeRO's units in forward order: each module the first stage runs before the blocks (the
        embedding), each block, each module the last stage runs after them (the head), as the
        pipeline's Stage names them."""
        units = list(blocks)
        if stage.is_first:
            units = [stage.get_submodule(name) for name in stage.first_modules] + units
        if stage.is_last:
            units += [stage.get_submodule(name) for name in stage.last_modules]
        return units

    def shard(self, stage, units, device, **options):
        """zero.py's sharding of the stage's units over the dp group (options: what zero.py's
        parts take besides)."""
        dp_group = self.mesh["dp"].get_group()
        zero.parallelize(stage, device, self.zero_stage, units=units, group=dp_group, **options)

    def train_step(self, stage, x, y, loss_fn):
        """The pipeline's forward and backward of every micro-batch, then after_backward."""
        loss = pipeline.train_step(stage, x, y, self.schedule, self.micro_batches, loss_fn)
        self.after_backward(stage)
        return loss

    def after_backward(self, stage):
        """The step's last reduce-scatter finished (zero.py's run while backward computes): each
        unit's grad_shard is this rank's shard of its gradient averaged over dp."""
        stage.zero.finish_reduce_scatter()


# The class parallelize builds: each `### more:` part that extends a step rebinds it to its
# subclass.
Composition = Hybrid


def parallelize(model, mesh, device, zero_stage=1, schedule="1f1b", micro_batches=1, **options):
    """This rank's part of the model (Hybrid.parallelize), ZeRO at `zero_stage`. `schedule` and
    `micro_batches`: the pipeline's (the micro-batches are also ZeRO's gradient accumulation).
    `options`: what the parts' subclasses take besides (sequence_parallel, contract)."""
    hybrid = Composition(mesh, zero_stage, schedule, micro_batches, **options)
    return hybrid.parallelize(model, device)


def hook_optimizer(stage, optimizer):
    """zero.py's work around optimizer.step(): the gradient shards handed to the optimizer before
    it, the updated shards all-gathered after it (stages 1-2)."""
    zero.hook_optimizer(stage, optimizer)


def train_step(stage, x, y, loss_fn=F.cross_entropy):
    """Forward, loss_fn and backward of this data-parallel rank's batch through the pipeline (its
    micro-batches are ZeRO's gradient accumulation), then the gradients made whole on ZeRO's
    shards: each unit's `grad_shard` is this rank's shard of its averaged gradient. Call it once
    per optimizer step: what after_backward sums is not to be summed twice. The optimizer's
    pre-hook (zero.py's before_step) hands the shards to its pieces. Returns the batch's mean loss
    on the last stage, and 0 on the stages before it."""
    return stage.hybrid.train_step(stage, x, y, loss_fn)


@torch.no_grad()
def infer(stage, x):
    """The batch through the stages in turn (pipeline.py's infer on the pp group). Returns the
    logits where stage.answers, None elsewhere."""
    logits = pipeline.infer(stage, x)
    if stage.answers:
        return logits
    return None


### more: ZeRO-1 reduces once a step: the micro-batches' gradients summed locally in between
# ZeRO-1 keeps each unit's whole flat gradient anyway (it shards only the optimizer state), so the
# step's m micro-batches can add their gradients into it and reduce-scatter the sum once, in the
# last micro-batch's backward: 4Ψ_s a step instead of 4Ψ_s·m, as DeepSpeed's stage 1 and
# Megatron-LM ("communicate only at gradient accumulation boundaries") do. zero.py's
# gradient-accumulation part does it when told the backward passes of each step: here each
# micro-batch's backward is one, m a step. The same average: the division by N and the sum over
# ranks commute with the sum over micro-batches. ZeRO-2 and 3 keep a reduce-scatter a micro-batch
# (freeing the whole gradient after it is their memory saving).


class ReduceOnceAStep(Composition):
    """ZeRO's engine told that each step runs `micro_batches` backward passes."""

    def shard(self, stage, units, device, **options):
        options["gradient_accumulation_steps"] = self.micro_batches  # zero.py's part's option
        super().shard(stage, units, device, **options)


Composition = ReduceOnceAStep


### more: the checkpoint: ZeRO's shards gathered, the tp splits joined, the stages merged


def full_state_dict(stage, mesh):
    """The model's own state_dict() on rank 0 (its keys, its persistent buffers, whatever its
    state_dict hooks make of them), None elsewhere, put together as it was taken apart, in
    reverse: ZeRO gathers each unit's shards on the dp group's first rank, which holds this tp
    rank's split of the stage; the tp ranks' splits are joined on the tp group's first rank, which
    takes the stage's state_dict() with the whole parameters and head counts in place; the stages
    are gathered on rank 0 over the pp group of the ranks at dp 0 and tp 0."""
    split_state = stage.zero.gather_parameters()  # {} off the dp group's first rank
    if mesh["dp"].get_local_rank() != 0:
        return None
    whole_parameters = join_tp_splits(stage, split_state, mesh["tp"].get_group())
    if mesh["tp"].get_local_rank() != 0:
        return None
    with tensor_parallel.swapped(tensor_parallel.whole_counts(stage)):
        stage_state = zero.state_dict_with(stage, whole_parameters)
    stage_state = {key: tensor.cpu() for key, tensor in stage_state.items()}
    pp_group = mesh["pp"].get_group()
    stage_states = None  # gather_object fills a list on the destination only
    if stage.is_first:
        stage_states = [None] * stage.num_stages
    dist.gather_object(stage_state, stage_states, group=pp_group, group_dst=0)
    if not stage.is_first:
        return None
    # The stages' keys are disjoint (each block keeps its index in the model): merge them.
    state = {}
    for one_stage_state in stage_states:
        state.update(one_stage_state)
    return state


def join_tp_splits(stage, split_state, tp_group):
    """The tp ranks' splits of the stage joined on the tp group's first rank: each parameter a
    parallel linear split is gathered and joined as it was cut (tensor_parallel.join_shards), in
    the same key order on every tp rank so that the gathers pair up. ZeRO's gather_parameters
    hands CPU tensors; each travels from the device, where NCCL can send it."""
    tp_rank = dist.get_rank(tp_group)
    tp_world = dist.get_world_size(tp_group)
    state = {}
    for key in sorted(split_state):
        tensor = split_state[key]
        module, name = owner_of(stage, key)
        shard_dims = getattr(module, "shard_dims", {})  # only the parallel linears have them
        if name not in shard_dims:
            state[key] = tensor  # every tp rank holds it whole
            continue
        tensor = tensor.to(stage.zero.device)
        shards = None  # dist.gather fills a list on the destination only
        if tp_rank == 0:
            shards = [torch.empty_like(tensor) for _ in range(tp_world)]
        dist.gather(tensor, shards, group=tp_group, group_dst=0)
        if tp_rank == 0:
            # module.parts: 3 for a fused q, k, v, whose shards hold a third of each
            whole = tensor_parallel.join_shards(shards, shard_dims[name], module.parts)
            state[key] = whole.cpu()
    return state


def owner_of(stage, key):
    """The module holding the parameter with the state_dict key `key`, and its name there."""
    module_name, _, name = key.rpartition(".")
    return stage.get_submodule(module_name), name


### more: gradient clipping over every dimension, each parameter counted once


@torch.no_grad()
def clip_grad_norm_(stage, max_norm):
    """torch.nn.utils.clip_grad_norm_ as one process computes it, over parameters no rank holds
    whole. The dp shards, the tp splits and the pp stages are disjoint: the squares summed over
    every rank of the world are the square of the global norm, but for two kinds of copies. A
    parameter every tp rank holds whole counts 1/T on each; a weight tied across the first and the
    last stage counts on the first only (after train_step both copies hold its whole gradient).
    Every rank scales its shards, both copies too, by the same factor. Call it after train_step,
    before the step; returns the total norm, as torch's does."""
    tp_size = stage.hybrid.mesh["tp"].size()
    split_keys = tp_split_keys(stage)
    tied_units = getattr(stage, "tied_units", [])  # a language model's: its `### more:` part
    shards = []
    squares = torch.zeros((), device=stage.zero.device)
    for unit in stage.zero.units:
        grad = unit.grad_shard
        shards.append(grad)
        if unit in tied_units and not stage.is_first:
            continue  # the last stage's copy of a tied weight: the first stage's counts
        whole_keys = {key for key, _, _ in unit.params} - split_keys
        whole_parts = shard_slices(unit, stage.zero.rank, whole_keys)
        replicated = sum(grad[part].square().sum() for part in whole_parts)
        split = grad.square().sum() - replicated
        squares += split + replicated / tp_size
    dist.all_reduce(squares)  # the world: every dimension at once
    total_norm = squares.sqrt()
    scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)  # torch's own formula
    for grad in shards:
        grad.mul_(scale)
    return total_norm


def tp_split_keys(stage):
    """The keys of the parameters tensor parallelism split, each tp rank holding other rows or
    columns of them: those the parallel linears name in their `shard_dims`."""
    keys = set()
    for unit in stage.zero.units:
        for key, _, _ in unit.params:
            module, name = owner_of(stage, key)
            if name in getattr(module, "shard_dims", {}):
                keys.add(key)
    return keys


def shard_slices(unit, rank, keys):
    """The slices of this rank's ZeRO shard of `unit` that hold the parameters named by `keys`."""
    shard_start = rank * unit.shard_numel
    shard_end = shard_start + unit.shard_numel
    slices = []
    for key, tensor, offset in unit.params:
        low = max(offset, shard_start)
        high = min(offset + tensor.numel(), shard_end)
        if key in keys and low < high:
            slices.append(slice(low - shard_start, high - shard_start))
    return slices


### more: sequence parallelism (Korthikanti et al. 2022), its partial gradients on ZeRO's shards
# tensor_parallel.py's part, in each stage: the first stage's first block hands each tp rank its
# L/T tokens, the last stage's head gathers them back, and the stages between them receive and
# send token shards, [B/m, L/T, D]. The blocks' norms and row-parallel biases then see only this
# tp rank's tokens: tensor_parallel.py sums their gradients with hooks on the parameters, which
# ZeRO replaces; here they are summed after the step's last reduce-scatter, on ZeRO's shards,
# which gives the same: both sums are linear, and every tp rank's shard holds the same parameters
# at the same offsets (its units have the same shapes).


class SequenceParallel(Composition):
    """parallelize(..., sequence_parallel=True): with tp > 1, the blocks on L/T tokens."""

    def __init__(self, mesh, *args, sequence_parallel=False, **options):
        super().__init__(mesh, *args, **options)
        self.sequence_parallel = sequence_parallel and mesh["tp"].size() > 1

    def activation_shape(self, model):
        tokens, dim = super().activation_shape(model)
        if self.sequence_parallel:
            tokens //= self.mesh["tp"].size()  # each tp rank's share of the tokens crosses
        return tokens, dim

    def operators(self, tp_group):
        if self.sequence_parallel:
            return tensor_parallel.sequence_operators(tp_group)
        return super().operators(tp_group)

    def split_blocks(self, stage, blocks):
        super().split_blocks(stage, blocks)
        if self.sequence_parallel:
            tp_group = self.mesh["tp"].get_group()
            tensor_parallel.gather_tokens_into(blocks, tp_group)
            first_block = blocks[0] if stage.is_first else None
            head = stage.head if stage.is_last else None
            tensor_parallel.split_tokens(first_block, head, tp_group)

    def shard(self, stage, units, device, **options):
        """ZeRO's, and on each unit `token_sharded`: the slices of this rank's shard whose
        parameters saw only this tp rank's tokens, read by name before ZeRO replaces them."""
        token_sharded_keys = set()
        if self.sequence_parallel:
            blocks = [stage.get_submodule(name) for name in stage.block_names]
            token_sharded_keys = keys_of(stage, tensor_parallel.token_sharded_params(blocks))
        super().shard(stage, units, device, **options)
        for unit in stage.zero.units:
            unit.token_sharded = shard_slices(unit, stage.zero.rank, token_sharded_keys)

    def after_backward(self, stage):
        super().after_backward(stage)
        if self.sequence_parallel:
            sum_token_sharded(stage)


Composition = SequenceParallel


def keys_of(stage, params):
    """The state_dict keys of `params` in the stage."""
    key_of = {param: key for key, param in stage.named_parameters()}
    return {key_of[param] for param in params}


def sum_token_sharded(stage):
    """The tp ranks' partial gradients, summed over tp on ZeRO's shards: one all-reduce, not one
    per parameter, as Megatron does."""
    partials = []
    for unit in stage.zero.units:
        partials += [unit.grad_shard[part] for part in unit.token_sharded]
    if not partials:
        return
    flat = torch.cat(partials)
    dist.all_reduce(flat, group=stage.hybrid.mesh["tp"].get_group())
    sums = flat.split([partial.numel() for partial in partials])
    for partial, summed in zip(partials, sums, strict=True):
        partial.copy_(summed)


### more: a language model (parts, plan, a tied weight across the first and last stage)
# What the core reads off the ViT, another model names in a Contract: pipeline.py's Parts and the
# (L, D) crossing a stage boundary; tensor_parallel.py's plan (its layers, a fused q, k, v as
# GPT-2's c_attn, the head counts it divides); the optimizer's groups, built on the stage the tp
# split left, where zero.py cuts each unit's shard into pieces. GPT-2's tied embedding
# (wte.weight is lm_head.weight) is one weight on two stages: pipeline.py gives the last stage a
# copy and sums the two copies' .grad after the backward, but under ZeRO the copies are flat shards
# without a .grad.
# So each copy is a ZeRO unit of its own (its module holds nothing else): the same shape on both
# ends, the same padding and shard cut, so dp rank d holds the same elements of it on both. After
# the step's last reduce-scatter, each end's shard of it is summed over the pipe's embedding group
# (its first and last stage, at this rank's dp and tp coordinate): both copies take the same step.


class Contract(NamedTuple):
    """What the sections need of a model, by name; the defaults are the common ViT's. parts: a
    pipeline.Parts (None: the ViT's embed, blocks, head). activation_shape: (L, D) of a sample's
    activation between stages (None: model.embed.pos's, the ViT's). plan: tensor_parallel.py's
    (None: its PLAN, the ViT's). param_groups: a function of the stage returning the optimizer's
    groups over its parameters as the tp split left them, each copy of a tied weight in a group
    with the same hyperparameters on both ends (None: one group)."""

    parts: pipeline.Parts | None = None
    activation_shape: tuple | None = None
    plan: dict = tensor_parallel.PLAN
    param_groups: Callable | None = None


class LanguageModel(Composition):
    """parallelize(..., contract=Contract(...)): a model other than the common ViT, and a weight
    tied across the first and the last stage."""

    def __init__(self, mesh, *args, contract=None, **options):
        super().__init__(mesh, *args, **options)
        self.contract = contract or Contract()
        check_contract(self.contract, getattr(self, "sequence_parallel", False))
        self.plan = self.contract.plan

    def activation_shape(self, model):
        if self.contract.parts is None:  # the ViT's
            return super().activation_shape(model)
        return self.contract.activation_shape

    def split_stages(self, model, device):
        shape = self.activation_shape(model)
        pp_group = self.mesh["pp"].get_group()
        parts = self.contract.parts
        return pipeline.parallelize(model, device, shape, group=pp_group, parts=parts)

    def shard(self, stage, units, device, **options):
        """ZeRO's, the shards cut where the optimizer's groups meet, each tied copy a unit of its
        own."""
        if self.contract.param_groups is not None:
            options["param_groups"] = self.contract.param_groups(stage)
        tied_keys = tied_weight_keys(stage)  # by name, before ZeRO replaces the copies
        super().shard(stage, units, device, **options)
        mark_tied(stage, tied_keys)

    def after_backward(self, stage):
        super().after_backward(stage)
        sum_tied_copies(stage)


Composition = LanguageModel


def check_contract(contract, sequence_parallel):
    """A model of another layout names the shape crossing a stage boundary itself, and runs
    without sequence parallelism: the token split hooks the ViT's embed (its output is the first
    block's input) and head, which a Parts does not name (CausalLM and nanoGPT add wte's and wpe's
    outputs inline)."""
    if contract.parts is None:
        return
    if contract.activation_shape is None:
        raise ValueError("a Contract with Parts of its own names its activation_shape: (L, D)")
    if sequence_parallel:
        raise ValueError(
            "sequence parallelism splits the tokens after the ViT's embed and gathers them "
            "before its head: a Contract with Parts of its own runs without it"
        )


def tied_weight_keys(stage):
    """The state_dict keys of the stage's copies of the weights tied across the first and the last
    stage (pipeline.py's stage.tied, in the same order on both ends: GPT-2's embed.wte.weight on
    the first stage, head.lm_head.weight on the last), read before ZeRO replaces them."""
    key_of = {param: key for key, param in stage.named_parameters()}
    return [key_of[param] for param in stage.tied]


def mark_tied(stage, tied_keys):
    """After ZeRO: `stage.tied_units`, the unit of each tied copy, in tied_keys' order, which must
    hold it alone. pipeline.py's stage.tied is emptied: ZeRO replaced its copies, so its train_step
    has no .grad to sum, and the list would keep the originals' memory alive."""
    stage.tied_units = []
    for key in tied_keys:
        holding = []  # the units that flattened this copy: exactly one
        for unit in stage.zero.units:
            unit_keys = [unit_key for unit_key, _, _ in unit.params]
            if key in unit_keys:
                holding.append(unit)
        (unit,) = holding
        if len(unit.params) > 1:
            raise ValueError(
                f"{key}: a weight tied across the first and the last stage must be a ZeRO unit of "
                "its own on both ends (the same shard cut on both): name the module holding it, "
                "and nothing else, in the Parts' first and last (GPT-2's wte, lm_head)"
            )
        stage.tied_units.append(unit)
    stage.tied = []


def sum_tied_copies(stage):
    """After the step's last reduce-scatter, on the first and the last stage: each copy's gradient
    shard holds its stage's part of the tied weight's gradient (the embedding's use, the head's),
    averaged over dp; summed over the embedding group, both hold the shard of the whole gradient
    (the same slices: the same unit shape, the same dp rank), and both copies take the same step.
    The stages between hold no copy."""
    for unit in stage.tied_units:
        dist.all_reduce(unit.grad_shard, group=stage.tied_group)


### more: mixed precision: zero.py's recipe over dp, bf16 across the tp and pp boundaries
# ZeRO over dp runs zero.py's own mixed-precision part (its engine takes mixed_precision=True):
# bf16 working parameters, which forward and backward read and ZeRO-3 all-gathers; each rank's
# shard of the fp32 master weights and of the optimizer state; gradients reduce-scattered in fp32.
# Its hooks cast each unit's inputs to bf16, so the blocks compute in bf16 and tensor parallelism's
# f and g all-reduce bf16 activations and their gradients, with nothing of the hybrid's own. The
# pipeline sends bf16 activations forward and their bf16 gradients back: half the bytes. zero.py
# casts its model's output to fp32 for the loss; its model is a stage here, and only the last
# stage's output is the logits. The stages before it cast theirs back to bf16 before the send,
# which is exact: bf16 to fp32 to bf16 is the identity, and so is its backward.


class MixedPrecision(Composition):
    """parallelize(..., mixed_precision=True): ZeRO in zero.py's mixed-precision recipe, the
    activations bf16 across the tp and pp boundaries, the logits fp32 for the loss."""

    def __init__(self, mesh, *args, mixed_precision=False, **options):
        super().__init__(mesh, *args, **options)
        self.mixed_precision = mixed_precision

    def split_stages(self, model, device):
        stage = super().split_stages(model, device)
        if self.mixed_precision:
            # the receive buffers in the dtype the peer sends: its blocks' bf16 output
            stage.activation_dtype = torch.bfloat16
        return stage

    def shard(self, stage, units, device, **options):
        if self.mixed_precision:
            options["mixed_precision"] = True  # zero.py's part's option
        super().shard(stage, units, device, **options)
        if self.mixed_precision and not stage.is_last:
            stage.register_forward_hook(to_activation_dtype)  # after zero.py's cast to fp32


Composition = MixedPrecision


def to_activation_dtype(stage, args, output):
    """A stage's output, which zero.py's part cast to fp32 as if it were the logits, back in the
    dtype the next stage receives."""
    return output.to(stage.activation_dtype)


### more: the layouts data x context and data x expert
# Two more layouts on the same mesh, each another section beside data parallelism: a model of
# either keeps its layout at model.layout, and each function of the core (and the checkpoint's and
# the clip's) is wrapped so that the layout's method of the same name runs for it instead.


class OtherLayout:
    """What data x context and data x expert share: the model whole but for their section's
    split, kept at model.layout, and the loop's forward, loss and backward."""

    def __init__(self, mesh):
        self.mesh = mesh

    def train_step(self, model, x, y, loss_fn=F.cross_entropy):
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss.detach()

    @torch.no_grad()
    def infer(self, model, x):
        logits = model(x)
        if model.answers:
            return logits
        return None


class DataContext(OtherLayout):
    """Data x context (mesh["cp"] > 1): each sample's tokens split over the cp ranks (ring
    attention), the data over dp; DDP averages over every rank of the mesh, which is the whole
    gradient of the global batch (each cp rank's gradient is its tokens' part, made W_cp times
    larger by context_parallel.py's SumOverRanks). The ViT, as context_parallel.py takes it."""

    def parallelize(self, model, device):
        cp_group = self.mesh["cp"].get_group()
        model = model.to(device)
        context_parallel.split_sequence(model.embed, model.head.fc, cp_group)  # the ViT's tokens
        model = context_parallel.parallelize(model, device, "ring", cp_group, data_group=None)
        model.layout = self
        model.answers = self.mesh["cp"].get_local_rank() == 0  # the cp ranks pool the same logits
        return model

    def hook_optimizer(self, model, optimizer):
        """Nothing: DDP averages in backward."""

    def clip_grad_norm_(self, model, max_norm):
        """torch's: every rank holds every whole gradient after DDP's average."""
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def full_state_dict(self, model, mesh):
        """DDP's copy of the model's own state_dict() on rank 0."""
        return context_parallel.full_state_dict(model)


class DataExpert(OtherLayout):
    """Data x expert (mesh["ep"] > 1): each MoE layer's experts spread over the ep ranks, every rank
    a data-parallel rank on its own slice of the batch; the dense part's gradients averaged over
    every rank before the step, each expert's over the ranks holding it (one in each dp copy of
    the ep group). The ViT, as expert_parallel.py takes it."""

    def parallelize(self, model, device):
        model = expert_parallel.parallelize(model, device, group=self.mesh["ep"].get_group())
        model.layout = self
        model.answers = True  # each rank evaluates samples of its own
        return model

    def hook_optimizer(self, model, optimizer):
        replica_group = self.mesh["dp"].get_group()
        expert_parallel.hook_optimizer(
            model, optimizer, data_group=None, replica_group=replica_group
        )

    def clip_grad_norm_(self, model, max_norm):
        """expert_parallel.py's, over the ep group, where each expert lives once."""
        ep_group = self.mesh["ep"].get_group()
        return expert_parallel.clip_grad_norm_(model, max_norm, group=ep_group)

    def full_state_dict(self, model, mesh):
        """The model's own state_dict() on rank 0, the experts gathered over the ep group."""
        return expert_parallel.full_state_dict(model, group=self.mesh["ep"].get_group())


def with_other_layouts(parallelize_3d):
    """parallelize, wrapped: on a mesh with cp or ep > 1, that layout's."""

    @functools.wraps(parallelize_3d)
    def parallelize_any(model, mesh, device, *args, **options):
        if mesh["cp"].size() == mesh["ep"].size() == 1:
            return parallelize_3d(model, mesh, device, *args, **options)
        if options.get("contract") is not None:
            raise ValueError("a Contract is for the pp x dp x tp layout; cp and ep take the ViT")
        if options.get("mixed_precision"):
            raise ValueError("mixed precision is the pp x dp x tp layout's ZeRO; cp and ep: fp32")
        layout = DataContext(mesh) if mesh["cp"].size() > 1 else DataExpert(mesh)
        return layout.parallelize(model, device)

    return parallelize_any


def on_its_layout(function_3d):
    """A function of the pp x dp x tp layout, wrapped: for a model of another layout, the layout's
    method of the same name."""

    @functools.wraps(function_3d)
    def on_any_layout(model, *args, **kwargs):
        layout = getattr(model, "layout", None)
        if layout is None:
            return function_3d(model, *args, **kwargs)
        return getattr(layout, function_3d.__name__)(model, *args, **kwargs)

    return on_any_layout


parallelize = with_other_layouts(parallelize)
hook_optimizer = on_its_layout(hook_optimizer)
train_step = on_its_layout(train_step)
infer = on_its_layout(infer)
clip_grad_norm_ = on_its_layout(clip_grad_norm_)
full_state_dict = on_its_layout(full_state_dict)


### end: Hybrid parallel


def stage_units(args, stage):
    """The ZeRO units of pipeline stage `stage` (the same on each of its tp ranks), counted off
    the model's shapes: for each unit, its parameters in the order zero.py flattens them, as
    (elements after the tp split, whether it is a block parameter the split left whole: under
    sequence parallelism its gradient is a partial sum over the tp ranks)."""
    model = common.build_model(args)
    stage = pipeline.Stage(model, stage, args.pp)
    names = list(stage.block_names)
    if stage.is_first:
        names = ["embed", *names]
    if stage.is_last:
        names += ["head"]
    modules = {name: stage.get_submodule(name) for name in names}
    units = []
    for module_name, module in modules.items():
        in_block = module_name.startswith("blocks.")
        params = []
        for name, param in module.named_parameters():
            layer, _, kind = name.rpartition(".")
            style = tensor_parallel.PLAN.get(layer) if in_block and args.tp > 1 else None
            column = style is tensor_parallel.ColumnParallelLinear
            row_weight = style is tensor_parallel.RowParallelLinear and kind == "weight"
            numel = param.numel()
            if column or row_weight:
                numel //= args.tp
            params.append((numel, in_block and not (column or row_weight)))
        units.append(params)
    return units


def formula(psi, world, args):
    """The reporting rank's bytes from its stage's shapes (Ψ_s: split by T, each ZeRO unit padded
    to a multiple of N), and each mesh dimension's traffic per step, which the report sets next to
    what the Meter measured (per process group). The reporting rank is rank 0, or --simulate's
    rank r: its pipeline stage s and data-parallel rank d are its mesh coordinates."""
    k = 8 if args.optim == "adamw" else 4  # the ZeRO paper's K: optimizer bytes per parameter
    if args.cp > 1 or args.ep > 1:
        return other_layout_formula(psi, k, args)
    s = args.simulate_rank // (args.dp * args.tp)  # the mesh (pp, dp, tp), outermost first
    d = args.simulate_rank // args.tp % args.dp
    psi_stage = 0  # Ψ_s
    partial_elements = 0  # of this rank's shards: the norms' and row biases' under SP
    for params in stage_units(args, s):
        shard = math.ceil(sum(numel for numel, _ in params) / args.dp)
        psi_stage += shard * args.dp
        offset = 0  # where the parameter starts in the unit's flat buffer; the shard: [dS, dS + S)
        for numel, partial in params:
            if partial:
                overlap = min(offset + numel, (d + 1) * shard) - max(offset, d * shard)
                partial_elements += max(0, overlap)
            offset += numel
    m = args.microbatches if args.pp > 1 else 1
    tokens = (common.IMAGE // args.patch) ** 2
    # --mixed-precision: the activations and the all-gathered parameters bf16, the gradients fp32
    element = 2 if args.mixed_precision else 4
    act = element * (args.batch_size // args.dp) * tokens * args.dim  # bytes of [B/N, L, D]
    boundary = act // args.tp if args.sequence_parallel else act  # what crosses a stage boundary
    blocks = (s + 1) * args.depth // args.pp - s * args.depth // args.pp  # pipeline.Stage's cut
    first, last = s == 0, s == args.pp - 1
    dims = dict(tp={}, dp={}, pp={})  # {dimension: {kind: bytes a step}}
    if args.tp > 1 and args.sequence_parallel:
        # + the first block's input gradient gathered (first stage), the head's input (last)
        dims["tp"]["all_gather"] = (4 * blocks + first + last) * act
        dims["tp"]["reduce_scatter"] = 4 * blocks * act
        dims["tp"]["all_reduce"] = 4 * partial_elements
    elif args.tp > 1:
        dims["tp"]["all_reduce"] = 4 * blocks * act
    if args.dp > 1:
        reduces = m if args.zero_stage >= 2 else 1  # ZeRO-1 sums the micro-batches locally
        dims["dp"]["reduce_scatter"] = reduces * 4 * psi_stage
        gathers = 2 * m if args.zero_stage == 3 else 1
        dims["dp"]["all_gather"] = gathers * element * psi_stage
    if args.pp > 1:
        # a stage between the ends has two neighbours: activations on, gradients back, to each
        neighbours = 2 - first - last
        dims["pp"]["send"] = neighbours * boundary
        dims["pp"]["recv"] = neighbours * boundary
    comm = {}  # the report's comm: {kind: bytes a step}, every dimension together
    for traffic in dims.values():
        for kind, nbytes in traffic.items():
            comm[kind] = comm.get(kind, 0) + nbytes
    params_sharded = args.zero_stage == 3
    # ZeRO-1 hands the optimizer its own slice of the whole flat gradient, micro-batches or not
    # (the sum is reduce-scattered once, in place): the whole is what the Meter reads.
    grads_sharded = args.zero_stage >= 2
    rows = dict(
        param_bytes=4 * psi_stage // args.dp if params_sharded else 4 * psi_stage,
        grad_bytes=4 * psi_stage // args.dp if grads_sharded else 4 * psi_stage,
        optim_bytes=k * psi_stage // args.dp,
        comm=comm,
        dims=dims,
        notes=dict(
            param_bytes="4Ψ_s/N sharded" if params_sharded else f"4Ψ_s: stage {s} split by T",
            grad_bytes="4Ψ_s/N sharded" if grads_sharded else "4Ψ_s whole, m summed in it",
            optim_bytes=f"{k}Ψ_s/N",
            all_gather="dp: the updated shards (stage 3: each unit before each micro-batch's "
            "forward and backward); tp under SP: f's tokens, the head's, gradients",
            all_reduce="tp: g in forward, f in backward, 2 each a block; under SP the norms' "
            "and row biases' partial gradients in this rank's shards",
            reduce_scatter="dp: the stage's gradients, "
            + ("each micro-batch" if args.zero_stage >= 2 else "once a step, m summed locally")
            + "; tp under SP: g, f's grads",
            send="pp: act to each neighbour stage (m activations on, m gradients back)",
            recv="pp: act from each neighbour stage",
        ),
    )
    if args.mixed_precision:
        mixed_precision_rows(rows, psi_stage, args)
    return rows


def mixed_precision_rows(rows, psi_stage, args):
    """--mixed-precision: zero.py's mixed_precision_formula on the stage's Ψ_s over N = dp. The
    optimizer's parameters are the fp32 master shards (4Ψ_s/N at every stage); the gradients stay
    fp32 (whole at ZeRO-1), the state KΨ_s/N. The bf16 working copy that forward reads is no
    Parameter, so the Meter does not read it: `working_bytes`, 2Ψ_s/N at ZeRO-3, else 2Ψ_s."""
    stage3 = args.zero_stage == 3
    rows["param_bytes"] = 4 * psi_stage // args.dp
    rows["working_bytes"] = 2 * psi_stage // args.dp if stage3 else 2 * psi_stage
    working = "2Ψ_s/N" if stage3 else "2Ψ_s whole"
    rows["notes"]["param_bytes"] = f"4Ψ_s/N fp32 master shards; the bf16 working copy, {working}"
    rows["notes"]["all_gather"] = (
        "dp: the updated bf16 shards (stage 3: each unit before each micro-batch's forward and "
        "backward); tp under SP: f's tokens, the head's, gradients, bf16"
    )


def other_layout_formula(psi, k, args):
    """Data x context: DDP's copy on every rank, its gradients all-reduced over every rank. Data x
    expert: the dense part and E/ep experts. The ring's and the all-to-alls' traffic is measured
    (their own groups' rows); context_parallel.py and expert_parallel.py derive it."""
    own = psi
    if args.ep > 1:
        model = common.build_model(args)
        named = model.named_parameters()
        experts = sum(param.numel() for name, param in named if ".experts." in name)
        own = psi - experts + experts // args.ep
    comm = dict(all_reduce=4 * own) if args.cp > 1 else {}
    return dict(
        param_bytes=4 * own,
        grad_bytes=4 * own,
        optim_bytes=k * own,
        comm=comm,
        notes=dict(
            param_bytes="4Ψ" if args.cp > 1 else "4(Ψ_d + Ψ_e/ep)",
            grad_bytes="4Ψ" if args.cp > 1 else "4(Ψ_d + Ψ_e/ep)",
            optim_bytes=f"{k}Ψ" if args.cp > 1 else f"{k}(Ψ_d + Ψ_e/ep)",
            all_reduce="DDP over every rank: Ψ gradients" if args.cp > 1 else "",
        ),
    )


def resolve_mesh_sizes(args, world):
    """Set the one mesh size given as -1 ("the rest of the world") to world / the others, and
    refuse sizes whose product is not the world."""
    sizes = {dim: getattr(args, dim) for dim in MESH_DIMS}
    rest_dims = [dim for dim, size in sizes.items() if size == -1]
    common.check(
        len(rest_dims) <= 1 and all(size == -1 or size >= 1 for size in sizes.values()),
        f"mesh sizes {sizes}: each must be >= 1, and at most one -1 (the rest of the world)",
    )
    known_ranks = math.prod(size for size in sizes.values() if size != -1)
    given = " x ".join(f"--{dim} {sizes[dim]}" for dim in sizes if dim not in rest_dims)
    if rest_dims:
        covered = world % known_ranks == 0  # the -1 takes the quotient
    else:
        covered = known_ranks == world
    common.check(
        covered,
        f"{given} = {known_ranks} ranks, but the world size is {world}: "
        "the mesh must cover every rank once",
    )
    if rest_dims:
        setattr(args, rest_dims[0], world // known_ranks)


def check_args(args, world):
    """Resolve the one -1 ("the rest of the world") and refuse a layout that cannot work, before
    any process group is formed."""
    resolve_mesh_sizes(args, world)
    common.check(
        args.cp == 1 or args.pp == args.tp == args.ep == 1,
        "--cp composes with --dp only (the data x context layout): give --pp, --tp and --ep 1",
    )
    common.check(
        args.ep == 1 or args.pp == args.tp == args.cp == 1,
        "--ep composes with --dp only (the data x expert layout): give --pp, --tp and --cp 1",
    )
    common.check(
        args.zero_stage is None or args.cp == args.ep == 1,
        "--zero-stage is for the pp x dp x tp layout: data x context runs DDP, data x expert "
        "expert_parallel.py's averages",
    )
    if args.zero_stage is None:
        args.zero_stage = 1
    common.check(
        bool(args.experts) == (args.ep > 1),
        "--experts goes with --ep > 1 (the data x expert layout), and --ep > 1 with --experts",
    )
    common.check(
        not args.experts or args.experts % args.ep == 0,
        f"--experts {args.experts} is not divisible by --ep {args.ep}: each rank holds E/ep",
    )
    common.check(
        not args.simulate or args.cp == args.ep == 1,
        "--simulate runs the pp x dp x tp layout: data x context's DDP and data x expert's "
        "all-to-alls read values (its parameters' count, its tokens' routes), which meta has not",
    )
    common.check(
        not args.mixed_precision or args.cp == args.ep == 1,
        "--mixed-precision is ZeRO's (zero.py's recipe) in the pp x dp x tp layout: data x "
        "context and data x expert train in fp32",
    )
    common.check(
        args.tp > 1 or not args.sequence_parallel,
        "--sequence-parallel splits the tokens over the tensor-parallel ranks: give --tp > 1",
    )
    common.check(
        args.heads % args.tp == 0,
        f"--heads {args.heads} is not divisible by --tp {args.tp}: "
        "tensor parallelism gives every rank whole heads",
    )
    tokens = (common.IMAGE // args.patch) ** 2
    token_split = args.cp * (args.tp if args.sequence_parallel else 1)
    common.check(
        tokens % token_split == 0,
        f"the {tokens} tokens (--patch {args.patch}) are not divisible by the {token_split} "
        "ranks that split them (--cp, and --tp with --sequence-parallel)",
    )
    common.check(
        args.pp <= args.depth,
        f"--pp {args.pp} stages is more than --depth {args.depth} blocks",
    )
    common.check(
        args.microbatches >= 1,
        f"--microbatches must be >= 1, got {args.microbatches}",
    )
    dp_size = args.dp * args.ep
    shares = dp_size
    shares_named = f"the data-parallel size {dp_size}"
    if args.pp > 1:  # every data-parallel rank's batch is cut again into m micro-batches
        shares *= args.microbatches
        shares_named += f" x {args.microbatches} micro-batches"
    common.check(
        args.batch_size % shares == 0,
        f"--batch-size {args.batch_size} is not divisible by {shares_named}: "
        "every share must be equal",
    )
    common.check(
        args.pp == 1 or args.schedule != "1f1b" or args.microbatches >= args.pp,
        f"--schedule 1f1b needs --microbatches >= --pp: {args.microbatches} < {args.pp} "
        "(or use gpipe)",
    )


def setup(args):
    """Join the process group. torchrun (or common.launch) put RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT in the environment; LOCAL_RANK picks this process's GPU."""
    backend, device = common.pick_backend(args.backend)  # NCCL and a GPU per rank, else Gloo
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank, world = common.init_process_group(backend, device, args.timeout)
    return rank, world, device, backend


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def train(model, optimizer, scheduler, loader, sampler, args, device, step=0):
    """The loop every script shares: forward, loss, backward, step, schedule, log."""
    stop = args.max_steps or float("inf")
    world = dist.get_world_size() // args.pp  # the ranks that hold a loss: the last stage's
    loss_sum = torch.zeros((), device=device)  # stays on the device until a logging step
    losses_summed = 0
    last_loss = float("nan")
    for epoch in range(step // len(loader), args.epochs):
        if step >= stop:
            break
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        loader.dataset.set_epoch(epoch)  # and new augmentations (--shift), the same everywhere
        model.train()
        bar = common.progress(loader, args, epoch)
        for i, (x, y) in enumerate(bar):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            loss = train_step(model, x, y)  # forward, loss, backward (micro-batches when pp > 1)
            if args.clip:
                clip_grad_norm_(model, args.clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            loss_sum += loss.detach()
            losses_summed += 1
            if step % args.log_every == 0 or step >= stop or i + 1 == len(loader):
                # Only the last stage's ranks hold a loss (equal on its tp and cp ranks): average.
                dist.all_reduce(loss_sum)
                last_loss = loss_sum.item() / world / losses_summed
                loss_sum.zero_()
                losses_summed = 0
                common.log_loss(bar, args, epoch, step, last_loss)
            if step >= stop:
                break
        common.log(f"epoch {epoch}: step {step}, train loss {last_loss:.4f}")
    return dict(steps=step, loss=last_loss)


@torch.no_grad()
def evaluate(model, loader, device):
    """Exact: the loader pads every rank to the same number of batches (padding masked out), so
    every rank runs the same forward passes and collectives and each sample counts once."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=device)
    for x, y, keep in loader:
        x, y, keep = x.to(device), y.to(device), keep.to(device)
        logits = infer(model, x)  # stage to stage: the logits on one rank per data-parallel rank
        if logits is not None:
            counts += torch.stack([((logits.argmax(1) == y) & keep).sum(), keep.sum()])
    dist.all_reduce(counts)
    return counts[0].item() / max(counts[1].item(), 1)


def run(args):
    """One rank, in the seeds' order: join the group, deal the data, build the model, wrap it,
    train, evaluate, save on rank 0, leave the group."""
    rank, world, device, backend = setup(args)
    try:
        train_set, test_set, source = common.load_data(args, device)
        sizes = [getattr(args, dim) for dim in MESH_DIMS]
        mesh = init_device_mesh(device.type, sizes, mesh_dim_names=MESH_DIMS)
        # The data-parallel rank is the (dp, ep) coordinate, numbered row by row: ranks that differ
        # only in tp, cp or pp read the same samples (the experts' ranks read samples of their own).
        dp_mesh = mesh["dp"]
        ep_mesh = mesh["ep"]
        dp_rank = dp_mesh.get_local_rank() * ep_mesh.size() + ep_mesh.get_local_rank()
        dp_world = dp_mesh.size() * ep_mesh.size()
        sampler = DistributedSampler(
            train_set,
            num_replicas=dp_world,
            rank=dp_rank,
            shuffle=True,
            seed=args.seed,
            drop_last=True,
        )
        loader = DataLoader(
            train_set,
            batch_size=args.batch_size // dp_world,
            sampler=sampler,
            drop_last=True,
            pin_memory=device.type == "cuda",
            num_workers=args.workers,
            persistent_workers=args.workers > 0,  # started once, not every epoch
        )
        common.check(
            len(loader) > 0,
            f"{len(train_set)} training samples make no full batch of {args.batch_size}",
        )
        model = common.build_model(args)  # the same seeded weights on every rank
        if args.load:
            model.load_state_dict(common.load_state_dict_file(args.load, model.state_dict()))
        psi = sum(p.numel() for p in model.parameters())
        micro_batches = args.microbatches if args.pp > 1 else 1
        model = parallelize(
            model,
            mesh,
            device,
            args.zero_stage,
            args.schedule,
            micro_batches,
            sequence_parallel=args.sequence_parallel,
            mixed_precision=args.mixed_precision,
        )
        optimizer = common.make_optimizer(model.parameters(), args)
        hook_optimizer(model, optimizer)
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        common.log(
            f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data "
            f"({len(train_set)} train / {len(test_set)} test), "
            f"batch {args.batch_size} = {dp_world} x {args.batch_size // dp_world}"
        )
        with common.Meter(model, optimizer, args, device=device) as meter:
            out = train(model, optimizer, scheduler, loader, sampler, args, device)
        acc = None
        if not args.simulate:  # --simulate: meta tensors, no values to test or save
            test_loader = common.test_loader(
                test_set, dp_rank, dp_world, pin_memory=device.type == "cuda"
            )
            acc = evaluate(model, test_loader, device)
            state = full_state_dict(model, mesh)  # every rank takes part; rank 0 holds the whole
            if rank == 0 and args.save:
                common.save_checkpoint(state, args.save)
                common.log(f"saved {args.save}")
        common.report(
            SCRIPT,
            args,
            world=world,
            backend=backend,
            device=device,
            data=source,
            params=psi,
            trained=out,
            test_acc=acc,
            meter=meter,
            formula=formula(psi, world, args),
            **common.traffic_per_mesh_dimension(meter, mesh),
        )
    finally:
        cleanup()


def main():
    parser = common.get_parser(
        "Hybrid parallelism: ZeRO x TP x PP (or data x context, data x expert) on one DeviceMesh, "
        "from this codebase's own sections, on the common ViT",
        simulates=True,
    )
    rest_help = "-1: the rest of the world"
    parser.add_argument("--dp", type=int, default=-1, help=f"data-parallel ranks D; {rest_help}")
    parser.add_argument("--tp", type=int, default=1, help=f"tensor-parallel ranks T; {rest_help}")
    parser.add_argument("--pp", type=int, default=1, help=f"pipeline stages P; {rest_help}")
    parser.add_argument("--cp", type=int, default=1, help=f"context-parallel ranks; {rest_help}")
    parser.add_argument("--ep", type=int, default=1, help=f"expert-parallel ranks; {rest_help}")
    parser.add_argument(
        "--zero-stage",
        type=int,
        choices=[1, 2, 3],
        default=None,
        help="ZeRO over dp: 1 (the default) shards the optimizer state, 2 + the gradients, "
        "3 + the parameters; the pp x dp x tp layout only",
    )
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp > 1: the norms and residuals on T/tp tokens (Korthikanti et al. 2022)",
    )
    parser.add_argument(
        "--mixed-precision",
        action="store_true",
        help="ZeRO's bf16 parameters and compute, fp32 master weights and gradients in the shard; "
        "bf16 activations across the tp and pp boundaries",
    )
    parser.add_argument(
        "--microbatches", type=int, default=4, help="micro-batches per batch with --pp > 1 (m)"
    )
    parser.add_argument(
        "--schedule",
        choices=["gpipe", "1f1b"],
        default="1f1b",
        help="pipeline schedule with --pp > 1 (1f1b holds fewer activations)",
    )
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
