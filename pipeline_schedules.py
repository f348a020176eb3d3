"""Pipeline schedules past 1F1B: pipeline.py plus two --schedule choices. interleaved: V·p chunks
of blocks (--virtual-stages V), V a rank, so a micro-batch crosses the ranks V times and the fill
and drain cost a V-th as much. zb-h1: each backward split into B, the input's gradient (which the
previous stage waits for), and W, the weights' gradients, moved into the slots where 1F1B idles.

    rank 0: chunks 0, p, 2p, ..    rank 1: chunks 1, p+1, ..    ..    rank p-1: chunks p-1, 2p-1, ..
p=2, m=4, a slot per F, B or W (a whole backward two), '.' idle; F3': in the second chunk (V=2):
    zb-h1         rank 0:  F0 F1 .  B0 W0 F2 B1 W1 F3 B2 W2 B3 W3
                  rank 1:  .  F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3
    interleaved   rank 0:  F0  F1  F0' F1' F2  .   B0' B0' F3  B1' B1' F2' B0  B0  F3' B1  B1  ..
                  rank 1:  .   F0  F1  F0' B0' B0' F1' B1' B1' F2  B0  B0  F3  B1  B1  F2' B2' ..

Idle (the bubble): (p-1)/(V·m+p-1) interleaved, (p-1)/(3m+p-1) zb-h1. Memory per rank (fp32,
AdamW): 16Ψ_s bytes plus the activations in flight: 2(p-s-1) + (V-1)·p + 1 chunks (interleaved),
p micro-batches on every stage (zb-h1). Communication per step: 2m messages of B/m·T·D fp32 per
chunk boundary (V·p-1 of them interleaved). Synchronous: exact. Papers: Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
https://arxiv.org/abs/2104.04473; Qi et al. 2024, "Zero Bubble Pipeline Parallelism",
https://arxiv.org/abs/2401.10241. docs/techniques.md#pipeline-schedules-past-1f1b

    torchrun --standalone --nproc_per_node=4 pipeline_schedules.py --schedule interleaved \\
        --virtual-stages 2 --depth 8
    torchrun --standalone --nproc_per_node=4 pipeline_schedules.py --schedule zb-h1 --microbatches 8
    diff -u pipeline.py pipeline_schedules.py                 # what the schedules change
    python pipeline_schedules.py --simulate 8 --schedule zb-h1 --microbatches 8 --depth 8  # meta
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
    """Stage `index` of `num_stages` (s of p), holding `num_chunks` (V) chunks: its chunk v is
    global chunk c = v·p + s of the C = V·p the blocks are cut into (blocks
    c·d/C .. (c+1)·d/C - 1), with the first modules before global chunk 0 and the last ones after
    chunk C-1. Each module sits under its name in the whole model (block 5 stays blocks.5), so the
    stage's state_dict has the model's keys."""

    # What the stage holds of the model, by name: its list of blocks, the modules the first stage
    # runs before them and those the last stage runs after them (the common ViT's).
    block_list = "blocks"
    first_modules = ("embed",)
    last_modules = ("head",)

    def __init__(
        self, model, index, num_stages, num_chunks=1, activation_shape=None, activation_dtype=None
    ):
        super().__init__()
        self.index = index
        self.num_stages = num_stages
        self.num_chunks = num_chunks
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        # F sends to global chunk c+1, B to c-1: they live on the next and the previous rank of
        # the pipeline's group (chunk p on rank 0 follows chunk p-1 on rank p-1)
        self.next_rank = (index + 1) % num_stages
        self.previous_rank = (index - 1) % num_stages
        depth = len(model.get_submodule(self.block_list))
        global_chunks = num_chunks * num_stages
        self.chunks = []  # per chunk v of this stage: its blocks' names
        for global_chunk in range(index, global_chunks, num_stages):  # c = v·p + s
            first_block = global_chunk * depth // global_chunks
            end_block = (global_chunk + 1) * depth // global_chunks
            self.chunks.append([f"{self.block_list}.{i}" for i in range(first_block, end_block)])
        held = [name for block_names in self.chunks for name in block_names]
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

    def is_first_chunk(self, chunk):
        return self.is_first and chunk == 0

    def is_last_chunk(self, chunk):
        return self.is_last and chunk == self.num_chunks - 1

    def forward(self, x, chunk=0, inputs=None):
        """x: the micro-batch's inputs before the first chunk, the activation received before the
        others; inputs: the micro-batch's inputs, which every stage is given (the ViT's blocks take
        x alone)."""
        if self.is_first_chunk(chunk):
            x = self.embed(x)
        for name in self.chunks[chunk]:
            x = self.get_submodule(name)(x)
        if self.is_last_chunk(chunk):
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


def parallelize(
    model,
    device,
    num_chunks=1,
    activation_shape=None,
    activation_dtype=None,
    group=None,
    **options,
):
    """Keep this rank's chunks, on its device; the rest of the model is dropped. activation_shape:
    (T, D) of one sample's activation between stages (default: model.embed.pos's), in
    activation_dtype (default: the parameters' dtype, bf16 for a bf16 model); group: the
    pipeline's process group (the world when None), whose rank s holds stage s; options: what the
    StageClass takes besides."""
    num_stages = dist.get_world_size(group)
    index = dist.get_rank(group)  # stage s on the group's rank s
    stage = StageClass(
        model, index, num_stages, num_chunks, activation_shape, activation_dtype, **options
    )
    stage.group = group  # train_step, infer and full_state_dict communicate on it
    return stage.to(device)


# Stage s's actions for one batch of m micro-batches: `warmup` forwards, then one forward and one
# backward at a time, then the backwards left (the docstring draws them on the ranks' timelines):
#
#   1f1b   F0 .. F(w-1) Fw B0 F(w+1) B1 .. B(m-1)  warmup w = p-s-1: what fills the stages after s
#   zb-h1  1f1b's, W(k-s) after Bk, the last s Ws at the end of stage s: `### more: zero bubble`
#   interleaved   V chunks a rank, in an order of its own: `### more: interleaved 1F1B`
# The core writes 1f1b; each other schedule is a part that wraps schedule() under its own name.
def schedule(name, micro_batches, num_stages, index, num_chunks=1):
    """Stage `index`'s steps for one batch: lists of actions (F | B | W, micro-batch, chunk), whose
    sends go out in one group with the next step's receives. 1f1b as in pipeline.py, one action a
    step. Narayanan et al. 2021, PipeDream-Flush: https://arxiv.org/abs/2006.09503"""
    if name != "1f1b":
        raise ValueError(f"schedule {name!r}: the core runs 1f1b, the others are parts of it")
    warmup = min(num_stages - index - 1, micro_batches)
    actions = [("F", i, 0) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        actions.append(("F", warmup + i, 0))
        actions.append(("B", i, 0))
    actions += [("B", i, 0) for i in range(micro_batches - warmup, micro_batches)]
    return [[action] for action in actions]


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


def receives(stage, step, inputs, received):
    """The receives of a step's inputs, each into a new tensor (as many samples as micro-batch i
    of `inputs`, on its device) put in `received`: an F's activation from the chunk before it (none
    for global chunk 0), a B's gradient from the chunk after it (none for the last). A W receives
    nothing: it takes back the gradient its B received."""
    ops = []
    for action, i, chunk in step:
        if action == "F" and not stage.is_first_chunk(chunk):
            peer = stage.previous_rank
        elif action == "B" and not stage.is_last_chunk(chunk):
            peer = stage.next_rank
        else:
            continue
        tensor = stage.empty(len(inputs[i]), inputs[i].device)
        received[action, i, chunk] = tensor
        ops.append((dist.irecv, tensor, peer))
    return ops


def train_step(stage, x, y, schedule_name, micro_batches, loss_fn=F.cross_entropy):
    """Forward, loss and backward of every micro-batch in the schedule's order. Returns the
    batch's mean loss on the last stage, 0 elsewhere. The micro-batches are the step's gradient
    accumulation; a second train_step before the optimizer's step adds to the gradients too.

    A step's sends go in one batch with the next step's receives, as Megatron-LM and
    torch.distributed.pipelining do, so no two stages both wait to send. zb-h1: B takes the input's
    gradient only and keeps the graph; W takes the weights' gradients through it later."""
    inputs = x.chunk(micro_batches)
    targets = y.chunk(micro_batches)
    steps = schedule(schedule_name, micro_batches, stage.num_stages, stage.index, stage.num_chunks)
    split_backward = schedule_name == "zb-h1"
    loss = torch.zeros((), device=x.device)
    received = {}  # (action, micro-batch, chunk) -> the tensor its input arrives in
    kept = {}  # (micro-batch, chunk) -> (its input, its output), kept for its B (zb-h1: its W)
    output_grads = {}  # zb-h1: (micro-batch, chunk) -> the gradient its B went back with, for W
    # The first step's inputs come alone: no step before it has sends to pair them with.
    p2p(receives(stage, steps[0], inputs, received), stage.group)
    for step, next_step in zip(steps, [*steps[1:], []], strict=True):
        sends = []
        for action, i, chunk in step:
            if action == "F":
                if stage.is_first_chunk(chunk):
                    activation = inputs[i]
                else:
                    activation = received.pop(("F", i, chunk))
                    activation.requires_grad_()  # its gradient is what goes back to chunk c-1
                output = stage(activation, chunk, inputs=inputs[i])
                if stage.is_last_chunk(chunk):
                    # The loss takes the output's place, so the backward starts from it. It is the
                    # mean over the micro-batch's B/m samples; / m makes the m of them sum to the
                    # batch's mean.
                    output = loss_fn(output, targets[i]) / micro_batches
                    loss += output.detach()
                else:
                    sends.append((dist.isend, output.detach(), stage.next_rank))
                kept[i, chunk] = (activation, output)
            elif action == "B":
                grad = None if stage.is_last_chunk(chunk) else received.pop(("B", i, chunk))
                if split_backward:
                    activation, output = kept[i, chunk]
                    output_grads[i, chunk] = grad
                    if not stage.is_first_chunk(chunk):  # chunk 0's input needs no gradient
                        output.backward(grad, inputs=[activation], retain_graph=True)
                else:
                    activation, output = kept.pop((i, chunk))
                    output.backward(grad)
                if not stage.is_first_chunk(chunk):
                    sends.append((dist.isend, activation.grad, stage.previous_rank))
            else:  # W: the weights' gradients, back through the graph B kept
                _, output = kept.pop((i, chunk))
                output.backward(output_grads.pop((i, chunk)), inputs=list(stage.parameters()))
        p2p(sends + receives(stage, next_step, inputs, received), stage.group)
    return loss


@torch.no_grad()
def infer(stage, x):
    """The whole batch through the chunks in turn, around the ranks V times: the logits on the
    last stage, None on the others. A chain (receive, compute, send): one op a group is safe."""
    activation = x
    for chunk in range(stage.num_chunks):
        if not stage.is_first_chunk(chunk):
            activation = stage.empty(len(x), x.device)
            p2p([(dist.irecv, activation, stage.previous_rank)], stage.group)
        activation = stage(activation, chunk, inputs=x)
        if not stage.is_last_chunk(chunk):
            p2p([(dist.isend, activation, stage.next_rank)], stage.group)
    return activation if stage.is_last else None


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


### more: interleaved 1F1B (Narayanan et al. 2021, Megatron-LM)


def interleaved(micro_batches, num_stages, index, num_chunks):
    """Megatron-LM's interleaved 1F1B: the forwards in rounds of p micro-batches, chunk 0 then
    chunk 1 .. (a round goes around the ranks V times, like one pipeline V times deeper), the
    backwards in the same rounds with the chunks reversed. Stage s runs 2(p-s-1) + (V-1)·p
    forwards ahead (all of them when m = p), Megatron's count of what keeps it busy until the
    first gradient comes back; then steps of one forward and one backward; then the rest."""
    forwards = []  # (micro-batch, chunk) in the order this rank runs them
    for forward_index in range(micro_batches * num_chunks):
        round_index, position = divmod(forward_index, num_stages * num_chunks)
        chunk, offset = divmod(position, num_stages)
        forwards.append((round_index * num_stages + offset, chunk))
    backwards = [(i, num_chunks - 1 - chunk) for i, chunk in forwards]
    total = len(forwards)
    if micro_batches == num_stages:  # Megatron-LM's special case: every forward first
        warmup = total
    else:
        warmup = min(2 * (num_stages - index - 1) + (num_chunks - 1) * num_stages, total)
    steady = zip(forwards[warmup:], backwards[: total - warmup], strict=True)
    steps = [[("F", *forward)] for forward in forwards[:warmup]]
    steps += [[("F", *forward), ("B", *backward)] for forward, backward in steady]
    steps += [[("B", *backward)] for backward in backwards[total - warmup :]]
    return steps


schedule_without_interleaved = schedule


def schedule(name, micro_batches, num_stages, index, num_chunks=1):
    """The core's schedule (the same arguments), and --schedule interleaved in its own order."""
    if name == "interleaved":
        return interleaved(micro_batches, num_stages, index, num_chunks)
    return schedule_without_interleaved(name, micro_batches, num_stages, index, num_chunks)


### more: zero bubble (ZB-H1, Qi et al. 2024): the backward split into B and W


def with_weight_passes(actions, micro_batches, index):
    """ZB-H1: stage s runs W of micro-batch k-s right after its k-th B and the last s Ws at the
    end. 1F1B leaves stage s idle about s backwards at the end (the later stages drain first): the
    Ws held back fill that, the others fill the steady state's waits for gradients.

    What a W costs here: train_step's W is a second backward from the output, through the graph
    B kept (retain_graph), with the stage's parameters as its inputs; autograd recomputes every
    input gradient between the output and the first block's weights to get there. So W costs
    about a whole backward (~2F) and B about half of one (~F): a micro-batch's backward costs
    ~1.5 times 1F1B's. On a GPU, where the stages are busy rather than waiting, expect zb-h1 to
    run slower than 1f1b unless the bubble it removes, about (p-1)/(m+p-1) of the step, is more
    than that extra third of each micro-batch's work. Qi et al.'s W, and torch.distributed.
    pipelining's (stage_backward_weight), start from the intermediate gradients B kept and compute
    only the weights' gradients (~F)."""
    scheduled = []
    backwards = 0
    for action in actions:
        scheduled.append(action)
        if action[0] == "B":
            if backwards >= index:
                scheduled.append(("W", backwards - index, 0))
            backwards += 1
    scheduled += [("W", i, 0) for i in range(micro_batches - index, micro_batches)]
    return scheduled


schedule_without_weight_passes = schedule


def schedule(name, micro_batches, num_stages, index, num_chunks=1):
    """The schedule before this part (the same arguments), and --schedule zb-h1: 1f1b's actions,
    one a step, with the Ws put in by with_weight_passes."""
    if name != "zb-h1":
        return schedule_without_weight_passes(name, micro_batches, num_stages, index, num_chunks)
    steps = schedule_without_weight_passes("1f1b", micro_batches, num_stages, index, num_chunks)
    actions = [action for step in steps for action in step]
    return [[action] for action in with_weight_passes(actions, micro_batches, index)]


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
        self,
        model,
        index,
        num_stages,
        num_chunks=1,
        activation_shape=None,
        activation_dtype=None,
        parts=None,
    ):
        parts = parts or Parts()
        # Stage's __init__ reads the names: plain attributes, so they may be set before it.
        self.parts = parts
        self.block_list = parts.blocks
        self.first_modules = parts.first
        self.last_modules = parts.last
        super().__init__(model, index, num_stages, num_chunks, activation_shape, activation_dtype)
        hold_own_buffers(self, model)

    def forward(self, x, chunk=0, inputs=None):
        if self.is_first_chunk(chunk):
            x = self.parts.embed(self, x)
        arguments = self.parts.block_arguments(self, inputs, x)  # None for the ViT's blocks
        for name in self.chunks[chunk]:
            x = self.parts.call_block(self.get_submodule(name), x, arguments)
        if self.is_last_chunk(chunk):
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
    """A stage whose output, on every chunk but the last (it goes to the next chunk), is checked
    against the buffer the next chunk posts for it (`empty`): one clear error before any send."""

    def forward(self, x, chunk=0, inputs=None):
        output = super().forward(x, chunk, inputs)
        if self.is_last_chunk(chunk):
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
    zero_bubble = args.schedule == "zb-h1"
    orders = []
    for s in range(world):
        with playing_rank(s, world):
            model = common.build_model(args, forwards_per_step=args.microbatches)
            stage = parallelize(model, device, args.virtual_stages)  # stage s's chunks
            recorder = common.record_pipeline_order(stage, args.microbatches, weights=zero_bubble)
            train_step(stage, x, y, args.schedule, args.microbatches)
            orders.append(recorder.recorded()["order"])
    return orders


def formula(psi, world, args, rank=0):
    """Stage `rank`'s promises, psi its parameters: its bytes; per micro-batch an activation out
    of each of its V chunks but the model's last and a gradient out of each but the model's first
    (2V-1 messages on an end stage, 2V between), as many in; the schedule's idle fraction of the
    slots; each stage's peak of micro-batch chunks in flight."""
    optim_per_param = 8 if args.optim == "adamw" else 4
    m = args.microbatches
    V = args.virtual_stages
    tokens = (common.IMAGE // args.patch) ** 2
    per_micro_batch = 2 * V if 0 < rank < world - 1 else 2 * V - 1  # messages each way
    # m·(2V-1) messages of B/m·T·D fp32 each way, m·2V between (none in a world of one)
    bytes_each_way = 4 * args.batch_size * tokens * args.dim * per_micro_batch if world > 1 else 0
    if args.schedule == "interleaved":
        bubble = (world - 1) / (V * m + world - 1)
        bubble_text = "(p-1)/(V·m+p-1)"
        if m == world:  # every forward first, as interleaved() runs it
            warmups = [m * V] * world
        else:
            warmups = [2 * (world - s - 1) + (V - 1) * world for s in range(world)]
        peaks = [min(warmup + 1, m * V) for warmup in warmups]
    elif args.schedule == "zb-h1":
        bubble = (world - 1) / (3 * m + world - 1)
        bubble_text = "(p-1)/(3m+p-1)"
        peaks = [world] * world
    else:
        bubble = (world - 1) / (m + world - 1)
        bubble_text = "(p-1)/(m+p-1)"
        peaks = [world - s for s in range(world)]
    return dict(
        param_bytes=4 * psi,
        grad_bytes=4 * psi,
        optim_bytes=optim_per_param * psi,
        comm=dict(send=bytes_each_way, recv=bytes_each_way),
        bubble=bubble,
        peak_inflight=peaks,
        notes=dict(
            param_bytes="4Ψ_s: this stage's",
            grad_bytes="4Ψ_s",
            optim_bytes=f"{optim_per_param}Ψ_s",
            send=f"{per_micro_batch}·m tensors of B/m·T·D fp32",
            recv=f"{per_micro_batch}·m tensors of B/m·T·D fp32",
            bubble=bubble_text,
        ),
    )


def check_args(args, world):
    name = args.schedule
    m = args.microbatches
    V = args.virtual_stages
    common.check(
        m >= world and args.batch_size % m == 0,
        f"--schedule {name} needs --microbatches >= {world} stages and dividing "
        f"--batch-size {args.batch_size}, got {m}",
    )
    common.check(
        V >= 1 and args.depth >= world * V,
        f"--depth {args.depth} blocks cannot fill {world} stages x {V} chunks",
    )
    interleaved_ok = V >= 2 and world >= 2 and m % world == 0
    common.check(
        interleaved_ok if name == "interleaved" else V == 1,
        f"--schedule interleaved needs --virtual-stages >= 2, >= 2 stages, --microbatches a "
        f"multiple of them (and the others V = 1): {name}, V={V}, p={world}, m={m}",
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
        model = parallelize(model, device, args.virtual_stages)  # this rank's chunks, on its device
        optimizer = common.make_optimizer(model.parameters(), args)
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        common.log(
            f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data "
            f"({len(train_set)} train / {len(test_set)} test), "
            f"batch {args.batch_size} = {dp_world} x {args.batch_size // dp_world}"
        )
        zero_bubble = args.schedule == "zb-h1"  # its W, a backward pass of its own, is recorded
        recorder = common.record_pipeline_order(model, args.microbatches, weights=zero_bubble)
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
        psi_stage = sum(p.numel() for p in model.parameters())  # Ψ_s: this rank's chunks only
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
        "Pipeline schedules past 1F1B (interleaved, zero-bubble) on the common ViT",
        simulates=True,
    )
    parser.add_argument("--schedule", choices=["1f1b", "interleaved", "zb-h1"], default="1f1b")
    parser.add_argument(
        "--virtual-stages", type=int, default=1, help="chunks per rank (V), interleaved"
    )
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per batch (m)")
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
