"""Four real nodes whose rounds always split in two (``--max-group-size 2``): no group holds a majority, so
every round the two groups unite their results (daemon/majority.py) and theta stays bit-identical."""

from __future__ import annotations

import signal
from collections import Counter

import pytest

from tests.harness.localswarm import JOINT, LocalNode, wait_all
from tests.helpers import FAST, start

pytestmark = [pytest.mark.integration, pytest.mark.swarm]

# H = 100 (about 2 s of compute per round here): with FAST's H = 20 a round took 0.3 s, and on a loaded CI machine a
# pair that matched first raced ahead while the other two re-synced and never caught a round again
ARGS = FAST + ["--run-id", "union", "--min-replicas", "4", "--overlap", "none",
               "--max-group-size", "2", "--inner-steps", "100"]


# shared: each group reduce-scatters on its own index set, and the groups unite their results weighted by the
# contributors the records list (without them, members weighted groups by the holders seen so far and forked)
@pytest.mark.parametrize("compression", ["sparse", "shared"])
@pytest.mark.timeout(420)
def test_groups_of_two_unite_every_round_and_the_replicas_agree(tmp_path, compression):
    args = ARGS + ["--compression", compression]
    first = start(tmp_path, "n0", args)
    nodes = [first] + [LocalNode(f"n{i}", tmp_path / f"n{i}", args + ["--join", first.join_maddr])
                       for i in (1, 2, 3)]
    try:
        wait_all(nodes, lambda: all(n.poll_started() for n in nodes), 180, "every node's start")
        wait_all(nodes, lambda: all(sum(r["outcome"] == "united" for r in n.metrics()) >= 3 for n in nodes), 240,
                 "three united rounds on every node")
        rows = [r for n in nodes for r in n.metrics()]
        by_step: dict[int, Counter] = {}
        for r in rows:
            by_step.setdefault(r["outer_step"], Counter())[r["digest"]] += 1
        united = [r for r in rows if r["outcome"] == "united"]
        # two groups' contributions (4; 3 where one group dropped a member that had just re-synced)
        assert all(r["group_size"] >= 3 for r in united), Counter(r["group_size"] for r in united)
        # a united step holds one theta on every node that recorded it (joint: the swarm's update)
        for step in {r["outer_step"] for r in united}:
            assert len(by_step[step]) == 1, (step, by_step[step])
        joint = [r for r in rows if r["outcome"] in JOINT]
        assert len(joint) >= 0.9 * len(rows), Counter(r["outcome"] for r in rows)
        for n in nodes:
            status = n.status()
            assert status.loss < status.initial_loss - 1.0, (n.name, status.loss, status.initial_loss)
    finally:
        codes = [n.terminate(signal.SIGTERM, timeout=60) for n in nodes]
    assert codes == [0] * 4, codes
