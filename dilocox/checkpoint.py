"""Atomic checkpoints: write to a temporary file, fsync, rename; a SHA-256 sidecar guards the payload.

Layout under the checkpoint directory: ``step-<outer_step:08d>.pt`` and ``step-<outer_step:08d>.pt.sha256``.
A file whose checksum does not match (truncated, corrupt) is reported and skipped in favour of
the newest good one. Files are read with ``torch.load(weights_only=True)``: tensors, numbers,
strings and containers only, so a crafted file cannot run code (it is refused and skipped); the
state saved must hold nothing else (numpy arrays as lists, for instance).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

import torch

logger = logging.getLogger(__name__)
KEEP = 3


CHUNK = 16 << 20  # bytes hashed at a time


def _fsync_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """``write(file)`` into a temporary file beside ``path``, fsync, rename onto ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256_file(path: Path) -> str:
    """SHA-256 of a file read CHUNK bytes at a time (a checkpoint of a 1 B-parameter model is many GB: never
    held as one bytes object)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def save_checkpoint(directory: Path, outer_step: int, state: dict[str, Any]) -> Path:
    """Write ``state`` (torch.save-able) atomically; keep the newest KEEP checkpoints. Returns the path.

    torch.save streams the tensors straight into the temporary file and the checksum is read back from it in
    chunks: the state is never copied into memory (a BytesIO and its bytes held two copies: 16 nodes of 25 M
    values on one machine ran out of memory writing their final checkpoints together)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step-{outer_step:08d}.pt"
    # payload first, checksum last: a crash in between leaves a file without a checksum, which is skipped
    _fsync_write(path, lambda f: torch.save(state, f))
    checksum = _sha256_file(path).encode()
    _fsync_write(path.with_name(path.name + ".sha256"), lambda f: f.write(checksum))
    for torn in directory.glob(".step-*.tmp-*"):  # left by a writer killed mid-write
        if not torn.name.endswith(f".tmp-{os.getpid()}"):
            torn.unlink(missing_ok=True)
    for old in sorted(directory.glob("step-*.pt"))[:-KEEP]:
        old.unlink(missing_ok=True)
        old.with_name(old.name + ".sha256").unlink(missing_ok=True)
    return path


def load_latest_checkpoint(directory: Path) -> Optional[tuple[Path, dict[str, Any]]]:
    """Newest checkpoint whose checksum matches, or None; bad ones are logged and skipped."""
    if not directory.is_dir():
        return None
    for path in sorted(directory.glob("step-*.pt"), reverse=True):
        digest_file = path.with_name(path.name + ".sha256")
        try:
            expected = digest_file.read_text().strip()
            actual = _sha256_file(path)
        except OSError as e:
            logger.warning("checkpoint %s unreadable (%s); trying an older one", path, e)
            continue
        if actual != expected:
            logger.warning("checkpoint %s is corrupt or truncated (checksum mismatch); trying an older one", path)
            continue
        try:
            return path, torch.load(path, weights_only=True)
        except Exception as e:
            logger.warning("checkpoint %s cannot be loaded (%s); trying an older one", path, e)
    return None
