"""Global top-k of a round's aggregate (dilocox/experimental/resparsify.py): what it keeps, that a reducer of a range of
chunks computes exactly its part, and that what it drops returns to the contributors' error feedback."""

import numpy as np
import pytest
import torch

from dilocox.experimental.resparsify import reencode, residual, result_config
from dilocox.sparse import SparseCodec, SparseConfig, aggregate, decode

CFG = SparseConfig(chunk=64, topk=4, bits=2, beta=0.9, rice=True)
SHAPES = [(3, 50), (40,), (7, 3)]  # 211 values: 3 whole chunks and a short last one, straddling tensors


def _round(seed: int, replicas: int = 5):
    g = torch.Generator().manual_seed(seed)
    codecs = [SparseCodec(SHAPES, CFG) for _ in range(replicas)]
    deltas = [[torch.randn(s, generator=g) * (1 + r) for s in SHAPES] for r in range(replicas)]
    payloads = {f"p{r}": c.encode(d) for r, (c, d) in enumerate(zip(codecs, deltas))}
    weights = {p: float(2 + r) for r, p in enumerate(payloads)}
    mean, dropped = aggregate(payloads, weights, SHAPES, CFG)
    assert not dropped
    return codecs, payloads, weights, mean


def test_keeps_the_largest_values_of_each_chunk():
    _, _, _, mean = _round(1)
    res = reencode(mean, CFG, budget=2)
    flat = torch.cat([t.reshape(-1) for t in mean])
    applied = torch.cat([t.reshape(-1) for t in res.applied])
    assert res.cfg.topk == 8
    chunks = [(a, min(a + 64, flat.numel())) for a in range(0, flat.numel(), 64)]
    pos = set(res.positions.tolist())
    assert list(res.positions) == sorted(pos)
    for a, b in chunks:
        kept = [p for p in pos if a <= p < b]
        assert len(kept) == min(8, b - a)
        dropped = [p for p in range(a, b) if p not in pos]
        if dropped:  # every kept |value| is at least every dropped one
            assert min(abs(float(flat[p])) for p in kept) >= max(abs(float(flat[p])) for p in dropped)
    off = torch.ones(flat.numel(), dtype=torch.bool)
    off[torch.from_numpy(res.positions)] = False
    assert bool((applied[off] == 0).all())
    # the kept values are quantized as a contribution's: within scale / 2^bits of the aggregate
    for a, b in chunks:
        kept = torch.tensor([p for p in pos if a <= p < b])
        scale = float(flat[kept].abs().max())
        assert float((applied[kept] - flat[kept]).abs().max()) <= scale / 4 + 1e-7
    assert decode(res.payload, SHAPES, res.cfg)[0].equal(res.applied[0])


def test_a_reducer_of_a_range_of_chunks_computes_that_range_of_the_result():
    _, _, _, mean = _round(2)
    flat = torch.cat([t.reshape(-1) for t in mean])
    whole = torch.cat([t.reshape(-1) for t in reencode(mean, CFG, budget=2).applied])
    for a, b in ((0, 64), (64, 192), (128, 211)):
        part = reencode([flat[a:b].clone()], CFG, budget=2)
        assert part.applied[0].equal(whole[a:b]), (a, b)


def test_what_is_dropped_returns_to_the_contributors_and_nothing_is_lost():
    codecs, payloads, weights, mean = _round(3)
    res = reencode(mean, CFG, budget=1)
    total = sum(weights.values())
    back = torch.zeros(211, dtype=torch.float64)
    for p, c in zip(payloads, codecs):
        before = torch.cat([e.reshape(-1) for e in c.error]).clone()
        r = residual(decode(payloads[p], SHAPES, CFG), mean, res)
        c.restore(r)
        flat_r = torch.cat([t.reshape(-1) for t in r])
        assert torch.cat([e.reshape(-1) for e in c.error]).equal(before + flat_r)
        back += weights[p] / total * flat_r.double()
    applied = torch.cat([t.reshape(-1) for t in res.applied]).double()
    flat_mean = torch.cat([t.reshape(-1) for t in mean]).double()
    assert torch.allclose(back + applied, flat_mean, atol=1e-6)
    # the result is smaller than the union it came from, and it dropped something real
    assert len(res.payload) < 2 * len(payloads["p0"])
    assert int((flat_mean != 0).sum()) > len(res.positions)


def test_a_dropped_value_is_sent_again_next_round():
    cfg = SparseConfig(chunk=8, topk=1, bits=8, beta=1.0)
    a, b = SparseCodec([(8,)], cfg), SparseCodec([(8,)], cfg)
    pa = a.encode([torch.tensor([0, 0, 0, 5.0, 0, 0, 0, 0])])
    pb = b.encode([torch.tensor([0, 9.0, 0, 0, 0, 0, 0, 0])])
    mean, _ = aggregate({"a": pa, "b": pb}, {"a": 1.0, "b": 1.0}, [(8,)], cfg)
    res = reencode(mean, cfg, budget=1)
    assert res.positions.tolist() == [1]  # b's 4.5 beats a's 2.5
    a.restore(residual(decode(pa, [(8,)], cfg), mean, res))
    again = decode(a.encode([torch.zeros(8)]), [(8,)], cfg)[0]
    assert float(again[3]) == pytest.approx(5.0, rel=1e-2)


def test_bad_input_is_refused():
    _, _, _, mean = _round(4)
    with pytest.raises(ValueError, match="budget"):
        result_config(CFG, 0)
    with pytest.raises(ValueError, match="bits"):
        result_config(CFG, 1, bits=3)
    assert result_config(CFG, 2, bits=8).bits == 8 and result_config(CFG, 100).topk == CFG.chunk
    res = reencode(mean, CFG, budget=1)
    with pytest.raises(ValueError, match="shapes"):
        residual([torch.zeros(3)], mean, res)
    c = SparseCodec(SHAPES, CFG)
    with pytest.raises(ValueError, match="shapes"):
        c.restore([torch.zeros(3)])
    with pytest.raises(ValueError, match="non-finite"):
        c.restore([torch.full(s, float("nan")) for s in SHAPES])
    assert all(bool((e == 0).all()) for e in c.error)
    c.restore([torch.ones(s) for s in SHAPES], whole=True)  # / beta: the next encode's decay leaves it whole
    assert float(c.error[0][0, 0]) == pytest.approx(1 / CFG.beta)
    with pytest.raises(ValueError, match="non-finite"):
        reencode([torch.full((70,), float("inf"))], CFG, budget=1)
    assert np.all(res.positions < 211)
