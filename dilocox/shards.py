"""Pre-tokenized token shards: ``dilocox-ctl data prepare SPEC --tokenizer T -o DIR`` writes them, nodes read
them memory-mapped (as ``numpy.memmap`` does; ``--data DIR``), so a node's memory does not grow with the corpus.

Layout of DIR:
  * ``index.json``: format, the tokenizer (name, digest, vocabulary, end-of-text id), the token dtype
    (uint16 where the vocabulary fits, else uint32), and per split (``train``, ``val``) its shard files, token
    counts and the UTF-8 bytes they encode (for bits per byte);
  * ``train-00000.bin``, ...: raw little-endian token ids, at most ``shard_tokens`` per file.

Documents come from dilocox/data.py's ``iter_documents``, cut into units of at most ``UNIT_CHARS`` characters
at line ends (a unit is what goes to one split). Every ``round(1 / val_fraction)``-th unit goes to ``val``,
so the split is the same wherever the same SPEC is prepared, and a whole-file corpus still gets both splits.
Documents are packed back to back with the tokenizer's end-of-text id between them (none for bytes).
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from dilocox.tokenizer import Tokenizer

FORMAT = "dilocox-shards/1"
UNIT_CHARS = 65536
SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 per file


class ShardError(ValueError):
    """A prepared folder that cannot be read (no index, missing or short shard files, wrong tokenizer)."""


def units(doc: str, limit: int = UNIT_CHARS) -> Iterator[str]:
    """``doc`` cut at line ends into pieces of at most about ``limit`` characters (a longer line is one piece)."""
    start = 0
    while len(doc) - start > limit:
        cut = doc.rfind("\n", start, start + limit)
        cut = start + limit if cut <= start else cut + 1
        yield doc[start:cut]
        start = cut
    if start < len(doc):
        yield doc[start:]


class _SplitWriter:
    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.out, self.split, self.dtype, self.shard_tokens = out, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self.tokens = self.bytes = 0
        self._file = None

    def write(self, ids: np.ndarray, nbytes: int) -> None:
        self.bytes += nbytes
        ids = ids.astype(self.dtype, copy=False)
        while len(ids):
            if self._file is None or self.shards[-1]["tokens"] == self.shard_tokens:
                self._open()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            part, ids = ids[:room], ids[room:]
            self._file.write(part.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
            self.shards[-1]["tokens"] += len(part)
            self.tokens += len(part)

    def _open(self) -> None:
        self.close()
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._file = open(self.out / name, "wb")
        self.shards.append(dict(file=name, tokens=0))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def summary(self) -> dict:
        return dict(shards=self.shards, tokens=self.tokens, bytes=self.bytes)


def prepare(documents: Iterator[str], tok: Tokenizer, out: Path, source: str = "", val_fraction: float = 0.05,
            shard_tokens: int = SHARD_TOKENS, batch_units: int = 256, progress=None) -> dict:
    """Tokenize ``documents`` into ``out`` (created; an index.json already there is replaced last, so a
    reader never sees a half-written folder as complete). Returns the index. ``progress(units, tokens)`` is
    called after each batch. Raises ShardError when a split ends up with no tokens."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)
    every = max(2, round(1 / val_fraction))
    writers = {s: _SplitWriter(out, s, dtype, shard_tokens) for s in ("train", "val")}
    batch: list[tuple[str, str, bool]] = []  # (split, text, ends a document)
    count = 0

    def flush():
        for (split, text, last), ids in zip(batch, tok.encode_batch([t for _, t, _ in batch])):
            if last and tok.eot_id is not None:
                ids = np.append(ids, np.uint32(tok.eot_id))
            writers[split].write(ids, len(text.encode("utf-8")))
        if progress:
            progress(count, writers["train"].tokens + writers["val"].tokens)
        batch.clear()

    for doc in documents:
        pieces = list(units(doc))
        for i, piece in enumerate(pieces):
            batch.append(("val" if count % every == every - 1 else "train", piece, i == len(pieces) - 1))
            count += 1
            if len(batch) >= batch_units:
                flush()
    flush()
    for w in writers.values():
        w.close()
    empty = [s for s, w in writers.items() if w.tokens == 0]
    if empty:
        raise ShardError(f"data {source!r}: {count} units of up to {UNIT_CHARS} characters gave no {empty[0]} "
                         f"tokens (every {every}th unit is held out for validation): too little text")
    return write_index(out, tok, dtype, {s: w.summary() for s, w in writers.items()}, source, val_fraction)


def write_index(out: Path, tok: Tokenizer, dtype: np.dtype, splits: dict, source: str = "",
                val_fraction: float = 0.05) -> dict:
    """Write ``out/index.json`` for shard files already in ``out`` (``splits``: split -> dict(shards=[dict(file,
    tokens)], tokens, bytes)), atomically: a reader never sees a half-written folder as complete."""
    index = dict(format=FORMAT, source=source, val_fraction=val_fraction, dtype=np.dtype(dtype).name,
                 tokenizer=tok.record(), splits=splits)
    tmp = Path(out) / "index.json.tmp"
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, Path(out) / "index.json")
    return index


class ShardedTokens:
    """The token ids of one split as one read-only sequence over memory-mapped shard files: ``len()`` and
    ``[a:b]`` (a contiguous slice, copied; a slice across two files is joined).

    Pages are read on demand into the page cache. Windows drawn at random would leave every page they
    touched mapped into the process (the kernel maps whole page-cache folios around each fault, up to MBs), so
    its resident memory would grow with the corpus: the mappings are advised MADV_RANDOM (no read-ahead) and,
    after each read, MADV_DONTNEED on the files it read (the pages leave this process, the kernel's cache keeps
    them; ~0.1 ms per batch of 8 windows), which keeps a node's RSS independent of the corpus size (make
    bench-scale measures it)."""

    def __init__(self, folder: Path, split: dict, dtype: str):
        self.maps, self.ends, self._mmaps = [], [], []
        total = 0
        for shard in split["shards"]:
            path = folder / shard["file"]
            n = int(shard["tokens"])
            try:
                size = path.stat().st_size
            except OSError as e:
                raise ShardError(f"prepared data {folder}: cannot read {path.name} ({e.strerror})") from e
            if size != n * np.dtype(dtype).itemsize:
                raise ShardError(f"prepared data {folder}: {path.name} holds {size} bytes, the index says {n} "
                                 f"{dtype} tokens (a copy cut short?)")
            if n:
                with open(path, "rb") as f:  # the mapping outlives the file object
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                mm.madvise(mmap.MADV_RANDOM)
                self._mmaps.append(mm)
                self.maps.append(np.frombuffer(mm, dtype=np.dtype(dtype).newbyteorder("<"), count=n))
                total += n
                self.ends.append(total)
        self.starts = [0, *self.ends[:-1]]
        self.length = total

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("ShardedTokens supports contiguous slices only")
        a, b, _ = key.indices(self.length)
        parts = []
        for start, end, m, mm in zip(self.starts, self.ends, self.maps, self._mmaps):
            if end > a and start < b:
                parts.append(np.array(m[max(a, start) - start:min(b, end) - start]))  # a copy: the pages go now
                mm.madvise(mmap.MADV_DONTNEED)
        return np.concatenate(parts) if len(parts) > 1 else parts[0] if parts else np.zeros(0, dtype=np.uint32)


@dataclass
class PreparedData:
    """A prepared folder opened for reading: ``train`` and ``val`` ShardedTokens and the index."""

    folder: Path
    index: dict
    train: ShardedTokens
    val: ShardedTokens

    @classmethod
    def open(cls, folder: Path, tok: Tokenizer) -> "PreparedData":
        """Raises ShardError for a folder without a valid index, short shards, or another tokenizer's ids."""
        folder = Path(folder)
        try:
            index = json.loads((folder / "index.json").read_text())
        except (OSError, ValueError) as e:
            raise ShardError(f"prepared data {folder}: no readable index.json ({e})") from e
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise ShardError(f"prepared data {folder}: index.json is not {FORMAT}")
        made_with = index.get("tokenizer", {})
        if made_with.get("digest") != tok.digest:
            raise ShardError(f"prepared data {folder} was tokenized with {made_with.get('name')!r} (sha256 "
                             f"{made_with.get('digest')}), not with --tokenizer {tok.name!r} ({tok.digest}): pass "
                             f"--tokenizer {made_with.get('name')}")
        try:
            splits = {s: ShardedTokens(folder, index["splits"][s], index["dtype"]) for s in ("train", "val")}
        except (KeyError, TypeError) as e:
            raise ShardError(f"prepared data {folder}: index.json lacks {e}") from e
        return cls(folder, index, splits["train"], splits["val"])

    @staticmethod
    def is_prepared(path: Path) -> bool:
        return (Path(path) / "index.json").is_file()

    def val_bytes_per_token(self) -> float:
        v = self.index["splits"]["val"]
        return v["bytes"] / max(1, v["tokens"])
