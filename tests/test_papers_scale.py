"""The papers' settings, run by the scripts themselves (--simulate W: one process as rank 0 of W on
torch's fake process group, every tensor on the meta device; common/simulate.py): at the papers'
sizes every measured row equals the script's formula, and the measurement meets the number the
paper prints, within 3% (the papers round, and their models differ from ours by a few layers'
worth of Ψ). The rows, with the papers' numbers and sources, are
benchmarks/bench_papers_scale.py's, which prints them as the table in docs/measured.md."""

import functools
import sys

import pytest

from helpers import ROOT, fork_launch, ok

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_papers_scale  # noqa: E402
from bench_papers_scale import GB, MEMORY_ROWS, ROWS, model_states  # noqa: E402


@functools.cache  # two rows may read one run
def simulate(script, world, flags):
    """The RESULT of `python script --simulate world flags`, run in a process forked from the test
    fork server (a world of one: the simulated run is one process)."""
    result = ok(fork_launch(script, 1, "--simulate", str(world), *flags, timeout=300))
    assert result["simulated"] is True and result["world_size"] == world, result
    return result


@pytest.mark.parametrize("row", ROWS, ids=[row[0] for row in ROWS])
def test_measured_equals_formula_and_meets_the_paper(row):
    label, script, world, flags, measured, formula, paper, unit, source = row
    result = simulate(script, world, tuple(flags))
    for memory_row in MEMORY_ROWS:
        if result["formula"].get(memory_row) is not None:
            assert result[memory_row] == result["formula"][memory_row], (memory_row, result)
    assert result["comm"] == result["formula"]["comm"], result
    assert measured(result) == pytest.approx(formula(result)), (label, result)
    if "model_states" in result["paper"]:  # the paper's formula at this Ψ, exactly
        states = model_states(result) * GB
        assert states == pytest.approx(result["paper"]["model_states"]), (label, result)
    # the number the paper prints, for its own Ψ and rounded: within 3%
    assert measured(result) == pytest.approx(paper, rel=0.03), f"{label}: {unit}, {source}"


def test_the_benchmark_prints_the_rows(monkeypatch, capsys):
    """benchmarks/bench_papers_scale.py's table, its runs the ones above (one row here)."""
    monkeypatch.setattr(bench_papers_scale, "simulate", simulate)
    monkeypatch.setattr(sys, "argv", ["bench_papers_scale.py", "--only", "Megatron"])
    bench_papers_scale.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| Mega")]
    assert len(rows) == 1 and "| 4 | 4 | 4 | all-reduces a layer |" in rows[0], rows
