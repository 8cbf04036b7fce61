"""Recomputation audits of SCAFFOLD's rounds on real peers (``--outer-algorithm scaffold --audit-rate 1``): a start
state commits the contributor's c_i, an auditor replays the round with c - c_i from the c it kept, and the next c_i
must be option II's update (dilocox/audit.py). Honest members pass every link; a member that makes up its c_i
(bench/attacks/control.py) is accused, checked and excluded by the group."""

from __future__ import annotations

import pytest

from tests.helpers import FAST_DEFAULTS, start

pytestmark = [pytest.mark.integration, pytest.mark.swarm]


def test_scaffold_rounds_are_audited_and_a_made_up_control_variate_is_excluded(tmp_path):
    steps = 7
    args = FAST_DEFAULTS + ["--run-id", "scaffold-audits", "--min-replicas", "3", "--max-outer-steps", str(steps),
                            "--outer-algorithm", "scaffold", "--audit-rate", "1"]
    a = start(tmp_path, "a", args)
    b = start(tmp_path, "b", args + ["--join", a.join_maddr])
    liar = start(tmp_path, "s", args + ["--join", a.join_maddr, "--attack", "bench.attacks.control:CraftedControl"])
    honest = [a, b]
    try:
        bad = liar.status().peer_id
        for n in honest:
            n.wait_for(lambda p: any(bad in r.get("excluded", {}) for r in p.metrics()), 150, "the liar excluded")
        log = "".join(n.err_path.read_text() for n in honest)
        assert f"audit: voting to exclude {bad} from later rounds" in log
        assert "control_variate_error" in log  # the link was checked on the rounds audited here
        for n in honest:
            rows = n.metrics()
            assert all(set(r["audit_votes"]) <= {bad} and set(r["excluded"]) <= {bad} for r in rows), \
                [(r["outer_step"], r["audit_votes"], r["excluded"]) for r in rows]
            assert rows[-1]["control_digest"], "a SCAFFOLD swarm publishes its c's digest"
        # the honest pair audits each other at rate 1 and finds each other honest, the c_i link included
        assert sum(n.metrics()[-1]["audit_outcomes"].get("honest", 0) for n in honest) >= 2, \
            [n.metrics()[-1]["audit_outcomes"] for n in honest]
        honest_links = [line for line in log.splitlines() if "audit of round" in line and ": honest " in line]
        assert any("control_variate_error" in line for line in honest_links), honest_links[:4]
        for n in honest:
            n.wait_for(lambda p: any(r["outer_step"] >= steps for r in p.metrics()), 120, "the last outer step")
    finally:
        for n in [*honest, liar]:
            n.terminate()
