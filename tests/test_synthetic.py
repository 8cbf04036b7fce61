"""The emulated workload (--workload synthetic:PARAMS:STEP_S): spec parsing, shapes, a deterministic update
per inner step that takes STEP_S, and a ReplicaState built on it (pure, no network)."""

from __future__ import annotations

import math
import time

import pytest
import torch
from dilocox.daemon.config import ConfigError, NodeConfig, load_config
from dilocox.daemon.replica_state import ReplicaState

from dilocox.diloco import InnerConfig
from dilocox.synthetic import SLICES, SyntheticWorkload, WorkloadSpecError, parse_spec, shapes_for
from dilocox.workload import make_workload


@pytest.mark.parametrize("spec,params,step_s", [("synthetic:25M:0.5", 25_000_000, 0.5),
                                                ("synthetic:1.5k:0", 1500, 0.0),
                                                ("synthetic:1e6:2", 1_000_000, 2.0),
                                                ("synthetic:2G:0.01", 2_000_000_000, 0.01)])
def test_spec_parses(spec, params, step_s):
    assert parse_spec(spec) == (params, step_s)


@pytest.mark.parametrize("spec,words", [("synthetic:25M", "expected synthetic:PARAMS:STEP_S"),
                                        ("synthetic:0:1", "PARAMS must be"), ("synthetic:5T:1", "expected"),
                                        ("synthetic:10:-1", "expected"), ("synthetic:10:99999", "STEP_S must be")])
def test_bad_specs_name_the_problem(spec, words):
    with pytest.raises(WorkloadSpecError, match=words):
        parse_spec(spec)


def test_shapes_hold_every_value_in_matrices_of_at_most_2_24():
    for n in (1, 4095, 4096, 4097, (1 << 24) + 5, 3 * (1 << 24) + 4096 * 7 + 3):
        shapes = shapes_for(n)
        assert sum(math.prod(s) for s in shapes) == n
        assert all(math.prod(s) <= 1 << 24 for s in shapes)


def test_inner_steps_write_a_deterministic_update_and_take_step_s():
    w = SyntheticWorkload.from_spec("synthetic:100k:0.02")
    runs = []
    for _ in range(2):
        model = w.build(seed=3, stage_index=0, num_stages=1)
        inner = w.inner_loop(model, InnerConfig(lr=1e-3, warmup_steps=0, total_steps=100), seed=3, shard_key=7)
        start = [p.detach().clone() for p in inner.params]
        shard = w.shard(3, 7)
        began = time.monotonic()
        for i in range(SLICES):
            inner.inner_step(*shard.next_batch(), i)
        took = time.monotonic() - began
        assert took >= SLICES * 0.02 * 0.95, took
        delta = torch.cat([(s - p.detach()).reshape(-1) for s, p in zip(start, inner.params)])
        assert bool((delta != 0).all())  # every slice moved once
        runs.append(delta)
    assert torch.equal(runs[0], runs[1])
    other = w.inner_loop(w.build(3, 0, 1), InnerConfig(lr=1e-3, warmup_steps=0), seed=3, shard_key=8)
    other.inner_step(*w.shard(3, 8).next_batch(), 0)
    assert not torch.equal(other.params[0], w.build(3, 0, 1).values[0])  # another replica pulls elsewhere
    assert shard.position == SLICES and shard.next_batch()[0].numel() == w.samples_per_step


def test_a_node_config_builds_a_replica_on_it():
    cfg = load_config({"workload": "synthetic:50k:0", "inner_steps": 4}, environ={})
    assert "workload=synthetic:50k " in cfg.swarm_settings()
    # STEP_S is the emulated machine's speed: a slower node is the same swarm, a bigger model is not
    slower = load_config({"workload": "synthetic:50k:0.5", "inner_steps": 4}, environ={})
    assert slower.settings_digest() == cfg.settings_digest()
    assert load_config({"workload": "synthetic:60k:0", "inner_steps": 4}, environ={}).settings_digest() != \
        cfg.settings_digest()
    assert cfg.settings_digest() != load_config({"inner_steps": 4}, environ={}).settings_digest()
    w = make_workload(cfg.model, cfg.data, None, None, 1, workload=cfg.workload)
    state = ReplicaState(cfg, w, shard_key=1)
    state.begin_round()
    for i in range(4):
        state.inner_step(*state.shard.next_batch(), i)
    delta = state.pseudo_gradient()
    assert sum(d.numel() for d in delta) == 50_000 and any(bool(d.abs().sum() > 0) for d in delta)
    loss, accuracy = state.evaluate()
    assert loss > 0 and math.isnan(accuracy)
    with pytest.raises(ConfigError, match="workload"):
        load_config({"workload": "real:1B"}, environ={})
    with pytest.raises(WorkloadSpecError, match="pipeline stages"):
        w.build(0, 0, 2)
    assert NodeConfig(workload=None).workload is None
