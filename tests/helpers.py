"""Test settings for real dilocox-node processes on loopback (launcher: tests/harness/localswarm.py)."""

from __future__ import annotations

from pathlib import Path

import psutil

from tests.harness.localswarm import LocalNode, digests_by_step, node_env, peers_on_loopback  # noqa: F401 (re-exported)

# Seconds-scale timeouts and a tiny model so a round takes ~2 s (matchmaking window dominates); every other
# setting is the default.
FAST_DEFAULTS = ["--model", "tiny", "--listen", "/ip4/127.0.0.1/tcp/0", "--status-addr", "127.0.0.1:0",
                 "--request-timeout", "1", "--matchmaking-time", "2", "--averaging-timeout", "8",
                 "--outer-round-deadline", "30", "--announce-period", "1", "--inner-steps", "20",
                 "--warmup-steps", "10", "--total-steps", "2000", "--eval-batches", "2"]
# The same without recomputation audits (on by default: a newcomer's first 5 rounds are each recomputed by a
# group-mate, which doubles the CPU load of a young swarm on CI's 2 cores): tests whose subject is not audits.
# tests/test_audit_swarm.py runs the defaults.
FAST = FAST_DEFAULTS + ["--audit-rate", "0"]


def start(workdir: Path, name: str, args: list[str]) -> LocalNode:
    return LocalNode(name, workdir / name, args).wait_started()


def two_and_a_window_attacker(workdir: Path, args: list[str]) -> list[LocalNode]:
    """Nodes a, b and s (``bench.attacks.gradient:ScaleThenStop``: 100x contributions in rounds 2 and 3) with
    ``args``, b and s joining a."""
    a = start(workdir, "a", args)
    b = start(workdir, "b", args + ["--join", a.join_maddr])
    attack = ["--attack", "bench.attacks.gradient:ScaleThenStop"]
    return [a, b, start(workdir, "s", args + ["--join", a.join_maddr, *attack])]


def dht_process(node: LocalNode) -> psutil.Process:
    """The node's DHT process: its child that launched p2pd (suspend it to play a peer too busy to answer)."""
    return next(p for p in psutil.Process(node.proc.pid).children() if any("p2pd" in c.name() for c in p.children()))


def thaw(proc: psutil.Process) -> None:
    """Resume a suspended process, if it still exists."""
    try:
        proc.resume()
    except psutil.Error:
        pass
