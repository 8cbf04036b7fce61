"""SparseLoCo pseudo-gradient codec: chunked top-k, 2-bit codes, error feedback, as self-describing bytes.

Source: SparseLoCo (Sarfi et al., arXiv 2508.15706). Per replica r and outer step t,
with a local fp32 error-feedback buffer e_r:

    e_r <- beta * e_r + delta_r
    c_r <- Q_bits(TopK_chunk(e_r));   e_r <- e_r - decode(c_r)
    all-gather c_r;   Delta = sum_r w_r decode(c_r) / sum_r w_r    (the outer step is done elsewhere)

Published recipe: chunks of 4096 values, top-64 per chunk (1.56%), 2-bit values, beta = 0.95,
outer lr 1, no outer momentum. Taken from the reference optimizer (one-covenant/SparseLoCo, read in
a published port of its ``TopKCompressor`` and ``SparseLoCo.step``, and in Templar's
``tplr/compress/topk.py``): the EF update order above
(``error_buffer.mul_(decay).add_(grad)``, compress, subtract the *local decompression*), top-k by
|e| per chunk, 12-bit indices for 4096-value chunks (Templar's ``pack12``). Where we differ **(ours)**:

* chunks are runs of ``chunk`` consecutive values of all tensors flattened and concatenated, not
  64x64 tiles of each matrix; a chunk may straddle two tensors. The last chunk may be short
  (L < chunk values): it sends min(topk, L) values, and its padding is never selected;
* values are quantized per chunk with one fp32 absmax scale s and a uniform mid-rise quantizer
  (below), not the reference's per-tensor "statistical" bins (mean shift, 1.5 sigma bins, an fp32
  lookup table of bin means): no table to send per chunk, and the error is bounded by s / 2^bits;
* indices within a chunk are sorted ascending and distinct (the reference uses unsorted top-k and
  a scatter "mean" that would hide duplicates): one canonical payload per selection, so a receiver
  can reject anything else. Values tied with the topk-th largest |e| go to the lowest positions, so
  the payload is a function of e alone (whatever the machine or thread count);
* indices have a fixed width, ceil(log2 chunk) bits. Templar's current index codec
  (``tplr/compress/bits.py``) Rice-codes counts per 64- or 128-value sub-chunk, then offsets or
  bitmaps, about 8 bits per index at 1.56% density; fixed width costs a third more index bytes but
  gives a size known in advance, vectorized packing and a simple validation;
* the mean divides by the sum of the weights of all accepted contributions (zeros where a peer did
  not select a value; the reference's scatter "mean" averages only over the peers that picked a
  position), in float64 over peer ids in sorted order, so every member gets the same bits; it and
  the robust rules (dilocox/robust.py, with its determinism contract) run on the sorted union of
  the positions the accepted contributions sent.

Quantizer (bits b in {2, 4, 8}, M = 2^(b-1)), per chunk with s = max |selected value|:
``code = clamp(floor((v / s + 1) * M), 0, 2M - 1)``, decoded ``v~ = s * (2 code + 1 - 2M) / (2M)``:
2^b equal bins over [-s, s] decoded at their centres (2 bits: +-s/4, +-3s/4), i.e. sign + magnitude
with no zero level; |v - v~| <= s / 2^b. (2 code + 1 - 2M) / (2M) is exact in fp32, so v~ is one
fp32 product, the same on both sides: decode(encode(x)) is exactly what the error feedback
subtracts. A chunk with s = 0 decodes to zeros.

Payload (little-endian; bit streams fill each byte from its least significant bit, each value
least significant bit first; unused bits of a stream's last byte must be 0):

    header  24 bytes  magic b"DXSP", version u16 (1), bits u8, flags u8 (0),
                      total values u64, chunk u32, topk u32
    scales  4 * nchunks bytes    fp32 per chunk (fp32, not fp16: pseudo-gradients of small-lr
                                 tensors sit below fp16's normal range 6e-5; 2 more bytes per
                                 chunk are 1.8% of the default payload)
    indices ceil(nidx * ceil(log2 chunk) / 8) bytes   position inside its chunk, chunk after chunk
    codes   ceil(nidx * bits / 8) bytes               in the same order as the indices

with nchunks = ceil(n / chunk) and nidx = (nchunks - 1) * topk + min(topk, last chunk's length).
Default config: 116 bytes per 4096 values (141x smaller than fp32).

Speed (``make bench-aggregate``: the daemon's config, top-128 of each 4096 with Rice-coded indices,
norm bound 2, one contribution outsized; 50 M values, one thread of a busy 2-core VM, medians): per
value, encode 5.4 ns, decode 1 ns, the aggregate of 4 contributions 6 ns under the mean and 11 ns
under centered-clip, of 8 contributions 17 and 41 ns (the rule's rows span the union of the sent
positions, which grows with k). Everything is vectorized numpy over the chunks, a cache-sized block
at a time; with more torch threads (``torch.set_num_threads``) the chunks, the contributions and the
rule's column batches are split between threads (Python threads: numpy releases the GIL), with the
same bits. ``python -m bench.codec_speed`` times this against an older version and prints a digest of
the outputs to compare between machines.
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)

MAGIC = b"DXSP"
VERSION = 1
HEADER = struct.Struct("<4sHBBQII")  # magic, version, bits, flags, total values, chunk, topk
HEADER_BYTES = HEADER.size
RICE_FLAG = 1  # flags bit 0: indices Rice-coded; a u64 (unary stream bits) follows the header
UNARY = struct.Struct("<Q")
SCALE_BYTES = 4
SUPPORTED_BITS = (1, 2, 4, 8)


class ContributionError(ValueError):
    """A peer's payload failed validation; the message names the problem."""


@dataclass(frozen=True)
class SparseConfig:
    """chunk: values per chunk; topk: values sent per chunk; bits: bits per sent value (2, 4 or 8);
    beta: decay of the error-feedback buffer per outer step (1 = plain error feedback)."""

    chunk: int = 4096
    topk: int = 64
    bits: int = 2
    beta: float = 0.95
    rice: bool = False  # Rice-coded index gaps instead of fixed-width indices (module docstring)

    def __post_init__(self):
        if not isinstance(self.chunk, int) or not 2 <= self.chunk < 2**32:
            raise ValueError(f"chunk must be an integer in [2, 2^32); got {self.chunk!r}")
        if not isinstance(self.topk, int) or not 1 <= self.topk <= self.chunk:
            raise ValueError(f"topk must be an integer in [1, chunk={self.chunk}]; got {self.topk!r}")
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}; got {self.bits!r}")
        if not (isinstance(self.beta, (int, float)) and 0.0 <= self.beta <= 1.0):
            raise ValueError(f"beta must be in [0, 1]; got {self.beta!r}")

    @property
    def index_bits(self) -> int:
        """ceil(log2(chunk)): 12 for 4096."""
        return (self.chunk - 1).bit_length()

    @property
    def rice_bits(self) -> int:
        """Rice parameter b for the gaps between sent indices: floor(log2(mean gap x ln 2)), near-optimal for
        geometric gaps (Gallager and van Voorhis); 4 for 128 of 4096."""
        return max(0, int(math.log2(self.chunk / self.topk * math.log(2))))


class Layout(NamedTuple):
    """Sizes of a payload for n values (see the module docstring). With Rice-coded indices the unary
    stream's length depends on the gaps: ``index_bytes`` then counts the fixed-width remainders only,
    ``max_unary_bits`` bounds the unary stream and ``total`` is the largest valid payload."""

    n: int
    nchunks: int
    last: int  # values in the last chunk
    nidx: int
    index_bytes: int
    code_bytes: int
    total: int
    max_unary_bits: int = 0

    def rice_total(self, unary_bits: int) -> int:
        """Exact length of a Rice payload whose unary stream has ``unary_bits`` bits."""
        return self.total - -(-self.max_unary_bits // 8) + -(-unary_bits // 8)


def layout(n: int, cfg: SparseConfig) -> Layout:
    nchunks = -(-n // cfg.chunk)
    last = n - (nchunks - 1) * cfg.chunk if nchunks else 0
    nidx = (nchunks - 1) * cfg.topk + min(cfg.topk, last) if nchunks else 0
    code_bytes = -(-nidx * cfg.bits // 8)
    if not cfg.rice:
        index_bytes = -(-nidx * cfg.index_bits // 8)
        return Layout(n, nchunks, last, nidx, index_bytes, code_bytes,
                      HEADER_BYTES + SCALE_BYTES * nchunks + index_bytes + code_bytes)
    # each gap v <= chunk length: sum of (v >> b) over a chunk <= its length >> b, plus one stop bit per index
    max_unary = nidx + ((nchunks - 1) * cfg.chunk + last >> cfg.rice_bits if nchunks else 0)
    index_bytes = -(-nidx * cfg.rice_bits // 8)
    return Layout(n, nchunks, last, nidx, index_bytes, code_bytes,
                  HEADER_BYTES + UNARY.size + SCALE_BYTES * nchunks + index_bytes + -(-max_unary // 8) + code_bytes,
                  max_unary)


def _numel(shapes: Sequence[Sequence[int]]) -> int:
    return sum(math.prod(s) for s in shapes)


def payload_bytes(shapes: Sequence[Sequence[int]], cfg: SparseConfig) -> int:
    """Payload length in bytes (header, scales, indices, codes) for tensors of ``shapes``: exact with
    fixed-width indices, the largest valid one with Rice-coded indices."""
    return layout(_numel(shapes), cfg).total


def _widen(width: int) -> type:
    """The narrowest numpy unsigned type that holds ``width``-bit values."""
    return np.uint8 if width <= 8 else np.uint16 if width <= 16 else np.uint32 if width <= 32 else np.uint64


def pack_bits(values: torch.Tensor | np.ndarray, width: int) -> bytes:
    """Non-negative integers < 2^width -> bit stream (LSB first), zero-padded to whole bytes."""
    v = values.numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
    v = v.reshape(-1)
    count = len(v)
    if width in (8, 16, 32):
        return v.astype(f"<u{width // 8}").tobytes()
    if width in (1, 2, 4):
        per = 8 // width
        cols = np.zeros(-(-count // per) * per, dtype=np.uint8)
        cols[:count] = v
        cols = cols.reshape(-1, per)
        out = cols[:, 0].copy()
        for j in range(1, per):
            out |= cols[:, j] << np.uint8(j * width)
        return out.tobytes()
    if width == 12:  # two values in three bytes
        pairs = np.zeros(-(-count // 2) * 2, dtype=np.uint16)
        pairs[:count] = v
        a, b = pairs[0::2], pairs[1::2]
        out = np.empty((len(a), 3), dtype=np.uint8)
        out[:, 0] = a & 0xFF
        out[:, 1] = (a >> 8) | ((b & 0xF) << 4)
        out[:, 2] = b >> 4
        return out.tobytes()[:-(-count * 12 // 8)]
    bits = ((v.astype(np.int64)[:, None] >> np.arange(width, dtype=np.int64)) & 1).astype(np.uint8)
    return np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def _unpack(buf: bytes, offset: int, count: int, width: int, what: str) -> np.ndarray:
    """Inverse of pack_bits for ``count`` values at ``offset`` as a numpy array of the narrowest unsigned type;
    rejects nonzero padding bits."""
    used = count * width
    raw = np.frombuffer(buf, dtype=np.uint8, count=-(-used // 8), offset=offset)
    if used % 8 and int(raw[-1]) >> (used % 8):
        raise ContributionError(f"nonzero padding bits after the last {what}")
    if width in (8, 16, 32):
        return raw.view(f"<u{width // 8}").astype(_widen(width))
    if width in (1, 2, 4):
        out = np.empty((len(raw), 8 // width), dtype=np.uint8)
        for j in range(8 // width):
            np.right_shift(raw, np.uint8(j * width), out=out[:, j])
        out &= np.uint8((1 << width) - 1)
        return out.reshape(-1)[:count]
    if width == 12:
        trip = np.zeros(-(-count // 2) * 3, dtype=np.uint16)
        trip[:len(raw)] = raw
        trip = trip.reshape(-1, 3)
        out = np.empty((len(trip), 2), dtype=np.uint16)
        out[:, 0] = trip[:, 0] | ((trip[:, 1] & 0xF) << 8)
        out[:, 1] = (trip[:, 1] >> 4) | (trip[:, 2] << 4)
        return out.reshape(-1)[:count]
    # any other width (<= 57): each value from the 8 bytes that hold its first bit
    padded = np.zeros(len(raw) + 8, dtype=np.uint8)
    padded[:len(raw)] = raw
    words = np.ndarray((len(raw) + 1,), dtype="<u8", buffer=padded, strides=(1,))  # unaligned, overlapping
    start = np.arange(count, dtype=np.uint64) * np.uint64(width)
    vals = (words[(start >> np.uint64(3)).astype(np.intp)] >> (start & np.uint64(7))) & np.uint64((1 << width) - 1)
    return vals.astype(_widen(width))


def unpack_bits(buf: bytes, offset: int, count: int, width: int, what: str) -> torch.Tensor:
    """Inverse of pack_bits for ``count`` values at ``offset`` (int64); rejects nonzero padding bits."""
    return torch.from_numpy(_unpack(buf, offset, count, width, what).astype(np.int64))


def _quantize(vals: np.ndarray, scale: np.ndarray, bits: int) -> np.ndarray:
    """(chunks, k) fp32 values, (chunks,) scales -> uint8 codes in [0, 2^bits): floor((v / s + 1) M) in fp32."""
    m = 1 << (bits - 1)
    q = vals / np.where(scale > 0, scale, np.float32(1))[:, None]
    q += np.float32(1)
    q *= np.float32(m)
    np.floor(q, out=q)
    np.clip(q, 0, 2 * m - 1, out=q)
    return q.astype(np.uint8)


def _levels(bits: int) -> np.ndarray:
    """The decoded value of each code for a scale of 1, (2 code + 1 - 2M) / (2M): exact in fp32. A code decodes to
    scale x its level, one fp32 product, on both sides (``SparseCodec.prepare``, ``_parse``)."""
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
    scale, codes = _quantized(vals, bits)
    return scale.astype(np.float32), codes


def decode_rows(scale: np.ndarray, codes: np.ndarray, bits: int) -> np.ndarray:
    """(rows,) scales and (rows, k) codes -> fp32 values, scale x level, the same bits on every machine."""
    out = _levels(bits)[codes]
    out *= np.asarray(scale, dtype=np.float32)[:, None]
    return out


def quantize_rows(vals: np.ndarray, bits: int) -> np.ndarray:
    """(rows, k) fp32 values -> the fp32 values a receiver decodes from them (``encode_rows``, ``decode_rows``)."""
    return decode_rows(*encode_rows(vals, bits), bits)


def _rows(a: np.ndarray, lay: Layout, cfg: SparseConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per-index values -> (the chunks that send ``topk`` each, as (chunks, topk); the last chunk's)."""
    body = (lay.nchunks - 1) * cfg.topk if lay.nchunks else 0
    return a[:body].reshape(-1, cfg.topk), a[body:]


def _parse(payload: bytes, n: int, cfg: SparseConfig) -> tuple[np.ndarray, np.ndarray]:
    """Validate an untrusted payload completely, then return (position inside its chunk, value fp32) of each sent
    value, chunk after chunk and ascending inside each (numpy; ``_positions`` makes the flat positions)."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ContributionError(f"payload is {type(payload).__name__}, not bytes")
    buf = bytes(payload)
    if len(buf) < HEADER_BYTES:
        raise ContributionError(f"truncated header: {len(buf)} bytes, need {HEADER_BYTES}")
    magic, version, bits, flags, total, chunk, topk = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise ContributionError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ContributionError(f"unsupported version {version}, expected {VERSION}")
    if flags & ~RICE_FLAG:
        raise ContributionError(f"reserved header flags set: {flags:#x}")
    if bool(flags & RICE_FLAG) != cfg.rice:
        raise ContributionError(f"index coding {'rice' if flags & RICE_FLAG else 'fixed'} disagrees with ours "
                                f"({'rice' if cfg.rice else 'fixed'})")
    for name, got, ours in (("bits", bits, cfg.bits), ("chunk", chunk, cfg.chunk), ("topk", topk, cfg.topk),
                            ("total values", total, n)):
        if got != ours:
            raise ContributionError(f"header {name}={got} disagrees with ours ({ours})")
    lay = layout(n, cfg)
    off = HEADER_BYTES
    expected = lay.total
    if cfg.rice:
        if len(buf) < off + UNARY.size:
            raise ContributionError(f"truncated header: {len(buf)} bytes, need {off + UNARY.size}")
        (unary_bits,) = UNARY.unpack_from(buf, off)
        off += UNARY.size
        if not lay.nidx <= unary_bits <= lay.max_unary_bits:
            raise ContributionError(f"unary stream of {unary_bits} bits outside [{lay.nidx}, {lay.max_unary_bits}]")
        expected = lay.rice_total(unary_bits)
    if len(buf) < expected:
        raise ContributionError(f"truncated payload: {len(buf)} bytes, expected {expected}")
    if len(buf) > expected:
        raise ContributionError(f"oversized payload: {len(buf)} bytes, expected {expected} "
                                f"({len(buf) - expected} extra bytes)")
    scale = np.frombuffer(buf, dtype="<f4", count=lay.nchunks, offset=off).astype(np.float32)
    if not np.isfinite(scale).all():
        c = int(np.flatnonzero(~np.isfinite(scale))[0])
        raise ContributionError(f"non-finite scale {scale[c]} in chunk {c}")
    if (scale < 0).any():
        c = int(np.flatnonzero(scale < 0)[0])
        raise ContributionError(f"negative scale {scale[c]} in chunk {c}")
    off += SCALE_BYTES * lay.nchunks
    if cfg.rice:
        idx = _rice_indices(buf, off, lay, cfg, unary_bits)  # ascending inside each chunk by construction
        off += lay.index_bytes + -(-unary_bits // 8)
    else:
        idx = _unpack(buf, off, lay.nidx, cfg.index_bits, "index")
        off += lay.index_bytes
    codes = _unpack(buf, off, lay.nidx, cfg.bits, "code")
    body, tail = _rows(idx, lay, cfg)
    ok = not len(body) or bool((body[:, -1] < np.int64(cfg.chunk)).all())
    ok = ok and (not len(tail) or int(tail[-1]) < lay.last)
    if ok and not cfg.rice:
        ok = bool((body[:, 1:] > body[:, :-1]).all()) and bool((tail[1:] > tail[:-1]).all())
    if not ok:
        _index_error(idx, lay, cfg)
    m = 1 << (cfg.bits - 1)
    values = codes.astype(np.float32)  # the level (2 code + 1 - 2M) / (2M), exactly
    values *= np.float32(2)
    values -= np.float32(2 * m - 1)
    values *= np.float32(1 / (2 * m))
    vbody, vtail = _rows(values, lay, cfg)
    vbody *= scale[:len(body), None]  # one fp32 product (_levels)
    vtail *= scale[-1] if len(vtail) else np.float32(1)
    return idx, values


def _positions(idx: np.ndarray, lay: Layout, cfg: SparseConfig) -> np.ndarray:
    """Positions inside their chunks (as ``_parse`` returns them) -> flat positions (int64)."""
    pos = np.empty(lay.nidx, dtype=np.int64)
    (pbody, ptail), (body, tail) = _rows(pos, lay, cfg), _rows(idx, lay, cfg)
    np.add(body, (np.arange(len(body), dtype=np.int64) * cfg.chunk)[:, None], out=pbody)
    np.add(tail, np.int64((lay.nchunks - 1) * cfg.chunk), out=ptail)
    return pos


def _rice_streams(idx: np.ndarray, lay: Layout, cfg: SparseConfig) -> tuple[int, bytes, bytes]:
    """Positions inside their chunks (ascending in each) -> (unary stream bits, the gap remainders' bytes, the
    unary stream's bytes): Rice-coded gaps with parameter cfg.rice_bits (module docstring)."""
    gaps = np.empty_like(idx)
    body, tail = _rows(gaps, lay, cfg)
    ibody, itail = _rows(idx, lay, cfg)
    np.subtract(ibody[:, 1:], ibody[:, :-1], out=body[:, 1:])
    body[:, 1:] -= 1
    body[:, 0] = ibody[:, 0]
    if len(tail):
        np.subtract(itail[1:], itail[:-1], out=tail[1:])
        tail[1:] -= 1
        tail[0] = itail[0]
    b = cfg.rice_bits
    q = gaps >> b
    unary = np.ones(int(q.sum()) + len(q), dtype=np.uint8)
    q += 1
    unary[np.cumsum(q) - 1] = 0  # q ones, then the stop bit
    return (len(unary), pack_bits(gaps & ((1 << b) - 1), b) if b else b"",
            np.packbits(unary, bitorder="little").tobytes())


def encode_positions(positions: np.ndarray, n: int, cfg: SparseConfig) -> bytes:
    """An index set alone, as a contribution with ``cfg`` codes its indices: ``cfg.topk`` sorted flat positions
    per chunk of n values (all of a last chunk shorter than that). Bytes: the unary stream's length in bits
    (u64), the Rice remainders, the unary stream (``cfg.rice`` must be set). For codecs that agree on
    positions apart from values (dilocox/shared_index.py). Raises ValueError for another count per chunk."""
    if not cfg.rice:
        raise ValueError("an index set alone is sent Rice-coded (cfg.rice)")
    lay = layout(n, cfg)
    positions = np.asarray(positions, dtype=np.int64)
    chunks = np.bincount(positions // cfg.chunk, minlength=lay.nchunks) if len(positions) else np.zeros(lay.nchunks)
    want = np.full(lay.nchunks, cfg.topk)
    if lay.nchunks:
        want[-1] = min(cfg.topk, lay.last)
    if len(positions) != lay.nidx or not np.array_equal(chunks, want):
        raise ValueError(f"an index set for {n} values sends {cfg.topk} positions per chunk; got {len(positions)}")
    if len(positions) and not (np.diff(positions) > 0).all():
        raise ValueError("the positions of an index set must be distinct and sorted")
    unary_bits, remainders, unary = _rice_streams(positions % cfg.chunk, lay, cfg)
    return UNARY.pack(unary_bits) + remainders + unary


def decode_positions(payload: bytes, n: int, cfg: SparseConfig) -> np.ndarray:
    """Inverse of ``encode_positions`` for untrusted bytes: the sorted flat positions (int64). Raises
    ContributionError for another length, a unary stream that does not hold one gap per index, nonzero
    padding, or positions out of range, repeated or unsorted inside a chunk."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ContributionError(f"index set is {type(payload).__name__}, not bytes")
    buf = bytes(payload)
    lay = layout(n, cfg)
    if len(buf) < UNARY.size:
        raise ContributionError(f"truncated index set: {len(buf)} bytes, need {UNARY.size}")
    (unary_bits,) = UNARY.unpack_from(buf)
    if not lay.nidx <= unary_bits <= lay.max_unary_bits:
        raise ContributionError(f"unary stream of {unary_bits} bits outside [{lay.nidx}, {lay.max_unary_bits}]")
    expected = UNARY.size + lay.index_bytes + -(-unary_bits // 8)
    if len(buf) != expected:
        raise ContributionError(f"index set of {len(buf)} bytes; {expected} expected")
    idx = _rice_indices(buf, UNARY.size, lay, cfg, unary_bits)
    body, tail = _rows(idx, lay, cfg)
    if not ((not len(body) or bool((body[:, -1] < np.int64(cfg.chunk)).all())) and
            (not len(tail) or int(tail[-1]) < lay.last)):
        _index_error(idx, lay, cfg)
    return _positions(idx, lay, cfg)


def _index_error(idx: np.ndarray, lay: Layout, cfg: SparseConfig) -> None:
    """Raise the ContributionError naming the first bad index: out of range, else duplicate, else unsorted."""
    idx = idx.astype(np.int64)
    cid = np.arange(lay.nidx) // cfg.topk
    length = np.where(cid == lay.nchunks - 1, lay.last, cfg.chunk)
    bad = np.flatnonzero(idx >= length)
    if len(bad):
        i = int(bad[0])
        raise ContributionError(f"index {int(idx[i])} out of range in chunk {int(cid[i])} "
                                f"of {int(length[i])} values")
    same, step = cid[1:] == cid[:-1], idx[1:] - idx[:-1]
    for mask, what in (((step == 0) & same, "duplicate"), ((step < 0) & same, "unsorted")):
        bad = np.flatnonzero(mask)
        if len(bad):
            i = int(bad[0]) + 1
            raise ContributionError(f"{what} index {int(idx[i])} in chunk {int(cid[i])}")
    raise AssertionError("_index_error called on valid indices")


def _rice_indices(buf: bytes, off: int, lay: Layout, cfg: SparseConfig, unary_bits: int) -> np.ndarray:
    """Positions inside their chunks (int32 or int64) from Rice-coded gaps (remainders at ``off``, then the unary
    stream), validated: exactly one stop bit per index, the stream ending on one, zero padding."""
    b = cfg.rice_bits
    start = off + lay.index_bytes
    rem = _unpack(buf, off, lay.nidx, b, "gap remainder") if b else None
    raw = np.frombuffer(buf, dtype=np.uint8, count=-(-unary_bits // 8), offset=start)
    if unary_bits % 8 and int(raw[-1]) >> (unary_bits % 8):
        raise ContributionError("nonzero padding bits after the unary stream")
    stops = np.flatnonzero(np.unpackbits(~raw, count=unary_bits, bitorder="little").view(bool))
    if len(stops) != lay.nidx or (lay.nidx and stops[-1] != unary_bits - 1):
        raise ContributionError(f"unary stream holds {len(stops)} gaps, expected {lay.nidx} ending on its last bit")
    # gap v = positions skipped before this index (the first: its position); position = sum of (v + 1) - 1;
    # within a chunk that sum is at most (unary bits << b) + nidx << b: int32 when that fits
    small = (unary_bits + lay.nidx) << b < 2**31
    steps = np.empty(lay.nidx, dtype=np.int32 if small else np.int64)  # q + 1 for quotient q
    if lay.nidx:
        steps[0] = stops[0] + 1
        np.subtract(stops[1:], stops[:-1], out=steps[1:], casting="unsafe")
    if b:
        steps -= 1
        steps <<= b
        np.add(steps, rem, out=steps, casting="unsafe")  # rem < 2^b: it fits
        steps += 1
    body, tail = _rows(steps, lay, cfg)
    np.cumsum(body, axis=1, out=body)
    np.cumsum(tail, out=tail)
    steps -= 1
    return steps


def _split(flat: torch.Tensor, shapes: Sequence[tuple]) -> list[torch.Tensor]:
    out, o = [], 0
    for s in shapes:
        k = math.prod(s)
        out.append(flat[o:o + k].view(s))
        o += k
    return out


def decode(payload: bytes, shapes: Sequence[Sequence[int]], cfg: SparseConfig) -> list[torch.Tensor]:
    """A peer's payload -> dense fp32 tensors of ``shapes`` (zeros where nothing was sent).

    Validates everything before use; raises ContributionError naming the problem (magic, version,
    header fields vs ``cfg``/``shapes``, truncated or oversized payload, scale, index range, order).
    """
    shapes = [tuple(s) for s in shapes]
    n = _numel(shapes)
    idx, values = _parse(payload, n, cfg)
    pos = _positions(idx, layout(n, cfg), cfg)
    flat = np.zeros(n, dtype=np.float32)  # fresh zero pages: only those holding a sent value are written
    _scatter(flat, pos, values)
    return _split(torch.from_numpy(flat), shapes)


def sent_positions(payload: bytes, shapes: Sequence[Sequence[int]], cfg: SparseConfig) -> np.ndarray:
    """The flat positions (int64, ascending) a payload sends values at, after ``decode``'s validation
    (raises ContributionError as it does)."""
    n = _numel([tuple(s) for s in shapes])
    idx, _ = _parse(payload, n, cfg)
    return _positions(idx, layout(n, cfg), cfg)


def _fill(job: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    """A contribution's row of the rule: its values at their ranks in the union (zeros elsewhere)."""
    row, rank, values = job
    values += np.float32(0.0)  # canonical: a zero scale decodes to -0.0 for negative codes
    row[rank] = values


def _scatter(out: np.ndarray, pos: np.ndarray, values: np.ndarray) -> None:
    """out[pos] = values (distinct positions), in slices on the threads torch may use."""
    parts = max(1, min(torch.get_num_threads(), len(pos) // (1 << 16)))
    b = [len(pos) * i // parts for i in range(parts + 1)]

    def put(i: int) -> None:
        out[pos[b[i]:b[i + 1]]] = values[b[i]:b[i + 1]]

    _map(put, range(parts))


UNION_KEYS = 1 << 16  # keys per block in _union (speed only: a block's scratch stays in a core's cache)


def _union(idxs: Sequence[np.ndarray], lay: Layout, cfg: SparseConfig) -> tuple[np.ndarray, np.ndarray]:
    """Each contribution's sent positions (as ``_parse`` returns them) -> (the sorted union of all of them as flat
    positions (int64), (nidx, k) the rank in that union of each contribution's positions).

    Chunk by chunk: each of a chunk's k x topk positions becomes one integer key, position then origin (entry j
    of contribution i: j k + i), a chunk's keys are sorted (values only: no tie to break), a position that
    differs from its left neighbour starts a new member of the union, and the running count of those is every
    key's rank. The last chunk, if it sends fewer than topk values, is one more (shorter) row of keys."""
    k, topk, nidx = len(idxs), cfg.topk, lay.nidx
    full, short = divmod(nidx, topk)
    tag_bits = max(1, (k * topk - 1).bit_length())
    key_bits = cfg.index_bits + tag_bits
    kt = np.uint16 if key_bits <= 16 else np.uint32 if key_bits <= 32 else np.uint64
    rt = np.int32 if k * nidx < 2**31 else np.int64
    ranks = np.empty((nidx, k), dtype=rt)
    flat = ranks.reshape(-1)
    block = max(1, UNION_KEYS // (k * topk))
    segments = [(r, min(block, full - r), topk) for r in range(0, full, block)] + ([(full, 1, short)] if short else [])
    parts = max(1, min(torch.get_num_threads(), len(segments) // 4))
    groups = [segments[len(segments) * g // parts:len(segments) * (g + 1) // parts] for g in range(parts)]

    support = np.empty(k * nidx, dtype=np.int64)  # at most; the pages past the union are never touched

    def run(group) -> int:  # ranks counted from 0 in each group, members from its first key; both moved below
        at = group[0][0] * topk * k if group else 0
        size = 0
        for row, rows, per in group:
            start = row * topk
            keys = np.empty((rows, per, k), dtype=kt)
            tag = np.arange(0, per * k, k, dtype=kt)
            for i, idx in enumerate(idxs):
                np.left_shift(idx[start:start + rows * per].reshape(rows, per).astype(kt, copy=False), kt(tag_bits),
                              out=keys[:, :, i])
                keys[:, :, i] |= tag + kt(i)
            keys = keys.reshape(rows, per * k)
            keys.sort(axis=1)
            pos = (keys >> kt(tag_bits)).astype(np.int64)
            new = np.empty(keys.shape, dtype=bool)
            new[:, 0] = True
            np.not_equal(pos[:, 1:], pos[:, :-1], out=new[:, 1:])
            rank = np.cumsum(new.reshape(-1), dtype=rt)
            rank += rt(size - 1)
            target = (keys & kt((1 << tag_bits) - 1)).astype(np.intp)  # j k + i: the flat index into ranks
            target += np.arange(start * k, (start + rows * per) * k, per * k, dtype=np.intp)[:, None]
            flat[target.reshape(-1)] = rank
            pos += np.arange(row * cfg.chunk, (row + rows) * cfg.chunk, cfg.chunk, dtype=np.int64)[:, None]
            count = int(rank[-1]) + 1 - size
            support[at + size:at + size + count] = pos.reshape(-1)[new.reshape(-1)]
            size += count
        return size

    offset = 0
    for group, size in zip(groups, _map(run, groups)):
        if group and offset:
            at = group[0][0] * topk * k
            flat[at:(group[-1][0] * topk + group[-1][1] * group[-1][2]) * k] += rt(offset)
            support[offset:offset + size] = support[at:at + size]  # down: offset <= at
        offset += size
    return support[:offset], ranks


def aggregate(contributions: Mapping[str, bytes], weights: Mapping[str, float],
              shapes: Sequence[Sequence[int]], cfg: SparseConfig, rule: str = "mean", norm_bound: float = 0.0,
              **robust_kwargs) -> tuple[list[torch.Tensor], dict[str, str]]:
    """``aggregate_scaled`` without the scales: (fp32 tensors, rejected peer -> reason)."""
    out, rejected, _ = aggregate_scaled(contributions, weights, shapes, cfg, rule, norm_bound, **robust_kwargs)
    return out, rejected


def aggregate_scaled(contributions: Mapping[str, bytes], weights: Mapping[str, float],
                     shapes: Sequence[Sequence[int]], cfg: SparseConfig, rule: str = "mean", norm_bound: float = 0.0,
                     **robust_kwargs) -> tuple[list[torch.Tensor], dict[str, str], dict[str, float]]:
    """The group's aggregate of the decoded contributions: (fp32 tensors, rejected peer -> reason, scaled peer ->
    the norm bound's scale < 1 of its contribution).

    A contribution is dropped if its weight is missing, not finite or <= 0, or its payload fails
    ``decode``'s validation. The accepted ones go through ``dilocox.robust`` (``rule``, ``norm_bound`` and
    its other keyword arguments) in float64 over peer ids in sorted order, then the result is cast to fp32:
    the same inputs give the same bits on every member, whatever the dicts' order, its CPU or thread count.
    Raises ValueError if no contribution is accepted.

    The rule runs on the sorted union of the sent positions only (at most k x topk/chunk of the
    coordinates; a position no one sent stays +0.0): row i holds contribution i's decoded values there
    (zeros where it sent nothing). That layout is the same on every member; robust.py's norms are fixed
    pairwise trees over it (tests/test_sparse.py checks the result against a plain reference of each rule).
    """
    from dilocox import robust

    shapes = [tuple(s) for s in shapes]
    n = _numel(shapes)
    parsed, accepted, rejected = {}, {}, {}
    for peer in sorted(contributions):
        w = weights.get(peer)
        try:
            w = float(w)
        except (TypeError, ValueError):
            rejected[peer] = f"weight {w!r} is not a number"
            continue
        if not (math.isfinite(w) and w > 0):
            rejected[peer] = f"weight {w} must be finite and > 0"
            continue
        accepted[peer] = w

    def parse(peer):
        try:
            return _parse(contributions[peer], n, cfg)
        except ContributionError as e:
            return e

    for peer, got in zip(list(accepted), _map(parse, list(accepted))):
        if isinstance(got, ContributionError):
            rejected[peer] = str(got)
            del accepted[peer]
        else:
            parsed[peer] = got
    rejected = dict(sorted(rejected.items()))
    if not parsed:
        raise ValueError(f"no contribution accepted out of {len(contributions)}: {rejected}")
    peers = sorted(parsed)
    support, ranks = _union([parsed[p][0] for p in peers], layout(n, cfg), cfg)
    rows = np.zeros((len(peers), len(support)), dtype=np.float32)
    _map(_fill, [(row, ranks[:, i], parsed[p][1]) for i, (row, p) in enumerate(zip(rows, peers))])
    del ranks, parsed
    compact, scales = robust.aggregate_rows(rows, [accepted[p] for p in peers], rule, norm_bound=norm_bound,
                                            **robust_kwargs)
    del rows
    out = np.zeros(n, dtype=np.float32)  # fresh zero pages: only the union of the sent positions is written
    _scatter(out, support, compact.numpy().astype(np.float32))  # rounded to nearest
    scaled = {peer: float(scale) for peer, scale in zip(peers, scales) if scale < 1.0}
    for peer, scale in scaled.items():  # the caller reports drops; clipping is the rule's business
        logger.info("contribution of %s scaled by %.3g to the group's norm bound", peer, scale)
    return _split(torch.from_numpy(out), shapes), rejected, scaled


SELECT_VALUES = 1 << 18  # values per block of chunks in _select (speed only: a block stays in a core's cache)


def _decay_add(out: np.ndarray, e: np.ndarray, delta: np.ndarray, beta: float) -> None:
    """out <- beta e + delta in fp32: the product rounded, then the sum (as torch's e * beta + delta)."""
    with np.errstate(over="ignore", invalid="ignore"):  # overflow: the caller finds the inf and refuses
        np.multiply(e, np.float32(beta), out=out)
        out += delta


def _slices(n: int, size: int = 1 << 20) -> list[tuple[int, int]]:
    """[0, n) in runs of ``size`` (the last shorter): work for ``_map``."""
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def _map(fn, items: Sequence) -> list:
    """[fn(item) ...], on up to torch.get_num_threads() threads (numpy releases the GIL in its array work); the
    results do not depend on the thread count."""
    workers = min(torch.get_num_threads(), len(items))
    if workers < 2:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


def _encode(chunks: np.ndarray, topk: int, pad: int, bits: int, idx: np.ndarray, codes: np.ndarray,
            scale: np.ndarray) -> bool:
    """``_encode_rows`` over the rows of ``chunks``, split between the threads torch may use (each row's result does
    not depend on the split)."""
    rows = len(chunks)
    parts = max(1, min(torch.get_num_threads(), rows // max(1, SELECT_VALUES // chunks.shape[1])))
    b = [rows * i // parts for i in range(parts + 1)]
    return all(_map(lambda i: _encode_rows(chunks[b[i]:b[i + 1]], topk, pad if b[i + 1] == rows else 0, bits,
                                           idx[b[i]:b[i + 1]], codes[b[i]:b[i + 1]], scale[b[i]:b[i + 1]]),
                    range(parts)))


def _encode_rows(chunks: np.ndarray, topk: int, pad: int, bits: int, idx: np.ndarray, codes: np.ndarray,
                 scale: np.ndarray) -> bool:
    """Encode each row of ``chunks`` (fp32 error feedback; the last row's last ``pad`` values are padding, never
    picked): the positions of its ``topk`` largest |value| -> ``idx`` (ascending; ties at the threshold go to the
    lowest positions), their ``scale`` and ``codes``; subtracts what was sent from ``chunks``. False (outputs
    unfinished) if a value is not finite.

    Top-k by threshold: t = the topk-th largest |value| of the row (a partial sort, ``np.partition``), then every
    position with |value| > t and the first ones with |value| = t. One block of rows at a time, in cache."""
    rows, chunk = chunks.shape
    per = max(1, SELECT_VALUES // chunk)
    mag = np.empty((min(per, rows), chunk), dtype=np.float32)
    sel = np.empty(mag.shape, dtype=bool)
    kth = chunk - topk
    for r0 in range(0, rows, per):
        r1 = min(r0 + per, rows)
        block, m, s = chunks[r0:r1], mag[:r1 - r0], sel[:r1 - r0]
        np.abs(block, out=m)
        if pad and r1 == rows:
            m[-1, chunk - pad:] = -1.0
        m.partition(kth, axis=1)
        if not np.isfinite(m[:, kth:]).all():  # NaN sorts last, inf next: a non-finite value lands here
            return False
        t = m[:, kth:kth + 1].copy()
        np.abs(block, out=m)
        if pad and r1 == rows:
            m[-1, chunk - pad:] = -1.0
        np.greater_equal(m, t, out=s)
        p = np.flatnonzero(s)
        if len(p) != (r1 - r0) * topk:  # ties with the threshold: keep the first ones
            many = np.flatnonzero(np.bincount(p // chunk, minlength=r1 - r0) > topk)
            gt = m[many] > t[many]
            eq = m[many] == t[many]
            need = topk - gt.sum(axis=1, keepdims=True)
            s[many] = gt | (eq & (np.cumsum(eq, axis=1) <= need))
            p = np.flatnonzero(s)
        flat = block.reshape(-1)
        vals = flat[p].reshape(r1 - r0, topk)
        scale[r0:r1], codes[r0:r1] = _quantized(vals, bits)
        sent = _levels(bits)[codes[r0:r1]]
        sent *= scale[r0:r1, None]  # what every member decodes: one fp32 product (_levels)
        flat[p] -= sent.reshape(-1)
        np.subtract(p.reshape(r1 - r0, topk), (np.arange(r1 - r0, dtype=np.int64) * chunk)[:, None], out=idx[r0:r1])
    return True


def _quantized(vals: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(chunks, topk) sent values -> (fp32 scale per chunk, uint8 codes). 1 bit is a sign: decoded at +-scale/2,
    so scale = 2 x the mean magnitude sent; else the largest magnitude."""
    scale = (2 * torch.from_numpy(vals).abs().mean(dim=1)).numpy() if bits == 1 else np.abs(vals).max(axis=1)
    return scale, _quantize(vals, scale, bits)


class SparseCodec:
    """This replica's encoder and its error-feedback buffers (CPU fp32, one per tensor, local).

    ``error`` lists the buffers as views into one flat buffer (update them in place only).
    """

    def __init__(self, shapes: Sequence[Sequence[int]], cfg: SparseConfig = SparseConfig()):
        self.cfg = cfg
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        if any(d < 0 for s in self.shapes for d in s):
            raise ValueError(f"negative dimension in shapes {self.shapes}")
        self.layout = layout(_numel(self.shapes), cfg)
        self._flat = torch.zeros(self.layout.n)
        self.error = _split(self._flat, self.shapes)

    def payload_bytes(self) -> int:
        """Length of every payload this codec encodes (Rice-coded indices: the largest valid length)."""
        return self.layout.total

    def encode(self, pseudo_gradient: Sequence[torch.Tensor]) -> bytes:
        """e <- beta e + delta; send the top-k of each chunk of e, quantized; e <- e - what was sent.

        Raises ValueError (and leaves the buffers unchanged) if the tensors do not match ``shapes``
        or hold non-finite values. ``prepare`` + ``commit`` in one call.
        """
        payload, new_error = self.prepare(pseudo_gradient)
        self.commit(new_error)
        return payload

    def prepare(self, pseudo_gradient: Sequence[torch.Tensor]) -> tuple[bytes, torch.Tensor]:
        """(payload, the flat error-feedback buffer it leaves) without changing ours: a round whose
        result is not applied must not consume the buffer (``commit`` adopts it once it is).

        Raises ValueError if the tensors do not match ``shapes`` or hold non-finite values (or if
        beta x buffer + pseudo-gradient overflows fp32)."""
        got = [tuple(g.shape) for g in pseudo_gradient]
        if got != self.shapes:
            raise ValueError(f"pseudo-gradient shapes {got} do not match the codec's {self.shapes}")
        lay, cfg = self.layout, self.cfg
        chunk, topk = cfg.chunk, cfg.topk
        full = torch.empty(lay.nchunks * chunk)  # e, then zeros up to a whole number of chunks
        e = full[:lay.n]
        old, new, o, jobs = self._flat.numpy(), full.numpy(), 0, []
        for g in pseudo_gradient:  # e <- beta e + delta: the fp32 product rounded, then the sum (never fused)
            delta = g.detach().to("cpu", torch.float32).reshape(-1).numpy()
            jobs += [(new[o + a:o + b], old[o + a:o + b], delta[a:b]) for a, b in _slices(len(delta))]
            o += len(delta)
        _map(lambda job: _decay_add(*job, cfg.beta), jobs)
        new[lay.n:] = 0.0
        header = HEADER.pack(MAGIC, VERSION, cfg.bits, RICE_FLAG if cfg.rice else 0, lay.n, cfg.chunk, cfg.topk)
        if lay.n == 0:
            return header, e
        chunks = new.reshape(lay.nchunks, chunk)
        nfull = lay.nchunks - 1 if lay.last < topk else lay.nchunks  # chunks that send topk values
        idx = np.empty((lay.nchunks, topk), dtype=np.int64)
        codes = np.empty((lay.nchunks, topk), dtype=np.uint8)
        scale = np.empty(lay.nchunks, dtype=np.float32)
        if not _encode(chunks[:nfull], topk, lay.nchunks * chunk - lay.n if nfull == lay.nchunks else 0, cfg.bits,
                       idx[:nfull], codes[:nfull], scale[:nfull]) or not np.isfinite(chunks[nfull:, :lay.last]).all():
            if not all(bool(torch.isfinite(g).all()) for g in pseudo_gradient):
                raise ValueError("pseudo-gradient holds non-finite values")
            raise ValueError("beta x error-feedback buffer + pseudo-gradient overflows fp32")
        if nfull < lay.nchunks:  # a last chunk shorter than topk sends all its values (the rest: padding, value 0)
            last = chunks[-1]
            vals = last[:topk].copy()
            vals[lay.last:] = 0.0
            s, c = _quantized(vals[None], cfg.bits)
            scale[-1], codes[-1], idx[-1] = s[0], c[0], np.arange(topk)
            sent = _levels(cfg.bits)[c[0, :lay.last]]
            sent *= s[0]
            last[:lay.last] -= sent
        idx, codes = idx.reshape(-1)[:lay.nidx], codes.reshape(-1)[:lay.nidx]
        scales = scale.astype("<f4").tobytes()
        if not cfg.rice:
            out = b"".join((header, scales, pack_bits(idx, cfg.index_bits), pack_bits(codes, cfg.bits)))
            assert len(out) == lay.total
            return out, e
        unary_bits, remainders, unary = _rice_streams(idx, lay, cfg)
        out = b"".join((header, UNARY.pack(unary_bits), scales, remainders, unary, pack_bits(codes, cfg.bits)))
        assert len(out) == lay.rice_total(unary_bits)
        return out, e

    def commit(self, new_error: torch.Tensor) -> None:
        """Adopt the buffer a ``prepare`` left (its round was applied)."""
        self._flat.copy_(new_error)

    def restore(self, tensors: Sequence[torch.Tensor], whole: bool = False) -> None:
        """e <- e + tensors: return to the buffer what the swarm did not apply of a committed contribution
        (dilocox/resparsify.py). ``whole``: e <- e + tensors / beta instead, so the next encode's decay
        (e <- beta e + delta) leaves them whole, as if they were part of the next pseudo-gradient (beta 0:
        nothing survives the decay, so nothing is added). Raises ValueError (buffers unchanged) for other
        shapes or non-finite values."""
        got = [tuple(t.shape) for t in tensors]
        if got != self.shapes:
            raise ValueError(f"shapes {got} do not match the codec's {self.shapes}")
        flat = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors]) if tensors else torch.zeros(0)
        if whole:
            if self.cfg.beta == 0:
                return
            flat = flat / self.cfg.beta
        if not bool(torch.isfinite(flat).all()):
            raise ValueError("tensors to restore hold non-finite values")
        self._flat.add_(flat)

    def reset(self) -> None:
        """Zero the buffers (e.g. after adopting another trajectory's parameters)."""
        self._flat.zero_()

    def state_dict(self) -> dict:
        return {"error": [t.clone() for t in self.error]}

    def load_state_dict(self, state: Mapping) -> None:
        """Adopt saved buffers; raises ValueError (and keeps ours) if they do not fit or are not finite."""
        tensors = list(state.get("error", ()))
        got = [tuple(t.shape) for t in tensors]
        if got != self.shapes:
            raise ValueError(f"error-feedback shapes {got} do not match the codec's {self.shapes}")
        if not all(bool(torch.isfinite(t).all()) for t in tensors):
            raise ValueError("error-feedback state holds non-finite values")
        for dst, src in zip(self.error, tensors):
            dst.copy_(src)


class SparseRound:
    """One round's sparse contribution (``SparseCompressor.begin``): ``payload`` to all-gather, the
    error-feedback buffer it leaves (adopted by ``SparseCompressor.commit`` if the round is applied)
    and its figures in ``stats`` (dilocox.compression.RoundStats)."""

    num_phases = 1

    def __init__(self, codec: "SparseCompressor", pseudo_gradient: Sequence[torch.Tensor]):
        from dilocox.compression import RoundStats

        self.codec = codec
        self.payload, self.new_error = codec.codec.prepare(pseudo_gradient)
        # ||M - C(M)|| / ||M|| with M = beta e + delta, without another full copy: M equals the new buffer except at
        # the sent positions, where it is the new buffer plus the sent value
        lay, cfg = codec.codec.layout, codec.codec.cfg
        idx, values = _parse(self.payload, lay.n, cfg)
        left = self.new_error.numpy()[_positions(idx, lay, cfg)].astype(np.float64)
        err2 = float(torch.linalg.vector_norm(self.new_error)) ** 2 if lay.n else 0.0
        m2 = err2 + float(np.sum((left + values) ** 2 - left ** 2))
        self.stats = RoundStats(rank=0, bits=codec.cfg.bits, payload_bytes=len(self.payload),
                                relative_error=math.sqrt(err2 / m2) if m2 > 0 else 0.0)

    def own(self) -> list[torch.Tensor]:
        """Our contribution as every member decodes it (what the group's mean holds of ours)."""
        return decode(self.payload, self.codec.shapes, self.codec.cfg)

    def decide_rank(self, *args) -> int:
        """No rank to adapt (the Compressor's round protocol)."""
        return 0


class LocalState:
    """The shared-state surface of dilocox.compression.Compressor for compressors whose buffers are all local (no
    state is shared between replicas but the config, which ``digest`` covers): nothing to serve a joiner, and a
    downloaded state, which must be empty, resets our buffers (``reset``)."""

    name = "sparse"
    rank = 0

    def digest(self) -> str:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def shared_tensors(self) -> list[torch.Tensor]:
        return []

    def shared_digest(self, rank: int, tensors: Sequence[torch.Tensor]) -> str:
        """Digest of a downloaded shared state, which must be empty; raises ValueError otherwise."""
        if rank != 0 or len(tensors):
            raise ValueError(f"{self.name} compression has no shared state; got rank {rank} and {len(tensors)} "
                             f"tensors")
        return self.digest()

    def load_shared(self, rank: int, tensors: Sequence[torch.Tensor]) -> None:
        """Adopt a peer's (empty) shared state: our buffers belonged to another trajectory."""
        self.shared_digest(rank, tensors)
        self.reset()


class SparseCompressor(LocalState):
    """The daemon's sparse pseudo-gradient compression (``--compression sparse``): a SparseCodec with
    the state surface of dilocox.compression.Compressor (shared state, digest, checkpoint).

    Nothing is shared between replicas but the config: the error feedback is local, so a round's
    start digest covers only the config, and joiners download no compression tensors."""

    def __init__(self, shapes: Sequence[Sequence[int]], cfg: SparseConfig = SparseConfig()):
        self.codec = SparseCodec(shapes, cfg)
        self.cfg, self.shapes = cfg, self.codec.shapes

    @property
    def error(self) -> list[torch.Tensor]:
        return self.codec.error

    def payload_bytes(self) -> int:
        return self.codec.payload_bytes()

    def begin(self, pseudo_gradient: Sequence[torch.Tensor], bounds=None, round_index: int = 1) -> SparseRound:
        """This round's contribution; nothing changes until ``commit``."""
        return SparseRound(self, pseudo_gradient)

    def commit(self, rnd: SparseRound) -> None:
        self.codec.commit(rnd.new_error)

    def digest(self) -> str:
        c = self.cfg
        return hashlib.sha256(f"sparse/{c.chunk}/{c.topk}/{c.bits}/{c.beta}".encode()).hexdigest()[:8]

    def reset(self) -> None:
        """Our buffers belonged to another trajectory (LocalState.load_shared)."""
        self.codec.reset()

    def state_dict(self) -> dict:
        return dict(rank=0, shared=[], **self.codec.state_dict())

    def load_state_dict(self, state: Mapping) -> None:
        self.codec.load_state_dict(state)
