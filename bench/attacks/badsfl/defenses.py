"""The published defenses BadSFL (arXiv 2411.16167) is compared against, as server-side rules of the harness.

These are baselines measured beside the daemon's own defense (``dilocox.robust``), not part of the daemon.
Each takes the round's flattened pseudo-gradients (float64 [d] per client, delta = theta - x, so the outer
step is theta <- theta - agg) and returns the aggregate and which clients it admitted:

* ``flame`` -- FLAME (Nguyen et al., USENIX Security 2022, Algorithm 1): (1) HDBSCAN on the clients' pairwise
  cosine distances, min_cluster_size = n/2 + 1, min_samples 1 (scikit-learn's ``HDBSCAN`` on the
  precomputed matrix); the largest cluster is admitted, everyone when HDBSCAN finds none; (2) every
  admitted update clipped to S_t, the median L2 norm of all the round's updates; (3) the mean plus Gaussian
  noise of std lambda * S_t per coordinate, lambda = 0.001 (the paper's value for image classification).
  The cosine is taken between updates, not whole models: with one shared global model the two differ by
  that model only, which swamps the angle between models of 21,840 parameters.
* ``dp-prune`` -- weak differential privacy (Sun et al., "Can you really backdoor federated learning?",
  2019: every update clipped to a norm bound, Gaussian noise on the aggregate; here the bound is S_t and the
  noise std ``dp_sigma`` * S_t) followed by pruning (Wu et al., "Mitigating backdoor attacks in federated
  learning", 2020: the round's clients rank the last convolution's channels by their mean activation on
  their own data; the ``prune_fraction`` least active channels by mean rank are zero in the deployed model,
  which PTA and BTA measure; training goes on from the unpruned theta).
* ``sparsefed`` -- SparseFed (Panda et al., AISTATS 2022, Algorithm 1 with server-side top-k): each update
  clipped to S_t, their mean added to the server's accumulator e, the top ``sparse_fraction`` of e by
  magnitude applied and removed from e (error feedback).

Errors: ValueError for an unknown name or no clients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

DEFENSES = ("flame", "dp-prune", "sparsefed")


@dataclass
class Outcome:
    """``aggregate``: float64 [d]; ``admitted``: client keys whose update counts; ``clip``: S_t."""

    aggregate: torch.Tensor
    admitted: list[str]
    clip: float
    detail: dict = field(default_factory=dict)


def median_norm(vectors: dict[str, torch.Tensor]) -> float:
    """S_t: the median L2 norm of the round's updates (the upper median for an even count, as ``np.median``)."""
    return float(np.median([float(v.norm()) for v in vectors.values()]))


def clipped(v: torch.Tensor, bound: float) -> torch.Tensor:
    """``v`` scaled to norm at most ``bound``."""
    n = float(v.norm())
    return v * (bound / n) if n > bound > 0 else v


def flame_clusters(vectors: dict[str, torch.Tensor]) -> list[str]:
    """FLAME's step 1: the keys in HDBSCAN's largest cluster of cosine distances (all keys if it finds none)."""
    from sklearn.cluster import HDBSCAN  # bench extra: pip install -e '.[bench]'

    keys = sorted(vectors)
    n = len(keys)
    if n < 3:
        return keys
    x = torch.stack([vectors[k] for k in keys]).to(torch.float64)
    x = x / x.norm(dim=1, keepdim=True).clamp_min(1e-30)
    dist = (1.0 - x @ x.T).clamp_min(0.0).numpy()
    np.fill_diagonal(dist, 0.0)
    labels = HDBSCAN(min_cluster_size=n // 2 + 1, min_samples=1, metric="precomputed",
                     allow_single_cluster=True, copy=True).fit_predict(dist)
    found = [lab for lab in labels if lab >= 0]
    if not found:
        return keys
    biggest = max(set(found), key=found.count)
    return [k for k, lab in zip(keys, labels) if lab == biggest]


class Defense:
    """One of ``DEFENSES`` with its state across rounds (SparseFed's accumulator, the pruning mask)."""

    def __init__(self, name: str, seed: int = 0, flame_lambda: float = 0.001, dp_sigma: float = 0.001,
                 prune_fraction: float = 0.2, sparse_fraction: float = 0.1):
        if name not in DEFENSES:
            raise ValueError(f"defense {name!r}: expected one of {', '.join(DEFENSES)}")
        self.name = name
        self.prunes = name == "dp-prune"  # ranks channels after each step (``rank_channels``)
        self.flame_lambda, self.dp_sigma = flame_lambda, dp_sigma
        self.prune_fraction, self.sparse_fraction = prune_fraction, sparse_fraction
        self.noise = torch.Generator().manual_seed(10_007 + seed)
        self.error: Optional[torch.Tensor] = None   # SparseFed's server accumulator, float64 [d]
        self.pruned: list[int] = []                 # channels of the last convolution zero when deployed

    def aggregate(self, vectors: dict[str, torch.Tensor]) -> Outcome:
        """The round's aggregate (float64 [d]) from the clients' flattened pseudo-gradients."""
        if not vectors:
            raise ValueError("no client updates to aggregate")
        bound = median_norm(vectors)
        admitted = flame_clusters(vectors) if self.name == "flame" else sorted(vectors)
        mean = torch.stack([clipped(vectors[k].to(torch.float64), bound) for k in admitted]).mean(0)
        if self.name == "sparsefed":
            self.error = mean if self.error is None else self.error + mean
            k = max(1, int(math.ceil(self.sparse_fraction * mean.numel())))
            top = self.error.abs().topk(k).indices
            agg = torch.zeros_like(mean)
            agg[top] = self.error[top]
            self.error[top] = 0.0
            return Outcome(agg, admitted, bound, dict(kept=k))
        sigma = (self.flame_lambda if self.name == "flame" else self.dp_sigma) * bound
        noise = torch.randn(mean.shape, generator=self.noise, dtype=torch.float64) * sigma
        return Outcome(mean + noise, admitted, bound, dict(sigma=sigma))

    @torch.no_grad()
    def rank_channels(self, model: torch.nn.Module, params: list[torch.Tensor], batches: list[torch.Tensor],
                      forward_to: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]) -> None:
        """``dp-prune`` only: rank the last convolution's channels on each of ``batches`` (one per client of the
        round, preprocessed [B, 1, 28, 28]) by mean activation, and mark the ``prune_fraction`` least active by
        mean rank for ``deployed``. ``forward_to(model, x)`` returns that convolution's activations
        [B, C, H, W] with ``params`` (theta) loaded into ``model``."""
        if not self.prunes:
            return
        weight = self._last_conv(params)
        for p, t in zip(model.parameters(), params):
            p.copy_(t)
        ranks = np.zeros(params[weight].shape[0])
        for x in batches:
            act = forward_to(model, x).mean(dim=(0, 2, 3)).numpy()
            ranks += np.argsort(np.argsort(act, kind="stable"))  # 0 = least active on this client's data
        wanted = int(round(self.prune_fraction * len(ranks)))
        self.pruned = sorted(int(c) for c in np.argsort(ranks, kind="stable")[:wanted])

    def deployed(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The model the server would deploy: ``params`` itself, or for ``dp-prune`` a copy with the marked
        channels of the last convolution (weights and bias) at zero. Pruning acts on the deployed model, as in
        Wu et al. (after training); training goes on from the unpruned theta."""
        if not self.prunes or not self.pruned:
            return params
        out = [p.clone() for p in params]
        weight = self._last_conv(params)
        channels = params[weight].shape[0]
        for c in self.pruned:
            out[weight][c] = 0.0
            if weight + 1 < len(out) and out[weight + 1].dim() == 1 and out[weight + 1].shape[0] == channels:
                out[weight + 1][c] = 0.0  # its bias
        return out

    @staticmethod
    def _last_conv(params: list[torch.Tensor]) -> int:
        convs = [i for i, p in enumerate(params) if p.dim() == 4]
        if not convs:
            raise ValueError("dp-prune needs a convolution in the model")
        return convs[-1]
