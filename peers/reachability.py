"""Who can dial whom: direct-dial outcomes, and this node's reachability verdict.

A volunteer behind a NAT or a firewall accepts no inbound connections; two such volunteers behind
different routers cannot connect to each other at all (hivemind #472, #536). libp2p reuses a
connection the NAT'd side opened, so a public peer can still reach it, which is why a swarm of
one public and one NAT'd node shows nothing wrong.

Every node keeps a ``DialLog`` of its direct attempts to reach group-mates (the all-gather's
downloads, peers/allgather.py) and publishes the peers it could not dial in its membership
record (``MemberRecord.undialable``). From the records of the live members a node derives its
own ``Reachability``: a node that others cannot dial is told so, in its log and status, with
the advice to run with ``--client-mode`` (hivemind's client mode: it then dials out only).
"""

from __future__ import annotations

import enum
import threading
import time
from typing import Callable, Dict, Iterable, List, Tuple

FORGET_S = 600.0  # a failed dial is reported for this long unless a later dial succeeds
RETRY_S = 120.0   # a peer we failed to dial is not tried directly again for this long (relays serve it)


class Reachability(str, enum.Enum):
    CLIENT = "client"            # --client-mode: nobody dials us, by design
    REACHABLE = "reachable"      # no live peer reports a failed dial to us
    UNREACHABLE = "unreachable"  # live peers report they could not dial us


class DialLog:
    """Outcomes of this node's direct dials to other peers; thread-safe. ``clock``: seconds, monotonic."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._failed: Dict[str, float] = {}  # peer_id -> time of the last failed direct dial
        self._lock = threading.Lock()

    def failed(self, peer_id: str) -> None:
        with self._lock:
            self._failed[peer_id] = self._clock()

    def succeeded(self, peer_id: str) -> None:
        with self._lock:
            self._failed.pop(peer_id, None)

    def worth_dialing(self, peer_id: str) -> bool:
        """False for RETRY_S seconds after a failed dial: averaging does not wait on it again meanwhile."""
        with self._lock:
            at = self._failed.get(peer_id)
        return at is None or self._clock() - at >= RETRY_S

    def undialable(self) -> List[str]:
        """Peers whose last direct dial failed less than FORGET_S ago, sorted (published in our record)."""
        now = self._clock()
        with self._lock:
            self._failed = {p: t for p, t in self._failed.items() if now - t < FORGET_S}
            return sorted(self._failed)


def verdict(me: str, client_mode: bool, reports: Iterable[Tuple[str, Iterable[str]]]) -> Tuple[Reachability, List[str]]:
    """This node's reachability from the live members' records.

    ``reports``: (peer_id, the peer_ids it could not dial) for each live member other than us. Returns
    (verdict, sorted peer_ids of the members that could not dial us). A client is CLIENT whatever
    others report (they should not have dialed it)."""
    reporters = sorted({peer for peer, failed in reports if peer != me and me in set(failed)})
    if client_mode:
        return Reachability.CLIENT, reporters
    return (Reachability.UNREACHABLE if reporters else Reachability.REACHABLE), reporters


def describe(reachability: Reachability, reporters: List[str]) -> str:
    """One line for status and the log."""
    if reachability != Reachability.UNREACHABLE:
        return reachability.value
    shown = ", ".join(p[:12] + "…" for p in reporters[:3])
    if len(reporters) > 3:
        shown += f" and {len(reporters) - 3} more"
    return (f"unreachable: {len(reporters)} peer(s) could not dial us ({shown}); behind a NAT or firewall, "
            "run with --client-mode (or --auto-relay, or --announce a reachable address)")
