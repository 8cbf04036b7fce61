"""Pure algorithm pieces: outer Nesterov step, pseudo-gradient, schedule, data shards, checkpoints."""

from __future__ import annotations

import itertools

import pytest
import torch

from dilocox.checkpoint import load_latest_checkpoint, save_checkpoint
from dilocox.data import Corpus, DataError, ReplicaShard, load_documents
from dilocox.diloco import InnerConfig, InnerLoop, OuterOptimizer, params_digest
from dilocox.model import ModelSpec
from dilocox.stages import build_stage


def test_outer_step_is_nesterov_sgd_on_the_pseudo_gradient():
    theta = [torch.tensor([1.0, -2.0])]
    outer = OuterOptimizer(theta, outer_lr=0.7, outer_momentum=0.9, nesterov=True)
    local = [torch.tensor([0.5, -1.0])]
    delta = outer.pseudo_gradient(local)
    assert torch.allclose(delta[0], torch.tensor([0.5, -1.0]))  # theta - x
    outer.step(delta)
    # first step: buf = g; update = g + 0.9 * buf = 1.9 g
    assert torch.allclose(outer.global_params[0], torch.tensor([1.0, -2.0]) - 0.7 * 1.9 * delta[0])
    outer.step(delta)
    buf = 0.9 * delta[0] + delta[0]
    expected = torch.tensor([1.0, -2.0]) - 0.7 * 1.9 * delta[0] - 0.7 * (delta[0] + 0.9 * buf)
    assert torch.allclose(outer.global_params[0], expected)
    assert torch.allclose(outer.momentum_buffers()[0], buf)


def test_outer_lr_ramps_linearly_by_outer_step_and_then_holds():
    outer = OuterOptimizer([torch.zeros(2)], outer_lr=2.5, outer_momentum=0.0, nesterov=False,
                           outer_lr_final=4.5, ramp_steps=101)
    assert [outer.lr_at(t) for t in (1, 51, 101, 500)] == [2.5, 3.5, 4.5, 4.5]
    assert OuterOptimizer([torch.zeros(2)], 0.7).lr_at(77) == 0.7  # no final lr: constant
    g = [torch.tensor([1.0, -2.0])]
    outer.step(g, outer_step=51)  # plain SGD at lr_at(51)
    assert torch.equal(outer.global_params[0], -3.5 * g[0])
    outer.step(g)  # no index: the last lr set
    assert torch.equal(outer.global_params[0], -7.0 * g[0])
    with pytest.raises(ValueError, match="ramp_steps"):
        OuterOptimizer([torch.zeros(2)], 1.0, outer_lr_final=2.0, ramp_steps=0)
    with pytest.raises(ValueError, match="> 0"):
        OuterOptimizer([torch.zeros(2)], 1.0, outer_lr_final=-1.0)


def test_schedule_warms_up_then_decays():
    cfg = InnerConfig(lr=1e-3, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert cfg.lr_at(0) == pytest.approx(1e-4)
    assert cfg.lr_at(9) == pytest.approx(1e-3)
    assert cfg.lr_at(60) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert cfg.lr_at(500) == pytest.approx(1e-4)


def test_tiny_model_learns_and_same_seed_same_weights():
    spec = ModelSpec.resolve("tiny")
    m1, m2 = build_stage(spec, seed=3), build_stage(spec, seed=3)
    assert params_digest(list(m1.parameters())) == params_digest(list(m2.parameters()))
    corpus = Corpus.from_spec("builtin:shakespeare", spec.seq_len)
    shard = ReplicaShard(corpus.train, spec.seq_len, spec.batch_size, seed=0, shard_key=1)
    loop = InnerLoop(m1, InnerConfig(lr=3e-3, warmup_steps=5, total_steps=60))
    losses = [loop.inner_step(*shard.next_batch(), global_step=i) for i in range(60)]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0


def test_shards_are_deterministic_and_distinct():
    corpus = Corpus.from_spec("builtin:shakespeare", 32)
    a1, a2 = (ReplicaShard(corpus.train, 32, 4, seed=0, shard_key=7) for _ in range(2))
    b = ReplicaShard(corpus.train, 32, 4, seed=0, shard_key=8)
    for _ in range(3):
        xa, ya = a1.next_batch()
        assert torch.equal(xa, a2.next_batch()[0]) and not torch.equal(xa, b.next_batch()[0])
        assert torch.equal(xa[:, 1:], ya[:, :-1])
    assert len(corpus.train) > 4_000_000 and len(corpus.val) > 200_000


def test_directory_specs(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 100)
    (tmp_path / "skip.bin").write_bytes(b"\x00\xff")
    assert load_documents(str(tmp_path)) == ["hello world " * 100]
    with pytest.raises(DataError, match="too small"):
        Corpus.from_spec(str(tmp_path / "a.txt"), seq_len=2000)
    with pytest.raises(DataError, match="unknown builtin"):
        load_documents("builtin:nothing")


def test_checkpoint_falls_back_to_the_last_good_one(tmp_path):
    save_checkpoint(tmp_path, 1, {"x": torch.ones(3)})
    path = save_checkpoint(tmp_path, 2, {"x": torch.full((3,), 2.0)})
    path.write_bytes(path.read_bytes()[:-10])  # truncated
    found_path, state = load_latest_checkpoint(tmp_path)
    assert found_path.name == "step-00000001.pt" and torch.equal(state["x"], torch.ones(3))
    assert not list(tmp_path.glob(".*tmp*"))


def test_the_outer_step_leaves_the_aggregate_as_it_was():
    """rounds.py hands the same aggregate to the outer step and then to the catch-up log (dilocox/catchup.py):
    the step must not change it (torch's Nesterov SGD adds momentum into the gradient in place)."""
    g = torch.Generator().manual_seed(0)
    for (lr, mu, nesterov), foreach in itertools.product(((0.7, 0.9, True), (0.7, 0.9, False), (3.5, 0.0, False)),
                                                         (None, True)):
        outer = OuterOptimizer([torch.randn(7, generator=g)], lr, mu, nesterov)
        outer.outer_optimizer.param_groups[0]["foreach"] = foreach  # True: the path torch takes on GPUs
        for _ in range(3):
            aggregate = [torch.randn(7, generator=g)]
            kept = aggregate[0].clone()
            outer.step(aggregate)
            assert torch.equal(aggregate[0], kept)
