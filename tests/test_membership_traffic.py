"""A membership publish or read asks a few DHT peers, not every one (peers/swarm.py: MEMBER_REPLICAS,
MEMBER_READ_BEAM), and a read still finds every record.

Every DHT peer asked answers with the whole members dictionary (every member's signed record), so a read or
a publish that asks all N peers costs O(N^2) bytes: hivemind's defaults (beam 20, that is every peer of a
small swarm, for both) made these answers 60-75% of what a node sent per round at 8 nodes in network
namespaces (bench.upload, issue 29). Real parts: two Swarms (a DHT process each) among eight plain hivemind
DHTNodes on loopback; the test counts how often each plain node looked the members key up to answer a find.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from dilocox.peers.identity import load_or_create_identity
from dilocox.peers.swarm import MEMBER_READ_BEAM, MEMBER_REPLICAS, MemberRecord, Swarm
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID

pytestmark = pytest.mark.integration
PLAIN = 8


@pytest.fixture
def plain_nodes():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    first = run(DHTNode.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    maddrs = [str(m) for m in run(first.p2p.get_visible_maddrs())]
    nodes = [first] + [run(DHTNode.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
                       for _ in range(PLAIN - 1)]
    yield nodes, maddrs
    for n in nodes:
        run(n.shutdown())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _count_finds(nodes, key: str) -> list[int]:
    """Spy on each node's storage: its ``rpc_find`` is the only caller of ``storage.get`` (hivemind's protocol)."""
    key_id, hits = DHTID.generate(key), [0] * len(nodes)
    for i, node in enumerate(nodes):
        original = node.protocol.storage.get

        def counted(k, i=i, original=original):
            if k == key_id:
                hits[i] += 1
            return original(k)
        node.protocol.storage.get = counted
    return hits


def _record(swarm: Swarm) -> MemberRecord:
    return MemberRecord(peer_id=swarm.peer_id, run_id="traffic", state="TRAINING", outer_step=3, inner_step=0,
                        inner_steps=4, tokens_per_second=1.0, loss=1.0, global_params_digest="ab")


def test_a_publish_and_a_read_ask_a_few_dht_peers_and_the_read_finds_the_record(plain_nodes, tmp_path):
    nodes, maddrs = plain_nodes
    swarms = []
    try:
        for name in ("a", "b"):
            _, key = load_or_create_identity(tmp_path / f"{name}.key")
            swarms.append(Swarm("traffic", key, initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                announce_maddrs=[], identity_path=str(tmp_path / f"{name}.key"), ttl_s=30.0))
        a, b = swarms
        assert b.publish(_record(b))
        hits = _count_finds(nodes, "traffic_members")
        assert a.publish(_record(a))
        publish_asked = sum(h > 0 for h in hits)
        hits[:] = [0] * len(hits)
        seen = {r.peer_id for r, _ in b.members(max_age_s=0.0)}
        read_asked = sum(h > 0 for h in hits)
    finally:
        for s in swarms:
            s.shutdown()
    assert seen == {a.peer_id, b.peer_id}
    # hivemind's defaults ask all 9 other peers each time; the bounds allow a traversal's extra hop
    assert publish_asked <= MEMBER_REPLICAS + 1, hits
    assert read_asked <= MEMBER_READ_BEAM + 1, hits
