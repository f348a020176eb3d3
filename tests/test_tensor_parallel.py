"""tensor_parallel.py: Megatron TP (with and without sequence parallelism) ends with the same
parameters as the one-process ddp.py run, issues exactly the predicted collectives, holds the
predicted slice of the parameters, and refuses bad input with one message."""
import argparse

import pytest

import common
import tensor_parallel
from helpers import SMALL, max_diff, ok, python, torchrun

DEPTH = 4                                   # the same config as test_pipeline.py, so they share references
CFG = [*SMALL, "--depth", str(DEPTH)]
TOL = {"sgd": 1e-6, "adamw": 1e-5}          # float32 round-off (ddp.py itself: ~7e-9 SGD, ~1.6e-6 AdamW)
B, T, D = 32, common.TOKENS, 32             # SMALL's batch and dim


def split_numel(dim=D, depth=DEPTH, heads=4):
    """Ψs: the elements TP splits (q, k, v, proj, fc1, fc2 weights; q, v, fc1 biases) and Ψ."""
    model = common.ViT(dim, depth, heads)
    psi = sum(p.numel() for p in model.parameters())
    return sum(b.attn.q.weight.numel() * 4 + 2 * b.attn.q.bias.numel() + b.mlp.fc1.weight.numel()
               + b.mlp.fc2.weight.numel() + b.mlp.fc1.bias.numel() for b in model.blocks), psi


# Each of W in {2, 4}, SP on/off and SGD/AdamW meets each other in one of four runs; one of them
# starts from --load (slice a plain state_dict) instead of slicing the model it built.
@pytest.mark.parametrize("world,sp,optim", [(2, False, "sgd"), (2, True, "adamw"),
                                            (4, False, "adamw"), (4, True, "sgd")])
def test_same_parameters_and_collectives(world, sp, optim, refs, initial, tmp_path):
    out = tmp_path / "tp.pt"
    load = ["--load", initial] if (world, sp) == (4, True) else []
    r = ok(torchrun("tensor_parallel.py", world, *CFG, "--optim", optim, *(["--sequence-parallel"] if sp else []),
                    *load, "--save", out, timeout=150))
    diff = max_diff(refs[optim], out)
    print(f"tensor_parallel W={world} sp={sp} {optim}: max |Δparam| vs ddp.py W=1 = {diff:.3g}")
    assert diff < TOL[optim]

    n = B * T * D                            # elements of one [B, T, D] activation
    if sp:                                   # 2 all-gathers + 2 reduce-scatters per block each way, 2 at the ends,
        want = dict(all_reduce=1, all_gather=4 * DEPTH + 2, reduce_scatter=4 * DEPTH)   # 1 for norm/bias grads
        want_bytes = 4 * ((8 * DEPTH + 2) * n + 6 * D * DEPTH)
    else:                                    # 2 all-reduces forward + 2 backward per block
        want = dict(all_reduce=4 * DEPTH, all_gather=0, reduce_scatter=0)
        want_bytes = 4 * 4 * DEPTH * n
    assert r["collectives"] == want, r
    assert r["comm_bytes"] == want_bytes
    assert r["native_reduce_scatter"] is True   # this torch's Gloo has reduce_scatter_tensor

    psi_split, psi = split_numel()
    assert r["param_bytes"] == 4 * (psi - psi_split + psi_split // world)
    assert r["grad_bytes"] == r["param_bytes"]
    assert r["optim_bytes"] == (2 if optim == "adamw" else 1) * r["param_bytes"]

    if (world, sp) == (2, False):            # the dense file TP saved loads in ddp.py (lr 0: nothing moves)
        ok(python("ddp.py", "--nproc", "1", *CFG, "--load", out, "--optim", "sgd", "--lr", "0", "--max-steps", "1",
                  "--save", tmp_path / "ddp.pt", timeout=120))
        assert max_diff(out, tmp_path / "ddp.pt") == 0


@pytest.mark.parametrize("world,heads,dim,sp,message", [
    (2, 1, 32, False, "--heads 1 is not divisible by the 2 tensor-parallel ranks"),
    (4, 2, 32, True, "--heads 2 is not divisible by the 4 tensor-parallel ranks"),
    (3, 3, 48, True, "--sequence-parallel splits the 16 tokens over ranks: 3 does not divide them"),
])
def test_check_args(world, heads, dim, sp, message, capsys):
    """The checks themselves, in-process. (The MLP width 4·dim is divisible whenever the heads are,
    so its check cannot fire on its own for this model.)"""
    with pytest.raises(SystemExit) as e:
        tensor_parallel.check_args(argparse.Namespace(heads=heads, dim=dim, sequence_parallel=sp), world)
    assert e.value.code == 2 and message in capsys.readouterr().err
    tensor_parallel.check_args(argparse.Namespace(heads=heads, dim=dim, sequence_parallel=False), 1)   # fine at W=1
