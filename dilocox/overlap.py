"""Outer-step schedules: synchronous DiLoCo and DiLoCoX's one-step-delay overlap.

``none`` (DiLoCo, arXiv 2311.08105): each round starts from theta_{t-1}; the round's
pseudo-gradient is averaged and applied before the next round starts.

``delayed`` (DiLoCoX, arXiv 2506.21263 sec. 3.2; our formulation, docs/algorithms.md "One-step
delay", which matches the "delayed" variant of Eager Updates, arXiv 2502.12996). The all-reduce
of round t runs while round t+1 computes:
  * a replica's local trajectory is never reset to wait for the network;
  * delta_{r,t} = x_r(start of round t) - x_r(end of round t);
  * theta_t = outer_optimizer(theta_{t-1}, Delta_t) once Delta_t is in (``update_theta``; the
    daemon does it mid-round t+1 for whole-model nodes, at its end for stage nodes: the outer step
    does not read the local parameters, so the result is the same);
  * at the end of round t+1, re-base x_r <- theta_t + (x_r(end of t+1) - x_r(start of t+1))
    **(ours: exact re-base rule)** and start the all-reduce of delta_{r,t+1}.

The plain re-base starts round t+2 from theta_t minus round t+1's raw local progress: the outer
step of round t+1 (learning rate, momentum) reaches the local trajectory one round late, which is
what "naive delayed" costs in Eager Updates (arXiv 2502.12996). ``proxy`` starts the next round
from a local estimate of theta_{t+1} instead; theta itself (what every replica holds, digests,
serves and checkpoints) is untouched, so replicas stay bit-identical **(ours)**:
  * ``none``:  x_r <- theta_t - delta_{r,t+1}                       (the plain re-base);
  * ``local``: x_r <- outer_optimizer.lookahead(theta_t, g), g = c_{r,t+1}: our own contribution
    as the group will decode it stands in for the group's mean;
  * ``eager``: the same with g = Delta_t + (c_{r,t+1} - c_{r,t}) / M (M: last group size), Eager
    Updates' mix of our fresh contribution with the others' latest mean.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch

from dilocox.diloco import OuterOptimizer

Overlap = Literal["none", "delayed"]
Proxy = Literal["none", "local", "eager"]


class OuterSchedule:
    """Keeps the start-of-round copy of the local parameters and applies outer updates.

    All tensors are CPU fp32 except ``local_params`` (the model's parameters, any device).
    """

    def __init__(self, outer: OuterOptimizer, overlap: Overlap, proxy: Proxy = "none"):
        if overlap not in ("none", "delayed"):
            raise ValueError(f"overlap must be 'none' or 'delayed', got {overlap!r}")
        if proxy not in ("none", "local", "eager"):
            raise ValueError(f"proxy must be 'none', 'local' or 'eager', got {proxy!r}")
        self.outer, self.overlap, self.proxy = outer, overlap, proxy
        self.round_start: list[torch.Tensor] = [p.clone() for p in outer.global_params]
        self.last_mean: list[torch.Tensor] | None = None  # Delta of the last outer update (eager)
        self.last_own: list[torch.Tensor] | None = None   # our contribution to the round before (eager)
        self.group_size = 1

    @torch.no_grad()
    def begin_round(self, local_params: list[torch.Tensor]) -> None:
        """Remember x(start of round)."""
        self.round_start = [p.detach().to("cpu", torch.float32).clone() for p in local_params]

    @torch.no_grad()
    def pseudo_gradient(self, local_params: list[torch.Tensor]) -> list[torch.Tensor]:
        """delta = x(start of round) - x(now); equals theta_{t-1} - x in synchronous mode."""
        return [s - p.detach().to("cpu", torch.float32) for s, p in zip(self.round_start, local_params)]

    @torch.no_grad()
    def apply(self, averaged_pseudo_gradient: list[torch.Tensor], local_params: list[torch.Tensor]) -> None:
        """theta <- outer_optimizer(theta, Delta), then re-base the local parameters (``rebase``)."""
        self.update_theta(averaged_pseudo_gradient)
        self.rebase(local_params)

    @torch.no_grad()
    def update_theta(self, averaged_pseudo_gradient: list[torch.Tensor], group_size: int = 1,
                     outer_step: Optional[int] = None) -> None:
        """theta <- outer_optimizer(theta, Delta) only. Delayed overlap may do this as soon as the
        all-reduce is in, mid-round (the outer step does not read the local parameters), and
        ``rebase`` at the round's end: the result is the same as ``apply`` at the round's end.
        ``group_size``: replicas in Delta (the eager proxy's M); ``outer_step``: the step's index, for the
        outer learning-rate ramp (``OuterOptimizer.lr_at``)."""
        self.outer.step(averaged_pseudo_gradient, outer_step)
        if self.proxy == "eager":
            self.last_mean = [g.to(torch.float32).clone() for g in averaged_pseudo_gradient]
            self.group_size = max(1, group_size)

    @torch.no_grad()
    def rebase(self, local_params: list[torch.Tensor]) -> None:
        """none: x <- theta. delayed: x <- theta + (x - x(start of round)). Call ``begin_round`` after."""
        for p, theta, start in zip(local_params, self.outer.global_params, self.round_start):
            if self.overlap == "none":
                p.copy_(theta)
            else:
                p.copy_(theta.to(p.device) + (p - start.to(p.device)))

    @torch.no_grad()
    def start_from_proxy(self, local_params: list[torch.Tensor], own: list[torch.Tensor]) -> bool:
        """Delayed overlap with a ``proxy``: x <- the local estimate of the next theta (module
        docstring), from theta as it is now (the version the round just sent starts from) and ``own``,
        our contribution to that round as the group decodes it (the pseudo-gradient itself when sent
        uncompressed). False (nothing changed) for synchronous rounds or proxy ``none``. Call
        ``begin_round`` after."""
        if self.overlap != "delayed" or self.proxy == "none":
            return False
        target = self._proxy_start([g.to("cpu", torch.float32) for g in own])
        for p, t in zip(local_params, target):
            p.copy_(t.to(p.device))
        return True

    def _proxy_start(self, own: list[torch.Tensor]) -> list[torch.Tensor]:
        g = own
        if self.proxy == "eager":
            if self.last_mean is not None and self.last_own is not None:
                m = self.group_size
                g = [d + (c - c_prev) / m for d, c, c_prev in zip(self.last_mean, own, self.last_own)]
            self.last_own = [c.clone() for c in own]
        return self.outer.lookahead(g)
