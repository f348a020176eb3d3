"""pipeline.py: every schedule ends with the same parameters as the one-process ddp.py run,
sends exactly 2(p-1)m tensors a step, idles (p-1)/(m+p-1) of its slots (naive: (p-1)/p), holds
m micro-batches per stage under GPipe and at most p under 1F1B, and refuses bad input."""
import argparse

import pytest

import pipeline
from helpers import SMALL, max_diff, ok, torchrun

DEPTH = 4                                   # >= 4 stages; the same config as test_tensor_parallel.py
CFG = [*SMALL, "--depth", str(DEPTH)]
TOL = {"sgd": 1e-6, "adamw": 1e-5}

TIMELINE_1F1B_2x4 = """\
  rank 0:  F0 F1 .  B0 F2 B1 F3 B2 .  B3
  rank 1:  .  F0 B0 F1 B1 F2 B2 F3 B3 ."""


def in_flight(order):
    """Most micro-batches whose forward has run and backward has not, along one stage's order."""
    held = peak = 0
    for a, _ in order:
        held += 1 if a == "F" else -1
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_schedules_in_process(p):
    """The orders themselves: each micro-batch forward then backward once per stage, the bubble
    of the replayed timeline, the activations held."""
    for m in range(p, 9):
        for name in ("naive", "gpipe", "1f1b"):
            orders = [pipeline.schedule(name, m, p, s) for s in range(p)]
            for o in orders:
                assert sorted(o) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
            _, bubble = pipeline.draw(orders)
            want = (p - 1) / p if name == "naive" else (p - 1) / (m + p - 1)
            assert bubble == pytest.approx(want), (name, p, m)
            peaks = [in_flight(o) for o in orders]
            assert peaks == {"naive": [1] * p, "gpipe": [m] * p, "1f1b": [min(p - s, m) for s in range(p)]}[name]


# Each schedule at W=2 and W=4, with each optimizer once; one run places a --load state_dict.
@pytest.mark.parametrize("world,schedule,m,optim", [
    (2, "naive", 1, "sgd"), (2, "gpipe", 4, "adamw"), (2, "1f1b", 4, "sgd"),
    (4, "naive", 1, "adamw"), (4, "gpipe", 8, "sgd"), (4, "1f1b", 8, "adamw")])
def test_same_parameters_and_schedule(world, schedule, m, optim, refs, initial, tmp_path):
    out = tmp_path / "pp.pt"
    load = ["--load", initial] if (world, schedule) == (4, "gpipe") else []
    run = torchrun("pipeline.py", world, *CFG, "--optim", optim, "--schedule", schedule, "--microbatches", m,
                   *load, "--save", out, timeout=150)
    r = ok(run)
    diff = max_diff(refs[optim], out)
    print(f"pipeline W={world} {schedule} m={m} {optim}: max |Δparam| vs ddp.py W=1 = {diff:.3g}")
    assert diff < TOL[optim]

    p = world
    assert r["p2p_sends"] == 2 * (p - 1) * m          # one activation and one gradient per micro-batch per boundary
    assert r["p2p_bytes"] == 2 * (p - 1) * 4 * 32 * 16 * 32
    want = (p - 1) / p if schedule == "naive" else (p - 1) / (m + p - 1)
    assert r["bubble"] == pytest.approx(want)
    assert r["peak_inflight"] == {"naive": [1] * p, "gpipe": [m] * p,
                                  "1f1b": [min(p - s, m) for s in range(p)]}[schedule]
    if schedule == "1f1b":
        assert max(r["peak_inflight"]) <= p < m
    if (world, schedule, m) == (2, "1f1b", 4):
        assert TIMELINE_1F1B_2x4 in run.stdout
    assert sum(r["stage_params"]) == r["params"]     # the stages partition the model


@pytest.mark.parametrize("world,flags,message", [
    (2, dict(depth=1), "--depth 1 blocks cannot fill 2 pipeline stages"),
    (1, dict(schedule="gpipe", microbatches=5), "--batch-size 32 is not divisible by --microbatches 5"),
    (4, dict(schedule="1f1b", microbatches=2),
     "--schedule 1f1b needs at least as many micro-batches as stages: --microbatches 2 < 4 stages"),
    (2, dict(microbatches=0), "--microbatches must be >= 1, got 0"),
])
def test_check_args(world, flags, message, capsys):
    """The checks themselves, in-process; the config without the bad flag passes."""
    ok_args = dict(depth=DEPTH, batch_size=32, schedule="1f1b", microbatches=None)
    with pytest.raises(SystemExit) as e:
        pipeline.check_args(argparse.Namespace(**{**ok_args, **flags}), world)
    assert e.value.code == 2 and message in capsys.readouterr().err
    pipeline.check_args(argparse.Namespace(**ok_args), world)
