"""Pipeline stages in bf16 with micro-batches, in-process: each stage a thread, gloo over loopback
(tests/harness/threaded_gloo.py). A 2-stage replica of the tiny model trains in bf16 with fp32 master
weights and AdamW state, sends bf16 activations and gradients between its stages, and ends within 2% of
the same replica in fp32; ``micro_batch_size`` sets the sequences per pipeline micro-batch."""

from __future__ import annotations

import pytest
import torch

from dilocox.data import Corpus, ReplicaShard
from dilocox.diloco import InnerConfig
from dilocox.model import ModelSpec, ModelSpecError
from dilocox.pipeline import PipelinedInnerLoop, pipeline_microbatches
from dilocox.stages import build_stage
from tests.harness.staged_replica import train_staged_replica
from tests.harness.threaded_gloo import run_ranks

BATCH, SEQ, HIDDEN = 8, 32, 64  # the harness's defaults; tiny's hidden size


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_two_stages_train_in_bf16_with_micro_batches(schedule):
    run = train_staged_replica("bf16", micro_batch_size=2, rounds=4, inner_steps=5, schedule=schedule)
    assert run.losses[0] == run.losses[1]  # both stages report the replica's loss
    assert run.losses[0][-1] < run.losses[0][0] - 1.0, run.losses[0]  # from ln 256 = 5.5
    assert run.val_loss < run.val_loss_start - 1.0, (run.val_loss_start, run.val_loss)
    assert run.params_dtypes == {torch.float32}  # master weights and AdamW state
    # one bf16 activation forward and its bf16 gradient back per sequence, whatever the micro-batch split
    assert run.boundary_dtypes == {torch.bfloat16}
    assert run.boundary_bytes == 2 * BATCH * SEQ * HIDDEN * 2


def test_bf16_stages_end_within_2_percent_of_fp32():
    """20 outer steps of H = 5, 4 micro-batches of 2, seed 7: only the precision differs."""
    fp32, bf16 = (train_staged_replica(p, micro_batch_size=2, rounds=20, inner_steps=5) for p in ("fp32", "bf16"))
    assert fp32.val_loss < fp32.val_loss_start - 2.0, (fp32.val_loss_start, fp32.val_loss)  # it learned
    assert abs(bf16.val_loss - fp32.val_loss) < 0.02 * fp32.val_loss, (bf16.val_loss, fp32.val_loss)
    assert fp32.boundary_dtypes == {torch.float32} and bf16.boundary_bytes * 2 == fp32.boundary_bytes


def test_micro_batch_size_sets_the_pipeline_micro_batches():
    assert pipeline_microbatches(8, 4) == 4
    assert pipeline_microbatches(8, 3, micro_batch_size=2) == 4  # microbatches is not used then
    assert pipeline_microbatches(8, 4, micro_batch_size=8, num_stages=2, schedule="gpipe") == 1
    # 2 sequences each is what microbatches=4 gives: the same trajectory, bit for bit
    a = train_staged_replica("fp32", micro_batch_size=2, microbatches=1, rounds=1, inner_steps=3)
    b = train_staged_replica("fp32", micro_batch_size=0, microbatches=4, rounds=1, inner_steps=3)
    assert a.losses == b.losses and a.val_loss == b.val_loss


@pytest.mark.parametrize("micro, microbatches, message", [
    (3, 4, "micro_batch_size=3 must divide batch_size=8"),
    (16, 4, "micro_batch_size=16 must divide batch_size=8"),
    (0, 3, "microbatches=3 must divide batch_size=8"),
    # torch's 1F1B needs a micro-batch per stage in flight
    (8, 4, r"batch_size=8 / micro_batch_size=8 gives 1 pipeline micro-batch\(es\), fewer than the 2 stages the 1f1b"),
    (0, 1, r"microbatches=1 gives 1 pipeline micro-batch\(es\), fewer than the 2 stages the 1f1b"),
])
def test_a_batch_that_does_not_split_is_named(micro, microbatches, message):
    with pytest.raises(ModelSpecError, match=message):
        pipeline_microbatches(8, microbatches, micro, num_stages=2, schedule="1f1b")


def test_a_stage_refuses_a_training_batch_that_does_not_split():
    with pytest.raises(ModelSpecError, match="micro_batch_size=3 must divide batch_size=8"):
        train_staged_replica("bf16", micro_batch_size=3, rounds=1, inner_steps=1)


def test_a_short_validation_batch_runs_as_one_micro_batch():
    """The last validation batch of a small set may not split: it is evaluated whole, not refused."""
    spec = ModelSpec.resolve("tiny")
    spec.seq_len = SEQ
    modules = [build_stage(spec, 7, k, 2) for k in range(2)]
    x, y = ReplicaShard(Corpus.from_spec("builtin:shakespeare", SEQ).val, SEQ, BATCH, 0, shard_key=0).next_batch()

    def evaluate(rank, group):
        inner = PipelinedInnerLoop(modules[rank], InnerConfig(micro_batch_size=4), microbatches=2, group=group)
        return inner.evaluate([(x, y), (x[:6], y[:6])]), inner.evaluate([(x, y)]), inner.evaluate([(x[:6], y[:6])])

    both, full, short = run_ranks(2, evaluate)[0]
    assert both == pytest.approx((full + short) / 2, rel=1e-6) and short > 0


@pytest.mark.integration
@pytest.mark.timeout(300)  # about 60 s; the wait's own deadline fails first, with both nodes' logs
def test_two_stage_nodes_train_in_bf16_with_micro_batches(tmp_path):
    """The daemon takes --precision bf16 and --micro-batch-size on stage nodes: one replica of two nodes trains."""
    import signal

    from tests.harness.localswarm import wait_all
    from tests.helpers import FAST, start

    args = FAST + ["--run-id", "staged-bf16", "--overlap", "none", "--pipeline-addr", "127.0.0.1:0",
                   "--precision", "bf16", "--micro-batch-size", "2"]
    a0 = start(tmp_path, "a0", args + ["--stage", "0/2"])
    nodes = [a0]
    try:
        nodes.append(start(tmp_path, "a1", args + ["--stage", "1/2", "--join", a0.join_maddr]))

        def losses(n) -> dict:
            return {r["outer_step"]: r["loss"] for r in n.metrics()}
        wait_all(nodes, lambda: all(len(losses(n)) >= 3 for n in nodes), 180, "three rounds of both stages")
        common = sorted(set(losses(nodes[0])) & set(losses(nodes[1])))
        assert [losses(nodes[0])[t] for t in common] == pytest.approx([losses(nodes[1])[t] for t in common], abs=1e-6)
        for n in nodes:
            s = n.status()
            assert s.num_stages == 2 and len(s.replica_members) == 2, s
            assert s.loss < s.initial_loss - 0.5, (s.loss, s.initial_loss)
    finally:
        for n in nodes:
            n.terminate(signal.SIGKILL)
