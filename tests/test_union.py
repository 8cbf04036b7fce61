"""dilocox/union.py: the union of a split round's group results."""

from __future__ import annotations

import pytest
import torch

from dilocox.robust import norm
from dilocox.union import UnionError, unite


def _group(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(4, 3, generator=g), scale * torch.randn(5, generator=g)]


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1).double() for t in tensors])


def test_groups_of_equal_norm_unite_to_the_mean_of_all_contributions():
    """Group results are means of their contributions; with no norm above the median, the union is the mean of
    the union of contributions (weights: contributions per group)."""
    contributions = [_group(i) for i in range(6)]
    a, b = contributions[:4], contributions[4:]
    mean = lambda rows: [torch.stack(ts).double().mean(0).float() for ts in zip(*rows)]  # noqa: E731
    ra, rb = mean(a), mean(b)
    target = norm(_flat(ra))  # rescale b's mean to a's norm so that nothing is clipped
    rb = [t * (target / norm(_flat(rb))) for t in rb]
    expected = (4 * _flat(ra) + 2 * _flat(rb)) / 6
    got = unite([(4, ra), (2, rb)])
    assert [t.shape for t in got] == [t.shape for t in ra] and all(t.dtype == torch.float32 for t in got)
    assert torch.allclose(_flat(got), expected, atol=1e-6)


def test_a_small_group_with_a_huge_result_moves_the_union_by_its_weight_times_a_typical_norm():
    honest = [(6, _group(1)), (5, _group(2))]
    poisoned = (1, _group(3, scale=-1e4))  # a lone "group" sending a sign-flipped, scaled result
    got = unite(honest + [poisoned])
    clean = unite(honest)
    typical = max(norm(_flat(t)) for _, t in honest)
    assert norm(_flat(got) - _flat(clean) * 11 / 12) <= typical / 12 * (1 + 1e-9)


def test_the_same_inputs_give_the_same_bits():
    results = [(3, _group(4)), (2, _group(5, 3.0)), (1, _group(6, 0.1))]
    first = unite(results)
    again = unite([(w, [t.clone() for t in ts]) for w, ts in results])
    assert all(torch.equal(x, y) for x, y in zip(first, again))


@pytest.mark.parametrize("results, message", [
    ([], "no group results"),
    ([(0, _group(1))], "positive"),
    ([(1, _group(1)), (1, [torch.zeros(4, 3)])], "different shapes"),
    ([(1, _group(1)), (1, [torch.full((4, 3), float("nan")), torch.zeros(5)])], "NaN"),
])
def test_bad_results_are_refused_with_a_reason(results, message):
    with pytest.raises(UnionError, match=message):
        unite(results)
