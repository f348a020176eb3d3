"""FSDP: PyTorch's fully sharded data parallel (FSDP2, `fully_shard`) on the common ViT --
ZeRO-3 as a library. Every parameter becomes a DTensor sharded on dim 0 over a 1-D device
mesh; each block (and then the root: embed + head) is one unit that FSDP all-gathers before
its forward and backward and frees after, and whose gradients it reduce-scatters.

    mesh (W,):   rank 0       rank 1       ...   rank W-1
    block i      rows 0::W    rows of 1    ...   each parameter's dim-0 chunk r (torch.chunk)
    root         embed, head chunked the same way
    optimizer    AdamW on the local chunks only (made after sharding)

Memory per rank (fp32, AdamW, Ψ parameters): 4Ψ/W params + 4Ψ/W grads + 8Ψ/W optimizer =
16Ψ/W (up to the uneven last chunk), plus the units gathered at once.
Communication per step: Ψ all-gathered for forward + Ψ again for backward + Ψ reduce-scattered
= 3Ψ elements (2Ψ with --no-reshard-after-forward, which keeps parameters gathered from
forward to backward: ZeRO-2-like memory); a ring sends (W-1)/W of that per rank. The root
unit (embed + head) stays gathered from forward to backward, so FSDP2 moves 3Ψ - Ψ_root.

    torchrun --standalone --nproc_per_node=4 fsdp.py
    torchrun --standalone --nproc_per_node=2 fsdp.py --max-steps 100 --dcp ckpt/   # sharded save
    torchrun --standalone --nproc_per_node=4 fsdp.py --max-steps 200 --dcp ckpt/   # resume at W=4
    python fsdp.py --save vit.pt                                               # a world of one
"""
import datetime
import gc
import itertools
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

import common


class CommCounter(TorchDispatchMode):
    """Counts what FSDP's own collectives move on this rank (all-gather output, reduce-scatter input),
    in elements and bytes. It sees every op, so it is switched on for one step only."""

    def __init__(self):
        super().__init__()
        self.elements, self.bytes = {"all_gather": 0, "reduce_scatter": 0}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        t = args[0] if "_allgather_base_" in name else args[1] if "_reduce_scatter_base_" in name else None
        if t is not None:
            self.elements["all_gather" if "allgather" in name else "reduce_scatter"] += t.numel()
            self.bytes += t.numel() * t.element_size()
        return func(*args, **(kwargs or {}))


def shard_model(model, mesh, args, device):
    """fully_shard each block, then the root (embed + head); parameters become DTensor shards."""
    kw = dict(mesh=mesh, reshard_after_forward=not args.no_reshard_after_forward)
    if args.mixed_precision:                  # bf16 copies for compute and all-gather, fp32 reduce and master
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if args.cpu_offload and device.type == "cuda":
        kw["offload_policy"] = CPUOffloadPolicy()
    for block in model.blocks:
        fully_shard(block, **kw)
    # The root (embed + head) is used last in forward and first in backward: resharding it in between
    # would only gather it again at once, so it stays gathered (FSDP2's own default for the root).
    fully_shard(model, **{**kw, "reshard_after_forward": False})
    return model


def check_dcp(path, model, optim):
    """Before any process group: is `path` empty/new (start fresh) or a DCP checkpoint of this model?"""
    if not os.path.exists(path) or (os.path.isdir(path) and not os.listdir(path)):
        return False
    common.check(os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata")),
                 f"--dcp {path}: not a torch.distributed.checkpoint directory (no .metadata file); "
                 f"give an empty or new directory to start one")
    try:
        meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as e:
        common.fail(f"--dcp {path}: unreadable DCP metadata ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
    for k, v in model.state_dict().items():
        saved = meta.get(f"model.{k}")
        common.check(saved is not None, f"--dcp {path}: missing tensor 'model.{k}' (other --dim/--depth/--heads?)")
        common.check(tuple(saved.size) == tuple(v.shape), f"--dcp {path}: tensor 'model.{k}' has shape "
                     f"{tuple(saved.size)}, this model needs {tuple(v.shape)} (check --dim/--depth/--heads)")
    state = "exp_avg" if optim == "adamw" else "momentum_buffer"
    common.check(any(k.endswith(state) for k in meta), f"--dcp {path}: holds no {state} optimizer state; "
                 f"was it saved with another --optim than {optim}?")
    return True


def dcp_state(model, optimizer, step):
    """What a sharded checkpoint holds: each rank's shards of model and optimizer, and the step."""
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
            "step": torch.tensor(step)}


def setup(backend, timeout, device):
    # MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE come from the environment (torchrun or default_env()).
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    return dist.get_rank(), dist.get_world_size(), mesh


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def train(model, optimizer, loader, sampler, args, device, comm, start=0):
    steps, t_train, loss_sum, loss_n, last_loss, mem = start, 0.0, torch.zeros((), device=device), 0, float("nan"), {}
    for epoch in range(start // len(loader), args.epochs):
        sampler.set_epoch(epoch)                   # a new shuffle each epoch, the same on every rank
        model.train()
        t0 = time.perf_counter()
        skip = start % len(loader) if epoch == start // len(loader) else 0   # resumed: these batches are done
        bar = common.progress(itertools.islice(loader, skip, None), args, desc=f"epoch {epoch}")
        for x, y in bar:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with comm if steps == start else nullcontext():     # count the first step's collectives
                loss = F.cross_entropy(model(x), y)
                loss.backward()                    # FSDP gathers each block for backward, reduce-scatters its grads
            loss_sum += loss.detach()
            optimizer.step()                       # on the local shards only
            if not mem:
                mem = dict(param_bytes=common.param_bytes(model.parameters()),
                           grad_bytes=common.grad_bytes(model.parameters()),
                           optim_bytes=common.optimizer_bytes(optimizer))
            optimizer.zero_grad(set_to_none=True)
            steps, loss_n = steps + 1, loss_n + 1
            if steps % 20 == 0 or steps == args.max_steps or steps % len(loader) == 0:
                dist.all_reduce(loss_sum)
                last_loss, loss_sum, loss_n = loss_sum.item() / dist.get_world_size() / loss_n, loss_sum * 0, 0
                if not isinstance(bar, itertools.islice):
                    bar.set_postfix(loss=f"{last_loss:.4f}")
            if steps == args.max_steps:
                break
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_train += time.perf_counter() - t0
        common.log(f"epoch {epoch}: steps {steps}, train loss {last_loss:.4f}")
        if steps == args.max_steps:
            break
    return dict(steps=steps, loss=last_loss, train_time=t_train, **mem)


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
    resume = check_dcp(args.dcp, model, args.optim) if args.dcp else False
    if args.cpu_offload and device.type != "cuda":
        common.log("--cpu-offload: the device is the CPU, so everything is in CPU memory anyway: no change")
    if args.mixed_precision and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        common.fail("--mixed-precision: this GPU has no bf16 support")
    shapes = [p.shape for p in model.parameters()]
    psi = sum(p.numel() for p in model.parameters())
    rank, world, mesh = setup(backend, args.timeout, device)
    try:
        xtr, ytr, xte, yte, source = common.load_data(args)
        loader, sampler = common.train_loader(xtr, ytr, args.batch_size, rank, world, args.seed)
        common.check(len(loader) > 0, f"{len(ytr)} training samples make no full batch of {args.batch_size}")
        model = shard_model(model.to(device), mesh, args, device)
        optimizer = common.make_optimizer(model.parameters(), args)   # after sharding: it sees the DTensor shards
        start = 0
        if resume:                                 # DCP reshards on load: the saving world size may differ
            state = dcp_state(model, optimizer, 0)
            dcp.load(state, checkpoint_id=args.dcp)
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, optimizer, state["optim"])
            start = int(state["step"])
            common.log(f"resumed from {args.dcp} at step {start}")
        common.log(f"fsdp: world {world}, Ψ = {psi:,} parameters, {source} data ({len(ytr)} train / {len(yte)} test), "
                   f"batch {args.batch_size} = {world} x {args.batch_size // world}, reshard after forward: "
                   f"{not args.no_reshard_after_forward}, mixed precision: {args.mixed_precision}")
        comm = CommCounter()
        out = train(model, optimizer, loader, sampler, args, device, comm, start)
        acc = evaluate(model, common.test_loader(xte, yte, 512, rank, world), device)
        # This rank's exact share: FSDP2 cuts each parameter's dim 0 like torch.chunk (rank r: chunk r).
        rows = lambda n: max(0, min(-(-n // world), n - rank * -(-n // world)))   # noqa: E731
        local = sum(rows(s[0]) * (s.numel() // s[0]) for s in shapes)
        opt_k = 8 if args.optim == "adamw" else 4
        k = 2 if args.no_reshard_after_forward else 3
        # What the collectives carry: each unit padded to W equal chunks; the root unit (embed + head) is
        # gathered once, as FSDP2 never reshards the root after forward, so it costs 2Ψ_root, not 3Ψ_root.
        padded = lambda s: -(-s[0] // world) * world * (s.numel() // s[0])   # noqa: E731
        blocks = sum(padded(p.shape) for b in model.blocks for p in b.parameters())
        root = sum(padded(s) for s in shapes) - blocks
        expected = k * blocks + 2 * root
        formula = dict(param_bytes=4 * local, grad_bytes=4 * local, optim_bytes=opt_k * local, comm_elements=expected)
        elements = comm.elements["all_gather"] + comm.elements["reduce_scatter"]
        comm_bytes = comm.bytes
        common.report([
            ("parameters", out.get("param_bytes", 0), formula["param_bytes"], f"4Ψ/W = {4 * psi / world:,.0f} B "
             "+ uneven chunks"),
            ("gradients", out.get("grad_bytes", 0), formula["grad_bytes"], "4Ψ/W"),
            ("optimizer state", out.get("optim_bytes", 0), formula["optim_bytes"],
             f"{opt_k}Ψ/W " + ("AdamW m, v" if opt_k == 8 else "SGD momentum")),
            ("collective per step", comm_bytes, None if args.mixed_precision else 4 * expected,
             f"paper {k}Ψ; FSDP2: {k}Ψ'_blocks + 2Ψ'_root (Ψ' padded)"),
            ("sent per step (ring)", (world - 1) * comm_bytes // world,
             None if args.mixed_precision else (world - 1) * 4 * expected // world, "(W-1)/W of that"),
        ], title="per-rank memory (DTensor local shards) and communication")
        if device.type == "cuda":
            common.log(f"  cuda max_memory_allocated: {common.fmt_bytes(torch.cuda.max_memory_allocated(device))}")
        sps = (out["steps"] - start) * args.batch_size / max(out["train_time"], 1e-9)
        common.log(f"\ntest accuracy {acc:.4f}, final train loss {out['loss']:.4f}, {sps:.0f} samples/s")
        if args.save:                              # every rank takes part in the gather; rank 0 gets the tensors
            sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                common.save_checkpoint(sd, args.save)
                common.log(f"saved {args.save}")
        if args.dcp:
            dcp.save(dcp_state(model, optimizer, out["steps"]), checkpoint_id=args.dcp)
            common.log(f"saved a sharded checkpoint (step {out['steps']}, {world} ranks) in {args.dcp}")
        common.result(script="fsdp", world_size=world, backend=backend, device=device.type, data=source,
                      params=psi, steps=out["steps"], loss=out["loss"], test_acc=acc, samples_per_s=sps,
                      param_bytes=out.get("param_bytes", 0), grad_bytes=out.get("grad_bytes", 0),
                      optim_bytes=out.get("optim_bytes", 0), comm_bytes=comm_bytes, formula=formula,
                      comm_elements=elements, all_gather_elements=comm.elements["all_gather"],
                      reduce_scatter_elements=comm.elements["reduce_scatter"],
                      reshard_after_forward=not args.no_reshard_after_forward, mixed_precision=args.mixed_precision,
                      start_step=start)
    finally:
        cleanup()


def main():
    common.default_env()                           # plain `python fsdp.py`: a world of one
    parser = common.get_parser("FSDP2 (fully_shard) on the common ViT")
    parser.add_argument("--no-reshard-after-forward", action="store_true",
                        help="keep each unit gathered from forward to backward (ZeRO-2-like: 2Ψ traffic, more memory)")
    parser.add_argument("--mixed-precision", action="store_true", help="bf16 parameters for compute, fp32 reduce")
    parser.add_argument("--cpu-offload", action="store_true", help="shards, grads and optimizer state in CPU memory")
    parser.add_argument("--dcp", default=None, help="sharded checkpoint directory: resume from it if it holds one, "
                                                    "save to it at the end")
    run(common.parse_args(parser))
    # FSDP's modules, mesh and hooks form reference cycles that still hold the process group; free them
    # now, not during interpreter shutdown, where Gloo's worker threads can abort the process at exit.
    gc.collect()


if __name__ == "__main__":
    main()
