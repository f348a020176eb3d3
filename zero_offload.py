"""ZeRO-Offload and ZeRO-Infinity: zero.py's ZeRO stages 1-3 (its docstring has the split and its
formulas; `diff -u zero.py zero_offload.py` is the offload), the optimizer stepping an fp32 master
of each shard away from the device, whose shard stays the copy forward and the all-gathers read.

    --offload cpu, each step:         device                       CPU
        backward, unit by unit:       gradient shard  --copy-->    master.grad
        optimizer.step():                                          master, m, v stepped
        after the step:               shard           <--copy--    master
    --offload disk, unit by unit (a thread reads unit i+1's file meanwhile):
        DIR/zero-rank<r>-unit<i>.pt --read--> master, m, v --step--> file; master --> shard

Memory per rank, besides the stage's parameters and whole gradients on the device (zero.py's):
    --offload cpu:   device: no optimizer state; CPU: 4Ψ'/W master + 4Ψ'/W gradient + KΨ'/W state
    --offload disk:  device: 4Ψ'/W gradient shards until the step; CPU: one unit's master and KS
                     of state while it steps, the next unit's file being read; DIR: (4+K)Ψ'/W
Traffic per step, besides the stage's collectives: 4Ψ'/W device -> CPU and 4Ψ'/W CPU -> device,
on a GPU on a stream of their own; --offload disk also reads and writes (4+K)Ψ'/W of files.
--mixed-precision (the papers' setting): the device's parameters are bf16 (2 bytes an element)
and the fp32 master is the CPU's or the file's, rounded there: 2Ψ'/W bytes go to the device.
Papers: Ren et al. 2021, "ZeRO-Offload", https://arxiv.org/abs/2101.06840; Rajbhandari et al.
2021, "ZeRO-Infinity", https://arxiv.org/abs/2104.07857. More: docs/techniques.md (ZeRO-Offload).

    torchrun --standalone --nproc_per_node=4 zero_offload.py --stage 3 --offload cpu
    torchrun --standalone --nproc_per_node=4 zero_offload.py --offload disk --offload-dir DIR
"""

import functools
import os
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

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
    finished and the shards handed to the optimizer's pieces now, as the step's pre-hook does.
    With --offload disk they wait in the units until step_on_disk."""
    engine.before_step()
    if engine.offload == "disk":
        return [unit.grad_shard for unit in engine.units if unit.params]
    return [piece.grad for unit in engine.units for _, _, piece in unit.pieces]


### more: ZeRO-Offload and ZeRO-Infinity: the optimizer's step off the device
# The optimizer's parameters are fp32 master copies of the shards, on the CPU (--offload cpu) or in
# a file per unit (--offload disk), cut into the same pieces, each stepped with its group's
# hyperparameters; the device shard stays the copy that forward and the all-gathers read.


class ZeROOffload(Engine):
    """ZeRO's engine, with the optimizer's step moved off the device: ZeRO-Offload (Ren et al.
    2021, https://arxiv.org/abs/2101.06840) steps CPU masters, ZeRO-Infinity (Rajbhandari et al.
    2021, https://arxiv.org/abs/2104.07857) steps each unit from its file on disk. Each method
    does ZeRO's work and the offload's around it; offload "none" is ZeRO as it is."""

    def __init__(
        self, model, device, stage, modules, group=None, offload="none", directory=None, **options
    ):
        self.offload = offload  # make_unit reads it
        # the CPU the masters go to; under --simulate the meta device, which holds no values either
        self.host = torch.device("meta" if device.type == "meta" else "cpu")
        self.on_cpu = set()  # --offload cpu: the units whose master_grad holds this step's gradient
        super().__init__(model, device, stage, modules, group, **options)
        if offload == "cpu":
            self.copies = CopyStream(device)
        if offload == "disk":
            self.reader = ThreadPoolExecutor(1)  # reads the next unit's file while one steps
            # each process its own files, named by its rank in the world, not in the group: two
            # data-parallel groups sharing the directory number their ranks alike
            world_rank = dist.get_rank()
            for index, unit in enumerate(self.units):
                unit.path = os.path.join(directory, f"zero-rank{world_rank}-unit{index}.pt")

    def make_unit(self, model, module, name):
        """--offload cpu: the unit's master moved to the CPU, its pieces the optimizer's (and the
        module's, as ZeRO then lists them), and under mixed precision a CPU buffer for its bf16
        rounding. --offload disk under mixed precision: the pieces cut from the bf16 shard."""
        unit = super().make_unit(model, module, name)
        pin_memory = self.device.type == "cuda"
        if self.offload == "cpu":
            # mixed precision: the fp32 master moves, the bf16 shard stays the working copy
            source = unit.master if self.mixed_precision else unit.shard
            move_master_to_cpu(unit, source, self.host, pin_memory)
        if self.offload == "cpu" and self.mixed_precision:
            # ZeRO-Offload's Float2Half on the CPU: the stepped master is rounded to bf16 here, so
            # that 2 bytes an element cross to the device, not 4
            unit.rounded = torch.empty_like(unit.shard, device=self.host, pin_memory=pin_memory)
        if self.offload == "disk" and self.mixed_precision:
            # The optimizer steps nothing under --offload disk (step_on_disk steps the files), so
            # its pieces are cut from the bf16 shard, as they are from the shard without mixed
            # precision; the fp32 master leaves the device once it is in its file.
            unit.pieces = [
                (group, own, nn.Parameter(unit.shard[own])) for group, own, _ in unit.pieces
            ]
        return unit

    def hook(self, optimizer):
        """hook_optimizer's first hook: after each step, the stepped masters back to the device
        shards, before ZeRO's own hooks (stages 1-2's all-gathers read the shards). --offload disk
        writes the units' first files here, where the optimizer's class is known."""
        if self.offload == "disk":
            self.write_unit_files(optimizer)
        # torch calls a step hook as hook(optimizer, args, kwargs), with step()'s own arguments
        optimizer.register_step_post_hook(
            lambda optimizer, args, kwargs: self.masters_to_device(optimizer)
        )
        super().hook(optimizer)

    def start_flat_grad(self, unit):
        super().start_flat_grad(unit)
        if self.offload == "cpu" and unit.to_cpu is not None:
            # on a GPU the last backward's copy to the CPU may still be reading its source, at
            # stage 1 flat_grad's own slice, which this backward overwrites
            torch.cuda.current_stream().wait_event(unit.to_cpu)

    def finish_reduce_scatter(self):
        if self.reducing is None:
            return
        unit = self.reducing[0]
        super().finish_reduce_scatter()
        if self.offload == "cpu":
            self.gradient_to_cpu(unit)

    def gradient_to_cpu(self, unit):
        """ZeRO-Offload: the gradient shard to the CPU. On a GPU the copy runs on the copy stream,
        so the rest of backward's kernels do not queue behind it; the host waits for it before the
        step reads master_grad (before_step)."""
        if unit in self.on_cpu:
            # gradient accumulation: a later backward of the same step adds to the CPU copy, on
            # the host, once the earlier backward's copy has landed (a blocking copy)
            self.wait_for_gradient_copy(unit)
            unit.master_grad += unit.grad_shard.to(unit.master_grad.device)
        else:
            unit.to_cpu = self.copies.copy(unit.master_grad, unit.grad_shard)
            self.on_cpu.add(unit)
        unit.grad_shard = None

    def before_step(self):
        # Every unit's average first, for the offload's work below: stage 1's sums that no backward
        # reduce-scattered (Accumulation.before_step's, reduced past its hold), then the last
        # reduce-scatter, the first unit's (backward runs from the last unit to the first).
        for unit in self.units:
            if unit.backwards_held > 0:
                unit.backwards_held = 0
                super(Accumulation, self).reduce_scatter(unit)
        self.finish_reduce_scatter()
        if self.offload == "disk":
            return  # the gradient shards wait in the units: step_on_disk steps them after step()
        if self.offload == "cpu":
            # the step reads master_grad and writes master: every copy into or out of them done
            for unit in self.units:
                self.wait_for_gradient_copy(unit)
                self.wait_for_master_copy_on_host(unit)
                if unit in self.on_cpu:
                    unit.grad_shard = unit.master_grad  # the pieces are the CPU master's
                    self.on_cpu.discard(unit)  # the next step's first backward overwrites it
        super().before_step()

    def refresh_working_copy(self):
        """Mixed precision: masters_to_device, the step's post-hook before this one, has rounded
        the stepped masters into the bf16 shards already, from the CPU or the files."""
        if self.offload == "none":
            super().refresh_working_copy()

    @torch.no_grad()
    def gather_parameters(self):
        """--offload disk under mixed precision: the fp32 masters, which the mixed-precision part
        gathers, are in the files (once hook_optimizer has written them). Read back onto the
        device for the gather, they take 4Ψ'/W there, what the gradient shards took in training."""
        if not (self.offload == "disk" and self.mixed_precision):
            return super().gather_parameters()
        in_files = [unit for unit in self.on_disk() if unit.master is None]
        for unit in in_files:
            unit.master = torch.load(unit.path, weights_only=True)["master"].to(self.device)
        try:
            return super().gather_parameters()
        finally:
            for unit in in_files:
                unit.master = None

    @torch.no_grad()
    def masters_to_device(self, optimizer):
        """After the step: --offload disk steps the units from their files here, and the stepped
        master shards (CPU or disk) go back to the device shards."""
        if self.offload == "disk":
            self.step_on_disk(optimizer)
        if self.offload == "cpu":
            for unit in self.units:
                source = unit.master
                if self.mixed_precision:
                    unit.rounded.copy_(unit.master)  # before_step saw its last copy done
                    source = unit.rounded
                # on a GPU the host goes on at once; the next step waits before it writes the master
                unit.to_device = self.copies.copy(unit.shard, source)
            for unit in self.units:
                self.wait_for_master_copy(unit)

    # ZeRO-Offload on a GPU: waiting for the copies on the copy stream (none on a CPU device)

    def wait_for_gradient_copy(self, unit):
        """The host, before it reads the unit's master_grad: the gradient shard's copy landed."""
        if unit.to_cpu is not None:
            unit.to_cpu.synchronize()
            unit.to_cpu = None

    def wait_for_master_copy_on_host(self, unit):
        """The host, before the step writes the unit's master (and, after the step, its rounded
        copy): the copy to the shard has read it."""
        if unit.to_device is not None:
            unit.to_device.synchronize()
            unit.to_device = None

    def wait_for_master_copy(self, unit):
        """The compute stream, before anything reads the unit's shard (stages 1-2's all-gathers
        next, stage 3's next forward, full_state_dict; a collective waits for the compute stream):
        the stepped master is in it. The host goes on at once."""
        if unit.to_device is not None:
            torch.cuda.current_stream().wait_event(unit.to_device)

    # ZeRO-Infinity: the master shards and the optimizer state on disk, one unit in memory at a time

    def on_disk(self):
        """The units with a file: those holding parameters of their own (not only tied ones)."""
        return [unit for unit in self.units if unit.params]

    def write_unit_files(self, optimizer):
        """Each unit's file, written anew: its master shard and the empty state of an optimizer of
        `optimizer`'s class over it, a group per piece (made here, unstepped, only for its
        state_dict)."""
        for unit in self.on_disk():
            # mixed precision: the fp32 master, which then leaves the device; else the shard
            source = unit.master if self.mixed_precision else unit.shard
            master = source.to(self.host, copy=True)
            pieces = [nn.Parameter(master[own]) for _, own, _ in unit.pieces]
            empty_optimizer = type(optimizer)([{"params": [piece]} for piece in pieces])
            state = dict(master=master, optimizer=empty_optimizer.state_dict())
            save_atomically(state, unit.path)
            if self.mixed_precision:
                unit.master = None

    def step_on_disk(self, optimizer):
        """ZeRO-Infinity's step, after `optimizer.step()` has stepped nothing: none of its
        parameters (the device shards' pieces) has a .grad, so it skips them all and holds no
        state. It lends this step its class and each group's hyperparameters, the learning rate
        the schedule set. The units step one at a time, from their files; a thread reads the next
        unit's file while this one steps."""
        hyperparameters = [  # the optimizer's groups, in parallelize's param_groups order
            {key: value for key, value in group.items() if key != "params"}
            for group in optimizer.param_groups
        ]
        units = self.on_disk()
        reading = self.reader.submit(torch.load, units[0].path, weights_only=True)
        for index, unit in enumerate(units):
            saved = reading.result()
            if index + 1 < len(units):
                next_path = units[index + 1].path
                reading = self.reader.submit(torch.load, next_path, weights_only=True)
            self.step_unit(unit, saved, type(optimizer), hyperparameters)

    def step_unit(self, unit, saved, optimizer_class, hyperparameters):
        """One unit's step: an optimizer over its master shard alone, cut into the shard's pieces,
        each piece a group with its optimizer group's hyperparameters; its state from the file."""
        master = saved["master"]
        grad_shard = unit.grad_shard.to(self.host)
        unit.grad_shard = None
        unit_groups = []
        for _, own, _ in unit.pieces:
            piece = nn.Parameter(master[own])  # a view: stepping it steps the master
            piece.grad = grad_shard[own]
            unit_groups.append({"params": [piece]})
        unit_optimizer = optimizer_class(unit_groups)
        unit_optimizer.load_state_dict(saved["optimizer"])
        for (group, _, _), unit_group in zip(unit.pieces, unit_optimizer.param_groups, strict=True):
            unit_group.update(hyperparameters[group])  # the file holds the last step's
        unit_optimizer.step()
        state = dict(master=master, optimizer=unit_optimizer.state_dict())
        save_atomically(state, unit.path)
        unit.shard.copy_(master)  # rounded to bf16 under mixed precision


Engine = ZeROOffload


@torch.no_grad()
def move_master_to_cpu(unit, source, host, pin_memory):
    """ZeRO-Offload: the optimizer steps an fp32 master copy of the shard in CPU memory, next to its
    gradient, both allocated once. Pinned memory lets copies between it and the GPU run without the
    host waiting. The shard on the device stays, as the working copy. The master is cut into the
    shard's pieces (one per optimizer group), which become the unit's pieces. `source`: the shard,
    or under mixed precision its fp32 master (the device keeps the bf16 shard only). `host`: the
    CPU (the meta device under --simulate)."""
    unit.master = torch.empty_like(source, device=host, pin_memory=pin_memory)
    unit.master.copy_(source)
    unit.master_grad = torch.empty_like(unit.master, pin_memory=pin_memory)
    unit.pieces = [(group, own, nn.Parameter(unit.master[own])) for group, own, _ in unit.pieces]
    unit.to_cpu = None  # on a GPU: the event of the gradient shard's copy into master_grad
    unit.to_device = None  # on a GPU: the event of the stepped master's copy into the shard


def save_atomically(obj, path):
    """torch.save to a temporary file, forced to the disk, then renamed over `path`: killed at any
    moment, the process leaves the old file or the new one, whole."""
    temporary = f"{path}.tmp"
    with open(temporary, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


### more: the offload copies on a stream of their own (a GPU)


class CopyStream:
    """ZeRO-Offload's copies between the device and the CPU buffers. On a GPU they run on a CUDA
    stream of their own: on the compute stream every later kernel (the rest of backward, the next
    forward) would queue behind each PCIe transfer. The engine waits for a copy's event before it
    uses the copy: the host before the step reads or writes the CPU buffers, the compute stream
    before it reads a shard the copy wrote. On a CPU device the copies are plain ones, done when
    copy() returns."""

    def __init__(self, device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, destination, source):
        """Start copying `source` into `destination`; return the event that marks it done (None on
        a CPU device, where it is done)."""
        if self.stream is None:
            destination.copy_(source)
            return None
        # the source was just produced, or the destination is still read, on the compute stream
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            destination.copy_(source, non_blocking=True)
        if source.device.type == "cuda":
            # the engine drops the source now (a gradient shard): the allocator must not hand its
            # memory to the compute stream before this stream has read it
            source.record_stream(self.stream)
        done = torch.cuda.Event()
        done.record(self.stream)
        return done


### end: ZeRO


def formula(psi, world, args, dtype=torch.float32, tied=0, backwards=1, largest_shard=0):
    """ZeRO's per-rank bytes for Ψ' = psi (each unit padded to a multiple of W), which the report
    sets next to what the Meter measured. dtype: the model's parameters' (B bytes an element, 4 for
    fp32: the gradients and the optimizer state are in it too). tied: Ψ'_t, the elements of each
    unit holding a weight a later module uses too (tied_numel; GPT-2's embedding, which its head
    uses), once per such module: stage 3 all-gathers it once more a step, for that module's
    forward (its backward keeps it whole). backwards: the backward passes a step (gradient
    accumulation): stage 1 reduce-scatters once a step, stages 2-3 once a backward. --offload cpu:
    the parameters the optimizer steps are the CPU master shards, with their gradients. --offload
    disk: the optimizer holds one unit's state at a time, at most the largest shard's (S =
    largest_shard); the gradient shards wait in the engine, which the Meter (reading .grad) does
    not see. --mixed-precision: zero.py's formula without offload; with --offload cpu the master
    and its gradient are the model's dtype on the CPU, the device keeps the bf16 working copy
    (working_bytes); with --offload disk the master is in the files and the optimizer's
    parameters are the bf16 copy itself (param_bytes, 2 bytes an element); the all-gathers move
    bf16, the reduce-scatters fp32."""
    if args.mixed_precision and args.offload == "none":
        return mixed_precision_formula(psi, world, args, dtype, tied, backwards)
    b = dtype.itemsize  # B: bytes an element
    k = (2 if args.optim == "adamw" else 1) * b  # the ZeRO paper's K: optimizer bytes a parameter
    cpu = args.offload == "cpu"
    disk = args.offload == "disk"
    params_sharded = args.stage == 3 or cpu
    # --mixed-precision --offload disk: the parameters the Meter reads are the bf16 copy itself
    bf16_parameters = args.mixed_precision and disk
    param_b = 2 if bf16_parameters else b
    grads_sharded = args.stage >= 2 or cpu
    reductions = backwards if args.stage >= 2 else 1  # reduce-scatters of every unit a step
    # elements all-gathered a step: stage 3 gathers in every forward and backward
    gathered = backwards * (2 * psi + tied) if args.stage == 3 else psi
    # --mixed-precision: the flat gradient fp32, the working copy the all-gathers read bf16
    reduced = torch.float32 if args.mixed_precision else dtype
    working = torch.bfloat16 if args.mixed_precision else dtype
    copy_numel = psi // world if args.stage == 3 else psi  # the bf16 copy's: its shard at stage 3
    cpu_note = " (CPU)" if cpu else ""
    param_layout = f"{param_b}Ψ'/W sharded" if params_sharded else f"{param_b}Ψ' replicated"
    state_note = " in files" if disk else cpu_note
    return dict(
        param_bytes=param_b * psi // world if params_sharded else param_b * psi,
        grad_bytes=None if disk else (b * psi // world if grads_sharded else b * psi),
        optim_bytes=0 if disk else k * psi // world,
        optim_peak_bytes=k * largest_shard if disk else None,
        working_bytes=2 * copy_numel if args.mixed_precision and not disk else None,
        comm=dict(
            reduce_scatter=reductions * reduced.itemsize * psi,
            all_gather=working.itemsize * gathered,
        ),
        notes=dict(
            param_bytes=param_layout
            + cpu_note
            + (
                "; the bf16 copy forward reads, the fp32 master in the files"
                if bf16_parameters
                else ""
            )
            + (
                "; about two units whole besides, the one computing and the next"
                if args.stage == 3
                else ""
            ),
            grad_bytes=(
                "held by the engine until the step, not in .grad: not measured"
                if disk
                else (f"{b}Ψ'/W sharded" if grads_sharded else f"{b}Ψ' replicated") + cpu_note
            )
            + (
                "; in backward up to two units' whole flat gradients besides (the one "
                "reduce-scattered, the next filled), in the engine, not measured"
                if args.stage >= 2
                else ""
            ),
            optim_bytes=f"{k}Ψ'/W sharded "
            + ("AdamW m, v" if args.optim == "adamw" else "SGD momentum")
            + state_note,
            optim_peak_bytes=f"{k}S: the largest unit's shard, in memory while it steps",
            working_bytes="the bf16 copy forward reads, on the device: "
            + ("2Ψ'/W (and about two units whole in use)" if args.stage == 3 else "2Ψ' whole"),
            reduce_scatter=f"Ψ' {dtype_name(reduced)} gradients, "
            + reduced_when(args.stage, backwards)
            + "; a ring sends (W-1)/W of it",
            all_gather=gathered_note(args.stage, tied, backwards)
            + (" (bf16)" if args.mixed_precision else ""),
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
    if args.offload == "disk":
        directory = args.offload_dir
        writable = (
            directory is not None and os.path.isdir(directory) and os.access(directory, os.W_OK)
        )
        common.check(
            writable,
            "--offload disk needs --offload-dir DIR, an existing writable directory "
            f"(got {args.offload_dir})",
        )
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
        model = parallelize(
            model.to(device),
            device,
            args.stage,
            offload=args.offload,
            directory=args.offload_dir,
            units=units,
            **options,
        )
        # Ψ': every unit padded to a multiple of W (model.parameters() are the shards now)
        padded = world * sum(p.numel() for p in model.parameters())
        largest_shard = max(p.numel() for p in model.parameters())  # --offload disk's formula
        optimizer = common.make_optimizer(model.parameters(), args)
        hook_optimizer(model, optimizer)  # before the Meter's hook: its window sees the all-gather
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        common.log(
            f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data "
            f"({len(train_set)} train / {len(test_set)} test), "
            f"batch {args.batch_size} = {dp_world} x {args.batch_size // dp_world}"
        )
        # --mixed-precision: the bf16 copy forward reads is not a Parameter; the Meter reads it too
        # (with --offload disk it is: the optimizer's parameters, the fp32 master in the files)
        separate_copy = args.mixed_precision and args.offload != "disk"
        held = dict(working_bytes=lambda: working_copy(model)) if separate_copy else {}
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
            formula=formula(
                padded, world, args, dtype, tied_numel(model.zero), largest_shard=largest_shard
            ),
            params_padded=padded,
            offload=args.offload,
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
        "--offload",
        choices=["none", "cpu", "disk"],
        default="none",
        help="cpu: ZeRO-Offload, disk: ZeRO-Infinity (with --offload-dir)",
    )
    parser.add_argument(
        "--offload-dir", default=None, help="--offload disk: where each rank's unit files go"
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
