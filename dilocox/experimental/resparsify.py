"""Re-sparsifying a round's aggregate (global top-k) and returning what it drops to the contributors.

Why: in an all-gather every member downloads the other k - 1 contributions, and the swarm's upload
equals its download, so a member uploads (k - 1) x its payload on average, whatever relays do
(docs/protocol.md, "Swarm size"). Upload that does not grow with k needs aggregation inside the swarm:
a reduce-scatter over ranges of whole chunks (each range's reducer aggregates that range of every
contribution), then an all-gather of the ranges' results. The union of k top-k selections holds up to
k x topk values per chunk, so a result must be cut back to about a contribution's size for the
all-gather to stay flat. ``reencode`` keeps the ``budget`` x topk largest |values| of each chunk of the
aggregate, quantized and coded as a contribution is: global top-k (gTop-k; Shi et al., "A Distributed
Synchronous SGD Algorithm with Global Top-k Sparsification for Low Bandwidth Networks", arXiv
1901.04359; here per chunk of dilocox/sparse/). It works chunk by chunk, so the
reducer of a range of chunks computes exactly that range of the whole result.

Per member and round the upload is then about (payload + result) x (k - 1) / k: its contribution's
ranges to their reducers, and its own range's result to the others. With ``budget`` B the result is
about B payloads, so (1 + B) x payload whatever k is.

What is not applied is not lost. ``residual`` is what a contributor adds to its error-feedback buffer:
its own decoded contribution where the result dropped a position, and the aggregate's quantization
error where it kept one (gTop-k returns the first part to the workers' residuals; the second is ours).
For the weighted mean rule, the weighted mean of the residuals plus the applied update equals the
aggregate (up to fp32 rounding), so nothing leaves the system (tests/test_resparsify.py).

Only the rule is here. Its cost in quality is measured in bench/quality.py (methods ``*-gtopkB``,
docs/algorithms.md, "Re-sparsified aggregates"); the reduce-scatter transport is not built.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

from dilocox.sparse.codec import SparseCodec
from dilocox.sparse.wire import SparseConfig, decode, sent_positions


@dataclass(frozen=True)
class Reencoded:
    """One round's re-sparsified aggregate.

    payload: the result as a contribution's bytes (dilocox/sparse/wire.py format, topk = ``cfg.topk``);
    applied: what every member applies, ``decode(payload)`` (fp32, the aggregate's shapes);
    positions: the flat positions the result kept (int64, ascending, ``cfg.topk`` per whole chunk);
    cfg: the codec configuration of ``payload``."""

    payload: bytes
    applied: list[torch.Tensor]
    positions: np.ndarray
    cfg: SparseConfig


def result_config(cfg: SparseConfig, budget: int, bits: int = 0) -> SparseConfig:
    """The codec configuration of a result: ``budget`` x cfg.topk values per chunk (at most the chunk), at
    ``bits`` bits per value (0: the contributions' bits). Raises ValueError for a budget below 1 or bits
    the codec does not offer."""
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be an integer >= 1 (result values per chunk / topk); got {budget!r}")
    return replace(cfg, topk=min(cfg.chunk, budget * cfg.topk), bits=bits or cfg.bits, beta=0.0)


def reencode(aggregate: Sequence[torch.Tensor], cfg: SparseConfig, budget: int, bits: int = 0) -> Reencoded:
    """Keep the budget x topk largest |values| of each chunk of ``aggregate`` (fp32 tensors, any shapes),
    quantized to ``bits`` (0: ``cfg.bits``) with one scale per chunk: a fresh SparseCodec's encode, so ties and padding
    follow dilocox/sparse/ and the result is the same bits on every machine.
    Raises ValueError for a non-finite aggregate or a bad budget."""
    shapes = [tuple(t.shape) for t in aggregate]
    rcfg = result_config(cfg, budget, bits)
    payload = SparseCodec(shapes, rcfg).encode(aggregate)
    return Reencoded(payload, decode(payload, shapes, rcfg), sent_positions(payload, shapes, rcfg), rcfg)


def residual(own: Sequence[torch.Tensor], aggregate: Sequence[torch.Tensor], result: Reencoded) -> list[torch.Tensor]:
    """What a contributor adds to its error feedback after ``result`` was applied: ``own`` (its contribution
    as decoded by the group, fp32) at the positions the result dropped, aggregate - applied at the ones it
    kept. Shapes are the aggregate's; raises ValueError if ``own`` does not match them."""
    shapes = [tuple(t.shape) for t in aggregate]
    if [tuple(t.shape) for t in own] != shapes:
        raise ValueError(f"contribution shapes {[tuple(t.shape) for t in own]} do not match {shapes}")
    flat = torch.cat([t.reshape(-1).to(torch.float32) for t in own]) if own else torch.zeros(0)
    agg = torch.cat([t.reshape(-1).to(torch.float32) for t in aggregate]) if aggregate else torch.zeros(0)
    applied = torch.cat([t.reshape(-1) for t in result.applied]) if result.applied else torch.zeros(0)
    kept = torch.from_numpy(result.positions)
    flat[kept] = agg[kept] - applied[kept]
    return [t.view(s) for t, s in zip(torch.split(flat, [t.numel() for t in aggregate]), shapes)]
