"""Each core runs alone (issue 42): delete every `### more:` part of a technique script
(tests/strip_parts.py) and the copy still trains, evaluates and saves the ViT at its default
technique flags, ending with one process's parameters (ddp.py at W=1), at W = 2 and 3 (context
parallelism at 2 and 4: no patch size that divides MNIST's 28-pixel side gives a number of tokens
that 3 divides).

The copy is written under the script's own name into the test's temporary folder, never into the
repository (where the suite's globs of *.py would find it), and launched from there by the fork
server (helpers.fork_launch). Its ranks find `common` among the modules the server has imported;
the scripts import nothing else of this repository. One launch a case; each script runs on its own
test module's configuration at W=2, so that the suite shares the ddp.py references, and on one
its technique accepts at W=3 (whole heads, experts, tokens and samples a rank).

The quick suite runs W=2 alone, which keeps it to 5 launches of a few seconds, with one optimizer
a script: AdamW where the sharded state is the technique (zero.py, tensor_parallel.py), SGD, which
catches a sum where a mean belongs, where gradients are averaged or summed across ranks (context,
expert and pipeline parallelism). The full tier (`-m full`) adds W=3 (4) and the other optimizer: 15
launches more.
"""

import pytest
from section_lines import section_lines
from strip_parts import strip_parts
from test_skeleton import core_lines

from helpers import ROOT, SMALL, ddp_reference, fork_launch, max_diff, ok, tiered

TOL = {"sgd": 1e-6, "adamw": 5e-5}  # the scripts' own tests': AdamW turns round-off into steps
TP = [*SMALL, "--depth", "4"]  # test_tensor_parallel.py's and test_pipeline.py's CFG
CFGS = {  # script: {world: configuration}
    "zero.py": dict.fromkeys(
        (2, 3), [*SMALL, *"--limit 1025 --batch-size 24 --dim 33 --heads 3 --patch 14".split()]
    ),
    "tensor_parallel.py": {2: TP, 3: [*SMALL, "--dim", "48", "--heads", "6"]},
    "context_parallel.py": dict.fromkeys((2, 4), [*SMALL, "--patch", "2"]),  # 196 tokens
    "expert_parallel.py": {
        2: [*SMALL, "--experts", "4", "--top-k", "2"],
        3: [*SMALL, "--batch-size", "24", "--experts", "6", "--top-k", "2"],
    },
    "pipeline.py": dict.fromkeys((2, 3), TP),
}
QUICK = [
    ("zero.py", 2, "adamw"),
    ("tensor_parallel.py", 2, "adamw"),
    ("context_parallel.py", 2, "sgd"),
    ("expert_parallel.py", 2, "sgd"),
    ("pipeline.py", 2, "sgd"),
]
GRID = [
    (script, world, optim)
    for script, worlds in CFGS.items()
    for world in worlds
    for optim in ("sgd", "adamw")
]


@pytest.mark.parametrize("script, world, optim", tiered(GRID, QUICK))
def test_core_alone_equals_one_ddp_process(script, world, optim, tmp_path, tmp_path_factory):
    text, parts = strip_parts((ROOT / script).read_text())
    assert parts > 0 and "\n### more:" not in text, f"{script}: no `### more:` part deleted"
    core = tmp_path / script
    core.write_text(text)
    cfg = CFGS[script][world]
    saved = tmp_path / "core.pt"
    result = ok(fork_launch(core, world, *cfg, "--optim", optim, "--save", saved))
    assert (result["world_size"], result["steps"]) == (world, 6)
    diff = max_diff(saved, ddp_reference(tmp_path_factory, cfg, optim))
    print(f"{script} core alone, W={world} {optim}: max |Δ| vs ddp.py W=1 = {diff:.2e}")
    assert diff <= TOL[optim]


@pytest.mark.parametrize("script", CFGS)
def test_section_lines_count_as_the_guard(script):
    """tests/section_lines.py (the README's core and parts columns) counts the core as
    tests/test_skeleton.py's CORE_LINES guard does, and the parts as lines of code too."""
    text = (ROOT / script).read_text()
    core, parts = section_lines(text)
    assert core == core_lines(text)
    assert 0 < parts < len(text.splitlines())
