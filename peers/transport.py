"""The transport a round's exchange runs on: one interface, one implementation per code.

A node builds one ``Transport`` in its wiring (daemon/node.py), for the compression it runs:

- ``ButterflyTransport`` (peers/averaging.py): dense codes (fp32, int8, PowerSGD), phase by phase through
  hivemind's butterfly all-reduce;
- ``AllGatherTransport`` (peers/allgather.py): sparse contributions; hivemind matches the group and
  all-gathers its metadata, every member fetches every payload and aggregates the same bytes alike;
- ``ReduceScatterTransport`` (peers/reducescatter.py): shared index sets, reduced range by range.

A transport holds what stays fixed for the node's life (the averager, the contribution server, our peer_id,
the screen and its aggregation rule, the red-team hooks) and takes one ``RoundInput`` a round. ``exchange``
blocks (the daemon runs it on its communication thread) and returns a ``RoundResult`` (peers/averaging.py), or
raises ``RoundCancelled`` (``cancel`` was set, or ``abandon`` held) or ``RoundFailed`` (no group, or no usable
contribution but ours). As in torchft's DiLoCo sync, the process group (here the transport) is injected: the
round's rules (daemon/rounds.py) never know which one runs, and unit tests give them a fake.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Collection, Optional, Protocol

from dilocox.peers.deadlines import RoundTimes

if TYPE_CHECKING:
    from dilocox.peers.averaging import RoundGather, RoundResult

    from dilocox.sign_agreement import SignPolicy


@dataclass(frozen=True)
class RoundInput:
    """One round's exchange.

    ``index``: the round (outer step ``index - 1`` is where it started); ``contribution``: the compressor's round
    (``begin``'s answer: a CompressionRound, SparseRound or SharedRound), or a Future that will hold it (early
    matchmaking: the group forms while the round's last inner steps compute, ``ready_in_s`` seconds before
    they end); ``gather``: our metadata for the group; ``times``: the matchmaking time and group wait the round
    uses (peers/deadlines.py); ``cancel``: set to end the round (we leave or re-sync); ``abandon()``: the
    give-up rule, polled while the group forms and the downloads run (the round went on without us);
    ``gone(peers)``: those of ``peers`` that left the swarm (a reduce-scatter's reducers stop waiting for them)."""

    index: int
    contribution: Any
    gather: RoundGather
    times: RoundTimes
    cancel: threading.Event
    abandon: Optional[Callable[[], bool]] = None
    ready_in_s: Optional[float] = None
    gone: Optional[Callable[[Collection[str]], Collection[str]]] = None


class Transport(Protocol):
    """What a round's rules need of a transport (module docstring)."""

    def exchange(self, rnd: RoundInput) -> RoundResult:
        """Average round ``rnd.index``'s contribution with a group; blocking. Raises RoundCancelled, RoundFailed."""
        ...


@dataclass(frozen=True)
class Screen:
    """Which gathered contributions count, and how they combine (peers/allgather.py ``screen_gathered``).

    ``max_weight``: the largest weight a member may claim (H inner steps); ``rule`` / ``norm_bound``: the
    aggregation rule and the norm bound applied before it (dilocox/robust.py); ``admitted(peer_id)``: None if
    that member may contribute, else why not (None: the contribution server's admission alone); ``sign``: the
    robust learning rate on the rule's aggregate (dilocox/sign_agreement.py; None: off); ``drop_outsized``: F > 1
    leaves out a contribution the norm bound scales by less than 1/F (0: off; dilocox/sparse/aggregate.py);
    ``committed``: the swarm audits its rounds, so a contribution without a start-state commitment is left out."""

    max_weight: float
    rule: str = "mean"
    norm_bound: float = 0.0
    admitted: Optional[Callable[[str], Optional[str]]] = None
    sign: Optional[SignPolicy] = None
    drop_outsized: float = 0.0
    committed: bool = False


@dataclass(frozen=True)
class Hooks:
    """The red-team hooks of an attacking node (daemon/redteam.py); None on an honest one. ``gather(meta, round)``
    rewrites our gathered metadata; ``contribution(payload, round)`` the payload we announce and serve."""

    gather: Optional[Callable[[dict, int], dict]] = None
    contribution: Optional[Callable[[bytes, int], bytes]] = None


def matchmaking_schedule(times: RoundTimes, ready_in_s: Optional[float], request_timeout_s: float
                         ) -> tuple[float, float]:
    """(scheduled_in_s, group_wait_s) of a matched round: the all-reduce begins after the matchmaking time in use,
    or when an early round's contribution is ready if later; the group wait covers that and one request
    (hivemind's averager refuses a schedule beyond its timeout). Seconds."""
    scheduled_in_s = max(times.matchmaking_s, ready_in_s or 0.0)
    return scheduled_in_s, max(times.group_wait_s, scheduled_in_s + request_timeout_s)
