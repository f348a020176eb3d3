"""Pipeline parallelism, PipeDream's asynchronous 1F1B with weight stashing: pipeline.py's stages
with no flush. The micro-batches of all batches are one stream; stage s runs w = p-s-1 forwards
ahead of its backwards, across batch boundaries too, and steps its optimizer after each backward
with that micro-batch's gradient. Micro-batch j's forward runs on the weights after max(0, j-w)
updates; its backward goes through those same weights, stashed at the forward.

    rank 0                      rank 1                        rank p-1
    embed, blocks 0..d/p-1 -->  blocks d/p..2d/p-1 --> .. --> blocks (p-1)d/p..d-1, head, loss
                           <--                     <-- .. <-- (activations -->, gradients <--)
p=2, m=4, a slot per forward F j of micro-batch j of the stream and two per backward B j:
    rank 0:  F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 F4 B3 B3 F5 B4 B4 ..   batch 2's F4 F5 .. run in
    rank 1:  .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 F4 B4 B4 F5 B5 ..   batch 1's cool-down

Idle: p-1 forwards' and backwards' worth at the start of training and at its end, none between.
Memory per rank (fp32, AdamW): 16Ψ_s bytes, plus up to p-s stashed weight versions (4Ψ_s each)
and the activations of p-s micro-batches. Communication per step: 2m messages of B/m·T·D fp32
per stage boundary. Not one process's training, by design. Paper: Harlap et al. 2018, "PipeDream:
Fast and Efficient Pipeline Parallel DNN Training", https://arxiv.org/abs/1806.03377.
docs/techniques.md#pipedream-asynchronous-no-flush

    torchrun --standalone --nproc_per_node=2 pipeline_pipedream.py --microbatches 4 --optim sgd
    diff -u pipeline.py pipeline_pipedream.py                 # what asynchrony and the stash change
    python pipeline_pipedream.py --simulate 8 --microbatches 8 --depth 8   # as rank 0 of 8, on meta
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
# parameters' dtype by default). The loss is cross-entropy. The pipeline is the ranks of
# parallelize's `group` (the world when None): stage s on its group rank s, the peers group ranks,
# every send and receive on the group. No gradient clipping: each stage steps after each of its
# backwards, at its own times, so no step has a norm over all stages (check_args refuses --clip).
# Another model's parts by name and the arguments of its blocks, each send checked against its
# receive, and the refusal of a weight the first and the last stage share: the `### more:` parts.


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
        # The stream's state, which outlives a batch (a train_step):
        self.streamed = 0  # micro-batches fed to the stream so far
        self.kept = {}  # micro-batch -> (input, output, stashed weights) until its backward
        self.pending = []  # the last step's closing send, which stage s-1 takes in the next step

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


# Stage s's actions on the stream of micro-batches, batch after batch with no flush between them
# (Harlap et al. 2018, PipeDream: https://arxiv.org/abs/1806.03377): 1F1B's w = p-s-1 forwards
# ahead, then one forward and one backward at a time, across the batches' boundaries too; only the
# run's final batch drains the backwards left.
#
#   batch 1   F0 .. F(w-1) Fw B0 F(w+1) B1 .. F(m-1) B(m-1-w)
#   batch 2   F(m) B(m-w) F(m+1) B(m+1-w) ..              batch 1's last w backwards run here
#   final     .. F(e-1) B(e-1-w) B(e-w) .. B(e-1)         e = the stream's end: the drain
def schedule(micro_batches, num_stages, index, first, final):
    """Stage `index`'s actions on this batch, micro-batches first .. first+m-1 of the stream, in
    order: ("F", j) then ("B", j-w), w = p-s-1 the forwards stage s runs ahead of its backwards
    (across batches too); the final batch then drains the w whose backward has not run."""
    ahead = num_stages - index - 1  # the paper's w: forwards run ahead of the backwards
    end = first + micro_batches
    actions = []
    for j in range(first, end):
        actions.append(("F", j))
        if j >= ahead:
            actions.append(("B", j - ahead))
    if final:
        actions += [("B", j) for j in range(max(end - ahead, 0), end)]
    return actions


def stash_weights(stage):
    """Weight stashing: the stage's weights as they are now, copied, for one micro-batch's forward
    and, w updates later, its backward."""
    return {
        name: parameter.detach().clone().requires_grad_()
        for name, parameter in stage.named_parameters()
    }


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


def train_step(stage, x, y, micro_batches, optimizer, final=False):
    """This batch's m micro-batches into the stream, in the schedule's order: each forward on a copy
    of the weights (the stash), each backward through that copy, its gradient into .grad and an
    optimizer step: one update per micro-batch. Returns the sum of this batch's micro-batch mean
    losses / m on the last stage, 0 elsewhere. Sends are paired with receives as in pipeline.py."""
    inputs = x.chunk(micro_batches)
    targets = y.chunk(micro_batches)
    loss = torch.zeros((), device=x.device)
    first = stage.streamed  # this batch's first micro-batch, numbered in the stream
    actions = schedule(micro_batches, stage.num_stages, stage.index, first, final)
    stage.streamed += micro_batches
    sends = stage.pending  # the last step's closing gradient, which stage s-1 takes now
    for action, j in actions:
        if action == "F":
            if stage.is_first:
                activation = inputs[j - first]
                receives = []
            else:
                activation = stage.empty(len(inputs[j - first]), x.device)
                receives = [(dist.irecv, activation, stage.index - 1)]
            p2p(sends + receives, stage.group)
            if not stage.is_first:
                activation.requires_grad_()  # its gradient is what goes back to stage s-1
            stash = stash_weights(stage)
            micro_batch = {"inputs": inputs[j - first]}
            output = torch.func.functional_call(stage, stash, (activation,), micro_batch)
            if stage.is_last:
                # The loss takes the output's place, so the backward starts from it. It is the
                # mean over the micro-batch's B/m samples, not / m: it makes an update of its own.
                output = F.cross_entropy(output, targets[j - first])
                loss += output.detach() / micro_batches
                sends = []
            else:
                sends = [(dist.isend, output.detach(), stage.index + 1)]
            stage.kept[j] = (activation, output, stash)
        else:
            activation, output, stash = stage.kept.pop(j)
            if stage.is_last:
                grad = None  # the output is the loss
                receives = []
            else:
                grad = stage.empty(len(output), x.device)
                receives = [(dist.irecv, grad, stage.index + 1)]
            p2p(sends + receives, stage.group)
            output.backward(grad)  # through the weights micro-batch j's forward used
            # PipeDream's rule: the gradient taken at the stashed weights updates the current ones
            for name, parameter in stage.named_parameters():
                parameter.grad = stash[name].grad
            optimizer.step()  # the stage's weights move on; the stash is dropped with j
            optimizer.zero_grad(set_to_none=True)
            sends = [] if stage.is_first else [(dist.isend, activation.grad, stage.index - 1)]
    # A last forward's activation is received by stage s+1 in this step, and so is everything in
    # the final (draining) step. A last backward's gradient is received by stage s-1 only in its
    # next step, after its next forward: it waits for this stage's first group of that step, so
    # that no send is open while the loop runs a collective between steps (NCCL and Gloo would
    # both hang there: stage s-1 in the all-reduce, stage s in its send).
    last_action, _ = actions[-1]
    if last_action == "B" and not final:
        stage.pending = sends
    else:
        stage.pending = []
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


### more: a tied weight, refused (GPT-2's wte.weight, lm_head.weight)
# pipeline.py gives the last stage a copy of a weight the first and the last stage share and sums
# the two copies' gradients before each step, but here the first and the last stage step after
# each micro-batch's backward at different times, each with its own stashed versions. This part
# wraps the core's parallelize under its own name: the callers' code does not change.


def refuse_tied_weights(stage, model):
    """A ValueError naming the weights the first and the last modules share, in a pipeline of
    more than one stage."""
    tied_names = tied_weights(model, stage)
    if stage.num_stages > 1 and tied_names:
        raise ValueError(
            f"the first and the last modules share {tied_names}: pipeline_pipedream.py cannot "
            "keep a tied weight's two stages in step; untie it, or use pipeline.py"
        )


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


untied_parallelize = parallelize


def parallelize(model, device, *args, **kwargs):
    """The core's parallelize (the same arguments), refusing a weight the first and the last
    stage share."""
    stage = untied_parallelize(model, device, *args, **kwargs)
    refuse_tied_weights(stage, model)
    return stage


### end: Pipeline


def every_stage_order(args, loader, world, device):
    """--simulate: each stage's actions in two steps, as it ran them. The other ranks do not exist
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
            optimizer = common.make_optimizer(stage.parameters(), args)
            recorder = common.record_pipeline_order(stage, 2 * args.microbatches, optimizer)
            # The formula's two batches: the stream runs through their boundary, the second drains.
            train_step(stage, x, y, args.microbatches, optimizer)
            train_step(stage, x, y, args.microbatches, optimizer, final=True)
            orders.append(recorder.recorded()["order"])
    return orders


def formula(psi, world, args):
    """Rank 0's promises, psi its stage's parameters: its bytes (the stashed copies come and go
    with the micro-batches); over the first two batches, the idle fraction of one 1F1B over 2m
    micro-batches (no flush between them) and p-s micro-batches in flight on stage s, or all 2m
    when there are fewer (m < p/2). No traffic promise: the Meter counts the stream's first steps,
    in which fewer gradients than activations cross a boundary (the backwards still in flight
    come in later steps)."""
    optim_per_param = 8 if args.optim == "adamw" else 4
    m = args.microbatches
    return dict(
        param_bytes=4 * psi,
        grad_bytes=4 * psi,
        optim_bytes=optim_per_param * psi,
        bubble=(world - 1) / (2 * m + world - 1),
        peak_inflight=[min(world - s, 2 * m) for s in range(world)],
        notes=dict(
            param_bytes="4Ψ_s: this stage's",
            grad_bytes="4Ψ_s",
            optim_bytes=f"{optim_per_param}Ψ_s",
            bubble="(p-1)/(2m+p-1)",
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
        not args.clip,
        "--clip is refused: each stage steps after each of its micro-batches' backwards, at its "
        "own times, so no step has a gradient norm over all stages (use pipeline.py)",
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
            # the run's last batch drains the pipeline
            final = step + 1 >= stop or (epoch + 1 == args.epochs and i + 1 == len(loader))
            loss = train_step(model, x, y, args.microbatches, optimizer, final)  # m updates
            scheduler.step()
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
        # the first two batches: their orders, and the weight versions each F and B used
        recorder = common.record_pipeline_order(model, 2 * args.microbatches, optimizer)
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
        promised = formula(psi_stage, world, args)
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
        "PipeDream: asynchronous 1F1B with weight stashing on the common ViT, written out",
        simulates=True,
    )
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per batch (m)")
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
