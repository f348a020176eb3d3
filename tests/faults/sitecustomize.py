"""Fault injection for the reliability tests, loaded into every worker through PYTHONPATH.

FAULT=raise|hang|exit  FAULT_RANK=r  FAULT_STEP=k: on global rank r, just before its k-th
optimizer step (1-based), raise an exception, sleep forever, or exit(3). FAULT=exit-in-save: in
the k-th torch.save of rank r (to an open file), write half of its bytes, then exit(3). Only on
the first attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT 0), so a restarted group runs
clean.
OFFLINE=1: no connection to any host but this one (MNIST cannot be downloaded).
FAKE_MNIST=DIR: downloading MNIST copies DIR's IDX files, slowly, and logs who downloaded.
HIDE=PATH FAULT_RANK=r: on rank r that file does not exist (a node without the shared file system).
PROBE=DIR: what the first optimizer step of training did, seen from outside the script and written
to DIR/rank<r>.json at that step: `attention`, the attention calls made with grad enabled, by the
dtype of their queries (a checkpointed block runs its forward again during backward; autocast makes
the queries 16-bit). What autograd saved for backward is the Meter's `act_bytes`, in every RESULT.
MUTANT=name: a deliberate bug that breaks one promise, applied from outside (tests/test_mutants.py
lists them with the test that must fail under each). The scripts themselves carry no test hooks.
"""

import os

if os.environ.get("FAULT") and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    import time

    import torch.optim.optimizer as _opt

    _steps = {"n": 0}

    def _inject(optimizer, args, kwargs):
        if os.environ.get("RANK", "0") != os.environ.get("FAULT_RANK", "0"):
            return
        _steps["n"] += 1
        if _steps["n"] == int(os.environ.get("FAULT_STEP", "1")):
            kind = os.environ["FAULT"]
            if kind == "raise":
                raise RuntimeError(
                    f"injected fault on rank {os.environ.get('RANK')} at step {_steps['n']}"
                )
            if kind == "hang":
                time.sleep(3600)
            if kind == "exit":
                os._exit(3)

    _opt.register_optimizer_step_pre_hook(_inject)

    if os.environ["FAULT"] == "exit-in-save" and os.environ.get("RANK", "0") == os.environ.get(
        "FAULT_RANK", "0"
    ):
        # the FAULT_STEP-th torch.save of that rank writes half of its bytes, then the process
        # dies (killed mid-write)
        import io

        import torch

        _save, _saves = torch.save, {"n": 0}

        def _dying_save(obj, f, *args, **kwargs):
            _saves["n"] += 1
            if _saves["n"] != int(os.environ.get("FAULT_STEP", "1")):
                return _save(obj, f, *args, **kwargs)
            buffer = io.BytesIO()
            _save(obj, buffer, *args, **kwargs)
            f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            f.flush()
            os._exit(3)

        torch.save = _dying_save

if os.environ.get("OFFLINE"):
    # No connection leaves this machine: what a laptop without network (or CI) sees.
    import socket

    _create_connection = socket.create_connection

    def _offline(address, *args, **kwargs):
        if address[0] not in ("127.0.0.1", "localhost", "::1"):
            raise OSError(f"offline (tests/faults): no connection to {address[0]}")
        return _create_connection(address, *args, **kwargs)

    socket.create_connection = _offline

if os.environ.get("HIDE") and os.environ.get("RANK", "0") == os.environ.get("FAULT_RANK", "0"):
    import builtins

    _hidden, _exists, _open = os.path.abspath(os.environ["HIDE"]), os.path.exists, builtins.open

    def _is_hidden(path):
        return (
            isinstance(path, (str, bytes, os.PathLike))
            and os.path.abspath(os.fsdecode(path)) == _hidden
        )

    def _hidden_exists(path):
        return False if _is_hidden(path) else _exists(path)

    def _hidden_open(file, *args, **kwargs):
        if _is_hidden(file):
            raise FileNotFoundError(
                2, "No such file or directory (hidden by tests/faults)", str(file)
            )
        return _open(file, *args, **kwargs)

    os.path.exists, builtins.open = _hidden_exists, _hidden_open

if os.environ.get("PROBE"):
    import json

    import torch
    import torch.nn.functional as F
    import torch.optim.optimizer as _opt

    _probe = {"attention": {}}
    _sdpa = F.scaled_dot_product_attention

    def _attention(q, *args, **kwargs):
        if torch.is_grad_enabled():
            _probe["attention"][str(q.dtype)] = _probe["attention"].get(str(q.dtype), 0) + 1
        return _sdpa(q, *args, **kwargs)

    def _first_step(optimizer, args, kwargs):
        _probe_step.remove()
        F.scaled_dot_product_attention = _sdpa
        os.makedirs(os.environ["PROBE"], exist_ok=True)
        with open(
            os.path.join(os.environ["PROBE"], f"rank{os.environ.get('RANK', '0')}.json"), "w"
        ) as f:
            json.dump(dict(attention=_probe["attention"]), f)

    F.scaled_dot_product_attention = _attention
    _probe_step = _opt.register_optimizer_step_pre_hook(_first_step)

if os.environ.get("FAKE_MNIST"):
    # "Downloading" MNIST copies the IDX files from FAKE_MNIST, each in two halves with a pause
    # between them (a reader on another node could see a half-written file), and appends this
    # rank to FAKE_MNIST/downloads.log: how many ranks downloaded, and which.
    import time

    from torchvision.datasets import MNIST

    def _fake_download(self):
        if self._check_exists():  # as torchvision's own download() does
            return
        source = os.environ["FAKE_MNIST"]
        with open(os.path.join(source, "downloads.log"), "a") as log:
            log.write(f"rank {os.environ.get('RANK', '0')}\n")
        os.makedirs(self.raw_folder, exist_ok=True)
        for name in sorted(os.listdir(source)):
            if not name.endswith("ubyte"):
                continue
            with open(os.path.join(source, name), "rb") as f:
                data = f.read()
            with open(os.path.join(self.raw_folder, name), "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                time.sleep(0.5)
                f.write(data[len(data) // 2 :])

    MNIST.download = _fake_download

if os.environ.get("MUTANT"):
    import importlib.abc
    import sys

    import torch
    import torch.distributed as dist

    _mutant = os.environ["MUTANT"]
    _after_import = {}  # module name -> patch applied right after it is imported

    class _PatchOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname not in _after_import:
                return None
            for finder in sys.meta_path:
                if finder is self:
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    spec.loader.exec_module = self.then_patch(spec.loader.exec_module, fullname)
                    return spec
            return None

        @staticmethod
        def then_patch(exec_module, fullname):
            def exec_and_patch(module):
                exec_module(module)
                _after_import[fullname](module)

            return exec_and_patch

    sys.meta_path.insert(0, _PatchOnImport())

    if _mutant == "sampler-same-shard":  # every rank trains on rank 0's shard
        from torch.utils.data import DistributedSampler

        _init = DistributedSampler.__init__
        DistributedSampler.__init__ = lambda self, ds, num_replicas=None, rank=None, *a, **k: _init(
            self, ds, num_replicas, 0, *a, **k
        )
    elif _mutant == "ddp-sum":  # DDP sums the gradients instead of averaging them
        from torch.nn.parallel import DistributedDataParallel as _DDP

        _ddp_init = _DDP.__init__

        def _summing(self, *a, **k):
            _ddp_init(self, *a, **k)
            self.register_comm_hook(
                None,
                lambda state, bucket: (
                    dist.all_reduce(bucket.buffer(), async_op=True)
                    .get_future()
                    .then(lambda f: f.value()[0])
                ),
            )

        _DDP.__init__ = _summing
    elif _mutant == "eval-counts-padding":  # evaluation counts the padding samples too

        def _keep_all(common):
            getitem = common._Masked.__getitem__
            common._Masked.__getitem__ = lambda self, i: (*getitem(self, i)[:2], True)
            getitems = common._Masked.__getitems__  # the loader's batched fetch
            common._Masked.__getitems__ = lambda self, indices: [
                (x, y, True) for x, y, _ in getitems(self, indices)
            ]

        _after_import["common"] = _keep_all
    elif _mutant == "resume-forgets-schedule":  # a resumed run restarts its learning-rate schedule
        torch.optim.lr_scheduler.LRScheduler.load_state_dict = lambda self, state: None
        torch.optim.lr_scheduler.LambdaLR.load_state_dict = lambda self, state: None
    elif _mutant in ("no-checkpoint", "checkpoint-stops-after-first-step"):
        # activation checkpointing does nothing: from the start, or once the first optimizer step
        # is done (a global step hook, so it sees every optimizer the script builds)
        import torch.utils.checkpoint
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _checkpoint = torch.utils.checkpoint.checkpoint
        _checkpointing = _mutant != "no-checkpoint"

        def _stop_checkpointing(optimizer, args, kwargs):
            global _checkpointing
            _checkpointing = False

        def _checkpoint_until_stopped(function, *args, use_reentrant=None, **kwargs):
            if not _checkpointing:
                return function(*args, **kwargs)
            return _checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)

        register_optimizer_step_post_hook(_stop_checkpointing)
        torch.utils.checkpoint.checkpoint = _checkpoint_until_stopped
    elif _mutant in ("no-autocast", "autocast-stops-after-first-step"):
        # mixed precision does nothing: from the start, or once the first optimizer step is done
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _autocast_init = torch.autocast.__init__
        _autocasting = _mutant != "no-autocast"

        def _stop_autocasting(optimizer, args, kwargs):
            global _autocasting
            _autocasting = False

        def _autocast_until_stopped(
            self, device_type, dtype=None, enabled=True, cache_enabled=None
        ):
            enabled = enabled and _autocasting
            _autocast_init(
                self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled
            )

        register_optimizer_step_post_hook(_stop_autocasting)
        torch.autocast.__init__ = _autocast_until_stopped
    elif _mutant == "no-clip":  # gradient clipping does nothing
        torch.nn.utils.clip_grad_norm_ = lambda parameters, max_norm, *a, **k: torch.zeros(())
    elif (
        _mutant == "zero-no-average"
    ):  # ZeRO reduce-scatters the sum of the gradients, not the mean
        _rs = dist.reduce_scatter_tensor

        def _sum_scatter(output, input, *a, **k):
            input.mul_(dist.get_world_size())
            return _rs(output, input, *a, **k)

        dist.reduce_scatter_tensor = _sum_scatter
    elif _mutant in (
        "fsdp-sum",
        "nd-fsdp-sum",
    ):  # FSDP sums the gradients instead of averaging them
        import torch.distributed.fsdp as _fsdp

        _fully_shard = _fsdp.fully_shard

        def _summing_shard(module, *a, **k):
            out = _fully_shard(module, *a, **k)
            out.set_gradient_divide_factor(1.0)
            # a plain sum on every backend (Gloo has no PREMUL_SUM), so the test fails on the
            # numbers, not on a crash
            out.set_force_sum_reduction_for_comms(True)
            return out

        _summing_shard.state = _fully_shard.state  # torch.distributed.pipelining reads it
        _fsdp.fully_shard = _summing_shard
    elif _mutant == "tp-f-identity":  # tensor parallel's f does no all-reduce in backward
        _ar = dist.all_reduce
        dist.all_reduce = lambda t, *a, **k: (
            None if t.dim() == 3 and not torch.is_grad_enabled() else _ar(t, *a, **k)
        )
    elif (
        _mutant == "pipeline-unpaired"
    ):  # pipeline sends and receives one op per group (NCCL deadlocks)

        def _unpair(pipeline):
            p2p = pipeline.p2p
            pipeline.p2p = lambda ops, group=None: [p2p([op], group) for op in ops]

        _after_import["pipeline"] = _unpair
    elif (
        _mutant == "schedules-unpaired"
    ):  # pipeline_schedules.py sends and receives one op per group

        def _unpair_schedules(schedules):
            p2p = schedules.p2p
            schedules.p2p = lambda ops, group=None: [p2p([op], group) for op in ops]

        _after_import["pipeline_schedules"] = _unpair_schedules
    elif _mutant == "pipedream-eager-send":  # PipeDream posts its closing send at once (hangs)

        def _eager(pipedream):
            train_step = pipedream.train_step

            def eager_train_step(stage, *args, **kwargs):
                loss = train_step(stage, *args, **kwargs)
                if stage.pending:
                    pipedream.p2p(stage.pending, stage.group)
                    stage.pending = []
                return loss

            pipedream.train_step = eager_train_step

        _after_import["pipeline_pipedream"] = _eager
    elif (
        _mutant == "cp-head-not-summed"
    ):  # context parallelism: the head averages this rank's tokens only
        _ar2 = dist.all_reduce
        dist.all_reduce = lambda t, *a, **k: (
            None if t.dim() == 2 and t.is_floating_point() else _ar2(t, *a, **k)
        )
    elif _mutant == "ep-dense-sum":  # expert parallelism: the dense gradients summed, not averaged
        _ar1 = dist.all_reduce

        class _TimesWorldOnWait:  # an async all-reduce (bucketed gradients): scaled once done
            def __init__(self, work, tensor):
                self.work = work
                self.tensor = tensor

            def wait(self, *a, **k):
                done = self.work.wait(*a, **k)
                self.tensor.mul_(dist.get_world_size())
                return done

        def _summed(t, *a, **k):
            work = _ar1(t, *a, **k)
            if not (t.dim() == 1 and t.is_floating_point()):
                return work
            if work is None:  # a blocking all-reduce: t holds the sum already
                t.mul_(dist.get_world_size())
                return None
            return _TimesWorldOnWait(work, t)

        dist.all_reduce = _summed
    elif _mutant == "zero-untied":  # ZeRO leaves a tied parameter's later use untied

        def _untie(zero):
            # the later module keeps its own Parameter where the first one's tensor belongs: the
            # head's wte.weight neither gets the embedding's updates nor gives it its gradient
            zero.UserUnits.tie_later_uses = lambda self, model, modules: None

        _after_import["zero"] = _untie
    elif _mutant == "zero-last-backward":  # ZeRO keeps only a step's last backward's gradient

        def _forget_accumulated(zero):
            start_flat_grad = zero.ZeRO.start_flat_grad

            def start_forgetting(self, unit):
                start_flat_grad(self, unit)
                unit.grad_shard = None  # the earlier backward passes' average, dropped

            zero.ZeRO.start_flat_grad = start_forgetting

        _after_import["zero"] = _forget_accumulated
    elif _mutant == "zero-clip-before-shards":  # ZeRO clips before the shards have gradients

        def _clip_early(script):
            def shards_as_they_are(engine):
                # the pieces' .grad as they are after backward: none yet, the step hook hands them
                return [
                    piece.grad
                    for unit in engine.units
                    for _, _, piece in unit.pieces
                    if piece.grad is not None
                ]

            script.gradient_shards = shards_as_they_are

        _after_import["zero"] = _clip_early
        _after_import["zero_offload"] = _clip_early
    elif _mutant == "zero-tied-only-unit-dropped":  # ZeRO: a tied-only unit left out

        def _drop_tied_only(script):
            parallelize = script.parallelize

            def parallelize_dropping(model, *args, units, **kw):
                seen = set()
                kept = []
                for module in units:
                    own = [param for param in module.parameters() if param not in seen]
                    seen.update(own)
                    if own:
                        kept.append(module)
                return parallelize(model, *args, units=kept, **kw)

            script.check_units = lambda model, modules: None
            script.parallelize = parallelize_dropping

        _after_import["zero"] = _drop_tied_only
        _after_import["zero_offload"] = _drop_tied_only
    elif _mutant == "save-bypasses-state-dict-hooks":  # ZeRO saves its parameters by name

        def _parameters_only(zero):
            # the whole parameters under their names, as before issue 40: no state_dict hook runs
            # (Llama's wqkv is saved fused) and no buffer is saved (freqs_cis)
            zero.full_state_dict = lambda model: model.zero.gather_parameters()

        _after_import["zero"] = _parameters_only
    elif _mutant == "pipeline-tied-unsummed":  # pipeline: each tied copy steps on its stage's part

        def _unsummed(pipeline):
            pipeline.all_reduce_tied = lambda stage: None

        _after_import["pipeline"] = _unsummed
    elif _mutant in ("pipeline-fp32-buffers", "schedules-fp32-buffers"):  # default-dtype buffers

        def _fp32_buffers(module):
            import torch

            def fp32_empty(stage, samples, device):
                return torch.empty(samples, *stage.activation_shape, device=device)

            module.Stage.empty = fp32_empty

        _module = "pipeline" if _mutant == "pipeline-fp32-buffers" else "pipeline_schedules"
        _after_import[_module] = _fp32_buffers
    elif _mutant == "pipeline-stage-without-mask":  # the stages call their blocks without a mask

        def _without_mask(pipeline):
            parallelize = pipeline.parallelize

            def parallelize_without_mask(model, *args, **kwargs):
                stage = parallelize(model, *args, **kwargs)
                block_arguments = stage.parts.block_arguments

                def arguments_without_mask(stage, inputs, x):
                    arguments = block_arguments(stage, inputs, x)
                    if isinstance(arguments, dict):  # HF's keywords: attention_mask=None
                        arguments = {**arguments, "attention_mask": None}
                    return arguments

                stage.parts = stage.parts._replace(block_arguments=arguments_without_mask)
                return stage

            pipeline.parallelize = parallelize_without_mask

        _after_import["pipeline"] = _without_mask
    elif _mutant == "pipeline-clip-local-norm":  # pipeline: each stage clips by its own norm

        def _local_norm(pipeline):
            import torch

            def clip_by_stage_norm(stage, max_norm, group=None):
                return torch.nn.utils.clip_grad_norm_(stage.parameters(), max_norm)

            pipeline.clip_grad_norm_ = clip_by_stage_norm

        _after_import["pipeline"] = _local_norm
    elif _mutant == "tp-clip-local-norm":  # TP: each rank clips by the norm of its own shards

        def _tp_local_norm(tensor_parallel):
            import torch

            def clip_by_own_shards(model, max_norm, group=None):
                return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

            tensor_parallel.clip_grad_norm_ = clip_by_own_shards

        _after_import["tensor_parallel"] = _tp_local_norm
    elif _mutant in ("zero-one-group", "zero-offload-one-group"):  # the groups dropped

        def _one_group(script):
            parallelize = script.parallelize

            def parallelize_one_group(model, device, stage, *, param_groups=None, **kw):
                # every parameter in the first group, with the first group's settings
                if param_groups:
                    params = [param for group in param_groups for param in group["params"]]
                    param_groups = [{**param_groups[0], "params": params}]
                return parallelize(model, device, stage, param_groups=param_groups, **kw)

            script.parallelize = parallelize_one_group

        script = "zero" if _mutant == "zero-one-group" else "zero_offload"
        _after_import[script] = _one_group
    elif _mutant == "tp-sp-accumulation":  # TP+SP sums the partial gradients in .grad, as before

        def _sum_in_grad(tensor_parallel):
            import torch

            def keep(self, param, grad):
                return grad  # into .grad, where the step's earlier backward passes' sums are

            def sum_when_all_arrived(self, _param):
                self.accumulated += 1
                if self.accumulated < len(self.params):
                    return
                self.accumulated = 0
                flat = torch.cat([param.grad.flatten() for param in self.params])
                summed = tensor_parallel.all_reduce(flat).split([p.numel() for p in self.params])
                for param, grad in zip(self.params, summed, strict=True):
                    param.grad.copy_(grad.view_as(param))

            tensor_parallel.PartialGradientSum.hold = keep
            tensor_parallel.PartialGradientSum.hook = sum_when_all_arrived

        _after_import["tensor_parallel"] = _sum_in_grad
    elif _mutant == "ep-clip-local-experts":  # EP's clip: the experts' norms not summed over ranks

        def _local_expert_norms(expert_parallel):
            clip_grad_norm_ = expert_parallel.clip_grad_norm_

            def clip_by_local_experts(model, max_norm, group=None):
                # the clip's one scalar all-reduce (the experts' squared norm) skipped: each rank
                # counts its own experts only
                all_reduce = dist.all_reduce
                dist.all_reduce = lambda t, *a, **k: (
                    None if t.dim() == 0 else all_reduce(t, *a, **k)
                )
                try:
                    return clip_grad_norm_(model, max_norm, group)
                finally:
                    dist.all_reduce = all_reduce

            expert_parallel.clip_grad_norm_ = clip_by_local_experts

        _after_import["expert_parallel"] = _local_expert_norms
    elif _mutant == "ep-shared-communicator":  # EP: the dense all-reduces on the all-to-alls' group

        def _shared_group(expert_parallel):
            expert_parallel.own_group = lambda data_group=None: data_group or dist.group.WORLD

        _after_import["expert_parallel"] = _shared_group
    elif _mutant == "ep-buckets-start-when-complete":  # EP: where a bucket starts depends on rank

        def _start_when_complete(expert_parallel):
            averager = expert_parallel.GradientAverager
            wait = averager.wait

            def grad_ready_hook(self, index):
                def grad_ready(param):  # the old rule: the next bucket starts once all arrived
                    self.averaged = False
                    self.arrived = getattr(self, "arrived", set()) | {id(param)}
                    while len(self.in_flight) < len(self.buckets) and all(
                        id(p) in self.arrived for p in self.buckets[len(self.in_flight)]
                    ):
                        self.launch()

                return grad_ready

            def wait_and_forget(self, *args):
                self.arrived = set()
                return wait(self, *args)

            averager.output_hook = lambda self, m: lambda *args: None
            averager.grad_ready_hook = grad_ready_hook
            averager.wait = wait_and_forget

        _after_import["expert_parallel"] = _start_when_complete
    elif _mutant == "ep-stacked-wrong-rank":  # EP: stacked experts sliced at another rank's rows

        def _next_ranks_rows(expert_parallel):
            keep_own_experts = expert_parallel.StackedExperts.keep_own_experts

            def keep_next_ranks(self, experts, owned):
                # the rows of the next rank's experts, while the routing sends this rank the
                # tokens of its own
                first = (owned.start + len(owned)) % self.num_experts
                keep_own_experts(self, experts, range(first, first + len(owned)))

            expert_parallel.StackedExperts.keep_own_experts = keep_next_ranks

        _after_import["expert_parallel"] = _next_ranks_rows
    elif _mutant == "cp-loss-rank-mean":  # context parallelism: the mean of each rank's mean

        def _rank_mean(context_parallel):
            causal_lm_loss = context_parallel.causal_lm_loss

            def mean_of_rank_means(logits, targets, group=None, ignore_index=-100):
                causal_lm_loss(logits, targets, group, ignore_index)  # its checks, not its mean
                group = group or dist.group.WORLD
                loss = torch.nn.functional.cross_entropy(
                    logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index
                )
                return context_parallel.SumOverRanks.apply(loss / dist.get_world_size(group), group)

            context_parallel.causal_lm_loss = mean_of_rank_means

        _after_import["context_parallel"] = _rank_mean
    elif _mutant in ("cp-positions-from-zero", "cp-llama-positions-from-zero"):  # CP: 0..T/W-1

        def _from_zero(context_parallel):
            split_batch = context_parallel.split_batch

            def split_at_zero(x, y, group=None, zigzag=False):
                x, y, positions = split_batch(x, y, group, zigzag)
                return x, y, torch.arange(positions.numel(), device=positions.device)

            context_parallel.split_batch = split_at_zero

        _after_import["context_parallel"] = _from_zero
    elif _mutant == "cp-targets-checked-alone":  # context parallelism: a bad target raises alone

        def _alone(context_parallel):
            causal_lm_loss = context_parallel.causal_lm_loss

            def loss_raising_alone(logits, targets, group=None, ignore_index=-100):
                # cross_entropy on this rank's targets first: it raises on their rank only
                torch.nn.functional.cross_entropy(
                    logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index
                )
                return causal_lm_loss(logits, targets, group, ignore_index)

            context_parallel.causal_lm_loss = loss_raising_alone

        _after_import["context_parallel"] = _alone
    elif _mutant == "cp-shared-communicator":  # context parallelism: attention on DDP's group

        def _ddp_group(context_parallel):
            context_parallel.own_group = lambda group: group

        _after_import["context_parallel"] = _ddp_group
    elif _mutant == "cp-index-per-call":  # context parallelism: index tensors built at every call

        def _emptied_before_each_call(cached):
            def call(*args):
                cached.cache_clear()  # lru_cache's public reset: every call builds anew
                return cached(*args)

            return call

        def _uncached(context_parallel):
            for name in ("positions_on", "zigzag_positions_on", "future_mask", "gathered_order"):
                cached = getattr(context_parallel, name)
                setattr(context_parallel, name, _emptied_before_each_call(cached))

        _after_import["context_parallel"] = _uncached
    elif _mutant == "zero-bf16-master":  # ZeRO --mixed-precision keeps its master weights in bf16

        def _bf16_master(zero):
            import torch
            import torch.nn as nn

            keep = zero.keep_master_in_fp32

            def keep_in_bf16(unit, rank, stage):
                keep(unit, rank, stage)
                unit.master = unit.master.to(torch.bfloat16)
                pieces = [
                    (group, own, nn.Parameter(unit.master[own])) for group, own, _ in unit.pieces
                ]
                unit.pieces = pieces

            zero.keep_master_in_fp32 = keep_in_bf16

        _after_import["zero"] = _bf16_master
    elif _mutant == "zero-bf16-not-refreshed":  # the bf16 copy never takes the stepped master

        def _not_refreshed(zero):
            engine = zero.MixedPrecision
            engine.after_step = lambda self: super(engine, self).after_step()

        _after_import["zero"] = _not_refreshed
    elif _mutant == "zero-bf16-reduce":  # ZeRO --mixed-precision reduce-scatters bf16 gradients

        def _bf16_reduce(zero):
            engine = zero.MixedPrecision

            def start_in_bf16(self, unit):
                if self.mixed_precision and unit.flat_grad is None:
                    unit.flat_grad = unit.flat.new_zeros(unit.flat.numel())  # bf16, as flat
                super(engine, self).start_flat_grad(unit)

            def keep_in_fp32(self, unit, average):
                super(engine, self).keep_average(unit, average.float())  # the step reads fp32

            engine.start_flat_grad = start_in_bf16
            engine.keep_average = keep_in_fp32

        _after_import["zero"] = _bf16_reduce
    elif _mutant == "zero1-reduces-every-backward":  # gradient_accumulation_steps ignored

        def _reduce_every_backward(zero):
            engine = zero.Accumulation
            engine.reduce_scatter = lambda self, unit: super(engine, self).reduce_scatter(unit)

        _after_import["zero"] = _reduce_every_backward
    elif _mutant == "zero-formula-untied":  # formula() without the tied unit's second gather

        def _untied_formula(zero):
            formula = zero.formula

            def without_tie(psi, world, args, *a, tied=0, **k):
                if a[1:]:  # tied passed by position, after dtype
                    a = (a[0], 0, *a[2:])
                return formula(psi, world, args, *a, **k)

            zero.formula = without_tie

        _after_import["zero"] = _untied_formula
    elif _mutant == "zero-world-group":  # ZeRO's reduce-scatter forgets its group: the world's
        _rs_on_group = dist.reduce_scatter_tensor

        def _rs_on_world(output, input, *a, group=None, **k):
            return _rs_on_group(output, input, *a, **k)

        dist.reduce_scatter_tensor = _rs_on_world
    elif _mutant == "tp-world-group":  # TP's f and g all-reduce over the world, not their group

        def _tp_on_world(tensor_parallel):
            all_reduce = tensor_parallel.all_reduce
            tensor_parallel.all_reduce = lambda partial, group=None: all_reduce(partial)

        _after_import["tensor_parallel"] = _tp_on_world
    elif _mutant == "tp-f-twice":  # TP's f on the attention's and MLP's input too, as it once was

        def _f_twice(tensor_parallel):
            split_block = tensor_parallel.split_block

            def split_block_f_twice(block, plan, f, g, group=None):
                split_block(block, plan, f, g, group)
                copy = tensor_parallel.CopyToTensorParallel
                for module in block.modules():
                    children = list(module.children())
                    if any(isinstance(c, tensor_parallel.ColumnParallelLinear) for c in children):
                        tensor_parallel.hook_first_argument(module, copy, group)

            tensor_parallel.split_block = split_block_f_twice

        _after_import["tensor_parallel"] = _f_twice
    elif _mutant == "tp-save-bypasses-state-dict-hooks":  # TP saves its tensors by name

        def _tensors_by_name(tensor_parallel):
            import torch

            full_state_dict = tensor_parallel.full_state_dict

            def by_name(module, *args, **kwargs):
                # the whole tensors under their names, as before issue 40: no state_dict hook
                # runs (Llama's wqkv is saved fused)
                named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]
                return dict(named)

            def full_state_dict_by_name(model, group=None):
                state_dict = torch.nn.Module.state_dict
                torch.nn.Module.state_dict = by_name
                try:
                    return full_state_dict(model, group)
                finally:
                    torch.nn.Module.state_dict = state_dict

            tensor_parallel.full_state_dict = full_state_dict_by_name

        _after_import["tensor_parallel"] = _tensors_by_name
    elif _mutant == "pipeline-world-peers":  # the stages' messages name their peers in the world

        def _peers_in_world(pipeline):
            p2p = pipeline.p2p
            pipeline.p2p = lambda ops, group=None: p2p(ops)

        _after_import["pipeline"] = _peers_in_world
    elif _mutant == "workers-epoch-copied":  # the dataset's epoch a plain attribute again

        def _plain_epoch(common):
            # a DataLoader worker holds a copy made when it started: it never sees set_epoch
            common.Digits.set_epoch = lambda self, epoch: setattr(self, "plain_epoch", epoch)
            common.Digits.epoch = property(lambda self: getattr(self, "plain_epoch", 0))

        _after_import["common"] = _plain_epoch
    elif _mutant == "hybrid-loss-every-rank":  # hybrid: the loss averaged over all W ranks

        def _every_rank(hybrid_parallel):
            train = hybrid_parallel.train

            def train_over_every_rank(model, optimizer, scheduler, loader, sampler, args, *a):
                out = train(model, optimizer, scheduler, loader, sampler, args, *a)
                # W/pp ranks (the last stage's) hold a loss: divided by W, it is pp times too small
                return dict(out, loss=out["loss"] / args.pp)

            hybrid_parallel.train = train_over_every_rank

        _after_import["hybrid_parallel"] = _every_rank
    elif _mutant == "hybrid-ep-clip-world":  # hybrid, data x expert: the experts' norm on the world

        def _ep_clip_on_world(hybrid_parallel):
            clip_grad_norm_ = hybrid_parallel.expert_parallel.clip_grad_norm_

            def clip_over_the_world(model, max_norm, group=None):
                return clip_grad_norm_(model, max_norm)

            hybrid_parallel.expert_parallel.clip_grad_norm_ = clip_over_the_world

        _after_import["hybrid_parallel"] = _ep_clip_on_world
    elif _mutant == "hybrid-zero1-every-micro-batch":  # zero.py's engine not told m a step

        def _engine_told_nothing(hybrid_parallel):
            part = hybrid_parallel.ReduceOnceAStep
            part.shard = lambda self, *args, **options: super(part, self).shard(*args, **options)

        _after_import["hybrid_parallel"] = _engine_told_nothing
    elif _mutant == "deepspeed-loss-divided-twice":  # the loss divided by gas before the engine's

        def _divide_again(engine_module):
            # a loop that divides its loss by the accumulation steps, as for plain torch, before
            # engine.backward, which divides it by them again (or, told scale_wrt_gas=False, once
            # where the loss was already over the step's global count of targets)
            backward = engine_module.DeepSpeedEngine.backward

            def backward_of_a_divided_loss(engine, loss, *args, **kwargs):
                divided = loss / engine.gradient_accumulation_steps()
                return backward(engine, divided, *args, **kwargs)

            engine_module.DeepSpeedEngine.backward = backward_of_a_divided_loss

        _after_import["deepspeed.runtime.engine"] = _divide_again
    elif _mutant == "deepspeed-save-parameters-by-name":  # DeepSpeed's save without state_dict()

        def _parameters_by_name(deepspeed_zero):
            def full_state_dict_by_name(engine):
                # every parameter whole, under its name: no hook runs (Llama's wqkv saved fused),
                # no buffer is saved (freqs_cis), a tied one once
                params = list(engine.module.parameters())
                stage_3 = engine.zero_optimization_stage() == 3
                gathered = deepspeed_zero.deepspeed.zero.GatheredParameters(params, enabled=stage_3)
                with gathered:
                    named = engine.module.named_parameters()
                    return {name: param.detach().clone() for name, param in named}

            deepspeed_zero.full_state_dict = full_state_dict_by_name

        _after_import["deepspeed_zero"] = _parameters_by_name
    elif _mutant == "offload-bf16-refreshed-twice":  # the bf16 shard written on the compute stream

        def _refreshed_again(zero_offload):
            # the mixed-precision part's refresh after the copy stream's: the master copied twice
            parent = zero_offload.MixedPrecision
            zero_offload.ZeROOffload.refresh_working_copy = parent.refresh_working_copy

        _after_import["zero_offload"] = _refreshed_again
    elif _mutant == "offload-disk-bf16-master":  # the files' masters rounded to bf16 each write

        def _rounded_files(zero_offload):
            save = zero_offload.save_atomically

            def save_rounded(state, path):
                state["master"] = state["master"].bfloat16().float()  # small updates lost
                save(state, path)

            zero_offload.save_atomically = save_rounded

        _after_import["zero_offload"] = _rounded_files
    else:
        raise SystemExit(f"tests/faults: unknown MUTANT={_mutant}")
