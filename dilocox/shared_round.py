"""The daemon's shared-index compression (``--compression shared``): one round's state and the buffers kept
across rounds, with the state surface of dilocox.sparse.SparseCompressor (begin, commit, digest, checkpoint).

A shared round's contribution is not known when the round begins: the members first agree on the index set
P (the union of their proposals), then each sends its values on P range by range and reduces one range
(peers/reducescatter.py; docs/algorithms.md, "A reduce-scatter transport for shared index sets"). So
``begin`` only accumulates m = beta e + delta; the transport fills in the round (``settle``) and works on
copies of the two buffers, which ``commit`` adopts when the round is applied, as SparseCompressor adopts its
new error buffer:

- the member's error feedback e (SharedIndexMember: m minus the values it sent, n fp32 values);
- its reducer's error feedback g (ReducerFeedback, DoubleSqueeze, arXiv 1905.05957: what quantizing its
  range's result dropped, n fp32 values of which only its range's positions are ever non-zero).

Both are local: a round's start digest covers only the config, joiners download neither, and a checkpoint
holds both.
"""

from __future__ import annotations

import hashlib
import math
from typing import Mapping, Optional, Sequence

import numpy as np
import torch

from dilocox.compression import RoundStats
from dilocox.shared_index import ReducerFeedback, SharedIndexConfig, SharedIndexMember
from dilocox.sparse.compressor import LocalState


class SharedRound:
    """One round of shared-index compression (``SharedCompressor.begin``). ``m``: beta e + delta (flat CPU fp32,
    n values); ``member`` / ``feedback``: the round's working copies of the two buffers (the transport changes
    them); ``stats``: the round's figures (rank 0; payload and relative error once ``settle`` ran)."""

    num_phases = 1

    def __init__(self, codec: "SharedCompressor", pseudo_gradient: Sequence[torch.Tensor]):
        self.codec, self.cfg, self.shapes = codec, codec.cfg, codec.shapes
        self.m = codec.member.accumulate(pseudo_gradient)  # raises ValueError for a wrong size or non-finite values
        self.member = SharedIndexMember(self.m.numel(), self.cfg)
        self.member.error = codec.member.error  # contribute() replaces it, never writes into it
        self.feedback = ReducerFeedback(0)
        self.feedback.error = codec.feedback.error.copy()  # quantize() writes into it
        self.stats = RoundStats(rank=0, bits=self.cfg.bits, payload_bytes=0, relative_error=1.0)

    def settle(self, payload_bytes: int) -> None:
        """The transport sent our values (``member.error`` is m minus them) in ``payload_bytes`` bytes: record the
        round's figures, ||m - C(m)|| / ||m|| as dilocox.compression.RoundStats defines it."""
        m2 = float(torch.linalg.vector_norm(self.m)) ** 2
        e2 = float(torch.linalg.vector_norm(self.member.error)) ** 2
        self.stats = RoundStats(rank=0, bits=self.cfg.bits, payload_bytes=int(payload_bytes),
                                relative_error=math.sqrt(e2 / m2) if m2 > 0 else 0.0)

    def own(self) -> list[torch.Tensor]:
        """Not known before the round's index set is (module docstring): overlapped rounds' proxy is not offered."""
        raise NotImplementedError("a shared round's own contribution is only known after its exchange")

    def lookahead(self) -> None:
        """Our contribution is known only once the round's index set is: overlapped rounds' proxy uses the
        pseudo-gradient itself."""
        return None

    def decide_rank(self, *args) -> int:
        """No rank to adapt (the Compressor's round protocol)."""
        return 0


class SharedCompressor(LocalState):
    """Shared-index compression's state (module docstring): n = the model's values, ``cfg`` the index set's
    chunk, top-k, bits, result bits and decay."""

    name = "shared"

    def __init__(self, shapes: Sequence[Sequence[int]], cfg: SharedIndexConfig = SharedIndexConfig()):
        self.cfg, self.shapes = cfg, [tuple(s) for s in shapes]
        n = sum(math.prod(s) for s in self.shapes)
        self.member = SharedIndexMember(n, cfg)
        self.feedback = ReducerFeedback(n)

    @property
    def error(self) -> list[torch.Tensor]:
        """Both buffers (member, reducer) as tensors: what memory figures and checkpoints count."""
        return [self.member.error, torch.from_numpy(self.feedback.error)]

    def payload_bytes(self) -> int:
        """An upper bound on one member's values on P (topk per chunk at ``bits``, a 4-byte scale per chunk)."""
        n = self.member.error.numel()
        chunks = -(-n // self.cfg.chunk)
        return chunks * (4 + -(-self.cfg.topk * self.cfg.bits // 8))

    def begin(self, pseudo_gradient: Sequence[torch.Tensor], bounds=None, round_index: int = 1) -> SharedRound:
        """This round's m = beta e + delta; nothing changes until ``commit``."""
        return SharedRound(self, pseudo_gradient)

    def commit(self, rnd: SharedRound) -> None:
        """The round was applied: adopt the buffers its exchange left."""
        self.member.error, self.feedback.error = rnd.member.error, rnd.feedback.error

    def digest(self) -> str:
        c = self.cfg
        return hashlib.sha256(f"shared/{c.chunk}/{c.topk}/{c.bits}/{c.result_bits}/{c.beta}/{c.selection.value}"
                              .encode()).hexdigest()[:8]

    def reset(self) -> None:
        """Our buffers belonged to another trajectory (LocalState.load_shared)."""
        self.member.error = torch.zeros_like(self.member.error)
        self.feedback.error = np.zeros_like(self.feedback.error)

    def state_dict(self) -> dict:
        return dict(rank=0, shared=[], error=[self.member.error.clone()],
                    reducer_error=torch.from_numpy(self.feedback.error.copy()))

    def load_state_dict(self, state: Mapping) -> None:
        """Restore both buffers; raises ValueError naming the problem for a buffer of another size or with
        non-finite values (a checkpoint of another model or config, or a corrupt one)."""
        n = self.member.error.numel()
        error = state.get("error")
        reducer: Optional[torch.Tensor] = state.get("reducer_error")
        if not isinstance(error, (list, tuple)) or len(error) != 1 or not isinstance(reducer, torch.Tensor):
            raise ValueError("a shared-compression state needs 'error' (one tensor) and 'reducer_error'")
        for name, t in (("error-feedback", error[0]), ("reducer error-feedback", reducer)):
            if not isinstance(t, torch.Tensor) or t.numel() != n:
                raise ValueError(f"{name} state holds {getattr(t, 'numel', lambda: '?')()} values; the model has {n}")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} state holds non-finite values")
        self.member.error = error[0].detach().reshape(-1).to(torch.float32).clone()
        self.feedback.error = reducer.detach().reshape(-1).to(torch.float32).numpy().copy()
