"""pipeline_pipedream.py against its own definition (it is not one process's training, by design):
micro-batch j's forward on stage s ran after max(0, j-w) of the stage's optimizer steps (w =
p-s-1) and its backward after j, so it ran w steps stale; and the final parameters are those of a
one-process simulation of the same staleness -- the forward of micro-batch j through each stage's
weights after max(0, j-w) updates, the backward through those same weights (the stash), the update
on the current ones -- with SGD (momentum 0.9) and AdamW. A simulation without the staleness does
not match (the test can fail). One launch at p=3 for both optimizers.

NCCL's rule: every communication the loop issues, collectives included, replayed in-process
(test_pipeline's replay) across batch and epoch boundaries; the same replay fails when the last
backward's gradient is sent at the end of its step (the code before the fix of issue 25).

--simulate W: every stage's first two batches run in the one process, the same stream replayed."""

import functools
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from causal_lm import CONTEXT, CausalLM
from test_pipeline import (
    LOOP,
    LOOP_COLLECTIVES,
    LOOP_STEPS,
    collectives,
    loop_calls,
    replay,
    sends,
    simulated,
    stage_params,
)
from torch.utils.data import DataLoader, DistributedSampler

import common
import pipeline_pipedream
from helpers import ROOT, SMALL, launch_cases, max_diff

P = 3
M = 4
STEPS = 3
CFG = [*SMALL, "--dim", "16", "--depth", "3", "--heads", "2", "--max-steps", str(STEPS)]
CFG += ["--lr-schedule", "constant", "--warmup", "0"]
TOL = {"sgd": 1e-6, "adamw": 5e-5}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both optimizers in one launch: {optim: (RESULT, saved path)}."""
    folder = tmp_path_factory.mktemp("pd")
    optims = ("sgd", "adamw")
    argv = []
    for optim in optims:
        flags = [*CFG, "--microbatches", M, "--optim", optim, "--save", folder / f"{optim}.pt"]
        argv.append(["pipeline_pipedream", flags])
    results = launch_cases(P, argv)
    return {optim: (results[k][0], folder / f"{optim}.pt") for k, optim in enumerate(optims)}


@functools.lru_cache(maxsize=1)
def micro_batches():
    """The micro-batches the script trained on, in order: its DistributedSampler of one, epoch 0."""
    args = common.parse_args(common.get_parser("test"), CFG)
    train_set = common.load_data(args)[0]
    sampler = DistributedSampler(
        train_set, num_replicas=1, rank=0, shuffle=True, seed=args.seed, drop_last=True
    )
    sampler.set_epoch(0)  # the script's first epoch: its shuffle and its augmentation
    train_set.set_epoch(0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    stream = []
    for (x, y), _ in zip(loader, range(STEPS), strict=False):
        stream += zip(x.chunk(M), y.chunk(M), strict=True)
    return stream


def weights(stage):
    return {name: parameter.detach().clone() for name, parameter in stage.named_parameters()}


def simulate(optim, stale=True):
    """One process: every micro-batch in turn through the p stages, stage s's weights those after
    max(0, j-w) of its updates (all of them if not stale), the gradient on them, then the stage's
    update of its current weights. Returns the final state_dict."""
    args = common.parse_args(common.get_parser("test"), [*CFG, "--optim", optim])
    model = common.build_model(args)
    stages = [pipeline_pipedream.Stage(model, s, P) for s in range(P)]
    optimizers = [common.make_optimizer(stage.parameters(), args) for stage in stages]
    versions = [[weights(stage)] for stage in stages]  # stage s's weights after each update
    for j, (x, y) in enumerate(micro_batches()):
        stashes = []
        for s, stage in enumerate(stages):
            version = max(0, j - (P - s - 1)) if stale else j
            stash = {name: t.clone().requires_grad_() for name, t in versions[s][version].items()}
            stashes.append(stash)
            x = torch.func.functional_call(stage, stash, (x,))
        F.cross_entropy(x, y).backward()
        for stage, stash, optimizer, history in zip(
            stages, stashes, optimizers, versions, strict=True
        ):
            for name, parameter in stage.named_parameters():
                parameter.grad = stash[name].grad
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            history.append(weights(stage))
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_every_backward_uses_its_forwards_weights_w_steps_stale(runs):
    """Stage s (w = p-s-1): micro-batch j's forward after max(0, j-w) updates (the weights it
    stashes), its backward after j: the stage moved on min(j, w) updates in between, which the
    stash undoes."""
    result = runs["sgd"][0]
    for s, stage in enumerate(result["stages"]):
        w = P - s - 1
        assert stage["versions"]["forward"] == [max(0, j - w) for j in range(2 * M)], s
        assert stage["versions"]["backward"] == list(range(2 * M)), s
    assert result["steps"] == STEPS and result["world_size"] == P


def test_no_flush_between_batches(runs):
    """The first two batches as each stage ran them are one 1F1B stream, F j then B j-w, through
    the batch boundary; replayed one slot per F, two per B, they idle (p-1)/(2m+p-1) of the slots
    (one 1F1B over 2m micro-batches, not two over m), the script's formula, with p-s micro-batches
    in flight on stage s."""
    result = runs["sgd"][0]
    for s, stage in enumerate(result["stages"]):
        stream = []
        for j in range(STEPS * M):
            stream += [("F", j, 0), ("B", j - (P - s - 1), 0)]
        recorded = [action for action in stream if 0 <= action[1] < 2 * M]
        assert [tuple(action) for action in stage["order"]] == recorded, s
    assert result["bubble"] == pytest.approx((P - 1) / (2 * M + P - 1))
    assert result["formula"]["bubble"] == pytest.approx((P - 1) / (2 * M + P - 1))
    assert result["peak_inflight"] == result["formula"]["peak_inflight"] == [3, 2, 1]


def test_simulated_stream_from_every_stage(monkeypatch, capsys, one_thread):
    """--simulate 5 at m = 2 (fewer micro-batches a batch than stage 0's w = 4 ahead): the one
    process runs each of the 5 stages' first two batches in turn (the fake group's gather has only
    its own), and each ran the stream F j then B j-w through the batch boundary; replayed they idle
    (p-1)/(2m+p-1) of the slots, the formula, with p-s in flight on stage s but at most the 2m
    micro-batches of the two batches. The memory and traffic reported stay rank 0's in its one
    step, the run's last: Ψ_0, m activations out, m gradients in."""
    p, m = 5, 2
    flags = [*CFG, "--depth", p, "--simulate", p, "--microbatches", m]
    result = simulated(pipeline_pipedream, flags, monkeypatch, capsys)
    assert result["simulated"] and result["world_size"] == p and "stages" not in result
    for s, order in enumerate(result["orders"]):
        stream = []
        for j in range(2 * m + p):
            stream += [("F", j, 0), ("B", j - (p - s - 1), 0)]
        assert [tuple(action) for action in order] == [a for a in stream if 0 <= a[1] < 2 * m], s
    assert result["bubble"] == pytest.approx((p - 1) / (2 * m + p - 1))
    assert result["formula"]["bubble"] == pytest.approx((p - 1) / (2 * m + p - 1))
    assert result["peak_inflight"] == result["formula"]["peak_inflight"] == [4, 4, 3, 2, 1]
    args = common.parse_args(common.get_parser("test"), [*CFG, "--depth", str(p)])
    model = common.build_model(args)
    psi = stage_params(model, p)[0]
    assert (result["param_bytes"], result["optim_bytes"]) == (4 * psi, 8 * psi)
    message = 4 * (args.batch_size // m) * model.embed.tokens * args.dim
    assert result["comm"] == dict(send=m * message, recv=m * message)
    assert result["comm_calls"] == dict(send=m, recv=m) and result["comm_steps"] == 1


@pytest.fixture
def one_thread():
    """Tiny matrices: one thread, not a fight over busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_same_parameters_as_the_one_process_simulation(optim, runs, tmp_path, one_thread):
    torch.save(simulate(optim), tmp_path / "sim.pt")
    torch.save(simulate(optim, stale=False), tmp_path / "fresh.pt")
    diff = max_diff(runs[optim][1], tmp_path / "sim.pt")
    fresh = max_diff(runs[optim][1], tmp_path / "fresh.pt")
    print(f"pipedream p={P} {optim}: max |Δparam| vs simulation {diff:.3g}, unstale {fresh:.3g}")
    assert diff < TOL[optim]
    assert fresh > 100 * TOL[optim]


def pipedream_loop(p, m, monkeypatch, *flags):
    flags = [*LOOP, "--depth", p, "--batch-size", 2 * m, "--microbatches", m, *flags]
    return loop_calls(pipeline_pipedream, flags, p, monkeypatch)


# p=4, m=1: stage 0 (w=3) takes its first update in the fourth batch, while the learning-rate
# schedule steps every batch on every stage (the same rate for the same batch): torch warns.
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
@pytest.mark.parametrize("p", [2, 3, 4])
def test_p2p_order_is_nccl_safe(p, monkeypatch, one_thread):
    """m in {1, p+1}: every communication each rank's loop issues (test_pipeline.loop_calls: train
    past logging steps and an epoch boundary, evaluation, the save), replayed under NCCL's rule:
    across batch and epoch boundaries and the loop's all-reduces no stage waits for ever; every
    micro-batch's activation and gradient crosses each boundary once; every rank issues the
    loop's collectives in the same order. The last batch drains the stream: the run's last step
    by --max-steps (m = 1), or the last epoch's last batch (m = p+1, no --max-steps: 4 steps)."""
    for m, flags, steps in ((1, [], LOOP_STEPS), (p + 1, ["--max-steps", 0], 4)):
        calls = pipedream_loop(p, m, monkeypatch, *flags)
        assert sends(calls) == steps * 2 * (p - 1) * m + 2 * (p - 1)
        logged = [("all_reduce", 1)] * (steps - LOOP_STEPS)
        assert [collectives(rank_calls) for rank_calls in calls] == [logged + LOOP_COLLECTIVES] * p
        assert replay(calls) is None, (p, m)


def test_the_replay_catches_a_send_left_open_across_the_loops_all_reduce(monkeypatch, one_thread):
    """The code before the fix of issue 25 sent a batch's last gradient at the end of its step,
    which stage s-1 receives only in its next step, after the loop's all-reduce: the replay of the
    loop finds that deadlock (the test above can fail)."""
    train_step = pipeline_pipedream.train_step

    def closing_send_at_once(stage, *args, **kwargs):
        loss = train_step(stage, *args, **kwargs)
        pipeline_pipedream.p2p(stage.pending, stage.group)
        stage.pending = []
        return loss

    monkeypatch.setattr(pipeline_pipedream, "train_step", closing_send_at_once)
    assert replay(pipedream_loop(2, 2, monkeypatch)) is not None


def test_a_weight_tied_across_stages_is_refused(monkeypatch):
    """A language model's tied embedding (tests/causal_lm.py: lm_head.weight is wte.weight) cannot
    be kept in step by PipeDream's per-micro-batch steps: parallelize says so before training,
    instead of training two copies that drift apart (pipeline.py sums them)."""
    monkeypatch.setattr(pipeline_pipedream.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(pipeline_pipedream.dist, "get_rank", lambda group=None: 0)
    with pytest.raises(ValueError, match="share \\['head.lm_head.weight'\\].*use pipeline.py"):
        model = CausalLM()
        shape = (CONTEXT, model.embed.wte.embedding_dim)  # what it sends, as copy_pipeline's
        pipeline_pipedream.parallelize(model, torch.device("cpu"), activation_shape=shape)


def test_clip_is_refused_before_any_process_group():
    """--clip has no meaning here (each stage steps after each of its backwards, at its own times:
    no step has a norm over all stages), so the script refuses it in one message before it starts
    any process: a clip by each stage's own norm would train silently unlike one process."""
    run = subprocess.run(
        [sys.executable, "pipeline_pipedream.py", "--nproc", "2", "--clip", "0.5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.count("--clip is refused") == 1, run.stderr
    assert "init_process_group" not in run.stderr and "rank 1" not in run.stderr


def test_infer_receives_in_the_model_dtype(monkeypatch):
    """Issue 33, item 6, in one process: the model converted to bf16, infer() on three stages,
    rank by rank (test_nd_parallel's stand-in for torch.distributed, which checks that each
    receive buffer has the shape and dtype of the message). Each stage receives bf16, the dtype
    its peer sends (on NCCL an fp32 buffer posts twice the bytes sent: a hang or garbage), and the
    last stage's logits are the whole model's. train_step takes its buffers from the same
    Stage.empty."""
    from test_nd_parallel import Message, OneRankAtATime

    model = common.build_model(common.parse_args(common.get_parser("test"), CFG))
    model = model.eval().to(torch.bfloat16)
    images = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    images = images.to(torch.bfloat16)
    fake = OneRankAtATime()
    monkeypatch.setattr(dist, "batch_isend_irecv", fake.batch_isend_irecv)
    monkeypatch.setattr(dist, "P2POp", Message)
    outputs = []
    for index in range(3):
        fake.rank = index
        fake.calls[index] = []
        stage = pipeline_pipedream.Stage(model, index, 3)
        stage.group = None  # the world, as parallelize sets it for group=None
        outputs.append(pipeline_pipedream.infer(stage, images))
    assert all(messages == [] for messages in fake.in_flight.values()), "a message never received"
    with torch.no_grad():
        expected = model(images)
    assert outputs[2].dtype == torch.bfloat16
    assert torch.equal(outputs[2], expected)
