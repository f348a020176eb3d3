"""ZeRO through DeepSpeed: the same sharding as zero.py (stage 1 the optimizer state, 2 also the
gradients, 3 also the parameters), done by the library most projects pick for it. Your code
hardly changes: `deepspeed.initialize` wraps the model, the optimizer and the schedule into an
engine, and the loop calls `engine(x)`, `engine.backward(loss)`, `engine.step()` (which also
clips, steps the schedule and zeroes the gradients). The flags become a ds_config.

    ddp.py:            loss.backward(); clip; optimizer.step(); scheduler.step(); zero_grad()
    deepspeed_zero.py: engine.backward(loss); engine.step()

Memory per rank (fp32, AdamW, Ψ parameters), the paper's: stage 1: 4Ψ + 4Ψ + 8Ψ/W; stage 2:
4Ψ + 12Ψ/W; stage 3: 16Ψ/W. DeepSpeed's (formula(), exact, padding included): stages 1-2 keep
the parameters whole, an fp32 copy of the partition and its gradient alone (4Ψ + 16Ψ/W, stage 1
too); stage 3 each parameter's piece beside that copy (20Ψ/W). --mixed-precision (ds_config's
bf16): bf16 parameters and compute, the fp32 master in the partition, gradients reduced in fp32.
Stage 3 gathers every parameter in the first step's forward and backward, then the persistent
ones (stage3_param_persistence_threshold) after each step. Paper: Rajbhandari et al. 2019,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
https://arxiv.org/abs/1910.02054. Against zero.py: docs/techniques.md#zero-through-deepspeed.
Needs DeepSpeed: pip install -r requirements-deepspeed.txt.

    torchrun --standalone --nproc_per_node=4 deepspeed_zero.py --stage 3
    python deepspeed_zero.py --nproc 2 --stage 2 --offload cpu --grad-accum 2
    python deepspeed_zero.py --nproc 2 --stage 3 --mixed-precision
    python deepspeed_zero.py --nproc 2 --stage 3 --offload disk --offload-dir /nvme/ds
    python deepspeed_zero.py --nproc 2 --ds-config ds_config.json   # your own config
"""

import contextlib
import glob
import json
import os
import sys
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils import cpp_extension
from torch.utils.data import DataLoader, DistributedSampler

import common

# DeepSpeed, an optional dependency, picks its accelerator as it loads: import_deepspeed() imports
# it once --backend has named the device.
deepspeed = None

SCRIPT = os.path.splitext(os.path.basename(__file__))[0]
SHM_OP = "deepspeed_shm_comm"  # DeepSpeed's shared-memory collectives, a C++ op built on a CPU
BUILD_WARNING_S = 15  # seconds in deepspeed.initialize before a CPU run says what it waits for


### begin: DeepSpeed ZeRO
# Model contract: any nn.Module, built with the same weights on every rank, an optimizer over its
# parameters and a schedule over the optimizer; deepspeed.initialize takes all three. The loop
# (train(), through forward_backward) then calls engine(x), engine.backward(loss) and
# engine.step(), which replace backward, clip, optimizer.step(), scheduler.step() and zero_grad().


def ds_config(args, world):
    """The ds_config that the flags mean (keys: https://www.deepspeed.ai/docs/config-json/)."""
    zero = {"stage": args.stage}
    if args.offload != "none":
        target = {"device": "cpu" if args.offload == "cpu" else "nvme"}
        if args.offload == "disk":
            target["nvme_path"] = args.offload_dir
        zero["offload_optimizer"] = target
        if args.stage == 3:  # DeepSpeed offloads parameters at stage 3 only
            zero["offload_param"] = dict(target)
    config = {
        "train_batch_size": args.batch_size,
        "train_micro_batch_size_per_gpu": args.batch_size // world // args.grad_accum,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": args.clip,
        "zero_optimization": zero,
        # --mixed-precision's bf16 (below), never a config's alone: the model's inputs and
        # logits are cast by that flag's part
        "bf16": {"enabled": args.mixed_precision},
        # the torch optimizer every script builds (SGD or AdamW), also with offload: DeepSpeed
        # would otherwise ask for its own CPU Adam, a C++ extension
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # the loop logs the loss; DeepSpeed need not
    }
    if args.mixed_precision:
        # bf16 parameters, forward and backward; the fp32 master weights and the optimizer state
        # in each rank's partition. DeepSpeed reduces bf16 gradients in bf16 unless told: fp32,
        # as zero.py --mixed-precision and FSDP2's reduce_dtype do.
        config["communication_data_type"] = "fp32"
    return config


def cpu_adam(model, args):
    """DeepSpeed's own CPU Adam, the optimizer its CPU offload is made for (a C++ extension, built
    at its first run, about 2 minutes here): the skeleton's AdamW (weight decay 0.01)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(model.parameters(), lr=args.lr, weight_decay=0.01, adamw_mode=True)


def parallelize(model, optimizer, scheduler, config):
    """deepspeed.initialize shards as the config's zero_optimization.stage says: it wraps the
    optimizer into its ZeRO optimizer and the model into an engine whose backward reduces the
    gradients in buckets, each rank keeping its partition, and whose step clips, steps the
    optimizer and the
    schedule and zeroes the gradients. At stage 3 it partitions the parameters here and gathers
    each module's in its forward and backward."""
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=config,
    )
    return engine, optimizer, scheduler


def forward_backward(engine, x, y, grad_accum=1):
    """The batch (x, y) through the engine as grad_accum micro-batches; returns its mean loss.
    engine.backward divides each micro-batch's loss by gradient_accumulation_steps itself (a loss
    divided again would halve the gradients at 2); engine.step() counts the micro-batches and,
    after the last, clips, steps the optimizer and the schedule and zeroes the gradients."""
    batch_loss = torch.zeros((), device=x.device)
    for micro_x, micro_y in zip(x.chunk(grad_accum), y.chunk(grad_accum), strict=True):
        loss = F.cross_entropy(engine(micro_x), micro_y)
        engine.backward(loss)  # backward, and the gradients averaged and sharded
        engine.step()
        batch_loss += loss.detach() / grad_accum
    return batch_loss


def full_state_dict(engine):
    """The model's own state_dict() on every rank, its hooks run and its persistent buffers in (a
    collective at stage 3, where GatheredParameters gathers every parameter whole for the copy,
    the whole model at once on every rank, fine for the ViT, and partitions them again)."""
    stage_3 = engine.zero_optimization_stage() == 3
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage_3):
        return {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}


### more: mixed precision: bf16 working parameters, fp32 master weights in the partition
# ds_config's "bf16" makes the engine cast the parameters to bf16 and keep each rank's partition
# of them in fp32 in its ZeRO optimizer, which steps it and copies it back into the bf16 ones.
# It casts neither the model's inputs nor its outputs: the model's are cast here, so that forward
# reads bf16 and the loss is computed from fp32 logits, as zero.py --mixed-precision does.


def bf16_inputs_fp32_logits(model):
    """The model's floating-point inputs cast to bf16, its parameters' dtype, and its logits to
    fp32, for the loss (before deepspeed.initialize, which keeps the model's hooks)."""
    model.register_forward_pre_hook(inputs_to_bf16)
    model.register_forward_hook(output_to_fp32)


def inputs_to_bf16(module, args):
    return tuple(
        arg.to(torch.bfloat16) if torch.is_tensor(arg) and arg.is_floating_point() else arg
        for arg in args
    )


def output_to_fp32(module, args, output):
    if torch.is_tensor(output) and output.is_floating_point():
        return output.float()
    return output


def full_master_state_dict(engine):
    """full_state_dict with each parameter's fp32 master weights, whole, where the bf16 working
    copy was: what one process training in fp32 would save (a collective: every rank assembles
    every master from the partitions; at stage 3 the working parameters stay partitioned)."""
    params = list(engine.module.parameters())
    masters = [deepspeed.utils.safe_get_full_fp32_param(param) for param in params]
    working = [param.data for param in params]
    for param, master in zip(params, masters, strict=True):
        param.data = master
    try:
        return {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
    finally:
        for param, data in zip(params, working, strict=True):
            param.data = data


### more: a GPU of its own per process (srun --gpus-per-task=1)


def give_deepspeed_the_device(device):
    """DeepSpeed takes LOCAL_RANK for the index of this process's GPU among those it sees, as under
    its own launcher, which shows every process all of the node's GPUs: the engine calls
    set_device(LOCAL_RANK) (initialize's args.device_rank overrides that call alone) and stage 3
    puts the parameters on cuda:LOCAL_RANK. A process shown only its own GPU trains on cuda:0
    whatever its local rank ("invalid device ordinal"): tell DeepSpeed the index, before
    deepspeed.initialize."""
    if device.type == "cuda":
        os.environ["LOCAL_RANK"] = str(device.index)


### end: DeepSpeed ZeRO


# DeepSpeed's defaults for the ds_config keys formula() reads (deepspeed/runtime/zero/config.py,
# deepspeed/runtime/precision_config.py), where the config leaves them out
PERSISTENCE_THRESHOLD = 100_000  # zero_optimization.stage3_param_persistence_threshold
MODEL_PERSISTENCE_THRESHOLD = sys.maxsize  # zero_optimization.stage3_model_persistence_threshold
# stage_1_and_2.py: nccl_start_alignment_factor = 2 elements, times the world, is what each flat
# buffer of parameters is padded to, so that every rank's partition starts 4-byte aligned
ALIGNMENT = 2
INT64_BYTES = 8  # stage 3's check that every rank traced the same modules: int64 lists


def flat_numel(psi, world):
    """Stages 1-2: the elements of DeepSpeed's flat buffer of the model's parameters, Ψ padded to a
    multiple of ALIGNMENT·W (stage_1_and_2.py, flatten_dense_tensors_aligned); a rank's partition
    is 1/W of it."""
    alignment = ALIGNMENT * world
    return -(-psi // alignment) * alignment


def partition_numel(sizes, world):
    """Stage 3: the elements of a rank's partition, each parameter padded to a multiple of W on its
    own (partition_parameters.py, _padding_size): Σ ceil(numel / W)."""
    return sum(-(-numel // world) for numel in sizes)


def persistent(model, config):
    """The parameters DeepSpeed's stage 3 keeps whole on every rank once traced
    (parameter_offload.py, mark_persistent_parameters): those of at most
    stage3_param_persistence_threshold elements, while their sum stays within
    stage3_model_persistence_threshold."""
    zero = config["zero_optimization"]
    threshold = zero.get("stage3_param_persistence_threshold", PERSISTENCE_THRESHOLD)
    model_threshold = zero.get("stage3_model_persistence_threshold", MODEL_PERSISTENCE_THRESHOLD)
    kept, total = [], 0
    for param in model.parameters():
        numel = ds_numel(param)
        if numel + total > model_threshold:
            continue
        if numel <= threshold:
            kept.append(param)
            total += numel
    return kept


def ds_numel(param):
    """A parameter's elements, also at stage 3, where its own tensor is empty between uses."""
    return getattr(param, "ds_numel", param.numel())


def formula(model, world, args, config, window):
    """DeepSpeed's per-rank bytes, as the Meter reads them after the first step (memory) and counts
    them over the `window` steps it watches (communication, per step): what DeepSpeed 0.19's
    stage_1_and_2.py and stage3.py hold and send, padding included, with the ZeRO paper's own
    figures beside (`paper`). `model` is the module the engine wraps, `config` the ds_config.
    Exact for the common ViT; at stage 3 with --experts the trace rows are not (the experts a
    forward runs vary)."""
    sizes = [ds_numel(param) for param in model.parameters()]
    psi = sum(sizes)
    b = 2 if args.mixed_precision else 4  # bytes of a working parameter: bf16, or fp32
    k = 8 if args.optim == "adamw" else 4  # optimizer state bytes a parameter: AdamW m, v; momentum
    dtype = "bf16" if args.mixed_precision else "fp32"
    notes = {}
    if args.stage < 3:
        # The model's parameters become views of one flat buffer of Ψ' = Ψ padded to ALIGNMENT·W
        # elements, whole on every rank; the optimizer steps an fp32 copy of this rank's 1/W of
        # it (cloned, also in fp32).
        n = flat_numel(psi, world)
        rows = dict(
            param_bytes=b * n + 4 * n // world,
            grad_bytes=4 * n // world,
            optim_bytes=k * n // world,
        )
        role = (
            "the master (in the paper's K)" if args.mixed_precision else "a copy the paper has not"
        )
        notes["param_bytes"] = (
            f"{b}Ψ' {dtype} whole (the model's) + 4Ψ'/W fp32 partition, {role}; "
            f"Ψ' = Ψ padded to {ALIGNMENT}W"
        )
        notes["grad_bytes"] = (
            "4Ψ'/W: the averaged fp32 partition; the model's gradients are freed once reduced"
            + ("; the paper's stage 1 keeps them whole" if args.stage == 1 else "")
        )
    else:
        # Each parameter is cut into W pieces of its own; the optimizer steps an fp32 flat copy
        # of this rank's pieces, and the pieces themselves (ds_tensor) stay beside it.
        n = partition_numel(sizes, world)
        rows = dict(
            param_bytes=4 * n,
            grad_bytes=4 * n,
            optim_bytes=k * n,
            working_bytes=b * n,
        )
        notes["param_bytes"] = "4Ψ'/W fp32 partition the optimizer steps, Ψ' = Σ ceil(n/W)·W"
        notes["working_bytes"] = f"{b}Ψ'/W: each parameter's own {dtype} piece (ds_tensor), " + (
            "the paper's parameters" if args.mixed_precision else "a second fp32 copy"
        )
        notes["grad_bytes"] = "4Ψ'/W: the averaged fp32 partition"
    notes["optim_bytes"] = f"{k}Ψ'/W sharded " + ("AdamW m, v" if k == 8 else "SGD momentum")
    comm, comm_notes = communication(model, sizes, world, args, config, window)
    notes.update(comm_notes)
    paper, paper_notes = paper_figures(psi, world, args)
    notes.update(paper_notes)
    return dict(**rows, comm=comm, paper=paper, notes=notes)


def communication(model, sizes, world, args, config, window):
    """({kind: bytes a step}, {kind: note}) over the Meter's `window` steps, as it counts them:
    the window's bytes floor-divided by its steps."""
    b = 2 if args.mixed_precision else 4
    dtype = "bf16" if args.mixed_precision else "fp32"
    psi = sum(sizes)
    micro_batches = window * args.grad_accum
    # the gradients reach the optimizer in fp32: ds_config's communication_data_type under bf16
    if args.stage < 3:
        # One all-reduce of the unpadded gradients, each rank keeping its partition
        # (use_multi_rank_bucket_allreduce): at the step's last micro-batch at stage 1, after
        # every micro-batch's backward at stage 2, which keeps no whole gradient.
        reductions = args.grad_accum if args.stage == 2 else 1
        all_reduce = reductions * 4 * psi * window
        overflow = args.mixed_precision and config["bf16"].get("check_grad_overflow", True)
        all_reduce += window if overflow else 0  # a 1-byte flag a step: any inf or NaN?
        offload = args.offload != "none"
        all_reduce += 4 * window if offload else 0  # the offloaded gradients' norm (below)
        comm = dict(all_reduce=all_reduce, all_gather=b * flat_numel(psi, world) * window)
        notes = dict(
            all_reduce=("" if reductions == 1 else f"{reductions}x ")
            + "4Ψ fp32 gradients, where the paper reduce-scatters: DeepSpeed all-reduces and "
            "keeps its partition"
            + (" (after each micro-batch)" if reductions > 1 else "")
            + (" + 1 B, the bf16 overflow check" if overflow else "")
            + (" + 4 B, the offloaded gradients' norm" if offload else ""),
            all_gather=f"{b}Ψ' {dtype}: the updated partitions into the flat buffer",
        )
        return {kind: total // window for kind, total in comm.items()}, notes
    # Stage 3 gathers a parameter's W pieces whole (each padded to W) before a module uses it.
    # The first forward and backward record the order of use (the trace) and gather every
    # parameter for each use; once traced, the persistent ones stay whole, refreshed by one
    # gather after each step, and the others are gathered once a micro-batch, in its forward
    # (kept for backward: models under stage3_max_reuse_distance elements).
    whole = b * world * partition_numel(sizes, world)
    kept_params = persistent(model, config)
    kept = b * world * partition_numel([ds_numel(param) for param in kept_params], world)
    all_gather = 2 * whole + (micro_batches - 1) * (whole - kept) + window * kept
    if args.grad_accum > 1:
        # The first step's second micro-batch gathers in its forward the persistent parameters
        # that the traced backward let go: all but those of the modules whose backward hook
        # never fires, those reading the images (no gradient to them): the patch embedding's.
        embedding = set(model.embed.parameters())
        still_whole = [ds_numel(param) for param in kept_params if param in embedding]
        all_gather += kept - b * world * partition_numel(still_whole, world)
    # At the second micro-batch's forward every rank checks that it traced the same order:
    # int64 lists of the modules used (forward and backward: 2M) and, for the parameters of
    # each use, their ids and step ids (2 x 2P); the first forward checked an empty list.
    modules = [m for m in model.modules() if not isinstance(m, torch.nn.ModuleList)]
    params = sum(len(list(m.parameters(recurse=False))) for m in modules)
    trace = INT64_BYTES * (2 * len(modules) + 4 * params) if micro_batches > 1 else 0
    comm = dict(
        reduce_scatter=args.grad_accum * 4 * world * partition_numel(sizes, world) * window,
        all_gather=all_gather,
        broadcast=trace,
    )
    notes = dict(
        reduce_scatter=("" if args.grad_accum == 1 else f"{args.grad_accum}x ")
        + "4Ψ' fp32 gradients, after each backward",
        all_gather=f"{b}Ψ' {dtype} a gather: 2 in the first (traced) step, then "
        "the persistent parameters (stage3_param_persistence_threshold) after each step"
        + ("" if kept == whole else ", the others in each forward")
        + (", and once in the second micro-batch" if args.grad_accum > 1 else "")
        + "; the paper: 2 a step",
        broadcast="DeepSpeed's check that the ranks traced the same modules, once",
    )
    if args.offload != "none":
        # The offloaded gradients' squared norm (for the clip, taken also without one), summed
        # over the ranks as a 1-element fp32 tensor, at every stage; the device's is 0-d, which
        # the Meter leaves out as bookkeeping.
        comm["all_reduce"] = 4 * window
        notes["all_reduce"] = "4 B: the squared norm of the offloaded gradients, summed"
    return {kind: total // window for kind, total in comm.items()}, notes


def paper_figures(psi, world, args):
    """The ZeRO paper's per-rank bytes (https://arxiv.org/abs/1910.02054, §5 and Table 1) for this
    run's dtypes and optimizer: parameters B, gradients B and K bytes of optimizer state a
    parameter (mixed precision: 2 + 2 + K with the fp32 master in K, Table 1's K = 12 for Adam;
    fp32: 4 + 4 + K, no master), sharded from stage 1 (state), 2 (gradients), 3 (parameters);
    communication a step without accumulation: the gradients reduce-scattered once (B Ψ) and the
    parameters all-gathered once (B Ψ), at stage 3 in forward and in backward."""
    b = 2 if args.mixed_precision else 4
    k = (8 if args.optim == "adamw" else 4) + (4 if args.mixed_precision else 0)
    sharded = {1: (b + b) * psi + k * psi / world, 2: b * psi + (b + k) * psi / world}
    states = sharded.get(args.stage, (b + b + k) * psi / world)
    paper = dict(model_states=states, all_gather=(2 if args.stage == 3 else 1) * b * psi)
    reduction = "reduce_scatter" if args.stage == 3 else "all_reduce"
    paper[reduction] = b * psi
    formulas = {1: f"{2 * b}Ψ + {k}Ψ/W", 2: f"{b}Ψ + {b + k}Ψ/W"}
    source = "ZeRO Table 1" if k == 12 else "ZeRO §5's formulas"
    dtype = "bf16" if args.mixed_precision else "fp32"
    notes = dict(
        model_states="the rows below: DeepSpeed's copies beside the paper's",
        paper=f"{source}: {b} + {b} + K bytes a parameter, K = {k}, "
        + formulas.get(args.stage, f"{2 * b + k}Ψ/W")
        + f"; Ψ {dtype} gradients reduce-scattered (beside DeepSpeed's reduction) and Ψ "
        + ("parameters all-gathered twice" if args.stage == 3 else "parameters all-gathered")
        + " a step (https://arxiv.org/abs/1910.02054)",
    )
    return paper, notes


def ds_config_from(args, world):
    """The flags' ds_config, or the user's --ds-config file checked against the flags: a key both
    set must agree (a batch size, a stage), and the flags fill in what the file leaves out."""
    config = ds_config(args, world)
    if not args.ds_config:
        return config
    with open(args.ds_config) as f:
        user_config = json.load(f)
    fill_in_and_check(user_config, config, args.ds_config)
    return user_config


def fill_in_and_check(user_config, flags_config, path, where=""):
    """Each key of flags_config, nested ones too, put into user_config where it has none, else
    compared: a value that differs is one error naming the key."""
    for key, value in flags_config.items():
        if isinstance(value, dict):
            fill_in_and_check(user_config.setdefault(key, {}), value, path, f"{where}{key}.")
            continue
        user_value = user_config.setdefault(key, value)
        common.check(
            user_value == value,
            f"--ds-config {path}: {where}{key} is {user_value}, but the flags mean {value}",
        )


def import_deepspeed(accelerator):
    """Import DeepSpeed for `accelerator` ("cuda" or "cpu"), or leave `deepspeed` None where it is
    not installed (check_args says how to install it). DeepSpeed picks its accelerator once, as it
    loads: from DS_ACCELERATOR, else from the GPUs it sees, so --backend gloo on a GPU host would
    get CUDA's and fail on a device mismatch. Name the device the run trains on."""
    global deepspeed
    os.environ["DS_ACCELERATOR"] = accelerator
    try:
        import deepspeed as library
    except ImportError:
        return
    deepspeed = library


def check_args(args, world):
    common.check(
        args.batch_size % world == 0,
        f"--batch-size {args.batch_size} is not divisible by world size {world}: "
        "every rank must get the same whole number of samples per step",
    )
    samples_per_rank = args.batch_size // world
    common.check(
        args.grad_accum >= 1 and samples_per_rank % args.grad_accum == 0,
        f"--grad-accum {args.grad_accum} must be >= 1 and divide the {samples_per_rank} samples "
        "each rank gets per step",
    )
    # At stages 1-2 DeepSpeed takes an offload_optimizer device "nvme" for "cpu", without a word.
    common.check(
        args.offload != "disk" or args.stage == 3,
        f"--offload disk swaps to NVMe at --stage 3 only: at stage {args.stage} DeepSpeed would "
        "keep the optimizer state in CPU memory instead; give --stage 3, or --offload cpu",
    )
    common.check(
        deepspeed is not None,
        "deepspeed_zero.py needs DeepSpeed: pip install -r requirements-deepspeed.txt",
    )
    if args.offload == "disk":
        # DeepSpeed's NVMe offload reads and writes through its async_io op, built at the first
        # run where libaio is installed (apt install libaio-dev), else a traceback from a rank
        aio = deepspeed.accelerator.get_accelerator().create_op_builder("AsyncIOBuilder")
        common.check(
            aio is not None and aio.is_compatible(verbose=False),
            "--offload disk needs DeepSpeed's async_io op, which cannot be built here "
            "(it needs libaio: apt install libaio-dev)",
        )
        directory = args.offload_dir
        writable = (
            directory is not None and os.path.isdir(directory) and os.access(directory, os.W_OK)
        )
        common.check(
            writable,
            "--offload disk needs --offload-dir DIR, an existing writable directory "
            f"(got {args.offload_dir})",
        )
    common.check(
        not args.cpu_adam or (args.offload == "cpu" and args.optim == "adamw"),
        "--cpu-adam is DeepSpeed's CPU AdamW for --offload cpu: give --offload cpu --optim adamw",
    )
    if args.ds_config:
        common.check(os.path.isfile(args.ds_config), f"--ds-config {args.ds_config}: no such file")
        try:
            ds_config_from(args, world)
        except json.JSONDecodeError as error:
            common.fail(f"--ds-config {args.ds_config} is not JSON: {error}")


def unfinished_builds():
    """The lock files of DeepSpeed's shared-memory op where it is not built yet: torch builds it in
    $TORCH_EXTENSIONS_DIR/deepspeed_shm_comm, else in <build root>/<python>_<device>/..."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    folders = glob.glob(os.path.join(root, SHM_OP)) + glob.glob(os.path.join(root, "*", SHM_OP))
    return [
        os.path.join(folder, "lock")
        for folder in folders
        if os.path.exists(os.path.join(folder, "lock"))
        and not glob.glob(os.path.join(folder, f"{SHM_OP}*.so"))
    ]


@contextlib.contextmanager
def saying_what_deepspeed_waits_for(device, seconds=BUILD_WARNING_S):
    """On a CPU, deepspeed.initialize loads DeepSpeed's shared-memory collectives, a C++ op that it
    builds at its first run (about 25 s) under a lock that another process may hold: a build
    still running, or one killed where torch's lock is a plain file (older torch). Every rank
    then sleeps without a word, for ever. If initialize is still waiting for an unfinished build
    after `seconds`, rank 0 says which lock it waits for."""

    def warn():
        locks = unfinished_builds()
        if locks and dist.get_rank() == 0:
            print(
                f"warning: DeepSpeed has waited {seconds} s for its shared-memory op, which it "
                f"builds at its first run on a CPU (about 25 s) under the lock {locks[0]}: if no "
                "run is building it now, delete that file, or give this run a folder of its own "
                "(TORCH_EXTENSIONS_DIR=DIR)",
                file=sys.stderr,
                flush=True,
            )

    timer = threading.Timer(seconds, warn)
    timer.daemon = True  # never what keeps a failed run alive
    if device.type == "cpu":
        timer.start()
    try:
        yield
    finally:
        timer.cancel()


def setup(args):
    """Join the process group. torchrun (or common.launch) put RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT in the environment; LOCAL_RANK picks this process's GPU."""
    backend, device = common.pick_backend(args.backend)  # NCCL and a GPU per rank, else Gloo
    import_deepspeed(device.type)  # again in a process that --nproc spawned: it ran no main()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank, world = common.init_process_group(backend, device, args.timeout)
    return rank, world, device, backend


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def train(model, optimizer, scheduler, loader, sampler, args, device, step=0):
    """The loop every script shares: forward, loss, backward, step, schedule, log."""
    stop = args.max_steps or float("inf")
    world = dist.get_world_size()
    loss_sum = torch.zeros((), device=device)  # stays on the device until a logging step
    losses_summed = 0
    last_loss = float("nan")
    for epoch in range(step // len(loader), args.epochs):
        if step >= stop:
            break
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        loader.dataset.set_epoch(epoch)  # and new augmentations (--shift), the same everywhere
        model.train()
        bar = common.progress(loader, args, epoch)
        for i, (x, y) in enumerate(bar):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            loss = forward_backward(model, x, y, args.grad_accum)  # and the engine's step
            step += 1
            loss_sum += loss.detach()
            losses_summed += 1
            if step % args.log_every == 0 or step >= stop or i + 1 == len(loader):
                dist.all_reduce(loss_sum)  # each rank's loss is its slice's: average them
                last_loss = loss_sum.item() / world / losses_summed
                loss_sum.zero_()
                losses_summed = 0
                common.log_loss(bar, args, epoch, step, last_loss)
            if step >= stop:
                break
        common.log(f"epoch {epoch}: step {step}, train loss {last_loss:.4f}")
    return dict(steps=step, loss=last_loss)


@torch.no_grad()
def evaluate(model, loader, device):
    """Exact: the loader pads every rank to the same number of batches (padding masked out), so
    every rank runs the same forward passes and collectives and each sample counts once."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=device)
    for x, y, keep in loader:
        x, y, keep = x.to(device), y.to(device), keep.to(device)
        counts += torch.stack([((model(x).argmax(1) == y) & keep).sum(), keep.sum()])
    dist.all_reduce(counts)
    return counts[0].item() / max(counts[1].item(), 1)


def run(args):
    """One rank, in the seeds' order: join the group, deal the data, build the model, wrap it,
    train, evaluate, save on rank 0, leave the group."""
    rank, world, device, backend = setup(args)
    try:
        train_set, test_set, source = common.load_data(args, device)
        dp_rank, dp_world = rank, world  # every rank is a data-parallel rank
        sampler = DistributedSampler(
            train_set,
            num_replicas=dp_world,
            rank=dp_rank,
            shuffle=True,
            seed=args.seed,
            drop_last=True,
        )
        loader = DataLoader(
            train_set,
            batch_size=args.batch_size // dp_world,
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
        # the same seeded weights on every rank; --grad-accum: the MoE balance loss (--experts)
        # is divided as the engine divides each micro-batch's loss
        model = common.build_model(args, forwards_per_step=args.grad_accum)
        if args.load:
            model.load_state_dict(common.load_state_dict_file(args.load, model.state_dict()))
        psi = sum(p.numel() for p in model.parameters())
        model = model.to(device)
        optimizer = common.make_optimizer(model.parameters(), args)
        if args.cpu_adam:
            optimizer = cpu_adam(model, args)
        scheduler = common.make_scheduler(optimizer, args, common.total_steps(args, len(loader)))
        if args.mixed_precision:
            bf16_inputs_fp32_logits(model)
        config = ds_config_from(args, dp_world)
        give_deepspeed_the_device(device)
        with saying_what_deepspeed_waits_for(device):
            model, optimizer, scheduler = parallelize(model, optimizer, scheduler, config)
        common.log(
            f"{SCRIPT}: world {world}, Ψ = {psi:,} parameters, {source} data "
            f"({len(train_set)} train / {len(test_set)} test), "
            f"batch {args.batch_size} = {dp_world} x {args.batch_size // dp_world}"
        )
        # the torch optimizer inside DeepSpeed's ZeRO optimizer: it holds the sharded state; at
        # stage 3 each parameter's own piece (ds_tensor) is held besides, not as a Parameter
        held = {}
        if args.stage == 3:
            held["working_bytes"] = lambda: [p.ds_tensor for p in model.module.parameters()]
        with common.Meter(model, optimizer.optimizer, args, device=device, held=held) as meter:
            out = train(model, optimizer, scheduler, loader, sampler, args, device)
        test_loader = common.test_loader(
            test_set, dp_rank, dp_world, pin_memory=device.type == "cuda"
        )
        acc = evaluate(model, test_loader, device)
        # every rank takes part and holds the whole; rank 0 saves
        if args.mixed_precision:
            state = full_master_state_dict(model)
        else:
            state = full_state_dict(model)
        if rank == 0 and args.save:
            common.save_checkpoint(state, args.save)
            common.log(f"saved {args.save}")
        common.report(
            SCRIPT,
            args,
            world=world,
            backend=backend,
            device=device,
            data=source,
            params=psi,
            trained=out,
            test_acc=acc,
            meter=meter,
            formula=formula(model.module, world, args, config, min(out["steps"], meter.steps)),
        )
    finally:
        cleanup()


def main():
    parser = common.get_parser("ZeRO through DeepSpeed's engine, on the common ViT")
    parser.add_argument(
        "--stage",
        type=int,
        choices=[1, 2, 3],
        default=1,
        help="1: shard the optimizer state, 2: + the gradients, 3: + the parameters",
    )
    parser.add_argument(
        "--offload",
        choices=["none", "cpu", "disk"],
        default="none",
        help="cpu: offload_optimizer (and at stage 3 offload_param) to the CPU; disk: both to "
        "NVMe files in --offload-dir, at --stage 3 only (DeepSpeed's NVMe offload)",
    )
    parser.add_argument(
        "--offload-dir", default=None, help="--offload disk: the nvme_path DeepSpeed writes to"
    )
    parser.add_argument(
        "--cpu-adam",
        action="store_true",
        help="with --offload cpu and --optim adamw: DeepSpeed's C++ CPU Adam for torch's AdamW",
    )
    parser.add_argument(
        "--mixed-precision",
        action="store_true",
        help="ds_config's bf16: bf16 parameters and compute, fp32 master weights in the partition",
    )
    parser.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="micro-batches per step: the ds_config's gradient_accumulation_steps",
    )
    parser.add_argument(
        "--ds-config", default=None, help="a ds_config.json of your own, checked against the flags"
    )
    args = common.parse_args(parser)
    import_deepspeed("cuda" if common.uses_gpus(args.backend) else "cpu")
    check_args(args, common.world_size(args))
    common.launch(run, args)


if __name__ == "__main__":
    main()
