"""StateTransfer's donor window and its checks of downloaded state, with a real ReplicaState and no network."""

from __future__ import annotations

import time

import pytest
import torch
from dilocox.daemon.transfer import StateTransfer
from dilocox.peers.deadlines import LinkEstimate

from tests.fakes.progress import FakeProgress
from tests.fakes.records import Record
from tests.fakes.transfer import transfer_for


def test_donor_serves_one_joiner_per_short_window(state):
    state.snapshot()
    t = transfer_for(state)
    meta, tensors = t.serve()
    assert meta["donor_state"] == "TRAINING" and meta["donor_inner_step"] == 3 and meta["donor_round"] == state.round
    assert len(tensors) >= 2 * len(state.outer.global_params)
    assert t.serve() == (None, [])  # a second joiner at once goes to another donor
    # the window is request_timeout + the state at 100 Mbit/s (no bandwidth configured), not a measured rate
    time.sleep(state.cfg.request_timeout + 8 * sum(x.numel() * x.element_size() for x in tensors) / 100e6 + 0.05)
    assert t.serve()[0] is not None


class FakeServingAverager:
    """The two calls StateTransfer makes of its averager as a donor (peers/averaging.py)."""

    def __init__(self):
        self.whole_streams = 0

    def set_priority(self, priority: float) -> None:
        pass

    def states_served(self) -> int:
        return self.whole_streams


def test_a_donor_serves_the_next_joiner_as_soon_as_the_last_stream_ended(state):
    state.snapshot()
    t, averager = transfer_for(state), FakeServingAverager()
    t.attach(averager)
    assert t.serve()[0] is not None
    assert t.serve() == (None, [])  # the first joiner's stream is still going
    averager.whole_streams += 1  # ... and now it has ended: no need to wait out the window
    assert t.serve()[0] is not None
    assert t.serve() == (None, [])  # a stream that broke off is not counted: the window holds again


def served(state):
    state.snapshot()
    meta, tensors = transfer_for(state).serve()
    return dict(meta), [x.clone() for x in tensors]


def test_valid_state_passes(state):
    meta, tensors = served(state)
    got = transfer_for(state).validate(meta, tensors)
    assert got.meta.outer_step == state.outer_step and len(got.theta) == len(state.outer.global_params)


def test_a_state_no_members_record_holds_is_not_adopted(state):
    """A donor outside the swarm (not certified, or lying about who it is) can serve a self-consistent state;
    only one whose (outer step, digest) a member's signed record holds is adopted."""
    meta, tensors = served(state)
    for others in ([], [Record("m", state.outer_step, "0" * 16)], [Record("m", state.outer_step + 1, state.digest)]):
        t = transfer_for(state, others)
        got = t.validate(meta, tensors)  # self-consistent
        with pytest.raises(ValueError, match="no member's record holds"):
            t.vouch(got.meta)


def test_a_state_of_a_minority_lineage_is_not_adopted(state):
    """A split round left two thetas at one outer step: a re-sync adopts the one most live replicas hold, so a
    member of the minority that re-syncs from a lineage-mate (hivemind picks among donors at random) tries again."""
    meta, tensors = served(state)
    step, ours, theirs = state.outer_step, state.digest, "f" * 16
    minority = [Record("m0", step, ours)] + [Record(f"o{i}", step, theirs) for i in range(3)]
    t = transfer_for(state, minority)
    with pytest.raises(ValueError, match="minority's: the live replicas' prevailing theta there is f"):
        t.vouch(t.validate(meta, tensors).meta)
    # 1 against 1 with every replica at the step: the smaller digest prevails (dilocox.consensus.prevailing_theta)
    t = transfer_for(state, [Record("m0", step, ours), Record("o0", step, "0" * 16)])
    with pytest.raises(ValueError, match="prevailing theta there is 0000"):
        t.vouch(t.validate(meta, tensors).meta)
    for others in (minority[:2],  # 1 against 1: ours is the smaller digest ("f" * 16 is the largest)
                   minority[:2] + [Record(f"s{i}", step, theirs, "SYNCING") for i in range(3)],  # syncing: no vote
                   [Record(f"m{i}", step, ours) for i in range(3)] + minority[1:]):  # ours is the majority's
        t = transfer_for(state, others)
        t.vouch(t.validate(meta, tensors).meta)


@pytest.mark.parametrize("damage, message", [
    (lambda m, t: t.__delitem__(slice(3, None)), "truncated state"),
    (lambda m, t: t[0].add_(1.0), "do not match the donor's digest"),
    (lambda m, t: m.update(run_id="other"), "does not fit ours"),
    (lambda m, t: m.update(outer_step=-1), "outer_step"),
    (lambda m, t: t.__setitem__(0, torch.zeros(3)), "shape"),
])
def test_bad_state_is_rejected_with_a_reason(state, damage, message):
    meta, tensors = served(state)
    damage(meta, tensors)
    with pytest.raises(Exception) as err:
        transfer_for(state).validate(meta, tensors)
    assert message in str(err.value)


class FlakyAverager:
    """Serves nothing the first ``misses`` times, then the given state."""

    def __init__(self, misses, served_state):
        self.misses, self.served_state, self.calls = misses, served_state, 0

    def download_state(self, timeout_s):
        self.calls += 1
        return None if self.calls <= self.misses else self.served_state

    def set_priority(self, value):
        pass


@pytest.mark.timeout(60)
def test_a_joiner_keeps_trying_and_says_why(state, monkeypatch):
    """No donor serves twice, then one does: sync retries with backoff (slept, not spun), reports each
    attempt's reason, and joins; with --sync-deadline it gives up with the attempt count."""
    from dilocox.daemon import transfer as transfer_module
    from dilocox.daemon.transfer import SyncError

    sleeps, real_sleep = [], time.sleep
    monkeypatch.setattr(transfer_module.time, "sleep", sleeps.append)
    meta, tensors = served(state)
    donor = Record("donor", state.outer_step, state.digest)
    donor.state, donor.round, donor.inner_step, donor.num_stages = "TRAINING", state.round, 1, 1
    t = transfer_for(state, [donor])
    t.averager = FlakyAverager(2, (dict(meta, donor_peer_id="donor", donor_inner_step=1), tensors))
    reports = []
    t.on_attempt = lambda reason, n: reports.append((reason, n))
    t.link = LinkEstimate()
    point, got = t.sync(initial=False)
    assert got is not None and t.averager.calls == 3
    assert t.link.snapshot().bps > 0 and t.link.snapshot().samples == 0  # the download seeded our rate
    assert reports == [("no donor served a state", 1), ("no donor served a state", 2)]
    assert sleeps[:2] == [0.5, 1.0]  # backoff doubles
    cfg = state.cfg.model_copy(update=dict(sync_deadline=0.001))
    t = StateTransfer(cfg, state, FakeProgress([donor]), lambda: ("TRAINING", 3), lambda: False)
    t.averager = FlakyAverager(10**9, None)
    monkeypatch.setattr(transfer_module.time, "sleep", lambda s: real_sleep(0.002))
    with pytest.raises(SyncError, match="--sync-deadline"):
        t.sync(initial=False)


def test_a_member_that_followed_a_round_rejoins_where_the_holders_of_its_theta_are(state):
    """After applying the update most replicas applied (no download), the member skips to their inner step in the
    round they compute now; nobody holding our theta (they went further): no point, the next round sorts it out."""
    from tests.fakes.records import Peer

    assert state.H == 2
    holders = [Peer("a", outer_step=state.outer_step, round=state.round, inner_step=0,
                    global_params_digest=state.digest),
               Peer("b", outer_step=state.outer_step, round=state.round, inner_step=1,
                    global_params_digest=state.digest, state="AVERAGING"),
               Peer("c", outer_step=state.outer_step + 1, round=state.round + 1, inner_step=15,
                    global_params_digest="further"),
               Peer("d", outer_step=state.outer_step, round=state.round, inner_step=1,
                    global_params_digest=state.digest, state="SYNCING")]  # not active: not where the swarm is
    point = StateTransfer(state.cfg, state, FakeProgress(holders), lambda: ("TRAINING", 0), lambda: False).in_phase()
    assert (point.round, point.skip) == (state.round, 1)  # the most advanced holder's step
    first = StateTransfer(state.cfg, state, FakeProgress(holders[:1] + holders[2:]), lambda: ("TRAINING", 0),
                          lambda: False).in_phase()
    assert (first.round, first.skip) == (state.round, 0)  # the syncing record does not count
    alone = StateTransfer(state.cfg, state, FakeProgress(holders[2:]), lambda: ("TRAINING", 0), lambda: False)
    assert alone.in_phase() is None
