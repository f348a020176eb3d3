"""zero_offload.py: ZeRO-Offload (--offload cpu) and ZeRO-Infinity (--offload disk) end with the
parameters of one ddp.py process, hold their bytes where the docstring says, and a rank killed
while writing its state files leaves every file whole.

The model and data of tests/test_zero.py (so the same ddp.py references): W=2 pads the embed unit.
On a machine without a GPU --offload cpu runs the same path with unpinned CPU buffers.
"""

import contextlib
import json
import sys
from types import SimpleNamespace

import nanogpt_model
import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import common
import zero_offload
from common import simulate
from common.meter import CollectiveCounter, memory
from helpers import ROOT, SMALL, launch_cases, max_diff, tiered, torchrun

# test_zero.py's configuration: the same ddp.py references serve both files
CFG = [
    *SMALL,
    *("--limit 1025 --batch-size 24 --dim 33 --heads 3 --patch 14").split(),
]  # later flags win
# round-off; AdamW turns it into steps on ~0 gradients
TOL = {"sgd": 1e-6, "adamw": 5e-5}
STEPS = 3  # optimizer steps in the Meter's window (6 steps are run)
WORLD = 2
CPU = torch.device("cpu")
CPU_CASES = [(1, "adamw"), (2, "sgd"), (3, "adamw")]
# Disk: every stage with each optimizer in the full tier; the quick suite takes the pairs CPU_CASES
# leaves out, so that the two together cover every (stage, optimizer) once.
DISK_GRID = [(stage, optim) for stage in (1, 2, 3) for optim in ("sgd", "adamw")]
DISK_CASES = tiered(DISK_GRID, [(1, "sgd"), (2, "adamw"), (3, "sgd")])


def build():
    """The common model for CFG."""
    return common.build_model(common.parse_args(common.get_parser("test"), CFG))


def padded(sizes, world):
    """Ψ': every unit padded to a multiple of W."""
    return sum(-(-n // world) * world for n in sizes)


@pytest.fixture(scope="module")
def sizes():
    """Each unit's parameter count, from the common model (not read from zero_offload.py)."""
    model = build()
    units = [model.embed, *model.blocks, model.head]
    return [sum(p.numel() for p in unit.parameters()) for unit in units]


# the tests that read a launched run, and the offload of the run each reads
OFFLOAD_READ_BY = {
    "test_offload_cpu_equals_one_ddp_process": "cpu",
    "test_offload_to_disk_equals_one_ddp_process": "disk",
    "test_disk_holds_the_state_and_memory_one_unit_of_it": "disk",
}


def selected(request, names):
    """(test name, its parameters) of this session's selected tests of this module named in
    `names`: every one in a whole run, one when a single test is asked for (as
    tests/test_mutants.py does)."""
    return [
        (item.originalname, item.callspec.params)
        for item in request.session.items
        if item.module is request.module and item.originalname in names
    ]


def needed(request):
    """The (stage, optim, offload) runs this session's selected tests of this module read."""
    cases = set()
    for name, params in selected(request, OFFLOAD_READ_BY):
        cases.add((params["stage"], params["optim"], OFFLOAD_READ_BY[name]))
    every = [(stage, optim, "cpu") for stage, optim in CPU_CASES]
    every += [(stage, optim, "disk") for stage, optim in DISK_GRID]
    return [case for case in every if case in cases]


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """{(stage, optim, offload): (RESULT, saved path, offload dir)}: zero_offload.py at W=2 on CFG,
    the needed runs as the cases of ONE launch (tests/script_cases.py), each run shared by the
    tests that read it."""
    cases = needed(request)
    directories = {}
    argv = []
    for stage, optim, offload in cases:
        directory = tmp_path_factory.mktemp(f"offload-{offload}-{stage}-{optim}")
        flags = ["--stage", stage, "--optim", optim, "--save", directory / "out.pt"]
        flags += ["--offload", offload]
        if offload == "disk":
            flags += ["--offload-dir", directory]
        argv.append(["zero_offload", [*CFG, *flags]])
        directories[stage, optim, offload] = directory
    results = launch_cases(WORLD, argv, timeout=max(300, 120 * len(argv)))
    return {
        case: (result, directories[case] / "out.pt", directories[case])
        for case, (result, _) in zip(cases, results, strict=True)
    }


@pytest.mark.parametrize("stage,optim", CPU_CASES)
def test_offload_cpu_equals_one_ddp_process(stage, optim, refs, sizes, launched):
    """ZeRO-Offload: the parameters of ddp.py at W=1; the optimizer's parameters are the CPU master
    shards, so the Meter reads 4Ψ'/W of them, 4Ψ'/W of gradients and kΨ'/W of state at every
    stage, and the collectives are the stage's."""
    res, path, _ = launched[stage, optim, "cpu"]
    diff = max_diff(path, refs[optim])
    print(f"stage {stage} --offload cpu W={WORLD} {optim}: max |Δ| vs ddp.py W=1 = {diff:.2e}")
    assert res["offload"] == "cpu" and res["steps"] == 6 and diff <= TOL[optim]
    pad = padded(sizes, WORLD)
    k = 8 if optim == "adamw" else 4
    memory = (res["param_bytes"], res["grad_bytes"], res["optim_bytes"])
    assert memory == (4 * pad // WORLD, 4 * pad // WORLD, k * pad // WORLD)
    assert res["comm"] == {"reduce_scatter": 4 * pad, "all_gather": (8 if stage == 3 else 4) * pad}


@pytest.mark.filterwarnings("ignore:.*is deprecated")
def test_offload_cpu_buffers_are_allocated_once():
    """White-box, in this process at W=1: the master shard and its gradient are CPU buffers made
    once; every step copies into them (the optimizer's parameters are the master's pieces, one
    per unit with one group, and their .grad the same buffer each step)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = build()
        units = [model.embed, *model.blocks, model.head]
        model = zero_offload.parallelize(model, torch.device("cpu"), 3, offload="cpu", units=units)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        zero_offload.hook_optimizer(model, optimizer)
        units = model.zero.units
        assert all(len(unit.pieces) == 1 for unit in units)
        pieces = [piece for unit in units for _, _, piece in unit.pieces]
        assert list(model.parameters()) == pieces
        assert [piece.data_ptr() for piece in pieces] == [unit.master.data_ptr() for unit in units]
        buffers = [(u.master.data_ptr(), u.master_grad.data_ptr()) for u in units]
        for _ in range(2):
            model(torch.randn(4, 1, 28, 28)).logsumexp(1).mean().backward()
            optimizer.step()
            grads = [piece.grad.data_ptr() for piece in pieces]
            assert grads == [unit.master_grad.data_ptr() for unit in units]
            assert all(torch.equal(unit.master, unit.shard) for unit in units)
            optimizer.zero_grad(set_to_none=True)
        assert [(u.master.data_ptr(), u.master_grad.data_ptr()) for u in units] == buffers
    finally:
        dist.destroy_process_group()


class FakeCuda:
    """torch.cuda's streams and events as CopyStream and the engine use them, recording every call
    in `log`; the copies themselves run on CPU tensors, done when copy_ returns."""

    def __init__(self):
        self.log = []
        self.events = 0
        self.current = FakeStream("compute", self.log)

    def Stream(self, device):
        return FakeStream("copy", self.log)

    def current_stream(self):
        return self.current

    @contextlib.contextmanager
    def stream(self, stream):
        compute = self.current
        self.current = stream
        try:
            yield
        finally:
            self.current = compute

    def Event(self):
        self.events += 1
        return FakeEvent(self.events, self.log)


class FakeStream:
    def __init__(self, name, log):
        self.name = name
        self.log = log

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, event.number))


class FakeEvent:
    def __init__(self, number, log):
        self.number = number
        self.log = log

    def record(self, stream):
        self.log.append(("record", self.number, stream.name))

    def synchronize(self):
        self.log.append(("synchronize", self.number))


class LogOffloadTraffic(TorchDispatchMode):
    """Every copy into (and addition to) a unit's master_grad or shard, with the stream current
    and the source's dtype, and every write of a gradient into a unit's flat gradient ("fill")."""

    def __init__(self, log, current_stream, targets, units):
        super().__init__()
        self.log = log
        self.current_stream = current_stream
        self.targets = targets  # data_ptr -> ("grad" or "shard", unit index)
        self.units = units

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kinds = {torch.ops.aten.copy_.default: "copy", torch.ops.aten.add_.Tensor: "add"}
        target = self.targets.get(args[0].data_ptr()) if func in kinds else None
        if target is not None:
            self.log.append((kinds[func], target, self.current_stream().name, args[1].dtype))
        elif func is torch.ops.aten.copy_.default:
            storage = args[0].untyped_storage().data_ptr()
            for index, unit in enumerate(self.units):
                if unit.flat_grad is not None and unit.flat_grad.data_ptr() == storage:
                    self.log.append(("fill", ("grad", index)))
        return func(*args, **(kwargs or {}))


def train_offloaded(stage, mixed_precision, fake, monkeypatch):
    """W=1 in this process: --offload cpu, 2 steps of 2 backward passes, then a forward; with
    torch.cuda's streams and events replaced by `fake`'s, or the CPU path when fake is None.
    Returns (the log, full_state_dict)."""
    log = fake.log if fake else []
    current = fake.current_stream if fake else lambda: FakeStream("compute", log)
    torch.manual_seed(0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = build()
        units = [model.embed, *model.blocks, model.head]
        model = zero_offload.parallelize(
            model, CPU, stage, offload="cpu", units=units, mixed_precision=mixed_precision
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        zero_offload.hook_optimizer(model, optimizer)
        optimizer.register_step_pre_hook(lambda *args: log.append(("step",)))
        engine = model.zero
        targets = {u.master_grad.data_ptr(): ("grad", i) for i, u in enumerate(engine.units)}
        targets.update({u.shard.data_ptr(): ("shard", i) for i, u in enumerate(engine.units)})
        gather = dist.all_gather_into_tensor

        def logged_gather(output, shard, **kwargs):
            log.append(("all_gather", targets[shard.data_ptr()], current().name))
            return gather(output, shard, **kwargs)

        with monkeypatch.context() as patch:
            if fake:
                for name in ("Stream", "Event", "current_stream", "stream"):
                    patch.setattr(torch.cuda, name, getattr(fake, name))
                engine.copies = zero_offload.CopyStream(torch.device("cuda"))
            patch.setattr(dist, "all_gather_into_tensor", logged_gather)
            with LogOffloadTraffic(log, current, targets, engine.units):
                for _ in range(2):
                    for _ in range(2):
                        model(torch.randn(4, 1, 28, 28)).logsumexp(1).mean().backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                with torch.no_grad():
                    model(torch.randn(4, 1, 28, 28))
            return log, zero_offload.full_state_dict(model)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("stage,mixed_precision", [(1, False), (3, False), (3, True)])
def test_offload_cpu_copies_run_on_a_side_stream(stage, mixed_precision, monkeypatch):
    """Issue 33 item 3, by construction (no GPU here): with torch.cuda's streams and events faked,
    every copy of a gradient shard to the CPU and of a stepped master to the device runs on the
    copy stream, right after that stream waited for the compute stream, and records an event; the
    host waits for each such event before the step (which reads master_grad and writes master)
    and before adding a later backward's gradient to master_grad; the compute stream waits for a
    master's event before the all-gather that reads its shard, and at stage 1 for a gradient's
    before the next backward fills the flat gradient it was copied from. Under mixed precision
    the bf16 shard takes each stepped master once, by the copy stream, from a copy rounded on the
    host. The parameters are those of the same run on the CPU path."""
    log, state = train_offloaded(stage, mixed_precision, FakeCuda(), monkeypatch)
    _, expected = train_offloaded(stage, mixed_precision, None, monkeypatch)
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[key], expected[key]) for key in state)
    copied = {}  # event number -> (what was copied into, its place in the log)
    for at, entry in enumerate(log):
        if entry[0] == "copy":
            assert entry[2] == "copy", (at, entry)  # never on the compute stream
            assert at > 0 and log[at - 1] == ("wait_stream", "copy", "compute"), (at, log[at - 1])
            assert log[at + 1][0] == "record" and log[at + 1][2] == "copy", (at, log[at + 1])
            copied[log[at + 1][1]] = (entry[1], at)
    units = len(build().blocks) + 2
    kinds = [target[0] for target, _ in copied.values()]
    assert kinds.count("grad") == kinds.count("shard") == 2 * units  # 2 steps
    # under mixed precision the master crosses rounded (2 bytes an element), the gradient in fp32
    crossing = {log[at][1][0]: log[at][3] for _, at in copied.values()}
    master_dtype = torch.bfloat16 if mixed_precision else torch.float32
    assert crossing == {"grad": torch.float32, "shard": master_dtype}
    adds = [at for at, entry in enumerate(log) if entry[0] == "add"]
    assert len(adds) == 2 * units  # the second backward of each step adds on the host
    for number, (target, at) in copied.items():
        later = log[at + 2 :]
        steps = [i for i, entry in enumerate(later) if entry == ("step",)]
        synchronized = (
            later.index(("synchronize", number)) if ("synchronize", number) in later else None
        )
        if steps:  # the step after the copy reads or writes its CPU buffer
            assert synchronized is not None and synchronized < steps[0], (target, number)
        uses = [
            i
            for i, entry in enumerate(later)
            if entry[0] in ("add", "all_gather") and entry[1] == target
        ]
        if target[0] == "grad" and uses:  # the host adds to master_grad
            assert synchronized is not None and synchronized < uses[0], (target, number)
        fills = [i for i, entry in enumerate(later) if entry == ("fill", target)]
        if stage == 1 and target[0] == "grad" and fills:
            # stage 1 keeps the flat gradient whose own slice the copy reads: the next backward
            # of the step fills it only after the compute stream waited for the copy
            waited = later.index(("wait_event", "compute", number))
            assert waited < fills[0], (target, number)
        if target[0] == "shard":  # the all-gathers read the shard
            assert uses, target
            waited = later.index(("wait_event", "compute", number))
            assert waited < uses[0], (target, number)


@pytest.mark.parametrize("stage,optim", DISK_CASES)
def test_offload_to_disk_equals_one_ddp_process(stage, optim, refs, sizes, launched):
    """ZeRO-Infinity: the parameters of ddp.py at W=1 (with the schedule's learning rate of each
    step, not the one saved in the file), and the stage's collectives."""
    res, path, _ = launched[stage, optim, "disk"]
    diff = max_diff(path, refs[optim])
    print(f"stage {stage} --offload disk W={WORLD} {optim}: max |Δ| vs ddp.py W=1 = {diff:.2e}")
    assert res["offload"] == "disk" and res["steps"] == 6 and diff <= TOL[optim]
    pad = padded(sizes, WORLD)
    assert res["comm"] == {"reduce_scatter": 4 * pad, "all_gather": (8 if stage == 3 else 4) * pad}
    assert res["comm_calls"]["reduce_scatter"] == STEPS * len(sizes)


@pytest.mark.parametrize("stage,optim", DISK_CASES)
def test_disk_holds_the_state_and_memory_one_unit_of_it(stage, optim, sizes, launched):
    """The optimizer holds one unit's state at a time: its peak during the first step is the largest
    unit's k·S and nothing stays between steps, while each rank's files hold its master shards
    (4Ψ'/W) and their state (kΨ'/W), stepped 6 times."""
    res, path, directory = launched[stage, optim, "disk"]
    k = 8 if optim == "adamw" else 4
    shards = [-(-n // WORLD) for n in sizes]
    assert len(set(shards)) > 1, "the units must differ in size"
    assert (res["optim_bytes"], res["optim_peak_bytes"]) == (0, k * max(shards))
    assert res["formula"]["optim_peak_bytes"] == k * max(shards)
    for rank in range(WORLD):
        files = [
            torch.load(directory / f"zero-rank{rank}-unit{i}.pt", weights_only=True)
            for i in range(len(sizes))
        ]
        assert [file["master"].numel() for file in files] == shards
        states = [file["optimizer"]["state"][0] for file in files]
        tensors = [value for state in states for key, value in state.items() if key != "step"]
        state_bytes = sum(t.numel() * t.element_size() for t in tensors)
        assert state_bytes == k * sum(shards) == k * padded(sizes, WORLD) // WORLD
        assert optim == "sgd" or all(state["step"].item() == 6 for state in states)
    # rank 1's master shard of the embed unit is the saved model's second slice of it
    saved = torch.load(path, weights_only=True)
    flat = torch.cat(
        [saved[key].flatten() for key in saved]
    )  # the units' order is the state_dict's
    first = files[0]["master"]
    assert torch.equal(first[: sizes[0] - shards[0]], flat[shards[0] : sizes[0]])


def test_killed_mid_write_leaves_every_state_file_whole(tmp_path):
    """Rank 1 dies half-way through writing unit 1's file in step 3 (tests/faults: its torch.save
    number U + 2U + 2, U units, the first U the initial files): that file is still step 2's and
    whole, unit 0's is step 3's, and every file of both ranks loads (written to a temporary file,
    fsynced, renamed over the old one)."""
    units = len(build().blocks) + 2
    env = {
        "PYTHONPATH": str(ROOT / "tests" / "faults"),
        "FAULT": "exit-in-save",
        "FAULT_RANK": "1",
        "FAULT_STEP": str(3 * units + 2),
    }
    flags = ["--stage", "2", "--optim", "adamw", "--offload", "disk", "--offload-dir", tmp_path]
    r = torchrun("zero_offload.py", WORLD, *CFG, *flags, env=env, timeout=240)
    assert r.returncode != 0 and "RESULT" not in r.stdout, r.output
    assert (tmp_path / "zero-rank1-unit1.pt.tmp").exists()  # the half-written file, never renamed
    for rank, expected in ((0, None), (1, [3, 2, 2, 2])):
        steps = []
        for i in range(units):
            file = torch.load(tmp_path / f"zero-rank{rank}-unit{i}.pt", weights_only=True)
            steps.append(file["optimizer"]["state"][0]["step"].item())
        assert steps == expected if expected else set(steps) <= {2.0, 3.0}, (rank, steps)


# --mixed-precision offloaded, against zero.py --mixed-precision: every stage with each offload in
# the full tier; the quick suite takes each offload at stage 3 and one more stage each.
MIXED_GRID = [(stage, offload) for stage in (1, 2, 3) for offload in ("cpu", "disk")]
MIXED_CASES = tiered(MIXED_GRID, [(2, "cpu"), (3, "cpu"), (1, "disk"), (3, "disk")])


@pytest.fixture(scope="module")
def mixed_launched(request, tmp_path_factory):
    """{(script, stage, offload): (RESULT, its directory)}: zero_offload.py --mixed-precision for
    the selected cases, and zero.py --mixed-precision (offload "none") at their stages, at W=2
    with SGD on CFG, in ONE launch; each run saves to out.pt in its directory, --offload disk
    keeps its unit files there."""
    chosen = selected(request, ["test_offload_mixed_precision_equals_zero_mixed_precision"])
    wanted = {(params["stage"], params["offload"]) for _, params in chosen}
    cases = [case for case in MIXED_GRID if case in wanted]
    stages = sorted({stage for stage, _ in cases})
    runs = [("zero", stage, "none") for stage in stages]
    runs += [("zero_offload", stage, offload) for stage, offload in cases]
    directories = [
        tmp_path_factory.mktemp(f"{script}-{stage}-{offload}") for script, stage, offload in runs
    ]
    argv = []
    for (script, stage, offload), directory in zip(runs, directories, strict=True):
        flags = [*CFG, "--optim", "sgd", "--mixed-precision", "--stage", stage]
        flags += ["--save", directory / "out.pt"]
        if script == "zero_offload":
            flags += ["--offload", offload, "--offload-dir", directory]
        argv.append([script, flags])
    results = launch_cases(WORLD, argv, timeout=max(300, 120 * len(argv)))
    return {
        run: (result, directory)
        for run, directory, (result, _) in zip(runs, directories, results, strict=True)
    }


@pytest.mark.parametrize("stage,offload", MIXED_CASES)
def test_offload_mixed_precision_equals_zero_mixed_precision(stage, offload, sizes, mixed_launched):
    """--offload cpu or disk --mixed-precision (the seeds' ZeRO-Offload and ZeRO-Infinity: the
    fp32 master and the optimizer state on the CPU or in the files, bf16 on the device) ends where
    zero.py --mixed-precision ends, at W=2 with SGD. The all-gathers move bf16 (2Ψ' a gather of
    every unit), the reduce-scatters fp32. --offload cpu: the master and its gradient are the
    CPU's 4Ψ'/W each, the bf16 working copy the device's (whole at stages 1-2, its shard at stage
    3). --offload disk: the optimizer's parameters are the bf16 copy itself, nothing fp32 stays
    on the device, and the files hold the fp32 masters."""
    pad = padded(sizes, WORLD)
    res, directory = mixed_launched["zero_offload", stage, offload]
    _, reference = mixed_launched["zero", stage, "none"]
    diff = max_diff(directory / "out.pt", reference / "out.pt")
    print(f"--offload {offload} --mixed-precision stage {stage}: vs zero.py {diff:.2e}")
    assert res["offload"] == offload and res["steps"] == 6 and diff <= 1e-5
    assert res["comm"]["all_gather"] == (4 if stage == 3 else 2) * pad
    assert res["comm"]["reduce_scatter"] == 4 * pad
    assert res["comm"] == res["formula"]["comm"]
    copy_bytes = 2 * pad // (WORLD if stage == 3 else 1)  # bf16: whole at 1-2, the shard at 3
    if offload == "cpu":
        assert res["param_bytes"] == res["grad_bytes"] == 4 * pad // WORLD
        assert res["working_bytes"] == res["formula"]["working_bytes"] == copy_bytes
    else:
        assert "working_bytes" not in res
        assert res["param_bytes"] == res["formula"]["param_bytes"] == copy_bytes
        shards = [-(-n // WORLD) for n in sizes]
        assert (res["optim_bytes"], res["optim_peak_bytes"]) == (0, 4 * max(shards))  # momentum
        for rank in range(WORLD):
            for index, shard in enumerate(shards):
                file = torch.load(directory / f"zero-rank{rank}-unit{index}.pt", weights_only=True)
                assert file["master"].dtype == torch.float32 and file["master"].numel() == shard


# Issue 44 on the offload: zero.py's stage 1 reduce-scatters once a step under gradient
# accumulation, its formula counts the dtype, the tied weight's extra gather and the backward
# passes, and --simulate runs it on meta; the offload's own work (the CPU copies, the unit files)
# must take each of them.


def nanogpt_units(model):
    """nanoGPT's modules in forward order; lm_head holds only wte's tied weight."""
    transformer = model.transformer
    return [transformer.wte, transformer.wpe, *transformer.h, transformer.ln_f, model.lm_head]


@pytest.mark.filterwarnings("ignore:.*is deprecated")
@pytest.mark.parametrize("offload", ["cpu", "disk"])
@pytest.mark.parametrize("told", [1, 2, 4])
def test_stage1_accumulation_offloaded_equals_plain_torch(offload, told, world_of_one, tmp_path):
    """W=1, stage 1, three backward passes a step, the engine told 1, 2 or 4 a step: it
    reduce-scatters each unit 3, 2 (the sum of two at the second, the third's at the step) or 1
    times a step (all three summed at the step), and the offload steps what it reduced: the
    parameters are torch's own .grad sum and SGD's, step after step."""
    micro_batches = [pair for step in nanogpt_model.batches(2) for pair in step][:3]
    plain = nanogpt_model.model()
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    model = nanogpt_model.model()
    model = zero_offload.parallelize(
        model,
        CPU,
        1,
        units=nanogpt_units(model),
        offload=offload,
        directory=tmp_path,
        gradient_accumulation_steps=told,
    )
    optimizer = torch.optim.SGD(model.zero.param_groups, lr=0.1, momentum=0.9)
    zero_offload.hook_optimizer(model, optimizer)
    for _ in range(2):
        plain_optimizer.zero_grad(set_to_none=True)
        for x, y in micro_batches:
            plain(x, y)[1].backward()
        plain_optimizer.step()
        with CollectiveCounter() as counter:
            for x, y in micro_batches:
                model(x, y)[1].backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        units = len(model.zero.units)
        assert counter.calls["reduce_scatter"] == {1: 3, 2: 2, 4: 1}[told] * units
    state = zero_offload.full_state_dict(model)
    expected = plain.state_dict()
    assert state.keys() == expected.keys()
    for key, tensor in expected.items():
        torch.testing.assert_close(state[key], tensor, rtol=0, atol=1e-6, msg=key)


@pytest.mark.filterwarnings("ignore:.*is deprecated")
def test_disk_mixed_precision_saves_the_fp32_masters(world_of_one, tmp_path):
    """--offload disk --mixed-precision at W=1, stage 3, on nanoGPT: full_state_dict before
    hook_optimizer (the fp32 masters still on the device, no file written) is the model's own
    state, and after a step (the masters in the files alone) it is the files' fp32 masters, whose
    bf16 copy is what the device keeps."""
    original = nanogpt_model.model().state_dict()
    model = nanogpt_model.model()
    model = zero_offload.parallelize(
        model,
        CPU,
        3,
        units=nanogpt_units(model),
        offload="disk",
        directory=tmp_path,
        mixed_precision=True,
    )
    before = zero_offload.full_state_dict(model)
    assert before.keys() == original.keys()
    assert all(torch.equal(before[key], original[key]) for key in original)
    optimizer = torch.optim.SGD(model.zero.param_groups, lr=0.1)
    zero_offload.hook_optimizer(model, optimizer)
    x, y = nanogpt_model.batches(1)[0][0]
    model(x, y)[1].backward()
    optimizer.step()
    after = zero_offload.full_state_dict(model)
    engine = model.zero
    first = engine.units[0]  # wte's unit, its weight first in the file's master
    master = torch.load(first.path, weights_only=True)["master"]
    wte = after["transformer.wte.weight"].flatten()
    assert wte.dtype == torch.float32 and torch.equal(wte, master[: wte.numel()])
    assert not torch.equal(wte, wte.bfloat16().float())  # not a bf16 value widened
    assert torch.equal(first.shard[: wte.numel()], master[: wte.numel()].bfloat16())
    assert all(unit.master is None for unit in engine.on_disk())  # read back, dropped again


@pytest.mark.parametrize(
    "stage, offload, dtype, mixed_precision",
    [
        (1, "cpu", torch.float32, False),
        (3, "cpu", torch.bfloat16, False),
        (3, "cpu", torch.float32, True),
        (3, "disk", torch.float32, False),
        (2, "disk", torch.float32, True),
    ],
    ids=["1-cpu", "3-cpu-bf16", "3-cpu-mixed", "3-disk", "2-disk-mixed"],
)
def test_formula_on_a_tied_model_offloaded(stage, offload, dtype, mixed_precision, tmp_path):
    """nanoGPT (wte tied to lm_head) on torch's fake group at W=4, two backward passes a step,
    told so: the bytes held and moved are formula()'s with the offload, in the parameters' dtype,
    the tied unit's gather counted at stage 3, stage 1 reducing once a step."""
    world, backwards = 4, nanogpt_model.ACCUMULATE
    simulate.init_fake_process_group(0, world)
    try:
        model = nanogpt_model.model().to(dtype)
        optimizer = nanogpt_model.make_optimizer(model, "adamw")
        model = zero_offload.parallelize(
            model,
            CPU,
            stage,
            param_groups=optimizer.param_groups,
            units=nanogpt_units(model),
            offload=offload,
            directory=tmp_path,
            gradient_accumulation_steps=backwards,
            mixed_precision=mixed_precision,
        )
        optimizer = type(optimizer)(model.zero.param_groups)
        zero_offload.hook_optimizer(model, optimizer)
        with CollectiveCounter() as counter:
            for x, y in nanogpt_model.batches(1)[0][:backwards]:
                model(x, y)[1].backward()
            optimizer.step()
        held = memory(model.parameters(), optimizer)
        engine = model.zero
        padded = world * sum(unit.shard_numel for unit in engine.units)
        largest = max(unit.shard_numel for unit in engine.units)
        tied = zero_offload.tied_numel(engine)
        assert tied == engine.units[0].flat.numel() > 0  # lm_head borrows wte's unit
        args = SimpleNamespace(
            stage=stage, optim="adamw", mixed_precision=mixed_precision, offload=offload
        )
        expected = zero_offload.formula(
            padded, world, args, dtype, tied, backwards, largest_shard=largest
        )
        rows = ("param_bytes", "optim_bytes") if offload == "disk" else held
        for row in rows:
            assert held[row] == expected[row], row
        if offload == "disk" and mixed_precision:  # the fp32 masters are the files' alone
            assert all(unit.master is None for unit in engine.on_disk())
        assert counter.bytes == expected["comm"]
        units = len(engine.units)
        reductions = units if stage == 1 else backwards * units
        assert counter.calls["reduce_scatter"] == reductions
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "flags",
    [
        ["--stage", "1", "--offload", "cpu", "--mixed-precision"],
        ["--stage", "3", "--offload", "cpu"],
        ["--stage", "3", "--offload", "disk"],
        ["--stage", "3", "--offload", "disk", "--mixed-precision"],
    ],
    ids=["1-cpu-mixed", "3-cpu", "3-disk", "3-disk-mixed"],
)
def test_simulated_rows_equal_the_formula(flags, tmp_path, monkeypatch, capsys):
    """`zero_offload.py --simulate 64` in this process (rank 0 of 64 on the fake group, the model
    and the "CPU" masters on meta; --offload disk writes its unit files of meta tensors): every
    measured row is the formula's, the optimizer state off the device."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)  # common.launch sets them; monkeypatch takes them away again
    flags = [*CFG, "--simulate", "64", "--batch-size", "64", *flags, "--offload-dir", tmp_path]
    monkeypatch.setattr(sys, "argv", ["zero_offload.py", *map(str, flags)])
    capsys.readouterr()
    zero_offload.main()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1 and not dist.is_initialized()
    res = json.loads(lines[0][len("RESULT ") :])
    assert res["simulated"] and res["world_size"] == 64 and res["steps"] == 1
    formula = res["formula"]
    rows = ("param_bytes", "grad_bytes", "optim_bytes", "optim_peak_bytes", "working_bytes")
    for row in rows:
        assert formula.get(row) is None or res[row] == formula[row], row
    disk = "disk" in flags
    # the bf16 copy is a row of its own where it is not the optimizer's parameters (disk)
    assert ("working_bytes" in res) == ("--mixed-precision" in flags and not disk)
    assert res["comm"] == formula["comm"]
    assert res["optim_bytes"] == (0 if disk else 8 * res["params_padded"] // 64)
