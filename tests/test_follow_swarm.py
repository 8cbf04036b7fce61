"""Real nodes whose rounds leave a member out: four replicas with ``--max-group-size 3``. Each round's group of
three holds a majority; the member outside it, left behind, follows the update the group applied
(daemon/majority.py, ``MajorityUpdate.follow``) and rejoins the next round at the members' inner step, with no
state download, where it used to wait for the round to end and re-sync. A member four times slower than the
others falls two rounds or more behind (the fast three run two rounds or more to its one): it follows the chain of
updates they applied (``MajorityUpdate._fetch_chain``), where it used to re-sync every time."""

from __future__ import annotations

import signal
from collections import Counter

import pytest

from tests.harness.localswarm import JOINT, LocalNode, wait_all
from tests.helpers import start

pytestmark = [pytest.mark.integration, pytest.mark.swarm]

ARGS = ["--listen", "/ip4/127.0.0.1/tcp/0", "--status-addr", "127.0.0.1:0", "--request-timeout", "1",
        "--matchmaking-time", "2", "--averaging-timeout", "8", "--outer-round-deadline", "30", "--announce-period",
        "1", "--inner-steps", "20", "--run-id", "follow", "--min-replicas", "4", "--overlap", "none",
        "--max-group-size", "3", "--eval-every", "1000000"]
FOLLOWED = "went on without us: applied the swarm's update"
CHAINED = "followed the swarm to outer step"


def _rows(node: LocalNode) -> list[dict]:
    import json

    return [json.loads(line.split(" round ", 1)[1]) for line in node.log_tail(10 ** 8).splitlines()
            if " dilocox.daemon.node: round {" in line]


@pytest.mark.timeout(300)
def test_a_member_outside_the_rounds_group_follows_its_update_without_a_download(tmp_path):
    # 3 s of compute a round: with 1 s rounds the members applied the next round before their records (announced
    # every second) showed the last one, and a member that came late could not follow (it re-synced instead)
    args = ARGS + ["--workload", "synthetic:200k:0.15"]
    first = start(tmp_path, "n0", args)
    nodes = [first] + [LocalNode(f"n{i}", tmp_path / f"n{i}", args + ["--join", first.join_maddr]) for i in (1, 2, 3)]
    try:
        wait_all(nodes, lambda: all(n.poll_started() for n in nodes), 180, "every node's start")
        wait_all(nodes, lambda: sum(n.log_tail(10 ** 8).count(FOLLOWED) for n in nodes) >= 4, 200,
                 "four rounds that a member outside the group followed")
        rows = {n.name: _rows(n) for n in nodes}
        digests: dict[int, set] = {}
        for r in (r for rs in rows.values() for r in rs if r["outcome"] in JOINT):
            digests.setdefault(r["outer_step"], set()).add(r["digest"])
        assert all(len(d) == 1 for d in digests.values()), digests  # one theta per outer step, swarm-wide
        outcomes = Counter(r["outcome"] for rs in rows.values() for r in rs)
        assert outcomes["adopted"] >= 4 and sum(outcomes[o] for o in JOINT) >= 0.9 * sum(outcomes.values()), outcomes
        resyncs = {n.name: n.status().resyncs for n in nodes}
        assert sum(resyncs.values()) <= 2, (resyncs, outcomes)  # following needs no download
    finally:
        codes = [n.terminate(signal.SIGTERM, timeout=60) for n in nodes]
    assert codes == [0] * 4, codes


@pytest.mark.timeout(300)
def test_a_member_four_times_slower_follows_the_chain_of_updates_it_missed(tmp_path):
    fast = ARGS + ["--workload", "synthetic:200k:0.15"]
    first = start(tmp_path, "n0", fast)
    nodes = [first] + [LocalNode(f"n{i}", tmp_path / f"n{i}", fast + ["--join", first.join_maddr]) for i in (1, 2)]
    slow = LocalNode("n3", tmp_path / "n3", ARGS + ["--workload", "synthetic:200k:0.6", "--join", first.join_maddr])
    nodes.append(slow)
    try:
        wait_all(nodes, lambda: all(n.poll_started() for n in nodes), 180, "every node's start")
        wait_all(nodes, lambda: slow.log_tail(10 ** 8).count(CHAINED) >= 2, 200,
                 "two chains of updates that the slow member followed")
        digests: dict[int, set] = {}
        for r in (r for n in nodes for r in _rows(n) if r["outcome"] in JOINT):
            digests.setdefault(r["outer_step"], set()).add(r["digest"])
        assert all(len(d) == 1 for d in digests.values()), digests  # one theta per outer step, swarm-wide
        assert slow.status().resyncs <= 1, slow.log_tail(4000)  # following a chain needs no download
    finally:
        codes = [n.terminate(signal.SIGTERM, timeout=60) for n in nodes]
    assert codes == [0] * 4, codes
