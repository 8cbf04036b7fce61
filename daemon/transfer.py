"""StateTransfer: serving this node's state to joiners, and fetching the swarm's state.

A donor serves theta, outer momentum and the shared compression state through hivemind's
``load_state_from_peers`` (peers/averaging.py): a consistent snapshot of one outer step, taken when
it was applied, served at any phase of the donor's round. A joiner whose download took longer than
the swarm's rounds catches up by replaying the updates applied since (dilocox/catchup.py), fetched
from members that keep the last ``catch_up_steps`` of them, instead of downloading again. Everything
that arrives is validated here before the node adopts it (it comes from another machine), and the
state it adopts must be one a member's record holds. ``sync`` returns a ``JoinPoint``
(dilocox/consensus.py) and the validated state; the node adopts them, this class changes nothing
of the replica's state itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import pydantic.v1 as pydantic
import torch
from dilocox.daemon.config import NodeConfig
from dilocox.daemon.progress import ProgressTracker
from dilocox.daemon.replica_state import ReplicaState
from dilocox.peers.averaging import PseudoGradientAverager
from dilocox.peers.contributions import ContributionServer
from dilocox.peers.deadlines import LinkEstimate

from dilocox.catchup import AppliedUpdate, CatchUpError, decode, max_encoded_bytes
from dilocox.consensus import (
    ACTIVE_STATES,
    JOINING,
    SYNCING,
    DonorMeta,
    JoinKind,
    JoinPoint,
    WaitFor,
    current_join,
    join_point,
    late_steps,
    no_donor_join,
    prevailing_theta,
    wait_over,
    wait_satisfied,
)
from dilocox.diloco import check_shapes, params_digest
from dilocox.scaffold import control_digest

logger = logging.getLogger(__name__)


class SyncError(RuntimeError):
    """No peer served a usable state before the deadline."""


class StateMeta(pydantic.BaseModel):
    """Metadata a donor sends with its state (validated: it comes from another machine)."""

    run_id: pydantic.StrictStr
    outer_step: pydantic.conint(ge=0)
    digest: pydantic.StrictStr
    num_params: pydantic.conint(ge=1)
    donor_state: pydantic.StrictStr
    donor_inner_step: pydantic.conint(ge=0)
    donor_round: pydantic.conint(ge=0)
    compression_rank: pydantic.conint(ge=0) = 0
    compression_digest: pydantic.StrictStr = ""
    donor_peer_id: pydantic.StrictStr = ""
    control_digest: pydantic.StrictStr = ""  # SCAFFOLD's c (empty for DiLoCo)
    control_last_outsized: Optional[pydantic.conint(ge=0, strict=True)] = None  # its pending quiet restart


@dataclass
class DownloadedState:
    """A validated state: theta and momentum (fp32, our shapes), the shared compression state."""

    meta: StateMeta
    theta: list[torch.Tensor]
    momentum: list[torch.Tensor]
    compression_shared: list[torch.Tensor]
    control: Optional[list[torch.Tensor]] = None  # SCAFFOLD's c


class StateTransfer:
    """Donor and joiner sides of state transfer for one node.

    ``donor_progress()`` -> (state name, inner step) of this node, put in the served metadata."""

    def __init__(self, cfg: NodeConfig, state: ReplicaState, progress: ProgressTracker,
                 donor_progress: Callable[[], tuple[str, int]], cancelled: Callable[[], bool],
                 samples_per_step: int = 0):
        self.cfg, self.state, self.progress = cfg, state, progress
        self.samples_per_step = samples_per_step  # tokens (or images) per inner step: a donor's step time
        self._donor_progress, self._cancelled = donor_progress, cancelled
        self.averager: Optional[PseudoGradientAverager] = None  # set by attach()
        self.updates: Optional[ContributionServer] = None  # set by attach(): applied updates, for catch-up
        self.results: Optional[ContributionServer] = None  # set by attach(): group results of split rounds
        self.ahead = False  # set by attach(): joins may compute the next round ahead of its start
        self.link: Optional[LinkEstimate] = None  # set by attach(): our download link, seeded by a state download
        self.caught_up = 0  # outer steps replayed by catch-up since start
        self._waited_for_result, self._late_waits = False, 0
        self._busy_until = 0.0  # monotonic time until which we serve no other joiner ...
        self._served_before = 0  # ... unless the averager's count of whole streams grows past this
        self.attempts = 0  # state downloads and waits of the current sync
        self.on_attempt: Callable[[str, int], None] = lambda reason, attempts: None  # e.g. status

    def attach(self, averager: PseudoGradientAverager, updates: Optional[ContributionServer] = None,
               results: Optional[ContributionServer] = None, ahead: bool = False,
               link: Optional[LinkEstimate] = None) -> None:
        """The averager that serves (``serve``) and downloads our stage's state, the server of applied
        updates (sparse rounds; None: no catch-up, a joiner that missed steps downloads again) and that of
        split rounds' group results (daemon/majority.py; None: no union). ``ahead``: the node merges one
        missed update mid-round (daemon/join_ahead.py), so joins may compute the next round at once.
        ``link``: the estimate our rounds' download deadlines come from; a state download seeds it
        (``LinkEstimate.seed``) while no round has measured it."""
        self.averager, self.updates, self.results, self.ahead = averager, updates, results, ahead
        self.link = link
        self.published()

    def published(self) -> None:
        """The replica state took a new snapshot: donors with a higher outer step are preferred."""
        if self.averager is not None:
            self.averager.set_priority(float(self.state.outer_step))

    def offer_state(self, allowed: bool) -> None:
        """Serve our state to joiners or not (a node others report they cannot dial withdraws)."""
        if self.averager is not None:
            self.averager.share_state(allowed)

    def in_phase(self) -> Optional[JoinPoint]:
        """Where the live replicas that hold our theta are now (dilocox.consensus.current_join: their most
        advanced round, at their inner step): a member that followed a round's update without a download
        rejoins there, as a re-sync would, so it reaches the next round's matchmaking with them. None: nobody
        holds our theta."""
        active = [m for m in self.progress.others() if m.state in ACTIVE_STATES]
        return current_join(active, self.state.outer_step, self.state.digest, self.state.H)

    # ------------------------------------------------------------------ donor
    def serve(self):
        """hivemind's state provider (runs on the averager's thread in this process): (meta, tensors).

        A donor serves one joiner at a time: until the averager has streamed the state to its end
        (``PseudoGradientAverager.states_served``), or at most for a transfer window (request_timeout + the
        state's bytes at ``bandwidth_mbps``, or at 100 Mbit/s when that is not configured) when the joiner
        breaks off. A joiner that asks meanwhile gets no state and hivemind moves it on to the next donor, so
        joiners arriving together spread over the donors (hivemind breaks priority ties at random, and skips
        a donor that fails mid-download), and a donor that is the only one serves them back to back. Not the
        all-reduce's measured rate: that is a lower bound (it counts waiting for the slowest member), and with
        a 4 s all-reduce of 18 KB it shut joiners out for a minute."""
        now = time.monotonic()
        served = self.averager.states_served() if self.averager is not None else 0
        if now < self._busy_until and served <= self._served_before:
            logger.info("state requested while serving another joiner: redirecting it to other donors")
            return None, []
        meta, tensors = self.state.served()  # after the busy check: a redirected joiner costs no copy of theta
        size = sum(t.numel() * t.element_size() for t in tensors)
        self._busy_until = now + self.cfg.request_timeout + 8 * size / ((self.cfg.bandwidth_mbps or 100) * 1e6)
        self._served_before = served
        state_name, inner_step = self._donor_progress()
        return dict(meta, donor_state=state_name, donor_inner_step=inner_step, donor_round=self.state.round,
                    donor_peer_id=self.progress.peer_id), tensors

    # ------------------------------------------------------------------ joiner
    def transfer_s(self) -> float:
        """Seconds to move our state at the slowest link this project supports (100 Mbit/s), or at
        ``bandwidth_mbps`` when that is lower."""
        rate = min(100e6, self.cfg.bandwidth_mbps * 1e6) if self.cfg.bandwidth_mbps else 100e6
        return 8 * self.state.state_bytes() / rate

    def sync(self, initial: bool, keep_round: bool = False) -> tuple[JoinPoint, Optional[DownloadedState]]:
        """Find where to (re-)enter the swarm: a JoinPoint, with the state to adopt for DOWNLOAD.

        initial: a joiner's first sync (it never averages its random init into the swarm: it trains from
        a downloaded state, or from the seed when no replica trains anywhere). keep_round: we finished
        this round's compute and need the parameters it starts from (delayed overlap). Returns
        (JoinPoint(WAIT), None) when asked to leave. A node that cannot sync keeps trying, with a
        backoff between failed downloads (0.5 s doubling to 10 s), and reports each attempt's reason
        (``on_attempt``); it raises SyncError only past ``cfg.sync_deadline`` seconds, if one is set."""
        cfg, st = self.cfg, self.state
        self.attempts = 0
        self._waited_for_result, self._late_waits = False, 0  # per sync, across downloads (``_enter``)
        transfer_s = self.transfer_s()
        deadline = time.monotonic() + cfg.sync_deadline if cfg.sync_deadline else float("inf")
        first_seen, backoff, seen_active = time.monotonic(), 0.5, False

        def attempted(reason: str) -> None:
            self.attempts += 1
            self.on_attempt(reason, self.attempts)

        def failed(reason: str) -> None:
            nonlocal backoff
            attempted(reason)
            time.sleep(backoff)
            backoff = min(10.0, 2 * backoff)

        while not self._cancelled():
            if time.monotonic() > deadline:
                raise SyncError(f"no peer served a usable state within --sync-deadline {cfg.sync_deadline:.0f}s "
                                f"({self.attempts} attempts)")
            others = self.progress.others()
            active = [m for m in others if m.state in ACTIVE_STATES]
            seen_active = seen_active or bool(active)
            if not active:
                # a joiner that saw the swarm train never starts from the seed: records can vanish for a moment
                # (a busy or saturated link delays DHT reads), and the seed would fork the swarm
                newest = max((m.outer_step for m in others if m.state in (JOINING, SYNCING)), default=0)
                point = None if initial and seen_active else no_donor_join(
                    initial, keep_round, time.monotonic() - first_seen, 2 * cfg.announce_period + 2, st.outer_step,
                    st.round, cfg.min_replicas, newest_seen=newest)
                if point is not None:
                    return point, None
                time.sleep(0.3)
                continue
            if initial:
                point = current_join(active, st.outer_step, st.digest, st.H)
                if point is not None:
                    return point, None
            # hivemind fails a donor that stalls for next_chunk_timeout and tries the next one; this
            # bound only guards against a hang, so it allows the whole state at the slowest link
            began = time.monotonic()
            got = self.averager.download_state(timeout_s=cfg.averaging_timeout + transfer_s)
            if got is None:
                failed("no donor served a state")
                continue
            try:
                downloaded = self.validate(*got)
            except (pydantic.ValidationError, ValueError) as e:
                logger.warning("rejected a downloaded state: %s", e)
                failed(f"rejected a downloaded state: {str(e).splitlines()[0][:200]}")
                continue
            seconds, nbytes = time.monotonic() - began, sum(t.numel() * t.element_size() for t in got[1])
            logger.info("downloaded the state of outer step %d from %s in %.1f s (%d bytes)",
                        downloaded.meta.outer_step, downloaded.meta.donor_peer_id or "a donor", seconds, nbytes)
            if self.link is not None:
                self.link.seed(nbytes, seconds)
            point, downloaded = self._enter(downloaded, keep_round, deadline, attempted, failed)
            if point is not None:
                return point, downloaded
        return JoinPoint(JoinKind.WAIT, reason="asked to leave"), None

    def _enter(self, held: DownloadedState, keep_round: bool, deadline: float,
               attempted: Callable[[str], None],
               failed: Callable[[str], None]) -> tuple[Optional[JoinPoint], DownloadedState]:
        """The join point for a downloaded state, served at any phase of the donor's round: catch up on
        the outer steps applied since (``_catch_up``), then join the round the members at our outer step
        compute, or wait for the next one and catch up again. One download suffices however long it took,
        as long as the members keep the updates we missed (``catch_up_steps``). Returns (None, held) when
        a new download is needed: updates we cannot get, or a wait that ran out."""
        st, cfg = self.state, self.cfg
        while not self._cancelled() and time.monotonic() <= deadline:
            held, why = self._catch_up(held)
            if why:
                logger.info("%s; downloading the state again", why)
                if self.updates is None:
                    attempted(why)  # no catch-up here: a newer download is the way on, at once
                else:
                    failed(why)  # updates nobody serves, or that do not replay: with a failed download's backoff
                return None, held
            meta, others = held.meta, self.progress.others(max_age_s=0.2)
            ref = self._reference(meta, others)
            if ref is None and any(m.outer_step > meta.outer_step for m in others if m.state in ACTIVE_STATES):
                time.sleep(0.1)  # the swarm moved on during the catch-up (or our reads disagree): catch up again
                continue
            donor = DonorMeta(meta.outer_step, ref.state, ref.inner_step, ref.round, ref.peer_id) if ref is not None \
                else DonorMeta(meta.outer_step, meta.donor_state, meta.donor_inner_step, meta.donor_round,
                               meta.donor_peer_id)
            live = ref or next((m for m in others if m.peer_id == meta.donor_peer_id), None)
            point = join_point(donor, live, inner_steps=st.H, our_round=st.round, keep_round=keep_round,
                               early_apply=cfg.overlap != "none" and cfg.num_stages == 1,
                               waited_for_result=self._waited_for_result,
                               # twice at most: where a join always lands late (a slow link), join anyway
                               late=self._late_steps(live) if self._late_waits < 2 else 0,
                               ahead=self.ahead and not keep_round)
            if point.kind == JoinKind.REFETCH:  # the swarm moved on meanwhile: catch up again
                logger.info("%s", point.reason)
                if ref is None:  # nobody's record is at our step: only a new download helps
                    return None, held
                continue
            if point.kind != JoinKind.WAIT:
                if point.reason:
                    logger.info("%s", point.reason)
                return point, held
            logger.info("%s", point.reason)
            attempted(point.reason)
            if point.wait_for == WaitFor.OUTER_STEP and not keep_round:
                self._waited_for_result = True  # the donor's mid-round result: waited for once per sync
            self._late_waits += point.late
            timeout = (3 if point.wait_for == WaitFor.NEXT_ROUND else 1) * cfg.outer_round_deadline
            if not self.progress.wait(lambda others, p=point: wait_over(p, others), timeout, self._cancelled):
                return None, held  # nothing moved for a whole deadline: look for a donor afresh
            if not wait_satisfied(point, self.progress.others()):
                # no member trains any more (or our read of the records missed them): look for a state afresh,
                # after a pause, rather than ask the same donor's meta again at once (that spun, seen in CI)
                time.sleep(0.5)
                return None, held
        return None, held

    def _reference(self, meta: StateMeta, others: list) -> Optional[object]:
        """The live member whose round a node holding ``meta``'s outer step joins: the donor if it is still
        at that step, else the most advanced member at it; None if nobody is (the served meta stands in)."""
        at = [m for m in others if m.state in ACTIVE_STATES and m.outer_step == meta.outer_step]
        donor = [m for m in at if m.peer_id == meta.donor_peer_id]
        return (donor or sorted(at, key=lambda m: (m.round, m.inner_step), reverse=True) or [None])[0]

    def _catch_up(self, held: DownloadedState) -> tuple[DownloadedState, str]:
        """``held`` advanced to the newest outer step a live member of our stage holds, by replaying the
        updates applied since (dilocox/catchup.py), fetched from members that applied them (the donor
        first). Returns (state, "") when current, or (held, why not) when the updates cannot be had or do
        not replay to a state a member's record holds; the caller downloads again then."""
        meta = held.meta
        records = self.progress.others(max_age_s=0.2)  # one read: the step we replay to is vouched by it
        active = [m for m in records if m.state in ACTIVE_STATES]
        newest = max((m.outer_step for m in active), default=meta.outer_step)
        if newest > meta.outer_step:
            if self.updates is None:
                return held, f"the swarm applied outer step {newest} during the download (no catch-up without " \
                              f"sparse rounds and --catch-up-steps)"
            updates, nbytes, why = self._fetch_updates(meta, newest, active)
            if why:
                return held, why
            try:
                replayed = self.state.replay(held.theta, held.momentum, held.control, meta.outer_step, updates,
                                             meta.control_last_outsized)
            except (CatchUpError, ValueError) as e:
                return held, f"catch-up from outer step {meta.outer_step} failed: {e}"
            caught = DownloadedState(meta.copy(update=dict(outer_step=replayed.outer_step, digest=replayed.digest,
                                                           control_last_outsized=replayed.last_outsized)),
                                     replayed.theta, replayed.momentum, held.compression_shared, replayed.control)
        else:
            caught, updates, nbytes = held, [], 0
        try:
            self.vouch(caught.meta, records)
        except ValueError as e:
            return held, str(e)
        if updates:
            logger.info("caught up from outer step %d to %d by replaying %d applied updates (%d bytes)",
                        meta.outer_step, caught.meta.outer_step, len(updates), nbytes)
            self.caught_up += len(updates)
        return caught, ""

    def _fetch_updates(self, meta: StateMeta, newest: int, active: list) -> tuple[list, int, str]:
        """The updates of outer steps meta.outer_step + 1 .. newest, each from the first member that applied
        it and serves it (the donor first; clients accept no connections): (updates, bytes, "") or
        ([], 0, why not)."""
        sources = [m.peer_id for m in sorted(active, key=lambda m: m.peer_id != meta.donor_peer_id)
                   if m.outer_step >= newest and not m.client_mode]
        updates, nbytes = [], 0
        for step in range(meta.outer_step + 1, newest + 1):
            update, size, errors = self._fetch_update(sources, step)
            if update is None:
                return [], 0, f"no member served the update of outer step {step} " \
                              f"({'; '.join(errors) or 'none asked'})"
            updates.append(update)
            nbytes += size
        return updates, nbytes, ""

    def fetch_update(self, peers: list[str], step: int) -> Optional[AppliedUpdate]:
        """The update of outer ``step`` from the first of ``peers`` that serves a valid one (decoded and checked
        against our parameters' shapes: dilocox/catchup.py), or None (also without sparse catch-up)."""
        return self._fetch_update(peers, step)[0] if self.updates is not None else None

    def fetch_result(self, peers: list[str], index: int) -> Optional[AppliedUpdate]:
        """The group result of round ``index`` from the first of ``peers`` that offers one (decoded and checked
        against our shapes; its digests are what the server claims), or None; for daemon/majority.py."""
        return self._fetch_update(peers, index, self.results, result_key(index))[0] if self.results else None

    def _fetch_update(self, peers: list[str], step: int, server: Optional[ContributionServer] = None,
                      key: str = "") -> tuple[Optional[AppliedUpdate], int, list[str]]:
        shapes = [tuple(p.shape) for p in self.state.outer.global_params]
        server, key = server or self.updates, key or update_key(step)
        errors = []
        for peer in peers:
            if self._cancelled():  # leaving: one source at most, however many hold it
                errors.append("asked to leave")
                break
            got, failed = server.fetch({peer: (None, max_encoded_bytes(shapes))}, key,
                                       self.cfg.request_timeout + self.transfer_s())
            try:
                if peer in got:
                    return decode(got[peer], shapes), len(got[peer]), errors
            except CatchUpError as e:
                failed[peer] = str(e)
            errors += [f"{peer[-6:]}: {why[:100]}" for why in failed.values()]
        return None, 0, errors

    def _late_steps(self, live) -> int:
        """The donor's round's last inner steps in which its group forms (synchronous sparse rounds of whole
        models match early: daemon/node.py); 0 where groups form at the round's end or the pace is unknown."""
        if not self.cfg.matches_early or live is None:
            return 0
        step_s = self.samples_per_step / live.tokens_per_second if live.tokens_per_second > 0 else 0.0
        return late_steps(self.state.H, step_s, self.cfg.early_window_s)

    def validate(self, raw_meta, tensors: list) -> DownloadedState:
        """Check a donor's state against ours; raises ValueError / ValidationError naming the problem. Whether
        a member holds it is checked after catch-up (``vouch``)."""
        meta = StateMeta.parse_obj(raw_meta)
        n = len(self.state.outer.global_params)
        if meta.run_id != self.cfg.run_id or meta.num_params != n:
            raise ValueError(f"state for run {meta.run_id!r} with {meta.num_params} parameter tensors "
                             f"does not fit ours ({self.cfg.run_id!r}, {n})")
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            raise ValueError("downloaded state holds something other than tensors")
        if len(tensors) < 2 * n:  # hivemind returns what arrived when a donor's stream ends early
            raise ValueError(f"truncated state: {len(tensors)} of at least {2 * n} tensors arrived "
                             f"(the donor stopped mid-transfer?)")
        k = 3 * n if self.state.control is not None else 2 * n  # SCAFFOLD: c follows the momentum
        if len(tensors) < k:
            raise ValueError(f"truncated state: {len(tensors)} of at least {k} tensors arrived (the donor stopped "
                             f"mid-transfer, or runs DiLoCo where we run SCAFFOLD?)")
        theta, momentum, control, shared_tensors = tensors[:n], tensors[n:2 * n], tensors[2 * n:k], tensors[k:]
        check_shapes(self.state.outer.global_params, theta, "downloaded parameters")
        check_shapes(self.state.outer.global_params, momentum, "downloaded momentum")
        if self.state.control is not None:
            check_shapes(self.state.outer.global_params, control, "downloaded control variate c")
            if control_digest(control, meta.control_last_outsized) != meta.control_digest:
                raise ValueError("downloaded control variate does not match the donor's digest")
        if params_digest(theta) != meta.digest:
            raise ValueError("downloaded parameters do not match the donor's digest")
        if self.state.compressor.shared_digest(meta.compression_rank, shared_tensors) != meta.compression_digest:
            raise ValueError("downloaded compression state does not match the donor's digest")
        return DownloadedState(meta, theta, momentum, shared_tensors, control or None)

    def vouch(self, meta: StateMeta, records: Optional[list] = None) -> None:
        """Raise ValueError unless a live member's record holds theta at (meta.outer_step, meta.digest).
        Whoever served a state, a member's signed record (certified, in a certified swarm) must hold it
        before it is adopted; a state caught up by replay (``_catch_up``) is vouched for at its final step,
        so a download older than every record is fine once the updates since bring it to one. It must also be
        the theta the swarm converges on there (dilocox.consensus.prevailing_theta: a strict majority's, or the
        larger of a split's lineages when every replica is at that step), else a re-sync would not heal a split.
        ``records``: the members' records to check against (default: a fresh read)."""
        records = self.progress.others(max_age_s=0.2) if records is None else records
        if not any((m.outer_step, m.global_params_digest) == (meta.outer_step, meta.digest) for m in records):
            held = ", ".join(f"{m.peer_id[-6:]}: {m.outer_step}/{m.global_params_digest}" for m in records)
            raise ValueError(f"no member's record holds the downloaded state (outer step {meta.outer_step}, digest "
                             f"{meta.digest}; records hold {held or 'nothing'}): not adopted")
        lineage = prevailing_theta(records, meta.outer_step)
        if lineage not in (None, meta.digest):  # a split's minority lineage: a re-sync from it would not heal
            raise ValueError(f"the downloaded state (outer step {meta.outer_step}, digest {meta.digest}) is a "
                             f"minority's: the live replicas' prevailing theta there is {lineage}; not adopted")


def result_key(index: int) -> str:
    """Key under which a node serves its group's result of round ``index`` while a split round is settled."""
    return f"result/{index}"


def update_key(outer_step: int) -> str:
    """Key under which a node serves the update it applied at ``outer_step`` (dilocox/catchup.py)."""
    return f"update/{outer_step}"
