"""Payloads kept on disk: what a node serves for many rounds (applied updates for joiners, group results) lives in
files, mapped read-only, instead of the process's memory.

``Spill.keep(write)`` runs ``write(f)`` on a new file in ``directory`` (unlinked at once: nothing is left behind
if the process dies) and returns an ``mmap.mmap`` of it, which ``ContributionServer.offer`` serves like bytes
(``len`` and slices). Its pages are the kernel's page cache, clean and file-backed: the kernel reclaims them under
memory pressure instead of the node's anonymous memory growing, and the file's blocks are freed when the last
reference to the map goes (the server drops the oldest offers, ``keep`` and ``max_bytes``). Source: mmap(2) and
unlink(2) (a mapping keeps an unlinked file alive).
"""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, Optional


class Spill:
    """Files for served payloads in ``directory`` (None: the system's temporary directory, ``TMPDIR``; a node
    puts them beside its checkpoints where it has a ``--checkpoint-dir``, since ``/tmp`` may be memory)."""

    def __init__(self, directory: Optional[Path] = None):
        self.directory = None if directory is None else Path(directory)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    def keep(self, write: Callable[[BinaryIO], None]) -> mmap.mmap | bytes:
        """The bytes ``write`` produces, as a read-only map of an unlinked file (``b""`` when it wrote nothing:
        an empty file cannot be mapped). Raises OSError if the file cannot be written (a full disk)."""
        with tempfile.TemporaryFile(dir=self.directory, prefix="served-") as f:
            write(f)
            f.flush()
            if f.tell() == 0:
                return b""
            return mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)  # the map keeps the file once it is closed


    def keep_path(self, write: Callable[[Path], None]) -> mmap.mmap | bytes:
        """As ``keep``, for a writer that wants a path (a library that opens the file itself): ``write(path)`` runs on
        a new file in ``directory``, which is mapped and unlinked as soon as it returns (or raises)."""
        with tempfile.NamedTemporaryFile(dir=self.directory, prefix="served-", delete=False) as f:
            path = Path(f.name)
        try:
            write(path)
            with path.open("rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    return b""
                return mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        finally:
            path.unlink(missing_ok=True)


def spill_directory(checkpoint_dir: Optional[str | os.PathLike]) -> Optional[Path]:
    """Where a node keeps its served payloads: ``<checkpoint_dir>/served`` if it has one, else None (TMPDIR)."""
    return None if checkpoint_dir is None else Path(checkpoint_dir) / "served"
