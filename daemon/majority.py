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
import random
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from dilocox.catchup import AppliedUpdate
from dilocox.consensus import (
    Standing,
    applied_majority,
    chosen_union,
    group_standing,
    in_round,
    majority_theta,
    union_groups,
)
from dilocox.diloco import params_digest
from dilocox.union import UnionError, unite

logger = logging.getLogger(__name__)
POLL_S = 0.25
FRESH_S = 0.5  # the result-digest exchange's last read (moments before resolve) serves resolve's first poll: a
# read of its own, 0.2-0.35 s later, was 0.7 of a node's 5.7 reads a round at 16 nodes (bench.upload). The first poll
# also takes that read when it is older (ProgressTracker.exchanged_at): with 32 nodes on 2 cores, or 25 M values
# whose result this member offers first, the steps before it took longer, and it read again once a round
FETCH_SHARE = 0.25  # of wait_s: the least time a union has to fetch the other groups' results
STABLE_S = 1.0  # a union is decided once the groups seen stayed the same this long (records arrive late)
ROSTER_SHARE = 0.25  # of wait_s: how long a member's record counts after reads stopped returning it
# holders asked per fetch attempt: each is bounded by the transfer's own timeout, and the caller's loop asks others
# at its next poll, so a holder that is gone or overloaded costs one timeout, not one per holder (at 32 nodes a
# sweep over 30 holders kept a member in one round for minutes and past its leave)
FETCH_SOURCES = 2
# outer steps a member left behind follows by fetching the updates that took the swarm on (each a sparse aggregate,
# served from the catch-up log); further behind, it re-syncs (a state download)
MAX_CHAIN = 4

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
        # peer_id -> (its last record, monotonic time last read): a record a loaded DHT read misses still counts
        # for ROSTER_SHARE x wait_s, so a group does not take itself for the round's majority (seen at 32 nodes)
        self._roster: dict[str, tuple[object, float]] = {}

    def resolve(self, index: int, group: set[str], holders: int, parent_digest: str,
                result: Optional[Sequence[torch.Tensor]] = None, weight: int = 0, outsized: bool = False,
                result_digest: Optional[str] = None) -> Resolution:
        """Round ``index``: ``group`` is our group's peer_ids (ours included), ``holders`` how many of them
        hold our result ``result`` (the group's aggregate; None: this member cannot unite), ``parent_digest``
        our theta's digest at outer step index - 1; ``weight``: the contributions in our result (the inputs
        our record lists; 0: ``holders``), our group's weight in a union; ``outsized``: our group's round had an
        outsized contribution (served with our result; a union is outsized if one of its groups was);
        ``result_digest``: ``params_digest(result)`` where the caller has it already (a pass over the aggregate)."""
        uniting = result is not None and self.fetch_result is not None and self.offer_result is not None
        if uniting:  # before anyone can ask: the other groups fetch it if the round has no majority
            digest = result_digest or params_digest(result)
            self.offer_result(index, AppliedUpdate(index, parent_digest, digest, holders, result, outsized))
        deadline = time.monotonic() + self.wait_s
        reason = ""
        seen, seen_since = None, 0.0  # the union's groups at the last poll, and since when unchanged
        since = self.progress.exchanged_at(index)  # the first poll's read: the exchange's last
        while True:
            others = [m for m in self._others(index, parent_digest, since) if m.peer_id not in group]
            since = None
            theta = applied_majority(others, index, len(group))
            if theta is not None:  # most of the swarm has applied round index already: take what they applied
                update, why = self._fetch_applied(index, theta, parent_digest, others)
                if update is not None:
                    logger.info("round %d: a majority of the swarm already applied it (theta %s); our group of %d "
                                "adopts that update", index, theta, len(group))
                    return Resolution(Standing.ADOPT, update)
            reported = {m.peer_id: m.result_digest for m in others if m.result_step == index and m.result_digest}
            pending = [m for m in in_round(others, index, self.delayed)
                       if m.peer_id not in reported and m.outer_step < index]
            sizes = {m.peer_id: m.num_inputs for m in others if m.peer_id in reported}
            standing, digest = group_standing(holders, len(group) + len(reported) + len(pending), reported,
                                              len(pending), sizes)
            late = time.monotonic() >= deadline or self.cancelled()
            if standing == Standing.WAIT and late and reported:
                standing = Standing.UNION  # the missing reports may never come: unite the groups that reported
            if standing == Standing.UNION and not uniting:
                standing = Standing.ALONE
            if standing in (Standing.MAJORITY, Standing.ALONE):
                if reported or len(group) < len(others) + len(group):
                    logger.info("round %d: our group of %d keeps its update (%s: %d members seen outside it, %d "
                                "reported a result, %d pending)", index, len(group), standing.value, len(others),
                                len(reported), len(pending))
                return Resolution(standing)
            if standing == Standing.UNION:
                groups = union_groups(reported, sizes)
                if groups != seen:
                    seen, seen_since = groups, time.monotonic()
                if late or time.monotonic() - seen_since >= STABLE_S:
                    # fetches get time of their own when the union was only decided at the deadline
                    return self._unite(index, groups, weight or holders, list(result), parent_digest, group,
                                       max(deadline, time.monotonic() + FETCH_SHARE * self.wait_s), outsized)
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

    def follow(self, index: int, parent_digest: str) -> Optional[list[AppliedUpdate]]:
        """Round ``index`` went on without us (our exchange failed, or had not begun, while others applied it): the
        updates that took a strict majority of the live replicas (ours counted) from ``parent_digest`` to the theta
        they hold, fetched from them and checked (content and theta, ``_fetch_checked``), in outer-step order. One
        update where the majority holds outer step ``index`` (dilocox.consensus.applied_majority); where it has
        gone on to outer step s > index, the chain of updates index .. s (at most ``MAX_CHAIN``), each continuing
        the one before and the last leading to the majority's theta at s (``_fetch_chain``).
        Polls while a replica that has not applied round ``index`` is still in it, or the swarm is ahead (a
        majority may be forming at one outer step), up to ``wait_s``; None when no majority can be followed by
        then (or it is more than ``MAX_CHAIN`` steps ahead), no member served a valid chain, or ``cancelled()``
        (the caller then re-syncs)."""
        deadline, why = time.monotonic() + self.wait_s, "no strict majority of the live replicas applied it"
        while not self.cancelled():
            others = self._others(index, parent_digest)
            theta = applied_majority(others, index, 1)
            if theta is not None:
                update, why = self._fetch_applied(index, theta, parent_digest, others)
                if update is not None:
                    return [update]
            else:
                chain, why, hopeless = self._fetch_chain(index, parent_digest, others)
                if chain:
                    return chain
                if hopeless:
                    break
                if not any(m.outer_step > index for m in others) and \
                        not [m for m in in_round(others, index, self.delayed) if m.outer_step < index]:
                    why = f"no replica that could still apply it is in round {index}"
                    break
            if time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        logger.info("round %d: cannot follow the swarm's update (%s)", index, why)
        return None

    def _fetch_chain(self, index: int, parent_digest: str, others) -> tuple[Optional[list[AppliedUpdate]], str, bool]:
        """The updates of outer steps index .. s that took a strict majority of the live replicas (ours counted)
        to the theta they hold at s > index (the furthest such s), each fetched from members of that majority
        (they serve ``update/{j}`` from their catch-up log) and checked to continue the one before, the last to
        lead to their theta. (chain, "", False), or (None, why, hopeless): hopeless when the majority is more than
        ``MAX_CHAIN`` steps ahead (a re-sync is due), else worth another poll."""
        for step in sorted({m.outer_step for m in others if m.outer_step > index}, reverse=True):
            theta = majority_theta(others, step, ours=1)
            if theta is not None:
                break
        else:
            return None, "no strict majority of the live replicas holds one theta at a later outer step", False
        if step - index + 1 > MAX_CHAIN:
            return None, (f"the swarm is at outer step {step}, {step - index + 1} updates from ours (more than "
                          f"{MAX_CHAIN}: re-sync)"), True
        sources = [m.peer_id for m in others if m.outer_step == step and m.global_params_digest == theta
                   and not m.client_mode]
        if not sources:
            return None, f"no holder of theta {theta[:16]} at outer step {step} accepts connections", False
        chain, parent = [], parent_digest
        for j in range(index, step + 1):
            if self.cancelled():
                return None, "cancelled", True
            update, why = self._fetch_checked(self.fetch, list(sources), j, parent, theta=theta if j == step else "")
            if update is None:
                return None, f"outer step {j} of {index}..{step}: {why}", False
            chain.append(update)
            parent = update.digest
        logger.info("round %d: the swarm went on to outer step %d; following it through %d updates", index, step,
                    len(chain))
        return chain, "", False

    def _others(self, index: int, parent_digest: str, since: Optional[float] = None) -> list:
        """The other members' records in round ``index``'s lineage: a fresh read merged with the roster
        (``_roster``), less the members whose record holds another theta at outer step index - 1. Their round
        continues another theta, so their results can be neither adopted nor united with ours (seen at 32 nodes:
        a union that named such a result sent all 9 members that chose it to re-sync); counting them would only
        make our lineage wait for them. Their lineage settles on its own, and the next round's start digests
        send the smaller one to re-sync. ``since``: a read made at or after it serves, however old
        (``ProgressTracker.exchanged_at``)."""
        now = time.monotonic()
        for m in self.progress.others(FRESH_S, since=since):
            self._roster[m.peer_id] = (m, now)
        keep_s = ROSTER_SHARE * self.wait_s
        self._roster = {p: (m, t) for p, (m, t) in self._roster.items() if now - t <= keep_s}
        return [m for m, _ in self._roster.values()
                if m.outer_step != index - 1 or m.global_params_digest in ("", parent_digest)]

    def _unite(self, index: int, groups: dict[str, int], weight: int, ours: list[torch.Tensor],
               parent_digest: str, group: set[str], deadline: float, outsized: bool = False) -> Resolution:
        """Propose the union of ``groups`` (digest -> weight) and ours (``weight``), settle on the proposal
        most members of the round made (``chosen_union``), fetch its results and unite them. Proposals
        are awaited, and fetches retried, until ``deadline``. Re-sync when a chosen result cannot be had.
        A fetched result's ``digest`` field is the result digest its server claims: only the content check
        (params_digest of the aggregate) is trusted. The union is outsized (``outsized``: ours) if a group was."""
        mine = params_digest(ours)
        if not set(groups) - {mine}:
            return Resolution(Standing.ALONE)
        proposal = tuple(sorted({*groups, mine}))
        self.progress.propose_union(index, list(proposal))
        chosen, everyone = self._settle_union(index, proposal, parent_digest, deadline)
        others = [m for m in everyone if m.peer_id not in group]
        weights = {**self._weights(index, everyone), mine: weight}
        got: dict[str, AppliedUpdate] = {}
        why = ""
        while True:
            missing = [d for d in chosen if d not in weights]
            if missing:
                return Resolution(Standing.UNION, None, reason=f"round {index}: the chosen union holds results "
                                                               f"nobody reported to us: {missing}")
            for digest in sorted(set(chosen) - set(got) - {mine}):
                if self.cancelled():
                    break
                sources = [m.peer_id for m in others if m.result_step == index and m.result_digest == digest
                           and not m.client_mode]
                if not sources:
                    why = f"no holder of {digest[:16]} accepts connections"
                    continue
                update, problem = self._fetch_checked(self.fetch_result, sources, index, parent_digest, digest)
                if update is None:
                    why = f"{digest[:16]}: {problem}"
                else:
                    got[digest] = update
            if set(got) >= set(chosen) - {mine}:
                break
            if time.monotonic() >= deadline or self.cancelled():
                return Resolution(Standing.UNION, None, reason=f"round {index}: the union of {len(chosen)} "
                                                               f"groups' results could not be fetched ({why})")
            time.sleep(POLL_S)
            others = [m for m in self._others(index, parent_digest) if m.peer_id not in group]
            weights = {**self._weights(index, others), **weights}
        results = {**{d: u.aggregate for d, u in got.items()}, mine: ours}
        try:
            united = unite([(weights[d], results[d]) for d in chosen])
        except UnionError as e:
            return Resolution(Standing.UNION, None, reason=f"round {index}: group results cannot be united: {e}")
        logger.info("round %d: no group holds a majority; uniting %d groups' results (weights %s%s)", index,
                    len(chosen), [weights[d] for d in chosen], "" if mine in chosen else "; ours came too late")
        outsized = any(got[d].outsized for d in chosen if d in got) or (outsized and mine in chosen)
        return Resolution(Standing.UNION, AppliedUpdate(index, parent_digest, "", sum(weights[d] for d in chosen),
                                                        united, outsized), groups=len(chosen))

    def _settle_union(self, index: int, proposal: tuple, parent_digest: str, deadline: float) -> tuple[tuple, list]:
        """Wait until every member (group-mates too) holding a result of round ``index`` that a union may
        hold has proposed one, or ``deadline``; then the chosen union (ours is ``proposal``) and the
        records read last."""
        while True:
            everyone = self._others(index, parent_digest)
            reported = {m.peer_id: m.result_digest for m in everyone if m.result_step == index and m.result_digest}
            valid = set(union_groups(reported, {m.peer_id: m.num_inputs for m in everyone}))
            proposals = {m.peer_id: tuple(m.union) for m in everyone if m.result_step == index and m.union}
            proposals[self.progress.peer_id] = proposal
            waiting = [p for p, d in reported.items() if d in valid and p not in proposals]
            if not waiting or time.monotonic() >= deadline or self.cancelled():
                return chosen_union(proposals), everyone
            time.sleep(POLL_S)

    @staticmethod
    def _weights(index: int, records) -> dict[str, int]:
        """Result digest of round ``index`` -> its weight: the contributions its holders' records list (the
        largest; the holder count where none lists any), as in dilocox.consensus.union_groups."""
        held: dict[str, list[int]] = {}
        for m in records:
            if m.result_step == index and m.result_digest:
                held.setdefault(m.result_digest, []).append(m.num_inputs)
        return {d: max(sizes) or len(sizes) for d, sizes in held.items()}

    def _fetch_applied(self, index: int, theta: str, parent_digest: str, others) -> tuple[Optional[AppliedUpdate],
                                                                                           str]:
        """The update that took the members at outer step ``index`` with theta digest ``theta`` there."""
        sources = [m.peer_id for m in others if m.outer_step == index and m.global_params_digest == theta
                   and not m.client_mode]
        if not sources:
            return None, "no member served it"
        return self._fetch_checked(self.fetch, sources, index, parent_digest, theta=theta)

    def _fetch(self, index: int, digest: str, parent_digest: str, others) -> tuple[Optional[AppliedUpdate], str]:
        """The majority's update from a member that applied it; (None, why) if none serves a valid one yet."""
        sources = [m.peer_id for m in others if m.result_step == index and m.result_digest == digest
                   and m.outer_step >= index and not m.client_mode]
        if not sources:
            return None, "no member of that group has applied it yet"
        return self._fetch_checked(self.fetch, sources, index, parent_digest, digest)

    @staticmethod
    def _fetch_checked(fetch: FetchUpdate, sources: list[str], index: int, parent_digest: str,
                       result_digest: str = "", theta: str = "") -> tuple[Optional[AppliedUpdate], str]:
        """Round ``index``'s update from one of ``sources`` (asked in random order: each serves the same bytes, so
        fetchers spread over them), checked to continue ``parent_digest`` and, where given, to hold
        ``result_digest`` (its content) or to lead to ``theta`` (as its server claims); (None, why) if not.
        At most ``FETCH_SOURCES`` of them are asked per call."""
        random.shuffle(sources)
        update = fetch(sources[:FETCH_SOURCES], index)
        if update is None or update.aggregate is None:
            return None, "no member served it"
        if update.parent_digest != parent_digest:
            return None, f"it continues theta {update.parent_digest}, ours is {parent_digest}"
        if result_digest and params_digest(update.aggregate) != result_digest:  # content-addressed
            return None, f"its aggregate does not match the result digest {result_digest[:16]}"
        if theta and update.digest != theta:
            return None, f"it leads to theta {update.digest}, not {theta}"
        return update, ""
