"""A Transport (peers/transport.py) that stands in for hivemind: it records each RoundInput and answers with what
the test scripted, the way torchft's tests inject a process group into its Manager."""

from __future__ import annotations

import threading
from typing import Callable, Optional

from dilocox.peers.averaging import RoundGather, RoundResult
from dilocox.peers.transport import RoundInput


class FakeTransport:
    """``answer(rnd)`` returns the round's RoundResult or raises (RoundFailed, RoundCancelled); None: a group of
    ``group`` members that all started where we did, whose mean is our own pseudo-gradient halved. ``rounds``: the
    inputs seen; ``entered`` is set when an exchange begins."""

    def __init__(self, answer: Optional[Callable[[RoundInput], RoundResult]] = None, group=("me", "a", "b")):
        self.answer, self.group = answer, group
        self.rounds: list[RoundInput] = []
        self.entered = threading.Event()

    def exchange(self, rnd: RoundInput) -> RoundResult:
        self.rounds.append(rnd)
        self.entered.set()
        if self.answer is not None:
            return self.answer(rnd)
        gathered = {q: RoundGather(outer_step=rnd.gather.outer_step, start_digest=rnd.gather.start_digest,
                                   weight=rnd.gather.weight) for q in self.group}
        mean = [g * 0.5 for g in rnd.contribution.pseudo_gradient]
        return RoundResult(mean, gathered, 100, 100, 100, 0.1, 1000)
