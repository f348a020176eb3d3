"""zero_offload.py: ZeRO-Offload (--offload cpu) and ZeRO-Infinity (--offload disk) end with the
parameters of one ddp.py process, hold their bytes where the docstring says, and a rank killed
while writing its state files leaves every file whole.

The model and data of tests/test_zero.py (so the same ddp.py references): W=2 pads the embed unit.
On a machine without a GPU --offload cpu runs the same path with unpinned CPU buffers.
"""

import pytest
import torch
import torch.distributed as dist

import common
import zero_offload
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


def needed(request):
    """The (stage, optim, offload) runs this session's selected tests of this module read: every
    one in a whole run, one when a single test is asked for (as tests/test_mutants.py does)."""
    cases = set()
    for item in request.session.items:
        if item.module is request.module and item.originalname in OFFLOAD_READ_BY:
            params = item.callspec.params
            cases.add((params["stage"], params["optim"], OFFLOAD_READ_BY[item.originalname]))
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
