"""The tests bite: each mutant (tests/faults/sitecustomize.py, MUTANT=name) breaks one promise from
outside the scripts, and the test that guards that promise must fail under it. Each row runs only
its guarding test, in a fresh pytest process whose every launch carries the mutant."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import ROOT

pytestmark = pytest.mark.full  # minutes of reruns: the full tier (`python -m pytest -m full`)

# mutant -> (the promise it breaks, the test in tests/ that must fail under it)
MUTANTS = {
    "sampler-same-shard": (
        "every rank trains on rank 0's shard",
        "test_ddp.py::test_ddp_equals_one_process[sgd-W2-torchrun]",
    ),
    "ddp-sum": (
        "DDP sums the gradients",
        "test_ddp.py::test_ddp_equals_one_process[sgd-W2-torchrun]",
    ),
    "eval-counts-padding": (
        "evaluation counts the padding",
        "test_ddp.py::test_distributed_accuracy_equals_one_process_accuracy",
    ),
    "resume-forgets-schedule": (
        "a resume restarts the schedule",
        "test_ddp.py::test_snapshot_resume_equals_uninterrupted",
    ),
    "no-checkpoint": (
        "checkpoint() runs the block plainly",
        "test_amp_checkpoint.py::test_checkpointed_blocks_run_forward_twice_in_training[ckpt]",
    ),
    "checkpoint-stops-after-first-step": (
        "checkpointing off after step 1",
        "test_amp_checkpoint.py::test_checkpointed_blocks_recompute_in_every_step",
    ),
    "no-autocast": (
        "autocast disabled",
        "test_amp_checkpoint.py::test_bf16_is_active",
    ),
    "autocast-stops-after-first-step": (
        "autocast off after step 1",
        "test_amp_checkpoint.py::test_autocast_in_every_step",
    ),
    "no-clip": (
        "clip_grad_norm_ does nothing",
        "test_amp_checkpoint.py::test_clip_bounds_every_step",
    ),
    "zero-no-average": (
        "ZeRO's reduce-scatter sums",
        "test_zero.py::test_stage_equals_one_ddp_process[2-3-sgd]",
    ),
    "fsdp-sum": (
        "FSDP sums the gradients",
        "test_fsdp.py::test_equals_ddp_one_process[W2-sgd]",
    ),
    "tp-f-identity": (
        "TP's f skips its backward all-reduce",
        "test_tensor_parallel.py::test_same_parameters_as_ddp_one_process[W2-tp-sgd]",
    ),
    "pipeline-unpaired": (
        "one op per batch_isend_irecv",
        "test_pipeline.py::test_p2p_order_is_nccl_safe",
    ),
    "schedules-unpaired": (
        "one op per batch_isend_irecv",
        "test_pipeline_schedules.py::test_p2p_order_is_nccl_safe[2]",
    ),
    "pipedream-eager-send": (
        "PipeDream's closing send posted at once",
        "test_pipeline_pipedream.py::test_p2p_order_is_nccl_safe[2]",
    ),
    "cp-head-not-summed": (
        "the head pools this rank's tokens only",
        "test_context_parallel.py::test_same_parameters_as_ddp_one_process[ring-W2-sgd]",
    ),
    "ep-dense-sum": (
        "EP sums the dense gradients",
        "test_expert_parallel.py::test_equals_one_ddp_process[W2-E4-K2-sgd]",
    ),
    "zero-untied": (
        "ZeRO unties lm_head.weight from wte.weight",
        "test_copy.py::test_zero_equals_one_process[1-sgd]",
    ),
    "zero-last-backward": (
        "ZeRO drops all but a step's last backward",
        "test_copy.py::test_zero_equals_one_process[2-adamw]",
    ),
    "zero-one-group": (
        "ZeRO puts every parameter in one group",
        "test_copy.py::test_zero_equals_one_process[1-adamw]",
    ),
    "zero-offload-one-group": (
        "ZeRO-Infinity steps every piece with one group's settings",
        "test_copy.py::test_zero_offload_equals_one_process[disk-3-adamw]",
    ),
    "zero-clip-before-shards": (
        "ZeRO clips before the shards have their gradients",
        "test_copy_nanogpt.py::test_equals_one_process[zero-zero2-sgd]",
        "test_zero.py::test_clip_equals_one_ddp_process_clip",
    ),
    "zero-tied-only-unit-dropped": (
        "ZeRO leaves out a unit holding only the tied weight",
        "test_copy_nanogpt.py::test_equals_one_process[zero-zero3-sgd]",
    ),
    "save-bypasses-state-dict-hooks": (
        "ZeRO saves its parameters by name, not through the model's own state_dict()",
        "test_copy_llama.py::test_save_is_the_models_state_dict[zero-llama-zero3-adamw]",
    ),
    "tp-sp-accumulation": (
        "TP+SP counts a step's earlier backward W times",
        "test_copy.py::test_tensor_parallel_equals_one_process[sgd-sp]",
    ),
    "pipeline-tied-unsummed": (
        "pipeline: the tied copies' gradients not summed",
        "test_copy.py::test_pipeline_equals_one_process[pipeline-sgd]",
    ),
    "pipeline-fp32-buffers": (
        "pipeline: receive buffers in the default dtype, not the boundary's",
        "test_copy.py::test_pipeline_bf16_equals_one_process_bf16[pipeline-bf16-sgd]",
    ),
    "schedules-fp32-buffers": (
        "pipeline_schedules: receive buffers in the default dtype, not the boundary's",
        "test_copy.py::test_pipeline_bf16_equals_one_process_bf16"
        "[pipeline_schedules-zb-h1-bf16-sgd]",
    ),
    "pipeline-stage-without-mask": (
        "pipeline: the stages call HF GPT-2's eager blocks without the causal mask",
        "test_copy_llama.py::test_equals_one_process[pipeline-gpt2-pipeline-eager-sgd]",
    ),
    "pipeline-clip-local-norm": (
        "pipeline: each stage clips by its own norm",
        "test_copy_nanogpt.py::test_equals_one_process[pipeline-pipeline-sgd]",
        "test_pipeline.py::test_clip_equals_one_ddp_process_clip[p2-1f1b-m4-sgd]",
    ),
    "tp-clip-local-norm": (
        "TP: each rank clips by the norm of its own shards",
        "test_copy_nanogpt.py::test_equals_one_process[tensor_parallel-tensor_parallel-tp-sgd]",
        "test_tensor_parallel.py::test_clip_equals_one_ddp_process_clip[W2-sp-sgd-clip]",
    ),
    "nd-fsdp-sum": (
        "N-D: FSDP sums under a pipeline",
        "test_nd_parallel.py::test_same_parameters_as_ddp_one_process[R1S2T1P2-sgd]",
    ),
    "ep-clip-local-experts": (
        "EP clips by a norm of this rank's experts only",
        "test_expert_parallel.py::test_clip_equals_one_ddp_process_clip[W2-E4-K2-sgd-clip]",
    ),
    "ep-shared-communicator": (
        "EP all-reduces the dense gradients on the all-to-alls' group",
        "test_expert_parallel.py::test_dispatch_combine_equals_loop_over_experts",
    ),
    "ep-buckets-start-when-complete": (
        "EP starts a bucket where its gradients complete, which depends on the rank",
        "test_expert_parallel.py::test_dispatch_combine_equals_loop_over_experts",
    ),
    "ep-stacked-wrong-rank": (
        "EP keeps another rank's rows of the stacked experts",
        "test_copy_llama.py::test_equals_one_process[expert_parallel-llama-expert_parallel-sgd]",
    ),
    "cp-loss-rank-mean": (
        "CP averages each rank's mean loss (rank 0 has a target fewer)",
        "test_copy_nanogpt.py::test_equals_one_process"
        "[context_parallel-context_parallel-ring-contiguous-sgd]",
    ),
    "cp-positions-from-zero": (
        "CP embeds every rank's tokens at positions 0..T/W-1",
        "test_copy_nanogpt.py::test_context_parallel_split_the_sequence"
        "[context_parallel-context_parallel-ring-zigzag-sgd]",
    ),
    "cp-llama-positions-from-zero": (
        "CP gives Llama's RoPE positions 0..T/W-1 on every rank (SGD moves < 1e-6; AdamW sees it)",
        "test_copy_llama.py::test_equals_one_process"
        "[context_parallel-llama-context_parallel-ring-zigzag-adamw]",
    ),
    "cp-targets-checked-alone": (
        "CP: a bad target raises on its rank alone",
        "test_context_parallel.py::test_errors_are_said_on_every_rank",
    ),
    "cp-shared-communicator": (
        "CP sends the ring's blocks on DDP's process group",
        "test_context_parallel.py::test_attention_on_its_own_process_group",
    ),
    "zero-bf16-master": (
        "ZeRO --mixed-precision keeps its master weights in bf16",
        "test_zero.py::test_mixed_precision_dtypes[1]",
    ),
    "zero-bf16-not-refreshed": (
        "ZeRO --mixed-precision never refreshes its bf16 copy from the stepped master",
        "test_zero.py::test_mixed_precision_dtypes[3]",
    ),
    "zero-bf16-reduce": (
        "ZeRO --mixed-precision reduce-scatters its gradients in bf16",
        "test_zero.py::test_mixed_precision_dtypes[1]",
    ),
    "offload-bf16-refreshed-twice": (
        "ZeRO-Offload --mixed-precision copies the stepped master into the bf16 shard twice a step",
        "test_zero_offload.py::test_offload_cpu_copies_run_on_a_side_stream[3-True]",
    ),
    "offload-disk-bf16-master": (
        "ZeRO-Infinity --mixed-precision keeps the masters in its files at bf16's precision",
        "test_zero_offload.py::test_offload_mixed_precision_equals_zero_mixed_precision[1-disk]",
    ),
    "zero-world-group": (
        "ZeRO reduce-scatters over the world, not its data-parallel group",
        "test_groups.py::test_section_on_a_group_equals_one_process[group-zero1-sgd]",
    ),
    "zero1-reduces-every-backward": (
        "ZeRO-1 reduce-scatters every backward pass of a step, not once at its last",
        "test_zero.py::test_stage1_reduce_scatters_once_a_step_under_accumulation[1]",
    ),
    "zero-formula-untied": (
        "ZeRO's formula leaves out the tied weight's second all-gather at stage 3",
        "test_zero.py::test_formula_on_a_tied_model[3-bf16]",
    ),
    "tp-world-group": (
        "TP's f and g all-reduce over the world, not the tensor-parallel group",
        "test_groups.py::test_section_on_a_group_equals_one_process[group-tp-adamw]",
    ),
    "tp-f-twice": (
        "TP's f on the attention's input as well as in its column-parallel layer",
        "test_tensor_parallel.py::test_each_block_input_gradient_all_reduced_once[gpt2]",
    ),
    "tp-save-bypasses-state-dict-hooks": (
        "TP saves its tensors by name, not through the model's own state_dict()",
        "test_copy_llama.py::test_save_is_the_models_state_dict"
        "[tensor_parallel-llama-tensor_parallel-tp-sgd]",
    ),
    "pipeline-world-peers": (
        "the pipeline's messages name world ranks, not its group's",
        "test_groups.py::test_section_on_a_group_equals_one_process[group-pipeline-1f1b-sgd]",
    ),
    "workers-epoch-copied": (
        "a DataLoader worker's copy of the dataset keeps epoch 0's shifts",
        "test_loop.py::test_workers_change_nothing",
    ),
    "hybrid-loss-every-rank": (
        "hybrid_parallel: the loss divided by every rank, not the last stage's",
        "test_hybrid_parallel.py::test_reported_loss_is_one_process_loss[dp2pp2-z3-sgd]",
    ),
    "hybrid-ep-clip-world": (
        "hybrid_parallel, data x expert: the experts' squares summed over the world, not ep",
        "test_hybrid_parallel.py::test_expert_clip_is_one_process_clip[dp2ep2-z1-clip0.05-sgd]",
    ),
    "hybrid-zero1-every-micro-batch": (
        "hybrid_parallel: ZeRO-1 reduce-scatters every micro-batch, not once a step",
        "test_hybrid_parallel.py::test_zero1_reduces_once_a_step[1-0]",
    ),
    "cp-index-per-call": (
        "CP builds its positions, causal mask and Ulysses' order at every call",
        "test_context_parallel.py::test_index_tensors_made_once",
    ),
    "deepspeed-loss-divided-twice": (
        "DeepSpeed: the loss divided by the accumulation steps before engine.backward divides it",
        "test_copy_llama.py::test_equals_one_process[deepspeed-llama-deepspeed2-sgd]",
    ),
    "deepspeed-save-parameters-by-name": (
        "DeepSpeed saves its parameters by name, not through the model's own state_dict()",
        "test_copy_llama.py::test_save_is_the_models_state_dict[deepspeed-llama-deepspeed3-adamw]",
    ),
}


def under(mutant, basetemp):
    """Run the guarding test of `mutant` in a fresh pytest process whose every launch carries it."""
    env = {
        **os.environ,
        "MUTANT": mutant,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "tests" / "faults"), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    }
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-x",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "full or not full",  # the guarding test may itself be in the full tier
            "--basetemp",
            str(basetemp),
            "tests/" + MUTANTS[mutant][1],
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory):
    """The mutants this session selected, two at a time (each is mostly one process waiting on
    another: two keep both cores busy)."""
    wanted = [
        item.callspec.params["mutant"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    ]
    # the folders made here, in this thread: pytest's tmp_path_factory is not thread-safe (made
    # from the pool's threads, one mktemp once failed its own path check)
    folders = {mutant: tmp_path_factory.mktemp(mutant) / "t" for mutant in wanted}
    with ThreadPoolExecutor(2) as pool:
        runs = pool.map(lambda mutant: under(mutant, folders[mutant]), wanted)
        return dict(zip(wanted, runs, strict=True))


@pytest.mark.parametrize("mutant", MUTANTS)
def test_the_guarding_test_fails_under_the_mutant(mutant, outcomes):
    r = outcomes[mutant]
    tail = "\n".join(r.stdout.splitlines()[-15:])
    assert "unknown MUTANT" not in r.stdout + r.stderr, tail
    summary = r.stdout.splitlines()[-1]
    assert "no tests ran" not in r.stdout and " error" not in summary, tail  # it ran
    assert r.returncode == 1 and " failed" in summary, tail  # and it failed
