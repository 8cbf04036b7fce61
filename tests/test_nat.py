"""Volunteers behind two different NATs and a NAT'd joiner average with a public node (bench/nat.py).

Network namespaces: one public node; NAT'd nodes behind routers of their own (nftables masquerade),
which reach the public node but not each other. Before client mode and relays, one NAT'd node tried
to download state from and average with the other, failed to dial it round after round, and went
solo with parameters of its own; with 3 replicas required no group formed at all.
"""

from __future__ import annotations

import pytest

from bench import nat
from tests.harness.netsim import NetSim

ok, why = NetSim.nat_available()
pytestmark = [pytest.mark.integration, pytest.mark.swarm, pytest.mark.skipif(not ok, reason=why)]


def test_two_nated_clients_and_a_public_node_average_in_groups_of_three_and_a_nated_joiner_follows(tmp_path):
    result = nat.run(tmp_path, rounds=6, client_mode=True, joiner=True, timeout_s=240, prefix="dlxnat")
    assert result["timed_out"] is None, result
    steps = result["steps"]
    # from the 4th outer step on, until the joiner's: every node applied it in a group of 3, with equal parameters
    before_join = [s for s in steps if 4 <= s["outer_step"] <= result["joiner_started_after_step"]]
    assert len(before_join) >= 3, steps
    for s in before_join:
        assert s["equal_digests"] and s["outcomes"] == ["applied"] and s["group_sizes"] == [3, 3, 3], s
    # the joiner (NAT'd too) averaged within its first 3 rounds, with the same parameters as the others
    assert 1 <= result["joiner_averaged_within_rounds"] <= 3, result
    assert all(s["equal_digests"] for s in steps if s["outer_step"] >= 4), steps
    # nobody dialed a client: the clients' contributions came through the public node
    assert sum(result["failed_dials"].values()) == 0, result["failed_dials"]
    assert result["relayed_rounds"]["nat1"] >= 3 and result["relayed_rounds"]["public"] == 0, result
    assert result["reachability"] == dict(public="reachable", nat1="client", nat2="client", nat3="client"), result
