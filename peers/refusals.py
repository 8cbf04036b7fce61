"""Peers a node refuses in matchmaking: the peers its group excluded (daemon/exclusions.py's ledger).

An excluded peer counts for nothing in a round's rules, but hivemind's matchmaking would still take it into a group,
and a group it fills with a few honest members is one whose update those members cannot vote on (they adopt the
swarm's update and lose their contribution for the round). hivemind's averager answers join requests in its own
process (``DecentralizedAverager.rpc_join_group``, the servicer method its followers call), so the refused peer ids
live in shared memory made before that process is forked: the node writes them, the averager reads them when a peer
asks to join a group it leads.

The node's DHT handle holds the set (``SupervisedDHT.refused``, peers/dht.py) and its reads of the averagers' keys
leave out the refused peers' declarations, so a follower never asks a refused peer to lead it, nor a joiner to serve
it state: one set, written by the node, read by the averager and DHT processes.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
from typing import Iterable

CAPACITY = 1024  # peer ids; as many as a round's metadata may carry exclusion votes for (RoundGather)
_DIGEST = 32


def _key(peer_id: str) -> bytes:
    return hashlib.sha256(peer_id.encode()).digest()


class RefusedPeers:
    """A set of up to ``capacity`` peer ids (base58 strings, as ``PeerID.to_base58()`` writes them), shared with
    processes forked after it is made. ``replace`` from the node; ``in`` and ``refused`` (a count of refused join
    requests) from any process."""

    def __init__(self, capacity: int = CAPACITY):
        ctx = mp.get_context("fork")
        self.capacity = capacity
        self._digests = ctx.Array("c", capacity * _DIGEST)  # sorted SHA-256 digests of the peer ids
        self._count = ctx.Value("L", 0, lock=False)  # guarded by the array's lock
        self._refusals = ctx.Value("L", 0)

    def replace(self, peer_ids: Iterable[str]) -> None:
        """Refuse exactly ``peer_ids`` from now on. Raises ValueError past ``capacity`` (nothing is changed)."""
        keys = sorted({_key(p) for p in peer_ids})
        if len(keys) > self.capacity:
            raise ValueError(f"{len(keys)} refused peers: at most {self.capacity}")
        with self._digests.get_lock():
            self._digests.raw = b"".join(keys).ljust(self.capacity * _DIGEST, b"\0")
            self._count.value = len(keys)

    def __contains__(self, peer_id: str) -> bool:
        key = _key(peer_id)
        with self._digests.get_lock():
            raw, n = self._digests.raw, self._count.value
        return any(raw[i * _DIGEST:(i + 1) * _DIGEST] == key for i in range(n))

    def refused(self) -> None:
        """Count one join request refused (the averager process); ``refusals`` reads the count from any process."""
        with self._refusals.get_lock():
            self._refusals.value += 1

    @property
    def refusals(self) -> int:
        return self._refusals.value

    def __len__(self) -> int:
        with self._digests.get_lock():
            return self._count.value
