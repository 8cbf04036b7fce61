"""SharedCompressor / SharedRound (dilocox/shared_round.py): the buffers change only when a round is committed,
a checkpoint holds both, and bad checkpoint contents get a clear error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dilocox.shared_index import SharedIndexConfig
from dilocox.shared_round import SharedCompressor

SHAPES = [(64, 128), (128,)]
CFG = SharedIndexConfig(chunk=1024, topk=64, bits=2, result_bits=4, beta=0.9, selection="union")


def grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def test_a_round_changes_the_buffers_only_when_committed():
    c = SharedCompressor(SHAPES, CFG)
    r = c.begin(grads(1))
    assert torch.equal(r.m, torch.cat([g.reshape(-1) for g in grads(1)]))  # e = 0: m = delta
    positions = np.arange(0, r.m.numel(), 7, dtype=np.int64)
    sent = r.member.contribute(r.m, positions)
    r.feedback.quantize(np.ones(len(positions), dtype=np.float32) / 3, positions, r.m.numel(), CFG)
    r.settle(1234)
    assert r.stats.payload_bytes == 1234 and 0 < r.stats.relative_error < 1
    assert not c.member.error.any() and not c.feedback.error.any()  # an uncommitted round left nothing
    c.commit(r)
    assert torch.allclose(c.member.error[positions], r.m[positions] - torch.from_numpy(sent))
    assert c.feedback.error[positions].any()
    nxt = c.begin(grads(2))  # m = beta e + delta
    assert torch.allclose(nxt.m, 0.9 * c.member.error + torch.cat([g.reshape(-1) for g in grads(2)]))


def test_the_checkpoint_holds_both_buffers_and_bad_ones_are_named():
    c = SharedCompressor(SHAPES, CFG)
    r = c.begin(grads(3))
    positions = np.arange(0, r.m.numel(), 5, dtype=np.int64)
    r.member.contribute(r.m, positions)
    r.feedback.quantize(np.full(len(positions), 0.3, dtype=np.float32), positions, r.m.numel(), CFG)
    c.commit(r)
    again = SharedCompressor(SHAPES, CFG)
    again.load_state_dict(c.state_dict())
    assert torch.equal(again.member.error, c.member.error) and np.array_equal(again.feedback.error, c.feedback.error)
    state = c.state_dict()
    with pytest.raises(ValueError, match="reducer error-feedback state holds 3 values"):
        again.load_state_dict({**state, "reducer_error": torch.zeros(3)})
    with pytest.raises(ValueError, match="error-feedback state holds non-finite"):
        again.load_state_dict({**state, "error": [torch.full_like(c.member.error, float("nan"))]})
    with pytest.raises(ValueError, match="needs 'error'"):
        again.load_state_dict({"rank": 0})
    assert torch.equal(again.member.error, c.member.error)  # a refused state changed nothing
    with pytest.raises(ValueError, match="no shared state"):
        again.load_shared(1, [])
    again.load_shared(0, [])  # a downloaded state: our buffers belonged to another trajectory
    assert not again.member.error.any() and not again.feedback.error.any()
    assert again.digest() == c.digest() != SharedCompressor(SHAPES, SharedIndexConfig(chunk=1024, topk=32)).digest()


def test_a_pseudo_gradient_of_another_size_is_refused():
    with pytest.raises(ValueError, match="pseudo-gradient has 10 values"):
        SharedCompressor(SHAPES, CFG).begin([torch.zeros(10)])
