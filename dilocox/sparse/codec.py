"""Top-k with error feedback (SparseCodec): this replica's encoder of sparse contributions and its local fp32
error-feedback buffer (the package docstring's e_r).

Top-k by threshold per chunk, ties at the threshold to the lowest positions, one cache-sized block of chunks
at a time, split between threads (the same bits whatever their count); the sent values are quantized per
chunk (dilocox/sparse/quantizer.py) and packed as dilocox/sparse/wire.py describes.

Two ways in: ``prepare``/``commit`` take a pseudo-gradient and leave the buffer unchanged until the round is
applied; ``fold``/``unfold`` compute theta - x slice by slice straight into the buffer (no pseudo-gradient, no
second buffer: the synchronous round's path), with the same payload and buffer bits.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np
import torch

from dilocox.sparse.quantizer import levels, scale_and_codes
from dilocox.sparse.threads import slices, thread_map
from dilocox.sparse.wire import (
    HEADER,
    MAGIC,
    RICE_FLAG,
    UNARY,
    VERSION,
    SparseConfig,
    layout,
    numel,
    pack_bits,
    parse,
    positions,
    rice_streams,
    split,
)
from dilocox.threads import cpu_budget

SELECT_VALUES = 1 << 18  # values per block of chunks in _encode_rows (speed only: a block stays in cache)


def _decay_add(out: np.ndarray, e: np.ndarray, delta: np.ndarray, beta: float) -> None:
    """out <- beta e + delta in fp32: the product rounded, then the sum (as torch's e * beta + delta)."""
    with np.errstate(over="ignore", invalid="ignore"):  # overflow: the caller finds the inf and refuses
        np.multiply(e, np.float32(beta), out=out)
        out += delta


def _host(x: torch.Tensor) -> np.ndarray:
    """A slice of the parameters as CPU fp32 numpy (no copy where it already is one)."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        x = x.to("cpu", torch.float32)
    return x.numpy()


def _encode(chunks: np.ndarray, topk: int, pad: int, bits: int, idx: np.ndarray, codes: np.ndarray,
            scale: np.ndarray) -> bool:
    """``_encode_rows`` over the rows of ``chunks``, split between the process's CPU threads (each row's result does
    not depend on the split)."""
    rows = len(chunks)
    parts = max(1, min(cpu_budget(), rows // max(1, SELECT_VALUES // chunks.shape[1])))
    b = [rows * i // parts for i in range(parts + 1)]
    return all(thread_map(lambda i: _encode_rows(chunks[b[i]:b[i + 1]], topk, pad if b[i + 1] == rows else 0, bits,
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
        scale[r0:r1], codes[r0:r1] = scale_and_codes(vals, bits)
        sent = levels(bits)[codes[r0:r1]]
        sent *= scale[r0:r1, None]  # what every member decodes: one fp32 product (levels)
        flat[p] -= sent.reshape(-1)
        np.subtract(p.reshape(r1 - r0, topk), (np.arange(r1 - r0, dtype=np.int64) * chunk)[:, None], out=idx[r0:r1])
    return True



class SparseCodec:
    """This replica's encoder and its error-feedback buffers (CPU fp32, one per tensor, local).

    ``error`` lists the buffers as views into one flat buffer (update them in place only).
    """

    def __init__(self, shapes: Sequence[Sequence[int]], cfg: SparseConfig = SparseConfig()):
        self.cfg = cfg
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        if any(d < 0 for s in self.shapes for d in s):
            raise ValueError(f"negative dimension in shapes {self.shapes}")
        self.layout = layout(numel(self.shapes), cfg)
        # whole chunks: ``fold`` encodes in place (the padding after the n values stays 0)
        self._flat = torch.zeros(self.layout.nchunks * cfg.chunk)
        self.error = split(self._flat[:self.layout.n], self.shapes)

    @property
    def flat(self) -> torch.Tensor:
        """The error-feedback buffer as one flat view (n values, in the order of ``shapes``)."""
        return self._flat[:self.layout.n]

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
        lay = self.layout
        full = torch.empty(lay.nchunks * self.cfg.chunk)  # e, then zeros up to a whole number of chunks
        old, new, o, jobs = self._flat.numpy(), full.numpy(), 0, []
        for g in pseudo_gradient:  # e <- beta e + delta: the fp32 product rounded, then the sum (never fused)
            delta = g.detach().to("cpu", torch.float32).reshape(-1).numpy()
            jobs += [(new[o + a:o + b], old[o + a:o + b], delta[a:b]) for a, b in slices(len(delta))]
            o += len(delta)
        thread_map(lambda job: _decay_add(*job, self.cfg.beta), jobs)
        new[lay.n:] = 0.0
        payload = self._select(new)
        if payload is None:
            if not all(bool(torch.isfinite(g).all()) for g in pseudo_gradient):
                raise ValueError("pseudo-gradient holds non-finite values")
            raise ValueError("beta x error-feedback buffer + pseudo-gradient overflows fp32")
        return payload, full[:lay.n]

    def fold(self, reference: Sequence[torch.Tensor], local: Sequence[torch.Tensor]) -> bytes:
        """``encode`` of the pseudo-gradient reference - local (DiLoCo's theta_{t-1} - x; ``local`` on any device),
        computed slice by slice into our buffer: neither the pseudo-gradient nor a second buffer is held (4 + 4
        bytes per value less than ``prepare``), and payload and buffer get the bits ``encode`` gives them.
        ``unfold`` puts the buffer back if the round is not applied.

        Raises ValueError if the tensors do not match ``shapes`` (buffer unchanged), or if the pseudo-gradient
        holds non-finite values or beta x buffer + pseudo-gradient overflows fp32: the buffer, part-way
        updated, is then zeroed."""
        got, other = [tuple(t.shape) for t in reference], [tuple(t.shape) for t in local]
        if got != self.shapes or other != self.shapes:
            raise ValueError(f"pseudo-gradient shapes {got} / {other} do not match the codec's {self.shapes}")
        e, beta = self._flat.numpy(), self.cfg.beta

        def fold_slice(job) -> bool:
            out, ref, x = job
            delta = np.subtract(ref, _host(x))  # as torch's theta - x: one rounded difference
            if not np.isfinite(delta).all():
                return False
            _decay_add(out, out, delta, beta)
            return True

        if not all(thread_map(fold_slice, self._jobs(e, reference, local))):
            self.reset()
            raise ValueError("pseudo-gradient holds non-finite values")
        payload = self._select(e)
        if payload is None:
            self.reset()
            raise ValueError("beta x error-feedback buffer + pseudo-gradient overflows fp32")
        return payload

    def unfold(self, payload: bytes, reference: Sequence[torch.Tensor], local: Sequence[torch.Tensor]) -> None:
        """Undo the ``fold`` that returned ``payload``, whose round was not applied, with ``reference`` and
        ``local`` as they were then: e <- (e + sent - (reference - local)) / beta, slice by slice. The buffer is
        then what it was before the fold up to fp32 rounding (a few ulps), not bit for bit; with beta 0 it is
        zeroed (nothing of it would survive the next decay). Raises ValueError (buffer unchanged) if ``payload``
        is not one of our encodings."""
        lay, cfg = self.layout, self.cfg
        idx, values = parse(payload, lay.n, cfg)
        e = self._flat.numpy()
        if cfg.beta == 0:
            self.reset()
            return
        e[positions(idx, lay, cfg)] += values
        inverse = np.float32(1.0 / cfg.beta)

        def unfold_slice(job) -> None:
            out, ref, x = job
            out -= np.subtract(ref, _host(x))
            out *= inverse

        thread_map(unfold_slice, self._jobs(e, reference, local))

    def _jobs(self, e: np.ndarray, reference: Sequence[torch.Tensor], local: Sequence[torch.Tensor]) -> list:
        """(e's slice, the reference's slice, local's slice) over all tensors, in runs of ``slices``."""
        jobs, o = [], 0
        for ref, x in zip(reference, local):
            r = ref.detach().reshape(-1).numpy()
            flat = x.detach().reshape(-1)
            jobs += [(e[o + a:o + b], r[a:b], flat[a:b]) for a, b in slices(len(r))]
            o += len(r)
        return jobs

    def _select(self, new: np.ndarray) -> Optional[bytes]:
        """Encode the padded buffer ``new`` (beta e + delta, zeros after the first n values) in place: top-k of
        each chunk, quantized, subtracted from ``new``; the payload, or None if a value is not finite."""
        lay, cfg = self.layout, self.cfg
        chunk, topk = cfg.chunk, cfg.topk
        header = HEADER.pack(MAGIC, VERSION, cfg.bits, RICE_FLAG if cfg.rice else 0, lay.n, cfg.chunk, cfg.topk)
        if lay.n == 0:
            return header
        chunks = new.reshape(lay.nchunks, chunk)
        nfull = lay.nchunks - 1 if lay.last < topk else lay.nchunks  # chunks that send topk values
        idx = np.empty((lay.nchunks, topk), dtype=np.int64)
        codes = np.empty((lay.nchunks, topk), dtype=np.uint8)
        scale = np.empty(lay.nchunks, dtype=np.float32)
        if not _encode(chunks[:nfull], topk, lay.nchunks * chunk - lay.n if nfull == lay.nchunks else 0, cfg.bits,
                       idx[:nfull], codes[:nfull], scale[:nfull]) or not np.isfinite(chunks[nfull:, :lay.last]).all():
            return None
        if nfull < lay.nchunks:  # a last chunk shorter than topk sends all its values (the rest: padding, value 0)
            last = chunks[-1]
            vals = last[:topk].copy()
            vals[lay.last:] = 0.0
            s, c = scale_and_codes(vals[None], cfg.bits)
            scale[-1], codes[-1], idx[-1] = s[0], c[0], np.arange(topk)
            sent = levels(cfg.bits)[c[0, :lay.last]]
            sent *= s[0]
            last[:lay.last] -= sent
        idx, codes = idx.reshape(-1)[:lay.nidx], codes.reshape(-1)[:lay.nidx]
        scales = scale.astype("<f4").tobytes()
        if not cfg.rice:
            out = b"".join((header, scales, pack_bits(idx, cfg.index_bits), pack_bits(codes, cfg.bits)))
            assert len(out) == lay.total
            return out
        unary_bits, remainders, unary = rice_streams(idx, lay, cfg)
        out = b"".join((header, UNARY.pack(unary_bits), scales, remainders, unary, pack_bits(codes, cfg.bits)))
        assert len(out) == lay.rice_total(unary_bits)
        return out

    def commit(self, new_error: torch.Tensor) -> None:
        """Adopt the buffer a ``prepare`` left (its round was applied)."""
        self._flat[:self.layout.n].copy_(new_error)

    def restore(self, tensors: Sequence[torch.Tensor], whole: bool = False) -> None:
        """e <- e + tensors: return to the buffer what the swarm did not apply of a committed contribution
        (dilocox/experimental/resparsify.py). ``whole``: e <- e + tensors / beta instead, so the next encode's decay
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
        self._flat[:self.layout.n].add_(flat)

    def reset(self) -> None:
        """Zero the buffers (e.g. after adopting another trajectory's parameters)."""
        self._flat.zero_()

    def state_dict(self) -> dict:
        """{"error": the buffers}: views of the live buffers, not copies (a checkpoint is written before the next
        encode changes them; clone them to keep them longer)."""
        return {"error": list(self.error)}

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
