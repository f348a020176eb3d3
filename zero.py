"""ZeRO-1/2/3 written out with torch.distributed collectives: every rank trains on its slice of
each global batch, like DDP, but the optimizer state (stage 1), the gradients (stage 2) and the
parameters (stage 3) are split across the W ranks instead of replicated.

Each unit (embed, every block, head) is one flat fp32 buffer, padded to a multiple of W;
rank r owns the contiguous shard [r·S, (r+1)·S) of every unit:

    unit buffer:  [ shard 0 | shard 1 | ... | shard W-1 ]
                   rank 0     rank 1          rank W-1
                 stage 1        stage 2        stage 3
    params       full           full           own shard; a unit is all-gathered just before
                                               its forward and again before its backward
    grads        full           own shard      own shard  (stages 2-3: each unit's full gradient
                                               is reduce-scattered and freed during backward)
    optimizer    own shard      own shard      own shard  (m, v only for the elements it owns)

Memory per rank (fp32, AdamW, Ψ parameters, ZeRO paper's P_os, P_os+g, P_os+g+p):
    stage 1: 4Ψ + 4Ψ + 8Ψ/W    stage 2: 4Ψ + 12Ψ/W    stage 3: 16Ψ/W    (DDP: 16Ψ)
Communication per step, in elements each rank puts through collectives:
    stages 1-2: Ψ reduce-scattered + Ψ all-gathered = 2Ψ (the same as DDP's all-reduce)
    stage 3:    Ψ gathered for forward + Ψ for backward + Ψ reduce-scattered = 3Ψ
and a ring sends (W-1)/W of that per rank, 4 bytes an element.

    torchrun --standalone --nproc_per_node=4 zero.py --stage 1
    torchrun --standalone --nproc_per_node=4 zero.py --stage 3 --dim 256 --depth 8
    torchrun --standalone --nproc_per_node=2 zero.py --stage 2 --offload   # ZeRO-Offload (on a GPU)
    python zero.py --stage 2                                   # a world of one process
"""
import datetime
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import common

# torch >= 2.14 renames the two tensor collectives; 2.11 has only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class AllReduceThenSlice:
    """Reduce-scatter for a backend without it (an older Gloo): all-reduce the whole bucket and keep
    this rank's shard. Same result, twice the traffic; it is still counted as the Ψ reduce-scattered
    that the algorithm needs, not as the 2Ψ all-reduce a weaker backend forces."""

    def __init__(self, out, inp, async_op=True):
        self.out, self.inp, self.work = out, inp, dist.all_reduce(inp, async_op=True)

    def wait(self):
        self.work.wait()
        self.out.copy_(self.inp.view(-1, self.out.numel())[dist.get_rank()])


def collectives(device):
    """(reduce_scatter, all_gather) on flat tensors: the real ones where the backend has them (NCCL
    always; Gloo in this torch), else all-reduce / list all-gather with the same results."""
    W = dist.get_world_size()
    rs, ag = _reduce_scatter, _all_gather
    try:
        rs(torch.zeros(1, device=device), torch.zeros(W, device=device))
    except (RuntimeError, NotImplementedError):
        rs = AllReduceThenSlice
    try:
        ag(torch.zeros(W, device=device), torch.zeros(1, device=device))
    except (RuntimeError, NotImplementedError):
        ag = lambda out, inp, async_op=False: dist.all_gather(list(out.chunk(W)), inp, async_op=async_op)  # noqa: E731
    return rs, ag


def storage_bytes(tensors):
    """Bytes of the distinct storages behind `tensors` (a view adds nothing; a freed buffer is 0)."""
    seen = {}
    for t in tensors:
        if t is not None and t.untyped_storage().nbytes() > 0:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


class Unit:
    """One module's parameters as a flat buffer `full` of N = W·S elements (zero padding at the end);
    the module's parameters become views into it and `shard` is this rank's [r·S, (r+1)·S)."""

    def __init__(self, module, rank, world, stage):
        self.module, self.params = module, list(module.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.S = -(-self.numel // world)
        self.N, self.rank = self.S * world, rank
        p0 = self.params[0]
        self.full = torch.zeros(self.N, dtype=p0.dtype, device=p0.device)
        self.offsets, offset = {}, 0                 # id(parameter) -> where it starts in the flat buffer
        with torch.no_grad():
            for p in self.params:
                self.full[offset:offset + p.numel()].copy_(p.flatten())
                p.data = self.full[offset:offset + p.numel()].view_as(p)
                self.offsets[id(p)], offset = offset, offset + p.numel()
        own = self.full[rank * self.S:(rank + 1) * self.S]
        if stage < 3:                      # the optimizer updates the owned slice of `full` in place
            self.shard = nn.Parameter(own)
        else:                              # the shard is the only copy; `full` exists only when gathered
            self.shard = nn.Parameter(own.clone())
            self.full.untyped_storage().resize_(0)
        self.gbuf = None                   # the unit's full flat gradient, while it exists
        self.ready = 0                     # parameters whose gradient has arrived this backward


class Zero:
    """The ZeRO engine: hooks that reduce-scatter each unit's gradients as backward produces them
    (and, at stage 3, gather and free each unit's parameters around its forward and backward),
    the optimizer step on the owned shards, and counters of collective elements and bytes."""

    def __init__(self, model, stage, device, offload):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.stage, self.offload = stage, offload and device.type == "cuda"
        self.reduce_scatter, self.all_gather = collectives(device)
        self.units = [Unit(m, self.rank, self.world, stage) for m in [model.embed, *model.blocks, model.head]]
        assert sum(u.numel for u in self.units) == sum(p.numel() for p in model.parameters())
        self.comm = {"reduce_scatter": 0, "all_gather": 0}
        self.peak = {"params": 0, "grads": 0}
        self.pending = None                # (unit, work) of the reduce-scatter in flight
        for u in self.units:
            if stage == 1:                 # full gradients stay: accumulate straight into the flat buffer
                u.gbuf = torch.zeros_like(u.full)
                for p in u.params:
                    p.grad = u.gbuf[u.offsets[id(p)]:u.offsets[id(p)] + p.numel()].view_as(p)
                u.shard.grad = u.gbuf[self.rank * u.S:(self.rank + 1) * u.S]
            else:
                u.shard.grad = torch.zeros_like(u.shard)
            for p in u.params:
                p.register_post_accumulate_grad_hook(lambda p, u=u: self.on_grad(u, p))
            if stage == 3:
                # (in evaluate(), under no_grad, the gathers are not counted as training traffic)
                u.module.register_forward_pre_hook(lambda m, args, u=u: self.gather(u, torch.is_grad_enabled()))
                u.module.register_forward_hook(lambda m, args, out, u=u: self.after_forward(u, out))
        # --offload: the fp32 master shard and the optimizer state live in CPU memory, the optimizer
        # steps there, and the updated shard is copied back (ZeRO-Offload).
        self.masters = [nn.Parameter(u.shard.detach().cpu().pin_memory()) if self.offload else u.shard
                        for u in self.units]
        self.measure()

    def measure(self, extra_grad=0):
        """Resident bytes now; keeps the peak. Called wherever a buffer appears or goes."""
        now = dict(params=storage_bytes([t for u in self.units for t in (u.full, u.shard)]),
                   grads=storage_bytes([t for u in self.units for t in (u.gbuf, u.shard.grad)]) + extra_grad)
        for k in now:
            self.peak[k] = max(self.peak[k], now[k])
        return now

    # ---- stage 3: parameters exist in full only around the unit's forward and backward
    @torch.no_grad()
    def gather(self, u, count=True):
        u.full.untyped_storage().resize_(u.N * u.full.element_size())
        self.all_gather(u.full, u.shard.detach())
        self.comm["all_gather"] += u.N if count else 0
        self.measure()

    def free(self, u):
        u.full.untyped_storage().resize_(0)

    def after_forward(self, u, out):
        self.free(u)
        if out.requires_grad:              # fires when the gradient reaches the unit's output: before its backward
            out.register_hook(lambda grad, u=u: self.gather(u))

    # ---- gradients: reduce-scatter each unit as soon as all its gradients exist
    @torch.no_grad()
    def on_grad(self, u, p):
        if self.stage >= 2:                # copy into the unit's bucket and drop the per-parameter gradient
            if u.gbuf is None:
                u.gbuf = torch.zeros(u.N, dtype=u.shard.dtype, device=u.shard.device)
            self.measure(extra_grad=p.grad.untyped_storage().nbytes())
            a = u.offsets[id(p)]
            u.gbuf[a:a + p.numel()].copy_(p.grad.flatten())
            p.grad = None
        u.ready += 1
        if u.ready < len(u.params):
            return
        u.ready = 0
        self.wait_pending()                # at most two buckets in flight: this one and the one before
        u.gbuf.div_(self.world)            # Σ_ranks grad/W = gradient of the global-batch mean, as DDP does
        self.pending = (u, self.reduce_scatter(u.shard.grad, u.gbuf, async_op=True))
        self.comm["reduce_scatter"] += u.N
        if self.stage == 3:
            self.free(u)

    def wait_pending(self):
        if self.pending is not None:
            u, work = self.pending
            work.wait()
            self.pending = None
            if self.stage >= 2:            # stage 2-3: the full gradient is gone as soon as it is reduced
                self.measure()
                u.gbuf = None

    def finish_backward(self):
        self.wait_pending()
        if self.offload:
            for u, m in zip(self.units, self.masters):
                m.grad = u.shard.grad.to("cpu")

    @torch.no_grad()
    def after_step(self):
        works = []
        for u, m in zip(self.units, self.masters):
            if self.offload:
                u.shard.copy_(m, non_blocking=True)
            if self.stage < 3:             # everyone needs the full, updated parameters for the next forward
                works.append(self.all_gather(u.full, u.shard.detach(), async_op=True))
                self.comm["all_gather"] += u.N
            if self.stage == 1:
                u.gbuf.zero_()
        for work in works:
            work.wait()

    @torch.no_grad()
    def state_dict(self, model):
        """The full, plain state_dict (stage 3 gathers every unit for it; all ranks must call)."""
        if self.stage == 3:
            for u in self.units:
                self.gather(u, count=False)
        sd = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        if self.stage == 3:
            for u in self.units:
                self.free(u)
        return sd


def setup(backend, timeout):
    # MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE come from the environment (torchrun or default_env()).
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def train(model, zero, optimizer, loader, sampler, args, device):
    steps, t_train, loss_sum, loss_n, last_loss, mem = 0, 0.0, torch.zeros((), device=device), 0, float("nan"), {}
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)                   # a new shuffle each epoch, the same on every rank
        model.train()
        t0 = time.perf_counter()
        bar = common.progress(loader, args, desc=f"epoch {epoch}")
        for x, y in bar:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()                        # the hooks reduce-scatter each unit's gradients as they arrive
            zero.finish_backward()
            loss_sum += loss.detach()
            optimizer.step()                       # each rank updates only the shard it owns
            if steps == 0:
                mem = dict(zero.measure(), optim_bytes=common.optimizer_bytes(optimizer))
            zero.after_step()
            steps, loss_n = steps + 1, loss_n + 1
            if steps % 20 == 0 or steps == args.max_steps or steps % len(loader) == 0:
                dist.all_reduce(loss_sum)
                last_loss, loss_sum, loss_n = loss_sum.item() / dist.get_world_size() / loss_n, loss_sum * 0, 0
                if bar is not loader:
                    bar.set_postfix(loss=f"{last_loss:.4f}")
            if steps == args.max_steps:
                break
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_train += time.perf_counter() - t0
        common.log(f"epoch {epoch}: steps {steps}, train loss {last_loss:.4f}")
        if steps == args.max_steps:
            break
    return dict(steps=steps, loss=last_loss, train_time=t_train, param_bytes=mem.get("params", 0),
                grad_bytes=mem.get("grads", 0), optim_bytes=mem.get("optim_bytes", 0))


@torch.no_grad()
def evaluate(model, loader, device):
    """Each rank counts its own unpadded shard; one all-reduce of (correct, seen) makes it exact."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        counts += torch.stack([(model(x).argmax(1) == y).sum(), torch.tensor(len(y), device=device)])
    dist.all_reduce(counts)
    return counts[0].item() / max(counts[1].item(), 1)


def check_args(args, world):
    common.check(args.stage in (1, 2, 3), f"--stage must be 1, 2 or 3, got {args.stage}")
    common.check(args.batch_size % world == 0,
                 f"--batch-size {args.batch_size} is not divisible by world size {world}: every rank must get "
                 f"the same whole number of samples per step")


def run(args):
    """One rank's work; RANK, LOCAL_RANK and WORLD_SIZE are in the environment."""
    check_args(args, int(os.environ["WORLD_SIZE"]))
    backend, device = common.pick_backend(args.backend)
    model = common.build_model(args)               # same seed -> same weights on every rank
    if args.load:
        model.load_state_dict(common.load_state_dict_file(args.load, model.state_dict()))
    if args.offload and device.type != "cuda":
        common.log("--offload: the device is the CPU, so the optimizer state is in CPU memory anyway: no change")
    rank, world = setup(backend, args.timeout)
    try:
        xtr, ytr, xte, yte, source = common.load_data(args)
        loader, sampler = common.train_loader(xtr, ytr, args.batch_size, rank, world, args.seed)
        common.check(len(loader) > 0, f"{len(ytr)} training samples make no full batch of {args.batch_size}")
        psi = sum(p.numel() for p in model.parameters())
        zero = Zero(model.to(device), args.stage, device, args.offload)
        optimizer = common.make_optimizer(zero.masters, args)
        pad = sum(u.N for u in zero.units)         # Ψ' = Ψ + padding: what the buffers and collectives hold
        common.log(f"zero stage {args.stage}: world {world}, Ψ = {psi:,} parameters ({pad - psi} padding), "
                   f"{len(zero.units)} units, {source} data ({len(ytr)} train / {len(yte)} test), "
                   f"batch {args.batch_size} = {world} x {args.batch_size // world}")
        zero.peak = {"params": 0, "grads": 0}
        out = train(model, zero, optimizer, loader, sampler, args, device)
        peak, steps = dict(zero.peak), max(out["steps"], 1)     # the peaks of the training steps only
        elements = (zero.comm["reduce_scatter"] + zero.comm["all_gather"]) // steps
        acc = evaluate(model, common.test_loader(xte, yte, 512, rank, world), device)
        s, k = args.stage, 8 if args.optim == "adamw" else 4
        shard = lambda sharded: "4Ψ/W (sharded)" if sharded else "4Ψ (replicated)"   # noqa: E731
        formula = dict(param_bytes=4 * pad // (world if s == 3 else 1), grad_bytes=4 * pad // (world if s >= 2 else 1),
                       optim_bytes=k * pad // world, comm_elements=(3 if s == 3 else 2) * pad)
        comm_bytes = 4 * elements
        wire = (world - 1) * comm_bytes // world
        common.report([
            ("parameters", out["param_bytes"], formula["param_bytes"], shard(s == 3)),
            ("gradients", out["grad_bytes"], formula["grad_bytes"], shard(s >= 2)),
            ("optimizer state" + (" (CPU)" if zero.offload else ""), out["optim_bytes"], formula["optim_bytes"],
             f"{k}Ψ/W (sharded) " + ("AdamW m, v" if k == 8 else "SGD momentum")),
            ("peak params in step", peak["params"], None, "with the units gathered at once" if s == 3 else ""),
            ("peak grads in step", peak["grads"], None, "with the buckets in flight" if s >= 2 else ""),
            ("collective per step", comm_bytes, 4 * formula["comm_elements"],
             "3Ψ: 2Ψ all-gathered + Ψ reduce-scattered" if s == 3 else "2Ψ: Ψ reduce-scattered + Ψ all-gathered"),
            ("sent per step (ring)", wire, (world - 1) * 4 * formula["comm_elements"] // world, "(W-1)/W of that"),
        ], title=f"per-rank memory and communication (Ψ' = {pad:,}: padded to a multiple of W)")
        if device.type == "cuda":
            common.log(f"  cuda max_memory_allocated: {common.fmt_bytes(torch.cuda.max_memory_allocated(device))}")
        sps = out["steps"] * args.batch_size / max(out["train_time"], 1e-9)
        common.log(f"\ntest accuracy {acc:.4f}, final train loss {out['loss']:.4f}, {sps:.0f} samples/s")
        sd = zero.state_dict(model) if args.save else None   # every rank takes part in stage 3's gathers
        if rank == 0 and args.save:
            common.save_checkpoint(sd, args.save)
            common.log(f"saved {args.save}")
        common.result(script="zero", world_size=world, backend=backend, device=device.type, data=source,
                      params=psi, steps=out["steps"], loss=out["loss"], test_acc=acc, samples_per_s=sps,
                      param_bytes=out["param_bytes"], grad_bytes=out["grad_bytes"], optim_bytes=out["optim_bytes"],
                      comm_bytes=comm_bytes, stage=s, offload=zero.offload, params_padded=pad, units=len(zero.units),
                      formula=formula, peak_param_bytes=peak["params"], peak_grad_bytes=peak["grads"],
                      comm_elements=elements, reduce_scatter_elements=zero.comm["reduce_scatter"] // steps,
                      all_gather_elements=zero.comm["all_gather"] // steps, wire_bytes=wire)
    finally:
        cleanup()


def main():
    common.default_env()                           # plain `python zero.py`: a world of one
    parser = common.get_parser("ZeRO stages 1-3 written out with collectives, on the common ViT")
    parser.add_argument("--stage", type=int, default=1, help="1: shard optimizer state, 2: + grads, 3: + params")
    parser.add_argument("--offload", action="store_true", help="fp32 master shard and optimizer state on the CPU")
    run(common.parse_args(parser))
    # The hooks tie model and engine into reference cycles that still hold tensors the process group
    # touched; free them now, not during interpreter shutdown, where Gloo's threads can abort the exit.
    gc.collect()


if __name__ == "__main__":
    main()
