"""common.py in-process: the data path, the sampler's promises, the model, checkpoint files."""
import struct

import pytest
import torch
import torch.distributed as dist

import common

ARGS = ["--data", "synthetic", "--limit", "300"]


def parse(*argv):
    return common.parse_args(common.get_parser("test"), list(argv))


def write_idx(root, n_train=64, n_test=32):
    """Tiny MNIST in the IDX format torchvision reads, in root/MNIST/raw."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    out = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        x = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g)
        y = torch.randint(0, 10, (n,), dtype=torch.uint8, generator=g)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, n, 28, 28) + x.numpy().tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, n) + y.numpy().tobytes())
        out[prefix] = (x, y)
    return out


# --------------------------------------------------------------------------- data

def test_synthetic_is_deterministic_mnist_shaped_and_prefix_stable():
    x, y = common.synthetic_digits(3000, seed=7)
    assert x.shape == (3000, 28, 28) and x.dtype == torch.uint8 and y.shape == (3000,)
    assert set(y.tolist()) == set(range(10))
    x2, y2 = common.synthetic_digits(3000, seed=7)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, y3 = common.synthetic_digits(1000, seed=7)            # --limit takes a prefix of the same set
    assert torch.equal(x3, x[:1000]) and torch.equal(y3, y[:1000])
    assert not torch.equal(common.synthetic_digits(100, seed=8)[0], x[:100])


def test_synthetic_classes_are_not_trivially_separable():
    """A nearest-class-mean classifier (which solves a set of fixed templates) must not be near-perfect."""
    x, y = common.synthetic_digits(6000, seed=1)
    x = x.float().flatten(1)
    means = torch.stack([x[:5000][y[:5000] == c].mean(0) for c in range(10)])
    acc = (torch.cdist(x[5000:], means).argmin(1) == y[5000:]).float().mean().item()
    assert 0.3 < acc < 0.9, acc


def test_load_data_normalises_and_limits():
    xtr, ytr, xte, yte, source = common.load_data(parse(*ARGS))
    assert source == "synthetic" and xtr.shape == (300, 1, 28, 28) and xte.shape == (300, 1, 28, 28)
    assert xtr.dtype == torch.float32 and ytr.dtype == torch.long
    raw = common.synthetic_digits(300, common.SYNTHETIC_SEED)[0]
    assert torch.allclose(xtr[:, 0], (raw.float() / 255 - common.MNIST_MEAN) / common.MNIST_STD)


def test_mnist_from_idx_files(tmp_path):
    written = write_idx(tmp_path)
    for data in ("auto", "mnist"):
        xtr, ytr, xte, yte, source = common.load_data(parse("--data", data, "--data-dir", str(tmp_path)))
        assert source == "mnist"
        assert torch.equal(ytr, written["train"][1].long()) and torch.equal(yte, written["t10k"][1].long())
        assert torch.allclose(xte[:, 0], (written["t10k"][0].float() / 255 - common.MNIST_MEAN) / common.MNIST_STD)


@pytest.fixture
def offline(monkeypatch):
    """No MNIST download possible, even on a machine that has internet: point the mirrors at a closed port."""
    from torchvision.datasets import MNIST
    monkeypatch.setattr(MNIST, "mirrors", ["http://127.0.0.1:9/"])


def test_auto_falls_back_to_synthetic_with_one_warning(tmp_path, offline, capsys):
    *_, source = common.load_data(parse("--data", "auto", "--data-dir", str(tmp_path), "--limit", "100"))
    out = capsys.readouterr()
    assert source == "synthetic"
    warnings = [l for l in (out.out + out.err).splitlines() if l.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("warning:") and "synthetic" in warnings[0], warnings


def test_mnist_offline_without_files_is_a_clear_error(tmp_path, offline, capsys):
    with pytest.raises(SystemExit) as e:
        common.load_data(parse("--data", "mnist", "--data-dir", str(tmp_path)))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "could not be downloaded" in err and "--data synthetic" in err


# --------------------------------------------------------------------------- sampler

@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_are_disjoint_cover_and_reshuffle(world):
    n, batch = 103, 12                                        # neither divides evenly
    x, y = torch.arange(n).float(), torch.arange(n)
    epochs = []
    for epoch in range(2):
        per_rank = []
        for rank in range(world):
            loader, sampler = common.train_loader(x, y, batch, rank, world, seed=5)
            sampler.set_epoch(epoch)
            per_rank.append([b[1].tolist() for b in loader])
        flat = [i for r in per_rank for b in r for i in b]
        assert len(flat) == len(set(flat)) == (n // batch) * batch          # disjoint, full batches only
        assert all(len(b) == batch // world for r in per_rank for b in r)
        # global batch k = the union of every rank's batch k = the same samples as at world size 1
        epochs.append([sorted(i for r in per_rank for i in r[k]) for k in range(n // batch)])
    loader, sampler = common.train_loader(x, y, batch, 0, 1, seed=5)
    sampler.set_epoch(0)
    assert epochs[0] == [sorted(b[1].tolist()) for b in loader]
    assert epochs[0] != epochs[1]                                           # set_epoch reshuffles


@pytest.mark.parametrize("world", [1, 3, 4])
def test_test_shards_count_every_sample_once(world):
    n = 103
    seen = [i for r in range(world) for b in common.test_loader(torch.zeros(n), torch.arange(n), 10, r, world)
            for i in b[1].tolist()]
    assert sorted(seen) == list(range(n))


# --------------------------------------------------------------------------- model

def test_model_is_seeded_and_shaped():
    a, b = common.build_model(parse("--seed", "3")), common.build_model(parse("--seed", "3"))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    c = common.build_model(parse("--seed", "4"))
    assert not torch.equal(a.blocks[0].attn.q.weight, c.blocks[0].attn.q.weight)
    assert a(torch.randn(5, 1, 28, 28)).shape == (5, 10)
    assert a.blocks[0].attn.k.bias is None                       # a key bias would get a zero gradient
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

@pytest.mark.parametrize("argv,message", [
    (["--data", "foo"], "invalid choice: 'foo'"),
    (["--dim", "30", "--heads", "4"], "--dim 30 is not divisible by --heads 4"),
    (["--batch-size", "0"], "--batch-size must be positive"),
    (["--load", "/nonexistent/x.pt"], "--load /nonexistent/x.pt: no such file"),
])
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
    assert [p.name for p in path.parent.iterdir()] == ["m.pt"]              # no temp file left behind
    sd = common.load_state_dict_file(path, model.state_dict())
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())
    bigger = common.build_model(parse("--dim", "128"))
    with pytest.raises(SystemExit):
        common.load_state_dict_file(path, bigger.state_dict())
    assert "tensor 'embed.pos' has shape (1, 16, 64), this model needs (1, 16, 128)" in capsys.readouterr().err
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(SystemExit):
        common.load_state_dict_file(tmp_path / "junk.pt", model.state_dict())
    assert "not a checkpoint torch.load can read" in capsys.readouterr().err


def test_byte_accounting():
    model = common.build_model(parse())
    psi = sum(p.numel() for p in model.parameters())
    opt = common.make_optimizer(model.parameters(), parse())
    model(torch.randn(2, 1, 28, 28)).sum().backward()
    opt.step()
    assert common.param_bytes(model.parameters()) == common.grad_bytes(model.parameters()) == 4 * psi
    assert common.optimizer_bytes(opt) == 8 * psi
    assert not dist.is_initialized()
