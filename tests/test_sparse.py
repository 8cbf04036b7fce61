"""SparseLoCo codec (dilocox/sparse/): round trip, exact sizes, error feedback, deterministic
aggregation, and rejection of malformed contributions."""

import math
import random
import struct

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dilocox import sparse
from dilocox.sparse import ContributionError, SparseCodec, SparseConfig, aggregate, decode, payload_bytes

SHAPES = [(30, 20), (77,), (5, 7, 3)]  # 782 values: 4 chunks of 195 and a last one of 2 (< topk)
CFG = SparseConfig(chunk=195, topk=12, bits=2, beta=0.95)  # not a power of two: 8-bit indices can overflow
NIDX = 4 * 12 + 2


def randn(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def expected_round_trip(x: torch.Tensor, cfg: SparseConfig) -> torch.Tensor:
    """Top-k of each chunk, quantized by the documented mid-rise rule, zeros elsewhere (loops, no codec)."""
    out = torch.zeros_like(x)
    m = 2 ** (cfg.bits - 1)
    for start in range(0, len(x), cfg.chunk):
        c = x[start:start + cfg.chunk]
        top = np.argsort(-c.abs().numpy(), kind="stable")[:cfg.topk]
        s = float(c.abs().max())
        for i in top:
            code = min(max(math.floor((float(c[i]) / s + 1) * m), 0), 2 * m - 1)
            out[start + i] = s * (2 * code + 1 - 2 * m) / (2 * m)
    return out


def test_config_validation_names_the_field():
    for kwargs, field in (({"chunk": 1}, "chunk"), ({"topk": 0}, "topk"), ({"chunk": 64, "topk": 65}, "topk"),
                          ({"bits": 3}, "bits"), ({"beta": 1.5}, "beta"), ({"beta": float("nan")}, "beta")):
        with pytest.raises(ValueError, match=field):
            SparseConfig(**kwargs)
    assert SparseConfig().index_bits == 12 and SparseConfig(chunk=200).index_bits == 8


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_round_trip_is_quantized_topk_and_zero_elsewhere(bits):
    cfg = SparseConfig(chunk=195, topk=12, bits=bits)
    x = randn(SHAPES, bits)
    codec = SparseCodec(SHAPES, cfg)
    out = decode(codec.encode(x), SHAPES, cfg)
    flat_x = torch.cat([t.reshape(-1) for t in x])
    flat_out = torch.cat([t.reshape(-1) for t in out])
    want = expected_round_trip(flat_x, cfg)
    assert torch.equal(flat_out, want)
    assert int((flat_out != 0).sum()) == NIDX
    for start in range(0, len(flat_x), cfg.chunk):  # error bound s / 2^bits on what was sent
        sl = slice(start, start + cfg.chunk)
        sent = flat_out[sl] != 0
        s = float(flat_x[sl].abs().max())
        assert float((flat_out[sl] - flat_x[sl])[sent].abs().max()) <= s / 2**bits + s * 2**-20  # fp32 rounding
    # first round: e = x exactly, then e - decode(payload)
    assert all(torch.equal(e, xi - oi) for e, xi, oi in zip(codec.error, x, out))


@pytest.mark.parametrize("n,chunk,topk,bits", [(782, 200, 12, 2), (3 * 256 + 5, 256, 16, 4), (1000, 100, 100, 8),
                                               (4096 * 3, 4096, 64, 2), (1, 4096, 64, 2)])
def test_payload_length_is_exact(n, chunk, topk, bits):
    cfg = SparseConfig(chunk=chunk, topk=topk, bits=bits)
    nchunks = math.ceil(n / chunk)
    last = n - (nchunks - 1) * chunk
    nidx = (nchunks - 1) * topk + min(topk, last)
    idx_bits = math.ceil(math.log2(chunk))
    formula = 24 + 4 * nchunks + math.ceil(nidx * idx_bits / 8) + math.ceil(nidx * bits / 8)
    codec = SparseCodec([(n,)], cfg)
    payload = codec.encode([torch.randn(n)])
    assert len(payload) == formula == payload_bytes([(n,)], cfg) == codec.payload_bytes()
    assert int((decode(payload, [(n,)], cfg)[0] != 0).sum()) == nidx


def test_zero_chunks_decode_to_zeros_and_never_send_padding():
    cfg, n = SparseConfig(chunk=256, topk=16), 3 * 256 + 20
    x = torch.randn(n)
    x[256:512] = 0.0  # scale 0
    x[-20:] = 0.0  # short last chunk of zeros: its picks tie with the padding
    codec = SparseCodec([(n,)], cfg)
    out = decode(codec.encode([x]), [(n,)], cfg)[0]  # the decoder rejects a picked padding position
    assert not bool(out[256:512].any()) and not bool(out[-20:].any())
    assert int((out != 0).sum()) == 2 * 16 and torch.equal(codec.error[0], x - out)


def test_default_config_compresses_over_100x():
    n = 1_000_000
    payload = SparseCodec([(n,)]).encode([torch.randn(n)])
    assert n * 4 / len(payload) >= 100  # 140.6x: 116 bytes per 4096 values


def test_error_feedback_beta_one_sends_everything_eventually():
    cfg = SparseConfig(chunk=64, topk=8, bits=2, beta=1.0)
    n, rounds = 4096, 60
    codec = SparseCodec([(n,)], cfg)
    g = torch.Generator().manual_seed(1)
    drift = torch.randn(n, generator=g)
    true_sum, sent_sum, norms = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64), []
    for _ in range(rounds):
        delta = drift + torch.randn(n, generator=g)
        sent = decode(codec.encode([delta]), [(n,)], cfg)[0]
        true_sum += delta.double()
        sent_sum += sent.double()
        # nothing is lost: what was not sent yet is exactly the buffer
        assert torch.allclose(true_sum - sent_sum, codec.error[0].double(), atol=1e-4, rtol=0)
        norms.append(float(codec.error[0].norm()))
    assert max(norms[30:]) <= 1.5 * max(norms[:30])  # bounded: it does not grow with the rounds
    assert float((true_sum - sent_sum).norm() / true_sum.norm()) < 0.1


def test_error_feedback_recurrence_with_decay_is_exact():
    codec = SparseCodec(SHAPES, CFG)
    e0, delta = randn(SHAPES, 10), randn(SHAPES, 11)
    codec.load_state_dict({"error": e0})
    out = decode(codec.encode(delta), SHAPES, CFG)
    for e, a, d, o in zip(codec.error, e0, delta, out):
        assert torch.equal(e, (0.95 * a + d) - o)
    flat = torch.cat([(0.95 * a + d).reshape(-1) for a, d in zip(e0, delta)])
    assert torch.equal(torch.cat([o.reshape(-1) for o in out]), expected_round_trip(flat, CFG))


def peer_payloads(k, shapes=SHAPES, cfg=CFG):
    return {f"peer{i}": SparseCodec(shapes, cfg).encode(randn(shapes, 100 + i)) for i in range(k)}


def test_aggregate_is_order_independent_and_equals_float64_reference():
    payloads = peer_payloads(5)
    weights = {p: w for p, w in zip(payloads, [100.0, 37.0, 1.0, 0.3, 99.0])}
    ref = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    for p in sorted(payloads):
        for r, d in zip(ref, decode(payloads[p], SHAPES, CFG)):
            r += weights[p] * d.double()
    ref = [(r / sum(weights[p] for p in sorted(payloads))).float() for r in ref]
    first, rejected = aggregate(payloads, weights, SHAPES, CFG)
    assert rejected == {} and all(torch.equal(a, b) for a, b in zip(first, ref))
    rng = random.Random(0)
    for _ in range(5):
        keys = list(payloads)
        rng.shuffle(keys)
        wkeys = list(weights)
        rng.shuffle(wkeys)
        out, _ = aggregate({k: payloads[k] for k in keys}, {k: weights[k] for k in wkeys}, SHAPES, CFG)
        assert all(torch.equal(a, b) for a, b in zip(out, first))


def test_aggregate_sums_in_sorted_peer_order():
    # float64 hides the order for ordinary data; here it does not: 7.5e19 + 1 == 7.5e19 in float64
    cfg, shapes = SparseConfig(chunk=2, topk=1), [(1,)]
    values = {"a": 1e20, "c": 4.0 / 3.0, "b": -1e20}  # decoded as 3/4 of each (2 bits, one value per chunk)
    payloads = {p: SparseCodec(shapes, cfg).encode([torch.tensor([v])]) for p, v in values.items()}
    small = float(decode(payloads["c"], shapes, cfg)[0])
    for order in (["a", "c", "b"], ["c", "b", "a"], ["b", "a", "c"]):
        out, _ = aggregate({p: payloads[p] for p in order}, dict.fromkeys(order, 1.0), shapes, cfg)
        assert float(out[0]) == float(torch.tensor(small / 3.0, dtype=torch.float32)) != 0.0


def sent_positions(payload: bytes, cfg: SparseConfig, shapes=SHAPES) -> np.ndarray:
    n = sum(math.prod(s) for s in shapes)
    return sparse.positions(sparse.parse(payload, n, cfg)[0], sparse.layout(n, cfg), cfg)


@pytest.mark.parametrize("rule", ["mean", "centered-clip", "trimmed-mean", "median"])
@pytest.mark.parametrize("k", [1, 2, 4, 5])
def test_aggregate_is_the_rule_on_the_sorted_union_of_the_sent_positions(rule, k):
    """sparse.aggregate runs the rule on the sorted union of the sent positions (zeros where a contribution did not
    send one), every other position +0.0: the bits of tests/robust_reference.py's plain reference on those vectors,
    with a scaled attacker that the norm bound clips, partly overlapping supports and a chunk of zeros (a zero
    scale: its values decode to +-0.0 but its positions are sent)."""
    from dilocox import robust
    from tests.robust_reference import reference_aggregate, same_bits

    cfg = SparseConfig(chunk=195, topk=12, bits=2, beta=0.95, rice=True)
    grads = [[t * (50.0 if i == 1 else 1.0) for t in randn(SHAPES, 100 + i % 3)] for i in range(k)]
    grads[0][0][:10] = 0.0  # the first chunk of peer0 (195 values): all zeros
    payloads = {f"peer{i}": SparseCodec(SHAPES, cfg).encode(g) for i, g in enumerate(grads)}
    assert np.frombuffer(payloads["peer0"], "<f4", 1, sparse.HEADER_BYTES + sparse.UNARY.size)[0] == 0.0
    weights = {p: 1.0 + i for i, p in enumerate(payloads)}
    union = torch.from_numpy(np.unique(np.concatenate([sent_positions(b, cfg) for b in payloads.values()])))
    dense = {p: torch.cat([d.reshape(-1) for d in decode(payloads[p], SHAPES, cfg)]) for p in sorted(payloads)}
    want = reference_aggregate([v[union] for v in dense.values()], list(weights.values()), rule)
    fast, report = robust.aggregate({p: v[union] for p, v in dense.items()}, weights, rule, norm_bound=2.0)
    assert same_bits(fast, want) and (k < 2 or report["clipped"])  # the attacker was clipped: the bound is exercised
    out, rejected = aggregate(payloads, weights, SHAPES, cfg, rule=rule, norm_bound=2.0)
    flat = torch.cat([o.reshape(-1) for o in out])
    expected = torch.zeros(len(flat))
    expected[union] = want.float()
    assert rejected == {} and same_bits(flat.double(), expected.double())  # -0.0 nowhere
    # the scales the norm bound gave (SCAFFOLD's quiet restart reads them): the rule's own, for the same bits
    again, _, scaled = sparse.aggregate_scaled(payloads, weights, SHAPES, cfg, rule=rule, norm_bound=2.0)
    assert scaled == pytest.approx(report["clipped"]) and all(0 < v < 1 for v in scaled.values())
    assert same_bits(torch.cat([o.reshape(-1) for o in again]).double(), flat.double())


def test_aggregate_has_the_same_bits_with_one_thread_or_two_and_any_order():
    shapes, cfg = [(40_000,), (1_000, 33)], SparseConfig(chunk=4096, topk=128, rice=True)
    payloads = {f"p{i}": SparseCodec(shapes, cfg).encode([t * (30.0 if i == 2 else 1.0)
                                                          for t in randn(shapes, 200 + i % 4)]) for i in range(6)}
    weights = {p: 10.0 + i for i, p in enumerate(payloads)}
    threads = torch.get_num_threads()
    try:
        for rule in ("centered-clip", "mean", "median", "trimmed-mean"):
            outs = []
            for n, order in ((1, 1), (2, -1), (2, 1), (1, -1)):
                torch.set_num_threads(n)
                ordered = dict(sorted(payloads.items())[::order])
                outs.append(torch.cat([o.reshape(-1) for o in aggregate(ordered, weights, shapes, cfg, rule=rule,
                                                                          norm_bound=2.0)[0]]))
            assert all(torch.equal(o.view(torch.int32), outs[0].view(torch.int32)) for o in outs[1:]), rule
    finally:
        torch.set_num_threads(threads)


def test_union_ranks_every_sent_position():
    rng = np.random.default_rng(1)
    for trial in range(150):
        chunk = int(rng.choice([2, 3, 7, 64, 195, 4096]))
        cfg = SparseConfig(chunk=chunk, topk=int(rng.integers(1, chunk + 1)), rice=bool(trial % 2))
        lay = sparse.layout(int(rng.integers(0, 5 * chunk + 3)), cfg)
        idxs = []
        for i in range(int(rng.integers(1, 10))):
            parts = [np.sort(rng.choice(length, min(cfg.topk, length), replace=False)) if rng.random() < 0.5
                     else np.arange(min(cfg.topk, length))
                     for length in [chunk] * (lay.nchunks - 1) + [lay.last] * (lay.nchunks > 0)]
            idxs.append(np.concatenate(parts).astype([np.int64, np.int32, np.uint16][trial % 3]) if parts
                        else np.zeros(0, np.int64))
        positions = [sparse.positions(x, lay, cfg) for x in idxs]
        union, ranks = sparse.union(idxs, lay, cfg)
        assert np.array_equal(union, np.unique(np.concatenate(positions))), trial
        for i, pos in enumerate(positions):
            assert np.array_equal(ranks[:, i], np.searchsorted(union, pos)), trial


def reference_pack(values, width: int) -> bytes:
    bits = [(int(v) >> j) & 1 for v in values for j in range(width)]
    bits += [0] * (-len(bits) % 8)
    return bytes(sum(b << j for j, b in enumerate(bits[i:i + 8])) for i in range(0, len(bits), 8))


@pytest.mark.parametrize("width", range(1, 33))
def test_bit_packing_of_every_width(width):
    rng = np.random.default_rng(width)
    for count in (0, 1, 2, 3, 7, 8, 9, 100, 1001):
        values = torch.from_numpy(rng.integers(0, 2**width, count, dtype=np.int64))
        packed = sparse.pack_bits(values, width)
        assert packed == reference_pack(values.tolist(), width)
        assert torch.equal(sparse.unpack_bits(b"ab" + packed + b"\xff", 2, count, width, "x"), values)
        if count * width % 8:
            bad = bytearray(packed)
            bad[-1] |= 0x80
            with pytest.raises(ContributionError, match="padding bits after the last x"):
                sparse.unpack_bits(bytes(bad), 0, count, width, "x")


def test_encode_ties_go_to_the_lowest_positions_and_threads_change_nothing():
    cfg, n = SparseConfig(chunk=64, topk=8, bits=4), 64 * 40 + 9
    x = torch.randn(n)
    x[64:128] = 0.5  # all tied
    x[128:192] = torch.rand(64) * 0.1
    x[[130, 140, 150]] = 5.0
    x[131:191:6] = -3.0  # 10 values tie for the last 5 places
    payloads = set()
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            payloads.add(SparseCodec([(n,)], cfg).encode([x]))
    finally:
        torch.set_num_threads(threads)
    assert len(payloads) == 1
    out = decode(payloads.pop(), [(n,)], cfg)[0]
    assert torch.equal(out, expected_round_trip(x, cfg))  # the stable-argsort reference: lowest positions first
    assert torch.equal(torch.nonzero(out[64:128]).flatten(), torch.arange(8))
    assert torch.equal(torch.nonzero(out[128:192]).flatten(), torch.tensor([2, 3, 9, 12, 15, 21, 22, 27]))


@pytest.mark.parametrize("where", [0, 100, 4095, 4096 * 3 + 2])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_encode_rejects_a_non_finite_value_anywhere(where, bad):
    n = 4096 * 3 + 3  # a short last chunk (3 < topk)
    codec = SparseCodec([(n,)], SparseConfig(topk=128))
    x = torch.randn(n)
    x[where] = bad
    with pytest.raises(ValueError, match="non-finite"):
        codec.encode([x])
    x = torch.randn(n)
    x[:4096] = float("nan")  # a whole chunk
    with pytest.raises(ValueError, match="non-finite"):
        codec.encode([x])
    codec.load_state_dict({"error": [torch.full((n,), 3e38)]})
    with pytest.raises(ValueError, match="overflows"):
        codec.encode([torch.full((n,), 3e38)])


def sections(payload: bytes, cfg=CFG, shapes=SHAPES):
    lay = sparse.layout(sum(math.prod(s) for s in shapes), cfg)
    off = sparse.HEADER_BYTES
    scales = np.frombuffer(payload, "<f4", lay.nchunks, off).copy()
    off += 4 * lay.nchunks
    idx = sparse.unpack_bits(payload, off, lay.nidx, cfg.index_bits, "index")
    codes = sparse.unpack_bits(payload, off + lay.index_bytes, lay.nidx, cfg.bits, "code")
    return payload[:sparse.HEADER_BYTES], scales, idx, codes


def rebuild(header, scales, idx, codes, cfg=CFG):
    return header + scales.astype("<f4").tobytes() + sparse.pack_bits(idx, cfg.index_bits) + \
        sparse.pack_bits(codes, cfg.bits)


def malformed(good: bytes) -> dict[str, tuple[bytes, str]]:
    """name -> (payload, words the rejection must contain)."""
    header, scales, idx, codes = sections(good)
    assert rebuild(header, scales, idx, codes) == good

    def with_idx(f):
        i = idx.clone()
        f(i)
        return rebuild(header, scales, i, codes)

    def with_scale(v):
        s = scales.copy()
        s[1] = v
        return rebuild(header, s, idx, codes)

    def with_header(**kw):
        fields = dict(zip(["magic", "version", "bits", "flags", "total", "chunk", "topk"],
                          struct.unpack("<4sHBBQII", header)))
        fields.update(kw)
        return struct.pack("<4sHBBQII", *fields.values()) + good[len(header):]

    def set_(i, pos, v):
        i[pos] = v

    def swap(i):
        i[0], i[1] = int(i[1]), int(i[0])

    k = CFG.topk
    padded = bytearray(good)
    padded[-1] |= 0x80  # 50 codes * 2 bits = 100 bits: the last byte's top 4 bits are padding
    return {
        "truncated": (good[:-1], "truncated"),
        "short header": (good[:10], "truncated header"),
        "oversized": (good + b"\x00", "oversized"),
        "out of range": (with_idx(lambda i: set_(i, k - 1, 250)), "out of range"),
        "last chunk out of range": (with_idx(lambda i: set_(i, len(i) - 1, 190)), "of 2 values"),
        "duplicate": (with_idx(lambda i: set_(i, 1, int(i[0]))), "duplicate"),
        "unsorted": (with_idx(swap), "unsorted"),
        "nan scale": (with_scale(float("nan")), "non-finite scale"),
        "inf scale": (with_scale(float("inf")), "non-finite scale"),
        "negative scale": (with_scale(-1.0), "negative scale"),
        "magic": (with_header(magic=b"XXXX"), "magic"),
        "version": (with_header(version=2), "version"),
        "flags": (with_header(flags=2), "flags"),
        "rice flag": (with_header(flags=1), "index coding rice disagrees"),
        "bits": (with_header(bits=4), "bits=4"),
        "chunk": (with_header(chunk=256), "chunk=256"),
        "topk": (with_header(topk=11), "topk=11"),
        "total": (with_header(total=781), "total values=781"),
        "padding": (bytes(padded), "padding bits"),
        "not bytes": ("hello", "not bytes"),
    }


def test_malformed_contributions_are_rejected_and_the_rest_aggregates():
    good = peer_payloads(2)
    weights = {"peer0": 2.0, "peer1": 1.0}
    bad = malformed(good["peer0"])
    for name, (payload, words) in bad.items():
        with pytest.raises(ContributionError, match=words):
            decode(payload, SHAPES, CFG)
    contributions = dict(good, **{f"bad {name}": p for name, (p, _) in bad.items()})
    weights.update({f"bad {name}": 1.0 for name in bad})
    for name, w in (("zero", 0.0), ("negative", -1.0), ("nan", float("nan")), ("inf", float("inf"))):
        contributions[f"weight {name}"] = good["peer1"]
        weights[f"weight {name}"] = w
    contributions["weight missing"] = good["peer1"]
    out, rejected = aggregate(contributions, weights, SHAPES, CFG)
    assert set(rejected) == set(contributions) - set(good)
    for name, (_, words) in bad.items():
        assert words in rejected[f"bad {name}"]
    assert all("weight" in rejected[p] for p in rejected if p.startswith("weight"))
    clean, _ = aggregate(good, {"peer0": 2.0, "peer1": 1.0}, SHAPES, CFG)
    assert all(torch.equal(a, b) for a, b in zip(out, clean))
    with pytest.raises(ValueError, match="no contribution accepted"):
        aggregate({"x": bad["truncated"][0]}, {"x": 1.0}, SHAPES, CFG)


def test_encode_rejects_bad_input_and_keeps_its_buffers():
    codec = SparseCodec(SHAPES, CFG)
    codec.encode(randn(SHAPES, 3))
    before = {"error": [t.clone() for t in codec.state_dict()["error"]]}
    with pytest.raises(ValueError, match="shapes"):
        codec.encode(randn(SHAPES[:2], 4))
    bad = randn(SHAPES, 5)
    bad[1][3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        codec.encode(bad)
    assert all(torch.equal(a, b) for a, b in zip(codec.error, before["error"]))


def test_state_dict_round_trip_reproduces_the_payload():
    a = SparseCodec(SHAPES, CFG)
    a.encode(randn(SHAPES, 6))
    b = SparseCodec(SHAPES, CFG)
    b.load_state_dict(a.state_dict())
    delta = randn(SHAPES, 7)
    assert a.encode(delta) == b.encode(delta)
    with pytest.raises(ValueError, match="shapes"):
        b.load_state_dict({"error": randn(SHAPES[:1], 8)})
    b.reset()
    assert all(not bool(e.any()) for e in b.error)


def test_prepare_changes_nothing_until_commit():
    codec = SparseCodec(SHAPES, CFG)
    codec.encode(randn(SHAPES, 11))  # a non-zero buffer
    before = [e.clone() for e in codec.error]
    x = randn(SHAPES, 12)
    payload, new_error = codec.prepare(x)
    assert all(torch.equal(a, b) for a, b in zip(before, codec.error))
    twin = SparseCodec(SHAPES, CFG)
    twin.load_state_dict({"error": before})
    assert twin.encode(x) == payload  # prepare + commit is encode
    codec.commit(new_error)
    assert all(torch.equal(a, b) for a, b in zip(twin.error, codec.error))


def test_sparse_compressor_round_protocol_and_state():
    comp = sparse.SparseCompressor(SHAPES, CFG)
    x = randn(SHAPES, 13)
    rnd = comp.begin(x)
    assert rnd.stats.payload_bytes == len(rnd.payload) == comp.payload_bytes() and rnd.stats.bits == 2
    assert 0 < rnd.stats.relative_error < 1
    # ||M - C(M)|| / ||M|| with M = beta e + delta, computed the long way (a second round: e is not zero)
    probe = sparse.SparseCompressor(SHAPES, CFG)
    probe.commit(probe.begin(randn(SHAPES, 14)))
    y = randn(SHAPES, 15)
    m = torch.cat([g.reshape(-1) for g in y]) + CFG.beta * torch.cat([e.reshape(-1) for e in probe.error])
    second = probe.begin(y)
    assert second.stats.relative_error == pytest.approx(float(second.new_error.norm() / m.norm()), rel=1e-5)
    own = rnd.own()
    assert all(torch.equal(a, b) for a, b in zip(own, decode(rnd.payload, SHAPES, CFG)))
    assert all(float(e.abs().sum()) == 0 for e in comp.error)  # not committed: a skipped round keeps nothing
    comp.commit(rnd)
    # error feedback: what was sent plus what is kept is exactly the pseudo-gradient (beta * 0 + delta)
    for o, e, d in zip(own, comp.error, x):
        assert torch.allclose(o + e, d, atol=1e-6)
    assert comp.shared_tensors() == [] and comp.shared_digest(0, []) == comp.digest()
    with pytest.raises(ValueError, match="no shared state"):
        comp.shared_digest(2, [])
    with pytest.raises(ValueError, match="no shared state"):
        comp.load_shared(0, [torch.zeros(3)])
    saved = comp.state_dict()
    other = sparse.SparseCompressor(SHAPES, CFG)
    other.load_state_dict(saved)
    assert other.begin(x).payload == comp.begin(x).payload
    other.load_shared(0, [])  # adopting a downloaded state resets the local buffers
    assert all(float(e.abs().sum()) == 0 for e in other.error)
    assert sparse.SparseCompressor(SHAPES, SparseConfig(chunk=195, topk=13)).digest() != comp.digest()


RICE = SparseConfig(chunk=195, topk=12, bits=2, rice=True)


def test_rice_indices_decode_to_the_same_contribution_in_fewer_bytes():
    for seed in range(5):
        x = randn(SHAPES, 40 + seed)
        fixed, rice = SparseCodec(SHAPES, CFG).encode(x), SparseCodec(SHAPES, RICE).encode(x)
        assert all(torch.equal(a, b) for a, b in zip(decode(fixed, SHAPES, CFG), decode(rice, SHAPES, RICE)))
        assert len(rice) <= payload_bytes(SHAPES, RICE)
    big = [(133_440,)]  # the tiny preset's size at the default density: fixed 12-bit vs Rice-coded indices
    x = randn(big, 3)
    fixed = SparseCodec(big, SparseConfig(topk=128)).encode(x)
    rice = SparseCodec(big, SparseConfig(topk=128, rice=True)).encode(x)
    assert len(rice) < 0.65 * len(fixed) and 133_440 * 4 / len(rice) > 100


def test_malformed_rice_streams_are_rejected():
    payload = SparseCodec(SHAPES, RICE).encode(randn(SHAPES, 5))
    start = sparse.HEADER_BYTES
    (unary,) = sparse.UNARY.unpack_from(payload, start)
    lay = sparse.layout(sum(math.prod(s) for s in SHAPES), RICE)
    stream = start + sparse.UNARY.size + 4 * lay.nchunks + lay.index_bytes

    def with_unary_bits(n):
        return payload[:start] + sparse.UNARY.pack(n) + payload[start + sparse.UNARY.size:]

    def flip(at, bit):
        b = bytearray(payload)
        b[at] ^= 1 << bit
        return bytes(b)

    cases = {
        "unary length below the index count": (with_unary_bits(lay.nidx - 1), "outside"),
        "unary length too large": (with_unary_bits(lay.max_unary_bits + 1), "outside"),
        "unary length disagrees with the bytes": (with_unary_bits(unary + 8), "truncated payload"),
        "a stop bit turned into a one": (flip(stream, next(i for i in range(8) if not payload[stream] >> i & 1)),
                                         "unary stream holds"),
    }
    for name, (bad, words) in cases.items():
        with pytest.raises(ContributionError, match=words):
            decode(bad, SHAPES, RICE)
    # a gap pushed past the end of the last (2-value) chunk
    x = [torch.zeros(s) for s in SHAPES]
    x[-1].view(-1)[-1] = 1.0
    p = SparseCodec(SHAPES, RICE).encode(x)
    lay_p = sparse.layout(sum(math.prod(s) for s in SHAPES), RICE)
    (u,) = sparse.UNARY.unpack_from(p, start)
    rem_at = start + sparse.UNARY.size + 4 * lay_p.nchunks
    idx_rem = sparse.unpack_bits(p, rem_at, lay_p.nidx, RICE.rice_bits, "r")
    idx_rem[-1] = (1 << RICE.rice_bits) - 1  # the last chunk's second gap grows past its 2 values
    bad = p[:rem_at] + sparse.pack_bits(idx_rem, RICE.rice_bits) + p[rem_at + lay_p.index_bytes:]
    with pytest.raises(ContributionError, match="out of range"):
        decode(bad, SHAPES, RICE)

FUZZ_PAYLOADS = {cfg.rice: SparseCodec(SHAPES, cfg).encode(randn(SHAPES, 9)) for cfg in (CFG, RICE)}


@given(rice=st.booleans(), data=st.data())
def test_fuzzed_contributions_never_crash_the_decoder(rice, data):
    """Random bytes and random edits of a valid payload: decode either accepts (finite values inside the
    shapes) or raises ContributionError, nothing else."""
    cfg = RICE if rice else CFG
    base = FUZZ_PAYLOADS[rice]
    kind = data.draw(st.sampled_from(["random", "flip", "cut", "extend", "splice"]))
    if kind == "random":
        payload = data.draw(st.binary(max_size=len(base) + 16))
    elif kind == "flip":
        b = bytearray(base)
        for at in data.draw(st.lists(st.integers(0, len(base) - 1), min_size=1, max_size=8)):
            b[at] ^= data.draw(st.integers(1, 255))
        payload = bytes(b)
    elif kind == "cut":
        payload = base[:data.draw(st.integers(0, len(base) - 1))]
    elif kind == "extend":
        payload = base + data.draw(st.binary(min_size=1, max_size=32))
    else:
        at = data.draw(st.integers(0, len(base)))
        payload = base[:at] + data.draw(st.binary(max_size=16)) + base[at + data.draw(st.integers(0, 16)):]
    try:
        out = decode(payload, SHAPES, cfg)
    except ContributionError:
        return
    assert [tuple(t.shape) for t in out] == SHAPES and all(bool(torch.isfinite(t).all()) for t in out)


@pytest.mark.parametrize("threads", [1, 3])
def test_fold_gives_encodes_payload_and_buffer_bit_for_bit(monkeypatch, threads):
    """``fold(theta, x)`` computes theta - x into the error feedback in place: the same payload and buffer bits as
    ``encode(theta - x)`` round after round, whatever the thread count; ``unfold`` puts the buffer back up to
    fp32 rounding."""
    import dilocox.threads

    monkeypatch.setattr(dilocox.threads, "_budget", threads)
    shapes, cfg = [(3_000, 70), (5_001,), (13,)], SparseConfig(chunk=4096, topk=128, rice=True)
    encoded, folded = SparseCodec(shapes, cfg), SparseCodec(shapes, cfg)
    for r in range(3):
        theta = randn(shapes, 10 + r)
        x = [t + 0.01 * d for t, d in zip(theta, randn(shapes, 20 + r))]
        assert folded.fold(theta, x) == encoded.encode([t - u for t, u in zip(theta, x)])
        assert torch.equal(folded.flat.view(torch.int32), encoded.flat.view(torch.int32))
    before = folded.flat.clone()
    folded.unfold(folded.fold(theta, x), theta, x)
    torch.testing.assert_close(folded.flat, before, rtol=0, atol=4 * float(before.abs().max()) * 2 ** -23)


def test_fold_refuses_what_does_not_fit_and_zeroes_the_buffer_after_a_non_finite_value():
    shapes, cfg = [(500,), (70, 3)], SparseConfig(chunk=64, topk=4)
    codec = SparseCodec(shapes, cfg)
    theta = randn(shapes, 1)
    codec.fold(theta, [t * 0.5 for t in theta])
    kept = codec.flat.clone()
    with pytest.raises(ValueError, match="do not match"):
        codec.fold(theta, [torch.zeros(500), torch.zeros(3, 70)])
    assert torch.equal(codec.flat, kept)  # a shape mismatch changes nothing
    bad = [t.clone() for t in theta]
    bad[1][5, 1] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        codec.fold(theta, bad)
    assert not codec.flat.any()  # half-updated: zeroed, not left half one round's
    with pytest.raises(ContributionError):
        codec.unfold(b"not a payload", theta, theta)


def test_a_sparse_aggregate_reads_as_the_dense_one_tensor_by_tensor():
    """The group's aggregate is kept as (sorted positions, values); read tensor by tensor it gives the dense
    aggregate's bits, positions crossing tensor boundaries included, and the outer step applied from it gives
    the dense step's theta bit for bit while holding one dense tensor at a time (numpy allocations traced)."""
    import tracemalloc

    from dilocox.diloco import OuterOptimizer
    from dilocox.sparse import SparseAggregate

    shapes = [(300, 400), (7,), (1000, 130), (5,)]
    n = sum(math.prod(s) for s in shapes)
    rng = np.random.default_rng(3)
    support = np.sort(rng.choice(n, size=n // 20, replace=False)).astype(np.int64)
    support = np.union1d(support, [0, 120_000 - 1, 120_000, 120_006, 120_007, n - 1]).astype(np.int64)
    values = rng.standard_normal(len(support)).astype(np.float32)
    values[3] = -0.0
    agg = SparseAggregate(support, values, shapes)
    dense = np.zeros(n, dtype=np.float32)
    dense[support] = values
    assert len(agg) == 4 and [tuple(t.shape) for t in agg] == shapes
    flat = torch.cat([t.reshape(-1) for t in agg])
    assert torch.equal(flat.view(torch.int32), torch.from_numpy(dense).view(torch.int32))
    assert torch.equal(agg[-1], agg[3]) and len(agg[1:3]) == 2 and agg.nbytes == 12 * len(support)
    with pytest.raises(IndexError):
        agg[4]
    theta = randn(shapes, 9)
    sparse_step = OuterOptimizer(theta, outer_lr=2.5, outer_momentum=0.0, nesterov=False)
    dense_step = OuterOptimizer(theta, outer_lr=2.5, outer_momentum=0.0, nesterov=False)
    dense_step.step(list(agg), 1)
    tracemalloc.start()
    sparse_step.step(agg, 1)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32))
               for a, b in zip(sparse_step.global_params, dense_step.global_params))
    assert peak < 1.5 * 4 * max(math.prod(s) for s in shapes) < 4 * n  # one tensor at a time, not all of them


def test_the_momentum_free_outer_step_has_torch_sgds_bits():
    from dilocox.diloco import OuterOptimizer

    shapes = [(1000, 37), (4097,)]
    theta = randn(shapes, 4)
    ours = OuterOptimizer(theta, outer_lr=2.5, outer_momentum=0.0, nesterov=False, outer_lr_final=4.5, ramp_steps=3)
    ref = [t.clone() for t in theta]
    sgd = torch.optim.SGD(ref, lr=2.5, momentum=0.0)
    for step in (1, 2, 3):
        grads = [1e-3 * g for g in randn(shapes, 40 + step)]
        ours.step(grads, step)
        sgd.param_groups[0]["lr"] = ours.lr_at(step)
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        sgd.step()
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(ours.global_params, ref))


def test_half_of_a_group_of_four_against_the_other_half_gets_nothing_applied(caplog):
    """Two contributions of four sign-flipped x1000 (the seed-13 group of docs/results/2026-12-06-attacks-screen.md):
    each middle value is one half's, the screen applies nothing (every scale 0) and says so once; with one flipped of
    four, that one is left out and the others' rule applies."""
    base = randn(SHAPES, 7)
    grads = [[b + 0.3 * n for b, n in zip(base, randn(SHAPES, 200 + i))] for i in range(4)]
    for i in (2, 3):
        grads[i] = [-1000.0 * t for t in grads[i]]
    payloads = {f"peer{i}": SparseCodec(SHAPES, CFG).encode(g) for i, g in enumerate(grads)}
    weights = dict.fromkeys(payloads, 20.0)
    with caplog.at_level("INFO", logger="dilocox.sparse.aggregate"):
        out, rejected, scaled = sparse.aggregate_scaled(payloads, weights, SHAPES, CFG, rule="centered-clip")
    assert rejected == {} and all(not o.any() for o in out) and set(scaled.values()) == {0.0}
    assert "nothing applied: the contributions of peer0, peer1, peer2, peer3 share no direction" in caplog.text
    assert "left out" not in caplog.text
    del payloads["peer2"]
    payloads["peer4"] = SparseCodec(SHAPES, CFG).encode([b + 0.3 * n for b, n in zip(base, randn(SHAPES, 204))])
    out, _, scaled = sparse.aggregate_scaled(payloads, dict.fromkeys(payloads, 20.0), SHAPES, CFG,
                                             rule="centered-clip")
    flat, honest = torch.cat([o.reshape(-1) for o in out]), torch.cat([b.reshape(-1) for b in base])
    assert {p for p, s in scaled.items() if s == 0.0} == {"peer3"}
    assert float(flat @ honest) / float(flat.norm() * honest.norm()) > 0.5


def _four_honest_and_one(seed: int, boost: float) -> dict[str, bytes]:
    """Payloads of four members sharing a direction (peer0-3) and a fifth with its own, ``boost`` x (peer9)."""
    base = randn(SHAPES, seed)
    honest = [[b + 0.1 * n for b, n in zip(base, randn(SHAPES, 100 * seed + i))] for i in range(4)]
    payloads = {f"peer{i}": SparseCodec(SHAPES, CFG).encode(g) for i, g in enumerate(honest)}
    payloads["peer9"] = SparseCodec(SHAPES, CFG).encode([boost * t for t in randn(SHAPES, 1000 + seed)])
    return payloads


def test_the_robust_learning_rate_reverses_what_only_a_boosted_member_pushes(caplog):
    """--robust-lr flip, gated on outsized rounds: four honest members share a direction, a fifth sends its own x100.
    The norm bound scales it below 1/4, so the round is outsized: every position where fewer than 2 of the 5 signs
    agree, those only the fifth sent among them, moves against it. The same fifth member at honest size leaves the
    aggregate bit for bit as without the policy."""
    from dilocox.sign_agreement import SignPolicy

    policy = SignPolicy("flip", 0.35, "outsized", 4.0)
    for boost, acts in ((100.0, True), (1.0, False)):
        payloads = _four_honest_and_one(11, boost)
        weights = dict.fromkeys(payloads, 20.0)
        plain, _, scaled = sparse.aggregate_sparse(payloads, weights, SHAPES, CFG, rule="mean", norm_bound=2.0)
        caplog.clear()
        with caplog.at_level("INFO", logger="dilocox.sparse.aggregate"):
            out, rejected, scaled2 = sparse.aggregate_sparse(payloads, weights, SHAPES, CFG, rule="mean",
                                                             norm_bound=2.0, sign=policy)
        assert rejected == {} and scaled == scaled2
        assert policy.acts(scaled.values()) is acts
        if not acts:
            assert np.array_equal(out.values, plain.values) and "robust learning rate" not in caplog.text
            continue
        assert scaled["peer9"] < 0.25 and "robust learning rate:" in caplog.text and "reversed" in caplog.text
        sent = {p: torch.cat([t.reshape(-1) for t in decode(b, SHAPES, CFG)]) for p, b in payloads.items()}
        lone = (sent["peer9"] != 0) & torch.stack([sent[f"peer{i}"] == 0 for i in range(4)]).all(0)
        flat, before = torch.cat([o.reshape(-1) for o in out]), torch.cat([o.reshape(-1) for o in plain])
        assert int(lone.sum()) > 10
        assert (torch.sign(flat[lone]) == -torch.sign(sent["peer9"][lone])).all()
        assert torch.equal(flat[lone].abs(), before[lone].abs())
        # where all four honest members sent the same sign, the step is theirs, as without the policy
        agree = torch.stack([torch.sign(sent[f"peer{i}"]) for i in range(4)]).sum(0).abs() == 4
        assert torch.equal(flat[agree & (sent["peer9"] == 0)], before[agree & (sent["peer9"] == 0)])


def test_an_outsized_contribution_is_left_out_and_the_round_stays_outsized(caplog):
    """--drop-outsized 4: a contribution the norm bound would scale below 1/4 is not clipped into the aggregate but
    left out, and the rule runs again over the others; its scale stays in the report (the quiet restart and the
    gated robust learning rate still see an outsized round). At honest size nothing changes, bit for bit."""
    for boost in (100.0, 1.0):
        payloads = _four_honest_and_one(12, boost)
        weights = dict.fromkeys(payloads, 20.0)
        clipped, _, scaled = sparse.aggregate_sparse(payloads, weights, SHAPES, CFG, rule="mean", norm_bound=2.0)
        caplog.clear()
        with caplog.at_level("INFO", logger="dilocox.sparse.aggregate"):
            out, rejected, scaled2 = sparse.aggregate_sparse(payloads, weights, SHAPES, CFG, rule="mean",
                                                             norm_bound=2.0, drop_outsized=4.0)
        if boost == 1.0:
            assert np.array_equal(out.values, clipped.values) and scaled2 == scaled and "outsized" not in caplog.text
            continue
        assert rejected == {} and scaled2["peer9"] == scaled["peer9"] < 0.25
        assert "contribution of peer9 left out: the norm bound would scale it by" in caplog.text
        assert "peer9 scaled by" not in caplog.text
        del payloads["peer9"]
        alone, _, _ = sparse.aggregate_sparse(payloads, weights, SHAPES, CFG, rule="mean", norm_bound=2.0)
        flat = torch.cat([o.reshape(-1) for o in out])
        assert torch.allclose(flat, torch.cat([o.reshape(-1) for o in alone]), rtol=1e-6, atol=1e-9)
        assert not torch.allclose(flat, torch.cat([o.reshape(-1) for o in clipped]), rtol=1e-3)
