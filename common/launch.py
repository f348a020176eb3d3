"""The shared flags, one-line messages from rank 0, the launcher and the backend/device choice."""

import argparse
import datetime
import gc
import os
import re
import socket
import sys

import torch
import torch.distributed as dist

from common.messages import check, env_rank, fail, log
from common.model import IMAGE, ViT
from common.training import load_state_dict_file


class Parser(argparse.ArgumentParser):
    """argparse that prints usage errors once, from rank 0, instead of once per process. Its args
    say simulate=0 unless the script offers --simulate (get_parser(..., simulates=True))."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.set_defaults(simulate=0, simulate_rank=0)

    def error(self, message):
        if env_rank() == 0:
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)

    def print_help(self, file=None):
        if env_rank() == 0:
            super().print_help(file)


def get_parser(description, simulates=False):
    """The shared flags; `simulates`: the script runs under --simulate W (common/simulate.py),
    which the others do not offer."""
    p = Parser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("shared flags (common.py)")
    g.add_argument("--epochs", type=int, default=6)
    g.add_argument(
        "--batch-size",
        type=int,
        default=128,
        help="GLOBAL batch: each of W data-parallel ranks gets batch/W",
    )
    g.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate (default: 2e-3 for adamw, 0.05 for sgd)",
    )
    g.add_argument(
        "--warmup",
        type=float,
        default=0.05,
        help="fraction of the steps spent warming the lr up linearly",
    )
    g.add_argument(
        "--lr-schedule",
        choices=["cosine", "constant"],
        default="cosine",
        help="after warm-up: cosine decay to 0 over the run, or constant",
    )
    g.add_argument("--optim", choices=["adamw", "sgd"], default="adamw")
    g.add_argument(
        "--clip",
        type=float,
        default=0.0,
        help="clip the global gradient norm to this before each step (0: no clipping)",
    )
    g.add_argument(
        "--shift",
        type=int,
        default=1,
        help="augmentation: move each training image by up to N pixels",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--data", choices=["auto", "mnist", "synthetic"], default="auto")
    g.add_argument("--data-dir", default="data")
    g.add_argument(
        "--limit",
        type=int,
        default=0,
        help="use only the first N train and N test samples (0: all)",
    )
    g.add_argument(
        "--max-steps", type=int, default=0, help="stop after N optimizer steps (0: no limit)"
    )
    g.add_argument(
        "--workers",
        type=int,
        default=None,
        help="DataLoader worker processes per rank, the same run for any N "
        "(default: 4 on a GPU, 0 on the CPU, where the batches cost next to nothing)",
    )
    g.add_argument("--dim", type=int, default=64)
    g.add_argument("--depth", type=int, default=4)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument(
        "--patch", type=int, default=7, help="patch side, a divisor of 28: (28/patch)^2 tokens"
    )
    g.add_argument(
        "--experts",
        type=int,
        default=0,
        help="E > 0: each block's MLP becomes a mixture of E expert MLPs",
    )
    g.add_argument("--top-k", type=int, default=1, help="with --experts: experts per token (K)")
    g.add_argument(
        "--aux-loss",
        type=float,
        default=0.01,
        help="with --experts: load-balancing loss coefficient",
    )
    g.add_argument(
        "--save", default=None, help="write the plain, unsharded state_dict here at the end"
    )
    g.add_argument(
        "--load", default=None, help="start from a state_dict written by any script's --save"
    )
    g.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto")
    g.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a collective may wait before the run fails",
    )
    g.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="without torchrun: processes to spawn on this machine",
    )
    g.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (a log line every --log-every steps)",
    )
    g.add_argument(
        "--log-every", type=int, default=50, help="steps between loss lines when not on a terminal"
    )
    g.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="write a torch.profiler trace of a few training steps per rank to DIR/rank<r>.json",
    )
    if not simulates:  # the scripts that run on the fake backend say so (common/simulate.py)
        return p
    g.add_argument(
        "--simulate",
        type=int,
        default=0,
        metavar="W",
        help="run one step as one rank of W on torch's fake process group, every tensor on the "
        "meta device: the papers' sizes in one process, measured, nothing computed "
        "(common/simulate.py)",
    )
    g.add_argument(
        "--simulate-rank", type=int, default=0, help="with --simulate: the rank this process is"
    )
    return p


def parse_args(parser, argv=None):
    """Parse and check the shared flags; each script checks its own afterwards."""
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "dim", "depth", "heads", "patch", "log_every"):
        check(
            getattr(args, name) > 0,
            f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}",
        )
    if args.workers is None:  # what is fastest on the device
        args.workers = 4 if uses_gpus(args.backend) else 0
    for name in ("limit", "max_steps", "shift", "workers"):
        check(
            getattr(args, name) >= 0,
            f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}",
        )
    check(args.clip >= 0, f"--clip must be >= 0 (0: no clipping), got {args.clip}")
    check(args.timeout > 0, f"--timeout must be positive, got {args.timeout}")
    check(0 <= args.warmup < 1, f"--warmup is a fraction of the steps in [0, 1), got {args.warmup}")
    check(args.dim % args.heads == 0, f"--dim {args.dim} is not divisible by --heads {args.heads}")
    check(IMAGE % args.patch == 0, f"--patch {args.patch} does not divide the 28-pixel image side")
    check(args.nproc is None or args.nproc >= 1, f"--nproc must be >= 1, got {args.nproc}")
    check(args.experts >= 0, f"--experts must be >= 0 (0: the dense MLP), got {args.experts}")
    check(
        not args.experts or 1 <= args.top_k <= args.experts,
        f"--top-k {args.top_k} must be between 1 and --experts {args.experts}: "
        "each token picks K distinct experts",
    )
    check(args.aux_loss >= 0, f"--aux-loss must be >= 0, got {args.aux_loss}")
    if args.lr is None:
        args.lr = 2e-3 if args.optim == "adamw" else 0.05
    if args.simulate:
        check_simulation(args)
    if args.load is not None:  # a bad file fails now, before any process group or data
        check(os.path.isfile(args.load), f"--load {args.load}: no such file")
        load_state_dict_file(
            args.load,
            ViT(
                args.dim, args.depth, args.heads, args.patch, args.experts, args.top_k
            ).state_dict(),
        )
    return args


def check_simulation(args):
    """--simulate W: one process, one step, nothing read or written. Sets what the simulated run
    uses: the fake backend (pick_backend, init_process_group) and one step of meta batches."""
    W, r = args.simulate, args.simulate_rank
    check(W >= 1, f"--simulate must be >= 1 (the simulated world size), got {W}")
    check(
        args.backend == "auto", f"--simulate runs on the fake backend, not --backend {args.backend}"
    )
    check(0 <= r < W, f"--simulate-rank must be in [0, {W}), got {r}")
    check(
        int(os.environ.get("WORLD_SIZE", "1")) == 1 and (args.nproc or 1) == 1,
        "--simulate runs one process as one rank of its W: start it with python, "
        "not torchrun or --nproc",
    )
    for flag in ("load", "save", "profile"):
        check(
            getattr(args, flag) is None,
            f"--simulate holds no values: nothing to --{flag} (a meta tensor has shape only)",
        )
    args.backend = "fake"
    args.epochs = 1
    args.max_steps = 1
    args.workers = 0


def uses_gpus(requested):
    """Whether --backend `requested` trains on GPUs here: pick_backend's choice, known before it."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return requested != "gloo" and gpus > 0 and dist.is_nccl_available()


def world_size(args):
    """The world size this launch will have, known before any process group exists."""
    if args.simulate:
        return args.simulate
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return args.nproc or 1


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(local_rank, nproc, run, args):
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
    )
    run_and_collect(run, args)


# A rank that srun or mpirun started (not torchrun, nor --nproc) finds its place on its node in
# the launcher's own variables. Open MPI's and MPICH's (Hydra's) come first: mpirun inside a SLURM
# allocation gives every rank the batch script's SLURM variables, in which each is task 0 of its
# node (SLURM_LOCALID=0), so all would take GPU 0.
MPI_LOCAL_VARIABLES = (
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),  # Open MPI's mpirun
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH's and Intel MPI's mpirun (Hydra)
)
# srun: the task's index on its node, the node's index in the job step, and the step's tasks per
# node, which srun always sets (SLURM_NTASKS_PER_NODE only comes with --ntasks-per-node); else the
# allocation's SLURM_TASKS_PER_NODE.
SLURM_LOCAL_VARIABLES = ("SLURM_LOCALID", "SLURM_NODEID")
SLURM_TASKS_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


def slurm_tasks_on_node(tasks_per_node, node):
    """The number of tasks SLURM runs on node `node` (its SLURM_NODEID), read from SLURM's
    compressed list: "2(x3),1" is 2 tasks on each of nodes 0, 1 and 2, then 1 task on node 3."""
    groups = tasks_per_node.split(",")
    well_formed = all(re.fullmatch(r"\d+(\(x\d+\))?", group) for group in groups)
    check(well_formed, f"SLURM's tasks per node {tasks_per_node!r}: expected e.g. '2(x3),1'")
    first_node = 0
    for group in groups:
        count, _, repeat = group.partition("(x")
        nodes = int(repeat.rstrip(")")) if repeat else 1
        if node < first_node + nodes:
            return int(count)
        first_node += nodes
    fail(f"SLURM_NODEID={node} is past the {first_node} nodes of SLURM's {tasks_per_node!r}")


def launcher_local_rank(env):
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) of this rank from the variables of the launcher that
    started it, mpirun's before srun's, or None where there are none."""
    for local_rank, local_world in MPI_LOCAL_VARIABLES:
        if local_rank in env and local_world in env:
            return int(env[local_rank]), int(env[local_world])
    tasks_per_node = [env[name] for name in SLURM_TASKS_PER_NODE if name in env]
    if all(name in env for name in SLURM_LOCAL_VARIABLES) and tasks_per_node:
        node = int(env["SLURM_NODEID"])
        return int(env["SLURM_LOCALID"]), slurm_tasks_on_node(tasks_per_node[0], node)
    return None


def adopt_launcher_environment(args):
    """A rank started by srun or mpirun (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT exported by
    the user, no LOCAL_RANK): take LOCAL_RANK and LOCAL_WORLD_SIZE from the launcher's variables,
    which pick this rank's GPU. MASTER_* stay as they are: every rank must meet at one store."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    check(
        not missing,
        f"RANK and WORLD_SIZE are set but {' and '.join(missing)} not: a launcher other than "
        "torchrun must export RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every rank",
    )
    check(args.nproc is None, "--nproc starts ranks itself: not with RANK set by a launcher")
    local = launcher_local_rank(os.environ)
    check(
        local is not None,
        "RANK and WORLD_SIZE are set but not LOCAL_RANK, nor SLURM_LOCALID, SLURM_NODEID and "
        "SLURM_STEP_TASKS_PER_NODE (srun), nor OMPI_COMM_WORLD_LOCAL_RANK and "
        "OMPI_COMM_WORLD_LOCAL_SIZE (Open MPI's mpirun), nor MPI_LOCALRANKID and MPI_LOCALNRANKS "
        "(MPICH's): export LOCAL_RANK and LOCAL_WORLD_SIZE, which pick each rank's GPU, "
        "or use torchrun",
    )
    local_rank, local_world = local
    os.environ.update(LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_world))


def launch(run, args):
    """Start `run(args)` on every rank. Under torchrun this process is one rank; so it is under
    srun or mpirun (Open MPI's, MPICH's) when RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are
    exported for every rank (docs/reliability.md), the local rank taken from the launcher's own.
    Otherwise `python X.py --nproc N` spawns N processes on this machine on a free port, and plain
    `python X.py` is a world of one."""
    import torch.multiprocessing as mp

    if args.simulate:  # one process as rank r of W (common/simulate.py)
        from common.simulate import simulated_rank

        with simulated_rank(args.simulate_rank, args.simulate):
            run_and_collect(run, args)
        return
    launched = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if launched and "LOCAL_RANK" not in os.environ:
        adopt_launcher_environment(args)
    if "LOCAL_RANK" not in os.environ and (args.nproc or 1) > 1 and args.backend != "gloo":
        # Every rank gets this process's environment, so one GPU that CUDA_VISIBLE_DEVICES
        # shows is the same GPU for all of them, not a per-rank binding (pick_backend's case).
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        check(
            gpus == 0 or gpus >= args.nproc,
            f"--nproc {args.nproc} but {gpus} GPUs visible: two ranks would share a GPU. "
            f"Use --nproc {gpus}, or --backend gloo",
        )
    if "LOCAL_RANK" not in os.environ:  # no launcher: this process starts the world itself
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if "LOCAL_RANK" in os.environ or (args.nproc or 1) == 1:
        for k, v in (
            ("RANK", "0"),
            ("LOCAL_RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("LOCAL_WORLD_SIZE", "1"),
        ):
            os.environ.setdefault(k, v)
        run_and_collect(run, args)
    else:
        try:
            mp.spawn(_spawned, args=(args.nproc, run, args), nprocs=args.nproc)
        except mp.ProcessRaisedException as e:  # the failing rank's traceback once, not a wall
            print(f"error: rank {e.error_index} failed:\n{e}", file=sys.stderr)
            sys.exit(1)
        except mp.ProcessExitedException as e:
            if e.exit_code != 2:  # 2: bad input, which rank 0 has already explained
                print(
                    f"error: rank {e.error_index} exited with code {e.exit_code}", file=sys.stderr
                )
            sys.exit(e.exit_code if e.exit_code and e.exit_code > 0 else 1)


def run_and_collect(run, args):
    """run(args), then a garbage collection, also when the run ends in an error (bad input exits
    with code 2 once the process group exists): wrappers and hooks form reference cycles that hold
    tensors Gloo's work touched; free them now, not during interpreter shutdown, where Gloo's
    threads can abort the exit ("terminate called without an active exception")."""
    try:
        run(args)
    finally:
        gc.collect()


def pick_backend(requested):
    """'auto' -> NCCL on cuda:(LOCAL_RANK % visible GPUs) when GPUs are visible (a launcher may
    show each process only its own GPU), else Gloo on the CPU. More local ranks than GPUs is
    refused, in one message. Called before the process group exists, so bad input fails before
    any rendezvous. Returns (backend, device)."""
    if requested == "fake":  # --simulate: no devices, only shapes (common/simulate.py)
        log("backend: fake on meta (simulated: no communication, no values)")
        return "fake", torch.device("meta")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = dist.is_nccl_available()
    if requested == "nccl":
        why_not = f"{gpus} GPUs visible" if gpus == 0 else "this torch has no NCCL"
        check(gpus > 0 and nccl, f"--backend nccl needs a CUDA GPU and NCCL ({why_not})")
    if requested == "auto":
        backend = "nccl" if gpus > 0 and nccl else "gloo"
    else:
        backend = requested
    if backend == "nccl":
        # Fewer GPUs than local ranks would put two ranks on one GPU, which NCCL rejects once
        # every rank has started ("Duplicate GPU detected", a traceback from each). Except one
        # GPU that CUDA_VISIBLE_DEVICES shows each process: a per-process binding (SLURM, a
        # launcher that sets it per rank), a different GPU for each; when it is the same GPU
        # for all, init_process_group refuses it once the ranks can compare their GPUs.
        bound = gpus == 1 and "CUDA_VISIBLE_DEVICES" in os.environ
        check(
            local_world <= gpus or bound,
            f"{local_world} processes on this node but {gpus} GPUs visible: two ranks would share "
            f"a GPU. Use --nproc_per_node={gpus} (or --nproc {gpus}), or --backend gloo",
        )
        device = torch.device("cuda", local_rank % gpus)
        why = f"{gpus} GPUs visible to {local_world} local ranks"
    else:
        device = torch.device("cpu")
        why = "no GPUs visible" if gpus == 0 else "asked for"
        if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets it; mp.spawn and python do not
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    log(f"backend: {backend} on {device.type} ({why})")
    return backend, device


def init_process_group(backend, device, timeout):
    """Join the process group: torchrun (or common.launch, srun, mpirun) put RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT in the environment. `timeout` is in seconds. Two ranks on one GPU
    are refused in one message before NCCL starts. Returns (rank, world)."""
    if backend == "fake":  # --simulate: rank r of W, nobody to meet
        from common.simulate import init_fake_process_group

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        init_fake_process_group(rank, world)
        return rank, world
    timeout = datetime.timedelta(seconds=timeout)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    # torchrun keeps one store across restarts (--max-restarts): prefix it per attempt, or a
    # restarted rank may read the address of a worker that died in the last attempt and hang.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"attempt_{attempt}", store)
    if device.type == "cuda" and world > 1:
        refuse_shared_gpus(store, rank, world, device)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world,
        timeout=timeout,
        # NCCL: bind the communicator to this GPU now (not lazily at the first collective), so
        # that device meshes can split it and the first call is not a point-to-point one.
        device_id=device if device.type == "cuda" else None,
    )
    return rank, world


def refuse_shared_gpus(store, rank, world, device):
    """Two ranks on one GPU of one host (CUDA_VISIBLE_DEVICES=0 for every rank looks like a
    per-rank binding to pick_backend): NCCL would fail with "Duplicate GPU", a traceback from
    every rank. Each rank claims its (host, GPU UUID) in the store, a few messages per rank at
    any world size; once all have, rank 0 says the clash once and every rank exits 2."""
    host = socket.gethostname()
    gpu = str(torch.cuda.get_device_properties(device).uuid)
    holder = int(store.compare_set(f"gpu/{host}/{gpu}", "", str(rank)))
    if holder != rank:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        store.set(
            "gpu_shared",
            f"ranks {min(holder, rank)} and {max(holder, rank)} share one GPU ({gpu}) on {host}, "
            f"which NCCL refuses (CUDA_VISIBLE_DEVICES={visible}). Give each rank its own GPU: "
            "show each process a different one, or start as many ranks per node as it has GPUs; "
            "or use --backend gloo",
        )
    # A barrier on the store: nobody decides before every rank has claimed its GPU.
    if store.add("gpus_claimed", 1) == world:
        store.set("gpus_all_claimed", "")
    store.wait(["gpus_all_claimed"])
    if store.check(["gpu_shared"]):
        if rank == 0:
            print(f"error: {store.get('gpu_shared').decode()}", file=sys.stderr, flush=True)
        sys.exit(2)
