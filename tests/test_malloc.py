"""peers/malloc.py: with the mmap threshold fixed, a large block freed early no longer sends later blocks of
that size to the heap, where what they leave when freed stays in the process."""

import ctypes
import ctypes.util
import json
import os
import subprocess
import sys

import pytest
from dilocox.peers import malloc

PROBE = r"""
import ctypes, ctypes.util, json, sys
from dilocox.peers import malloc

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.mallinfo2.restype = Mallinfo2
tuned = malloc.tune() if sys.argv[1] == "tune" else False
libc.free(libc.malloc(8 << 20))  # glibc's dynamic threshold rises to 8 MB here unless it is fixed
before = libc.mallinfo2().hblkhd
blocks = [libc.malloc(2 << 20) for _ in range(4)]  # a round's buffers: 2 MB each
mapped = libc.mallinfo2().hblkhd - before
for b in blocks:
    libc.free(b)
print(json.dumps(dict(tuned=tuned, mapped=mapped, left_mapped=libc.mallinfo2().hblkhd - before)))
"""


def _probe(mode: str, **env) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in {**os.environ, **env}.items() if v is not None})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _glibc() -> bool:
    try:
        return hasattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "mallinfo2")
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _glibc(), reason="glibc (>= 2.33, mallinfo2) only: the setting is glibc's")


def test_fixed_threshold_keeps_large_blocks_in_their_own_mappings():
    clean = dict(MALLOC_MMAP_THRESHOLD_=None, GLIBC_TUNABLES=None)
    plain = _probe("plain", **clean)
    tuned = _probe("tune", **clean)
    assert tuned["tuned"] is True
    # without the fix the 2 MB blocks came from the heap (the 8 MB free raised the threshold) ...
    assert plain["mapped"] == 0, plain
    # ... with it each is a mapping of its own, and freeing returns every byte of them to the kernel
    assert tuned["mapped"] >= 8 << 20, tuned
    assert tuned["left_mapped"] == 0, tuned


def test_an_operators_own_setting_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert malloc.tune() is False
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    assert malloc.tune() is False


TRIM_PROBE = r"""
import ctypes, ctypes.util, json, os, sys
from dilocox.peers import malloc

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
malloc.tune()

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

blocks, keep = [], []
for _ in range(800):  # 50 MB of 64 KB buffers (on the heap: under the 1 MiB threshold), each followed by a
    b = libc.malloc(64 << 10)  # small block that stays, so the freed space is not at the heap's top
    libc.memset(b, 1, 64 << 10)
    blocks.append(b)
    keep.append(libc.malloc(64))
for b in blocks:
    libc.free(b)
before = rss()
trimmed = malloc.trim() if sys.argv[1] == "trim" else False
print(json.dumps(dict(trimmed=trimmed, released=before - rss())))
"""


def test_trim_hands_a_rounds_freed_heap_pages_back():
    """malloc.trim (called once a round) gives back freed heap pages that are not at the heap's top: glibc keeps
    them in the process otherwise."""
    out = {}
    for mode in ("plain", "trim"):
        run = subprocess.run([sys.executable, "-c", TRIM_PROBE, mode], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        out[mode] = json.loads(run.stdout)
    assert out["trim"]["trimmed"] is True
    assert out["trim"]["released"] >= 40 << 20, out  # of the 50 MB freed
    assert out["plain"]["released"] < 5 << 20, out


def test_the_c_library_is_found_without_spawning_a_process(monkeypatch):
    """ctypes.util.find_library runs ``ldconfig -p`` as a child: a node's first malloc_trim, mid-round, spawned
    one (a forked node's namespace test once saw it exit under its feet). glibc's soname needs none."""
    malloc._libc.cache_clear()
    malloc._glibc_function.cache_clear()

    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was spawned: {args}")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    assert malloc.tune() and isinstance(malloc.trim(), bool)
