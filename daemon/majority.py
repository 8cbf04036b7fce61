"""One update per round when hivemind's matchmaking split a round into several groups.

Each group all-gathers and aggregates its own members' contributions, so two groups of one round
would apply two different updates and fork theta. After a group agrees on its result, each member
looks at the result digests every member of the round publishes in its membership record
(``result_step`` / ``result_digest``) and applies dilocox.consensus.group_standing:

- our group holds a strict majority of the round's replicas: its update is the round's; apply it;
- another group's result is held by a strict majority: fetch that group's applied update
  (``update/{r}``, served for catch-up by every member that applied it: dilocox/catchup.py),
  check it is content-addressed by that result digest and continues our theta, and apply it in
  place of our own group's, so theta stays bit-identical swarm-wide;
- no group can reach a majority: every group applies its own, as before this rule, and the next
  round's start digests send the smaller side to re-sync.

The rule and its limits are in docs/protocol.md ("One update per round").
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from dilocox.catchup import AppliedUpdate
from dilocox.consensus import Standing, group_standing, in_round
from dilocox.diloco import params_digest

logger = logging.getLogger(__name__)
POLL_S = 0.25
FRESH_S = 0.2

# fetch(peer_ids, outer_step) -> the update one of them applied at that step (checked against our shapes), or None
FetchUpdate = Callable[[list[str], int], Optional[AppliedUpdate]]


@dataclass
class Resolution:
    """``standing``: MAJORITY or ALONE (apply our group's update), ADOPT (apply ``update``; None: it could
    not be fetched in time, so re-sync: ``reason``)."""

    standing: Standing
    update: Optional[AppliedUpdate] = None
    reason: str = ""


class MajorityUpdate:
    """Settles a round that may have been split: ``resolve`` after the group agreed on its result."""

    def __init__(self, progress, fetch: FetchUpdate, delayed: bool, wait_s: float, cancelled: Callable[[], bool]):
        """``progress``: the membership records (daemon/progress.py); ``wait_s``: how long to wait for the
        other groups' results and for the majority's applied update; ``cancelled()``: stop waiting."""
        self.progress, self.fetch, self.delayed = progress, fetch, delayed
        self.wait_s, self.cancelled = wait_s, cancelled

    def resolve(self, index: int, group: set[str], holders: int, parent_digest: str) -> Resolution:
        """Round ``index``: ``group`` is our group's peer_ids (ours included), ``holders`` how many of them
        hold our result, ``parent_digest`` our theta's digest at outer step index - 1."""
        deadline = time.monotonic() + self.wait_s
        reason = ""
        while True:
            others = [m for m in self.progress.others(FRESH_S) if m.peer_id not in group]
            reported = {m.peer_id: m.result_digest for m in others if m.result_step == index and m.result_digest}
            pending = [m for m in in_round(others, index, self.delayed)
                       if m.peer_id not in reported and m.outer_step < index]
            standing, digest = group_standing(holders, len(group) + len(reported) + len(pending), reported,
                                              len(pending))
            if standing in (Standing.MAJORITY, Standing.ALONE):
                return Resolution(standing)
            if standing == Standing.ADOPT:
                update, reason = self._fetch(index, digest, parent_digest, others)
                if update is not None:
                    logger.info("round %d: a group of %d holds a majority of the round's replicas; our group of %d "
                                "adopts its update %s", index, update.group_size, len(group), digest[:16])
                    return Resolution(Standing.ADOPT, update)
            if time.monotonic() >= deadline or self.cancelled():
                if standing == Standing.ADOPT:
                    return Resolution(Standing.ADOPT, None, f"round {index}: the majority's update {digest[:16]} "
                                                            f"could not be fetched ({reason or 'not applied yet'})")
                logger.warning("round %d: no group reached a majority within %.0fs; applying our group's", index,
                               self.wait_s)
                return Resolution(Standing.ALONE)
            time.sleep(POLL_S)

    def _fetch(self, index: int, digest: str, parent_digest: str, others) -> tuple[Optional[AppliedUpdate], str]:
        """The majority's update from a member that applied it; (None, why) if none serves a valid one yet."""
        sources = [m.peer_id for m in others if m.result_step == index and m.result_digest == digest
                   and m.outer_step >= index and not m.client_mode]
        if not sources:
            return None, "no member of that group has applied it yet"
        update = self.fetch(sources, index)
        if update is None or update.aggregate is None:
            return None, "no member served it"
        if update.parent_digest != parent_digest:
            return None, f"it continues theta {update.parent_digest}, ours is {parent_digest}"
        if params_digest(update.aggregate) != digest:  # content-addressed: the bytes are the majority's result
            return None, "its aggregate does not match the majority's result digest"
        return update, ""
