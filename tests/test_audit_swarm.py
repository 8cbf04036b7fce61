"""Recomputation audits on real peers (daemon/audits.py): a small-norm liar that the robust rule lets through is
audited, accused, checked by the other members and excluded by all of them, while the honest members never accuse
each other and keep one theta."""

from __future__ import annotations

import time

import pytest

from tests.helpers import FAST, start

pytestmark = [pytest.mark.integration, pytest.mark.swarm]  # 47 s: test-swarm (make test's budget)


def test_a_small_norm_liar_is_caught_and_excluded_by_every_honest_member(tmp_path):
    args = FAST + ["--run-id", "audits", "--min-replicas", "4", "--audit-rate", "1.0", "--max-outer-steps", "14"]
    a = start(tmp_path, "a", args)
    others = [start(tmp_path, n, args + ["--join", a.join_maddr]) for n in ("b", "c")]
    liar = start(tmp_path, "s", args + ["--join", a.join_maddr, "--attack", "bench.attacks.gradient:InnerProduct"])
    honest = [a, *others]
    try:
        s = liar.status().peer_id
        for n in honest:
            n.wait_for(lambda p: any(r.get("audit_excluded") == [s] for r in p.metrics()), 150,
                       "the liar excluded by audit")
        for n in honest:
            rows = n.metrics()
            brief = [(r["outer_step"], r["outcome"], r["dropped"], r.get("audit_excluded"), r.get("audit_outcomes"))
                     for r in rows]
            # nobody honest is ever accused or excluded, and once out the liar stays out
            assert all(set(r["audit_excluded"]) <= {s} and set(r["audit_accusations"]) <= {s} for r in rows), brief
            first = next(i for i, r in enumerate(rows) if r["audit_excluded"] == [s])
            assert all(r["audit_excluded"] == [s] for r in rows[first:]), brief
        log = "".join(n.err_path.read_text() for n in honest)
        assert f"audit: excluding {s} from later rounds" in log
        # after the exclusion the liar's contribution is no longer used: the groups count honest members only, and
        # where the liar still took part (it falls behind, as its results never match) it was dropped as excluded
        excluded_from = max(next(r["outer_step"] for r in n.metrics() if r["audit_excluded"] == [s]) for n in honest)
        for n in honest:
            n.wait_for(lambda p: any(r["outer_step"] >= excluded_from + 2 for r in p.metrics()), 90,
                       "two rounds after the exclusion")
        late = [r for n in honest for r in n.metrics() if r["outer_step"] > excluded_from and r["outcome"] == "applied"]
        assert late and all(r["group_size"] <= len(honest) for r in late), late
        assert f"dropped the contribution of {s}: not admitted: excluded by audit" in log
        # the honest members audit each other too, and find each other honest (no false accusation: checked above)
        for n in honest:
            n.wait_for(lambda p: p.metrics()[-1]["audit_outcomes"].get("honest", 0) >= 1, 90, "an honest audit")
        assert all(set(r["audit_excluded"]) <= {s} for n in honest for r in n.metrics())
        # a member that has not yet excluded the liar when the others have aggregates other contributions, finds no
        # majority, skips that round and re-syncs (docs/security.md, Audits): the rounds applied agree
        applied = {}
        for n in honest:
            for r in n.metrics():
                if r["outcome"] in ("applied", "resynced"):
                    applied.setdefault(r["outer_step"], set()).add(r["digest"])
        split = {step: d for step, d in applied.items() if len(d) > 1}
        assert not split, split
        # a node with audits queued or in flight still drains and exits promptly on SIGTERM
        for n in honest:
            began = time.monotonic()
            assert n.terminate(timeout=30) == 0 and time.monotonic() - began < 20, n.err_path.read_text()[-2000:]
    finally:
        for n in [*honest, liar]:
            n.terminate()
