"""OuterRounds' outcomes with fakes: a completed future stands for hivemind's all-reduce and a list of
peer records for the swarm, the way torchft tests its Manager. The ReplicaState is real (tiny model)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest
import torch
from dilocox.daemon.exclusions import Exclusions
from dilocox.daemon.outcomes import PendingRound, RoundOutcome
from dilocox.daemon.rounds import OuterRounds
from dilocox.peers.averaging import RoundCancelled, RoundFailed, RoundGather, RoundResult
from dilocox.peers.deadlines import RoundDeadlines

from dilocox.diloco import params_digest
from tests.fakes.progress import FakeProgress
from tests.fakes.records import Peer
from tests.fakes.transport import FakeTransport
from tests.replicas import computed_round

_made: list[OuterRounds] = []


@pytest.fixture(autouse=True)
def _shut_down_rounds():
    """Every OuterRounds a test made is shut down (its verifier thread would otherwise wait for an exchange
    that never comes and keep pytest from exiting: the interpreter joins pool threads at exit)."""
    yield
    while _made:
        _made.pop().shutdown()


def rounds_for(state, progress, delayed=False, overlap=None, transport=None, **fields):
    """OuterRounds over ``state`` and ``progress`` (``fields``: NodeConfig fields to change, e.g. timeouts)."""
    cfg = state.cfg.model_copy(update=dict(overlap=overlap or ("delayed" if delayed else "none"), **fields))
    flags = RoundDeadlines(None, matchmaking_cap_s=cfg.matchmaking_time,
                           group_wait_cap_s=cfg.outer_round_deadline - cfg.averaging_timeout,
                           request_timeout_s=cfg.request_timeout)
    _made.append(OuterRounds(cfg, state, progress, transport or FakeTransport(), leave_requested=threading.Event(),
                             deadlines=flags, exclusions=Exclusions(lambda: state.round)))
    return _made[-1]


def pending(state, outcome, gathered_start=None, averaged=None):
    """Round 1 with an all-reduce that already ended in ``outcome`` (a RoundResult or an exception)."""
    pg = state.pseudo_gradient()
    compression = state.compressor.begin(pg, state.pseudo_gradient_bounds(1), 1)
    future = Future()
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    else:
        start = gathered_start or state.start_digest()
        gathered = {q: RoundGather(outer_step=0, start_digest=start if q != "me" else state.start_digest(), weight=2.0)
                    for q in ("me", "a", "b")}
        averaged = averaged or [g * 0.5 for g in pg]
        future.set_result(RoundResult(averaged, gathered, 100, 100, 100, 0.1, 1000))
    return PendingRound(1, pg, compression, future, 1.0, [2.0, 1.9], time.monotonic())


def test_applied_when_the_majority_holds_our_result(state):
    theta0 = params_digest(state.outer.global_params)
    averaged = [torch.full_like(p, 1e-3) for p in state.outer.global_params]
    mine = params_digest(averaged)
    done = rounds_for(state, FakeProgress(results={"a": mine, "b": "other"})).finish(
        pending(state, None, averaged=averaged))
    assert done.outcome == RoundOutcome.APPLIED and done.info.group_size == 3
    assert state.outer_step == 1 and state.digest != theta0 and state.round == 2
    # local parameters were re-based onto theta (synchronous DiLoCo: x <- theta_1)
    assert params_digest([p.detach() for p in state.params]) == state.digest


def test_partial_result_is_never_applied(state):
    theta0 = state.digest
    done = rounds_for(state, FakeProgress(results={"a": "group", "b": "group"})).finish(pending(state, None))
    assert done.outcome == RoundOutcome.RESYNC and "partial result" in done.reason
    assert done.info.outcome == "resynced"  # recorded as such if the re-sync fetches round 1
    assert (state.outer_step, state.digest) == (0, theta0)


def test_no_majority_is_skipped_without_an_update(state):
    theta0 = state.digest
    done = rounds_for(state, FakeProgress(results={"a": "x", "b": "y"})).finish(pending(state, None))
    assert done.outcome == RoundOutcome.SKIPPED
    assert (state.outer_step, state.digest) == (1, theta0)  # round consumed, theta_1 = theta_0


def test_a_late_report_is_waited_for_instead_of_skipping_the_round(state):
    class LateReports(FakeProgress):
        timeouts: list = []

        def reports(self, digest, peers, timeout_s):
            self.timeouts.append(timeout_s)  # the group-mates' digests arrive only on the second read
            return {"me": digest} if len(self.timeouts) == 1 else {"me": digest, **{q: digest for q in peers}}

    progress = LateReports()
    rounds = rounds_for(state, progress)
    done = rounds.finish(pending(state, None))
    assert done.outcome == RoundOutcome.APPLIED and state.outer_step == 1
    assert len(progress.timeouts) == 2 and progress.timeouts[1] == rounds.cfg.request_timeout  # read in slices


class SlowGroupMates(FakeProgress):
    """Group-mates "a" and "b" still checking round 1 (records: AVERAGING, theta of outer step 0, no report of
    round 1); their reports appear with the ``reports_on``-th read, if ever. A read without every report
    lasts its timeout, as ProgressTracker's does."""

    def __init__(self, reports_on=None, **peer):
        super().__init__([Peer(peer_id=q, state="AVERAGING", outer_step=0, round=2, **peer) for q in "ab"])
        self.reports_on, self.timeouts = reports_on, []

    def reports(self, digest, peers, timeout_s):
        self.timeouts.append(timeout_s)
        if self.reports_on is not None and len(self.timeouts) >= self.reports_on:
            return {"me": digest, **{q: digest for q in peers}}
        time.sleep(timeout_s)
        return {"me": digest}


QUICK = dict(request_timeout=0.05, matchmaking_time=0.1, averaging_timeout=0.2, outer_round_deadline=1.0)


def test_group_mates_that_may_still_apply_are_waited_for_past_averaging_timeout(state):
    # their reports come on the 8th read (slices of 0.05 s), after averaging_timeout: skipping then would leave
    # them applying a round we skipped (seen in CI: one of two stage replicas applied, the other skipped)
    progress = SlowGroupMates(reports_on=8)
    done = rounds_for(state, progress, **QUICK).finish(pending(state, None))
    assert done.outcome == RoundOutcome.APPLIED and state.outer_step == 1
    assert len(progress.timeouts) == 8 and max(progress.timeouts) <= 0.05


def test_group_mates_that_never_report_are_waited_for_up_to_outer_round_deadline_then_skipped(state):
    theta0, began = state.digest, time.monotonic()
    progress = SlowGroupMates(reports_on=None)
    done = rounds_for(state, progress, **QUICK).finish(pending(state, None))
    assert done.outcome == RoundOutcome.SKIPPED and (state.outer_step, state.digest) == (1, theta0)
    assert 1.0 <= time.monotonic() - began < 3.0 and len(progress.timeouts) > 3


def test_group_mates_that_dropped_the_round_are_not_waited_for(state):
    progress = SlowGroupMates(reports_on=None)
    progress._others = [Peer(peer_id="a", state="SYNCING", outer_step=0), Peer(peer_id="b", state="STOPPED")]
    began = time.monotonic()
    done = rounds_for(state, progress, **QUICK).finish(pending(state, None))
    assert done.outcome == RoundOutcome.SKIPPED and time.monotonic() - began < 0.6  # averaging_timeout (0.2 s), no more


def test_a_leave_ends_the_wait_for_missing_reports_within_a_slice_and_consumes_nothing(state):
    theta0 = state.digest
    rounds = rounds_for(state, SlowGroupMates(reports_on=None), request_timeout=0.05, matchmaking_time=0.1,
                        averaging_timeout=5.0, outer_round_deadline=10.0)
    threading.Timer(0.3, rounds.leave_requested.set).start()
    began = time.monotonic()
    done = rounds.finish(pending(state, None))
    assert done.outcome == RoundOutcome.CANCELLED and time.monotonic() - began < 1.0  # not averaging_timeout
    assert (state.outer_step, state.digest) == (0, theta0)


def test_a_group_mate_that_consumed_the_round_without_a_report_we_saw_sends_us_to_resync(state):
    theta0 = state.digest
    progress = SlowGroupMates(reports_on=None)
    progress._others = [Peer(peer_id="a", outer_step=1, round=2), Peer(peer_id="b", state="STOPPED")]
    done = rounds_for(state, progress, **QUICK).finish(pending(state, None))
    assert done.outcome == RoundOutcome.RESYNC and "other replicas applied it" in done.reason
    assert (state.outer_step, state.digest) == (0, theta0)


def test_no_majority_is_still_skipped_when_only_group_mates_advanced(state):
    theta0 = state.digest
    # group-mate "a" skipped the round too (its outer_step is 1): that alone does not make us re-sync
    skipped = rounds_for(state, FakeProgress([Peer(peer_id="a", outer_step=1, round=2)],
                                             results={"a": "x", "b": "y"})).finish(pending(state, None))
    assert skipped.outcome == RoundOutcome.SKIPPED and (state.outer_step, state.digest) == (1, theta0)


def test_a_group_fragment_without_a_majority_resyncs_when_replicas_outside_it_applied_the_round(state):
    theta0 = state.digest
    # our group (me, a, b) had no majority while "z", outside it, applied round 1: skipping would diverge
    done = rounds_for(state, FakeProgress([Peer(peer_id="z", outer_step=1, round=2)],
                                          results={"a": "x", "b": "y"})).finish(pending(state, None))
    assert done.outcome == RoundOutcome.RESYNC and "other replicas applied it" in done.reason
    assert done.info.outcome == "resynced" and (state.outer_step, state.digest) == (0, theta0)


def test_different_start_means_resync(state):
    theta0 = state.digest
    done = rounds_for(state, FakeProgress()).finish(pending(state, None, gathered_start="elsewhere"))
    assert done.outcome == RoundOutcome.RESYNC and "the group from elsewhere" in done.reason
    assert state.digest == theta0


def test_failed_allreduce_applied_alone_unless_someone_applied(state):
    theta0 = state.digest
    went_on = rounds_for(state, FakeProgress([Peer(outer_step=1, round=2)])).finish(
        pending(state, RoundFailed("no group")))
    assert went_on.outcome == RoundOutcome.RESYNC and state.digest == theta0
    alone = rounds_for(state, FakeProgress([Peer(outer_step=0, round=1)])).finish(
        pending(state, RoundFailed("no group")))
    assert alone.outcome == RoundOutcome.APPLIED_ALONE and alone.info.group_size == 1
    assert state.outer_step == 1 and state.digest != theta0


def test_cancelled_round_changes_nothing(state):
    theta0 = state.digest
    done = rounds_for(state, FakeProgress()).finish(pending(state, RoundCancelled("left")))
    assert done.outcome == RoundOutcome.CANCELLED and (state.outer_step, state.digest) == (0, theta0)


def test_start_is_solo_alone_and_resync_when_others_applied(state):
    solo = rounds_for(state, FakeProgress()).start(state.pseudo_gradient(), 2, 1.0, [2.0])
    assert isinstance(solo, PendingRound) and solo.future is None
    done = rounds_for(state, FakeProgress()).finish(solo)
    assert done.outcome == RoundOutcome.SOLO and state.outer_step == 1
    late = rounds_for(state, FakeProgress([Peer(outer_step=2, round=3)])).start(state.pseudo_gradient(), 2, 1.0, [])
    assert late.outcome == RoundOutcome.RESYNC and "already completed" in late.reason


def test_delayed_applies_theta_mid_round_and_rebases_at_the_end(state):
    rounds = rounds_for(state, FakeProgress(results={"a": None, "b": None}), delayed=True)
    p = pending(state, None)
    mine = params_digest(p.future.result().tensors)
    rounds.progress.results = {"a": mine, "b": mine}
    rounds.hold(p)
    assert state.round == 2 and rounds.finish_early(1)
    assert state.outer_step == 1 and not rounds.finish_early(2)  # tried once per round
    local = [t.detach().clone() for t in state.params]
    done = rounds.finish(rounds.take_pending())
    assert done.outcome == RoundOutcome.APPLIED and state.round == 2
    # x <- theta_1 + (x - x(start of round 2)); x(start of round 2) was x itself here
    assert all(torch.allclose(p, t) for p, t, in zip(state.params, state.outer.global_params))
    assert any(not torch.equal(a, b) for a, b in zip(local, state.params))


def test_adaptive_merges_theta_into_the_local_parameters_when_it_lands(tmp_path):
    """overlap=adaptive: finish_early updates theta *and* folds it into the local trajectory at once (the
    delay is the inner steps the exchange took); the round's end does not re-base again and reports them."""
    state = computed_round(tmp_path, inner_steps=4, overlap="adaptive")
    rounds = rounds_for(state, FakeProgress(results={"a": None, "b": None}), overlap="adaptive")
    p = pending(state, None)
    digest = params_digest(p.future.result().tensors)
    rounds.progress.results = {"a": digest, "b": digest}
    rounds.hold(p)  # round 2 begins from the local parameters
    start = [t.detach().clone() for t in state.params]
    state.inner_step(*state.shard.next_batch(), 0)
    progress = [a - b for a, b in zip(state.params, start)]
    # the exchange was checked against the group on the verifier thread while round 2 computed
    assert p.checked is not None and p.checked.result(timeout=10).outcome == RoundOutcome.APPLIED
    assert rounds.finish_early(1) and state.outer_step == 1
    # x <- theta_1 + (x - x(start of round 2)): one inner step of progress on top of theta
    theta = state.outer.global_params
    assert all(torch.allclose(x, t + u, atol=1e-6) for x, t, u in zip(state.params, theta, progress))
    assert all(torch.allclose(d, -u, atol=1e-6) for d, u in zip(state.pseudo_gradient(), progress))  # from theta
    for i in range(1, 4):
        state.inner_step(*state.shard.next_batch(), i)
    local = [t.detach().clone() for t in state.params]
    done = rounds.finish(rounds.take_pending())
    assert done.outcome == RoundOutcome.APPLIED and done.info.overlap_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(local, state.params))  # merged once, not again at the end


def test_delayed_reports_a_full_round_of_overlap(state):
    rounds = rounds_for(state, FakeProgress(results={"a": None, "b": None}), delayed=True)
    p = pending(state, None)
    rounds.progress.results = {"a": params_digest(p.future.result().tensors), "b": params_digest(
        p.future.result().tensors)}
    rounds.hold(p)
    assert rounds.finish(rounds.take_pending()).info.overlap_steps == state.cfg.inner_steps
    sync = rounds_for(state, FakeProgress(results={"a": None, "b": None}))
    q = pending(state, None)
    sync.progress.results = {"a": params_digest(q.future.result().tensors), "b": params_digest(
        q.future.result().tensors)}
    assert sync.finish(q).info.overlap_steps == 0


def test_delayed_leaves_a_resync_to_the_rounds_end(state):
    rounds = rounds_for(state, FakeProgress(results={"a": "group", "b": "group"}), delayed=True)
    rounds.hold(pending(state, None))
    assert not rounds.finish_early(1) and state.outer_step == 0
    assert rounds.finish(rounds.take_pending()).outcome == RoundOutcome.RESYNC


def test_adaptive_waits_briefly_for_an_exchange_that_lands_in_time(tmp_path):
    """wait_briefly: an exchange already in (or in within the budget) is applied and merged before the next
    round's first step (tau = 0, a synchronous round); one still out after the budget is left to overlap."""
    state = computed_round(tmp_path, overlap="adaptive")
    rounds = rounds_for(state, FakeProgress(), overlap="adaptive")
    p = pending(state, None)
    digest = params_digest(p.future.result().tensors)
    rounds.progress.results = {"a": digest, "b": digest}
    rounds.hold(p)
    assert rounds.wait_briefly(0.5) and state.outer_step == 1
    assert all(torch.equal(x, t) for x, t in zip(state.params, state.outer.global_params))  # starts from theta
    done = rounds.finish(rounds.take_pending())
    assert done.outcome == RoundOutcome.APPLIED and done.info.overlap_steps == 0
    late = pending(state, None)
    late.future = Future()  # never completes
    rounds.hold(late)
    began = time.monotonic()
    assert not rounds.wait_briefly(0.2) and 0.15 < time.monotonic() - began < 1.0
    assert state.outer_step == 1 and late.waited_s >= 0.15
    # stopping with that exchange still out frees the verifier thread (the interpreter joins it at exit)
    rounds.shutdown()
    assert late.checked.result(timeout=3).outcome == RoundOutcome.CANCELLED


def test_held_rounds_start_from_a_lookahead_by_our_own_share(tmp_path):
    """--overlap-proxy local: while round 1's exchange is in flight, round 2 starts from theta_0 advanced by our
    own share of round 1 (a lookahead); none: from where round 1 ended. Theta itself is untouched."""
    starts = {}
    for proxy in ("local", "none"):
        state = computed_round(tmp_path, overlap="delayed", overlap_proxy=proxy)
        ended = [t.detach().clone() for t in state.params]
        theta = [t.clone() for t in state.outer.global_params]
        rounds = rounds_for(state, FakeProgress(), overlap="delayed")
        p = pending(state, None)
        rounds.hold(p)
        assert all(torch.equal(a, b) for a, b in zip(theta, state.outer.global_params))
        starts[proxy] = [t.detach().clone() for t in state.params]
        if proxy == "none":
            assert all(torch.equal(a, b) for a, b in zip(ended, starts[proxy]))
        else:
            ahead = state.outer.lookahead(p.pseudo_gradient)
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ahead, starts[proxy]))
    assert any(not torch.equal(a, b) for a, b in zip(starts["local"], starts["none"]))


def test_adaptive_waits_for_exchanges_a_round_cannot_hide(state):
    """overlap_budget_s, from the recent exchanges' length: the fraction of the round's compute while they fit in
    it (a synchronous round for a short wait); no wait where they are longer (it would only be lost: the exchange
    overlaps); the whole exchange once they took longer than a round's compute (overlap could not hide them)."""
    rounds = rounds_for(state, FakeProgress(), overlap="adaptive")
    assert rounds.overlap_budget_s(10.0, 0.05) == pytest.approx(0.5)  # nothing measured yet
    for exchange_s, expected in ((0.3, 0.5), (2.0, 0.0), (12.0, float("inf")), (1.0, float("inf")),
                                 (1.0, float("inf")), (1.0, 0.0), (0.4, 0.0), (0.4, 0.0), (0.4, 0.5)):
        # the longest of the last three decides
        rounds.observe_exchange(exchange_s)
        assert rounds.overlap_budget_s(10.0, 0.05) == expected, (exchange_s, rounds.exchange_s)


# ---------------------------------------------------------------- split rounds (daemon/majority.py)

@dataclass
class Member(Peer):
    """A record with the round result fields (peers.records.MemberRecord) a split round is settled from."""

    result_step: int = 0
    result_digest: str = ""
    client_mode: bool = False
    num_inputs: int = 0  # the contributions its group used
    union: list = field(default_factory=list)  # the group results it proposes to unite


def _majority_update(tmp_path, state, group_size: int):
    """What a majority group of ``group_size`` applied at outer step 1: its aggregate, theta's digests."""
    from dilocox.catchup import AppliedUpdate

    twin = computed_round(tmp_path / "twin")  # same seed: the same theta_0
    assert twin.digest == state.digest
    aggregate = [torch.full_like(p, 2e-3) for p in twin.outer.global_params]
    twin.apply_outer(aggregate, 1, group_size)
    return AppliedUpdate(1, state.digest, twin.digest, group_size, aggregate), params_digest(aggregate)


def split_rounds(state, outside, fetch, fetch_result=None, offer_result=None):
    cfg = state.cfg.model_copy(update=dict(averaging_timeout=1.0))
    flags = RoundDeadlines(None, matchmaking_cap_s=cfg.matchmaking_time,
                           group_wait_cap_s=cfg.outer_round_deadline - cfg.averaging_timeout,
                           request_timeout_s=cfg.request_timeout)
    mine = None  # our group's (me, a, b) result: all three hold it

    class Progress(FakeProgress):
        def reports(self, digest, peers, timeout_s):
            nonlocal mine
            mine = digest
            return {"me": digest, "a": digest, "b": digest}

    _made.append(OuterRounds(cfg, state, Progress(outside), FakeTransport(), leave_requested=threading.Event(),
                             deadlines=flags, exclusions=Exclusions(lambda: state.round), fetch_update=fetch,
                             fetch_result=fetch_result,
                             offer_result=offer_result))
    return _made[-1]


def test_a_minority_group_adopts_the_majority_groups_update(tmp_path, state):
    update, majority = _majority_update(tmp_path, state, 4)
    outside = [Member(peer_id=p, outer_step=1, round=2, result_step=1, result_digest=majority,
                      global_params_digest=update.digest) for p in "cdef"]
    asked = []
    done = split_rounds(state, outside, lambda peers, step: asked.append((sorted(peers), step)) or update).finish(
        pending(state, None))
    assert done.outcome == RoundOutcome.ADOPTED and done.info.group_size == 4
    (peers, step), = asked  # from members that applied it: two of them (majority.FETCH_SOURCES), at random
    assert step == 1 and len(peers) == 2 and set(peers) < set("cdef"), asked
    assert (state.outer_step, state.digest) == (1, update.digest)  # bit-identical with the majority's theta


def test_a_majority_group_keeps_its_update_and_a_tie_keeps_each_groups(tmp_path, state):
    for outside in ([Member(peer_id=p, outer_step=1, round=2, result_step=1, result_digest="M") for p in "cd"],
                    [Member(peer_id=p, outer_step=1, round=2, result_step=1, result_digest="M") for p in "cde"]):
        st = computed_round(tmp_path / f"s{len(outside)}")
        done = split_rounds(st, outside, lambda peers, step: pytest.fail("nothing to fetch")).finish(pending(st, None))
        assert done.outcome == RoundOutcome.APPLIED and st.outer_step == 1


def test_a_majority_update_that_fails_its_checks_is_not_applied(tmp_path, state):
    from dataclasses import replace

    update, majority = _majority_update(tmp_path, state, 4)
    outside = [Member(peer_id=p, outer_step=1, round=2, result_step=1, result_digest=majority) for p in "cdef"]
    theta0 = state.digest
    for bad in (replace(update, aggregate=[a * 2 for a in update.aggregate]),  # not the majority's result
                replace(update, parent_digest="elsewhere"),  # continues another theta
                None):  # nobody served it
        done = split_rounds(state, outside, lambda peers, step: bad).finish(pending(state, None))
        assert done.outcome == RoundOutcome.RESYNC and "could not be fetched" in done.reason, done.reason
        assert (state.outer_step, state.digest) == (0, theta0)


def test_groups_without_a_majority_apply_the_union_of_their_results(tmp_path, state):
    """A tie, 3 against 3: both groups offer their result, fetch the other's, and apply the same union
    (dilocox/union.py, in result-digest order), so theta stays bit-identical across the split."""
    from dilocox.catchup import AppliedUpdate
    from dilocox.union import unite

    theirs = [torch.full_like(p, -1e-3) for p in state.outer.global_params]
    their_digest = params_digest(theirs)
    outside = [Member(peer_id=p, outer_step=0, round=1, global_params_digest=state.digest, result_step=1,
                      result_digest=their_digest,
                      num_inputs=3) for p in "cde"]
    offered, asked = [], []
    theta0 = state.digest
    twin = computed_round(tmp_path / "twin")  # the same theta_0, to apply the expected union by hand
    done = split_rounds(state, outside, lambda peers, step: pytest.fail("no majority to adopt"),
                        fetch_result=lambda peers, r: asked.append((sorted(peers), r)) or AppliedUpdate(
                            r, theta0, their_digest, 99, theirs),
                        offer_result=lambda r, u: offered.append((r, u))).finish(pending(state, None))
    assert done.outcome == RoundOutcome.UNITED and done.info.group_size == 6, done
    (peers, step), = asked
    assert step == 1 and len(peers) == 2 and set(peers) < set("cde"), asked
    (r, ours), = offered  # our group's result went out before the union was decided
    assert r == 1 and ours.parent_digest == theta0 and ours.digest == params_digest(ours.aggregate)
    # weights are the holders in the records (3 and 3), not the 99 the server claimed
    expected = unite([(3, u) for _, u in sorted([(their_digest, theirs), (ours.digest, ours.aggregate)])])
    twin.apply_outer(expected, 1, 6)
    assert (state.outer_step, state.digest) == (1, twin.digest)


def test_a_union_whose_other_result_cannot_be_had_re_syncs(tmp_path, state):
    from dataclasses import replace

    from dilocox.catchup import AppliedUpdate

    theirs = [torch.full_like(p, -1e-3) for p in state.outer.global_params]
    outside = [Member(peer_id=p, outer_step=0, round=1, global_params_digest=state.digest, result_step=1,
                      result_digest=params_digest(theirs)) for p in "cde"]
    good = AppliedUpdate(1, state.digest, params_digest(theirs), 3, theirs)
    for bad in (None, replace(good, aggregate=[a * 2 for a in theirs]), replace(good, parent_digest="elsewhere")):
        st = computed_round(tmp_path / f"u{id(bad)}")
        done = split_rounds(st, outside, lambda peers, step: None, fetch_result=lambda peers, r: bad,
                            offer_result=lambda r, u: None).finish(pending(st, None))
        assert done.outcome == RoundOutcome.RESYNC and "union of 2 groups" in done.reason, done.reason
        assert st.outer_step == 0


def test_a_group_whose_result_came_too_late_applies_the_union_most_members_proposed(tmp_path, state):
    """Five members of two other groups (3 and 2) united without our result (it came too late for them): we
    propose theirs plus ours, the proposal most members made wins, and we apply it without ours."""
    from dilocox.catchup import AppliedUpdate
    from dilocox.union import unite

    x, y = ([torch.full_like(p, v) for p in state.outer.global_params] for v in (1e-3, -2e-3))
    dx, dy = params_digest(x), params_digest(y)
    union = sorted([dx, dy])
    outside = [Member(peer_id=p, outer_step=0, round=1, global_params_digest=state.digest, result_step=1,
                      result_digest=dx, union=union,
                      num_inputs=3) for p in "cde"]
    outside += [Member(peer_id=p, outer_step=0, round=1, global_params_digest=state.digest, result_step=1,
                       result_digest=dy, union=union,
                       num_inputs=2) for p in "fg"]
    served = {dx: x, dy: y}
    twin = computed_round(tmp_path / "twin")
    rounds = split_rounds(state, outside, lambda peers, step: None,
                          fetch_result=lambda peers, r: AppliedUpdate(r, state.digest, "", 1, served[
                              dx if peers[0] in "cde" else dy]), offer_result=lambda r, u: None)
    done = rounds.finish(pending(state, None))
    assert done.outcome == RoundOutcome.UNITED and done.info.group_size == 5, done
    proposed_step, proposed = rounds.progress.proposed
    assert proposed_step == 1 and len(proposed) == 3 and set(union) < set(proposed)  # ours proposed theirs + ours
    twin.apply_outer(unite([(3 if d == dx else 2, served[d]) for d in union]), 1, 5)
    assert state.digest == twin.digest


def test_a_late_group_adopts_what_most_of_the_swarm_already_applied(tmp_path, state):
    """Five of seven replicas already hold theta_1 = D (their groups settled first); ours of 2 fetches the update
    that took them there and applies it, whatever the results in the records say by now."""
    update, _ = _majority_update(tmp_path, state, 5)
    outside = [Member(peer_id=p, outer_step=1, round=2, global_params_digest=update.digest) for p in "cdefg"]
    asked = []
    done = split_rounds(state, outside, lambda peers, step: asked.append((sorted(peers), step)) or update).finish(
        pending(state, None))
    assert done.outcome == RoundOutcome.ADOPTED and len(asked) == 1 and set(asked[0][0]) < set("cdefg"), asked
    assert (state.outer_step, state.digest) == (1, update.digest)


def test_a_member_the_round_went_on_without_follows_the_update_most_replicas_applied(tmp_path, state):
    """Our exchange failed (late to the round's one group) while four of five replicas applied the round: we fetch
    the update that took them to theta_1 and apply it (ADOPTED, ``behind``), with no state download; our own
    contribution never went out, so the error feedback keeps what it held."""
    update, _ = _majority_update(tmp_path, state, 4)
    outside = [Member(peer_id=p, outer_step=1, round=2, inner_step=3, global_params_digest=update.digest)
               for p in "cdef"]
    asked = []
    rounds = split_rounds(state, outside, lambda peers, step: asked.append((sorted(peers), step)) or update)
    committed = []
    state.compressor.commit = committed.append  # what a codec's error feedback keeps from the round
    done = rounds.finish(pending(state, RoundFailed("no group: the round's group formed without us")))
    assert done.outcome == RoundOutcome.ADOPTED and done.behind and done.info.group_size == 4
    assert len(asked) == 1 and set(asked[0][0]) < set("cdef")
    assert (state.outer_step, state.digest, state.round) == (1, update.digest, 2) and committed == []


def test_a_member_the_round_went_on_without_re_syncs_while_no_majority_applied_it(tmp_path, state):
    """Two of five replicas applied the round (the others are still in it): nothing to follow within the wait
    (averaging_timeout, 1 s here), so the member re-syncs as before; a fetched update that does not lead to the
    majority's theta is not applied either."""
    update, _ = _majority_update(tmp_path, state, 4)
    theta0 = state.digest
    minority = [Member(peer_id=p, outer_step=1, round=2, global_params_digest=update.digest) for p in "cd"] + \
               [Member(peer_id=p, outer_step=0, round=1, global_params_digest=theta0) for p in "ef"]
    began = time.monotonic()
    done = split_rounds(state, minority, lambda peers, step: pytest.fail("nothing to fetch")).finish(
        pending(state, RoundFailed("no group")))
    assert done.outcome == RoundOutcome.RESYNC and "went on without us" in done.reason and not done.behind
    assert 0.9 <= time.monotonic() - began < 5 and (state.outer_step, state.digest) == (0, theta0)
    from dataclasses import replace

    majority = [Member(peer_id=p, outer_step=1, round=2, global_params_digest=update.digest) for p in "cdef"]
    for bad in (replace(update, digest="elsewhere"), replace(update, parent_digest="elsewhere")):
        done = split_rounds(state, majority, lambda peers, step: bad).finish(pending(state, RoundFailed("no group")))
        assert done.outcome == RoundOutcome.RESYNC and (state.outer_step, state.digest) == (0, theta0)


def test_a_round_others_already_completed_follows_their_update_at_its_start(tmp_path, state):
    """Our inner steps ended after most replicas had applied the round (round_start_action: ALREADY_DONE): the
    round is joint all the same, through the update they applied, and nothing of ours goes out."""
    update, _ = _majority_update(tmp_path, state, 3)
    outside = [Member(peer_id=p, outer_step=1, round=2, global_params_digest=update.digest) for p in "cde"]
    rounds = split_rounds(state, outside, lambda peers, step: update)
    started = rounds.start(state.pseudo_gradient(), 2, 1.0, [2.0])
    assert isinstance(started, PendingRound) and started.compression is None
    done = rounds.finish(started)
    assert done.outcome == RoundOutcome.ADOPTED and done.behind
    assert (state.outer_step, state.digest) == (1, update.digest)
    # overlapped rounds re-sync as before: the next round is computed from theta_0 already
    st = computed_round(tmp_path / "delayed")
    cfg = st.cfg.model_copy(update=dict(overlap="delayed", averaging_timeout=1.0))
    delayed = OuterRounds(cfg, st, FakeProgress(outside), FakeTransport(), leave_requested=threading.Event(),
                          deadlines=rounds.deadlines, exclusions=Exclusions(lambda: st.round),
                          fetch_update=lambda peers, step: pytest.fail("no follow"))
    _made.append(delayed)
    late = delayed.start(st.pseudo_gradient(), 2, 1.0, [])
    assert late.outcome == RoundOutcome.RESYNC and "already completed" in late.reason


def _chain(tmp_path, state, steps: int, group_size: int = 4):
    """The updates a majority applied at outer steps 1 .. ``steps`` from our theta_0, each continuing the last."""
    from dilocox.catchup import AppliedUpdate

    twin = computed_round(tmp_path / "chain")  # same seed: the same theta_0
    assert twin.digest == state.digest
    chain = []
    for step in range(1, steps + 1):
        aggregate = [torch.full_like(p, 1e-3 * step) for p in twin.outer.global_params]
        parent = twin.digest
        twin.apply_outer(aggregate, step, group_size)
        chain.append(AppliedUpdate(step, parent, twin.digest, group_size, aggregate))
    return chain


def test_a_member_two_rounds_behind_follows_the_chain_of_updates_without_a_download(tmp_path, state):
    """Our exchange of round 1 failed and by the time we look, four of five replicas hold theta_2 (they applied
    rounds 1 and 2): we fetch update/1 and update/2 from them, check each continues the last and the second leads
    to their theta, and apply both (ADOPTED, ``behind``); the next round we compute is round 3, the swarm's."""
    chain = _chain(tmp_path, state, 2)
    outside = [Member(peer_id=p, outer_step=2, round=3, inner_step=1, global_params_digest=chain[-1].digest)
               for p in "cdef"]
    asked = []
    rounds = split_rounds(state, outside, lambda peers, step: asked.append((sorted(peers), step)) or chain[step - 1])
    done = rounds.finish(pending(state, RoundFailed("no group: the round's group formed without us")))
    assert done.outcome == RoundOutcome.ADOPTED and done.behind and done.info.outer_step == 2, done
    assert [step for _, step in asked] == [1, 2] and all(set(peers) < set("cdef") for peers, _ in asked)
    assert (state.outer_step, state.digest, state.round) == (2, chain[-1].digest, 3)


def test_a_chain_that_breaks_or_is_too_long_is_not_followed(tmp_path):
    """A broken link (an update that continues another theta, or a last one leading elsewhere) or a swarm more
    than MAX_CHAIN steps ahead: the member re-syncs with nothing applied; too far ahead, at once (no poll)."""
    from dataclasses import replace

    for case in ("parent", "theta", "far"):
        st = computed_round(tmp_path / case)
        theta0 = st.digest
        chain = _chain(tmp_path / case, st, 6 if case == "far" else 2)
        outside = [Member(peer_id=p, outer_step=len(chain), round=len(chain) + 1,
                          global_params_digest=chain[-1].digest) for p in "cdef"]
        served = {"parent": [chain[0], replace(chain[1], parent_digest="elsewhere")],
                  "theta": [chain[0], replace(chain[1], digest="elsewhere")], "far": chain}[case]
        rounds = split_rounds(st, outside, lambda peers, step: served[step - 1])
        began = time.monotonic()
        done = rounds.finish(pending(st, RoundFailed("no group")))
        assert done.outcome == RoundOutcome.RESYNC and not done.behind, (case, done)
        assert (st.outer_step, st.digest) == (0, theta0), case
        if case == "far":
            assert time.monotonic() - began < 0.5


def test_a_fetch_asks_two_holders_at_a_time_and_a_leave_ends_the_settling_at_once(tmp_path, state):
    """A majority result whose holders do not answer (each ask costs the transfer's timeout, here 0.3 s): every
    attempt asks at most two of the 20 holders (not a sweep over all of them, which at 32 nodes held a member in
    one round for minutes), and a leave requested meanwhile ends the round as CANCELLED within one attempt,
    with nothing applied."""
    _, majority = _majority_update(tmp_path, state, 20)
    outside = [Member(peer_id=f"p{i:02d}", outer_step=1, round=2, result_step=1, result_digest=majority)
               for i in range(20)]
    asked = []

    def slow(peers, step):
        asked.append(list(peers))
        time.sleep(0.3 * len(peers))
        return None

    rounds = split_rounds(state, outside, slow)
    threading.Timer(0.5, rounds.leave_requested.set).start()
    began = time.monotonic()
    done = rounds.finish(pending(state, None))
    assert done.outcome == RoundOutcome.CANCELLED, done
    assert time.monotonic() - began < 3.0  # an attempt or two after the leave, not a sweep over 20 holders
    assert asked and all(len(peers) <= 2 for peers in asked), asked
    assert state.outer_step == 0


def test_results_of_a_round_that_continues_another_theta_are_neither_adopted_nor_waited_for(tmp_path, state):
    """Four members hold another theta_0 (a lineage that forked earlier) and report a result of round 1: it cannot
    continue ours, so our group of 3 settles among the replicas of our lineage (it is all of them: it keeps its
    update) instead of adopting theirs, failing the parent check and re-syncing."""
    outside = [Member(peer_id=p, outer_step=0, round=1, global_params_digest="other", result_step=1,
                      result_digest="R" * 16) for p in "cdef"]
    done = split_rounds(state, outside, lambda peers, step: pytest.fail("nothing of theirs can continue ours")).finish(
        pending(state, None))
    assert done.outcome == RoundOutcome.APPLIED and state.outer_step == 1, done


def test_early_matchmaking_waits_until_the_previous_rounds_update_is_applied(state):
    """A sparse round's early matchmaking gathers its start digest when it begins: before update r-1 is merged
    that would be theta_{r-2} under the name of outer step r-1, and members that gathered at different moments
    disagree on the start and all re-sync (seen under load with adaptive overlap)."""
    rounds = rounds_for(state, FakeProgress(), overlap="adaptive")
    rounds.contributions = object()  # sparse rounds: contributions are all-gathered
    assert state.outer_step == state.round - 1 and rounds.early_wanted()
    state.round += 1  # round 2 computes while round 1's update is not merged yet
    assert not rounds.early_wanted()


@pytest.mark.parametrize("scale, restarts", [(0.4, True), (0.6, False)])
def test_an_outsized_contribution_restarts_scaffolds_c_the_quiet_rounds_later(tmp_path, scale, restarts):
    """--scaffold-reset-quiet 1 (outsized: under 1/2 of the norm bound's scale): round 1's group scaled a's
    contribution by ``scale``; the update joiners replay carries the flag, and c restarts after outer step 2."""
    state = computed_round(tmp_path, outer_algorithm="scaffold", compression="sparse", scaffold_reset_quiet=1,
                           scaffold_quiet_factor=0.0, scaffold_quiet_rounds=1, scaffold_outsized=2.0,
                           scaffold_quiet_every=0)
    applied = []
    state.on_applied = applied.append
    averaged = [torch.full_like(p, 1e-3) for p in state.outer.global_params]
    p = pending(state, None, averaged=averaged)
    p.future.result().scales = {"a": scale}
    done = rounds_for(state, FakeProgress(results={"a": params_digest(averaged), "b": "other"})).finish(p)
    assert done.outcome == RoundOutcome.APPLIED and applied[-1].outsized == restarts
    assert state.control.last_outsized == (1 if restarts else None)
    assert any(float(c.abs().sum()) > 0 for c in state.control.c)
    state.apply_outer(averaged, 2)
    assert any(float(c.abs().sum()) > 0 for c in state.control.c) != restarts


class AgeRecordingProgress(FakeProgress):
    """FakeProgress that notes the read age each ``others()`` call allowed."""

    def __init__(self, others=()):
        super().__init__(others)
        self.ages = []

    def others(self, max_age_s: float = 1.0):
        self.ages.append(max_age_s)
        return self._others


def test_the_give_up_poll_reuses_reads_longer_in_a_larger_swarm(state):
    """The give-up rule polled while matchmaking (OuterRounds' abandon check) reuses a read up to ABANDON_READ_S
    old among up to 8 other members, and in proportion beyond (each read costs every record): 12 s once 32
    others were seen. A healthy round's polls make no fresh read (its first poll read afresh until 2026-12-03:
    a read a node-round at 16 nodes)."""
    from dilocox.daemon.rounds import ABANDON_READ_S, abandon_read_age_s

    assert abandon_read_age_s(0) == abandon_read_age_s(8) == ABANDON_READ_S == 3.0
    assert abandon_read_age_s(16) == 6.0 and abandon_read_age_s(32) == 12.0
    peers = [Peer(f"p{i}", state="AVERAGING", outer_step=0, round=1, global_params_digest="d0") for i in range(32)]
    for others, later in ((peers[:4], 3.0), (peers, 12.0)):
        progress = AgeRecordingProgress(others)
        check = rounds_for(state, progress)._abandon(1)
        assert not check() and not check()  # everyone is still in round 1: nobody left us behind
        assert progress.ages == [3.0, later], progress.ages


class StaleThenFreshProgress(FakeProgress):
    """FakeProgress whose reads older than 0 s give ``stale`` and whose fresh reads give ``fresh``."""

    def __init__(self, stale, fresh):
        super().__init__(stale)
        self.stale, self.fresh, self.ages = stale, fresh, []

    def others(self, max_age_s: float = 1.0):
        self.ages.append(max_age_s)
        return self.fresh if max_age_s == 0.0 else self.stale


def test_the_give_up_poll_gives_a_round_up_only_on_a_fresh_read(state):
    """A reused read that says the round left us behind (here: the only other replica still SYNCING, so nobody
    is in round 1; two 3-node CI swarms gave their first round up on such a read) is confirmed by a fresh read:
    the round goes on when the fresh read shows that replica in the round, and is given up when it still shows
    nobody in it."""
    syncing = [Peer("p1", state="SYNCING", outer_step=0, round=0, global_params_digest="d0")]
    entered = [Peer("p1", state="AVERAGING", outer_step=0, round=1, global_params_digest="d0")]
    progress = StaleThenFreshProgress(syncing, entered)
    assert not rounds_for(state, progress)._abandon(1)()
    assert progress.ages == [3.0, 0.0], progress.ages
    progress = StaleThenFreshProgress(syncing, syncing)
    assert rounds_for(state, progress)._abandon(1)()
    assert progress.ages == [3.0, 0.0], progress.ages


class MembersProgress(FakeProgress):
    """FakeProgress whose ``members()`` (ours included) notes each read's allowed age."""

    def __init__(self, members):
        super().__init__()
        self._members, self.ages = list(members), []

    def members(self, max_age_s: float = 1.0):
        self.ages.append(max_age_s)
        return self._members


def test_the_reduce_scatters_leavers_are_the_members_whose_records_say_they_left_or_have_expired():
    """``leavers`` (what a shared round's reducers ask before waiting further for a member's upload) names those
    of the awaited members that are DRAINING or STOPPED or have no live record (it expired: the process crashed),
    none in another state, from a read as old as the give-up poll may reuse: 3 s first, 12 s once 32 others
    were seen."""
    from dilocox.daemon.rounds import leavers

    peers = [Peer(f"p{i}", state="AVERAGING", outer_step=0, round=1, global_params_digest="d0") for i in range(30)]
    peers += [Peer("drain", state="DRAINING"), Peer("stop", state="STOPPED"), Peer("sync", state="SYNCING")]
    progress = MembersProgress(peers)
    gone = leavers(progress)
    awaited = {"p3", "drain", "stop", "sync", "crashed"}
    assert gone(awaited) == {"drain", "stop", "crashed"} and gone({"p3", "sync"}) == set()
    assert progress.ages == [3.0, 12.0], progress.ages


def test_the_majoritys_first_poll_takes_the_digest_exchanges_read_and_later_polls_read_afresh():
    """``MajorityUpdate.resolve``'s first look at the other groups is the exchange's last read however long the
    steps before it took (offering our result first, 32 nodes on 2 cores: it read again about once a round);
    the polls after it read at most FRESH_S old records, as before."""
    from dilocox.daemon.majority import FRESH_S, MajorityUpdate

    class Polled(FakeProgress):
        def __init__(self, others):
            super().__init__(others)
            self.asked = []

        def others(self, max_age_s: float = 1.0, since=None):
            self.asked.append((max_age_s, since))
            return self._others

        def exchanged_at(self, result_step):
            return 123.5 if result_step == 4 else None

    # three members of round 4 outside our group of 2 that have not reported: no majority yet, so the group
    # waits, polling, until cancelled
    pending = [Peer(f"p{i}", state="AVERAGING", outer_step=3, round=4, global_params_digest="ab") for i in range(3)]
    progress, polls = Polled(pending), []
    majority = MajorityUpdate(progress, fetch=lambda peers, step: None, delayed=False, wait_s=30.0,
                              cancelled=lambda: polls.append(1) or len(polls) > 2)
    majority.resolve(4, {"me", "q"}, holders=2, parent_digest="ab")
    assert progress.asked[0] == (FRESH_S, 123.5)
    assert len(progress.asked) >= 2 and all(asked == (FRESH_S, None) for asked in progress.asked[1:])


# ---------------------------------------------------------------- the transport, injected

def test_a_round_runs_start_exchange_check_apply_on_the_injected_transport(state):
    """start hands the transport one RoundInput (our contribution as the compressor began it, our metadata, the
    deadlines in use, the give-up rule), finish checks the transport's result against the group and applies it."""
    averaged = [torch.full_like(p, 1e-3) for p in state.outer.global_params]
    transport = FakeTransport(answer=lambda rnd: RoundResult(
        averaged, {q: RoundGather(outer_step=0, start_digest=rnd.gather.start_digest, weight=2.0) for q in "mab"},
        100, 100, 100, 0.1, 1000))
    mine = params_digest(averaged)
    peers = [Peer(peer_id=q, outer_step=0, round=1) for q in "ab"]
    rounds = rounds_for(state, FakeProgress(peers, results={"a": mine, "b": mine}), transport=transport)
    start_digest = state.start_digest()
    p = rounds.start(state.pseudo_gradient(), 2, 1.0, [2.0])
    done = rounds.finish(p)
    (rnd,) = transport.rounds
    assert (rnd.index, rnd.gather.start_digest, rnd.gather.weight) == (1, start_digest, 2.0)
    assert rnd.contribution is p.compression and rnd.times == rounds.deadlines.current()
    assert rnd.abandon() is False  # the group is still in round 1: nobody left us behind
    assert done.outcome == RoundOutcome.APPLIED and done.info.group_size == 3 and state.outer_step == 1


def test_a_round_records_what_was_sent_under_its_keys_by_then_and_the_ratio_of_its_payload(state):
    """The transport returned before our group-mate fetched our 4.6 KB payload (the metadata phase's 2 bytes alone):
    the fetch that came later, before the round is recorded, counts in the round (``sent_since``), and the
    compression ratio is our pseudo-gradient's fp32 size over our payload, whoever fetched it (it read 266,880x)."""
    averaged = [torch.full_like(p, 1e-3) for p in state.outer.global_params]
    late = [0]
    transport = FakeTransport(answer=lambda rnd: RoundResult(
        averaged, {q: RoundGather(outer_step=0, start_digest=rnd.gather.start_digest, weight=2.0) for q in "ma"},
        4600, 2, 4602, 0.1, 533_760, fp32_bytes=533_760, sent_since=lambda: late[0]))
    mine = params_digest(averaged)
    rounds = rounds_for(state, FakeProgress([Peer(peer_id="a", outer_step=0, round=1)], results={"a": mine}),
                        transport=transport)
    p = rounds.start(state.pseudo_gradient(), 2, 1.0, [2.0])
    p.future.result(timeout=10)
    late[0] = 4600  # our mate's fetch, after our exchange returned
    info = rounds.finish(p).info
    assert (info.payload_bytes, info.bytes_sent, info.bytes_received) == (4600, 4602, 4602)
    assert info.compression_ratio == 533_760 / 4600


def test_what_a_member_committed_to_us_joins_the_equivocation_check_beside_the_inputs_we_used(state):
    """``RoundResult.claimed`` (the digest a member committed to when it fetched our row, where we did not use that
    row): checked with the inputs, so the member it committed to and the members it served another row name it with
    two digests (peers/contributions.py, "Commitments"), and it is excluded."""
    averaged = [torch.full_like(p, 1e-3) for p in state.outer.global_params]
    transport = FakeTransport(answer=lambda rnd: RoundResult(
        averaged, {q: RoundGather(outer_step=0, start_digest=rnd.gather.start_digest, weight=2.0) for q in "mab"},
        100, 100, 100, 0.1, 1000, inputs={"a": "a" * 16}, claimed={"b": "c" * 16}))

    class Conflicts(FakeProgress):
        def input_conflicts(self, result_step, inputs, timeout_s):
            self.checked = dict(inputs)
            return {"b": "a"}  # member a used other bytes of b than b committed to us

    progress = Conflicts([Peer(peer_id=q, outer_step=0, round=1) for q in "ab"])
    rounds = rounds_for(state, progress, transport=transport)
    rounds.finish(rounds.start(state.pseudo_gradient(), 2, 1.0, [2.0]))
    assert progress.checked == {"a": "a" * 16, "b": "c" * 16}
    assert "excluded until" in rounds.exclusions.admitted("b")


def test_the_node_totals_are_the_contribution_servers_count_where_there_is_one(state):
    """Sparse and shared rounds: every byte the server moved, in a round or not (peers/contributions.py
    ``traffic``); butterfly rounds (no server): the recorded rounds' sum the node passes in."""
    class Counted:
        def traffic(self):
            return 9000, 7000

    rounds = rounds_for(state, FakeProgress())
    assert (rounds.bytes_sent_total(123), rounds.bytes_received_total(45)) == (123, 45)
    rounds.contributions = Counted()
    assert (rounds.bytes_sent_total(123), rounds.bytes_received_total(45)) == (9000, 7000)


def test_a_transport_failure_with_nobody_else_applying_applies_our_own(state):
    def fail(rnd):
        raise RoundFailed("no group formed")

    peers = [Peer(peer_id=q, outer_step=0, round=1) for q in "ab"]
    rounds = rounds_for(state, FakeProgress(peers), transport=FakeTransport(answer=fail))
    done = rounds.finish(rounds.start(state.pseudo_gradient(), 2, 1.0, [2.0]))
    assert done.outcome == RoundOutcome.APPLIED_ALONE and state.outer_step == 1


def test_exclusions_drop_an_equivocator_for_ten_rounds_and_leave_audited_lies_to_the_group():
    from dilocox.daemon.exclusions import EXCLUDE_ROUNDS

    now = {"round": 3}
    refused = []  # what the node hands its averagers (matchmaking refuses them), once per change of the ledger
    ex = Exclusions(lambda: now["round"], verified=lambda: {"liar": 2},
                    admission=lambda q: "no certificate" if q == "stranger" else None, on_ledger=refused.append)
    ex.equivocated(3, {"two-faced": "a"})
    assert "excluded until round 13" in ex.admitted("two-faced")
    assert ex.admitted("stranger") == "no certificate" and ex.admitted("honest") is None
    # a lie our audits found is a vote, not an exclusion of our own: the group decides, alike on every member
    assert ex.admitted("liar") is None and ex.excluded("liar") is None and ex.votes() == {"liar": 2}
    ex.group_decided(4, {"liar": "excluded by 3 of the group's 5 members: it lied in round 2", "slow": "voted"})
    assert "excluded by its group in round 4" in ex.excluded("liar") and ex.ledger() == {"liar": 4, "slow": 4}
    assert ex.votes() == {"liar": 2, "slow": 3}  # the ledger keeps being voted, so later joiners keep the decision
    ex.group_decided(6, {"liar": "again"})
    assert ex.ledger()["liar"] == 4 and refused == [["liar", "slow"]]
    now["round"] = 3 + EXCLUDE_ROUNDS + 1
    assert ex.admitted("two-faced") is None


@pytest.mark.parametrize("ending", ["applied", "skipped", "alone", "resync"])
def test_a_folded_round_keeps_its_error_feedback_only_when_the_swarm_applied_it(tmp_path, ending):
    """Synchronous sparse rounds fold theta - x into the error feedback in place (no pseudo-gradient held through
    the exchange). Applied: the buffer is bit for bit the one a prepared round leaves, and the payload the same.
    Not applied (skipped, applied alone with our whole pseudo-gradient, re-sync): the buffer is back to what it
    was, up to fp32 rounding."""
    st = computed_round(tmp_path, compression="sparse")
    before = st.compressor.codec.flat.clone()
    st.compressor.codec.flat.copy_(torch.randn_like(before) * 1e-3)  # a buffer from earlier rounds
    before = st.compressor.codec.flat.clone()
    payload, expected = st.compressor.codec.prepare(st.pseudo_gradient())  # changes nothing
    averaged = [torch.full_like(p, 1e-3) for p in st.outer.global_params]

    def answer(rnd):
        if ending == "alone":
            raise RoundFailed("no group formed")
        return RoundResult(averaged, {q: RoundGather(outer_step=0, start_digest=rnd.gather.start_digest, weight=2.0)
                                      for q in "mab"}, 100, 100, 100, 0.1, 1000)

    mine = params_digest(averaged)
    results = dict(applied={"a": mine, "b": mine}, skipped={"a": "x", "b": "y"}, alone={},
                   resync={"a": "group", "b": "group"})[ending]
    peers = [Peer(peer_id=q, outer_step=0, round=1) for q in "ab"]
    rounds = rounds_for(st, FakeProgress(peers, results=results), transport=FakeTransport(answer=answer))
    assert rounds.folds()
    p = rounds.start(None, 2, 1.0, [2.0])
    assert p.compression.payload == payload and p.compression.new_error is None
    done = rounds.finish(p)
    outcome = dict(applied=RoundOutcome.APPLIED, skipped=RoundOutcome.SKIPPED, alone=RoundOutcome.APPLIED_ALONE,
                   resync=RoundOutcome.RESYNC)[ending]
    assert done.outcome == outcome
    if ending == "applied":
        assert torch.equal(st.compressor.codec.flat, expected)
    else:
        assert not torch.equal(st.compressor.codec.flat, expected)
        torch.testing.assert_close(st.compressor.codec.flat, before, rtol=0, atol=1e-8)


def test_a_folded_round_is_not_started_from_parameters_that_are_not_finite(tmp_path):
    """A diverged replica's NaN reaches the fold: the round is not sent and the node is told to re-sync."""
    st = computed_round(tmp_path, compression="sparse")
    with torch.no_grad():
        st.params[0].view(-1)[3] = float("nan")
    assert not st.progress_finite()
    done = rounds_for(st, FakeProgress([Peer(peer_id="a", outer_step=0, round=1)])).start(None, 2, 1.0, [2.0])
    assert done.outcome == RoundOutcome.RESYNC and "non-finite" in done.reason


def test_a_folded_round_alone_in_the_swarm_applies_theta_minus_x_read_at_its_end(tmp_path):
    """Nobody else is there: the round is solo before anything is encoded, and applies the whole pseudo-gradient,
    read from theta and x when it is applied (the error feedback is untouched)."""
    st = computed_round(tmp_path, compression="sparse")
    theta0 = [t.clone() for t in st.outer.global_params]
    delta = st.pseudo_gradient()
    before = st.compressor.codec.flat.clone()
    rounds = rounds_for(st, FakeProgress())
    solo = rounds.start(None, 2, 1.0, [2.0])
    assert isinstance(solo, PendingRound) and solo.future is None and solo.compression is None
    done = rounds.finish(solo)
    assert done.outcome == RoundOutcome.SOLO and st.outer_step == 1
    assert torch.equal(st.compressor.codec.flat, before)
    lr = st.outer.lr_at(1)
    for t0, d, t1 in zip(theta0, delta, st.outer.global_params):  # momentum-free outer SGD: theta -= lr delta
        torch.testing.assert_close(t1, t0 - lr * d)
    assert params_digest([p.detach() for p in st.params]) == st.digest


def test_a_folded_round_others_already_completed_follows_them_without_a_pseudo_gradient(tmp_path):
    st = computed_round(tmp_path, compression="sparse")
    late = rounds_for(st, FakeProgress([Peer(outer_step=2, round=3)])).start(None, 2, 1.0, [])
    assert late.outcome == RoundOutcome.RESYNC and "already completed" in late.reason


def test_adaptive_waits_at_the_delay_cap_for_an_exchange_still_out(tmp_path):
    """--max-delay-steps (default H/10): below the cap an update still out is left to overlap; at the cap the node
    waits for it, then applies and merges it there, so no round's update joins more than the cap late."""
    state = computed_round(tmp_path, inner_steps=20, overlap="adaptive")
    rounds = rounds_for(state, FakeProgress(), overlap="adaptive")
    assert rounds.max_delay_steps == 2  # 20 // 10
    p = pending(state, None)
    result = p.future.result()
    digest = params_digest(result.tensors)
    rounds.progress.results = {"a": digest, "b": digest}
    p.future = Future()
    rounds.hold(p)
    assert not rounds.finish_early(1) and state.outer_step == 0  # under the cap: not waited for
    threading.Timer(0.3, p.future.set_result, (result,)).start()
    began = time.monotonic()
    assert rounds.finish_early(2) and state.outer_step == 1  # at the cap: waited for, applied and merged
    assert 0.2 < time.monotonic() - began < 5 and p.merged_at == 2 and p.waited_s >= 0.2
    assert rounds_for(state, FakeProgress(), overlap="adaptive", max_delay_steps=7).max_delay_steps == 7
