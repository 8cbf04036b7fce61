"""Joining ahead (daemon/join_ahead.py, dilocox.consensus.join_point ``ahead``): a joiner whose donor is finishing
a round computes the next one at once and merges the missed update mid-round, with real ReplicaStates and the
simulated swarm of tests/fakes/catchup.py."""

from __future__ import annotations

import dataclasses
import time

import torch
from dilocox.daemon.join_ahead import JoinAhead

from dilocox.catchup import decode, encode
from dilocox.consensus import JoinKind
from dilocox.diloco import params_digest
from tests.fakes.catchup import H, SimProgress, SimSwarm, UpdateServer, joiner_for, make_state


def _joined_ahead(tmp_path):
    """A donor averaging round 3 (its group formed): the joiner takes theta_2 and computes round 4 at once."""
    donor = make_state(tmp_path)
    swarm = SimSwarm(donor)
    swarm.advance(2 * (H + 1) + H)  # round 3, averaging
    joiner, t = joiner_for(tmp_path, donor, swarm, download_ticks=0)
    t.ahead = True
    point, got = t.sync(initial=True)
    assert (point.kind, point.round, point.skip, point.outer_step) == (JoinKind.DOWNLOAD, 4, 0, 2), point
    joiner.adopt(got.theta, got.momentum, got.meta.compression_rank, got.compression_shared, got.meta.outer_step,
                 got.meta.digest, point.round, point.keep_round, got.control)
    return donor, swarm, joiner, t


def test_a_joiner_computes_the_next_round_at_once_and_merges_the_missed_update_mid_round(tmp_path):
    donor, swarm, joiner, t = _joined_ahead(tmp_path)
    ahead = JoinAhead(joiner, SimProgress(swarm), t.fetch_update)
    assert ahead.behind() and not ahead.merge(now=0.0)  # nobody holds theta_3 yet: nothing to fetch
    for p in joiner.params:  # inner steps of round 4, from theta_2
        p.data.add_(0.01)
    progress = [g.clone() for g in joiner.pseudo_gradient()]
    swarm.advance(1)  # the donor applies round 3
    assert not ahead.merge(now=0.5)  # asked at most once per POLL_S
    assert ahead.merge(now=2.0) and not ahead.behind() and ahead.merged == 1
    # theta_3 and its momentum bit for bit as the donor's; our round's progress is still ours to send
    assert (joiner.outer_step, joiner.digest, joiner.round) == (3, donor.digest, 4)
    assert params_digest(joiner.outer.momentum_buffers()) == params_digest(donor.outer.momentum_buffers())
    assert all(torch.equal(a, b) for a, b in zip(joiner.pseudo_gradient(), progress))
    assert joiner.start_digest() == donor.start_digest()  # round 4's exchange starts where the swarm's does


def test_a_forged_or_unvouched_update_is_not_merged(tmp_path):
    donor, swarm, joiner, t = _joined_ahead(tmp_path)
    swarm.advance(1)
    shapes = [tuple(p.shape) for p in donor.outer.global_params]
    theta2 = joiner.digest
    forged = lambda step, payload: encode(dataclasses.replace(  # noqa: E731
        decode(payload, shapes), parent_digest="0" * 16))
    t.updates = UpdateServer(swarm, forged)
    ahead = JoinAhead(joiner, SimProgress(swarm), t.fetch_update)
    assert not ahead.merge(now=0.0) and (joiner.outer_step, joiner.digest) == (2, theta2)
    fetched = len(t.updates.fetched)  # the members' theta_2 is not ours: no source can help, so no more asks
    assert not ahead.merge(now=10.0) and len(t.updates.fetched) == fetched
    # and the round's end does not wait for it (it waited the whole outer_round_deadline at 32 nodes): re-sync now
    began = time.monotonic()
    assert ahead.forked() and not ahead.wait(300.0, lambda: False) and time.monotonic() - began < 1.0

    class Unvouched(SimProgress):  # the records hold another theta at outer step 3 than the update leads to
        def others(self, max_age_s: float = 1.0):
            return [dataclasses.replace(self.swarm.record(), global_params_digest="f" * 16)]

    t.updates = UpdateServer(swarm)
    ahead = JoinAhead(joiner, Unvouched(swarm), t.fetch_update)
    assert not ahead.merge(now=0.0) and (joiner.outer_step, joiner.digest) == (2, theta2)
    assert JoinAhead(joiner, SimProgress(swarm), t.fetch_update).merge(now=0.0) and joiner.digest == donor.digest


def test_a_result_only_part_of_a_split_round_holds_is_not_merged_until_most_of_the_swarm_holds_it(tmp_path):
    """Seen at 32 nodes: a group applied its own result of a split round, the joiner merged it, and the swarm then
    applied the union of the groups' results: the joiner re-synced 13 s later. A result counts once a strict
    majority of the live replicas holds it (dilocox.consensus.majority_theta)."""
    donor, swarm, joiner, t = _joined_ahead(tmp_path)
    swarm.advance(1)  # the donor's group applies its result of round 3

    class Split(SimProgress):  # replicas b and c of round 3 still settle it; ``applied``: those that are done
        applied: set = set()

        def others(self, max_age_s: float = 1.0):
            mine = self.swarm.record()
            settling = dataclasses.replace(mine, state="AVERAGING", outer_step=2, round=3)
            return [mine, *(dataclasses.replace(mine if p in self.applied else settling, peer_id=p) for p in "bc")]

    ahead = JoinAhead(joiner, Split(swarm), t.fetch_update)
    assert not ahead.merge(now=0.0) and joiner.outer_step == 2 and not t.updates.fetched  # 1 of 3: not yet
    Split.applied.add("b")  # b applied the same result: 2 of 3
    assert ahead.merge(now=2.0) and (joiner.outer_step, joiner.digest) == (3, donor.digest)


def test_without_join_ahead_the_joiner_waits_for_the_next_round(tmp_path):
    donor = make_state(tmp_path)
    swarm = SimSwarm(donor)
    swarm.advance(2 * (H + 1) + H)
    joiner, t = joiner_for(tmp_path, donor, swarm, download_ticks=0)
    point, _ = t.sync(initial=True)  # the wait ends when round 4 trains; the catch-up then brings theta_3
    assert (point.kind, point.round, point.outer_step) == (JoinKind.DOWNLOAD, 4, 3), point
    assert swarm.donor.round == 4


def test_the_look_up_runs_on_the_executor_and_only_the_apply_on_the_training_thread(tmp_path):
    """The node looks the update up on a thread of its own: a slow read of the records or fetch never holds up the
    inner steps (at 32 nodes a round computed ahead took 32-89 s against the swarm's 20 s when it did)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    donor, swarm, joiner, t = _joined_ahead(tmp_path)
    swarm.advance(1)  # the donor applies round 3: the update is to be had
    gate, threads = threading.Event(), []

    class Slow(SimProgress):  # a DHT read that takes as long as the test says
        def others(self, max_age_s: float = 1.0):
            threads.append(threading.current_thread().name)
            assert gate.wait(10)
            return super().others(max_age_s)

    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="join-ahead")
    ahead = JoinAhead(joiner, Slow(swarm), t.fetch_update, executor=executor)
    assert not ahead.merge(now=0.0) and joiner.outer_step == 2  # returns at once: the look-up waits on the read
    assert not ahead.merge(now=5.0)  # one look-up at a time
    gate.set()
    deadline = time.monotonic() + 10
    while not ahead.merge() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (joiner.outer_step, joiner.digest) == (3, donor.digest)
    assert threads and all(n.startswith("join-ahead") for n in threads), threads
    ahead.shutdown()
