"""Two real nodes with the default flags (sparse contributions, all-gathered): every round's ``bytes_sent`` counts the
payload its group-mate fetched, whenever it fetched it, the node's totals hold every round's bytes, and the
compression ratio is the payload's. A round whose mate fetched our payload after our exchange returned once
recorded the metadata phase's 2 bytes and a ratio of 266,880x (about one round in four)."""

from __future__ import annotations

import signal

import pytest

from tests.harness.localswarm import LocalNode, wait_all
from tests.helpers import FAST, start

pytestmark = [pytest.mark.integration, pytest.mark.swarm]  # about 25 s on 2 cores

FP32_BYTES = 133_440 * 4  # the tiny preset's pseudo-gradient in fp32
ROUNDS = 6


@pytest.mark.timeout(300)
def test_every_round_counts_the_payload_its_mate_fetched_and_the_totals_hold_them_all(tmp_path):
    args = FAST + ["--run-id", "traffic", "--min-replicas", "2"]
    first = start(tmp_path, "n0", args)
    nodes = [first, LocalNode("n1", tmp_path / "n1", args + ["--join", first.join_maddr])]
    try:
        wait_all(nodes, lambda: all(n.poll_started() for n in nodes), 120, "every node's start")
        wait_all(nodes, lambda: all(sum(r["group_size"] == 2 for r in n.metrics()) >= ROUNDS for n in nodes), 200,
                 f"{ROUNDS} rounds of 2 on every node")
        for n in nodes:
            rows = n.metrics()
            status = n.status()  # read after the rows: its totals only grow
            joint = [r for r in rows if r["group_size"] == 2 and r["outcome"] == "applied"]
            brief = [(r["outer_step"], r["payload_bytes"], r["bytes_sent"], r["compression_ratio"]) for r in rows]
            assert len(joint) >= ROUNDS - 1, brief
            # our mate fetched our payload in every joint round: at least that much went under the round's key
            assert all(r["bytes_sent"] >= r["payload_bytes"] > 0 for r in joint), brief
            assert all(abs(r["compression_ratio"] - FP32_BYTES / r["payload_bytes"]) < 1e-6 for r in joint), brief
            assert status.bytes_sent >= sum(r["bytes_sent"] for r in rows), (status.bytes_sent, brief)
            assert status.bytes_received >= sum(r["bytes_received"] for r in rows), (status.bytes_received, brief)
    finally:
        codes = [n.terminate(signal.SIGTERM, timeout=60) for n in nodes]
    assert codes == [0, 0], codes
