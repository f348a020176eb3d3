"""Pipeline parallelism: the d blocks (--depth) cut into p contiguous stages, one a rank. Every
stage sees the whole batch of B samples, cut into m micro-batches (--microbatches); each
micro-batch's activation goes forward and its gradient back with batch_isend_irecv.

    rank 0                      rank 1                        rank p-1
    embed, blocks 0..d/p-1 -->  blocks d/p..2d/p-1 --> .. --> blocks (p-1)d/p..d-1, head, loss
                           <--                     <-- .. <-- (activations -->, gradients <--)
p=2, m=4, a slot per forward Fi of micro-batch i and two per backward Bi, '.' idle:
    gpipe   rank 0:  F0 F1 F2 F3 .  .  .  B0 B0 B1 B1 B2 B2 B3 B3    all m forwards, then all m
            rank 1:  .  F0 F1 F2 F3 B0 B0 B1 B1 B2 B2 B3 B3 .  .     backwards
    1f1b    rank 0:  F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 .  B3 B3    p-s-1 forwards ahead on stage
            rank 1:  .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .  .     s, then one forward, one back

Idle (the bubble): (p-1)/(m+p-1) of the slots ((p-1)/p for naive: one micro-batch at a time).
Memory per rank (fp32, AdamW): 16Ψ_s bytes for the stage's Ψ_s ≈ Ψ/p parameters, plus A_s/m per
micro-batch in flight: m (gpipe), p-s on stage s (1f1b), 1 (naive). Communication per step: 2m
messages of B/m·T·D fp32 per stage boundary. Synchronous (one step per batch): exact. Papers:
Huang et al. 2018, "GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism",
https://arxiv.org/abs/1811.06965; 1F1B (PipeDream-Flush): Narayanan et al. 2021, "Memory-Efficient
Pipeline-Parallel DNN Training", https://arxiv.org/abs/2006.09503. docs/techniques.md#pipelines

    torchrun --standalone --nproc_per_node=2 pipeline.py --schedule 1f1b --microbatches 4
    python pipeline.py --nproc 4 --schedule gpipe --microbatches 8
    python pipeline.py                   # a world of one: one stage, the whole model
    python pipeline.py --simulate 8 --microbatches 8 --depth 8   # as rank 0 of 8, on meta
"""

import os
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

import common

SCRIPT = os.path.splitext(os.path.basename(__file__))[0]


### begin: Pipeline
# Model contract: the common ViT's embed, its list of blocks ([B, T, D] -> [B, T, D]), cut into p
# contiguous stages, and its head; each block called on x alone. The same weights are built on
# every rank. A [B/m, T, D] tensor crosses each stage boundary: (T, D) is parallelize's
# activation_shape, model.embed.pos's [1, T, D] by default, in parallelize's activation_dtype (the
# parameters' dtype by default). The loss is train_step's loss_fn(output, targets), cross-entropy
# by default. The pipeline is the ranks of parallelize's `group` (the world when None): stage s on
# its group rank s, the peers group ranks, every send and receive on the group. Why it is exact:
# the micro-batches' gradients add up in .grad, each loss divided by m, so one optimizer step sees
# the batch's mean gradient, as one process; every stage sees the whole batch, and a stage's
# receive buffer has the shape and dtype its peer sends (the ViT's blocks keep [B/m, T, D]).
# Another model's parts by name and the arguments of its blocks, each send checked against its
# receive, a weight its first and last stage share (GPT-2's tied embedding) and clipping: the
# `### more:` parts after the core.


class Stage(torch.nn.Module):
    """Stage `index` of `num_stages` (s of p): blocks s·d/p .. (s+1)·d/p - 1, with the embedding
    before them on the first stage and the head after them on the last. Each module sits under its
    name in the whole model (block 5 stays blocks.5), so the stage's state_dict has the model's
    keys."""

    # What the stage holds of the model, by name: its list of blocks, the modules the first stage
    # runs before them and those the last stage runs after them (the common ViT's).
    block_list = "blocks"
    first_modules = ("embed",)
    last_modules = ("head",)

    def __init__(self, model, index, num_stages, activation_shape=None, activation_dtype=None):
        super().__init__()
        self.index = index
        self.num_stages = num_stages
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        depth = len(model.get_submodule(self.block_list))
        first_block = index * depth // num_stages
        end_block = (index + 1) * depth // num_stages
        self.block_names = [f"{self.block_list}.{i}" for i in range(first_block, end_block)]
        held = list(self.block_names)
        if self.is_first:
            held += self.first_modules
        if self.is_last:
            held += self.last_modules
        for name in held:
            hold(self, model, name)  # at the same dotted path in the stage as in the model
        if activation_shape is None:
            activation_shape = model.embed.pos.shape[1:]
        self.activation_shape = tuple(activation_shape)
        # In the parameters' dtype by default: a model converted to bf16 sends bf16.
        self.activation_dtype = activation_dtype or next(model.parameters()).dtype

    def empty(self, samples, device):
        """A receive buffer for `samples` samples' activations or their gradients, in the dtype
        the peer sends: on NCCL another dtype posts another byte count (a hang or garbage)."""
        shape = (samples, *self.activation_shape)
        return torch.empty(shape, dtype=self.activation_dtype, device=device)

    def forward(self, x, inputs=None):
        """x: the micro-batch's inputs on the first stage, the activation received on the others;
        inputs: the micro-batch's inputs, which every stage is given (the ViT's blocks take x
        alone)."""
        if self.is_first:
            x = self.embed(x)
        for name in self.block_names:
            x = self.get_submodule(name)(x)
        if self.is_last:
            x = self.head(x)
        return x


def hold(stage, model, name):
    """Hold the model's module `name` (a dotted path) at the same path in `stage`, inside empty
    modules standing for the ones around it that the stage does not hold whole."""
    owner = stage
    *path, leaf = name.split(".")
    for part in path:
        if part not in dict(owner.named_children()):
            owner.add_module(part, torch.nn.Module())
        owner = owner.get_submodule(part)
    owner.add_module(leaf, model.get_submodule(name))


# The class parallelize builds: where the `### more:` parts that change a stage plug in, each with
# a subclass of the one before it.
StageClass = Stage


def parallelize(model, device, activation_shape=None, activation_dtype=None, group=None, **options):
    """Keep this rank's stage, on its device; the rest of the model is dropped. activation_shape:
    (T, D) of one sample's activation between stages (default: model.embed.pos's), in
    activation_dtype (default: the parameters' dtype, bf16 for a bf16 model); group: the
    pipeline's process group (the world when None), whose rank s holds stage s; options: what the
    StageClass takes besides."""
    num_stages = dist.get_world_size(group)
    index = dist.get_rank(group)  # stage s on the group's rank s
    stage = StageClass(model, index, num_stages, activation_shape, activation_dtype, **options)
    stage.group = group  # train_step, infer and full_state_dict communicate on it
    return stage.to(device)


# Stage s's actions for one batch of m micro-batches: `warmup` forwards, then one forward and one
# backward at a time, then the backwards left (the docstring draws them on the ranks' timelines):
#
#   naive  F0 B0 F1 B1 .. F(m-1) B(m-1)            warmup 0: one micro-batch in the pipeline
#   gpipe  F0 F1 .. F(m-1) B0 B1 .. B(m-1)         warmup m: all the forwards, then the backwards
#   1f1b   F0 .. F(w-1) Fw B0 F(w+1) B1 .. B(m-1)  warmup w = p-s-1: what fills the stages after s
def schedule(name, micro_batches, num_stages, index):
    """Stage `index`'s actions for one batch, in order: ("F", i) and ("B", i) for micro-batch i.
    1f1b never holds more than p-s micro-batches in flight on stage s; gpipe holds all m."""
    if name == "naive":
        warmup = 0
    elif name == "gpipe":  # Huang et al. 2018, GPipe: https://arxiv.org/abs/1811.06965
        warmup = micro_batches
    else:  # 1f1b: Narayanan et al. 2021, PipeDream-Flush: https://arxiv.org/abs/2006.09503
        warmup = min(num_stages - index - 1, micro_batches)
    actions = [("F", i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        actions.append(("F", warmup + i))
        actions.append(("B", i))
    actions += [("B", i) for i in range(micro_batches - warmup, micro_batches)]
    return actions


def p2p(ops, group=None):
    """Post ops = [(dist.isend or dist.irecv, tensor, peer), ...], each peer a rank of the process
    group `group` (the world when None), as ONE batch_isend_irecv and wait for all of them. NCCL
    runs a rank's batches in order, and a send holds its stream until the peer posts the matching
    receive: two neighbours that each send first, in a batch of its own, wait for ever. What must
    progress together goes in one batch."""
    if not ops:
        return
    batch = [dist.P2POp(op, tensor, group=group, group_peer=peer) for op, tensor, peer in ops]
    for work in dist.batch_isend_irecv(batch):
        work.wait()


def train_step(stage, x, y, schedule_name, micro_batches, loss_fn=F.cross_entropy):
    """Forward, loss and backward of every micro-batch in the schedule's order. Returns the
    batch's mean loss on the last stage, 0 elsewhere. The micro-batches are the step's gradient
    accumulation; a second train_step before the optimizer's step adds to the gradients too.

    An action's output is sent in one batch with the next action's receive, as Megatron-LM and
    torch.distributed.pipelining do: in 1F1B's steady state stage s sends activation i while stage
    s+1 sends gradient j back, and each also receives what the other sends."""
    inputs = x.chunk(micro_batches)
    targets = y.chunk(micro_batches)
    loss = torch.zeros((), device=x.device)
    kept = {}  # micro-batch -> (its input, its output), kept for its backward
    sends = []  # the last action's output, which goes out with the next action's receive
    for action, i in schedule(schedule_name, micro_batches, stage.num_stages, stage.index):
        if action == "F":
            if stage.is_first:
                activation = inputs[i]
                receives = []
            else:
                activation = stage.empty(len(inputs[i]), x.device)
                receives = [(dist.irecv, activation, stage.index - 1)]
            p2p(sends + receives, stage.group)
            if not stage.is_first:
                activation.requires_grad_()  # its gradient is what goes back to stage s-1
            output = stage(activation, inputs=inputs[i])
            if stage.is_last:
                # The loss takes the output's place, so the backward starts from it. It is the
                # mean over the micro-batch's B/m samples; / m makes the m of them sum to the
                # batch's mean.
                output = loss_fn(output, targets[i]) / micro_batches
                loss += output.detach()
                sends = []
            else:
                sends = [(dist.isend, output.detach(), stage.index + 1)]
            kept[i] = (activation, output)
        else:
            activation, output = kept.pop(i)
            if stage.is_last:
                grad = None  # the output is the loss
                receives = []
            else:
                grad = stage.empty(len(output), x.device)
                receives = [(dist.irecv, grad, stage.index + 1)]
            p2p(sends + receives, stage.group)
            output.backward(grad)
            sends = [] if stage.is_first else [(dist.isend, activation.grad, stage.index - 1)]
    # the last backward's gradient: stage s-1 receives it in its own last backward
    p2p(sends, stage.group)
    return loss


@torch.no_grad()
def infer(stage, x):
    """The whole batch through the stages in turn: the logits on the last stage, None on the
    others. A chain (receive, compute, send), so a batch of one op each cannot deadlock."""
    activation = x
    if not stage.is_first:
        activation = stage.empty(len(x), x.device)
        p2p([(dist.irecv, activation, stage.index - 1)], stage.group)
    output = stage(activation, inputs=x)
    if stage.is_last:
        return output
    p2p([(dist.isend, output, stage.index + 1)], stage.group)
    return None


def full_state_dict(model):
    """The model's own state_dict(), gathered on the pipeline group's rank 0 (None elsewhere):
    each stage holds its modules and the model's own buffers under the model's names, so its
    state_dict() has the model's keys (its modules' hooks run); the parts only need merging."""
    mine = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    group = model.group
    parts = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(mine, parts, group=group, group_dst=0)
    if parts is None:
        return None
    return {name: tensor for part in parts for name, tensor in part.items()}


### more: a language model's parts, by name, and the arguments of its blocks (Parts)
# A language model names its parts otherwise (nanoGPT: transformer.wte, transformer.h, lm_head)
# and runs code of its own around its blocks. A Parts names them: `blocks`, the dotted name of
# the model's list of blocks; `first`, the modules the first stage runs before the blocks, and
# `embed(stage, inputs) -> [B, T, D]`, how it runs them; `last` and `head(stage, x) -> what the
# loss takes`, likewise after the blocks on the last stage. A stage holds each module under its
# name in the model, so `embed` and `head` read as the model's forward does (stage.transformer.wte)
# and the stage's state_dict has the model's own keys. The optimizer is built on the stage: its
# named_parameters() are the model's, so a recipe that reads only them (nanoGPT's
# configure_optimizers, called on the stage) builds the stage's groups.
#
# A block may take more than x: HF's GPT-2 with eager attention, the causal mask its forward
# builds (without it the block attends both ways, with no error); Llama, its RoPE table freqs_cis
# and the positions. `block_arguments(stage, inputs, x)` prepares them as the model's forward
# does, once per micro-batch on every stage, from the micro-batch's inputs (every stage has them)
# and the activation entering the stage's blocks; `call_block(block, x, arguments) -> x` is the
# forward's line that calls a block (HF's blocks return a tuple: `block(x, ...)[0]`). Every stage
# holds the buffers the model keeps outside its modules (Llama's freqs_cis), persistent or not as
# in the model: its blocks' arguments read them there, and the saved state_dict has them.
# parallelize(..., parts=...) builds a LanguageModelStage.


class Parts(NamedTuple):
    """The model's parts a pipeline runs, by name; the defaults are the common ViT's."""

    blocks: str = "blocks"
    first: tuple = ("embed",)
    embed: Callable = lambda stage, inputs: stage.embed(inputs)
    last: tuple = ("head",)
    head: Callable = lambda stage, x: stage.head(x)
    block_arguments: Callable = lambda stage, inputs, x: None
    call_block: Callable = lambda block, x, arguments: block(x)


class LanguageModelStage(Stage):
    """A Stage of the model `parts` names (a Parts; None: the common ViT's), run as its forward
    runs: the parts' embed, each block called with what block_arguments prepares, the head."""

    def __init__(
        self, model, index, num_stages, activation_shape=None, activation_dtype=None, parts=None
    ):
        parts = parts or Parts()
        # Stage's __init__ reads the names: plain attributes, so they may be set before it.
        self.parts = parts
        self.block_list = parts.blocks
        self.first_modules = parts.first
        self.last_modules = parts.last
        super().__init__(model, index, num_stages, activation_shape, activation_dtype)
        hold_own_buffers(self, model)

    def forward(self, x, inputs=None):
        if self.is_first:
            x = self.parts.embed(self, x)
        arguments = self.parts.block_arguments(self, inputs, x)  # None for the ViT's blocks
        for name in self.block_names:
            x = self.parts.call_block(self.get_submodule(name), x, arguments)
        if self.is_last:
            x = self.parts.head(self, x)
        return x


def hold_own_buffers(stage, model):
    """The buffers `model` holds itself, not in a module, on `stage` under the same names, each
    persistent (in the state_dict) as it is in the model."""
    saved = model.state_dict(keep_vars=True)
    for name, buffer in model.named_buffers(recurse=False):
        persistent = any(value is buffer for value in saved.values())
        stage.register_buffer(name, buffer, persistent=persistent)


StageClass = LanguageModelStage


### more: each send checked against the receive its peer posts (NCCL)
# The core's receive buffer has the shape and dtype the ViT's blocks give. Another model's (T, D),
# or autocast's bf16 activations of an fp32 model, may not: on NCCL a message of another shape
# hangs or fails, and one of another dtype of the same size arrives as garbage, with no error.
# Each activation is checked before it is sent; its gradient, sent back, has the shape and dtype
# of the buffer it was received in.


class CheckedStage(LanguageModelStage):
    """A stage whose output, on every stage but the last (it goes to the next stage), is checked
    against the buffer the next stage posts for it (`empty`): one clear error before any send."""

    def forward(self, x, inputs=None):
        output = super().forward(x, inputs)
        if self.is_last:
            return output  # the logits or the loss's input: not sent
        expected = (len(output), *self.activation_shape)
        if tuple(output.shape) != expected or output.dtype != self.activation_dtype:
            raise ValueError(
                f"pipeline stage {self.index} sends a {list(output.shape)} {output.dtype} tensor "
                f"where its peer receives {list(expected)} {self.activation_dtype}: pass "
                "parallelize the activation_shape and activation_dtype its blocks give"
            )
        return output


StageClass = CheckedStage


### more: a weight tied across the first and the last stage (GPT-2's wte.weight, lm_head.weight)
# A tied weight cannot be one tensor on two ranks. As in Megatron-LM, the last stage gets a copy
# of its own (stage.tied), equal to the first stage's (every rank built the same weights), and the
# two stages, its "embedding group", sum their gradients after each step's backward
# (all_reduce_tied): both copies take the same step, the tied weight's. Several pipelines side by
# side (hybrid parallelism) have an embedding group each. A weight-decay split by shape puts the
# last stage's copy in the group of its original's shape there. This part wraps the core's
# parallelize and train_step under their own names: the callers' code does not change.


def tie_first_and_last(stage, model):
    """parallelize's, on every rank: `stage.tied`, the stage's copies of the tied weights (on the
    first and the last stage; none elsewhere), and `stage.tied_group`, the two stages' group."""
    stage.tied = []
    stage.tied_group = None
    # A pipeline of one stage holds both ends of a tied weight: nothing to keep equal.
    tied_names = tied_weights(model, stage) if stage.num_stages > 1 else []
    if not tied_names:
        return
    stage.tied_group = embedding_group(stage.group)
    if stage.is_first:
        stage.tied = [model.get_parameter(name) for name in tied_names]
    if stage.is_last:
        stage.tied = [untie(stage, name) for name in tied_names]


def embedding_group(group):
    """The process group of the first and the last stage of the pipeline over `group` (the world
    when None): its ranks 0 and p-1. dist.new_group must be called by every rank of the world, the
    ranks outside the new group too, in the same order: with several pipelines, every rank makes
    every pipeline's pair (gathered from all the ranks), sorted, and keeps its own."""
    num_stages = dist.get_world_size(group)
    if group is None:  # one pipeline, the world's: one pair, known to every rank
        return dist.new_group([0, num_stages - 1])
    mine = (dist.get_global_rank(group, 0), dist.get_global_rank(group, num_stages - 1))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    made = None
    for pair in sorted(set(every)):
        pair_group = dist.new_group(list(pair))
        if pair == mine:
            made = pair_group
    return made


def tied_weights(model, stage):
    """The names, in the model, of the parameters of the last modules that the first modules hold
    too (GPT-2's lm_head.weight, which is transformer.wte.weight), as the stage names them."""
    first_parameters = set()
    for name in stage.first_modules:
        first_parameters.update(model.get_submodule(name).parameters())
    tied = []
    for name in stage.last_modules:
        for param_name, param in model.get_submodule(name).named_parameters():
            if param in first_parameters:
                tied.append(f"{name}.{param_name}")
    return tied


def untie(module, name):
    """Give `module` a copy of its parameter `name` (a dotted path) of its own; return the copy."""
    owner_name, _, attribute = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    copy = torch.nn.Parameter(owner.get_parameter(attribute).detach().clone())
    setattr(owner, attribute, copy)
    return copy


def drop_summed_copies(stage):
    """Before train_step's backwards, on the last stage: a tied copy's gradient from an earlier
    train_step of this optimizer step is in the first stage's copy too (all_reduce_tied summed it
    there), so it is dropped here and the next sum counts it once."""
    if stage.is_last:
        for weight in stage.tied:
            weight.grad = None


def all_reduce_tied(stage):
    """The first and the last stage: each copy of a tied weight has its stage's part of the
    weight's gradient (the embedding's use, the head's); both take their sum. At the same point on
    both, after the step's last backward. The other stages hold no copy and do nothing."""
    for weight in stage.tied:
        dist.all_reduce(weight.grad, group=stage.tied_group)


untied_parallelize = parallelize
untied_train_step = train_step


def parallelize(model, device, *args, **kwargs):
    """The core's parallelize (the same arguments), then the tied weights' copies and group."""
    stage = untied_parallelize(model, device, *args, **kwargs)
    tie_first_and_last(stage, model)
    return stage


def train_step(stage, *args, **kwargs):
    """The core's train_step (the same arguments), each tied copy's gradient summed after it."""
    drop_summed_copies(stage)
    loss = untied_train_step(stage, *args, **kwargs)
    all_reduce_tied(stage)
    return loss


### more: gradient clipping over the stages


def clip_grad_norm_(stage, max_norm, group=None):
    """torch.nn.utils.clip_grad_norm_ for the whole model, which no rank holds: the sum of squares
    of the stage's gradients, all-reduced over the pipeline's ranks (`group`; stage.group, the
    pipeline's, when None), is the square of the global norm. A tied weight counts once: after
    all_reduce_tied both copies hold its whole gradient, and only the first stage's counts. Every
    stage scales by the same factor, so the copies stay equal. Call it after the step's last
    train_step; returns the total norm, as one process's clip_grad_norm_ would."""
    copies = set() if stage.is_first else set(stage.tied)
    grads = [param.grad for param in stage.parameters() if param.grad is not None]
    counted = [
        param.grad for param in stage.parameters() if param.grad is not None and param not in copies
    ]
    square = torch.zeros((), device=next(stage.parameters()).device)
    for grad in counted:
        square += torch.linalg.vector_norm(grad) ** 2
    if group is None:
        group = stage.group
    dist.all_reduce(square, group=group)
    total = square.sqrt()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's factor, the same everywhere
    for grad in grads:
        grad.mul_(scale)
    return total


### end: Pipeline


def every_stage_order(args, loader, world, device):
    """--simulate: each stage's actions in a step, as it ran them. The other ranks do not exist
    (the fake group's gather_object returns this rank's object in every slot), and the fake
    group's rank is fixed when it starts: so it is started again as each rank s in turn, and the
    script's own parallelize and train_step run stage s on a new meta model and a meta batch,
    recorded as on the real path. After the Meter: the report's rows stay this rank's."""
    from common.simulate import playing_rank

    x, y = next(iter(loader))
    orders = []
    for s in range(world):
        with playing_rank(s, world):
            model = common.build_model(args, forwards_per_step=args.microbatches)
            stage = parallelize(model, device)  # stage s
            recorder = common.record_pipeline_order(stage, args.microbatches)
            train_step(stage, x, y, args.schedule, args.microbatches)
            orders.append(recorder.recorded()["order"])
    return orders


def formula(psi, world, args, rank=0):
    """Stage `rank`'s promises, psi its parameters: its bytes; per step m activations and m
    gradients (B/m·T·D fp32 each), an end stage one of each kind out and the other in, a stage
    between the ends both each way; the schedule's idle fraction of the slots; each stage's peak
    of micro-batches in flight, whose activations it holds."""
    optim_per_param = 8 if args.optim == "adamw" else 4
    m = args.microbatches
    tokens = (common.IMAGE // args.patch) ** 2
    # Each way, m messages of B/m·T·D fp32 (4·B·T·D bytes) of each kind crossing it: the first
    # stage sends activations and receives gradients, the last the reverse, a stage between the
    # ends both kinds each way (a neighbour on each side); none at W = 1.
    between = 0 < rank < world - 1
    kinds = 2 if between else 1
    bytes_each_way = 4 * args.batch_size * tokens * args.dim * kinds if world > 1 else 0
    activations = "m activations of B/m·T·D fp32"
    gradients = "m gradients of B/m·T·D fp32"
    if between:
        sent = received = "m activations and m gradients of B/m·T·D fp32"
    elif rank == 0:
        sent, received = activations, gradients
    else:
        sent, received = gradients, activations
    if args.schedule == "naive":
        bubble = (world - 1) / world
        bubble_text = "(p-1)/p"
    else:
        bubble = (world - 1) / (m + world - 1)
        bubble_text = "(p-1)/(m+p-1)"
    in_flight = {
        "naive": [1] * world,
        "gpipe": [m] * world,
        "1f1b": [world - s for s in range(world)],
    }
    return dict(
        param_bytes=4 * psi,
        grad_bytes=4 * psi,
        optim_bytes=optim_per_param * psi,
        comm=dict(send=bytes_each_way, recv=bytes_each_way),
        bubble=bubble,
        peak_inflight=in_flight[args.schedule],
        notes=dict(
            param_bytes="4Ψ_s: this stage's",
            grad_bytes="4Ψ_s",
            optim_bytes=f"{optim_per_param}Ψ_s",
            send=sent,
            recv=received,
            bubble=bubble_text,
        ),
    )


def check_args(args, world):
    common.check(args.microbatches >= 1, f"--microbatches must be >= 1, got {args.microbatches}")
    common.check(
        args.depth >= world, f"--depth {args.depth} blocks cannot fill {world} pipeline stages"
    )
    common.check(
        args.batch_size % args.microbatches == 0,
        f"--batch-size {args.batch_size} is not divisible by --microbatches {args.microbatches}",
    )
    common.check(
        args.schedule != "1f1b" or args.microbatches >= world,
        "--schedule 1f1b needs at least as many micro-batches as stages: "
        f"--microbatches {args.microbatches} < {world} stages (or use gpipe)",
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
            loss = train_step(model, x, y, args.schedule, args.microbatches)  # F, loss, B
            if args.clip:
                clip_grad_norm_(model, args.clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            loss_sum += loss.detach()
            losses_summed += 1
            if step % args.log_every == 0 or step >= stop or i + 1 == len(loader):
                dist.all_reduce(loss_sum)  # only the last stage has the loss; the others add 0
                last_loss = loss_sum.item() / losses_summed
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
        logits = infer(model, x)  # stage to stage: the logits on the last stage, None elsewhere
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
        dp_rank, dp_world = 0, 1  # every stage sees the whole batch
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
        # the same seeded weights on every rank; a micro-batch's loss (and its MoE balance
        # loss) is divided by the micro-batch count
        model = common.build_model(args, forwards_per_step=args.microbatches)
        if args.load:
            model.load_state_dict(common.load_state_dict_file(args.load, model.state_dict()))
        psi = sum(p.numel() for p in model.parameters())
        model = parallelize(model, device)  # this rank's stage only, moved to its device
        optimizer = common.make_optimizer(model.parameters(), args)
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        common.log(
            f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data "
            f"({len(train_set)} train / {len(test_set)} test), "
            f"batch {args.batch_size} = {dp_world} x {args.batch_size // dp_world}"
        )
        recorder = common.record_pipeline_order(model, args.microbatches)
        with common.Meter(model, optimizer, args, device=device) as meter:
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
        psi_stage = sum(p.numel() for p in model.parameters())  # Ψ_s: this rank's stage only
        promised = formula(psi_stage, world, args, rank)
        orders = None  # every rank's, gathered by pipeline_timeline
        if args.simulate:  # the other ranks do not exist: their stages run here, one by one
            orders = every_stage_order(args, loader, world, device)
        timeline = common.pipeline_timeline(recorder, meter, promised, orders)  # every rank
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
            formula=promised,
            **timeline,
        )
    finally:
        cleanup()


def main():
    parser = common.get_parser(
        "Pipeline parallelism (naive, GPipe, 1F1B) on the common ViT, written out",
        simulates=True,
    )
    parser.add_argument("--schedule", choices=["naive", "gpipe", "1f1b"], default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per batch (m)")
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
