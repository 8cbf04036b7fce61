"""Every code implements dilocox/compressor.py's Compressor protocol, and its rounds the CompressedRound one: the
round's rules (daemon/rounds.py) call begin, lookahead, commit and digest without knowing which code runs."""

from __future__ import annotations

import pytest
import torch

from dilocox.compression import CompressionConfig, DenseCompressor
from dilocox.compressor import CompressedRound, Compressor
from dilocox.shared_index import SharedIndexConfig
from dilocox.shared_round import SharedCompressor
from dilocox.sparse import SparseCompressor, SparseConfig

SHAPES = [(64, 32), (512,)]


def _codes():
    return {
        "dense-powersgd": lambda: DenseCompressor(SHAPES, CompressionConfig(mode="adaptive", rank_max=4)),
        "dense-none": lambda: DenseCompressor(SHAPES, CompressionConfig(mode="none")),
        "sparse": lambda: SparseCompressor(SHAPES, SparseConfig()),
        "shared": lambda: SharedCompressor(SHAPES, SharedIndexConfig(chunk=512, topk=32)),
    }


def _pseudo_gradient(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


@pytest.mark.parametrize("code", sorted(_codes()))
def test_each_code_is_a_compressor_and_its_rounds_are_compressed_rounds(code):
    comp = _codes()[code]()
    assert isinstance(comp, Compressor)
    rnd = comp.begin(_pseudo_gradient(0), [10.0] * len(SHAPES), 1)
    assert isinstance(rnd, CompressedRound) and rnd.num_phases >= 1
    sizes = comp.averager_sizes()
    assert sizes == sorted(sizes, reverse=True) and all(s >= 1 for s in sizes)
    ahead = rnd.lookahead()
    if code == "sparse":  # known before the exchange: what every member decodes of ours
        assert [tuple(t.shape) for t in ahead] == SHAPES and any(bool(t.any()) for t in ahead)
    else:
        assert ahead is None


@pytest.mark.parametrize("code", ["sparse", "dense-none"])
def test_a_committed_round_changes_the_error_feedback_and_a_checkpoint_restores_it(code):
    comp = _codes()[code]()
    before = [e.clone() for e in comp.error]
    rnd = comp.begin(_pseudo_gradient(1), [10.0] * len(SHAPES), 1)
    if code == "dense-none":  # a dense round's error is known once its phases ran: run them as a group of one
        for _ in range(rnd.num_phases):
            codes, stats = rnd.phase_payload()
            rnd.phase_done(codes, [stats], [1.0])
    comp.commit(rnd)
    if code == "sparse":  # top-k leaves most of the pseudo-gradient in the buffer for later rounds
        assert any(not torch.equal(a, b) for a, b in zip(before, comp.error))
    fresh = _codes()[code]()
    fresh.load_state_dict(comp.state_dict())
    assert fresh.digest() == comp.digest()
    assert all(torch.equal(a, b) for a, b in zip(fresh.error, comp.error))
