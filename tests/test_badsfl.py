"""The BadSFL harness (bench/attacks/badsfl/): the look-ahead objective, and a few rounds of the federation.

The full benchmark is ``make bench-badsfl``; here a scaled-down federation (6 clients, 3,000 images, a few
rounds) checks that the attack takes hold during injection and that the harness reports what it measures.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.attacks.badsfl.attacks import lookahead_params
from bench.attacks.badsfl.run import BY_NAME, QUICK
from bench.attacks.badsfl.sim import FederatedData, SimConfig, run_setting
from dilocox.vision import DEBIAN_FASHION_MNIST

pytestmark = pytest.mark.skipif(not DEBIAN_FASHION_MNIST.is_dir(),
                                reason="Debian's dataset-fashion-mnist is not installed (.ci/run installs it)")


def test_the_lookahead_model_is_differentiable_in_the_attackers_weights():
    # P_j = (w_p + (n-1) w_g)/n - j s c: d P_j / d w_p = 1/n (the authors' code computes it without gradient)
    w = [torch.ones(3, requires_grad=True)]
    g, c = [torch.full((3,), 2.0)], [torch.full((3,), 0.5)]
    p = lookahead_params(w, g, participants=4, rounds_ahead=10, step_scale=0.1, control=c)
    assert torch.allclose(p[0], torch.full((3,), (1 + 3 * 2) / 4 - 10 * 0.1 * 0.5))
    p[0].sum().backward()
    assert torch.allclose(w[0].grad, torch.full((3,), 0.25))
    with pytest.raises(ValueError, match="participants"):
        lookahead_params(w, g, participants=0, rounds_ahead=1, step_scale=1.0)


def test_badsfl_takes_hold_during_injection_in_a_small_federation(tmp_path):
    cfg = SimConfig(**{**QUICK, "rounds": 4, "attack_start": 2, "attack_stop": 3})
    data = FederatedData(cfg, cfg.partition)
    runs = {name: run_setting(cfg, BY_NAME[name], tmp_path, data) for name in ("scaffold", "scaffold+badsfl")}
    bta = {name: max(p["bta"] for p in r["curve"] if cfg.attack_start <= p["round"] <= cfg.attack_stop)
           for name, r in runs.items()}
    # the clean run never teaches sneakers -> Bag; the attacker does within two rounds of injection
    assert bta["scaffold"] < 0.5 and bta["scaffold+badsfl"] > 0.6, bta
    for r in runs.values():
        assert [p["round"] for p in r["curve"]] == list(range(0, cfg.rounds + 1))
        assert all(0.0 <= p["pta"] <= 1.0 for p in r["curve"])
    assert dataclasses.asdict(BY_NAME["scaffold+badsfl"])["attack"] == "badsfl"
