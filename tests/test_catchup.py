"""Catch-up (dilocox/catchup.py) and the join rule it enables (daemon/transfer.py), with real ReplicaStates and
a simulated swarm: a donor at every phase of its round, and downloads longer than a round."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dilocox.daemon.transfer import StateTransfer, SyncError, update_key

from dilocox.catchup import AppliedUpdate, CatchUpError, decode, encode, max_encoded_bytes
from dilocox.consensus import JoinKind
from dilocox.diloco import params_digest
from tests.fakes.catchup import H, Record, SimSwarm, UpdateServer, aggregate, joiner_for, make_state

# ----------------------------------------------------------------------------- the update format

def test_an_update_round_trips_bit_for_bit_and_a_sparse_one_is_smaller(tmp_path):
    st = make_state(tmp_path)
    shapes = [tuple(p.shape) for p in st.outer.global_params]
    agg = aggregate(st, 1)
    agg[0].view(-1)[:3] = torch.tensor([-0.0, 0.0, -0.0])  # kept by their bits
    u = AppliedUpdate(3, "a" * 16, "b" * 16, 2, agg)
    back = decode(encode(u), shapes)
    assert (back.outer_step, back.parent_digest, back.digest, back.group_size) == (3, "a" * 16, "b" * 16, 2)
    assert params_digest(back.aggregate) == params_digest(agg)
    dense = AppliedUpdate(3, "a" * 16, "b" * 16, 2, aggregate(st, 1, density=1.0))
    assert params_digest(decode(encode(dense), shapes).aggregate) == params_digest(dense.aggregate)
    theta_bytes = sum(4 * p.numel() for p in st.outer.global_params)
    assert len(encode(u)) < 0.15 * theta_bytes < len(encode(dense)) <= max_encoded_bytes(shapes)
    skipped = decode(encode(AppliedUpdate(4, "b" * 16, "b" * 16, 1, None)), shapes)
    assert skipped.aggregate is None and skipped.outer_step == 4 and not skipped.outsized
    assert decode(encode(dataclasses.replace(u, outsized=True)), shapes).outsized
    assert decode(encode(AppliedUpdate(4, "b" * 16, "b" * 16, 1, None, True)), shapes).outsized
    assert not decode(_strip(u, "outsized"), shapes).outsized  # an older peer's


def _reencode(u: AppliedUpdate, **fields) -> bytes:
    import io

    raw = torch.load(io.BytesIO(encode(u)), weights_only=True)
    raw.update(fields)
    buf = io.BytesIO()
    torch.save(raw, buf)
    return buf.getvalue()


def _strip(u: AppliedUpdate, field: str) -> bytes:
    import io

    raw = torch.load(io.BytesIO(encode(u)), weights_only=True)
    del raw[field]
    buf = io.BytesIO()
    torch.save(raw, buf)
    return buf.getvalue()


@pytest.mark.parametrize("damage, message", [
    (lambda u, shapes: _reencode(u, outsized=1), "bad outsized flag"),
    (lambda u, shapes: b"\x00" * 100, "unreadable update"),
    (lambda u, shapes: b"\x00" * (max_encoded_bytes(shapes) + 1), "oversized update"),
    (lambda u, shapes: _reencode(u, format=99), "not an update of this format"),
    (lambda u, shapes: _reencode(u, outer_step=-1), "bad outer_step"),
    (lambda u, shapes: _reencode(u, digest="short"), "bad digests"),
    (lambda u, shapes: _reencode(u, parts=[]), "aggregate of 0 tensors"),
    (lambda u, shapes: _reencode(u, parts=[dict(indices=torch.tensor([10 ** 9], dtype=torch.int32),
                                                values=torch.ones(1))] * len(shapes)), "an index outside"),
    (lambda u, shapes: _reencode(u, parts=[dict(indices=torch.tensor([0], dtype=torch.int32),
                                                values=torch.tensor([float("nan")]))] * len(shapes)), "NaN/Inf"),
    (lambda u, shapes: _reencode(u, parts=[dict(indices=torch.tensor([0, 1], dtype=torch.int32),
                                                values=torch.ones(1))] * len(shapes)), "2 indices for 1 values"),
    (lambda u, shapes: _reencode(u, parts=[dict(dense=torch.ones(3))] * len(shapes)), "dense values"),
    (lambda u, shapes: _reencode(u, parts=[dict(dense=torch.ones(3, dtype=torch.float64))] * len(shapes)),
     "1-D torch.float32"),
])
def test_a_bad_update_is_rejected_with_a_reason(tmp_path, damage, message):
    st = make_state(tmp_path)
    shapes = [tuple(p.shape) for p in st.outer.global_params]
    u = AppliedUpdate(3, "a" * 16, "b" * 16, 2, aggregate(st, 1))
    with pytest.raises(CatchUpError, match=message):
        decode(damage(u, shapes), shapes)


# ----------------------------------------------------------------------------- replay

@pytest.mark.parametrize("outer", [{}, dict(outer_lr=0.5, outer_lr_final=2.0, total_steps=4 * H)],
                         ids=["constant-lr", "ramped-lr"])  # the ramp's lr is a function of the outer step
def test_replay_reaches_the_donors_theta_and_momentum_bit_for_bit(tmp_path, outer):
    donor = make_state(tmp_path, **outer)
    swarm = SimSwarm(donor)
    meta, tensors = donor.served()
    n = len(donor.outer.global_params)
    swarm.advance(4 * (H + 1))  # 4 outer steps, one of them skipped
    assert donor.outer_step == 4
    joiner = make_state(tmp_path, **outer)
    shapes = [tuple(p.shape) for p in donor.outer.global_params]
    updates = [decode(swarm.updates[s], shapes) for s in range(1, 5)]
    out = joiner.replay(tensors[:n], tensors[n:2 * n], None, meta["outer_step"], updates)
    assert (out.outer_step, out.digest) == (4, donor.digest)
    assert params_digest(out.momentum) == params_digest(donor.outer.momentum_buffers())
    assert joiner.outer_step == 0  # scratch copies: nothing of the joiner changed
    with pytest.raises(CatchUpError, match="does not continue"):
        joiner.replay(tensors[:n], tensors[n:2 * n], None, meta["outer_step"], updates[1:])
    forged = dataclasses.replace(updates[0], aggregate=[a * 2 for a in updates[0].aggregate])
    with pytest.raises(CatchUpError, match="replayed to digest"):
        joiner.replay(tensors[:n], tensors[n:2 * n], None, meta["outer_step"], [forged] + updates[1:])


def test_replay_carries_scaffolds_control_variate(tmp_path):
    donor = make_state(tmp_path, outer_algorithm="scaffold", compression="sparse")
    swarm = SimSwarm(donor)
    meta, tensors = donor.served()
    n = len(donor.outer.global_params)
    swarm.advance(2 * (H + 1))
    joiner = make_state(tmp_path, outer_algorithm="scaffold", compression="sparse")
    shapes = [tuple(p.shape) for p in donor.outer.global_params]
    out = joiner.replay(tensors[:n], tensors[n:2 * n], tensors[2 * n:3 * n], 0,
                        [decode(swarm.updates[s], shapes) for s in (1, 2)])
    assert out.digest == donor.digest and params_digest(out.control) == donor.control.digest()


def test_replay_restarts_the_control_variate_where_the_swarm_does(tmp_path):
    """--scaffold-reset-every 2: the donor's c restarts at zero after outer step 2 and is rebuilt at step 3; a
    joiner replaying steps 1-3 from the donor's state at 0 holds the same c (and would not without the restart)."""
    cfg = dict(outer_algorithm="scaffold", compression="sparse", scaffold_reset_every=2)
    donor = make_state(tmp_path, **cfg)
    swarm = SimSwarm(donor)
    meta, tensors = donor.served()
    n = len(donor.outer.global_params)
    swarm.advance(3 * (H + 1))
    assert donor.outer_step == 3 and any(float(c.abs().sum()) > 0 for c in donor.control.c)
    shapes = [tuple(p.shape) for p in donor.outer.global_params]
    updates = [decode(swarm.updates[s], shapes) for s in (1, 2, 3)]
    out = make_state(tmp_path, **cfg).replay(tensors[:n], tensors[n:2 * n], tensors[2 * n:3 * n], 0, updates)
    assert out.digest == donor.digest and params_digest(out.control) == donor.control.digest()
    plain = make_state(tmp_path, outer_algorithm="scaffold", compression="sparse").replay(
        tensors[:n], tensors[n:2 * n], tensors[2 * n:3 * n], 0, updates)
    assert params_digest(plain.control) != donor.control.digest()


QUIET = dict(outer_algorithm="scaffold", compression="sparse", scaffold_reset_quiet=2, scaffold_quiet_factor=0.0,
             scaffold_quiet_rounds=1, scaffold_quiet_every=0)  # one restart at zero, 2 steps after the outsized round


def test_replay_restarts_the_control_variate_after_an_outsized_round_as_the_swarm_does(tmp_path):
    """--scaffold-reset-quiet 2: round 1 had an outsized contribution, so the donor restarts c after outer step 3.
    A joiner replaying steps 1-4 from the state at 0 reads the flag in update 1; one replaying 3-4 from the state
    at 2 reads the pending restart from the state. Both hold the donor's c; without either they would not."""
    donor = make_state(tmp_path, **QUIET)
    swarm = SimSwarm(donor, outsized=frozenset({1}))
    n = len(donor.outer.global_params)
    shapes = [tuple(p.shape) for p in donor.outer.global_params]
    served = {}
    for step in range(5):
        served[step] = donor.served()
        swarm.advance(H + 1 if step < 4 else 0)
    assert served[2][0]["control_last_outsized"] == 1 and served[0][0]["control_last_outsized"] is None
    assert donor.outer_step == 4 and donor.control.last_outsized is None
    updates = {s: decode(swarm.updates[s], shapes) for s in range(1, 5)}
    assert [updates[s].outsized for s in range(1, 5)] == [True, False, False, False]
    replayer = make_state(tmp_path, **QUIET)
    for start, last_outsized in ((0, None), (2, 1)):
        _, tensors = served[start]
        out = replayer.replay(tensors[:n], tensors[n:2 * n], tensors[2 * n:3 * n], start,
                              [updates[s] for s in range(start + 1, 5)], last_outsized)
        assert out.digest == donor.digest and params_digest(out.control) == donor.control.digest(), start
        assert out.last_outsized is None
    _, tensors = served[2]
    forgot = replayer.replay(tensors[:n], tensors[n:2 * n], tensors[2 * n:3 * n], 2, [updates[3], updates[4]])
    assert params_digest(forgot.control) != donor.control.digest()
    _, tensors = served[0]
    unflagged = [dataclasses.replace(updates[s], outsized=False) for s in range(1, 5)]
    assert params_digest(replayer.replay(tensors[:n], tensors[n:2 * n], tensors[2 * n:3 * n], 0,
                                         unflagged).control) != donor.control.digest()


def test_a_joiner_downloads_a_pending_quiet_restart_and_catches_up_across_it(tmp_path):
    """The whole join: the download begins while the donor's quiet restart is pending (its digest of c says so),
    lands two rounds later, catch-up replays across the restart, and the joiner holds the donor's c."""
    donor = make_state(tmp_path, **QUIET)
    swarm = SimSwarm(donor, outsized=frozenset({2}))
    swarm.advance(3 * (H + 1) + 1)  # outer step 3: the restart comes after step 4
    assert donor.control.last_outsized == 2
    joiner, t = joiner_for(tmp_path, donor, swarm, 2 * (H + 1), **QUIET)
    point, got = t.sync(initial=True)
    assert point.kind == JoinKind.DOWNLOAD and got.meta.outer_step == donor.outer_step >= 5
    assert t.caught_up >= 2 and donor.control.last_outsized is None
    assert params_digest(got.control) == donor.control.digest() and got.meta.control_last_outsized is None
    joiner.adopt(got.theta, got.momentum, got.meta.compression_rank, got.compression_shared, got.meta.outer_step,
                 got.meta.digest, point.round, point.keep_round, got.control, got.meta.control_last_outsized)
    assert joiner.start_digest() == donor.start_digest()


def test_a_state_whose_pending_restart_does_not_match_its_digest_is_refused(tmp_path):
    donor = make_state(tmp_path, **QUIET)
    swarm = SimSwarm(donor, outsized=frozenset({1}))
    swarm.advance(H + 2)
    meta, tensors = donor.served()
    assert meta["control_last_outsized"] == 1
    joiner, t = joiner_for(tmp_path, donor, swarm, 1, **QUIET)
    meta = dict(meta, donor_state="TRAINING", donor_inner_step=1, donor_round=2)
    assert t.validate(meta, tensors).meta.control_last_outsized == 1
    with pytest.raises(ValueError, match="control variate does not match"):
        t.validate(dict(meta, control_last_outsized=None), tensors)
    with pytest.raises(ValueError, match="control_last_outsized"):
        t.validate(dict(meta, control_last_outsized="1"), tensors)


# ----------------------------------------------------------------------------- the join rule

@pytest.mark.parametrize("phase", range(H + 1))
@pytest.mark.parametrize("download_ticks", [2, 2 * (H + 1) + 1, 5 * (H + 1) + 3])
def test_one_download_joins_from_any_donor_phase_even_when_it_is_slower_than_a_round(tmp_path, phase,
                                                                                     download_ticks):
    """The donor serves at every phase of its round (training early or late, averaging); the download takes
    from under one round to over five. One download, then catch-up: the joiner holds the swarm's theta and
    momentum bit for bit and joins the round the donor computes, where it is."""
    donor = make_state(tmp_path)
    swarm = SimSwarm(donor)
    swarm.advance(2 * (H + 1) + phase)
    joiner, t = joiner_for(tmp_path, donor, swarm, download_ticks)
    point, got = t.sync(initial=True)
    assert t.averager.calls == 1
    assert point.kind == JoinKind.DOWNLOAD, point
    assert (got.meta.outer_step, got.meta.digest) == (donor.outer_step, donor.digest)
    assert params_digest(got.theta) == donor.digest
    assert params_digest(got.momentum) == params_digest(donor.outer.momentum_buffers())
    assert point.round == donor.round and point.skip == swarm.tick < H
    assert t.caught_up == len(t.updates.fetched) >= download_ticks // (H + 1) - 1


def test_without_catch_up_a_download_slower_than_a_round_never_joins(tmp_path, monkeypatch):
    """The race the catch-up removes: each new download lands after the swarm moved on again."""
    from dilocox.daemon import transfer as transfer_module

    monkeypatch.setattr(transfer_module.time, "sleep", lambda s: None)
    donor = make_state(tmp_path)
    swarm = SimSwarm(donor)
    swarm.advance(2 * (H + 1))
    joiner, t = joiner_for(tmp_path, donor, swarm, 2 * (H + 1), catch_up=False, sync_deadline=1.0)
    reasons = []
    t.on_attempt = lambda reason, n: reasons.append(reason)
    with pytest.raises(SyncError, match="--sync-deadline"):
        t.sync(initial=True)
    assert t.averager.calls >= 3 and all("during the download" in r for r in reasons), reasons[:3]


def test_a_forged_update_is_not_adopted_and_the_joiner_downloads_again(tmp_path, monkeypatch):
    from dilocox.daemon import transfer as transfer_module

    monkeypatch.setattr(transfer_module.time, "sleep", lambda s: None)
    donor = make_state(tmp_path)
    swarm = SimSwarm(donor)
    swarm.advance(2 * (H + 1))
    joiner, t = joiner_for(tmp_path, donor, swarm, H + 1)
    shapes = [tuple(p.shape) for p in donor.outer.global_params]
    forged = set()

    def tamper(step, payload):
        if forged:
            return payload
        forged.add(step)
        u = decode(payload, shapes)
        return encode(dataclasses.replace(u, aggregate=[a * -1 for a in u.aggregate]))

    t.updates = UpdateServer(swarm, tamper)
    reasons = []
    t.on_attempt = lambda reason, n: reasons.append(reason)
    point, got = t.sync(initial=True)
    assert point.kind == JoinKind.DOWNLOAD and got.meta.digest == donor.digest
    assert t.averager.calls == 2 and any("replayed to digest" in r for r in reasons), reasons


def test_update_keys_name_the_outer_step():
    assert update_key(7) == "update/7" != update_key(8)


class VanishingRecords:
    """Records that show the swarm training once, then nothing (a saturated link delays DHT reads)."""

    peer_id = "joiner"

    def __init__(self, record):
        self.calls, self.record = 0, record

    def others(self, max_age_s: float = 1.0):
        self.calls += 1
        return [self.record] if self.calls == 1 else []

    def wait(self, predicate, timeout_s, cancelled):
        return False


class NoDonor:
    def download_state(self, timeout_s):
        return None

    def set_priority(self, value):
        pass


def test_a_joiner_that_saw_the_swarm_train_never_starts_from_the_seed(tmp_path, monkeypatch):
    """With --min-replicas 2 a joiner that sees no active member starts from the seed at once (the swarm starts
    together). One that saw the swarm train must keep looking instead: the seed would fork the swarm."""
    from dilocox.daemon import transfer as transfer_module

    monkeypatch.setattr(transfer_module.time, "sleep", lambda s: None)
    joiner = make_state(tmp_path, min_replicas=2, sync_deadline=0.3)
    seen = VanishingRecords(Record("donor", "TRAINING", 5, 6, 1, "f" * 16))
    t = StateTransfer(joiner.cfg, joiner, seen, lambda: ("SYNCING", 0), lambda: False)
    t.averager = NoDonor()
    with pytest.raises(SyncError, match="--sync-deadline"):
        t.sync(initial=True)
    assert seen.calls > 2
    never = VanishingRecords(None)
    never.calls = 1  # no record from the start: the swarm starts together, from the seed
    t = StateTransfer(joiner.cfg, joiner, never, lambda: ("SYNCING", 0), lambda: False)
    point, got = t.sync(initial=True)
    assert point.kind == JoinKind.SEED and got is None


def test_a_pending_quiet_restart_survives_a_checkpoint_file(tmp_path):
    """A node that stops between an outsized round and its restart resumes with the restart still pending (else its
    c would part from the swarm's at the restart)."""
    from dilocox.checkpoint import load_latest_checkpoint, save_checkpoint

    st = make_state(tmp_path, **QUIET)
    st.apply_outer(aggregate(st, 1), 1, group_size=2, outsized=True)
    assert st.control.last_outsized == 1
    save_checkpoint(tmp_path / "ckpt", 1, st.checkpoint_state())
    _, state = load_latest_checkpoint(tmp_path / "ckpt")
    fresh = make_state(tmp_path, **QUIET)
    fresh.restore(state)
    assert fresh.control.last_outsized == 1 and fresh.start_digest() == st.start_digest()
    for s in (fresh, st):
        s.apply_outer(aggregate(st, 2), 2, group_size=2)
        s.apply_outer(aggregate(st, 3), 3, group_size=2)
    assert fresh.start_digest() == st.start_digest() and all(float(c.abs().sum()) == 0 for c in st.control.c)


def test_a_sparse_aggregate_is_written_from_its_positions_and_decodes_to_the_dense_bits():
    """The daemon's applied updates are SparseAggregates: written from their positions (a +0.0 among the values
    included), they decode to what the dense aggregate decodes to, bit for bit, at a fraction of theta's bytes."""
    import numpy as np

    from dilocox.sparse import SparseAggregate

    shapes = [(200, 300), (10,), (5000,)]
    n = 65_010
    rng = np.random.default_rng(2)
    support = np.sort(rng.choice(n, size=3000, replace=False)).astype(np.int64)
    support = np.union1d(support, np.arange(60_000, 60_010)).astype(np.int64)  # all of the 10-value tensor
    values = rng.standard_normal(len(support)).astype(np.float32)
    values[:2] = [0.0, -0.0]
    agg = SparseAggregate(support, values, shapes)
    sparse, dense = (AppliedUpdate(3, "a" * 16, "b" * 16, 2, a) for a in (agg, list(agg)))
    got, want = decode(encode(sparse), shapes), decode(encode(dense), shapes)
    assert all(torch.equal(g.view(torch.int32), w.view(torch.int32)) for g, w in zip(got.aggregate, want.aggregate))
    assert all(torch.equal(g.view(torch.int32), a.view(torch.int32)) for g, a in zip(got.aggregate, agg))
    assert len(encode(sparse)) < 4 * n / 4
