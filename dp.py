"""DP: torch.nn.DataParallel -- one process drives every visible GPU. Each step it copies
the model from GPU 0 to the others, splits the batch, runs the replicas in threads, gathers
the outputs on GPU 0, and backward sums the gradients back onto GPU 0's parameters.

    GPU 0: [ model ] --replicate--> GPU 1..N-1: [ copy ]     x --scatter--> x[0], x[1], ...
           outputs <----gather---- each GPU's forward;      grads --reduce--> GPU 0 --> optimizer

Memory (fp32, AdamW, Ψ parameters): GPU 0 holds 4Ψ params + 4Ψ grads + 8Ψ optimizer = 16Ψ,
every other GPU a 4Ψ replica (+ its gradients) rebuilt each step.
Communication per step, all through GPU 0: broadcast Ψ parameters to N-1 GPUs, reduce Ψ
gradients from them ((N-1) · 4Ψ bytes each way), plus scattering inputs and gathering outputs.
One Python process and GIL for all GPUs is why DistributedDataParallel (ddp.py) replaced it.

    python dp.py                 # nn.DataParallel over all visible GPUs
    python dp.py --manual        # the same step written out: replicate -> scatter -> parallel_apply -> gather
    CUDA_VISIBLE_DEVICES=0,1 python dp.py --epochs 1

Without GPUs it trains on the CPU as one device, and says so.
"""
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import gather, parallel_apply, replicate, scatter

import common


def manual_data_parallel(module, x, device_ids):
    """What nn.DataParallel.forward does, one primitive at a time (all differentiable)."""
    replicas = replicate(module, device_ids)                 # broadcast the parameters to every GPU
    inputs = scatter(x, device_ids)                          # split the batch along dim 0
    outputs = parallel_apply(replicas[:len(inputs)], [(i,) for i in inputs])   # one thread per GPU
    return gather(outputs, device_ids[0])                    # concatenate the outputs on GPU 0


def train(model, forward, optimizer, loader, sampler, args, device):
    steps, t_train, loss_sum, loss_n, last_loss, mem = 0, 0.0, torch.zeros((), device=device), 0, float("nan"), {}
    first_loss = None
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.perf_counter()
        bar = common.progress(loader, args, desc=f"epoch {epoch}")
        for x, y in bar:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(forward(x), y)      # outputs are gathered on GPU 0: one loss, one backward
            loss.backward()
            optimizer.step()
            if steps == 0:
                mem = dict(param_bytes=common.param_bytes(model.parameters()),
                           grad_bytes=common.grad_bytes(model.parameters()),
                           optim_bytes=common.optimizer_bytes(optimizer))
            optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
            steps, loss_n = steps + 1, loss_n + 1
            if first_loss is None:
                first_loss = loss.item()
            if steps % 20 == 0 or steps == args.max_steps or steps % len(loader) == 0:
                last_loss, loss_sum, loss_n = loss_sum.item() / loss_n, loss_sum * 0, 0
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
    return dict(steps=steps, loss=last_loss, first_loss=first_loss, train_time=t_train, **mem)


@torch.no_grad()
def evaluate(forward, loader, device):
    correct = seen = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        correct += (forward(x).argmax(1) == y).sum().item()
        seen += len(y)
    return correct / max(seen, 1)


def main():
    parser = common.get_parser("DP: nn.DataParallel (one process, all visible GPUs) on the common ViT")
    parser.add_argument("--manual", action="store_true", help="write the step out: replicate, scatter, parallel_apply, gather")
    args = common.parse_args(parser)
    common.check(args.backend == "auto", "dp.py makes no process group, so --backend does not apply (leave it at auto)")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    common.check(args.batch_size >= max(gpus, 1), f"--batch-size {args.batch_size} is smaller than the {gpus} GPUs")
    model = common.build_model(args)
    if args.load:
        model.load_state_dict(common.load_state_dict_file(args.load, model.state_dict()))
    if gpus == 0:
        device, device_ids, forward = torch.device("cpu"), [], model
        common.log("dp: no GPUs visible, training on the CPU as a single device (nothing is parallel here)")
    else:
        device, device_ids = torch.device("cuda", 0), list(range(gpus))
        model.to(device)             # DataParallel needs the parameters on device_ids[0]
        if args.manual:
            forward = lambda x: manual_data_parallel(model, x, device_ids)   # noqa: E731
        else:
            forward = nn.DataParallel(model, device_ids=device_ids)
        common.log(f"dp: {'replicate/scatter/parallel_apply/gather' if args.manual else 'nn.DataParallel'} "
                   f"over {gpus} GPU{'s' * (gpus > 1)}")
    xtr, ytr, xte, yte, source = common.load_data(args)
    loader, sampler = common.train_loader(xtr, ytr, args.batch_size, 0, 1, args.seed)
    common.check(len(loader) > 0, f"{len(ytr)} training samples make no full batch of {args.batch_size}")
    optimizer = common.make_optimizer(model.parameters(), args)
    psi = sum(p.numel() for p in model.parameters())
    n = max(gpus, 1)
    common.log(f"dp: Ψ = {psi:,} parameters, {source} data ({len(ytr)} train / {len(yte)} test), "
               f"batch {args.batch_size} split over {n} device{'s' * (n > 1)}")
    out = train(model, forward, optimizer, loader, sampler, args, device)
    acc = evaluate(forward, common.test_loader(xte, yte, 512), device)
    comm_bytes = 2 * (n - 1) * 4 * psi          # broadcast params out + reduce grads back (activations not counted)
    common.report([
        ("parameters (GPU 0)", out["param_bytes"], 4 * psi, "4Ψ (+ a 4Ψ replica per other GPU, each step)"),
        ("gradients (GPU 0)", out["grad_bytes"], 4 * psi, "4Ψ"),
        ("optimizer state", out["optim_bytes"], (8 if args.optim == "adamw" else 4) * psi,
         "8Ψ AdamW m, v" if args.optim == "adamw" else "4Ψ SGD momentum"),
        ("through GPU 0 per step", comm_bytes, comm_bytes, "2(N-1) · 4Ψ: broadcast params, reduce grads"),
    ])
    if device.type == "cuda":
        common.log(f"  cuda max_memory_allocated (GPU 0): {common.fmt_bytes(torch.cuda.max_memory_allocated(device))}")
    sps = out["steps"] * args.batch_size / max(out["train_time"], 1e-9)
    common.log(f"\ntest accuracy {acc:.4f}, final train loss {out['loss']:.4f}, {sps:.0f} samples/s")
    if args.save:
        common.save_checkpoint({k: v.cpu() for k, v in model.state_dict().items()}, args.save)
        common.log(f"saved {args.save}")
    common.result(script="dp", world_size=n, backend="none", device=device.type, data=source, params=psi,
                  steps=out["steps"], loss=out["loss"], first_loss=out["first_loss"], test_acc=acc,
                  samples_per_s=sps, param_bytes=out["param_bytes"], grad_bytes=out["grad_bytes"],
                  optim_bytes=out["optim_bytes"], comm_bytes=comm_bytes, manual=args.manual)


if __name__ == "__main__":
    main()
