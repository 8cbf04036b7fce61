"""A donor that dies in the middle of a joiner's state download, on shaped links (network namespaces).

A tiny model with a wide MLP (~0.46 M parameters: theta + outer momentum ~3.7 MB) takes ~3 s to
download at 10 Mbit/s, so the donor is killed while the bytes are on the wire. The joiner must get
the state from the other donor and train with the swarm; the surviving donor must not stall. Rounds
(480 inner steps, 11-14 s of compute on 2 cores) are kept well above the download: a download that
spans the survivor's outer step is fetched again, and with rounds close to the download time that
race is lost for minutes (a known limit of the join point, docs/operations.md; CI lost it once at
240 inner steps, 6.8 s rounds).
"""

from __future__ import annotations

import json
import re
import signal
import time

import pytest

from tests.harness.localswarm import LocalNode
from tests.harness.netsim import NetSim

ok, why = NetSim.available()
pytestmark = [pytest.mark.integration, pytest.mark.swarm, pytest.mark.skipif(not ok, reason=why)]

RATE_MBIT = 10
AVERAGING_TIMEOUT, MATCHMAKING = 8, 2
WIDE = dict(hidden_size=64, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4, seq_len=64,
            batch_size=8)
ARGS = ["--status-addr", "127.0.0.1:0", "--run-id", "donor-loss", "--compression", "int8", "--overlap", "delayed",
        "--request-timeout", "1", "--matchmaking-time", str(MATCHMAKING), "--averaging-timeout", str(AVERAGING_TIMEOUT),
        "--outer-round-deadline", "30", "--announce-period", "1", "--inner-steps", "480", "--warmup-steps", "5",
        "--total-steps", "2000", "--eval-batches", "1"]


def _node(net: NetSim, i: int, name: str, tmp_path, extra: list[str]) -> LocalNode:
    model = tmp_path / "wide.json"
    model.write_text(json.dumps(WIDE))
    args = ARGS + ["--model", str(model), "--listen", f"/ip4/{net.address(i)}/tcp/0"] + extra
    return LocalNode(name, tmp_path / name, args, wrapper=net.wrapper(i)).wait_started()


def _peer_id(node: LocalNode) -> str:
    return node.join_maddr.rsplit("/p2p/", 1)[1]


def _poll(predicate, timeout: float, what: str, nodes: list[LocalNode]):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        dead = [n.name for n in nodes if n.proc.poll() is not None]
        assert not dead, f"{dead} exited while waiting for {what}"
        time.sleep(0.05)
    raise TimeoutError(f"no {what} within {timeout}s:\n" + "\n".join(n.log_tail(2000) for n in nodes))


def test_joiner_survives_a_donor_dying_mid_download(tmp_path):
    with NetSim(3, RATE_MBIT, prefix="dlxd") as net:
        a = _node(net, 0, "a", tmp_path, ["--min-replicas", "2"])
        b = _node(net, 1, "b", tmp_path, ["--min-replicas", "2", "--join", a.join_maddr])
        nodes = [a, b]
        try:
            _poll(lambda: all(len(n.metrics()) >= 2 for n in nodes), 180, "two rounds on a and b", nodes)
            c = _node(net, 2, "c", tmp_path, ["--join", a.join_maddr])
            nodes.append(c)
            started = _poll(lambda: re.search(r"Downloading parameters from peer (\w+)", c.err_path.read_text()),
                            120, "a state download by c", nodes)
            donor = {_peer_id(n): n for n in (a, b)}[started.group(1)]
            time.sleep(1.0)  # a third of the transfer is on the wire
            donor.terminate(signal.SIGKILL)
            survivor = b if donor is a else a
            nodes.remove(donor)

            _poll(lambda: "synced state of outer step" in c.err_path.read_text(), 150, "c to load a state", nodes)
            log = c.err_path.read_text()
            # The cut stream never became c's state. hivemind either fails it ("Failed to download") or, when
            # the stream just ends, hands over what arrived as a finished download; our checks reject that.
            cut = log.split(f"Downloading parameters from peer {_peer_id(donor)}", 1)[1]
            assert (f"Failed to download state from {_peer_id(donor)}" in cut
                    or "rejected a downloaded state: truncated state" in cut), log[-3000:]
            finished = re.findall(r"Finished downloading state in [\d.]+s from (\w+)", log.split("synced state", 1)[0])
            assert finished and finished[-1] == _peer_id(survivor), log[-3000:]  # the state c loaded

            # c trains with the survivor: a round they applied together, on the same parameters
            _poll(lambda: any(r["outcome"] == "applied" and r["group_size"] == 2 for r in c.metrics()), 120,
                  "a round c applied with the survivor", nodes)
            joint = next(r for r in c.metrics() if r["outcome"] == "applied" and r["group_size"] == 2)
            _poll(lambda: any(r["outer_step"] == joint["outer_step"] for r in survivor.metrics()), 60,
                  "the survivor's record of that round", nodes)
            mine = next(r for r in survivor.metrics() if r["outer_step"] == joint["outer_step"])
            assert mine["digest"] == joint["digest"], (mine, joint)
            # the survivor never waited on communication longer than one averaging timeout (+ matchmaking)
            rows = survivor.metrics()
            assert max(r["wait_s"] for r in rows) < AVERAGING_TIMEOUT + MATCHMAKING + 2, rows
        finally:
            for n in [a, b, *nodes]:
                n.terminate(signal.SIGKILL)
