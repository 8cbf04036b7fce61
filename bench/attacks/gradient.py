"""Attacks on the pseudo-gradient a malicious replica sends (the daemon's own code does the rest).

* ``SignFlip``: -1000 x the honest pseudo-gradient (sign flip with scaling);
* ``Noise``: Gaussian noise scaled to the honest pseudo-gradient's norm (a useless update that looks
  normal in size);
* ``Scale``: 100 x the honest pseudo-gradient (a too-large, correctly signed update);
* ``ScaleThenStop``: a 100 x contribution in rounds 2 and 3 only, then honest (an attack window, as BadSFL's; what
  SCAFFOLD's quiet restart follows);
* ``InnerProduct``: -0.5 x the honest pseudo-gradient (small-norm, the wrong way: what audits catch).
"""

from __future__ import annotations

import numpy as np
import torch
from dilocox.daemon.redteam import Attack

from dilocox.sparse import HEADER, HEADER_BYTES, RICE_FLAG, UNARY


class SignFlip(Attack):
    name = "sign-flip-x1000"

    def pseudo_gradient(self, tensors: list[torch.Tensor], round_index: int) -> list[torch.Tensor]:
        return [-1000.0 * t for t in tensors]


class Scale(Attack):
    name = "scale-x100"

    def pseudo_gradient(self, tensors: list[torch.Tensor], round_index: int) -> list[torch.Tensor]:
        return [100.0 * t for t in tensors]


class ScaleThenStop(Attack):
    """100 x its sparse payload's per-chunk scales in rounds 2 and 3: the contribution it sends is 100 x its honest
    one, while its own error feedback stays honest, so from round 4 on it is an honest member again (scaling the
    pseudo-gradient instead would leave the boost in the error feedback for dozens of rounds)."""

    name = "scale-x100-rounds-2-3"
    window = range(2, 4)

    def contribution(self, payload: bytes, round_index: int) -> bytes:
        if round_index not in self.window:
            return payload
        _, _, bits, flags, total, chunk, topk = HEADER.unpack_from(payload)
        offset = HEADER_BYTES + (UNARY.size if flags & RICE_FLAG else 0)
        scales = np.frombuffer(payload, dtype="<f4", count=-(-total // chunk), offset=offset)
        out = bytearray(payload)
        out[offset:offset + scales.nbytes] = (scales * np.float32(100.0)).astype("<f4").tobytes()
        return bytes(out)


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
