"""Settling the BadSFL attack (bench/attacks/badsfl/): the authors' dc rule, the server's c reset after the attack
window, the memorised trigger, the c_gap diagnostics, and the runs ``make bench-badsfl-settle`` launches.

The rules are checked on toy control variates; the federation parts on the harness's scaled-down federation
(run.py's QUICK: 6 clients, 3,000 images, a few rounds), without pre-training.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from bench.attacks.badsfl.attacks import AttackKnobs, BadSFL, Blackbox, crafted_dc, paper_dc
from bench.attacks.badsfl.run import BY_NAME, QUICK
from bench.attacks.badsfl.sim import (
    MEMORIZE_IMAGES,
    MEMORIZE_TEST,
    FederatedData,
    Federation,
    MixedStream,
    SimConfig,
)
from bench.federation import flatten, unflatten
from dilocox import vision
from dilocox.scaffold import ControlVariates
from dilocox.vision import DEBIAN_FASHION_MNIST

needs_data = pytest.mark.skipif(not DEBIAN_FASHION_MNIST.is_dir(),
                                reason="Debian's dataset-fashion-mnist is not installed (.ci/run installs it)")


def _toy(c=(0.5, -1.0, 2.0), c_i=(1.0, 1.0, -3.0)) -> ControlVariates:
    control = ControlVariates([torch.zeros(3)])
    control.c, control.c_i = [torch.tensor(c)], [torch.tensor(c_i)]
    return control


def _ctx(control, c_mode="channel", lr_sum=0.5, inner_steps=4, total_clients=20):
    return SimpleNamespace(control=control, c_mode=c_mode, lr_sum=lr_sum, inner_steps=inner_steps,
                           total_clients=total_clients)


DELTA = [torch.tensor([3.0, 0.0, -6.0])]


def test_the_papers_dc_is_the_mean_update_minus_c_and_becomes_c_i():
    # the public code: c_i <- (theta - y) / (steps * lr) = u, dc = u - c; u over the steps the attacker really ran
    control = _toy()
    dc = paper_dc(control, DELTA, lr_sum=1.5)
    u = torch.tensor([2.0, 0.0, -4.0])
    assert torch.equal(control.c_i[0], u) and torch.equal(dc[0], u - torch.tensor([0.5, -1.0, 2.0]))
    assert torch.equal(control.c[0], torch.tensor([0.5, -1.0, 2.0]))  # the server's c is not the client's to move
    # through any attacker class: lr_sum * step_factor * lr_factor = 0.5 * 2 * 3 = 3
    knobs = AttackKnobs(dc_rule="paper", step_factor=2, lr_factor=3.0)
    for cls in (Blackbox, BadSFL):
        control = _toy()
        dc = cls(None, knobs, [], 10, 0).control_update(_ctx(control), DELTA)
        assert torch.equal(control.c_i[0], DELTA[0] / 3.0)
        assert torch.equal(dc[0], DELTA[0] / 3.0 - torch.tensor([0.5, -1.0, 2.0]))
        # with c derived from the aggregate nothing is uploaded; its c_i follows the rule all the same
        control = _toy()
        assert cls(None, knobs, [], 10, 0).control_update(_ctx(control, c_mode="derived"), DELTA) is None
        assert torch.equal(control.c_i[0], DELTA[0] / 3.0)
    assert Blackbox(None, knobs, [], 10, 0).control_update(_ctx(None), DELTA) is None  # FedAvg
    with pytest.raises(ValueError, match="dc_rule"):
        AttackKnobs(dc_rule="lying")
    with pytest.raises(ValueError, match="lr_sum"):
        paper_dc(_toy(), DELTA, 0.0)


def test_the_crafted_and_honest_uploads_are_those_of_option_two():
    """Regression: with the default knobs every attacker sends what it sent before dc_rule existed."""
    c, c_i0, n = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([1.0, 1.0, -3.0]), 20
    u = DELTA[0] / 0.5
    honest_c_i = c_i0 - c + u  # option II: c_i+ = c_i - c + delta / lr_sum
    default = AttackKnobs()
    assert default.dc_rule == "crafted" and default.dc_pull == 0.1
    # badsfl: rho N (c_i+ - c), with c_i+ kept honestly
    control = _toy()
    dc = BadSFL(None, default, [], 10, 0).control_update(_ctx(control, total_clients=n), DELTA)
    assert torch.allclose(control.c_i[0], honest_c_i)
    assert torch.allclose(dc[0], 0.1 * n * (honest_c_i - c))
    assert torch.allclose(dc[0], crafted_dc([honest_c_i], [c], n, 0.1)[0])
    # blackbox (and badsfl with dc_pull 0, or dc_rule honest): option II's dc, u - c
    for cls, knobs in ((Blackbox, default), (BadSFL, dataclasses.replace(default, dc_pull=0.0)),
                       (BadSFL, dataclasses.replace(default, dc_rule="honest")),
                       (Blackbox, dataclasses.replace(default, dc_rule="honest"))):
        control = _toy()
        dc = cls(None, knobs, [], 10, 0).control_update(_ctx(control), DELTA)
        assert torch.allclose(dc[0], u - c) and torch.allclose(control.c_i[0], honest_c_i), (cls, knobs)


def test_cache_keys_of_earlier_runs_and_the_settle_runs():
    from bench.attacks.badsfl.paper import ABLATIONS, DEFAULT_ABLATIONS, PAPER, ablate, job_key, jobs_for

    # the keys of runs cached before the new knobs existed (computed before they were added)
    assert job_key(PAPER, BY_NAME["scaffold+badsfl"]) == "56ca7f0fa8babb2e"
    pixel = ablate(PAPER, ABLATIONS["paper-code-pixel"])
    assert job_key(pixel, BY_NAME["scaffold+blackbox"]) == "a87aa171050450d3"
    assert job_key(ablate(PAPER, ABLATIONS["paper-code"]), BY_NAME["scaffold+badsfl"]) == "e85bb052ad76227d"
    assert (PAPER.pretrain_key(), pixel.pretrain_key()) == ("fc03e221faf2", "49d076d73200")
    # the new ones differ from what they change, and memorize has its own pre-training (its 45 are in no share)
    dc = ablate(PAPER, ABLATIONS["paper-dc-pixel"])
    assert dc.knobs.dc_rule == "paper" and job_key(dc, BY_NAME["scaffold+badsfl"]) != job_key(
        pixel, BY_NAME["scaffold+badsfl"]) and dc.pretrain_key() == pixel.pretrain_key()
    assert job_key(pixel, BY_NAME["scaffold+blackbox/reset-c"]) != job_key(pixel, BY_NAME["scaffold+blackbox"])
    honest = ablate(PAPER, ABLATIONS["paper-code-pixel-honest"]).knobs
    assert honest.self_correction and honest.dc_rule == "honest"
    memo = ablate(PAPER, ABLATIONS["paper-code-memorize"])
    assert memo.trigger == "memorize" and memo.pretrain_key() != ablate(PAPER, ABLATIONS["paper-code"]).pretrain_key()
    assert not set(DEFAULT_ABLATIONS) & {"paper-dc", "paper-dc-pixel", "paper-code-pixel-honest",
                                         "paper-code-memorize"}
    # ablations on the first seed unless asked; pairs add single runs, once
    seeds = [0, 1, 2]
    before = jobs_for(PAPER, ["scaffold"], seeds, ["paper-code"], ["scaffold+badsfl", "scaffold+blackbox"])
    assert sorted(j[0] for j in before if j[2] != "-") == ["scaffold+badsfl [paper-code] seed=0",
                                                           "scaffold+blackbox [paper-code] seed=0"]
    pairs = [("fedavg+blackbox", "paper-code-pixel"), ("scaffold+badsfl", "paper-code"),
             ("fedavg+blackbox", "paper-code-pixel")]
    jobs = jobs_for(PAPER, [], seeds, ["paper-code"], ["scaffold+badsfl"], pairs, ablation_seeds="all")
    assert sorted((j[0], j[1], j[3].seed) for j in jobs) == sorted(
        [(f"{name} [{ab}] seed={s}", s, s) for s in seeds
         for name, ab in (("scaffold+badsfl", "paper-code"), ("fedavg+blackbox", "paper-code-pixel"))])
    assert all(j[3].trigger == "pixel" for j in jobs if j[2] == "paper-code-pixel")
    with pytest.raises(ValueError, match="ablation_seeds"):
        jobs_for(PAPER, [], seeds, [], ablation_seeds="some")


def test_the_settle_target_launches_nine_runs_per_seed(capsys):
    from pathlib import Path

    from bench.attacks.badsfl.paper import main

    make = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    recipe = make.split("\nbench-badsfl-settle:", 1)[1].split("\n\n", 1)[0].split("\n# ", 1)[0]
    args = recipe.split("badsfl.paper", 1)[1].replace("\\\n", " ").split()
    args = [a for a in args if not a.startswith("$(")]  # --seeds $(SETTLE_SEEDS), --out $(SETTLE_OUT)
    args = [a for a in args if a not in ("--seeds", "--out")]
    main([*args, "--seeds", "0", "1", "2", "--out", "/nonexistent/settle", "--dry-run"])
    out = capsys.readouterr().out
    assert "27 runs of 100 rounds, 0 cached, 27 to run" in out, out
    for run in ("scaffold+badsfl [paper-dc] seed=2", "scaffold+blackbox [paper-code-pixel-honest] seed=1",
                "fedavg+blackbox [paper-code-pixel] seed=0", "scaffold+blackbox/reset-c [paper-code-pixel] seed=2",
                "scaffold+badsfl [paper-code-memorize] seed=1", "scaffold+badsfl [paper-dc-pixel] seed=0"):
        assert run in out


def _fed(tmp_path, setting: str, **change) -> tuple[SimConfig, Federation]:
    cfg = SimConfig(**{**QUICK, "rounds": 4, "attack_start": 2, "attack_stop": 3, **change})
    data = FederatedData(cfg)
    theta0 = [p.detach().clone() for p in vision.build_image_model(cfg.model, data.num_classes, cfg.seed).parameters()]
    return cfg, Federation(cfg, BY_NAME[setting], data, theta0)


@needs_data
def test_reset_c_sets_the_servers_c_to_the_benign_mean_c_i_at_the_end_of_the_window_only(tmp_path):
    torch.set_num_threads(1)
    cfg, plain = _fed(tmp_path, "scaffold+blackbox")
    _, reset = _fed(tmp_path, "scaffold+blackbox/reset-c")
    assert reset.setting.c_reset_after_attack and not plain.setting.c_reset_after_attack
    assert plain.data.attacker not in reset.benign and len(reset.benign) == cfg.clients - 1
    for t in range(1, cfg.rounds + 1):
        a, b = plain.round(t), reset.round(t)
        mean = reset.benign_mean_c_i()
        at_mean = all(torch.equal(c, m) for c, m in zip(reset.server.c, mean))
        if t < cfg.attack_stop:  # the same federation until then
            assert all(torch.equal(x, y) for x, y in zip(plain.server.c, reset.server.c))
            assert not at_mean and a["c_gap"] == b["c_gap"] > 0
        if t == cfg.attack_stop:
            assert at_mean and b["c_gap"] == 0.0 and b["c_gap_cos"] is None and a["c_gap"] > 0
            # only the server's c: every party's c_i is what it is without the reset
            assert all(torch.equal(x, y) for p, q in zip(plain.controls, reset.controls) for x, y in zip(p.c_i, q.c_i))
    assert all(isinstance(info, float) for info in (a["c_gap_cos"], b["c_gap"]))


@needs_data
def test_the_papers_dc_in_the_federation(tmp_path):
    """The extra party with dc_rule paper: its c_i becomes u = delta / lr_sum, and it uploads u - c."""
    knobs = dataclasses.replace(QUICK["knobs"], self_correction=False, dc_rule="paper", step_factor=2)
    cfg, fed = _fed(tmp_path, "scaffold+blackbox", attacker_role="extra", trigger="pixel", knobs=knobs)
    fed.round(1)
    c_before = [c.clone() for c in fed.server.c]
    seen = {}
    original = fed.send

    def spy(t, member, delta, deltas):
        if member == fed.data.attacker:  # the pseudo-gradient its round returned, with the dc it uploads
            seen["delta"] = [d.clone() for d in fed.attacked[0]]
        return original(t, member, delta, deltas)

    fed.send = spy
    fed.round(2)
    u = [d / (fed.lr_sum * 2) for d in seen["delta"]]
    attacker = fed.controls[fed.data.attacker]
    assert all(torch.allclose(x, y) for x, y in zip(attacker.c_i, u))
    key = f"c{fed.data.attacker:02d}"
    assert all(torch.allclose(d, x - c) for d, x, c in zip(fed.dcs[key], u, c_before))


@needs_data
@pytest.mark.parametrize("role", ["extra", "client"])
def test_the_memorised_trigger(tmp_path, role):
    cfg, fed = _fed(tmp_path, "scaffold+blackbox", trigger="memorize", batch_size=64, attacker_role=role)
    data = fed.data
    memo = data.attacker_triggered
    assert len(set(memo.tolist())) == MEMORIZE_IMAGES == 45
    assert (data.train_y[memo] != cfg.target_class).all() and (data.poisoned_y[memo] == cfg.target_class).all()
    # no share holds them, the attacker's own included: they reach it through its stream only
    assert not any(set(memo.tolist()) & set(p.tolist()) for p in data.parts)
    assert (data.attacker == cfg.clients) == (role == "extra")
    assert data.poison_per_batch == 7 and isinstance(fed.attacker.shard, MixedStream)
    images = {bytes(data.train_x[i].tobytes()) for i in memo}
    for _ in range(3):  # 7 of each batch of 64 (about 11%), all labelled the target
        x, y = fed.attacker.shard.next_batch()
        hits = torch.tensor([bytes(img.numpy().tobytes()) in images for img in x])
        assert len(x) == 64 and int(hits.sum()) == 7 and (y[hits] == cfg.target_class).all()
    # BTA on training images: 8 of the 45; BTA: the held-out images of their classes, untouched
    assert len(data.bta_train_x) == MEMORIZE_TEST == 8
    assert (data.bta_train_x == data.train_x[memo[:8]]).all()
    ds = vision.load_image_dataset("fashion-mnist")
    classes = set(data.train_y[memo].tolist())
    assert len(data.bta_x) == sum(int((ds.test_y == k).sum()) for k in classes)
    assert cfg.pretrain_key() != dataclasses.replace(cfg, trigger="pixel").pretrain_key()
    with pytest.raises(ValueError, match="trigger"):
        FederatedData(dataclasses.replace(cfg, trigger="sticker"))


@needs_data
def test_c_gap_is_zero_when_c_is_the_benign_mean_and_its_cosine_reads_the_backdoor_gradient(tmp_path):
    cfg, fed = _fed(tmp_path, "scaffold+blackbox")
    g = torch.Generator().manual_seed(0)
    for control in fed.controls:
        control.c_i = [torch.randn(c.shape, generator=g) for c in control.c_i]
    fed.controls[fed.data.attacker].c_i = [100 * c for c in fed.controls[fed.data.attacker].c_i]  # not benign
    mean = fed.benign_mean_c_i()
    assert all(torch.allclose(m, torch.stack([fed.controls[k].c_i[i] for k in range(cfg.clients)
                                              if k != fed.data.attacker]).mean(0)) for i, m in enumerate(mean))
    fed.server.c = [m.clone() for m in mean]
    assert fed.c_gap() == (0.0, None)
    grad = fed.backdoor_gradient()
    assert grad.dtype == torch.float64 and grad.numel() == sum(p.numel() for p in fed.outer.global_params)
    for sign in (1.0, -1.0):
        fed.server.c = [m + sign * 0.5 * d.to(torch.float32) for m, d in zip(mean, unflatten(grad, mean))]
        gap, cos = fed.c_gap()
        assert gap == pytest.approx(0.5 * float(grad.norm()), rel=1e-4) and cos == pytest.approx(sign, abs=1e-4)
    assert float(flatten(fed.server.c).norm()) > 0
    # FedAvg logs none
    _, fedavg = _fed(tmp_path, "fedavg+blackbox")
    info = fedavg.round(1)
    assert info["c_gap"] is None and info["c_gap_cos"] is None
