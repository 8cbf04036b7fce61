"""All-gather of sparse contributions (peers/allgather.py): the screening rules with fake gathered
metadata, and the contribution server between real hivemind peers on loopback."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
import torch
from dilocox.peers.allgather import CANCEL_GRACE_S, AllGatherTransport, after, download_stop, screen_gathered
from dilocox.peers.averaging import RoundFailed, RoundGather, group_bits
from dilocox.peers.contributions import EMPTY_RETRIES, ContributionServer
from dilocox.peers.deadlines import RoundTimes
from dilocox.peers.transport import RoundInput, Screen

from dilocox.sparse import SparseCompressor, SparseConfig
from tests.fakes.gathering import SHA, GatheringAverager, meta
from tests.helpers import peers_on_loopback


def test_screen_keeps_the_canonical_group_and_names_each_drop():
    gathered = {
        "p1": meta(), "p2": meta(), "p3": meta(),
        "p4": meta(start="other"),                        # another theta: not the canonical start digest
        "p5": meta(outer_step=3),                          # behind by one outer step
        "p6": meta(weight=1e6),                            # a weight above H = 20 inner steps
        "p7": {"outer_step": 4, "start_digest": "d0"},     # no weight, no payload digest
        "p8": meta(sha="not-a-digest"),
        "p9": "garbage",
        "pa": meta(size=-1),
        "pb": meta(client_mode="yes"),                      # a flag must be a JSON boolean
        "pc": meta(link_bps=-1.0),                          # a link rate is not negative
        "pd": meta(link_latency_s=float("inf")),            # nor infinite
    }
    metas, announced, dropped, excluded = screen_gathered(gathered, round_index=5, max_weight=20.0, payload_bytes=100)
    assert not excluded
    assert set(announced) - set(dropped) == {"p1", "p2", "p3"}
    assert announced["p1"] == (SHA, 100)
    assert "started from other parameters" in dropped["p4"] and "outer step 3" in dropped["p5"]
    assert "weight 1000000.0 exceeds" in dropped["p6"]
    for p in ("p7", "p8", "p9", "pa", "pb", "pc", "pd"):
        assert dropped[p].startswith("malformed metadata"), (p, dropped[p])
        assert metas[p] is None
    assert metas["p4"] is not None  # it parsed: it may vote, its contribution is not used
    # a round matched before its payloads existed announces no digest: the codec's length is expected
    _, announced, dropped, _ = screen_gathered({"p1": {k: v for k, v in meta().items() if not k.startswith("payload")}},
                                            5, 20.0, payload_bytes=116)
    assert announced == {"p1": (None, 116)} and not dropped


def test_an_audited_swarm_leaves_out_a_contribution_without_a_start_state_commitment():
    """A member that commits no start state could never be audited (daemon/audits.py skips it): where the swarm
    audits, its contribution is left out alike on every member; elsewhere the field is not required."""
    committed = dict(meta(), state_sha256="ab" * 32, state_bytes=10)
    gathered = {"p1": committed, "p2": committed, "p3": meta()}
    _, announced, dropped, _ = screen_gathered(gathered, 5, 20.0, 100, committed=True)
    assert set(dropped) == {"p3"} and "no start-state commitment" in dropped["p3"]
    assert not screen_gathered(gathered, 5, 20.0, 100).dropped


def test_screen_is_the_same_for_every_member_whatever_the_order():
    gathered = {f"p{i}": meta(start="a" if i < 3 else "b") for i in range(6)}  # a 3:3 tie
    first = screen_gathered(gathered, 5, 20.0, 100)[2]
    again = screen_gathered(dict(reversed(list(gathered.items()))), 5, 20.0, 100)[2]
    assert first == again and set(first) == {"p3", "p4", "p5"}  # the tie goes to the smallest peer id's digest


def test_the_group_excludes_whom_most_of_it_voted_against_from_the_same_round_on_every_member():
    """Members that found a lie at different times vote in their gathered metadata; the round that drops the liar is
    the first in which most of the group lists it, the same on every member, whatever its own verdict."""
    def gathered_at(votes_of: dict) -> dict:
        return {p: dict(meta(), exclusion_votes=votes_of.get(p, {})) for p in ("h1", "h2", "h3", "l1", "l2")}

    # h1 found l1's lie of round 3, h2 checked it a round later, h3 has not yet; l2 (l1's accomplice) votes against h1
    timeline = {4: {"h1": {"l1": 3}, "l2": {"h1": 3}}, 5: {"h1": {"l1": 3}, "h2": {"l1": 3}, "l2": {"h1": 3}},
                6: {"h1": {"l1": 3}, "h2": {"l1": 3}, "h3": {"l1": 3}, "l2": {"h1": 3}}}
    out = {r: screen_gathered(gathered_at(v), r, 20.0, 100) for r, v in timeline.items()}
    assert not out[4].excluded and not out[5].excluded  # 1 and 2 of 5: not a majority (no member drops anyone yet)
    assert set(out[6].excluded) == {"l1"} and "3 of the group's 5 members" in out[6].excluded["l1"]
    assert out[6].metas["l1"] is None and out[6].dropped["l1"] == out[6].excluded["l1"]
    assert set(out[6].announced) - set(out[6].dropped) == {"h1", "h2", "h3", "l2"}  # a minority cannot exclude h1
    # every member screens the same bytes, in whatever order they came
    again = screen_gathered(dict(reversed(list(gathered_at(timeline[6]).items()))), 6, 20.0, 100)
    assert again.excluded == out[6].excluded and again.dropped == out[6].dropped
    # a vote counts from the round after the lie it names; votes of members that are not in the group do not count
    assert not screen_gathered(gathered_at({p: {"l1": 6} for p in ("h1", "h2", "h3")}), 6, 20.0, 100).excluded
    assert not screen_gathered({**{p: dict(meta(), exclusion_votes={"x": 1}) for p in ("h1", "h2")}, "h3": meta()},
                               6, 20.0, 100).excluded
    # votes are bounded and typed like the rest of the metadata
    bad = screen_gathered({"h1": dict(meta(), exclusion_votes={"l1": 0}), "h2": meta()}, 6, 20.0, 100)
    assert bad.dropped["h1"].startswith("malformed metadata") and not bad.excluded


@pytest.fixture(scope="module")
def servers():
    with peers_on_loopback(2, "test_allgather", (None, lambda payload, requester, key: payload[:-1] + b"X")) as out:
        yield [(peer_id, server) for peer_id, server, _ in out]


@pytest.mark.integration
def test_fetch_checks_length_and_digest(servers):
    (a_id, a), (b_id, b) = servers
    payload = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MiB: several pieces
    a.offer("r1", payload)
    got, failed = b.fetch({a_id: (hashlib.sha256(payload).hexdigest(), len(payload))}, "r1", 30)
    assert got == {a_id: payload} and not failed
    # one whole payload; a stream cut before its first byte is asked for again (EMPTY_RETRIES: seen once in CI
    # under load), and the server counts what it handed to each stream, so at most that many more
    served = a.served_bytes("r1")
    assert len(payload) <= served <= (1 + EMPTY_RETRIES) * len(payload), served
    short = payload[:1000]
    a.offer("r2", short)
    _, failed = b.fetch({a_id: (hashlib.sha256(short).hexdigest(), 999)}, "r2", 30)
    assert "oversized" in failed[a_id]
    _, failed = b.fetch({a_id: (hashlib.sha256(short).hexdigest(), 1001)}, "r2", 30)
    assert "truncated" in failed[a_id]
    _, failed = b.fetch({a_id: ("00" * 32, 1000)}, "r2", 30)
    assert "do not match the digest" in failed[a_id]
    _, failed = b.fetch({a_id: (SHA, 10)}, "nothing-here", 30)
    assert "no contribution under key" in failed[a_id]


@pytest.mark.integration
def test_a_fetch_on_a_starved_event_loop_fails_with_a_reason_and_the_next_one_works(servers, monkeypatch):
    """Our transport's event loop does not answer within the fetch's timeout + 5 s (32 nodes on 2 cores): the fetch
    fails with a reason for every peer asked, instead of raising a bare TimeoutError (which ended a node)."""
    (a_id, a), (b_id, b) = servers
    a.offer("starved", b"x" * 100)
    fetch_all = ContributionServer._fetch_all

    async def starved(self, *args):
        time.sleep(5.6)  # blocks the loop, as a busy machine does
        return await fetch_all(self, *args)

    monkeypatch.setattr(ContributionServer, "_fetch_all", starved)
    got, failed = b.fetch({a_id: (None, 100)}, "starved", 0.1)
    assert not got and "our transport did not answer in time" in failed[a_id], failed
    monkeypatch.undo()
    time.sleep(0.6)  # the blocked call ends
    got, failed = b.fetch({a_id: (None, 100)}, "starved", 30)
    assert got == {a_id: b"x" * 100} and not failed


@pytest.mark.integration
def test_a_fetch_stops_waiting_once_the_round_went_on_without_us(servers):
    """A group-mate that left the round never serves its contribution: once ``stop()`` (the round's
    abandon rule) holds, the fetch gives up with RoundFailed instead of waiting out its deadline. Without
    ``stop`` the wait is bounded by the deadline alone."""
    (a_id, a), (b_id, b) = servers
    a.offer_wait_s = 20.0  # a holds the request open, as a peer that is still deciding does
    try:
        began = time.monotonic()
        with pytest.raises(RoundFailed, match="abandoned after .* the round left us behind"):
            b.fetch({a_id: (SHA, 10)}, "never-offered", 30, stop=lambda: time.monotonic() > began + 1.0,
                    check_every_s=0.2)
        assert time.monotonic() - began < 4.0
        began = time.monotonic()  # a stop that never holds changes nothing: the download's own timeout ends it
        _, failed = b.fetch({a_id: (SHA, 10)}, "never-offered", 2, stop=lambda: False, check_every_s=0.2)
        assert "not received within 2s" in failed[a_id] and 1.9 < time.monotonic() - began < 6.0
    finally:
        a.offer_wait_s = 1.0


def transport(averager, server, **kwargs) -> AllGatherTransport:
    """Our transport as peer "me": weights up to 20 inner steps, anyone admitted, downloads capped at 30 s."""
    return AllGatherTransport(averager, server, "me", Screen(20.0, admitted=lambda peer: None), request_timeout_s=1.0,
                              fetch_timeout_s=30.0, **kwargs)


def round_input(rnd, cancel, abandon) -> RoundInput:
    """Round 5 from outer step 4 (start digest "d0", weight 20), with a 10 s group wait."""
    return RoundInput(5, rnd, RoundGather(outer_step=4, start_digest="d0", weight=20.0), RoundTimes(0.0, 10.0), cancel,
                      abandon)


@pytest.mark.integration
def test_a_sparse_round_whose_group_mate_never_serves_is_given_up_once_the_others_moved_on(servers):
    """The wiring of the rule above: a joiner's group waits its whole download cap (30 s here: no member has
    measured its link) for a mate that never serves; with the others gone from the round it gives up once its
    downloads have lasted the grace. Without ``abandon`` the wait ends at the mate's own refusal (20 s), then
    it averages alone."""
    (a_id, a), (b_id, b) = servers
    comp = SparseCompressor([(1000,)], SparseConfig())
    rnd = comp.begin([torch.randn(1000)])
    avg = GatheringAverager({a_id: meta(outer_step=4, start="d0", weight=20.0, sha=SHA, size=100)})
    a.offer_wait_s = 20.0
    try:
        began = time.monotonic()
        with pytest.raises(RoundFailed, match="abandoned after"):
            transport(avg, b, abandon_grace_s=1.0).exchange(round_input(rnd, threading.Event(), lambda: True))
        assert time.monotonic() - began < 5.0
    finally:
        a.offer_wait_s = 1.0


@pytest.mark.integration
def test_a_sparse_round_cancelled_while_it_downloads_ends_them_after_the_cancel_grace(servers):
    """We leave (the round's ``cancel`` is set) while a group-mate never serves: the downloads end CANCEL_GRACE_S
    later, not at the mate's refusal (20 s here), so the node can exit (compose stop kills 10 s after SIGTERM)."""
    (a_id, a), (b_id, b) = servers
    comp = SparseCompressor([(1000,)], SparseConfig())
    rnd = comp.begin([torch.randn(1000)])
    avg = GatheringAverager({a_id: meta(outer_step=4, start="d0", weight=20.0, sha=SHA, size=100)})
    a.offer_wait_s = 20.0
    cancel = threading.Event()
    threading.Timer(1.0, cancel.set).start()  # the leave comes once the downloads are under way
    try:
        began = time.monotonic()
        with pytest.raises(RoundFailed, match="abandoned after"):
            transport(avg, b).exchange(round_input(rnd, cancel, lambda: False))
        took = time.monotonic() - began
        assert 1.0 + CANCEL_GRACE_S - 0.5 < took < 1.0 + CANCEL_GRACE_S + 4.0, took
    finally:
        a.offer_wait_s = 1.0


@pytest.mark.integration
def test_a_payload_fetched_after_our_round_ended_counts_in_that_round_and_in_our_totals(servers):
    """A 2-member round: we fetched our mate's payload and returned before it fetched ours (it is slower). The
    round's figure read when it ended is the metadata phase alone (2 bytes: what metrics.jsonl recorded, with a
    compression ratio of 266,880x); the mate's fetch afterwards counts in the round (``sent_since``, added when
    the round is recorded) and in the server's totals; the compression ratio does not depend on it."""
    (a_id, a), (b_id, b) = servers  # b is us; its tamper hook flips the last byte it serves (same length)
    comp = SparseCompressor([(1000,)], SparseConfig())
    theirs = SparseCompressor([(1000,)], SparseConfig()).begin([torch.randn(1000)]).payload
    key = group_bits(9) + "0"  # round 9 (from outer step 8): a key no other test offers
    a.offer(key, theirs)
    avg = GatheringAverager({a_id: meta(outer_step=8, sha=hashlib.sha256(theirs).hexdigest(), size=len(theirs))},
                            phase_bytes=2)
    rnd = comp.begin([torch.randn(1000)])
    sent0, received0 = b.traffic()
    result = transport(avg, b).exchange(RoundInput(9, rnd, RoundGather(outer_step=8, start_digest="d0", weight=20.0),
                                                   RoundTimes(0.0, 10.0), threading.Event()))
    assert result.bytes_sent == 2 and result.sent_since() == 0  # nobody fetched ours yet
    assert result.fp32_bytes == 4 * 1000 and result.payload_bytes == len(rnd.payload)
    # our mate, late; our payload goes only to a request that carries its commitment (peers/contributions.py)
    _, failed = a.fetch({b_id: (None, len(rnd.payload))}, key, 30)
    assert "no commitment" in failed[b_id] and result.sent_since() == 0
    got, failed = a.fetch({b_id: (None, len(rnd.payload))}, key, 30, commitment=hashlib.sha256(theirs).hexdigest())
    assert not failed and len(got[b_id]) == len(rnd.payload)
    assert result.bytes_sent + result.sent_since() == 2 + len(rnd.payload)
    sent, received = b.traffic()
    assert (sent - sent0, received - received0) == (2 + len(rnd.payload), 2 + len(theirs))


@pytest.mark.integration
def test_the_totals_count_every_byte_served_relayed_pushed_or_fetched_once(servers):
    """``traffic()``: whatever the key, offered or not, in a round or not: a relayed copy of a key we never offered,
    an upload pushed with a request (both ways), a download, and bytes counted for us elsewhere (hivemind's
    phases, ``add_traffic``)."""
    (a_id, a), (b_id, b) = servers
    a0, b0 = a.traffic(), b.traffic()
    payload = b"x" * 5000
    a.offer("t1", payload)
    got, _ = b.fetch({a_id: (hashlib.sha256(payload).hexdigest(), len(payload))}, "t1", 30)
    assert got == {a_id: payload}
    # b relays its checked copy of a's payload (a key b never offered) to a member that asks b for it
    got, failed = a.fetch({a_id: (hashlib.sha256(payload).hexdigest(), len(payload))}, "t1", 30, relays=(b_id,),
                          no_direct=frozenset({a_id}))
    assert got == {a_id: payload} and not failed
    a.offer("t2/u", b"answer")
    got, failed = b.fetch({a_id: (None, 100)}, "t2/u", 30, uploads={a_id: ("t2/p0", b"u" * 300)})
    assert got == {a_id: b"answer"} and not failed
    b.add_traffic(7, 11)
    a1, b1 = a.traffic(), b.traffic()
    assert (a1[0] - a0[0], a1[1] - a0[1]) == (len(payload) + len(b"answer"), len(payload) + 300)
    assert (b1[0] - b0[0], b1[1] - b0[1]) == (len(payload) + 300 + 7, len(payload) + len(b"answer") + 11)
    assert a.served_bytes("t1") == b.served_bytes("t1") == len(payload) and b.served_bytes("t2/p0") == 300


def test_download_stop_holds_once_cancel_was_seen_for_its_grace_or_the_give_up_rule_after_its_own(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    cancel, left_behind = threading.Event(), [False]
    stop = download_stop(cancel, lambda: left_behind[0], abandon_grace_s=15.0)
    assert not stop()
    now[0] = 102.0
    cancel.set()
    assert not stop()  # first seen set now
    now[0] = 102.0 + CANCEL_GRACE_S - 0.1
    assert not stop()
    now[0] = 102.0 + CANCEL_GRACE_S
    assert stop()
    stop = download_stop(threading.Event(), lambda: left_behind[0], abandon_grace_s=15.0)
    left_behind[0] = True
    assert not stop()  # the give-up rule waits its own grace
    now[0] += 15.0
    assert stop()
    assert not download_stop(threading.Event(), None)()


def test_after_asks_nothing_until_its_delay_has_passed(monkeypatch):
    now, calls = [100.0], []
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    held = after(lambda: calls.append(now[0]) or True, delay_s=10.0)
    seen = []
    for t in (100, 105, 109.9, 110, 115):
        now[0] = t
        seen.append(held())
    assert seen == [False, False, False, True, True] and calls == [110, 115]  # no DHT read before the delay


@pytest.mark.integration
def test_a_contribution_asked_for_before_it_is_offered_is_served_once_it_is(servers):
    """A group-mate whose compute ended first asks while we still encode: the request waits for our offer
    (up to offer_wait_s) instead of failing, which would make members drop different contributions."""
    (a_id, a), (b_id, b) = servers
    payload = b"late contribution" * 1000
    a.offer_wait_s = 10.0
    try:
        threading.Timer(1.5, a.offer, ("late", payload)).start()
        began = time.monotonic()
        got, failed = b.fetch({a_id: (hashlib.sha256(payload).hexdigest(), len(payload))}, "late", 30)
        assert got == {a_id: payload} and not failed and time.monotonic() - began >= 1.4
    finally:
        a.offer_wait_s = 1.0


@pytest.mark.integration
def test_a_stream_cut_part_way_is_asked_for_again(servers, monkeypatch):
    """hivemind ends a stream whose connection broke as if it were complete: the first piece states the whole
    length, so a short download of an unannounced (early-round) payload is fetched again, not used short."""
    from dilocox.proto.dilocox.v1.swarm_pb2 import ContributionChunk

    (a_id, a), (b_id, b) = servers
    payload = bytes(range(200)) * 50
    calls = []

    class CutOnce:
        async def rpc_contribution(self, request):
            calls.append(request.key)

            async def stream():
                yield ContributionChunk(data=payload[:4000], total_bytes=len(payload))
                if len(calls) > 1:  # the first stream is cut after its first piece
                    yield ContributionChunk(data=payload[4000:])
            return stream()

    monkeypatch.setattr(b, "get_stub", lambda *args, **kwargs: CutOnce())
    got, failed = b.fetch({a_id: (None, 2 * len(payload))}, "cut", 30)
    assert got == {a_id: payload} and not failed and calls == ["cut", "cut"]


@pytest.mark.integration
def test_a_peer_serving_other_bytes_than_it_announced_is_caught(servers):
    (a_id, a), (b_id, b) = servers
    payload = b"honest contribution" * 100
    b.offer("r3", payload)  # b's tamper hook flips its last byte for every requester (equivocation)
    _, failed = a.fetch({b_id: (hashlib.sha256(payload).hexdigest(), len(payload))}, "r3", 30)
    assert "do not match the digest" in failed[b_id]


@pytest.mark.integration
def test_old_offers_are_forgotten(servers):
    (a_id, a), (b_id, b) = servers
    for k in range(6):
        a.offer(f"old{k}", b"x")
    _, failed = b.fetch({a_id: (hashlib.sha256(b"x").hexdigest(), 1)}, "old0", 30)
    assert "no contribution" in failed[a_id]
    got, _ = b.fetch({a_id: (hashlib.sha256(b"x").hexdigest(), 1)}, "old5", 30)
    assert got == {a_id: b"x"}


@pytest.mark.integration
def test_offers_beyond_the_byte_budget_are_forgotten_oldest_first_but_the_newest_stays(servers):
    (a_id, a), (b_id, b) = servers
    a.max_bytes = 10  # the catch-up server's budget: a state download's bytes (daemon/node.py)
    try:
        for key, payload in (("m0", b"123456"), ("m1", b"abcdef"), ("m2", b"z" * 20)):
            a.offer(key, payload)
            got, _ = b.fetch({a_id: (hashlib.sha256(payload).hexdigest(), len(payload))}, key, 30)
            assert got == {a_id: payload}  # the newest is served even when it alone is over the budget
        for key in ("m0", "m1"):  # m1 went when m2 came; m0 when m1 came (12 bytes > 10)
            _, failed = b.fetch({a_id: (SHA, 6)}, key, 30)
            assert "no contribution" in failed[a_id]
    finally:
        a.max_bytes = None


@pytest.fixture(scope="module")
def trio():
    """Four servers; the test makes the last one leave (a group-mate whose address nobody can dial any more)."""
    with peers_on_loopback(4, "test_relay") as out:
        yield out


@pytest.mark.integration
def test_a_contribution_nobody_can_dial_comes_through_a_relay_and_a_failed_dial_is_remembered(trio):
    (a_id, a, _), (b_id, b, _), (c_id, c, _), (gone_id, gone, gone_dht) = trio
    payload = b"a client's contribution" * 5000
    wanted = {c_id: (hashlib.sha256(payload).hexdigest(), len(payload))}
    c.offer("k1", payload)
    got, _ = a.fetch(wanted, "k1", 30)  # a reaches c directly and keeps a checked copy
    assert got == {c_id: payload}
    assert c.served_bytes("k1") == len(payload)
    got, failed = b.fetch(wanted, "k1", 30, relays=(a_id,), no_direct=frozenset({c_id}))
    assert got == {c_id: payload} and not failed
    assert c.served_bytes("k1") == len(payload)  # b never dialed c: a relayed it
    # a relay without a copy is asked again until the timeout, then the round goes on without it
    c.offer("k2", payload)
    _, failed = b.fetch(wanted, "k2", 3, relays=(a_id,), no_direct=frozenset({c_id}))
    assert "not received within 3s" in failed[c_id]
    # a group-mate that left: dialing its known address fails; that is remembered, published, and the peer
    # is not dialed again for a while
    _, failed = b.fetch({gone_id: (SHA, 10)}, "k1", 20)  # while it is up: it answers (no such offer)
    assert "no contribution under key" in failed[gone_id] and b.dials.undialable() == []
    gone.shutdown()
    gone_dht.shutdown()
    _, failed = b.fetch({gone_id: (SHA, 10)}, "k1", 20)
    assert gone_id in failed and gone_id in b.dials.undialable() and not b.dials.worth_dialing(gone_id)
    _, failed = b.fetch({gone_id: (SHA, 10)}, "k1", 20)
    assert "neither the peer nor a relay" in failed[gone_id] and "no relay" in failed[gone_id]
    # relays without a copy are asked until the deadline, unless the contributor is known to have left (its
    # record says so): then one pass over them decides, and the group stops waiting for it (it took 60 s)
    _, failed = b.fetch({gone_id: (SHA, 10)}, "k1", 3, relays=(a_id,))
    assert "not received within 3s" in failed[gone_id]
    b.left = lambda peer: True
    try:
        started = time.monotonic()
        _, failed = b.fetch({gone_id: (SHA, 10)}, "k1", 20, relays=(a_id,))
        assert "it left the swarm" in failed[gone_id] and time.monotonic() - started < 6, failed
        got, _ = b.fetch(wanted, "k1", 20, relays=(a_id,), no_direct=frozenset({c_id}))  # a relay's copy still counts
        assert got == {c_id: payload}
    finally:
        b.left = None


@pytest.mark.integration
def test_an_empty_stream_is_asked_for_again_then_dropped_with_its_reason(trio):
    (a_id, a, _), (_, b, _) = trio[0], trio[1]
    a.offer("empty", b"")  # what a cut stream looks like to hivemind's reader: no bytes, no error
    started = time.monotonic()
    _, failed = b.fetch({a_id: (None, 100)}, "empty", 20)
    assert failed[a_id].startswith("not received: empty payload") and "3 times" in failed[a_id], failed
    assert time.monotonic() - started >= 2 * 0.5  # two pauses before giving up
