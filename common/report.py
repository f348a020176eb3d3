"""What rank 0 prints: progress, the loss lines, measured-next-to-formula, the RESULT line."""

import json
import sys

import torch
import torch.distributed as dist

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
    script,
    args,
    *,
    world,
    backend,
    device,
    data,
    params,
    trained,
    test_acc,
    meter,
    formula,
    **extra,
):
    """Every rank calls it, at the same point (it all-reduces the CUDA peak); rank 0 prints the
    measured per-rank memory and communication next to the formula, then the one
    machine-readable line `RESULT {json}` that run_all.sh and the tests read.

    `formula` maps param_bytes / grad_bytes / optim_bytes / comm (a {kind: bytes} dict) to the
    script's promise (None where it makes none), optionally optim_peak_bytes and working_bytes
    (rows of their own, working_bytes where the Meter measured it: its `held=`), and `notes` to
    the formula's text. `paper` (optional): the paper's own formula at this run's size, printed in
    a column of its own: {"model_states": bytes} adds a "model states, all" row (parameters,
    gradients, optimizer state and working copy), a comm kind goes on its row; notes["paper"]
    names the paper. `data` names the data source, `params` is Ψ, `trained` is train()'s dict
    (steps, loss), `test_acc` evaluate()'s accuracy (None under --simulate); `extra` goes into
    the RESULT line as it is."""
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
    if "working_bytes" in meter.mem:  # a copy the script holds besides (bf16 working weights)
        working = ("working copy", meter.mem["working_bytes"], formula.get("working_bytes"))
        rows.insert(3, (*working, notes.get("working_bytes", "")))
    paper = formula.pop("paper", {})  # {row: the paper's bytes}, notes["paper"]: which paper
    if "model_states" in paper:
        states = ("param_bytes", "grad_bytes", "optim_bytes", "working_bytes")
        measured = sum(meter.mem.get(k) or 0 for k in states)
        promised = sum(formula.get(k) or 0 for k in states)
        rows.insert(0, ("model states, all", measured, promised, notes.get("model_states", "")))
    for kind in sorted(set(comm) | set(formula.get("comm", {}))):
        rows.append(
            (
                f"{kind.replace('_', '-')} per step",
                comm.get(kind, 0),
                formula.get("comm", {}).get(kind),
                notes.get(kind, "") + f" ({calls.get(kind, 0)} calls in {counted} steps)",
            )
        )
    # The paper's formula where the script gives it (ZeRO's Table 1 for the model states, its
    # traffic): a column of its own, between this recipe's formula and the formula's text.
    paper_keys = {"model states, all": "model_states"}
    paper_keys.update({f"{kind.replace('_', '-')} per step": kind for kind in comm})
    log("\nper-rank memory and communication (measured from outside the technique)")
    paper_column = f"{'paper':>12}" if paper else ""
    log(f"  {'':<26}{'measured':>12}{'formula':>12}{paper_column}   formula")
    for what, measured, expected, text in rows:
        papers = paper.get(paper_keys.get(what))
        paper_column = f"{'' if papers is None else fmt_bytes(papers):>12}" if paper else ""
        if measured is None:
            log(f"  {what:<26}{'not measured':>12}{'':>12}{paper_column}   {text}")
            continue
        promised = "" if expected is None else fmt_bytes(expected)
        flag = "" if expected is None or measured == expected else "  (differs)"
        log(f"  {what:<26}{fmt_bytes(measured):>12}{promised:>12}{paper_column}   {text}{flag}")
    if paper:
        log(f"  paper: {notes.get('paper', '')}")
    cuda_peak = training_cuda_peak(meter, device)
    if cuda_peak is not None:
        log(f"  cuda peak in training, max over ranks: {fmt_bytes(cuda_peak)}")
    if args.simulate:  # shapes only: no loss, accuracy or speed to report (common/simulate.py)
        sps = None
        log(f"\nsimulated: rank {dist.get_rank()} of {world}, one step, nothing computed")
    else:
        sps = meter.samples_per_s()
        loss = trained["loss"]
        log(f"\ntest accuracy {test_acc:.4f}, final train loss {loss:.4f}, {sps:.0f} samples/s")
    fields = dict(
        script=script,
        world_size=world,
        backend=backend,
        device=device.type,
        data=data,
        params=params,
        steps=trained["steps"],
        loss=None if args.simulate else trained["loss"],
        test_acc=test_acc,
        samples_per_s=sps,
        cuda_peak_bytes=cuda_peak,
        **meter.mem,
        comm_bytes=sum(comm.values()),
        comm=comm,
        comm_calls=calls,
        comm_steps=counted,
        formula=formula,
        paper=paper,
        simulated=bool(args.simulate),
        **extra,
    )
    result(**fields)
    return fields


def training_cuda_peak(meter, device):
    """The largest of the ranks' CUDA peaks in training (the Meter's max_memory_allocated, reset
    as training began, read as it ended), None on the CPU. Every rank issues the all-reduce, also
    on the CPU, so that a script calling report() on some ranks only hangs in the CPU tests too."""
    peak = meter.cuda_peak if meter.cuda_peak is not None else -1
    if dist.is_available() and dist.is_initialized():
        # NCCL reduces GPU tensors (this rank's), Gloo CPU ones
        on = device if dist.get_backend() == "nccl" else torch.device("cpu")
        peaks = torch.tensor([peak], dtype=torch.int64, device=on)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        peak = int(peaks.item())
    return peak if peak >= 0 else None


def result(**fields):
    """The machine-readable last line that run_all.sh and the tests read (rank 0 only)."""
    log("RESULT " + json.dumps(fields))


def pipeline_timeline(recorder, meter, promised, orders=None):
    """Every rank calls it after training: each stage's recorded actions (record_pipeline_order)
    and measured bytes are gathered on rank 0, which replays the actions in slots and prints the
    picture, the idle fraction and the peak of micro-batches in flight next to the script's
    formula (`promised["bubble"]`, `promised["peak_inflight"]`). Returns the RESULT's fields on
    rank 0 (the bubble, the peaks, each stage's measurements as `stages`), {} on the others.

    `orders`: under --simulate, every stage's actions, which the script recorded by running each
    stage in this one process (the fake group's gather returns this rank's in every slot). They
    are replayed instead, and RESULT gains them as `orders`: its own fields are this rank's
    measurements, and there are no other ranks' (no `stages`)."""
    stages = None
    if orders is None:  # the ranks' own, gathered
        comm, calls, _ = meter.comm()
        mine = dict(meter.mem, comm=comm, comm_calls=calls, **recorder.recorded())
        stages = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, stages, dst=0)
        if stages is None:
            return {}
        orders = [stage["order"] for stage in stages]
    picture, bubble, peaks = replay_pipeline(orders)
    chunks = 1 + max(chunk for order in orders for _, _, chunk in order)
    micro_batches = 1 + max(micro_batch for order in orders for _, micro_batch, _ in order)
    split = f"{len(orders)} stages" + (f" x {chunks} chunks" if chunks > 1 else "")
    bubble_formula = promised.get("notes", {}).get("bubble", "")
    log(f"\npipeline as run: {split}, {micro_batches} micro-batches, a slot per F, B or W")
    log("(a whole backward B two; F3' is micro-batch 3 in the rank's next chunk)")
    log(picture)
    log(
        f"  bubble {bubble:.3f} of the slots (formula {bubble_formula} = "
        f"{promised['bubble']:.3f}), peak micro-batches in flight {peaks} "
        f"(formula {promised['peak_inflight']})"
    )
    if stages is None:  # --simulate
        return dict(bubble=bubble, peak_inflight=peaks, orders=orders)
    return dict(bubble=bubble, peak_inflight=peaks, stages=stages)


def replay_pipeline(orders):
    """Each rank's actions (F | B | W, micro-batch, chunk), in the order it ran them, replayed in
    slots: (the picture, the idle fraction of the slots, each rank's peak in flight)."""
    cost = _slots_per_action(orders)
    end = _replay_in_slots(orders, cost)
    busy = sum(cost[action] for order in orders for action, _, _ in order)
    bubble = 1 - busy / (len(orders) * max(end.values()))
    peaks = [_peak_in_flight(order, cost) for order in orders]
    return _draw(len(orders), end, cost), bubble, peaks


def _slots_per_action(orders):
    """A whole backward costs about two forwards, so B takes two slots; where the weights'
    gradients are a pass of their own (W), B (the input's gradient) and W take one slot each (Zero
    Bubble's unit)."""
    split = any(action == "W" for order in orders for action, _, _ in order)
    return dict(F=1, B=1 if split else 2, W=1)


def _replay_in_slots(orders, cost):
    """{(rank, action, micro-batch, chunk): the slot it ends in}, each action as early as it can
    run: after the rank's previous action and after the action that makes its input (F of global
    chunk c = v·p + s after F of chunk c-1, B of c after B of c+1; W needs only its B, earlier on
    its rank). An action's end is set by the longest chain of actions leading to it; after n passes
    over all the ranks every end whose chain has at most n actions is right, and no chain holds
    more actions than there are, so that many passes settle them all (Bellman-Ford's argument)."""
    ranks = len(orders)
    global_chunks = ranks * (1 + max(chunk for order in orders for _, _, chunk in order))
    end = {}
    for _ in range(sum(len(order) for order in orders)):
        for rank, order in enumerate(orders):
            rank_free_at = 0  # the end of the rank's previous action
            for action, micro_batch, chunk in order:
                global_chunk = chunk * ranks + rank
                # F's input comes from the chunk before, B's from the chunk after
                input_chunk = global_chunk - 1 if action == "F" else global_chunk + 1
                input_ready = 0
                if action != "W" and 0 <= input_chunk < global_chunks:
                    producer = (input_chunk % ranks, action, micro_batch, input_chunk // ranks)
                    input_ready = end.get(producer, 0)
                rank_free_at = max(rank_free_at, input_ready) + cost[action]
                end[rank, action, micro_batch, chunk] = rank_free_at
    return end


def _peak_in_flight(order, cost):
    """The most micro-batch chunks whose forward has run and whose last backward pass has not."""
    last_backward = "W" if cost["B"] == 1 else "B"  # split off, W is the one that frees them
    in_flight = 0
    peak = 0
    for action, _, _ in order:
        if action == "F":
            in_flight += 1
        elif action == last_backward:
            in_flight -= 1
        peak = max(peak, in_flight)
    return peak


def _draw(ranks, end, cost):
    """One line per rank, one cell per slot: the action in it (F3' is micro-batch 3 in chunk 1, F3''
    in chunk 2), or '.' where the rank idles."""
    cells = [["."] * max(end.values()) for _ in range(ranks)]
    for (rank, action, micro_batch, chunk), finish in end.items():
        for slot in range(finish - cost[action], finish):
            cells[rank][slot] = f"{action}{micro_batch}" + "'" * chunk
    width = 1 + max(len(cell) for row in cells for cell in row)
    rows = ["".join(cell.ljust(width) for cell in row).rstrip() for row in cells]
    return "\n".join(f"  rank {rank}:  {row}" for rank, row in enumerate(rows))


def show_expert_load(load, meter, world):
    """Every rank takes part; rank 0 prints the tokens each expert received per step (every
    block), and each rank's all-to-all bytes per step. Returns the RESULT fields."""
    per_rank = [None] * world
    window = meter.counter.bytes.get("all_to_all", 0)  # this rank's, in the Meter's window
    mine = dict(load=[counts.tolist() for counts in load], all_to_all=window)
    dist.all_gather_object(per_rank, mine)
    steps = max(meter.loop_steps, 1)
    table = []
    for block_index, counts in enumerate(load):
        # an expert receives what every rank routes to it
        received = []
        for expert in range(len(counts)):
            total = sum(seen["load"][block_index][expert] for seen in per_rank)
            received.append(total / steps)
        table.append(received)
    log("\ntokens received per expert per step (mean over the run's steps):")
    for block_index, row in enumerate(table):
        log(f"  block {block_index}: " + " ".join(f"{tokens:7.1f}" for tokens in row))
    all_to_all = [seen["all_to_all"] for seen in per_rank]
    window_steps = meter.comm()[2]
    each = ", ".join(fmt_bytes(size / window_steps) for size in all_to_all)
    mean = fmt_bytes(sum(all_to_all) / window_steps / world)
    log(f"all-to-all per step on each rank: {each}; mean over ranks {mean} (the formula's)")
    return dict(tokens_per_expert=table, all_to_all_window=all_to_all)
