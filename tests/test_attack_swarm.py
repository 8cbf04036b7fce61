"""One attack end to end on real nodes: three honest nodes and one that sends its pseudo-gradient sign-flipped
and scaled by 1000 (bench/attacks/gradient.py), with the default defense. The honest nodes keep learning,
agree on every outer step, and the attacker's contribution is scaled down to the group's norm bound."""

from __future__ import annotations

import signal

import pytest

from tests.helpers import FAST, digests_by_step, start

pytestmark = pytest.mark.integration


def test_sign_flip_of_one_in_four_does_not_take_over(tmp_path):
    args = FAST + ["--run-id", "attacked", "--min-replicas", "4"]
    honest = [start(tmp_path, "h0", args)]
    honest += [start(tmp_path, f"h{i}", args + ["--join", honest[0].join_maddr]) for i in (1, 2)]
    bad = start(tmp_path, "bad", args + ["--join", honest[0].join_maddr, "--attack",
                                          "bench.attacks.gradient:SignFlip"])
    try:
        for n in honest:
            n.wait_for(lambda p: len(p.metrics()) >= 6, 180, "six recorded rounds")
        rows = honest[0].metrics()
        assert all(r["group_size"] >= 3 for r in rows[:6]), rows
        val = [r["val_loss"] for r in rows]
        assert val[5] < val[0] - 0.3 and max(val[:6]) < val[0] + 0.2, val  # it learns; no blow-up
        assert all(len(d) == 1 for d in digests_by_step(honest).values())
        bad_id = bad.status().peer_id
        assert f"contribution of {bad_id} scaled by" in honest[0].err_path.read_text()
    finally:
        for n in honest + [bad]:
            n.terminate(signal.SIGKILL)
