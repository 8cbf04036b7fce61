"""Commitments before rows (peers/contributions.py, "Commitments"): a member serves its payload, or its copy of a
mate's, under a sparse round's key only to a request that carries the requester's own payload's SHA-256, keeps the
first such commitment, and drops a mate whose payload is not the one it committed to. So a member matched early,
which announces no digest, cannot fetch the honest rows first and craft its own against them (a rushing attack)."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
import torch
from dilocox.peers.allgather import AllGatherTransport, broken_commitments
from dilocox.peers.averaging import RoundGather, group_bits
from dilocox.peers.deadlines import RoundTimes
from dilocox.peers.transport import RoundInput, Screen

from dilocox.sparse import SparseCompressor, SparseConfig
from tests.fakes.gathering import GatheringAverager, meta
from tests.helpers import peers_on_loopback


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def test_only_a_payload_other_than_the_committed_one_is_named():
    got = {"a": b"kept", "b": b"crafted", "c": b"never asked"}
    committed = {"a": sha(b"kept"), "b": sha(b"what it committed to")}
    broken = broken_commitments({p: sha(b) for p, b in got.items()}, committed.get)
    assert list(broken) == ["b"] and "not the one it committed to" in broken["b"]


@pytest.mark.integration
def test_rows_go_only_to_committed_requesters_and_a_payload_must_match_its_commitment():
    with peers_on_loopback(2, "test_commitments") as peers:
        (a_id, a, _), (b_id, b, _) = peers
        key, mine, theirs = "r/7", b"a's row" * 50, b"b's row" * 50
        a.offer(key, mine, committed=True)
        for commitment, why in (("", "no commitment"), ("xyz", "no commitment")):
            _, failed = b.fetch({a_id: (None, 1000)}, key, 20.0, commitment=commitment)
            assert why in failed[a_id]
        assert a.commitment(key, b_id) is None and a.served_bytes(key) == 0  # no byte of the row went out
        got, failed = b.fetch({a_id: (None, 1000)}, key, 20.0, commitment=sha(theirs))
        assert got == {a_id: mine} and not failed and a.commitment(key, b_id) == sha(theirs)
        # a second, different commitment under the key is refused; the first stays
        _, failed = b.fetch({a_id: (None, 1000)}, key, 20.0, commitment=sha(b"crafted after reading a's row"))
        assert "a different commitment" in failed[a_id] and a.commitment(key, b_id) == sha(theirs)
        # b crafts another row after reading a's: a's download of it fails on the commitment
        b.offer(key, b"crafted" * 50, committed=True)
        _, failed = a.fetch({b_id: (None, 1000)}, key, 20.0, commitment=sha(mine))
        assert "do not match the commitment" in failed[b_id]
        # ... and the committed row is accepted
        b.offer(key, theirs, committed=True)
        got, failed = a.fetch({b_id: (None, 1000)}, key, 20.0, commitment=sha(mine))
        assert got == {b_id: theirs} and not failed
        # a relay's copy under a committed key also needs a commitment: b holds a copy of a's row (fetched above)
        _, failed = a.fetch({a_id: (None, 1000)}, key, 20.0, relays=(b_id,), no_direct=frozenset({a_id}))
        assert "no commitment" in failed[a_id]
        got, _ = a.fetch({a_id: (None, 1000)}, key, 20.0, relays=(b_id,), no_direct=frozenset({a_id}),
                         commitment=sha(mine))
        assert got == {a_id: mine}
        # keys offered without committed=True (catch-up, audits) serve as before
        a.offer("state/7", b"state")
        got, _ = b.fetch({a_id: (None, 100)}, "state/7", 20.0)
        assert got == {a_id: b"state"}


@pytest.mark.integration
def test_a_round_drops_an_early_mate_whose_row_is_not_the_one_it_committed_to():
    """An early round (no digest announced): the mate fetches our row with a commitment, then serves another row.
    Our transport drops it with the reason, aggregates without it and reports what it claimed."""
    with peers_on_loopback(2, "test_commitments_round") as peers:
        (a_id, a, _), (me_id, me, _) = peers
        key = group_bits(5) + "0"
        shapes = [(1000,)]
        committed_to = SparseCompressor(shapes, SparseConfig()).begin([torch.randn(1000)]).payload
        crafted = SparseCompressor(shapes, SparseConfig()).begin([torch.randn(1000)]).payload
        a.offer(key, crafted, committed=True)

        def rushing_mate():  # fetches our row as soon as it is offered, committing to a row it will not serve
            deadline = time.monotonic() + 20
            while not me.offered(key) and time.monotonic() < deadline:
                time.sleep(0.01)
            a.fetch({me_id: (None, 1 << 20)}, key, 20.0, commitment=sha(committed_to))
        mate = threading.Thread(target=rushing_mate)
        mate.start()
        time.sleep(0.2)
        avg = GatheringAverager({a_id: meta(sha=None, size=None)})  # matched early: no digest announced
        rnd = SparseCompressor(shapes, SparseConfig()).begin([torch.randn(1000)])
        transport = AllGatherTransport(avg, me, "me", Screen(20.0, admitted=lambda peer: None),
                                       request_timeout_s=1.0, fetch_timeout_s=30.0)
        orig_fetch = me.fetch

        def fetch_after_the_mate(*args, **kwargs):  # the mate read our row before we download its own
            mate.join(20)
            return orig_fetch(*args, **kwargs)
        me.fetch = fetch_after_the_mate
        result = transport.exchange(RoundInput(5, rnd, RoundGather(outer_step=4, start_digest="d0", weight=20.0),
                                               RoundTimes(0.0, 10.0), threading.Event()))
        mate.join(20)
        assert "commitment" in result.dropped[a_id] and a_id not in result.contributions
        assert me.commitment(key, a_id) == sha(committed_to)
        # what it claimed goes to the equivocation check (daemon/checks.py): members it served the crafted row name
        # it with another digest
        assert result.claimed == {a_id: sha(committed_to)[:16]}
