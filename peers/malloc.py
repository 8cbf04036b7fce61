"""glibc malloc settings for a long-running node (docs/operations.md, "Memory per node").

glibc raises its mmap threshold each time a large mmapped block is freed, up to 32 MB on 64-bit
(mallopt(3), "M_MMAP_THRESHOLD": the dynamic threshold). A node allocates and frees buffers of a
tensor's size every round (decoded contributions, aggregates, encoded payloads), so after the first
rounds those buffers come from the heap and arenas instead of their own mappings, and what they
leave behind when freed stays in the process (fragmented, untrimmed). Setting the threshold by hand
turns the dynamic adjustment off: every block of at least ``MMAP_THRESHOLD`` bytes (1 MiB) is its own
mapping again and goes back to the kernel when freed. Not glibc's initial 128 KB: with it every
activation of the tiny model's inner steps became a fresh mapping, and the rounds' timing changed enough
that adaptive overlap no longer landed its synchronous rounds (tests/test_overlap_swarm.py failed).

``trim()`` (glibc's ``malloc_trim(0)``) hands the free pages inside the heap and arenas back to the kernel;
the node calls it once a round, after settling it, when that round's buffers are gone.

``tune()`` is called once, early in the main process; hivemind's DHT and averager processes are
forked from it and inherit the setting (malloc's state is process memory). An operator's own
``MALLOC_MMAP_THRESHOLD_`` (glibc's environment variable) or ``GLIBC_TUNABLES`` wins: then nothing is
changed. Elsewhere than glibc (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD = 1 << 20  # 1 MiB: tensor-sized buffers get mappings of their own, small ones stay on the heap


@functools.lru_cache(maxsize=None)
def _libc():
    """The C library, loaded once: glibc's soname first, since ``ctypes.util.find_library`` runs ``ldconfig -p``
    as a child process (a node's first malloc_trim spawned one mid-round); find_library only if that fails."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        name = ctypes.util.find_library("c")
        return ctypes.CDLL(name) if name else None


@functools.lru_cache(maxsize=None)
def _glibc_function(name: str, argtypes: tuple, restype):
    """The C library's function ``name`` with its signature set, looked up once; None elsewhere than glibc."""
    try:
        function = getattr(_libc(), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, restype
    return function


def tune(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes; True if it was set. Returns False without change when
    the operator set ``MALLOC_MMAP_THRESHOLD_`` or ``GLIBC_TUNABLES``, or the C library is not glibc."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "GLIBC_TUNABLES" in os.environ:
        return False
    mallopt = _glibc_function("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)
    if mallopt is None:
        return False
    ok = mallopt(M_MMAP_THRESHOLD, int(threshold)) == 1  # mallopt returns 1 on success
    if not ok:
        logger.debug("mallopt(M_MMAP_THRESHOLD, %d) refused", threshold)
    return ok


def trim() -> bool:
    """glibc's ``malloc_trim(0)``: return the free pages of every arena to the kernel (madvise), not only the
    heap's top (malloc_trim(3), glibc 2.8 and later); True if memory was released. False elsewhere than glibc."""
    malloc_trim = _glibc_function("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)
    return malloc_trim is not None and malloc_trim(0) == 1
