"""The group's aggregate of sparse contributions: validated, weighted (or robust, dilocox/robust.py) on the
sorted union of the positions they sent, in float64 over peer ids in sorted order, so every member gets
the same bits.
"""

from __future__ import annotations

import logging
import math
from typing import Mapping, Optional, Sequence

import numpy as np
import torch

from dilocox.sign_agreement import SignPolicy, threshold
from dilocox.sparse.threads import thread_map
from dilocox.sparse.wire import ContributionError, Layout, SparseConfig, layout, numel, parse
from dilocox.threads import cpu_budget

logger = logging.getLogger(__name__)


class SparseAggregate(Sequence[torch.Tensor]):
    """The group's aggregate as the sorted union of the sent positions (``support``, int64 positions in all tensors
    flattened and concatenated) and its fp32 ``values`` there: about (8 + 4) x the union's share of the parameters
    in bytes, instead of a dense fp32 copy. It reads as the dense tensors of ``shapes`` it stands for, one at a
    time: item i is a fresh tensor of zeros (+0.0) with tensor i's values scattered in, so consumers that go
    tensor by tensor (digests, the outer step, the catch-up encoding) hold one dense tensor at most, and get the
    same bits as from the dense aggregate."""

    def __init__(self, support: np.ndarray, values: np.ndarray, shapes: Sequence[Sequence[int]]):
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.support, self.values = support, values
        self._offsets = np.cumsum([0] + [math.prod(s) for s in self.shapes])
        self._bounds = np.searchsorted(support, self._offsets)  # tensor i's positions: support[bounds[i]:bounds[i + 1]]

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"tensor {i} of {len(self)}")
        i %= len(self)
        out = np.zeros(self._offsets[i + 1] - self._offsets[i], dtype=np.float32)
        positions, values = self.part(i)
        out[positions] = values
        return torch.from_numpy(out).view(self.shapes[i])

    def part(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Tensor i's (flat positions within it, int64 ascending; its values there), views where they can be."""
        a, b = self._bounds[i], self._bounds[i + 1]
        return self.support[a:b] - self._offsets[i], self.values[a:b]

    @property
    def nbytes(self) -> int:
        """Bytes held (positions and values)."""
        return self.support.nbytes + self.values.nbytes


def _fill(job: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    """A contribution's row of the rule: its values at their ranks in the union (zeros elsewhere)."""
    row, rank, values = job
    values += np.float32(0.0)  # canonical: a zero scale decodes to -0.0 for negative codes
    row[rank] = values


UNION_KEYS = 1 << 16  # keys per block in union (speed only: a block's scratch stays in a core's cache)


def union(idxs: Sequence[np.ndarray], lay: Layout, cfg: SparseConfig) -> tuple[np.ndarray, np.ndarray]:
    """Each contribution's sent positions (as ``parse`` returns them) -> (the sorted union of all of them as flat
    positions (int64), (nidx, k) the rank in that union of each contribution's positions).

    Chunk by chunk: each of a chunk's k x topk positions becomes one integer key, position then origin (entry j
    of contribution i: j k + i), a chunk's keys are sorted (values only: no tie to break), a position that
    differs from its left neighbour starts a new member of the union, and the running count of those is every
    key's rank. The last chunk, if it sends fewer than topk values, is one more (shorter) row of keys."""
    k, topk, nidx = len(idxs), cfg.topk, lay.nidx
    full, short = divmod(nidx, topk)
    tag_bits = max(1, (k * topk - 1).bit_length())
    key_bits = cfg.index_bits + tag_bits
    kt = np.uint16 if key_bits <= 16 else np.uint32 if key_bits <= 32 else np.uint64
    rt = np.int32 if k * nidx < 2**31 else np.int64
    ranks = np.empty((nidx, k), dtype=rt)
    flat = ranks.reshape(-1)
    block = max(1, UNION_KEYS // (k * topk))
    segments = [(r, min(block, full - r), topk) for r in range(0, full, block)] + ([(full, 1, short)] if short else [])
    parts = max(1, min(cpu_budget(), len(segments) // 4))
    groups = [segments[len(segments) * g // parts:len(segments) * (g + 1) // parts] for g in range(parts)]

    support = np.empty(k * nidx, dtype=np.int64)  # at most; the pages past the union are never touched

    def run(group) -> int:  # ranks counted from 0 in each group, members from its first key; both moved below
        at = group[0][0] * topk * k if group else 0
        size = 0
        for row, rows, per in group:
            start = row * topk
            keys = np.empty((rows, per, k), dtype=kt)
            tag = np.arange(0, per * k, k, dtype=kt)
            for i, idx in enumerate(idxs):
                np.left_shift(idx[start:start + rows * per].reshape(rows, per).astype(kt, copy=False), kt(tag_bits),
                              out=keys[:, :, i])
                keys[:, :, i] |= tag + kt(i)
            keys = keys.reshape(rows, per * k)
            keys.sort(axis=1)
            pos = (keys >> kt(tag_bits)).astype(np.int64)
            new = np.empty(keys.shape, dtype=bool)
            new[:, 0] = True
            np.not_equal(pos[:, 1:], pos[:, :-1], out=new[:, 1:])
            rank = np.cumsum(new.reshape(-1), dtype=rt)
            rank += rt(size - 1)
            target = (keys & kt((1 << tag_bits) - 1)).astype(np.intp)  # j k + i: the flat index into ranks
            target += np.arange(start * k, (start + rows * per) * k, per * k, dtype=np.intp)[:, None]
            flat[target.reshape(-1)] = rank
            pos += np.arange(row * cfg.chunk, (row + rows) * cfg.chunk, cfg.chunk, dtype=np.int64)[:, None]
            count = int(rank[-1]) + 1 - size
            support[at + size:at + size + count] = pos.reshape(-1)[new.reshape(-1)]
            size += count
        return size

    offset = 0
    for group, size in zip(groups, thread_map(run, groups)):
        if group and offset:
            at = group[0][0] * topk * k
            flat[at:(group[-1][0] * topk + group[-1][1] * group[-1][2]) * k] += rt(offset)
            support[offset:offset + size] = support[at:at + size]  # down: offset <= at
        offset += size
    return support[:offset], ranks


def aggregate(contributions: Mapping[str, bytes], weights: Mapping[str, float],
              shapes: Sequence[Sequence[int]], cfg: SparseConfig, rule: str = "mean", norm_bound: float = 0.0,
              **robust_kwargs) -> tuple[list[torch.Tensor], dict[str, str]]:
    """``aggregate_scaled`` without the scales: (fp32 tensors, rejected peer -> reason)."""
    out, rejected, _ = aggregate_scaled(contributions, weights, shapes, cfg, rule, norm_bound, **robust_kwargs)
    return out, rejected


def aggregate_scaled(contributions: Mapping[str, bytes], weights: Mapping[str, float],
                     shapes: Sequence[Sequence[int]], cfg: SparseConfig, rule: str = "mean", norm_bound: float = 0.0,
                     **robust_kwargs) -> tuple[list[torch.Tensor], dict[str, str], dict[str, float]]:
    """``aggregate_sparse`` with the aggregate as dense fp32 tensors of ``shapes``."""
    out, rejected, scaled = aggregate_sparse(contributions, weights, shapes, cfg, rule, norm_bound, **robust_kwargs)
    return list(out), rejected, scaled


def aggregate_sparse(contributions: Mapping[str, bytes], weights: Mapping[str, float],
                     shapes: Sequence[Sequence[int]], cfg: SparseConfig, rule: str = "mean", norm_bound: float = 0.0,
                     sign: Optional[SignPolicy] = None, drop_outsized: float = 0.0,
                     **robust_kwargs) -> tuple[SparseAggregate, dict[str, str], dict[str, float]]:
    """The group's aggregate of the decoded contributions: (SparseAggregate, rejected peer -> reason, scaled peer
    -> the norm bound's scale < 1 of its contribution).

    A contribution is dropped if its weight is missing, not finite or <= 0, or its payload fails
    ``decode``'s validation. The accepted ones go through ``dilocox.robust`` (``rule``, ``norm_bound`` and
    its other keyword arguments) in float64 over peer ids in sorted order; with ``drop_outsized`` F > 1, the
    contributions the norm bound scaled by less than 1/F are left out and the rule runs again over the others (their
    scales stay in the third value, so a round stays outsized); then ``sign`` (the robust learning rate,
    dilocox/sign_agreement.py, on the signs of the rows the rule kept; exact); then the result is cast to fp32:
    the same inputs give the same bits on every member, whatever the dicts' order, its CPU or thread count.
    Raises ValueError if no contribution is accepted.

    The rule runs on the sorted union of the sent positions only (at most k x topk/chunk of the
    coordinates; a position no one sent stays +0.0): row i holds contribution i's decoded values there
    (zeros where it sent nothing). That layout is the same on every member; robust.py's norms are fixed
    pairwise trees over it (tests/test_sparse.py checks the result against a plain reference of each rule).
    """
    from dilocox import robust

    shapes = [tuple(s) for s in shapes]
    n = numel(shapes)
    parsed, accepted, rejected = {}, {}, {}
    for peer in sorted(contributions):
        w = weights.get(peer)
        try:
            w = float(w)
        except (TypeError, ValueError):
            rejected[peer] = f"weight {w!r} is not a number"
            continue
        if not (math.isfinite(w) and w > 0):
            rejected[peer] = f"weight {w} must be finite and > 0"
            continue
        accepted[peer] = w

    def parse_one(peer):
        try:
            return parse(contributions[peer], n, cfg)
        except ContributionError as e:
            return e

    for peer, got in zip(list(accepted), thread_map(parse_one, list(accepted))):
        if isinstance(got, ContributionError):
            rejected[peer] = str(got)
            del accepted[peer]
        else:
            parsed[peer] = got
    rejected = dict(sorted(rejected.items()))
    if not parsed:
        raise ValueError(f"no contribution accepted out of {len(contributions)}: {rejected}")
    peers = sorted(parsed)
    support, ranks = union([parsed[p][0] for p in peers], layout(n, cfg), cfg)
    rows = np.zeros((len(peers), len(support)), dtype=np.float32)
    thread_map(_fill, [(row, ranks[:, i], parsed[p][1]) for i, (row, p) in enumerate(zip(rows, peers))])
    del ranks, parsed
    weights_in_order = [accepted[p] for p in peers]
    compact, scales = robust.aggregate_rows(rows, weights_in_order, rule, norm_bound=norm_bound, **robust_kwargs)
    outsized = [i for i, scale in enumerate(scales) if 0.0 < scale < 1.0 / drop_outsized] if drop_outsized else []
    if outsized and len(outsized) < len(peers):  # the rule again without them; their scales stay in the report
        keep = [i for i in range(len(peers)) if i not in outsized]
        compact, again = robust.aggregate_rows(rows[keep], [weights_in_order[i] for i in keep], rule,
                                               norm_bound=norm_bound, **robust_kwargs)
        scales = list(scales)
        for i, scale in zip(keep, again):
            scales[i] = scale
        rows = rows[keep]
        kept_scales = list(again)
        for i in outsized:
            logger.info("contribution of %s left out: the norm bound would scale it by %.3g, under 1/%g (outsized)",
                        peers[i], scales[i], drop_outsized)
    else:
        outsized, kept_scales = [], scales
    if sign is not None and sign.acts(scales):  # the signs of the contributions the rule kept (scale 0: left out)
        kept = [torch.from_numpy(row) for row, scale in zip(rows, kept_scales) if scale > 0.0]
        if kept:
            compact, low = sign.apply(compact, kept, scales)
            logger.info("robust learning rate: %d of %d coordinates %s (|sum of signs| under %d of %d contributions)",
                        low, len(support), "reversed" if sign.rule.value == "flip" else "left out",
                        threshold(sign.min_agreement, len(kept)), len(kept))
    del rows
    values = compact.numpy().astype(np.float32)  # rounded to nearest
    scaled = {peer: float(scale) for peer, scale in zip(peers, scales) if scale < 1.0}
    if len(peers) > 1 and all(scale == 0.0 for scale in scales):
        logger.warning("nothing applied: the contributions of %s share no direction (the opposition screen: too many "
                       "point against the group's coordinate-wise median)", ", ".join(peers))
        return SparseAggregate(support, values, shapes), rejected, scaled
    for peer, scale in scaled.items():  # the caller reports drops; clipping and screening are the rule's business
        if peers.index(peer) in outsized:
            continue
        if scale == 0.0:
            logger.info("contribution of %s left out: it points against the group's coordinate-wise median", peer)
        else:
            logger.info("contribution of %s scaled by %.3g to the group's norm bound", peer, scale)
    return SparseAggregate(support, values, shapes), rejected, scaled
