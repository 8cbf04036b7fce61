"""Malformed sparse contributions: what a buggy or hostile peer may announce and serve.

Each attack rewrites our own (honest) payload before its digest is announced, so the bytes reach
every group-mate intact and it is the codec's validation (dilocox.sparse) that must reject them:

* ``Truncated``: the payload without its last 10 bytes;
* ``Oversized``: the payload with 10 extra bytes;
* ``OutOfRange``: the first index of the last (short) chunk set past the chunk's end;
* ``Cycle``: round r uses Truncated, Oversized, OutOfRange for r mod 3 = 0, 1, 2.
"""

from __future__ import annotations

import numpy as np
from dilocox.daemon.redteam import Attack

from dilocox.sparse import (
    HEADER,
    HEADER_BYTES,
    RICE_FLAG,
    SCALE_BYTES,
    UNARY,
    SparseConfig,
    layout,
    pack_bits,
    unpack_bits,
)


class Truncated(Attack):
    name = "truncated"

    def contribution(self, payload: bytes, round_index: int) -> bytes:
        return payload[:-10]


class Oversized(Attack):
    name = "oversized"

    def contribution(self, payload: bytes, round_index: int) -> bytes:
        return payload + bytes(10)


class OutOfRange(Attack):
    name = "out-of-range"

    def contribution(self, payload: bytes, round_index: int) -> bytes:
        return out_of_range(payload)


class Cycle(Attack):
    name = "malformed-cycle"

    def contribution(self, payload: bytes, round_index: int) -> bytes:
        kind = round_index % 3
        return payload[:-10] if kind == 0 else payload + bytes(10) if kind == 1 else out_of_range(payload)


def out_of_range(payload: bytes) -> bytes:
    """Push an index of the last chunk past that chunk's end: fixed-width indices, its first index set to
    chunk - 1 (>= the length of a short last chunk); Rice-coded indices, the last gap grown by a chunk."""
    _, _, bits, flags, total, chunk, topk = HEADER.unpack_from(payload)
    if flags & RICE_FLAG:
        return _rice_out_of_range(payload, SparseConfig(chunk=chunk, topk=topk, bits=bits, rice=True), total)
    cfg = SparseConfig(chunk=chunk, topk=topk, bits=bits)
    lay = layout(total, cfg)
    if lay.last == chunk:
        raise ValueError("the last chunk is full: every index fits, pick a model whose size is not a multiple")
    start = HEADER_BYTES + SCALE_BYTES * lay.nchunks
    idx = unpack_bits(payload, start, lay.nidx, cfg.index_bits, "index")
    idx[(lay.nchunks - 1) * topk] = chunk - 1
    return payload[:start] + pack_bits(idx, cfg.index_bits) + payload[start + lay.index_bytes:]


def _rice_out_of_range(payload: bytes, cfg: SparseConfig, total: int) -> bytes:
    lay = layout(total, cfg)
    (unary_bits,) = UNARY.unpack_from(payload, HEADER_BYTES)
    start = HEADER_BYTES + UNARY.size + SCALE_BYTES * lay.nchunks + lay.index_bytes  # the unary stream
    end = start + -(-unary_bits // 8)
    bits = np.unpackbits(np.frombuffer(payload[start:end], dtype=np.uint8), count=unary_bits, bitorder="little")
    extra = -(-cfg.chunk // (1 << cfg.rice_bits))  # quotient ones worth a whole chunk
    bits = np.concatenate([bits[:-1], np.ones(extra, dtype=np.uint8), bits[-1:]])  # before the last stop bit
    stream = np.packbits(bits, bitorder="little").tobytes()
    return (payload[:HEADER_BYTES] + UNARY.pack(len(bits)) + payload[HEADER_BYTES + UNARY.size:start] + stream
            + payload[end:])
