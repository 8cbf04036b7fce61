"""Deadlines from measurement: how long a round's downloads may take, from this node's measured link.

Fixed timeouts suit one model size and one link rate only: a larger model or a slower link needs
longer ones, and a faster swarm waits needlessly long on a member that died (hivemind #676 asks
for adaptive deadlines). ``LinkEstimate`` keeps running estimates (exponentially weighted, the
newest observation weighing ``ALPHA``) of this node's effective download rate (bytes over the
whole batch's wall time, latency included: a lower bound on the link rate, so deadlines err long)
and of its latency to the first byte, from the all-gather's past downloads (peers/allgather.py).
``download_deadline`` turns the bytes a round will fetch into a deadline: ``MARGIN`` x (latency +
bytes / rate), at least ``FLOOR_S`` seconds, at most the configured cap (``--averaging-timeout``).
Until a download has been measured the cap is used; a joiner's state download gives a first rate
(``LinkEstimate.seed``). A group uses the longest deadline any of its
members needs (``group_download_deadline``: members announce their link with their metadata).

``RoundDeadlines`` derives the other two deadlines of a sparse round the same way, each with its
flag as the cap and the flag itself until measured:

- **matchmaking** (``--matchmaking-time``): ``MARGIN`` x ``MATCHMAKING_TRIPS`` x latency, at least
  ``MATCHMAKING_FLOOR_S``. Matchmaking is a few sequential requests (declare, look up, join, begin:
  hivemind's ``Matchmaking``), so its time follows the latency, not the payload. hivemind fixes an
  averager's ``min_matchmaking_time`` at construction and lets a step extend it (``scheduled_time``,
  never shorter), so the averager is built with the floor and each round schedules the value in use.
- **group wait** (``--outer-round-deadline`` minus ``--averaging-timeout``: the hivemind step's
  timeout, how long a round looks for its group): ``MARGIN`` x (matchmaking + the compute lag), at
  least ``GROUP_WAIT_FLOOR_S``. The compute lag is how much longer the slowest group-mate's inner
  steps took than ours (members send their compute time with their metadata), the largest of the
  last ``LAG_WINDOW`` rounds: a fast replica waits that long in matchmaking for a slow one.

The round deadline the status reports is the group wait plus the downloads' deadline.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional

ALPHA = 0.3           # weight of the newest observation
MARGIN = 3.0          # headroom over the estimate: CPU load, a slower group-mate, a relay's extra hop
RELAY_FACTOR = 2.0    # a relayed download waits for the relay's own download first
FLOOR_S = 5.0         # never shorter: scheduling noise on a busy host is seconds, not milliseconds
MIN_RATE_BYTES = 1 << 10  # a download batch smaller than this measures latency only
MATCHMAKING_TRIPS = 4     # sequential requests in a matchmaking: declare, look up, join a leader, begin
MATCHMAKING_FLOOR_S = 6.0  # a busy host answers a matchmaking request within seconds, not milliseconds
GROUP_WAIT_FLOOR_S = 60.0  # a stalled matchmaking retries for at least this long before the round fails
LAG_WINDOW = 8            # rounds over which the largest compute lag is kept (a slow member is not forgotten)


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

    def seed(self, nbytes: int, seconds: float) -> None:
        """A first rate from one download outside the rounds: a joiner's state download, ``nbytes`` in
        ``seconds`` (finding the donor included, so a lower bound on the rate, and deadlines from it err
        long). Taken only while no round has been measured (``samples`` 0), which it leaves at 0: the
        matchmaking time and group wait keep their flags until a round is measured, and the first round's
        observation replaces the latency (unknown here: 0). Without it a joiner announces no rate, and its
        whole group waits the download cap for a missing contribution (run P, docs/protocol.md)."""
        if not (0 < seconds < float("inf")) or nbytes < MIN_RATE_BYTES:
            return
        with self._lock:
            if self._s.samples == 0:
                self._s = LinkSnapshot(8 * nbytes / seconds, 0.0, 0)

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


def group_download_deadline(links: Iterable[LinkSnapshot], nbytes: int, cap_s: float, relayed: bool = False) -> float:
    """The download deadline every member of a group uses (seconds): the longest ``download_deadline`` of
    the members' links (as each announced it) for ``nbytes``; the cap if any member has not measured its
    link yet (a joiner). Each member computes it from the same gathered metadata, so all stop waiting for a
    missing payload at about the same time and publish their results together: a member that waited
    its own longer deadline would finish after the others had judged the round without its result (a
    skip for them, an applied round for it). A member can make it longer, never beyond ``cap_s``."""
    return max((download_deadline(link, nbytes, cap_s, relayed) for link in links), default=cap_s)


def describe(link: LinkSnapshot, deadline_s: Optional[float], cap_s: float) -> str:
    """One line for status: the deadline in use and what it came from."""
    if link.bps <= 0 or deadline_s is None:
        return f"downloads {cap_s:.0f}s (--averaging-timeout; link not measured yet)"
    if link.samples == 0:
        return (f"downloads {deadline_s:.1f}s (the state download's {link.bps / 1e6:.1f} Mbit/s; no round measured "
                f"yet; cap {cap_s:.0f}s)")
    return (f"downloads {deadline_s:.1f}s (measured {link.bps / 1e6:.1f} Mbit/s, {1e3 * link.latency_s:.0f} ms to "
            f"first byte, {link.samples} rounds; cap {cap_s:.0f}s)")


def matchmaking_floor(cap_s: float, request_timeout_s: float) -> float:
    """The averager's fixed ``min_matchmaking_time`` (seconds) when matchmaking is derived: the shortest
    matchmaking a round may schedule. Longer than a request (hivemind warns otherwise), at most ``cap_s``."""
    return min(cap_s, max(MATCHMAKING_FLOOR_S, request_timeout_s + 1.0))


@dataclass(frozen=True)
class RoundTimes:
    """The deadlines one round uses, in seconds: ``matchmaking_s`` (the all-reduce is scheduled this long
    after matchmaking begins) and ``group_wait_s`` (the step's timeout: matchmaking and its retries);
    ``measured``: derived from this node's measurements (False: the flags)."""

    matchmaking_s: float
    group_wait_s: float
    measured: bool = False


class RoundDeadlines:
    """The matchmaking time and group wait of one node's rounds (module docstring); thread-safe.

    ``link``: the download estimate the all-gather keeps (None: nothing is measured, e.g. all-reduce
    rounds: the flags are used). Caps: ``matchmaking_cap_s`` (``--matchmaking-time``), ``group_wait_cap_s``
    (``--outer-round-deadline`` - ``--averaging-timeout``)."""

    def __init__(self, link: Optional[LinkEstimate], *, matchmaking_cap_s: float, group_wait_cap_s: float,
                 request_timeout_s: float):
        self.link = link
        self.matchmaking_cap_s, self.group_wait_cap_s = matchmaking_cap_s, group_wait_cap_s
        self.floor_s = matchmaking_floor(matchmaking_cap_s, request_timeout_s) if link else matchmaking_cap_s
        self._lags: deque = deque(maxlen=LAG_WINDOW)
        self._lock = threading.Lock()

    def observe_group(self, own_compute_s: float, group_compute_s: Iterable[float]) -> None:
        """One averaged round: our inner steps took ``own_compute_s`` seconds, the group's members' (ours
        included, as they sent them; 0: unknown) ``group_compute_s``. Non-finite values are ignored."""
        times = [t for t in group_compute_s if 0 < t < float("inf")]
        if not (0 < own_compute_s < float("inf")) or not times:
            return
        with self._lock:
            self._lags.append(max(0.0, max(times) - own_compute_s))

    def current(self) -> RoundTimes:
        """The deadlines for the next round: the caps until the link's latency and a group were measured."""
        with self._lock:
            lag = max(self._lags) if self._lags else None
        snap = self.link.snapshot() if self.link is not None else LinkSnapshot()
        if snap.samples == 0 or lag is None:
            return RoundTimes(self.matchmaking_cap_s, self.group_wait_cap_s)
        matchmaking = min(self.matchmaking_cap_s, max(self.floor_s, MARGIN * MATCHMAKING_TRIPS * snap.latency_s))
        wait = min(self.group_wait_cap_s, max(min(GROUP_WAIT_FLOOR_S, self.group_wait_cap_s),
                                              MARGIN * (matchmaking + lag)))
        return RoundTimes(matchmaking, max(wait, matchmaking), measured=True)

    def describe(self, download_deadline_s: Optional[float], download_cap_s: float) -> str:
        """One status line: matchmaking, round (group wait + downloads) and downloads, and their sources."""
        t = self.current()
        with self._lock:
            lag = max(self._lags) if self._lags else 0.0
        snap = self.link.snapshot() if self.link is not None else LinkSnapshot()
        downloads = describe(snap, download_deadline_s, download_cap_s)
        if not t.measured:
            return (f"matchmaking {t.matchmaking_s:g}s, round {t.group_wait_s + download_cap_s:g}s (flags; not "
                    f"measured yet), {downloads}")
        round_s = t.group_wait_s + (download_deadline_s or download_cap_s)
        return (f"matchmaking {t.matchmaking_s:.1f}s (cap {self.matchmaking_cap_s:g}s), round {round_s:.1f}s "
                f"(group wait {t.group_wait_s:.1f}s for a compute lag of {lag:.1f}s, cap "
                f"{self.group_wait_cap_s:g}s; plus downloads), {downloads}")
