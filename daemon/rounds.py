"""OuterRounds: a round's exchange, its checks, and the outer step.

A round reads top to bottom: ``start`` (the compressor begins our contribution, dilocox/compressor.py) →
exchange (``_submit``: the transport injected at construction runs it on the communication thread,
peers/transport.py) → check (daemon/checks.py: start digests, result digests, equivocation, one update per round) →
apply (``_apply``: the outer step, then the local re-base). ``finish`` returns a ``Finished`` whose
``RoundOutcome`` the caller acts on: this class never re-syncs, records or checkpoints by itself (like torchft's
Manager, the node decides).

overlap = "none": round r's all-reduce finishes before round r+1 starts. overlap = "delayed"
(DiLoCoX): round r's all-reduce runs while round r+1 computes (``hold``). Whole-model nodes apply
its outer step as soon as it is in, between inner steps of round r+1 (``finish_early``), so a donor
serves theta_r to joiners during round r+1; the re-base of the local parameters waits for round
r+1's end (``finish``). Stage nodes apply at the round's end (a pause between inner steps would
hold up their replica's pipeline).

Consistency (docs/protocol.md): a round's mean is applied only if this node started the round from
the parameters most of its group started from (start digests in the all-gathered metadata) and its
result is bit-identical to a strict majority of the group's (result digests exchanged through the
membership records), which catches hivemind's partial results. The rules are dilocox/consensus.py.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Collection, Optional, Sequence, Union

import torch
from dilocox.daemon.audits import Audits
from dilocox.daemon.checks import FRESH_S, RoundChecks
from dilocox.daemon.config import NodeConfig
from dilocox.daemon.exclusions import Exclusions
from dilocox.daemon.majority import FetchResult, FetchUpdate, MajorityUpdate, OfferResult
from dilocox.daemon.outcomes import Checked, EarlyRound, Finished, PendingRound, RoundOutcome
from dilocox.daemon.progress import ProgressTracker
from dilocox.daemon.redteam import Attack
from dilocox.daemon.replica_state import ReplicaState
from dilocox.daemon.status import GONE_STATES, RoundInfo
from dilocox.peers.averaging import RoundCancelled, RoundGather, RoundResult
from dilocox.peers.contributions import ContributionServer
from dilocox.peers.deadlines import RoundDeadlines, RoundTimes
from dilocox.peers.transport import RoundInput, Transport

from dilocox.catchup import AppliedUpdate
from dilocox.consensus import (
    StartAction,
    left_behind,
    round_start_action,
)

logger = logging.getLogger(__name__)
# the give-up rule, polled every second while matchmaking, reuses a read this old: a quarter of a node's reads per
# round otherwise (Swarm.traffic at 8 nodes), and reacting up to 3 s later costs a round nothing it had.
# A read costs every member's record, so beyond ABANDON_READ_PEERS members the age grows with their number
# (abandon_read_age_s): the poll's bytes per node and second stay flat in N
ABANDON_READ_S = 3.0
ABANDON_READ_PEERS = 8
EXCHANGE_WINDOW = 3  # adaptive overlap: rounds whose exchange times predict the next one's (their maximum)


def abandon_read_age_s(num_others: int) -> float:
    """Seconds the give-up rule may reuse a read of the membership records, with ``num_others`` other members
    seen: ABANDON_READ_S up to ABANDON_READ_PEERS, then in proportion (12 s at 32). Each read costs every
    member's record from each DHT peer asked (peers/swarm.py), and at 32 nodes on 2 cores this poll made about
    20 reads per node and round of 70 s, most of the members key's traffic (bench.upload, docs/algorithms.md)."""
    return ABANDON_READ_S * max(1.0, num_others / ABANDON_READ_PEERS)


def leavers(progress: ProgressTracker) -> Callable[[Collection[str]], set[str]]:
    """For one round: a function naming those of the given members that left: their membership records say they
    are leaving or left (GONE_STATES), or have expired (no heartbeat for a record's lifetime, 3 x
    ``--announce-period``: the process crashed or lost the swarm), from a read as old as the give-up rule may
    reuse (``abandon_read_age_s`` of the members the last read held; ABANDON_READ_PEERS before any; expiry is
    checked at every call, peers/swarm.py ``Swarm.members``). A reduce-scatter's reducer stops waiting for their
    uploads; peers/reducescatter.py asks only once a wait has lasted LEAVER_GRACE_S, so a healthy round pays no
    read. Every member it is asked about was in a screened group (its record was live moments before)."""
    seen = ABANDON_READ_PEERS

    def gone(peers: Collection[str]) -> set[str]:
        nonlocal seen
        members = progress.members(abandon_read_age_s(seen))
        seen = max(len(members) - 1, 0)
        live = {m.peer_id: m.state for m in members}
        return {p for p in peers if p not in live or live[p] in GONE_STATES}
    return gone


class OuterRounds:
    """The rounds of one node. ``transport``: where a round's exchange runs (peers/transport.py; built once in the
    node's wiring for its compression, a fake in unit tests). Call from the training thread."""

    def __init__(self, cfg: NodeConfig, state: ReplicaState, progress: ProgressTracker, transport: Transport,
                 leave_requested: threading.Event, deadlines: RoundDeadlines, exclusions: Exclusions,
                 contributions: Optional[ContributionServer] = None,
                 attack: Optional[Attack] = None, fetch_update: Optional[FetchUpdate] = None,
                 audits: Optional[Audits] = None, fetch_result: Optional[FetchResult] = None,
                 offer_result: Optional[OfferResult] = None):
        """``deadlines``: the matchmaking time and group wait each round uses (peers/deadlines.py);
        ``exclusions``: who may contribute (equivocators found here are added to it; the transport's screen asks
        it); ``contributions``: serves and fetches all-gathered contributions (sparse and shared compression:
        their rounds match early, and their link measurement goes into our metadata);
        ``attack``: the red-team hook (daemon/redteam.py), None on an honest node; ``fetch_update``:
        fetches an update other members applied (sparse catch-up), so that a group outside a split
        round's majority adopts the majority's update (daemon/majority.py); None: every group applies its own.
        ``fetch_result`` / ``offer_result``: fetch another group's result of a round, serve ours, so that the
        groups of a split round without a majority apply the union of their results (None: each its own).
        ``audits``: commitments for the gathered metadata and the peers audits excluded (daemon/audits.py)."""
        self.cfg, self.state, self.progress, self.transport = cfg, state, progress, transport
        self.exclusions = exclusions
        self.deadlines = deadlines
        self.leave_requested, self.contributions, self.attack = leave_requested, contributions, attack
        self.audits = audits
        self.delayed = cfg.overlap != "none"  # overlapped: round r's exchange runs while round r + 1 computes
        self.merge_early = cfg.overlap == "adaptive" and cfg.num_stages == 1  # merge as soon as it is in
        # adaptive: the most inner steps of the next round an update may be late by (tau <= H/10 held the quality
        # rows, docs/algorithms.md); beyond it the node waits for the exchange
        self.max_delay_steps = cfg.max_delay_steps if cfg.max_delay_steps is not None else max(1, cfg.inner_steps // 10)
        self.comm = ThreadPoolExecutor(max_workers=1, thread_name_prefix="comm")  # exchanges run here
        self.verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify")  # adaptive: checks
        self.pending: Optional[PendingRound] = None  # delayed overlap: the all-reduce in flight
        self.early: Optional[EarlyRound] = None  # synchronous sparse round matched before its end
        self.times: dict[int, RoundTimes] = {}  # round index -> the deadlines its exchange was given
        self.exchange_s: Optional[float] = None  # the longest exchange of the last EXCHANGE_WINDOW rounds (seconds)
        self._exchanges: list[float] = []
        self._stopping = threading.Event()  # shutdown: a verifier wait for an exchange ends
        majority = None if fetch_update is None or cfg.num_stages > 1 else MajorityUpdate(
            progress, fetch_update, self.delayed, cfg.averaging_timeout,
            lambda: self._stopping.is_set() or leave_requested.is_set(), fetch_result, offer_result)
        self.checks = RoundChecks(cfg, state, progress, deadlines, exclusions, majority, leave_requested,
                                  self._stopping, self.delayed)

    def bytes_sent_total(self, rounds_sum: int) -> int:
        """Bytes this node sent in outer rounds since it started: the contribution server's count where rounds run
        over it (sparse and shared: every byte it served, relayed or pushed, in a round's window or not, plus the
        estimates of the rounds' hivemind phases), else ``rounds_sum`` (butterfly rounds: the sum of the recorded
        rounds' ``bytes_sent``, hivemind's estimates)."""
        return self.contributions.traffic()[0] if self.contributions is not None else rounds_sum

    def bytes_received_total(self, rounds_sum: int) -> int:
        """Bytes this node received in outer rounds since it started, as ``bytes_sent_total`` counts them."""
        return self.contributions.traffic()[1] if self.contributions is not None else rounds_sum

    def bandwidth_bps(self) -> float:
        """Our link rate for the rank cap (bit/s): configured, else the best all-reduce throughput seen
        (bytes sent / time in the all-reduce: a lower bound, as latency counts against it); 0: unknown."""
        return self.cfg.bandwidth_mbps * 1e6 if self.cfg.bandwidth_mbps else self.checks.measured_bps

    def _gather(self, weight: int, compute_s: float) -> RoundGather:
        """Our metadata for round ``state.round`` (peers/averaging.py: RoundGather)."""
        link = self.contributions.link.snapshot() if self.contributions is not None else None
        return RoundGather(outer_step=self.state.round - 1, start_digest=self.state.start_digest(),
                           weight=float(weight), bandwidth_bps=self.bandwidth_bps(), compute_s=compute_s,
                           client_mode=self.cfg.client_mode, link_bps=link.bps if link else 0.0,
                           link_latency_s=link.latency_s if link else 0.0, exclusion_votes=self.exclusions.votes(),
                           **(self.audits.gather_fields(self.state.round) if self.audits is not None else {}))

    # ------------------------------------------------------------------ starting
    def folds(self) -> bool:
        """Whether ``start`` takes no pseudo-gradient (None): synchronous sparse rounds fold it into the error
        feedback where it is computed (``ReplicaState.fold_contribution``), 8 bytes per parameter less at the
        round's peak; not with a red-team attack, which rewrites the pseudo-gradient."""
        return not self.delayed and self.attack is None and self.state.folds()

    def start(self, pseudo_gradient: Optional[list[torch.Tensor]], weight: int, compute_s: float,
              losses: list[float], read_since: Optional[float] = None) -> Union[PendingRound, Finished]:
        """Send round ``state.round``'s pseudo-gradient (``weight``: inner steps it covers; None where ``folds``:
        computed here) into the all-reduce, or make it a solo round; Finished(RESYNC) if others already applied
        the round, or if a folded pseudo-gradient is not finite.
        ``read_since``: a read of the membership records made at or after this ``time.monotonic()`` value serves
        the decision however old (the node's lineage check moments before: with 32 nodes on 2 cores the steps
        between took longer than FRESH_S, and the start read again, about once a round); else one FRESH_S old."""
        r, started = self.state.round, time.monotonic()
        action = round_start_action(self.progress.others(FRESH_S, since=read_since), r, self.delayed)
        early, self.early = self.early, None
        if action == StartAction.ALREADY_DONE:
            self._cancel(early)
            reason = f"round {r} was already completed by others"
            followed = self.checks.follow(r, reason)
            if followed.outcome == RoundOutcome.RESYNC:
                return Finished(r, RoundOutcome.RESYNC, reason=reason)
            p = PendingRound(r, pseudo_gradient, None, None, compute_s, losses, started, checked=Future(),
                             recompute=self.state.pseudo_gradient)
            p.checked.set_result(followed)  # finish() applies it as it applies any checked round
            return p
        if early is not None and early.index != r:
            self._cancel(early)
            early = None
        # a round already matched early is not made solo by a record that looks stale: its group may have
        # formed (going solo would leave the others a partial result); it gives up by itself if nobody came
        if action == StartAction.SOLO and early is None:
            self._cancel(early)
            # a folded round (pseudo_gradient None) is not encoded: a solo round applies theta - x, read then
            return PendingRound(r, pseudo_gradient, None, None, compute_s, losses, started,
                                recompute=self.state.pseudo_gradient)
        honest = pseudo_gradient
        if self.attack is not None:
            pseudo_gradient = self.attack.pseudo_gradient([g.clone() for g in pseudo_gradient], r)
        encode_began = time.monotonic()
        if pseudo_gradient is None:  # folded into the error feedback (``folds``)
            try:
                compression = self.state.fold_contribution()
            except ValueError as e:
                self._cancel(early)
                return Finished(r, RoundOutcome.RESYNC, reason=f"round {r}: {e}; not sent")
        else:
            compression = self.state.compressor.begin(pseudo_gradient, self.state.pseudo_gradient_bounds(r), r)
        encoded = dict(sent_at=time.monotonic(), encode_s=time.monotonic() - encode_began)
        if not self.delayed and self.attack is None:
            # synchronous: neither theta nor the parameters move until the round is applied, so theta - x is
            # recomputed bit for bit if a lone round needs it, instead of held through the exchange
            honest, encoded["recompute"] = None, self.state.pseudo_gradient
        del pseudo_gradient
        gather = self._gather(weight, compute_s)
        if early is not None and (early.index, early.weight) == (r, weight):
            early.ready.set_result(compression)  # the comm thread offers it and lets the all-reduce begin
            return PendingRound(r, honest, compression, early.future, compute_s, losses, early.started,
                                cancel=early.cancel, **encoded)
        self._cancel(early)
        p = PendingRound(r, honest, compression, None, compute_s, losses, started, **encoded)
        p.future = self._submit(compression, r, gather, p.cancel)
        return p

    def _submit(self, contribution, r: int, gather: RoundGather, cancel: threading.Event,
                ready_in_s: Optional[float] = None) -> Future:
        """Run round r's exchange on the comm thread with the deadlines in use now (a Future of its RoundResult).
        ``contribution``: the compressor's round, or a Future of it (early matchmaking, ready in ``ready_in_s``)."""
        self.times[r] = self.deadlines.current()
        return self.comm.submit(self.transport.exchange, RoundInput(
            r, contribution, gather, self.times[r], cancel, self._abandon(r), ready_in_s, leavers(self.progress)))

    def _abandon(self, r: int):
        """The exchange's give-up rule for round r (matchmaking, and downloads after their grace): the round left
        us behind (dilocox.consensus.left_behind). Each poll reuses a read of the membership records at most
        ``abandon_read_age_s`` old (ABANDON_READ_S, longer in a swarm of more than ABANDON_READ_PEERS); one that
        says the round left us behind is confirmed by a fresh read before the round is given up."""
        seen = ABANDON_READ_PEERS  # the number of other members the last poll read

        def check() -> bool:
            nonlocal seen
            others = self.progress.others(abandon_read_age_s(seen))
            seen = len(others)
            if not left_behind(others, r, self.delayed):
                return False
            # a give-up is decided from a fresh read only: a read from moments before (e.g. early matchmaking's)
            # can show a replica still SYNCING that has entered the round since, and "nobody is in it" gave two
            # 3-node CI swarms' first round up. Reading afresh at every round's first poll instead cost a read a
            # node-round in healthy rounds (bench.upload at 16 nodes)
            others = self.progress.others(0.0)
            seen = len(others)
            return left_behind(others, r, self.delayed)
        return check

    # ------------------------------------------------------------------ early matchmaking
    def early_window_s(self) -> float:
        """Seconds before a round's inner steps end at which its early matchmaking begins: the matchmaking
        time in use (measured, or --matchmaking-time) and one request."""
        return self.deadlines.current().matchmaking_s + self.cfg.request_timeout

    def early_wanted(self) -> bool:
        """Sparse rounds form their group while their last inner steps compute (``begin_early``): the all-gather
        needs nothing of the butterfly's per-phase data, so only the payload is late. Overlapped rounds do so
        only once the previous round's update is applied: the gathered start digest, taken now, must be that of
        theta_{r-1}, the outer step it names. (An exchange that is over is not enough: its update merges later.
        Under load two of three members gathered theta_{r-2} as step r-1, the third theta_{r-1}, and all three
        re-synced.)"""
        if self.contributions is None or self.early is not None:
            return False
        if self.state.outer_step != self.state.round - 1:
            return False
        p = self.pending
        return p is None or p.future is None or p.future.done()

    def begin_early(self, weight: int, compute_s: float, eta_s: float) -> bool:
        """Start matchmaking for round ``state.round`` now, its all-reduce to begin in about ``eta_s`` seconds,
        when the round's inner steps end (``start`` then hands over the contribution). ``weight``: inner
        steps this round will have computed. False (nothing started) if the round would be solo or was
        already completed by others: ``start`` decides at the round's end as usual."""
        r = self.state.round
        if not self.early_wanted():
            return False
        if round_start_action(self.progress.others(FRESH_S), r, self.delayed) != StartAction.ALLREDUCE:
            return False
        gather = self._gather(weight, compute_s)
        ready, cancel = Future(), threading.Event()
        future = self._submit(ready, r, gather, cancel, ready_in_s=eta_s)
        self.early = EarlyRound(r, weight, ready, future, cancel, time.monotonic())
        logger.debug("round %d: matchmaking began %.1fs before the end of its inner steps", r, eta_s)
        return True

    def cancel_early(self) -> None:
        """The round is abandoned (leave, a broken pipeline, a re-sync): stop its early matchmaking."""
        early, self.early = self.early, None
        self._cancel(early)

    @staticmethod
    def _cancel(early: Optional[EarlyRound]) -> None:
        if early is not None:
            early.cancel.set()
            early.ready.cancel()

    def hold(self, p: PendingRound) -> None:
        """Overlapped rounds: keep round p's exchange in flight and begin round p.index + 1, from a lookahead
        by our own share of round p (``--overlap-proxy local``: our contribution as the group decodes it, or
        the pseudo-gradient itself for codes that are only known after the all-reduce) where one is set."""
        self.pending = p
        self.state.round = p.index + 1
        if p.future is not None and self.merge_early:  # checked while the next round computes
            p.checked = self.verifier.submit(self.checks.check, p)
        if p.future is not None and self.cfg.overlap_proxy != "none":
            ahead = p.compression.lookahead()  # None: our contribution is known only after the exchange
            self.state.start_from_proxy(ahead if ahead is not None else p.pseudo_gradient)
        self.state.begin_round()

    def overlap_budget_s(self, round_compute_s: float, wait_fraction: float) -> float:
        """Adaptive overlap: how long the round's end waits for its exchange, from the recent exchanges' length E
        (the longest of the last EXCHANGE_WINDOW, seconds from the end of the inner steps to the result):
        - nothing measured yet: ``wait_fraction`` of the round's compute;
        - E within that fraction: the fraction (the exchange should land in it, for a synchronous round at a
          utilization cost of at most the fraction);
        - E longer than the fraction but shorter than the round's compute: 0, no wait that would only be lost
          (the exchange overlaps the next round, whose delay ``max_delay_steps`` bounds);
        - E at least a whole round's compute: all of it (inf): overlap could not hide it and would still cost a
          round of delay in quality (docs/algorithms.md, "Overlapped rounds")."""
        budget = wait_fraction * round_compute_s
        if self.exchange_s is None:
            return budget
        if self.exchange_s >= round_compute_s:
            return float("inf")
        return budget if self.exchange_s <= budget else 0.0

    def wait_briefly(self, budget_s: float) -> bool:
        """Adaptive overlap, between a round's end and the next round's first inner step: wait up to ``budget_s``
        for the held round's exchange; if it lands in time, apply and merge it now (the next round then starts
        from theta: a synchronous round). True if it did. The time waited counts in the round's ``wait_s``."""
        p = self.pending
        if p is None or not self.merge_early or budget_s <= 0:
            return False
        if not self._wait_landed(p, budget_s):
            return False
        return self.finish_early(0)

    def _wait_landed(self, p: PendingRound, budget_s: float) -> bool:
        """Wait up to ``budget_s`` for round p's exchange (and its check) to be done, adding the time to
        ``p.waited_s``; False if a leave request ended the wait."""
        began, deadline = time.monotonic(), time.monotonic() + budget_s
        waiting = p.checked or p.future
        try:
            while waiting is not None and not waiting.done() and time.monotonic() < deadline:
                if self.leave_requested.is_set():
                    return False
                time.sleep(0.005)
            return True
        finally:
            p.waited_s += time.monotonic() - began

    def take_pending(self) -> Optional[PendingRound]:
        p, self.pending = self.pending, None
        return p

    def drop_pending(self) -> None:
        """Forget the round in flight (a downloaded state holds or supersedes its result)."""
        p = self.take_pending()
        if p is not None:
            p.cancel.set()

    # ------------------------------------------------------------------ finishing
    def finish_early(self, inner_step: int) -> bool:
        """Overlapped rounds, between inner steps: once the pending round's exchange is in (or it was solo),
        check it and update theta now rather than at the round's end; ``adaptive`` also merges it into the
        local parameters now (dilocox/overlap.py), ``inner_step`` steps into the round, and waits for an exchange
        still out once ``inner_step`` reaches ``max_delay_steps`` (the delay's cap: beyond it the quality rows
        do not hold). Tried once per round; a round that needs a re-sync is left to the round's end. True if
        theta was updated."""
        p = self.pending
        if p is not None and self.merge_early and not p.early_tried and inner_step >= self.max_delay_steps:
            if not self._wait_landed(p, float("inf")):
                return False
        if p is None or p.early_tried or (p.future is not None and (
                not p.future.done() or isinstance(p.future.exception(), RoundCancelled))) or (
                p.checked is not None and not p.checked.done()):
            return False
        p.early_tried = True
        self.finish(p, early=True)
        if p.early is not None and self.merge_early:
            self.state.merge_local()
            p.merged_at = inner_step
        return p.early is not None

    def finish(self, p: PendingRound, early: bool = False) -> Finished:
        """Wait for round p.index, check it, apply it (theta, then the local re-base unless ``early``).

        early: update theta and outer_step only, or nothing if the round needs a re-sync or failed
        while someone else applied it (DEFERRED either way); a later call re-bases and reports."""
        if p.early is not None:
            return self._finish_locally(p, p.early)
        waited_from = time.monotonic()
        checked = self._exchanged(p)  # the exchange's result, checked against the group
        if checked.outcome in (RoundOutcome.CANCELLED, RoundOutcome.RESYNC):
            self.state.abandon(p.compression)  # not applied here (a re-sync may reset the error feedback anyway)
        if checked.outcome == RoundOutcome.CANCELLED:
            return Finished(p.index, RoundOutcome.CANCELLED)
        if checked.outcome == RoundOutcome.RESYNC:
            finished = self._resync(p, early, checked.reason)
            if checked.fetches_result:  # the re-sync may bring this very round's result: record it then
                finished.info = self._info(p, checked.group_size, RoundOutcome.RESYNCED, checked.result, waited_from)
            finished.result = checked.result
            return finished
        return self._apply(p, checked, early, waited_from)

    def _exchanged(self, p: PendingRound) -> Checked:
        """Round p's exchange, waited for (a leave request cancels it) and checked (``RoundChecks.check``; already
        checked on the verifier thread under adaptive overlap); SOLO for a round nobody else could take part in."""
        if p.future is None and p.checked is None:
            return Checked(RoundOutcome.SOLO)
        waiting = p.checked if p.checked is not None else p.future
        while not waiting.done():  # poll so a leave request cancels the exchange
            if self.leave_requested.is_set():
                p.cancel.set()
            time.sleep(0.02)
        return p.checked.result() if p.checked is not None else self.checks.check(p)

    def _apply(self, p: PendingRound, checked: Checked, early: bool, waited_from: float) -> Finished:
        """Apply a checked round: the outer step with the group's mean (APPLIED), the adopted or united update
        (ADOPTED, UNITED, then any chain the swarm went further by), our own pseudo-gradient (SOLO, APPLIED_ALONE)
        or none (SKIPPED: the round is consumed); then the local re-base unless ``early``."""
        outcome, result, group_size = checked.outcome, checked.result, checked.group_size
        adopted = checked.adopted.aggregate if checked.adopted else None
        swarms = {RoundOutcome.APPLIED: result.tensors if result else None, RoundOutcome.SKIPPED: None,
                  RoundOutcome.ADOPTED: adopted, RoundOutcome.UNITED: adopted}
        averaged = swarms[outcome] if outcome in swarms else p.ours()  # solo, alone: our own
        # averaged None (skipped): only the local re-base follows; a donor serves the new shared compression
        # state only together with the outer step it belongs to
        apply_began = time.monotonic()
        with self.state.changing():
            if outcome in (RoundOutcome.APPLIED, RoundOutcome.ADOPTED, RoundOutcome.UNITED) and result is not None:
                self.state.compressor.commit(p.compression)  # ours went out (not when the round went on without us)
            else:
                self.state.abandon(p.compression)  # before theta moves: a folded contribution is undone from it
            # SCAFFOLD's quiet restart counts from a round with an outsized contribution: the group's, or the update's
            outsized = checked.adopted.outsized if checked.adopted is not None else \
                outcome == RoundOutcome.APPLIED and result is not None and self.state.outsized(result.scales)
            self.state.apply_outer(averaged, p.index, group_size, outsized)
        if outcome == RoundOutcome.ADOPTED and self.state.digest != checked.adopted.digest:
            # same theta, aggregate and outer rule (shared settings) give the same bits; if not, the next round's
            # start digests send us to re-sync
            logger.error("round %d: the adopted update gave theta %s, its group's is %s", p.index, self.state.digest,
                         checked.adopted.digest)
        elif checked.chain:
            self._apply_chain(p.index, checked.chain)
        if result is not None:
            result.release()  # applied: the dense aggregate is not held through the round's record and checkpoint
        info = self._info(p, group_size, outcome, result, waited_from)
        info.apply_s, info.outsized = time.monotonic() - apply_began, outsized
        if checked.chain:  # the row names the theta we hold: the chain's last outer step
            info.outer_step = self.state.outer_step
        if early:
            p.early = info
            return Finished(p.index, RoundOutcome.DEFERRED, info)
        finished = self._finish_locally(p, info)
        finished.result, finished.behind = result, checked.behind
        return finished

    def _resync(self, p: PendingRound, early: bool, reason: str) -> Finished:
        return Finished(p.index, RoundOutcome.DEFERRED if early else RoundOutcome.RESYNC, losses=p.losses,
                        reason=reason)

    def _apply_chain(self, index: int, chain: Sequence[AppliedUpdate]) -> None:
        """Round ``index`` went on without us and the swarm went further: apply the updates of the outer steps
        after it (``MajorityUpdate.follow``), in order, each checked to give the theta its servers hold; a
        mismatch stops there (the next round's start digests send us to re-sync)."""
        for update in chain:
            with self.state.changing():
                self.state.apply_outer(update.aggregate, update.outer_step, update.group_size, update.outsized)
            if self.state.digest != update.digest:
                logger.error("outer step %d: the followed update gave theta %s, the swarm's is %s", update.outer_step,
                             self.state.digest, update.digest)
                return
        logger.info("round %d: followed the swarm to outer step %d (%d more updates applied)", index,
                    self.state.outer_step, len(chain))

    def _finish_locally(self, p: PendingRound, info: RoundInfo) -> Finished:
        """Re-base the local parameters on theta (already updated; a no-op where ``finish_early`` merged it)
        and report the round. ``overlap_steps``: inner steps of the next round computed before the merge.
        The next round follows ``info.outer_step`` (p.index; after a followed chain, its last outer step)."""
        if self.delayed:
            info.overlap_steps = self.cfg.inner_steps if p.merged_at is None else p.merged_at
        self.state.rebase_and_begin()
        if not self.delayed:
            self.state.round = info.outer_step + 1
        return Finished(p.index, RoundOutcome(info.outcome), info, p.losses)

    def finish_on_leave(self) -> Optional[Finished]:
        """Leaving with an all-reduce in flight (delayed): let it finish (bounded by averaging_timeout) so
        the group is not left with a partial average, and apply it so the checkpoint holds it."""
        p = self.take_pending()
        if p is None:
            return None
        if p.future is not None and not p.future.done():
            try:
                p.future.result(timeout=self.cfg.averaging_timeout)
            except Exception:
                p.cancel.set()
                return Finished(p.index, RoundOutcome.CANCELLED)
        return self.finish(p)

    def shutdown(self) -> None:
        self.cancel_early()
        self.drop_pending()
        self._stopping.set()
        self.comm.shutdown(wait=False, cancel_futures=True)
        self.verifier.shutdown(wait=False, cancel_futures=True)

    def _info(self, p: PendingRound, group_size: int, outcome: RoundOutcome, result: Optional[RoundResult],
              waited_from: float) -> RoundInfo:
        now = time.monotonic()
        info = RoundInfo(outer_step=p.index, group_size=group_size, duration_s=now - p.started,
                         compute_s=p.compute_s, outcome=outcome.value, wait_s=now - waited_from + p.waited_s)
        times = self.times.get(p.index)
        self.times = {r: t for r, t in self.times.items() if r > p.index}
        if times is not None:
            info.matchmaking_s, info.group_wait_s = times.matchmaking_s, times.group_wait_s
        if result is not None:
            stats = p.compression.stats
            # the round's bytes by its keys, whenever sent: a slower group-mate may fetch our payload after our
            # exchange returned
            info.payload_bytes, info.bytes_sent = result.payload_bytes, result.bytes_sent + result.sent_since()
            info.bytes_received = result.bytes_received
            # what the compression made of our pseudo-gradient, not of the traffic (which depends on who fetched)
            info.compression_ratio = result.fp32_bytes / result.payload_bytes if result.payload_bytes else 0.0
            info.rank, info.bits, info.compression_error = stats.rank, stats.bits, stats.relative_error
            info.allreduce_s = result.allreduce_s
            info.dropped = sorted(result.dropped)
            info.download_deadline_s, info.link_mbps = result.download_deadline_s, result.link_bps / 1e6
            info.encode_s = p.encode_s
            info.exchange_s = max(0.0, result.finished_at - p.sent_at) if p.sent_at else 0.0
            info.group_s = result.phases.get("matchmaking", result.phases.get("allreduce", 0.0))
            info.gather_s, info.aggregate_s = result.phases.get("gather", 0.0), result.phases.get("aggregate", 0.0)
            self.observe_exchange(info.exchange_s)
        return info

    def observe_exchange(self, exchange_s: float) -> None:
        """Record a finished exchange's length (end of the inner steps to a complete result, seconds); ``exchange_s``
        becomes the longest of the last EXCHANGE_WINDOW (``overlap_budget_s`` reads it)."""
        self._exchanges = (self._exchanges + [exchange_s])[-EXCHANGE_WINDOW:]
        self.exchange_s = max(self._exchanges)
