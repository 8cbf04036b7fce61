"""The node's DHT process (SupervisedDHT): hivemind's DHT supervised as a child process, with bounded and paced
traffic on the averagers' keys, and its start (``start_dht``) that cleans up after a failed one. The bounds on
how many DHT peers a read or store asks (MEMBER_*) are the membership records' (peers/swarm.py), shared here.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time
from typing import Dict, Optional

import hivemind
from dilocox.peers import lifecycle
from dilocox.peers.nearstore import SearchSchedule, read_latest, store_near
from dilocox.peers.refusals import RefusedPeers
from hivemind.averaging.key_manager import is_valid_group
from hivemind.p2p import PeerID
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.timed_storage import ValueWithExpiration

# Every DHT peer a publish or read asks answers with the whole members dictionary (every member's signed record,
# about 0.65 KB each on the wire with Ed25519 signatures, 1.5 KB with RSA ones), so asking all N peers, as hivemind's
# beam of 20 does in a small swarm, costs O(N^2) bytes: 60-75% of what a node sent per round at 8 nodes (bench.upload).
MEMBER_REPLICAS = 5  # a record is stored on the 5 DHT peers nearest the key (hivemind's num_replicas)...
MEMBER_READ_BEAM = 3  # ...a search reads from the 3 nearest; a direct read asks one of the 5 in turn (read_near)
# A publish goes straight to the nearest peers the routing table knows (peers/nearstore.py); hivemind's store, whose
# search asks MEMBER_REPLICAS peers for the whole dictionary first, runs when the last one is this old, or after a
# direct store that a peer refused or missed
MEMBER_SEARCH_S = 30.0
GROUP_READ_INTERVAL_S = 0.5  # matchmaking reads a group key at most this often (SupervisedDHT)


async def _peer_id_of(_dht, node):
    """Runs in the DHT process through hivemind's documented ``DHT.run_coroutine`` hook: the node's PeerID."""
    return node.peer_id


def start_dht(settings: dict, startup_timeout_s: float) -> "SupervisedDHT":
    """Start one DHT process; on failure end it and its p2pd (its own process group) before raising.

    A failed DHT process reports its exception through hivemind's MPFuture while holding MPFuture's
    cross-process ``_update_lock`` and then returns, so it is given time to exit by itself before its
    group (p2pd) is killed: killed inside that lock it would leave it held, and every later process
    of ours (the next attempt's DHT, the averagers) would block on its first update. One that must be
    killed (a start that hung) may hold it, so MPFuture's locks are renewed (its public
    ``reset_backend``; no other MPFuture exists yet while we join)."""
    dht = SupervisedDHT(start=False, **settings)
    try:
        lifecycle.before_fork()
        dht.run_in_background(await_ready=True, timeout=startup_timeout_s)
        # the first call through its pipe, bounded: a DHT process that is ready but never answers (seen in CI with
        # 24 DHTs starting at once in one process) is ended here and the join retried, instead of hanging the
        # caller on hivemind's unbounded ``peer_id``
        dht.run_coroutine(_peer_id_of, return_future=True).result(startup_timeout_s)
    except BaseException:
        if dht.pid is not None:
            dht.join(5.0)
            hung = dht.is_alive()
            try:
                os.killpg(dht.pid, signal.SIGKILL)  # p2pd shares the DHT process's group
            except (ProcessLookupError, PermissionError):
                pass
            dht.join(5.0)
            if hung:
                MPFuture.reset_backend()
        raise
    return dht



async def _get_without_refused(dht: "SupervisedDHT", node, key, latest: bool, kwargs: dict):
    """Runs in the DHT process (``DHT.run_coroutine``): what hivemind's ``DHT.get`` reads (``DHTNode.get``),
    without the refused peers' declarations."""
    return dht.without_refused(await node.get(key, latest=latest, **kwargs))


def _averagers_key(key) -> bool:
    """A key of hivemind's averagers: a matchmaking group key, or where they declare the state they serve."""
    return isinstance(key, str) and (is_valid_group(key) or key.endswith(".all_averagers"))


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class SupervisedDHT(hivemind.DHT):
    """hivemind's DHT process, supervised (peers/lifecycle.py): in a process group of its own (with the
    p2pd it launches), SIGTERM only from the main process, and it ends p2pd and itself if that dies.

    Its ``get`` also paces matchmaking's reads. hivemind's matchmaking (``PotentialLeaders``) re-reads
    its group key with ``get(key, latest=True)`` each time it looks at its leader queue, and while an
    averager waits as a leader or alone, that is one DHT round trip after another: about 150 KB/s each
    way on a 10 Mbit/s link, some 1 MB per node per round (bench.compare's interface counters). Reads
    of a group key (hivemind's ``is_valid_group``) from an event loop are therefore spaced at least
    ``GROUP_READ_INTERVAL_S`` apart, per key and process; the averager awaits the task returned in
    place of the MPFuture, as it awaits the MPFuture. A new leader is seen at most that much later.
    The first read or declaration of a group key searches (hivemind's get or store); for MEMBER_SEARCH_S
    after it, reads ask one of the MEMBER_REPLICAS nearest holders in turn (peers/nearstore.py,
    ``read_latest``) and declarations go straight to the MEMBER_REPLICAS nearest (``store_near``), as the
    members records do: each search asked 3 or 5 peers, each answering with every declaration.

    Its ``get`` and ``store`` also bound how many DHT peers hivemind asks about the averagers' keys (a group key,
    and ``{prefix}.all_averagers``, where each averager declares it serves state): a read asks MEMBER_READ_BEAM
    peers, the search before a store MEMBER_REPLICAS, as for the membership records. Every peer asked answers with
    the whole dictionary under the key (one entry per averager), and hivemind's default beam (its bucket size, 20:
    every peer of a swarm of up to 21) made each matchmaking read and declaration cost O(N) answers of O(N) entries:
    at 32 hosts in network namespaces, with rounds of 134 s and long matchmaking, 27.6 MB a node and round on the
    interfaces against 0.29 MB of contributions (bench.upload). Values are stored on MEMBER_REPLICAS peers
    (``num_replicas``), so the MEMBER_READ_BEAM nearest hold them.

    Its reads of the averagers' keys leave out the declarations of the peers in ``refused`` (peers/refusals.py: the
    node's exclusion ledger, shared memory made here, before any averager is forked): an averager never asks an
    excluded leader to take it in, nor downloads state from an excluded donor. hivemind keys both declarations by
    the declaring averager's ``PeerID.to_bytes()`` (``GroupKeyManager.declare_averager``, the averager's state
    declarations). A declaration read from the DHT is only a hint of whom to ask, so dropping one changes nothing
    else. Every other call is hivemind's own."""

    def __init__(self, *args, refused: Optional[RefusedPeers] = None, **kwargs):
        self._next_group_read: Dict[str, float] = {}  # group key -> monotonic time its next read may start
        self._schedule = SearchSchedule(MEMBER_SEARCH_S, MEMBER_REPLICAS)  # averagers' keys: direct or searched
        self.refused = refused if refused is not None else RefusedPeers()
        super().__init__(*args, **kwargs)

    def get(self, key, latest: bool = False, return_future: bool = False, **kwargs):
        if not _averagers_key(key):
            return super().get(key, latest=latest, return_future=return_future, **kwargs)
        kwargs.setdefault("beam_size", MEMBER_READ_BEAM)
        kwargs.setdefault("num_workers", MEMBER_READ_BEAM)
        if return_future and latest and is_valid_group(key) and _in_event_loop():
            return asyncio.ensure_future(self._unrefused(self._paced_group_read(key, kwargs)))
        # hivemind's get, filtered in the DHT process (which holds this object's copy, with the same shared set)
        return self.run_coroutine(functools.partial(_get_without_refused, key=key, latest=latest, kwargs=kwargs),
                                  return_future=return_future)

    def without_refused(self, found: Optional[ValueWithExpiration]) -> Optional[ValueWithExpiration]:
        """``found`` (what ``get`` read under an averagers' key: a ValueWithExpiration of {subkey:
        ValueWithExpiration}, or None) without the entries whose subkey is a refused peer's ``PeerID.to_bytes()``.
        Anything else is returned as it is."""
        if found is None or not isinstance(found.value, dict) or len(self.refused) == 0:
            return found
        kept = {subkey: item for subkey, item in found.value.items()
                if not (isinstance(subkey, bytes) and PeerID(subkey).to_base58() in self.refused)}
        return ValueWithExpiration(kept, found.expiration_time)

    async def _unrefused(self, read):
        return self.without_refused(await read)

    def store(self, key, value, expiration_time, subkey=None, return_future: bool = False, **kwargs):
        if _averagers_key(key):
            kwargs.setdefault("beam_size", MEMBER_REPLICAS)
            kwargs.setdefault("num_workers", MEMBER_REPLICAS)
            if return_future and subkey is not None and _in_event_loop() and self._schedule.direct(key):
                return asyncio.ensure_future(self._store_near(key, value, expiration_time, subkey, kwargs))
            self._schedule.searched(key)
        return super().store(key, value, expiration_time, subkey=subkey, return_future=return_future, **kwargs)

    async def _store_near(self, key: str, value, expiration_time: float, subkey, kwargs: dict) -> bool:
        """A declaration straight on the MEMBER_REPLICAS nearest peers (peers/nearstore.py, as ``Swarm.publish``
        stores); hivemind's store, with its search, when one refused or missed."""
        accepted, tried = await self.run_coroutine(functools.partial(
            store_near, key=key, subkey=subkey, value=value, expiration_time=expiration_time,
            replicas=MEMBER_REPLICAS), return_future=True)
        if tried > 0 and accepted == tried:
            return True
        self._schedule.searched(key)
        return await super().store(key, value, expiration_time, subkey=subkey, return_future=True, **kwargs)

    async def _paced_group_read(self, key: str, kwargs: dict):
        now = time.monotonic()
        start = max(now, self._next_group_read.get(key, now))
        self._next_group_read[key] = start + GROUP_READ_INTERVAL_S
        while len(self._next_group_read) > 64:  # a key per round and phase: keep the recent ones
            self._next_group_read.pop(next(iter(self._next_group_read)))
        if start > now:
            await asyncio.sleep(start - now)
        if self._schedule.direct(key):
            return await self.run_coroutine(functools.partial(
                read_latest, key=key, replicas=MEMBER_REPLICAS, turn=self._schedule.turn(),
                beam_size=MEMBER_READ_BEAM), return_future=True)
        self._schedule.searched(key)
        return await super().get(key, latest=True, return_future=True, **kwargs)

    def run(self) -> None:
        lifecycle.supervise_child(own_process_group=True)
        super().run()

