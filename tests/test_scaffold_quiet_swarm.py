"""SCAFFOLD's quiet restart on real peers, as the defaults set it (--scaffold-reset-quiet 3, halving c and c_i in 5
rounds; dilocox/scaffold.py QuietRestart) but restarting them at multiples of 5 (not 20) while outsized rounds come,
so that a short run shows both: a member sends a 100x contribution in rounds 2 and 3, then trains honestly. The norm
bound scales it down (outsized); every member restarts c at outer step 5 (an outsized round among its last 5) and,
from 3 rounds after the last outsized round, halves it at the same 5 outer steps, with no message between them."""

from __future__ import annotations

import re

import pytest

from tests.helpers import FAST, two_and_a_window_attacker

pytestmark = [pytest.mark.integration, pytest.mark.swarm]

SHRINK = re.compile(r"outer step (\d+): SCAFFOLD's c and c_i scaled by 0.5 \(quiet restart\)")
RESTART = re.compile(r"outer step (\d+): SCAFFOLD's c and c_i restarted at zero \(during-attack restart\)")


def test_every_member_shrinks_c_at_the_same_outer_steps_after_a_boosting_attacker_stops(tmp_path):
    args = FAST + ["--run-id", "quiet", "--min-replicas", "3", "--outer-algorithm", "scaffold",
                   "--scaffold-quiet-every", "5", "--max-outer-steps", "20"]
    nodes = two_and_a_window_attacker(tmp_path, args)
    try:
        for n in nodes:
            n.wait_for(lambda p: any(r["outer_step"] >= 3 + 3 + 4 for r in p.metrics()), 240, "the last halving")
        logs = {n.name: n.err_path.read_text() for n in nodes}
        # outsized (over 4 x the bound): left out, not clipped in (--drop-outsized 4, SCAFFOLD's default)
        assert "left out: the norm bound would scale it by" in logs["a"] and "(outsized)" in logs["a"]
        states, verdicts = {}, {}
        for n in nodes:
            for r in n.metrics():
                if r["outcome"] in ("applied", "resynced"):  # a re-sync brings the swarm's theta and c
                    states.setdefault(r["outer_step"], set()).add((r["digest"], r["control_digest"]))
                if r["outcome"] == "applied":
                    verdicts.setdefault(r["outer_step"], set()).add(r["outsized"])
        assert all(len(d) == 1 for d in states.values()), states  # one theta and one c per outer step
        assert all(len(v) == 1 for v in verdicts.values()), verdicts  # and one verdict among those who applied it
        # the window's rounds, 2 and 3, were outsized, and no later one
        assert [step for step, v in sorted(verdicts.items()) if True in v] == [2, 3], verdicts
        # restarted at 5 (an outsized round in 1-5), then Q = 3 after the last outsized round halved at 6-10; a
        # member that re-synced in between took c from a download and logged nothing for that step
        through = [n.name for n in nodes
                   if all(r["outcome"] == "applied" for r in n.metrics() if r["outer_step"] <= 10)]
        assert len(through) >= 2, [(n.name, [r["outcome"] for r in n.metrics()]) for n in nodes]
        acted = {name: ([int(s) for s in SHRINK.findall(logs[name])], [int(s) for s in RESTART.findall(logs[name])])
                 for name in through}
        assert all(steps == ([6, 7, 8, 9, 10], [5]) for steps in acted.values()), acted
    finally:
        for n in nodes:
            n.terminate()


@pytest.mark.parametrize("rice", [True, False])
def test_the_window_attack_boosts_its_payload_100x_in_rounds_2_and_3_only(rice):
    import torch

    from bench.attacks.gradient import ScaleThenStop
    from dilocox.sparse import SparseCodec, SparseConfig, decode

    shapes, cfg = [(30, 20), (77,)], SparseConfig(chunk=195, topk=12, bits=2, rice=rice)
    payload = SparseCodec(shapes, cfg).encode([torch.randn(s) for s in shapes])
    attack = ScaleThenStop(None)
    honest = torch.cat([t.reshape(-1) for t in decode(payload, shapes, cfg)])
    for r in (1, 2, 3, 4):
        sent = torch.cat([t.reshape(-1) for t in decode(attack.contribution(payload, r), shapes, cfg)])
        assert torch.allclose(sent, honest * (100.0 if r in (2, 3) else 1.0), rtol=1e-6), r
