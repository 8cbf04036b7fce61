"""Batches drawn ahead of the training thread, on a thread of their own, into pinned memory for a GPU.

A shard (dilocox/data.py ``ReplicaShard``, dilocox/vision.py ``ImageShard``) gives batch k as a pure function
of (seed, shard key, k) through ``batch_at(k)``, and ``position`` counts the batches the training loop has taken,
which is what a checkpoint and an audit record. ``Prefetcher`` draws ``batch_at(position)``, ``position + 1``, ...
on a background thread and hands them out in that order; ``position`` moves only when the training thread takes
one, so it still counts the batches consumed, never those merely drawn ahead. A shard without ``batch_at`` (the
synthetic workload's) is read on the caller's thread, as before.

For a CUDA device each batch is copied into page-locked host memory (``torch.empty(..., pin_memory=True)``), from
which ``tensor.to(device, non_blocking=True)`` is an asynchronous DMA that does not stall the training thread
(PyTorch notes, "Use pinned memory buffers"). The copy into it is numpy's: the background thread runs no torch
CPU kernels, which would give it an OpenMP team of its own beside the training thread's (dilocox/threads.py).
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Optional, Sequence

import torch

_POLL_S = 0.1  # how often a blocked put or get looks at the stop flag and the thread's liveness


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor ``t`` in page-locked memory, same shape and dtype; the bytes move in numpy
    (dtypes numpy lacks, such as bfloat16, fall back to ``Tensor.pin_memory``). Needs a CUDA build and device."""
    try:
        source = t.numpy()
    except (TypeError, RuntimeError):
        return t.contiguous().pin_memory()
    out = torch.empty(tuple(t.shape), dtype=t.dtype, pin_memory=True)
    out.numpy()[...] = source
    return out


class Prefetcher:
    """Batches ``shard.position`` .. ``shard.position + count - 1`` of ``shard``, drawn up to ``depth`` ahead.

    ``next_batch()`` has the contract of the shard's own: the batch at ``shard.position`` as a tuple of CPU
    tensors (pinned when ``pin``), then ``position + 1``. Past ``count`` batches it draws on the caller's
    thread. If ``shard.position`` is changed between calls (a checkpoint restored, a re-sync), the batches drawn
    ahead are dropped and drawing restarts there. An exception raised while drawing (DataError, an unreadable
    memory map) is raised by the ``next_batch`` call that would have returned that batch, with its traceback.
    ``close()`` (or leaving a ``with`` block) stops the thread and drops what was drawn ahead; nothing of the
    shard changes. Call it from one thread (the training thread)."""

    def __init__(self, shard: Any, count: int, pin: bool = False, depth: int = 2):
        """``shard``: has ``position`` and ``next_batch()``, and ``batch_at(k)`` to be drawn ahead; ``count``:
        batches this prefetcher will be asked for (the round's inner steps); ``pin``: page-locked copies (for
        a CUDA device); ``depth`` >= 1: batches held ready. Raises ValueError for a depth < 1."""
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.shard, self.count, self.pin, self.depth = shard, max(0, count), pin, depth
        self._ahead = hasattr(shard, "batch_at")
        self._queue: Optional[queue.Queue] = None
        self._stop: Optional[threading.Event] = None
        self._thread: Optional[threading.Thread] = None
        self._end = shard.position + self.count  # drawn ahead only below this index
        if self._ahead and self.count:
            self._start(shard.position)

    def _start(self, first: int) -> None:
        self._queue, self._stop = queue.Queue(maxsize=self.depth), threading.Event()
        self._thread = threading.Thread(target=self._draw, args=(first, self._queue, self._stop),
                                        name="batch-prefetch", daemon=True)
        self._thread.start()

    def _draw(self, first: int, out: queue.Queue, stop: threading.Event) -> None:
        """Background thread: (index, batch) for each index from ``first`` to the end, then stops; (index,
        exception) for the first that fails."""
        for index in range(first, self._end):
            try:
                item: Any = self._prepare(self.shard.batch_at(index))
            except Exception as e:  # handed to the training thread, raised there
                item = e
            while not stop.is_set():
                try:
                    out.put((index, item), timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if stop.is_set() or isinstance(item, Exception):
                return

    def _prepare(self, batch: Sequence[torch.Tensor]) -> tuple:
        return tuple(pinned_copy(t) for t in batch) if self.pin else tuple(batch)

    def _halt(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = self._queue = self._stop = None

    def next_batch(self) -> tuple:
        """The batch at ``shard.position`` (a tuple of CPU tensors, pinned when ``pin``); ``position`` + 1.
        Raises what drawing it raised."""
        index = self.shard.position
        if self._thread is None or index >= self._end:
            self._halt()
            batch = self._prepare(self.shard.batch_at(index)) if self._ahead else self.shard.next_batch()
            if self._ahead:
                self.shard.position = index + 1
            return batch
        while True:
            try:
                got, item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():  # ended below index: position moved
                    self._halt()
                    self._start(index)
                continue
            if got == index:
                break
            self._halt()  # position moved since the thread started: draw again from it
            self._start(index)
        if isinstance(item, Exception):
            self._halt()
            raise item
        self.shard.position = index + 1
        return item

    def close(self) -> None:
        """Stop the background thread and drop the batches drawn ahead (idempotent)."""
        self._halt()

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
