"""--precision bf16, --micro-batch-size, --activation-checkpointing and --device on CPU, in-process: what each
changes in an inner step (the swarm-level figures are make bench-scale's)."""

from __future__ import annotations

import pytest
import torch

from dilocox.data import Corpus, ReplicaShard
from dilocox.diloco import InnerConfig
from dilocox.model import ModelSpec


def _loop(precision="fp32", micro=0, checkpointing=False, seed=0):
    from dilocox.diloco import InnerLoop
    from dilocox.stages import build_stage

    module = build_stage(ModelSpec.resolve("tiny"), seed)
    module.activation_checkpointing = checkpointing
    return InnerLoop(module, InnerConfig(lr=3e-3, warmup_steps=2, total_steps=100, precision=precision,
                                         micro_batch_size=micro))


def _batches(n=3, seed=0):
    corpus = Corpus.from_spec("builtin:shakespeare", 64)
    shard = ReplicaShard(corpus.train, 64, 8, seed=seed, shard_key=0)
    return [shard.next_batch() for _ in range(n)]


def test_accumulating_four_micro_batches_gives_one_batchs_update():
    """--micro-batch-size 2 of a batch of 8: the same losses and, after 3 AdamW steps, the same parameters to
    1e-6 (the sums differ only in their order of float additions)."""
    whole, micro = _loop(), _loop(micro=2)
    for step, (x, y) in enumerate(_batches()):
        a, b = whole.inner_step(x, y, step), micro.inner_step(x, y, step)
        assert abs(a - b) < 1e-5, (a, b)
    diff = max(float((p - q).detach().abs().max()) for p, q in zip(whole.params, micro.params))
    assert diff < 1e-6, diff


def test_activation_checkpointing_recomputes_the_same_gradients():
    plain, ckpt = _loop(), _loop(checkpointing=True)
    for step, (x, y) in enumerate(_batches(2)):
        assert plain.inner_step(x, y, step) == ckpt.inner_step(x, y, step)
    assert all(torch.equal(p, q) for p, q in zip(plain.params, ckpt.params))


def test_bf16_autocast_keeps_fp32_weights_and_tracks_fp32_loss():
    fp32, bf16 = _loop(), _loop(precision="bf16")
    batches = _batches(40)
    for step, (x, y) in enumerate(batches):
        a, b = fp32.inner_step(x, y, step), bf16.inner_step(x, y, step)
    assert all(p.dtype == torch.float32 for p in bf16.params)
    assert abs(a - b) < 0.05 * a and b < 4.5, (a, b)  # learning (from ln 256 = 5.5), close to fp32
    val = _batches(2, seed=9)
    assert abs(fp32.evaluate(val) - bf16.evaluate(val)) < 0.05


def test_devices_resolve_or_name_what_is_missing():
    from dilocox.diloco import training_device

    assert training_device("cpu") == "cpu"
    assert training_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match=r"device cuda:7: this process sees \d+ CUDA device"):
        training_device("cuda:7")
