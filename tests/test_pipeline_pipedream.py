"""pipeline_pipedream.py against its own definition (it is not one process's training, by design):
micro-batch j's forward on stage s ran after max(0, j-w) of the stage's optimizer steps (w = p-s-1)
and its backward after j, so it ran w steps stale; and the final parameters are those of a one-process
simulation of the same staleness -- the forward of micro-batch j through each stage's weights after
max(0, j-w) updates, the backward through those same weights (the stash), the update on the current
ones -- with SGD (momentum 0.9) and AdamW. A simulation without the staleness does not match (the test
can fail). One launch at p=3 for both optimizers."""

import functools
import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

import common
import pipeline_pipedream
from helpers import SMALL, max_diff, torchrun

P, M, STEPS = 3, 4, 3
CFG = [
    *SMALL,
    "--dim",
    "16",
    "--depth",
    "3",
    "--heads",
    "2",
    "--max-steps",
    str(STEPS),
    "--lr-schedule",
    "constant",
    "--warmup",
    "0",
]
TOL = {"sgd": 1e-6, "adamw": 5e-5}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pd")
    argv = [
        ["pipeline_pipedream", [*CFG, "--microbatches", M, "--optim", o, "--save", d / f"{o}.pt"]]
        for o in ("sgd", "adamw")
    ]
    run = torchrun("tests/pipeline_cases.py", P, json.dumps(argv, default=str), timeout=400)
    assert run.returncode == 0, run.output
    chunks = run.stdout.split("\nRESULT ")
    assert len(chunks) == 3, run.output
    return {
        o: (json.loads(chunks[i + 1].splitlines()[0]), d / f"{o}.pt")
        for i, o in enumerate(("sgd", "adamw"))
    }


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
    return [mb for (x, y), _ in zip(loader, range(STEPS)) for mb in zip(x.chunk(M), y.chunk(M))]


def simulate(optim, stale=True):
    """One process: every micro-batch in turn through p stages, stage s's weights those after max(0, j-w)
    of its updates (all of them if not stale), the gradient on them, then the stage's update of its
    current weights. Returns the final state_dict."""
    args = common.parse_args(common.get_parser("test"), [*CFG, "--optim", optim])
    model = common.build_model(args)
    stages = [pipeline_pipedream.Stage(model, s, P) for s in range(P)]
    opts = [common.make_optimizer(st.parameters(), args) for st in stages]
    versions = [[{n: q.detach().clone() for n, q in st.named_parameters()}] for st in stages]
    for j, (x, y) in enumerate(micro_batches()):
        used = []
        for s, st in enumerate(stages):
            v = max(0, j - (P - s - 1)) if stale else j
            used.append({n: t.clone().requires_grad_() for n, t in versions[s][v].items()})
            x = torch.func.functional_call(st, used[s], (x,))
        F.cross_entropy(x, y).backward()
        for s, st in enumerate(stages):
            for n, q in st.named_parameters():
                q.grad = used[s][n].grad
            opts[s].step()
            opts[s].zero_grad(set_to_none=True)
            versions[s].append({n: q.detach().clone() for n, q in st.named_parameters()})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_every_backward_uses_its_forwards_weights_w_steps_stale(runs):
    """Stage s (w = p-s-1): micro-batch j's forward after max(0, j-w) updates (the weights it stashes),
    its backward after j: the stage moved on min(j, w) updates in between, which the stash undoes."""
    r = runs["sgd"][0]
    for s, st in enumerate(r["stages"]):
        w = P - s - 1
        assert st["versions"]["fwd"] == [max(0, j - w) for j in range(2 * M)], (s, st["versions"])
        assert st["versions"]["bwd"] == list(range(2 * M)), (s, st["versions"])
    assert r["steps"] == STEPS and r["world_size"] == P


def test_no_flush_between_batches(runs):
    """The first two batches as each stage ran them are one 1F1B stream, F j then B j-w, through the batch
    boundary; replayed one slot per F, two per B, they idle (p-1)/(2m+p-1) of the slots (one 1F1B over
    2m micro-batches, not two over m) with p-s micro-batches in flight on stage s."""
    r = runs["sgd"][0]
    for s, st in enumerate(r["stages"]):
        stream = [
            a
            for j in range(STEPS * M)
            for a in (("F", j, 0), ("B", j - (P - s - 1), 0))
            if 0 <= a[1] < 2 * M
        ]
        assert [tuple(a) for a in st["versions"]["order"]] == stream, s
    assert r["bubble"] == pytest.approx((P - 1) / (2 * M + P - 1))
    assert r["peak_inflight"] == [P - s for s in range(P)]


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_same_parameters_as_the_one_process_simulation(optim, runs, tmp_path, one_thread):
    torch.save(simulate(optim), tmp_path / "sim.pt")
    torch.save(simulate(optim, stale=False), tmp_path / "fresh.pt")
    diff, fresh = (
        max_diff(runs[optim][1], tmp_path / "sim.pt"),
        max_diff(runs[optim][1], tmp_path / "fresh.pt"),
    )
    print(
        f"pipedream p={P} {optim}: max |Δparam| vs simulation {diff:.3g}, vs no staleness {fresh:.3g}"
    )
    assert diff < TOL[optim]
    assert fresh > 100 * TOL[optim]


@pytest.fixture
def one_thread():
    """Tiny matrices: one thread, not a fight over busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_p2p_order_is_nccl_safe(p, monkeypatch, one_thread):
    """Each stage's own train_step over three batches (the last one draining) and an evaluation, run
    in-process, their groups recorded at dist.batch_isend_irecv and replayed under NCCL's rule
    (test_pipeline.replay): across the batch boundaries too, no stage waits for ever."""
    from test_pipeline import record, replay

    args = common.parse_args(common.get_parser("test"), ["--optim", "sgd"])
    for m in (1, p + 1):
        torch.manual_seed(0)
        model = common.ViT(dim=8, depth=p, heads=2, patch=14)
        stages = [pipeline_pipedream.Stage(model, s, p) for s in range(p)]
        x, y = torch.randn(2 * m, 1, 28, 28), torch.randint(0, 10, (2 * m,))
        groups = []
        for st in stages:
            opt = common.make_optimizer(st.parameters(), args)
            groups.append(
                record(
                    monkeypatch,
                    st,
                    lambda: (
                        [pipeline_pipedream.train_step(st, x, y, m, opt, k == 2) for k in range(3)]
                        + [pipeline_pipedream.infer(st, x)]
                    ),
                )
            )
        monkeypatch.undo()
        assert sum(op[1] == "send" for g in groups for b in g for op in b) == 3 * 2 * (
            p - 1
        ) * m + (p - 1)
        assert replay(groups) is None, (p, m, groups)
