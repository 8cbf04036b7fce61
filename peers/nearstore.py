"""Store a DHT subkey on, or read a dictionary from, the peers nearest its key that the routing table already knows,
without a search.

hivemind's ``DHTNode.store`` first searches for the nearest peers (``find_nearest_nodes``), and every peer that
search asks answers ``rpc_find`` with the key's whole value as well as its neighbours (hivemind/dht/protocol.py).
For the members key that value is every member's signed record, so each publish made ``beam_size`` peers send
N records: with a publish every few seconds, about 60% of the membership bytes a node caused per round at 8
nodes (bench.upload, issue 29). A node's routing table already knows the nearest peers of a small or settled
swarm, so most publishes can go straight to them (``DHTProtocol.call_store``, the RPC ``store_many`` ends
with); ``Swarm.publish`` still learns the nearest peers again now and then and whenever a direct store was
refused or missed (``SearchSchedule``), by a walk that asks for a neighbour of the key, so that no peer answers
with the value (``learn_nearest``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from typing import Dict

from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.utils import ValueWithExpiration


class SearchSchedule:
    """When a DHT key's next read or store may go straight to the nearest holders (``read_near``, ``read_latest``,
    ``store_near``) and when it must search first (for the members records a walk, ``learn_nearest``; for
    hivemind's matchmaking keys hivemind's search): straight for ``window_s`` seconds after the key's last search,
    which also teaches the routing table the peers nearest the key. One rule for ``Swarm`` and ``SupervisedDHT``;
    the caller notes a search with ``searched`` (or lets ``attempts`` note it), also after a direct call that
    missed, and turns the holder it asks with ``turn``.

    Remembers the ``keep`` most recently searched keys (a key per round and phase for matchmaking); not thread-safe
    (each user calls it under its own lock or from one event loop)."""

    def __init__(self, window_s: float, replicas: int, keep: int = 64):
        self.window_s, self.keep = window_s, keep
        self._searched_at: Dict[str, float] = {}  # key -> monotonic time of its last search, oldest first
        self._turn = random.randrange(replicas)  # a random first holder: nodes starting together spread their reads

    def direct(self, key: str) -> bool:
        """True while ``key``'s last search is under ``window_s`` seconds old."""
        return time.monotonic() - self._searched_at.get(key, -math.inf) < self.window_s

    def searched(self, key: str) -> None:
        """Note a search of ``key`` now."""
        self._searched_at.pop(key, None)
        self._searched_at[key] = time.monotonic()
        while len(self._searched_at) > self.keep:
            self._searched_at.pop(next(iter(self._searched_at)))

    def attempts(self, key: str):
        """The tries of one read or store of ``key``, as whether each searches first: a direct try while the window
        is open, then one that searches (noted as a search when it is reached). The caller stops at the first
        that succeeds."""
        if self.direct(key):
            yield False
        self.searched(key)
        yield True

    def turn(self) -> int:
        """The ``turn`` for the next direct read (``read_near``): each call the next holder."""
        self._turn += 1
        return self._turn


async def learn_nearest(node, key: str, replicas: int, beam_size: int) -> int:
    """Walk the DHT towards ``key`` without fetching its value, so the routing table learns the peers nearest it;
    returns how many of the ``replicas`` nearest the walk found. Runs in the DHT process.

    hivemind's searching ``get`` and ``store`` walk with ``rpc_find`` on the key itself, and every peer asked that
    holds the key answers with its whole dictionary: for the members key, every member's signed record (11 KB at 16
    nodes, 21 KB at 32), and a search got about 4 such answers (bench.upload with per-RPC byte counts,
    at 16 nodes, 25 M values, about half of the members key's find bytes came from searches). This walk asks for the
    key id with its lowest bit flipped (``DHTNode.find_nearest_nodes``, hivemind's public traversal): no peer holds a
    value there, and the peers nearest that id are the ones nearest the key (XOR distances to the two differ by at
    most 1, so only an exact tie in the other 159 bits can order two peers differently). Peers that answer join the
    routing table (``DHTProtocol.call_find`` adds every responder)."""
    probe = DHTID(int(DHTID.generate(source=key)) ^ 1)
    found = await node.find_nearest_nodes([probe], k_nearest=replicas, beam_size=beam_size, num_workers=beam_size)
    return len(found.get(probe, {}))


async def store_near(_dht, node, key: str, subkey, value, expiration_time: float, replicas: int,
                     search: bool = False) -> tuple[int, int]:
    """Runs in the DHT process (hivemind's documented ``DHT.run_coroutine`` hook, ``node`` its DHTNode).

    With ``search``, first ``learn_nearest`` (beam ``replicas``). Signs ``value`` as ``store_many`` does (the
    node's record validators), stores it on the ``replicas`` nodes nearest ``key`` among the routing table and this
    node (unless in client mode), through ``DHTProtocol.call_store`` (this node: its local storage after
    validation) and returns (stores accepted, stores tried). Tried < replicas means the routing table knows fewer
    peers; accepted < tried means a peer refused (e.g. a newer value) or missed."""
    protocol = node.protocol
    key_id = DHTID.generate(source=key)
    if search:
        await learn_nearest(node, key, replicas, beam_size=replicas)
    targets = _nearest_targets(node, key_id, replicas)
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


def _nearest_targets(node, key_id, replicas: int) -> list:
    """The ``replicas`` nodes nearest ``key_id`` among the routing table and this node (not in client mode: nobody
    can read a client-mode node's storage), nearest first, as (node_id, peer_id or None for this node)."""
    protocol = node.protocol
    known = protocol.routing_table.get_nearest_neighbors(key_id, k=replicas, exclude=node.node_id)
    ours = [] if protocol.client_mode else [(node.node_id, None)]
    return sorted([*known, *ours], key=lambda item: key_id.xor_distance(item[0]))[:replicas]


async def read_near(_dht, node, key: str, replicas: int, turn: int = 0, search: bool = False,
                    beam_size: int = 3):
    """Runs in the DHT process (``DHT.run_coroutine``): with ``search``, first ``learn_nearest`` (``beam_size``);
    then read ``key``'s dictionary from one of the ``replicas`` nodes
    nearest it among the routing table and this node (unless in client mode), the ``turn % replicas``-th nearest
    (this node: its local storage, no bytes), and only when that one answers with no dictionary from the others, one
    ``DHTProtocol.call_find`` each (its own validation of every record), without hivemind's beam search. Returns
    (ValueWithExpiration of {subkey: ValueWithExpiration of the value, signatures stripped} or None, answers).

    Every holder answers with the whole dictionary, so asking all ``replicas`` at once cost that many copies of every
    record per read: at 16 nodes the members key's answers were as many bytes as the contributions themselves
    (bench.upload with per-RPC byte counts). A caller that turns ``turn`` from read to read sees each
    holder in turn; a record a holder missed is seen at the next (``Swarm.members`` keeps the newest of each).

    hivemind's ``DHTNode.get`` walks the DHT towards the key and every peer on the way that holds the key answers with
    the whole dictionary: with a beam of 3 a members read got about 8 such answers at 32 nodes (20.8 KB each, 1.8 MB a
    node and round on the interfaces, bench.upload with per-RPC byte counts) and 4.4 at 8. Subkeys are merged as
    hivemind's search merges them (the newest expiration of each), then stripped and deserialized as it does."""
    if search:
        await learn_nearest(node, key, replicas, beam_size=beam_size)
    found, answers, _ = await _read_near(node, key, replicas, turn)
    return found, answers


async def read_latest(_dht, node, key: str, replicas: int, turn: int, beam_size: int):
    """Runs in the DHT process (``DHT.run_coroutine``): what ``DHTNode.get(key, latest=True)`` returns (a
    ValueWithExpiration of {subkey: ValueWithExpiration}, or None), read as ``read_near`` reads: one of the
    ``replicas`` nearest holders in turn. None when a holder asked answered that it holds nothing under ``key``;
    hivemind's search (beam ``beam_size``) only when none of them answered at all.

    For hivemind's matchmaking keys (``SupervisedDHT``), which every waiting averager reads every
    GROUP_READ_INTERVAL_S: with hivemind's search each read asked 3 peers, each answering with every declaration."""
    found, answers, responded = await _read_near(node, key, replicas, turn)
    if answers or responded:
        return found
    return await node.get(key, latest=True, beam_size=beam_size, num_workers=beam_size)


async def _read_near(node, key: str, replicas: int, turn: int):
    """(the merged dictionary or None, holders that answered with one, peers that answered at all)."""
    protocol = node.protocol
    key_id = DHTID.generate(source=key)
    targets = _nearest_targets(node, key_id, replicas)

    async def one(peer_id) -> tuple[bool, object]:
        """(whether the peer answered at all, what it holds under the key or None)."""
        if peer_id is None:
            return True, protocol.storage.get(key_id)
        found = await protocol.call_find(peer_id, [key_id])
        if not found or key_id not in found:
            return False, None
        return True, found[key_id][0]

    if not targets:
        return None, 0, 0
    first = targets[turn % len(targets)]
    replies = [await one(first[1])]
    if replies[0][1] is None or not isinstance(replies[0][1].value, DictionaryDHTValue):
        replies += await asyncio.gather(*(one(peer_id) for node_id, peer_id in targets if node_id != first[0]))
    responded = sum(answered for answered, _ in replies)
    merged: dict = {}
    answers = 0
    for _, item in replies:
        if item is None or not isinstance(item.value, DictionaryDHTValue):
            continue
        answers += 1
        for subkey, (value_bytes, expiration) in item.value.items():
            if subkey not in merged or expiration > merged[subkey][1]:
                merged[subkey] = (value_bytes, expiration)
    if not merged:
        return None, answers, responded
    out = {}
    for subkey, (value_bytes, expiration) in merged.items():
        if protocol.record_validator is not None:
            record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), value_bytes, expiration)
            value_bytes = protocol.record_validator.strip_value(record)
        try:
            out[subkey] = ValueWithExpiration(protocol.serializer.loads(value_bytes), expiration)
        except Exception:  # a value that does not deserialize: skipped, as a reader skips one it cannot parse
            continue
    return ValueWithExpiration(out, max(e for _, e in merged.values())), answers, responded
