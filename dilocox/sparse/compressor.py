"""The daemon's sparse compressor (``--compression sparse``): SparseCodec with the round protocol and state
surface of dilocox.compression.DenseCompressor, and LocalState, that surface for compressors whose buffers are all
local (also dilocox/shared_round.py's).
"""

from __future__ import annotations

import hashlib
import math
from typing import Mapping, Optional, Sequence

import numpy as np
import torch

from dilocox.sparse.codec import SparseCodec
from dilocox.sparse.wire import SparseConfig, decode, parse, positions


class SparseRound:
    """One round's sparse contribution (``SparseCompressor.begin`` or ``fold``): ``payload`` to all-gather, the
    error-feedback buffer it leaves (``new_error``, adopted by ``SparseCompressor.commit`` if the round is applied;
    None for a folded round, already in the buffer) and its figures in ``stats`` (dilocox.compression.RoundStats).
    ``folded``: (reference, local) a folded round was computed from, for ``SparseCompressor.abandon``."""

    num_phases = 1

    def __init__(self, codec: "SparseCompressor", payload: bytes, new_error: Optional[torch.Tensor],
                 folded: Optional[tuple] = None):
        from dilocox.compression import RoundStats

        self.codec, self.payload, self.new_error, self.folded = codec, payload, new_error, folded
        buffer = new_error if new_error is not None else codec.codec.flat
        # ||M - C(M)|| / ||M|| with M = beta e + delta, without another full copy: M equals the new buffer except at
        # the sent positions, where it is the new buffer plus the sent value
        lay, cfg = codec.codec.layout, codec.codec.cfg
        idx, values = parse(self.payload, lay.n, cfg)
        left = buffer.numpy()[positions(idx, lay, cfg)].astype(np.float64)
        err2 = float(torch.linalg.vector_norm(buffer)) ** 2 if lay.n else 0.0
        m2 = err2 + float(np.sum((left + values) ** 2 - left ** 2))
        self.stats = RoundStats(rank=0, bits=codec.cfg.bits, payload_bytes=len(self.payload),
                                relative_error=math.sqrt(err2 / m2) if m2 > 0 else 0.0)

    def own(self) -> list[torch.Tensor]:
        """Our contribution as every member decodes it (what the group's mean holds of ours)."""
        return decode(self.payload, self.codec.shapes, self.codec.cfg)

    def lookahead(self) -> list[torch.Tensor]:
        """Our contribution as the group will decode it, known before the exchange (overlapped rounds' proxy)."""
        return self.own()

    def decide_rank(self, *args) -> int:
        """No rank to adapt (the Compressor's round protocol)."""
        return 0


class LocalState:
    """The shared-state surface of dilocox.compression.DenseCompressor for compressors whose buffers are all local (no
    state is shared between replicas but the config, which ``digest`` covers): nothing to serve a joiner, and a
    downloaded state, which must be empty, resets our buffers (``reset``)."""

    name = "sparse"
    rank = 0

    def digest(self) -> str:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def averager_sizes(self) -> list[int]:
        """A single one-value buffer: the averager only matches the group (the transport carries the payloads)."""
        return [1]

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
    the state surface of dilocox.compression.DenseCompressor (shared state, digest, checkpoint).

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
        return SparseRound(self, *self.codec.prepare(pseudo_gradient))

    def fold(self, reference: Sequence[torch.Tensor], local: Sequence[torch.Tensor]) -> SparseRound:
        """This round's contribution from the pseudo-gradient reference - local, folded into the error feedback
        in place (``SparseCodec.fold``: the payload ``begin`` would give, 8 bytes per value less). The round is
        then committed already; ``abandon`` undoes it, and needs ``reference`` and ``local`` unchanged until then
        (a synchronous round: neither theta nor the parameters move before its outer step). Raises ValueError as
        ``SparseCodec.fold`` does."""
        return SparseRound(self, self.codec.fold(reference, local), None, folded=(list(reference), list(local)))

    def commit(self, rnd: SparseRound) -> None:
        """The round was applied: adopt the buffer it leaves (a folded round's is in place already)."""
        if rnd.new_error is not None:
            self.codec.commit(rnd.new_error)
        rnd.folded = None

    def abandon(self, rnd: SparseRound) -> None:
        """The round was not applied: the buffer stays (a prepared round) or is put back (a folded one,
        ``SparseCodec.unfold``: up to fp32 rounding). A second call does nothing."""
        if rnd.folded is not None:
            self.codec.unfold(rnd.payload, *rnd.folded)
            rnd.folded = None

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
