"""Matchmaking refuses the peers a node's group excluded (peers/refusals.py, ``PseudoGradientAverager.refuse``).

The set itself in one process; then a real hivemind averager on loopback, whose join requests are answered in its
own forked process: a peer named after the fork is refused there, another gets hivemind's own answer."""

from __future__ import annotations

import asyncio

import hivemind
import pytest
from dilocox.peers.averaging import PseudoGradientAverager
from dilocox.peers.refusals import RefusedPeers
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time


def test_the_set_holds_exactly_what_was_named():
    refused = RefusedPeers(capacity=3)
    assert "QmA" not in refused and len(refused) == 0
    refused.replace(["QmA", "QmB", "QmA"])
    assert "QmA" in refused and "QmB" in refused and "QmC" not in refused and len(refused) == 2
    refused.replace(["QmC"])
    assert "QmA" not in refused and "QmC" in refused
    with pytest.raises(ValueError, match="4 refused peers: at most 3"):
        refused.replace(["1", "2", "3", "4"])
    assert "QmC" in refused and len(refused) == 1  # unchanged by the refused call


@pytest.mark.integration
def test_a_refused_peer_cannot_join_a_group_this_averager_leads():
    dhts, averager = [], None
    try:
        for _ in range(3):
            dhts.append(hivemind.DHT(initial_peers=dhts[0].get_visible_maddrs() if dhts else None, start=True,
                                     host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, startup_timeout=60))
        averager = PseudoGradientAverager(1, dhts[0], "refusals", matchmaking_time_s=2.0, request_timeout_s=1.0,
                                          averaging_timeout_s=10.0)
        averager.refuse([dhts[1].peer_id.to_base58()])  # after the fork: the averager process reads shared memory

        async def first_answer(dht: hivemind.DHT) -> int:
            p2p = await dht.replicate_p2p()
            stub = PseudoGradientAverager.get_stub(p2p, averager.peer_id, namespace=averager.prefix)
            request = averaging_pb2.JoinRequest(schema_hash=b"x", expiration=get_dht_time() + 10, gather=b"",
                                                group_key="refusals.0b0")
            async for message in await stub.rpc_join_group(request):
                return message.code
            raise AssertionError("no answer")

        assert averager.refused_joins() == 0
        assert asyncio.run(first_answer(dhts[1])) == averaging_pb2.PROTOCOL_VIOLATION
        assert averager.refused_joins() == 1  # counted in the averager process, read here
        # not looking for a group now: hivemind's own answer to anyone else
        assert asyncio.run(first_answer(dhts[2])) == averaging_pb2.NOT_LOOKING_FOR_GROUP
        averager.refuse([])
        assert asyncio.run(first_answer(dhts[1])) == averaging_pb2.NOT_LOOKING_FOR_GROUP
    finally:
        if averager is not None:
            averager.shutdown()
        for d in dhts:
            d.shutdown()
