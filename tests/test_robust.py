"""Robust aggregation rules (dilocox/robust.py): what each rule computes, that one poisoned contribution
cannot take the aggregate over, and that the bits do not depend on the order peers arrive in."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from bench.robust_screen import sparse_rows
from dilocox.robust import Aggregation, aggregate, aggregate_rows, bound_norms, norm, tree_sum
from tests.robust_reference import reference_aggregate, reference_tree_sum, same_bits


def honest(k: int, n: int = 200, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=g, dtype=torch.float64)
    return {f"p{i}": base + 0.1 * torch.randn(n, generator=g, dtype=torch.float64) for i in range(k)}


def test_mean_is_the_weighted_mean():
    v = honest(4)
    w = {"p0": 10.0, "p1": 20.0, "p2": 20.0, "p3": 10.0}
    out, report = aggregate(v, w, "mean", norm_bound=0)
    want = sum(w[p] * v[p] for p in v) / sum(w.values())
    assert torch.allclose(out, want, atol=1e-12) and report == dict(rule="mean", clipped={})


def test_rules_agree_on_identical_contributions():
    x = torch.linspace(-1, 1, 50, dtype=torch.float64)
    v = {f"p{i}": x.clone() for i in range(5)}
    for rule in Aggregation:
        out, _ = aggregate(v, dict.fromkeys(v, 1.0), rule)
        assert torch.allclose(out, x, atol=1e-12), rule


def test_coordinate_rules_compute_what_they_say():
    v = {"a": torch.tensor([1.0, 5.0], dtype=torch.float64), "b": torch.tensor([2.0, -1.0], dtype=torch.float64),
         "c": torch.tensor([100.0, 0.0], dtype=torch.float64), "d": torch.tensor([3.0, 2.0], dtype=torch.float64),
         "e": torch.tensor([4.0, 1.0], dtype=torch.float64)}
    w = dict.fromkeys(v, 1.0)
    median, _ = aggregate(v, w, "median", norm_bound=0)
    assert median.tolist() == [3.0, 1.0]
    trimmed, _ = aggregate(v, w, "trimmed-mean", norm_bound=0, trim=0.2)  # drops one value at each end
    assert torch.allclose(trimmed, torch.tensor([3.0, 1.0], dtype=torch.float64))


def test_norm_bounding_clips_to_a_multiple_of_the_median_norm():
    v = honest(5)
    v["p4"] = v["p4"] * 1000
    rows, scales = bound_norms([v[p] for p in sorted(v)], 2.0)
    med = sorted(norm(v[p]) for p in v)[2]
    assert norm(rows[4]) == pytest.approx(2.0 * med, rel=1e-12) and scales[4] < 0.01
    assert scales[:4] == [1.0] * 4


@pytest.mark.parametrize("rule", ["mean", "centered-clip"])
def test_a_pair_with_one_poisoned_contribution_moves_at_most_a_few_honest_norms(rule):
    # a group of two (the others missed the round, or were dropped as malformed): no majority, but the bound is the
    # smaller norm, so a sign flip x1000 moves the model by a few honest updates, not a thousand (a mean of the
    # two norms as the bound let it through: seen on real nodes, val loss 2.3 -> 8,068 in one round)
    v = honest(2)
    h = norm(v["p0"])
    v["p1"] = -1000 * v["p1"]
    out, report = aggregate(v, dict.fromkeys(v, 20.0), rule)
    assert norm(out) < 3 * h and report["clipped"]["p1"] < 0.01, (norm(out) / h, report)


@pytest.mark.parametrize("rule", ["centered-clip", "trimmed-mean", "median"])
def test_one_poisoned_contribution_of_five_does_not_take_over(rule):
    v = honest(5)
    clean = sum(v[p] for p in list(v)[:4]) / 4
    v["p4"] = -1000 * v["p4"]  # sign flip and scaling
    w = dict.fromkeys(v, 20.0)
    plain, _ = aggregate(v, w, "mean", norm_bound=0)
    robust, report = aggregate(v, w, rule)
    assert norm(plain - clean) > 100 * norm(clean)  # the plain mean is the attacker's
    assert norm(robust - clean) < 0.5 * norm(clean), (rule, norm(robust - clean), norm(clean))
    assert "p4" in report["clipped"]


@pytest.mark.parametrize("rule", list(Aggregation))
def test_the_same_bits_whatever_the_order(rule):
    v = honest(6, n=1000, seed=3)
    v["p5"] = 50 * v["p5"]
    w = {p: float(10 + i) for i, p in enumerate(v)}
    first, _ = aggregate(v, w, rule)
    items = list(v.items())
    random.Random(1).shuffle(items)
    again, _ = aggregate(dict(items), w, rule)
    assert torch.equal(first, again)


def test_norm_is_the_fixed_tree():
    assert norm(torch.tensor([3.0, 4.0, 0.0, 12.0], dtype=torch.float64)) == 13.0
    assert norm(torch.zeros(0, dtype=torch.float64)) == 0.0
    assert math.isinf(norm(torch.full((10,), 1e300, dtype=torch.float64)))  # clipped to nothing, never a crash
    g = torch.Generator().manual_seed(5)
    for m in (1, 2, 3, 1023, 16384, 16385, 40_000, 100_000):
        x = torch.randn(m, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-5, 5, (m,), generator=g)
        assert tree_sum(x) == reference_tree_sum(x), m
        assert norm(x) == math.sqrt(reference_tree_sum(x * x)), m


def rows_for(k: int, m: int, seed: int, attacker: bool) -> np.ndarray:
    """(k, m) fp32 values in float64 with zeros (both signs), equal values across rows and, if ``attacker``, one
    outsized row (numpy: the reference and the rows stay off torch's thread pool)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(m)
    rows = np.empty((k, m))
    for i in range(k):
        r = base + 0.3 * rng.standard_normal(m)
        r[3::11] = base[3::11]  # ties between rows
        rows[i] = (r * (40.0 if attacker and i == k - 1 else 1.0)).astype(np.float32)
        rows[i, i::5] = 0.0
        rows[i, (i + 2)::7] = -0.0
    return rows


@pytest.mark.parametrize("rule", list(Aggregation))
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 8])
def test_the_rules_have_the_bits_of_the_reference(rule, k):
    for m, batch in ((1, None), (17, None), (16383, None), (16385, None), (40_000, None), (40_000, 2), (70_000, 3)):
        for attacker in (False, True):
            rows = rows_for(k, m, seed=m + k, attacker=attacker)
            w = [1.0 + 3 * i for i in range(k)]
            want = reference_aggregate(list(torch.from_numpy(rows)), w, rule.value)
            got, scales = aggregate_rows(rows + 0.0, w, rule, batch_blocks=batch)
            assert same_bits(got, want), (rule, k, m, batch, attacker)
            assert m < 1000 or (min(scales) < 1.0) == (attacker and k > 1)  # both paths: clipped or not
            f32, _ = aggregate_rows(rows.astype(np.float32) + np.float32(0), w, rule, batch_blocks=batch)  # exact
            got = got.numpy()
            assert same_bits(f32, want) and not np.signbit(got[got == 0]).any()


@pytest.mark.parametrize("k", [3, 4, 5, 6, 7, 8])
def test_the_opposition_screen_has_the_bits_of_the_reference(k):
    """centered-clip leaves out a minority of rows pointing against the coordinate-wise median (scale 0; k even:
    against both middle values) and runs anew over the others, with the bits of the reference; if more than a
    minority are opposed (k even: half to either middle value), the aggregate is 0."""
    for m, batch in ((17, None), (40_000, None), (70_000, 3)):
        for flipped in range(1, k):
            rows = rows_for(k, m, seed=m + k, attacker=True)
            rows[:flipped] *= -1.0
            rows += 0.0
            w = [1.0 + 3 * i for i in range(k)]
            got, scales = aggregate_rows(rows, w, "centered-clip", batch_blocks=batch)
            assert same_bits(got, reference_aggregate(list(torch.from_numpy(rows)), w, "centered-clip")), (k, m)
            dropped = [i for i, s in enumerate(scales) if s == 0.0]
            if flipped <= (k - 1) // 2:  # flipped ones only, and some where rows are long enough to be clear
                assert set(dropped) <= set(range(flipped)) and (m < 1000 or dropped), (k, m, scales)
            else:  # no minority flipped: a minority goes, or more are opposed and the group applies nothing
                assert len(dropped) <= (k - 1) // 2 or (len(dropped) == k and not got.any()), (k, m, flipped)


@pytest.mark.parametrize("attack", ["sign-flip", "ipm"])
def test_two_colluders_of_five_cannot_turn_centered_clip_around(attack):
    """2 of 5 sparse contributions sign-flipped x1000, or both the inner-product attack (-2 x the honest mean):
    plain CenteredClip (centered-clip-plain) moves off the honest mean, for IPM to its opposite; with
    the screen both colluders are left out and the aggregate is the honest rows'."""
    v = sparse_rows(5, seed=4)
    honest_mean = sum(v[p] for p in ("p0", "p1", "p2")) / 3
    for p in ("p3", "p4"):
        v[p] = -1000 * v[p] if attack == "sign-flip" else -2.0 * honest_mean

    def cos(a):
        return float(a @ honest_mean) / (norm(a) * norm(honest_mean))

    plain, _ = aggregate(v, dict.fromkeys(v, 20.0), "centered-clip-plain")
    screened, report = aggregate(v, dict.fromkeys(v, 20.0), "centered-clip")
    assert cos(plain) < (0.0 if attack == "ipm" else 0.8) and cos(screened) > 0.99, (cos(plain), cos(screened))
    assert report["clipped"]["p3"] == report["clipped"]["p4"] == 0.0


@pytest.mark.parametrize("seed", range(4))
def test_half_of_an_even_group_cannot_turn_it_around(seed):
    """Two colluders of four (an honest member missed the group) sending -2 x the honest mean: plain CenteredClip
    applies their direction; each middle value is one half's, so the screen sees the halves oppose and applies
    nothing. No honest row is left out while the colluders stay in (that is what an odd-style screen against the
    lower median did on real nodes: the model's loss 5.6 -> 103)."""
    v = sparse_rows(4, seed=seed, spread=1.0)
    honest_mean = (v["p0"] + v["p1"]) / 2
    v["p2"] = v["p3"] = -2.0 * honest_mean
    w = dict.fromkeys(v, 20.0)
    screened, report = aggregate(v, w, "centered-clip")
    plain, _ = aggregate(v, w, "centered-clip-plain")
    assert float(plain @ honest_mean) < 0.0
    assert not screened.any() and set(report["clipped"].values()) == {0.0}


@pytest.mark.parametrize("k, colluders", [(4, 1), (6, 1), (6, 2), (8, 3)])
def test_a_minority_of_an_even_group_is_left_out(k, colluders):
    """A minority of sign flippers (x1000) in an even group is opposed to both middle values: left out, and the
    aggregate is the honest rows' direction."""
    for seed in range(3):
        v = sparse_rows(k, seed=seed, spread=1.0)
        names = sorted(v)
        honest_mean = sum(v[p] for p in names[colluders:]) / (k - colluders)
        for p in names[:colluders]:
            v[p] = -1000.0 * v[p]
        out, report = aggregate(v, dict.fromkeys(v, 20.0), "centered-clip")
        left_out = {p for p, s in report["clipped"].items() if s == 0.0}
        assert left_out == set(names[:colluders]), (seed, report)
        assert float(out @ honest_mean) / (norm(out) * norm(honest_mean)) > 0.95


def test_a_majority_against_the_median_gets_nothing_applied():
    """Three rows each against the coordinate-wise median (-1, -1, -1): the group shares no direction, so its
    aggregate is zero and every scale 0 (plain CenteredClip would apply something)."""
    x = np.array([[3.0, -1.0, -1.0], [-1.0, 3.0, -1.0], [-1.0, -1.0, 3.0]])
    got, scales = aggregate_rows(x, [1.0] * 3, "centered-clip", norm_bound=0.0)
    assert not got.any() and scales == [0.0] * 3
    assert same_bits(got, reference_aggregate(list(torch.from_numpy(x)), [1.0] * 3, "centered-clip", norm_bound=0.0))
    assert aggregate_rows(x, [1.0] * 3, "centered-clip-plain", norm_bound=0.0)[0].any()


@pytest.mark.parametrize("k", [4, 5, 6])
def test_the_screen_leaves_honest_rows_alone(k):
    """Honest sparse rows of a wide spread all point along the median (both middle values): nobody is left out."""
    for seed in range(5):
        v = sparse_rows(k, seed=seed, spread=4.0)
        _, report = aggregate(v, dict.fromkeys(v, 20.0), "centered-clip")
        assert 0.0 not in report["clipped"].values(), (seed, report)


def test_the_same_bits_with_one_thread_or_two_and_any_batching():
    x = rows_for(5, 100_000, seed=1, attacker=True) + 0.0
    threads = torch.get_num_threads()
    try:
        for rule in Aggregation:
            outs = []
            for n, batch in ((1, None), (2, None), (2, 3), (1, 2)):
                torch.set_num_threads(n)
                outs.append(aggregate_rows(x, [1.0, 2.0, 3.0, 4.0, 5.0], rule, batch_blocks=batch)[0])
            assert all(same_bits(o, outs[0]) for o in outs[1:]), rule
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 9, 16, 17, 33, 1000, 1_000_003])
def test_elementwise_kernels_round_like_scalar_ieee(n):
    """The ops the rules use give, on vectors of any length (vectorized body, scalar tail), the bits of one
    IEEE operation per element: no fused multiply-add, no lane-dependent result."""
    g = torch.Generator().manual_seed(n)
    a = torch.randn(n, generator=g, dtype=torch.float64) * 1e3
    b = torch.randn(n, generator=g, dtype=torch.float64) * 1e-3
    c = torch.rand(n, generator=g, dtype=torch.float64)
    na, nb, nc = a.numpy(), b.numpy(), c.numpy()
    prod = na * nc
    acc = a.clone()
    acc.add_(c * b)  # the accumulation step: product rounded, then the sum
    assert same_bits(acc, torch.from_numpy(na + nc * nb))
    assert same_bits(torch.sub(a, b), torch.from_numpy(na - nb))
    assert same_bits(a * c, torch.from_numpy(prod))
    col = torch.stack([a, b])
    col.mul_(torch.tensor([[0.3], [0.7]], dtype=torch.float64))
    assert same_bits(col[0], torch.from_numpy(na * 0.3)) and same_bits(col[1], torch.from_numpy(nb * 0.7))
    if n <= 33:  # and against Python's own scalar arithmetic
        assert acc.tolist() == [x + z * y for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())]


def test_order_statistics_are_what_a_sort_gives():
    from dilocox.robust import _order_stats

    g = torch.Generator().manual_seed(3)
    for k in range(1, 13):
        rows = [torch.randint(-3, 4, (4000,), generator=g).double() + 0.0 for _ in range(k)]  # many ties
        want = torch.sort(torch.stack(rows), dim=0).values
        for wanted in (((k - 1) // 2,), tuple(range(k)), tuple(range(min(2, k), k - min(2, k)))):
            got = _order_stats([r.numpy() for r in rows], wanted)
            assert all(same_bits(torch.from_numpy(x), want[i]) for x, i in zip(got, wanted)), (k, wanted)


def test_errors():
    with pytest.raises(ValueError, match="no contribution"):
        aggregate({}, {}, "mean")
    with pytest.raises(ValueError):
        aggregate(honest(2), dict.fromkeys(["p0", "p1"], 1.0), "krum")
