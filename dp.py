"""DP: torch.nn.DataParallel -- one process drives every visible GPU. Each step it copies the
model from GPU 0 to the others, splits the batch, runs the replicas in threads, gathers the
outputs on GPU 0, and backward sums the gradients back onto GPU 0's parameters.

    forward:  GPU 0's model  --replicate-->  a replica on each GPU
              batch x        --scatter---->  x[0] on GPU 0, x[1] on GPU 1, ...  (N chunks)
              each replica runs on its chunk, one thread per GPU
              outputs        <--gather-----  concatenated on GPU 0, where the loss is computed
    backward: the same in reverse; each replica's gradients are summed onto GPU 0's parameters
    step:     the optimizer, on GPU 0 only

Memory (fp32, AdamW, Ψ parameters): GPU 0 holds 4Ψ params + 4Ψ grads + 8Ψ optimizer = 16Ψ,
every other GPU a 4Ψ replica (+ its gradients) rebuilt each step.
Communication per step, all through GPU 0: broadcast Ψ parameters to N-1 GPUs, reduce Ψ
gradients from them ((N-1) · 4Ψ bytes each way), plus scattering inputs and gathering outputs.
Data parallelism: Krizhevsky 2014, "One weird trick for parallelizing convolutional neural
networks", https://arxiv.org/abs/1404.5997. nn.DataParallel is what DistributedDataParallel
(ddp.py) replaced: one Python process and GIL for all GPUs. What the Meter sees, and why not
under torchrun: docs/techniques.md#dataparallel

    python dp.py                  # nn.DataParallel over all visible GPUs
    python dp.py --manual         # the same step written out: replicate, scatter, apply, gather
    CUDA_VISIBLE_DEVICES=0,1 python dp.py --epochs 1
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import gather, parallel_apply, replicate, scatter
from torch.utils.data import DataLoader, DistributedSampler

import common

SCRIPT = os.path.splitext(os.path.basename(__file__))[0]


### begin: DataParallel
# Model contract: any nn.Module whose parameters are on device_ids[0].


class ManualDataParallel(nn.Module):
    """What nn.DataParallel.forward does, one primitive at a time (each differentiable, so that
    backward runs the same steps in reverse: gradients are summed back onto GPU 0's parameters)."""

    def __init__(self, module, device_ids):
        super().__init__()
        self.module = module
        self.device_ids = device_ids

    def forward(self, x):
        replicas = replicate(self.module, self.device_ids)  # copy the parameters to every GPU
        chunks = scatter(x, self.device_ids)  # split the batch along dim 0, a chunk per GPU
        # One thread per GPU runs its replica on its chunk (a batch smaller than the number of
        # GPUs leaves the last GPUs without a chunk). parallel_apply takes each replica's
        # positional arguments as a tuple.
        inputs = [(chunk,) for chunk in chunks]
        outputs = parallel_apply(replicas[: len(chunks)], inputs)
        return gather(outputs, self.device_ids[0])  # concatenate the outputs on GPU 0


def parallelize(model, device_ids, manual=False):
    """Wrap the model to run over `device_ids`; without GPUs there is nothing to split."""
    if not device_ids:
        return model
    if manual:
        return ManualDataParallel(model, device_ids)
    return nn.DataParallel(model, device_ids=device_ids)


def full_state_dict(model):
    """The model's own state_dict(), hooks and buffers included, inside the wrapper if any."""
    if isinstance(model, (nn.DataParallel, ManualDataParallel)):
        model = model.module
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


### end: DataParallel


def formula(psi, gpus, args):
    """The paper's bytes on GPU 0, which the report sets next to what the Meter measured."""
    k = 8 if args.optim == "adamw" else 4  # the ZeRO paper's K: optimizer bytes per parameter
    return dict(
        param_bytes=4 * psi,
        grad_bytes=4 * psi,
        optim_bytes=k * psi,
        notes=dict(
            param_bytes="4Ψ on GPU 0 (+ a 4Ψ replica per other GPU, each step)",
            grad_bytes="4Ψ on GPU 0",
            optim_bytes=f"{k}Ψ " + ("AdamW m, v" if k == 8 else "SGD momentum"),
        ),
    )


def visible_gpus():
    """The GPUs this process sees (CUDA_VISIBLE_DEVICES picks them); 0 without CUDA."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_args(args, world):
    common.check(
        args.backend == "auto",
        "dp.py makes no process group, so --backend does not apply (leave it at auto)",
    )
    common.check(
        args.nproc is None,
        "dp.py is one process driving every GPU: --nproc does not apply (see ddp.py)",
    )
    common.check(
        world == 1,
        f"dp.py is one process driving every GPU, but this launch started {world} "
        f"(WORLD_SIZE={world}): each would train its own DataParallel copy over the same GPUs. "
        "Run `python dp.py`, or ddp.py under torchrun",
    )
    gpus = visible_gpus()
    common.check(
        args.batch_size >= max(gpus, 1),
        f"--batch-size {args.batch_size} is smaller than the {gpus} GPUs",
    )
    common.check(
        not args.experts or gpus <= 1,
        f"--experts over {gpus} GPUs: each DataParallel replica would add the "
        "load-balancing gradient again (use ddp.py or expert_parallel.py)",
    )


def train(model, optimizer, scheduler, loader, sampler, args, device, step=0):
    """The loop every script shares: forward, loss, backward, step, schedule, log."""
    stop = args.max_steps or float("inf")
    loss_sum = torch.zeros((), device=device)  # stays on the device until a logging step
    losses_summed = 0
    last_loss = float("nan")
    for epoch in range(step // len(loader), args.epochs):
        if step >= stop:
            break
        sampler.set_epoch(epoch)  # a new shuffle each epoch
        loader.dataset.set_epoch(epoch)  # and new augmentations (--shift), the same everywhere
        model.train()
        bar = common.progress(loader, args, epoch)
        for i, (x, y) in enumerate(bar):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            # The outputs are gathered on GPU 0: one loss, one backward for all replicas.
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if args.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            loss_sum += loss.detach()
            losses_summed += 1
            if step % args.log_every == 0 or step >= stop or i + 1 == len(loader):
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
    """Exact: every test sample once, in one process (the padding the loader adds is masked out)."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=device)
    for x, y, keep in loader:
        x, y, keep = x.to(device), y.to(device), keep.to(device)
        counts += torch.stack([((model(x).argmax(1) == y) & keep).sum(), keep.sum()])
    return counts[0].item() / max(counts[1].item(), 1)


def run(args):
    """One process, in the seeds' order: the data, the model, the wrap, train, evaluate, save."""
    gpus = visible_gpus()
    if gpus:
        device = torch.device("cuda", 0)  # the parameters, the loss and the optimizer live here
        device_ids = list(range(gpus))
        wrapper = "replicate/scatter/parallel_apply/gather" if args.manual else "nn.DataParallel"
        common.log(f"{SCRIPT}: {wrapper} over {gpus} GPU(s)")
    else:
        device = torch.device("cpu")
        device_ids = []
        common.log(
            f"{SCRIPT}: no GPUs visible, training on the CPU as a single device "
            "(nothing is parallel here)"
        )
    train_set, test_set, source = common.load_data(args, device)
    # One process sees every sample. A sampler for a world of one shuffles exactly as ddp.py's do
    # at any W, so dp.py trains on the same global batches (and, on one device, to the same
    # weights).
    sampler = DistributedSampler(
        train_set, num_replicas=1, rank=0, shuffle=True, seed=args.seed, drop_last=True
    )
    loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
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
    model = common.build_model(args)
    if args.load:
        model.load_state_dict(common.load_state_dict_file(args.load, model.state_dict()))
    psi = sum(p.numel() for p in model.parameters())
    # DataParallel copies the parameters from device_ids[0]: they must be there before it wraps.
    model = parallelize(model.to(device), device_ids, args.manual)
    optimizer = common.make_optimizer(model.parameters(), args)
    scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
    common.log(
        f"{SCRIPT}: Ψ = {psi:,} parameters, {source} data "
        f"({len(train_set)} train / {len(test_set)} test), "
        f"batch {args.batch_size} split over {max(gpus, 1)} device(s)"
    )
    # The Meter's saved-tensor hooks are per thread: they see what autograd keeps for backward
    # only where the forward runs in this thread, on one device.
    with common.Meter(
        model, optimizer, args, activations=len(device_ids) <= 1, device=device
    ) as meter:
        out = train(model, optimizer, scheduler, loader, sampler, args, device)
    test_loader = common.test_loader(test_set, pin_memory=device.type == "cuda")
    acc = evaluate(model, test_loader, device)
    if args.save:
        common.save_checkpoint(full_state_dict(model), args.save)
        common.log(f"saved {args.save}")
    common.report(
        SCRIPT,
        args,
        world=max(gpus, 1),
        backend="none",
        device=device,
        data=source,
        params=psi,
        trained=out,
        test_acc=acc,
        meter=meter,
        formula=formula(psi, gpus, args),
        manual=args.manual,
    )


def main():
    parser = common.get_parser(
        "DP: nn.DataParallel (one process, all visible GPUs) on the common ViT"
    )
    parser.add_argument(
        "--manual",
        action="store_true",
        help="write the step out: replicate, scatter, parallel_apply, gather",
    )
    args = common.parse_args(parser)
    check_args(args, common.world_size(args))
    run(args)


if __name__ == "__main__":
    main()
