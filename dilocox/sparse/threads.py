"""Work split between the process's CPU threads (``dilocox.threads.cpu_budget``; Python threads: numpy releases the
GIL, and they open no OpenMP team of their own); every result is the same whatever the thread count."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from dilocox.threads import cpu_budget


def slices(n: int, size: int = 1 << 20) -> list[tuple[int, int]]:
    """[0, n) in runs of ``size`` (the last shorter): work for ``thread_map``."""
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def thread_map(fn, items: Sequence) -> list:
    """[fn(item) ...], on up to cpu_budget() threads (numpy releases the GIL in its array work); the
    results do not depend on the thread count."""
    workers = min(cpu_budget(), len(items))
    if workers < 2:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))



def scatter(out: np.ndarray, pos: np.ndarray, values: np.ndarray) -> None:
    """out[pos] = values (distinct positions), in slices on the process's CPU threads (dilocox/threads.py)."""
    parts = max(1, min(cpu_budget(), len(pos) // (1 << 16)))
    b = [len(pos) * i // parts for i in range(parts + 1)]

    def put(i: int) -> None:
        out[pos[b[i]:b[i + 1]]] = values[b[i]:b[i + 1]]

    thread_map(put, range(parts))
