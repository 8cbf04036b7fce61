"""The union of a split round's group results: one update every group of the round applies.

hivemind's matchmaking can split a round's replicas into groups that each aggregate their own
members' contributions (daemon/majority.py). When no group holds a strict majority, every group
fetches the others' results and applies ``unite`` of all of them, so theta stays bit-identical
swarm-wide (docs/protocol.md, "One update per round").

A group's result is the mean of its n_g contributions, so the weighted mean of group results with
weights n_g is the mean of the union of contributions for a plain mean. For robust rules
(CenteredClip, trimmed mean) it is a two-level aggregate: robust inside each group, then a mean of
groups whose norms are bounded by their weighted median, so a small group (or a lone member
posing as one) moves the union by at most its weight times a typical group's norm.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch

from dilocox.robust import norm


class UnionError(ValueError):
    """The group results cannot be united (no results, mismatched shapes, weights or values)."""


def _weighted_median(values: Sequence[float], weights: Sequence[float]) -> float:
    """The smallest value whose cumulative weight reaches half the total (deterministic, no interpolation)."""
    order = sorted(range(len(values)), key=lambda i: (values[i], i))
    half, seen = 0.5 * sum(weights), 0.0
    for i in order:
        seen += weights[i]
        if seen >= half:
            return values[i]
    return values[order[-1]]


def unite(results: Sequence[Tuple[int, Sequence[torch.Tensor]]]) -> list[torch.Tensor]:
    """sum_g w_g * c_g * r_g / sum_g w_g, in float64 and the order given, cast to float32.

    ``results``: (weight w_g > 0: the group's holders, the group's aggregated pseudo-gradient r_g: one
    tensor per parameter, the same shapes for every group), in the order every member uses (sorted by
    result digest: dilocox.consensus.union_groups). c_g = min(1, m / ||r_g||) with m the weighted
    median of the global L2 norms ||r_g||. Equal inputs give equal bits on every machine.
    Raises UnionError for no results, a weight <= 0, shapes that differ, or a non-finite value."""
    if not results:
        raise UnionError("no group results to unite")
    shapes = [tuple(t.shape) for t in results[0][1]]
    for w, tensors in results:
        if not w > 0:
            raise UnionError(f"a group's weight must be positive, got {w}")
        if [tuple(t.shape) for t in tensors] != shapes:
            raise UnionError(f"group results have different shapes: {[tuple(t.shape) for t in tensors]} != {shapes}")
        if not all(bool(torch.isfinite(t).all()) for t in tensors):
            raise UnionError("a group result holds NaN or Inf")
    norms = [norm(torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])) for _, tensors in results]
    bound = _weighted_median(norms, [float(w) for w, _ in results])
    total = float(sum(w for w, _ in results))
    out = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for (w, tensors), n in zip(results, norms):
        scale = w / total * (min(1.0, bound / n) if n > 0 else 1.0)
        for acc, t in zip(out, tensors):
            acc.add_(t.to(torch.float64), alpha=scale)
    return [t.to(torch.float32) for t in out]
