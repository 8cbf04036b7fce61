"""The robust learning rate on real peers (--robust-lr flip, gated on outsized rounds; dilocox/sign_agreement.py): a
member sends a 100x contribution in rounds 2 and 3, then trains honestly. The norm bound scales it by less than 1/4,
so those two rounds, and no other, reverse the coordinates whose signs too few members share; every member does it
from the same contributions, so all hold one theta per outer step. On DiLoCo's sparse default and on SCAFFOLD."""

from __future__ import annotations

import re

import pytest

from tests.helpers import FAST, two_and_a_window_attacker

pytestmark = [pytest.mark.integration, pytest.mark.swarm]

REVERSED = re.compile(r"robust learning rate: (\d+) of (\d+) coordinates reversed")


@pytest.mark.parametrize("algorithm", ["diloco", "scaffold"])
def test_only_the_boosted_rounds_are_reversed_and_every_member_agrees(tmp_path, algorithm):
    args = FAST + ["--run-id", f"rlr-{algorithm}", "--min-replicas", "3", "--outer-algorithm", algorithm,
                   "--robust-lr", "flip", "--max-outer-steps", "7"]
    nodes = two_and_a_window_attacker(tmp_path, args)
    try:
        for n in nodes:
            n.wait_for(lambda p: any(r["outer_step"] >= 6 for r in p.metrics()), 240, "outer step 6")
        states = {}
        for n in nodes:
            for r in n.metrics():
                if r["outcome"] in ("applied", "resynced"):
                    states.setdefault(r["outer_step"], set()).add(r["digest"])
        assert all(len(d) == 1 for d in states.values()), states  # one theta per outer step
        through = [n for n in nodes if all(r["outcome"] == "applied" for r in n.metrics() if r["outer_step"] <= 6)]
        assert len(through) >= 2, [(n.name, [r["outcome"] for r in n.metrics()]) for n in nodes]
        for n in through:
            log = n.err_path.read_text()
            found = [(int(low), int(total)) for low, total in REVERSED.findall(log)]
            # rounds 2 and 3 (the attacker's window), each aggregated once by this member, and nothing after
            assert len(found) == 2 and all(0 < low < total for low, total in found), (n.name, found)
            # SCAFFOLD leaves the outsized contribution out (--drop-outsized 4), DiLoCo clips it
            assert ("(outsized)" in log) if algorithm == "scaffold" else ("to the group's norm bound" in log)
    finally:
        for n in nodes:
            n.terminate()
