"""The data-parallel family: ddp.py (mp.spawn and torchrun), ddp_torchrun.py snapshots, dp.py.

Each launch is a real multi-process run on CPU/Gloo; the promise checked is that data
parallelism changes nothing about the result: the parameters after N steps equal those of
one process training on the same global batches.
"""
import pytest
import torch

import common
from helpers import SMALL, max_diff, ok, python, torchrun

CFG = SMALL + ["--limit", "510"]          # 510 test samples: uneven shards at W=4 (128, 128, 127, 127)
TOL = {"sgd": 1e-6, "adamw": 1e-5}        # float32 round-off; measured ~7e-9 (SGD), ~2e-6 (AdamW)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, per optimizer: the run every data-parallel run must reproduce."""
    d = tmp_path_factory.mktemp("ref")
    out = {}
    for opt in ("sgd", "adamw"):
        res = ok(torchrun("ddp.py", 1, *CFG, "--optim", opt, "--save", d / f"{opt}.pt"))
        out[opt] = (d / f"{opt}.pt", res)
    return out


@pytest.mark.parametrize("opt,world,launcher", [
    ("sgd", 2, "torchrun"), ("sgd", 4, "spawn"), ("adamw", 2, "spawn"), ("adamw", 4, "torchrun"),
])
def test_ddp_equals_one_process(reference, tmp_path, opt, world, launcher):
    ref_path, ref = reference[opt]
    args = [*CFG, "--optim", opt, "--save", tmp_path / "w.pt"]
    res = ok(torchrun("ddp.py", world, *args) if launcher == "torchrun" else python("ddp.py", "--nproc", world, *args))
    assert res["world_size"] == world and res["backend"] == "gloo" and res["steps"] == ref["steps"] == 6
    diff = max_diff(ref_path, tmp_path / "w.pt")
    print(f"{opt} W={world} ({launcher}): max |param diff| = {diff:.2e}")
    assert diff < TOL[opt]
    assert res["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    # exact distributed evaluation: the same weights give the same accuracy at every world size
    assert res["test_acc"] == ref["test_acc"]
    # the measured bytes and communication equal the formula: 4Ψ / 4Ψ / 8Ψ (4Ψ SGD), all-reduce of Ψ
    psi = res["params"]
    assert (res["param_bytes"], res["grad_bytes"], res["comm_bytes"]) == (4 * psi, 4 * psi, 4 * psi)
    assert res["optim_bytes"] == (8 if opt == "adamw" else 4) * psi


def test_distributed_accuracy_equals_one_process_accuracy(reference):
    """Recompute the accuracy of the saved weights in this process over the whole test set."""
    path, res = reference["adamw"]
    args = common.parse_args(common.get_parser("t"), CFG)
    model = common.build_model(args)
    model.load_state_dict(torch.load(path, weights_only=True))
    *_, xte, yte, _ = common.load_data(args)
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).sum().item() / len(yte)
    assert len(yte) == 510 and res["test_acc"] == acc


def test_grad_accum_equals_plain_step(reference, tmp_path):
    """--grad-accum 2: each rank does two half-size micro-steps under no_sync(), one all-reduce."""
    res = ok(torchrun("ddp.py", 2, *CFG, "--optim", "adamw", "--grad-accum", "2", "--save", tmp_path / "a.pt"))
    assert max_diff(reference["adamw"][0], tmp_path / "a.pt") < TOL["adamw"]
    assert res["comm_bytes"] == 4 * res["params"]          # still one all-reduce of Ψ per optimizer step


def test_snapshot_resume_equals_uninterrupted(tmp_path):
    """ddp_torchrun.py: train 1 epoch, stop; start again with --epochs 2: it resumes from the
    snapshot and ends where an uninterrupted 2-epoch run ends."""
    cfg = ["--data", "synthetic", "--limit", "256", "--batch-size", "32", "--dim", "32", "--depth", "2",
           "--no-progress", "--snapshot", tmp_path / "snap.pt"]
    first = ok(torchrun("ddp_torchrun.py", 2, *cfg, "--epochs", "1"))
    assert first["steps"] == 8 and (tmp_path / "snap.pt").exists()
    second = torchrun("ddp_torchrun.py", 2, *cfg, "--epochs", "2", "--save", tmp_path / "resumed.pt")
    assert "resuming from" in second.stdout and ok(second)["steps"] == 16
    cfg[-1] = tmp_path / "other.pt"
    ok(torchrun("ddp_torchrun.py", 2, *cfg, "--epochs", "2", "--save", tmp_path / "straight.pt"))
    assert max_diff(tmp_path / "resumed.pt", tmp_path / "straight.pt") == 0


def test_dp_trains_on_cpu_and_says_so():
    r = python("dp.py", "--data", "synthetic", "--limit", "1024", "--batch-size", "32", "--dim", "32",
               "--depth", "2", "--max-steps", "30", "--no-progress", "--lr", "3e-3")
    res = ok(r)
    assert "no GPUs visible, training on the CPU as a single device" in r.stdout
    assert res["world_size"] == 1 and res["steps"] == 30 and res["loss"] < 0.9 * res["first_loss"]


@pytest.mark.parametrize("script", ["ddp.py", "dp.py", "ddp_torchrun.py"])
def test_save_of_one_script_loads_in_another(reference, tmp_path, script):
    """Load a ddp.py checkpoint, take one SGD step with lr 0, save: the file must be unchanged."""
    path, res = reference["adamw"]
    r = python(script, *CFG, "--load", path, "--optim", "sgd", "--lr", "0", "--max-steps", "1",
               "--save", tmp_path / "out.pt", *(["--nproc", "1"] if script == "ddp.py" else []))
    assert ok(r)["test_acc"] == res["test_acc"]
    assert max_diff(path, tmp_path / "out.pt") == 0
