"""RoundChecks: a round's finished exchange checked against its group, before anything is applied.

A round's mean is applied only if this node started the round from the parameters most of its group started
from (start digests in the all-gathered metadata) and its result is bit-identical to a strict majority of the
group's (result digests exchanged through the membership records), which catches hivemind's partial results;
a contributor that served different bytes to different members is excluded (daemon/exclusions.py); where
matchmaking split the round, one update is applied by every group (daemon/majority.py). The verdict rules are
dilocox/consensus.py; this class gathers their inputs and returns a ``Checked`` the caller applies. It changes
nothing of the replica's state, so adaptive overlap runs ``check`` on a thread of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Optional

from dilocox.daemon.config import NodeConfig
from dilocox.daemon.exclusions import Exclusions
from dilocox.daemon.majority import MajorityUpdate
from dilocox.daemon.outcomes import Checked, PendingRound, RoundOutcome
from dilocox.daemon.progress import ProgressTracker
from dilocox.daemon.replica_state import ReplicaState
from dilocox.peers.averaging import RoundCancelled, RoundFailed, RoundResult, group_limits
from dilocox.peers.deadlines import RoundDeadlines

from dilocox.consensus import (
    Standing,
    Verdict,
    canonical_digest,
    failure_action,
    judge_result,
    undecided,
)
from dilocox.diloco import params_digest

logger = logging.getLogger(__name__)
FRESH_S = 0.2  # once-a-round decisions read the membership records (nearly) afresh: stale ones split rounds


class RoundChecks:
    """The checks of one node's rounds. ``majority``: settles split rounds (None: each group applies its own, as
    pipeline stages do); ``stopping``: set at shutdown (a wait for an exchange ends); ``delayed``: overlapped
    rounds (a round that went on without us re-syncs rather than following the swarm's updates).
    ``measured_bps``: the best all-reduce throughput seen (bytes sent / time in the all-reduce, bit/s)."""

    def __init__(self, cfg: NodeConfig, state: ReplicaState, progress: ProgressTracker, deadlines: RoundDeadlines,
                 exclusions: Exclusions, majority: Optional[MajorityUpdate], leave_requested: threading.Event,
                 stopping: threading.Event, delayed: bool):
        self.cfg, self.state, self.progress, self.deadlines = cfg, state, progress, deadlines
        self.exclusions, self.majority, self.leave_requested, self.stopping = exclusions, majority, \
            leave_requested, stopping
        self.delayed = delayed
        self.measured_bps = 0.0

    def check(self, p: PendingRound) -> Checked:
        """Wait for round p's exchange and check it against the group: start digests, the group's result digests
        (through the membership records, up to request_timeout), equivocation; the verdict rules are
        dilocox/consensus.py. Changes nothing of the replica's state, so adaptive overlap runs it on the
        verifier thread while the next round computes (OuterRounds.hold); the training thread applies what it found."""
        try:
            result = self._await_exchange(p)
        except (RoundCancelled, CancelledError):
            return Checked(RoundOutcome.CANCELLED)
        except RoundFailed as e:
            if failure_action(self.progress.others(FRESH_S), p.index) == Verdict.RESYNC:
                return self.follow(p.index, f"round {p.index} went on without us ({e})")
            logger.warning("round %d: %s; applying our own pseudo-gradient", p.index, e)
            return Checked(RoundOutcome.APPLIED_ALONE)
        self.exclusions.group_decided(p.index, result.excluded)  # the same on every member of the group
        self.deadlines.observe_group(p.compute_s, [g.compute_s for g in result.gathered.values() if g])
        starts = {q: g.start_digest for q, g in result.gathered.items()
                  if g is not None and g.outer_step == p.index - 1}
        canon, _ = canonical_digest(starts)
        if canon != self.state.start_digest():
            return Checked(RoundOutcome.RESYNC, reason=f"round {p.index}: we started from "
                                                       f"{self.state.start_digest()}, the group from {canon}")
        # every member that started from the same parameters contributed to this average
        group_size = sum(d == canon and q not in result.dropped for q, d in starts.items())
        result_digest = params_digest(result.tensors)
        results = self.progress.exchange_result_digests(p.index, result_digest, set(starts),
                                                        self.cfg.request_timeout, result.inputs)
        verdict = judge_result(result_digest, results, members=len(starts))
        if verdict == Verdict.SKIP and set(results) < set(starts):
            results = self._await_reports(p, set(starts))
            if set(results) < set(starts) and self._dropped(p):  # leaving: nothing consumed, the checkpoint keeps r-1
                return Checked(RoundOutcome.CANCELLED)
            verdict = judge_result(result_digest, results, members=len(starts))
        self._exclude_equivocators(p.index, {**result.claimed, **result.inputs})
        # the exchange's last read serves (progress.exchanged_at), however long the steps since took
        unreported = [m for m in self.progress.others(FRESH_S, since=self.progress.exchanged_at(p.index))
                      if m.peer_id not in results]
        if verdict == Verdict.SKIP and failure_action(unreported, p.index) == Verdict.RESYNC:
            # our group fell apart (e.g. two late members matched each other, and one left for a re-sync), or
            # a group-mate consumed the round without a report we saw, while others applied it: skipping would
            # diverge from them
            return Checked(RoundOutcome.RESYNC, result, group_size, fetches_result=True,
                           reason=f"round {p.index}: no majority among our group's results "
                                  f"{sorted(set(results.values()))}, and other replicas applied it")
        if verdict == Verdict.SKIP:
            # e.g. two replicas, one with a partial average: nobody can tell which is right, so every member
            # consumes the round without an update (theta_r = theta_{r-1}) and all stay aligned
            logger.warning("round %d: no majority among all-reduce results %s; skipped by the whole group",
                           p.index, sorted(set(results.values())))
            return Checked(RoundOutcome.SKIPPED, result, group_size)
        if verdict == Verdict.RESYNC:
            canon, _ = canonical_digest(results)
            # hivemind can return part of the average ("received 79% results") and still succeed
            return Checked(RoundOutcome.RESYNC, result, group_size, fetches_result=True,
                           reason=f"round {p.index}: all-reduce result {result_digest} differs from the group's "
                                  f"{canon} (partial result?); not applied")
        if self.majority is not None:  # one update per round, even where matchmaking split it
            _, holders = canonical_digest(results)
            settled = self.majority.resolve(p.index, set(starts), len(holders), self.state.digest, result.tensors,
                                            len(result.inputs), self.state.outsized(result.scales), result_digest)
            if settled.standing in (Standing.ADOPT, Standing.UNION) and settled.update is None:
                if self.leave_requested.is_set():  # leaving: nothing to re-sync for; the checkpoint keeps r - 1
                    return Checked(RoundOutcome.CANCELLED)
                return Checked(RoundOutcome.RESYNC, result, group_size, fetches_result=True, reason=settled.reason)
            if settled.update is not None:
                outcome = RoundOutcome.UNITED if settled.standing == Standing.UNION else RoundOutcome.ADOPTED
                return Checked(outcome, result, settled.update.group_size, adopted=settled.update)
        if result.allreduce_s > 0:
            self.measured_bps = max(self.measured_bps, 8 * result.bytes_sent / result.allreduce_s)
        # from all-gathered figures only, so every member picks the same rank (and averager)
        p.compression.decide_rank(*group_limits(result.gathered), group_size)
        return Checked(RoundOutcome.APPLIED, result, group_size)

    def follow(self, index: int, reason: str) -> Checked:
        """Round ``index`` went on without us (``reason``): ADOPTED (``behind``) with the update a strict majority
        of the live replicas applied, fetched and checked (MajorityUpdate.follow), so the round counts as joint and
        no state download is needed; else RESYNC. Overlapped rounds re-sync as before: their next round is
        already computed from theta_{index - 1}."""
        chain = None if self.majority is None or self.delayed else self.majority.follow(index, self.state.digest)
        if not chain:
            return Checked(RoundOutcome.RESYNC, reason=reason)
        logger.info("%s: applying the update%s most of the swarm applied (theta %s)", reason,
                    f"s of outer steps {index}..{chain[-1].outer_step}" if len(chain) > 1 else "", chain[-1].digest)
        return Checked(RoundOutcome.ADOPTED, None, chain[0].group_size, adopted=chain[0], behind=True,
                       chain=tuple(chain[1:]))

    def _await_reports(self, p: PendingRound, group: set[str]) -> dict[str, str]:
        """Result reports of round p's group when some were missing at first (missing, not different: a loaded
        member publishes late): wait up to averaging_timeout, then on while a member without a report may still
        apply the round (``consensus.undecided``), up to outer_round_deadline. Skipping while a group-mate
        applies forks theta: seen in CI with two pipeline-stage members, one reporting 27 s after the all-reduce.
        Our own report is published already (``exchange_result_digests``); this only reads, in request_timeout
        slices, so a leave or a dropped round ends the wait within one (a leave that
        waited out averaging_timeout missed a 60 s drain at 32 nodes). Returns peer_id -> digest of those that
        reported (ours included)."""
        began = time.monotonic()
        patient_until, deadline = began + self.cfg.averaging_timeout, began + self.cfg.outer_round_deadline
        logged = False
        while True:
            slice_s = max(0.0, min(self.cfg.request_timeout, deadline - time.monotonic()))
            results = self.progress.collect_result_digests(p.index, group, slice_s)
            missing, now = group - set(results), time.monotonic()
            if not missing or now >= deadline or self._dropped(p):
                return results
            if now < patient_until:
                continue
            waiting_for = undecided(self.progress.others(FRESH_S), missing, p.index)
            if not waiting_for:
                return results
            if not logged:
                logger.info("round %d: no result report yet from %s, who may still apply it; waiting", p.index,
                            ", ".join(q[-8:] for q in waiting_for))
                logged = True

    def _dropped(self, p: PendingRound) -> bool:
        """Round p no longer matters to us: dropped (a re-sync), or we stop or leave."""
        return p.cancel.is_set() or self.stopping.is_set() or self.leave_requested.is_set()

    def _await_exchange(self, p: PendingRound) -> RoundResult:
        """Round p's exchange result, waited for in slices so a dropped round (``p.cancel``: a re-sync or leave)
        or ``shutdown`` frees the verifier thread; the interpreter joins pool threads at exit, so a wait with no
        end would keep a stopping process alive. Raises RoundCancelled once p is dropped or we stop."""
        while True:
            try:
                return p.future.result(timeout=0.5)
            except FutureTimeout:
                if p.cancel.is_set() or self.stopping.is_set():
                    raise RoundCancelled(f"round {p.index} was dropped") from None

    def _exclude_equivocators(self, r: int, inputs: dict) -> None:
        """A contributor another member used with other bytes than we did served different bytes to
        different peers: it is excluded for a while (daemon/exclusions.py; the group's results
        differed, so the round itself is skipped or re-synced by the verdict rules). ``inputs`` also holds what
        a member committed to us where we did not use it (``RoundResult.claimed``): one that committed to one
        payload and served another, as a rushing member must, is caught the same way."""
        if inputs:
            self.exclusions.equivocated(r, self.progress.input_conflicts(r, inputs, self.cfg.request_timeout))

