"""N-D parallelism: data (HSDP: replicas of FSDP groups), tensor and pipeline parallelism composed
on one DeviceMesh, with PyTorch's own pieces: init_device_mesh, parallelize_module (Megatron TP),
fully_shard (FSDP2; HSDP with a replicate dimension) and torch.distributed.pipelining.

W = P·R·S·T ranks on a mesh of shape (pp, dp_replicate, dp_shard, tp), tp innermost (the ranks
that talk every layer sit next to each other: one node, NVLink), pp outermost (one send per
micro-batch may cross the slow network). 2 nodes x 4 GPUs, --pp 2 --dp-shard 2 --tp 2:

                 dp_shard 0      dp_shard 1
    pp 0 node 0: [ 0 | 1 ]       [ 2 | 3 ]      [a | b] one TP group: blocks' linears split by heads
    pp 1 node 1: [ 4 | 5 ]       [ 6 | 7 ]      0-2, 1-3, 4-6, 5-7: FSDP groups (shard the TP shards)
                                                0-4, 1-5, 2-6, 3-7: pipelines (stage 0 -> stage 1)
The data-parallel rank is (dp_replicate, dp_shard): ranks that differ only in tp or pp read the
same batch/(R·S) samples. Order of application: the pipeline split first (each rank keeps its
stage's blocks, FSDP and TP then see only those); TP inside, then FSDP: fully_shard shards the
DTensor TP shards further along the dp mesh (a 2-D parameter), whereas sharding first would leave
TP to split flat FSDP buffers that no longer have the weight's rows and columns.

Memory per rank (fp32, AdamW): 16Ψ/(P·T·S) bytes for the split part (Ψ_stage's linears / T, then
/ S by FSDP), the norms and row biases of the stage not split by T. Communication per step on
the mesh dimension that carries it: tp: 4 all-reduces per block per micro-batch of the
[B/(R·S·m), T, D] activation (Megatron f and g); dp_shard: FSDP all-gathers of the stage's
parameters for forward and backward, one reduce-scatter of its gradients; dp_replicate: one
all-reduce of the shard's gradients (HSDP); pp: m activations sent forward, m gradients back.

    torchrun --standalone --nproc_per_node=4 nd_parallel.py --dp-shard 2 --tp 2
    torchrun --standalone --nproc_per_node=8 nd_parallel.py --pp 2 --dp-shard 2 --tp 2 --microbatches 4
    python nd_parallel.py --nproc 4 --dp-replicate 2 --dp-shard -1 --pp 2 --schedule gpipe
"""
import datetime
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler

import common

SCRIPT = os.path.splitext(os.path.basename(__file__))[0]


### begin: N-D parallel
# Model contract: model.embed (images -> [B, T, D], with a parameter pos [1, T, D]) -> model.blocks
# (each norm1, attn.{q,k,v,proj}, norm2, mlp.{fc1,fc2}: nn.Linear, heads contiguous in q, k, v's
# outputs, attention reading its head count off q's width) -> model.head (-> logits); cross-entropy.

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")    # outermost to innermost


def make_mesh(device, pp, dp_replicate, dp_shard, tp):
    return init_device_mesh(device.type, (pp, dp_replicate, dp_shard, tp), mesh_dim_names=DIMS)


def data_rank(mesh):
    """(dp rank, dp size): the ranks that differ only in tp or pp read the same samples."""
    r, s = mesh["dp_replicate"], mesh["dp_shard"]
    return r.get_local_rank() * s.size() + s.get_local_rank(), r.size() * s.size()


class Stage(nn.Module):
    """Stage s of p: blocks s·d/p .. (s+1)·d/p - 1, the embedding on the first, the head on the last.
    Blocks keep their index in the whole model, so the state_dict has the plain model's keys."""

    def __init__(self, model, s, p):
        super().__init__()
        d, self.s, self.p = len(model.blocks), s, p
        self.embed = model.embed if s == 0 else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(s * d // p, (s + 1) * d // p)})
        self.head = model.head if s == p - 1 else None
        self.act_shape = tuple(model.embed.pos.shape[1:])      # (T, D): what crosses a stage boundary

    def forward(self, x):
        for layer in [self.embed, *self.blocks.values(), self.head]:
            x = x if layer is None else layer(x)
        return x


# Megatron's split: q, k, v, fc1 by output rows (heads), proj, fc2 by input columns, their outputs
# summed by an all-reduce; norms and row biases replicated (DTensor keeps their gradients whole).
TP_PLAN = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
           "attn.proj": RowwiseParallel(), "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def parallelize(model, mesh, device, microbatches, schedule):
    """Pipeline split, then TP inside each block, then FSDP over the dp mesh (HSDP when R > 1)."""
    pp, tp = mesh["pp"], mesh["tp"]
    stage = Stage(model, pp.get_local_rank(), pp.size()).to(device)
    if tp.size() > 1:
        for block in stage.blocks.values():
            parallelize_module(block, tp, TP_PLAN)
    dp = mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]
    if dp.size() > 1:
        for block in stage.blocks.values():
            fully_shard(block, mesh=dp)                # gathered for its forward, freed, again for backward
        fully_shard(stage, mesh=dp)                    # the rest of the stage: embedding, head
    stage.answers = stage.s == stage.p - 1 and tp.get_local_rank() == 0    # counts the test samples once
    stage.schedule, stage.group = None, pp.get_group()
    if pp.size() > 1:   # each micro-batch's mean loss / m: the summed gradients are the batch mean's
        pipe = PipelineStage(stage, stage.s, stage.p, device, group=stage.group)
        stage.schedule = SCHEDULES[schedule](pipe, microbatches, scale_grads=False,
                                             loss_fn=lambda out, y: F.cross_entropy(out, y) / microbatches)
    return stage


def train_step(stage, x, y):
    """Forward, loss and backward of this dp rank's batch: the pipeline schedule runs its micro-batches
    (input on the first stage, targets on the last). The batch's mean loss on the last stage, 0 before."""
    if stage.schedule is None:
        loss = F.cross_entropy(stage(x), y)
        loss.backward()
        return loss.detach()
    losses = []
    stage.schedule.step(*([x] if stage.s == 0 else []), **(dict(target=y, losses=losses) if stage.s == stage.p - 1 else {}))
    return torch.stack(losses).sum().detach() if losses else torch.zeros((), device=x.device)


@torch.no_grad()
def infer(stage, x):
    """The batch through the stages in turn (p2p on the pp group): logits where stage.answers, else None."""
    s, p, group = stage.s, stage.p, stage.group
    if s > 0:
        x = torch.empty(len(x), *stage.act_shape, device=x.device)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, x, dist.get_global_rank(group, s - 1), group)]):
            work.wait()
    out = stage(x)
    if s < p - 1:
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, dist.get_global_rank(group, s + 1), group)]):
            work.wait()
    return out if stage.answers else None


def full_state_dict(stage, mesh):
    """The common model's plain state_dict on rank 0 (None elsewhere): each stage's whole tensors
    (TP and FSDP shards gathered by every rank of the stage), then the stages' pieces to rank 0."""
    state = {k: v.cpu() for k, v in get_model_state_dict(stage, options=StateDictOptions(full_state_dict=True)).items()}
    if any(mesh[d].get_local_rank() for d in DIMS[1:]):
        return None
    parts = [None] * mesh["pp"].size() if stage.s == 0 else None
    dist.gather_object(state, parts, dst=dist.get_global_rank(stage.group, 0), group=stage.group)
    return {k: v for part in parts for k, v in part.items()} if parts else None
### end: N-D parallel


def formula(psi, world, args):
    """Rank 0's bytes (stage 0, TP shard 0, FSDP shard 0) worked out from the model's shapes, and the
    traffic per step on each mesh dimension (B_dp = batch/(R·S) samples of T tokens of D on this rank)."""
    model, k, (R, S, T, P, m) = common.build_model(args), 8 if args.optim == "adamw" else 4, \
        (args.dp_replicate, args.dp_shard, args.tp, args.pp, args.microbatches if args.pp > 1 else 1)
    stage, own = Stage(model, 0, P), dict(blocks=0, rest=0)
    for name, p in stage.named_parameters():
        shape, (layer, kind), part = list(p.shape), name.split(".")[-2:], name.split(".")[0]
        if T > 1 and part == "blocks" and layer in ("q", "k", "v", "fc1"):
            shape[0] //= T                             # ColwiseParallel: rows (heads)
        elif T > 1 and part == "blocks" and layer in ("proj", "fc2") and kind == "weight":
            shape[1] //= T                             # RowwiseParallel: columns
        if R * S > 1:
            shape[0] = -(-shape[0] // S)               # fully_shard: dim 0 in S pieces, padded
        own["blocks" if part == "blocks" else "rest"] += math.prod(shape)
    n = own["blocks"] + own["rest"]
    act = 4 * args.batch_size // (R * S) * model.embed.tokens * args.dim
    dims = dict(tp=dict(all_reduce=6 * len(stage.blocks) * act) if T > 1 else {},
                dp_shard=dict(all_gather=4 * S * (2 * own["blocks"] + own["rest"]), reduce_scatter=4 * S * n)
                if S > 1 else {}, dp_replicate=dict(all_reduce=4 * n) if R > 1 else {},
                pp=dict(send=act, recv=0) if P > 1 else {})
    comm = {}
    for kinds in dims.values():
        for kind, b in kinds.items():
            comm[kind] = comm.get(kind, 0) + b
    return dict(param_bytes=4 * n, grad_bytes=4 * n, optim_bytes=k * n, comm=comm, dims=dims,
                notes=dict(param_bytes="≈4Ψ/(P·T·S): stage 0's, split by T, sharded by S",
                           grad_bytes="≈4Ψ/(P·T·S)", optim_bytes=f"≈{k}Ψ/(P·T·S)",
                           all_reduce="tp: 6 per block (f: q, k, v, fc1; g: proj, fc2) of B/(R·S)·T·D; "
                                      "dp_replicate: the shard's grads",
                           all_gather="dp_shard: blocks for forward and backward, the rest once",
                           reduce_scatter="dp_shard: the stage's TP-shard grads once a step",
                           send="pp: m activations of B/(R·S·m)·T·D", recv="stage 0 receives none"))


def per_dimension(meter, mesh, args):
    """The Meter's traffic, keyed by the mesh dimension whose process group carried it."""
    names = {mesh.get_group(d).group_name: d for d in DIMS if mesh[d].size() > 1}
    dims = {names.get(g, f"group {g}"): kinds for g, kinds in meter.comm_by_group().items()}
    common.log("\ncommunication per mesh dimension, per step (calls in the Meter's window)")
    for d, kinds in sorted(dims.items()):
        common.log(f"  {d:<14}" + ", ".join(f"{k} {common.fmt_bytes(b)} ({c})" for k, (c, b) in sorted(kinds.items())))
    return dict(mesh=dict(zip(DIMS, mesh.mesh.shape)), comm_by_dim=dims)


def check_args(args, world):
    """Resolve the one -1 ("the rest") and refuse a layout that cannot work, before any group is formed."""
    sizes = dict(dp_replicate=args.dp_replicate, dp_shard=args.dp_shard, tp=args.tp, pp=args.pp)
    rest = [k for k, v in sizes.items() if v == -1]
    common.check(len(rest) <= 1 and all(v == -1 or v >= 1 for v in sizes.values()),
                 f"mesh sizes must be >= 1, at most one of them -1 (the rest): {sizes}")
    known = math.prod(v for v in sizes.values() if v != -1)
    if rest:
        common.check(world % known == 0, f"world size {world} is not divisible by the product {known} of {sizes}")
        sizes[rest[0]] = world // known
        setattr(args, rest[0], world // known)
    layout = " x ".join(f"--{k.replace('_', '-')} {v}" for k, v in sizes.items())
    common.check(math.prod(sizes.values()) == world, f"{layout} = {math.prod(sizes.values())} ranks, but the world "
                 f"size is {world}: the mesh must cover every rank once")
    common.check(args.heads % args.tp == 0, f"--heads {args.heads} is not divisible by --tp {args.tp}: tensor "
                 f"parallelism gives every rank whole heads")
    common.check(args.pp <= args.depth, f"--pp {args.pp} stages is more than --depth {args.depth} blocks")
    dp, m = args.dp_replicate * args.dp_shard, args.microbatches if args.pp > 1 else 1
    common.check(args.microbatches >= 1, f"--microbatches must be >= 1, got {args.microbatches}")
    common.check(args.batch_size % (dp * m) == 0, f"--batch-size {args.batch_size} is not divisible by the "
                 f"data-parallel size {dp} x {m} micro-batches: every micro-batch must have the same size")
    common.check(args.pp == 1 or args.schedule != "1f1b" or args.microbatches >= args.pp,
                 f"--schedule 1f1b needs at least as many micro-batches as stages: --microbatches "
                 f"{args.microbatches} < --pp {args.pp} (or use gpipe)")


def setup(args):
    """Join the process group. torchrun (or common.launch) put RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT in the environment; LOCAL_RANK picks this process's GPU."""
    backend, device = common.pick_backend(args.backend)    # NCCL and a GPU per rank, else Gloo on the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=args.timeout)
    # torchrun keeps one store across restarts (--max-restarts): prefix it per attempt, or a
    # restarted rank may read the address of a worker that died in the last attempt and hang.
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return rank, world, device, backend


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def train(model, optimizer, scheduler, loader, sampler, args, device, step=0):
    """The loop every script shares: forward, loss, backward, step, schedule, log."""
    stop, world = args.max_steps or float("inf"), dist.get_world_size() // args.pp    # ranks with the loss
    loss_sum, loss_n, last_loss, steps_run, t_train = torch.zeros((), device=device), 0, float("nan"), 0, 0.0
    for epoch in range(step // len(loader), args.epochs):
        if step >= stop:
            break
        sampler.set_epoch(epoch)                   # a new shuffle each epoch, the same on every rank
        loader.dataset.set_epoch(epoch)            # and new augmentations (--shift), the same everywhere
        model.train()
        t0 = time.perf_counter()
        bar = common.progress(loader, args, epoch)
        for i, (x, y) in enumerate(bar):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = train_step(model, x, y)         # forward, loss, backward (micro-batches when pp > 1)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            loss_sum, loss_n, step, steps_run = loss_sum + loss.detach(), loss_n + 1, step + 1, steps_run + 1
            if step % args.log_every == 0 or step >= stop or i + 1 == len(loader):
                dist.all_reduce(loss_sum)          # last stages' losses (every TP rank's, the same): average
                last_loss, loss_sum, loss_n = loss_sum.item() / world / loss_n, loss_sum * 0, 0
                common.log_loss(bar, args, epoch, step, last_loss)
            if step >= stop:
                break
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_train += time.perf_counter() - t0
        common.log(f"epoch {epoch}: step {step}, train loss {last_loss:.4f}")
    return dict(steps=step, steps_run=steps_run, loss=last_loss, train_time=t_train)


@torch.no_grad()
def evaluate(model, loader, device):
    """Exact: the loader pads every rank to the same number of batches (padding masked out), so
    every rank runs the same forward passes and collectives and each sample counts once."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=device)
    for x, y, keep in loader:
        x, y, keep = x.to(device), y.to(device), keep.to(device)
        logits = infer(model, x)                   # stage to stage: the logits on one rank per dp rank
        counts += torch.stack([((logits.argmax(1) == y) & keep).sum(), keep.sum()]) if logits is not None else 0
    dist.all_reduce(counts)
    return counts[0].item() / max(counts[1].item(), 1)


def run(args):
    """One rank, in the seeds' order: join the group, deal the data, build the model, wrap it,
    train, evaluate, save on rank 0, leave the group."""
    rank, world, device, backend = setup(args)
    try:
        train_set, test_set, source = common.load_data(args, device)
        mesh = make_mesh(device, args.pp, args.dp_replicate, args.dp_shard, args.tp)
        dp_rank, dp_world = data_rank(mesh)        # the mesh's (dp_replicate, dp_shard) coordinates
        sampler = DistributedSampler(train_set, num_replicas=dp_world, rank=dp_rank, shuffle=True,
                                     seed=args.seed, drop_last=True)
        loader = DataLoader(train_set, batch_size=args.batch_size // dp_world, sampler=sampler, drop_last=True,
                            pin_memory=device.type == "cuda")
        common.check(len(loader) > 0, f"{len(train_set)} training samples make no full batch of {args.batch_size}")
        model = common.build_model(args)           # the same seeded weights on every rank
        if args.load:
            model.load_state_dict(common.load_state_dict_file(args.load, model.state_dict()))
        psi = sum(p.numel() for p in model.parameters())
        model = parallelize(model, mesh, device, args.microbatches, args.schedule)
        optimizer = common.make_optimizer(model.parameters(), args)
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        common.log(f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data ({len(train_set)} train / "
                   f"{len(test_set)} test), batch {args.batch_size} = {dp_world} x {args.batch_size // dp_world}")
        with common.Meter(model, optimizer, args) as meter:
            out = train(model, optimizer, scheduler, loader, sampler, args, device)
        acc = evaluate(model, common.test_loader(test_set, dp_rank, dp_world, pin_memory=device.type == "cuda"),
                       device)
        state = full_state_dict(model, mesh)       # every rank takes part; rank 0 holds the whole
        if rank == 0 and args.save:
            common.save_checkpoint(state, args.save)
            common.log(f"saved {args.save}")
        common.report(SCRIPT, args, world, backend, device, source, psi, out, acc, meter, formula(psi, world, args),
                      **per_dimension(meter, mesh, args))
    finally:
        cleanup()


def main():
    parser = common.get_parser("N-D parallelism: HSDP x TP x PP on one DeviceMesh, on the common ViT")
    for flag, default, what in (("dp-replicate", 1, "replicas (HSDP)"), ("dp-shard", -1, "FSDP shards"),
                                ("tp", 1, "tensor-parallel ranks"), ("pp", 1, "pipeline stages")):
        parser.add_argument(f"--{flag}", type=int, default=default, help=f"{what}; -1: the rest of the world")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per batch with --pp > 1 (m)")
    parser.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b")
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
