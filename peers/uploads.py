"""Payloads group-mates push to us with their requests: a reduce-scatter round's proposals and values.

In a reduce-scatter round (peers/reducescatter.py) member i sends reducer j its proposal for j's range and
fetches j's union, then sends its values there and fetches j's result. Pulled one by one, those were four
libp2p calls per pair of members, each opening a stream (about 1 KB of multistream, yamux, noise and TCP
framing on the wire for a 100-byte answer). Pushed with the fetch they answer, they are two
(``ContributionServer.rpc_exchange``): the request stream carries the upload, the answer the reducer's
union or result. ``Uploads`` holds what arrived, per key and requester, until the round's reducer
``collect``s it.

Nothing here is trusted: sizes are checked against what the collector expects, and the codec reads the
bytes (dilocox/shared_index.py). A requester's first upload under a key is kept; a different second one is
refused (it would be two contributions to one round) and the first stays. Each requester holds at most
``keep`` keys (its oldest go first), so one peer's uploads under made-up keys never push out another's.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable, Collection, Dict, Mapping, Optional, Tuple

from dilocox.peers.averaging import LEFT_BEHIND, RoundFailed


class Uploads:
    """Uploads by key and requester (module docstring); thread-safe (the server's loop puts, a round's thread
    collects)."""

    def __init__(self, keep: int):
        if keep < 1:
            raise ValueError(f"keep must be at least 1; got {keep}")
        self.keep = keep
        self._by_peer: Dict[str, "OrderedDict[str, bytes]"] = {}
        self._cond = threading.Condition()

    def put(self, key: str, peer: str, payload: bytes) -> Optional[str]:
        """Keep ``peer``'s upload under ``key``; None, or why it was refused (a different second upload)."""
        with self._cond:
            mine = self._by_peer.setdefault(peer, OrderedDict())
            held = mine.get(key)
            if held is not None:
                return None if held == payload else "a different upload under this key was already received"
            mine[key] = bytes(payload)
            while len(mine) > self.keep:
                mine.popitem(last=False)
            self._cond.notify_all()
            return None

    def collect(self, key: str, sizes: Mapping[str, int], timeout_s: float,
                stop: Optional[Callable[[], bool]] = None,
                check_every_s: float = 1.0,
                gone: Optional[Callable[[Collection[str]], Collection[str]]] = None
                ) -> Tuple[Dict[str, bytes], Dict[str, str]]:
        """Wait until every peer of ``sizes`` (peer_id -> the largest valid length in bytes) has uploaded under
        ``key``, at most ``timeout_s`` seconds; blocking. Returns (peer_id -> upload, peer_id -> why not: none
        came in time, it left, or it is longer than its size). ``stop()``, asked first and then about every
        ``check_every_s`` seconds, ends the wait with RoundFailed (the round went on without us). ``gone(peers)``,
        asked as often with the peers still waited for, names those known to have left (their membership records
        say they left, or have expired): the wait stops waiting for them, so a member that leaves or crashes
        mid-round costs its group-mates seconds, not ``timeout_s``."""
        began = time.monotonic()
        deadline, next_check = began + timeout_s, began  # stop() is asked first: a wait the round has left is not begun
        polled, left = stop is not None or gone is not None, set()
        with self._cond:
            while True:
                have = {p for p in sizes if key in self._by_peer.get(p, ())}
                now = time.monotonic()
                if len(have | left) == len(sizes) or now >= deadline:
                    break
                if polled and now >= next_check:
                    next_check = now + check_every_s
                    self._cond.release()
                    try:  # stop() and gone() may read the DHT: not under our lock
                        stopped = stop is not None and stop()
                        if not stopped and gone is not None:
                            left = set(gone(set(sizes) - have)) & set(sizes)
                    finally:
                        self._cond.acquire()
                    if stopped:
                        raise RoundFailed(f"abandoned after {now - began:.1f}s of waiting for uploads under "
                                          f"{key!r}: {LEFT_BEHIND}")
                    continue
                self._cond.wait(min(deadline, next_check if polled else deadline) - now)
            got = {p: self._by_peer[p][key] for p in have}
        missing = {p: f"it left mid-round after {time.monotonic() - began:.1f}s (its membership record says so, "
                   "or has expired)"
                   if p in left else f"not received within {timeout_s:.0f}s" for p in sizes if p not in got}
        for p in list(got):
            if len(got[p]) > sizes[p]:
                missing[p] = f"oversized upload: {len(got.pop(p))} bytes where at most {sizes[p]} are valid"
        return got, missing
