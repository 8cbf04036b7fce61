"""A membership publish or read asks a few DHT peers, not every one (peers/swarm.py: MEMBER_REPLICAS,
MEMBER_READ_BEAM), and a read still finds every record.

Every DHT peer asked answers with the whole members dictionary (every member's signed record), so a read or
a publish that asks all N peers costs O(N^2) bytes: hivemind's defaults (beam 20, that is every peer of a
small swarm, for both) made these answers 60-75% of what a node sent per round at 8 nodes in network
namespaces (bench.upload, issue 29). A publish soon after another asks none: it stores straight on the
nearest peers the routing table knows (peers/nearstore.py), and searches again when one of them is gone.
Real parts: two Swarms (a DHT process each) among eight plain hivemind DHTNodes on loopback; the test counts
how often each plain node looked the members key up to answer a find.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from dilocox.peers.dht import MEMBER_READ_BEAM, MEMBER_REPLICAS
from dilocox.peers.identity import load_or_create_identity
from dilocox.peers.records import MemberRecord
from dilocox.peers.swarm import Swarm, wait_for
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
    stopped = set()

    def stop(node):
        stopped.add(id(node))
        run(node.shutdown())
    yield nodes, maddrs, stop
    for n in nodes:
        if id(n) not in stopped:
            run(n.shutdown())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _count_finds(nodes, key: str) -> tuple[list[int], list[int]]:
    """Spy on each node's storage: finds (hivemind's ``rpc_find`` calls ``storage.get``) and stores (``rpc_store``
    calls ``storage.store_subkey``, which itself calls ``get``: not counted as a find)."""
    key_id, finds, stores = DHTID.generate(key), [0] * len(nodes), [0] * len(nodes)
    for i, node in enumerate(nodes):
        storage, storing = node.protocol.storage, [False]
        get, store_subkey = storage.get, storage.store_subkey

        def counted_get(k, i=i, get=get, storing=storing):
            if k == key_id and not storing[0]:
                finds[i] += 1
            return get(k)

        def counted_store(k, *args, i=i, store_subkey=store_subkey, storing=storing):
            stores[i] += k == key_id
            storing[0] = True
            try:
                return store_subkey(k, *args)
            finally:
                storing[0] = False
        storage.get, storage.store_subkey = counted_get, counted_store
    return finds, stores


def _swarm(tmp_path, name: str, maddrs: list[str], run_id: str = "traffic", ttl_s: float = 15.0) -> Swarm:
    """A Swarm (its own DHT process) joined to the plain nodes at ``maddrs``, with a key of its own."""
    _, key = load_or_create_identity(tmp_path / f"{name}.key")
    return Swarm(run_id, key, initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
                 identity_path=str(tmp_path / f"{name}.key"), ttl_s=ttl_s)


def _pair(tmp_path, maddrs: list[str], swarms: list[Swarm], ttl_s: float) -> list[Swarm]:
    """Swarms "a" and "b" joined to the plain nodes, appended to ``swarms`` as each starts (the caller shuts
    down whatever started)."""
    for name in ("a", "b"):
        swarms.append(_swarm(tmp_path, name, maddrs, ttl_s=ttl_s))
    return swarms[-2:]


def _record(swarm: Swarm, outer_step: int = 3) -> MemberRecord:
    return MemberRecord(peer_id=swarm.peer_id, run_id="traffic", state="TRAINING", outer_step=outer_step, inner_step=0,
                        inner_steps=4, tokens_per_second=1.0, loss=1.0, global_params_digest="ab")


def test_a_publish_and_a_read_ask_a_few_dht_peers_and_the_read_finds_the_record(plain_nodes, tmp_path):
    nodes, maddrs, plain_stop = plain_nodes
    swarms = []
    try:
        a, b = _pair(tmp_path, maddrs, swarms, ttl_s=30.0)
        assert b.publish(_record(b))
        hits, stores = _count_finds(nodes, "traffic_members")
        assert a.publish(_record(a))
        publish_asked = sum(h > 0 for h in hits)
        seen, read_asked = [], []
        for _ in range(2):  # one holder in turn, which may be b's own storage (no find): never twice in a row
            hits[:] = [0] * len(hits)
            seen.append({r.peer_id for r, _ in b.members(max_age_s=0.0)})
            read_asked.append(sum(h > 0 for h in hits))
        # ``since``: a read made at or after it serves, however old; an older one does not. Counted by caller
        mark, reads = time.monotonic(), b.traffic()["reads"]
        for pause in (0.0, 0.0, 0.3):  # the last read is older than the mark: one read, then the same one serves
            time.sleep(pause)
            b.members(max_age_s=0.0, since=mark, caller="test.since")
        b.members(max_age_s=0.0, caller="test.plain")  # without ``since`` a read of its own
        since_reads = (b.traffic()["reads"] - reads, b.traffic().get("reads_by:test.since"))
        # a publish soon after goes straight to the nearest peers (peers/nearstore.py): no find at all
        hits[:], stores[:] = [0] * len(hits), [0] * len(stores)
        assert a.publish(_record(a, outer_step=4))
        direct_asked, direct_stored = sum(hits), sum(stores)
        steps = {r.peer_id: r.outer_step for r, _ in b.members(max_age_s=0.0)}
        # a direct store that misses (one of its nearest peers is gone) walks towards the key and stores again
        plain_stop(nodes[next(i for i, n in enumerate(stores) if n)])
        hits[:] = [0] * len(hits)
        t0 = time.monotonic()
        assert a.publish(_record(a, outer_step=5))
        fallback_s, fallback_asked = time.monotonic() - t0, sum(hits)
        after = wait_for(lambda: {r.peer_id: r.outer_step for r, _ in b.members(max_age_s=0.0)}.get(a.peer_id) == 5,
                         timeout_s=10.0, poll_s=0.5)
    finally:
        for s in swarms:
            s.shutdown()
    assert seen == [{a.peer_id, b.peer_id}] * 2
    assert since_reads == (2, 1)
    assert direct_asked == 0, hits
    assert 1 <= direct_stored <= MEMBER_REPLICAS, stores
    assert steps == {a.peer_id: 4, b.peer_id: 3}
    assert fallback_asked == 0 and fallback_s < 20, (hits, fallback_s)
    assert after  # the live peers the walk found hold the new record
    # a's first publish walked towards the key (peers/nearstore.py, learn_nearest): no peer answered with the records
    # (hivemind's searching store made every peer on the way answer with them; its defaults ask all 9 other peers)
    assert publish_asked == 0, hits
    # one holder in turn (all of them if it held none), and not only b's own storage
    assert max(read_asked) <= MEMBER_REPLICAS and sum(read_asked) >= 1, read_asked


def test_matchmaking_and_state_sharing_keys_ask_a_few_dht_peers(plain_nodes, tmp_path):
    """hivemind's averagers store and read a group key (matchmaking) and ``{prefix}.all_averagers`` (who serves
    state) through our DHT: each peer asked answers with every averager's entry, so these go to as few peers as
    the membership records do (peers/dht.py, SupervisedDHT). hivemind's default beam would ask all 9."""
    from hivemind.utils import get_dht_time

    nodes, maddrs, _ = plain_nodes
    swarm = _swarm(tmp_path, "m", maddrs, run_id="mm")
    asked = {}
    try:
        for name in ("mm_pseudo_gradient_sparse1.0b0110", "mm_pseudo_gradient_sparse1.all_averagers"):
            hits, _ = _count_finds(nodes, name)
            assert swarm.dht.store(name, subkey=b"me", value=True, expiration_time=get_dht_time() + 30)
            stored = sum(h > 0 for h in hits)
            hits[:] = [0] * len(hits)

            async def read(name=name):  # as hivemind's GroupKeyManager and load_state_from_peers call it
                return await swarm.dht.get(name, latest=True, return_future=True)
            # two reads: a direct read asks one holder in turn, and the swarm's own node may be the one (its local
            # storage, no find); consecutive turns are different holders, so at most one of the two reads is local
            reads = []
            for _ in range(2):
                hits[:] = [0] * len(hits)
                found = asyncio.run(read())
                reads.append((sum(h > 0 for h in hits), found is not None and b"me" in found.value))
            asked[name] = (stored, [n for n, _ in reads], all(ok for _, ok in reads))
        hits, _ = _count_finds(nodes, "mm_other")  # any other key is hivemind's own: the default beam
        assert swarm.dht.store("mm_other", value=1, expiration_time=get_dht_time() + 30)
        other = sum(h > 0 for h in hits)
    finally:
        swarm.shutdown()
    for name, (stored, reads, found) in asked.items():
        assert found, name
        assert 1 <= stored <= MEMBER_REPLICAS + 1, (name, stored)
        assert max(reads) <= MEMBER_READ_BEAM + 1 and sum(reads) >= 1, (name, reads)
    assert other > MEMBER_REPLICAS + 1, other  # shows the bound is ours: hivemind asks every peer it finds


def test_matchmaking_reads_and_declarations_after_the_first_go_straight_to_the_nearest(plain_nodes, tmp_path):
    """After the first search of a group key, hivemind's matchmaking reads of it ask one of the MEMBER_REPLICAS
    nearest holders in turn and its declarations store straight on the nearest (peers/dht.py, SupervisedDHT;
    peers/nearstore.py, ``read_latest``, ``store_near``), and a read still sees every declaration: a search asked 3
    (read) or 5 (store) peers, each answering with every averager's entry, every GROUP_READ_INTERVAL_S."""
    from hivemind.utils import get_dht_time

    nodes, maddrs, _ = plain_nodes
    swarm = _swarm(tmp_path, "g", maddrs, run_id="gg")
    key, empty = "gg_pseudo_gradient_sparse1.0b01", "gg_pseudo_gradient_sparse1.0b10"

    async def declare(subkey: bytes):  # as hivemind's GroupKeyManager.declare_averager calls it
        return await swarm.dht.store(key, subkey=subkey, value=True, expiration_time=get_dht_time() + 30,
                                     return_future=True)

    async def read(name=key):  # as GroupKeyManager.get_averagers calls it
        return await swarm.dht.get(name, latest=True, return_future=True)

    try:
        hits, stores = _count_finds(nodes, key)
        assert asyncio.run(declare(b"first"))  # searches
        first = asyncio.run(read())  # searches
        searched = sum(hits)
        hits[:], stores[:] = [0] * len(hits), [0] * len(stores)
        assert asyncio.run(declare(b"second"))
        declared = (sum(hits), sum(stores))
        reads = []
        for _ in range(2 * MEMBER_REPLICAS):
            hits[:] = [0] * len(hits)
            found = asyncio.run(read())
            reads.append((list(hits), set(found.value) if found is not None else set()))
        empty_hits, _ = _count_finds(nodes, empty)
        assert asyncio.run(read(empty)) is None  # searches: nobody declared
        empty_hits[:] = [0] * len(empty_hits)
        again = asyncio.run(read(empty))
    finally:
        swarm.shutdown()
    assert first is not None and b"first" in first.value and searched >= 2, (first, searched)
    assert declared[0] == 0 and 1 <= declared[1] <= MEMBER_REPLICAS, declared  # no search, straight stores
    for asked, seen in reads:
        assert seen == {b"first", b"second"}, reads
        assert sum(asked) <= 1, reads  # one holder (none when it is our own storage)
    assert sum(sum(asked) for asked, _ in reads) >= 2, reads  # holders in turn, not only our own storage
    assert again is None and sum(empty_hits) <= MEMBER_REPLICAS, empty_hits  # an empty answer is trusted


def test_a_read_pushes_nothing_on_and_refreshes_nothing(plain_nodes, tmp_path):
    """hivemind's Kademlia caching is off for our DHT (peers/swarm.py): a read that found the members dictionary
    does not store it on a nearest peer (``cache_nearest``), and nothing re-reads it before it expires
    (``cache_refresh_before_expiry``): both moved whole dictionaries for nothing."""
    nodes, maddrs, _ = plain_nodes
    key_id = DHTID.generate("traffic_members")
    cached = [0] * len(nodes)
    for i, node in enumerate(nodes):
        cache = node.protocol.cache

        def counted(k, *args, i=i, store=cache.store):
            cached[i] += k == key_id
            return store(k, *args)

        def counted_subkey(k, *args, i=i, store=cache.store_subkey):  # a dictionary arrives subkey by subkey
            cached[i] += k == key_id
            return store(k, *args)
        cache.store, cache.store_subkey = counted, counted_subkey
    swarms = []
    try:
        a, b = _pair(tmp_path, maddrs, swarms, ttl_s=8.0)
        assert a.publish(_record(a))
        finds, _ = _count_finds(nodes, "traffic_members")
        seen = {r.peer_id for r, _ in b.members(max_age_s=0.0)}
        read_finds = sum(finds)
        time.sleep(5.0)  # a refresh would come 5 s before the record's 8 s expire
        refreshed = sum(finds) - read_finds
    finally:
        for s in swarms:
            s.shutdown()
    assert seen == {a.peer_id}
    assert sum(cached) == 0, cached  # hivemind's default (cache_nearest=1) stores the found value on a peer
    assert refreshed == 0, finds


def test_our_own_publish_is_seen_by_our_reads_without_a_dht_read(plain_nodes, tmp_path):
    """A publish puts our new record in our own view of the members (peers/swarm.py): a read that may reuse the
    last one (``max_age_s``) still shows our new record, and asks no DHT peer. Before, each publish made the next
    read go to the DHT (about 15 publishes per node and round at 32 nodes: as many reads of every record)."""
    nodes, maddrs, _ = plain_nodes
    swarms = []
    try:
        a, b = _pair(tmp_path, maddrs, swarms, ttl_s=30.0)
        assert b.publish(_record(b))
        assert wait_for(lambda: any(r.peer_id == b.peer_id for r, _ in a.members(max_age_s=0.0)), 10.0)
        assert a.publish(_record(a, outer_step=3))
        time.sleep(1.0)  # hivemind's searches end in the background (traverse_dht's await_all_tasks=False)
        before = dict(a.traffic())
        finds, _ = _count_finds(nodes, "traffic_members")
        assert a.publish(_record(a, outer_step=4))
        steps = {r.peer_id: r.outer_step for r, _ in a.members(max_age_s=60.0)}
        after = dict(a.traffic())
    finally:
        for s in swarms:
            s.shutdown()
    assert steps == {a.peer_id: 4, b.peer_id: 3}, steps
    assert after["reads"] == before["reads"], (before, after)
    assert sum(finds) == 0, (finds, before, after)


def test_reads_after_the_first_ask_one_nearest_peer_in_turn_and_find_every_record(plain_nodes, tmp_path):
    """A read within MEMBER_SEARCH_S of the last searching one asks one of the MEMBER_REPLICAS nearest peers the
    routing table knows (each holds every record stored there), the next one at the next read (peers/nearstore.py,
    ``read_near``), and still finds every record; hivemind's get walked towards the key and every holder on the way
    answered with the whole dictionary (about 8 answers per read at 32 nodes), and asking the three nearest at once
    made each read three copies."""
    nodes, maddrs, plain_stop = plain_nodes
    swarms = []
    try:
        a, b = _pair(tmp_path, maddrs, swarms, ttl_s=30.0)
        assert a.publish(_record(a)) and b.publish(_record(b))
        assert {r.peer_id for r, _ in b.members(max_age_s=0.0)} == {a.peer_id, b.peer_id}  # the searching read
        first = dict(b.traffic())
        finds, _ = _count_finds(nodes, "traffic_members")
        counts = []
        for step in range(4, 4 + 2 * MEMBER_REPLICAS):
            assert a.publish(_record(a, outer_step=step))
            finds[:] = [0] * len(finds)
            seen = {r.peer_id: r.outer_step for r, _ in b.members(max_age_s=0.0)}
            counts.append((list(finds), seen))
        after = dict(b.traffic())
    finally:
        for s in swarms:
            s.shutdown()
    assert after["reads"] - first["reads"] == 2 * MEMBER_REPLICAS, (first, after)
    assert after["read_searches"] == first["read_searches"], (first, after)
    for (asked, seen), step in zip(counts, range(4, 4 + 2 * MEMBER_REPLICAS)):
        assert seen == {a.peer_id: step, b.peer_id: 3}, seen
        assert sum(asked) <= 1, asked  # one holder (none when it is b itself or a), no walk
    # in turn: the same holder again after MEMBER_REPLICAS reads, and not before
    holders = [asked.index(1) if 1 in asked else None for asked, _ in counts]
    assert holders[:MEMBER_REPLICAS] == holders[MEMBER_REPLICAS:], holders
    plain = [h for h in holders[:MEMBER_REPLICAS] if h is not None]
    assert len(set(plain)) == len(plain) >= 1, holders


def test_search_schedule_goes_direct_only_inside_the_window_after_a_search_and_forgets_old_keys(monkeypatch):
    """The one rule for members and matchmaking keys (peers/nearstore.py): never searched or searched window_s ago ->
    search; searched under window_s ago -> direct; each key on its own; only the ``keep`` newest remembered."""
    from dilocox.peers import nearstore

    now = [1000.0]
    monkeypatch.setattr(nearstore.time, "monotonic", lambda: now[0])
    schedule = nearstore.SearchSchedule(window_s=30.0, replicas=5, keep=2)
    assert not schedule.direct("a")
    schedule.searched("a")
    now[0] += 29.9
    assert schedule.direct("a") and not schedule.direct("b")
    now[0] += 0.2
    assert not schedule.direct("a")
    schedule.searched("a")
    schedule.searched("b")
    schedule.searched("c")  # "a" is the oldest of three: forgotten, so searched again
    assert not schedule.direct("a") and schedule.direct("b") and schedule.direct("c")
    turns = [schedule.turn() % 5 for _ in range(5)]
    assert sorted(turns) == [0, 1, 2, 3, 4]  # every holder once in five direct reads


def test_a_walk_learns_the_nearest_peers_of_a_key_without_any_peer_answering_with_its_value(plain_nodes):
    """peers/nearstore.py ``learn_nearest``: a node that knows only the first peer walks towards a key that holds a
    value; afterwards its routing table holds the MEMBER_REPLICAS peers nearest the key, and no peer's storage was
    asked for the key (the walk asks for its neighbour id)."""
    from dilocox.peers.nearstore import learn_nearest
    from hivemind.utils import get_dht_time

    nodes, maddrs, _ = plain_nodes
    key = "walked_members"
    key_id = DHTID.generate(source=key)
    loop = asyncio.new_event_loop()
    try:
        writer = loop.run_until_complete(DHTNode.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        walker = loop.run_until_complete(DHTNode.create(initial_peers=maddrs[:1], host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        try:
            assert loop.run_until_complete(writer.store(key, subkey="s", value=b"x" * 100,
                                                        expiration_time=get_dht_time() + 60))
            hits, _ = _count_finds([*nodes, writer], key)
            others = [n.node_id for n in [*nodes, writer]]
            nearest = set(sorted(others, key=key_id.xor_distance)[:MEMBER_REPLICAS])
            before = {node_id for node_id, _ in walker.protocol.routing_table.get_nearest_neighbors(
                key_id, k=MEMBER_REPLICAS, exclude=walker.node_id)}
            found = loop.run_until_complete(learn_nearest(walker, key, MEMBER_REPLICAS, beam_size=MEMBER_REPLICAS))
            after = {node_id for node_id, _ in walker.protocol.routing_table.get_nearest_neighbors(
                key_id, k=MEMBER_REPLICAS, exclude=walker.node_id)}
        finally:
            loop.run_until_complete(walker.shutdown())
            loop.run_until_complete(writer.shutdown())
    finally:
        loop.close()
    assert found == MEMBER_REPLICAS
    assert after == nearest, (before, after, nearest)
    assert sum(hits) == 0, hits
