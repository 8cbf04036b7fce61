"""Real nodes running ``--compression shared`` (peers/reducescatter.py: the members agree on one index set and
reduce-scatter their values on it): the replicas apply the same update every round, the loss goes down, and each
node's upload stays below what an all-gather of the same payloads would send."""

from __future__ import annotations

import signal
from collections import Counter

import pytest

from tests.harness.localswarm import JOINT, LocalNode, wait_all
from tests.helpers import FAST, start

pytestmark = [pytest.mark.integration, pytest.mark.swarm]  # 34 s: test-swarm (make test's budget)

K = 4
ARGS = FAST + ["--run-id", "shared", "--min-replicas", str(K), "--compression", "shared", "--inner-steps", "40"]


@pytest.mark.timeout(300)
def test_a_shared_index_swarm_trains_with_one_update_per_round(tmp_path):
    first = start(tmp_path, "n0", ARGS)
    nodes = [first] + [LocalNode(f"n{i}", tmp_path / f"n{i}", ARGS + ["--join", first.join_maddr])
                       for i in range(1, K)]
    try:
        wait_all(nodes, lambda: all(n.poll_started() for n in nodes), 180, "every node's start")
        wait_all(nodes, lambda: all(sum(r["outcome"] == "applied" and r["group_size"] == K for r in n.metrics()) >= 3
                                    for n in nodes), 200, f"three applied rounds of {K} on every node")
        rows = [r for n in nodes for r in n.metrics()]
        by_step: dict[int, Counter] = {}
        for r in rows:
            if r["outcome"] in JOINT:
                by_step.setdefault(r["outer_step"], Counter())[r["digest"]] += 1
        assert all(len(c) == 1 for c in by_step.values()), by_step  # one theta per outer step, swarm-wide
        full = [r for r in rows if r["outcome"] == "applied" and r["group_size"] == K]
        for r in full:
            # all-gather: (k - 1) x payload; reduce-scatter: about 2 x, flat in k (plus the matchmaking's bytes)
            assert r["bytes_sent"] < (K - 1) * r["payload_bytes"], r
        for n in nodes:
            status = n.status()
            assert status.loss < status.initial_loss - 1.0, (n.name, status.loss, status.initial_loss)
    finally:
        codes = [n.terminate(signal.SIGTERM, timeout=60) for n in nodes]
    assert codes == [0] * K, codes
