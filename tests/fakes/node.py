"""A node as the gRPC status server (daemon/service.py) sees it: a status board, an empty swarm and the leave
requests it was sent."""

from __future__ import annotations

from dilocox.daemon.status import StatusBoard


class FakeSwarm:
    def members(self):
        return []


class FakeNode:
    def __init__(self):
        self.board = StatusBoard(run_id="bad-input", version="test", inner_steps=5)
        self.swarm = FakeSwarm()
        self.leave_reasons: list[str] = []

    def request_leave(self, reason: str = "requested") -> None:
        self.leave_reasons.append(reason)
