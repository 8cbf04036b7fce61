"""Robust aggregation of the group's decoded contributions, bit-identical on every member.

Every member of an all-gather round (peers/allgather.py) holds the same accepted contributions
and runs the same rule here, so all get the same bits; a member that disagrees is caught by the
result digests (docs/protocol.md). The rules (``--aggregation``), after **norm bounding** (each
contribution scaled down to at most ``norm_bound`` times the lower median norm of the group's
contributions; Sun et al., arXiv 1911.07963, with the median as the data-driven bound; the lower
middle value, so that in a pair with one attacker the bound is the smaller norm, not their mean):

* ``mean``: the weighted mean (weights = inner steps), what DiLoCo averages;
* ``centered-clip``: CenteredClip (Karimireddy et al., arXiv 2012.10333; as used by BTARD,
  Gorbunov et al., arXiv 2106.11257): from v_0 = the coordinate-wise median,
  v_{l+1} = v_l + sum_i w_i (x_i - v_l) min(1, tau / ||x_i - v_l||) / sum_i w_i, ``iterations`` times,
  with tau = the median of ||x_i - v_0|| (ours: a scale-free clipping radius);
* ``trimmed-mean``: coordinate-wise, drop the floor(``trim`` k) largest and smallest values of each
  coordinate and average the rest (unweighted);
* ``median``: coordinate-wise median (unweighted; the lower middle value for even k).

With sparse contributions most coordinates are zero in most contributions, so the coordinate-wise
rules also zero most of the signal (``make bench-attacks`` measures what each costs).

Determinism across machines: every per-coordinate operation is elementwise over contributions taken
in sorted peer-id order (no reduction whose association order a CPU's vector units could change), and
every norm is ``math.fsum`` of exactly rounded squares (correctly rounded, hence independent of the
summation order). Inputs are float64; the caller casts the result.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Mapping

import numpy as np
import torch


class Aggregation(str, Enum):
    MEAN = "mean"
    CENTERED_CLIP = "centered-clip"
    TRIMMED_MEAN = "trimmed-mean"
    MEDIAN = "median"


def norm(x: torch.Tensor) -> float:
    """||x||_2 of a float64 vector, correctly rounded (math.fsum of the squares); inf when it overflows."""
    a = x.detach().to(torch.float64).numpy()
    with np.errstate(over="ignore"):  # a square past float64's range is inf: the norm is then inf
        squares = a * a
    try:
        return math.sqrt(math.fsum(squares.tolist())) if a.size else 0.0
    except (OverflowError, ValueError):  # fsum: inf - inf or an intermediate overflow
        return math.inf


def _weighted_sum(rows: list[torch.Tensor], coefs: list[float]) -> torch.Tensor:
    """sum_i coefs[i] * rows[i], accumulated row by row in the given order (elementwise, deterministic)."""
    acc = torch.zeros_like(rows[0])
    for c, r in zip(coefs, rows):
        acc += c * r
    return acc


def _coordinate_sorted(rows: list[torch.Tensor]) -> torch.Tensor:
    """(k, n): each coordinate's values in ascending order (a sort moves values, it rounds nothing)."""
    return torch.sort(torch.stack(rows), dim=0, stable=True).values


def coordinate_median(rows: list[torch.Tensor]) -> torch.Tensor:
    """The lower middle value of each coordinate (k odd: the median)."""
    return _coordinate_sorted(rows)[(len(rows) - 1) // 2].clone()


def trimmed_mean(rows: list[torch.Tensor], trim: float) -> torch.Tensor:
    s = _coordinate_sorted(rows)
    k = len(rows)
    cut = min(int(math.floor(trim * k)), (k - 1) // 2)
    kept = [s[i] for i in range(cut, k - cut)]
    return _weighted_sum(kept, [1.0 / len(kept)] * len(kept))


def centered_clip(rows: list[torch.Tensor], weights: list[float], iterations: int) -> torch.Tensor:
    v = coordinate_median(rows)
    tau = float(np.median([norm(r - v) for r in rows]))
    total = math.fsum(weights)
    for _ in range(iterations):
        coefs = []
        for r, w in zip(rows, weights):
            d = norm(r - v)
            coefs.append(w / total * (min(1.0, tau / d) if d > 0 else 1.0))
        v = v + _weighted_sum([r - v for r in rows], coefs)
    return v


def bound_norms(rows: list[torch.Tensor], norm_bound: float) -> tuple[list[torch.Tensor], list[float]]:
    """Scale each row to at most ``norm_bound`` x the lower median norm (k odd: the median; k = 2: the
    smaller, so one of two cannot raise the bound by scaling itself); returns (rows, the scale of each)."""
    norms = [norm(r) for r in rows]
    limit = norm_bound * sorted(norms)[(len(norms) - 1) // 2]
    scales = [min(1.0, limit / n) if n > 0 else 1.0 for n in norms]
    return [r * s if s < 1.0 else r for r, s in zip(rows, scales)], scales


def aggregate(vectors: Mapping[str, torch.Tensor], weights: Mapping[str, float], rule: Aggregation | str,
              norm_bound: float = 2.0, trim: float = 0.2, iterations: int = 3) -> tuple[torch.Tensor, dict]:
    """The group's aggregate of ``vectors`` (peer_id -> flat float64 tensor, all of one length) under ``rule``.

    ``weights``: peer_id -> finite weight > 0 (validated by the caller). ``norm_bound``: multiple of the
    lower median norm each contribution is clipped to (0 or inf: no bounding). Returns (float64 vector,
    report: {"clipped": {peer: scale < 1}, "rule": value}). Raises ValueError on no vectors or an
    unknown rule."""
    rule = Aggregation(rule)
    peers = sorted(vectors)
    if not peers:
        raise ValueError("no contribution to aggregate")
    rows = [vectors[p].to(torch.float64) for p in peers]
    w = [float(weights[p]) for p in peers]
    clipped = {}
    if norm_bound and math.isfinite(norm_bound) and len(rows) > 1:
        rows, scales = bound_norms(rows, norm_bound)
        clipped = {p: s for p, s in zip(peers, scales) if s < 1.0}
    if rule == Aggregation.MEAN or len(rows) == 1:
        total = math.fsum(w)
        out = _weighted_sum(rows, [x / total for x in w])
    elif rule == Aggregation.CENTERED_CLIP:
        out = centered_clip(rows, w, iterations)
    elif rule == Aggregation.TRIMMED_MEAN:
        out = trimmed_mean(rows, trim)
    else:
        out = coordinate_median(rows)
    return out, dict(rule=rule.value, clipped=clipped)
