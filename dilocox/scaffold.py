"""SCAFFOLD control variates (Karimireddy et al., arXiv 1910.06378, Algorithm 1, option II) in DiLoCo terms.

Notation of the paper: server model x, server control variate c, client i's control variate c_i,
K local steps, local learning rate eta_l, global learning rate eta_g, S the participating clients
of N. One round (Algorithm 1, lines 7-17):
  client i:  y_i <- x;  K times  y_i <- y_i - eta_l (g_i(y_i) - c_i + c)
             c_i+ = c_i - c + (x - y_i) / (K eta_l)                          (option II)
             send dy_i = y_i - x and dc_i = c_i+ - c_i;  c_i <- c_i+
  server:    x <- x + eta_g mean_S(dy_i);   c <- c + (|S| / N) mean_S(dc_i)

In DiLoCo terms (dilocox/diloco.py) the pseudo-gradient is delta_i = x - y_i = -dy_i (theta minus
the local parameters) and the outer optimizer applies mean(delta_i) (eta_g is outer_lr). Our inner
optimizer is AdamW with a learning-rate schedule, so K eta_l is replaced by lr_sum = sum_k lr_k, the
learning rates the K inner steps actually used **(ours)**:
  c_i+ = c_i - c + delta_i / lr_sum,      dc_i = c_i+ - c_i = delta_i / lr_sum - c.
Why lr_sum: if each inner step is y <- y - lr_k (u_k - c_i + c), with u_k the optimizer's update
direction (u_k = g_k for plain SGD), then delta_i = sum_k lr_k u_k + lr_sum (c - c_i), hence
  c_i+ = (sum_k lr_k u_k) / lr_sum,
the learning-rate-weighted mean of the client's update directions; for SGD with a constant lr this is
the mean gradient along the trajectory, the paper's reading of option II (tests/test_scaffold.py
checks it on quadratics). Units: ``apply_correction`` adds c - c_i to the gradient, which gives that
step only when u_k is linear in g (SGD). AdamW normalizes its step, so c and c_i are in units of
its update direction, not of gradients: there, call ``apply_correction_step`` after
``optimizer.step()`` (y <- y - lr_k (c - c_i)), which makes the identity exact for any optimizer.

``ControlVariates.derive_c_from_aggregate`` is the stricter variant **(ours)**: c is updated from
the (robustly) aggregated pseudo-gradient rather than from a separate dc channel,
  c <- c + (|S| / N) (mean_delta / lr_sum - c).
When every participant reports honestly with the same c and lr_sum (same outer step, same schedule),
dc_i = delta_i / lr_sum - c, so mean_S(dc_i) = mean_S(delta_i) / lr_sum - c and this is exactly the
server step of option II. A client that lies about its control variate (BadSFL, arXiv 2411.16167,
steers benign clients through c) then has no channel of its own: c moves only as far as the
pseudo-gradients that passed aggregation move it.

``reset_every`` R (**ours**, a defense): after every outer step that is a multiple of R, c and c_i restart at
zero on every member (``outer_step_done``), with no message. Algorithm 1 keeps c = mean_i c_i only while every
dc enters c as sent. Once a robust rule clips or drops an update whose effect reached c (a boosted attacker's,
or an honest outlier's), the part of c it moved is never taken back: honest clients' dc carry only changes of
their own gradients, and the aggregate cannot show c's error (in steady state delta_i = lr_sum (g_i - c_i + c)
with c_i = g_i, so delta = lr_sum c: every client steps along c, error included, round after round). Zero is
a state where c = mean_i c_i holds again; the rounds after a restart run as DiLoCo until c is rebuilt.

``QuietRestart`` (**ours**, a defense): restart (or shrink) c and c_i only after an attack, not on a clock. A round
is *outsized* when the robust rule scaled one of its contributions by less than 1 / ``outsized`` (its norm over
that many times the norm bound: BadSFL's boosted update is 8-50 times the lower median). ``after`` Q rounds after
the last outsized round, and in each of the ``rounds`` - 1 rounds that follow, c and c_i are multiplied by
``factor`` (0: the restart). While outsized rounds keep coming, c and c_i also restart at zero after each outer
step that is a multiple of ``every`` with an outsized round among its last ``every``: an attack that lasts cannot
build c up for long, and the damage a long-built c does when it is removed (a deep dip in clean accuracy) is
avoided. Every member reads the same scales from the same contributions (and a joiner the round's ``outsized``
flag from the update it replays), so all act at one outer step. Measured in the BadSFL harness (docs/security.md,
``make bench-badsfl-paper-quiet``).

Per round, in order: ``correction()`` at the start (c and c_i must not change until step 3); the
inner steps with ``apply_correction`` / ``apply_correction_step``; ``client_update(delta, K,
lr_sum)`` (updates c_i, returns dc_i); aggregation (peers/); then ``server_update(mean_dc, |S|, N)``
or ``derive_c_from_aggregate(mean_delta, lr_sum, |S|, N)`` on every member alike, so every member
holds the same c (``digest``). All tensors are lists (one per parameter), CPU fp32.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Mapping, Optional, Union

import torch

from dilocox.diloco import check_shapes, params_digest


def _check_lr_sum(lr_sum: float) -> float:
    lr_sum = float(lr_sum)
    if not math.isfinite(lr_sum) or lr_sum <= 0:
        raise ValueError(f"lr_sum must be a finite sum of learning rates > 0, got {lr_sum}")
    return lr_sum


def _check_participation(participating: int, total: int) -> float:
    if not 1 <= participating <= total:
        raise ValueError(f"participating must satisfy 1 <= participating <= total, got {participating} of {total}")
    return participating / total


def _fp32(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().to("cpu", torch.float32) for t in tensors]


@dataclass(frozen=True)
class QuietRestart:
    """When c and c_i restart (or shrink) after an attack (module docstring). ``after`` Q >= 0 rounds after the
    last outsized round (0: off); ``factor`` in [0, 1) multiplies c and c_i (0: the restart) in each of ``rounds``
    >= 1 rounds in a row; ``outsized`` > 1: a contribution the rule scaled by less than 1 / this is outsized.
    ``every`` E >= 0: while outsized rounds keep coming, c and c_i also restart at zero after each outer step that
    is a multiple of E with an outsized round among its last E (0: off), so an attack that lasts cannot build c up
    for long. The defaults are the BadSFL harness's ``default-quiet3-half5-every20`` (docs/security.md): halving
    in 5 rounds dips less than one restart, at 4 x the bound no honest outlier set it off on 3 seeds (at 2 x, one
    did twice), and restarts during the attack keep its clean accuracy within 1 point of SCAFFOLD without one
    (every 10 did too, but let the backdoor work in more rounds of the attack).
    Raises ValueError naming the field that is out of range."""

    after: int = 0
    factor: float = 0.5
    rounds: int = 5
    outsized: float = 4.0
    every: int = 20

    def __post_init__(self):
        if int(self.after) < 0:
            raise ValueError(f"quiet restart: after must be >= 0 (0: off), got {self.after}")
        if not 0.0 <= float(self.factor) < 1.0:
            raise ValueError(f"quiet restart: factor must lie in [0, 1) (0: restart at zero), got {self.factor}")
        if int(self.rounds) < 1:
            raise ValueError(f"quiet restart: rounds must be >= 1, got {self.rounds}")
        if int(self.every) < 0:
            raise ValueError(f"quiet restart: every must be >= 0 (0: off), got {self.every}")
        if not (math.isfinite(float(self.outsized)) and float(self.outsized) > 1.0):
            raise ValueError(f"quiet restart: outsized must be a finite multiple > 1 of the norm bound, "
                             f"got {self.outsized}")

    def is_outsized(self, scales: Union[Mapping[str, float], Iterable[float]]) -> bool:
        """Whether a round whose rule scaled its contributions by ``scales`` (peer_id -> scale, or the scales;
        those below 1 suffice: dilocox.robust's report) had an outsized one. Always False when off."""
        values = scales.values() if isinstance(scales, Mapping) else scales
        return bool(self.after) and any(float(v) < 1.0 / self.outsized for v in values)


class Restart(str, Enum):
    """What ``ControlVariates.outer_step_done`` did to c and c_i."""

    NONE = "none"
    PERIODIC = "periodic"            # reset_every: restarted at zero
    DURING_ATTACK = "during-attack"  # QuietRestart.every: restarted at zero while outsized rounds come
    QUIET = "quiet"                  # QuietRestart after an attack: restarted at zero, or shrunk by its factor


class ControlVariates:
    """The swarm's control variate c (shared: every member holds the same) and this client's c_i.

    Both start at zero, shaped like ``params`` (one CPU fp32 tensor per parameter). Formulas and the
    order of calls: module docstring. ``last_outsized``: the last outsized round whose quiet restart is
    still to come or under way (None: none); shared like c (``digest``).
    """

    def __init__(self, params: list[torch.Tensor], reset_every: int = 0, quiet: Optional[QuietRestart] = None):
        """``reset_every``: restart c and c_i at zero after every outer step that is a multiple of it (0: never;
        ``outer_step_done``). ``quiet``: restart or shrink them after an outsized round (None: never). Raises
        ValueError if reset_every is negative."""
        if int(reset_every) < 0:
            raise ValueError(f"reset_every must be >= 0 (0: never), got {reset_every}")
        self.reset_every = int(reset_every)
        self.quiet = quiet or QuietRestart()
        self.last_outsized: Optional[int] = None
        self.c = [torch.zeros(tuple(p.shape), dtype=torch.float32) for p in params]
        self.c_i = [torch.zeros_like(t) for t in self.c]

    def correction(self) -> list[torch.Tensor]:
        """c - c_i per parameter: added to each inner gradient (g + c - c_i), or stepped (``apply_correction_step``)."""
        return [c - ci for c, ci in zip(self.c, self.c_i)]

    @torch.no_grad()
    def client_update(self, pseudo_gradient: list[torch.Tensor], inner_steps: int, lr_sum: float) -> list[torch.Tensor]:
        """Option II with K eta_l -> lr_sum (ours): c_i <- c_i - c + delta / lr_sum; returns dc = delta / lr_sum - c.

        pseudo_gradient: delta = theta - local params after the round's inner steps (DiLoCo sign).
        inner_steps: K (>= 1); with a constant learning rate eta_l, lr_sum = K * eta_l. lr_sum: the sum
        of the learning rates the K steps used. Raises ValueError for misshapen or non-finite
        delta, K < 1 or lr_sum not > 0.
        """
        check_shapes(self.c, pseudo_gradient, "pseudo-gradient")
        if int(inner_steps) < 1:
            raise ValueError(f"inner_steps must be >= 1, got {inner_steps}")
        lr_sum = _check_lr_sum(lr_sum)
        dc = [d / lr_sum - c for d, c in zip(_fp32(pseudo_gradient), self.c)]
        self.c_i = [ci + d for ci, d in zip(self.c_i, dc)]
        return [d.clone() for d in dc]

    @torch.no_grad()
    def server_update(self, mean_dc: list[torch.Tensor], participating: int, total: int) -> None:
        """c <- c + (|S| / N) mean_S(dc) (Algorithm 1, line 17); |S| = participating, N = total clients."""
        check_shapes(self.c, mean_dc, "mean control-variate update")
        weight = _check_participation(participating, total)
        self.c = [c + weight * d for c, d in zip(self.c, _fp32(mean_dc))]

    @torch.no_grad()
    def derive_c_from_aggregate(self, mean_delta: list[torch.Tensor], lr_sum: float, participating: int,
                                total: int) -> None:
        """c <- c + (|S| / N) (mean_delta / lr_sum - c) (ours): option II's server step from the aggregate.

        mean_delta: the aggregated pseudo-gradient of the round (what the outer optimizer applies);
        lr_sum: the round's sum of inner learning rates (the same on every member). Equal to
        ``server_update`` with honest, consistent clients; no separate dc channel (module docstring).
        """
        check_shapes(self.c, mean_delta, "aggregated pseudo-gradient")
        lr_sum = _check_lr_sum(lr_sum)
        weight = _check_participation(participating, total)
        self.c = [c + weight * (d / lr_sum - c) for c, d in zip(self.c, _fp32(mean_delta))]

    def outer_step_done(self, outer_step: int, outsized: bool = False) -> Restart:
        """Outer step ``outer_step`` was applied (or consumed without an update); ``outsized``: its round had an
        outsized contribution (``QuietRestart.is_outsized`` of the rule's scales, or the replayed update's flag).
        c <- 0 and c_i <- 0 if the step is a multiple of ``reset_every``, or of the quiet restart's ``every`` with
        an outsized round among its last ``every``; then c and c_i are scaled by the quiet restart's factor if the
        step is its ``after``-th to (``after`` + ``rounds`` - 1)-th after the last outsized round (module
        docstring). Every member calls this at every outer step with the same flag, so c stays identical
        swarm-wide. Returns what it did: a restart at zero (PERIODIC, DURING_ATTACK) before QUIET where several
        acted."""
        if outsized and self.quiet.after:
            self.last_outsized = int(outer_step)
        periodic = bool(self.reset_every) and outer_step > 0 and not outer_step % self.reset_every
        shrink = during = False
        if self.last_outsized is not None:
            q, since = self.quiet, outer_step - self.last_outsized
            shrink = q.after <= since < q.after + q.rounds
            during = bool(q.every) and not outer_step % q.every and since < q.every  # no long build-up
            if since >= max(q.after + q.rounds, q.every) - 1:  # the restart is over: nothing left to share
                self.last_outsized = None
        if periodic or during:  # a shrink after a restart would change nothing
            self.reset()
            return Restart.DURING_ATTACK if during else Restart.PERIODIC
        if shrink:
            self.scale(self.quiet.factor)
            return Restart.QUIET
        return Restart.NONE

    def scale(self, factor: float) -> None:
        """c <- factor c and c_i <- factor c_i (0 <= factor <= 1): scales c - mean_i c_i by the same factor when
        every member does it at one outer step, so an error in c shrinks without the jump of a ``reset``.
        Raises ValueError for a factor outside [0, 1]."""
        if not 0.0 <= float(factor) <= 1.0:
            raise ValueError(f"scale factor must lie in [0, 1], got {factor}")
        self.c = [float(factor) * t for t in self.c]
        self.c_i = [float(factor) * t for t in self.c_i]

    def reset(self) -> None:
        """c <- 0 and c_i <- 0: the state where c = mean_i c_i holds again (module docstring, ``reset_every``).
        Every member must reset at the same outer step, or c's digest splits."""
        self.c = [torch.zeros_like(t) for t in self.c]
        self.c_i = [torch.zeros_like(t) for t in self.c_i]

    def state_dict(self) -> dict:
        """{"c": [...], "c_i": [...], "last_outsized": int or None}: copies, CPU fp32. A joiner takes the swarm's
        c and last_outsized and starts c_i at zero."""
        return {"c": [t.clone() for t in self.c], "c_i": [t.clone() for t in self.c_i],
                "last_outsized": self.last_outsized}

    def load_state_dict(self, state: dict) -> None:
        """Replace c and c_i; raises ValueError naming the key when one is missing, misshapen or not finite."""
        if not isinstance(state, dict):
            raise ValueError(f"control-variate state must be a dict, got {type(state).__name__}")
        for key in ("c", "c_i"):
            if key not in state:
                raise ValueError(f"control-variate state lacks {key!r}")
            if not isinstance(state[key], (list, tuple)):
                raise ValueError(f"control-variate state {key!r} must be a list of tensors")
            check_shapes(self.c, list(state[key]), f"control variate {key}")
        last = state.get("last_outsized")  # absent in checkpoints and states from before the quiet restart
        if last is not None and (isinstance(last, bool) or not isinstance(last, int) or last < 0):
            raise ValueError(f"control-variate state 'last_outsized' must be an outer step >= 0 or None, got {last!r}")
        self.c = [t.clone() for t in _fp32(state["c"])]
        self.c_i = [t.clone() for t in _fp32(state["c_i"])]
        self.last_outsized = last

    def digest(self) -> str:
        """``control_digest(c, last_outsized)``: equal on two members iff their c is bit-identical and their quiet
        restart (if one is pending) comes at the same outer step."""
        return control_digest(self.c, self.last_outsized)


def control_digest(c: list[torch.Tensor], last_outsized: Optional[int] = None) -> str:
    """Hex SHA-256 (first 16 hex digits) of c's fp32 bytes (``params_digest``), and of ``last_outsized`` when a
    quiet restart is pending (None: c's digest alone, as before the quiet restart existed)."""
    digest = params_digest(c)
    if last_outsized is None:
        return digest
    return hashlib.sha256(f"{digest}/outsized@{int(last_outsized)}".encode()).hexdigest()[:16]


def _check_pairs(params: list[torch.Tensor], correction: list[torch.Tensor]) -> None:
    if len(params) != len(correction):
        raise ValueError(f"correction: expected {len(params)} tensors, got {len(correction)}")
    for i, (p, corr) in enumerate(zip(params, correction)):
        if tuple(p.shape) != tuple(corr.shape):
            raise ValueError(f"correction: tensor {i} has shape {tuple(corr.shape)}, expected {tuple(p.shape)}")


@torch.no_grad()
def apply_correction(params: list[torch.Tensor], correction: list[torch.Tensor]) -> None:
    """p.grad += correction (c - c_i) for every parameter that has a gradient; SCAFFOLD's corrected gradient.

    Call after ``backward()`` (and after gradient clipping, so the clip measures the data's gradient)
    and before ``optimizer.step()``. Exact SCAFFOLD for plain SGD; for AdamW see ``apply_correction_step``.
    """
    _check_pairs(params, correction)
    for p, corr in zip(params, correction):
        if p.grad is not None:
            p.grad.add_(corr.to(p.grad.device, p.grad.dtype))


@torch.no_grad()
def apply_correction_step(params: list[torch.Tensor], correction: list[torch.Tensor], lr: float) -> None:
    """p <- p - lr * correction for every parameter that has a gradient (ours: the correction in update units).

    Call after ``optimizer.step()`` and before ``zero_grad()``, with the step's learning rate: the step
    becomes y <- y - lr (u - c_i + c) for the optimizer's update direction u, which is what the lr_sum
    form of option II assumes (module docstring). The same as ``apply_correction`` for SGD without momentum.
    """
    _check_pairs(params, correction)
    for p, corr in zip(params, correction):
        if p.grad is not None:
            p.sub_(corr.to(p.device, p.dtype), alpha=lr)
