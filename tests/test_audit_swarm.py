"""Recomputation audits on real peers with the defaults (daemon/audits.py; rate 0.1 after a 5-round probation at
rate 1): two small-norm liars of five, which the robust rule lets through, are audited, accused, checked by the
other members and excluded by their group's vote from the same round on all of them, while the honest members never
accuse each other, never skip, apply alone or re-sync around the exclusions, reach the last step while the pair keeps
running, and keep one theta."""

from __future__ import annotations

import time

import pytest

from tests.helpers import FAST_DEFAULTS, start

pytestmark = [pytest.mark.integration, pytest.mark.swarm]  # 47 s: test-swarm (make test's budget)


def test_two_small_norm_liars_are_caught_and_excluded_by_every_honest_member_from_the_same_round(tmp_path):
    steps = 14
    args = FAST_DEFAULTS + ["--run-id", "audits", "--min-replicas", "5", "--max-outer-steps", str(steps)]
    a = start(tmp_path, "a", args)
    others = [start(tmp_path, n, args + ["--join", a.join_maddr]) for n in ("b", "c")]
    liars = [start(tmp_path, n, args + ["--join", a.join_maddr, "--attack", "bench.attacks.gradient:InnerProduct"])
             for n in ("s", "t")]
    honest = [a, *others]
    try:
        ids = {n.status().peer_id for n in liars}
        for n in honest:
            n.wait_for(lambda p: any(ids <= set(r.get("excluded", {})) for r in p.metrics()), 200,
                       "both liars excluded by the group")
        for n in honest:
            rows = n.metrics()
            brief = [(r["outer_step"], r["outcome"], r["dropped"], r.get("audit_votes"), r.get("excluded"))
                     for r in rows]
            # nobody honest is ever voted against or excluded, and once out a liar stays out
            assert all(set(r["audit_votes"]) <= ids and set(r["audit_accusations"]) <= ids for r in rows), brief
            assert all(set(r["excluded"]) <= ids for r in rows), brief
            for s in ids:
                first = next(i for i, r in enumerate(rows) if s in r["excluded"])
                assert all(s in r["excluded"] for r in rows[first:]), brief
        # the group's vote excludes each from one round, the same on every honest member whose own group decided it
        # (dilocox/exclusion.py); a member whose group matchmaking split off in that round (with the excluded pair,
        # which can still lead groups of its own: docs/security.md) adopted the majority's update, recorded with the
        # rounds it followed, and takes the decision from the next group that makes it
        ledgers = [n.metrics()[-1]["excluded"] for n in honest]
        assert all(set(ledger) == ids for ledger in ledgers), ledgers
        for s in ids:
            first = min(ledger[s] for ledger in ledgers)
            for n, ledger in zip(honest, ledgers):
                outcome = next((r["outcome"] for r in n.metrics() if r["outer_step"] == first), "followed")
                assert ledger[s] == first or outcome in ("adopted", "united", "followed"), (ledgers, n.name, outcome)
        excluded_from = max(max(ledger.values()) for ledger in ledgers)
        log = "".join(n.err_path.read_text() for n in honest)
        for s in ids:
            assert f"audit: voting to exclude {s} from later rounds" in log
            assert f"the group excluded {s}" in log
            assert f"dropped the contribution of {s}: excluded by" in log
        # the excluded pair keeps running and matching, yet every honest member reaches the last step
        for n in honest:
            n.wait_for(lambda p: any(r["outer_step"] >= steps for r in p.metrics()), 150, "the last outer step")
        # groups the honest members lead refuse the excluded pair in matchmaking (peers/refusals.py)
        assert sum(n.metrics()[-1]["refused_joins"] for n in honest) >= 1, [n.metrics()[-1] for n in honest]
        # from that round on the rounds count honest members only
        late = [r for n in honest for r in n.metrics()
                if r["outer_step"] >= excluded_from and r["outcome"] == "applied"]
        assert late and all(r["group_size"] <= len(honest) for r in late), late
        # the honest members audit each other too, and find each other honest (no false accusation: checked above);
        # who audits whom is drawn, so one member can go unpicked for every round (about 1 run in 10 here): the
        # honest audits are counted over the honest members together
        assert sum(n.metrics()[-1]["audit_outcomes"].get("honest", 0) for n in honest) >= 2, \
            [n.metrics()[-1]["audit_outcomes"] for n in honest]
        # members that verified the lies at different rounds still agree on every round: nobody skips, applies alone
        # or re-syncs around the exclusions, and the rounds applied agree
        around = [(r["outer_step"], r["outcome"]) for n in honest for r in n.metrics()
                  if r["outer_step"] >= 3 and r["outcome"] in ("skipped", "applied_alone", "resynced")]
        assert not around, around
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
        for n in [*honest, *liars]:
            n.terminate()
