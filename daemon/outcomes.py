"""What a round is and what became of it: the data OuterRounds (daemon/rounds.py) and RoundChecks
(daemon/checks.py) pass between them, and the outcomes the node acts on (daemon/node.py)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Optional

from dilocox.daemon.status import RoundInfo
from dilocox.peers.averaging import RoundResult

from dilocox.catchup import AppliedUpdate
from dilocox.compressor import CompressedRound


class RoundOutcome(str, Enum):
    """What became of a round (the value is the ``outcome`` in status and metrics.jsonl)."""

    APPLIED = "applied"              # the group's verified mean was applied
    ADOPTED = "adopted"              # a split round: the majority group's update was applied in place of ours
    UNITED = "united"                # a split round without a majority: the union of every group's results
    SOLO = "solo"                    # nobody else could take part: our own pseudo-gradient was applied
    APPLIED_ALONE = "applied_alone"  # the all-reduce failed and nobody else applied the round: ours was
    SKIPPED = "skipped"              # no result had a majority: the whole group consumed it without update
    RESYNC = "resync"                # nothing applied; the caller must re-sync (``reason``)
    RESYNCED = "resynced"            # recorded by the caller when its re-sync fetched this round's result
    CANCELLED = "cancelled"          # asked to leave while in flight: nothing applied
    DEFERRED = "deferred"            # finish_early only: left to the round's end


@dataclass
class Finished:
    """``finish``'s answer. ``info``: the round's figures (for status and metrics); for RESYNC it is
    set when the re-sync may fetch this very round's result (record it then as RESYNCED)."""

    index: int
    outcome: RoundOutcome
    info: Optional[RoundInfo] = None
    losses: list[float] = field(default_factory=list)
    reason: str = ""
    # the exchange's result where one came in from a group that started from our parameters (daemon/audits.py
    # keeps its contributions to audit, whatever became of the round)
    result: Optional[RoundResult] = None
    # ADOPTED after the round went on without us: the caller rejoins the next round at the members' inner step
    behind: bool = False


@dataclass
class Checked:
    """What checking a round's finished exchange found (``OuterRounds._check``): APPLIED, ADOPTED, UNITED, SKIPPED,
    APPLIED_ALONE, RESYNC (``reason``; ``fetches_result``: the re-sync may bring this round's result) or CANCELLED."""

    outcome: RoundOutcome
    result: Optional[RoundResult] = None
    group_size: int = 1
    reason: str = ""
    fetches_result: bool = False
    adopted: Optional[AppliedUpdate] = None  # ADOPTED, UNITED: what is applied in place of ours (daemon/majority.py)
    behind: bool = False  # ADOPTED: the round went on without us (MajorityUpdate.follow)
    # ADOPTED behind a swarm that went further: the updates of the outer steps after ``adopted``'s, in order
    chain: tuple[AppliedUpdate, ...] = ()


@dataclass
class PendingRound:
    """Round ``index`` being averaged: ``future`` runs peers.averaging.exchange on the communication
    thread (None: a solo round)."""

    index: int
    pseudo_gradient: Optional[list]  # None: not kept while the exchange runs (``ours`` recomputes it)
    compression: Optional[CompressedRound]
    future: Optional[Future]
    compute_s: float
    losses: list[float]
    started: float
    cancel: threading.Event = field(default_factory=threading.Event)
    early: Optional[RoundInfo] = None  # theta already updated mid-round (delayed); the local part is due
    sent_at: float = 0.0  # time.monotonic() when the round's inner steps ended and its contribution was ready
    encode_s: float = 0.0
    early_tried: bool = False
    merged_at: Optional[int] = None  # adaptive: the next round's inner step at which theta joined the local params
    waited_s: float = 0.0  # adaptive: time waited for the exchange before the next round began (wait_briefly)
    checked: Optional[Future] = None  # adaptive: ``_check`` running on the verifier thread (a Checked)
    recompute: Optional[Callable[[], list]] = None  # gives the pseudo-gradient again where it was not kept

    def ours(self) -> list:
        """Our pseudo-gradient of the round (what a solo or lone round applies): the one kept, or recomputed."""
        return self.pseudo_gradient if self.pseudo_gradient is not None else self.recompute()


@dataclass
class EarlyRound:
    """A synchronous sparse or shared round whose matchmaking began before its inner steps ended: ``ready`` gets
    the compressor's round at the round's end, and ``future`` runs the transport's exchange on the comm thread."""

    index: int
    weight: int
    ready: Future
    future: Future
    cancel: threading.Event
    started: float
