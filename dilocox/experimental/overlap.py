"""Overlapped-round variants measured by bench/quality.py alone (the daemon runs dilocox/overlap.py's).

``ExperimentalSchedule`` is ``OuterSchedule`` (x: local parameters, s: x when round t+1 began, own: our share
of Delta_t, as there) with two more options:

  * proxy ``eager``: s = outer_optimizer.lookahead(theta_{t-1}, g) with g = Delta_{t-1} + (own_t - own_{t-1}) / M
    (M: last group size; ``own`` alone until both are known): Eager Updates' mix of our fresh share with the
    others' latest mean (arXiv 2502.12996);
  * merge ``mix``: x <- a x + (1 - a) theta_t, a = ``mix`` (Streaming DiLoCo's merge, arXiv 2501.18512,
    a = 0.5 there), instead of the exact re-base ``rebase``.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch

from dilocox.diloco import OuterOptimizer
from dilocox.overlap import PROXIES, OuterSchedule, Overlap

Proxy = Literal["none", "local", "eager"]
Merge = Literal["rebase", "mix"]
MERGES = ("rebase", "mix")


class ExperimentalSchedule(OuterSchedule):
    """OuterSchedule with the ``eager`` proxy and the ``mix`` merge (module docstring). Raises ValueError for an
    unknown ``overlap``, ``proxy`` or ``merge``, or ``mix`` outside [0, 1]."""

    proxies = (*PROXIES, "eager")

    def __init__(self, outer: OuterOptimizer, overlap: Overlap = "none", proxy: Proxy = "none",
                 merge: Merge = "rebase", mix: float = 0.5):
        super().__init__(outer, overlap, proxy)
        if merge not in MERGES:
            raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
        if not 0.0 <= mix <= 1.0:
            raise ValueError(f"mix must be in [0, 1], got {mix!r}")
        self.merge_rule, self.mix = merge, mix
        self.last_mean: list[torch.Tensor] | None = None  # Delta of the last outer update (eager)
        self.last_own: list[torch.Tensor] | None = None   # our share of the round before (eager)
        self.group_size = 1

    @torch.no_grad()
    def update_theta(self, averaged_pseudo_gradient: list[torch.Tensor], group_size: int = 1,
                     outer_step: Optional[int] = None) -> None:
        """OuterSchedule's, and the eager proxy keeps Delta and ``group_size`` (its M)."""
        super().update_theta(averaged_pseudo_gradient, group_size, outer_step)
        if self.proxy == "eager":
            self.last_mean = [g.to(torch.float32).clone() for g in averaged_pseudo_gradient]
            self.group_size = max(1, group_size)

    def fold(self, p: torch.Tensor, theta: torch.Tensor, start: torch.Tensor) -> None:
        """OuterSchedule's re-base (``rebase``), or x <- mix x + (1 - mix) theta (``mix``)."""
        if self.merge_rule == "rebase":
            super().fold(p, theta, start)
        else:
            p.mul_(self.mix).add_(theta.to(p.device), alpha=1.0 - self.mix)

    def _proxy_start(self, own: list[torch.Tensor]) -> list[torch.Tensor]:
        g = own
        if self.proxy == "eager":
            if self.last_mean is not None and self.last_own is not None:
                m = self.group_size
                g = [d + (c - c_prev) / m for d, c, c_prev in zip(self.last_mean, own, self.last_own)]
            self.last_own = [c.clone() for c in own]
        return self.outer.lookahead(g)
