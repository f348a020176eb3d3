"""The measuring instrument, attached from outside: collectives, memory, activations, timing."""

import contextlib
import os
import time

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

# TorchDispatchMode has no public home: CommDebugMode (torch.distributed.tensor.debug) is built on
# it but counts DTensor collectives only, not the c10d ops DDP and FSDP issue from C++.
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
        self.calls = {}  # {kind: calls}
        self.bytes = {}  # {kind: bytes}
        self.groups = {}  # {process group name: {kind: [calls, bytes]}}: traffic per mesh dimension
        self.paused = False  # inside untimed(): not the technique's training, not counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        if func.namespace in ("c10d", "_c10d_functional"):
            self.count(func.overloadpacket.__name__, args, out)
        return out

    def count(self, op_name, args, out):
        kind, where = COLLECTIVES.get(op_name, (None, None))
        if kind is None:
            return
        if where == -1:
            tensors = _tensors(out)
        elif where < len(args):
            tensors = _tensors(args[where])
        else:
            tensors = []
        if not tensors or all(t.dim() == 0 for t in tensors):
            return
        size = sum(_local(t).numel() * t.element_size() for t in tensors)
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + size
        per_group = self.groups.setdefault(_group_name(args), {}).setdefault(kind, [0, 0])
        per_group[0] += 1
        per_group[1] += size


def _group_name(args):
    """The process group a c10d op runs on: a functional collective names it (its last str
    argument), a c10d op passes the ProcessGroup as a script object."""
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


def storage_key(storage):
    """What tells one storage from another: its address, where it has one. A freed buffer (0
    bytes) and a meta tensor's storage (--simulate: address 0, bytes counted) have none; torch
    keeps one Python object per live storage, so its identity does."""
    if storage.nbytes() and storage.device.type != "meta":
        return storage.data_ptr()
    return id(storage)


def storage_bytes(tensors):
    """Bytes of the distinct storages behind `tensors`: a view adds nothing, a freed buffer is 0,
    a DTensor counts its local shard."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        s = _local(t).untyped_storage()
        seen[storage_key(s)] = (s, s.nbytes())  # the storage held: its identity stays its own
    return sum(size for _, size in seen.values())


def optimizer_state_bytes(optimizer):
    """Bytes of an optimizer's state tensors, the scalar step counters left out."""
    return storage_bytes(
        value
        for state in optimizer.state.values()
        for key, value in state.items()
        if torch.is_tensor(value) and key != "step"
    )


def memory(params, optimizer):
    """Per-rank bytes of parameters, gradients and optimizer state (the scalar step counters are
    left out, as the papers do), read off the storages that hold them right now."""
    params = list(params) + [p for g in optimizer.param_groups for p in g["params"]]
    return dict(
        param_bytes=storage_bytes(params),
        grad_bytes=storage_bytes(p.grad for p in params),
        optim_bytes=optimizer_state_bytes(optimizer),
    )


class SavedActivations:
    """What autograd keeps for backward during the first forward (until the first backward
    begins): the distinct storages of the saved tensors, parameters left out (also gathered or
    unsharded ones: a leaf that requires grad, or a view of one). A checkpointed block keeps only
    its input."""

    def __init__(self):
        self.kept = {}  # {storage key: bytes}
        self.counting = True  # until the first backward unpacks a tensor
        self.part = None  # the `parts` name whose module is running its forward, if any
        self.parts = {}  # {part name: {storage key: bytes}}

    def pack(self, t):
        if not self.counting:
            return t
        # A view's `_base` is the tensor it views: no public accessor tells a parameter's view
        # (which saves nothing new) from an activation.
        base = t._base if t._base is not None else t
        if base.is_leaf and base.requires_grad:
            return t
        storage = _local(t).untyped_storage()
        key = storage_key(storage)
        self.kept[key] = storage.nbytes()
        if self.part is not None:
            self.parts.setdefault(self.part, {})[key] = storage.nbytes()
        return t

    def unpack(self, t):
        self.counting = False
        return t

    def bytes(self, params, part=None):
        own = {storage_key(_local(p).untyped_storage()) for p in params}
        kept = self.kept if part is None else self.parts.get(part, {})
        return sum(size for key, size in kept.items() if key not in own)


class Meter:
    """The instrument, attached from outside: `with Meter(model, optimizer, args): train(...)`.

    It counts the collectives of the first `steps` steps of the loop (forward, backward and step;
    a step is a batch drawn through `progress`, whether or not the optimizer stepped, e.g. when
    fp16's GradScaler skips one). After the window the dispatch mode is gone, but the hooks the
    Meter left (a step counter) still run. Throughput is timed from one warm-up step after the
    window to the end of training, so the observed steps are not timed (the dispatch mode slows
    them; what runs after the window is the script's own code and the Meter's step hook).
    It reads per-rank memory off the storages right after the first step (activations: what the
    first forward saved for backward; optimizer state also at its peak during that step), and with
    --profile records those steps with torch.profiler, one Chrome/Perfetto trace per rank.
    Deleting it from a script changes nothing the technique does. `parts={"attention": [modules]}`
    adds a row act_bytes_attention: what those modules' forwards saved for backward in the first
    forward. `held={"working_bytes": f}`: the bytes of the tensors f() returns, the report's
    "working copy" row (the one key it prints; any other reaches the RESULT line only).

    `device` is the script's: the clock synchronizes its stream, the CUDA peak is its. Left out:
    the GPU torch.cuda.set_device chose under NCCL (also where the parameters live on the CPU, as
    under zero_offload.py --offload cpu), else the first parameter's device. On a GPU it resets
    the peak memory statistics on entering and reads max_memory_allocated on leaving: `cuda_peak`
    is training's own, not evaluation's or the final gathers'. What runs inside `untimed()` (a
    snapshot) is left out of the time, the CUDA peak and the window."""

    active = None  # the Meter inside whose `with` block training runs: progress() reports to it

    def __init__(
        self,
        model,
        optimizer,
        args,
        steps=3,
        parts=None,
        activations=True,
        device=None,
        held=None,
    ):
        self.params = list(model.parameters())
        # {row: a function returning tensors the technique holds besides the parameters, their
        # gradients and the optimizer state}, read after the first step (zero.py's bf16 copy)
        self.held = held or {}
        self.optimizer = optimizer
        self.steps = steps  # the window: loop steps observed
        self.profile_dir = args.profile
        self.counter = CollectiveCounter()
        self.profiler = None
        self.seen = 0  # optimizer steps taken so far
        self.mem = {}  # the memory rows, read after the first optimizer step
        self.open = False  # the dispatch mode is active
        self.saved = SavedActivations()
        self.packing = None  # the saved-tensor hooks, while they count
        # False where the forward runs in threads of its own (nn.DataParallel's replicas over
        # several GPUs): saved-tensor hooks are per thread and would see nothing there, so
        # act_bytes is None, which the report prints as "not measured".
        self.activations = activations
        self.optim_peak = 0
        self.loop_steps = 0  # batches drawn through progress() so far
        self.device = torch.device(device) if device is not None else self._device()
        self.clock_start = None  # (time, loop steps done) when the throughput clock started
        self.first_step = None
        self.samples_per_step = args.batch_size
        self.elapsed = (0.0, 0)  # (seconds, loop steps) timed
        self.pauses = []  # (start, end) of each untimed() stretch: not training, not timed
        self.cuda_peak = None  # max_memory_allocated in training, on a CUDA device
        # The optimizer state's peak in the first step: its bytes after that step, and after each
        # optimizer a technique steps inside it (zero_offload.py --offload disk steps one per
        # unit, holding its state only while it steps). Not after every op: at 72 layers reading
        # every state tensor after every op made a simulated step 23 times slower (156 s, 6.8 s).
        self.inner_hook = register_optimizer_step_post_hook(self._inner_step)
        self.hook = optimizer.register_step_post_hook(lambda *_: self._after_step())
        self.parts = parts or {}
        self.part_hooks = []
        for name, modules in self.parts.items():
            for module in modules:
                self.part_hooks.append(module.register_forward_pre_hook(self._entering(name)))
                self.part_hooks.append(module.register_forward_hook(self._leaving))

    def _device(self):
        """The script's device when it passes none: under NCCL the GPU torch.cuda.set_device
        bound, also where the parameters live on the CPU (zero_offload.py --offload cpu), else the
        first parameter's device."""
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return self.params[0].device if self.params else torch.device("cpu")

    def _entering(self, name):
        def hook(module, args):
            self.saved.part = name

        return hook

    def _leaving(self, module, args, output):
        self.saved.part = None

    def _inner_step(self, optimizer, args, kwargs):
        if optimizer is not self.optimizer and self.seen == 0:
            held = optimizer_state_bytes(self.optimizer) + optimizer_state_bytes(optimizer)
            self.optim_peak = max(self.optim_peak, held)

    def __enter__(self):
        Meter.active = self
        if self.device.type == "cuda":  # the peak of training alone: not model building
            torch.cuda.reset_peak_memory_stats(self.device)
            self.cuda_peak = 0
        self.counter.__enter__()
        if self.activations:
            self.packing = torch.autograd.graph.saved_tensors_hooks(
                self.saved.pack, self.saved.unpack
            )
            self.packing.__enter__()
        self.open = True
        if self.profile_dir:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self.profiler = profile(activities=activities, record_shapes=True)
            self.profiler.__enter__()
        return self

    def _now(self):
        if self.device.type == "cuda":
            # at the clock's start and its end, and around each untimed() stretch (a snapshot an
            # epoch): the GPU's queued work is counted where it was issued
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _read_cuda_peak(self):
        if self.cuda_peak is not None:
            self.cuda_peak = max(self.cuda_peak, torch.cuda.max_memory_allocated(self.device))

    @contextlib.contextmanager
    def paused(self):
        """Work inside the training loop that is not training (a snapshot: its gather, save and
        fsync): its time is left out of samples/s, its memory out of the CUDA peak (the peak so
        far is kept, the counter reset after it) and its collectives out of the window."""
        start = self._now()
        self._read_cuda_peak()
        self.counter.paused = True
        try:
            yield
        finally:
            self.counter.paused = False
            self.pauses.append((start, self._now()))
            if self.cuda_peak is not None:
                torch.cuda.reset_peak_memory_stats(self.device)

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
            self.mem = memory(self.params, self.optimizer)
            self.mem["optim_peak_bytes"] = max(self.optim_peak, self.mem["optim_bytes"])
            for row, tensors in self.held.items():
                self.mem[row] = storage_bytes(tensors())
            self._stop_packing()
            if self.activations:
                self.mem["act_bytes"] = self.saved.bytes(self.params)
                for name in self.parts:
                    self.mem[f"act_bytes_{name}"] = self.saved.bytes(self.params, name)
            else:
                self.mem["act_bytes"] = None  # not measured

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
        self.inner_hook.remove()
        Meter.active = None
        if self.loop_steps:
            end = self._now()
            start, steps_before = self.clock_start or (self.first_step, 0)
            untimed = sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.pauses)
            self.elapsed = (end - start - untimed, self.loop_steps - steps_before)
        self._read_cuda_peak()  # training's peak: evaluation and the final gathers come after

    def comm(self):
        """({kind: bytes per step}, {kind: calls in the window}, loop steps in the window)."""
        n = max(min(self.loop_steps, self.steps), 1)
        per_step = {kind: size // n for kind, size in self.counter.bytes.items()}
        return per_step, dict(self.counter.calls), n

    def comm_by_group(self):
        """{process group name: {kind: [calls in the window, bytes per optimizer step]}}."""
        n = max(min(self.loop_steps, self.steps), 1)
        return {
            g: {k: [c, b // n] for k, (c, b) in kinds.items()}
            for g, kinds in self.counter.groups.items()
        }


@contextlib.contextmanager
def untimed():
    """`with common.untimed(): save_snapshot(...)` inside the training loop: the active Meter, if
    any, leaves that stretch out of samples/s, the CUDA peak and its window (Meter.paused)."""
    if Meter.active is None:
        yield
        return
    with Meter.active.paused():
        yield


class PipelineRecorder:
    """What one pipeline stage ran, seen from outside through hooks: its actions (F | B | W,
    micro-batch, chunk) in the order they ran, for the first `micro_batches` micro-batches of each
    chunk, and, given the optimizer, how many optimizer steps the stage had taken at each forward
    and at each backward.

    F: a forward hook on the stage (the chunk is the forward's second argument, 0 without one). B: a
    hook on that forward's output, which the gradient passes through. W (`weights`: a schedule that
    takes the weights' gradients in a pass of their own, after B): a hook on the stage's first
    parameter. Without `weights`, a backward that reaches the parameters is one whole B."""

    def __init__(self, stage, micro_batches, optimizer=None, weights=False):
        self.micro_batches = micro_batches
        self.order = []  # (action, micro-batch, chunk), as they ran
        self.forward_versions = {}  # micro-batch -> optimizer steps taken when its forward ran
        self.backward_versions = {}  # micro-batch -> optimizer steps taken when its backward began
        self.optimizer_steps = 0
        # A hook does not see the micro-batch's number: every schedule runs a chunk's forwards
        # (and ZB-H1 its Ws) in micro-batch order, so the n-th one is micro-batch n.
        self.forwards = {}  # chunk -> forwards recorded on it
        self.weight_passes = 0  # Ws recorded
        self.records_versions = optimizer is not None
        stage.register_forward_hook(self._forward_ran)
        if weights:
            next(stage.parameters()).register_hook(self._weight_pass_ran)
        if optimizer is not None:
            optimizer.register_step_post_hook(self._optimizer_stepped)

    def _optimizer_stepped(self, optimizer, args, kwargs):
        self.optimizer_steps += 1

    def _forward_ran(self, module, inputs, output):
        if not output.requires_grad:  # evaluation: no backward follows
            return
        chunk = inputs[1] if len(inputs) > 1 else 0
        micro_batch = self.forwards.get(chunk, 0)
        if micro_batch >= self.micro_batches:
            return
        self.forwards[chunk] = micro_batch + 1
        self.order.append(("F", micro_batch, chunk))
        self.forward_versions[micro_batch] = self.optimizer_steps
        output.register_hook(self._backward_hook(micro_batch, chunk))

    def _backward_hook(self, micro_batch, chunk):
        """A hook for this forward's output. ZB's W goes back through the output a second time: the
        backward counts once, at its first pass. (On ZB-H1's first stage, whose B has no input
        gradient to take and runs nothing, that first pass is its W, which runs right after it.)"""
        backward = ("B", micro_batch, chunk)

        def backward_ran(grad):
            if backward not in self.order:
                self.order.append(backward)
                self.backward_versions[micro_batch] = self.optimizer_steps

        return backward_ran

    def _weight_pass_ran(self, grad):
        if self.weight_passes < self.micro_batches:
            self.order.append(("W", self.weight_passes, 0))
            self.weight_passes += 1

    def recorded(self):
        """What this stage recorded, for rank 0 to gather."""
        if not self.records_versions:
            return dict(order=self.order)
        versions = dict(
            forward=[self.forward_versions[j] for j in sorted(self.forward_versions)],
            backward=[self.backward_versions[j] for j in sorted(self.backward_versions)],
        )
        return dict(order=self.order, versions=versions)


def record_pipeline_order(stage, micro_batches, optimizer=None, weights=False):
    """Attach a PipelineRecorder to `stage` (before training, like the Meter); hand it to
    common.pipeline_timeline after training."""
    return PipelineRecorder(stage, micro_batches, optimizer, weights)


def record_expert_load(model):
    """Tokens this rank routes to each expert in training forwards, per block, summed on its
    device: a forward pre-hook on each block's experts module reads the rows per expert it is
    called with (rows, counts [E]), ahead of expert_parallel.py's hook that routes them."""
    load = [None] * len(model.blocks)

    def counter(block_index):
        def add(module, inputs):
            if not module.training:
                return
            counts = inputs[1].detach().clone()
            if load[block_index] is None:
                load[block_index] = counts
            else:
                load[block_index] += counts

        return add

    for block_index, block in enumerate(model.blocks):
        block.mlp.experts.register_forward_pre_hook(counter(block_index), prepend=True)
    return load
