"""Local nodes forked from one shared image instead of each importing torch in a fresh interpreter.

Many nodes on one machine (bench/swarm_size.py) pay twice for starting each as its own interpreter:
- memory: ``import torch`` alone leaves about 144 MB of anonymous memory (Python objects, torch's operator
  registrations, relocated library data) in every process, about 250 MB with hivemind and what
  ``torch.optim`` imports; processes started apart cannot share it;
- time: on a loaded machine the imports take tens of seconds, which a joiner spends before it even
  asks the swarm for state.

multiprocessing's *forkserver* start method (Python's standard library) solves both: one server process
imports the image once (``set_forkserver_preload``, tests/harness/node_image.py) and forks each node from it, so
every node shares those pages copy-on-write and starts at once. A forked node is otherwise the same
``dilocox-node``: its own session and process group, its own stdout/stderr files and environment, the
same ``node_main``. What it does not measure is a volunteer's own start-up, one interpreter on its own
machine; benchmarks say which launch they used.

``ForkedProcess`` wraps the ``multiprocessing.Process`` in the part of ``subprocess.Popen``'s interface
that tests/harness/localswarm.py uses (pid, poll, wait, send_signal, returncode). With ``netns`` the node enters a
network namespace of tests/harness/netsim.py's first, as ``ip netns exec`` would put an interpreter there, so many
hosts in namespaces share one image too (bench/upload.py at 32 hosts).
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import forkserver
from pathlib import Path

import psutil

IMAGE = "tests.harness.node_image"
CLONE_NEWNET = 0x40000000  # linux/sched.h
REPO = Path(__file__).resolve().parents[2]
LAUNCHER_POLL_S = 1.0  # how often a forked node looks whether the process that started it still runs
ORPHAN_KILL_S = 120.0  # after its SIGTERM, an orphaned node that has not drained is SIGKILLed (its group)
_CONTEXT = None


def _context():
    """The forkserver context, its server started now with the image preloaded."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([IMAGE])
        # Python 3.11's server ignores the sys.path it is handed and skips a preload it cannot import, so it
        # gets the repository through its environment; _node checks that the image is there
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), saved]))
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
        _CONTEXT = ctx
    return _CONTEXT


def enter_netns(name: str) -> None:
    """Move this process into the network namespace ``name`` (``ip netns add``'s /run/netns/NAME) with setns(2),
    as ``ip netns exec`` does; call it while the process has one thread: threads and programs it starts later
    (p2pd) are in the namespace too. Raises OSError naming the namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/run/netns/{name}") as f:
        if libc.setns(f.fileno(), CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot enter network namespace {name}: {os.strerror(err)}")


def leave_when_gone(launcher_pid: int, poll_s: float = LAUNCHER_POLL_S, kill_after_s: float = ORPHAN_KILL_S) -> None:
    """Blocking (a thread's body): once the process ``launcher_pid`` (the benchmark or test that started this node)
    has ended, SIGTERM this process (a leave: it drains and exits), and SIGKILL its process group if it still
    runs ``kill_after_s`` later. A forked node's parent is the forkserver, which lives as long as any node it
    forked (each holds its ``alive`` pipe, Python's multiprocessing/forkserver.py), so a launcher killed from
    outside left every node and the forkserver running."""
    try:
        launcher = psutil.Process(launcher_pid)
        while launcher.is_running() and launcher.status() != psutil.STATUS_ZOMBIE:  # is_running checks pid reuse
            time.sleep(poll_s)
    except psutil.Error:
        pass  # already gone
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(kill_after_s)
    os.killpg(os.getpgid(0), signal.SIGKILL)


def _node(argv: list[str], cwd: str, env: dict, stdout: str, stderr: str, threads: int,
          netns: str | None = None, launcher_pid: int | None = None) -> None:
    """The forked node's body: a session of its own, its own files and environment (and network namespace, with
    ``netns``), a watch on ``launcher_pid`` (``leave_when_gone``), then ``node_main``."""
    if IMAGE not in sys.modules:
        problem = f"the forkserver did not import {IMAGE}: run from the repository, or see its log"
        Path(stderr).write_text(f"{problem}\n")  # where the benchmarks read a node's last words
        raise RuntimeError(problem)
    os.setsid()
    if launcher_pid is not None:
        threading.Thread(target=leave_when_gone, args=(launcher_pid,), name="launcher-watch", daemon=True).start()
    # a forkserver child inherits the forkserver method as its default; a fresh interpreter on Linux (and
    # hivemind's averager, an mp.Process holding unpicklable callables) has fork
    mp.set_start_method("fork", force=True)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, stdout), (2, stderr)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    # the inherited TextIOWrappers buffer for a pipe; the benchmarks read these files while the node runs
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    if netns:
        enter_netns(netns)  # after the files: a failure is in the node's stderr
    import numpy as np
    import torch

    np.random.seed()  # a fresh interpreter seeds numpy's global generator from the OS, not from the image
    torch.set_num_threads(threads)
    from dilocox.daemon.cli import node_main

    sys.exit(node_main(argv))


class ForkedProcess:
    """A ``dilocox-node`` forked from the shared image; ``Popen``-like (see the module docstring)."""

    def __init__(self, argv: list[str], cwd: str, env: dict, stdout: str, stderr: str, threads: int = 1,
                 netns: str | None = None):
        for path in (stdout, stderr):  # there before start() returns, as with Popen, for readers that poll them
            open(path, "w").close()
        # not a daemonic process: those may not have children, and hivemind forks the DHT and averagers
        self._process = _context().Process(
            target=_node, args=(argv, cwd, env, stdout, stderr, threads, netns, os.getpid()), daemon=False)
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; raises subprocess.TimeoutExpired as Popen does."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"node {self.pid}", timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        """As Popen's: nothing once the node ended. Its parent is the forkserver, which reaps it before our
        ``exitcode`` knows (a node that exits at SIGTERM time ended run Q's bench with ProcessLookupError)."""
        if self._process.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


def image_holders(procs) -> set[int]:
    """The pids of the processes that the ForkedProcesses among ``procs`` were forked from (the forkserver); empty
    where none was forked. Memory figures share the holder's PSS among the nodes (bench/swarm_size.py)."""
    out = set()
    for proc in procs:
        if isinstance(proc, ForkedProcess):
            try:
                out.add(psutil.Process(proc.pid).ppid())
            except psutil.Error:
                pass
    return out
