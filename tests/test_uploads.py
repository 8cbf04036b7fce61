"""Uploads pushed with a request (peers/uploads.py, ``ContributionServer.rpc_exchange``): the rules of the store
without a network, then between two real hivemind peers on loopback: an upload of several pieces arrives whole
and the answer is the server's offer, and bad uploads (too large, a different second one, from a peer not
admitted) are refused with the reason while the server keeps serving."""

from __future__ import annotations

import threading
import time

import pytest
from dilocox.peers.averaging import RoundFailed
from dilocox.peers.contributions import CHUNK_BYTES
from dilocox.peers.uploads import Uploads

from tests.helpers import peers_on_loopback


def test_the_first_upload_of_a_peer_under_a_key_is_kept_and_each_peer_keeps_its_own_keys():
    u = Uploads(keep=2)
    assert u.put("k1", "a", b"one") is None
    assert u.put("k1", "a", b"one") is None  # a retry of the same bytes
    assert "different upload" in u.put("k1", "a", b"two")
    for key in ("j1", "j2", "j3"):  # b's made-up keys push out only b's own
        u.put(key, "b", b"x")
    got, missing = u.collect("k1", {"a": 10}, 0.1)
    assert got == {"a": b"one"} and not missing
    assert u.collect("j1", {"b": 10}, 0.1)[0] == {} and u.collect("j3", {"b": 10}, 0.1)[0] == {"b": b"x"}
    with pytest.raises(ValueError, match="at least 1"):
        Uploads(keep=0)


def test_collect_waits_for_every_peer_refuses_oversized_uploads_and_ends_when_stopped():
    u = Uploads(keep=4)
    threading.Timer(0.3, lambda: u.put("k", "b", b"late")).start()
    began = time.monotonic()
    u.put("k", "a", b"x" * 11)
    got, missing = u.collect("k", {"a": 10, "b": 10, "c": 10}, 1.5)
    assert got == {"b": b"late"}
    assert "oversized upload: 11 bytes" in missing["a"] and "not received within 2s" in missing["c"]
    assert 1.4 < time.monotonic() - began < 3.0
    began = time.monotonic()
    got, _ = u.collect("k", {"b": 10}, 30.0)  # everyone in: no wait
    assert got == {"b": b"late"} and time.monotonic() - began < 0.5
    with pytest.raises(RoundFailed, match="abandoned"):
        u.collect("k", {"c": 10}, 30.0, stop=lambda: True)
    assert time.monotonic() - began < 1.0  # stop() is asked before the wait begins


def test_collect_stops_waiting_for_a_peer_that_left_and_still_waits_for_the_others():
    u = Uploads(keep=4)
    u.put("k", "a", b"x")
    left_after = time.monotonic() + 0.5  # c's record says it left half a second in; nobody says so of b
    threading.Timer(1.2, lambda: u.put("k", "b", b"y")).start()
    began, asked = time.monotonic(), []

    def gone(peers):
        asked.append(set(peers))
        return {"c", "someone-else"} if time.monotonic() > left_after else set()
    got, missing = u.collect("k", {"a": 10, "b": 10, "c": 10}, 30.0, check_every_s=0.2, gone=gone)
    took = time.monotonic() - began
    assert asked[0] == {"b", "c"} and all("a" not in peers for peers in asked)  # only the peers still waited for
    assert got == {"a": b"x", "b": b"y"} and list(missing) == ["c"] and "left mid-round" in missing["c"]
    assert 1.1 < took < 3.0  # b was waited for; c was not waited for 30 s
    # once everyone that has not left is in, the wait ends at the next check
    began = time.monotonic()
    got, missing = u.collect("k", {"a": 10, "d": 10}, 30.0, check_every_s=0.2, gone=lambda peers: {"d"})
    assert got == {"a": b"x"} and "left mid-round" in missing["d"] and time.monotonic() - began < 1.0


@pytest.mark.integration
def test_an_upload_goes_with_its_request_and_bad_ones_are_refused_while_the_server_keeps_serving():
    with peers_on_loopback(2, "test_uploads") as peers:
        (a_id, a, _), (b_id, b, _) = peers
        big = bytes(range(256)) * (CHUNK_BYTES // 256 * 2 + 3)  # over two pieces
        threading.Timer(0.5, lambda: a.offer("r/u", b"answer")).start()  # the answer comes after the request
        got, failed = b.fetch({a_id: (None, 100)}, "r/u", 20.0, uploads={a_id: ("r/p0", big)})
        assert got == {a_id: b"answer"} and not failed
        assert a.uploads.collect("r/u", {b_id: len(big)}, 1.0)[0] == {b_id: big}
        assert b.served_bytes("r/p0") == len(big)  # what we pushed, counted under its name
        # a different second upload under the same key: refused, the first kept
        _, failed = b.fetch({a_id: (None, 100)}, "r/u", 20.0, uploads={a_id: ("r/p0", b"other")})
        assert "upload refused: a different upload" in failed[a_id]
        assert a.uploads.collect("r/u", {b_id: len(big)}, 1.0)[0] == {b_id: big}
        # too large: refused with the limit named
        a.max_upload_bytes = 1000
        a.offer("s/u", b"answer")
        _, failed = b.fetch({a_id: (None, 100)}, "s/u", 20.0, uploads={a_id: ("s/p0", b"y" * 1001)})
        assert "upload over 1000 bytes" in failed[a_id]
        assert a.uploads.collect("s/u", {b_id: 2000}, 0.2)[0] == {}
        # a peer not admitted: refused, nothing kept
        a.admitted = lambda peer: "no certified membership record"
        _, failed = b.fetch({a_id: (None, 100)}, "s/u", 20.0, uploads={a_id: ("s/p0", b"z")})
        assert "not admitted: no certified membership record" in failed[a_id]
        assert a.uploads.collect("s/u", {b_id: 2000}, 0.2)[0] == {}
        # and the server still serves
        a.admitted = None
        got, failed = b.fetch({a_id: (None, 100)}, "s/u", 20.0, uploads={a_id: ("s/p0", b"z")})
        assert got == {a_id: b"answer"} and a.uploads.collect("s/u", {b_id: 10}, 0.2)[0] == {b_id: b"z"}
