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
  with tau = the median of ||x_i - v_0|| (ours: a scale-free clipping radius). Before it, the **opposition
  screen** (k >= 3): a contribution whose inner product with v_0 is negative points against what most of the
  group agrees on. Odd k: if at most (k - 1) // 2 are opposed, they are left out (scale 0 in the report) and the
  norm bound and the rule run anew over the others; if more are, the group shares no direction and its aggregate
  is zero (every scale 0): a zero update costs one round where any other can cost the model. Even k: either middle
  value of a coordinate can be one half's (two colluders of four made the lower one theirs and an odd-style screen
  left out an honest member, seen on real nodes), so a row is tested against the lower and the upper middle value,
  v_0 and v_0': if k / 2 or more rows are opposed to either, the halves disagree and the aggregate is zero; else
  the rows opposed to both are left out and the rule runs anew over the others. Why: with 2 of 5 sign-flipped or
  inner-product-manipulated rows (IPM, Xie et al., arXiv 1903.03936) CenteredClip's fixed point moves about
  (2/3) tau towards them, which points against the honest mean once tau exceeds that mean's norm, as it does for
  sparse contributions of different supports; the median of a majority still points the honest way. FLTrust (Cao
  et al., arXiv 2012.13995) likewise drops updates of negative cosine with a reference, there a trusted server's
  update, here the group's median;
* ``centered-clip-plain``: CenteredClip without the screen, for strongly non-IID swarms, where honest
  contributions can point against the median (one class per client, groups of ten: 1.4 points of clean accuracy
  in the BadSFL harness's setting, docs/results/2026-12-06-robust-screen-even.md);
* ``trimmed-mean``: coordinate-wise, drop the floor(``trim`` k) largest and smallest values of each
  coordinate and average the rest (unweighted);
* ``median``: coordinate-wise median (unweighted; the lower middle value for even k).

With sparse contributions most coordinates are zero in most contributions, so the coordinate-wise
rules also zero most of the signal (``make bench-attacks`` measures what each costs).

Determinism across machines (the contract every member relies on). The inputs are k float64 rows of
one length m (float32 rows are widened exactly), finite, taken in sorted peer-id order. Every value is
computed by IEEE-754 basic operations (+ - * / sqrt, each correctly rounded, never fused into a
multiply-add) and by min/max/comparisons, applied elementwise in an order fixed by k, m and the row
order alone: no BLAS, no library reduction (``sum``, ``norm``, ``mean``) whose association order a
CPU's vector width or the thread count could change. Precisely:

* canonical zeros: every input value x is read as x + 0.0 (-0.0 becomes +0.0; nothing else changes),
  and so is every row scaled by the norm bound. Equal values then have equal bits, so the
  coordinate-wise order statistics (computed by min/max networks) are the values a stable sort gives,
  and no result holds -0.0;
* ``tree_sum(a)`` (length m): pad a with zeros to a multiple of ``BLOCK`` = 16384 values; inside each
  block, for h = 8192, 4096, ..., 1: a[j] <- a[j] + a[j + h] for j < h, which leaves the block's
  sum in its first value; then over the block sums s (count c): while c > 1, with h = ceil(c / 2),
  s[j] <- s[j] + s[j + h] for j < c - h, and c <- h. ``norm(x)`` = sqrt(tree_sum(x * x)): the tree
  depends on m, so a vector's norm changes in its last bits if zeros are inserted (sparse rounds run the
  rule on the sorted union of the sent positions: the same layout on every member);
* sums accumulate from +0.0 in a fixed order, acc <- acc + c_i * y_i (the product rounded first): the
  mean over the rows in sorted peer order, c_i = w_i / W with W = ``math.fsum`` of the weights; the
  trimmed mean over the kept order statistics from the smallest, c = 1 / their count; CenteredClip's
  step v + (sum over the rows in sorted peer order of c_i (x_i - v)), c_i = w_i / W * min(1, tau / d_i)
  (w_i / W if d_i = 0), d_i = norm(x_i - v) and tau the median of norm(x_i - v_0), the middle value or
  (a + b) / 2 for even k. The norm bound scales row i by min(1, limit / norm(x_i)), limit = norm_bound
  x the lower middle norm; the screen's inner products are tree_sum(x_i * v_0) (k even: and tree_sum(x_i * v_0'),
  v_0' the upper middle values) over the bounded rows, and a row is opposed if that is < 0.0. Scalars are
  Python floats (IEEE doubles) in exactly these expressions.

The implementation works on the columns in cache-sized batches of whole blocks with numpy's
elementwise loops (one rounding per operation: numpy never contracts a multiply and an add, whatever
its SIMD width), a batch entirely on one thread of up to cpu_budget(); the tree's blocks
never straddle a batch and each batch writes only its own columns and blocks, so batching and threads
change the speed, not the bits. tests/test_robust.py holds a straightforward whole-vector reference of
every rule and checks equal bits (and 1 vs 2 threads, and the scalar vs vectorized kernels).
Where the rows come from sparse contributions (dilocox/sparse/), they are the decoded values on the
sorted union of the sent positions, zeros where a contribution sent nothing.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from functools import lru_cache
from typing import Mapping, Sequence

import numpy as np
import torch

from dilocox.threads import cpu_budget

BLOCK = 1 << 14  # leaves of one pairwise tree (module docstring); part of the determinism contract
# bumped whenever the rules' bits change (2: norms summed by the fixed pairwise tree, not math.fsum; 3: centered-clip's
# opposition screen; 4: the screen in even groups): part of the swarm settings, so nodes whose aggregates would
# differ refuse to share a swarm
RULES_VERSION = 4
_KEEP = 64  # halving levels below this width run once over all blocks' partial sums (same tree, fewer calls)
BATCH_BLOCKS = 1  # tree blocks (columns / BLOCK) per batch (speed only): k x 16384 float64 stay in a core's cache


class Aggregation(str, Enum):
    """The rules (module docstring)."""

    MEAN = "mean"
    CENTERED_CLIP = "centered-clip"  # with the opposition screen (module docstring)
    CENTERED_CLIP_PLAIN = "centered-clip-plain"  # without it
    TRIMMED_MEAN = "trimmed-mean"
    MEDIAN = "median"


_CLIPS = (Aggregation.CENTERED_CLIP, Aggregation.CENTERED_CLIP_PLAIN)


def _finish_tree(parts: np.ndarray) -> list[float]:
    """(rows, blocks, w) partial sums (w a power of two <= BLOCK, each block halved down to w) -> each row's
    tree_sum; changes ``parts``."""
    h = parts.shape[2] // 2
    while h:
        np.add(parts[:, :, :h], parts[:, :, h:2 * h], out=parts[:, :, :h])
        h //= 2
    s = parts[:, :, 0]
    c = s.shape[1]
    while c > 1:
        h = (c + 1) // 2
        np.add(s[:, :c - h], s[:, h:c], out=s[:, :c - h])
        c = h
    return s[:, 0].tolist() if c else [0.0] * parts.shape[0]


def _halve(b: np.ndarray, spare: np.ndarray, parts: np.ndarray) -> None:
    """The tree's levels inside each block of ``b`` (rows, blocks, BLOCK), down to ``parts.shape[2]`` values per
    block, written into ``parts``; ``spare`` (rows, blocks, BLOCK // 2) and ``b`` take turns holding a level (a
    level written over its own input would make numpy copy it first)."""
    src, h = b, BLOCK // 2
    bufs = (spare, b)
    i = 0
    while h > parts.shape[2]:
        np.add(src[:, :, :h], src[:, :, h:2 * h], out=bufs[i][:, :, :h])
        src, h, i = bufs[i], h // 2, 1 - i
    np.add(src[:, :, :h], src[:, :, h:2 * h], out=parts)


def _float64(a) -> np.ndarray:
    a = a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    return a.reshape(-1).astype(np.float64, copy=False)


def tree_sum(a: torch.Tensor | np.ndarray) -> float:
    """The fixed pairwise sum of a float64 vector (module docstring): the same bits on every machine."""
    a = _float64(a)
    nb = -(-len(a) // BLOCK)
    if not nb:
        return 0.0
    buf = np.zeros(nb * BLOCK)
    buf[:len(a)] = a
    parts = np.empty((1, nb, min(_KEEP, BLOCK)))
    _halve(buf.reshape(1, nb, BLOCK), np.empty((1, nb, BLOCK // 2)), parts)
    return _finish_tree(parts)[0]


def norm(x: torch.Tensor | np.ndarray) -> float:
    """||x||_2 of a vector in float64: sqrt of ``tree_sum`` of the rounded squares (inf when they overflow)."""
    a = _float64(x)
    with np.errstate(over="ignore"):
        return math.sqrt(tree_sum(a * a))


@lru_cache(maxsize=None)
def _network(k: int, wanted: tuple[int, ...]) -> tuple[tuple[int, int, bool, bool], ...]:
    """Compare-exchange steps (i, j, min needed, max needed) that leave the sorted values ``wanted`` on their
    wires: Batcher's odd-even merge sort for k wires, pruned of what the wanted outputs do not read."""
    p = 1
    while p < k:
        p *= 2
    steps = []
    size = 1
    while size < p:  # Batcher's odd-even merge sort on p wires (Knuth 5.3.4, exercise 32)
        step = size
        while step:
            for j in range(step % size, p - step, 2 * step):
                for i in range(min(step, p - j - step)):
                    a, b = i + j, i + j + step
                    if a // (2 * size) == b // (2 * size) and b < k:  # wires >= k hold +inf: no-ops
                        steps.append((a, b))
            step //= 2
        size *= 2
    live, kept = set(wanted), []
    for a, b in reversed(steps):
        lo, hi = a in live, b in live
        if lo or hi:
            kept.append((a, b, lo, hi))
            live |= {a, b}
    return tuple(reversed(kept))


def _order_stats(rows: Sequence[np.ndarray], wanted: tuple[int, ...]) -> list[np.ndarray]:
    """The ``wanted`` order statistics (0 = smallest) of each coordinate of canonical rows (no -0.0, no NaN):
    a min/max network, so the values a stable sort would give."""
    wires = list(rows)
    for a, b, lo, hi in _network(len(wires), wanted):
        x, y = wires[a], wires[b]
        if lo:
            wires[a] = np.minimum(x, y)
        if hi:
            wires[b] = np.maximum(x, y)
    return [wires[i] for i in wanted]


def _median_of(values: Sequence[float]) -> float:
    """The median of a few floats: the middle one, or the mean (a + b) / 2 of the middle two."""
    s = sorted(values)
    h = len(s) // 2
    return s[h] if len(s) % 2 else (s[h - 1] + s[h]) / 2


class _Scratch:
    """One worker's float64 buffers for a batch: the rows (xd), a difference (d), a sum (acc) and the tree's
    spare half (spare)."""

    def __init__(self, k: int, width: int):
        self.xd, self.d, self.acc = np.empty((k, width)), np.empty((k, width)), np.empty(width)
        self.spare = np.empty((k, width // 2))


class _Rows:
    """k rows (float32 or float64, finite, canonical) processed in column batches of whole tree blocks, on up to
    ``workers`` threads (numpy releases the GIL in its loops; each batch is computed the same way by whichever
    thread takes it, and writes only its own columns and tree blocks).

    ``load`` widens a batch into float64 scratch, with each row's norm-bound scale applied (x * s + 0.0);
    ``tree`` halves squares in place and keeps each block's partial sums for ``_finish_tree``."""

    def __init__(self, x: np.ndarray, batch_blocks: int, workers: int):
        self.x = x
        self.k, self.m = x.shape
        self.scales = [1.0] * self.k
        self.width = BLOCK * max(1, batch_blocks)
        self.padded = -(-self.m // BLOCK) * BLOCK
        self.nblocks = self.padded // BLOCK
        self.spans = [(lo, min(lo + self.width, self.m), min(lo + self.width, self.padded))
                      for lo in range(0, self.padded, self.width)]
        self.workers = max(1, min(workers, len(self.spans)))
        w = min(self.width, self.padded)
        self.scratch = [_Scratch(self.k, w) for _ in range(self.workers)]
        self.pool = ThreadPoolExecutor(self.workers) if self.workers > 1 else None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()

    def load(self, ws: _Scratch, lo: int, stop: int, hi: int) -> np.ndarray:
        xd = ws.xd[:, :hi - lo]
        xd[:, :stop - lo] = self.x[:, lo:stop]
        xd[:, stop - lo:] = 0.0
        for i, s in enumerate(self.scales):
            if s < 1.0:
                xd[i] *= s
                xd[i] += 0.0  # canonical: a product that underflows to -0.0 reads as +0.0
        return xd

    def parts(self) -> np.ndarray:
        return np.empty((self.k, self.nblocks, min(_KEEP, BLOCK)))

    def tree(self, ws: _Scratch, sq: np.ndarray, lo: int, hi: int, parts: np.ndarray) -> None:
        """Halve the (k, hi - lo) squares ``sq`` (whole blocks; overwritten), the last level into ``parts``."""
        nb = (hi - lo) // BLOCK
        _halve(sq.reshape(self.k, nb, BLOCK), ws.spare[:, :nb * BLOCK // 2].reshape(self.k, nb, BLOCK // 2),
               parts[:, lo // BLOCK:hi // BLOCK])

    def sweep(self, *steps) -> None:
        """Each batch loaded once, then ``step(scratch, xd, lo, hi)`` for each step in order (the last may change
        xd); the batches split in contiguous runs between the workers."""
        def run(worker: int) -> None:
            ws = self.scratch[worker]
            n = len(self.spans)
            with np.errstate(over="ignore"):  # a square past float64's range is inf (its norm then is)
                for lo, stop, hi in self.spans[n * worker // self.workers:n * (worker + 1) // self.workers]:
                    xd = self.load(ws, lo, stop, hi)
                    for step in steps:
                        step(ws, xd, lo, hi)

        if self.pool is None:
            run(0)
        else:
            list(self.pool.map(run, range(self.workers)))


def _weighted_rows(d: np.ndarray, coefs: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out <- sum_i coefs[i] * d[i] in row order (``coefs`` a (k, 1) column; d is scaled in place): the sum from
    +0.0 of the module docstring but for the sign of a zero result."""
    d *= coefs
    if len(d) == 1:
        out[:] = d[0]
    else:
        np.add(d[0], d[1], out=out)
    for i in range(2, len(d)):
        out += d[i]
    return out


def aggregate_rows(x: torch.Tensor | np.ndarray, weights: Sequence[float], rule: Aggregation | str,
                   norm_bound: float = 2.0, trim: float = 0.2, iterations: int = 3, batch_blocks: int | None = None,
                   workers: int | None = None) -> tuple[torch.Tensor, list[float]]:
    """The rule on a (k, m) matrix of rows in sorted peer order (float32 or float64, finite, without -0.0):
    (float64 vector of m values, the scale of each row: 1, the norm bound's < 1, or 0 for a row the opposition
    screen left out). ``aggregate`` on a matrix; reads ``x`` only. Speed only: ``batch_blocks``, tree blocks
    processed at a time; ``workers``, threads (default cpu_budget()).

    The rule's first sweep over the rows runs with the norms' sweep, as if no row were scaled, and again
    only if one is: a round without an outsized contribution reads the rows once less."""
    rule = Aggregation(rule)
    x = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    k, m = x.shape
    if not k:
        raise ValueError("no contribution to aggregate")
    w = [float(v) for v in weights]
    rows = _Rows(x, batch_blocks or BATCH_BLOCKS, workers or cpu_budget())
    try:
        out = _aggregate(rows, w, rule, norm_bound, trim, iterations)
    finally:
        rows.close()
    return torch.from_numpy(out[:m]), rows.scales


def _aggregate(rows: _Rows, w: list[float], rule: Aggregation, norm_bound: float, trim: float,
               iterations: int, screen_opposed: bool = True) -> np.ndarray:
    k = rows.k
    out = np.empty(rows.padded)
    parts = rows.parts()
    if rule == Aggregation.MEAN or k == 1:
        total = math.fsum(w)
        coefs = np.array([v / total for v in w]).reshape(k, 1)

        def first(ws, xd, lo, hi):
            _weighted_rows(xd, coefs, out[lo:hi])
            out[lo:hi] += 0.0  # the sum from +0.0: a zero is +0.0
    elif rule in _CLIPS:
        screened = rule == Aggregation.CENTERED_CLIP and screen_opposed and k >= 3
        dot_parts = rows.parts() if screened else None
        # even k: the upper middle value too, as either middle can be one half's values (module docstring)
        upper_parts = rows.parts() if screened and not k % 2 else None
        middles = ((k - 1) // 2, k // 2) if upper_parts is not None else ((k - 1) // 2,)

        def first(ws, xd, lo, hi):  # v_0 = the lower median, the tree of each ||x_i - v_0||^2 and of each <x_i, v_0>
            vb = out[lo:hi]
            stats = _order_stats(list(xd), middles)
            vb[:] = stats[0]
            d = ws.d[:, :hi - lo]
            np.subtract(xd, vb, out=d)
            d *= d
            rows.tree(ws, d, lo, hi, parts)
            if dot_parts is not None:
                np.multiply(xd, vb, out=d)
                rows.tree(ws, d, lo, hi, dot_parts)
            if upper_parts is not None:
                np.multiply(xd, stats[1], out=d)
                rows.tree(ws, d, lo, hi, upper_parts)
    else:
        cut = min(int(math.floor(trim * k)), (k - 1) // 2) if rule == Aggregation.TRIMMED_MEAN else None
        wanted = tuple(range(cut, k - cut)) if cut is not None else ((k - 1) // 2,)
        c = 1.0 / len(wanted)

        def first(ws, xd, lo, hi):
            stats = _order_stats(list(xd), wanted)
            o = out[lo:hi]
            if cut is None:
                o[:] = stats[0]
                return
            np.multiply(stats[0], c, out=o)
            for s in stats[1:]:
                o += s * c
            o += 0.0
    if norm_bound and math.isfinite(norm_bound) and k > 1:
        squares = rows.parts()

        def norms(ws, xd, lo, hi):
            d = ws.d[:, :hi - lo]
            np.multiply(xd, xd, out=d)
            rows.tree(ws, d, lo, hi, squares)
        rows.sweep(norms, first)
        sizes = [math.sqrt(s) for s in _finish_tree(squares)]
        del squares
        limit = norm_bound * sorted(sizes)[(k - 1) // 2]
        scales = [min(1.0, limit / n) if n > 0 else 1.0 for n in sizes]
        if min(scales) < 1.0:
            rows.scales = scales
            rows.sweep(first)
    else:
        rows.sweep(first)
    if rule in _CLIPS and k > 1:
        if dot_parts is not None:
            left_out, nothing = _screen(_finish_tree(dot_parts),
                                        _finish_tree(upper_parts) if upper_parts is not None else None)
            if nothing:  # no direction the group shares: nothing applied
                rows.scales = [0.0] * k
                out[:] = 0.0
                return out
            if left_out:  # a minority against what the others share
                return _without(rows, left_out, w, rule, norm_bound, trim, iterations)
        _centered_clip(rows, w, iterations, out, [math.sqrt(s) for s in _finish_tree(parts)])
    return out


def _screen(dots: list[float], upper_dots: list[float] | None) -> tuple[list[int], bool]:
    """The opposition screen's verdict from each row's inner product with the lower middle value (and, k even,
    with the upper one): (rows left out, whether nothing is applied), by the module docstring's rule."""
    k = len(dots)
    opposed = [i for i, dot in enumerate(dots) if dot < 0.0]
    if upper_dots is None:  # k odd: a minority opposed is left out, a majority gets nothing applied
        return opposed, len(opposed) > (k - 1) // 2
    against_upper = [i for i, dot in enumerate(upper_dots) if dot < 0.0]
    return ([i for i in opposed if i in against_upper],
            len(set(opposed) | set(against_upper)) >= k // 2)


def _without(rows: _Rows, opposed: list[int], w: list[float], rule: Aggregation, norm_bound: float, trim: float,
             iterations: int) -> np.ndarray:
    """The rule over the rows not in ``opposed`` (the norm bound measured anew among them, no second screen);
    ``rows.scales`` becomes 0.0 for an opposed row and the kept rows' scales."""
    keep = [i for i in range(rows.k) if i not in opposed]
    sub = _Rows(rows.x[keep], rows.width // BLOCK, rows.workers)
    try:
        out = _aggregate(sub, [w[i] for i in keep], rule, norm_bound, trim, iterations, screen_opposed=False)
    finally:
        sub.close()
    scales = [0.0] * rows.k
    for i, s in zip(keep, sub.scales):
        scales[i] = s
    rows.scales = scales
    return out


def _centered_clip(rows: _Rows, weights: list[float], iterations: int, v: np.ndarray, dist: list[float]) -> None:
    """CenteredClip's iterations on ``v`` (``padded`` values, holding v_0; ``dist``: each ||x_i - v_0||): one sweep
    each, which also measures the distances the next one needs."""
    tau = _median_of(dist)
    total = math.fsum(weights)
    for it in range(iterations):
        coefs = np.array([w / total * (min(1.0, tau / d) if d > 0 else 1.0)
                          for w, d in zip(weights, dist)]).reshape(-1, 1)
        parts = rows.parts() if it < iterations - 1 else None

        def step(ws, xd, lo, hi):
            vb = v[lo:hi]
            d = ws.d[:, :hi - lo]
            np.subtract(xd, vb, out=d)
            vb += _weighted_rows(d, coefs, ws.acc[:hi - lo])  # v + (a zero sum's sign cannot matter: v has no -0.0)
            if parts is not None:
                np.subtract(xd, vb, out=d)
                d *= d
                rows.tree(ws, d, lo, hi, parts)
        rows.sweep(step)
        if parts is not None:
            dist = [math.sqrt(s) for s in _finish_tree(parts)]


def _matrix(rows: Sequence[torch.Tensor]) -> np.ndarray:
    """Stack rows as canonical float64 (x + 0.0: -0.0 becomes +0.0)."""
    x = np.empty((len(rows), len(rows[0].reshape(-1)) if rows else 0))
    for dst, r in zip(x, rows):
        np.add(_float64(r), 0.0, out=dst)
    return x


def coordinate_median(rows: list[torch.Tensor]) -> torch.Tensor:
    """The lower middle value of each coordinate (k odd: the median)."""
    return aggregate_rows(_matrix(rows), [1.0] * len(rows), Aggregation.MEDIAN, norm_bound=0.0)[0]


def trimmed_mean(rows: list[torch.Tensor], trim: float) -> torch.Tensor:
    return aggregate_rows(_matrix(rows), [1.0] * len(rows), Aggregation.TRIMMED_MEAN, norm_bound=0.0, trim=trim)[0]


def centered_clip(rows: list[torch.Tensor], weights: list[float], iterations: int) -> torch.Tensor:
    return aggregate_rows(_matrix(rows), weights, Aggregation.CENTERED_CLIP, norm_bound=0.0,
                          iterations=iterations)[0]


def bound_norms(rows: list[torch.Tensor], norm_bound: float) -> tuple[list[torch.Tensor], list[float]]:
    """Scale each row to at most ``norm_bound`` x the lower median norm (k odd: the median; k = 2: the
    smaller, so one of two cannot raise the bound by scaling itself); returns (rows, the scale of each).
    A scaled row is r * s + 0.0 (canonical zeros, module docstring)."""
    norms = [norm(r) for r in rows]
    limit = norm_bound * sorted(norms)[(len(norms) - 1) // 2]
    scales = [min(1.0, limit / n) if n > 0 else 1.0 for n in norms]
    return [r * s + 0.0 if s < 1.0 else r for r, s in zip(rows, scales)], scales


def aggregate(vectors: Mapping[str, torch.Tensor], weights: Mapping[str, float], rule: Aggregation | str,
              norm_bound: float = 2.0, trim: float = 0.2, iterations: int = 3) -> tuple[torch.Tensor, dict]:
    """The group's aggregate of ``vectors`` (peer_id -> flat float tensor, all of one length, finite) under ``rule``.

    ``weights``: peer_id -> finite weight > 0 (validated by the caller). ``norm_bound``: multiple of the
    lower median norm each contribution is clipped to (0 or inf: no bounding). Returns (float64 vector,
    report: {"clipped": {peer: scale < 1, 0 where the opposition screen left it out}, "rule": value}). Raises
    ValueError on no vectors or an unknown rule."""
    rule = Aggregation(rule)
    peers = sorted(vectors)
    if not peers:
        raise ValueError("no contribution to aggregate")
    out, scales = aggregate_rows(_matrix([vectors[p] for p in peers]), [float(weights[p]) for p in peers], rule,
                                 norm_bound=norm_bound, trim=trim, iterations=iterations)
    return out, dict(rule=rule.value, clipped={p: s for p, s in zip(peers, scales) if s < 1.0})
