"""A 2-node swarm trains; a third node joins after outer step 2 from the swarm's parameters."""

from __future__ import annotations

import re
import signal

import pytest

from tests.helpers import FAST, digests_by_step, start

pytestmark = [pytest.mark.integration, pytest.mark.swarm]


def test_two_nodes_then_late_joiner(tmp_path):
    # the synchronous fp32 configuration this test is about; delayed + adaptive joiners: tests/test_delayed.py
    # (adaptive low rank can give the swarm a transient val-loss spike, which would blur the "starts from the
    # swarm's parameters" check below)
    args = FAST + ["--run-id", "joiners", "--overlap", "none", "--compression", "none"]
    a = start(tmp_path, "a", args + ["--min-replicas", "2"])
    b = start(tmp_path, "b", args + ["--min-replicas", "2", "--join", a.join_maddr])
    nodes = [a, b]
    try:
        for n in nodes:
            n.wait_for(lambda p: p.status().outer_step >= 2, 120, "outer step 2")
        # two replicas: every round had both, and both hold the same parameters
        for n in nodes:
            assert [r["group_size"] for r in n.metrics()[:2]] == [2, 2]
        first_loss = a.status().initial_loss

        c = start(tmp_path, "c", args + ["--join", b.join_maddr])
        nodes.append(c)
        # its first applied round; a round it came late to it follows first (adopted: the swarm's update)
        joined = c.wait_for(lambda p: [r for r in p.metrics() if r["outcome"] == "applied"], 120, "its first round")[0]
        assert all(r["outcome"] == "adopted" for r in c.metrics() if r["outer_step"] < joined["outer_step"])
        # it started from the swarm's parameters: first loss near the swarm's, far below a random init's
        c_first = c.status().initial_loss
        assert c_first < first_loss - 1.0, (c_first, first_loss)
        # bit for bit the parameters the swarm held at the outer step it synced
        synced = re.search(r"synced state of outer step (\d+) \(digest (\w+)\)", (c.workdir / "stderr").read_text())
        assert synced, c.log_tail()
        assert any(r["outer_step"] == int(synced[1]) and r["digest"] == synced[2] for r in a.metrics() + b.metrics())
        # and it took part in the next round with everyone
        assert joined["outcome"] == "applied" and joined["group_size"] == 3, joined
        for n in (a, b):
            row = n.wait_for(lambda p: next((r for r in p.metrics() if r["outer_step"] == joined["outer_step"]), None),
                             30, f"its record of outer step {joined['outer_step']}")
            assert row["group_size"] == 3 and row["digest"] == joined["digest"]
        for n in nodes:
            n.wait_for(lambda p: p.status().outer_step >= joined["outer_step"] + 1, 60, "one more round")
        steps = digests_by_step(nodes)
        assert all(len(d) == 1 for d in steps.values()), steps
        assert a.status().loss < first_loss - 1.0
    finally:
        for n in nodes:
            n.terminate(signal.SIGKILL)
