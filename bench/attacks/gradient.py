"""Attacks on the pseudo-gradient a malicious replica sends (the daemon's own code does the rest).

* ``SignFlip``: -1000 x the honest pseudo-gradient (sign flip with scaling);
* ``Noise``: Gaussian noise scaled to the honest pseudo-gradient's norm (a useless update that looks
  normal in size);
* ``Scale``: 100 x the honest pseudo-gradient (a too-large, correctly signed update);
* ``InnerProduct``: -0.5 x the honest pseudo-gradient (small-norm, the wrong way: what audits catch).
"""

from __future__ import annotations

import torch
from dilocox.daemon.redteam import Attack


class SignFlip(Attack):
    name = "sign-flip-x1000"

    def pseudo_gradient(self, tensors: list[torch.Tensor], round_index: int) -> list[torch.Tensor]:
        return [-1000.0 * t for t in tensors]


class Scale(Attack):
    name = "scale-x100"

    def pseudo_gradient(self, tensors: list[torch.Tensor], round_index: int) -> list[torch.Tensor]:
        return [100.0 * t for t in tensors]


class Noise(Attack):
    name = "noise-at-honest-norm"

    def pseudo_gradient(self, tensors: list[torch.Tensor], round_index: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(round_index)
        noise = [torch.randn(t.shape, generator=g) for t in tensors]
        honest = torch.sqrt(sum((t.double() ** 2).sum() for t in tensors))
        drawn = torch.sqrt(sum((n.double() ** 2).sum() for n in noise))
        return [(n * (honest / drawn)).float() for n in noise]


class InnerProduct(Attack):
    """Inner-product manipulation by one peer (Xie et al., arXiv 1903.03936): -0.5 x its honest pseudo-gradient, a
    small-norm update pointing the wrong way, which norm- and distance-based rules let through."""

    name = "inner-product-x0.5"

    def pseudo_gradient(self, tensors: list[torch.Tensor], round_index: int) -> list[torch.Tensor]:
        return [-0.5 * t for t in tensors]
