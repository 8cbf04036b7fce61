"""The robust learning rate (dilocox/sign_agreement.py): thresholds, exact counts, what a lone pusher gets, and the
harness setting that applies it after the daemon's SCAFFOLD default."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dilocox import sign_agreement, vision
from dilocox.sign_agreement import SignRule


def test_the_threshold_is_a_share_of_the_contributions_rounded_up():
    assert sign_agreement.threshold(0.35, 10) == 4 == sign_agreement.threshold(0.35, 11)  # the paper's 4 of 10
    assert sign_agreement.threshold(0.4, 10) == 4  # 0.4 x 10 is 4.000000000000001 in floats: still 4
    assert sign_agreement.threshold(0.35, 5) == 2 and sign_agreement.threshold(0.01, 3) == 1
    assert sign_agreement.threshold(1.0, 7) == 7
    for bad in (0.0, -0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="min_agreement"):
            sign_agreement.threshold(bad, 10)
    with pytest.raises(ValueError, match="no contribution"):
        sign_agreement.threshold(0.5, 0)


def test_agreement_counts_signs_and_a_zero_counts_nothing():
    rows = [torch.tensor([1.0, 1.0, -1.0, 0.0, 5.0]), torch.tensor([2.0, -1.0, -3.0, 0.0, -0.0]),
            torch.tensor([1e-30, 1.0, 1.0, 2.0, 0.0])]
    assert sign_agreement.agreement(rows).tolist() == [3, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="one length"):
        sign_agreement.agreement([torch.zeros(3), torch.zeros(4)])
    with pytest.raises(ValueError, match="no contribution"):
        sign_agreement.agreement([])


def _backdoor_round(honest: int = 10, d_task: int = 200, d_trigger: int = 50, seed: int = 0):
    """Honest rows agree on the task's coordinates and split on the trigger's; one attacker pushes the trigger's
    coordinates one way, harder, and follows the task."""
    g = torch.Generator().manual_seed(seed)
    task = torch.randn(d_task, generator=g, dtype=torch.float64).abs() + 0.5
    rows = []
    for _ in range(honest):
        noise = 0.05 * torch.randn(d_trigger, generator=g, dtype=torch.float64)
        rows.append(torch.cat([task + 0.1 * torch.randn(d_task, generator=g, dtype=torch.float64), noise]))
    rows.append(torch.cat([task, torch.full((d_trigger,), 2.0, dtype=torch.float64)]))
    return rows, d_task


def test_a_coordinate_only_the_attacker_pushes_is_reversed_and_the_agreed_ones_kept():
    rows, d_task = _backdoor_round()
    mean = torch.stack(rows).mean(0)
    assert (mean[d_task:] > 0).all()  # the plain mean moves every trigger coordinate the attacker's way
    flipped, low = sign_agreement.apply(mean, rows, 0.35, "flip")
    masked, low_masked = sign_agreement.apply(mean, rows, 0.35, SignRule.MASK)
    assert torch.equal(flipped[:d_task], mean[:d_task]) and torch.equal(masked[:d_task], mean[:d_task])
    trig = sign_agreement.agreement(rows)[d_task:] < 4  # the trigger coordinates the honest split leaves low
    assert int(trig.sum()) >= 40 and low == low_masked == int(trig.sum())
    # reversed: theta moves against the attacker there (the paper's unlearning); masked: not at all
    assert torch.equal(flipped[d_task:][trig], -mean[d_task:][trig]) and (flipped[d_task:][trig] < 0).all()
    assert (masked[d_task:][trig] == 0).all() and not torch.signbit(masked).any()
    off, none = sign_agreement.apply(mean, rows, 0.35, "off")
    assert off is mean and none == 0


def test_the_factors_and_errors():
    rows = [torch.tensor([1.0, -1.0]), torch.tensor([1.0, 1.0])]
    assert sign_agreement.learning_rate_signs(rows, 1.0, "flip").tolist() == [1.0, -1.0]
    assert sign_agreement.learning_rate_signs(rows, 1.0, "mask").tolist() == [1.0, 0.0]
    assert sign_agreement.learning_rate_signs(rows, 0.5, "off").tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="aggregate of 3 values over contributions of 2"):
        sign_agreement.apply(torch.zeros(3, dtype=torch.float64), rows, 0.5, "flip")
    with pytest.raises(ValueError):
        sign_agreement.apply(torch.zeros(2, dtype=torch.float64), rows, 0.5, "reverse")


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 9), st.integers(1, 40), st.floats(0.05, 1.0), st.integers(0, 2 ** 16))
def test_the_mask_is_the_same_in_any_order_and_only_signs_change(k, d, share, seed):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(d, generator=g, dtype=torch.float64).round() for _ in range(k)]  # ties and zeros included
    agg = torch.stack(rows).mean(0)
    out, low = sign_agreement.apply(agg, rows, share, "flip")
    again, _ = sign_agreement.apply(agg, rows[::-1], share, "flip")
    assert torch.equal(out, again)  # every member, whatever order it holds the rows in
    assert torch.equal(out.abs(), agg.abs()) and 0 <= low <= d
    if share * k <= 1.0:  # theta = 1: only a coordinate whose signs cancel is reversed
        assert low == int((sign_agreement.agreement(rows) == 0).sum())


def test_the_harness_applies_it_after_the_daemons_scaffold_default(tmp_path):
    from bench.attacks.badsfl.run import BY_NAME, DAEMON_SCAFFOLD, QUICK
    from bench.attacks.badsfl.sim import FederatedData, Federation, SimConfig
    from dilocox.vision import DEBIAN_FASHION_MNIST

    if not DEBIAN_FASHION_MNIST.is_dir():
        pytest.skip("Debian's dataset-fashion-mnist is not installed (.ci/run installs it)")
    torch.set_num_threads(1)
    for name in ("scaffold+blackbox/daemon-rlr", "scaffold+blackbox/daemon-mask", "scaffold+blackbox/daemon"):
        s = BY_NAME[name]
        assert {k: getattr(s, k) for k in DAEMON_SCAFFOLD} == DAEMON_SCAFFOLD
    cfg = dataclasses.replace(SimConfig(**QUICK), rounds=3, attack_start=2, attack_stop=3, per_round=4)
    data = FederatedData(cfg)
    runs = {}
    for name in ("scaffold+blackbox/daemon", "scaffold+blackbox/daemon-rlr", "scaffold+blackbox/daemon-mask"):
        theta0 = [p.detach().clone() for p in vision.build_image_model(cfg.model, data.num_classes, 0).parameters()]
        fed = Federation(cfg, BY_NAME[name], data, theta0)
        runs[name] = [fed.round(t) for t in range(1, cfg.rounds + 1)], fed
    plain, rlr, mask = (runs[n] for n in ("scaffold+blackbox/daemon", "scaffold+blackbox/daemon-rlr",
                                          "scaffold+blackbox/daemon-mask"))
    assert all(r["sign_low"] == 0 for r in plain[0])
    assert rlr[0][0]["sign_low"] > 0 and rlr[0][0]["sign_low"] == mask[0][0]["sign_low"]  # one round 1, two rules
    # the same contributions in round 1, and an aggregate that differs where fewer than 2 of 4 agree
    assert rlr[0][0]["clients"] == plain[0][0]["clients"]
    assert not all(torch.equal(a, b) for a, b in zip(rlr[1].outer.global_params, plain[1].outer.global_params))


def test_the_gated_rule_acts_in_rounds_with_an_outsized_contribution_only(tmp_path):
    from bench.attacks.badsfl.run import BY_NAME, QUICK
    from bench.attacks.badsfl.sim import FederatedData, Federation, SimConfig
    from dilocox.vision import DEBIAN_FASHION_MNIST

    if not DEBIAN_FASHION_MNIST.is_dir():
        pytest.skip("Debian's dataset-fashion-mnist is not installed (.ci/run installs it)")
    torch.set_num_threads(1)
    cfg = dataclasses.replace(SimConfig(**QUICK), per_round=4)
    cfg = dataclasses.replace(cfg, knobs=dataclasses.replace(cfg.knobs, lr_factor=20.0, step_factor=4))
    data = FederatedData(cfg)
    theta0 = [p.detach().clone() for p in vision.build_image_model(cfg.model, data.num_classes, 0).parameters()]
    runs = {n: Federation(cfg, BY_NAME[n], data, theta0) for n in
            ("scaffold/daemon-rlr-gated", "scaffold/daemon-rlr", "scaffold+blackbox/daemon-rlr-gated",
             "scaffold+blackbox/daemon-drop4")}
    out, admitted = {n: [] for n in runs}, []
    for t in range(1, cfg.rounds + 1):
        for n, fed in runs.items():
            out[n].append(fed.round(t))
        admitted.append(runs["scaffold+blackbox/daemon-drop4"].admitted)
    assert all(r["sign_low"] == 0 for r in out["scaffold/daemon-rlr-gated"])  # no attack: it never acts
    assert all(r["sign_low"] > 0 for r in out["scaffold/daemon-rlr"])
    attacked = out["scaffold+blackbox/daemon-rlr-gated"]
    window = range(cfg.attack_start, cfg.attack_stop + 1)
    # the boosted attacker (20x lr, 4x steps) is outsized in its window; outside it nothing is
    assert all(r["sign_low"] == 0 for t, r in enumerate(attacked, 1) if t not in window)
    assert all(r["attacker_norm_ratio"] > 8 and r["sign_low"] > 0 for t, r in enumerate(attacked, 1) if t in window)
    # drop4: the outsized attacker is left out of its window's rounds (not clipped into them); everyone else counts
    attacker = f"c{data.attacker:02d}"
    for t, r in enumerate(out["scaffold+blackbox/daemon-drop4"], 1):
        chosen = {f"c{k:02d}" for k in r["clients"]}
        assert set(admitted[t - 1]) == (chosen - {attacker} if t in window else chosen), t
        assert attacker in chosen or t not in window  # forced into the window's rounds
