"""Store a DHT subkey on the peers nearest its key that the routing table already knows, without a search.

hivemind's ``DHTNode.store`` first searches for the nearest peers (``find_nearest_nodes``), and every peer that
search asks answers ``rpc_find`` with the key's whole value as well as its neighbours (hivemind/dht/protocol.py).
For the members key that value is every member's signed record, so each publish made ``beam_size`` peers send
N records: with a publish every few seconds, about 60% of the membership bytes a node caused per round at 8
nodes (bench.upload, issue 29). A node's routing table already knows the nearest peers of a small or settled
swarm, so most publishes can go straight to them (``DHTProtocol.call_store``, the RPC ``store_many`` ends
with); ``Swarm.publish`` still searches now and then and whenever a direct store was refused or missed.
"""

from __future__ import annotations

import asyncio
import dataclasses

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord


async def store_near(_dht, node, key: str, subkey, value, expiration_time: float, replicas: int) -> tuple[int, int]:
    """Runs in the DHT process (hivemind's documented ``DHT.run_coroutine`` hook, ``node`` its DHTNode).

    Signs ``value`` as ``store_many`` does (the node's record validators), stores it on the ``replicas`` nodes
    nearest ``key`` among the routing table and this node (unless in client mode), through
    ``DHTProtocol.call_store`` (this node: its local storage after validation) and returns (stores accepted,
    stores tried). Tried < replicas means the
    routing table knows fewer peers; accepted < tried means a peer refused (e.g. a newer value) or missed."""
    protocol = node.protocol
    key_id = DHTID.generate(source=key)
    known = protocol.routing_table.get_nearest_neighbors(key_id, k=replicas, exclude=node.node_id)
    ours = [] if protocol.client_mode else [(node.node_id, None)]  # nobody can read a client-mode node's storage
    targets = sorted([*known, *ours], key=lambda item: key_id.xor_distance(item[0]))[:replicas]
    record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), protocol.serializer.dumps(value),
                       expiration_time)
    if protocol.record_validator is not None:
        record = dataclasses.replace(record, value=protocol.record_validator.sign_value(record))

    async def one(peer_id) -> bool:
        if peer_id is None:  # ourselves: as store_many does for its own node
            if protocol.record_validator is not None and not protocol.record_validator.validate(record):
                return False
            return bool(protocol.storage.store(key_id, record.value, expiration_time, subkey=subkey))
        done = await protocol.call_store(peer_id, keys=[key_id], values=[record.value],
                                         expiration_time=[expiration_time], subkeys=[subkey])
        return bool(done and done[0])

    results = await asyncio.gather(*(one(peer_id) for _, peer_id in targets))
    return sum(results), len(targets)
