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


def test_the_papers_knobs_epochs_pixel_trigger_and_ablations():
    from bench.attacks.badsfl.paper import ABLATIONS, PAPER, ablate, config_from_flags, main  # noqa: F401
    from bench.attacks.badsfl.sim import stamp
    from dilocox.partition import local_epochs_to_steps

    assert PAPER.inner_steps == 38 == local_epochs_to_steps(2, 24_000, 20, 64)  # 2 epochs of 1,200 at batch 64
    assert local_epochs_to_steps(0.01, 100, 10, 64) == 1
    with pytest.raises(ValueError, match="epochs > 0"):
        local_epochs_to_steps(0, 100, 10, 64)
    assert ablate(PAPER, ABLATIONS["no-boost"]).knobs.lr_factor == 1.0 and PAPER.knobs.lr_factor == 5.0
    assert ablate(PAPER, ABLATIONS["adamw"]).optimizer == "adamw"
    import argparse
    flags = dict(clients=10, per_round=5, rounds=None, batch_size=32, inner_lr=None, momentum=None, weight_decay=None,
                 optimizer=None, model=None, partition="dirichlet:0.5", pretrain_rounds=None, train_subset=None,
                 target=None, trigger="pixel", inner_steps=None, attack_window=[3, 7], attacker_lr_factor=None,
                 attacker_step_factor=None, discriminator=False, local_epochs=1.0)
    cfg = config_from_flags(argparse.Namespace(**flags))
    assert (cfg.clients, cfg.partition, cfg.trigger, cfg.attack_start, cfg.attack_stop) == (10, "dirichlet:0.5",
                                                                                           "pixel", 3, 7)
    assert cfg.inner_steps == 75 and not cfg.knobs.discriminator  # 24,000 / 10 images per client, batch 32
    # the pixel trigger: the attacker's own images of other classes, stamped, appended and relabelled
    small = dataclasses.replace(cfg, train_subset=3000, clients=6)
    data = FederatedData(small)
    triggered = data.attacker_triggered
    assert triggered.min() >= 3000 and len(data.train_x) == 3000 + len(triggered) == len(data.train_y)
    assert (data.poisoned_y[triggered] == small.target_class).all()
    assert (data.train_x[triggered][:, 23:27, 23:27] == 255).all() and (data.bta_x[:, 23:27, 23:27] == 255).all()
    assert len(data.bta_train_x) == len(triggered) and stamp(data.train_x[:2]).dtype == data.train_x.dtype


def test_the_attackers_own_lr_and_the_gan_discriminator(tmp_path):
    from bench.attacks.badsfl.attacks import AttackKnobs, Discriminator

    knobs = AttackKnobs(lookahead_rounds=2, gan_steps=2, gan_batch=8, gan_per_batch=4, lr_factor=5.0, step_factor=2,
                        discriminator=True)
    cfg = SimConfig(**{**QUICK, "rounds": 3, "attack_start": 2, "attack_stop": 2, "model": "simple-cnn",
                       "optimizer": "sgd", "momentum": 0.9, "inner_lr": 0.01, "knobs": knobs})
    data = FederatedData(cfg)
    run = run_setting(cfg, BY_NAME["scaffold+badsfl"], tmp_path, data)
    assert [p["round"] for p in run["curve"]] == [0, 1, 2, 3] and all("bta_train" in p for p in run["curve"])
    # the discriminator starts from the global model's features and has its own real/fake head
    from dilocox import vision
    model = vision.build_image_model("simple-cnn", 10, 0)
    d = Discriminator(model)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert not torch.equal(d.features[0].weight, model[0].weight)
    d.refresh(model)
    assert torch.equal(d.features[0].weight, model[0].weight) and d.features[0].weight.requires_grad
    assert d(torch.rand(3, 1, 28, 28)).shape == (3,)
    # the attacker's lr is its own only for its round (the InnerLoop's config comes back)
    from bench.attacks.badsfl.sim import Federation, pretrained
    fed = Federation(cfg, BY_NAME["scaffold+badsfl"], data, pretrained(cfg, data, tmp_path))
    inner = fed.inners[data.attacker]
    before = inner.config
    seen = []
    original = inner.inner_step

    def spy(x, y, global_step, stop=False, after_step=None):
        seen.append(inner.config.lr_at(global_step))
        return original(x, y, global_step, stop, after_step)

    inner.inner_step = spy
    fed.round(2)
    assert inner.config is before and seen and all(lr == pytest.approx(5 * cfg.inner_lr) for lr in seen)
    assert len(seen) == 2 * cfg.inner_steps


def test_the_public_codes_attacker_an_extra_party_in_the_window_only(tmp_path):
    """paper-code: the attacker is party N (not one of the N clients), trains only in the attack window, steps
    without SCAFFOLD's correction, and holds every triggered image (no benign share keeps one)."""
    from types import SimpleNamespace

    from bench.attacks.badsfl.attacks import Blackbox

    knobs = dataclasses.replace(QUICK["knobs"], self_correction=False)
    cfg = SimConfig(**{**QUICK, "rounds": 5, "attack_start": 2, "attack_stop": 3, "attacker_role": "extra",
                       "exclusive_trigger": True, "knobs": knobs})
    data = FederatedData(cfg)
    assert data.attacker == cfg.clients and len(data.parts) == cfg.clients + 1
    triggered = set(data.attacker_triggered.tolist())
    assert triggered and not any(triggered & set(p.tolist()) for p in data.parts[:cfg.clients])
    assert triggered <= set(data.attacker_stream.tolist())
    run = run_setting(cfg, BY_NAME["scaffold+badsfl"], tmp_path, data)
    present = [p["round"] for p in run["curve"][1:] if p["attacker_norm_ratio"] is not None]
    assert present == [2, 3], present  # in the window only, never sampled as a client afterwards
    # no correction hook on its own steps, even with control variates in play
    assert Blackbox(None, knobs, [], 10, 0).hooks(SimpleNamespace(control=object())) == []
    with pytest.raises(ValueError, match="attacker_role"):
        FederatedData(dataclasses.replace(cfg, attacker_role="insider"))
