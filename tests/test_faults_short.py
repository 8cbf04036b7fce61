"""A short fault run beside CPU load (bench/faults.py): one seeded trial of churn on a busy 2-core host.

The soak (``make bench-soak``) runs 100 such trials; this one keeps the rules it counts honest in CI:
a joiner on a machine whose cores are busy with other work still joins, nobody splits the swarm or
applies a result nobody else holds, and a SIGTERM leave exits cleanly.
"""

from __future__ import annotations

import pytest

from bench import faults

pytestmark = [pytest.mark.integration, pytest.mark.swarm]


def test_one_fault_trial_under_cpu_load_keeps_the_swarm_whole(tmp_path):
    # seed 1000: the soak's first trial (join, kill, leave, ...); one busy process throughout
    r = faults.trial(1000, events=3, workdir=tmp_path / "trial", cpu_load=1)
    assert r["events"] and r["rounds"] >= 3, r
    for counter in ("splits", "lone_results", "unclean_leaves", "failed_joins", "lost_nodes"):
        assert r[counter] == 0, (counter, r)
    assert r["converged"], r
