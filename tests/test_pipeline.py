"""Pipeline stages: the stage split is the full model, and S = 2 over gloo trains like S = 1."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from dilocox.data import Corpus, ReplicaShard
from dilocox.diloco import InnerConfig, InnerLoop, OuterOptimizer
from dilocox.model import ModelSpec, ModelSpecError, build_model
from dilocox.stages import build_stage, layer_range, parse_stage, tensor_bytes

TEXT = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
        "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles. ") * 40
H, ROUNDS, SEED = 4, 3, 7


def test_stage_split_reproduces_the_full_model():
    spec = ModelSpec.resolve("tiny")
    whole = build_stage(spec, SEED)
    reference = build_model(spec, 0)
    reference.load_state_dict({whole.full_names[n]: p for n, p in whole.named_parameters()}, strict=True)
    x = torch.randint(0, 256, (2, 32))
    stage0, stage1 = build_stage(spec, SEED, 0, 2), build_stage(spec, SEED, 1, 2)
    assert torch.equal(whole(x), reference(input_ids=x).logits)
    assert torch.equal(stage1(stage0(x)), whole(x))  # per-name init: same weights whatever the split
    # nothing of the other stage is materialised
    assert stage0.lm_head is None and stage1.embed_tokens is None
    assert tensor_bytes(stage0.parameters()) + tensor_bytes(stage1.parameters()) == tensor_bytes(whole.parameters())


def test_stage_arguments_are_checked():
    assert parse_stage("1/4") == (1, 4)
    for bad in ("2/2", "x", "1/0", "-1/2"):
        with pytest.raises(ValueError, match="stage"):
            parse_stage(bad)
    with pytest.raises(ModelSpecError, match="3 stages need at least 3"):
        layer_range(2, 0, 3)
    assert [list(layer_range(4, k, 2)) for k in range(2)] == [[0, 1], [2, 3]]


def _diloco_rounds(inner, shard_tokens, config) -> list[float]:
    """One replica, ROUNDS outer steps of H inner steps (solo outer step: Delta = own delta)."""
    outer = OuterOptimizer(inner.params)
    shard = ReplicaShard(shard_tokens, 32, 4, SEED, shard_key=1)
    losses = []
    for t in range(ROUNDS):
        for i in range(H):
            x, y = shard.next_batch()
            losses.append(inner.inner_step(x, y, global_step=t * H + i))
        outer.step(outer.pseudo_gradient(inner.params))
        inner.load_params(outer.global_params)
    return losses


def _stage_worker(rank: int, world: int, store_path: str, out_path: str, tokens) -> None:
    import torch.distributed as dist

    from dilocox.pipeline import PipelinedInnerLoop

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        spec = ModelSpec.resolve("tiny")
        spec.seq_len = 32
        inner = PipelinedInnerLoop(build_stage(spec, SEED, rank, world), InnerConfig(lr=3e-3, warmup_steps=2),
                                   microbatches=2, group=dist.group.WORLD)
        losses = _diloco_rounds(inner, tokens, None)
        with open(out_path, "w") as f:
            json.dump(losses, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_two_stages_follow_the_one_stage_trajectory(tmp_path):
    """Same seed and data: S = 2 (1F1B over gloo, 2 microbatches) matches S = 1 over 3 outer steps."""
    corpus_file = tmp_path / "text.txt"
    corpus_file.write_text(TEXT)
    tokens = Corpus.from_spec(str(corpus_file), 32).train
    single = InnerLoop(build_stage(ModelSpec.resolve("tiny"), SEED), InnerConfig(lr=3e-3, warmup_steps=2))
    expected = _diloco_rounds(single, tokens, None)

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    outs = [tmp_path / f"stage{k}.json" for k in range(2)]
    procs = [ctx.Process(target=_stage_worker, args=(k, 2, str(tmp_path / "store"), str(outs[k]), tokens))
             for k in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, f"stage process exited with {p.exitcode}"
    got = [json.loads(o.read_text()) for o in outs]
    assert got[0] == got[1]  # every stage reports the replica's loss
    assert len(got[0]) == len(expected) == ROUNDS * H
    assert max(abs(a - b) for a, b in zip(got[0], expected)) < 1e-3, (got[0], expected)
    assert expected[-1] < expected[0] - 0.5  # it learns, so the comparison is not between two flat lines


def _node_memory(num_stages: int, stage_index: int) -> int:
    """What NodeStatus.memory reports for a node of this stage after one inner and one outer step."""
    from dilocox.daemon.replica_state import stage_memory

    from dilocox.compression import CompressionConfig, DenseCompressor
    from dilocox.overlap import OuterSchedule

    module = build_stage(ModelSpec.resolve("tiny"), SEED, stage_index, num_stages)
    inner = InnerLoop(module, InnerConfig())
    for p in inner.params:  # a step allocates AdamW's state
        p.grad = torch.zeros_like(p)
    inner.inner_optimizer.step()
    outer = OuterOptimizer(inner.params)
    outer.step([torch.zeros_like(p) for p in outer.global_params])
    compressor = DenseCompressor([tuple(p.shape) for p in outer.global_params], CompressionConfig())
    return stage_memory(inner, outer, OuterSchedule(outer, "delayed"), compressor).total_bytes


def test_two_stages_hold_half_the_memory_per_node():
    whole = _node_memory(1, 0)
    halves = [_node_memory(2, k) for k in range(2)]
    # params 4 B + AdamW 8 B + theta, momentum, round start 12 B + error feedback 4 B per parameter
    assert whole == 28 * 133_440
    assert sum(halves) == whole and 0.49 < max(halves) / whole < 0.51, (halves, whole)
    # momentum-free outer SGD (the sparse default) holds no momentum buffer, and none is reported; synchronous
    # rounds measure from theta itself (no round-start copy), overlapped ones keep one
    inner = InnerLoop(build_stage(ModelSpec.resolve("tiny"), SEED), InnerConfig())
    outer = OuterOptimizer(inner.params, outer_momentum=0.0, nesterov=False)
    from dilocox.daemon.replica_state import stage_memory

    from dilocox.overlap import OuterSchedule
    from dilocox.sparse import SparseCompressor, SparseConfig

    sparse = SparseCompressor([tuple(p.shape) for p in outer.global_params], SparseConfig())
    assert stage_memory(inner, outer, OuterSchedule(outer, "none"), sparse).outer_optimizer_bytes == 4 * 133_440
    assert stage_memory(inner, outer, OuterSchedule(outer, "adaptive"), sparse).outer_optimizer_bytes == 8 * 133_440


def test_a_stage_takes_the_same_inner_step_arguments_as_a_whole_model():
    # ReplicaState calls either loop with the same keywords (SCAFFOLD's after_step included): a stage
    # node that lacked one failed its first inner step
    import inspect

    from dilocox.pipeline import PipelinedInnerLoop
    whole, stage = (inspect.signature(c.inner_step).parameters for c in (InnerLoop, PipelinedInnerLoop))
    assert list(stage) == list(whole)
