"""glibc's ``malloc_trim`` for a long-running node (docs/operations.md, "Memory per node").

Blocks under glibc's mmap threshold come from the heap and its arenas, and free space there that is not at the
heap's top stays in the process. ``trim()`` (glibc's ``malloc_trim(0)``) hands the free pages inside the heap and
arenas back to the kernel; the node calls it once a round, after settling it, when that round's buffers are gone.

The node leaves glibc's dynamic mmap threshold alone: fixing it (mallopt ``M_MMAP_THRESHOLD``, 1 MiB) made every
activation of every inner step a fresh mapping whose pages the kernel zeroes again, and a lone node trained
llama-20m at 0.62 of a bare loop's speed (docs/results/README.md#node-overhead). An operator may still set
``MALLOC_MMAP_THRESHOLD_`` in the environment. Elsewhere than glibc (musl, macOS) ``trim`` does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)



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


def trim() -> bool:
    """glibc's ``malloc_trim(0)``: return the free pages of every arena to the kernel (madvise), not only the
    heap's top (malloc_trim(3), glibc 2.8 and later); True if memory was released. False elsewhere than glibc."""
    malloc_trim = _glibc_function("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)
    return malloc_trim is not None and malloc_trim(0) == 1
