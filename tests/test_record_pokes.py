"""When a node publishes its membership record at once (daemon/node.py ``Node._set_state``): a rule test with the
node's real StatusBoard and a counting ProgressTracker stand-in (the publish itself is tested with real DHTs in
tests/test_input_conflicts.py)."""

from __future__ import annotations

from types import SimpleNamespace

from dilocox.daemon.node import Node
from dilocox.daemon.status import State, StatusBoard


class _Pokes:
    def __init__(self):
        self.count = 0

    def poke(self) -> None:
        self.count += 1


def _node():
    node = SimpleNamespace(board=StatusBoard(state=State.SYNCING), progress=_Pokes(), state=SimpleNamespace(round=3))
    node._prompt_fields, node._prompted = (lambda: Node._prompt_fields(node)), None
    return node


def test_a_record_is_published_at_once_when_a_field_others_act_on_changes_and_not_for_inner_step_alone():
    node = _node()
    Node._set_state(node, State.TRAINING, inner_step=0)
    assert node.progress.count == 1  # a state change
    Node._set_state(node, State.TRAINING, outer_step=4, inner_step=0, global_params_digest="ab")
    assert node.progress.count == 2  # a new outer step (joiners wait for it)
    Node._set_state(node, State.TRAINING, inner_step=0)
    Node._set_state(node, State.TRAINING, inner_step=7, loss=1.5)
    assert node.progress.count == 2  # nothing others act on: the next heartbeat carries it
    assert node.board.snapshot().inner_step == 7
    node.state.round = 4  # a round given up: the round moves on, outer_step does not
    Node._set_state(node, State.TRAINING, inner_step=0)
    assert node.progress.count == 3  # a new round (joiners waiting for the next round look for it)
    Node._set_state(node, State.AVERAGING)
    assert node.progress.count == 4
    Node._set_state(node, State.TRAINING, global_params_digest="cd")
    Node._set_state(node, State.TRAINING, global_params_digest="ef")
    assert node.progress.count == 6  # theta's digest


def test_a_node_without_replica_state_yet_still_publishes_its_state_changes():
    node = _node()
    node.state = None  # BOOTSTRAPPING and JOINING come before the replica state exists
    Node._set_state(node, State.BOOTSTRAPPING, sync_reason="no peer answered", sync_attempts=1)
    Node._set_state(node, State.BOOTSTRAPPING, sync_reason="no peer answered", sync_attempts=2)
    Node._set_state(node, State.JOINING)
    assert node.progress.count == 2
