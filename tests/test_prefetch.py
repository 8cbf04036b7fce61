"""dilocox/prefetch.py: batches drawn ahead keep the shard's order and its position (batches consumed), stop
cleanly, and raise a drawing error where the batch would have been returned."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from dilocox.data import ReplicaShard
from dilocox.prefetch import Prefetcher, pinned_copy
from dilocox.synthetic import SyntheticShard
from dilocox.vision import ImageShard

TOKENS = np.random.default_rng(0).integers(0, 256, size=5000).astype(np.uint8)


def _shard(key: int = 1) -> ReplicaShard:
    return ReplicaShard(TOKENS, 16, 4, seed=0, shard_key=key)


class Recording(ReplicaShard):
    """A ReplicaShard that notes every index drawn and fails at ``fail_at``."""

    def __init__(self, fail_at: int = -1):
        super().__init__(TOKENS, 16, 4, seed=0, shard_key=1)
        self.drawn: list[int] = []
        self.fail_at = fail_at

    def batch_at(self, index: int):
        self.drawn.append(index)
        if index == self.fail_at:
            raise OSError(f"batch {index}: unreadable")
        return super().batch_at(index)


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "batch-prefetch"]


def _wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_prefetched_batches_are_the_shards_own_in_order_and_beyond_count():
    ours, plain = _shard(), _shard()
    with Prefetcher(ours, 5, depth=2) as batches:
        for k in range(8):  # 5 drawn ahead, 3 past count on the caller's thread
            got, want = batches.next_batch(), plain.next_batch()
            assert all(torch.equal(a, b) for a, b in zip(got, want)), k
            assert ours.position == plain.position == k + 1


def test_position_counts_batches_consumed_not_drawn_ahead():
    shard = Recording()
    with Prefetcher(shard, 10, depth=3) as batches:
        batches.next_batch()
        assert _wait_for(lambda: max(shard.drawn) >= 3)  # drawn ahead: 1, 2, 3 wait in the queue
        assert shard.position == 1  # what a checkpoint written now records
        batches.next_batch()
        assert shard.position == 2
    assert shard.position == 2  # closing drops the batches drawn ahead without moving it


def test_a_position_set_from_outside_restarts_the_drawing_there():
    shard, plain = _shard(), _shard()
    with Prefetcher(shard, 10) as batches:
        batches.next_batch()
        shard.position = 6  # a checkpoint restored, a re-sync
        assert torch.equal(batches.next_batch()[0], plain.batch_at(6)[0])
        shard.position = 2  # and backwards
        assert torch.equal(batches.next_batch()[0], plain.batch_at(2)[0])
        assert shard.position == 3


def test_close_stops_the_thread_and_is_idempotent():
    before = len(_prefetch_threads())
    batches = Prefetcher(_shard(), 100, depth=2)  # the thread blocks on a full queue
    assert _wait_for(lambda: len(_prefetch_threads()) == before + 1)
    batches.close()
    batches.close()
    assert len(_prefetch_threads()) == before
    with Prefetcher(_shard(), 100) as batches:
        batches.next_batch()
    assert len(_prefetch_threads()) == before


def test_an_error_while_drawing_is_raised_for_its_batch_and_again_on_retry():
    shard = Recording(fail_at=2)
    with Prefetcher(shard, 6) as batches:
        batches.next_batch()
        batches.next_batch()
        with pytest.raises(OSError, match="batch 2: unreadable"):
            batches.next_batch()
        assert shard.position == 2  # the failed batch was not consumed
        assert not _prefetch_threads()
        with pytest.raises(OSError):
            batches.next_batch()
        shard.fail_at = -1
        assert torch.equal(batches.next_batch()[0], _shard().batch_at(2)[0]) and shard.position == 3


def test_a_shard_without_batch_at_is_read_on_the_callers_thread():
    shard = SyntheticShard(3)
    with Prefetcher(shard, 4) as batches:
        assert not _prefetch_threads()
        for k in range(5):
            x, y = batches.next_batch()
            assert shard.position == k + 1 and x.shape == y.shape


def test_image_shards_prefetch_as_they_draw():
    rng = np.random.default_rng(1)
    images, labels = rng.integers(0, 256, (50, 28, 28)).astype(np.uint8), rng.integers(0, 10, 50)
    ours, plain = (ImageShard(images, labels, np.arange(0, 50, 2), 8, seed=0, shard_key=2) for _ in range(2))
    with Prefetcher(ours, 6) as batches:
        for _ in range(6):  # crosses an epoch (25 samples, 8 a batch)
            got, want = batches.next_batch(), plain.next_batch()
            assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_depth_below_one_is_refused():
    with pytest.raises(ValueError, match="depth"):
        Prefetcher(_shard(), 3, depth=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs a CUDA device")
def test_pinned_batches_are_page_locked_copies():
    shard, plain = _shard(), _shard()
    with Prefetcher(shard, 3, pin=True) as batches:
        x, y = batches.next_batch()
    want = plain.next_batch()
    assert x.is_pinned() and y.is_pinned() and torch.equal(x, want[0]) and torch.equal(y, want[1])
    assert pinned_copy(want[0][:, 1:]).is_contiguous()
