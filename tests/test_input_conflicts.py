"""Equivocation through the inputs' digests (daemon/progress.py ``input_conflicts``, docs/protocol.md).

Records carry one digest of the contributions a member used; the map itself goes to the DHT only when a
group-mate's digest differs, and then both members find the contributor that served them different bytes.
Real parts: two Swarms (a DHT process each) on loopback and the node's ProgressTracker.
"""

from __future__ import annotations

import threading
import time

import pytest
from dilocox.daemon.progress import ProgressTracker
from dilocox.peers.identity import load_or_create_identity
from dilocox.peers.records import MemberRecord, inputs_digest
from dilocox.peers.swarm import Swarm, wait_for

pytestmark = pytest.mark.integration


def _tracker(swarm: Swarm) -> ProgressTracker:
    def describe():
        return dict(peer_id=swarm.peer_id, run_id="eq", state="TRAINING", outer_step=0, round=1, inner_step=4,
                    inner_steps=4, tokens_per_second=1.0, loss=1.0, global_params_digest="ab")
    return ProgressTracker(swarm, describe, stage_index=0, num_stages=1, announce_period_s=0.5)


def test_members_whose_inputs_differ_find_the_contributor_and_agreeing_ones_publish_no_map(tmp_path):
    swarms = []
    try:
        for name in ("a", "b"):
            _, key = load_or_create_identity(tmp_path / f"{name}.key")
            join = swarms[0].visible_maddrs() if swarms else []
            swarms.append(Swarm("eq", key, initial_peers=join, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                announce_maddrs=[], identity_path=str(tmp_path / f"{name}.key"), ttl_s=30.0))
        a, b = (_tracker(s) for s in swarms)
        peers = {a.peer_id, b.peer_id}
        same = {"c": "1" * 16, a.peer_id: "2" * 16, b.peer_id: "3" * 16}

        # round 1: the same contributions everywhere; the records' digests agree, no map is published
        # (the first to publish does not wait: the second publishes after it)
        a.exchange_result_digests(1, "r1", peers, timeout_s=0.0, inputs=same)
        b.exchange_result_digests(1, "r1", peers, timeout_s=10.0, inputs=same)
        assert a.collect_result_digests(1, peers, timeout_s=10.0) == {a.peer_id: "r1", b.peer_id: "r1"}
        assert a.input_conflicts(1, same, timeout_s=5.0) == {}
        assert swarms[0].inputs_of(1) == {}
        record = next(m for m in a.others(max_age_s=0.0) if m.peer_id == b.peer_id)
        assert record.inputs_digest == inputs_digest(same) and record.num_inputs == 3
        # a peer its group excluded counts for nothing in the records' decisions (daemon/exclusions.py)
        a.ignore(lambda peer_id: "excluded" if peer_id == b.peer_id else None)
        assert b.peer_id not in {m.peer_id for m in a.others(max_age_s=0.0)}
        assert b.peer_id in {m.peer_id for m in a.members(max_age_s=0.0)}
        a.ignore(lambda peer_id: None)

        # round 2: contributor c served b other bytes than a
        theirs = {**same, "c": "9" * 16}
        a.exchange_result_digests(2, "ra", peers, timeout_s=0.0, inputs=same)
        b.exchange_result_digests(2, "rb", peers, timeout_s=10.0, inputs=theirs)
        for t in (a, b):
            t.collect_result_digests(2, peers, timeout_s=10.0)
        found = {}
        threads = [threading.Thread(target=lambda t=t, i=i: found.__setitem__(t.peer_id, t.input_conflicts(
            2, i, timeout_s=15.0))) for t, i in ((a, same), (b, theirs))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)

        # round 3: b claims other inputs but publishes our result: the same result came from the same
        # contributions, so nobody waits for a map (a lie there must not make every round wait)
        a.exchange_result_digests(3, "r3", peers, timeout_s=0.0, inputs=same)
        b.exchange_result_digests(3, "r3", peers, timeout_s=10.0, inputs=theirs)
        a.collect_result_digests(3, peers, timeout_s=10.0)
        t0 = time.monotonic()
        lied = a.input_conflicts(3, same, timeout_s=15.0)
        lied_s = time.monotonic() - t0

        # round 4: a group-mate that crashed has no live record and will never report: the exchange stops
        # waiting for it once the live ones are in (b, 1 s late), where a plain collection waits out its timeout
        ghost = "QmCrashedGroupMateWithoutARecord"
        threading.Timer(1.0, lambda: b.exchange_result_digests(4, "r4", peers, timeout_s=0.0, inputs=same)).start()
        t0 = time.monotonic()
        crashed = a.exchange_result_digests(4, "r4", peers | {ghost}, timeout_s=20.0, inputs=same)
        crashed_s = time.monotonic() - t0
        t0 = time.monotonic()
        plain = a.collect_result_digests(4, peers | {ghost}, timeout_s=2.0)
        plain_s = time.monotonic() - t0
    finally:
        for s in swarms:
            s.shutdown()
    assert found == {a.peer_id: {"c": b.peer_id}, b.peer_id: {"c": a.peer_id}}
    assert lied == {} and lied_s < 5.0, lied_s
    assert crashed == plain == {a.peer_id: "r4", b.peer_id: "r4"}
    assert 0.9 < crashed_s < 5.0 and plain_s >= 2.0, (crashed_s, plain_s)


def test_a_record_no_longer_grows_with_the_contributors():
    """The record's size does not depend on the round's contributors (it held all of them before: 75% of a
    record at 32 members)."""
    base = dict(peer_id="p", run_id="r", state="TRAINING", outer_step=1, inner_step=0, inner_steps=4,
                tokens_per_second=1.0, loss=1.0, global_params_digest="ab", result_step=1)
    small = {f"peer{i}": "0" * 16 for i in range(10)}
    large = {f"peer{i}": "0" * 16 for i in range(32)}
    sizes = {len(str(MemberRecord(**base, inputs_digest=inputs_digest(m), num_inputs=len(m)).dict()))
             for m in (small, large)}
    assert len(sizes) == 1
    with pytest.raises(ValueError, match="inputs"):
        MemberRecord(**base, inputs=large)


class _CountingSwarm:
    """Counts publishes (a rule test of the heartbeat's clock: the DHT itself is exercised above)."""

    peer_id = "QmCounting"

    def __init__(self):
        self.published = 0

    def publish(self, record) -> bool:
        self.published += 1
        return True

    def members(self, max_age_s: float = 1.0, caller: str = "", since=None):
        return []


def test_the_heartbeat_does_not_beat_after_a_direct_publish_refreshed_the_record_but_a_poke_still_publishes():
    swarm = _CountingSwarm()
    tracker = _tracker(swarm)  # announce_period_s=0.5
    tracker.start()
    try:
        assert wait_for(lambda: swarm.published == 1, 2.0, poll_s=0.01)  # the first beat
        for _ in range(14):  # direct publishes every 0.15 s for 2.1 s: each one pushes the next beat back
            tracker.publish()
            time.sleep(0.15)
        assert swarm.published == 1 + 14, swarm.published  # no beat in between (a fixed clock: 4 more)
        assert wait_for(lambda: swarm.published == 16, 2.0, poll_s=0.01)  # a beat once the record is 0.5 s old
        tracker.poke()
        assert wait_for(lambda: swarm.published == 17, 0.3, poll_s=0.01)  # a poke: at once, not 0.5 s later
    finally:
        tracker.stop()


class _GroupSwarm(_CountingSwarm):
    """A group-mate whose result digest becomes readable ``late_s`` after our publish (both end a round together,
    their publishes land moments apart); counts reads."""

    def __init__(self, late_s: float):
        super().__init__()
        self.late_s, self.reads, self.at = late_s, 0, float("inf")

    def publish(self, record) -> bool:
        self.at = min(self.at, time.monotonic())
        return super().publish(record)

    def members(self, max_age_s: float = 1.0, caller: str = "", since=None):
        self.reads += 1
        done = time.monotonic() >= self.at + self.late_s  # before: its live record of the round before
        mate = MemberRecord(peer_id="QmMate", run_id="eq", state="AVERAGING", outer_step=0, round=1, inner_step=4,
                            inner_steps=4, tokens_per_second=1.0, loss=1.0, global_params_digest="ab",
                            result_step=int(done), result_digest="r1" if done else "")
        return [(mate, 10.0)]


def test_the_digest_exchange_reads_once_when_the_group_mates_publish_moments_after_us():
    """A read at once after our own publish found a group-mate's digest missing in nearly every round, and the
    next read, a pause later, found it (1.95 reads a node-round at 16 nodes): the exchange reads after the pause."""
    swarm = _GroupSwarm(late_s=0.1)
    tracker = _tracker(swarm)
    assert tracker.exchange_result_digests(1, "r1", {"QmCounting", "QmMate"}, timeout_s=5.0) == {
        "QmCounting": "r1", "QmMate": "r1"}
    assert swarm.reads == 1, swarm.reads


def test_heartbeats_that_no_dht_peer_stores_are_logged_once_and_the_recovery_too(caplog):
    """A record no DHT peer takes (peers of another version refuse another schema, or none is reachable) leaves the
    node invisible to the swarm; before, nothing said so. Three such beats in a row give one warning, not one per
    beat, and a stored beat after them an info line."""
    import logging

    swarm = _CountingSwarm()
    stored = [False] * 5 + [True]

    def publish(record) -> bool:
        swarm.published += 1
        return stored.pop(0) if stored else True
    swarm.publish = publish
    tracker = _tracker(swarm)  # announce_period_s=0.5
    with caplog.at_level(logging.INFO, logger="dilocox.daemon.progress"):
        tracker.start()
        try:
            for _ in range(7):  # a poke is a beat at once
                tracker.poke()
                time.sleep(0.1)
            assert wait_for(lambda: swarm.published >= 7, 5.0, poll_s=0.05)
        finally:
            tracker.stop()
    warnings = [r for r in caplog.records if "no DHT peer took our membership record" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert any("stored again after 5" in r.getMessage() for r in caplog.records)


def test_each_membership_read_is_named_by_the_function_that_asked_for_it():
    """``reader``: the read's caller for ``Swarm.traffic``'s ``reads_by`` counts (bench.upload's breakdown of a
    round's reads): the first function outside the tracker's pass-through ``members`` and ``others``."""
    from dilocox.daemon.progress import reader

    callers = []

    class Naming(_CountingSwarm):
        def members(self, max_age_s: float = 1.0, caller: str = "", since=None):
            callers.append(caller)
            return []

    tracker = _tracker(Naming())

    def round_start():
        tracker.others(0.2)

    def check_majority():
        tracker.members()

    round_start()
    check_majority()
    tracker.exchange_result_digests(1, "r1", {"QmCounting"}, timeout_s=0.0)
    assert callers[:2] == [f"test_input_conflicts.{name}" for name in (
        "test_each_membership_read_is_named_by_the_function_that_asked_for_it.<locals>.round_start",
        "test_each_membership_read_is_named_by_the_function_that_asked_for_it.<locals>.check_majority")]
    assert set(callers[2:]) == {"progress.ProgressTracker.collect_result_digests"}, callers
    assert reader(depth=1) == "test_input_conflicts.test_each_membership_read_is_named_by_the_function_that_asked_" \
                              "for_it"


class _ReusingSwarm(_GroupSwarm):
    """``_GroupSwarm`` whose reads are shared as ``Swarm.members`` shares them: one less than ``max_age_s`` old or
    made at or after ``since`` serves; counts the reads made."""

    def __init__(self, late_s: float):
        super().__init__(late_s)
        self.read_at, self.made = -float("inf"), 0

    def members(self, max_age_s: float = 1.0, caller: str = "", since=None):
        now = time.monotonic()
        if now - self.read_at >= max_age_s and (since is None or self.read_at < since):
            self.read_at, self.made = now, self.made + 1
        return super().members(max_age_s, caller)


def test_the_checks_after_a_digest_exchange_share_its_last_read_however_long_the_steps_between_take():
    """With 32 nodes on 2 cores the steps between the exchange and the inputs check took longer than the check's
    0.2 s, and it read again (0.6 reads a node-round, bench.upload's ``reads_by``): it now takes the exchange's
    last read (``exchanged_at``), and a read made before the exchange never serves."""
    swarm = _ReusingSwarm(late_s=0.0)
    tracker = _tracker(swarm)
    assert tracker.exchanged_at(1) is None
    tracker.others(0.2)  # a read before the exchange: it must not serve the checks after it
    began = time.monotonic()
    assert tracker.exchange_result_digests(1, "r1", {"QmCounting", "QmMate"}, timeout_s=5.0) == {
        "QmCounting": "r1", "QmMate": "r1"}
    assert swarm.made == 2 and tracker.exchanged_at(1) >= began and tracker.exchanged_at(2) is None
    time.sleep(0.3)  # a busy machine: more than the 0.2 s the check asks for
    assert tracker.input_conflicts(1, {"QmOther": "d1"}, timeout_s=0.0) == {}
    assert tracker.others(0.2, since=tracker.exchanged_at(1)) and swarm.made == 2
    assert tracker.others(0.2) and swarm.made == 3  # without ``since``: a read of its own
