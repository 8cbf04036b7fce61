"""The Compressor protocol: what a round's rules need of a pseudo-gradient code, one implementation per code.

- ``DenseCompressor`` (dilocox/compression.py): fp32, int8 and PowerSGD low rank with an adaptive rank, summed
  part by part in a butterfly all-reduce (peers/averaging.py);
- ``SparseCompressor`` (dilocox/sparse/compressor.py): top-k with error feedback (SparseLoCo), all-gathered
  (peers/allgather.py);
- ``SharedCompressor`` (dilocox/shared_round.py): shared index sets, reduce-scattered (peers/reducescatter.py).

A round is ``begin`` (encode the pseudo-gradient with our error feedback into a ``CompressedRound``), the
transport's exchange, then ``commit`` if the round's result was applied (adopt its error feedback and advance
the shared state; a round that was not applied leaves the compressor as it was). ``digest`` covers the state the
replicas share (part of a round's start digest, docs/protocol.md); ``shared_tensors`` / ``load_shared`` carry it
to a joiner; ``state_dict`` / ``load_state_dict`` are the checkpoint (shared state and local error feedback).
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class CompressedRound(Protocol):
    """One round's contribution as ``Compressor.begin`` made it. ``num_phases``: all-reduces it takes (PowerSGD: 2);
    ``stats``: its figures (dilocox.compression.RoundStats: rank, bits, payload bytes, relative error)."""

    num_phases: int

    def lookahead(self) -> Optional[list[torch.Tensor]]:
        """Our contribution as the group will decode it, where known before the exchange (overlapped rounds start
        the next round from theta advanced by it); None where only the exchange tells."""
        ...

    def decide_rank(self, bandwidth_bps: float, round_s: float, group_size: int) -> int:
        """The next round's rank from the group's shared figures (0 for codes without a rank)."""
        ...


@runtime_checkable
class Compressor(Protocol):
    """A pseudo-gradient code and its state (module docstring). ``rank``: the current rank (0 without one);
    ``error``: the error-feedback buffers, one per tensor (CPU fp32)."""

    rank: int

    def begin(self, pseudo_gradient: Sequence[torch.Tensor], bounds: Sequence[float],
              round_index: int = 1) -> CompressedRound:
        """Encode a round's pseudo-gradient (tensors of the stage's shapes). ``bounds[i]``: a shared bound on
        |pseudo_gradient[i]| (dense codes' exact path); ``round_index`` seeds new rank columns. Raises ValueError
        for tensors of other shapes or non-finite values."""
        ...

    def commit(self, rnd: CompressedRound) -> None:
        """The round's result was applied: keep its error feedback and advance the shared state."""
        ...

    def digest(self) -> str:
        """A short hex digest of the state the replicas share (and the code's config)."""
        ...

    def averager_sizes(self) -> list[int]:
        """The all-reduce buffer sizes the code's rounds need, largest first (one hivemind averager each)."""
        ...

    def shared_tensors(self) -> list[torch.Tensor]:
        """The shared state a joiner downloads (empty for codes whose buffers are all local)."""
        ...

    def shared_digest(self, rank: int, tensors: Sequence[torch.Tensor]) -> str:
        """The digest ``digest`` would give after ``load_shared(rank, tensors)``; raises ValueError for a state that
        does not fit the code."""
        ...

    def load_shared(self, rank: int, tensors: Sequence[torch.Tensor]) -> None:
        """Adopt a downloaded shared state (our local buffers belonged to another trajectory)."""
        ...

    def state_dict(self) -> dict:
        ...

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint's state; raises ValueError for buffers that do not match the model."""
        ...
