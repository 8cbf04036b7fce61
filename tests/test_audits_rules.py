"""The node's audit rules (daemon/audits.py) with the recomputation faked: who is excluded after an accusation,
what a failed accusation costs the accuser, and that a peer's start state is checked before it is used."""

from __future__ import annotations

import io
import threading
from types import SimpleNamespace

import pytest
import torch
from dilocox.daemon.audits import STRIKES, AuditOutcome, Audits, data_lie, decode_state, encode_state


def _audits(verdicts: dict) -> Audits:
    """An Audits whose recomputation returns ``verdicts[(peer, round)]`` and which holds records of rounds 1-9."""
    a = Audits(SimpleNamespace(audit_rate=1.0, authority=None, averaging_timeout=1.0), state=None, workload=None,
               server=None, me="me")
    peers = {p: b"" for p, _ in verdicts}
    a._rounds = {r: SimpleNamespace(contributions=peers) for r in range(1, 10)}
    a.audit = lambda r, peer: (verdicts[(peer, r)], "faked")
    return a


def _drain(a: Audits) -> None:
    assert a.wait_idle(10)


def test_an_accusation_that_holds_up_excludes_the_accused():
    a = _audits({("liar", 3): AuditOutcome.LIED})
    a.review([SimpleNamespace(peer_id="x", accusations={"liar": 3})])
    _drain(a)
    assert a.excluded("liar") and a.accusations == {"liar": 3} and a.excluded("x") is None
    # judged once: a second reading of the same accusation recomputes nothing
    a.audit = lambda r, peer: pytest.fail("judged twice")
    a.review([SimpleNamespace(peer_id="y", accusations={"liar": 3})])
    _drain(a)
    a.shutdown()


def test_accusations_that_do_not_hold_up_exclude_the_accuser_at_the_strike_limit():
    a = _audits({("honest", r): AuditOutcome.HONEST for r in range(1, 9)})
    for r in range(1, STRIKES + 1):
        assert a.excluded("slanderer") is None
        a.review([SimpleNamespace(peer_id="slanderer", accusations={"honest": r})])
        _drain(a)
    assert a.excluded("slanderer") and a.excluded("honest") is None and not a.accusations
    # an excluded accuser's further accusations are not even checked
    a.audit = lambda r, peer: pytest.fail("checked an excluded accuser's accusation")
    a.review([SimpleNamespace(peer_id="slanderer", accusations={"honest": 9})])
    _drain(a)
    a.shutdown()


def test_unavailable_states_and_unknown_peers_accuse_nobody():
    a = _audits({("quiet", 2): AuditOutcome.UNAVAILABLE})
    a.review([SimpleNamespace(peer_id="x", accusations={"quiet": 2, "stranger": 3, "me": 2})])  # no round of theirs
    _drain(a)
    assert a.excluded("quiet") is None and a.excluded("x") is None and a.outcomes == {AuditOutcome.UNAVAILABLE: 1}
    a.shutdown()


def test_an_accused_round_we_did_not_keep_is_stood_in_for_by_the_latest_we_kept():
    """A member that joined after the accused round audits the accused's latest round it kept: a lie there excludes
    the accused; an honest one proves nothing about the accused round and counts against nobody."""
    a = _audits({("liar", 9): AuditOutcome.LIED, ("reformed", 9): AuditOutcome.HONEST})
    a.review([SimpleNamespace(peer_id="x", accusations={"liar": 42, "reformed": 42})])
    _drain(a)
    assert a.excluded("liar") and a.excluded("reformed") is None and a.excluded("x") is None
    assert a._strikes == {} and a.outcomes == {AuditOutcome.LIED: 1, AuditOutcome.HONEST: 1}
    a.shutdown()


def test_another_members_accusation_is_checked_before_the_rounds_drawn_for_us():
    """Each round a vote waits, the liar's contribution counts: checking an accusation jumps the queue of routine
    audits (the one already running finishes first)."""
    started, gate, calls = threading.Event(), threading.Event(), []

    def fake(r, peer):
        started.set()
        gate.wait(10)
        calls.append((r, peer))
        return (AuditOutcome.LIED if peer == "liar" else AuditOutcome.HONEST), "faked"

    a = Audits(SimpleNamespace(audit_rate=1.0, audit_probation=0, authority=None, averaging_timeout=1.0),
               state=None, workload=None, server=None, me="me")
    a.audit = fake
    for r in (1, 2, 3):  # with one other member, every round draws us to audit it
        a._thetas[r] = []
        a.observe(r, SimpleNamespace(inputs={"p": "d", "me": "d"}, gathered={}, contributions={"p": b"", "liar": b""}))
    assert started.wait(10)
    a.review([SimpleNamespace(peer_id="x", accusations={"liar": 2})])
    gate.set()
    _drain(a)
    assert calls == [(1, "p"), (2, "liar"), (2, "p"), (3, "p")] and a.excluded("liar")
    a.shutdown()


def test_a_start_state_is_checked_before_use():
    params = [torch.zeros(3, 2), torch.zeros(4)]
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    groups = opt.state_dict()["param_groups"]
    good = encode_state(opt.state_dict(), [torch.ones(3, 2), torch.ones(4)])
    state, error, c_i = decode_state(good, params, groups)
    assert set(state["state"]) == {0, 1} and [tuple(e.shape) for e in error] == [(3, 2), (4,)] and c_i == []
    # SCAFFOLD's start state holds the contributor's c_i, checked like the rest; a DiLoCo swarm refuses one
    with_c = encode_state(opt.state_dict(), [torch.ones(3, 2), torch.ones(4)], [torch.full((3, 2), 2.0), torch.ones(4)])
    _, _, c_i = decode_state(with_c, params, groups, control=True)
    assert [float(c.sum()) for c in c_i] == [12.0, 4.0]
    with pytest.raises(ValueError, match=r"unexpected entry 'control\."):
        decode_state(with_c, params, groups)
    with pytest.raises(ValueError, match="control variate c_i does not fit"):
        decode_state(good, params, groups, control=True)
    with pytest.raises(ValueError, match="control variate c_i holds NaN"):
        decode_state(encode_state(opt.state_dict(), [torch.ones(3, 2), torch.ones(4)],
                                  [torch.ones(3, 2), torch.full((4,), float("inf"))]), params, groups, control=True)
    with pytest.raises(ValueError, match="does not load"):
        decode_state(b"not a state", params, groups)
    with pytest.raises(ValueError, match="error-feedback buffer does not fit"):
        decode_state(encode_state(opt.state_dict(), [torch.ones(2, 3), torch.ones(4)]), params, groups)
    bad = opt.state_dict()
    bad["state"][1]["exp_avg"] = torch.ones(5)
    with pytest.raises(ValueError, match="has shape"):
        decode_state(encode_state(bad, [torch.ones(3, 2), torch.ones(4)]), params, groups)
    bad["state"][1]["exp_avg"] = torch.full((4,), float("nan"))
    with pytest.raises(ValueError, match="not a finite tensor"):
        decode_state(encode_state(bad, [torch.ones(3, 2), torch.ones(4)]), params, groups)
    # arbitrary pickled objects are refused (weights_only)
    buf = io.BytesIO()
    torch.save({"optimizer": {"state": {}}, "error": [SimpleNamespace(payload="arbitrary object")]}, buf)
    with pytest.raises(ValueError, match="does not load"):
        decode_state(buf.getvalue(), params, groups)


def test_a_data_stream_that_does_not_continue_is_a_lie():
    """A full round draws H batches: the next commitment must continue the same shard at position + H (checked before
    anything is fetched or recomputed)."""
    def meta(position, shard=7):
        return SimpleNamespace(state_sha256="ab" * 32, state_bytes=10, data_position=position, shard_key=shard,
                               client_mode=False)

    a = Audits(SimpleNamespace(audit_rate=1.0, authority=None, averaging_timeout=1.0, inner_steps=20,
                               assigned_data=False), state=None, workload=None, server=None, me="me")
    for nxt, verdict in ((meta(140), AuditOutcome.LIED), (meta(120, shard=8), AuditOutcome.LIED)):
        a._rounds = {3: SimpleNamespace(theta=[], gathered={"p": meta(100)}, contributions={"p": b"c"}),
                     4: SimpleNamespace(theta=[], gathered={"p": nxt}, contributions={"p": b"c"})}
        outcome, why = a.audit(3, "p")
        assert outcome == verdict and "data stream jumped" in why
    a.shutdown()


def test_kept_start_states_and_thetas_live_in_files_not_in_the_nodes_memory(tmp_path):
    """A commitment's start state is served from a read-only map of an unlinked file (peers/spill.py), and the theta
    an audit replays from is a view of another: kept rounds cost page cache, not the node's memory, and equal what
    was committed however the live state moves on."""
    import hashlib
    import mmap

    from dilocox.peers.spill import Spill

    params = [torch.zeros(5, requires_grad=True), torch.zeros(2, 3, requires_grad=True)]
    opt = torch.optim.AdamW(params, lr=0.1)
    sum(p.sum() for p in params).backward()
    opt.step()
    theta = [torch.randn(5), torch.randn(2, 3)]
    offered = {}
    state = SimpleNamespace(inner=SimpleNamespace(inner_optimizer=opt),
                            compressor=SimpleNamespace(error=[torch.ones(5), torch.ones(2, 3)]), control=None,
                            shard=SimpleNamespace(position=0, shard_key=7), outer=SimpleNamespace(global_params=theta))
    a = Audits(SimpleNamespace(audit_rate=1.0, authority=None, averaging_timeout=1.0), state=state, workload=None,
               server=SimpleNamespace(offer=offered.__setitem__), me="me", spill=Spill(tmp_path / "served"))
    a.commit(4, first_step=0)
    blob = offered["state/4"]
    assert isinstance(blob, mmap.mmap) and not list((tmp_path / "served").iterdir())  # mapped, already unlinked
    assert a.gather_fields(4)["state_sha256"] == hashlib.sha256(blob).hexdigest()
    assert bytes(blob) == encode_state(opt.state_dict(), state.compressor.error)
    kept = [t.clone() for t in theta]
    for t in theta:
        t.add_(1.0)  # theta moves on; the round's start stays
    assert all(torch.equal(k, t) for k, t in zip(kept, a._thetas[4]))
    a.shutdown()


def test_probation_audits_a_newcomer_every_round_then_at_the_low_rate():
    """Peers seen contributing for fewer than audit_probation rounds are audited at rate 1, later at audit_rate; a
    member that joins a swarm older than its probation takes those already in it as old."""
    def audits():
        return Audits(SimpleNamespace(audit_rate=0.1, audit_probation=3, authority=None, averaging_timeout=1.0),
                      state=None, workload=None, server=None, me="me")

    def seen(a, r, peers):
        a.observe(r, SimpleNamespace(inputs={p: "d" for p in peers}, gathered={}, contributions={}))

    young = audits()
    seen(young, 1, ["a", "b"])
    seen(young, 2, ["a", "b", "c"])
    assert [young.rate_of("a", r) for r in (1, 2, 3, 4)] == [1.0, 1.0, 1.0, 0.1]
    assert young.rate_of("c", 4) == 1.0 and young.rate_of("c", 5) == 0.1 and young.rate_of("new", 9) == 1.0
    late = audits()
    seen(late, 20, ["a", "b"])
    seen(late, 21, ["a", "b", "c"])
    assert late.rate_of("a", 20) == 0.1 and late.rate_of("c", 21) == 1.0 and late.rate_of("c", 24) == 0.1
    # the drawn targets follow the rates: over rounds, a newcomer is audited every round by someone
    from dilocox import audit

    members = ["a", "b", "c", "me", "x"]
    for r in range(50):
        targets = audit.audit_targets(members, audit.round_randomness(r, {"r": str(r)}),
                                      lambda p: 1.0 if p == "c" else 0.1)
        assert "c" in [t for ts in targets.values() for t in ts]
    young.shutdown()
    late.shutdown()


def test_an_audit_whose_contribution_holds_finishes_when_the_next_round_is_kept():
    """Stage one (the contribution link, as soon as round r is kept) finds most lies a round sooner; an audit it
    passes is PENDING, counted nowhere, and runs again (from its replay on disk) once round r + 1 is observed."""
    calls = []

    def fake(r, peer):
        calls.append((r, peer))
        if (r, peer) == (3, "p"):
            return (AuditOutcome.PENDING if calls.count((3, "p")) == 1 else AuditOutcome.LIED), "faked"
        return AuditOutcome.HONEST, "faked"

    a = Audits(SimpleNamespace(audit_rate=1.0, audit_probation=0, authority=None, averaging_timeout=1.0),
               state=None, workload=None, server=None, me="me")
    a.audit = fake
    a._thetas[3] = []
    a.observe(3, SimpleNamespace(inputs={"p": "d", "me": "d"}, gathered={}, contributions={}))
    _drain(a)
    assert not a.excluded("p") and not a.outcomes and calls == [(3, "p")]
    a._thetas[4] = []  # we took part in round 4 (its record is kept)
    a.observe(4, SimpleNamespace(inputs={"p": "d", "me": "d"}, gathered={}, contributions={}))
    _drain(a)
    assert a.excluded("p") and a.accusations == {"p": 3} and (3, "p") in calls[1:]
    a.shutdown()


def test_assigned_data_is_the_only_data_a_round_may_draw():
    """In a text swarm without --data-seed the swarm assigns round r's batches to (run_id, peer_id, r): a commitment to
    any other stream, or to another position in it, is a lie before anything is fetched or recomputed, even where the
    stream continues the last round's."""
    from dilocox.assignment import assigned_shard_key

    cfg = SimpleNamespace(assigned_data=True, run_id="run", inner_steps=20)

    def meta(shard, position):
        return SimpleNamespace(shard_key=shard, data_position=position)

    assigned = {r: assigned_shard_key("run", "p", r) for r in (3, 4)}
    assert data_lie(cfg, "p", 3, meta(assigned[3], 0), meta(assigned[4], 0)) == ""
    for bad in (meta(assigned[3], 20), meta(7, 0), meta(assigned_shard_key("run", "q", 3), 0),
                meta(assigned_shard_key("other-run", "p", 3), 0)):
        assert "data of its own choosing" in data_lie(cfg, "p", 3, bad, meta(assigned[4], 0))
    # a chosen stream (--data-seed) must continue where the last round ended
    chosen = SimpleNamespace(assigned_data=False, run_id="run", inner_steps=20)
    assert data_lie(chosen, "p", 3, meta(7, 100), meta(7, 120)) == ""
    assert "jumped" in data_lie(chosen, "p", 3, meta(7, 100), meta(8, 120))
    # the assignment is the same everywhere, and differs by peer, round and swarm
    keys = {assigned_shard_key(run, peer, r) for run in ("a", "b") for peer in ("p", "q") for r in range(50)}
    assert len(keys) == 200 and all(0 <= k < 1 << 63 for k in keys)
    with pytest.raises(ValueError, match="round"):
        assigned_shard_key("a", "p", -1)


def test_a_round_that_a_re_sync_moved_onto_another_theta_withdraws_its_commitment():
    """A re-sync that keeps the round's progress re-bases it onto the downloaded theta and zeroes the error feedback:
    the committed start state would recompute to another contribution, so the round goes out with no commitment
    (unauditable, like a joiner's partial round) rather than get its honest author accused."""
    offered = {}
    state = SimpleNamespace(inner=SimpleNamespace(inner_optimizer=torch.optim.SGD([torch.zeros(3, requires_grad=True)],
                                                                                     lr=0.1)),
                            compressor=SimpleNamespace(error=[torch.ones(3)]), control=None,
                            shard=SimpleNamespace(position=40, shard_key=7),
                            outer=SimpleNamespace(global_params=[torch.zeros(3)]))
    a = Audits(SimpleNamespace(audit_rate=1.0, authority=None, averaging_timeout=1.0), state=state, workload=None,
               server=SimpleNamespace(offer=offered.__setitem__), me="me")
    a.commit(4, first_step=0)
    a.commit(5, first_step=0)
    assert a.gather_fields(4)["data_position"] == 40 and "state/4" in offered
    a.withdraw(4)
    assert a.gather_fields(4) == {} and a.gather_fields(5)["shard_key"] == 7  # only that round's
    a.withdraw(9)  # nothing committed there: nothing to do
    a.shutdown()
