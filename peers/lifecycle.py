"""Process lifecycle of a node: its forked hivemind children (DHT, averagers), p2pd, and how they end.

A node is one main process plus hivemind's forked children: the DHT process (which launches p2pd,
the libp2p daemon) and one averager process per buffer size. Stopping is the main process's job:
it drains (finishes or abandons the round, checkpoints, marks its record STOPPED) and then shuts the
children down in order through hivemind's pipes. So:

* ``supervise_child`` (first thing in a child's ``run()``) makes the child ignore SIGINT and take
  SIGTERM only from its parent. Ctrl-C, ``timeout(1)``, ``kill -TERM -PGID`` and systemd's default
  KillMode signal every process of the group (or cgroup) at once; the children must stay up while
  the main process drains. SIGTERM is blocked and collected with ``sigtimedwait`` by a watchdog
  thread, which reads the sender's pid: from the parent (``Process.terminate()``, multiprocessing's
  exit handler) or once the parent is gone, the child ends its own descendants and exits; from
  anyone else it is logged and left to the main process.
* The same watchdog notices when the parent died (SIGKILL, OOM killer: ``os.getppid()`` changes),
  ends the child's descendants (p2pd) and exits, so nothing is left holding ports or DHT presence.
* The DHT child moves to a process group of its own before it launches p2pd (p2pd inherits it),
  because p2pd resets its signal dispositions (libuv's spawn) and a group-wide SIGINT/SIGTERM
  would kill it mid-drain. A signal sent to the whole cgroup still reaches p2pd; the drain then
  goes on without the network.
* ``Descendants`` (main process) remembers the multiprocessing children and everything below them,
  p2pd included, so the exit path can join what is left with a timeout and then terminate and kill
  it: the main process never waits forever on a child, and a second Ctrl-C can kill them all at once.
  torch's ``torch_shm_manager`` (a direct child that torch starts for hivemind's ``file_system``
  tensor sharing) is not ours to end: it exits by itself, removing the shared memory files, a few
  seconds after its last client (us) is gone; killing it would leave them in /dev/shm.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from typing import Iterable

import psutil

logger = logging.getLogger(__name__)

WATCHDOG_POLL_S = 0.5


def before_fork() -> None:
    """Call right before hivemind forks a child (the DHT process, an averager). Collects garbage, then moves
    every object the cyclic garbage collector tracks into its permanent generation (``gc.freeze``, what
    Python's ``gc`` docs advise before a fork without exec): no later collection, in the parent or in a child,
    writes to those objects' headers, so the pages of the imported image (torch, hivemind) stay shared
    copy-on-write. Without it each full collection gave a child private copies of them, about 50 MB at a
    time: at 12 nodes 629 MB per node (PSS of its process tree, median of the peaks), 476 MB with it
    (docs/operations.md, "Memory per node"). Frozen objects are never collected: a cycle among them that
    becomes garbage later stays. They are the imported modules and the node's long-lived state, and this runs
    a bounded number of times (per DHT start and per averager)."""
    gc.collect()
    gc.freeze()


def supervise_child(own_process_group: bool = False, poll_s: float = WATCHDOG_POLL_S) -> None:
    """Call first in a forked child's ``run()``, before it starts any thread or subprocess."""
    parent = mp.parent_process()
    parent_pid = parent.pid if parent is not None else os.getppid()
    if own_process_group:
        try:
            os.setpgid(0, 0)
        except OSError as e:  # still safe, only a group-wide signal would reach p2pd
            logger.warning("pid %d stays in its parent's process group: %s", os.getpid(), e)
        # a background group writing to (or reading) the terminal must not be stopped by job control
        for sig in (signal.SIGTTOU, signal.SIGTTIN):
            signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the child's threads; Ctrl-C is the main's
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the main process's handler, which it inherited
    # blocked in this thread before any other exists, so blocked in all of them: only the watchdog takes it
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_watchdog, args=(parent_pid, poll_s), name="parent-watchdog", daemon=True).start()


def _watchdog(parent_pid: int, poll_s: float) -> None:
    while True:
        info = signal.sigtimedwait({signal.SIGTERM}, poll_s)
        parent_gone = os.getppid() != parent_pid
        if info is not None:
            if info.si_pid == parent_pid or parent_gone:
                _exit_with_descendants(f"SIGTERM from pid {info.si_pid}", 128 + signal.SIGTERM)
            logger.info("pid %d: SIGTERM from pid %d ignored: the main process (pid %d) shuts us down",
                        os.getpid(), info.si_pid, parent_pid)
        elif parent_gone:
            _exit_with_descendants(f"parent process {parent_pid} is gone", 1)


def _exit_with_descendants(reason: str, code: int) -> None:
    logger.info("pid %d exiting: %s", os.getpid(), reason)
    end_processes(psutil.Process().children(recursive=True), grace_s=2.0)
    os._exit(code)


def end_processes(procs: Iterable[psutil.Process], grace_s: float) -> list[psutil.Process]:
    """SIGTERM each live process, wait up to grace_s for all, SIGKILL the rest (and wait for them).
    Returns the ones that had to be killed."""
    procs = [p for p in procs if _alive(p)]
    for p in procs:
        _signal(p, signal.SIGTERM)
    alive = _wait_dead(procs, grace_s)
    for p in alive:
        _signal(p, signal.SIGKILL)
    _wait_dead(alive, 2.0)
    return alive


def _wait_dead(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until none of procs runs (a zombie has stopped running) or timeout; returns those left.
    Our own multiprocessing children are reaped."""
    deadline = time.monotonic() + timeout
    while True:
        mp.active_children()  # reaps ended multiprocessing children
        left = [p for p in procs if _alive(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


def end_process(proc: mp.Process, grace_s: float) -> None:
    """After hivemind's own shutdown: wait up to grace_s for ``proc``, then terminate and kill it."""
    proc.join(grace_s)
    if proc.is_alive():
        logger.warning("%s (pid %s) still running %.0fs after shutdown: terminating it", type(proc).__name__,
                       proc.pid, grace_s)
        proc.terminate()  # its watchdog ends its descendants (p2pd) and exits
        proc.join(grace_s)
    if proc.is_alive():
        proc.kill()
        proc.join(2.0)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except psutil.Error:
        pass


class Descendants:
    """The main process's record of its multiprocessing children and their descendants, so none
    outlives it.

    ``remember()`` after the children started (p2pd is a grandchild: once the DHT process dies it is
    no longer below us, so it must be remembered before). ``end_all()`` on the way out."""

    def __init__(self):
        self._known: dict[tuple[int, float], psutil.Process] = {}
        self._lock = threading.RLock()  # a signal handler may call in while the main thread holds it

    def remember(self) -> None:
        found = []
        for child in mp.active_children():
            try:
                proc = psutil.Process(child.pid)
                found += [proc, *proc.children(recursive=True)]
            except psutil.Error:
                pass
        with self._lock:
            for p in found:
                try:
                    self._known.setdefault((p.pid, p.create_time()), p)
                except psutil.Error:
                    pass

    def alive(self) -> list[psutil.Process]:
        self.remember()
        with self._lock:
            return [p for p in self._known.values() if _alive(p)]

    def end_all(self, join_s: float = 1.0, grace_s: float = 2.0) -> None:
        """Join the multiprocessing children still running (join_s in all: after a drain they are
        already shut down, after an overrun drain nobody asked them to), then terminate and kill
        whatever is left below us, remembered grandchildren included."""
        deadline = time.monotonic() + join_s
        for child in mp.active_children():
            child.join(max(0.0, deadline - time.monotonic()))
        left = self.alive()
        if left:
            logger.warning("ending %d process(es) left behind: %s", len(left), ", ".join(_describe(p) for p in left))
            end_processes(left, grace_s)

    def kill_all(self) -> None:
        """SIGKILL everything below us at once (and wait for it)."""
        left = self.alive()
        for p in left:
            _signal(p, signal.SIGKILL)
        _wait_dead(left, 2.0)


def _describe(p: psutil.Process) -> str:
    try:
        return f"{p.name()}[{p.pid}]"
    except psutil.Error:
        return f"[{p.pid}]"

