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
"""

from __future__ import annotations

from typing import Literal

import torch

from dilocox.diloco import OuterOptimizer

Overlap = Literal["none", "delayed"]


class OuterSchedule:
    """Keeps the start-of-round copy of the local parameters and applies outer updates.

    All tensors are CPU fp32 except ``local_params`` (the model's parameters, any device).
    """

    def __init__(self, outer: OuterOptimizer, overlap: Overlap):
        if overlap not in ("none", "delayed"):
            raise ValueError(f"overlap must be 'none' or 'delayed', got {overlap!r}")
        self.outer, self.overlap = outer, overlap
        self.round_start: list[torch.Tensor] = [p.clone() for p in outer.global_params]

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
    def update_theta(self, averaged_pseudo_gradient: list[torch.Tensor]) -> None:
        """theta <- outer_optimizer(theta, Delta) only. Delayed overlap may do this as soon as the
        all-reduce is in, mid-round (the outer step does not read the local parameters), and
        ``rebase`` at the round's end: the result is the same as ``apply`` at the round's end."""
        self.outer.step(averaged_pseudo_gradient)

    @torch.no_grad()
    def rebase(self, local_params: list[torch.Tensor]) -> None:
        """none: x <- theta. delayed: x <- theta + (x - x(start of round)). Call ``begin_round`` after."""
        for p, theta, start in zip(local_params, self.outer.global_params, self.round_start):
            if self.overlap == "none":
                p.copy_(theta)
            else:
                p.copy_(theta.to(p.device) + (p - start.to(p.device)))
