"""Outer-step schedules: synchronous DiLoCo and overlapped rounds (DiLoCoX's delay and its relatives).

``none`` (DiLoCo, arXiv 2311.08105): each round starts from theta_{t-1}; the round's
pseudo-gradient is averaged and applied before the next round starts.

Overlapped rounds (``delayed``, ``adaptive``): round t's all-reduce runs while round t+1 computes.
Round t+1's first inner steps start from the local trajectory (or a ``proxy`` of theta_t) and, once
Delta_t is in, ``update_theta`` makes theta_t = outer_optimizer(theta_{t-1}, Delta_t) and ``merge``
folds it into the local parameters; from then on round t+1's pseudo-gradient is measured from
theta_t. The *delay* tau is the number of inner steps of round t+1 computed before the merge:

  * ``delayed``: tau = H, the merge at round t+1's end (DiLoCoX, arXiv 2506.21263 sec. 3.2; the
    "naive delayed" variant of Eager Updates, arXiv 2502.12996);
  * a fixed tau < H: Streaming DiLoCo's overlap (arXiv 2501.18512, sec. 2.3; torchft's
    ``fragment_sync_delay``);
  * ``adaptive`` **(ours)**: tau = the inner steps the round's communication actually took, from 0
    (a fast link: synchronous quality) to H (a slow one: full overlap); the caller merges as soon as
    Delta_t is in and checked.

The schedule does not count steps: the caller calls ``merge`` when its rule says so.

The merge (x: local parameters, s: x when round t+1 began, u = x - s: the tau steps' progress) is an
exact re-base **(ours)**: x <- theta_t + u. Every inner step's progress is sent exactly once; with tau = 0
this is synchronous DiLoCo, with tau = H DiLoCoX's one-step delay. (Streaming DiLoCo's ``mix`` merge,
measured by bench/quality.py alone, is dilocox/experimental/overlap.py's.)

Proxies (``proxy``) choose s, the local start of round t+1 while Delta_t is in flight; theta itself
(what every replica holds, digests, serves and checkpoints) is never touched, so replicas stay
bit-identical **(ours)**. ``own`` is the caller's stand-in for this replica's share of Delta_t: its
contribution as the group decodes it, its raw pseudo-gradient, or the error-feedback-corrected one:
  * ``none``:  s = x (the local trajectory goes on);
  * ``local``: s = outer_optimizer.lookahead(theta_{t-1}, own): a lookahead that the merge undoes
    (the re-base replaces s by theta_t), as Psyche's DisTrO does while its all-gather is in flight.

(Eager Updates' ``eager`` proxy, measured by bench/quality.py alone, is dilocox/experimental/overlap.py's.)
"""

from __future__ import annotations

from typing import Literal, Optional

import torch

from dilocox.diloco import OuterOptimizer

Overlap = Literal["none", "delayed", "adaptive"]
Proxy = Literal["none", "local"]
OVERLAPS, PROXIES = ("none", "delayed", "adaptive"), ("none", "local")


class OuterSchedule:
    """Keeps the reference the round's pseudo-gradient is measured from and applies outer updates.

    ``round_start`` (CPU fp32) is x when the round began, until ``merge`` makes it theta: one copy of the
    parameters in overlapped rounds; in synchronous ones, which begin at theta, theta itself (no copy) unless theta
    changes before the round's pseudo-gradient is read (``theta_changing``). All tensors are CPU fp32 except
    ``local_params`` (the model's parameters, any device).
    Raises ValueError for an unknown ``overlap`` or ``proxy`` (one of ``proxies``).
    """

    proxies: tuple[str, ...] = PROXIES

    def __init__(self, outer: OuterOptimizer, overlap: Overlap = "none", proxy: Proxy = "none"):
        if overlap not in OVERLAPS:
            raise ValueError(f"overlap must be one of {OVERLAPS}, got {overlap!r}")
        if proxy not in self.proxies:
            raise ValueError(f"proxy must be one of {self.proxies}, got {proxy!r}")
        self.outer, self.overlap, self.proxy = outer, overlap, proxy
        self.overlapped = overlap != "none"
        # synchronous rounds start from theta: theta itself is the reference, no copy (``theta_changing``)
        self.round_start: list[torch.Tensor] = [p.clone() for p in outer.global_params] if self.overlapped \
            else outer.global_params
        self.merged = True  # round_start is theta: the latest update is part of the local trajectory
        self.taken = False  # the round's pseudo-gradient was read at its end: the reference is no longer needed

    @property
    def aliased(self) -> bool:
        """Whether the reference is theta itself (synchronous rounds, no copy held)."""
        return self.round_start is self.outer.global_params

    @torch.no_grad()
    def begin_round(self, local_params: list[torch.Tensor]) -> None:
        """Remember x(start of round) as the pseudo-gradient's reference. Synchronous rounds begin where x is
        theta (after ``rebase``, a download or a restore): the reference is theta itself, and a copy held since
        ``theta_changing`` is dropped."""
        if not self.overlapped:
            self.round_start = self.outer.global_params
        else:
            for s, p in zip(self.round_start, local_params):
                s.copy_(p.detach())
        self.merged, self.taken = False, False

    def theta_changing(self) -> None:
        """Theta is about to change. Synchronous rounds whose pseudo-gradient has not been read yet (an update
        merged mid-round, daemon/join_ahead.py; a download that keeps the round) keep a copy of the old theta as
        the reference until the next ``begin_round`` (transient: one copy of the parameters)."""
        if self.aliased and not self.taken:
            self.round_start = [p.clone() for p in self.outer.global_params]

    def reference(self, final: bool = False) -> list[torch.Tensor]:
        """The tensors the round's pseudo-gradient is measured from (``pseudo_gradient`` = reference - x): theta
        itself in synchronous rounds unless ``theta_changing`` kept a copy. ``final`` as in ``pseudo_gradient``."""
        self.taken = self.taken or final
        return self.round_start

    @torch.no_grad()
    def pseudo_gradient(self, local_params: list[torch.Tensor], final: bool = False) -> list[torch.Tensor]:
        """delta = reference - x(now): theta_{t-1} - x in synchronous rounds and after a ``merge``,
        x(start of round) - x before it. CPU fp32, the parameters' shapes. ``final``: the round's own read at its
        end; the reference is not needed again this round (``theta_changing`` then keeps no copy)."""
        self.taken = self.taken or final
        return [s - p.detach().to("cpu", torch.float32) for s, p in zip(self.round_start, local_params)]

    @torch.no_grad()
    def apply(self, averaged_pseudo_gradient: list[torch.Tensor], local_params: list[torch.Tensor]) -> None:
        """theta <- outer_optimizer(theta, Delta), then fold it into the local parameters (``rebase``)."""
        self.update_theta(averaged_pseudo_gradient)
        self.rebase(local_params)

    @torch.no_grad()
    def update_theta(self, averaged_pseudo_gradient: list[torch.Tensor], group_size: int = 1,
                     outer_step: Optional[int] = None) -> None:
        """theta <- outer_optimizer(theta, Delta) only; the local parameters are untouched (``merge``
        folds theta in). ``group_size``: replicas in Delta (unused here; the experimental eager proxy's M);
        ``outer_step``: the step's index, for the outer learning-rate ramp (``OuterOptimizer.lr_at``)."""
        self.theta_changing()
        self.outer.step(averaged_pseudo_gradient, outer_step)

    @torch.no_grad()
    def rebase(self, local_params: list[torch.Tensor]) -> None:
        """Fold theta into the local parameters at a round's end, unless ``merge`` already did this round.
        Synchronous: x <- theta. Overlapped: ``merge``. Call ``begin_round`` after."""
        if not self.overlapped:
            for p, theta in zip(local_params, self.outer.global_params):
                p.copy_(theta)
            self.merged = True
        elif not self.merged:
            self.merge(local_params)

    @torch.no_grad()
    def merge(self, local_params: list[torch.Tensor]) -> None:
        """The latest theta lands in an overlapped round: x <- theta + (x - round_start), and the round's
        pseudo-gradient is measured from theta from now on. A second call in the same round does nothing."""
        if self.merged:
            return
        for p, theta, start in zip(local_params, self.outer.global_params, self.round_start):
            self.fold(p, theta, start)
            start.copy_(theta)
        self.merged = True

    def fold(self, p: torch.Tensor, theta: torch.Tensor, start: torch.Tensor) -> None:
        """One tensor's merge, in place on ``p`` (the parameter, any device; ``theta`` and ``start`` CPU fp32):
        x <- theta + (x - start). dilocox/experimental/overlap.py's schedule changes the rule."""
        p.copy_(theta.to(p.device) + (p - start.to(p.device)))  # exactly theta when no step was taken (tau = 0)

    @torch.no_grad()
    def start_from_proxy(self, local_params: list[torch.Tensor], own: list[torch.Tensor]) -> bool:
        """Overlapped rounds with a ``proxy``, right after a round's contribution is sent and before
        ``begin_round``: x <- the local estimate of the next theta (module docstring) from theta as it is
        now and ``own``, our share of the round just sent. False (nothing changed) for synchronous rounds
        or proxy ``none``."""
        if not self.overlapped or self.proxy == "none":
            return False
        target = self._proxy_start([g.to("cpu", torch.float32) for g in own])
        for p, t in zip(local_params, target):
            p.copy_(t.to(p.device))
        return True

    def _proxy_start(self, own: list[torch.Tensor]) -> list[torch.Tensor]:
        """The proxy's start from ``own`` (CPU fp32): the lookahead (a subclass's proxy may differ)."""
        return self.outer.lookahead(own)
