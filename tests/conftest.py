import os
import sys
from pathlib import Path

import pytest

# the scripts and common/ live in the repository root; helpers.py beside this file
sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

# The suite tests the CPU path (Gloo), so that every machine runs the same tests: on a machine
# with GPUs its launches would pick NCCL, or, with fewer GPUs than ranks, be refused. Hidden before
# torch is imported here; every launch inherits it. (benchmarks/check_cuda.py checks the GPU path.)
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402

import common  # noqa: E402
from helpers import ddp_references  # noqa: E402


@pytest.fixture(scope="module")
def refs(request, tmp_path_factory):
    """ddp.py at W=1 with SGD and with AdamW on the test module's CFG (shared across modules)."""
    return ddp_references(tmp_path_factory, request.module.CFG)


@pytest.fixture(scope="module")
def initial(request, tmp_path_factory):
    """The seeded model's starting weights for the module's CFG as a plain state_dict: a run that
    --loads it must end where the reference (which built them itself) ends."""
    path = tmp_path_factory.mktemp("init") / "initial.pt"
    args = common.parse_args(common.get_parser("test"), request.module.CFG)
    torch.save(common.build_model(args).state_dict(), path)
    return path


@pytest.fixture
def world_of_one(tmp_path):
    """A Gloo process group of this test's process alone, for a section's functions."""
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1
    )
    yield
    torch.distributed.destroy_process_group()
