"""Every technique section takes its process group: run on the interleaved pairs {0, 2} and
{1, 3} of a world of four (tests/copy_cases.py --groups), each pair ends with the parameters of
one process training the same model on the same batches. A section that forgets its group in one
collective talks to all four ranks instead, and ends elsewhere or fails."""

import importlib
import json

import pytest
from test_copy import TOL, max_parameter_diff

from helpers import fork_launch

# The case modules (tests/copy_<name>.py) whose sections take a group, and the cases each
# yields from group_cases(), named as its GROUP_CASES lists them.
MODULES = ["zero", "tensor_parallel", "pipeline", "expert_parallel", "context_parallel"]


def cases():
    params = []
    for name in MODULES:
        module = importlib.import_module(f"copy_{name}")
        for case in getattr(module, "GROUP_CASES", []):
            params.append(pytest.param(name, case, id=case))
    return params


@pytest.fixture(scope="module")
def on_groups(tmp_path_factory):
    """Every module's group cases in one launch at W=4: (the launch, the folder of its saved
    state_dicts). A launch that fails fails each test, not the fixture: a section that talks to
    the wrong ranks often fails the launch itself."""
    folder = tmp_path_factory.mktemp("groups")
    run = fork_launch("tests/copy_cases.py", 4, folder, "--groups", *MODULES, timeout=400)
    return run, folder


@pytest.mark.parametrize("module, case", cases())
def test_section_on_a_group_equals_one_process(on_groups, module, case):
    run, folder = on_groups
    assert run.returncode == 0, run.output
    references = json.loads((folder / "group_references.json").read_text())
    reference = references[case]  # "sgd", "adamw", or a case module's own ("moe-sgd")
    optim = reference.split("-")[-1]
    for pair in (0, 1):
        diff = max_parameter_diff(folder, f"{case}-group{pair}", reference)
        assert diff < TOL[optim], f"{case} on group {pair}: max |Δparameter| {diff:.2e}"
