"""ZeRO stages 1-3, written out with torch.distributed. Like DDP, every rank trains on its slice of
each global batch; unlike DDP, the W ranks split what DDP replicates: the optimizer state (stage 1),
also the gradients (stage 2), also the parameters (stage 3). zero_offload.py adds ZeRO-Offload.

    a unit (a module) of n parameters, one flat buffer of W·S elements (S = ⌈n/W⌉, padded):
    [ shard 0 | shard 1 | ... | shard W-1 ]      rank r's optimizer steps shard r only

    backward, unit by unit:  the unit's gradient --reduce-scatter / W--> own shard of the average
    step:                    each rank steps its shards; stages 1-2 all-gather the updated shards
    stage 3:                 each unit all-gathered before its forward and its backward, freed after

Memory per rank (K: optimizer bytes a parameter, 8 for AdamW; Ψ' is Ψ, each unit padded to W·S;
N the largest unit's W·S): stage 1: 4Ψ' + 4Ψ' + KΨ'/W (DDP: (8+K)Ψ); stage 2: 4Ψ' + (4+K)Ψ'/W
+ 8N; stage 3: (8+K)Ψ'/W + 8N (two whole flat gradients in backward) + 8N (two units whole).
Communication per step: Ψ' reduce-scattered and Ψ' all-gathered, DDP's all-reduce in two halves;
stage 3 all-gathers every unit twice: 2Ψ'. A ring sends (W-1)/W of each collective's bytes. (Bytes
for fp32; under gradient accumulation stage 1 still reduce-scatters once a step, stages 2-3 once
a backward, and stage 3 gathers in every forward and backward: formula() has each case.)
Paper: Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", https://arxiv.org/abs/1910.02054. The stage table and prefetch: docs/techniques.md (ZeRO).

    torchrun --standalone --nproc_per_node=4 zero.py --stage 3
    python zero.py --nproc 4 --stage 3                 # the same, through mp.spawn on a free port
"""

import functools
import os
import warnings
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

import common

SCRIPT = os.path.splitext(os.path.basename(__file__))[0]


### begin: ZeRO
# Model contract: `units`, parallelize's argument, are the modules ZeRO flattens, in the order
# forward runs them (the ViT: [embed, *blocks, head]); together they hold every parameter of the
# model, each in one unit. Forward calls each unit's forward once, which returns a tensor (stage 3
# gathers the unit around it and around its backward); every parameter gets a gradient in every
# backward; the same weights on every rank's device. ZeRO talks on `group`, parallelize's argument:
# the data-parallel ranks, the world when None. Every collective runs on it, W is its size and a
# rank's shard is cut by its rank in it. After parallelize, model.parameters() are this rank's
# shards (count Ψ before it, for MFU): build the optimizer over model.zero.param_groups, drop the
# old one (see parallelize), call hook_optimizer; save with full_state_dict. What a language model
# needs besides (blocks returning tuples, tied weights, optimizer groups, gradient accumulation,
# clipping) and what a GPU wants (stage 3's prefetch, stage 1's average in place) follow the
# core, each in a `### more:` part that subclasses the engine parallelize builds, `Engine`.


class Unit:
    """One module's parameters as views into a single flat buffer, and this rank's shard of it:
    ZeRO's partitioning (Rajbhandari et al. 2019, section 5, https://arxiv.org/abs/1910.02054).

    flat    N = W·S elements: the parameters one after another, then zeros up to a multiple of W
    shard   flat[r·S:(r+1)·S]: what this rank's optimizer steps. At stage 3 it is a copy, so that
            `flat` can be freed whenever the unit is not in use.
    pieces  (optimizer group, its slice of the shard, nn.Parameter): what the optimizer steps,
            here one piece: the whole shard, in the one group
    """

    @torch.no_grad()  # copying the parameters in must not make `flat` part of autograd's graph
    def __init__(self, model, named_params, rank, world, stage):
        """named_params: the module's (state_dict key, Parameter) pairs in flat's order, as
        module.named_parameters(prefix=its name in `model`) yields them."""
        named_params = list(named_params)  # read all before the loop replaces them in the model
        numel = sum(param.numel() for _, param in named_params)
        self.shard_numel = (numel + world - 1) // world  # S: numel / W, rounded up
        self.flat = named_params[0][1].new_zeros(world * self.shard_numel)
        self.params = []  # (state_dict key, the tensor in the parameter's place, offset in flat)
        offset = 0
        for key, param in named_params:
            view = self.flat[offset : offset + param.numel()].view_as(param)
            view.copy_(param)
            tensor = replace_with_view(model, key, view)
            self.params.append((key, tensor, offset))
            offset += param.numel()
        self.shard = self.flat[rank * self.shard_numel : (rank + 1) * self.shard_numel]
        if stage == 3:
            self.shard = self.shard.clone()
        self.pieces = self.cut_into_pieces(rank)
        self.flat_grad = None  # the unit's whole gradient, while it exists (always, at stage 1)
        self.grad_shard = None  # this rank's shard of the averaged gradient, until the step
        self.grads_arrived = 0  # how many of its parameters' gradients this backward has produced

    def cut_into_pieces(self, rank):
        """The shard as the optimizer's parameters: one piece, all of it. nn.Parameter(shard)
        shares the shard's memory: stepping the piece steps the shard."""
        return [(0, slice(0, self.shard_numel), nn.Parameter(self.shard))]

    def is_whole(self):
        """Stage 3: whether `flat` has its memory (gathered, or being gathered into)."""
        return self.flat.untyped_storage().size() > 0

    def free(self):
        """Stage 3: give back the whole unit's memory (the shard keeps this rank's part). The
        storage shrinks to 0 bytes instead of `flat` being dropped because the parameters' tensors
        are views into it: they stay where the module expects them, without memory until
        allocate()."""
        self.flat.untyped_storage().resize_(0)

    def allocate(self):
        """Stage 3: the whole unit's memory back under `flat` and its views, to be all-gathered
        into (what it holds until then is undefined)."""
        self.flat.untyped_storage().resize_(self.flat.numel() * self.flat.element_size())


def replace_with_view(model, key, view):
    """Put a new leaf tensor whose .data is `view` where the parameter `key` was, and return it.

    Why not the view itself: a view shares its version counter with `flat`, so it would count every
    write into `flat`, and stage 3 writes into `flat` again before the backward (the all-gather).
    Autograd would then refuse the tensors it saved in the forward as modified in place. Setting
    .data keeps the new tensor's own version counter, which no write into `flat` moves."""
    tensor = torch.empty(0, dtype=view.dtype, device=view.device, requires_grad=True)
    tensor.data = view
    put_tensor(model, key, tensor)
    return tensor


def put_tensor(model, key, tensor):
    """`tensor`, a plain attribute (not an nn.Parameter), where the model's parameter `key` was:
    the model's Parameters are now only the units' shard pieces."""
    owner_name, _, attribute = key.rpartition(".")
    owner = model.get_submodule(owner_name)
    delattr(owner, attribute)
    setattr(owner, attribute, tensor)


class ZeRO:
    """The engine, kept at model.zero. Its hooks reduce-scatter each unit's gradient as soon as the
    unit's backward is done and, at stage 3, gather each unit's parameters just before forward or
    backward needs them and free them right after; before_step / after_step wrap the step. Its
    collectives run on `group`, the data-parallel ranks (the world when None); rank and world are
    this rank's place in it and its size."""

    def __init__(self, model, device, stage, modules, group=None):
        self.device = device  # where a part's clip_grad_norm_ adds up the squares
        self.stage = stage
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        name_of = {module: name for name, module in model.named_modules()}
        self.units = []
        for index, module in enumerate(modules):
            unit = self.make_unit(model, module, name_of[module])
            self.units.append(unit)
            # an attribute of the module, so that model.parameters() yields the pieces from now on
            module.shards = nn.ParameterList([piece for _, _, piece in unit.pieces])
            for _, tensor, offset in unit.params:
                hook = functools.partial(self.gradient_arrived, unit, offset)
                tensor.register_post_accumulate_grad_hook(hook)
            if stage == 3:
                unit.free()
                module.register_forward_pre_hook(functools.partial(self.before_forward, index))
                module.register_forward_hook(functools.partial(self.after_forward, index))
        # the optimizer's parameters: every unit's pieces, in one group
        pieces = [piece for unit in self.units for _, _, piece in unit.pieces]
        self.param_groups = [{"params": pieces}]

    def make_unit(self, model, module, name):
        """The unit of `module`, named `name` in the model: every parameter it holds."""
        return Unit(model, module.named_parameters(prefix=name), self.rank, self.world, self.stage)

    # stage 3 (the paper's P_p): a unit is whole only around its forward and its backward

    def before_forward(self, index, module, args):
        self.gather(index)

    def after_forward(self, index, module, args, output):
        self.units[index].free()
        if output.requires_grad:  # training: the gradient reaching it starts its backward
            output.register_hook(functools.partial(self.before_backward, index))

    def before_backward(self, index, grad):
        self.gather(index)

    @torch.no_grad()  # writes the parameters' values beneath autograd, as an optimizer step does
    def gather(self, index):
        """Unit `index` whole: all-gathered from the W ranks' shards, unless it is whole already."""
        unit = self.units[index]
        if not unit.is_whole():
            unit.allocate()
            dist.all_gather_into_tensor(unit.flat, unit.shard, group=self.group)

    # every stage (P_g from stage 2 on): a unit's gradient is reduce-scattered once it is whole

    @torch.no_grad()
    def gradient_arrived(self, unit, offset, tensor):
        """Autograd has put `tensor`'s gradient in .grad: move it into the unit's flat gradient. The
        model contract gives every parameter a gradient in every backward, so the unit's gradient
        is complete when all of its parameters' have arrived."""
        if unit.grads_arrived == 0:
            self.start_flat_grad(unit)
        unit.flat_grad[offset : offset + tensor.numel()].copy_(tensor.grad.flatten())
        tensor.grad = None  # the flat gradient holds it now: autograd's copy can go
        unit.grads_arrived += 1
        if unit.grads_arrived == len(unit.params):
            unit.grads_arrived = 0  # ready for the next backward
            self.reduce_scatter(unit)

    def start_flat_grad(self, unit):
        """The unit's first gradient of this backward: a flat gradient to collect them in."""
        if unit.flat_grad is None:
            unit.flat_grad = unit.flat.new_zeros(unit.flat.numel())  # the padding stays zero

    def reduce_scatter(self, unit):
        """Reduce-scatter the unit's gradient: rank r gets shard r of the average."""
        unit.flat_grad.div_(self.world)  # Σ_ranks grad/W: the global batch's mean gradient, as DDP
        output = self.average_buffer(unit)
        dist.reduce_scatter_tensor(output, unit.flat_grad, group=self.group)
        self.keep_average(unit, output)
        if self.stage >= 2:
            unit.flat_grad = None  # only this rank's shard of the gradient stays
        if self.stage == 3:
            unit.free()  # all its gradients are in: backward reads its parameters no more

    def average_buffer(self, unit):
        """Where the reduce-scatter puts this rank's shard of the unit's average: S elements."""
        return unit.flat_grad.new_empty(unit.shard_numel)

    def keep_average(self, unit, average):
        """This rank's shard of the unit's averaged gradient, until the step."""
        unit.grad_shard = average

    # the step (P_os, every stage): each rank steps its own shards

    def hook(self, optimizer):
        """The engine's work around each optimizer.step() (hook_optimizer's)."""
        # torch calls a step hook as hook(optimizer, args, kwargs), with step()'s own arguments
        optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: self.before_step())
        optimizer.register_step_post_hook(lambda optimizer, args, kwargs: self.after_step())

    def before_step(self):
        for unit in self.units:
            if unit.grad_shard is not None:  # None: handed to the pieces already this step
                for _, own, piece in unit.pieces:
                    piece.grad = unit.grad_shard[own]
                # the optimizer's now: stages 2-3 free it in zero_grad(set_to_none=True); at stage
                # 1 it stays until the next backward's average replaces it
                unit.grad_shard = None

    @torch.no_grad()
    def after_step(self):
        """Stages 1-2: the next forward needs every unit whole and updated everywhere. The shard is
        flat's own slice r, so the all-gather fills the rest of flat around it. (Stage 3 gathers
        each unit when it is needed.)"""
        if self.stage < 3:
            for unit in self.units:
                dist.all_gather_into_tensor(unit.flat, unit.shard, group=self.group)

    # the save: the whole parameters on the group's rank 0

    @torch.no_grad()
    def gather_parameters(self):
        """{state_dict key: the parameter, whole, on the CPU} on the group's rank 0 ({} elsewhere).
        Every rank sends its shard of each unit; rank 0 receives the W shards into a new buffer of
        flat's shape (at stage 3 flat has no memory now), in the group's rank order, and cuts it
        back into the parameters."""
        state = {}
        for unit in self.units:
            if self.rank != 0:
                dist.gather(unit.shard, group=self.group, group_dst=0)
                continue
            flat = unit.shard.new_empty(unit.flat.numel())
            dist.gather(unit.shard, list(flat.chunk(self.world)), group=self.group, group_dst=0)
            for key, tensor, offset in unit.params:
                view = flat[offset : offset + tensor.numel()].view_as(tensor)
                state[key] = view.to("cpu", copy=True)
        return state

    def full_state_dict(self, model):
        """full_state_dict's: the ViT's state_dict() is its parameters (it has no buffers)."""
        return self.gather_parameters()


# The engine parallelize builds: a `### more:` part plugs in here, with a subclass of it.
Engine = ZeRO


def parallelize(model, device, stage, *, units, group=None, **options):
    """ZeRO at `stage`, in place: the engine goes to model.zero and model.parameters() become the
    shards; make the optimizer over model.zero.param_groups, then hook_optimizer(model,
    optimizer). The model is already on `device`. `units`: the modules to flatten, in forward
    order (the contract). `group`: the data-parallel process group ZeRO shards over and talks on,
    the world when None. `options`: what the parts' engines take besides (param_groups: the
    optimizer's groups over the model's parameters, whose hyperparameters model.zero.param_groups
    keeps over the shards; gradient_accumulation_steps: the backward passes of each step, which
    stage 1 reduce-scatters once, at the last).

    The optimizer, rebuilt with the user's class, the old one dropped (else it keeps the model's
    original parameters alive):
        model = parallelize(model, device, 3, param_groups=optimizer.param_groups, units=units)
        optimizer = type(optimizer)(model.zero.param_groups)
        hook_optimizer(model, optimizer)"""
    model.zero = Engine(model, device, stage, units, group, **options)
    return model


def hook_optimizer(model, optimizer):
    """The engine's work around each optimizer.step(): the gradient shards handed to the optimizer
    before it, the updated shards all-gathered after it."""
    model.zero.hook(optimizer)


def full_state_dict(model):
    """The model's own state_dict(), whole, on the CPU of the group's rank 0 ({} on the others),
    so that a strict load_state_dict into the unsplit model accepts it. Every rank of ZeRO's group
    takes part."""
    return model.zero.full_state_dict(model)


### more: a unit whose forward returns a tuple (HuggingFace's blocks)


def output_tensors(output):
    """The tensors a unit's forward returned: the tensor, or those of a tuple (HuggingFace's blocks
    return (hidden_states, ...)), whose gradients start the unit's backward."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [item for item in output if isinstance(item, torch.Tensor)]
    return []


class TupleOutputs(Engine):
    """Stage 3: the unit's backward starts where the gradient reaches any tensor it returned."""

    def after_forward(self, index, module, args, output):
        self.units[index].free()
        for tensor in output_tensors(output):
            if tensor.requires_grad:  # training: the gradient reaching it starts its backward
                tensor.register_hook(functools.partial(self.before_backward, index))


Engine = TupleOutputs


### more: the user's units: each parameter in one, tied weights, optimizer groups
# A language model's units: every module holding parameters, in forward order, one holding only
# tied parameters too (nanoGPT: [wte, wpe, *h, ln_f, lm_head]). A parameter two units share
# (GPT-2's lm_head.weight is wte.weight) is flattened once, in the first unit; the other gets that
# unit's tensor in its place, so autograd sums its two gradients, and at stage 3 that unit is
# gathered for the other's forward and backward too. A module holding only tied parameters is no
# unit of its own. The optimizer's groups (parallelize's param_groups): each unit lays its
# parameters out group by group and cuts its shard where the groups meet, a piece per group.


class UserUnits(Engine):
    """ZeRO over the user's units: checked to hold every parameter once, a tied weight flattened
    once, the shards cut where the optimizer's groups meet (param_groups: the optimizer's groups
    over the model's parameters, dicts with "params" and hyperparameters, such as weight_decay;
    None: one group)."""

    def __init__(self, model, device, stage, modules, group=None, param_groups=None, **options):
        check_units(model, modules)
        # These three hold the model's original Parameters: dropped below, so that their memory
        # is freed once the units hold their values.
        self.group_of = optimizer_group_of(model, param_groups)  # Parameter -> group index
        self.owner = first_holders(modules)  # Parameter -> the module whose unit flattens it
        self.placed = {}  # Parameter -> (its unit, its state_dict key, the tensor in its place)
        owning = [module for module in modules if self.holds_first(module)]
        super().__init__(model, device, stage, owning, group, **options)
        self.tied = []  # (state_dict key, key of the same parameter in the unit holding it)
        self.lenders = []  # a unit's index once per later module using a parameter it holds
        self.tie_later_uses(model, modules)
        self.param_groups = groups_over_pieces(param_groups, self.units)
        del self.group_of, self.owner, self.placed

    def holds_first(self, module):
        """Whether `module` holds a parameter no earlier unit holds: it is a unit."""
        return any(self.owner[param] is module for param in module.parameters())

    def make_unit(self, model, module, name):
        """The unit of the parameters `module` holds first, group by group (a stable sort keeps the
        module's order within a group), so that each group is one range of flat and meets this
        rank's shard in one range."""
        own = [
            (key, param)
            for key, param in module.named_parameters(prefix=name)
            if self.owner[param] is module
        ]
        own.sort(key=lambda named: self.group_of[named[1]])
        groups = [self.group_of[param] for _, param in own]
        unit = GroupedUnit(model, own, self.rank, self.world, self.stage, groups)
        for (key, param), (_, tensor, _) in zip(own, unit.params, strict=True):
            self.placed[param] = (unit, key, tensor)
        return unit

    def tie_later_uses(self, model, modules):
        """Each parameter a later module holds too (still the original Parameter there, found in
        `placed`): the tensor its unit put in the first module's place goes in the later one's.
        At stage 3 the units holding them are whole around the later module's forward and
        backward too."""
        name_of = {module: name for name, module in model.named_modules()}
        for module in modules:
            borrowed = []  # the indices of the units holding a parameter this module uses too
            for key, param in list(module.named_parameters(prefix=name_of[module])):
                if param not in self.placed:
                    continue  # one of the module's shard pieces
                unit, owner_key, tensor = self.placed[param]
                put_tensor(model, key, tensor)
                self.tied.append((key, owner_key))
                if self.units.index(unit) not in borrowed:
                    borrowed.append(self.units.index(unit))
            self.lenders += borrowed
            if self.stage == 3 and borrowed:
                hook_borrowed(self, borrowed, module)

    def gather_parameters(self):
        """A tied parameter one tensor under both its keys, as the model's own."""
        state = super().gather_parameters()
        if state:  # the group's rank 0
            for key, owner_key in self.tied:
                state[key] = state[owner_key]
        return state


Engine = UserUnits


def state_key(module_name, name):
    """A parameter's key in the model's state_dict: the root module's own (the whole
    model as one unit) have no prefix."""
    return f"{module_name}.{name}" if module_name else name


def check_units(model, modules):
    """Every parameter of the model in exactly one unit, by the names the model lists it under (a
    tied one under each): a module left out would stay whole, unsharded, and a weight tied into it
    (nanoGPT's lm_head.weight) silently untied; a module in two units would be flattened twice."""
    name_of = {module: name for name, module in model.named_modules()}
    in_units = [
        state_key(name_of[module], name)
        for module in modules
        for name, _ in module.named_parameters(remove_duplicate=False)
    ]
    in_model = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    missing = [name for name in in_model if name not in in_units]
    twice = sorted({name for name in in_units if in_units.count(name) > 1})
    problems = []
    if missing:
        problems.append(f"in no unit: {missing}")
    if twice:
        problems.append(f"in two units: {twice}")
    if problems:
        raise ValueError(
            f"ZeRO's units must hold every parameter of the model once ({'; '.join(problems)}). "
            "Pass every module holding parameters, in forward order (one holding only a tied "
            "weight too, e.g. nanoGPT's lm_head)."
        )


def first_holders(modules):
    """Parameter -> the first of `modules` that holds it: the module whose unit flattens it."""
    owner = {}
    for module in modules:
        for param in module.parameters():
            owner.setdefault(param, module)
    return owner


class GroupedUnit(Unit):
    """A unit whose parameters lie in flat group by group (`groups`: each one's optimizer group, in
    flat's order), its shard cut where the groups meet."""

    def __init__(self, model, named_params, rank, world, stage, groups):
        self.groups = groups
        super().__init__(model, named_params, rank, world, stage)

    def cut_into_pieces(self, rank):
        """A piece per group whose range of flat overlaps the shard."""
        group_end = {}  # group -> where its range of flat ends
        for group, (_, tensor, offset) in zip(self.groups, self.params, strict=True):
            group_end[group] = offset + tensor.numel()
        group_end[self.groups[-1]] = self.flat.numel()  # the padding: the last group's
        pieces = []
        shard_start = rank * self.shard_numel
        group_start = 0
        for group, end in group_end.items():
            low = max(group_start, shard_start) - shard_start
            high = min(end, shard_start + self.shard_numel) - shard_start
            if low < high:
                own = slice(low, high)
                # nn.Parameter(view) shares the view's memory: stepping the piece steps flat
                pieces.append((group, own, nn.Parameter(self.shard[own])))
            group_start = end
        return pieces


def optimizer_group_of(model, param_groups):
    """Parameter -> the index of its optimizer group in `param_groups` (0 for every parameter
    without groups)."""
    groups = param_groups or [{"params": list(model.parameters())}]
    return {param: index for index, group in enumerate(groups) for param in group["params"]}


def groups_over_pieces(param_groups, units):
    """The optimizer's groups, their hyperparameters kept, their parameters now the shard pieces
    of every unit that hold the group's parameters (one group of all of them without groups)."""
    groups = []
    for index, group in enumerate(param_groups or [{}]):
        pieces = [piece for unit in units for at, _, piece in unit.pieces if at == index]
        groups.append({**group, "params": pieces})
    return groups


def hook_borrowed(engine, owners, module):
    """Stage 3, tied weights: the units `owners` (their indices), holding a parameter `module`
    uses too (GPT-2's head uses the embedding's wte.weight), whole around its forward and its
    backward too, gathered right after its own unit if it is one. In backward they stay whole
    until their own gradients are in: the embedding, the largest unit, for the whole backward."""

    def gather_owners(*_):
        for owner in owners:
            engine.gather(owner)

    def free_owners(module, args, output):
        for owner in owners:
            engine.units[owner].free()
        for tensor in output_tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(gather_owners)

    # registered after the engine's own hooks, so that torch runs them after those
    module.register_forward_pre_hook(gather_owners)
    module.register_forward_hook(free_owners)


### more: stage 3's prefetch: the next unit's all-gather while this one computes


class Prefetch(Engine):
    """Stage 3: each unit's all-gather started one unit ahead, as FSDP2 does: the network moves
    the next unit's parameters while this unit computes, off the critical path. gather() waits for
    it when the unit is needed."""

    def __init__(self, *args, **options):
        self.gathering = {}  # unit index -> work: the all-gathers in flight
        super().__init__(*args, **options)

    def before_forward(self, index, module, args):
        super().before_forward(index, module, args)
        self.prefetch(index + 1)

    def before_backward(self, index, grad):
        super().before_backward(index, grad)
        self.prefetch(index - 1)  # backward runs the units in reverse

    def gather(self, index):
        if index in self.gathering:
            self.gathering.pop(index).wait()  # prefetched: on its way
        else:
            super().gather(index)

    @torch.no_grad()  # writes the parameters' values beneath autograd, as an optimizer step does
    def prefetch(self, index):
        """Start unit `index`'s all-gather without waiting for it."""
        if not 0 <= index < len(self.units):
            return  # no unit there: before the embedding, or past the head
        unit = self.units[index]
        if index in self.gathering or unit.is_whole():
            return  # already on its way, or here (a unit a tied weight keeps whole)
        unit.allocate()
        self.gathering[index] = dist.all_gather_into_tensor(
            unit.flat, unit.shard, group=self.group, async_op=True
        )


Engine = Prefetch


### more: the reduce-scatter in flight while backward computes the units before it


class Overlap(Engine):
    """Each unit's reduce-scatter started, not waited for: the network moves the gradient while
    backward computes the units before it, off the critical path. One at a time, so that at most
    two whole gradients exist at once (the one being reduced, the next one filled)."""

    def __init__(self, *args, **options):
        self.reducing = None  # (unit, output, work): the reduce-scatter in flight, at most one
        super().__init__(*args, **options)

    def reduce_scatter(self, unit):
        """Start reduce-scattering the unit's gradient: rank r gets shard r of the average."""
        self.finish_reduce_scatter()
        unit.flat_grad.div_(self.world)  # Σ_ranks grad/W: the global batch's mean gradient, as DDP
        output = self.average_buffer(unit)
        work = dist.reduce_scatter_tensor(output, unit.flat_grad, group=self.group, async_op=True)
        self.reducing = (unit, output, work)
        if self.stage == 3:
            unit.free()  # all its gradients are in: backward reads its parameters no more

    @torch.no_grad()
    def gradient_arrived(self, unit, offset, tensor):
        """A later backward of the same step (gradient accumulation) reaches the unit whose
        reduce-scatter is still reading its flat gradient (a model that is one unit): that one
        finishes first, before the parts start the unit's next flat gradient, so that each sees
        the old one dropped (mixed precision then makes the new one fp32, not flat's bf16)."""
        if self.reducing is not None and self.reducing[0] is unit:
            self.finish_reduce_scatter()
        super().gradient_arrived(unit, offset, tensor)

    def finish_reduce_scatter(self):
        """Wait for the reduce-scatter in flight, if any, and keep its average as the unit's
        gradient shard; from stage 2 on, drop the whole gradient it read."""
        if self.reducing is None:
            return
        unit, output, work = self.reducing
        work.wait()
        self.reducing = None
        self.keep_average(unit, output)
        if self.stage >= 2:
            unit.flat_grad = None  # only this rank's shard of the gradient stays

    def before_step(self):
        # the last reduce-scatter: the first unit's (backward runs from the last unit to the first)
        self.finish_reduce_scatter()
        super().before_step()


Engine = Overlap


### more: stage 1's average in place, in its own slice of the whole gradient


class AverageInPlace(Engine):
    def average_buffer(self, unit):
        """At stage 1, this rank's own slice of the whole gradient, with no second buffer. Stage 1
        keeps the whole gradient anyway (it shards only the optimizer state), and output =
        input[r·S:(r+1)·S] is the layout NCCL's in-place reduce-scatter expects. Not for a later
        backward of the step (gradient accumulation): the earlier backward's average sits there."""
        if self.stage == 1 and unit.grad_shard is None:
            own_slice = slice(self.rank * unit.shard_numel, (self.rank + 1) * unit.shard_numel)
            return unit.flat_grad[own_slice]
        return super().average_buffer(unit)


Engine = AverageInPlace


### more: gradient accumulation (several backward passes a step)
# Stage 1 keeps each unit's whole gradient anyway (it shards only the optimizer state), so the
# step's backward passes add theirs into the unit's flat gradient and only the last one
# reduce-scatters the sum: one reduce-scatter a unit a step, however many backward passes, as
# DeepSpeed's stage 1 and Megatron "communicate only at gradient accumulation boundaries". The
# engine is told how many backward passes a step has (gradient_accumulation_steps, nanoGPT's and
# DeepSpeed's name) and counts each unit's: the count reaching it is the step's last backward, in
# whatever order a schedule runs them. Stages 2-3 hold no whole gradient between backward passes
# (that is their memory saving): each backward reduce-scatters, and its average is added to the
# unit's gradient shard, as .grad sums a step's backward passes without ZeRO.


class Accumulation(Engine):
    """gradient_accumulation_steps=k: the backward passes of each step (1: every backward is the
    step's last). At stage 1 a unit's k-th backward of the step reduce-scatters the sum of the k;
    the step reduce-scatters any sum no backward has (a step of fewer backward passes, or a loop
    that says none), so the step is exact whatever k is: k sets only how often ranks talk."""

    def __init__(self, *args, gradient_accumulation_steps=1, **options):
        if not (isinstance(gradient_accumulation_steps, int) and gradient_accumulation_steps >= 1):
            raise ValueError(
                f"gradient_accumulation_steps must be a whole number >= 1 (the backward passes "
                f"of each step), not {gradient_accumulation_steps!r}"
            )
        self.gradient_accumulation_steps = gradient_accumulation_steps
        super().__init__(*args, **options)

    def make_unit(self, model, module, name):
        unit = super().make_unit(model, module, name)
        unit.backwards_held = 0  # stage 1: backward passes flat_grad sums, not reduced yet
        return unit

    @torch.no_grad()
    def gradient_arrived(self, unit, offset, tensor):
        """After a held backward, flat_grad holds the step's sum so far: this backward's gradient
        is added to it, in flat_grad's dtype (fp32 under mixed precision), where the core's copy
        would overwrite it."""
        if unit.backwards_held == 0:
            super().gradient_arrived(unit, offset, tensor)
            return
        unit.flat_grad[offset : offset + tensor.numel()].add_(tensor.grad.flatten())
        tensor.grad = None
        unit.grads_arrived += 1
        if unit.grads_arrived == len(unit.params):
            unit.grads_arrived = 0
            self.reduce_scatter(unit)

    def reduce_scatter(self, unit):
        """Stage 1: the unit's gradient held, summed in flat_grad, until its k-th backward."""
        if self.stage == 1:
            unit.backwards_held += 1
            if unit.backwards_held < self.gradient_accumulation_steps:
                return  # the step's next backward adds to it
            unit.backwards_held = 0
        super().reduce_scatter(unit)

    def start_flat_grad(self, unit):
        """A later backward of the same step, after the unit was reduce-scattered (k = 1, or more
        backward passes than k): the average kept must be safe from this backward's writes."""
        if self.stage == 1 and unit.grad_shard is not None:
            # the average may sit in flat_grad's own slice, which this backward overwrites
            unit.grad_shard = unit.grad_shard.clone()
        super().start_flat_grad(unit)

    def keep_average(self, unit, average):
        if unit.grad_shard is None:
            super().keep_average(unit, average)
        else:
            unit.grad_shard += average  # a later backward of the same step

    def before_step(self):
        """Stage 1: a sum no backward has reduce-scattered (the loop ran fewer than k backward
        passes this step) is reduce-scattered now, before the step reads the shards."""
        for unit in self.units:
            if unit.backwards_held > 0:
                unit.backwards_held = 0
                super().reduce_scatter(unit)
        super().before_step()  # waits for the reduce-scatters in flight


Engine = Accumulation


### more: the checkpoint through the model's own state_dict(), and what ZeRO refuses or warns of


class Checkpoint(Engine):
    """The save through the model's own state_dict() (its persistent buffers, its state_dict hooks:
    Llama's fused wqkv saved as wq, wk, wv); model.state_dict() refused; a warning when the
    model's original parameters outlive parallelize."""

    def __init__(self, model, *args, **options):
        # the model's own Parameters, about to be replaced: hook() checks that none stays
        self.originals = [(name, weakref.ref(param)) for name, param in model.named_parameters()]
        super().__init__(model, *args, **options)
        self.refusal = model.register_state_dict_pre_hook(refuse_state_dict)

    def hook(self, optimizer):
        check_originals_dropped(self)
        super().hook(optimizer)

    @torch.no_grad()
    def full_state_dict(self, model):
        """The model's own state_dict() on the group's rank 0, with the whole parameters in their
        places, on the CPU."""
        whole = self.gather_parameters()
        if self.rank != 0:
            return {}
        state = state_dict_with(model, whole)
        return {key: tensor.cpu() for key, tensor in state.items()}


Engine = Checkpoint


def refuse_state_dict(module, prefix, keep_vars):
    """model.state_dict() under ZeRO would hold this rank's shards under made-up keys."""
    raise RuntimeError(
        "this model is sharded by ZeRO: its state_dict() would hold this rank's shards; "
        "use full_state_dict(model) for the model's own keys, whole"
    )


def check_originals_dropped(engine):
    """ZeRO's memory promise: the model's original parameters, whole, are freed once parallelize
    has replaced them. Whatever still holds one (the user's old optimizer, its param_groups kept in
    a variable) keeps the whole model alive beside the shards: stage 3 would then save nothing."""
    alive = [name for name, original in engine.originals if original() is not None]
    if alive:
        warnings.warn(
            f"ZeRO: {len(alive)} of the model's original parameters (e.g. {alive[0]}) are still "
            "referenced elsewhere, so their memory is not freed. Build the new optimizer and drop "
            "the old one: parallelize(model, ..., param_groups=optimizer.param_groups, units=...), "
            "then optimizer = type(optimizer)(model.zero.param_groups), keeping no other "
            "reference to the old optimizer or its groups.",
            stacklevel=2,
        )


def state_dict_with(model, whole):
    """model.state_dict() with each parameter whole[key] in its place (nn.Parameters again, as the
    model had them, the shards' ParameterLists out of sight), ZeRO's tensors back after it."""
    engine = model.zero
    parameters = {}  # one nn.Parameter per tensor: a tied weight stays one Parameter
    in_place = []  # (module, attribute, ZeRO's tensor there)
    for key, tensor in whole.items():
        if id(tensor) not in parameters:
            parameters[id(tensor)] = nn.Parameter(tensor, requires_grad=False)
        owner_name, _, attribute = key.rpartition(".")
        owner = model.get_submodule(owner_name)
        in_place.append((owner, attribute, getattr(owner, attribute)))
        delattr(owner, attribute)
        owner.register_parameter(attribute, parameters[id(tensor)])
    # the modules ZeRO gave its shards to (the engine named the list `shards` in each unit)
    shard_lists = [
        (module, module.shards)
        for module in model.modules()
        if isinstance(getattr(module, "shards", None), nn.ParameterList)
    ]
    for module, _ in shard_lists:
        del module.shards
    engine.refusal.remove()
    try:
        return model.state_dict()
    finally:
        engine.refusal = model.register_state_dict_pre_hook(refuse_state_dict)
        for module, shards in shard_lists:
            module.shards = shards
        for owner, attribute, tensor in in_place:
            delattr(owner, attribute)
            setattr(owner, attribute, tensor)


### more: mixed precision: bf16 working parameters, fp32 master weights in the shard
# The ZeRO paper's setting (section 3.1): forward and backward in bf16 (the parameters they read,
# what stage 3 all-gathers: 2 bytes an element), each rank's shard of the fp32 master weights and
# of the optimizer state; gradients reduce-scattered in fp32 into the fp32 shard (FSDP2's
# reduce_dtype, torchtitan's default), the step on the fp32 master, then the bf16 copy refreshed
# from it. Each unit's inputs are cast to bf16 and the model's output back to fp32, so the loss is
# computed in fp32, as FSDP2's MixedPrecisionPolicy with output_dtype=float32 on the root does.


class MixedPrecision(Engine):
    """mixed_precision=True: `flat` and the shard the all-gathers read in bf16, `master` the fp32
    shard the optimizer's pieces step; the flat gradient fp32."""

    def __init__(self, model, device, stage, modules, group=None, mixed_precision=False, **options):
        self.mixed_precision = mixed_precision  # make_unit reads it
        super().__init__(model, device, stage, modules, group, **options)
        if mixed_precision:
            for module in modules:
                module.register_forward_pre_hook(to_bf16)
            model.register_forward_hook(output_to_fp32)

    def make_unit(self, model, module, name):
        unit = super().make_unit(model, module, name)
        if self.mixed_precision:
            keep_master_in_fp32(unit, self.rank, self.stage)
        return unit

    def start_flat_grad(self, unit):
        """The bf16 gradients autograd hands are collected, and reduce-scattered, in fp32."""
        if self.mixed_precision and unit.flat_grad is None:
            unit.flat_grad = unit.flat.new_zeros(unit.flat.numel(), dtype=torch.float32)
        super().start_flat_grad(unit)

    @torch.no_grad()
    def after_step(self):
        if self.mixed_precision:
            self.refresh_working_copy()
        super().after_step()

    def refresh_working_copy(self):
        """The stepped fp32 master rounded into the bf16 shard, which the all-gathers read."""
        for unit in self.units:
            unit.shard.copy_(unit.master)

    def gather_parameters(self):
        """The fp32 master weights, whole, as one process holds them (not their bf16 copy)."""
        if not self.mixed_precision:
            return super().gather_parameters()
        working = [unit.shard for unit in self.units]
        for unit in self.units:
            unit.shard = unit.master
        try:
            return super().gather_parameters()
        finally:
            for unit, shard in zip(self.units, working, strict=True):
                unit.shard = shard


Engine = MixedPrecision


@torch.no_grad()
def keep_master_in_fp32(unit, rank, stage):
    """The unit's fp32 shard becomes `master`, the optimizer's (its pieces cut again over it);
    `flat` and its views, the parameters forward reads, become bf16, and `shard` the bf16 slice
    (stages 1-2) or copy (stage 3) of it that the all-gathers read."""
    unit.master = unit.shard.clone()
    unit.pieces = [(group, own, nn.Parameter(unit.master[own])) for group, own, _ in unit.pieces]
    unit.flat = unit.flat.to(torch.bfloat16)
    for _, tensor, offset in unit.params:
        tensor.data = unit.flat[offset : offset + tensor.numel()].view_as(tensor)
    unit.shard = unit.flat[rank * unit.shard_numel : (rank + 1) * unit.shard_numel]
    if stage == 3:
        unit.shard = unit.shard.clone()


def working_copy(model):
    """The bf16 tensors forward reads, as they are held between steps: each unit's whole flat
    copy at stages 1-2 (its shard a slice of it), its bf16 shard at stage 3 (the flat freed)."""
    return [tensor for unit in model.zero.units for tensor in (unit.flat, unit.shard)]


def to_bf16(module, args):
    """A unit's floating-point inputs in bf16, its parameters' dtype (FSDP2's
    cast_forward_inputs)."""
    return tuple(
        arg.to(torch.bfloat16) if torch.is_tensor(arg) and arg.is_floating_point() else arg
        for arg in args
    )


def output_to_fp32(module, args, output):
    """The model's floating-point outputs (the logits) in fp32, for the loss; a tuple's too. (A
    model that computes its loss inside its forward casts its logits there itself.)"""
    if isinstance(output, tuple):
        return tuple(output_to_fp32(module, args, item) for item in output)
    if torch.is_tensor(output) and output.is_floating_point():
        return output.float()
    return output


### more: gradient clipping over the shards


@torch.no_grad()
def clip_grad_norm_(model, max_norm):
    """torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) as one process computes it, for
    a model whose gradient no rank holds whole: call it after the step's last backward, before
    optimizer.step(). It hands the shards their gradients now (the step's pre-hook then finds them
    handed); the global 2-norm is the square root of every rank's sum of squares over its shards,
    summed: the shards split each unit's flat gradient, so every element counts once, a tied
    weight once (flattened once), the padding adds zero; summed over ZeRO's group, whose ranks hold
    the shards. Every rank scales its shards by the same factor. Returns the total norm, as
    torch's does."""
    shards = gradient_shards(model.zero)
    squares = torch.zeros((), device=model.zero.device)
    for grad in shards:
        squares += grad.square().sum().to(squares.device)
    dist.all_reduce(squares, group=model.zero.group)
    total_norm = squares.sqrt()
    scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)  # torch's own formula
    for grad in shards:
        grad.mul_(scale.to(grad.device))
    return total_norm


def gradient_shards(engine):
    """This rank's shard of the step's averaged gradient: the backward's last reduce-scatter
    finished and the shards handed to the optimizer's pieces now, as the step's pre-hook does."""
    engine.before_step()
    return [piece.grad for unit in engine.units for _, _, piece in unit.pieces]


### end: ZeRO


def formula(psi, world, args, dtype=torch.float32, tied=0, backwards=1):
    """ZeRO's per-rank bytes for Ψ' = psi (each unit padded to a multiple of W), which the report
    sets next to what the Meter measured. dtype: the model's parameters' (B bytes an element, 4 for
    fp32: the gradients and the optimizer state are in it too). tied: Ψ'_t, the elements of each
    unit holding a weight a later module uses too (tied_numel; GPT-2's embedding, which its head
    uses), once per such module: stage 3 all-gathers it once more a step, for that module's
    forward (its backward keeps it whole). backwards: the backward passes a step (gradient
    accumulation): stage 1 reduce-scatters once a step, stages 2-3 once a backward."""
    if args.mixed_precision:
        return mixed_precision_formula(psi, world, args, dtype, tied, backwards)
    b = dtype.itemsize  # B: bytes an element
    k = (2 if args.optim == "adamw" else 1) * b  # the ZeRO paper's K: optimizer bytes a parameter
    params_sharded = args.stage == 3
    grads_sharded = args.stage >= 2
    reductions = backwards if grads_sharded else 1  # reduce-scatters of every unit a step
    # elements all-gathered a step: stage 3 gathers in every forward and backward
    gathered = backwards * (2 * psi + tied) if args.stage == 3 else psi
    return dict(
        param_bytes=b * psi // world if params_sharded else b * psi,
        grad_bytes=b * psi // world if grads_sharded else b * psi,
        optim_bytes=k * psi // world,
        comm=dict(reduce_scatter=reductions * b * psi, all_gather=b * gathered),
        notes=dict(
            param_bytes=(
                f"{b}Ψ'/W sharded; about two units whole besides, the one computing and the next"
                if params_sharded
                else f"{b}Ψ' replicated"
            ),
            grad_bytes=(
                f"{b}Ψ'/W sharded; in backward up to two units' whole flat gradients besides (the "
                "one reduce-scattered, the next filled), in the engine, not measured"
                if grads_sharded
                else f"{b}Ψ' replicated"
            ),
            optim_bytes=f"{k}Ψ'/W sharded "
            + ("AdamW m, v" if args.optim == "adamw" else "SGD momentum"),
            reduce_scatter=f"Ψ' {dtype_name(dtype)} gradients, "
            + reduced_when(args.stage, backwards)
            + "; a ring sends (W-1)/W of it",
            all_gather=gathered_note(args.stage, tied, backwards),
        ),
    )


def tied_numel(engine):
    """Ψ'_t: the elements of each unit holding a weight a later module uses too, once per such
    module (the user's-units part finds them; the core alone, as the ViT, has none)."""
    return sum(engine.units[index].flat.numel() for index in getattr(engine, "lenders", []))


def dtype_name(dtype):
    """The notes' name of a dtype: fp32, bf16, fp16, else torch's."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    return names.get(dtype, str(dtype).removeprefix("torch."))


def reduced_when(stage, backwards):
    """When the gradients are reduce-scattered (the Accumulation part)."""
    if stage == 1:
        return "once a step, at its last backward"
    return f"once a backward ({backwards} a step)" if backwards > 1 else "once a backward"


def gathered_note(stage, tied, backwards):
    """The all-gather row's note: what is gathered a step, and when."""
    if stage < 3:
        return "Ψ' updated parameters, after the step"
    note = "2Ψ' + Ψ'_t" if tied else "2Ψ'"
    note += ": every unit before its forward and its backward"
    if tied:
        note += "; a tied weight's unit once more, for the other module using it"
    if backwards > 1:
        note += f"; in each of the step's {backwards} backward passes"
    return note


def mixed_precision_formula(psi, world, args, dtype=torch.float32, tied=0, backwards=1):
    """--mixed-precision: the optimizer's parameters are the master shards, in the model's dtype
    (BΨ'/W at every stage, 4Ψ'/W for fp32), the gradients fp32 (whole at stage 1, where the
    average stays in place, else the shard), the state K'Ψ'/W (AdamW's m and v: the paper's K = 12
    is the master's 4 and these 8). The bf16 working copy that forward reads is not a Parameter, so
    the Meter does not read it: `working_bytes`, 2Ψ' whole at stages 1-2, 2Ψ'/W (the bf16 shard)
    at stage 3. The all-gathers move bf16, the reduce-scatters fp32, each as often as formula's.
    docs/techniques.md sets it next to the paper's Table 1."""
    b = dtype.itemsize  # the master's bytes an element
    k = (2 if args.optim == "adamw" else 1) * b  # optimizer state bytes a parameter, master apart
    stage3 = args.stage == 3
    reductions = backwards if args.stage >= 2 else 1  # reduce-scatters of every unit a step
    gathered = backwards * (2 * psi + tied) if stage3 else psi  # elements all-gathered a step
    # The paper's Table 1 (https://arxiv.org/abs/1910.02054): 2 bytes a parameter, 2 a gradient
    # and K = 12 of Adam's state (the fp32 master, momentum, variance), each sharded from its stage
    # on. This recipe differs in one place: its gradients are fp32 (+2 bytes each held), reduced
    # in fp32 as FSDP2's reduce_dtype=float32 and torchtitan's default do.
    paper_bytes = {1: 4 * psi + 12 * psi / world, 2: 2 * psi + 14 * psi / world}
    paper = dict(model_states=paper_bytes.get(args.stage, 16 * psi / world))
    return dict(
        param_bytes=b * psi // world,
        grad_bytes=4 * psi // world if args.stage >= 2 else 4 * psi,
        optim_bytes=k * psi // world,
        working_bytes=2 * psi // world if stage3 else 2 * psi,
        comm=dict(reduce_scatter=reductions * 4 * psi, all_gather=2 * gathered),
        paper=paper if args.optim == "adamw" else {},
        notes=dict(
            param_bytes=f"{b}Ψ'/W {dtype_name(dtype)} master shards",
            working_bytes="the bf16 copy forward reads: "
            + ("2Ψ'/W (and about two units whole in use)" if stage3 else "2Ψ' whole"),
            model_states="the four rows below; the paper counts 2-byte gradients",
            paper="ZeRO Table 1, mixed precision with Adam: 2Ψ + 2Ψ + KΨ, K = 12, "
            + {1: "4Ψ + 12Ψ/W", 2: "2Ψ + 14Ψ/W"}.get(args.stage, "16Ψ/W")
            + " (https://arxiv.org/abs/1910.02054)",
            grad_bytes=(
                "4Ψ'/W fp32 shard; in backward up to two units' whole fp32 flat gradients"
                if args.stage >= 2
                else "4Ψ' fp32: the whole flat gradient, the average in its own slice"
            ),
            optim_bytes=f"{k}Ψ'/W sharded "
            + ("AdamW m, v" if args.optim == "adamw" else "SGD momentum"),
            reduce_scatter="Ψ' fp32 gradients, " + reduced_when(args.stage, backwards),
            all_gather=gathered_note(args.stage, tied, backwards) + " (bf16)",
        ),
    )


def check_args(args, world):
    common.check(
        args.batch_size % world == 0,
        f"--batch-size {args.batch_size} is not divisible by world size {world}: "
        "every rank must get the same whole number of samples per step",
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
    world = dist.get_world_size()
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
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if args.clip:
                clip_grad_norm_(model, args.clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            loss_sum += loss.detach()
            losses_summed += 1
            if step % args.log_every == 0 or step >= stop or i + 1 == len(loader):
                dist.all_reduce(loss_sum)  # each rank's loss is its slice's: average them
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
        counts += torch.stack([((model(x).argmax(1) == y) & keep).sum(), keep.sum()])
    dist.all_reduce(counts)
    return counts[0].item() / max(counts[1].item(), 1)


def run(args):
    """One rank, in the seeds' order: join the group, deal the data, build the model, wrap it,
    train, evaluate, save on rank 0, leave the group."""
    rank, world, device, backend = setup(args)
    try:
        train_set, test_set, source = common.load_data(args, device)
        dp_rank, dp_world = rank, world  # every rank is a data-parallel rank
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
        dtype = next(model.parameters()).dtype  # the formula's bytes an element
        units = [model.embed, *model.blocks, model.head]  # ZeRO's units, in forward order
        # --mixed-precision is a `### more:` part's option: the core alone takes none
        options = dict(mixed_precision=True) if args.mixed_precision else {}
        model = parallelize(model.to(device), device, args.stage, units=units, **options)
        # Ψ': every unit padded to a multiple of W (model.parameters() are the shards now)
        padded = world * sum(p.numel() for p in model.parameters())
        optimizer = common.make_optimizer(model.parameters(), args)
        hook_optimizer(model, optimizer)  # before the Meter's hook: its window sees the all-gather
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        common.log(
            f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data "
            f"({len(train_set)} train / {len(test_set)} test), "
            f"batch {args.batch_size} = {dp_world} x {args.batch_size // dp_world}"
        )
        # --mixed-precision: the bf16 copy forward reads is not a Parameter; the Meter reads it too
        held = dict(working_bytes=lambda: working_copy(model)) if args.mixed_precision else {}
        with common.Meter(model, optimizer, args, device=device, held=held) as meter:
            out = train(model, optimizer, scheduler, loader, sampler, args, device)
        acc = None
        if not args.simulate:  # --simulate: meta tensors, no values to test or save
            test_loader = common.test_loader(
                test_set, dp_rank, dp_world, pin_memory=device.type == "cuda"
            )
            acc = evaluate(model, test_loader, device)
            state = full_state_dict(model)  # every rank takes part; rank 0 holds the whole
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
            formula=formula(padded, world, args, dtype, tied_numel(model.zero)),
            params_padded=padded,
        )
    finally:
        cleanup()


def main():
    parser = common.get_parser(
        "ZeRO stages 1-3 written out with torch.distributed, on the common ViT", simulates=True
    )
    parser.add_argument(
        "--stage",
        type=int,
        choices=[1, 2, 3],
        default=1,
        help="1: shard the optimizer state, 2: + the gradients, 3: + the parameters",
    )
    parser.add_argument(
        "--mixed-precision",
        action="store_true",
        help="bf16 parameters and compute, fp32 master weights and gradients in the shard",
    )
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
