"""Per-block integer quantization whose all-reduce mean is bit-identical on every peer.

Why (ours): hivemind's reducer sends each peer ``mean - own`` serialized with the codec that
peer used (hivemind/averaging/allreduce.py), so a lossy codec on that return path gives every
peer a slightly different mean. Here the *values* are quantized before the all-reduce, to
integer codes ``y = OFFSET + q`` with |q| <= QMAX and OFFSET a power of two (so every y lies in
[OFFSET/2, 2*OFFSET]); the wire codec (peers/codec.py) then ships them losslessly as uint8 or
int16, and Sterbenz' lemma makes ``y_i + (mean - y_i) == mean`` exactly, as in exact_mean.py.

Scales are per block of ``block`` consecutive values in a row; they must be equal on every peer,
so they come from shared data: the largest |value| of that block in the previous round's
all-reduced mean, times ``margin`` (compression.py). A block with no scale yet (scale 0: first
round, new rank column) is sent in fp32 with exact_mean's offset encoding.
Values beyond the scale's range are clamped; error feedback (compression.py) carries the rest.
"""

from __future__ import annotations

import math

import torch

from dilocox import exact_mean

# wire bits -> (OFFSET, QMAX): uint8 codes in [65, 191], int16 codes in [8193, 24575]
LEVELS = {8: (128.0, 63), 16: (16384.0, 8191)}
TINY_SCALE = 1e-30  # scale of a block that was all zeros: any value there clamps to ~0 and is fed back


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` as 2-D (rows, cols): (d0, rest) for >= 2-D tensors, (1, n) for 1-D / scalars."""
    return x.reshape(x.shape[0], -1) if x.dim() >= 2 else x.reshape(1, -1)


def num_blocks(shape: torch.Size | tuple, block: int) -> tuple[int, int]:
    """(rows, blocks per row) of the per-block scale tensor for a tensor of ``shape``."""
    rows = shape[0] if len(shape) >= 2 else 1
    cols = math.prod(shape) // rows if rows else 0
    return rows, max(1, math.ceil(cols / block))


def _blocked(x2: torch.Tensor, block: int) -> torch.Tensor:
    """(rows, cols) -> (rows, nb, block), zero-padded."""
    rows, cols = x2.shape
    nb = max(1, math.ceil(cols / block))
    pad = nb * block - cols
    if pad:
        x2 = torch.nn.functional.pad(x2, (0, pad))
    return x2.reshape(rows, nb, block)


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """max |x| per block, shape (rows, nb), fp32."""
    return _blocked(as_rows(x.float()), block).abs().amax(dim=-1)


def encode(x: torch.Tensor, scale: torch.Tensor, bits: int, block: int, exact_offset: float
           ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Quantize ``x`` (any shape) with per-block ``scale`` (rows, nb).

    Returns (codes, sent, clamped): ``codes`` flat fp32 of x.numel() values to all-reduce;
    ``sent`` = what the codes decode to (x minus the quantization/clamping error), shaped like x;
    ``clamped`` = values that exceeded their block's range (the error feedback keeps the excess).
    Blocks whose scale is 0 use the exact fp32 offset encoding around ``exact_offset`` (a power of two).
    """
    offset, qmax = LEVELS[bits]
    x2 = as_rows(x.float())
    rows, cols = x2.shape
    xb = _blocked(x2, block)
    s = scale.to(torch.float32).unsqueeze(-1)
    known = s > 0
    q = torch.round(xb / torch.where(known, s, torch.ones_like(s)))
    clamped = int(((q.abs() > qmax) & known).sum())
    q = q.clamp(-qmax, qmax)
    limit = exact_offset / 4.0
    clamped += int(((xb.abs() > limit) & ~known).sum())
    exact = xb.clamp(-limit, limit) + exact_offset
    codes = torch.where(known, q + offset, exact)
    sent = torch.where(known, q * s, exact - exact_offset)
    codes = codes.reshape(rows, -1)[:, :cols].reshape(-1)
    sent = sent.reshape(rows, -1)[:, :cols].reshape(x.shape)
    return codes, sent, clamped


def decode(codes: torch.Tensor, scale: torch.Tensor, bits: int, block: int, exact_offset: float,
           shape: torch.Size | tuple) -> torch.Tensor:
    """Averaged ``codes`` (flat) -> values of ``shape``; deterministic, so equal codes give equal values."""
    offset, _ = LEVELS[bits]
    rows = shape[0] if len(shape) >= 2 else 1
    xb = _blocked(codes.float().reshape(rows, -1), block)
    s = scale.to(torch.float32).unsqueeze(-1)
    out = torch.where(s > 0, (xb - offset) * s, xb - exact_offset)
    return out.reshape(rows, -1)[:, : codes.numel() // rows].reshape(shape)


def next_scale(absmax: list[torch.Tensor], bits: int, margin: float) -> torch.Tensor:
    """Scale for the next round: margin * max over ``absmax`` (block maxima of shared values) / QMAX."""
    _, qmax = LEVELS[bits]
    top = torch.stack([a.float() for a in absmax]).amax(dim=0)
    return (top * margin / qmax).clamp_min(TINY_SCALE)


def exact_offset(bound: float) -> float:
    """Power-of-two offset for the fp32 exact path, given a shared bound on |value|."""
    return exact_mean.offset_for(bound)
