"""N-D parallelism: data (HSDP: replicas of FSDP groups), tensor and pipeline parallelism on one
DeviceMesh with PyTorch's own pieces: init_device_mesh, parallelize_module (Megatron TP), fully_shard
(FSDP2, HSDP with a replicate dimension), torch.distributed.pipelining (GPipe, 1F1B). Exact.

W = P·R·S·T ranks on a mesh (pp, dp_replicate, dp_shard, tp): tp innermost (it talks every layer:
keep it inside a node), pp outermost (a send per micro-batch may cross nodes). 2 nodes x 4 GPUs,
--pp 2 --dp-shard 2 --tp 2:   node 0 = stage 0: [0 1] [2 3]   [a b]: a TP group (heads split)
                              node 1 = stage 1: [4 5] [6 7]   0-2, 1-3, 4-6, 5-7: FSDP groups; 0-4 ..: pipes
Ranks that differ only in tp or pp read the same batch/(R·S) samples (the data rank is the mesh's
(dp_replicate, dp_shard) coordinate). Order: the pipeline split first (TP and FSDP see only the
stage's blocks), then TP, then FSDP: fully_shard shards the DTensor TP shards again on dim 0 over
the dp mesh; sharded first, TP would have to split flat FSDP shards that lost rows and columns.

Memory per rank (fp32, AdamW): ≈16Ψ/(P·T·S) bytes (norms, biases, embedding, head: not split by T).
Per step, per mesh dimension: tp: 6 all-reduces of [B/(R·S), T, D] per block (DTensor's f for q,
k, v, fc1 each, g for proj, fc2); dp_shard: FSDP all-gathers, a reduce-scatter of the grads;
dp_replicate: an all-reduce of the shard's grads (HSDP); pp: m activations out, m gradients back.

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

DIMS = (
    "pp",
    "dp_replicate",
    "dp_shard",
    "tp",
)  # outermost to innermost: the mesh's dimension names


class Stage(nn.Module):
    """Blocks s·d/p .. (s+1)·d/p - 1 (keys: their index in the model), embedding on 0, head on p-1."""

    def __init__(self, model, s, p):
        super().__init__()
        d, self.s, self.p = len(model.blocks), s, p
        self.embed = model.embed if s == 0 else None
        self.blocks = nn.ModuleDict(
            {str(i): model.blocks[i] for i in range(s * d // p, (s + 1) * d // p)}
        )
        self.head = model.head if s == p - 1 else None
        self.act_shape = tuple(model.embed.pos.shape[1:])  # (T, D): what crosses a stage boundary

    def forward(self, x):
        for layer in [self.embed, *self.blocks.values(), self.head]:
            x = x if layer is None else layer(x)
        return x


# Megatron: q, k, v, fc1 split by rows (heads), proj, fc2 by columns (outputs all-reduced); norms replicated.
TP_PLAN = {
    "attn.q": ColwiseParallel(),
    "attn.k": ColwiseParallel(),
    "attn.v": ColwiseParallel(),
    "attn.proj": RowwiseParallel(),
    "mlp.fc1": ColwiseParallel(),
    "mlp.fc2": RowwiseParallel(),
}


def parallelize(model, mesh, device, microbatches, schedule):
    """Pipeline split, then TP inside each block, then FSDP over the dp mesh (HSDP when R > 1)."""
    pp, tp = mesh["pp"], mesh["tp"]
    stage = Stage(model, pp.get_local_rank(), pp.size()).to(device)
    if tp.size() > 1:
        parallelize_module(
            stage, tp, {f"blocks.*.{name}": style for name, style in TP_PLAN.items()}
        )
    dp = mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]
    if dp.size() > 1:
        for module in [
            *stage.blocks.values(),
            stage,
        ]:  # a block gathered for its forward, freed, again
            fully_shard(module, mesh=dp)  # for backward; then the rest (embedding, head)
    stage.answers = (
        stage.s == stage.p - 1 and tp.get_local_rank() == 0
    )  # counts the test samples once
    stage.schedule, stage.group = None, pp.get_group()
    if pp.size() > 1:  # each micro-batch's mean loss / m: the summed gradients are the batch mean's
        pipe = PipelineStage(
            stage, stage.s, stage.p, device, group=stage.group
        )  # shapes found in step 1
        stage.schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](
            pipe,
            microbatches,
            scale_grads=False,
            loss_fn=lambda out, y: F.cross_entropy(out, y) / microbatches,
        )
    return stage


def train_step(stage, x, y):
    """Forward, loss and backward of this dp rank's batch: the pipeline schedule runs its micro-batches
    (input on the first stage, targets on the last). The batch's mean loss on the last stage, 0 before."""
    if stage.schedule is None:
        (loss := F.cross_entropy(stage(x), y)).backward()
        return loss.detach()
    last, losses = stage.s == stage.p - 1, []
    stage.schedule.step(*[x][: stage.s == 0], **(dict(target=y, losses=losses) if last else {}))
    return torch.stack(losses).sum().detach() if last else torch.zeros((), device=x.device)


@torch.no_grad()
def infer(stage, x):
    """The batch through the stages in turn (p2p on the pp group): logits where stage.answers, else None."""
    s, p, peer = stage.s, stage.p, lambda i: dist.get_global_rank(stage.group, i)  # noqa: E731
    if s > 0:  # a chain 0 -> 1 -> ...: one send and one receive each, no cycle
        dist.recv(
            x := torch.empty(len(x), *stage.act_shape, device=x.device), peer(s - 1), stage.group
        )
    out = stage(x)
    if s < p - 1:
        dist.send(out, peer(s + 1), stage.group)
    return out if stage.answers else None


def full_state_dict(stage, mesh):
    """The plain state_dict on rank 0 (None elsewhere): whole tensors per stage, then the stages to rank 0."""
    state = {
        k: v.cpu()
        for k, v in get_model_state_dict(
            stage, options=StateDictOptions(full_state_dict=True)
        ).items()
    }
    if any(mesh[d].get_local_rank() for d in DIMS[1:]):
        return None
    parts = [None] * mesh["pp"].size() if stage.s == 0 else None
    dist.gather_object(state, parts, dst=dist.get_global_rank(stage.group, 0), group=stage.group)
    return {k: v for part in parts for k, v in part.items()} if parts else None


### end: N-D parallel


def formula(psi, world, args):
    """Rank 0's bytes (stage 0, TP shard 0, FSDP shard 0) from the model's shapes; each mesh dimension's
    traffic per step (act: this dp rank's B/(R·S) samples of T tokens of D, fp32)."""
    (R, S, T, P), model, own = (
        (args.dp_replicate, args.dp_shard, args.tp, args.pp),
        common.build_model(args),
        [0, 0],
    )
    for name, p in Stage(model, 0, P).named_parameters():
        shape, (layer, kind), part = list(p.shape), name.split(".")[-2:], name.split(".")[0]
        row = layer in ("proj", "fc2")
        if (
            T > 1
            and part == "blocks"
            and (layer in ("q", "k", "v", "fc1") or row and kind == "weight")
        ):
            shape[row] //= T  # Colwise: rows (heads); Rowwise: columns
        shape[0] = -(-shape[0] // S)  # fully_shard: dim 0 in S pieces, padded
        own[part == "blocks"] += math.prod(shape)
    n, k = sum(own), 8 if args.optim == "adamw" else 4
    act = 4 * args.batch_size // (R * S) * model.embed.tokens * args.dim
    gather = (
        {} if P > 1 else dict(all_gather=4 * S * (2 * own[1] + own[0]))
    )  # the schedule decides, with pp
    dims = dict(
        tp=dict(all_reduce=6 * (args.depth // P) * act) if T > 1 else {},
        dp_shard=dict(reduce_scatter=4 * S * n, **gather) if S > 1 else {},
        dp_replicate=dict(all_reduce=4 * n) if R > 1 else {},
        pp=dict(send=act, recv=act) if P > 1 else {},
    )
    comm = {kind: sum(d.get(kind, 0) for d in dims.values()) for d in dims.values() for kind in d}
    return dict(
        param_bytes=4 * n,
        grad_bytes=4 * n,
        optim_bytes=k * n,
        comm=comm,
        dims=dims,
        notes=dict(
            param_bytes="≈4Ψ/(P·T·S): stage 0's split by T, sharded by S",
            grad_bytes="≈4Ψ/(P·T·S)",
            optim_bytes=f"≈{k}Ψ/(P·T·S)",
            all_gather="dp_shard: blocks for forward and backward, the rest once",
            all_reduce="tp: 6 a block (f: q, k, v, fc1; g: proj, fc2) of act; dp_replicate: the shard's grads",
            reduce_scatter="dp_shard: the stage's grads once a step",
            send="pp: m activations, act in all",
            recv="pp: m gradients (step 1 adds a shape handshake and a no-grad forward: not in the formulas)",
        ),
    )


def per_dimension(meter, mesh, args):
    """The Meter's traffic, keyed by the mesh dimension whose process group carried it."""
    names = {mesh.get_group(d).group_name: d for d in DIMS if mesh[d].size() > 1}
    dims = {names.get(g, f"group {g}"): kinds for g, kinds in meter.comm_by_group().items()}
    common.log(
        "\ncommunication per mesh dimension, per step (calls in the Meter's window)\n"
        + "\n".join(
            f"  {d:<14}"
            + ", ".join(f"{k} {common.fmt_bytes(b)} ({c})" for k, (c, b) in sorted(kinds.items()))
            for d, kinds in sorted(dims.items())
        )
    )
    return dict(mesh=dict(zip(DIMS, mesh.mesh.shape)), comm_by_dim=dims)


def check_args(args, world):
    """Resolve the one -1 ("the rest") and refuse a layout that cannot work, before any group is formed."""
    common.check(
        not args.experts,
        "--experts: nd_parallel.py's tensor-parallel plan splits dense MLPs, not experts",
    )
    sizes, flag = (
        {d: getattr(args, d) for d in DIMS},
        lambda d: f"--{d.replace('_', '-')} {getattr(args, d)}",
    )  # noqa
    rest, known = (
        [d for d, v in sizes.items() if v == -1],
        math.prod(v for v in sizes.values() if v != -1),
    )
    common.check(
        len(rest) <= 1 and all(v == -1 or v >= 1 for v in sizes.values()),
        f"mesh sizes {sizes}: each must be >= 1, and at most one -1 (the rest of the world)",
    )
    common.check(
        world % known == 0 if rest else known == world,
        f"{' x '.join(flag(d) for d in DIMS if d not in rest)}"
        f" = {known} ranks, but the world size is {world}: the mesh must cover every rank once",
    )
    for d in rest:
        setattr(args, d, world // known)
    common.check(
        args.heads % args.tp == 0,
        f"--heads {args.heads} is not divisible by --tp {args.tp}: tensor "
        f"parallelism gives every rank whole heads",
    )
    common.check(
        args.pp <= args.depth, f"--pp {args.pp} stages is more than --depth {args.depth} blocks"
    )
    dp, m = args.dp_replicate * args.dp_shard, args.microbatches if args.pp > 1 else 1
    common.check(
        m >= 1 and args.batch_size % (dp * m) == 0,
        f"--batch-size {args.batch_size} is not divisible by the "
        f"data-parallel size {dp}"
        + f" x {m} micro-batches" * (args.pp > 1)
        + ": every share must be equal",
    )
    common.check(
        args.pp == 1 or args.schedule != "1f1b" or args.microbatches >= args.pp,
        f"--schedule 1f1b needs "
        f"--microbatches >= --pp: {args.microbatches} < {args.pp} (or use gpipe)",
    )


def setup(args):
    """Join the process group. torchrun (or common.launch) put RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT in the environment; LOCAL_RANK picks this process's GPU."""
    backend, device = common.pick_backend(args.backend)  # NCCL and a GPU per rank, else Gloo
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=args.timeout)
    # torchrun keeps one store across restarts (--max-restarts): prefix it per attempt, or a
    # restarted rank may read the address of a worker that died in the last attempt and hang.
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"attempt_{attempt}", store)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world,
        timeout=timeout,
        # NCCL: bind the communicator to this GPU now (not lazily at the first collective), so
        # that device meshes can split it and the first call is not a point-to-point one.
        device_id=device if device.type == "cuda" else None,
    )
    return rank, world, device, backend


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def train(model, optimizer, scheduler, loader, sampler, args, device, step=0):
    """The loop every script shares: forward, loss, backward, step, schedule, log."""
    stop, world = (
        args.max_steps or float("inf"),
        dist.get_world_size() // args.pp,
    )  # ranks with the loss
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
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            loss_sum += loss.detach()
            losses_summed += 1
            if step % args.log_every == 0 or step >= stop or i + 1 == len(loader):
                dist.all_reduce(
                    loss_sum
                )  # last stages' losses (every TP rank's, the same): average
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
        logits = infer(model, x)  # stage to stage: the logits on one rank per dp rank
        counts += (
            torch.stack([((logits.argmax(1) == y) & keep).sum(), keep.sum()])
            if logits is not None
            else 0
        )
    dist.all_reduce(counts)
    return counts[0].item() / max(counts[1].item(), 1)


def run(args):
    """One rank, in the seeds' order: join the group, deal the data, build the model, wrap it,
    train, evaluate, save on rank 0, leave the group."""
    rank, world, device, backend = setup(args)
    try:
        train_set, test_set, source = common.load_data(args, device)
        mesh = init_device_mesh(device.type, [getattr(args, d) for d in DIMS], mesh_dim_names=DIMS)
        r, s = (
            mesh["dp_replicate"],
            mesh["dp_shard"],
        )  # the data rank: ranks that differ in tp, pp read the same
        dp_rank, dp_world = r.get_local_rank() * s.size() + s.get_local_rank(), r.size() * s.size()
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
            f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data ({len(train_set)} train / "
            f"{len(test_set)} test), batch {args.batch_size} = {dp_world} x {args.batch_size // dp_world}"
        )
        with common.Meter(model, optimizer, args) as meter:
            out = train(model, optimizer, scheduler, loader, sampler, args, device)
        acc = evaluate(
            model,
            common.test_loader(test_set, dp_rank, dp_world, pin_memory=device.type == "cuda"),
            device,
        )
        state = full_state_dict(model, mesh)  # every rank takes part; rank 0 holds the whole
        if rank == 0 and args.save:
            common.save_checkpoint(state, args.save)
            common.log(f"saved {args.save}")
        common.report(
            SCRIPT,
            args,
            world,
            backend,
            device,
            source,
            psi,
            out,
            acc,
            meter,
            formula(psi, world, args),
            **per_dimension(meter, mesh, args),
        )
    finally:
        cleanup()


def main():
    parser = common.get_parser(
        "N-D parallelism: HSDP x TP x PP on one DeviceMesh, on the common ViT"
    )
    for flag, default in (
        ("dp-replicate", 1),
        ("dp-shard", -1),
        ("tp", 1),
        ("pp", 1),
    ):  # torchtitan's names
        parser.add_argument(
            f"--{flag}", type=int, default=default, help="mesh size; -1: the rest of the world"
        )
    parser.add_argument(
        "--microbatches", type=int, default=4, help="micro-batches per batch with --pp > 1 (m)"
    )
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
