"""Exclusions: which peers may contribute to the current round, and which count for nothing at all.

A contribution counts only if its peer is admitted (the swarm's certificates, peers/admission.py), has not been caught
equivocating (a contributor that another member used with other bytes than we did served different bytes to
different peers: its contributions are dropped for EXCLUDE_ROUNDS rounds) and is not excluded by its group's vote.

The vote (dilocox/exclusion.py): a lie found or checked here by an audit (daemon/audits.py) is not acted on alone. It
goes into our gathered metadata as a vote (``votes``), and a round's group drops a member once most of the group
votes against it: every member decides from the same gathered bytes, so all exclude it from the same round. From
then on the peer is in our ledger (``group_decided``): we keep voting against it, and its membership records count
for nothing here (``excluded``: daemon/progress.py leaves them out of matchmaking decisions, the majority that picks a
round's update, donors and join points), and matchmaking neither takes them in as followers nor asks them to lead
(``on_ledger``: peers/refusals.py, peers/dht.py). The transport's screen asks ``admitted`` for every gathered member
(peers/transport.py ``Screen``).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Mapping, Optional

logger = logging.getLogger(__name__)
EXCLUDE_ROUNDS = 10  # rounds an equivocating contributor's contributions are dropped


class Exclusions:
    """Who may contribute, and who counts. ``current_round()``: the round being computed or exchanged;
    ``verified()``: peer_id -> the round in which our audits found (or checked) that it lied (daemon/audits.py
    ``Audits.verified``); ``admission(peer_id)``: why the swarm's admission refuses it, or None (the contribution
    server's rule). Thread-safe: the verifier thread records group decisions while the training thread votes."""

    def __init__(self, current_round: Callable[[], int],
                 verified: Optional[Callable[[], Mapping[str, int]]] = None,
                 admission: Optional[Callable[[str], Optional[str]]] = None,
                 on_ledger: Optional[Callable[[list[str]], None]] = None):
        self.current_round, self.verified, self.admission = current_round, verified, admission
        self.on_ledger = on_ledger  # called with every ledger peer (sorted) when one joins it: matchmaking refuses them
        self.until: dict[str, int] = {}  # peer_id -> last round its contributions are dropped (equivocation)
        self._ledger: dict[str, tuple[int, str]] = {}  # peer_id -> (round its group first excluded it in, why)
        self._lock = threading.Lock()

    def equivocated(self, r: int, conflicts: Mapping[str, str]) -> None:
        """Round r found ``conflicts`` (peer_id -> the member that was served other bytes by it): each such peer's
        contributions are dropped until round r + EXCLUDE_ROUNDS."""
        for peer, witness in conflicts.items():
            if self.until.get(peer, 0) < r + EXCLUDE_ROUNDS:
                logger.warning("round %d: %s served different bytes to %s than to us: its contributions are "
                               "dropped until round %d", r, peer, witness, r + EXCLUDE_ROUNDS)
                self.until[peer] = r + EXCLUDE_ROUNDS

    def group_decided(self, r: int, excluded: Mapping[str, str]) -> None:
        """Round r's group excluded ``excluded`` (peer_id -> why; ``RoundResult.excluded``): they go into the ledger."""
        with self._lock:
            new = [peer for peer in excluded if peer not in self._ledger]
            for peer in new:
                self._ledger[peer] = (r, excluded[peer])
                logger.warning("round %d: the group excluded %s (%s); it counts for nothing from now on", r, peer,
                               excluded[peer])
            ledger = sorted(self._ledger)
        if new and self.on_ledger is not None:
            self.on_ledger(ledger)

    def votes(self) -> dict[str, int]:
        """Our exclusion votes for the round's gathered metadata (``RoundGather.exclusion_votes``): peer_id -> the
        round it lied in, for lies our audits found or checked and for every peer in the ledger (a group's decision
        is voted on after it, so a swarm whose members joined later keeps it)."""
        with self._lock:
            out = {peer: max(1, r - 1) for peer, (r, _) in self._ledger.items()}
        for peer, r in (self.verified() if self.verified is not None else {}).items():
            out[peer] = min(r, out.get(peer, r))
        return out

    def excluded(self, peer_id: str) -> Optional[str]:
        """Why a group excluded ``peer_id`` (it counts for nothing here), or None."""
        entry = self._ledger.get(peer_id)
        return None if entry is None else f"excluded by its group in round {entry[0]}: {entry[1]}"

    def ledger(self) -> dict[str, int]:
        """For metrics.jsonl: peer_id -> the round its group excluded it in."""
        with self._lock:
            return {peer: r for peer, (r, _) in sorted(self._ledger.items())}

    def admitted(self, peer_id: str) -> Optional[str]:
        """None if ``peer_id`` may contribute to the current round as far as this node alone can tell (equivocation,
        admission), else why not. Audited lies are not here: the group's vote decides them (module docstring)."""
        until = self.until.get(peer_id, 0)
        if until >= self.current_round():
            return f"served different bytes to different members; excluded until round {until}"
        return self.admission(peer_id) if self.admission is not None else None
