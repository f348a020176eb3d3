"""ZeRO-1/2/3 written out with torch.distributed: like DDP, every rank trains on its slice of each global batch, but the
optimizer state (stage 1), the gradients (stage 2) and the parameters (stage 3) are split across the W ranks. Each unit
(embed, every block, head) is one flat fp32 buffer, padded to a multiple of W; rank r owns the shard [r·S, (r+1)·S):

    unit buffer:  [ shard 0 | shard 1 | ... | shard W-1 ]     (shard r: rank r's)
                 stage 1        stage 2        stage 3
    params       full           full           own shard; a unit all-gathered before its forward and its backward
    grads        full           own shard      own shard; stages 2-3 reduce-scatter and free them during backward
    optimizer    own shard      own shard      own shard (m, v only for the elements it owns)
Memory per rank (fp32, AdamW, Ψ' = Ψ padded per unit to a multiple of W; ZeRO's P_os, P_os+g, P_os+g+p):
    stage 1: 4Ψ' + 4Ψ' + 8Ψ'/W    stage 2: 4Ψ' + 12Ψ'/W    stage 3: 16Ψ'/W    (DDP: 16Ψ)
Per step each rank reduce-scatters Ψ' and all-gathers Ψ' (DDP's all-reduce), stage 3 Ψ' more for the backward; a ring
sends (W-1)/W of it. --offload cpu (ZeRO-Offload, on a GPU): fp32 master shard, its gradient and optimizer state in
pinned CPU memory, the step there. --offload disk (ZeRO-Infinity): each unit's master shard and state in DIR/zero-rank
<r>-unit<i>.pt (atomic writes, left there); the step reads a unit in, steps it, writes it back while a thread reads the
next: the optimizer holds 8S, one unit's (the Meter's peak), not 8Ψ'/W. DeepSpeed swaps through pinned buffers with
async O_DIRECT reads and writes (libaio), the next read overlapping this step.
    torchrun --standalone --nproc_per_node=4 zero.py --stage 1|2|3 [--offload cpu | --offload disk --offload-dir DIR]
"""

import datetime
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

import common

SCRIPT = os.path.splitext(os.path.basename(__file__))[0]


### begin: ZeRO
# Model contract: model.embed, model.blocks (a sequence) and model.head hold every parameter (the units ZeRO flattens);
# each returns one tensor; every parameter gets a gradient in every backward; the same weights on every rank's device.


class Unit:
    """A module's parameters as views into one flat, zero-padded buffer of N = W·S elements. `local`: this rank's shard
    flat[r·S:(r+1)·S] (a copy at stage 3); `shard`, the module's only nn.Parameter: `local` or its pinned CPU copy."""

    @torch.no_grad()
    def __init__(self, prefix, module, rank, world, stage, offload):
        named, self.params, self.ready, self.grad = list(module.named_parameters()), [], 0, None
        self.S = -(-sum(p.numel() for _, p in named) // world)
        self.N, offset, self.flat = self.S * world, 0, named[0][1].new_zeros(self.S * world)
        for name, p in named:  # each parameter becomes a plain tensor viewing into `flat`
            # `.data = view`, not the view: the tensor keeps its own version counter, so autograd does
            # not reject what it saved when stage 3 re-gathers `flat` before the backward
            tensor = p.detach().requires_grad_()
            tensor.data = self.flat[offset : offset + p.numel()].view_as(p).copy_(p)
            owner, _, attr = name.rpartition(".")
            delattr(module.get_submodule(owner), attr)
            setattr(module.get_submodule(owner), attr, tensor)
            self.params.append((f"{prefix}.{name}", tensor, offset))
            offset += p.numel()
        self.local = self.flat[rank * self.S : (rank + 1) * self.S]
        self.local = self.local.clone() if stage == 3 else self.local
        module.shard = self.shard = nn.Parameter(
            self.local.cpu().pin_memory() if offload == "cpu" else self.local
        )
        self.gbuf = (
            torch.zeros_like(self.flat) if stage == 1 else None
        )  # the flat gradient: stage 1 keeps it


class ZeRO:
    """The engine (model.zero): gradient hooks (reduce-scatter), stage 3's gather and free; the step's work."""

    def __init__(self, model, stage, offload, directory=None):
        self.stage, self.offload, self.pending, self.pool = (
            stage,
            offload,
            None,
            ThreadPoolExecutor(1),
        )
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        units = [
            (name, m)
            for name, m in model.named_modules()
            if m in (model.embed, *model.blocks, model.head)
        ]
        self.units = [Unit(prefix, m, self.rank, self.world, stage, offload) for prefix, m in units]
        for i, u in enumerate(
            self.units if offload == "disk" else []
        ):  # each rank its own files, written anew
            u.path = os.path.join(directory, f"zero-rank{self.rank}-unit{i}.pt")
            torch.save(dict(master=u.local.to("cpu", copy=True), state={}), u.path)
        for (_, m), u in zip(units, self.units):
            for _, p, offset in u.params:
                p.register_post_accumulate_grad_hook(
                    lambda p, u=u, offset=offset: self.on_grad(u, p, offset)
                )
            if stage == 3:
                u.flat.untyped_storage().resize_(0)
                m.register_forward_pre_hook(lambda m, args, u=u: self.gather(u))
                m.register_forward_hook(lambda m, args, out, u=u: self.after_forward(u, out))

    def gather(self, u):  # stage 3: a unit is whole only around its forward and backward
        u.flat.untyped_storage().resize_(u.N * u.flat.element_size())
        dist.all_gather_into_tensor(u.flat, u.local)

    def after_forward(self, u, out):
        u.flat.untyped_storage().resize_(0)
        if out.requires_grad:  # the gradient reaching the unit's output: its backward is next
            out.register_hook(lambda grad: self.gather(u))

    @torch.no_grad()
    def on_grad(self, u, p, offset):  # reduce-scatter a unit as soon as all its gradients are in
        u.gbuf = u.local.new_zeros(u.N) if u.gbuf is None else u.gbuf
        u.gbuf[offset : offset + p.numel()].copy_(
            p.grad.flatten()
        )  # into the unit's flat gradient;
        p.grad = None  # the parameter's own one goes
        u.ready = (u.ready + 1) % len(u.params)
        if u.ready == 0:
            self.wait()  # one reduce-scatter pending at a time: the previous unit's ends first
            u.gbuf.div_(
                self.world
            )  # Σ_ranks grad/W: the gradient of the global batch's mean, as DDP
            # stage 1 reduces in place (NCCL's in-place layout: the output is the input's slice r)
            u.grad = (
                u.gbuf[self.rank * u.S : (self.rank + 1) * u.S]
                if self.stage == 1
                else u.local.new_empty(u.S)
            )
            self.pending = (u, dist.reduce_scatter_tensor(u.grad, u.gbuf, async_op=True))
            if self.stage == 3:
                u.flat.untyped_storage().resize_(0)

    def wait(self):
        if self.pending is not None:
            u, work = self.pending
            work.wait()
            self.pending, u.gbuf = (
                None,
                u.gbuf if self.stage == 1 else None,
            )  # stages 2-3 free it now

    def before_step(self):
        self.wait()
        for u in (
            self.units if self.offload != "disk" else []
        ):  # disk: the optimizer's own step sees no gradient
            u.shard.grad, u.grad = (
                u.grad.cpu() if self.offload == "cpu" else u.grad,
                None,
            )  # cpu: see after_step

    @torch.no_grad()
    def after_step(self, optimizer):
        group, read = (
            optimizer.param_groups[0],
            lambda u: self.pool.submit(torch.load, u.path, weights_only=True),
        )
        load = self.offload == "disk" and read(self.units[0])
        for u, after in zip(self.units, self.units[1:] + [None]):
            if load:  # ZeRO-Infinity (see the top); the optimizer's own step, hooks left out (they would call this)
                file, load, params = load.result(), after and read(after), group["params"]
                u.shard.data, u.shard.grad, group["params"] = (
                    file["master"],
                    u.grad.cpu(),
                    [u.shard],
                )
                optimizer.state[u.shard] = file["state"]
                type(optimizer).step.__wrapped__(optimizer)
                with open(f"{u.path}.tmp", "wb") as f:
                    torch.save(dict(master=u.shard.data, state=optimizer.state.pop(u.shard)), f)
                    f.flush(), os.fsync(f.fileno())
                os.replace(f"{u.path}.tmp", u.path)
                u.shard.data, u.shard.grad, u.grad, group["params"] = (
                    u.local.copy_(u.shard),
                    u.grad,
                    None,
                    params,
                )
            if (
                self.offload == "cpu"
            ):  # non_blocking, safe: the next before_step's .cpu() waits for this copy
                u.local.copy_(u.shard, non_blocking=True)
            if self.stage < 3:  # every rank needs the whole updated unit for the next forward
                dist.all_gather_into_tensor(u.flat, u.local)


def parallelize(model, device, stage, offload=None, directory=None):
    """ZeRO stage 1, 2 or 3, in place: model.parameters() become the shards. Offload "cpu" (on a GPU) or "disk"."""
    model.zero = ZeRO(model, stage, offload, directory)
    return model


def hook_optimizer(model, optimizer):
    optimizer.register_step_pre_hook(lambda *_: model.zero.before_step())
    optimizer.register_step_post_hook(lambda optimizer, *_: model.zero.after_step(optimizer))


def full_state_dict(model):
    """The plain state_dict of the common model, on every rank: every unit's shards all-gathered."""
    sd = {}
    for u in model.zero.units:
        dist.all_gather_into_tensor(flat := u.local.new_empty(u.N), u.local)
        sd.update(
            {
                key: flat[offset : offset + t.numel()].view_as(t).cpu().clone()
                for key, t, offset in u.params
            }
        )
    return sd


### end: ZeRO


def formula(psi, world, args, largest=0):
    """The papers' per-rank bytes for Ψ' = psi (padded), S = largest, next to the Meter's; offload: the optimizer's."""
    k, s, cpu, disk = (
        8 if args.optim == "adamw" else 4,
        args.stage,
        args.offload == "cpu",
        args.offload == "disk",
    )
    p, g, note = (
        s == 3 or cpu,
        s >= 2 or cpu,
        {True: "4Ψ'/W sharded" + " (CPU)" * cpu, False: "4Ψ' replicated"},
    )
    return dict(
        param_bytes=4 * psi // (world if p else 1),
        grad_bytes=4 * psi // (world if g else 1),
        optim_bytes=0 if disk else k * psi // world,
        optim_peak_bytes=k * largest if disk else None,
        comm=dict(reduce_scatter=4 * psi, all_gather=(8 if s == 3 else 4) * psi),
        notes=dict(
            param_bytes=note[p],
            grad_bytes=note[g],
            reduce_scatter="Ψ' fp32 gradients",
            optim_bytes=f"{k}Ψ'/W sharded "
            + ("in files" if disk else "m, v" if k == 8 else "momentum"),
            all_gather="2Ψ': before forward and backward" if s == 3 else "Ψ' updated parameters",
        ),
    )


def check_args(args, world):
    common.check(
        args.offload != "disk"
        or os.path.isdir(d := args.offload_dir or "")
        and os.access(d, os.W_OK),
        f"--offload disk needs --offload-dir DIR, an existing writable directory (got {args.offload_dir})",
    )
    common.check(
        args.batch_size % world == 0,
        f"--batch-size {args.batch_size} is not divisible by world size {world}: every rank must get "
        f"the same whole number of samples per step",
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
        )
        common.check(
            len(loader) > 0,
            f"{len(train_set)} training samples make no full batch of {args.batch_size}",
        )
        model = common.build_model(args)  # the same seeded weights on every rank
        if args.load:
            model.load_state_dict(common.load_state_dict_file(args.load, model.state_dict()))
        psi = sum(p.numel() for p in model.parameters())
        if args.offload == "cpu" and device.type != "cuda":
            common.log(
                "--offload cpu: the device is the CPU, where the optimizer state lives anyway: no change"
            )
            args.offload = "none"
        model = parallelize(model.to(device), device, args.stage, args.offload, args.offload_dir)
        padded = world * sum(
            p.numel() for p in model.parameters()
        )  # Ψ': every unit padded to a multiple of W
        optimizer = common.make_optimizer(model.parameters(), args)
        hook_optimizer(model, optimizer)  # before the Meter's hook: its window sees the all-gather
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
        state = full_state_dict(model)  # every rank takes part; rank 0 holds the whole
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
            formula(padded, world, args, max(p.numel() for p in model.parameters())),
            offload=args.offload,
            params_padded=padded,
        )
    finally:
        cleanup()


def main():
    parser = common.get_parser(
        "ZeRO stages 1-3 written out with torch.distributed, on the common ViT"
    )
    parser.add_argument(
        "--stage",
        type=int,
        choices=[1, 2, 3],
        default=1,
        help="1: shard optimizer state, 2: + grads, 3: + params",
    )
    parser.add_argument(
        "--offload",
        choices=["none", "cpu", "disk"],
        default="none",
        help="ZeRO-Offload / -Infinity",
    )
    parser.add_argument(
        "--offload-dir", default=None, help="--offload disk: where each rank's unit files go"
    )
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
