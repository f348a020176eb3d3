"""The copy cases: each technique section, imported from its script and nothing else, trains the
second model (tests/causal_lm.py) in ONE launch, one case after another in the same process
group, so that tests/test_copy.py starts its ranks once.

    torchrun --standalone --nproc_per_node=2 tests/copy_cases.py DIR [--nanogpt] [MODULE ...]
    torchrun --standalone --nproc_per_node=2 tests/copy_cases.py DIR --llama [MODULE ...]
    torchrun --standalone --nproc_per_node=4 tests/copy_cases.py DIR --groups [MODULE ...]

Each module tests/copy_<technique>.py yields its cases on the second model (`cases`, see
copy_zero.cases) and, with --nanogpt, on the third (`nanogpt_cases`: tests/nanogpt_model.py, the
model as nanoGPT lays it out and trains it); MODULE names some of them (`zero`, `fsdp`, ...) to
run only those. Rank 0 first trains the one-process references on the same batches, then writes
DIR/<case>.pt (the case's full state_dict, as its script's `full_state_dict` gives it),
DIR/reference-<optim>.pt (with --nanogpt, also DIR/reference-nobias-<optim>.pt: the model with
bias=False) and DIR/results.json.

With --llama the cases are a module's `llama_cases` (rank, world, folder), on the fourth and fifth
models: tests/llama_model.py (Llama 3 as torchtitan has it) and tests/hf_gpt2_model.py (HF's
GPT2LMHeadModel), each trained by its own recipe; a case's reference is named
<family>-[<variant>-]<optim> (llama-sgd, llama-moe-adamw, gpt2-eager-sgd, ...), each written to
DIR/reference-<that name>.pt; modules without llama_cases are skipped.

With --groups (W=4) each section runs on a process group of its own, not on the world: the
ranks {0, 2} and {1, 3} train the same cases side by side, each pair on its own group, whose
ranks are not the world's (rank 2 is its group's rank 1). `group_cases(batches, group, folder)`
yields a module's cases; each group's first rank writes DIR/<case>-group<0|1>.pt, and rank 0
DIR/group_references.json, each case's reference. A collective
that forgets its group runs over all four ranks and ends elsewhere (or fails).
"""

import gc
import importlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the scripts

import hf_gpt2_model  # noqa: E402
import llama_model  # noqa: E402
import nanogpt_model  # noqa: E402
from causal_lm import OPTIMS, evaluation_loss, reference, task  # noqa: E402

MODULES = [  # tests/copy_<name>.py
    "zero",
    "fsdp",
    "amp",
    "tensor_parallel",
    "context_parallel",
    "expert_parallel",
    "pipeline",
    "mixed_precision",  # nanoGPT cases only
]


def main():
    folder = Path(sys.argv[1])
    nanogpt = "--nanogpt" in sys.argv[2:]
    llama = "--llama" in sys.argv[2:]
    modules = [name for name in sys.argv[2:] if not name.startswith("--")] or MODULES
    groups = "--groups" in sys.argv[2:]
    # the modules with cases for this run (copy_mixed_precision has nanoGPT's only)
    if llama:
        runner = "llama_cases"
    elif nanogpt:
        runner = "nanogpt_cases"
    elif groups:
        runner = "group_cases"
    else:
        runner = "cases"
    modules = [name for name in modules if hasattr(copy_module(name), runner)]
    dist.init_process_group("gloo")
    if groups:
        run_on_groups(folder, modules)
        return
    rank = dist.get_rank()
    world = dist.get_world_size()
    batches, test_tokens = task()
    results = {}
    if rank == 0:
        for optim in OPTIMS:
            if llama:
                results.update(llama_references(optim, folder))
                continue
            if not nanogpt:
                state, results[f"reference-{optim}"] = reference(optim, batches, test_tokens)
                torch.save(state, folder / f"reference-{optim}.pt")
                continue
            for prefix, config in nanogpt_model.CONFIGS.items():
                name = f"reference-{prefix}{optim}"  # e.g. reference-nobias-sgd
                state, results[name] = nanogpt_model.reference(optim, config)
                torch.save(state, folder / f"{name}.pt")
    for name in modules:
        module = importlib.import_module(f"copy_{name}")
        if llama:
            module_cases = module.llama_cases(rank, world, folder)
        elif nanogpt:
            module_cases = module.nanogpt_cases(rank, world, folder)
        else:
            module_cases = module.cases(batches, rank, world, folder)
        for case, reference_name, model, state, proof in module_cases:
            # a case whose model cannot run a whole forward (a pipeline stage) brings its own
            if "eval_loss" not in proof:
                if llama:
                    recipe = LLAMA_FAMILIES[family(reference_name)]
                    proof["eval_loss"] = recipe.evaluation_loss(model)
                elif nanogpt:
                    proof["eval_loss"] = nanogpt_model.evaluation_loss(model)
                else:
                    proof["eval_loss"] = evaluation_loss(model, test_tokens)
            if rank == 0:
                torch.save(state, folder / f"{case}.pt")
                results[case] = dict(reference=reference_name, **proof)
            # free the case's model (DDP's reducer) now, while every rank is here, not at exit:
            # as ddp.py does, so that no teardown waits on a Gloo thread still finishing its work
            del model
            gc.collect()
            dist.barrier()
    if rank == 0:
        with open(folder / "results.json", "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


# --llama: the model families and the variants of each that a case may name as its reference
LLAMA_FAMILIES = {"llama": llama_model, "gpt2": hf_gpt2_model}
LLAMA_VARIANTS = {"llama": llama_model.ARGS_BY_PREFIX, "gpt2": hf_gpt2_model.CONFIGS}


def copy_module(name):
    return importlib.import_module(f"copy_{name}")


def family(reference_name):
    """The family ("llama" or "gpt2") of a reference name such as "llama-moe-adamw"."""
    return reference_name.split("-")[0]


def llama_references(optim, folder):
    """Rank 0, --llama: one process of every family and variant trained by its own recipe with
    `optim`, each state_dict written to DIR/reference-<family>-[<variant>-]<optim>.pt; returns
    {that file's stem: dict(losses, norms, eval_loss)}."""
    results = {}
    for name, recipe in LLAMA_FAMILIES.items():
        for prefix, config in LLAMA_VARIANTS[name].items():
            reference_name = f"reference-{name}-{prefix}{optim}"  # e.g. reference-llama-moe-sgd
            state, results[reference_name] = recipe.reference(optim, config)
            torch.save(state, folder / f"{reference_name}.pt")
    return results


def run_on_groups(folder, modules):
    """--groups: every module's group_cases on the interleaved pairs {0, 2} and {1, 3}."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    assert world == 4, f"--groups runs at W=4, not {world}"
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank makes both, in order
    pair = rank % 2
    group = pairs[pair]
    batches, test_tokens = task()
    if rank == 0:
        for optim in OPTIMS:
            state, _ = reference(optim, batches, test_tokens)
            torch.save(state, folder / f"reference-{optim}.pt")
    references = {}  # case -> the reference it must equal ("sgd", "moe-adamw", ...)
    for name in modules:
        module = importlib.import_module(f"copy_{name}")
        for case, reference_name, model, state, _ in module.group_cases(batches, group, folder):
            references[case] = reference_name
            if dist.get_rank(group) == 0:
                torch.save(state, folder / f"{case}-group{pair}.pt")
            del model
            gc.collect()
            dist.barrier()
    if rank == 0:
        with open(folder / "group_references.json", "w") as f:
            json.dump(references, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
