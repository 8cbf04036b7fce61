"""One DiLoCo replica split into pipeline stages, trained in-process (each stage a thread, gloo over
loopback: tests/harness/threaded_gloo.py). Used by tests/test_pipeline_bf16.py and bench/stages_bf16.py.

Solo outer steps (the replica's own pseudo-gradient is the aggregate, DiLoCo's outer Nesterov), so a run
is deterministic for a seed and compares precisions or micro-batch splits of the same replica.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dilocox.data import Corpus, ReplicaShard, validation_batches
from dilocox.diloco import InnerConfig, OuterOptimizer
from dilocox.model import ModelSpec
from dilocox.pipeline import PipelinedInnerLoop
from dilocox.stages import build_stage
from tests.harness.threaded_gloo import run_ranks


@dataclass
class StagedRun:
    """What one run of ``train_staged_replica`` reports (losses in nats/token)."""

    losses: list[list[float]]  # per stage, the replica's training loss of every inner step
    val_loss_start: float  # validation loss of theta before the first step
    val_loss: float  # validation loss of theta after the last outer step
    s_per_inner_step: float  # wall seconds per inner step (stage 0; the stages are threads sharing the CPU)
    boundary_bytes: int  # bytes received across the stage boundaries in one inner step (activations + gradients)
    boundary_dtypes: set = field(default_factory=set)  # dtypes of the receive buffers
    params_dtypes: set = field(default_factory=set)  # dtypes of parameters and AdamW state, all stages


def _received_bytes(inner: PipelinedInnerLoop) -> tuple[int, set]:
    """Bytes and dtypes of the stage's receive buffers for one schedule step (one per micro-batch)."""
    buffers = [info.buffer for infos in list(inner.stage.args_recv_info.values())
               + list(inner.stage.grad_recv_info.values()) for info in infos if info.buffer is not None]
    return sum(b.numel() * b.element_size() for b in buffers), {b.dtype for b in buffers}


def train_staged_replica(precision: str = "fp32", micro_batch_size: int = 0, microbatches: int = 2, seed: int = 7,
                         rounds: int = 3, inner_steps: int = 5, num_stages: int = 2, schedule: str = "1f1b",
                         model: str = "tiny", seq_len: int = 32, batch_size: int = 8, lr: float = 3e-3,
                         eval_batches: int = 4, data: str = "builtin:shakespeare") -> StagedRun:
    """Train one replica of ``num_stages`` stages for ``rounds`` outer steps of ``inner_steps`` inner steps.
    Raises what a stage raised (e.g. ModelSpecError for a batch that does not split into micro-batches)."""
    spec = ModelSpec.resolve(model)
    spec.seq_len = seq_len
    corpus = Corpus.from_spec(data, seq_len)
    val = validation_batches(corpus, seq_len, batch_size, eval_batches)
    # built here, not in the threads: transformers' lazy imports are not thread-safe
    modules = [build_stage(spec, seed, k, num_stages) for k in range(num_stages)]
    config = InnerConfig(lr=lr, warmup_steps=2, total_steps=rounds * inner_steps, precision=precision,
                         micro_batch_size=micro_batch_size)

    def stage(rank: int, group) -> dict:
        inner = PipelinedInnerLoop(modules[rank], config, microbatches, schedule, group=group)
        outer = OuterOptimizer(inner.params)
        shard = ReplicaShard(corpus.train, seq_len, batch_size, seed, shard_key=1)
        val_start = inner.evaluate(val)
        losses, start = [], time.perf_counter()
        for t in range(rounds):
            for i in range(inner_steps):
                x, y = shard.next_batch()
                losses.append(inner.inner_step(x, y, global_step=t * inner_steps + i))
            outer.step(outer.pseudo_gradient(inner.params))
            inner.load_params(outer.global_params)
        elapsed = time.perf_counter() - start
        received, dtypes = _received_bytes(inner)  # the last step's buffers: a training step's
        state = [v for s in inner.inner_optimizer.state.values() for v in s.values() if v.dim() > 0]
        return dict(losses=losses, val_start=val_start, elapsed=elapsed, received=received, dtypes=dtypes,
                    params=[p.dtype for p in inner.params] + [v.dtype for v in state], val=inner.evaluate(val))

    results = run_ranks(num_stages, stage)
    return StagedRun(losses=[r["losses"] for r in results], val_loss_start=results[0]["val_start"],
                     val_loss=results[0]["val"], s_per_inner_step=results[0]["elapsed"] / (rounds * inner_steps),
                     boundary_bytes=sum(r["received"] for r in results),
                     boundary_dtypes=set().union(*(r["dtypes"] for r in results)),
                     params_dtypes=set().union(*(set(r["params"]) for r in results)))
