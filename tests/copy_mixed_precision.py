"""Copy cases in mixed precision on nanoGPT (tests/nanogpt_model.py, its own recipe): zero.py's
and zero_offload.py's sections with mixed_precision=True (bf16 compute from fp32 master shards,
fp32 reduce-scatters, the fp32 step) at W=2. Run by tests/copy_cases.py --nanogpt, as a module of
their own, so that a fault the fp32 cases guard against (tests/test_mutants.py) is not also a
crash of these, which would stop the launch before the fp32 cases are read.

No process in fp32 rounds as they do, so each case is checked against its peer, fsdp.py's
MixedPrecisionPolicy on the same recipe (the same math), run in the same launch. With AdamW the
recipe does not clip (nanoGPT's grad_clip = 0.0): the two sum the norm's squares in different
orders, so a master may end an fp32 ulp apart, its bf16 copy then one of bf16's (2^-8 relative),
and AdamW carries that on (5e-4 apart after 4 steps, where without the clip they end equal); with
SGD it clips, as every other case does.
"""

import nanogpt_model
from causal_lm import OPTIMS
from copy_fsdp import run_nanogpt_fsdp
from copy_zero import run_nanogpt_zero

import zero
import zero_offload

NANOGPT_CASES = []  # none ends where one process in fp32 ends: see NANOGPT_BF16_CASES
NANOGPT_BF16_CASES = {  # case: its peer
    "zero1-bf16-adamw": "fsdp-bf16-adamw",
    "zero3-bf16-adamw": "fsdp-bf16-adamw",
    "zero_offload-disk2-bf16-sgd": "fsdp-bf16-sgd",
}


def nanogpt_cases(rank, world, folder):
    """The peers first, then each case that must end where its peer ends: (case, its reference,
    model, full state_dict, proof), as copy_zero.nanogpt_cases."""
    for optim in OPTIMS:
        clips = optim == "sgd"
        peer = run_nanogpt_fsdp(optim, rank, world, mixed_precision=True, clips=clips)
        yield f"fsdp-bf16-{optim}", optim, *peer
    directory = folder / "nanogpt-zero_offload-disk-bf16-files"
    directory.mkdir(exist_ok=True)
    sections = {
        "zero1-bf16-adamw": (
            zero,
            dict(stage=1, gradient_accumulation_steps=nanogpt_model.ACCUMULATE),
        ),
        "zero3-bf16-adamw": (zero, dict(stage=3)),
        "zero_offload-disk2-bf16-sgd": (
            zero_offload,
            dict(stage=2, offload="disk", directory=directory),
        ),
    }
    for case, (script, zero_args) in sections.items():
        optim = case.split("-")[-1]
        clips = optim == "sgd"  # AdamW unclipped: see the docstring
        run = run_nanogpt_zero(
            script, optim, rank, world, clips=clips, mixed_precision=True, **zero_args
        )
        yield case, NANOGPT_BF16_CASES[case], *run
