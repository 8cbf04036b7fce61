"""Shared index sets (dilocox/shared_index.py, dilocox/experimental/selections.py): who picks the positions, that
every member sends values at them, that nothing leaves the error feedback, the byte counts, and bad input."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dilocox.experimental.selections import (
    index_bytes,
    leader_rank,
    random_positions,
    reduce_by_range,
    union_positions,
)
from dilocox.shared_index import (
    ReducerFeedback,
    Selection,
    SharedIndexConfig,
    SharedIndexMember,
    chunk_ranges,
    decode_proposal,
    decode_union,
    encode_proposal,
    encode_union,
    leader_positions,
    pack_values,
    proposal_bytes,
    proposal_positions,
    reduce,
    union_bytes,
    union_bytes_bound,
    unpack_values,
    value_range,
    values_bytes,
)
from dilocox.sparse import ContributionError, SparseCodec, SparseConfig

CFG = SharedIndexConfig(chunk=64, topk=4, bits=2, result_bits=2, beta=0.9)
N = 211  # 3 whole chunks and a short last one (19 values)


def _chunks(n=N, chunk=64):
    return [(a, min(a + chunk, n)) for a in range(0, n, chunk)]


def test_the_leader_picks_the_largest_values_of_each_chunk_and_the_leader_rotates():
    m = torch.randn(N, generator=torch.Generator().manual_seed(1))
    pos = leader_positions(m, CFG)
    assert list(pos) == sorted(set(pos.tolist())) and pos.max() < N
    for a, b in _chunks():
        kept = [p for p in pos if a <= p < b]
        assert len(kept) == 4
        dropped = [p for p in range(a, b) if p not in set(kept)]
        assert min(abs(float(m[p])) for p in kept) >= max(abs(float(m[p])) for p in dropped)
    assert [leader_rank(t, 3) for t in range(1, 8)] == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(ValueError, match="at least one member"):
        leader_rank(1, 0)


def test_the_union_holds_every_members_largest_values_of_each_chunk():
    g = torch.Generator().manual_seed(2)
    ms = [torch.randn(N, generator=g) for _ in range(3)]
    pos, nbytes = union_positions(ms, CFG)  # ceil(4 / 3) = 2 per member and chunk
    assert list(pos) == sorted(set(pos.tolist()))
    own = SharedIndexConfig(chunk=64, topk=2)
    for m in ms:
        assert set(leader_positions(m, own).tolist()) <= set(pos.tolist())
    for a, b in _chunks():
        assert 2 <= len([p for p in pos if a <= p < b]) <= 6
    assert nbytes == sum(index_bytes(leader_positions(m, own), N, own) for m in ms)
    with pytest.raises(ValueError, match="no member"):
        union_positions([], CFG)


def test_random_positions_are_the_same_on_every_member_and_change_every_round():
    a, b = random_positions(N, CFG, 5, 3), random_positions(N, CFG, 5, 3)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, random_positions(N, CFG, 5, 4))
    for lo, hi in _chunks():  # the short last chunk too: padding is never drawn
        assert len([p for p in a if lo <= p < hi]) == min(4, hi - lo)
    assert list(a) == sorted(set(a.tolist())) and a.max() < N
    assert index_bytes(a, N, SharedIndexConfig(chunk=64, topk=4, selection="random")) == 0


def _round(replicas=4, seed=0, rule="mean"):
    g = torch.Generator().manual_seed(seed)
    members = [SharedIndexMember(N, CFG) for _ in range(replicas)]
    for mem in members:  # a buffer carried over from earlier rounds
        mem.error = torch.randn(N, generator=g)
    before = [mem.error.clone() for mem in members]
    deltas = [[torch.randn(11, 19, generator=g) * (1 + r), torch.randn(2, generator=g)] for r in range(replicas)]
    ms = [mem.accumulate(d) for mem, d in zip(members, deltas)]
    pos = leader_positions(ms[leader_rank(2, replicas)], CFG)
    sent = [mem.contribute(m, pos) for mem, m in zip(members, ms)]
    weights = [float(1 + r) for r in range(replicas)]
    red = reduce(sent, weights, pos, N, CFG, rule)
    return members, before, deltas, ms, pos, sent, weights, red


def test_every_member_sends_its_own_values_at_the_leaders_positions_within_the_quantizer_bound():
    members, _, _, ms, pos, sent, _, _ = _round()
    for m, s, mem in zip(ms, sent, members):
        for a, b in _chunks():
            sel = (pos >= a) & (pos < b)
            scale = float(m[torch.from_numpy(pos[sel])].abs().max())
            assert np.abs(m[torch.from_numpy(pos[sel])].numpy() - s[sel]).max() <= scale / 4 + 1e-6
        # what was not sent stays in the buffer, what was sent left it
        off = np.setdiff1d(np.arange(N), pos)
        assert torch.equal(mem.error[torch.from_numpy(off)], m[torch.from_numpy(off)])
        assert torch.allclose(mem.error[torch.from_numpy(pos)], m[torch.from_numpy(pos)] - torch.from_numpy(s))


def test_nothing_leaves_the_error_feedback():
    """Weighted mean rule: mean of what the buffers keep + what is applied = the mean of beta e + delta."""
    members, _, _, ms, pos, sent, weights, red = _round()
    assert np.abs(red.residual).max() > 0  # the 2-bit result did drop something
    for mem in members:
        mem.restore(pos, red.residual)
    w = torch.tensor(weights) / sum(weights)
    kept = sum(wi * mem.error for wi, mem in zip(w, members))
    applied = torch.zeros(N)
    applied[torch.from_numpy(pos)] = torch.from_numpy(red.applied)
    target = sum(wi * m for wi, m in zip(w, ms))
    torch.testing.assert_close(kept + applied, target, atol=1e-5, rtol=1e-5)
    # the result is the weighted mean on the positions, to its quantizer's bound
    exact = sum(wi * torch.from_numpy(s) for wi, s in zip(w, sent)).numpy()
    assert np.abs(exact - red.applied).max() <= np.abs(exact).max() / 4 + 1e-6


def test_a_range_of_chunks_reduces_to_that_range_of_the_whole_under_a_coordinate_wise_rule():
    _, _, _, _, pos, sent, weights, red = _round(rule="trimmed-mean")
    sel = (pos >= 64) & (pos < 192)
    part = reduce([s[sel] for s in sent], weights, pos[sel], N, CFG, "trimmed-mean")
    assert np.array_equal(part.applied, red.applied[sel])


def test_a_reducer_keeps_what_quantizing_its_results_dropped_and_applies_it_later():
    """ReducerFeedback (DoubleSqueeze): over rounds, the applied results plus the reducer's buffer sum to the
    aggregates exactly; the members' buffers get nothing; and the fixed chunk ranges partition the chunks."""
    fb = ReducerFeedback(N)
    total_agg, total_applied = np.zeros(N, np.float32), np.zeros(N, np.float32)
    for t in range(5):
        members, _, _, _, pos, sent, weights, plain = _round(seed=t)
        red = reduce(sent, weights, pos, N, CFG, feedback=fb)
        assert not red.residual.any() and red.result_bytes == plain.result_bytes
        total_agg[pos] += plain.applied + plain.residual  # the unquantized aggregate A
        total_applied[pos] += red.applied
    np.testing.assert_allclose(total_applied + fb.error, total_agg, atol=1e-5)
    assert np.abs(fb.error).max() > 0  # 2-bit results did drop something, and it is held
    # range by range, as a reduce-scatter's reducers: the whole's result under a coordinate-wise rule
    _, _, _, _, pos, sent, weights, red = _round(rule="median")
    assert np.array_equal(reduce_by_range(sent, weights, pos, N, CFG, "median").applied, red.applied)
    assert chunk_ranges(N, 64, 3) == [(0, 1), (1, 2), (2, 4)]
    assert chunk_ranges(N, 64, 6)[:2] == [(0, 0), (0, 1)]  # more reducers than chunks: some reduce nothing
    with pytest.raises(ValueError, match="at least one member"):
        chunk_ranges(N, 64, 0)


def test_byte_counts_match_the_sparse_codec():
    """A leader's index set is the Rice-coded index part of a sparse contribution with the same selection."""
    m = torch.randn(N, generator=torch.Generator().manual_seed(3))
    pos = leader_positions(m, CFG)
    payload = SparseCodec([(N,)], SparseConfig(chunk=64, topk=4, bits=2, beta=0.0, rice=True)).encode([m])
    values = values_bytes(pos, N, CFG)
    assert values == 4 * 4 + 4 * 1  # per chunk an fp32 scale and 4 x 2 bits
    assert len(payload) - 24 - 4 * 4 - 4 * 1 - index_bytes(pos, N, CFG) in (0, 1)  # two streams, each byte-padded
    assert values_bytes(pos, N, CFG, 0) == 4 * len(pos)
    assert reduce([np.zeros(len(pos), np.float32)], [1.0], pos, N, CFG).result_bytes == values


def test_bad_input_is_refused_and_the_buffer_is_kept():
    for kw, match in [(dict(topk=0), "topk"), (dict(bits=3), "bits"), (dict(result_bits=5), "result_bits"),
                      (dict(beta=1.5), "beta"), (dict(selection="vote"), "vote")]:
        with pytest.raises(ValueError, match=match):
            SharedIndexConfig(**kw)
    mem = SharedIndexMember(N, CFG)
    mem.error = torch.ones(N)
    with pytest.raises(ValueError, match="non-finite"):
        mem.accumulate([torch.full((N,), float("nan"))])
    with pytest.raises(ValueError, match="210 values"):
        mem.accumulate([torch.zeros(210)])
    assert torch.equal(mem.error, torch.ones(N))
    with pytest.raises(ValueError, match="non-finite"):
        leader_positions(torch.full((N,), float("inf")), CFG)
    pos = leader_positions(torch.randn(N), CFG)
    with pytest.raises(ValueError, match="every row"):
        reduce([np.zeros(len(pos) - 1, np.float32)], [1.0], pos, N, CFG)
    with pytest.raises(ValueError, match="no contribution"):
        reduce([], [], pos, N, CFG)
    assert SharedIndexConfig(selection="random").selection is Selection.RANDOM


def test_proposals_unions_and_values_on_the_wire_read_back_and_bad_bytes_get_a_clear_error():
    m = torch.randn(N, generator=torch.Generator().manual_seed(5))
    for k in (1, 2, 4):
        mine = proposal_positions(m, CFG, k)
        assert np.array_equal(mine, leader_positions(m, SharedIndexConfig(chunk=64, topk=-(-4 // k))))
        ranges = [value_range(N, 64, k, j) for j in range(k)]
        assert ranges[0][0] == 0 and ranges[-1][1] == N and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        back = []
        for lo, hi in ranges:
            wire = encode_proposal(mine, lo, hi, CFG, k)
            assert len(wire) <= proposal_bytes(lo, hi, CFG, k)
            back.append(decode_proposal(wire, lo, hi, CFG, k))
        assert np.array_equal(np.concatenate(back), mine)
    lo, hi = value_range(N, 64, 2, 1)  # chunks 2 and 3 (the short one): 128 .. 211
    wire = encode_proposal(proposal_positions(m, CFG, 2), lo, hi, CFG, 2)
    for bad, match in [(wire[:-1], "expected"), (wire + b"\0", "expected"), (b"\1" * 3, "truncated"),
                       (bytes(8) + wire[8:], "unary stream")]:
        with pytest.raises(ContributionError, match=match):
            decode_proposal(bad, lo, hi, CFG, 2)
    with pytest.raises(ContributionError):  # the same bytes read as a proposal of a group of 4: another count
        decode_proposal(wire, lo, hi, CFG, 4)
    with pytest.raises(ValueError, match="starts at a chunk"):
        encode_proposal(proposal_positions(m, CFG, 2), 5, hi, CFG, 2)
    # a union: any count up to the bound, the empty one included
    union = np.unique(np.r_[proposal_positions(m, CFG, 1), [130, 131, 210]])
    for sel in (union, np.zeros(0, np.int64)):
        wire = encode_union(sel, lo, hi)
        assert np.array_equal(decode_union(wire, lo, hi, 80), sel[(sel >= lo) & (sel < hi)])
        assert len(wire) <= union_bytes_bound(lo, hi, 80)
    with pytest.raises(ContributionError, match="at most 3"):
        decode_union(encode_union(union, lo, hi), lo, hi, 3)
    with pytest.raises(ContributionError):
        decode_union(encode_union(union, lo, hi)[:-1], lo, hi, 80)
    assert union_bytes(union, N, CFG, 2) == sum(len(encode_union(union, *value_range(N, 64, 2, j))) for j in (0, 1))
    pos = leader_positions(m, CFG)
    for bits in (0, 1, 2, 4, 8):
        payload, decoded = pack_values(m[torch.from_numpy(pos)].numpy(), pos, N, CFG.chunk, bits)
        assert len(payload) == values_bytes(pos, N, CFG, bits)
        assert np.array_equal(unpack_values(payload, pos, N, CFG.chunk, bits), decoded)
        # a range of chunks packed alone decodes to the same values (what a reducer of that range gets)
        sel = pos >= 128
        part, alone = pack_values(m[torch.from_numpy(pos[sel])].numpy(), pos[sel], N, CFG.chunk, bits)
        assert np.array_equal(alone, decoded[sel])
        with pytest.raises(ContributionError, match="expected"):
            unpack_values(payload[:-1], pos, N, CFG.chunk, bits)
    payload, _ = pack_values(m[torch.from_numpy(pos)].numpy(), pos, N, CFG.chunk, 2)
    with pytest.raises(ContributionError, match="scale"):
        unpack_values(np.float32(-1).tobytes() + payload[4:], pos, N, CFG.chunk, 2)
    with pytest.raises(ContributionError, match="non-finite"):
        unpack_values(np.full(len(pos), np.nan, np.float32).tobytes(), pos, N, CFG.chunk, 0)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=80))
def test_any_bytes_read_as_a_proposal_or_values_give_positions_or_a_contribution_error(data):
    pos = np.arange(0, N, 5)
    for read in (lambda: decode_proposal(data, 0, N, CFG, 2), lambda: decode_union(data, 64, N, 40),
                 lambda: unpack_values(data, pos[:40], N, 64, 2)):
        try:
            out = read()
        except ContributionError:
            continue
        assert np.isfinite(np.asarray(out, dtype=np.float64)).all()

