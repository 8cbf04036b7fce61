"""Pseudo-gradient all-reduce and state download over hivemind's DecentralizedAverager.

* Matchmaking: every round uses the group key ``{run_id}_pseudo_gradient.0b<round index as 16 bits>``
  (``set_group_bits``), so only replicas finishing the same round average together.
* Transport: butterfly all-reduce of fp32 offset-encoded tensors (dilocox.exact_mean), so every
  member of a group gets the bit-identical mean; the caller checks that with digests.
* State: ``get_current_state`` (the documented override point) serves the node's global
  parameters, outer momentum and metadata to joiners; ``state_sharing_priority`` is the donor's
  outer_step so joiners download from the most advanced peer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pydantic.v1 as pydantic
import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import NoCompression

logger = logging.getLogger(__name__)
GROUP_BITS = 16


class RoundFailed(RuntimeError):
    """No group was found, or the all-reduce failed, before the round deadline."""


class RoundCancelled(RuntimeError):
    """The node asked to leave while this round was in flight; nothing was applied."""


class RoundGather(pydantic.BaseModel):
    """Metadata every member sends with its pseudo-gradient (all-gathered by hivemind)."""

    outer_step: pydantic.conint(ge=0)  # version of theta the sender holds (round index - 1)
    start_digest: pydantic.StrictStr  # digest of that theta
    weight: pydantic.confloat(gt=0)


@dataclass
class RoundResult:
    tensors: List[torch.Tensor]      # the averaged (still offset-encoded) tensors
    gathered: Dict[str, Optional[RoundGather]]  # peer_id -> metadata (None if malformed)
    payload_bytes: int               # bytes of our contribution on the wire
    bytes_sent: int                  # butterfly estimate: 2 (n-1)/n payload
    bytes_received: int


def group_bits(round_index: int) -> str:
    return format(round_index % (1 << GROUP_BITS), f"0{GROUP_BITS}b")


def canonical_digest(digests: Dict[str, str]) -> Tuple[Optional[str], List[str]]:
    """The digest most members hold (ties: the one held by the smallest peer_id) and who holds it.

    Every member of a group sees the same gathered data, so all reach the same verdict.
    """
    if not digests:
        return None, []
    counts = Counter(digests.values())
    top = max(counts.values())
    candidates = {d for d, c in counts.items() if c == top}
    winner = digests[min(p for p, d in digests.items() if d in candidates)]
    return winner, sorted(p for p, d in digests.items() if d == winner)


def judge_result(mine: str, results: Dict[str, str]) -> str:
    """What to do with our all-reduce result given every member's result digest (ours included).

    'apply' if ours is held by a strict majority, 'resync' if another digest is, 'skip' if no
    digest has a strict majority (e.g. two members with a partial average each): then no member
    applies, so a partial average is never adopted by a tie-break.
    """
    canon, holders = canonical_digest(results)
    if 2 * len(holders) <= len(results):
        return "skip"
    return "apply" if canon == mine else "resync"


class PseudoGradientAverager(DecentralizedAverager):
    """hivemind averager for one stage's pseudo-gradient. Blocking calls; run them off the event loop."""

    def __init__(self, templates: Sequence[torch.Tensor], dht: DHT, run_id: str,
                 state_provider: Callable[[], Tuple[dict, List[torch.Tensor]]], *,
                 matchmaking_time_s: float, request_timeout_s: float, averaging_timeout_s: float,
                 **averager_kwargs):
        self._state_provider = state_provider
        super().__init__(
            [torch.zeros_like(t, dtype=torch.float32, device="cpu") for t in templates],
            dht,
            start=True,
            prefix=f"{run_id}_pseudo_gradient",
            target_group_size=None,
            min_group_size=2,
            initial_group_bits=group_bits(0),
            min_matchmaking_time=matchmaking_time_s,
            request_timeout=request_timeout_s,
            allreduce_timeout=averaging_timeout_s,
            next_chunk_timeout=request_timeout_s * 2,
            compression=NoCompression(),
            allow_state_sharing=True,
            declare_state_period=max(2.0, matchmaking_time_s),
            **averager_kwargs,
        )
        self.payload_bytes = sum(t.numel() * 4 for t in templates)

    def get_current_state(self):
        """Serve (metadata, tensors) to a joiner; runs in this (host) process (hivemind contract)."""
        metadata, tensors = self._state_provider()
        return metadata, tensors, None

    def start_round(self, round_index: int, encoded: Sequence[torch.Tensor], gather: RoundGather,
                    deadline_s: float):
        """Begin averaging ``encoded`` with the replicas of the same round; returns hivemind's StepControl.

        The all-reduce runs in the averager process; ``finish_round`` waits for it.
        """
        self.set_group_bits(group_bits(round_index))
        with self.get_tensors() as tensors:
            for dst, src in zip(tensors, encoded):
                dst.copy_(src)
        try:
            return self.step(gather=gather.dict(), weight=gather.weight, timeout=deadline_s,
                             allow_retries=True, wait=False)
        except Exception as e:
            raise RoundFailed(f"could not start averaging: {e!r}") from e

    def finish_round(self, control, cancel: threading.Event, abandon: Optional[Callable[[], bool]] = None,
                     check_every_s: float = 1.0) -> RoundResult:
        """Wait for ``control``; raises RoundFailed (no group, failure, abandoned) or RoundCancelled.

        ``abandon()`` is polled every ``check_every_s`` while no all-reduce has begun; when it returns
        True (e.g. no other replica is still in this round) the step is cancelled early.
        """
        started = time.monotonic()
        next_check = started + self.matchmaking_kwargs["min_matchmaking_time"]
        while not control.done():
            if cancel.is_set():
                control.cancel()
                raise RoundCancelled("left during averaging")
            if abandon is not None and time.monotonic() >= next_check and not control.began_allreduce:
                next_check = time.monotonic() + check_every_s
                if abandon():
                    control.cancel()
                    raise RoundFailed(f"abandoned after {time.monotonic() - started:.1f}s: no replica left in this round")
            time.sleep(0.02)
        try:
            gathered_raw = control.result()
        except BaseException as e:  # hivemind reports failures as exceptions on the StepControl
            raise RoundFailed(f"averaging failed: {e!r}") from e
        if not gathered_raw:
            raise RoundFailed("averaging returned no group")
        gathered = {}
        for peer, data in gathered_raw.items():
            try:
                gathered[peer.to_base58()] = RoundGather.parse_obj(data)
            except (pydantic.ValidationError, TypeError):
                gathered[peer.to_base58()] = None  # a peer sent malformed metadata: it cannot vote
        with self.get_tensors() as tensors:
            out = [t.clone() for t in tensors]
        n = len(gathered)
        moved = int(2 * (n - 1) / n * self.payload_bytes)
        return RoundResult(out, gathered, self.payload_bytes, moved, moved)

    def download_state(self, timeout_s: float) -> Optional[Tuple[Any, List[torch.Tensor]]]:
        """(metadata, tensors) from the highest-priority donor, or None if nobody served a state."""
        return self.load_state_from_peers(wait=True, timeout=timeout_s)
