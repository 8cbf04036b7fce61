"""dilocox-ctl status's human-readable lines (daemon/ctl.py) from a NodeStatus message."""

from __future__ import annotations

from dilocox.daemon.ctl import _print_status
from dilocox.proto.dilocox.v1 import node_pb2


def test_the_last_round_line_says_when_an_outsized_contribution_starts_a_quiet_restart(capsys):
    status = node_pb2.NodeStatus(peer_id="p", state="TRAINING",
                                 last_round=node_pb2.RoundInfo(outer_step=7, group_size=3, outcome="applied"))
    _print_status(status)
    plain = capsys.readouterr().out
    assert "step 7 group 3 applied" in plain and "outsized" not in plain
    status.last_round.outsized = True
    _print_status(status)
    assert "an outsized contribution" in capsys.readouterr().out
