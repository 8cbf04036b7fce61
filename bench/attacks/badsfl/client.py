"""One client's round with the daemon's own pieces, shared by honest and attacking clients.

A round of client i (DiLoCo / SCAFFOLD option II, dilocox/diloco.py and dilocox/scaffold.py):
  x <- theta; K inner steps of ``InnerLoop.inner_step`` (AdamW at ``InnerConfig.lr_at``, gradient clipped
  to max_grad_norm), each followed by the hooks in ``after`` (SCAFFOLD: ``apply_correction_step``, i.e.
  x <- x - lr (c - c_i), what ``ReplicaState.inner_step`` does); delta = theta - x (``OuterOptimizer
  .pseudo_gradient``). Vectors travel flattened (float64, parameter order, bench/federation.py's ``flatten``)
  into dilocox.robust.aggregate.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from dilocox.diloco import InnerLoop, OuterOptimizer
from dilocox.scaffold import apply_correction_step


def scaffold_hook(inner: InnerLoop, correction: list[torch.Tensor]) -> Callable[[float], None]:
    """The after-step hook of ``ReplicaState.inner_step``: x <- x - lr (c - c_i) (correction = c - c_i)."""

    def after(lr: float) -> None:
        apply_correction_step(inner.params, correction, lr)

    return after


def local_round(inner: InnerLoop, outer: OuterOptimizer, next_batch: Callable[[], tuple], round_index: int,
                inner_steps: int, after: Optional[list[Callable[[float], None]]] = None) -> list[torch.Tensor]:
    """Run one client round from theta (``outer.global_params``) and return its pseudo-gradient delta.

    ``next_batch()`` -> (uint8 images [B, 28, 28], int64 labels [B]); step i of round r uses the schedule's
    global step (r - 1) K + i, as a node does. ``after``: hooks run in order after each optimizer step.
    """
    inner.load_params(outer.global_params)
    hooks = list(after or [])

    def after_step(lr: float) -> None:
        for hook in hooks:
            hook(lr)

    for i in range(inner_steps):
        x, y = next_batch()
        inner.inner_step(x, y, global_step=(round_index - 1) * inner_steps + i,
                         after_step=after_step if hooks else None)
    return outer.pseudo_gradient(inner.params)
