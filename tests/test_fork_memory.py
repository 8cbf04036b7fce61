"""``lifecycle.before_fork``: a forked child's garbage collections leave the parent's pages shared.

Real processes (multiprocessing's fork, as hivemind's DHT and averagers use), real page accounting
(``/proc/self/smaps_rollup``). Without the freeze a full collection in the child writes to the header of
every tracked object it inherited, so it ends up holding private copies of all their pages.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
from pathlib import Path

import pytest
from dilocox.peers import lifecycle

OBJECTS = 500_000  # lists (dicts of ints are not tracked): about 45 MB of pages with a header each


def _private_dirty_mb() -> float:
    kb = sum(int(line.split()[1]) for line in Path("/proc/self/smaps_rollup").read_text().splitlines()
             if line.startswith("Private_Dirty:"))
    return kb / 1024


def _child(out) -> None:
    before = _private_dirty_mb()
    gc.collect()  # what a child's own collections do over a node's life
    out.send(_private_dirty_mb() - before)


def _collected_in_child(freeze: bool) -> float:
    """MB the child's pages privately dirtied by one full collection, forked after ``before_fork`` or not."""
    parent_state = [[i] for i in range(OBJECTS)]  # noqa: F841 (kept alive across the fork)
    if freeze:
        lifecycle.before_fork()
    try:
        ctx = mp.get_context("fork")
        recv, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_child, args=(send,))
        child.start()
        grown = recv.recv()
        child.join(30)
        assert child.exitcode == 0
        return grown
    finally:
        gc.unfreeze()


@pytest.mark.integration
def test_before_fork_keeps_the_parents_objects_shared_through_a_childs_collection():
    unfrozen, frozen = _collected_in_child(False), _collected_in_child(True)
    assert unfrozen > 20, f"the probe did not dirty the inherited pages ({unfrozen:.1f} MB): it tests nothing"
    print(f"child dirtied {unfrozen:.1f} MB unfrozen, {frozen:.1f} MB frozen")
    assert frozen < unfrozen / 4, f"a frozen image was still copied: {frozen:.1f} MB against {unfrozen:.1f} MB"
