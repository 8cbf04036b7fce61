"""Ranks of a gloo process group as threads of this process: pipeline stages tested in-process.

``run_ranks(world, fn)`` runs ``fn(rank, group)`` in ``world`` threads, each rank a real gloo
``ProcessGroup`` over loopback, rendezvoused through an in-memory ``HashStore``; returns the
results in rank order and re-raises the first rank's exception. torch.distributed keeps its
groups in one process-wide registry (``distributed_c10d._world``): for the duration of the call
it is replaced by torch's own per-thread registry (``ThreadLocalWorld``, from torch's threaded
test harness) and group names are isolated per thread (``_set_thread_isolation_mode``), so each
thread sees only its own default group. No process is started (``make check`` may run it).
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

FAILED_GRACE_S = 5.0  # after a rank fails, how long the others get to fail or finish
_lock = threading.Lock()  # one in-process world at a time: the registry swap is process-wide


class _World(ThreadLocalWorld):
    """ThreadLocalWorld plus the registry fields it lacks in this torch (kept per thread too)."""

    _extra = threading.local()

    @property
    def pg_config_info(self) -> list:
        if not hasattr(self._extra, "pg_config_info"):
            self._extra.pg_config_info = []
        return self._extra.pg_config_info


def run_ranks(world: int, fn: Callable[[int, dist.ProcessGroup], Any], timeout_s: float = 120.0) -> list:
    """``[fn(0, group), ..., fn(world - 1, group)]``, each in its own thread with its own gloo group
    of ``world`` ranks (``group`` is that thread's default group). Raises the lowest rank's exception
    if any rank failed, TimeoutError if a rank is still running after ``timeout_s``."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.HashStore()
    results: list = [None] * world
    errors: list = [None] * world

    def target(rank: int) -> None:
        try:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=timeout_s))
            try:
                results[rank] = fn(rank, dist.group.WORLD)
            finally:
                dist.destroy_process_group()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors[rank] = e

    with _lock:
        saved = c10d._world
        c10d._world = _World()
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        try:
            threads = [threading.Thread(target=target, args=(r,), name=f"rank{r}", daemon=True) for r in range(world)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + timeout_s
            while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
                if any(e is not None for e in errors):  # the others wait on it: at most one timeout longer
                    deadline = min(deadline, time.monotonic() + FAILED_GRACE_S)
                threads[[t.is_alive() for t in threads].index(True)].join(0.1)
            first = next((e for e in errors if e is not None), None)
            if first is not None:
                raise first
            if any(t.is_alive() for t in threads):
                raise TimeoutError(f"ranks {[r for r, t in enumerate(threads) if t.is_alive()]} still running "
                                   f"after {timeout_s} s")
        finally:
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
            c10d._world = saved
    return results
