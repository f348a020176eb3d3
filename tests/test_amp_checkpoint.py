"""amp_checkpoint.py: checkpointing is exact, it keeps only each block's input, bf16 converges.

- With --amp off, checkpointing recomputes the very same numbers: parameters after N steps equal
  those without it, bit for bit, and those of ddp.py (SGD catches a gradient-scale bug, AdamW runs
  at W=2 through DDP).
- The saved-tensor measurement: checkpointed bytes equal E + L·B·T·D·4 exactly, and the cut is at
  least the predicted factor.
- bf16 autocast (with checkpointing) trains: the loss falls and the accuracy is near fp32's.
- fp16 on CPU is one clear error, exit 2, before any process group.
"""
from concurrent.futures import ThreadPoolExecutor

import pytest

import common
from helpers import SMALL, max_diff, ok, python, torchrun

OFF = [*SMALL, "--amp", "off"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """fp32 runs to compare: ddp.py and amp_checkpoint.py --checkpoint with SGD at W=1; with AdamW and
    gradient clipping at W=2, amp_checkpoint.py with and without --checkpoint."""
    d = tmp_path_factory.mktemp("amp")
    launches = {(1, False): ("ddp.py", 1, *SMALL, "--optim", "sgd", "--save", d / "ddp.pt"),
                (1, True): ("amp_checkpoint.py", 1, *OFF, "--optim", "sgd", "--checkpoint", "--save", d / "1.pt")}
    for ckpt in (False, True):
        launches[2, ckpt] = ("amp_checkpoint.py", 2, *OFF, "--optim", "adamw", "--clip", "0.05",
                             "--save", d / f"2{ckpt}.pt", *(["--checkpoint"] if ckpt else []))
    with ThreadPoolExecutor(2) as pool:                  # two launches at a time: one per core
        done = {k: pool.submit(torchrun, *v) for k, v in launches.items()}
        out = {k: (launches[k][launches[k].index("--save") + 1], ok(f.result())) for k, f in done.items()}
    for (world, ckpt), (_, res) in out.items():
        assert res["world_size"] == world and res["steps"] == 6
        assert res["script"] == "ddp" or (res["checkpoint"] == ckpt and res["amp"] == "off")
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_checkpointing_changes_no_parameter(runs, world):
    """W=1: ddp.py against --amp off --checkpoint; W=2: --amp off with and without --checkpoint."""
    (plain, a), (ckpt, b) = runs[world, False], runs[world, True]
    assert max_diff(plain, ckpt) == 0                # recomputation gives the same bits
    assert a["loss"] == b["loss"]
    for k in ("param_bytes", "grad_bytes", "optim_bytes", "comm_bytes"):
        assert a[k] == b[k], k


@pytest.mark.parametrize("world", [1, 2])
def test_checkpointing_cuts_activation_bytes(runs, world):
    res = runs[world, True][1]
    B, T, D, L = 32 // world, common.TOKENS, 32, 2            # SMALL: batch 32, dim 32, depth 2
    outside = res["act_bytes_outside"]
    assert 0 < outside < res["act_bytes_ckpt"]
    assert res["act_bytes_ckpt"] == res["act_bytes_ckpt_expected"] == outside + L * B * T * D * 4
    assert res["act_bytes_plain"] >= res["act_bytes_plain_min"] == outside + L * 16 * B * T * D * 4
    assert res["act_ratio"] == pytest.approx(res["act_bytes_plain"] / res["act_bytes_ckpt"])
    assert res["act_ratio"] >= res["act_ratio_min"] > 4
    if world == 2:                        # both runs measure both modes, whichever one they train in
        assert runs[2, False][1]["act_bytes_ckpt"] == res["act_bytes_ckpt"]


def test_bf16_converges_like_fp32():
    # ~370 steps of a 1-block ViT: past the plateau at ~30% where the model has not yet learnt to
    # attend, so the accuracies compared are settled ones (~75%), not a point on a steep slope.
    cfg = ["--data", "synthetic", "--limit", "4000", "--batch-size", "64", "--dim", "32", "--depth", "1",
           "--heads", "4", "--epochs", "6", "--lr", "3e-3", "--no-progress"]
    with ThreadPoolExecutor(2) as pool:
        fp32 = pool.submit(torchrun, "amp_checkpoint.py", 1, *cfg, "--amp", "off", timeout=300)
        bf16 = pool.submit(torchrun, "amp_checkpoint.py", 1, *cfg, "--amp", "bf16", "--checkpoint", timeout=300)
        fp32, bf16 = ok(fp32.result()), ok(bf16.result())
    print(f"fp32: loss {fp32['loss']:.4f} acc {fp32['test_acc']:.4f}; bf16: loss {bf16['loss']:.4f} "
          f"acc {bf16['test_acc']:.4f}")
    assert bf16["amp"] == "bf16" and bf16["steps"] == fp32["steps"] == 6 * (4000 // 64)
    assert bf16["loss"] < 0.5 * 2.3026                       # well below ln(10), the loss at the start
    assert fp32["test_acc"] > 0.6                            # the comparison below means something
    assert abs(bf16["test_acc"] - fp32["test_acc"]) < 0.05
    assert bf16["act_bytes_plain"] < fp32["act_bytes_plain"]  # 16-bit activations


@pytest.mark.parametrize("argv,message", [
    (["--amp", "fp16"], "error: --amp fp16 needs CUDA (fp16 autocast with GradScaler('cuda')); this run is on cpu"),
    (["--clip", "-1"], "error: --clip must be >= 0 (0: no clipping), got -1.0"),
])
def test_bad_input_one_message(argv, message):
    r = python("amp_checkpoint.py", *SMALL, "--backend", "gloo", *argv, timeout=60)   # gloo: on CPU even with GPUs
    assert r.returncode == 2, r.output
    assert message in r.stderr and r.stderr.count("error") == 1 and "Traceback" not in r.stderr, r.output
