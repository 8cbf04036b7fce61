"""The pixel-backdoor node (bench/attacks/badsfl/pixel_node.py) without processes: it poisons half of each batch with
stamped images of its own shard labelled the target, only in its window, boosts its pseudo_gradient only there, and
refuses a node without images; the harness federation it is compared with matches the swarm's."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from dilocox.daemon.redteam import AttackError

from bench.attacks.badsfl.attacks import TARGET_CLASS
from bench.attacks.badsfl.pixel_node import FIRST, LAST, BoostedPixelBackdoor, PixelBackdoor, harness_config
from bench.attacks.badsfl.sim import PIXEL


def _state(round_index: int):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 200, (40, 28, 28), dtype=np.uint8)
    labels = np.arange(40) % 10
    dataset = SimpleNamespace(train_x=images, train_y=labels)
    return SimpleNamespace(round=round_index, workload=SimpleNamespace(dataset=dataset),
                           shard=SimpleNamespace(indices=np.arange(20)))


def test_half_of_each_batch_is_stamped_and_relabelled_in_the_window_only():
    attack = PixelBackdoor(SimpleNamespace(seed=0))
    state = _state(FIRST)
    attack.bind(state)
    x, y = torch.zeros(64, 28, 28, dtype=torch.uint8), torch.zeros(64, dtype=torch.int64)
    px, py = attack.batch(x, y)
    stamped = (px[:, PIXEL[0], PIXEL[1]] == 255).all(dim=(1, 2))
    assert int(stamped.sum()) == 32 and (py[stamped] == TARGET_CLASS).all() and (py[~stamped] == 0).all()
    assert (x == 0).all()  # the caller's batch is not changed in place
    for outside in (FIRST - 1, LAST + 1):
        state.round = outside
        same_x, same_y = attack.batch(x, y)
        assert same_x is x and same_y is y


def test_only_the_boosted_attacker_scales_and_only_in_its_window():
    grads = [torch.ones(3), torch.full((2, 2), -2.0)]
    for cls, factor in ((PixelBackdoor, 1.0), (BoostedPixelBackdoor, 30.0)):
        attack = cls(SimpleNamespace(seed=0))
        attack.bind(_state(FIRST))
        inside = attack.pseudo_gradient(grads, LAST)
        assert all(torch.equal(a, b * factor) for a, b in zip(inside, grads))
        assert attack.pseudo_gradient(grads, LAST + 1) is grads


def test_a_node_without_images_or_without_other_classes_is_refused():
    attack = PixelBackdoor(SimpleNamespace(seed=0))
    with pytest.raises(AttackError, match="image workload"):
        attack.bind(SimpleNamespace(workload=SimpleNamespace(), shard=None))
    state = _state(FIRST)
    state.shard.indices = np.flatnonzero(state.workload.dataset.train_y == TARGET_CLASS)
    with pytest.raises(AttackError, match="no image of another class"):
        attack.bind(state)


def test_the_harness_federation_is_the_swarms():
    cfg = harness_config(1, rounds=60, nodes=4)
    assert (cfg.clients, cfg.per_round, cfg.rounds, cfg.pretrain_rounds) == (4, 4, 60, 0)
    assert (cfg.attack_start, cfg.attack_stop, cfg.trigger, cfg.attacker_role) == (FIRST, LAST, "pixel", "client")
    assert cfg.knobs.self_correction  # a real node corrects its own steps with its c_i
