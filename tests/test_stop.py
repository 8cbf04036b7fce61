"""Every way of stopping a real dilocox-node ends it, with nothing of it left running.

A lone tiny node per case (a stop ends it, so cases cannot share one). Group-wide signals are what
a terminal's Ctrl-C, ``timeout(1)`` and systemd's default KillMode send; the main-process SIGTERM
is docker's and ``kill PID``'s. Leftovers are checked with psutil on the descendants recorded just
before the stop (DHT process, averagers, p2pd), so an orphan re-parented to init still counts.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from dilocox.daemon import ctl

from tests.helpers import FAST, start

pytestmark = pytest.mark.integration

EXIT_BOUND_S = 15.0  # a drain (checkpoint, record withdrawn, children shut down) must end within this
ORPHAN_BOUND_S = 10.0  # children of a SIGKILLed main process must be gone within this
# torch's shared-memory daemon (hivemind shares tensors with the file_system strategy) exits by itself,
# removing its /dev/shm files, a few seconds after its last client is gone; it is not killed
SHM_MANAGER = "torch_shm_manager"


def _trained(tmp_path: Path, name: str):
    node = start(tmp_path, name, FAST)
    node.wait_for(lambda n: n.status().outer_step >= 1, 90, "a first outer step")
    return node


def _descendants(pid: int) -> list[psutil.Process]:
    found = psutil.Process(pid).children(recursive=True)
    names = [_name(p) for p in found]
    pythons = sum(n.startswith("python") for n in names)
    assert "p2pd" in names and pythons >= 2, f"expected DHT, averager and p2pd processes: {names}"
    return found


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return "?"


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while _alive(procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _alive(procs)


def _wait_exit(node, timeout: float) -> tuple[int | None, float]:
    """(exit code or None if still running, seconds waited), measured from the call."""
    t0 = time.monotonic()
    try:
        return node.proc.wait(timeout), time.monotonic() - t0
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - t0


def _check_no_leftovers(node, procs: list[psutil.Process], how: str) -> None:
    ours = [p for p in procs if _name(p) != SHM_MANAGER]
    left = _wait_gone(ours, 1.0)  # already gone when the main process exits; 1 s to be reaped
    left_shm = _wait_gone(procs, ORPHAN_BOUND_S)
    assert not left, f"{how}: left running: {[(p.pid, _name(p)) for p in left]}\n{node.log_tail()}"
    assert not left_shm, f"{how}: {SHM_MANAGER} still running {ORPHAN_BOUND_S}s after the exit"


def _identity_files(procs: list[psutil.Process]) -> list[Path]:
    """The key files the node's p2pd runs with (hivemind passes ``-id=PATH``): without --identity, the node's
    temporary key, which it must remove when it exits."""
    return [Path(arg[len("-id="):]) for p in procs if _name(p) == "p2pd"
            for arg in p.cmdline() if arg.startswith("-id=")]


def _cleanup(node, procs: list[psutil.Process]) -> None:
    """Whatever a failed case left running. Not torch_shm_manager: killed, it would leave its files in
    /dev/shm; it exits by itself once the node's processes are gone."""
    if node.proc.poll() is None:
        node.proc.kill()
        node.proc.wait(5)
    for p in _alive(procs):
        if _name(p) != SHM_MANAGER:
            try:
                p.kill()
            except psutil.Error:
                pass


def _checkpoint_after_leave(node) -> Path:
    """The checkpoint the drain wrote (after the leave request), which must exist with its sidecar."""
    log = node.err_path.read_text()
    drain = log[log.index("leave requested"):]
    written = re.findall(r"checkpoint written: (\S+\.pt)", drain)
    assert written, f"no checkpoint written while draining:\n{drain[-3000:]}"
    path = Path(written[-1])
    assert path.exists() and path.with_name(path.name + ".sha256").exists()
    return path


STOPS = {
    "group-SIGINT": lambda node: os.killpg(node.proc.pid, signal.SIGINT),  # Ctrl-C in a terminal
    "group-SIGTERM": lambda node: os.killpg(node.proc.pid, signal.SIGTERM),  # timeout(1), systemctl stop
    "main-SIGTERM": lambda node: node.proc.send_signal(signal.SIGTERM),  # docker stop, kill PID
    "main-SIGINT": lambda node: node.proc.send_signal(signal.SIGINT),
    "dilocox-ctl-leave": lambda node: ctl.main(["--addr", node.addr, "leave"]),
}


@pytest.mark.parametrize("how", list(STOPS))
def test_stop_drains_and_exits(tmp_path, how):
    node, procs = _trained(tmp_path, "node"), []
    try:
        procs = _descendants(node.proc.pid)
        keys = _identity_files(procs)
        assert keys and all(k.exists() and k.parent.name.startswith("dilocox-id-") for k in keys), keys
        STOPS[how](node)
        code, waited = _wait_exit(node, EXIT_BOUND_S + 30)
        print(f"{how}: exit code {code} after {waited:.1f}s")
        assert code is not None, f"{how}: still running {waited:.0f}s after the stop:\n{node.log_tail()}"
        assert code == 0 and waited <= EXIT_BOUND_S, f"{how}: exit {code} after {waited:.1f}s:\n{node.log_tail()}"
        assert "stopped (exit code 0)" in node.err_path.read_text()
        _checkpoint_after_leave(node)
        _check_no_leftovers(node, procs, how)
        assert not any(k.parent.exists() for k in keys), f"{how}: the temporary identity was left: {keys}"
    finally:
        _cleanup(node, procs)


def test_sigkill_of_main_process_ends_its_children(tmp_path):
    node, procs = _trained(tmp_path, "node"), []
    try:
        procs = _descendants(node.proc.pid)
        # tensors reach the averager through file descriptors: no torch_shm_manager (about 60 MB) per node
        names = sorted(_name(p) for p in procs)
        assert "p2pd" in names and "torch_shm_manager" not in names, names
        node.proc.send_signal(signal.SIGKILL)  # the main process only, as the OOM killer does
        assert node.proc.wait(5) == -signal.SIGKILL
        t0 = time.monotonic()
        left = _wait_gone(procs, ORPHAN_BOUND_S)
        print(f"SIGKILL: children gone after {time.monotonic() - t0:.1f}s")
        assert not left, f"left running {ORPHAN_BOUND_S}s after the SIGKILL: {[(p.pid, _name(p)) for p in left]}"
    finally:
        _cleanup(node, procs)


def test_second_sigint_while_draining_exits_at_once(tmp_path):
    node, procs = _trained(tmp_path, "node"), []
    try:
        procs = _descendants(node.proc.pid)
        # a stuck drain: the DHT process (p2pd's parent) stops answering, so publishing our last record blocks
        dht = next(p for p in procs if any(_name(c) == "p2pd" for c in p.children()))
        dht.suspend()
        os.killpg(node.proc.pid, signal.SIGINT)
        code, _ = _wait_exit(node, 2.0)
        assert code is None, f"exited {code} with its DHT process stopped:\n{node.log_tail()}"
        assert "leave requested (SIGINT)" in node.err_path.read_text()
        os.killpg(node.proc.pid, signal.SIGINT)
        code, waited = _wait_exit(node, 10.0)
        print(f"second SIGINT: exit code {code} after {waited:.1f}s")
        assert code == 130 and waited <= 3.0, f"exit {code} after {waited:.1f}s:\n{node.log_tail()}"
        _check_no_leftovers(node, procs, "second SIGINT")
    finally:
        _cleanup(node, procs)
