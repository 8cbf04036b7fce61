"""DiLoCoX adaptive pseudo-gradient compression: PowerSGD low rank + block quantization + error feedback.

Source: DiLoCoX (Qi et al., arXiv 2506.21263, "adaptive gradient compression"); the formulation
is **(ours)** (docs/algorithms.md, "Adaptive compression"):
  * M_r = delta_r + e_r (error feedback, Karimireddy et al. / PowerSGD, kept per node in fp32);
  * matrices (m x n, large enough): PowerSGD (Vogels et al., arXiv 1905.13727, Alg. 1) with one
    power iteration warm-started from the last averaged Q:
      phase 1: P_r = M_r orth(Q_prev); P = mean_r P_r; P_hat = orth(P)
      phase 2: Q_r = M_r^T P_hat;      Q = mean_r Q_r;  C(M) = P_hat Q^T
  * other tensors, and every tensor in modes fp16/int8/none, are sent whole (quantized);
  * factors and whole tensors are quantized per block (dilocox/quantize.py, 8 or 16 bits);
  * e_r <- M_r - (what replica r's codes decode to), so nothing is lost, only delayed;
  * adaptive rank (``choose_rank``): after each round the swarm picks, from shared statistics,
    the smallest rank on the ladder keeping ``energy`` of the pseudo-gradient energy, capped so
    the next round's bytes fit in one round of compute at the slowest member's bandwidth.

Everything that must be equal on every replica (rank, Q_prev, block scales) is "shared state":
it only changes from all-reduced or all-gathered data, is digested with theta, served to joiners
and checkpointed. The error-feedback buffers are local.

Not hivemind's ``PowerSGDGradientAverager``: its rank is fixed, it accumulates a model's ``.grad``
rather than a pseudo-gradient, and its lossy return path gives each peer a different mean (see
quantize.py), so replicas would drift. The two phases here use the plain averager API with one
group key per phase. Bits: 8 (uint8 on the wire) is the narrowest; hivemind's reducer treats each
wire element as one value, so two 4-bit codes cannot share a byte and 4-bit would only lose precision.

Usage per round: ``r = compressor.begin(pseudo_gradient, bounds)``; for each phase
``codes, gather = r.phase_payload()``, all-reduce codes, ``r.phase_done(mean_codes, gathered)``;
then ``r.result()`` is the averaged pseudo-gradient and ``compressor.commit(r)`` advances the
shared state (only when the round is applied).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import torch

from dilocox import quantize

Mode = Literal["none", "fp16", "int8", "adaptive"]
MODE_BITS = {"none": 32, "fp16": 16, "int8": 8, "adaptive": 8}


@dataclass(frozen=True)
class CompressionConfig:
    """mode: none (fp32 exact), fp16 (16-bit blocks), int8 (8-bit blocks), adaptive (low rank + 8-bit).

    rank_min/rank_max bound the rank ladder (powers of two between them); energy is the fraction of
    the pseudo-gradient energy the chosen rank must keep; bandwidth_bps (0 = use measured) and
    fill (fraction of a round the transfer may take) set the bandwidth cap; block is the number
    of values per quantization scale; margin is the scale head-room over last round's maxima.
    error_feedback: keep what the codes missed and add it to the next round (off: it is dropped);
    dense: indices of tensors never sent in low rank (e.g. embeddings and the LM head, as hivemind
    and GaLore do), sent whole at ``bits`` instead.
    """

    mode: Mode = "adaptive"
    rank_min: int = 1
    rank_max: int = 8
    energy: float = 0.5
    block: int = 256
    margin: float = 2.0
    fill: float = 0.8
    seed: int = 0
    error_feedback: bool = True
    dense: tuple[int, ...] = ()

    def __post_init__(self):
        if self.mode not in MODE_BITS:
            raise ValueError(f"compression must be one of {', '.join(MODE_BITS)}; got {self.mode!r}")
        if not 1 <= self.rank_min <= self.rank_max:
            raise ValueError(f"need 1 <= rank_min <= rank_max; got {self.rank_min}, {self.rank_max}")
        if not 0 < self.energy <= 1:
            raise ValueError(f"energy must be in (0, 1]; got {self.energy}")

    @property
    def bits(self) -> int:
        return MODE_BITS[self.mode]

    @property
    def ladder(self) -> list[int]:
        """Ranks the swarm may use: rank_max, rank_max/2, ... down to rank_min (and rank_min itself)."""
        if self.mode != "adaptive":
            return [0]
        out, r = [], self.rank_max
        while r > self.rank_min:
            out.append(r)
            r //= 2
        return sorted(set(out + [self.rank_min]))


def is_low_rank(shape: Sequence[int], rank_max: int) -> bool:
    """Compress a tensor with PowerSGD only if it is a matrix and rank_max factors are < half its size."""
    return len(shape) == 2 and (shape[0] + shape[1]) * rank_max * 2 <= shape[0] * shape[1]


def orthonormalize(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning x's (m x r), via fp64 QR with a sign convention; deterministic."""
    q, r = torch.linalg.qr(x.double())
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1
    return (q * signs).float()


def choose_rank(ladder: Sequence[int], current: int, kept: dict[int, float], energy: float,
                bytes_at: dict[int, float], bandwidth_bps: float, round_s: float, fill: float) -> int:
    """The adaptive rank rule (ours; docs/algorithms.md, "Adaptive rank rule").

    kept[k]: fraction of the pseudo-gradient energy the top-k columns kept (k <= current).
    If even ``current`` keeps less than ``energy``, step up the ladder; otherwise take the
    smallest k that keeps ``energy``. Then cap: the largest ladder rank whose bytes
    (bytes_at[k], sent per node per round) take at most ``fill * round_s`` at ``bandwidth_bps``.
    """
    ladder = sorted(ladder)
    if kept.get(current, 0.0) < energy:
        wanted = next((k for k in ladder if k > current), ladder[-1])
    else:
        wanted = min((k for k in ladder if k <= current and kept.get(k, 0.0) >= energy), default=current)
    if bandwidth_bps > 0 and round_s > 0:
        fits = [k for k in ladder if bytes_at[k] * 8 / bandwidth_bps <= fill * round_s]
        wanted = min(wanted, max(fits) if fits else ladder[0])
    return max(wanted, ladder[0])


@dataclass
class Slot:
    """One tensor sent in one phase: a whole parameter or a factor (transposed: rows = rank)."""

    param: int
    kind: Literal["whole", "P", "Q"]
    shape: tuple


class DenseCompressor:
    """Shared compression state of one stage plus this replica's error feedback (CPU fp32)."""

    def __init__(self, shapes: Sequence[Sequence[int]], cfg: CompressionConfig):
        self.cfg = cfg
        self.shapes = [tuple(s) for s in shapes]
        self.bits = cfg.bits
        self.wire_bits = cfg.bits if cfg.bits < 32 else 16  # mode none: every block takes the fp32 exact path
        self.low_rank = [cfg.mode == "adaptive" and is_low_rank(s, cfg.rank_max) and i not in cfg.dense
                         for i, s in enumerate(self.shapes)]
        self.rank = cfg.rank_max if cfg.mode == "adaptive" else 0
        self.error = [torch.zeros(s) for s in self.shapes]
        self.q_prev: dict[int, torch.Tensor] = {
            i: self._random_q(i, 0, self.rank) for i, lr in enumerate(self.low_rank) if lr}
        self.scales: dict[tuple, torch.Tensor] = {}
        self._reset_scales()

    # ------------------------------------------------------------ layout
    def phases(self, rank: Optional[int] = None) -> list[list[Slot]]:
        """Slots per phase: low rank -> [P factors], [Q factors + whole tensors]; else [whole tensors]."""
        r = self.rank if rank is None else rank
        whole = [Slot(i, "whole", s) for i, s in enumerate(self.shapes) if not self.low_rank[i]]
        if not any(self.low_rank):
            return [whole]
        p = [Slot(i, "P", (r, s[0])) for i, s in enumerate(self.shapes) if self.low_rank[i]]
        q = [Slot(i, "Q", (r, s[1])) for i, s in enumerate(self.shapes) if self.low_rank[i]]
        return [p, q + whole]

    def buffer_size(self, rank: Optional[int] = None) -> int:
        """Elements of the all-reduce buffer for ``rank``: the largest phase."""
        return max(sum(math.prod(s.shape) for s in ph) for ph in self.phases(rank))

    def wire_bytes(self, rank: Optional[int] = None, group_size: int = 2) -> float:
        """Bytes one node sends per round in a butterfly all-reduce of ``group_size``: its parts
        (codes at ``bits``) and the fp32 deltas it returns as a reducer, for every phase."""
        up = self.bits // 8  # 4 for mode none
        return sum(self.buffer_size(rank) * (group_size - 1) / group_size * (up + 4) for _ in self.phases(rank))

    # ------------------------------------------------------------ shared state
    def _random_q(self, i: int, salt: int, r: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + i * 7919 + salt)
        return torch.randn(self.shapes[i][1], r, generator=g)

    def _reset_scales(self) -> None:
        self.scales = {}
        for ph in self.phases():
            for s in ph:
                self.scales[(s.param, s.kind)] = torch.zeros(quantize.num_blocks(s.shape, self.cfg.block))

    def shared_tensors(self) -> list[torch.Tensor]:
        """Shared state as tensors in a fixed order (Q_prev per low-rank matrix, then scales)."""
        qs = [self.q_prev[i] for i in sorted(self.q_prev)]
        return qs + [self.scales[k] for k in sorted(self.scales, key=lambda k: (k[0], k[1]))]

    def load_shared(self, rank: int, tensors: Sequence[torch.Tensor]) -> None:
        """Adopt a peer's shared state (joiner / resync); raises ValueError if it does not fit."""
        if self.cfg.mode == "adaptive" and rank not in self.cfg.ladder:
            raise ValueError(f"compression rank {rank} is not on our ladder {self.cfg.ladder}")
        old = (self.rank, dict(self.q_prev), dict(self.scales))
        self.rank = rank if self.cfg.mode == "adaptive" else 0
        self._reset_scales()
        expected = [(self.shapes[i][1], self.rank) for i in sorted(self.q_prev)]
        keys = sorted(self.scales, key=lambda k: (k[0], k[1]))
        expected += [tuple(self.scales[k].shape) for k in keys]
        got = [tuple(t.shape) for t in tensors]
        if got != [tuple(e) for e in expected] or not all(torch.isfinite(t).all() for t in tensors):
            self.rank, self.q_prev, self.scales = old
            raise ValueError(f"compression state does not fit: got shapes {got[:3]}..., expected {expected[:3]}...")
        n = len(self.q_prev)
        self.q_prev = {i: t.float().clone() for i, t in zip(sorted(self.q_prev), tensors[:n])}
        self.scales = {k: t.float().clone() for k, t in zip(keys, tensors[n:])}
        self.error = [torch.zeros(s) for s in self.shapes]  # our buffers belonged to another trajectory

    def shared_digest(self, rank: int, tensors: Sequence[torch.Tensor]) -> str:
        """Digest of a downloaded shared state (validated on a scratch copy; ours is untouched);
        raises ValueError if it does not fit."""
        scratch = DenseCompressor(self.shapes, self.cfg)
        scratch.load_shared(rank, tensors)
        return scratch.digest()

    def digest(self) -> str:
        h = hashlib.sha256(str(self.rank).encode())
        for t in self.shared_tensors():
            h.update(t.contiguous().numpy())
        return h.hexdigest()[:8]

    def begin(self, pseudo_gradient: Sequence[torch.Tensor], bounds: Sequence[float],
              round_index: int = 1) -> "CompressionRound":
        """Start a round. bounds[i]: shared bound on |pseudo_gradient[i]| (offsets of the exact path);
        round_index seeds new rank columns (shared)."""
        rnd = CompressionRound(self, pseudo_gradient, bounds)
        rnd.round_salt = round_index
        return rnd

    def commit(self, rnd: "CompressionRound") -> None:
        """The round was applied: keep its error feedback and advance the shared state from its
        all-reduced/all-gathered data (identical on every member of the group)."""
        self.error = rnd.new_error if self.cfg.error_feedback else [torch.zeros(s) for s in self.shapes]
        self.scales = rnd.new_scales
        if any(self.low_rank):
            order, new_rank = rnd.column_order, rnd.next_rank
            for i in self.q_prev:
                q = rnd.q_mean[i][:, order][:, :new_rank]
                if new_rank > q.shape[1]:
                    q = torch.cat([q, self._random_q(i, rnd.round_salt, new_rank - q.shape[1])], dim=1)
                self.q_prev[i] = q.contiguous()
            for (i, kind), s in list(self.scales.items()):
                if kind == "Q":  # Q column j of the next round follows P_hat column order[j]
                    s = s[order][:new_rank]
                    if new_rank > s.shape[0]:  # new columns start at the largest known scale (8-bit, not fp32)
                        s = torch.cat([s, s.amax(dim=0, keepdim=True).expand(new_rank - s.shape[0], -1)])
                elif kind == "P":
                    s = self._predicted_p_scale(i, rnd.averaged[i])
                self.scales[(i, kind)] = s.contiguous()
            self.rank = new_rank

    def refine(self, rnd: "CompressionRound") -> None:
        """One more power iteration: the next round over the same pseudo-gradient starts from this
        round's averaged Q (shared), while the error feedback and scales stay as they were (a
        finished round that was not applied)."""
        for i in self.q_prev:
            self.q_prev[i] = rnd.q_mean[i].contiguous()

    def _predicted_p_scale(self, i: int, averaged: torch.Tensor) -> torch.Tensor:
        """Scale of next round's P = M orth(Q_prev), predicted from this round's shared average
        (M ~ P_hat Q^T): the old P columns were taken in another basis, so their maxima do not carry
        over. Weak columns keep at least 1/64 of the strongest column's range."""
        predicted = quantize.block_absmax((averaged @ orthonormalize(self.q_prev[i])).T, self.cfg.block)
        floor = float(predicted.max()) / 64
        return quantize.next_scale([predicted.clamp_min(floor)], self.bits, self.cfg.margin)

    def averager_sizes(self) -> list[int]:
        """All-reduce buffer sizes of this code's rounds, largest first: one per rank of the adaptive ladder."""
        return sorted({self.buffer_size(r) for r in self.cfg.ladder}, reverse=True)

    def state_dict(self) -> dict:
        return dict(rank=self.rank, shared=self.shared_tensors(), error=self.error)

    def load_state_dict(self, state: dict) -> None:
        self.load_shared(int(state["rank"]), state["shared"])
        if [tuple(e.shape) for e in state["error"]] != [tuple(s) for s in self.shapes]:
            raise ValueError("error-feedback buffers do not match the model")
        self.error = [e.float().clone() for e in state["error"]]


@dataclass
class RoundStats:
    rank: int = 0
    bits: int = 32
    relative_error: float = 0.0  # ||M - C(M)|| / ||M|| of this replica's contribution
    clamped: int = 0
    payload_bytes: int = 0       # this replica's codes, as encoded for the wire
    kept_energy: float = 1.0     # shared: fraction of energy the rank kept (adaptive)


@dataclass
class CompressionRound:
    """One round's compression, phase by phase; see the module docstring."""

    comp: DenseCompressor
    pseudo_gradient: Sequence[torch.Tensor]
    bounds: Sequence[float]
    phase: int = 0

    def __post_init__(self):
        c = self.comp
        self.m = [g.float() + e for g, e in zip(self.pseudo_gradient, c.error)]
        self.rank = c.rank
        self.plan = c.phases()
        self.new_error = [x.clone() for x in self.m]
        self.new_scales = {k: v.clone() for k, v in c.scales.items()}
        self.p_hat: dict[int, torch.Tensor] = {}
        self.q_mean: dict[int, torch.Tensor] = {}
        self.local_q: dict[int, torch.Tensor] = {}
        self.averaged: list[Optional[torch.Tensor]] = [None] * len(self.m)
        self.captured: dict[int, list[float]] = {}
        self.stats = RoundStats(rank=self.rank, bits=c.bits)
        self.column_order = list(range(self.rank))
        self.next_rank = self.rank
        self.round_salt = 1

    @property
    def num_phases(self) -> int:
        return len(self.plan)

    def _values(self, slot: Slot) -> torch.Tensor:
        i, x = slot.param, self.m[slot.param]
        if slot.kind == "whole":
            return x
        if slot.kind == "P":
            return (x @ orthonormalize(self.comp.q_prev[i])).T  # (r, m)
        q = x.T @ self.p_hat[i]  # (n, r)
        self.local_q[i] = q
        self.captured[i] = (q * q).sum(dim=0).tolist()
        return q.T

    def _exact_offset(self, slot: Slot) -> float:
        bound = self.bounds[slot.param]
        if slot.kind != "whole":  # |P_ij| <= ||M_i,:|| <= sqrt(n) max|M| (orthonormal columns)
            bound *= math.sqrt(self.comp.shapes[slot.param][1 if slot.kind == "P" else 0])
        return quantize.exact_offset(bound)

    def phase_payload(self) -> tuple[torch.Tensor, dict]:
        """(flat fp32 codes of this phase, gather dict: in the last low-rank phase, this replica's
        energy statistics for the rank rule; else empty)."""
        c, codes = self.comp, []
        for slot in self.plan[self.phase]:
            x = self._values(slot)
            scale = c.scales[(slot.param, slot.kind)]
            code, sent, clamped = quantize.encode(x, scale, c.wire_bits, c.cfg.block, self._exact_offset(slot))
            self.stats.clamped += clamped
            # peers/codec.py sends a part as integers only if all its values are codes, else fp32
            self.stats.payload_bytes += code.numel() * (c.wire_bits // 8 if bool((scale > 0).all()) else 4)
            if slot.kind == "whole":
                self.new_error[slot.param] = self.m[slot.param] - sent
            elif slot.kind == "Q":
                self.local_q[slot.param] = sent.T  # what our codes carry: the error feedback keeps the rest
            codes.append(code)
        flat = torch.cat(codes) if codes else torch.zeros(0)
        gather: dict = {}  # small: it rides hivemind's control pipe and matchmaking messages
        if self.captured:
            gather.update(captured={str(k): v for k, v in self.captured.items()},
                          total=float(sum(float((x * x).sum()) for i, x in enumerate(self.m) if c.low_rank[i])))
        return flat, gather

    def phase_done(self, mean_codes: torch.Tensor, gathered: Sequence[dict], weights: Sequence[float]) -> None:
        """Decode the all-reduced ``mean_codes`` (identical on every member) and the gathered stats
        (every member's gather dict of this phase, in the same order on every member)."""
        c, offset = self.comp, 0
        for slot in self.plan[self.phase]:
            n = math.prod(slot.shape)
            scale = c.scales[(slot.param, slot.kind)]
            mean = quantize.decode(mean_codes[offset:offset + n], scale, c.wire_bits, c.cfg.block,
                                   self._exact_offset(slot), slot.shape)
            offset += n
            if c.bits < 32:  # from the shared mean: a saturated block still grows by ``margin`` per round
                self.new_scales[(slot.param, slot.kind)] = quantize.next_scale(
                    [quantize.block_absmax(mean, c.cfg.block)], c.bits, c.cfg.margin)
            i = slot.param
            if slot.kind == "whole":
                self.averaged[i] = mean
            elif slot.kind == "P":
                self.p_hat[i] = orthonormalize(mean.T)  # (m, r)
            else:
                self.q_mean[i] = mean.T  # (n, r)
                self.averaged[i] = self.p_hat[i] @ mean
                self.new_error[i] = self.m[i] - self.p_hat[i] @ self.local_q[i].T
        if self.phase == len(self.plan) - 1 and any(c.low_rank):
            self._rank_statistics(gathered, weights)
        self.phase += 1

    def _rank_statistics(self, gathered: Sequence[dict], weights: Sequence[float]) -> None:
        """Shared: column order by averaged Q norms; kept-energy fractions for the rank rule."""
        norms = torch.stack([(self.q_mean[i] ** 2).sum(dim=0) for i in sorted(self.q_mean)]).sum(dim=0)
        self.column_order = torch.argsort(norms, descending=True, stable=True).tolist()
        total, kept = 0.0, torch.zeros(self.rank, dtype=torch.float64)
        for g, w in zip(gathered, weights):
            captured = g.get("captured", {})
            total += w * float(g.get("total", 0.0))
            for key, cols in captured.items():
                if len(cols) == self.rank:
                    kept += w * torch.tensor(cols, dtype=torch.float64)[self.column_order]
        cum = torch.cumsum(kept, 0) / max(total, 1e-300)
        self.kept = {k: float(cum[k - 1]) for k in range(1, self.rank + 1)}
        self.stats.kept_energy = self.kept.get(self.rank, 0.0)

    def buffer_size(self) -> int:
        """Elements of this round's all-reduce buffer (its rank's largest phase): which averager carries it."""
        return self.comp.buffer_size(self.rank)

    def lookahead(self) -> None:
        """Our contribution is known only after the all-reduce (its factors depend on the group's P): overlapped
        rounds' proxy uses the pseudo-gradient itself."""
        return None

    def own(self) -> list[torch.Tensor]:
        """Our own contribution as the group decodes it, M_r - e_r (call after the last phase)."""
        return [m - e for m, e in zip(self.m, self.new_error)]

    def result(self) -> list[torch.Tensor]:
        """The averaged (decompressed) pseudo-gradient, identical on every member of the group."""
        assert self.phase == len(self.plan), "round not finished"
        num = sum(float((e * e).sum()) for e in self.new_error)
        den = sum(float((x * x).sum()) for x in self.m)
        self.stats.relative_error = math.sqrt(num / den) if den > 0 else 0.0
        return [a for a in self.averaged]

    def decide_rank(self, bandwidth_bps: float, round_s: float, group_size: int) -> int:
        """Next round's rank from the shared statistics (call after the last phase)."""
        c = self.comp
        if not any(c.low_rank):
            return self.rank
        ladder = c.cfg.ladder
        bytes_at = {k: c.wire_bytes(k, max(2, group_size)) for k in ladder}
        self.next_rank = choose_rank(ladder, self.rank, self.kept, c.cfg.energy, bytes_at, bandwidth_bps,
                                     round_s, c.cfg.fill)
        return self.next_rank
