"""Deadlines from measurement: how long a round's downloads may take, from this node's measured link.

Fixed timeouts suit one model size and one link rate only: a larger model or a slower link needs
longer ones, and a faster swarm waits needlessly long on a member that died (hivemind #676 asks
for adaptive deadlines). ``LinkEstimate`` keeps running estimates (exponentially weighted, the
newest observation weighing ``ALPHA``) of this node's effective download rate (bytes over the
whole batch's wall time, latency included: a lower bound on the link rate, so deadlines err long)
and of its latency to the first byte, from the all-gather's past downloads (peers/allgather.py).
``download_deadline`` turns the bytes a round will fetch into a deadline: ``MARGIN`` x (latency +
bytes / rate), at least ``FLOOR_S`` seconds, at most the configured cap (``--averaging-timeout``).
Until a download has been measured the cap is used.

Matchmaking and the round deadline stay as configured: hivemind fixes an averager's matchmaking
time at construction, and a round's wait for its group includes early matchmaking's lead time
(docs/protocol.md), which no link measurement predicts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

ALPHA = 0.3           # weight of the newest observation
MARGIN = 3.0          # headroom over the estimate: CPU load, a slower group-mate, a relay's extra hop
RELAY_FACTOR = 2.0    # a relayed download waits for the relay's own download first
FLOOR_S = 5.0         # never shorter: scheduling noise on a busy host is seconds, not milliseconds
MIN_RATE_BYTES = 1 << 10  # a download batch smaller than this measures latency only


@dataclass(frozen=True)
class LinkSnapshot:
    """Estimates at one time: ``bps`` effective download rate in bit/s (0: not measured), ``latency_s`` time
    to the first byte of a download in seconds (stream set-up included), ``samples`` batches observed."""

    bps: float = 0.0
    latency_s: float = 0.0
    samples: int = 0


class LinkEstimate:
    """Running estimate of this node's download rate and latency; thread-safe."""

    def __init__(self):
        self._s = LinkSnapshot()
        self._lock = threading.Lock()

    def observe(self, nbytes: int, seconds: float, first_byte_s: float) -> None:
        """One batch of concurrent downloads: ``nbytes`` in all, over ``seconds`` of wall time, the
        first byte of the fastest after ``first_byte_s``. Non-positive or non-finite times are ignored."""
        if not (0 < first_byte_s <= seconds < float("inf")) or nbytes < 0:
            return
        with self._lock:
            s = self._s
            latency = first_byte_s if s.samples == 0 else (1 - ALPHA) * s.latency_s + ALPHA * first_byte_s
            bps = s.bps
            if nbytes >= MIN_RATE_BYTES:
                rate = 8 * nbytes / seconds  # payloads of one chunk give no time between first and last byte
                bps = rate if s.bps == 0 else (1 - ALPHA) * s.bps + ALPHA * rate
            self._s = LinkSnapshot(bps, latency, s.samples + 1)

    def snapshot(self) -> LinkSnapshot:
        with self._lock:
            return self._s


def download_deadline(link: LinkSnapshot, nbytes: int, cap_s: float, relayed: bool = False) -> float:
    """Seconds to allow for downloading ``nbytes`` (a round's group-mates' payloads, all at once):
    MARGIN x (latency + 8 nbytes / bps), x RELAY_FACTOR when some come through a relay, within
    [min(FLOOR_S, cap_s), cap_s]; ``cap_s`` itself while the rate is not measured."""
    if link.bps <= 0:
        return cap_s
    estimate = MARGIN * (link.latency_s + 8 * nbytes / link.bps) * (RELAY_FACTOR if relayed else 1.0)
    return min(cap_s, max(FLOOR_S, estimate))


def describe(link: LinkSnapshot, deadline_s: Optional[float], cap_s: float) -> str:
    """One line for status: the deadline in use and what it came from."""
    if link.bps <= 0 or deadline_s is None:
        return f"downloads {cap_s:.0f}s (--averaging-timeout; link not measured yet)"
    return (f"downloads {deadline_s:.1f}s (measured {link.bps / 1e6:.1f} Mbit/s, {1e3 * link.latency_s:.0f} ms to "
            f"first byte, {link.samples} rounds; cap {cap_s:.0f}s)")
