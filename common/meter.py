"""The measuring instrument, attached from outside: collectives, memory, activations, timing."""

import os
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from common.messages import env_rank

COLLECTIVES = {  # c10d op -> (name in the report, which argument holds the bytes that count)
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
    "broadcast_": ("broadcast", 0),
    "reduce_": ("reduce", 0),
    "gather_": ("gather", 1),
    "scatter_": ("scatter", 0),
    "send": ("send", 0),
    "recv_": ("recv", 0),
    # torch.distributed._functional_collectives (DTensor): the output is returned, the input counts
    "all_reduce": ("all_reduce", 0),
    "all_gather_into_tensor": ("all_gather", -1),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "all_to_all_single": ("all_to_all", 0),
    "broadcast": ("broadcast", 0),
}


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


class CollectiveCounter(TorchDispatchMode):
    """Sees every c10d op this rank issues (also DDP's and FSDP's from C++ or from the autograd
    engine) and adds up calls and bytes per kind: for an all-reduce the tensor, for an all-gather
    the gathered output, for a reduce-scatter its input, for send/recv the message. A 0-d tensor
    (the skeleton's logged loss) is bookkeeping, not the technique's traffic, and is left out."""

    def __init__(self):
        super().__init__()
        self.calls, self.bytes, self.sample = {}, {}, None
        self.groups = {}  # {process group name: {kind: [calls, bytes]}}: traffic per mesh dimension

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (
            self.sample is not None
        ):  # the Meter's reading after every op (the optimizer state's peak)
            self.sample()
        if func.namespace in ("c10d", "_c10d_functional"):
            kind, where = COLLECTIVES.get(func._opname, (None, None))
            if kind is not None:
                ts = (
                    _tensors(out)
                    if where == -1
                    else _tensors(args[where] if where < len(args) else [])
                )
                if ts and not all(t.dim() == 0 for t in ts):
                    n = sum(_local(t).numel() * t.element_size() for t in ts)
                    self.calls[kind] = self.calls.get(kind, 0) + 1
                    self.bytes[kind] = self.bytes.get(kind, 0) + n
                    seen = self.groups.setdefault(_group_name(args), {}).setdefault(kind, [0, 0])
                    seen[0], seen[1] = seen[0] + 1, seen[1] + n
        return out


def _group_name(args):
    """The process group a c10d op runs on: a functional collective names it (its last str argument),
    a c10d op passes the ProcessGroup as a script object."""
    names = [a for a in args if isinstance(a, str)]
    if names:
        return names[-1]
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).group_name
            except RuntimeError:  # a ReduceOp
                pass
    return None


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors):
    """Bytes of the distinct storages behind `tensors`: a view adds nothing, a freed buffer is 0,
    a DTensor counts its local shard."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        s = _local(t).untyped_storage()
        seen[s.data_ptr() if s.nbytes() else id(s)] = s.nbytes()
    return sum(seen.values())


def memory(params, optimizer):
    """Per-rank bytes of parameters, gradients and optimizer state (the scalar step counters are
    left out, as the papers do), read off the storages that hold them right now."""
    params = list(params) + [p for g in optimizer.param_groups for p in g["params"]]
    state = [
        v
        for st in optimizer.state.values()
        for k, v in st.items()
        if torch.is_tensor(v) and k != "step"
    ]
    return dict(
        param_bytes=storage_bytes(params),
        grad_bytes=storage_bytes(p.grad for p in params),
        optim_bytes=storage_bytes(state),
    )


class SavedActivations:
    """What autograd keeps for backward during the first forward (until the first backward begins):
    the distinct storages of the saved tensors, parameters left out (also gathered or unsharded
    ones: a leaf that requires grad, or a view of one). A checkpointed block keeps only its input."""

    def __init__(self):
        self.kept, self.counting, self.part, self.parts = {}, True, None, {}

    def pack(self, t):
        if self.counting:
            base = t._base if t._base is not None else t
            if not (base.is_leaf and base.requires_grad):
                s = _local(t).untyped_storage()
                self.kept[s.data_ptr() if s.nbytes() else id(s)] = s.nbytes()
                if (
                    self.part is not None
                ):  # saved while inside one of the modules of Meter's `parts`
                    self.parts.setdefault(self.part, {})[s.data_ptr() if s.nbytes() else id(s)] = (
                        s.nbytes()
                    )
        return t

    def unpack(self, t):
        self.counting = False
        return t

    def bytes(self, params, part=None):
        own = {_local(p).untyped_storage().data_ptr() for p in params}
        return sum(
            n
            for ptr, n in (self.kept if part is None else self.parts.get(part, {})).items()
            if ptr not in own
        )


class Meter:
    """The instrument, attached from outside: `with Meter(model, optimizer, args): train(...)`.

    It counts the collectives of the first `steps` steps of the loop (forward, backward and step;
    a step is a batch drawn through `progress`, whether or not the optimizer stepped, e.g. when
    fp16's GradScaler skips one). After the window the dispatch mode is gone, but the hooks the
    Meter left (a step counter) still run. Throughput is timed from one warm-up step after the
    window to the end of training, so the observed steps do not slow it down.
    reads per-rank memory off the storages right after the first step (activations: what the first
    forward saved for backward; optimizer state also at its peak during that step), and with --profile records
    those steps with torch.profiler, one Chrome/Perfetto trace per rank. Deleting it from a
    script changes nothing the technique does. `parts={"attention": [modules]}` adds a row
    act_bytes_attention: what those modules' forwards saved for backward in the first forward."""

    active = None  # the Meter inside whose `with` block training runs: progress() reports to it

    def __init__(self, model, optimizer, args, steps=3, parts=None):
        self.params, self.optimizer, self.steps, self.profile_dir = (
            list(model.parameters()),
            optimizer,
            steps,
            args.profile,
        )
        self.counter, self.profiler, self.seen, self.mem, self.open = (
            CollectiveCounter(),
            None,
            0,
            {},
            False,
        )
        self.saved, self.packing, self.optim_peak = SavedActivations(), None, 0
        self.loop_steps = 0  # batches drawn through progress() so far
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.clock_start = None  # (time, loop steps done) when the throughput clock started
        self.first_step = None
        self.samples_per_step = args.batch_size
        self.elapsed = (0.0, 0)  # (seconds, loop steps) timed
        self.counter.sample = self._sample_optimizer_state
        self.hook = optimizer.register_step_post_hook(lambda *_: self._after_step())
        self.parts, self.part_hooks = parts or {}, []
        for name, modules in self.parts.items():
            for m in modules:
                self.part_hooks += [
                    m.register_forward_pre_hook(lambda *_, n=name: setattr(self.saved, "part", n)),
                    m.register_forward_hook(lambda *_: setattr(self.saved, "part", None)),
                ]

    def _sample_optimizer_state(self):
        """The optimizer state's bytes after every op until the first step ends: its peak, also where a technique
        brings the state in and out during the step (zero.py --offload disk, one unit at a time)."""
        state = [
            v
            for st in self.optimizer.state.values()
            for k, v in st.items()
            if torch.is_tensor(v) and k != "step"
        ]
        self.optim_peak = max(self.optim_peak, storage_bytes(state))

    def __enter__(self):
        Meter.active = self
        self.counter.__enter__()
        self.packing = torch.autograd.graph.saved_tensors_hooks(self.saved.pack, self.saved.unpack)
        self.packing.__enter__()
        self.open = True
        if self.profile_dir:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + (
                [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            )
            self.profiler = profile(activities=acts, record_shapes=True)
            self.profiler.__enter__()
        return self

    def _now(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # twice a run: at the clock's start and its end
        return time.perf_counter()

    def loop_step_starts(self):
        """Called by progress() as each batch is drawn: closes the window after `steps` steps and
        starts the throughput clock one warm-up step later."""
        if self.loop_steps == 0:
            self.first_step = self._now()
        if self.loop_steps == self.steps:
            self._close()
        if self.loop_steps == self.steps + 1:
            self.clock_start = (self._now(), self.loop_steps)
        self.loop_steps += 1

    def samples_per_s(self):
        """Global samples per second of the steps after the window (of all steps in a run too
        short to have any after it)."""
        seconds, steps = self.elapsed
        return steps * self.samples_per_step / seconds if seconds > 0 else 0.0

    def _after_step(self):
        self.seen += 1
        if self.seen == 1:
            self.mem, self.counter.sample = memory(self.params, self.optimizer), None
            self.mem["optim_peak_bytes"] = max(self.optim_peak, self.mem["optim_bytes"])
            self._stop_packing()
            self.mem["act_bytes"] = self.saved.bytes(self.params)
            for name in self.parts:
                self.mem[f"act_bytes_{name}"] = self.saved.bytes(self.params, name)

    def _stop_packing(self):
        for h in self.part_hooks:
            h.remove()
        self.part_hooks = []
        if self.packing is not None:
            self.packing.__exit__(None, None, None)
            self.packing = None

    def _close(self):
        self._stop_packing()
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            os.makedirs(self.profile_dir, exist_ok=True)
            self.profiler.export_chrome_trace(
                os.path.join(self.profile_dir, f"rank{env_rank()}.json")
            )
            self.profiler = None
        if self.open:
            self.counter.__exit__(None, None, None)
            self.open = False

    def __exit__(self, *exc):
        self._close()
        self.hook.remove()
        Meter.active = None
        if self.loop_steps:
            end = self._now()
            start, steps_before = self.clock_start or (self.first_step, 0)
            self.elapsed = (end - start, self.loop_steps - steps_before)

    def comm(self):
        """({kind: bytes per optimizer step}, {kind: calls in the window}, optimizer steps in the window)."""
        n = max(min(self.loop_steps, self.steps), 1)
        return {k: v // n for k, v in self.counter.bytes.items()}, dict(self.counter.calls), n

    def comm_by_group(self):
        """{process group name: {kind: [calls in the window, bytes per optimizer step]}}."""
        n = max(min(self.loop_steps, self.steps), 1)
        return {
            g: {k: [c, b // n] for k, (c, b) in kinds.items()}
            for g, kinds in self.counter.groups.items()
        }


def record_pipeline_order(stage, m, weights=False):
    """A pipeline stage's first-step actions, (F | B | W, micro-batch, chunk), in the order they ran, seen
    from outside: a forward hook (the chunk is the forward's second argument, 0 without one), a gradient
    hook on each output (B) and, where W is a pass of its own (weights), on the stage's first parameter."""
    ran, count = [], lambda a, v: sum(r[0] == a and r[2] == v for r in ran)

    def hook(module, inputs, out):
        v = inputs[1] if len(inputs) > 1 else 0
        if out.requires_grad and count("F", v) < m:
            ran.append(("F", count("F", v), v))
            out.register_hook(
                lambda grad, b=("B", count("F", v) - 1, v): None if b in ran else ran.append(b)
            )

    stage.register_forward_hook(hook)
    if weights:  # W goes back through the output too: its B counts once
        next(stage.parameters()).register_hook(
            lambda grad: ran.extend([("W", count("W", 0), 0)][: count("W", 0) < m])
        )
    return ran
