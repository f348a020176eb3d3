"""N-D parallelism: data, tensor and pipeline parallelism composed on one DeviceMesh
(init_device_mesh), with PyTorch's own pieces, applied in this order: torch.distributed.pipelining
(GPipe, 1F1B), parallelize_module (Megatron's tensor parallelism), fully_shard (FSDP2; HSDP when
there is a replicate dimension). W = P·R·S·T ranks on a mesh (pp, dp_replicate, dp_shard, tp),
outermost to innermost. Two nodes of 4 GPUs, --pp 2 --dp-shard 2 --tp 2:

                          dp_shard 0   dp_shard 1
    node 0, stage 0:        [0  1]       [2  3]       [a b]  a tp group: the blocks' heads split
    node 1, stage 1:        [4  5]       [6  7]       0-2, 1-3, 4-6, 5-7: dp_shard (FSDP) groups
                                                      0-4, 1-5, 2-6, 3-7: pp groups (the pipes)

Memory per rank (fp32, AdamW, Ψ parameters): ≈ 16Ψ/(P·T·S) bytes. Per step (act: B/(R·S)
samples x T tokens x D, fp32): tp all-reduces 6·act a block; dp_shard all-gathers ≈ 2·4Ψ/(P·T)
and reduce-scatters ≈ 4Ψ/(P·T); dp_replicate all-reduces ≈ 4Ψ/(P·T·S); pp sends and
receives act.
Paper: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", https://arxiv.org/abs/2104.04473. Layout and traffic derived:
docs/techniques.md#n-d-parallelism-mesh-layout-and-traffic

    torchrun --standalone --nproc_per_node=4 nd_parallel.py --dp-shard 2 --tp 2      # FSDP x TP
    torchrun --standalone --nproc_per_node=8 nd_parallel.py --pp 2 --dp-shard 2 --tp 2   # 3-D
    python nd_parallel.py --nproc 4 --dp-replicate 2 --dp-shard -1 --pp 2 --schedule gpipe  # S=1
    # the picture's two nodes: the same command on each, HOST being node 0's address
    torchrun --nnodes=2 --nproc_per_node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
             nd_parallel.py --pp 2 --dp-shard 2 --tp 2
"""

import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler

import common

SCRIPT = os.path.splitext(os.path.basename(__file__))[0]


### begin: N-D parallel
# Model contract: model.embed (images -> [B, T, D], with a parameter pos [1, T, D]), model.blocks
# (each norm1, attn.{q,k,v,proj}, norm2, mlp.{fc1,fc2}: nn.Linear; the heads contiguous in q, k
# and v's outputs; the attention reads its head count off q's width, so that on a TP rank, whose q
# puts out heads/T heads, it runs those heads only), model.head (-> logits); the loss is
# cross-entropy.

# The mesh's dimensions, outermost to innermost (torchtitan's names).
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")

# Megatron's split of a block. An nn.Linear's weight is [out, in]. ColumnParallelLinear (Colwise)
# for q, k, v and fc1: each rank holds some rows of the weight, so computes some of the output
# features: whole heads, and a slice of the MLP's hidden units. RowParallelLinear (Rowwise) for
# proj and fc2: each rank holds the matching columns, the input features it has, and their partial
# outputs are summed by an all-reduce (Megatron's g, in forward). Each Colwise layer's input is
# Megatron's f: the same on every rank in forward, its gradient all-reduced in backward. The norms
# stay replicated.
TP_PLAN = {
    "attn.q": ColwiseParallel(),
    "attn.k": ColwiseParallel(),
    "attn.v": ColwiseParallel(),
    "attn.proj": RowwiseParallel(),
    "mlp.fc1": ColwiseParallel(),
    "mlp.fc2": RowwiseParallel(),
}

# GPipe runs every micro-batch's forward, then every backward: m micro-batches' activations held.
# 1F1B alternates once the pipe is full: at most P micro-batches' activations held.
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class Stage(nn.Module):
    """Pipeline stage `index` of `num_stages`: its share of the model's blocks, the embedding on
    the first stage, the head on the last. Each block keeps its index in the model as its key, so
    that each of the stage's tensors has its name in the model."""

    def __init__(self, model, index, num_stages):
        super().__init__()
        depth = len(model.blocks)
        first_block = index * depth // num_stages
        end_block = (index + 1) * depth // num_stages  # one past the stage's last block
        self.index = index
        self.num_stages = num_stages
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self.embed = model.embed if self.is_first else None
        blocks = {str(i): model.blocks[i] for i in range(first_block, end_block)}
        self.blocks = nn.ModuleDict(blocks)
        self.head = model.head if self.is_last else None
        # One sample's activation, (T, D), in the parameters' dtype, is what crosses a stage
        # boundary: infer() sizes its receive buffer by both (on NCCL a buffer of another dtype
        # posts another byte count than the send). Training needs neither: PipelineStage sends
        # each boundary's shape and dtype in its first step's handshake.
        self.activation_shape = tuple(model.embed.pos.shape[1:])
        self.activation_dtype = model.embed.pos.dtype

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(x)
        return x


def data_parallel_mesh(mesh):
    """The mesh FSDP shards over: dp_shard, or (dp_replicate, dp_shard) for HSDP, which shards
    inside each replica and all-reduces the shards' gradients across the replicas."""
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def pipeline_schedule(stage, pp_mesh, device, microbatches, schedule_name):
    """The schedule that runs this stage's micro-batches. Each micro-batch's loss is its mean
    divided by m and the schedule does not rescale (scale_grads=False): the gradients summed over
    the m micro-batches are those of the batch's mean loss. PipelineStage finds the shapes that
    cross the stage boundaries at the first step (a handshake and one no-grad forward)."""
    # torch's wrapper of our Stage: it sends and receives the activations and their gradients
    pipeline_stage = PipelineStage(
        stage, stage.index, stage.num_stages, device, group=pp_mesh.get_group()
    )

    def micro_batch_loss(logits, targets):
        return F.cross_entropy(logits, targets) / microbatches

    schedule_class = SCHEDULES[schedule_name]
    return schedule_class(pipeline_stage, microbatches, loss_fn=micro_batch_loss, scale_grads=False)


def parallelize(model, mesh, device, microbatches, schedule_name):
    """This rank's part of the model: its pipeline stage, each block split by TP, the whole
    sharded by FSDP over the data-parallel ranks, and the schedule that runs the micro-batches."""
    pp_mesh = mesh["pp"]
    tp_mesh = mesh["tp"]
    dp_mesh = data_parallel_mesh(mesh)
    # 1. The pipeline split: this rank keeps its stage's blocks and nothing else.
    stage = Stage(model, pp_mesh.get_local_rank(), pp_mesh.size()).to(device)
    # Rank 0 also keeps the unsplit model, whose own state_dict() full_state_dict takes: the other
    # stages' modules stay where the model was built, a copy on rank 0 alone. object.__setattr__
    # keeps it out of the stage's submodules, whose parameters are the stage's.
    object.__setattr__(stage, "unsplit_model", model if dist.get_rank() == 0 else None)
    # 2. Tensor parallelism inside each of the stage's blocks: their weights become DTensors. The
    # plan's keys are module paths inside the stage; `*` matches every block's key.
    if tp_mesh.size() > 1:
        plan = {f"blocks.*.{name}": style for name, style in TP_PLAN.items()}
        parallelize_module(stage, tp_mesh, plan)
    # 3. FSDP over the TP shards. Each block is a unit: gathered for its forward, freed, gathered
    # again for its backward. The stage itself is the last unit: the embedding and the head.
    if dp_mesh.size() > 1:
        for block in stage.blocks.values():
            fully_shard(block, mesh=dp_mesh)
        fully_shard(stage, mesh=dp_mesh)
    # What train_step, infer and full_state_dict need besides the module, kept on the stage: the
    # skeleton's train() and evaluate() pass them only `model`.
    stage.pp_group = pp_mesh.get_group()
    # Each test sample's logits are counted on one rank: the last stage's first tp rank. Its tp
    # peers hold the same logits (the head is not split), and would count each sample T times.
    stage.answers = stage.is_last and tp_mesh.get_local_rank() == 0
    stage.schedule = None
    if pp_mesh.size() > 1:
        stage.schedule = pipeline_schedule(stage, pp_mesh, device, microbatches, schedule_name)
    return stage


def train_step(stage, x, y):
    """Forward, loss and backward of this data-parallel rank's batch. Returns the batch's mean
    loss on the last stage, and 0 on the stages before it, which never see the loss (train()
    sums the losses over every rank and divides by the last stage's ranks only)."""
    if stage.schedule is None:
        loss = F.cross_entropy(stage(x), y)
        loss.backward()
        return loss.detach()
    # The schedule runs the micro-batches; the stages after the first receive their inputs from
    # the stage before, so only the first is given the images and only the last the targets.
    if stage.is_first:
        stage.schedule.step(x)
        return torch.zeros((), device=x.device)
    if not stage.is_last:
        stage.schedule.step()
        return torch.zeros((), device=x.device)
    losses = []  # the schedule appends each micro-batch's loss, already divided by m
    stage.schedule.step(target=y, losses=losses)
    return torch.stack(losses).sum().detach()


def clip_grad_norm_(stage, max_norm):
    """torch's clip_grad_norm_ for a stage whose parameters are DTensors on several meshes (TP's,
    FSDP's, both) or plain tensors, which no one foreach call may mix: each mesh's norm is reduced
    over its own ranks (get_total_norm on DTensors, then full_tensor), the stages' squares summed
    over the pipeline, and each mesh's gradients scaled by the one global norm, as torchtitan
    does. Returns the global norm."""
    params_by_mesh = {}
    for param in stage.parameters():
        if param.grad is not None:
            mesh = param.device_mesh if isinstance(param, DTensor) else None
            params_by_mesh.setdefault(mesh, []).append(param)
    squares = torch.zeros((), device=next(stage.parameters()).device)
    for params in params_by_mesh.values():
        norm = torch.nn.utils.get_total_norm([param.grad for param in params])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # the norm over every rank of that mesh
        squares += norm**2
    if stage.num_stages > 1:
        # The stages hold different parameters: the global norm sums their squares.
        dist.all_reduce(squares, group=stage.pp_group)
    total_norm = squares.sqrt()
    for params in params_by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
    return total_norm


def send_or_receive(op, tensor, peer, group):
    """One message (op: dist.isend or dist.irecv), as a batch of one, as pipeline.py's p2p posts
    them. Which NCCL communicator carries it: launch binds each rank's GPU (init_process_group's
    device_id), so in torch 2.14 every group, pp_group too, connects its communicator eagerly, and
    a send or a receive, batched or not, runs on the group's own one. Unbound, a plain dist.send
    or dist.recv would create a two-rank communicator for each pair of peers (the batch would not);
    the batch of one is right either way."""
    message = dist.P2POp(op, tensor, peer, group)
    for request in dist.batch_isend_irecv([message]):
        request.wait()


@torch.no_grad()
def infer(stage, x):
    """The batch through the stages in turn: each stage receives its input from the stage before
    and sends its output to the stage after. A chain, not a cycle: every send meets a receive
    that its peer has already posted or is about to post. Returns the logits where stage.answers,
    None elsewhere."""
    group = stage.pp_group
    stage_input = x
    if not stage.is_first:
        # The stages after the first do not use the images: their input is the stage before's
        # activation, one [T, D] per sample. P2POp names the peer by its global rank.
        shape = (len(x), *stage.activation_shape)
        stage_input = torch.empty(shape, dtype=stage.activation_dtype, device=x.device)
        previous_rank = dist.get_global_rank(group, stage.index - 1)
        send_or_receive(dist.irecv, stage_input, previous_rank, group)
    output = stage(stage_input)
    if not stage.is_last:
        next_rank = dist.get_global_rank(group, stage.index + 1)
        send_or_receive(dist.isend, output, next_rank, group)
    if stage.answers:
        return output
    return None


def full_state_dict(stage, mesh):
    """The model's own state_dict() on rank 0 (its keys, its persistent buffers, whatever its
    state_dict hooks make of them), None elsewhere. Every rank puts its stage's tensors together
    from their TP and FSDP shards (whole_tensors); the pipe through rank 0 (every coordinate but
    pp zero) gathers them on rank 0, stage 0's first rank, which takes its unsplit model's
    state_dict() with every whole tensor in place, as one process would. (torch's
    get_model_state_dict on the stage would miss the buffers and hooks the model keeps outside
    its embed, blocks and head, and raises on a key a hook made.)"""
    # The other pipes hold copies of the same stages: they take part in the shards' gathers only.
    in_rank_0_pipe = all(
        mesh[dim].get_local_rank() == 0 for dim in ("dp_replicate", "dp_shard", "tp")
    )
    stage_tensors = whole_tensors(stage, keep=in_rank_0_pipe)
    if not in_rank_0_pipe:
        return None
    group = stage.pp_group
    stage_states = None  # gather_object fills a list on the destination only
    if stage.is_first:
        stage_states = [None] * stage.num_stages
    rank_0 = dist.get_global_rank(group, 0)  # gather_object names its destination globally
    dist.gather_object(stage_tensors, stage_states, dst=rank_0, group=group)
    if not stage.is_first:
        return None
    # The stages' names are disjoint and the model's (each block keeps its index in the model).
    in_place = []  # (module, name, what it held): put back after the state_dict
    model = stage.unsplit_model
    try:
        for parameters, buffers in stage_states:
            for path, whole in [*parameters.items(), *buffers.items()]:
                module_name, _, name = path.rpartition(".")
                module = model.get_submodule(module_name)
                in_place.append((module, name, getattr(module, name)))
                if path in parameters:
                    whole = nn.Parameter(whole, requires_grad=False)
                setattr(module, name, whole)
        return {key: tensor.detach().cpu() for key, tensor in model.state_dict().items()}
    finally:
        for module, name, held in reversed(in_place):
            setattr(module, name, held)


def whole_tensors(stage, keep):
    """({name: parameter}, {name: buffer}) of the stage, each whole on the CPU, under its name in
    the stage (the model's). A DTensor (TP's split, FSDP's shard, both) is all-gathered on its
    mesh, so every rank of the stage takes part, in the same order; a rank that does not `keep`
    the tensors drops each at once. TP and FSDP split no buffer."""
    for module in stage.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # its shards in place of any whole parameter a forward left
    parameters = {}
    for name, param in stage.named_parameters():
        whole = param.full_tensor() if isinstance(param, DTensor) else param
        if keep:
            parameters[name] = whole.detach().cpu()
    buffers = {}
    if keep:
        buffers = {name: buffer.detach().cpu() for name, buffer in stage.named_buffers()}
    return parameters, buffers


### end: N-D parallel


def rank0_elements(model, args):
    """Elements of rank 0's parameters (stage 0, tp shard 0, FSDP shard 0): (in its blocks, in
    the rest), counted off the model's shapes. TP splits q, k, v and fc1 by rows, the weights of
    proj and fc2 by columns; FSDP then cuts every tensor's dim 0 in S pieces, the last padded, so
    rank 0 holds the ceiling."""
    in_blocks = 0
    in_rest = 0
    for name, parameter in Stage(model, 0, args.pp).named_parameters():
        shape = list(parameter.shape)
        top_module = name.split(".")[0]  # embed, blocks or head
        layer, weight_or_bias = name.split(".")[-2:]  # e.g. q, weight
        if args.tp > 1 and top_module == "blocks":
            if layer in ("q", "k", "v", "fc1"):
                shape[0] //= args.tp
            elif layer in ("proj", "fc2") and weight_or_bias == "weight":
                shape[1] //= args.tp
        shape[0] = math.ceil(shape[0] / args.dp_shard)
        if top_module == "blocks":
            in_blocks += math.prod(shape)
        else:
            in_rest += math.prod(shape)
    return in_blocks, in_rest


def formula(psi, world, args):
    """Rank 0's bytes from the model's shapes, and each mesh dimension's traffic per step, which
    the report sets next to what the Meter measured (per process group)."""
    model = common.build_model(args)
    in_blocks, in_rest = rank0_elements(model, args)
    elements = in_blocks + in_rest
    k = 8 if args.optim == "adamw" else 4  # the ZeRO paper's K: optimizer bytes per parameter
    samples = args.batch_size // (args.dp_replicate * args.dp_shard)
    act = 4 * samples * model.embed.tokens * args.dim  # bytes of [B/(R·S), T, D] in fp32
    dims = dict(tp={}, dp_shard={}, dp_replicate={}, pp={})  # {dimension: {kind: bytes a step}}
    if args.tp > 1:  # rank 0's stage, the first, holds depth // P blocks
        dims["tp"]["all_reduce"] = 6 * (args.depth // args.pp) * act
    if args.dp_shard > 1:  # the bytes of the tensors: the reduce-scatter's input is S shards
        dims["dp_shard"]["reduce_scatter"] = 4 * args.dp_shard * elements
    if args.dp_shard > 1 and args.pp == 1:  # with a pipeline, the schedule decides how often
        dims["dp_shard"]["all_gather"] = 4 * args.dp_shard * (2 * in_blocks + in_rest)
    if args.dp_replicate > 1:
        dims["dp_replicate"]["all_reduce"] = 4 * elements
    if args.pp > 1:
        dims["pp"]["send"] = act
        dims["pp"]["recv"] = act
    comm = {}  # the report's comm: {kind: bytes a step}, every dimension together
    for traffic in dims.values():
        for kind, nbytes in traffic.items():
            comm[kind] = comm.get(kind, 0) + nbytes
    return dict(
        param_bytes=4 * elements,
        grad_bytes=4 * elements,
        optim_bytes=k * elements,
        comm=comm,
        dims=dims,
        notes=dict(
            param_bytes="≈4Ψ/(P·T·S): stage 0's split by T, sharded by S",
            grad_bytes="≈4Ψ/(P·T·S)",
            optim_bytes=f"≈{k}Ψ/(P·T·S)",
            all_gather="dp_shard: blocks for forward and backward, the rest once",
            all_reduce="tp: 6 of act a block (f: q, k, v, fc1; g: proj, fc2); "
            "dp_replicate: the shard's grads",
            reduce_scatter="dp_shard: the stage's grads once a step",
            send="pp: m activations, act in all",
            recv="pp: m gradients (step 1 adds a shape handshake and a no-grad forward: "
            "not in the formulas)",
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
    given = " x ".join(
        f"--{dim.replace('_', '-')} {sizes[dim]}" for dim in sizes if dim not in rest_dims
    )
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
    common.check(
        not args.experts,
        "--experts: nd_parallel.py's tensor-parallel plan splits dense MLPs, not experts",
    )
    resolve_mesh_sizes(args, world)
    common.check(
        args.heads % args.tp == 0,
        f"--heads {args.heads} is not divisible by --tp {args.tp}: "
        "tensor parallelism gives every rank whole heads",
    )
    common.check(
        args.pp <= args.depth,
        f"--pp {args.pp} stages is more than --depth {args.depth} blocks",
    )
    common.check(
        args.microbatches >= 1,
        f"--microbatches must be >= 1, got {args.microbatches}",
    )
    dp_size = args.dp_replicate * args.dp_shard
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
                # Only the last stage's ranks hold a loss (equal on its tp ranks): average those.
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
        # The data-parallel rank is the (dp_replicate, dp_shard) coordinate, numbered row by row:
        # ranks that differ only in tp or pp read the same samples.
        replicate_mesh = mesh["dp_replicate"]
        shard_mesh = mesh["dp_shard"]
        dp_rank = replicate_mesh.get_local_rank() * shard_mesh.size() + shard_mesh.get_local_rank()
        dp_world = replicate_mesh.size() * shard_mesh.size()
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
        model = parallelize(model, mesh, device, args.microbatches, args.schedule)
        optimizer = common.make_optimizer(model.parameters(), args)
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        common.log(
            f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data "
            f"({len(train_set)} train / {len(test_set)} test), "
            f"batch {args.batch_size} = {dp_world} x {args.batch_size // dp_world}"
        )
        with common.Meter(model, optimizer, args, device=device) as meter:
            out = train(model, optimizer, scheduler, loader, sampler, args, device)
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
        "N-D parallelism: HSDP x TP x PP on one DeviceMesh, on the common ViT"
    )
    rest_help = "-1: the rest of the world"
    parser.add_argument("--dp-replicate", type=int, default=1, help=f"HSDP replicas R; {rest_help}")
    parser.add_argument("--dp-shard", type=int, default=-1, help=f"FSDP shards S; {rest_help}")
    parser.add_argument("--tp", type=int, default=1, help=f"tensor-parallel ranks T; {rest_help}")
    parser.add_argument("--pp", type=int, default=1, help=f"pipeline stages P; {rest_help}")
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
