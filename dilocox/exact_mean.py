"""Offset encoding that makes hivemind's butterfly all-reduce return bit-identical means on every peer.

Why (ours): hivemind's reducer computes the mean a of a part once, but sends each peer the
difference ``a - y_i`` and the peer adds it to its own contribution y_i
(hivemind/averaging/allreduce.py, ``tensor.add_(update)``). In floating point
``y_i + (a - y_i)`` differs from a by an ulp that depends on y_i, so replicas drift apart.
If every value sent lies in [C/2, 2C] for one power of two C, Sterbenz' lemma makes
``a - y_i`` exact, hence ``y_i + (a - y_i) == a`` bit for bit on every peer. We send
y = C + x with |x| <= C/4, and decode x_mean = a - C (exact again by Sterbenz).

C must be the same on every peer before any data moves, so it comes from quantities all replicas
share: the global parameters theta_{t-1}, the learning-rate schedule of the round and the inner
optimizer's hyper-parameters, through a bound on how far H AdamW (or clipped SGD) steps can move one
coordinate. Precision: x is kept to C * 2^-24 absolute, i.e. 22 bits below the bound (finer than
fp16's 11 bits).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch


@lru_cache(maxsize=16)
def adam_step_bound(beta1: float, beta2: float, horizon: int = 100_000) -> float:
    """max_t |m_hat_t / sqrt(v_hat_t)| for Adam with bias correction, any gradients.

    With r = beta1 / sqrt(beta2) < 1, |m_t| <= (1-beta1)/sqrt(1-beta2) * (1-r^t)/(1-r) * sqrt(v_t)
    (Cauchy-style bound term by term), so the ratio is at most
    K_t = (1-beta1)(1-r^t) sqrt(1-beta2^t) / ((1-r) sqrt(1-beta2) (1-beta1^t)); K_1 = 1.
    Raises ValueError when beta1^2 >= beta2 (the update is then unbounded).
    """
    if not (0 <= beta1 < 1 and 0 < beta2 < 1) or beta1 * beta1 >= beta2:
        raise ValueError(f"AdamW betas {beta1}, {beta2}: need 0 <= beta1, beta1^2 < beta2 < 1 for a bounded update")
    r = beta1 / math.sqrt(beta2)
    best = 1.0
    for t in range(1, horizon + 1, 1 if horizon < 1000 else 7):
        k = (1 - beta1) * (1 - r**t) * math.sqrt(1 - beta2**t) / ((1 - r) * math.sqrt(1 - beta2) * (1 - beta1**t))
        best = max(best, k)
    return best * 1.01  # margin for the sampled t grid


def sgd_step_bound(max_grad_norm: float, momentum: float) -> float:
    """max |b_t| per coordinate of torch SGD's momentum buffer b_t = momentum b_{t-1} + g_t, per unit of lr.

    Every gradient is clipped to norm max_grad_norm (InnerLoop.inner_step), so |g_t| <= max_grad_norm per
    coordinate and the geometric sum gives max_grad_norm / (1 - momentum). Coupled weight decay adds
    wd |x| to g_t; it passes through the same sum, so callers divide weight_decay by (1 - momentum) too
    (``inner_step_bound``)."""
    if not 0.0 <= momentum < 1.0 or not max_grad_norm > 0:
        raise ValueError(f"SGD bound needs 0 <= momentum < 1 and max_grad_norm > 0, got {momentum}, {max_grad_norm}")
    return max_grad_norm / (1.0 - momentum)


def inner_step_bound(optimizer: str, betas: tuple[float, float], momentum: float,
                     max_grad_norm: float) -> tuple[float, float]:
    """(step bound per unit of lr, weight-decay factor) of the inner_optimizer, for ``pseudo_gradient_bound``.

    adamw: (``adam_step_bound(*betas)``, 1); decoupled weight decay moves x by lr wd |x|. sgd:
    (``sgd_step_bound``, 1 / (1 - momentum)); coupled weight decay rides the momentum buffer."""
    if optimizer == "adamw":
        return adam_step_bound(*betas), 1.0
    if optimizer == "sgd":
        return sgd_step_bound(max_grad_norm, momentum), 1.0 / (1.0 - momentum)
    raise ValueError(f"no step bound for inner optimizer {optimizer!r}")


def pseudo_gradient_bound(lr_sum: float, weight_decay: float, param_absmax: float, step_bound: float) -> float:
    """Bound B on |x_start - x_end| per coordinate after inner steps whose learning rates sum to lr_sum.

    Each step moves a coordinate by at most lr * (step_bound + weight_decay * |x|), and |x| stays
    below param_absmax + B, so B = lr_sum (step_bound + wd * param_absmax) / (1 - wd * lr_sum).
    """
    shrink = 1.0 - weight_decay * lr_sum
    if shrink <= 0.1:
        shrink = 0.1  # absurd schedules: stay finite, clipping reports any excess
    return max(lr_sum * (step_bound + weight_decay * param_absmax) / shrink, 1e-30)


def offset_for(bound: float) -> float:
    """The power of two C >= 4 * bound."""
    return float(2.0 ** math.ceil(math.log2(4.0 * bound)))


def encode(x: torch.Tensor, offset: float) -> tuple[torch.Tensor, int]:
    """Return (C + clamp(x, +-C/4) in fp32, number of clamped elements; 0 unless the bound was wrong)."""
    limit = offset / 4.0
    x = x.to(torch.float32)
    clipped = int((x.abs() > limit).sum())
    return x.clamp(-limit, limit) + offset, clipped


def decode(y: torch.Tensor, offset: float) -> torch.Tensor:
    """x = y - C, exact for y in [C/2, 2C]."""
    return y - offset
