"""Members' published progress records, the fields that the consistency rules and StateTransfer read."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Peer:
    peer_id: str = "p"
    state: str = "TRAINING"
    outer_step: int = 4
    round: int = 5
    inner_step: int = 3
    global_params_digest: str = "d4"
    num_stages: int = 1
    result_step: int = 0


class Record:
    """A member's published progress (the MemberRecord fields validate() reads)."""

    def __init__(self, peer_id, outer_step, digest, state="TRAINING"):
        self.peer_id, self.outer_step, self.global_params_digest, self.state = peer_id, outer_step, digest, state
