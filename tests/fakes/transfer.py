"""A StateTransfer (daemon/transfer.py) over fake progress records: no network."""

from __future__ import annotations

from dilocox.daemon.transfer import StateTransfer

from tests.fakes.progress import FakeProgress
from tests.fakes.records import Record


def transfer_for(state, others=None):
    others = [Record("donor", state.outer_step, state.digest)] if others is None else others
    return StateTransfer(state.cfg, state, FakeProgress(others), lambda: ("TRAINING", 3), lambda: False)
