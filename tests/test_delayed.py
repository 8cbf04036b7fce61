"""overlap=delayed on real peers: rounds overlap, replicas agree per outer step, a joiner catches up."""

from __future__ import annotations

import signal

import pytest

from tests.helpers import FAST, digests_by_step, start

pytestmark = pytest.mark.integration


def test_delayed_overlap_two_nodes_and_a_joiner(tmp_path):
    """The defaults (delayed overlap, adaptive compression) on loopback."""
    args = FAST + ["--run-id", "delayed", "--overlap", "delayed", "--compression", "adaptive"]
    a = start(tmp_path, "a", args + ["--min-replicas", "2"])
    b = start(tmp_path, "b", args + ["--min-replicas", "2", "--join", a.join_maddr])
    nodes = [a, b]
    try:
        for n in nodes:  # a round's row is recorded at the end of the next round; status shows its step earlier
            n.wait_for(lambda p: len(p.metrics()) >= 3, 120, "three recorded rounds")
        for n in nodes:
            rows = n.metrics()[:3]
            assert [r["group_size"] for r in rows] == [2, 2, 2], rows
            assert all(r["overlap"] == "delayed" for r in rows)
            # the all-reduce of round t ran during round t+1's ~0.3 s of compute: part of it was not waited for
            assert all(r["duration_s"] - r["wait_s"] > 0.1 for r in rows), rows
            # 8-bit low-rank codes once the first round set the shared scales: >= 10x below fp32
            assert all(r["bits"] == 8 and 1 <= r["rank"] <= 8 for r in rows)
            assert all(10 * r["payload_bytes"] <= 133_440 * 4 for r in rows[1:]), rows
        c = start(tmp_path, "c", args + ["--join", a.join_maddr])
        nodes.append(c)
        first = c.wait_for(lambda p: p.metrics(), 120, "its first applied round")[0]
        assert first["outcome"] == "applied" and first["group_size"] == 3, first
        for n in nodes:
            n.wait_for(lambda p: any(r["outer_step"] >= first["outer_step"] + 1 for r in p.metrics()), 60,
                       "one more recorded round")
        steps = digests_by_step(nodes)
        assert all(len(d) == 1 for d in steps.values()), steps
        assert a.status().loss < a.status().initial_loss - 1.0
    finally:
        for n in nodes:
            n.terminate(signal.SIGKILL)
