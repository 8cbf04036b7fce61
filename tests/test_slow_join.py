"""A joiner whose state download is slower than a round still averages within 3 rounds (bench/slowjoin.py).

Network namespaces: two nodes on 100 Mbit/s links train; a third joins on a 2 Mbit/s link, where its
state download takes several of the swarm's rounds. It used to download again and again, each state
outdated on arrival; now it downloads once, replays the updates applied meanwhile, and joins.
"""

from __future__ import annotations

import pytest

from bench import slowjoin
from tests.harness.netsim import NetSim

ok, why = NetSim.available()
pytestmark = [pytest.mark.integration, pytest.mark.swarm, pytest.mark.skipif(not ok, reason=why)]


def test_a_joiner_slower_than_a_round_downloads_once_catches_up_and_averages_within_3_rounds(tmp_path):
    r = slowjoin.run(tmp_path, rate_mbit=2.0, catch_up=True, timeout_s=180, prefix="dlxsjt")
    assert r["timed_out"] is None, r
    (download,) = r["downloads"]  # one download, never a second
    assert download["seconds"] > r["swarm_round_s"], r  # slower than a round
    assert sum(c["updates"] for c in r["caught_up"]) >= 1, r
    assert 1 <= r["joiner_averaged_in_round"] <= 3, r
    assert r["equal_digests_from_join"] and r["resyncs"] == 0, r
