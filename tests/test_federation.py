"""bench/federation.py's rounds do what they claim: with the dense fp32 code the outer step applies the plain mean
of the members' pseudo-gradients through OuterOptimizer, the per-contribution hooks see and replace what a member
sends, excluded replicas do not train, and the tiny model's loss falls over a few rounds."""

from __future__ import annotations

import torch

from bench.federation import Contributions, Federation, Method, ShardReplica, flatten, unflatten
from dilocox.data import Corpus, ReplicaShard, validation_batches
from dilocox.diloco import InnerConfig, InnerLoop, OuterOptimizer
from dilocox.model import ModelSpec
from dilocox.sparse import SparseConfig
from dilocox.stages import build_stage

H, SEED = 3, 7
SPEC = ModelSpec.resolve("tiny")
CORPUS = Corpus.from_spec("builtin:shakespeare", SPEC.seq_len)
INNER = InnerConfig(lr=1e-3, warmup_steps=2, total_steps=H * 4)


class Recorder(Contributions):
    """Keeps every member's honest pseudo-gradient and payload; ``zero``: that member sends zeros."""

    def __init__(self, zero: int | None = None):
        self.deltas, self.payloads, self.zero = {}, {}, zero

    def send(self, t, member, delta, deltas):
        self.deltas[member] = [d.clone() for d in delta]
        return [torch.zeros_like(d) for d in delta] if member == self.zero else delta

    def encoded(self, t, member, payload, sent):
        self.payloads[(t, member)] = payload


def _federation(method: Method, replicas: int = 2, rounds: int = 4, hooks: Contributions | None = None) -> Federation:
    torch.manual_seed(SEED)
    reps = [ShardReplica(InnerLoop(build_stage(SPEC, SEED, 0, 1), INNER),
                         ReplicaShard(CORPUS.train, SPEC.seq_len, SPEC.batch_size, SEED, r), H)
            for r in range(replicas)]
    return Federation(method, reps, INNER, H, rounds, SEED, contributions=hooks)


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    """Equal to the fp32 code's precision: the exact mean (dilocox/exact_mean.py) keeps 22 bits below a bound a
    few times the largest value (the fp16 and int8 codes' second rounds do not pass)."""
    return all(float((g - w).abs().max()) <= 2 ** -14 * float(w.abs().max()) for g, w in zip(got, want))


def test_a_dense_fp32_round_applies_the_plain_mean_through_the_outer_optimizer():
    method = Method("fp32")
    rec = Recorder()
    fed = _federation(method, replicas=2, hooks=rec)
    theta0 = [p.clone() for p in fed.outer.global_params]
    ref = OuterOptimizer(theta0, method.outer_lr, method.outer_momentum, method.nesterov, ramp_steps=4)
    for t in (1, 2):
        out = fed.round(t)
        assert _close(out.mean, [(a + b) / 2 for a, b in zip(rec.deltas[0], rec.deltas[1])])
        ref.step(out.mean, outer_step=t)
        assert all(torch.equal(a, b) for a, b in zip(ref.global_params, fed.outer.global_params))
    assert any(not torch.equal(a, b) for a, b in zip(theta0, fed.outer.global_params))
    # synchronous rounds re-base every member on theta
    for rep in fed.replicas:
        assert all(torch.equal(p.detach(), t) for p, t in zip(rep.params, fed.outer.global_params))
    assert out.payload == 4 * fed.numel and out.upload == out.payload  # 2 x payload x (k - 1) / k, k = 2


def test_hooks_replace_what_a_member_sends_and_see_each_sparse_payload():
    rec = Recorder(zero=1)
    fed = _federation(Method("fp32"), replicas=2, hooks=rec)
    out = fed.round(1)
    assert _close(out.mean, [d / 2 for d in rec.deltas[0]])  # (delta_0 + 0) / 2
    rec = Recorder()
    sparse = Method("sparse", codec="sparse", outer_lr=1.0, outer_momentum=0.0, nesterov=False,
                    sparse=SparseConfig(topk=128, rice=True))
    fed = _federation(sparse, replicas=3, hooks=rec)
    fed.round(1)
    fed.round(2, members=[0, 2])  # replica 1 excluded: it neither trains nor sends
    assert sorted(rec.payloads) == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 2)]
    assert all(torch.equal(p.detach(), t) for p, t in zip(fed.replicas[0].params, fed.outer.global_params))
    assert not all(torch.equal(p.detach(), t) for p, t in zip(fed.replicas[1].params, fed.outer.global_params))


def test_the_loss_falls_over_a_few_rounds():
    fed = _federation(Method("sparse", codec="sparse", outer_lr=1.0, outer_momentum=0.0, nesterov=False), replicas=2)
    val = validation_batches(CORPUS, SPEC.seq_len, SPEC.batch_size, 2)
    evaluator = InnerLoop(build_stage(SPEC, SEED, 0, 1), INNER)

    def loss() -> float:
        evaluator.load_params(fed.outer.global_params)
        return evaluator.evaluate(val)

    before = loss()
    for t in range(1, 5):
        fed.round(t)
    assert loss() < before - 0.05


def test_a_plain_round_is_the_robust_rule_over_flat_vectors_and_a_member_that_sat_out_starts_from_theta():
    rec = Recorder()
    fed = _federation(Method("plain", codec="plain", outer_lr=1.0, outer_momentum=0.0, nesterov=False), replicas=3,
                      hooks=rec)
    fed.round(1, members=[0, 2])
    rec.deltas.clear()
    out = fed.round(2)
    assert sorted(out.vectors) == ["r0", "r1", "r2"]
    want = (flatten(rec.deltas[0]) + flatten(rec.deltas[1]) + flatten(rec.deltas[2])) / 3
    assert float((out.flat - want).abs().max()) <= 1e-12 * float(want.abs().max())
    assert all(torch.equal(a, b) for a, b in zip(out.mean, unflatten(out.flat, fed.outer.global_params)))

    # replica 1 sat round 1 out: its params are still theta_0 until round 2 starts it from theta_1
    fed = _federation(Method("plain", codec="plain", outer_lr=1.0, outer_momentum=0.0, nesterov=False), replicas=2)
    starts = []
    steps = fed.replicas[1].inner_steps
    fed.replicas[1].inner_steps = lambda t, a, b: (starts.append([p.detach().clone() for p in fed.replicas[1].params]),
                                                   steps(t, a, b))
    fed.round(1, members=[0])
    theta1 = [p.clone() for p in fed.outer.global_params]
    fed.round(2)
    assert all(torch.equal(a, b) for a, b in zip(starts[0], theta1))
