"""Entering the DHT when the ``--join`` peers are busy or briefly unreachable: retries with backoff.

A popular swarm's bootstrap peer answers many joiners at once, and hivemind gives up on the first
try: p2pd exits with "failed to connect to bootstrap peers" when it reaches none of them, and
``DHTNode.create`` raises "DHTNode bootstrap failed: none of the initial_peers responded to a ping"
when they connect but do not answer within its ``wait_timeout`` (hivemind/dht/node.py). Each
attempt starts a fresh DHT process on every ``--join`` address at once (hivemind pings all initial
peers in parallel); between attempts the joiner waits an exponentially growing, jittered delay, so
a crowd of joiners spreads out instead of knocking again in step (as in AWS's "exponential backoff
and jitter"). Failures of our own (a listen address in use, a taken identity) are not retried.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

T = TypeVar("T")

# what hivemind's messages say when the join peers, not this node, are the problem
_JOIN_FAILURES = ("bootstrap", "initial_peers", "timed out", "timeout")


class JoinAbandoned(RuntimeError):
    """No attempt joined before the deadline (or a leave was requested); the message has the last failure."""

    def __init__(self, message: str, *, requested: bool):
        super().__init__(message)
        self.requested = requested  # a leave request ended the attempts (not a failure)


@dataclass(frozen=True)
class Backoff:
    """Delay after the n-th failed attempt: ``first_s * factor**(n-1)``, at most ``cap_s``, times a uniform
    factor in [1 - jitter, 1 + jitter]. Seconds."""

    first_s: float = 1.0
    factor: float = 2.0
    cap_s: float = 30.0
    jitter: float = 0.25

    def delay(self, attempt: int, rng: random.Random) -> float:
        base = min(self.cap_s, self.first_s * self.factor ** max(0, attempt - 1))
        return base * (1.0 + self.jitter * (2.0 * rng.random() - 1.0))


def is_join_failure(error: BaseException) -> bool:
    """True if ``error`` (from starting hivemind's DHT) says the join peers did not answer, so a later
    attempt may succeed; False for a problem of this node's own, which a retry would only repeat."""
    if isinstance(error, TimeoutError):
        return True
    text = str(error).lower()
    return any(marker.lower() in text for marker in _JOIN_FAILURES)


def keep_trying(attempt: Callable[[], T], *, deadline_s: Optional[float], stop: threading.Event,
                on_failure: Callable[[int, str, float], None], backoff: Backoff = Backoff(),
                rng: Optional[random.Random] = None, clock: Callable[[], float] = time.monotonic) -> T:
    """Call ``attempt()`` until it returns; return its value.

    A join failure (``is_join_failure``) is retried after ``backoff``'s delay, reported first as
    ``on_failure(attempt number, reason, delay_s)``; any other exception propagates at once.
    Raises JoinAbandoned when ``deadline_s`` seconds (None: no deadline) would pass before the
    next attempt, or when ``stop`` is set (checked during each wait)."""
    rng = rng or random.Random()
    give_up_at = clock() + deadline_s if deadline_s is not None else float("inf")
    n = 0
    while True:
        n += 1
        try:
            return attempt()
        except Exception as e:
            if not is_join_failure(e):
                raise
            reason = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
        wait_s = backoff.delay(n, rng)
        if clock() + wait_s > give_up_at:
            raise JoinAbandoned(f"no --join peer let us in within --sync-deadline {deadline_s:.0f}s "
                                f"({n} attempts; last: {reason})", requested=False)
        on_failure(n, reason, wait_s)
        if stop.wait(wait_s):
            raise JoinAbandoned(f"leave requested while joining ({n} attempts; last: {reason})", requested=True)
