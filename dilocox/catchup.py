"""Catch-up: replaying the outer steps a joiner missed while it downloaded a state.

On a slow link a joiner's state download (theta and momentum: 8 bytes per parameter) can take longer
than a round, so by the time it lands the swarm has applied more outer steps. Instead of downloading
again (and losing the same race again), the joiner fetches the *applied updates* of the steps it
missed and replays them (ours; the idea is state-machine replication's log replay). Each
``AppliedUpdate`` is what every replica of the swarm fed its outer optimizer at that step: the
round's aggregated pseudo-gradient (or nothing for a skipped round) and the digests of theta before
and after. Replaying it with the same outer optimizer gives theta bit for bit (same fp32 operations
in the same order, dilocox/diloco.py ``OuterOptimizer.step``), and the digest after each step
checks that.

Sparse aggregates (dilocox/sparse/) are mostly zeros, so an update is stored as (flat int32
indices, fp32 values) per tensor where that is smaller than the dense tensor: a group of 4 at 64 of
4096 values per chunk keeps at most 6% of the values, so an update costs about 12% of theta's bytes,
a sixteenth of a state download. Dense aggregates are stored dense.

No network here: ``encode``/``decode`` turn an update into bytes and back (``write``: into a file) (peers/allgather.py's
ContributionServer moves them), ``replay`` applies updates to a downloaded state.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import BinaryIO, Callable, Optional, Sequence

import numpy as np
import torch

from dilocox.diloco import OuterOptimizer, params_digest
from dilocox.scaffold import ControlVariates
from dilocox.sparse.aggregate import SparseAggregate

FORMAT = 1
HEADER_BYTES = 64 * 1024  # bound on everything of an encoded update that is not tensor data


class CatchUpError(ValueError):
    """An update that is malformed, does not fit our parameters, or does not continue our state."""


@dataclass(frozen=True)
class AppliedUpdate:
    """What the replicas applied at outer step ``outer_step``: theta_{outer_step} from
    theta_{outer_step - 1} (digest ``parent_digest``) and ``aggregate`` (the averaged
    pseudo-gradient, our parameters' shapes, CPU fp32; None: the round was skipped and theta kept).
    ``group_size``: replicas in the aggregate; ``digest``: of theta after the step. ``outsized``: the round had
    an outsized contribution (SCAFFOLD's quiet restart counts from it, dilocox/scaffold.py). Only theta is
    digested: a peer that lies about ``outsized`` moves the replayer's c off the swarm's, whose start digest
    then sends it to download the state again."""

    outer_step: int
    parent_digest: str
    digest: str
    group_size: int
    aggregate: Optional[Sequence[torch.Tensor]]  # dense tensors, or a SparseAggregate reading as them
    outsized: bool = False


def max_encoded_bytes(shapes: Sequence[Sequence[int]]) -> int:
    """The largest valid encoding for parameters of these shapes (bytes): every tensor dense."""
    return HEADER_BYTES + sum(4 * math.prod(s) for s in shapes)


def encode(update: AppliedUpdate) -> bytes:
    """Bytes of ``update``: each aggregate tensor dense, or as (int32 flat indices, fp32 values) of its
    non-zeros where that is smaller. Serialized with torch.save (read back with weights_only=True)."""
    buf = io.BytesIO()
    write(update, buf)
    return buf.getvalue()


def write(update: AppliedUpdate, f: BinaryIO) -> None:
    """``encode(update)``'s bytes written to the binary file ``f`` (no copy of them held in memory). A
    SparseAggregate is written from its positions and values (a +0.0 among them is kept: it decodes the same)."""
    parts = None
    if isinstance(update.aggregate, SparseAggregate):  # its positions are known: no dense tensor, no scan
        parts = []
        for i, shape in enumerate(update.aggregate.shapes):
            idx, values = update.aggregate.part(i)
            if 2 * len(idx) < math.prod(shape):
                parts.append(dict(indices=torch.from_numpy(idx.astype(np.int32)), values=torch.from_numpy(values)))
            else:
                parts.append(dict(dense=update.aggregate[i].reshape(-1)))
    elif update.aggregate is not None:
        parts = []
        for t in update.aggregate:
            flat = t.detach().to("cpu", torch.float32).reshape(-1)
            nz = torch.nonzero(flat.view(torch.int32), as_tuple=True)[0]  # by bits: -0.0 is kept, exactly
            if 2 * nz.numel() < flat.numel():
                parts.append(dict(indices=nz.to(torch.int32), values=flat[nz]))  # indexing copies
            else:
                parts.append(dict(dense=flat.clone()))
    torch.save(dict(format=FORMAT, outer_step=update.outer_step, parent_digest=update.parent_digest,
                    digest=update.digest, group_size=update.group_size, outsized=bool(update.outsized),
                    parts=parts), f)


def decode(payload: bytes, shapes: Sequence[Sequence[int]]) -> AppliedUpdate:
    """The update in ``payload``, checked against our parameters' ``shapes``; raises CatchUpError naming
    the problem (it comes from a peer: size, format, field types, tensor kinds, index ranges, NaN/Inf)."""
    if len(payload) > max_encoded_bytes(shapes):
        raise CatchUpError(f"oversized update: {len(payload)} bytes, at most {max_encoded_bytes(shapes)} fit")
    try:
        raw = torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as e:  # anything a damaged stream makes the unpickler raise
        raise CatchUpError(f"unreadable update ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise CatchUpError("not an update of this format")
    step, parent, digest, size = (raw.get(k) for k in ("outer_step", "parent_digest", "digest", "group_size"))
    if not (isinstance(step, int) and step >= 1 and isinstance(size, int) and size >= 1):
        raise CatchUpError(f"bad outer_step {step!r} or group_size {size!r}")
    if not (isinstance(parent, str) and isinstance(digest, str) and len(parent) == len(digest) == 16):
        raise CatchUpError("bad digests")
    outsized = raw.get("outsized", False)  # absent from updates served before the quiet restart
    if not isinstance(outsized, bool):
        raise CatchUpError(f"bad outsized flag {outsized!r}")
    parts = raw.get("parts")
    if parts is None:
        return AppliedUpdate(step, parent, digest, size, None, outsized)
    if not isinstance(parts, list) or len(parts) != len(shapes):
        raise CatchUpError(f"aggregate of {len(parts) if isinstance(parts, list) else '?'} tensors, "
                           f"ours has {len(shapes)}")
    return AppliedUpdate(step, parent, digest, size, [_part(p, tuple(s), i) for i, (p, s) in
                                                      enumerate(zip(parts, shapes))], outsized)


def _part(part, shape: tuple, i: int) -> torch.Tensor:
    n = math.prod(shape)

    def tensor(key: str, dtype: torch.dtype) -> torch.Tensor:
        t = part.get(key) if isinstance(part, dict) else None
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1 or t.numel() > n:
            raise CatchUpError(f"tensor {i}: {key!r} must be a 1-D {dtype} tensor of at most {n} values")
        return t

    if isinstance(part, dict) and "dense" in part:
        flat = tensor("dense", torch.float32)
        if flat.numel() != n:
            raise CatchUpError(f"tensor {i}: {flat.numel()} dense values, shape {shape} needs {n}")
    else:
        idx, values = tensor("indices", torch.int32).long(), tensor("values", torch.float32)
        if idx.numel() != values.numel():
            raise CatchUpError(f"tensor {i}: {idx.numel()} indices for {values.numel()} values")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise CatchUpError(f"tensor {i}: an index outside [0, {n})")
        flat = torch.zeros(n, dtype=torch.float32)
        flat[idx] = values
    if not torch.isfinite(flat).all():
        raise CatchUpError(f"tensor {i} holds NaN/Inf")
    return flat.reshape(shape)


@dataclass
class Replayed:
    """A state after ``replay``: theta and momentum (CPU fp32), SCAFFOLD's c (or None), the outer step
    and digest theta now has, and SCAFFOLD's pending quiet restart (``ControlVariates.last_outsized``)."""

    theta: list[torch.Tensor]
    momentum: list[torch.Tensor]
    control: Optional[list[torch.Tensor]]
    outer_step: int
    digest: str
    last_outsized: Optional[int] = None


@torch.no_grad()
def replay(outer: OuterOptimizer, outer_step: int, updates: Sequence[AppliedUpdate],
           control: Optional[ControlVariates] = None,
           lr_sum: Optional[Callable[[int], float]] = None) -> Replayed:
    """Apply ``updates`` in order to ``outer`` (a scratch OuterOptimizer holding the downloaded theta
    and momentum at ``outer_step``; it is changed). ``control``: a scratch ControlVariates holding the
    downloaded c, which is derived from each aggregate as the replicas do (``ReplicaState.apply_outer``,
    with ``lr_sum(step)``, and restarted where its ``reset_every`` and quiet restart say, the latter from each
    update's ``outsized`` flag). Raises CatchUpError if an update
    does not continue the state (wrong step or parent digest) or theta after it does not have the update's
    digest (a peer served a wrong one)."""
    digest = params_digest(outer.global_params)
    for u in updates:
        if u.outer_step != outer_step + 1 or u.parent_digest != digest:
            raise CatchUpError(f"update of outer step {u.outer_step} (from {u.parent_digest}) does not continue "
                               f"outer step {outer_step} (digest {digest})")
        if u.aggregate is not None:
            outer.step(u.aggregate, u.outer_step)
            if control is not None:
                control.derive_c_from_aggregate(u.aggregate, lr_sum(u.outer_step), 1, 1)
        if control is not None:
            control.outer_step_done(u.outer_step, u.outsized)
        outer_step, digest = u.outer_step, params_digest(outer.global_params)
        if digest != u.digest:
            raise CatchUpError(f"outer step {outer_step} replayed to digest {digest}, the update says {u.digest}")
    return Replayed([p.clone() for p in outer.global_params], outer.momentum_buffers(),
                    control.state_dict()["c"] if control is not None else None, outer_step, digest,
                    control.last_outsized if control is not None else None)

