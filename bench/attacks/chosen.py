"""Honest training on data of the attacker's own choosing (issue: assigned data, dilocox/assignment.py).

``ChosenData`` trains every inner step honestly, but on one narrow slice it picked (the same 4 windows of a stream of
its own, over and over) instead of the batches it was given; its commitments, contribution and error feedback are
those of that honest training. Without assigned data and audits nothing tells it from an honest member; with them the
auditor recomputes its round on the assigned batches and its contribution does not fit.
"""

from __future__ import annotations

import torch
from dilocox.daemon.redteam import Attack

SLICE_KEY, SLICE_BATCHES = 12345, 4


class ChosenData(Attack):
    name = "chosen-data"

    def bind(self, state) -> None:
        super().bind(state)
        self.slice = state.workload.shard(0, SLICE_KEY)
        self.drawn = 0

    def batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.drawn += 1
        return self.slice.batch_at(self.drawn % SLICE_BATCHES)
