"""A straightforward reference of the determinism contract of the robust aggregation rules (dilocox/robust.py's
docstring): whole vectors, one rule at a time, a stable sort for the order statistics (numpy, float64); the
implementation must give the same bits (tests/test_robust.py, and the sparse rounds in tests/test_sparse.py)."""

from __future__ import annotations

import math

import numpy as np
import torch


def reference_tree_sum(a) -> float:
    a = np.asarray(a, dtype=np.float64)
    nb = -(-len(a) // 16384)
    if not nb:
        return 0.0
    b = np.zeros(nb * 16384)
    b[:len(a)] = a
    b = b.reshape(nb, 16384)
    h = 8192
    while h:
        b[:, :h] = b[:, :h] + b[:, h:2 * h]
        h //= 2
    s, c = b[:, 0].copy(), nb
    while c > 1:
        h = (c + 1) // 2
        s[:c - h] = s[:c - h] + s[h:c]
        c = h
    return float(s[0])


def reference_norm(x) -> float:
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):
        return math.sqrt(reference_tree_sum(x * x))


def reference_aggregate(rows: list[torch.Tensor], w: list[float], rule: str, norm_bound: float = 2.0,
                        trim: float = 0.2, iterations: int = 3, screen_opposed: bool = True) -> torch.Tensor:
    """The rule's value by the contract (centered-clip-plain: centered-clip with ``screen_opposed`` False)."""
    if rule == "centered-clip-plain":
        rule, screen_opposed = "centered-clip", False
    given = rows
    rows = [r.double().numpy() + 0.0 for r in rows]
    k = len(rows)
    if norm_bound and k > 1:
        norms = [reference_norm(r) for r in rows]
        limit = norm_bound * sorted(norms)[(k - 1) // 2]
        scales = [min(1.0, limit / n) if n > 0 else 1.0 for n in norms]
        rows = [r * s + 0.0 if s < 1.0 else r for r, s in zip(rows, scales)]

    def weighted(rs, cs):
        acc = np.zeros_like(rs[0])
        for c, r in zip(cs, rs):
            acc += c * r
        return acc

    def ordered():
        return np.sort(np.stack(rows), axis=0, kind="stable")

    if rule == "mean" or k == 1:
        total = math.fsum(w)
        out = weighted(rows, [x / total for x in w])
    elif rule == "median":
        out = ordered()[(k - 1) // 2].copy()
    elif rule == "trimmed-mean":
        s, cut = ordered(), min(int(math.floor(trim * k)), (k - 1) // 2)
        kept = [s[i] for i in range(cut, k - cut)]
        out = weighted(kept, [1.0 / len(kept)] * len(kept))
    else:
        s = ordered()
        v, upper = s[(k - 1) // 2].copy(), s[k // 2]
        screened = k >= 3 and screen_opposed
        opposed = [i for i, r in enumerate(rows) if screened and reference_tree_sum(r * v) < 0.0]
        if k % 2:  # odd: a minority against the median is left out, a majority gets nothing applied
            out_, zero = opposed, len(opposed) > (k - 1) // 2
        else:  # even: against both middle values is left out, half against either gets nothing applied
            against_upper = [i for i, r in enumerate(rows) if screened and reference_tree_sum(r * upper) < 0.0]
            out_ = [i for i in opposed if i in against_upper]
            zero = len(set(opposed) | set(against_upper)) >= k // 2
        if zero:
            return torch.zeros(len(rows[0]), dtype=torch.float64)
        if out_:
            keep = [i for i in range(k) if i not in out_]
            return reference_aggregate([given[i] for i in keep], [w[i] for i in keep], rule, norm_bound, trim,
                                       iterations, screen_opposed=False)
        dist = sorted(reference_norm(r - v) for r in rows)
        tau = dist[k // 2] if k % 2 else (dist[k // 2 - 1] + dist[k // 2]) / 2
        total = math.fsum(w)
        for _ in range(iterations):
            coefs = []
            for r, x in zip(rows, w):
                d = reference_norm(r - v)
                coefs.append(x / total * (min(1.0, tau / d) if d > 0 else 1.0))
            v = v + weighted([r - v for r in rows], coefs)
        out = v
    return torch.from_numpy(out)


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and bool((a.view(np.int64) == b.view(np.int64)).all())


