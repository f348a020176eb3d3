"""Test accuracy per epoch and wall time of the main command's training (ddp.py at its defaults),
on whatever --data / --data-dir hold (not a test). It runs ddp.py's own setup, train and
evaluate, one epoch at a time over the whole run's learning-rate schedule, so its last line is
what `torchrun ... ddp.py` with the same flags ends with.

    torchrun --standalone --nproc_per_node=4 benchmarks/bench_accuracy.py --data mnist
    torchrun --standalone --nproc_per_node=4 benchmarks/bench_accuracy.py --data synthetic
    python benchmarks/bench_accuracy.py --nproc 2 --epochs 1 --limit 4096   # any shared flag
"""

import copy
import gc
import os
import sys
import time

from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import common  # noqa: E402
import ddp  # noqa: E402


def run(args):
    rank, world, device, backend = ddp.setup(args)
    try:
        train_set, test_set, source = common.load_data(args, device)
        sampler = DistributedSampler(
            train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True
        )
        loader = DataLoader(
            train_set,
            batch_size=args.batch_size // world,
            sampler=sampler,
            drop_last=True,
            pin_memory=device.type == "cuda",
            num_workers=args.workers,
            persistent_workers=args.workers > 0,  # started once, not every epoch
        )
        model = ddp.parallelize(common.build_model(args).to(device), device)
        optimizer = common.make_optimizer(model.parameters(), args)
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        test = common.test_loader(test_set, rank, world, pin_memory=device.type == "cuda")
        common.log(
            f"bench_accuracy: ddp.py defaults at W={world} ({backend}), {source} data "
            f"({len(train_set)} train / {len(test_set)} test), {args.epochs} epochs"
        )
        rows = []
        start = time.perf_counter()
        step = 0
        for epoch in range(args.epochs):
            # train() up to the end of this epoch, on the schedule drawn over all --epochs
            until_this_epoch = copy.copy(args)
            until_this_epoch.epochs = epoch + 1
            out = ddp.train(
                model, optimizer, scheduler, loader, sampler, until_this_epoch, device, step=step
            )
            step = out["steps"]
            acc = ddp.evaluate(model, test, device)
            wall_s = round(time.perf_counter() - start, 1)
            rows.append(dict(epoch=epoch, step=step, test_acc=acc, wall_s=wall_s))
            common.log(f"epoch {epoch}: test accuracy {acc:.4f}  ({wall_s:.0f} s)")
            if args.max_steps and step >= args.max_steps:
                break
        common.result(
            script="bench_accuracy",
            world_size=world,
            backend=backend,
            data=source,
            epochs=rows,
            test_acc=rows[-1]["test_acc"],
            wall_s=rows[-1]["wall_s"],
        )
        # Free DDP before leaving the group, as ddp.py does: its reducer holds the group and,
        # freed after it, waits for Gloo's threads while holding the GIL that one of them needs
        # (pytorch#56297; this benchmark's test hung so once in 25 runs on torch 2.11).
        del model
        gc.collect()
    finally:
        ddp.cleanup()


def main():
    args = common.parse_args(
        common.get_parser("Accuracy per epoch of ddp.py's training at its defaults")
    )
    ddp.check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
