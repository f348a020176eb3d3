"""context_parallel.py: ring attention and Ulysses on --patch 2 (196 tokens) end with the
parameters of the one-process ddp.py run (ring and Ulysses at W=2 with SGD and at W=4 with AdamW);
the collectives the Meter measures from outside and the attention activations it measures per rank
equal what this test works out from B, T, D, H and depth; F.scaled_dot_product_attention inside
the section's ContextParallel mode (the ring, or the Ulysses all-to-alls) gives one process's SDPA
output and gradients at W=2, 3, 4, also causal with the contiguous and the zig-zag split and
grouped-query (a driver, the last case of the W=4 launch), and in bf16 within 1.5 times SDPA's own
bf16 error (fp32 under autocast); attention runs on a process group of its own, not DDP's; index
tensors are made once, not at every call; --clip (torch's clip_grad_norm_: DDP leaves every whole
gradient on every rank) ends where ddp.py --clip ends in one process; inputs that go wrong on one
rank, and calls the swap cannot run, raise the same error on every rank, and the language-model
loss of bf16 logits is summed in fp32 (the driver with --errors, a W=2 launch of its own)."""

import json

import pytest

import common
from helpers import SMALL, ddp_references, fork_launch, max_diff

CFG = [*SMALL, "--patch", "2"]  # 196 tokens: 98 or 49 a rank at W=2, 4
TOL = {"sgd": 1e-6, "adamw": 5e-5}
WINDOW = 3  # optimizer steps the Meter counts collectives in

# Each method at W=2 and W=4 and with both optimizers: four cases, each read by three tests.
# AdamW at W=4: at W=2 both methods end 3.2e-5 from the reference (head.norm.bias, whose gradient
# crosses zero; AdamW turns the round-off of the split token mean into steps), within TOL but too
# near it to test on every CPU.
CASES = [("ring", 2, "sgd"), ("ring", 4, "adamw"), ("ulysses", 2, "sgd"), ("ulysses", 4, "adamw")]
IDS = [f"{m}-W{w}-{o}" for m, w, o in CASES]
CLIP = "0.01"  # far below every step's gradient norm: each step is clipped
CLIPPED = ("ring", 2, "sgd")  # run once more with --clip, in W=2's launch


def selected_tests(request):
    """This session's selected tests of this module: all of them in a whole run, one when a single
    test is asked for (as tests/test_mutants.py does), so that it launches only what it reads."""
    return [item for item in request.session.items if item.module is request.module]


def needed(request):
    """The cases the selected tests read, in CASES' order."""
    cases = set()
    for item in selected_tests(request):
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "method" in params:
            cases.add((params["method"], params["world"], params["optim"]))
    return [case for case in CASES if case in cases]


def checks_clip(request):
    """Whether test_clip_equals_one_ddp_process_clip is selected: it reads the --clip run."""
    return any(
        item.name == "test_clip_equals_one_ddp_process_clip" for item in selected_tests(request)
    )


DRIVER_TESTS = (  # the tests that read the attention driver's lines
    "test_attention_function_equals_sdpa",
    "test_ring_in_bf16_as_accurate_as_sdpa",
    "test_attention_on_its_own_process_group",
    "test_index_tensors_made_once",
)
DRIVER_LINES = ("CHECK", "BF16", "GROUPS", "INDEX")  # what the driver prints, by its first word


def checks_attention(request):
    """Whether a test that reads the driver's lines is selected."""
    return any(item.name in DRIVER_TESTS for item in selected_tests(request))


def launch(world, argv):
    """helpers.launch_cases, read line by line: the attention driver (tests/cp_attention_check.py,
    the last case of the W=4 launch) prints CHECK, BF16, GROUPS and INDEX lines and no RESULT.
    Returns (the RESULT of each context_parallel case, in order; {first word: the driver's lines
    that start with it})."""
    run = fork_launch("tests/script_cases.py", world, json.dumps(argv, default=str), timeout=400)
    assert run.returncode == 0, run.output
    lines = run.stdout.splitlines()
    results = [json.loads(line[len("RESULT ") :]) for line in lines if line.startswith("RESULT ")]
    driver = {word: [] for word in DRIVER_LINES}
    for line in lines:
        word = line.split(" ", 1)[0]
        if word in driver:
            driver[word].append(json.loads(line[len(word) + 1 :]))
    return results, driver


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """One launch per world size runs the cases the selected tests read, each shared by the three
    tests that read it; the W=4 launch ends with the attention driver when its test is selected.
    The W=2 launch ends with the --clip run when its test is selected, saved as "clip".
    Returns ({case: (RESULT, path of the saved state_dict)}, {first word: the driver's lines})."""
    folder = tmp_path_factory.mktemp("cp")
    saved = {case: folder / f"{i}.pt" for i, case in enumerate(CASES)}
    cases = needed(request)
    out = {}
    driver = {word: [] for word in DRIVER_LINES}
    for world in (2, 4):
        in_world = [case for case in cases if case[1] == world]
        argv = []
        for case in in_world:
            method, _, optim = case
            flags = [*CFG, "--method", method, "--optim", optim, "--save", saved[case]]
            argv.append(["context_parallel", flags])
        clip = world == 2 and checks_clip(request)
        if clip:
            method, _, optim = CLIPPED
            flags = [*CFG, "--method", method, "--optim", optim, "--clip", CLIP]
            argv.append(["context_parallel", [*flags, "--save", folder / "clip.pt"]])
        if world == 4 and checks_attention(request):
            argv.append(["cp_attention_check", []])
        if not argv:
            continue
        results, driver_here = launch(world, argv)
        if clip:
            out["clip"] = (results.pop(), folder / "clip.pt")
        for case, result in zip(in_world, results, strict=True):
            out[case] = (result, saved[case])
        for word, found in driver_here.items():
            driver[word] += found
    return out, driver


@pytest.fixture(scope="module")
def runs(launched):
    """{(method, world, optim): (RESULT, path of the saved state_dict)}."""
    return launched[0]


@pytest.fixture(scope="module")
def checks(launched):
    """The attention driver's CHECK lines: one per subgroup size and head dim."""
    return launched[1]["CHECK"]


@pytest.fixture(scope="module")
def driver(launched):
    """All the attention driver's lines, {first word: [json, ...]}."""
    return launched[1]


def shapes():
    args = common.parse_args(common.get_parser("test"), CFG)
    model = common.build_model(args)
    return (
        args.batch_size,
        model.embed.tokens,
        args.dim,
        args.heads,
        len(model.blocks),
        sum(p.numel() for p in model.parameters()),
    )


@pytest.mark.parametrize("method,world,optim", CASES, ids=IDS)
def test_same_parameters_as_ddp_one_process(method, world, optim, runs, refs):
    r, path = runs[method, world, optim]
    diff = max_diff(refs[optim], path)
    print(f"context_parallel --method {method} W={world} {optim}: max |Δparam| = {diff:.3g}")
    assert r["world_size"] == world and r["steps"] == 6
    assert diff < TOL[optim]


@pytest.mark.parametrize("method,world,optim", CASES, ids=IDS)
def test_measured_collectives(method, world, optim, runs):
    """Ring, per block: W-1 K/V blocks ([2, B, T/W, D] fp32) forward, W-1 K/V blocks and W-1
    dK/dV blocks backward, each a send and a receive. Ulysses, per block: q, k, v and the output
    all-to-all'd forward, their gradients backward, B·T·D/W each. Both: the head's all-reduce of
    the B x D pooled features, and DDP's of the Ψ gradients (one bucket: this model is under DDP's
    first bucket)."""
    r, _ = runs[method, world, optim]
    B, T, D, H, depth, psi = shapes()
    if method == "ring":
        block = 2 * B * (T // world) * D * 4
        calls = dict(send=3 * (world - 1) * depth, recv=3 * (world - 1) * depth)
        want = {k: n * block for k, n in calls.items()}
    else:
        calls = dict(all_to_all=8 * depth)
        want = dict(all_to_all=8 * depth * B * T * D * 4 // world)
    calls["all_reduce"], want["all_reduce"] = 2, 4 * (B * D + psi)
    assert r["comm_steps"] == WINDOW
    measured = {
        k: v for k, v in r["comm"].items() if k != "broadcast"
    }  # DDP's one-time bucket rebuild
    assert measured == want == r["formula"]["comm"], r
    assert {k: v for k, v in r["comm_calls"].items() if k != "broadcast"} == {
        k: WINDOW * n for k, n in calls.items()
    }


@pytest.mark.parametrize("method,world,optim", CASES, ids=IDS)
def test_attention_activations_per_rank(method, world, optim, runs):
    """What attention saved for backward in the first forward, per block: [B, T/W, D] fp32
    tensors (its input, q, k, v, output; Ulysses also the output brought back to this rank's
    tokens) and the log-sum-exp [B, H, T/W]: 1/W of one process's. Never a T x T score matrix."""
    r, _ = runs[method, world, optim]
    B, T, D, H, depth, _ = shapes()
    a = 5 if method == "ring" else 6
    want = depth * (a * B * (T // world) * D + B * H * (T // world)) * 4
    assert r["act_bytes_attention"] == want == r["formula"]["act_bytes_attention"], r
    assert want < depth * B * H * T * T * 4 // world  # smaller than its share of the scores


def test_attention_function_equals_sdpa(checks):
    """Random q, k, v (B=2, H=12, T=24, head dims 5 and 7) on subgroups of 2, 3 and 4 ranks:
    F.scaled_dot_product_attention called on this rank's tokens inside ContextParallel, the ring
    or the Ulysses all-to-alls, gives one process's SDPA output and dq, dk, dv to fp32 round-off,
    without a mask and causal (is_causal=True; the ring skipping the blocks in a rank's future),
    with the contiguous and the zig-zag token split, and grouped-query (enable_gqa with 4 K/V heads,
    scale=0.3); the ring sends W-1 K/V blocks forward and 2(W-1) backward, each step's sends and
    receives in one batch, causal or not; Ulysses all-to-alls 4 tensors each way."""
    assert sorted((c["world"], c["head_dim"]) for c in checks) == [
        (w, d) for w in (2, 3, 4) for d in (5, 7)
    ]
    rings = ("ring", "ring-causal", "ring-zigzag", "ring-gqa")
    ulysses = ("ulysses", "ulysses-causal", "ulysses-zigzag", "ulysses-gqa")
    for c in checks:
        w, d = c["world"], c["head_dim"]
        for method in rings + ulysses:
            errs = {k: c[method][k] for k in ("out", "dq", "dk", "dv")}
            assert max(errs.values()) < 1e-5, (w, d, method, errs)
        for ring in rings:
            assert c[ring]["fwd_calls"] == dict(send=w - 1, recv=w - 1), c
            assert c[ring]["bwd_calls"] == dict(send=2 * (w - 1), recv=2 * (w - 1)), c
            assert c[ring]["send_bytes"] == 3 * (w - 1) * 2 * 2 * 12 * (24 // w) * d * 4, c
            # One batch_isend_irecv per step, each pairing its sends with as many receives;
            # backward sends K/V until its last step and dK/dV partial sums from step 2, then one
            # hop home.
            steps_sending = [step for step in range(w) if step < w - 1 or step >= 2]
            assert c[ring]["paired"], c
            assert c[ring]["fwd_batches"] == w - 1, c
            assert c[ring]["bwd_batches"] == len(steps_sending) + 1, c
        for method in ulysses:
            assert c[method]["fwd_calls"] == dict(all_to_all=4), c
            assert c[method]["bwd_calls"] == dict(all_to_all=4), c


BF16_BAR = 1.5  # the ring in bf16 may err up to 1.5 times SDPA's own bf16 error (it measured 1.15)


def test_ring_in_bf16_as_accurate_as_sdpa(driver):
    """bf16 q, k, v (B=2, H=12, T=24, head dim 16, scores of a few units) on subgroups of 2, 3
    and 4 ranks, without a mask and causal with the zig-zag split: the ring's output and dq, dk, dv
    are within 1.5 times the error of SDPA in bf16 on the whole sequence, both measured against
    SDPA in fp32 on the same values (the ring keeps its scores, O, m, l and gradient sums in fp32
    and casts once; accumulated in bf16 over the W steps they erred 5 to 10 times SDPA's). Under
    CPU autocast to bf16, the ring on fp32 q, k, v stays fp32: within 1e-4 of SDPA in fp32.
    Ulysses in bf16 is SDPA in bf16 on H/W heads: no worse either."""
    assert sorted(line["world"] for line in driver["BF16"]) == [2, 3, 4]
    for line in driver["BF16"]:
        for split in ("plain", "zigzag"):
            errs = line[split]
            bar = errs["sdpa-bf16"]
            for method in ("ring-bf16", "ulysses-bf16"):
                for kind, err in errs[method].items():
                    assert err <= BF16_BAR * bar[kind], (line["world"], split, method, errs)
            assert max(errs["ring-autocast"].values()) < 1e-4, (line["world"], split, errs)


def test_attention_on_its_own_process_group(driver):
    """A forward and backward of the ViT under parallelize at W=4: the ring's sends and receives
    (and Ulysses' all-to-alls) run on a process group of their own, not on DDP's, which its
    gradient all-reduce (and the head's) runs on. On NCCL a group is a communicator that runs its
    operations in turn: on DDP's, the ring's backward transfers would wait behind DDP's bucket
    all-reduces. (That the two overlap on a GPU cannot be seen here: the group is the cause.)"""
    for method, attention_kinds in (("ring", ("send", "recv")), ("ulysses", ("all_to_all",))):
        seen = driver["GROUPS"][0][method]
        ddp_group = seen["ddp"]
        assert seen["kinds"]["all_reduce"] == [ddp_group], seen
        for kind in attention_kinds:
            assert len(seen["kinds"][kind]) == 1 and ddp_group not in seen["kinds"][kind], seen


def test_index_tensors_made_once(driver):
    """Two calls each of split_tokens, the causal zig-zag ring and Ulysses (forward and backward)
    and the ViT's patch embedding at W=4: the first builds the positions (arange) and Ulysses'
    order (sort), the second builds no index tensor and copies none between devices (the causal
    mask, the positions and the order are made once per size and device; the embedding's
    positions live on its parameters' device, here meta: no copy at each call). On a GPU each
    such CPU tensor moved at each call would wait for the copy."""
    (calls,) = driver["INDEX"]
    assert "arange" in calls["first"] and "sort" in calls["first"], calls
    assert calls["second"] == [], calls


def test_clip_equals_one_ddp_process_clip(runs, refs, tmp_path_factory):
    """--clip at a limit below every step's gradient norm: the ring at W=2 ends where ddp.py --clip
    ends in one process, so each rank clipped by the global norm of the whole gradients. Unclipped
    training ends far from there, so the clip bit."""
    method, world, optim = CLIPPED
    result, path = runs["clip"]
    clipped = ddp_references(tmp_path_factory, [*CFG, "--clip", CLIP], (optim,))[optim]
    assert max_diff(clipped, refs[optim]) > 100 * TOL[optim]
    diff = max_diff(path, clipped)
    print(f"context_parallel --method {method} W={world} --clip {CLIP}: max |Δ| = {diff:.2e}")
    assert result["world_size"] == world and result["steps"] == 6
    assert diff < TOL[optim]


@pytest.fixture(scope="module")
def errors_launch():
    """The driver's W=2 launch with --errors, which each test checks ended well: a launch that
    fails must fail the test that reads it, not this fixture (the mutant harness counts an error
    in a fixture as a test not run)."""
    return fork_launch("tests/cp_attention_check.py", 2, "--errors", timeout=60)


def test_errors_are_said_on_every_rank(errors_launch):
    """Inputs that go wrong on one rank raise the same ValueError on both ranks of a W=2 launch
    (tests/cp_attention_check.py --errors), where rank 0 used to see only Gloo's "Connection
    closed by peer": targets of -100 to a loss that ignores -1 (on rank 1, which holds the
    sequences' ends), rank 1 feeding shorter sequences, and 10 tokens that the zig-zag split
    cannot cut into 2W = 4 chunks. And the calls the kernel swap cannot run: SDPA with a mask,
    Ulysses on 3 heads at W = 2, and a forward that calls no SDPA (HF's GPT-2 with "eager"
    attention, written out in matmuls), which would attend to this rank's tokens alone. And SDPA
    under torch's checkpoint (use_reentrant=False), which recomputes it in backward outside the
    swap: torch raises its CheckpointError on both ranks (the recompute saves other tensors than
    the ring did), as the section's contract says, rather than attending locally."""
    run = errors_launch
    assert run.returncode == 0, run.output
    lines = [line for line in run.stdout.splitlines() if line.startswith("ERRORS ")]
    by_rank = sorted(
        (json.loads(line[len("ERRORS ") :]) for line in lines), key=lambda e: e["rank"]
    )
    assert [errors["rank"] for errors in by_rank] == [0, 1], run.output
    expected = {
        "targets": "not ignore_index=-1, on rank(s) [1]",
        "shapes": "the ranks feed batches of different shapes",
        "zigzag": "10 tokens do not split into 4 equal chunks",
        "mask": "with an attn_mask or dropout_p: context parallelism attends over the ranks",
        "ulysses": "Ulysses: 3 heads do not split over 2 ranks",
        "no_sdpa": "the model's forward called no F.scaled_dot_product_attention",
        "checkpoint": "torch.utils.checkpoint:",
    }
    for kind, text in expected.items():
        first, second = (errors[kind] for errors in by_rank)
        assert first == second and text in first, (kind, first, second)


def test_language_model_loss_sums_in_fp32(errors_launch):
    """causal_lm_loss on bf16 logits ([1, 4096, 8], 4,095 valid targets, split over W=2) is one
    process's cross-entropy on the same logits in fp32, to fp32 round-off, and comes back in fp32:
    summed in bf16, the count 4,095 would round to 4,096 and the sum of the losses lose its last
    units (off by ~1e-3 relative)."""
    assert errors_launch.returncode == 0, errors_launch.output
    (line,) = [line for line in errors_launch.stdout.splitlines() if line.startswith("LOSS ")]
    loss = json.loads(line[len("LOSS ") :])
    assert loss["dtype"] == "torch.float32", loss
    assert abs(loss["loss"] - loss["reference"]) < 1e-6 * loss["reference"], loss
