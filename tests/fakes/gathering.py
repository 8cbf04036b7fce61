"""The metadata all-gather of a sparse round (peers/allgather.py), faked: a member's gathered fields and an averager
whose phase returns them (tested with real peers in tests/test_partial_allreduce.py)."""

from __future__ import annotations

from dilocox.peers.averaging import PhaseResult, RoundGather

SHA = "ab" * 32


def meta(outer_step=4, start="d0", weight=20.0, sha=SHA, size=100, **extra):
    """What a member gathers: its RoundGather fields and its payload's announced digest and length."""
    return dict(RoundGather(outer_step=outer_step, start_digest=start, weight=weight).dict(),
                payload_sha256=sha, payload_bytes=size, **extra)


class GatheringAverager:
    """Stands in for the all-gather of metadata: returns our gather and ``others``' as the group's."""

    def __init__(self, others: dict, phase_bytes: int = 0):
        self.others, self.phase_bytes = others, phase_bytes

    def run_phase(self, bits, codes, gather, weight, control):
        return PhaseResult(codes, {**self.others, "me": gather}, 0.1, self.phase_bytes, self.phase_bytes)
