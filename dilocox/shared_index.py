"""Shared index sets: every member of a round sends its values at the same positions.

Why: with top-k chosen by each member, the group's aggregate holds up to k x topk values per chunk, so
a reduce-scatter (each range's reducer aggregates that range, then the results are all-gathered) must
cut its result back, and the cut costs quality (dilocox/experimental/resparsify.py, docs/algorithms.md
"Re-sparsified aggregates"). If every member sends values at one index set P, the aggregate lives on P
too: the reducers need no cut, and a member uploads about (V + R + I) x (k - 1) / k per round, with V
its values, R a result range's bytes and I the index set relayed once, whatever k is.

Selections (``Selection``):

* ``leader``: the round's leader (members in sorted peer-id order, rotating by outer
  step) takes the top-k |values| of each chunk of its error-feedback-corrected pseudo-gradient; the
  others use that index set. Cyclic local top-k (CLT-k), Chen et al., "ScaleCom: Scalable Sparsified
  Gradient Compression for Communication-Efficient Distributed Training", NeurIPS 2020, arXiv
  2104.11125, Sec. 3: it relies on the members' error-feedback buffers being alike. I is the index set
  Rice-coded as dilocox/sparse/ codes a contribution's indices.
* ``union``: every member proposes the ceil(topk / k) largest |values| of each chunk of its own beta e +
  delta, and P is the union of the k proposals (at most about topk per chunk): each member's largest
  values are sent every round, as in an all-gather of top-k, at a k-th of the count. I is the k
  proposals, each Rice-coded; a member uploads its own to the others, about I x (k - 1) / k.
* ``random``: topk positions per chunk drawn from a generator seeded by (seed, outer step): random-k
  with a shared seed, so no index bytes at all (I = 0), and values spend the bytes indices would.

The daemon runs ``union``. The leader's rotation, the random draw, the union computed in one place and the
reduction by ranges are measured by bench/quality.py alone: dilocox/experimental/selections.py.

Per member r and round, with e_r its fp32 error-feedback buffer (as dilocox/sparse/):

    m_r <- beta e_r + delta_r;   v_r <- Q_bits(m_r[P]) per chunk;   e_r <- m_r - scatter(P, v_r)
    A = rule(v_1 .. v_k) on P (dilocox/robust.py);   applied = Q_result_bits(A) per chunk (0: fp32)
    e_r[P] <- e_r[P] + (A - applied)   for every member (the result's quantization error)

For the weighted mean, mean_r(what each e_r keeps) + applied = mean_r(m_r) exactly as in
dilocox/experimental/resparsify.py: nothing is lost, only delayed (tests/test_shared_index.py).

The last line needs the unquantized A at every member, which a reduce-scatter never sends. What a transport
can do instead (``ReducerFeedback``): the result's quantization error stays with the reducer of its range,
in a buffer g over the positions of the chunks it reduces, and joins the next result there:

    A' = A + g[P];   applied = Q_result_bits(A') per chunk;   g[P] <- A' - applied

Error feedback at the aggregator, as DoubleSqueeze (Tang et al., "DoubleSqueeze: Parallel Stochastic Gradient
Descent with Double-Pass Error-Compensated Compression", ICML 2019, arXiv 1905.05957, Algorithm 1) keeps it at
its parameter server. Ranges are fixed runs of chunks (``chunk_ranges``), so a reducer meets its own chunks
again; sum(applied) + g over rounds equals the sum of A, nothing lost either.

Here are the rule, its byte counts and its wire formats (``encode_proposal``, ``pack_values``, with their
untrusted-input readers); peers/reducescatter.py sends a round between peers, and the daemon does not run
these rounds yet. Quality is measured in bench/quality.py (methods ``shared-*``, docs/algorithms.md
"Shared index sets": the union is the one that works, +0.19% of fp32 DiLoCo at 4 replicas for 2.2x a
contribution's upload).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from enum import Enum
from typing import Sequence

import numpy as np
import torch

from dilocox import robust
from dilocox.sparse.quantizer import decode_rows, encode_rows
from dilocox.sparse.wire import (
    SCALE_BYTES,
    SUPPORTED_BITS,
    ContributionError,
    SparseConfig,
    decode_positions,
    encode_positions,
    layout,
    pack_bits,
    unpack_bits,
)


class Selection(str, Enum):
    LEADER = "leader"
    UNION = "union"
    RANDOM = "random"


@dataclass(frozen=True)
class SharedIndexConfig:
    """chunk: values per chunk; topk: positions per chunk in P; bits: bits per contribution value;
    result_bits: bits per value of the reduced result (0: fp32, not quantized); beta: decay of the
    error-feedback buffer per outer step; selection: how P is chosen (module docstring)."""

    chunk: int = 4096
    topk: int = 128
    bits: int = 2
    result_bits: int = 8
    beta: float = 0.9
    selection: Selection = Selection.LEADER

    def __post_init__(self):
        self.contribution_config()  # chunk, topk, bits and beta within a contribution's limits, with its errors
        if self.result_bits not in (0, *SUPPORTED_BITS):
            raise ValueError(f"result_bits must be 0 (fp32) or one of {SUPPORTED_BITS}; got {self.result_bits!r}")
        object.__setattr__(self, "selection", Selection(self.selection))

    def contribution_config(self) -> SparseConfig:
        """The sparse codec's configuration with our chunk, topk, bits and beta (Rice-coded indices): the limits
        and the index code our values and index sets share with a contribution (dilocox/sparse/)."""
        return SparseConfig(self.chunk, self.topk, self.bits, self.beta, rice=True)

    @property
    def rice_bits(self) -> int:
        """Rice parameter of the index set's gaps, as dilocox/sparse/'s (4 for 128 of 4096)."""
        return self.contribution_config().rice_bits


def padded_chunks(flat: torch.Tensor, chunk: int) -> torch.Tensor:
    """(nchunks, chunk) view of ``flat`` with the last chunk padded by -1 (below any |value|)."""
    n = flat.numel()
    out = torch.full((-(-n // chunk) * chunk,), -1.0)
    out[:n] = flat
    return out.view(-1, chunk)


def flat_positions(local: torch.Tensor, n: int, chunk: int) -> np.ndarray:
    """(nchunks, topk) positions inside chunks -> sorted flat int64 positions below n."""
    local, _ = torch.sort(local, dim=1)
    flat = (local + torch.arange(local.shape[0]).unsqueeze(1) * chunk).reshape(-1).numpy().astype(np.int64)
    return flat[flat < n]


def leader_positions(m: torch.Tensor, cfg: SharedIndexConfig) -> np.ndarray:
    """The leader's index set: the topk largest |values| of each chunk of ``m`` (flat fp32, the leader's
    beta e + delta), as sorted flat int64 positions (a short last chunk: at most its length).
    Raises ValueError for non-finite values."""
    if not bool(torch.isfinite(m).all()):
        raise ValueError("the leader's pseudo-gradient holds non-finite values")
    if m.numel() == 0:
        return np.zeros(0, dtype=np.int64)
    chunks = padded_chunks(m.abs(), cfg.chunk)
    local = torch.topk(chunks, min(cfg.topk, cfg.chunk), dim=1, sorted=False).indices
    return flat_positions(local, m.numel(), cfg.chunk)


def proposal_config(cfg: SharedIndexConfig, k: int) -> SparseConfig:
    """The sparse codec's configuration of a member's proposal in a group of k: ceil(topk / k) positions per
    chunk, Rice-coded as a contribution's indices (the values' settings are unused)."""
    if k < 1:
        raise ValueError(f"a group has at least one member; got k={k}")
    return replace(cfg.contribution_config(), topk=-(-cfg.topk // k))


def proposal_positions(m: torch.Tensor, cfg: SharedIndexConfig, k: int) -> np.ndarray:
    """Our proposal for a union round of k members: the ceil(topk / k) largest |values| of each chunk of ``m``
    (flat fp32, beta e + delta), as sorted flat int64 positions (``leader_positions``)."""
    return leader_positions(m, replace(cfg, topk=proposal_config(cfg, k).topk, selection=Selection.LEADER))


def value_range(n: int, chunk: int, k: int, j: int) -> tuple[int, int]:
    """Reducer j's range (``chunk_ranges``) in flat positions: [lo, hi)."""
    lo, hi = chunk_ranges(n, chunk, k)[j]
    return lo * chunk, min(hi * chunk, int(n))


def encode_proposal(positions: np.ndarray, lo: int, hi: int, cfg: SharedIndexConfig, k: int) -> bytes:
    """The part of a proposal (``proposal_positions``) in the range [lo, hi) of whole chunks, for its reducer:
    an index set alone over hi - lo values (``dilocox.sparse.encode_positions``: Rice-coded as a
    contribution's indices, no scale, no value). Raises ValueError for a range that does not start a chunk."""
    if lo % cfg.chunk:
        raise ValueError(f"a range starts at a chunk; {lo} is not a multiple of {cfg.chunk}")
    sel = positions[(positions >= lo) & (positions < hi)]
    return encode_positions(sel - lo, hi - lo, proposal_config(cfg, k))


def decode_proposal(payload: bytes, lo: int, hi: int, cfg: SharedIndexConfig, k: int) -> np.ndarray:
    """A member's proposal for [lo, hi) (untrusted bytes) -> sorted flat int64 positions. Raises
    ContributionError (a ValueError) for anything but ceil(topk / k) distinct positions per chunk, Rice-coded."""
    return decode_positions(payload, hi - lo, proposal_config(cfg, k)) + lo


def proposal_bytes(lo: int, hi: int, cfg: SharedIndexConfig, k: int) -> int:
    """The largest valid proposal for [lo, hi) (a fetch's bound)."""
    lay = layout(hi - lo, proposal_config(cfg, k))
    return 8 + lay.index_bytes + -(-lay.max_unary_bits // 8)  # the u64 unary length, remainders, unary stream


COUNT = struct.Struct("<I")


def _run_config(count: int, length: int) -> SparseConfig:
    """The codec's configuration of ``count`` positions among ``length`` values read as one chunk."""
    return SparseConfig(chunk=max(2, length), topk=max(1, count), rice=True)


def encode_union(positions: np.ndarray, lo: int, hi: int) -> bytes:
    """The union of a range's proposals, as its reducer serves it: the count (u32), then the positions in
    [lo, hi) as one Rice-coded index set over the whole range (``dilocox.sparse.encode_positions`` with the
    range as a single chunk, so the Rice parameter follows the union's own density)."""
    sel = positions[(positions >= lo) & (positions < hi)] - lo
    if not len(sel):
        return COUNT.pack(0)
    return COUNT.pack(len(sel)) + encode_positions(sel, max(2, hi - lo), _run_config(len(sel), hi - lo))


def decode_union(payload: bytes, lo: int, hi: int, most: int) -> np.ndarray:
    """A reducer's union for [lo, hi) (untrusted bytes) -> sorted flat int64 positions. ``most``: the largest
    count a union may hold (k proposals' worth). Raises ContributionError for a count above ``most`` or the
    range, or an index set that does not read."""
    if not isinstance(payload, (bytes, bytearray, memoryview)) or len(payload) < COUNT.size:
        raise ContributionError("a union starts with its count (u32)")
    (count,) = COUNT.unpack_from(bytes(payload))
    if count > min(most, hi - lo):
        raise ContributionError(f"a union of {count} positions; at most {min(most, hi - lo)} in this range")
    if count == 0:
        if len(payload) != COUNT.size:
            raise ContributionError(f"an empty union of {len(payload)} bytes; {COUNT.size} expected")
        return np.zeros(0, dtype=np.int64)
    local = decode_positions(bytes(payload)[COUNT.size:], max(2, hi - lo), _run_config(count, hi - lo))
    if local[-1] >= hi - lo:  # a one-value range is read as a chunk of two
        raise ContributionError(f"position {int(local[-1]) + lo} outside the range [{lo}, {hi})")
    return local + lo


def union_bytes_bound(lo: int, hi: int, most: int) -> int:
    """The largest valid union for [lo, hi) holding at most ``most`` positions (a fetch's bound)."""
    count = max(1, min(most, hi - lo))
    lay = layout(max(2, hi - lo), _run_config(count, hi - lo))
    return COUNT.size + 8 + lay.index_bytes + -(-lay.max_unary_bits // 8)


def union_bytes(positions: np.ndarray, n: int, cfg: SharedIndexConfig, k: int) -> int:
    """Bytes of P as the k reducers serve it, each its range's union (``encode_union``), once."""
    return sum(len(encode_union(positions, *value_range(n, cfg.chunk, k, j))) for j in range(k))


def _chunk_counts(positions: np.ndarray, n: int, chunk: int) -> np.ndarray:
    return np.bincount(positions // chunk, minlength=-(-n // chunk))


def values_bytes(positions: np.ndarray, n: int, cfg: SharedIndexConfig, bits: int | None = None) -> int:
    """Bytes of values at ``positions`` as ``pack_values`` sends them: per chunk with any, an fp32 scale, then
    one stream of codes at ``bits`` (default cfg.bits; 0: fp32 values, no scale)."""
    bits = cfg.bits if bits is None else bits
    counts = _chunk_counts(positions, n, cfg.chunk)
    if bits == 0:
        return 4 * int(counts.sum())
    return int((counts > 0).sum()) * SCALE_BYTES + -(-int(counts.sum()) * bits // 8)


def _rows_of(positions: np.ndarray, n: int, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For sorted flat positions: the chunks holding any (ascending), and each position's row among them and
    column inside it."""
    counts = _chunk_counts(positions, n, chunk)
    held = np.flatnonzero(counts)
    row = np.searchsorted(held, positions // chunk)
    col = np.arange(len(positions)) - np.repeat(np.cumsum(counts[held]) - counts[held], counts[held])
    return held, row, col


def pack_values(values: np.ndarray, positions: np.ndarray, n: int, chunk: int, bits: int) -> tuple[bytes, np.ndarray]:
    """Values at sorted flat ``positions`` (fp32, one each) as wire bytes, and as every receiver decodes them.

    Layout (little-endian): for each chunk holding a position, in chunk order, its fp32 scale; then one code
    per position, in order, ``bits`` wide in the bit stream of dilocox/sparse/ (LSB first, zero-padded to
    a whole byte). One scale per chunk, the sparse codec's quantizer (``encode_rows``). bits 0: the fp32
    values, no scale. No index is sent: the receiver holds P. Chunk-local: a range of chunks packed alone
    decodes to the same values. Length: ``values_bytes(positions, n, cfg, bits)``. Raises ValueError for bits
    outside (0, 1, 2, 4, 8)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if bits == 0:
        return values.astype("<f4").tobytes(), values.copy()
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be 0 (fp32) or one of {SUPPORTED_BITS}; got {bits!r}")
    if not len(positions):
        return b"", np.zeros(0, np.float32)
    held, row, col = _rows_of(positions, n, chunk)
    rows = np.zeros((len(held), int(col.max()) + 1), dtype=np.float32)
    rows[row, col] = values
    scale, codes = encode_rows(rows, bits, np.bincount(row, minlength=len(held)))  # chunk-local at any width
    return scale.astype("<f4").tobytes() + pack_bits(codes[row, col], bits), decode_rows(scale, codes, bits)[row, col]


def unpack_values(buf: bytes, positions: np.ndarray, n: int, chunk: int, bits: int) -> np.ndarray:
    """Inverse of ``pack_values`` for untrusted bytes: the fp32 values at ``positions``. Raises
    ContributionError (a ValueError) for another length, a scale that is negative or not finite, nonzero
    padding bits, or fp32 values that are not finite."""
    if not isinstance(buf, (bytes, bytearray, memoryview)):
        raise ContributionError(f"values are {type(buf).__name__}, not bytes")
    buf = bytes(buf)
    if bits == 0:
        if len(buf) != 4 * len(positions):
            raise ContributionError(f"{len(buf)} bytes of fp32 values; {4 * len(positions)} expected")
        out = np.frombuffer(buf, dtype="<f4").astype(np.float32)
        if not np.isfinite(out).all():
            raise ContributionError("non-finite value")
        return out
    held, row, _ = _rows_of(positions, n, chunk)
    expected = SCALE_BYTES * len(held) + -(-len(positions) * bits // 8)
    if len(buf) != expected:
        raise ContributionError(f"{len(buf)} bytes of values; {expected} expected for {len(positions)} positions "
                                f"in {len(held)} chunks at {bits} bits")
    scale = np.frombuffer(buf, dtype="<f4", count=len(held)).astype(np.float32)
    if not (np.isfinite(scale).all() and (scale >= 0).all()):
        raise ContributionError("a chunk's scale is negative or not finite")
    codes = unpack_bits(buf, SCALE_BYTES * len(held), len(positions), bits, "code").numpy()
    return decode_rows(scale[row], codes[:, None], bits)[:, 0]  # one row per position: its chunk's scale


def _quantize_at(values: np.ndarray, positions: np.ndarray, n: int, chunk: int, bits: int) -> np.ndarray:
    """Values at sorted positions quantized per chunk (one scale per chunk, as a contribution's)."""
    return pack_values(values, positions, n, chunk, bits)[1]


class SharedIndexMember:
    """One member's error-feedback buffer (flat CPU fp32, the concatenation of the model's tensors)."""

    def __init__(self, n: int, cfg: SharedIndexConfig = SharedIndexConfig()):
        self.cfg = cfg
        self.error = torch.zeros(int(n))

    def accumulate(self, pseudo_gradient: Sequence[torch.Tensor]) -> torch.Tensor:
        """beta e + delta as a new flat fp32 tensor (the buffer is unchanged). Raises ValueError if the
        tensors do not hold n values or hold non-finite ones."""
        flat = torch.cat([g.detach().reshape(-1).to(torch.float32) for g in pseudo_gradient])
        if flat.numel() != self.error.numel():
            raise ValueError(f"pseudo-gradient has {flat.numel()} values; the buffer holds {self.error.numel()}")
        if not bool(torch.isfinite(flat).all()):
            raise ValueError("pseudo-gradient holds non-finite values")
        return self.error * self.cfg.beta + flat

    def contribute(self, m: torch.Tensor, positions: np.ndarray) -> np.ndarray:
        """Our values at ``positions`` (sorted flat int64), quantized per chunk at cfg.bits, as every member
        decodes them (fp32); the buffer becomes m minus what was sent."""
        pos = torch.from_numpy(positions)
        sent = _quantize_at(m[pos].numpy(), positions, m.numel(), self.cfg.chunk, self.cfg.bits)
        self.error = m.clone()
        self.error[pos] -= torch.from_numpy(sent)
        return sent

    def restore(self, positions: np.ndarray, residual: np.ndarray) -> None:
        """e[positions] += residual (fp32): what the result did not apply of the aggregate."""
        self.error[torch.from_numpy(positions)] += torch.from_numpy(np.asarray(residual, dtype=np.float32))


def chunk_ranges(n: int, chunk: int, k: int) -> list[tuple[int, int]]:
    """The k reducers' ranges of chunks, [lo, hi) in chunk indices, as equal as whole chunks allow
    (floor(j x nchunks / k) to floor((j + 1) x nchunks / k)): reducer j (members in sorted peer-id order)
    reduces range j. Fixed by n, chunk and k alone, so a reducer's ``ReducerFeedback`` meets the same chunks
    every round its group is the same.
    Raises ValueError for k < 1."""
    if k < 1:
        raise ValueError(f"a group has at least one member; got k={k}")
    nchunks = -(-int(n) // chunk)
    bounds = [j * nchunks // k for j in range(k + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class ReducerFeedback:
    """A reducer's error feedback on the result (module docstring, DoubleSqueeze): what quantizing the result
    dropped, per flat position (fp32, n values; a reducer only ever touches the positions of its chunks)."""

    def __init__(self, n: int):
        self.error = np.zeros(int(n), dtype=np.float32)

    def quantize(self, agg: np.ndarray, positions: np.ndarray, n: int,
                 cfg: "SharedIndexConfig") -> tuple[bytes, np.ndarray]:
        """agg (fp32 on ``positions``) plus what earlier results dropped there, quantized per chunk at
        cfg.result_bits (``pack_values``); what this one drops is kept. Returns (the result's bytes, the
        applied values: fp32, len(positions))."""
        want = (agg + self.error[positions]).astype(np.float32)
        payload, applied = pack_values(want, positions, n, cfg.chunk, cfg.result_bits)
        self.error[positions] = want - applied
        return payload, applied


@dataclass(frozen=True)
class Reduced:
    """A round's result on P: ``applied`` (fp32, len(P), what every member applies), ``residual``
    (fp32, len(P): aggregate - applied, what every member returns to its buffer), ``payload`` (the result
    as ``pack_values`` sends it at cfg.result_bits: ``applied`` is what it decodes to)."""

    applied: np.ndarray
    residual: np.ndarray
    payload: bytes

    @property
    def result_bytes(self) -> int:
        """The result's bytes as the all-gather of the ranges sends them."""
        return len(self.payload)


def reduce(values: Sequence[np.ndarray], weights: Sequence[float], positions: np.ndarray, n: int,
           cfg: SharedIndexConfig, rule: str = "mean", norm_bound: float = 0.0,
           feedback: "ReducerFeedback | None" = None) -> Reduced:
    """The members' values on P (in sorted peer-id order, each fp32 of len(P)) through ``rule``
    (dilocox/robust.py, float64), then quantized per chunk at cfg.result_bits (0: cast to fp32).
    ``feedback``: the reducer keeps the result's quantization error (``ReducerFeedback``) and ``residual``
    is all zeros (nothing for the members' buffers); None: ``residual`` is it, for every member.
    The quantization and the coordinate-wise rules (mean, trimmed-mean, median) are chunk-local, so a
    reducer of a range of chunks computes exactly that range; norm bounding and centered-clip use each
    row's whole-vector norms, which range reducers would first have to agree on (a few scalars per member
    and iteration). Raises ValueError for no members or rows of another length."""
    if not values:
        raise ValueError("no contribution to reduce")
    if any(len(v) != len(positions) for v in values):
        raise ValueError(f"every row must hold {len(positions)} values; got {[len(v) for v in values]}")
    rows = np.stack([np.asarray(v, dtype=np.float32) for v in values])
    rows += np.float32(0.0)  # -0.0 (a negative level x a zero scale) read as +0.0, as robust.py requires
    agg = robust.aggregate_rows(rows, list(weights), rule, norm_bound=norm_bound)[0].numpy().astype(np.float32)
    if feedback is not None:
        payload, applied = feedback.quantize(agg, positions, n, cfg)
        return Reduced(applied, np.zeros_like(agg), payload)
    payload, applied = pack_values(agg, positions, n, cfg.chunk, cfg.result_bits)
    return Reduced(applied, agg - applied, payload)


def range_slices(positions: np.ndarray, n: int, chunk: int, k: int) -> list[slice]:
    """Where each of the k reducers' ranges (``chunk_ranges``) lies in the sorted ``positions``."""
    first = [lo * chunk for lo, _ in chunk_ranges(n, chunk, k)] + [int(n)]
    cut = np.searchsorted(positions, first)
    return [slice(int(a), int(b)) for a, b in zip(cut[:-1], cut[1:])]
