"""Who runs torch's CPU threads: the training thread alone; helpers split work with Python threads.

torch's CPU ops run their intra-op parallelism on OpenMP (``torch.__config__.parallel_info()``: "ATen parallel
backend: OpenMP"). OpenMP gives every OS thread that opens a parallel region a team of its own, whose workers
stay alive, and libgomp cuts the spin-wait of idle workers to about 100 spins once it manages more threads than
the process has CPUs (libgomp manual, ``GOMP_SPINCOUNT``). A second team anywhere in the process (the model
built on the main thread, a codec or an aggregation on the comm thread) therefore puts the training thread's
worker to sleep between the thousands of parallel regions of every inner step, and each region then pays a
futex wake-up: llama-20m on 2 cores trained at 0.87 of its speed when its model was built on another thread
(docs/results/README.md#node-overhead).

So a process calls ``single_threaded_default()`` first, before any torch op: every thread then opens one-thread
regions (no workers), and the training thread alone takes ``cpu_budget()`` threads with ``claim_for_training()``.
Work beside training (codecs, aggregation, digests) splits itself over ``cpu_budget()`` Python threads that
release the GIL in numpy (``thread_map`` in dilocox/sparse/threads.py), which opens no OpenMP team.

Source for the per-thread behaviour: ATen's ParallelOpenMP.cpp (``set_num_threads`` sets the calling thread's
``omp_set_num_threads`` and a process-wide default that threads read at their first torch op,
``lazy_init_num_threads``).
"""

from __future__ import annotations

import os
import threading

import torch

_budget: int | None = None


def cpu_budget() -> int:
    """The CPU threads this process may keep busy: ``OMP_NUM_THREADS`` when set (a positive integer), else the
    CPUs it may run on (``os.sched_getaffinity``), else ``os.cpu_count()``. At least 1."""
    global _budget
    if _budget is None:
        env = os.environ.get("OMP_NUM_THREADS", "")
        if env.strip().isdigit() and int(env) > 0:
            _budget = int(env)
        elif hasattr(os, "sched_getaffinity"):
            _budget = max(1, len(os.sched_getaffinity(0)))
        else:
            _budget = max(1, os.cpu_count() or 1)
    return _budget


def _set_default(n: int) -> None:
    """The process-wide default that threads read at their first torch op, set from a thread of its own, so that
    no thread that already runs torch ops changes its own count."""
    setter = threading.Thread(target=torch.set_num_threads, args=(n,), name="torch-threads")
    setter.start()
    setter.join()


def single_threaded_default() -> None:
    """Every thread that has not yet run a torch op will run torch's CPU ops on one thread (no OpenMP team of its
    own). Call it once, early, before the model is built."""
    cpu_budget()
    _set_default(1)


def claim_for_training(threads: int | None = None) -> int:
    """Call on the training thread before its first torch op: it runs torch's CPU ops on ``threads`` (default
    ``cpu_budget()``) threads; the process-wide default stays one thread. Returns the count taken."""
    n = max(1, threads or cpu_budget())
    torch.set_num_threads(n)
    torch.get_num_threads()  # this thread's first read: it keeps n whatever the default becomes
    _set_default(1)
    return n
