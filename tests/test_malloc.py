"""peers/malloc.py: malloc_trim once a round hands freed heap pages back to the kernel."""

import json
import subprocess
import sys

from dilocox.peers import malloc

TRIM_PROBE = r"""
import ctypes, ctypes.util, json, os, sys
from dilocox.peers import malloc

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)

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
    assert isinstance(malloc.trim(), bool)
