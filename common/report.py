"""What rank 0 prints: progress, the loss lines, measured-next-to-formula, the RESULT line."""

import json
import sys

import torch

from common.messages import env_rank, log
from common.meter import Meter


def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


class Progress:
    """What train() iterates: the loader's batches, through tqdm on a terminal (a plain line every
    --log-every steps in a log file, from log_loss). Each batch drawn is one step of the loop,
    which the active Meter counts. The first `skip` batches (trained on before a resume) are drawn,
    so that the sampler's order stays the same, but not yielded."""

    def __init__(self, loader, bar=None, skip=0):
        self.loader = loader
        self.bar = bar
        self.skip = skip

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        batches = self.bar if self.bar is not None else self.loader
        for index, batch in enumerate(batches):
            if index < self.skip:
                continue
            if Meter.active is not None:
                Meter.active.loop_step_starts()
            yield batch


def progress(loader, args, epoch, skip=0):
    if args.no_progress or env_rank() != 0 or not sys.stderr.isatty():
        return Progress(loader, skip=skip)
    from tqdm import tqdm

    bar = tqdm(loader, leave=False, dynamic_ncols=True, desc=f"epoch {epoch}")
    return Progress(loader, bar, skip)


def log_loss(bar, args, epoch, steps, loss):
    """The windowed mean loss: on the bar's tail on a terminal, as a plain line every
    --log-every steps in a log file."""
    if bar.bar is not None:
        bar.bar.set_postfix(loss=f"{loss:.4f}")
    elif steps % args.log_every == 0:
        log(f"epoch {epoch} step {steps}: train loss {loss:.4f}")


def report(
    script, args, world, backend, device, source, model_params, out, acc, meter, formula, **extra
):
    """Rank 0: the measured per-rank memory and communication next to the formula, then the one
    machine-readable line `RESULT {json}` that run_all.sh and the tests read.

    `formula` maps param_bytes / grad_bytes / optim_bytes / comm (a {kind: bytes} dict) to the
    paper's value (None where it makes no promise), and `notes` to the formula's text."""
    notes = formula.pop("notes", {})
    comm, calls, counted = meter.comm()
    rows = [
        (what, meter.mem.get(k, 0), formula.get(k), notes.get(k, ""))
        for what, k in (
            ("parameters", "param_bytes"),
            ("gradients", "grad_bytes"),
            ("optimizer state", "optim_bytes"),
            ("activations (1st forward)", "act_bytes"),
        )
    ]
    rows += [
        (f"  of which {k[10:]}", meter.mem[k], formula.get(k), notes.get(k, ""))
        for k in sorted(meter.mem)
        if k.startswith("act_bytes_")
    ]
    if formula.get("optim_peak_bytes") is not None:
        rows.insert(
            3,
            (
                "optimizer state, peak",
                meter.mem.get("optim_peak_bytes", 0),
                formula["optim_peak_bytes"],
                notes.get("optim_peak_bytes", ""),
            ),
        )
    for kind in sorted(set(comm) | set(formula.get("comm", {}))):
        rows.append(
            (
                f"{kind.replace('_', '-')} per step",
                comm.get(kind, 0),
                formula.get("comm", {}).get(kind),
                notes.get(kind, "") + f" ({calls.get(kind, 0)} calls in {counted} steps)",
            )
        )
    log("\nper-rank memory and communication (measured from outside the technique)")
    log(f"  {'':<26}{'measured':>12}{'formula':>12}   formula")
    for what, measured, expected, text in rows:
        flag = "" if expected is None or measured == expected else "  (differs)"
        log(
            f"  {what:<26}{fmt_bytes(measured):>12}{fmt_bytes(expected) if expected is not None else '':>12}"
            f"   {text}{flag}"
        )
    if device.type == "cuda":
        log(f"  cuda max_memory_allocated: {fmt_bytes(torch.cuda.max_memory_allocated(device))}")
    sps = meter.samples_per_s()
    log(f"\ntest accuracy {acc:.4f}, final train loss {out['loss']:.4f}, {sps:.0f} samples/s")
    fields = dict(
        script=script,
        world_size=world,
        backend=backend,
        device=device.type,
        data=source,
        params=model_params,
        steps=out["steps"],
        loss=out["loss"],
        test_acc=acc,
        samples_per_s=sps,
        **meter.mem,
        comm_bytes=sum(comm.values()),
        comm=comm,
        comm_calls=calls,
        comm_steps=counted,
        formula=formula,
        **extra,
    )
    result(**fields)
    return fields


def result(**fields):
    """The machine-readable last line that run_all.sh and the tests read (rank 0 only)."""
    log("RESULT " + json.dumps(fields))


def pipeline_timeline(orders, cost, V=1):
    """Each rank's recorded actions replayed in slots, `cost` slots each, an action starting after the rank's
    last and after its input (F of global chunk c = v·p + s after F of c-1, B of c after B of c+1). Returns
    the picture (F3' is micro-batch 3 in the rank's chunk v=1), the idle fraction of the slots, and each
    rank's peak of micro-batch chunks in flight (F run, its last backward action not)."""
    end, p, last = {}, len(orders), "W" if any(a == "W" for o in orders for a, _, _ in o) else "B"
    for _ in range(sum(map(len, orders))):  # relax until every action ends at its longest path
        for s, o in enumerate(orders):
            for k, (a, i, v) in enumerate(o):
                c = v * p + s + (-1 if a == "F" else 1)
                dep = end.get((c % p, a, i, c // p), 0) if a != "W" and 0 <= c < V * p else 0
                end[s, a, i, v] = max(dep, end.get((s, *o[k - 1]), 0) if k else 0) + cost[a]
    total, width = max(end.values()), max(len(str(i)) for o in orders for _, i, _ in o) + V + 1
    cells = {
        (s, t): f"{a}{i}" + "'" * v
        for (s, a, i, v), e in end.items()
        for t in range(e - cost[a], e)
    }
    picture = "\n".join(
        f"  rank {s}:  "
        + "".join(cells.get((s, t), ".").ljust(width) for t in range(total)).rstrip()
        for s in range(p)
    )
    peaks = [
        max(sum({"F": 1, last: -1}.get(a, 0) for a, _, _ in o[: k + 1]) for k in range(len(o)))
        for o in orders
    ]
    return picture, 1 - sum(cost[a] for o in orders for a, _, _ in o) / (p * total), peaks
