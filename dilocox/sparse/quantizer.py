"""The per-chunk quantizer of sparse contributions (not dilocox/quantize.py's block codes for the dense
all-reduce).

Quantizer (bits b in {2, 4, 8}, M = 2^(b-1)), per chunk with s = max |selected value|:
``code = clamp(floor((v / s + 1) * M), 0, 2M - 1)``, decoded ``v~ = s * (2 code + 1 - 2M) / (2M)``:
2^b equal bins over [-s, s] decoded at their centres (2 bits: +-s/4, +-3s/4), i.e. sign + magnitude
with no zero level; |v - v~| <= s / 2^b. (2 code + 1 - 2M) / (2M) is exact in fp32, so v~ is one
fp32 product, the same on both sides: decode(encode(x)) is exactly what the error feedback
subtracts. A chunk with s = 0 decodes to zeros. One bit is a sign, decoded at +-s/2 with s = 2 x the mean magnitude.
"""

from __future__ import annotations

import numpy as np
import torch

from dilocox.sparse.wire import SUPPORTED_BITS


def _quantize(vals: np.ndarray, scale: np.ndarray, bits: int) -> np.ndarray:
    """(chunks, k) fp32 values, (chunks,) scales -> uint8 codes in [0, 2^bits): floor((v / s + 1) M) in fp32."""
    m = 1 << (bits - 1)
    q = vals / np.where(scale > 0, scale, np.float32(1))[:, None]
    q += np.float32(1)
    q *= np.float32(m)
    np.floor(q, out=q)
    np.clip(q, 0, 2 * m - 1, out=q)
    return q.astype(np.uint8)


def levels(bits: int) -> np.ndarray:
    """The decoded value of each code for a scale of 1, (2 code + 1 - 2M) / (2M): exact in fp32. A code decodes to
    scale x its level, one fp32 product, on both sides (``SparseCodec.prepare``, ``parse``)."""
    m = 1 << (bits - 1)
    return ((2 * np.arange(2 * m) + 1 - 2 * m) / (2 * m)).astype(np.float32)


def encode_rows(vals: np.ndarray, bits: int, counts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(rows, k) fp32 values -> (fp32 scale per row, uint8 codes (rows, k) in [0, 2^bits)): this payload's
    quantizer (module docstring; 1 bit: a sign at +-scale/2). For other codecs that send values at positions
    agreed elsewhere (dilocox/shared_index.py). ``counts``: the values of each row that are real, the rest
    zero padding (a 1-bit scale is the mean magnitude of those alone; the largest is unchanged by zeros).
    Raises ValueError for bits outside SUPPORTED_BITS."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}; got {bits!r}")
    vals = np.ascontiguousarray(vals, dtype=np.float32)
    if bits == 1 and counts is not None:
        scale = (2 * np.abs(vals).sum(axis=1, dtype=np.float64) / np.maximum(counts, 1)).astype(np.float32)
        return scale, _quantize(vals, scale, bits)
    scale, codes = scale_and_codes(vals, bits)
    return scale.astype(np.float32), codes


def decode_rows(scale: np.ndarray, codes: np.ndarray, bits: int) -> np.ndarray:
    """(rows,) scales and (rows, k) codes -> fp32 values, scale x level, the same bits on every machine."""
    out = levels(bits)[codes]
    out *= np.asarray(scale, dtype=np.float32)[:, None]
    return out


def quantize_rows(vals: np.ndarray, bits: int) -> np.ndarray:
    """(rows, k) fp32 values -> the fp32 values a receiver decodes from them (``encode_rows``, ``decode_rows``)."""
    return decode_rows(*encode_rows(vals, bits), bits)



def scale_and_codes(vals: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(chunks, topk) sent values -> (fp32 scale per chunk, uint8 codes). 1 bit is a sign: decoded at +-scale/2,
    so scale = 2 x the mean magnitude sent; else the largest magnitude."""
    scale = (2 * torch.from_numpy(vals).abs().mean(dim=1)).numpy() if bits == 1 else np.abs(vals).max(axis=1)
    return scale, _quantize(vals, scale, bits)
