"""Expert parallelism: a mixture-of-experts ViT (--experts E --top-k K) whose experts live on
different ranks. Each of W ranks holds the dense part whole and trains on its slice of each batch,
and owns E/W whole experts of every MoE block. The router picks each token's K experts; the token
travels to the ranks that own them (dispatch, an all-to-all) and the outputs travel back (combine).

    rank 0 owns experts 0, 1                rank 1 owns experts 2, 3        E = 4, W = 2, K = 1
    tokens      a  b  c  d                  tokens      e  f  g  h
    router      0  2  1  3                  router      3  0  2  1
    by expert   a  c | b  d                 by expert   f  h | g  e      to rank 0 | to rank 1
    received    a  c | f  h                 received    b  d | g  e      from 0 | from 1
    expert 0 runs on a f, expert 1 on c h   expert 2 on b g, expert 3 on d e; outputs go back

Memory per rank (fp32, AdamW): 16(Ψ_d + Ψ_e/W), the dense part Ψ_d replicated, the experts split.
Communication per step, per MoE layer: 2 all-to-alls of k·b·T rows of D forward, 2 backward
(b = batch/W), one of the E token counts; the Ψ_d dense gradients all-reduced in depth + 2
buckets on a process group of their own; --clip: one scalar all-reduce over the expert group.
Papers: Lepikhin et al. 2020, "GShard", https://arxiv.org/abs/2006.16668; Fedus et al. 2021,
"Switch Transformers", https://arxiv.org/abs/2101.03961. More in docs/techniques.md (experts).

    torchrun --standalone --nproc_per_node=4 expert_parallel.py --experts 8 --top-k 2
    python expert_parallel.py --nproc 2 --experts 4 --top-k 2
    python expert_parallel.py --experts 4                       # a world of one: every expert here
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

import common

SCRIPT = os.path.splitext(os.path.basename(__file__))[0]


### begin: Expert parallel
# Model contract: each MoE layer calls its experts module as torchtitan's MoE calls its
# GroupedExperts: `experts(rows [N, D], counts [E])` -> [N, D], the rows grouped by expert (the
# counts[0] rows of expert 0 first, then expert 1's, ...) and the outputs in the same order; its
# forward runs whatever experts the module holds on as many counts. The module is a list of E
# expert modules (an nn.ModuleList whose forward runs each on its rows, as common/moe.py's
# Experts), or, with the `style` of the part `### more: stacked experts`, one module holding only
# parameters stacked [E, ...] (torchtitan's GroupedExperts: w1, w2, w3 run by a grouped matmul).
# The router, the sort by expert, the weights and the sum over each token's K experts stay the
# model's. parallelize takes the experts modules (None: every module the model names `experts`,
# wherever it sits). Every other parameter is dense: hook_optimizer averages its gradient over the
# data-parallel ranks before each step, however many backward passes the step sums.
# Two groups, None meaning the world for each. The expert group, the ranks the E experts are spread
# over (its size divides E), is parallelize's, full_state_dict's and clip_grad_norm_'s `group`.
# The data-parallel group, every rank that trains on a slice of its own and holds the same dense
# part, is hook_optimizer's `data_group`: the expert group times `replica_group`, the ranks that
# hold this rank's experts (None: the expert group is every data-parallel rank). The dense
# all-reduces started during backward, on a group of their own, over your model's units, and
# clipping: the `### more:` parts after the core.

# GShard (Lepikhin et al. 2020, https://arxiv.org/abs/2006.16668) and Switch Transformers (Fedus
# et al. 2021, https://arxiv.org/abs/2101.03961): each rank holds the dense part whole and E/W
# experts; each token travels to the ranks of the experts the router picked for it, and back.
#
#   the model:    tokens -> router -> rows sorted by expert, counts
#   the section:  -> all-to-all (dispatch) -> the rows regrouped by this rank's expert
#   the model:    -> its experts module, holding this rank's E/W experts
#   the section:  -> regrouped by source rank -> all-to-all (combine)
#   the model:    -> each token's K outputs, summed with the router's weights
#
# The dense gradients are averaged over the ranks as DDP's are; an expert's gradient is already
# whole on its owner: the all-to-alls brought it every token routed to that expert.


class AllToAll(torch.autograd.Function):
    """all_to_all_single over `group` with uneven splits: x's first send_splits[0] rows go to the
    group's rank 0, the next send_splits[1] to its rank 1, ...; the output stacks the
    recv_splits[r] rows from each rank r in rank order. Its backward is the reverse all-to-all:
    each gradient row goes back where its row came from."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.send_splits = send_splits
        ctx.recv_splits = recv_splits
        ctx.group = group
        out = x.new_empty(sum(recv_splits), *x.shape[1:])
        dist.all_to_all_single(
            out,
            x.contiguous(),
            output_split_sizes=recv_splits,
            input_split_sizes=send_splits,
            group=group,
        )
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(sum(ctx.send_splits), *grad.shape[1:])
        dist.all_to_all_single(
            out,
            grad.contiguous(),
            output_split_sizes=ctx.send_splits,
            input_split_sizes=ctx.recv_splits,
            group=ctx.group,
        )
        return out, None, None, None


class ExpertParallel:
    """One experts module spread over the expert group (group; None: the world) of W ranks: the
    module keeps this rank's E/W experts, and two hooks route each call's rows around its own
    forward. Rank r of the group, its position in it, holds experts r·E/W .. (r+1)·E/W - 1. The
    module is a list of E experts (an nn.ModuleList); a part below, by subclassing, takes stacked
    parameters. Found again as `experts.expert_parallel`."""

    def __init__(self, experts, group=None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.num_experts = self.count_experts(experts)  # E, on every rank
        if self.num_experts % self.world:
            raise ValueError(f"{self.num_experts} experts do not split over {self.world} ranks")
        self.experts_per_rank = self.num_experts // self.world
        first = dist.get_rank(group) * self.experts_per_rank
        self.keep_own_experts(experts, range(first, first + self.experts_per_rank))
        experts.register_forward_pre_hook(self.dispatch)
        experts.register_forward_hook(self.combine)
        experts.expert_parallel = self

    def count_experts(self, experts):
        if not isinstance(experts, nn.ModuleList):
            raise ValueError(
                f"{type(experts).__name__} is not a list of experts: for parameters stacked "
                "[E, ...], give parallelize the style of the part '### more: stacked experts'"
            )
        return len(experts)

    def keep_own_experts(self, experts, owned):
        """Drop the other ranks' experts: the list renumbers the ones it keeps from 0, as its
        forward indexes them."""
        del experts[owned.stop :]
        del experts[: owned.start]

    def join(self, prefix, parts):
        """This module's entries in the unsplit model's keys, from each rank's (parts[r]; the
        keys under `prefix`, the module's name): expert j of rank r is expert r·E/W + j."""
        joined = {}
        for rank, part in enumerate(parts):
            for key, value in part.items():
                if key.startswith(prefix):
                    local_index, rest = key[len(prefix) :].split(".", 1)
                    index = rank * self.experts_per_rank + int(local_index)
                    joined[f"{prefix}{index}.{rest}"] = value
        return joined

    def dispatch(self, experts, args):
        """The forward pre-hook: the model's rows, grouped by its E experts, go to the ranks that
        own them (experts are numbered owner by owner: grouped by expert is grouped by rank), and
        the module gets the rows its own experts received, grouped by its experts, and their
        counts."""
        rows, counts = args
        sent_counts = counts.to(torch.long)
        received_counts = torch.empty_like(sent_counts)
        # Even splits of E/W: rank r gets the counts for its own experts, from every rank in order.
        dist.all_to_all_single(received_counts, sent_counts, group=self.group)
        # The section's one host sync a layer (a list's loop waits once more, as it does alone):
        # the uneven all-to-alls, and backward's, take their split sizes as host integers.
        both = torch.stack([sent_counts, received_counts]).view(2, self.world, -1)
        sent, received = both.tolist()  # [W][E/W]: rows to (from) rank r's (this rank's) j-th
        self.send_splits = [sum(per_expert) for per_expert in sent]
        self.recv_splits = [sum(per_expert) for per_expert in received]
        self.received = received
        arrived = AllToAll.apply(rows, self.send_splits, self.recv_splits, self.group)
        # They arrive grouped by source rank, then by expert: the experts want them by expert.
        by_expert = swap_chunk_order(arrived, received)
        local_counts = received_counts.view(self.world, -1).sum(0)
        return by_expert, local_counts.to(counts.dtype)

    def combine(self, experts, args, output):
        """The forward hook: the outputs, grouped by source rank again, go back where their rows
        came from (the reverse all-to-all), in the order the model sent them."""
        # received[r][j] transposed: the output's rows of this rank's expert j from rank r
        sizes = [
            [from_rank[j] for from_rank in self.received] for j in range(self.experts_per_rank)
        ]
        by_source = swap_chunk_order(output, sizes)
        return AllToAll.apply(by_source, self.recv_splits, self.send_splits, self.group)


def swap_chunk_order(x, sizes):
    """x's rows in chunks ordered (i, j), chunk (i, j) of sizes[i][j] rows, reordered (j, i).
    Rank 0 of 2, experts 0 and 1, sizes = received = [[2, 1], [0, 3]]:
        arrived   e0 e0 e1 | e1 e1 e1      by source rank (0 | 1), then expert
        returned  e0 e0 | e1 e1 e1 e1      by expert (0 | 1), then source rank"""
    chunks = x.split([size for row in sizes for size in row])
    rows, columns = len(sizes), len(sizes[0])
    return torch.cat([chunks[i * columns + j] for j in range(columns) for i in range(rows)])


def parallelize(model, device, group=None, experts=None, style=ExpertParallel):
    """Spread each experts module (experts; None: every module of the model named `experts`)
    over the expert group, as `style` holds them (ExpertParallel: a list; its subclass in the part
    `### more: stacked experts`: stacked parameters), and move the model to the device: the other
    ranks' experts never reach it.
    group: the ranks the E experts are spread over (None: the world); beside data parallelism on
    another mesh dimension, the DeviceMesh's expert dimension, mesh["ep"].get_group()."""
    if experts is None:
        named = model.named_modules()
        experts = [module for name, module in named if name.split(".")[-1] == "experts"]
    if not experts:
        raise ValueError("no experts module: pass parallelize the model's experts modules")
    for module in experts:
        style(module, group)
    return model.to(device)


def expert_layers(model):
    """(name, module) of each experts module parallelize spread, in the model's module order."""
    named = model.named_modules()
    return [(name, module) for name, module in named if hasattr(module, "expert_parallel")]


def expert_params(model):
    """The parameters of this rank's experts, every MoE layer's."""
    return [p for _, module in expert_layers(model) for p in module.parameters()]


class StepAverager:
    """Averages every gradient over the W data-parallel ranks before the step, as DDP would.

    The data-parallel ranks (data_group; None: the world) each train on their slice of the batch
    and hold the same dense part. They are the expert group (parallelize's) times replica_group:
    the ranks that hold the same experts as this one, one in each copy of the expert group (None:
    one copy, the expert group is every data-parallel rank).

    The dense gradients: all-reduced and divided by W as DDP's, in one flat bucket. The expert
    gradients need no all-reduce within the expert group: the all-to-alls already brought every
    token routed to an expert, from every rank of the group, to its one owner; with several
    copies, one all-reduce over replica_group adds the other copies'. Each rank's loss is the mean
    over its slice, so what the owner then holds is the sum of W ranks' mean gradients, W times
    the gradient of the global batch's mean: only the scale, 1/W, is missing."""

    def __init__(self, model, data_group=None, replica_group=None):
        self.group = data_group
        self.replica_group = replica_group
        self.world = dist.get_world_size(data_group)
        copies = 1 if replica_group is None else dist.get_world_size(replica_group)
        expert_group_size = expert_layers(model)[0][1].expert_parallel.world
        if self.world != expert_group_size * copies:
            raise ValueError(
                f"{self.world} data-parallel ranks are not {expert_group_size} ranks of "
                f"the expert group times {copies} copies of it: pass replica_group, the ranks "
                "that hold this rank's experts"
            )
        self.experts = expert_params(model)
        is_expert = {id(p) for p in self.experts}
        # Buckets of dense parameters, all-reduced in this order on every rank: here one bucket.
        self.buckets = [[p for p in model.parameters() if id(p) not in is_expert]]
        self.in_flight = []  # (flat gradients, all-reduce work) per started bucket, in order

    def launch(self):
        """Start the next bucket's all-reduce."""
        bucket = self.buckets[len(self.in_flight)]
        # A parameter that got no gradient sends zeros: the bucket has the same size everywhere.
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self.in_flight.append((flat, work))

    def wait(self, optimizer, args, kwargs):
        """The optimizer's step pre-hook (hence its arguments, unused): start the buckets not
        started yet, finish the all-reduces, then scale."""
        while len(self.in_flight) < len(self.buckets):
            self.launch()
        for bucket, (flat, work) in zip(self.buckets, self.in_flight, strict=True):
            work.wait()
            flat.div_(self.world)
            sizes = [p.numel() for p in bucket]
            for param, grad in zip(bucket, flat.split(sizes), strict=True):
                param.grad = grad.view_as(param)  # a view of the bucket: no copy
        expert_grads = [p.grad for p in self.experts if p.grad is not None]
        if self.replica_group is not None:
            for grad in expert_grads:
                dist.all_reduce(grad, group=self.replica_group)
        for grad in expert_grads:
            grad.div_(self.world)
        self.in_flight = []  # ready for the next step's backward


# The averager hook_optimizer builds: the one place where a part plugs in, with a subclass.
Averager = StepAverager


def hook_optimizer(model, optimizer, data_group=None, replica_group=None, **options):
    """Before each step, every gradient averaged over the data-parallel ranks (data_group, None:
    the world; replica_group, the ranks holding this rank's experts, None: no other) by an
    Averager (options: what a subclass takes besides). Beside data parallelism on a DeviceMesh
    ("dp", "ep"): parallelize's group is mesh["ep"].get_group(), replica_group
    mesh["dp"].get_group(), data_group every rank of the mesh (None where the mesh is the
    world)."""
    averager = Averager(model, data_group, replica_group, **options)
    optimizer.register_step_pre_hook(averager.wait)


def full_state_dict(model, group=None):
    """The unsplit model's state_dict() on the group's rank 0 (None elsewhere): this rank's, its
    hooks and buffers included, with each experts module's entries joined over the expert group
    (group: parallelize's; None: the world), which every rank of it calls. Each copy of the
    expert group (replica_group) holds every expert, so each copy's rank 0 gets the whole model."""
    state = {key: value.detach().cpu() for key, value in model.state_dict().items()}
    layers = expert_layers(model)
    prefixes = tuple(name + "." for name, _ in layers)
    mine = {key: value for key, value in state.items() if key.startswith(prefixes)}
    if dist.get_rank(group) != 0:
        dist.gather_object(mine, None, group=group, group_dst=0)
        return None
    parts = [None] * dist.get_world_size(group)  # parts[r]: the entries of rank r's experts
    dist.gather_object(mine, parts, group=group, group_dst=0)
    joined = {key: value for key, value in state.items() if key not in mine}  # the dense part
    for name, module in layers:
        joined.update(module.expert_parallel.join(name + ".", parts))
    return joined


### more: stacked experts, as torchtitan's GroupedExperts holds them for a grouped matmul
# torchtitan, DeepSeek-V3 and recent HuggingFace MoEs hold the E experts of a layer as parameters
# stacked [E, ...] (a SwiGLU's w1, w2, w3) and run them all in one grouped matmul. This rank keeps
# its E/W rows of each; the module's own forward then runs them on as many counts.


class StackedExperts(ExpertParallel):
    """ExpertParallel for an experts module that holds only parameters stacked [E, ...]: rank r of
    the group keeps rows r·E/W .. (r+1)·E/W - 1 of each."""

    def count_experts(self, experts):
        stacked = list(experts.parameters(recurse=False))
        leading = {param.shape[0] for param in stacked}
        if len(leading) != 1 or len(experts.state_dict()) != len(stacked):
            raise ValueError(
                "StackedExperts takes a module holding only parameters stacked [E, ...]; "
                f"{type(experts).__name__} holds {sorted(experts.state_dict())}"
            )
        return leading.pop()

    def keep_own_experts(self, experts, owned):
        """Every stacked parameter replaced by its rows of this rank's experts (a copy: the other
        experts' memory is freed)."""
        for name, param in list(experts.named_parameters(recurse=False)):
            rows = param.detach()[owned.start : owned.stop].clone()
            setattr(experts, name, nn.Parameter(rows, requires_grad=param.requires_grad))

    def join(self, prefix, parts):
        """The stacked parameters joined along the expert dimension, in rank order."""
        keys = [key for key in parts[0] if key.startswith(prefix)]
        return {key: torch.cat([part[key] for part in parts]) for key in keys}


### more: the dense all-reduces started during backward, a bucket per unit
# As DDP's buckets do (Li et al. 2020, https://arxiv.org/abs/2006.15704), a unit's all-reduce
# travels while backward runs the units before it. A bucket starts where every rank starts it,
# whatever gradients it got (NCCL wants the same order on every rank, across communicators too; a
# parameter used on some ranks only must not move it): when backward reaches the output of the
# nearest experts module before its unit, in the step's last backward pass, else at the step; a
# parameter with no gradient by then sends zeros. By then backward has finished the unit: autograd
# runs the nodes made later in forward first, and accumulates gradients first of all. A gradient
# that comes later (a parameter used outside its unit) is an error, not a wrong average.
# Its contract: every dense parameter lives in one of the units hook_optimizer is given in forward
# order (units=..., model.embed, model.blocks, model.head by default) and is used in that unit's
# forward only; backward_passes=... is how many backward passes one optimizer step sums
# (accumulation, micro-batches). It makes a process group for the dense all-reduces: every rank of
# the world calls hook_optimizer, in the same order as its other new groups.


class GradientAverager(StepAverager):
    """A StepAverager with a bucket per unit (units: the modules holding the dense parameters in
    forward order, None: model.embed, model.blocks, model.head), each started during backward
    where backward reaches the output of the nearest experts module before its unit
    (bucket_starts), the same point on every rank, in the last of a step's `backward_passes`; on
    a process group of its own. It waits once a step, as clip_grad_norm_ needs."""

    def __init__(self, model, data_group=None, replica_group=None, units=None, backward_passes=1):
        super().__init__(model, data_group, replica_group)
        self.group = own_group(data_group)  # `### more: the dense all-reduces' own process group`
        # One bucket of dense parameters per unit, in the order backward finishes them:
        # `### more: the dense parameters of your model's units, a bucket each`.
        self.buckets = [bucket for _, bucket in dense_buckets(model, units)]
        layers = [module for _, module in expert_layers(model)]
        self.backward_passes = backward_passes  # per optimizer step
        self.starts = bucket_starts(model, units)
        self.passes = [0] * len(layers)  # backward passes that reached each layer this step
        # This step's gradients are averaged already (clip_grad_norm_ waited before the step's
        # hook): the hook must not average them again.
        self.averaged = False
        model.grad_averager = self  # found again by clip_grad_norm_, which must average first
        for m, layer in enumerate(layers):
            layer.register_forward_hook(self.output_hook(m))
        for index, bucket in enumerate(self.buckets):
            for param in bucket:
                param.register_post_accumulate_grad_hook(self.grad_ready_hook(index))

    def output_hook(self, m):
        """A forward hook for experts module m: its output's gradient hook is where backward
        reaches the module, the same point on every rank (its all-to-alls follow)."""

        def reached(grad):
            self.averaged = False  # a new step's gradients are coming in
            self.passes[m] += 1
            if self.passes[m] > self.backward_passes:
                raise RuntimeError(
                    f"more than {self.backward_passes} backward passes before an optimizer step: "
                    "pass hook_optimizer backward_passes, the backward passes per step"
                )
            if self.passes[m] == self.backward_passes:  # the step's last backward pass
                for index in self.starts[m]:
                    # in backward's order on every rank: the next one is the count started
                    assert index == len(self.in_flight), (index, len(self.in_flight))
                    self.launch()

        def forward_hook(layer, args, output):
            if output.requires_grad:
                output.register_hook(reached)

        return forward_hook

    def grad_ready_hook(self, index):
        """The hook for bucket `index`'s parameters (a function per bucket: each keeps its own
        index, which a lambda in the loop would not)."""

        def grad_ready(param):
            self.averaged = False  # a new step's gradients are coming in
            if index < len(self.in_flight):
                raise RuntimeError(
                    "a dense gradient came after its bucket's all-reduce started: each parameter "
                    "must be used in the forward of its own unit, and the units be in forward order"
                )

        return grad_ready

    def wait(self, optimizer, args, kwargs):
        """StepAverager's, once a step: a second call (the hook after clip_grad_norm_) does
        nothing."""
        if self.averaged:
            return
        super().wait(optimizer, args, kwargs)
        self.passes = [0] * len(self.passes)  # ready for the next step's backward
        self.averaged = True


# Plugged in where the core offers it: hook_optimizer builds this averager, not StepAverager.
Averager = GradientAverager


def bucket_starts(model, units=None):
    """starts[m]: the buckets (their indices in dense_buckets' order) that start when backward
    reaches experts module m's output: those of the units after m's and before the next
    module's. The buckets of the units before the first one are in none: they start at the step."""
    if units is None:
        units = [model.embed, *model.blocks, model.head]
    layers = [module for _, module in expert_layers(model)]
    # place[m]: the unit (its place in forward order) holding experts module m
    place = [
        next(i for i, unit in enumerate(units) if any(mod is layer for mod in unit.modules()))
        for layer in layers
    ]
    starts = [[] for _ in layers]
    for index, (unit, _) in enumerate(dense_buckets(model, units)):
        before = [m for m in range(len(layers)) if place[m] < unit]
        if before:
            starts[before[-1]].append(index)
    return starts


### more: the dense all-reduces' own process group
# One NCCL communicator runs its operations in turn: on the all-to-alls' group each bucket would
# hold up the next MoE layer's backward all-to-all; on a group of its own it can travel while
# backward runs the blocks before it (not measured on GPUs here).


def own_group(data_group=None):
    """A process group over data_group's ranks (None: the world) for the averager alone. Every rank
    of the world makes every data group's copy, in the same order, as new_group requires; each
    keeps its own."""
    mine = dist.get_process_group_ranks(data_group or dist.group.WORLD)
    every = [mine]
    if data_group is not None:  # the other ranks' data groups, which this rank must make too
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    made = None
    for ranks in sorted({tuple(ranks) for ranks in every}):
        group = dist.new_group(list(ranks))
        if list(ranks) == mine:
            made = group
    return made


### more: the dense parameters of your model's units, a bucket each
# Any model: the units are its modules in forward order (nanoGPT: wte, wpe, *h, ln_f, lm_head),
# and a parameter two units share (a tied embedding) is handled.


def dense_buckets(model, units=None):
    """The dense parameters in the order backward finishes them, one bucket per unit (units: the
    model's modules in forward order; None: model.embed, the blocks, model.head): the head, the
    blocks from last to first (attention, norms, router: not the experts), the embedding, each as
    (the unit's place in forward order, its parameters). A parameter two units share (an embedding
    tied to the output head) goes in the bucket of the one nearest the input: its gradient is
    whole only once backward has reached that unit; a unit left with no parameter of its own (an
    output head holding only the tied weight) has none."""
    if units is None:
        units = [model.embed, *model.blocks, model.head]
    placed = {id(p) for p in expert_params(model)}  # each parameter in one bucket at most
    buckets = []
    for place, unit in enumerate(units):
        bucket = [p for p in unit.parameters() if id(p) not in placed]
        placed.update(id(p) for p in bucket)
        if bucket:
            buckets.append((place, bucket))
    outside = [p for p in model.parameters() if id(p) not in placed]
    if outside:
        raise ValueError("every dense parameter must live in one of the units")
    return buckets[::-1]  # backward's order


### more: gradient clipping over the expert group


def clip_grad_norm_(model, max_norm, group=None):
    """torch.nn.utils.clip_grad_norm_ for a model that hook_optimizer hooked: every gradient
    scaled by max_norm / (the global norm) where that is below one; returns the global norm, the
    same on every rank: the one a single process holding every expert computes. The dense
    gradients, the same on every rank once averaged, count once; the squares of the experts'
    norms are summed over the expert group (group: parallelize's; None: the world), where each
    expert lives on one rank. Every rank calls it after the step's last backward, where the loop
    would call torch's: it first waits for the dense all-reduces and scales (GradientAverager waits
    once a step: the optimizer's hook then has nothing left to do), as the norm of unaveraged
    gradients would be each rank's own."""
    model.grad_averager.wait(None, (), {})
    experts = expert_params(model)
    is_expert = {id(p) for p in experts}
    dense = [p.grad for p in model.parameters() if p.grad is not None and id(p) not in is_expert]
    expert_grads = [p.grad for p in experts if p.grad is not None]
    expert_squares = torch.nn.utils.get_total_norm(expert_grads) ** 2
    dist.all_reduce(expert_squares, group=group)  # a scalar: each rank's experts' part
    total_norm = (torch.nn.utils.get_total_norm(dense) ** 2 + expert_squares).sqrt()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, total_norm)
    return total_norm


### end: Expert parallel


def formula(psi, world, args):
    """Per-rank bytes: the dense Ψ_d whole, the experts' Ψ_e / W. All-to-all bytes per step, the
    mean over ranks (a rank sends its own k·b·T tokens and returns what its experts received,
    which the routing decides; the sum over ranks is exact): per MoE layer, 4 token all-to-alls
    of k·b·T·D fp32 elements (2 forward, 2 backward), plus E int64 counts."""
    k = 8 if args.optim == "adamw" else 4  # the ZeRO paper's K: optimizer bytes per parameter
    D = args.dim
    E = args.experts
    psi_e = args.depth * E * (8 * D * D + 5 * D)  # per expert: fc1 D·4D + 4D, fc2 4D·D + D
    held = psi - psi_e + psi_e // world  # Ψ_d + Ψ_e/W
    tokens = args.batch_size // world * (common.IMAGE // args.patch) ** 2  # b·T on this rank
    rows_bytes = args.top_k * tokens * D * 4  # one token all-to-all: k·b·T rows of D fp32
    counts_bytes = 8 * E  # the E int64 token counts
    a2a = args.depth * (4 * rows_bytes + counts_bytes)
    return dict(
        param_bytes=4 * held,
        grad_bytes=4 * held,
        optim_bytes=k * held,
        comm=dict(all_reduce=4 * (psi - psi_e), all_to_all=a2a),
        notes=dict(
            param_bytes="4(Ψ_d + Ψ_e/W)",
            grad_bytes="4(Ψ_d + Ψ_e/W)",
            optim_bytes=f"{k}(Ψ_d + Ψ_e/W)",
            all_reduce="Ψ_d dense fp32 gradients, in depth + 2 buckets",
            all_to_all="rank 0's; the mean over ranks: layers·(4·k·b·T·D fp32 + E counts)",
        ),
    )


def check_args(args, world):
    common.check(
        args.experts > 0,
        "expert_parallel.py needs a mixture of experts: give --experts E (and --top-k K)",
    )
    common.check(
        args.experts % world == 0,
        f"--experts {args.experts} is not divisible by world size {world}: "
        f"every rank must own the same number of whole experts",
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
        model = parallelize(model, device)  # this rank's experts only, moved to its device
        optimizer = common.make_optimizer(model.parameters(), args)
        hook_optimizer(model, optimizer)  # dense gradients averaged, expert gradients / W
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        common.log(
            f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data "
            f"({len(train_set)} train / {len(test_set)} test), "
            f"batch {args.batch_size} = {dp_world} x {args.batch_size // dp_world}"
        )
        load = common.record_expert_load(model)
        with common.Meter(model, optimizer, args, device=device) as meter:
            out = train(model, optimizer, scheduler, loader, sampler, args, device)
        test_loader = common.test_loader(
            test_set, dp_rank, dp_world, pin_memory=device.type == "cuda"
        )
        acc = evaluate(model, test_loader, device)
        state = full_state_dict(model)  # every rank takes part; rank 0 holds the whole
        if rank == 0 and args.save:
            common.save_checkpoint(state, args.save)
            common.log(f"saved {args.save}")
        extra = common.show_expert_load(load, meter, world)
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
            **extra,
        )
    finally:
        cleanup()


def main():
    parser = common.get_parser(
        "Expert parallelism: a mixture-of-experts ViT, experts spread over ranks"
    )
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
