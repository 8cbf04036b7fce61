"""Index-set selections for shared-index rounds measured by bench/quality.py alone (the daemon runs the union
of proposals, dilocox/shared_index.py, through peers/reducescatter.py):

* ``leader`` (``leader_rank``, then dilocox.shared_index.leader_positions on the leader's beta e + delta):
  cyclic local top-k (CLT-k), Chen et al., "ScaleCom", NeurIPS 2020, arXiv 2104.11125, Sec. 3;
* ``random`` (``random_positions``): random-k with a seed shared by (seed, outer step), no index bytes;
* ``union_positions``: the union of the k proposals computed in one place, with their index bytes
  (``index_bytes``), as a simulation of the union the reducers serve;
* ``reduce_by_range``: ``reduce`` as k range reducers of a reduce-scatter compute it.

The config's ``selection`` (dilocox.shared_index.Selection) names them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np
import torch

from dilocox.shared_index import (
    Reduced,
    ReducerFeedback,
    Selection,
    SharedIndexConfig,
    flat_positions,
    leader_positions,
    padded_chunks,
    range_slices,
    reduce,
)


def leader_rank(outer_step: int, k: int) -> int:
    """The leader's rank among the k members sorted by peer id: (outer_step - 1) mod k, so each leads in turn."""
    if k < 1:
        raise ValueError(f"a group has at least one member; got k={k}")
    return (outer_step - 1) % k


def random_positions(n: int, cfg: SharedIndexConfig, seed: int, outer_step: int) -> np.ndarray:
    """topk positions per chunk drawn uniformly without replacement from torch's CPU generator seeded by
    (seed, outer_step): the same on every member. Sorted flat int64 positions below n."""
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    g = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(outer_step)) % (1 << 63))
    keys = padded_chunks(torch.rand(n, generator=g), cfg.chunk)
    return flat_positions(torch.topk(keys, cfg.topk, dim=1, sorted=False).indices, n, cfg.chunk)


def union_positions(ms: Sequence[torch.Tensor], cfg: SharedIndexConfig) -> tuple[np.ndarray, int]:
    """The union of every member's proposal, the ceil(topk / k) largest |values| of each chunk of its ``ms``
    entry (flat fp32, beta e + delta), as sorted flat int64 positions, and the bytes of the k proposals as
    Rice-coded index sets (``index_bytes``). Raises ValueError for no members or non-finite values."""
    if not ms:
        raise ValueError("no member to propose positions")
    q = -(-cfg.topk // len(ms))
    own = replace(cfg, topk=q, selection=Selection.LEADER)
    proposals = [leader_positions(m, own) for m in ms]
    return np.unique(np.concatenate(proposals)), sum(index_bytes(p, ms[0].numel(), own) for p in proposals)


def index_bytes(positions: np.ndarray, n: int, cfg: SharedIndexConfig) -> int:
    """Bytes of the index set as ``dilocox.sparse.encode_positions`` sends it (Rice-coded gaps, chunk after
    chunk, after a u64 unary length); 0 for a random selection (the seed is the outer step)."""
    if cfg.selection == Selection.RANDOM or not len(positions):
        return 0
    local = positions % cfg.chunk
    first = np.r_[True, positions[1:] // cfg.chunk != positions[:-1] // cfg.chunk]
    gaps = np.where(first, local, np.r_[0, np.diff(local) - 1])
    b = cfg.rice_bits
    return 8 + -(-len(gaps) * b // 8) + -(-int(((gaps >> b) + 1).sum()) // 8)  # u64, remainders, unary stream


def reduce_by_range(values: Sequence[np.ndarray], weights: Sequence[float], positions: np.ndarray, n: int,
                    cfg: SharedIndexConfig, rule: str = "mean", norm_bound: float = 0.0,
                    feedback: "ReducerFeedback | None" = None) -> Reduced:
    """``reduce`` as k = len(values) reducers of a reduce-scatter compute it, each on its range of chunks
    (``chunk_ranges``): the same result under the coordinate-wise rules; norm bounding and centered-clip see
    each range's norms, as BTARD's butterfly clipping does (Gorbunov et al., arXiv 2106.11257, Sec. 3)."""
    parts = [reduce([np.asarray(v)[sl] for v in values], weights, positions[sl], n, cfg, rule, norm_bound, feedback)
             for sl in range_slices(positions, n, cfg.chunk, len(values)) if sl.stop > sl.start]
    if not parts:
        return reduce(values, weights, positions, n, cfg, rule, norm_bound, feedback)
    return Reduced(np.concatenate([p.applied for p in parts]), np.concatenate([p.residual for p in parts]),
                   b"".join(p.payload for p in parts))
