"""The sparse contribution's wire format: config, sizes, bit packing, Rice-coded indices, and the complete
validation of untrusted bytes (ContributionError) before they are decoded.

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

With ``rice`` set (flags bit 0), a u64 (the unary stream's length in bits) follows the header and the indices
are Rice-coded gaps instead: the fixed-width remainders, then the unary stream (``rice_streams``).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch

from dilocox.sparse.threads import scatter

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
    """The sizes of a payload of n values under ``cfg`` (Layout)."""
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


def numel(shapes: Sequence[Sequence[int]]) -> int:
    """Values in tensors of ``shapes``, all of them flattened and concatenated."""
    return sum(math.prod(s) for s in shapes)


def payload_bytes(shapes: Sequence[Sequence[int]], cfg: SparseConfig) -> int:
    """Payload length in bytes (header, scales, indices, codes) for tensors of ``shapes``: exact with
    fixed-width indices, the largest valid one with Rice-coded indices."""
    return layout(numel(shapes), cfg).total


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



def _rows(a: np.ndarray, lay: Layout, cfg: SparseConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per-index values -> (the chunks that send ``topk`` each, as (chunks, topk); the last chunk's)."""
    body = (lay.nchunks - 1) * cfg.topk if lay.nchunks else 0
    return a[:body].reshape(-1, cfg.topk), a[body:]


def parse(payload: bytes, n: int, cfg: SparseConfig) -> tuple[np.ndarray, np.ndarray]:
    """Validate an untrusted payload completely, then return (position inside its chunk, value fp32) of each sent
    value, chunk after chunk and ascending inside each (numpy; ``positions`` makes the flat positions). Raises
    ContributionError naming the first problem found."""
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
    vbody *= scale[:len(body), None]  # one fp32 product (levels)
    vtail *= scale[-1] if len(vtail) else np.float32(1)
    return idx, values


def positions(idx: np.ndarray, lay: Layout, cfg: SparseConfig) -> np.ndarray:
    """Positions inside their chunks (as ``parse`` returns them) -> flat positions (int64)."""
    pos = np.empty(lay.nidx, dtype=np.int64)
    (pbody, ptail), (body, tail) = _rows(pos, lay, cfg), _rows(idx, lay, cfg)
    np.add(body, (np.arange(len(body), dtype=np.int64) * cfg.chunk)[:, None], out=pbody)
    np.add(tail, np.int64((lay.nchunks - 1) * cfg.chunk), out=ptail)
    return pos


def rice_streams(idx: np.ndarray, lay: Layout, cfg: SparseConfig) -> tuple[int, bytes, bytes]:
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
    unary_bits, remainders, unary = rice_streams(positions % cfg.chunk, lay, cfg)
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
    return positions(idx, lay, cfg)


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


def split(flat: torch.Tensor, shapes: Sequence[tuple]) -> list[torch.Tensor]:
    """Views of ``flat`` (numel(shapes) values) as tensors of ``shapes``, in order."""
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
    n = numel(shapes)
    idx, values = parse(payload, n, cfg)
    pos = positions(idx, layout(n, cfg), cfg)
    flat = np.zeros(n, dtype=np.float32)  # fresh zero pages: only those holding a sent value are written
    scatter(flat, pos, values)
    return split(torch.from_numpy(flat), shapes)


def sent_positions(payload: bytes, shapes: Sequence[Sequence[int]], cfg: SparseConfig) -> np.ndarray:
    """The flat positions (int64, ascending) a payload sends values at, after ``decode``'s validation
    (raises ContributionError as it does)."""
    n = numel([tuple(s) for s in shapes])
    idx, _ = parse(payload, n, cfg)
    return positions(idx, layout(n, cfg), cfg)
