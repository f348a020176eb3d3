"""fsdp.py: FSDP2 ends with the one-process parameters, holds its DTensor shards' bytes, moves 3Ψ
(2Ψ without resharding after forward), and a DCP checkpoint saved at W=2 resumes at W=4."""
from types import SimpleNamespace

import pytest

import common
from helpers import SMALL, max_diff, ok, python, torchrun

NO_STEPS = [a for a in SMALL if a not in ("--max-steps", "6")]       # SMALL without its step count


def expected(world, rank=0):
    """(local elements on `rank`, elements the collectives move per step) for the SMALL model, computed
    here: FSDP2 cuts dim 0 like torch.chunk and pads each parameter to W equal chunks."""
    model = common.build_model(SimpleNamespace(seed=0, dim=32, depth=2, heads=4))
    chunk = lambda n: -(-n // world)                                                   # noqa: E731
    local = sum(max(0, min(chunk(p.shape[0]), p.shape[0] - rank * chunk(p.shape[0]))) * (p.numel() // p.shape[0])
                for p in model.parameters())
    padded = lambda ps: sum(chunk(p.shape[0]) * world * (p.numel() // p.shape[0]) for p in ps)   # noqa: E731
    blocks = padded([p for b in model.blocks for p in b.parameters()])
    root = padded(model.parameters()) - blocks
    slack = sum((world - 1) * (p.numel() // p.shape[0]) for p in model.parameters())   # at most W-1 rows short
    return local, blocks, root, slack


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """One-process references: ddp.py with AdamW, fsdp.py with SGD, and fsdp.py at W=2 (uninterrupted)."""
    d, cache = tmp_path_factory.mktemp("fsdp_ref"), {}

    def get(name):
        if name not in cache:
            script, world, optim = {"ddp1": ("ddp.py", 1, "adamw"), "fsdp1_sgd": ("fsdp.py", 1, "sgd"),
                                    "fsdp2": ("fsdp.py", 2, "adamw")}[name]
            path, args = d / f"{name}.pt", [*SMALL, "--optim", optim, "--save", d / f"{name}.pt"]
            cache[name] = (path, ok(python(script, *args, timeout=120) if script == "fsdp.py" and world == 1
                                    else torchrun(script, world, *args, timeout=120)))
        return cache[name]
    return get


def check_bytes(res, world, optim, reshard=True):
    local, blocks, root, slack = expected(world)
    assert res["param_bytes"] == res["grad_bytes"] == 4 * local
    assert res["optim_bytes"] == (8 if optim == "adamw" else 4) * local
    assert 0 <= local * world - res["params"] <= slack      # that is 4Ψ/W, up to the uneven last chunks
    # all-gather Ψ' for forward and (blocks only, when resharding) again for backward; reduce-scatter Ψ'
    assert res["all_gather_elements"] == (2 * blocks if reshard else blocks) + root
    assert res["reduce_scatter_elements"] == blocks + root
    assert res["comm_bytes"] == 4 * res["comm_elements"]


def test_w2_equals_ddp(ref):
    path, res = ref("fsdp2")
    diff = max_diff(path, ref("ddp1")[0])
    print(f"fsdp W=2 adamw: max |Δ| vs ddp.py W=1 = {diff:.2e}")
    assert diff <= 1e-5
    check_bytes(res, 2, "adamw")


def test_w4_equals_one_process(ref, tmp_path):
    r = ok(torchrun("fsdp.py", 4, *SMALL, "--optim", "sgd", "--save", tmp_path / "w4.pt", timeout=150))
    diff = max_diff(tmp_path / "w4.pt", ref("fsdp1_sgd")[0])
    print(f"fsdp W=4 sgd: max |Δ| vs fsdp.py W=1 = {diff:.2e}")
    assert diff <= 1e-6
    check_bytes(r, 4, "sgd")


def test_dcp_saved_at_w2_resumes_at_w4(ref, tmp_path):
    """3 steps at W=2 into a DCP checkpoint, then steps 3-5 at W=4 (without resharding after forward,
    also exact) must end where 6 uninterrupted steps at W=2 end."""
    ckpt = tmp_path / "dcp"
    first = ok(torchrun("fsdp.py", 2, *NO_STEPS, "--max-steps", "3", "--dcp", ckpt, timeout=120))
    assert first["steps"] == 3 and (ckpt / ".metadata").is_file()
    r = torchrun("fsdp.py", 4, *NO_STEPS, "--max-steps", "6", "--dcp", ckpt, "--no-reshard-after-forward",
                 "--save", tmp_path / "resumed.pt", timeout=150)
    res = ok(r)
    assert "resumed from" in r.stdout and res["start_step"] == 3 and res["steps"] == 6
    diff = max_diff(tmp_path / "resumed.pt", ref("fsdp2")[0])
    print(f"fsdp DCP W=2 -> W=4: max |Δ| vs uninterrupted W=2 = {diff:.2e}")
    assert diff <= 1e-5
    check_bytes(res, 4, "adamw", reshard=False)

    # a DCP checkpoint of another model size: the first mismatching tensor is named
    r = python("fsdp.py", *SMALL, "--dim", "64", "--dcp", ckpt, timeout=60)
    assert r.returncode == 2 and "tensor 'model.embed.pos' has shape (1, 16, 32), this model needs (1, 16, 64)" \
        in r.stderr, r.output
