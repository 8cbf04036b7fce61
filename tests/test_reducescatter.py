"""Reduce-scatter rounds on a shared index set (peers/reducescatter.py) between real hivemind peers on
loopback: every member gets the same result, the one the in-process rule computes; a member whose values
do not read is dropped by its reducers with the reason; a reducer that never comes, or leaves after the
unions, leaves its range without an update, alike on every other member (what they sent there back in their
buffers), and a member left with no other range fails the round with its buffer as it was; the upload is about
(k - 1) / k x (values + result + proposal + union)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from dilocox.peers.averaging import PhaseResult, RoundFailed, RoundGather
from dilocox.peers.deadlines import RoundTimes
from dilocox.peers.reducescatter import RangeRound, ReduceScatter, ReduceScatterTransport
from dilocox.peers.transport import RoundInput, Screen

from dilocox.experimental.selections import union_positions
from dilocox.shared_index import (
    ReducerFeedback,
    SharedIndexConfig,
    SharedIndexMember,
    proposal_bytes,
    range_slices,
    reduce,
    union_bytes,
    values_bytes,
)
from dilocox.shared_round import SharedCompressor
from tests.helpers import peers_on_loopback

pytestmark = pytest.mark.integration  # hivemind peers (p2pd) or node processes: make test, not make check

CFG = SharedIndexConfig(chunk=256, topk=32, bits=2, result_bits=4, selection="union")
N = 5000  # 20 chunks, the last one short


def _ms(k: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(N, generator=g) * (1 + r) for r in range(k)]


def reduce_scatter(server, me, group, key, member, m, weights, timeout_s, rule="mean", feedback=None, stop=None,
                   gone=None):
    """One member's ReduceScatter round (peers/reducescatter.py)."""
    return ReduceScatter(server, me, timeout_s, rule).run(RangeRound(group, key, member, m, weights, feedback),
                                                          stop=stop, gone=gone)


def _run(peers, ms, key, weights=None, timeout_s=20.0, feedbacks=None):
    """One round on every peer in threads; peer_id -> RangeResults or the exception it raised."""
    group = [p for p, _, _ in peers]
    weights = weights or {p: 30.0 for p in group}
    members = {p: SharedIndexMember(N, CFG) for p in group}
    out = {}

    def one(i, p, server):
        try:
            out[p] = reduce_scatter(server, p, group, key, members[p], ms[i], weights, timeout_s, rule="mean",
                                     feedback=None if feedbacks is None else feedbacks[p])
        except Exception as e:  # noqa: BLE001 (the test reads it)
            out[p] = e

    threads = [threading.Thread(target=one, args=(i, p, s)) for i, (p, s, _) in enumerate(peers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 4)
    return out, members


def test_every_member_gets_the_rules_result_and_a_bad_member_is_dropped_by_its_reducers():
    garble = lambda payload, requester, key: payload[:-1] if "/v" in key else payload  # noqa: E731
    with peers_on_loopback(4, "test_reducescatter", tampers=(None, None, None, garble), keep=8) as peers:
        group = sorted(p for p, _, _ in peers)
        order = {p: i for i, (p, _, _) in enumerate(peers)}
        ms = _ms(4)
        feedbacks = {p: ReducerFeedback(N) for p in group}
        out, members = _run(peers, ms, "rs/1", feedbacks=feedbacks)
        assert all(not isinstance(r, Exception) for r in out.values()), out
        first = out[group[0]]
        for r in out.values():  # one P and one result, bit for bit, on every member
            assert np.array_equal(r.positions, first.positions) and np.array_equal(r.applied, first.applied)
            assert r.digests == first.digests and len(r.digests) == 4
        # the garbling member's values (one byte short) are dropped by the three other reducers, with the reason;
        # its own range keeps its own values
        bad = peers[3][0]
        for p in group:
            if p != bad:
                assert "do not read" in out[p].dropped[bad], out[p].dropped
        # the result is the in-process rule's, range by range, over the members each reducer used
        ref_members = [SharedIndexMember(N, CFG) for _ in range(4)]
        accs = [mem.accumulate([m]) for mem, m in zip(ref_members, ms)]
        positions, _ = union_positions(accs, CFG)
        assert np.array_equal(positions, first.positions)
        sent = {p: ref_members[order[p]].contribute(accs[order[p]], positions) for p in group}
        for mem, p in zip(ref_members, [peers[i][0] for i in range(4)]):
            assert torch.equal(mem.error, members[p].error)  # each member's buffer is what it did not send
        for j, sl in enumerate(range_slices(positions, N, CFG.chunk, 4)):  # (a reducer's buffer starts at zero)
            used = [p for p in group if p == group[j] or p != bad]
            ref = reduce([sent[p][sl] for p in used], [30.0] * len(used), positions[sl], N, CFG)
            assert np.array_equal(ref.applied, first.applied[sl])
        # upload: about (k - 1) / k x (values + result) + (k - 1) x one proposal, and a reducer's quantization
        # error is held by it
        values, result = values_bytes(positions, N, CFG), values_bytes(positions, N, CFG, CFG.result_bits)
        for p, s, _ in peers:
            if p == bad:
                continue
            served = sum(s.served_bytes(f"rs/1/{x}") for x in ["u", "r"] + [f"{y}{j}" for j in range(4) for y in "pv"])
            bound = 3 / 4 * (values + result + proposal_bytes(0, N, CFG, 4) + union_bytes(positions, N, CFG, 4)) + 64
            assert 0.5 * bound < served <= bound, (served, bound)
            assert np.abs(feedbacks[p].error).max() > 0


def test_a_reducer_that_never_comes_or_leaves_before_its_result_leaves_its_range_without_an_update():
    with peers_on_loopback(3, "test_reducescatter_absent", keep=8) as peers:
        quitter, server, _ = peers[2]
        rank = sorted(p for p, _, _ in peers).index(quitter)
        ms = _ms(3, seed=1)
        out, members = _absent(peers, ms, "rs/2")
        (a, r_a), (b, r_b) = sorted(out.items())
        for p, r in out.items():  # no union of its range: that range is left out of P, alike on both members
            assert not isinstance(r, Exception), r
            assert "no union" in r.missing[quitter], r.missing
            sl = range_slices(r.positions, N, CFG.chunk, 3)[rank]
            assert sl.stop == sl.start  # nothing of its range in P
            assert members[p].error.any()  # the other ranges were sent
        assert np.array_equal(r_a.positions, r_b.positions) and np.array_equal(r_a.applied, r_b.applied)
        ms = _ms(3, seed=2)
        # it runs the round until it has served its union (its proposals went out with its union requests), then
        # is gone: no values of ours are taken and no result is served
        quit_out = {}
        quitting = threading.Thread(target=_quit_after_union, args=(server, quitter, [p for p, _, _ in peers], "rs/3",
                                                                    ms[2], quit_out))
        quitting.start()
        out, members = _absent(peers, ms, "rs/3")
        quitting.join(30)
        assert isinstance(quit_out.get("error"), RoundFailed), quit_out
        (a, r_a), (b, r_b) = sorted(out.items())
        assert np.array_equal(r_a.positions, r_b.positions) and np.array_equal(r_a.applied, r_b.applied)
        for i, (p, r) in enumerate(sorted(out.items(), key=lambda kv: [q for q, _, _ in peers].index(kv[0]))):
            assert "no result" in r.missing[quitter], r.missing
            sl = range_slices(r.positions, N, CFG.chunk, 3)[rank]
            assert sl.stop > sl.start and not r.applied[sl].any()  # in P, without an update
            # what it sent there is back in its buffer: m itself (beta e + delta with e = 0)
            there = torch.from_numpy(r.positions[sl])
            assert torch.allclose(members[p].error[there], ms[i][there], atol=1e-6)
        # both others gone: no range but ours, a failed round, the buffer as it was
        alone = peers[:1]
        out, members = _absent(alone, _ms(3, seed=3), "rs/4", group=[p for p, _, _ in peers])
        r = next(iter(out.values()))
        assert isinstance(r, RoundFailed) and "no union or result from any other member" in str(r), r
        assert not next(iter(members.values())).error.any()


def test_a_reducer_serving_different_results_to_different_members_shows_in_their_digests():
    """Equivocation: the members' applied values and digests of its range differ, so the round's result digests
    differ and the daemon's verdict rules (dilocox/consensus.py: majority, skip or re-sync) settle the round."""
    victim = []
    flip = lambda payload, requester, key: (  # noqa: E731
        payload[:-2] + bytes([payload[-2] ^ 0x55]) + payload[-1:] if key.endswith("/r") and requester in victim
        else payload)  # two codes changed (not the last byte, whose padding bits must stay zero)
    with peers_on_loopback(3, "test_reducescatter_equivocate", tampers=(flip,), keep=8) as peers:
        victim.append(peers[1][0])
        out, _ = _run(peers, _ms(3, seed=4), "rs/5")
        liar, fooled, other = peers[0][0], peers[1][0], peers[2][0]
        assert all(not isinstance(r, Exception) for r in out.values()), out
        # the fooled member read other values (or, had the bytes not read, none: its range without an update)
        assert out[fooled].digests.get(liar) != out[other].digests[liar] == out[liar].digests[liar]
        assert not np.array_equal(out[fooled].applied, out[other].applied)
        assert np.array_equal(out[other].applied, out[liar].applied)


class _Gathered:
    """Stands in for the averager's matchmaking and metadata all-gather (tested with real peers in
    tests/test_partial_allreduce.py): every member gets the same gathered metadata."""

    def __init__(self, gathered):
        self.gathered = gathered

    def run_phase(self, bits, codes, gather, weight, control):
        return PhaseResult(codes, dict(self.gathered), 0.1, 0, 0)


def test_the_daemons_round_screens_the_group_and_lists_its_contributors_alike_on_every_member():
    """ReduceScatterTransport (--compression shared): a member that started from other parameters is left out by
    every member alike; the others get one mean, bit for bit, as tensors of the model's shapes, and list the
    same contributors (what weighs their group when a split round's groups unite, daemon/majority.py)."""
    shapes = [(40, 100), (1000,)]  # 5000 values
    with peers_on_loopback(3, "test_reducescatter_daemon", keep=16) as peers:
        ids = [p for p, _, _ in peers]
        meta = RoundGather(outer_step=4, start_digest="d0", weight=20.0)
        gathered = {p: meta.dict() for p in ids}
        gathered["stale"] = RoundGather(outer_step=4, start_digest="other", weight=20.0).dict()
        out = {}

        def one(i, p, server):
            g = torch.Generator().manual_seed(i)
            rnd = SharedCompressor(shapes, CFG).begin([torch.randn(s, generator=g) for s in shapes])
            try:
                transport = ReduceScatterTransport(_Gathered(gathered), server, p, Screen(20.0), request_timeout_s=1.0,
                                                   fetch_timeout_s=10.0)
                out[p] = (transport.exchange(RoundInput(5, rnd, meta, RoundTimes(0.0, 10.0), threading.Event())), rnd)
            except Exception as e:  # noqa: BLE001 (the test reads it)
                out[p] = (e, rnd)

        threads = [threading.Thread(target=one, args=(i, p, s)) for i, (p, s, _) in enumerate(peers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        results = [out[p][0] for p in ids]
        assert all(not isinstance(r, Exception) for r in results), results
        first = results[0]
        assert [tuple(t.shape) for t in first.tensors] == shapes
        for r in results:
            assert all(torch.equal(a, b) for a, b in zip(r.tensors, first.tensors))
            assert "started from other parameters" in r.dropped["stale"]
            assert r.inputs == first.inputs and set(r.inputs) == set(ids)
        assert any(t.abs().sum() > 0 for t in first.tensors)
        assert all(0 < out[p][1].stats.relative_error < 1 for p in ids)  # the round's figures were settled


def _absent(peers, ms, key, group=None):
    """The first two of ``peers`` run a round of ``group`` (all of ``peers``); the others run no round (they may
    have offered something)."""
    group = group or [p for p, _, _ in peers]
    members = {p: SharedIndexMember(N, CFG) for p, _, _ in peers[:2]}
    out = {}

    def one(i, p, server):
        try:
            out[p] = reduce_scatter(server, p, group, key, members[p], ms[i], {q: 1.0 for q in group}, 3.0)
        except Exception as e:  # noqa: BLE001
            out[p] = e

    threads = [threading.Thread(target=one, args=(i, p, s)) for i, (p, s, _) in enumerate(peers[:2])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out, members


def _quit_after_union(server, me, group, key, m, out):
    """A member that leaves a round once it has offered its union (``stop`` holds from then on)."""
    try:
        reduce_scatter(server, me, group, key, SharedIndexMember(N, CFG), m, {q: 1.0 for q in group}, 3.0,
                        stop=lambda: server.offered(f"{key}/u"))
    except Exception as e:  # noqa: BLE001 (the test reads it)
        out["error"] = e


def test_a_member_that_left_mid_round_is_not_waited_for_and_the_others_agree():
    """A member that left (its process gone; ``gone(peers)`` says so, as its DRAINING or STOPPED record does in the
    daemon) costs the others seconds, not the fetch timeout (30 s here); its range is left out of P alike on both
    and their reducers report it. Without ``gone``, a member that sent no proposal is waited for once, not again
    for its values."""
    import time

    with peers_on_loopback(3, "test_reducescatter_left", keep=8) as peers:
        quitter, server, dht = peers[2]
        server.shutdown()
        dht.shutdown()  # it has left: nobody can dial it
        group = [p for p, _, _ in peers]
        members = {p: SharedIndexMember(N, CFG) for p in group[:2]}
        out, ms = {}, _ms(3, seed=4)

        def one(i, p, s, timeout_s, gone):
            began = time.monotonic()
            try:
                out[p] = reduce_scatter(s, p, group, f"rs/{int(timeout_s)}", members[p], ms[i],
                                         {q: 1.0 for q in group}, timeout_s, gone=gone)
            except Exception as e:  # noqa: BLE001 (the test reads it)
                out[p] = e
            out[p, "s"] = time.monotonic() - began

        def run(timeout_s, gone):
            threads = [threading.Thread(target=one, args=(i, p, s, timeout_s, gone))
                       for i, (p, s, _) in enumerate(peers[:2])]
            for t in threads:
                t.start()
            for t in threads:
                t.join(4 * timeout_s)

        run(30.0, lambda peers: {quitter} & set(peers))
        (a, b) = group[:2]
        for p in (a, b):
            r = out[p]
            assert not isinstance(r, Exception), r
            assert out[p, "s"] < 15.0, out[p, "s"]  # not the 30 s fetch timeout
            assert "left mid-round" in r.dropped[quitter] and "no union" in r.missing[quitter], (r.dropped, r.missing)
        assert np.array_equal(out[a].positions, out[b].positions) and np.array_equal(out[a].applied, out[b].applied)
        assert out[a].applied.any()
        out.clear()
        run(8.0, None)  # no news of the leave: one wait of 8 s for its proposal, none for its values
        for p in (a, b):
            assert not isinstance(out[p], Exception), out[p]
            assert 7.5 < out[p, "s"] < 14.0, out[p, "s"]
            assert "no proposal for our range" in out[p].dropped[quitter]


def test_bad_calls_are_refused():
    with peers_on_loopback(1, "test_reducescatter_bad_keep", keep=1) as peers:
        p, s, _ = peers[0]
        with pytest.raises(ValueError, match="needs 2"):
            reduce_scatter(s, p, [p, "a"], "k", SharedIndexMember(N, CFG), torch.zeros(N), {p: 1.0, "a": 1.0}, 1.0)
    with peers_on_loopback(1, "test_reducescatter_bad", keep=4) as peers:
        p, s, _ = peers[0]
        mem = SharedIndexMember(N, CFG)
        with pytest.raises(ValueError, match="not in the group"):
            reduce_scatter(s, p, ["someone-else"], "k", mem, torch.zeros(N), {}, 1.0)
        with pytest.raises(ValueError, match="no weight"):
            reduce_scatter(s, p, [p, "a"], "k", mem, torch.zeros(N), {p: 1.0}, 1.0)
        with pytest.raises(ValueError, match="a chunk per reducer"):
            reduce_scatter(s, p, [p, "a"], "k", SharedIndexMember(200, CFG), torch.zeros(200), {p: 1.0, "a": 1.0},
                            1.0)


def test_a_round_that_went_on_without_us_ends_the_fetches_and_changes_nothing():
    """``stop`` (the daemon's give-up rule after its grace, peers/reducescatter.py ``ReduceScatterTransport``) ends a
    reduce-scatter whose group-mates never serve, about a second after it holds, not after four fetch timeouts;
    the round fails and our buffer is as it was."""
    import time

    with peers_on_loopback(3, "test_reducescatter_stop", keep=8) as peers:
        (me, server, _), group = peers[0], [p for p, _, _ in peers]
        member = SharedIndexMember(N, CFG)
        began = time.monotonic()
        with pytest.raises(RoundFailed, match="abandoned"):
            reduce_scatter(server, me, group, "rs/9", member, _ms(3)[0], {p: 1.0 for p in group}, 30.0,
                            stop=lambda: time.monotonic() - began > 1.0)
        assert time.monotonic() - began < 10.0
        assert not member.error.any()
