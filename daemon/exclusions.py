"""Exclusions: which peers may contribute to the current round.

A contribution counts only if its peer is admitted (the swarm's certificates, peers/admission.py), not excluded by
an audit (daemon/audits.py) and has not been caught equivocating: a contributor that another member used with other
bytes than we did served different bytes to different peers, and its contributions are dropped for EXCLUDE_ROUNDS
rounds. The transport's screen asks ``admitted`` for every gathered member (peers/transport.py ``Screen``).
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping, Optional

logger = logging.getLogger(__name__)
EXCLUDE_ROUNDS = 10  # rounds an equivocating contributor's contributions are dropped


class Exclusions:
    """Who may contribute. ``current_round()``: the round being computed or exchanged; ``audited(peer_id)``: why an
    audit excluded that peer, or None (daemon/audits.py ``Audits.excluded``); ``admission(peer_id)``: why the swarm's
    admission refuses it, or None (the contribution server's rule)."""

    def __init__(self, current_round: Callable[[], int],
                 audited: Optional[Callable[[str], Optional[str]]] = None,
                 admission: Optional[Callable[[str], Optional[str]]] = None):
        self.current_round, self.audited, self.admission = current_round, audited, admission
        self.until: dict[str, int] = {}  # peer_id -> last round its contributions are dropped (equivocation)

    def equivocated(self, r: int, conflicts: Mapping[str, str]) -> None:
        """Round r found ``conflicts`` (peer_id -> the member that was served other bytes by it): each such peer's
        contributions are dropped until round r + EXCLUDE_ROUNDS."""
        for peer, witness in conflicts.items():
            if self.until.get(peer, 0) < r + EXCLUDE_ROUNDS:
                logger.warning("round %d: %s served different bytes to %s than to us: its contributions are "
                               "dropped until round %d", r, peer, witness, r + EXCLUDE_ROUNDS)
                self.until[peer] = r + EXCLUDE_ROUNDS

    def admitted(self, peer_id: str) -> Optional[str]:
        """None if ``peer_id`` may contribute to the current round, else why not (equivocation, audit, admission)."""
        until = self.until.get(peer_id, 0)
        if until >= self.current_round():
            return f"served different bytes to different members; excluded until round {until}"
        audited = self.audited(peer_id) if self.audited is not None else None
        if audited is not None:
            return f"excluded by audit: {audited}"
        return self.admission(peer_id) if self.admission is not None else None
