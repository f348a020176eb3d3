"""common.py in-process: the data path, the sampler's promises, the model, checkpoint files."""

import argparse
import datetime
import json
import os
import socket
import struct
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import common
from common.launch import adopt_launcher_environment, launcher_local_rank, slurm_tasks_on_node
from helpers import ROOT, kill_group

ARGS = ["--data", "synthetic", "--limit", "300"]


def parse(*argv):
    return common.parse_args(common.get_parser("test"), list(argv))


def write_idx(root, n_train=64, n_test=32):
    """Tiny MNIST in the IDX format torchvision reads, in root/MNIST/raw."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    out = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        x = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g)
        y = torch.randint(0, 10, (n,), dtype=torch.uint8, generator=g)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(
            struct.pack(">IIII", 2051, n, 28, 28) + x.numpy().tobytes()
        )
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(
            struct.pack(">II", 2049, n) + y.numpy().tobytes()
        )
        out[prefix] = (x, y)
    return out


# --------------------------------------------------------------------------- data


def test_synthetic_is_deterministic_mnist_shaped_and_prefix_stable():
    x, y = common.synthetic_digits(3000, seed=7)
    assert x.shape == (3000, 28, 28) and x.dtype == torch.uint8 and y.shape == (3000,)
    assert set(y.tolist()) == set(range(10))
    x2, y2 = common.synthetic_digits(3000, seed=7)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, y3 = common.synthetic_digits(1000, seed=7)  # --limit takes a prefix of the same set
    assert torch.equal(x3, x[:1000]) and torch.equal(y3, y[:1000])
    assert not torch.equal(common.synthetic_digits(100, seed=8)[0], x[:100])


def test_synthetic_classes_are_not_trivially_separable():
    """A nearest-class-mean classifier (which solves a set of fixed templates) must not be
    near-perfect."""
    x, y = common.synthetic_digits(6000, seed=1)
    x = x.float().flatten(1)
    means = torch.stack([x[:5000][y[:5000] == c].mean(0) for c in range(10)])
    acc = (torch.cdist(x[5000:], means).argmin(1) == y[5000:]).float().mean().item()
    assert 0.3 < acc < 0.9, acc


def tensors(ds):
    return torch.stack([ds[i][0] for i in range(len(ds))]), torch.stack(
        [ds[i][1] for i in range(len(ds))]
    )


def test_load_data_normalises_and_limits():
    train, test, source = common.load_data(parse(*ARGS, "--shift", "0"))
    (xtr, ytr), (xte, _) = tensors(train), tensors(test)
    assert source == "synthetic" and xtr.shape == (300, 1, 28, 28) and xte.shape == (300, 1, 28, 28)
    assert xtr.dtype == torch.float32 and ytr.dtype == torch.long
    raw = common.synthetic_digits(300, common.SYNTHETIC_SEED)[0]
    assert torch.allclose(xtr[:, 0], (raw.float() / 255 - common.MNIST_MEAN) / common.MNIST_STD)


def test_shift_augmentation_depends_on_seed_epoch_and_index_only():
    """--shift 2: each training image moved by whole pixels in [-2, 2], the same for the same
    (seed, epoch, index) in any process, new each epoch; the test set is never shifted."""
    train, test, _ = common.load_data(parse(*ARGS, "--shift", "2"))
    plain, bg = train.x, train.x.amin()
    moves = set()
    for epoch in (0, 1):
        train.set_epoch(epoch)
        for i in range(40):
            x = train[i][0][0]
            pad = torch.nn.functional.pad(plain[i, 0], (2, 2, 2, 2), value=float(bg))
            found = [
                (dy, dx)
                for dy in range(-2, 3)
                for dx in range(-2, 3)
                if torch.equal(x, pad[2 - dy : 30 - dy, 2 - dx : 30 - dx])
            ]
            assert found, (epoch, i)
            moves.add((epoch, i, found[0]))
    assert len({m[2] for m in moves}) > 10  # many different moves
    assert any(
        a[2] != b[2] for a in moves for b in moves if a[:2] == (0, b[1]) and b[0] == 1
    )  # new each epoch
    again, _, _ = common.load_data(parse(*ARGS, "--shift", "2"))
    again.set_epoch(1)
    assert all(
        torch.equal(again[i][0], train[i][0]) for i in range(40)
    )  # a function of (seed, epoch, index)
    assert torch.equal(test[3][0], test.x[3])


def test_batched_fetch_equals_per_sample_fetch():
    """Digits.__getitems__ (the DataLoader's batched fetch) gives exactly the samples
    __getitem__ gives one by one: the same shifts for the same (epoch, index), wherever the index
    sits in the batch; and so does the evaluation loader's."""
    train, test, _ = common.load_data(parse(*ARGS, "--shift", "2"))
    indices = [5, 0, 299, 17, 5, 128, 64, 3]  # any order, a repeat
    for ds in (train, test):
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            for batch in (indices, indices[::-1], indices[3:]):
                got = ds.__getitems__(batch)
                assert len(got) == len(batch)
                for i, (x, y) in zip(batch, got, strict=True):
                    want_x, want_y = ds[i]
                    assert torch.equal(x, want_x) and torch.equal(y, want_y), (epoch, i)
    assert not torch.equal(train.__getitems__([5])[0][0], train.x[5])  # shifted
    masked = common._Masked(test)
    for (x, y, keep), i in zip(masked.__getitems__([7, -1, 2]), [7, -1, 2], strict=True):
        want_x, want_y, want_keep = masked[i]
        assert torch.equal(x, want_x) and torch.equal(y, want_y) and keep == want_keep == (i >= 0)


def test_loaders_fetch_one_batch_per_call(monkeypatch):
    """The scripts' training loader and the evaluation loader fetch each batch with one call to
    the dataset, never one call per sample, and give the batches per-sample fetching gives."""
    train, test, _ = common.load_data(parse(*ARGS, "--shift", "1"))
    calls = {"__getitem__": 0, "__getitems__": 0}
    for cls in (common.Digits, common._Masked):
        for name in calls:
            original = getattr(cls, name)

            def counted(self, arg, original=original, name=name):
                calls[name] += 1
                return original(self, arg)

            monkeypatch.setattr(cls, name, counted)
    sampler = DistributedSampler(
        train, num_replicas=2, rank=1, shuffle=True, seed=3, drop_last=True
    )
    sampler.set_epoch(1)
    train.set_epoch(1)
    loader = DataLoader(train, batch_size=32, sampler=sampler, drop_last=True, pin_memory=False)
    batches = list(loader)
    assert calls == {"__getitem__": 0, "__getitems__": len(batches)} and len(batches) == 4
    order = list(sampler)
    for k, (x, y) in enumerate(batches):
        want = [train[i] for i in order[32 * k : 32 * (k + 1)]]
        assert torch.equal(x, torch.stack([w[0] for w in want]))
        assert torch.equal(y, torch.stack([w[1] for w in want]))
    calls.update({"__getitem__": 0, "__getitems__": 0})
    evaluation = list(common.test_loader(test, rank=1, world=2, batch=64))
    assert calls == {"__getitem__": 0, "__getitems__": len(evaluation)} and len(evaluation) == 3
    x, y, keep = (torch.cat(parts) for parts in zip(*evaluation, strict=True))
    assert keep.dtype == torch.bool and keep.sum() == 150 and keep.all()
    assert torch.equal(x, test.x[1::2]) and torch.equal(y, test.y[1::2])


def test_mnist_from_idx_files(tmp_path):
    written = write_idx(tmp_path)
    for data in ("auto", "mnist"):
        train, test, source = common.load_data(parse("--data", data, "--data-dir", str(tmp_path)))
        _, ytr = tensors(train)
        xte, yte = tensors(test)
        assert source == "mnist"
        assert torch.equal(ytr, written["train"][1].long()) and torch.equal(
            yte, written["t10k"][1].long()
        )
        assert torch.allclose(
            xte[:, 0], (written["t10k"][0].float() / 255 - common.MNIST_MEAN) / common.MNIST_STD
        )


@pytest.fixture
def offline(monkeypatch):
    """No MNIST download possible, even on a machine that has internet: point the mirrors at a
    closed port."""
    from torchvision.datasets import MNIST

    monkeypatch.setattr(MNIST, "mirrors", ["http://127.0.0.1:9/"])


def test_auto_falls_back_to_synthetic_with_one_warning(tmp_path, offline, capsys):
    *_, source = common.load_data(
        parse("--data", "auto", "--data-dir", str(tmp_path), "--limit", "100")
    )
    out = capsys.readouterr()
    assert source == "synthetic"
    warnings = [line for line in (out.out + out.err).splitlines() if line.strip()]
    assert (
        len(warnings) == 1 and warnings[0].startswith("warning:") and "synthetic" in warnings[0]
    ), warnings


def test_mnist_offline_without_files_is_a_clear_error(tmp_path, offline, capsys):
    with pytest.raises(SystemExit) as e:
        common.load_data(parse("--data", "mnist", "--data-dir", str(tmp_path)))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert (
        err.count("error:") == 1 and "could not be downloaded" in err and "--data synthetic" in err
    )


def two_nodes(tmp_path, cwds, *args, timeout=150, env=None, per_node=1):
    """Two torchrun agents as two 'nodes' of `per_node` processes each, each node started in its
    own directory, so a relative --data-dir is node-local, as on a cluster without a shared disk
    (the same directory twice: a shared file system). `env`: more variables for both nodes. One
    process a node unless a test needs a node's second rank (each costs a torch import)."""
    port = common.free_port()
    procs = []
    for node, cwd in enumerate(cwds):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--nproc_per_node={per_node}",
            f"--node-rank={node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=data",
            f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}",
            ROOT / "ddp.py",
            *args,
        ]
        node_env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(ROOT / "tests" / "faults"),
            "OFFLINE": "1",
            **(env or {}),
        }
        procs.append(
            subprocess.Popen(
                [str(c) for c in cmd],
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=node_env,
                start_new_session=True,  # its own process group: a kill reaches its ranks too
            )
        )
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            kill_group(p)
    return [p.returncode for p in procs], outs


def test_nodes_decide_on_the_data_together(tmp_path):
    """Node 0 has MNIST in its own data/, node 1 has none and cannot download it (offline): every
    rank must agree, falling back to synthetic (auto) with node 1 saying why, or failing with one
    clear message (mnist) -- not node 1 crashing on files only node 0 has. (Node 1 finding MNIST
    in its own --data-dir, so that every rank trains on it: the shared-disk test below, where it
    finds rank 0's files by the same look.)"""
    a, b = tmp_path / "node0", tmp_path / "node1"
    write_idx(a / "data", n_train=64, n_test=32)
    b.mkdir()
    cfg = [
        "--limit",
        "64",
        "--batch-size",
        "16",
        "--dim",
        "32",
        "--depth",
        "1",
        "--max-steps",
        "2",
        "--no-progress",
    ]
    codes, outs = two_nodes(tmp_path, [a, b], *cfg, "--data", "auto")
    assert codes == [0, 0], outs
    assert '"data": "synthetic"' in outs[0][0] and "MNIST is not in data/MNIST/raw" in outs[1][1], (
        outs
    )
    codes, outs = two_nodes(tmp_path, [a, b], *cfg, "--data", "mnist")
    assert codes[0] != 0 and codes[1] != 0, outs
    assert outs[0][1].count("error: --data mnist: MNIST is missing on another node") == 1, outs
    assert outs[1][1].count("MNIST is not in data/MNIST/raw") == 1, (
        outs
    )  # once, from node 1's local rank 0


@pytest.mark.full  # two nodes' launches, 14 s: test_nodes_decide_on_the_data_together stays quick
def test_on_a_shared_disk_rank_zero_alone_downloads(tmp_path):
    """Both nodes start in one directory (a shared file system) without MNIST. Rank 0 alone
    downloads (slowly, file by file, see FAKE_MNIST); the other node looks only once rank 0 is
    done, so it never reads a half-written file, and every rank trains on MNIST."""
    source = tmp_path / "source"
    write_idx(source, n_train=64, n_test=32)
    for path in (source / "MNIST" / "raw").iterdir():
        path.rename(source / path.name)
    shared = tmp_path / "shared"
    shared.mkdir()
    cfg = [*"--limit 64 --batch-size 16 --dim 32 --depth 1 --max-steps 2".split()]
    codes, outs = two_nodes(
        tmp_path,
        [shared, shared],
        *cfg,
        "--no-progress",
        "--data",
        "mnist",
        env={"FAKE_MNIST": str(source)},
    )
    assert codes == [0, 0], outs
    assert '"data": "mnist"' in outs[0][0], outs
    assert (source / "downloads.log").read_text() == "rank 0\n"


@pytest.mark.full  # two nodes' launches, 22 s: test_nodes_decide_on_the_data_together stays quick
def test_an_error_found_on_one_node_is_said_on_that_node(tmp_path):
    """The --load file is missing on node 1 only (HIDE on its local rank 0, global rank 2). The
    error is found before any process group exists, so node 1 must say it itself: on its own,
    rank 0 (node 0) would say nothing and node 1 would exit in silence."""
    checkpoint = tmp_path / "start.pt"
    torch.save(common.build_model(parse("--dim", "32", "--depth", "1")).state_dict(), checkpoint)
    a, b = tmp_path / "node0", tmp_path / "node1"
    a.mkdir()
    b.mkdir()
    cfg = [*"--data synthetic --limit 64 --batch-size 16 --dim 32 --depth 1".split()]
    codes, outs = two_nodes(
        tmp_path,
        [a, b],
        *cfg,
        "--max-steps",
        "2",
        "--no-progress",
        "--timeout",
        "15",
        "--load",
        str(checkpoint),
        env={"HIDE": str(checkpoint), "FAULT_RANK": "2"},
        timeout=120,
        per_node=2,  # node 1's first rank is global rank 2: not rank 0, nor the node's index
    )
    assert codes[1] != 0, outs
    node1_errors = [line for line in outs[1][1].splitlines() if line.startswith("error")]
    assert len(node1_errors) == 1, outs[1][1]
    assert "(rank 2 on " in node1_errors[0] and f"--load {checkpoint}" in node1_errors[0]


@pytest.mark.parametrize(
    "gpus, local_world, visible, refused",
    [
        (4, 8, None, True),
        (2, 3, None, True),
        (4, 4, None, False),
        (8, 2, None, False),
        (1, 4, "3", False),
        (1, 2, None, True),
        (2, 4, "0,1", True),
    ],
)
def test_backend_refuses_two_ranks_on_one_gpu(
    monkeypatch, capsys, gpus, local_world, visible, refused
):
    """More local ranks than visible GPUs would put two ranks on one GPU: one message, exit 2
    (NCCL's own refusal comes later, from every rank). One GPU that CUDA_VISIBLE_DEVICES shows is a
    launcher's per-process binding: allowed. One GPU in the node and two ranks: refused."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    # the refusal is said by the node's local rank 0; an allowed run shows rank 1's device
    monkeypatch.setenv("LOCAL_RANK", "0" if refused else "1")
    monkeypatch.setenv("RANK", "0" if refused else "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    if refused:
        with pytest.raises(SystemExit) as exit_info:
            common.pick_backend("auto")
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("error") == 1 and "two ranks would share a GPU" in err, err
    else:
        backend, device = common.pick_backend("auto")
        assert backend == "nccl" and device == torch.device("cuda", 1 % gpus)


def test_nproc_refuses_more_ranks_than_gpus(monkeypatch, capsys):
    """`--nproc N` starts every rank with this process's environment: one GPU that
    CUDA_VISIBLE_DEVICES shows is then the same GPU for all of them, not a per-rank binding.
    Refused before any rank starts, in one message."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    args = argparse.Namespace(nproc=2, backend="auto", simulate=0)
    started = []
    with pytest.raises(SystemExit) as exit_info:
        common.launch(started.append, args)
    assert exit_info.value.code == 2 and not started
    err = capsys.readouterr().err
    assert err.count("error") == 1 and "two ranks would share a GPU" in err, err
    args.backend = "gloo"  # the CPU: the GPUs do not matter
    monkeypatch.setattr(torch.multiprocessing, "spawn", lambda *a, **k: started.append(k))
    common.launch(started.append, args)
    assert len(started) == 1


@pytest.mark.parametrize(
    "gpus, refused",
    [
        ([("a", "u0"), ("a", "u1"), ("a", "u0")], "ranks 0 and 2"),  # rank 2 on rank 0's GPU
        ([("a", "u0"), ("a", "u1"), ("a", "u2")], None),  # one GPU each
        ([("a", "u0"), ("b", "u0"), ("c", "u0")], None),  # three hosts, their own GPUs
    ],
)
def test_ranks_on_one_gpu_are_refused_once_before_nccl(monkeypatch, capsys, gpus, refused):
    """`CUDA_VISIBLE_DEVICES=0 torchrun --nproc_per_node=2` passes pick_backend (one visible GPU
    looks like a per-rank binding). After the rendezvous the ranks compare (host, GPU UUID)
    through the store: a shared GPU is one message from rank 0 and exit 2 on every rank, before
    init_process_group (NCCL would say "Duplicate GPU" from each). On the CPU the store is not
    touched."""
    base = dist.HashStore()
    base.set_timeout(datetime.timedelta(seconds=20))  # a rank left waiting fails, not hangs
    ranks = threading.local()
    world = len(gpus)
    monkeypatch.setattr(dist, "rendezvous", lambda *a, **k: iter([(base, ranks.rank, world)]))
    monkeypatch.setattr(socket, "gethostname", lambda: gpus[ranks.rank][0])

    def properties(device):
        assert device == torch.device("cuda", ranks.rank)
        return argparse.Namespace(uuid=gpus[ranks.rank][1])

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    joined = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: joined.append(k["rank"]))
    codes = [None] * world

    def rank_main(rank, device):
        ranks.rank = rank
        try:
            assert common.init_process_group("nccl", device, 20) == (rank, world)
            codes[rank] = 0
        except SystemExit as e:
            codes[rank] = e.code

    threads = [
        threading.Thread(target=rank_main, args=(r, torch.device("cuda", r))) for r in range(world)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    err = capsys.readouterr().err
    if refused:
        assert codes == [2] * world and not joined, codes
        assert err.count("error") == 1 and f"{refused} share one GPU (u0) on a" in err, err
    else:
        assert codes == [0] * world and sorted(joined) == list(range(world)), codes
        assert "error" not in err, err
    # On the CPU: no GPU to compare, nothing written to the store.
    base = dist.HashStore()
    ranks.rank = 0
    monkeypatch.setattr(torch.cuda, "get_device_properties", None)
    assert common.init_process_group("gloo", torch.device("cpu"), 20) == (0, world)
    assert base.num_keys() == 0


# --------------------------------------------------------------------------- samplers


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_train_shards_are_disjoint_cover_and_reshuffle(world):
    """The scripts' DistributedSampler + DataLoader (batch/W each, drop_last): global batch k holds
    the same samples at every world size, so every technique sees the same batches."""
    n, batch = 103, 12  # neither divides evenly
    ds = common.Digits(torch.arange(n).float(), torch.arange(n))

    def loader(rank, w, epoch):
        sampler = DistributedSampler(
            ds, num_replicas=w, rank=rank, shuffle=True, seed=5, drop_last=True
        )
        sampler.set_epoch(epoch)
        return DataLoader(ds, batch_size=batch // w, sampler=sampler, drop_last=True)

    epochs = []
    for epoch in range(2):
        per_rank = [[b[1].tolist() for b in loader(rank, world, epoch)] for rank in range(world)]
        flat = [i for r in per_rank for b in r for i in b]
        assert len(flat) == len(set(flat))  # disjoint
        assert all(len(b) == batch // world for r in per_rank for b in r)
        steps = min(len(r) for r in per_rank)
        assert all(len(r) == steps for r in per_rank)  # every rank takes the same number of steps
        epochs.append([sorted(i for r in per_rank for i in r[k]) for k in range(steps)])
    if batch % world == 0 and n // world % (batch // world) == 0:
        assert epochs[0] == [sorted(b[1].tolist()) for b in loader(0, 1, 0)][: len(epochs[0])]
    assert epochs[0] != epochs[1]  # set_epoch reshuffles


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_test_shards_count_every_sample_once_with_equal_batches(world):
    """Padded evaluation: every rank gets the same number of batches (so the same collectives:
    FSDP / ZeRO-3 all-gathers cannot meet another rank's all-reduce), and the kept samples are
    every test sample exactly once."""
    n = 1025
    ds = common.Digits(torch.zeros(n, 1), torch.arange(n))
    loaders = [list(common.test_loader(ds, r, world, batch=512)) for r in range(world)]
    assert len({len(loader) for loader in loaders}) == 1
    sizes = [[len(batch[1]) for batch in loader] for loader in loaders]
    assert all(size == sizes[0] for size in sizes)
    kept = [i for loader in loaders for _, y, keep in loader for i in y[keep].tolist()]
    assert sorted(kept) == list(range(n))


# --------------------------------------------------------------------------- model


def test_model_is_seeded_and_shaped():
    a, b = common.build_model(parse("--seed", "3")), common.build_model(parse("--seed", "3"))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    c = common.build_model(parse("--seed", "4"))
    assert not torch.equal(a.blocks[0].attn.q.weight, c.blocks[0].attn.q.weight)
    assert a(torch.randn(5, 1, 28, 28)).shape == (5, 10)
    assert a.blocks[0].attn.k.bias is None  # a key bias would get a zero gradient
    assert not any(isinstance(m, (torch.nn.BatchNorm2d, torch.nn.Dropout)) for m in a.modules())
    m = common.build_model(parse("--dim", "48", "--depth", "3", "--heads", "6"))
    assert len(m.blocks) == 3 and m.blocks[0].mlp.fc1.out_features == 192


def test_model_is_a_sequence_of_pieces():
    """embed -> blocks -> head is the whole forward: what pipeline and FSDP rely on."""
    m = common.build_model(parse())
    x = torch.randn(3, 1, 28, 28)
    h = m.embed(x)
    for blk in m.blocks:
        h = blk(h)
    assert torch.equal(m.head(h), m(x))


# --------------------------------------------------------------------------- flags and checkpoints


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--data", "foo"], "invalid choice: 'foo'"),
        (["--dim", "30", "--heads", "4"], "--dim 30 is not divisible by --heads 4"),
        (["--batch-size", "0"], "--batch-size must be positive"),
        (["--load", "/nonexistent/x.pt"], "--load /nonexistent/x.pt: no such file"),
    ],
)
def test_bad_flags_exit_with_one_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("error") == 1, err


def test_save_is_atomic_and_load_checks_shapes(tmp_path, capsys):
    model = common.build_model(parse())
    path = tmp_path / "sub" / "m.pt"
    common.save_checkpoint(model.state_dict(), path)
    assert [p.name for p in path.parent.iterdir()] == ["m.pt"]  # no temp file left behind
    sd = common.load_state_dict_file(path, model.state_dict())
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())
    bigger = common.build_model(parse("--dim", "128"))
    with pytest.raises(SystemExit):
        common.load_state_dict_file(path, bigger.state_dict())
    assert (
        "tensor 'embed.pos' has shape (1, 16, 64), this model needs (1, 16, 128)"
        in capsys.readouterr().err
    )
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(SystemExit):
        common.load_state_dict_file(tmp_path / "junk.pt", model.state_dict())
    assert "not a checkpoint torch.load can read" in capsys.readouterr().err


def test_storage_bytes_count_what_is_held():
    t = torch.zeros(100)
    assert common.storage_bytes([t, t[:10], t.view(10, 10)]) == 400  # views add nothing
    u = torch.zeros(50)
    u.untyped_storage().resize_(0)
    assert common.storage_bytes([t, u, None]) == 400  # a freed buffer holds nothing


def test_schedule_warms_up_then_decays_to_zero():
    args = parse("--lr", "1.0", "--warmup", "0.1")
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=args.lr)
    sched = common.make_scheduler(opt, args, 100)
    lrs = []
    for _ in range(100):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:10] == pytest.approx(
        [(i + 1) / 11 for i in range(10)]
    )  # linear warm-up over 10 steps
    assert lrs[10] == pytest.approx(1.0) and lrs[55] == pytest.approx(0.5, abs=0.03)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False)) and lrs[-1] < 0.01
    const = common.make_scheduler(
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0),
        parse("--lr-schedule", "constant", "--warmup", "0"),
        100,
    )
    assert const.get_last_lr() == [1.0]
    assert common.total_steps(parse("--epochs", "3"), 10) == 30
    assert common.total_steps(parse("--epochs", "3", "--max-steps", "7"), 10) == 7


@pytest.fixture
def group(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def meter_on_one_of_two_ranks(rank, store, out):
    """One rank of two (forked from the test's process): the Meter around three steps of the loop
    that reduce-scatter the gradient (Ψ elements in, Ψ/2 out) and all-gather it back (Ψ/2 in, Ψ
    out); writes what the Meter measured to out/rank<r>.json."""
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP thread pool
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        model = common.build_model(parse("--dim", "32", "--depth", "1"))
        psi = sum(p.numel() for p in model.parameters())
        half = psi // 2  # each rank's shard of the gradient's first 2 * (psi // 2) elements
        opt = common.make_optimizer(model.parameters(), parse())
        with common.Meter(model, opt, parse(), steps=2) as meter:
            for step in common.progress([0, 1, 2], parse(), epoch=0):
                model(torch.randn(2, 1, 28, 28)).sum().backward()
                flat = torch.cat([p.grad.flatten() for p in model.parameters()])[: 2 * half]
                dist.all_reduce(flat)
                shard = torch.empty(half)
                dist.reduce_scatter_tensor(shard, flat)
                dist.all_gather_into_tensor(torch.empty(2 * half), shard)
                dist.all_reduce(torch.zeros(()))  # the logged loss: not counted
                if step > 0:  # step 0: skipped, as GradScaler skips a step with inf gradients
                    opt.step()
                opt.zero_grad(set_to_none=True)
        comm, calls, steps = meter.comm()
        measured = dict(psi=psi, comm=comm, calls=calls, steps=steps, mem=meter.mem)
        (out / f"rank{rank}.json").write_text(json.dumps(measured))
    finally:
        dist.destroy_process_group()


def test_meter_counts_collectives_and_memory_from_outside(tmp_path):
    """The instrument sees the c10d ops and their bytes, ignores the 0-d logged loss, closes its
    window after `steps` steps of the loop (batches drawn through common.progress, also a step
    whose optimizer step was skipped, as fp16's GradScaler does on an overflow), and reads memory
    off storages after the first optimizer step. At W = 2, where a collective's input and output
    differ in size: it counts the whole tensor, a reduce-scatter's input and an all-gather's
    output (at W = 1 both are the same size, and a Meter counting the shard would pass)."""
    store = tmp_path / "store"
    torch.multiprocessing.start_processes(
        meter_on_one_of_two_ranks, args=(store, tmp_path), nprocs=2, start_method="fork"
    )
    for rank in (0, 1):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        psi = measured["psi"]
        whole = 4 * 2 * (psi // 2)  # the bytes of the gradient the collectives move, unsplit
        kinds = ("all_reduce", "all_gather", "reduce_scatter")
        assert measured["steps"] == 2 and measured["calls"] == dict.fromkeys(kinds, 2), measured
        assert measured["comm"] == dict.fromkeys(kinds, whole), (measured["comm"], whole)
        mem = {
            k: measured["mem"][k]
            for k in ("param_bytes", "grad_bytes", "optim_bytes", "optim_peak_bytes")
        }
        assert mem == dict(
            param_bytes=4 * psi, grad_bytes=4 * psi, optim_bytes=8 * psi, optim_peak_bytes=8 * psi
        )


def test_meter_times_throughput_after_its_window():
    """samples/s counts the steps after the observed window and one warm-up step, not those."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    args = parse("--batch-size", "8")
    with common.Meter(model, opt, args, steps=2) as meter:
        for _ in common.progress(list(range(7)), args, epoch=0):
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
    seconds, steps = meter.elapsed
    assert steps == 7 - 2 - 1 and seconds > 0
    assert meter.samples_per_s() == steps * 8 / seconds


def test_meter_reads_what_the_first_forward_saved_for_backward():
    """Linear then tanh on x [4, 8]: autograd keeps x (128 B) and tanh's output [4, 16] (256 B) --
    and the weight, a parameter, which does not count; the later forwards are not counted."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with common.Meter(model, opt, parse()) as meter:
        for step in range(2):
            model(torch.randn(4 * (step + 1), 8)).sum().backward()
            opt.step()
    assert meter.mem["act_bytes"] == 4 * (4 * 8 + 4 * 16)


def train_a_few_steps(device, steps=4, each_step=lambda: None):
    """A Linear on the CPU (as zero_offload.py --offload cpu keeps its parameters) trained inside a
    Meter(model, optimizer, args, steps=1, device=device); returns the Meter."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    args = parse()
    with common.Meter(model, opt, args, steps=1, device=device) as meter:
        for _ in common.progress(list(range(steps)), args, epoch=0):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            each_step()
    return meter


def test_meter_clocks_the_scripts_gpu_also_where_the_parameters_are_on_the_cpu(monkeypatch):
    """Under zero_offload.py --offload cpu the first parameter is a CPU tensor: the Meter's clock
    must still wait for the GPU's queued kernels (torch.cuda.synchronize on the script's device), or
    samples/s times their launch. Its device: the one passed, else under NCCL the GPU set by
    torch.cuda.set_device, else the first parameter's."""
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    gpu = torch.device("cuda", 1)
    meter = train_a_few_steps(gpu)
    assert meter.device == gpu and meter.params[0].device.type == "cpu"
    assert len(synced) == 3 and set(synced) == {gpu}  # first step, the clock's start, its end
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for backend, device in (("nccl", torch.device("cuda", 3)), ("gloo", torch.device("cpu"))):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, backend=backend: backend)
        with common.Meter(model, opt, parse()) as meter:
            assert meter.device == device, backend


def test_cuda_peak_is_trainings_own_and_the_largest_over_ranks(monkeypatch, group):
    """The peak statistics are reset as the Meter is entered (model building before it does not
    count) and read as it is left (evaluation at batch 512 and the final state-dict gathers, after
    it, do not); report() all-reduces the ranks' peaks with MAX into RESULT's cuda_peak_bytes."""
    allocator = dict(peak=7000)  # the peak of building the model, before training
    calls = []

    def reset(device=None):
        calls.append(("reset", device))
        allocator["peak"] = 100

    def read(device=None):
        calls.append(("read", device))
        return allocator["peak"]

    def grow():
        assert calls[0] == ("reset", gpu)  # reset before the first step
        allocator["peak"] += 1000

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", read)
    gpu = torch.device("cuda", 0)
    meter = train_a_few_steps(gpu, steps=3, each_step=grow)
    assert calls == [("reset", gpu), ("read", gpu)] and meter.cuda_peak == 3100
    allocator["peak"] = 9000  # evaluation at batch 512 and the final gathers: not training's

    def all_reduce(tensor, op=dist.ReduceOp.SUM, **kwargs):
        """World 1 standing in for two ranks: the other one's training peak was 5000."""
        peaks = [tensor.item(), 5000]
        tensor.fill_(max(peaks) if op == dist.ReduceOp.MAX else sum(peaks))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    out = dict(steps=3, loss=0.5)
    fields = common.report(
        "t",
        parse(),
        world=1,
        backend="gloo",
        device=gpu,
        data="synthetic",
        params=20,
        trained=out,
        test_acc=0.5,
        meter=meter,
        formula={},
    )
    assert fields["cuda_peak_bytes"] == 5000 and len(calls) == 2  # nothing read after training


# --------------------------------------------------------------------------- other launchers


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def start_ranks_by_hand(envs, timeout=120):
    """ddp.py started once per env, as srun or mpirun starts its ranks: no torchrun, every
    variable set by hand. Returns each process's (exit code, stdout, stderr)."""
    tiny = [*ARGS, "--dim", "16", "--depth", "1", "--max-steps", "2", "--no-progress"]
    procs = []
    for env in envs:
        variables = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        # only what `env` sets: an earlier test's launch() may have left MASTER_PORT in os.environ
        for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", *LAUNCHER_VARIABLES):
            variables.pop(name, None)
        variables.update(env)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(ROOT / "ddp.py"), *tiny],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=variables,
                start_new_session=True,
            )
        )
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            kill_group(p)
    return [(p.returncode, *out) for p, out in zip(procs, outs, strict=True)]


def test_ranks_started_without_torchrun_meet_at_their_master():
    """Two "nodes" of one rank each, as a plain srun (no --ntasks-per-node) starts them: RANK,
    WORLD_SIZE, MASTER_ADDR and MASTER_PORT exported by hand, the place on the node in
    SLURM_LOCALID, SLURM_NODEID and SLURM_STEP_TASKS_PER_NODE (no SLURM_NTASKS_PER_NODE, which
    srun sets only with --ntasks-per-node). Both ranks join one world at the exported master and
    train (before: each made its own store on a random port and waited; then: refused)."""
    port = str(common.free_port())
    envs = [
        dict(
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            SLURM_LOCALID="0",
            SLURM_NODEID=str(rank),
            SLURM_STEP_TASKS_PER_NODE="1(x2)",
        )
        for rank in range(2)
    ]
    (code_0, out_0, err_0), (code_1, _, err_1) = start_ranks_by_hand(envs)
    assert code_0 == 0 and code_1 == 0, (err_0, err_1)
    assert '"world_size": 2' in out_0, out_0


@pytest.mark.parametrize(
    "tasks_per_node, counts",
    [("4", [4]), ("4(x2)", [4, 4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2),2", [1, 3, 3, 2])],
)
def test_slurm_tasks_per_node_are_read_at_this_node(tasks_per_node, counts):
    """SLURM's compressed count of tasks per node, read at each SLURM_NODEID: "2(x3),1" is 2
    tasks on nodes 0-2 and 1 on node 3 (the first number alone would give node 3 two ranks)."""
    nodes = range(len(counts))
    assert [slurm_tasks_on_node(tasks_per_node, node) for node in nodes] == counts


@pytest.mark.parametrize(
    "tasks_per_node, node, message",
    [("2(x3),1", 4, "SLURM_NODEID=4 is past the 4 nodes"), ("2(3)", 0, "expected e.g.")],
)
def test_slurm_tasks_per_node_that_do_not_fit_are_one_error(tasks_per_node, node, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        slurm_tasks_on_node(tasks_per_node, node)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.count(message) == 1


SRUN = dict(SLURM_LOCALID="1", SLURM_NODEID="3", SLURM_STEP_TASKS_PER_NODE="2(x3),1")


@pytest.mark.parametrize(
    "env, local",
    [
        # plain srun, 7 tasks on 4 nodes: the second task of node 2, which runs 2
        ({**SRUN, "SLURM_NODEID": "2"}, (1, 2)),
        # an sbatch script's srun that leaves the step's count out: the allocation's
        (dict(SLURM_LOCALID="0", SLURM_NODEID="1", SLURM_TASKS_PER_NODE="3(x2)"), (0, 3)),
        # Open MPI's mpirun inside an allocation: its daemons, one a node, were started by
        # `srun --ntasks-per-node=1`, whose SLURM variables every rank inherits (task 0 of 1)
        (
            dict(
                SLURM_LOCALID="0",
                SLURM_NODEID="1",
                SLURM_STEP_TASKS_PER_NODE="1(x2)",
                SLURM_NTASKS_PER_NODE="1",
                OMPI_COMM_WORLD_LOCAL_RANK="3",
                OMPI_COMM_WORLD_LOCAL_SIZE="4",
            ),
            (3, 4),
        ),
        # MPICH's or Intel MPI's mpirun (Hydra) inside an allocation
        ({**SRUN, "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"}, (2, 4)),
        (dict(SLURM_LOCALID="0", SLURM_PROCID="0"), None),  # no tasks per node: nothing to go by
    ],
)
def test_the_local_rank_is_the_launchers(env, local):
    """The place on the node that picks a rank's GPU, from the variables of whichever launcher
    started it: mpirun's before the SLURM ones its ranks inherit (every one SLURM_LOCALID=0, so
    every rank would take GPU 0), srun's read at this node."""
    assert launcher_local_rank(env) == local


def test_srun_and_mpirun_ranks_get_their_local_rank(monkeypatch):
    """adopt_launcher_environment sets LOCAL_RANK and LOCAL_WORLD_SIZE from the launcher's
    variables, which pick_backend then reads: under mpirun inside SLURM, Open MPI's."""
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        # Set, then deleted: monkeypatch records only a variable it changes, and only a recorded
        # one is restored; the two that adopt_launcher_environment exports must not outlive this
        # test (LOCAL_RANK=1 in every later launch silences its rank-0 messages).
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)
    variables = dict(RANK="5", WORLD_SIZE="8", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    # mpirun's daemons, one a node, were started by `srun --ntasks-per-node=1`: task 0 of 1
    variables.update(SLURM_LOCALID="0", SLURM_NODEID="1", SLURM_NTASKS_PER_NODE="1")
    variables.update(SLURM_STEP_TASKS_PER_NODE="1(x2)")
    variables.update(OMPI_COMM_WORLD_LOCAL_RANK="1", OMPI_COMM_WORLD_LOCAL_SIZE="4")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    adopt_launcher_environment(parse())
    assert (os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]) == ("1", "4")


def test_ranks_without_a_local_rank_are_refused_in_one_message():
    """RANK and WORLD_SIZE exported with no way to tell the local rank: one message per rank that
    says what to export, exit 2, no process group (and no hang)."""
    envs = [dict(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1") for rank in range(2)]
    for code, _, err in start_ranks_by_hand(envs, timeout=60):
        assert code == 2, err
        assert err.count("error") == 1 and "MASTER_PORT" in err, err
    envs = [{**env, "MASTER_PORT": "29999"} for env in envs]
    for code, _, err in start_ranks_by_hand(envs, timeout=60):
        assert code == 2, err
        assert err.count("error") == 1 and "SLURM_LOCALID" in err, err
