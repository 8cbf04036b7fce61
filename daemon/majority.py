"""One update per round when hivemind's matchmaking split a round into several groups.

Each group all-gathers and aggregates its own members' contributions, so two groups of one round
would apply two different updates and fork theta. After a group agrees on its result, each member
offers that result (``result/{r}``) and looks at the result digests every member of the round
publishes in its membership record (``result_step`` / ``result_digest``, with the contributions
used in ``inputs``), then applies dilocox.consensus.group_standing:

- our group holds a strict majority of the round's replicas: its update is the round's; apply it;
- another group's result is held by a strict majority: fetch that group's applied update
  (``update/{r}``, served for catch-up by every member that applied it: dilocox/catchup.py),
  check it is content-addressed by that result digest and continues our theta, and apply it in
  place of our own group's, so theta stays bit-identical swarm-wide;
- no group can reach a majority: once every group reported (or the wait ran out), fetch every
  other group's offered result, check each against its digest, and apply the union of all groups'
  results (dilocox/union.py), the same bits in every group; if one cannot be fetched in time, re-sync;
- nobody outside our group reported: apply our group's (the next round's start digests reconcile).

The rule and its limits are in docs/protocol.md ("One update per round").
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from dilocox.catchup import AppliedUpdate
from dilocox.consensus import Standing, group_standing, in_round, union_groups
from dilocox.diloco import params_digest
from dilocox.union import UnionError, unite

logger = logging.getLogger(__name__)
POLL_S = 0.25
FRESH_S = 0.2
FETCH_SHARE = 0.25  # of wait_s: the least time a union has to fetch the other groups' results
STABLE_S = 1.0  # a union is decided once the groups seen stayed the same this long (records arrive late)

# fetch(peer_ids, outer_step) -> the update one of them applied at that step (checked against our shapes), or None
FetchUpdate = Callable[[list[str], int], Optional[AppliedUpdate]]
# fetch_result(peer_ids, round) -> the group result one of them offers for that round (``result/{r}``), or None
FetchResult = Callable[[list[str], int], Optional[AppliedUpdate]]
# offer_result(round, our group's result) -> None: serve it under ``result/{r}`` for the other groups
OfferResult = Callable[[int, AppliedUpdate], None]


@dataclass
class Resolution:
    """``standing``: MAJORITY or ALONE (apply our group's update), ADOPT or UNION (apply ``update``; None:
    it could not be fetched or united in time, so re-sync: ``reason``). A UNION's ``update.digest`` is
    "" (theta after it is only known once applied) and ``groups`` counts the results united."""

    standing: Standing
    update: Optional[AppliedUpdate] = None
    reason: str = ""
    groups: int = 1


class MajorityUpdate:
    """Settles a round that may have been split: ``resolve`` after the group agreed on its result."""

    def __init__(self, progress, fetch: FetchUpdate, delayed: bool, wait_s: float, cancelled: Callable[[], bool],
                 fetch_result: Optional[FetchResult] = None, offer_result: Optional[OfferResult] = None):
        """``progress``: the membership records (daemon/progress.py); ``wait_s``: how long to wait for the
        other groups' results and for the majority's applied update; ``cancelled()``: stop waiting;
        ``fetch_result`` / ``offer_result``: the other groups' results and ours (None: no UNION, every group
        applies its own where no majority can form)."""
        self.progress, self.fetch, self.delayed = progress, fetch, delayed
        self.wait_s, self.cancelled = wait_s, cancelled
        self.fetch_result, self.offer_result = fetch_result, offer_result

    def resolve(self, index: int, group: set[str], holders: int, parent_digest: str,
                result: Optional[Sequence[torch.Tensor]] = None, weight: int = 0) -> Resolution:
        """Round ``index``: ``group`` is our group's peer_ids (ours included), ``holders`` how many of them
        hold our result ``result`` (the group's aggregate; None: this member cannot unite), ``parent_digest``
        our theta's digest at outer step index - 1; ``weight``: the contributions in our result (the inputs
        our record lists; 0: ``holders``), our group's weight in a union."""
        uniting = result is not None and self.fetch_result is not None and self.offer_result is not None
        if uniting:  # before anyone can ask: the other groups fetch it if the round has no majority
            self.offer_result(index, AppliedUpdate(index, parent_digest, params_digest(result), holders, list(result)))
        deadline = time.monotonic() + self.wait_s
        reason = ""
        seen, seen_since = None, 0.0  # the union's groups at the last poll, and since when unchanged
        while True:
            others = [m for m in self.progress.others(FRESH_S) if m.peer_id not in group]
            reported = {m.peer_id: m.result_digest for m in others if m.result_step == index and m.result_digest}
            pending = [m for m in in_round(others, index, self.delayed)
                       if m.peer_id not in reported and m.outer_step < index]
            sizes = {m.peer_id: len(m.inputs) for m in others if m.peer_id in reported}
            standing, digest = group_standing(holders, len(group) + len(reported) + len(pending), reported,
                                              len(pending), sizes)
            late = time.monotonic() >= deadline or self.cancelled()
            if standing == Standing.WAIT and late and reported:
                standing = Standing.UNION  # the missing reports may never come: unite the groups that reported
            if standing == Standing.UNION and not uniting:
                standing = Standing.ALONE
            if standing in (Standing.MAJORITY, Standing.ALONE):
                return Resolution(standing)
            if standing == Standing.UNION:
                groups = union_groups(reported, sizes)
                if groups != seen:
                    seen, seen_since = groups, time.monotonic()
                if late or time.monotonic() - seen_since >= STABLE_S:
                    # fetches get time of their own when the union was only decided at the deadline
                    return self._unite(index, groups, weight or holders, list(result), parent_digest, others,
                                       max(deadline, time.monotonic() + FETCH_SHARE * self.wait_s))
            if standing == Standing.ADOPT:
                update, reason = self._fetch(index, digest, parent_digest, others)
                if update is not None:
                    logger.info("round %d: a group of %d holds a majority of the round's replicas; our group of %d "
                                "adopts its update %s", index, update.group_size, len(group), digest[:16])
                    return Resolution(Standing.ADOPT, update)
            if late:
                if standing == Standing.ADOPT:
                    return Resolution(Standing.ADOPT, None, f"round {index}: the majority's update {digest[:16]} "
                                                            f"could not be fetched ({reason or 'not applied yet'})")
                logger.warning("round %d: no group reached a majority within %.0fs; applying our group's", index,
                               self.wait_s)
                return Resolution(Standing.ALONE)
            time.sleep(POLL_S)

    def _unite(self, index: int, groups: dict[str, int], weight: int, ours: list[torch.Tensor],
               parent_digest: str, others, deadline: float) -> Resolution:
        """Fetch every group's result in ``groups`` (digest -> weight) and unite them with ours (``weight``); fetches
        are retried until ``deadline`` (a group may still be offering). Re-sync when one cannot be had.
        A fetched result's ``digest`` field is the result digest its server claims: only the content check
        (params_digest of the aggregate) is trusted."""
        mine = params_digest(ours)
        groups = {d: w for d, w in groups.items() if d != mine}
        if not groups:
            return Resolution(Standing.ALONE)
        got: dict[str, AppliedUpdate] = {}
        why = ""
        while True:
            for digest in sorted(set(groups) - set(got)):
                sources = [m.peer_id for m in others if m.result_step == index and m.result_digest == digest
                           and not m.client_mode]
                update = self.fetch_result(sources, index) if sources else None
                if update is None or update.aggregate is None:
                    why = f"no holder of {digest[:16]} served it" if sources else f"no holder of {digest[:16]} " \
                                                                                  f"accepts connections"
                elif update.parent_digest != parent_digest:
                    why = f"{digest[:16]} continues theta {update.parent_digest}, ours is {parent_digest}"
                elif params_digest(update.aggregate) != digest:  # content-addressed: any holder may serve it
                    why = f"what a holder of {digest[:16]} served does not match that digest"
                else:
                    got[digest] = update
            if len(got) == len(groups):
                break
            if time.monotonic() >= deadline or self.cancelled():
                return Resolution(Standing.UNION, None, reason=f"round {index}: the union of {len(groups) + 1} "
                                                               f"groups' results could not be fetched ({why})")
            time.sleep(POLL_S)
        everyone = sorted([(mine, weight, ours)] + [(d, groups[d], got[d].aggregate) for d in got])
        try:
            united = unite([(w, tensors) for _, w, tensors in everyone])
        except UnionError as e:
            return Resolution(Standing.UNION, None, reason=f"round {index}: group results cannot be united: {e}")
        weight = sum(w for _, w, _ in everyone)
        logger.info("round %d: no group holds a majority; uniting %d groups' results (weights %s)", index,
                    len(everyone), [w for _, w, _ in everyone])
        return Resolution(Standing.UNION, AppliedUpdate(index, parent_digest, "", weight, united),
                          groups=len(everyone))

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
