"""zero.py: every stage ends with the one-process parameters, holds the formula's bytes per rank
and puts the paper's element count through its collectives."""
from types import SimpleNamespace

import pytest

import common
from helpers import SMALL, ddp_reference, max_diff, ok, python, torchrun

CFG = SMALL + ["--depth", "4"]      # 4 blocks: a block is small enough next to Ψ that stages 2-3 save at W=4
TOL = {"adamw": 1e-5, "sgd": 1e-6}


def units(world):
    """(Ψ, Ψ' padded, number of units) of the CFG model cut into zero.py's units, computed here, not read from it."""
    model = common.build_model(SimpleNamespace(seed=0, dim=32, depth=4, heads=4))
    sizes = [sum(p.numel() for p in m.parameters()) for m in [model.embed, *model.blocks, model.head]]
    return sum(sizes), sum(-(-n // world) * world for n in sizes), len(sizes)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """One-process references, each launched once: ddp.py with SGD, zero.py (stage 3) with AdamW."""
    d, cache = tmp_path_factory.mktemp("zero_ref"), {}

    def get(optim):
        if optim not in cache:
            path = d / f"{optim}.pt"
            if optim == "sgd":                     # the same file test_tensor_parallel/test_pipeline use
                path = ddp_reference(tmp_path_factory, CFG, "sgd")
            else:
                ok(python("zero.py", *CFG, "--stage", "3", "--optim", "adamw", "--save", path, timeout=120))
            cache[optim] = path
        return cache[optim]
    return get


# Each stage at W=2 and W=4, one of them with each optimizer (SGD catches a sum where a mean belongs,
# AdamW checks that the sharded optimizer state is right).
@pytest.mark.parametrize("stage,world,optim", [(1, 2, "adamw"), (1, 4, "sgd"), (2, 2, "sgd"), (2, 4, "adamw"),
                                               (3, 2, "adamw"), (3, 4, "sgd")])
def test_stage(stage, world, optim, ref, tmp_path):
    path = tmp_path / "out.pt"
    extra = ["--offload"] if (stage, world) == (3, 2) else []     # on a CPU it must say so and change nothing
    r = torchrun("zero.py", world, *CFG, "--stage", stage, "--optim", optim, "--save", path, *extra, timeout=150)
    res = ok(r)
    assert (res["stage"], res["world_size"], res["steps"]) == (stage, world, 6)

    # equivalence: the same parameters as one process (ddp.py for SGD, zero.py itself for AdamW)
    diff = max_diff(path, ref(optim))
    print(f"stage {stage} W={world} {optim}: max |Δ| vs {'ddp' if optim == 'sgd' else 'zero'}.py W=1 = {diff:.2e}")
    assert diff <= TOL[optim]

    # memory: measured bytes == the ZeRO formula for Ψ' (Ψ padded per unit to a multiple of W)
    psi, padded, n_units = units(world)
    assert res["params"] == psi and res["params_padded"] == padded and 0 <= padded - psi < n_units * world
    k = 8 if optim == "adamw" else 4
    assert res["param_bytes"] == (4 * padded // world if stage == 3 else 4 * padded)
    assert res["grad_bytes"] == (4 * padded // world if stage >= 2 else 4 * padded)
    assert res["optim_bytes"] == k * padded // world
    # ... and the saving is real during the step, not only at its end
    if stage == 1:
        assert res["peak_grad_bytes"] == 4 * padded
    if stage >= 2 and world == 4:
        assert res["peak_grad_bytes"] < 4 * psi, "a full gradient existed at once"
    if stage == 3 and world == 4:
        assert res["peak_param_bytes"] < 4 * psi, "all parameters were gathered at once"

    # communication: 2Ψ (stages 1-2) or 3Ψ (stage 3) elements per rank per step; (W-1)/W of it sent
    assert res["reduce_scatter_elements"] == padded
    assert res["all_gather_elements"] == (2 if stage == 3 else 1) * padded
    assert res["comm_elements"] == (3 if stage == 3 else 2) * padded
    assert res["comm_bytes"] == 4 * res["comm_elements"]
    assert res["wire_bytes"] == (world - 1) * res["comm_bytes"] // world
    if extra:
        assert "--offload: the device is the CPU, so the optimizer state" in r.stdout and not res["offload"]


def test_load_is_sharded_and_saved_back(ref, tmp_path):
    """--load a ddp.py checkpoint into stage 3 at W=2; with lr 0 nothing moves, so --save must give it back."""
    path = tmp_path / "back.pt"
    ok(torchrun("zero.py", 2, *CFG, "--stage", "3", "--lr", "0", "--max-steps", "1",
                "--load", ref("sgd"), "--save", path, timeout=120))
    assert max_diff(path, ref("sgd")) == 0
