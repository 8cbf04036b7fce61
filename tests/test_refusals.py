"""Matchmaking refuses the peers a node's group excluded (peers/refusals.py, ``PseudoGradientAverager.refuse``,
``SupervisedDHT.refused``).

The set itself in one process; then a real hivemind averager on loopback, whose join requests are answered in its
own forked process: a peer named after the fork is refused there, another gets hivemind's own answer. Then the
other side: the node's DHT reads leave out a refused peer's declarations, so a refused peer that declares itself
first, as a leader, gets no honest follower, and the honest averagers form their group without it."""

from __future__ import annotations

import asyncio
import time

import hivemind
import pytest
from dilocox.peers.averaging import PseudoGradientAverager, group_bits
from dilocox.peers.dht import start_dht
from dilocox.peers.refusals import RefusedPeers
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time


def test_the_set_holds_exactly_what_was_named():
    refused = RefusedPeers(capacity=3)
    assert "QmA" not in refused and len(refused) == 0
    refused.replace(["QmA", "QmB", "QmA"])
    assert "QmA" in refused and "QmB" in refused and "QmC" not in refused and len(refused) == 2
    refused.replace(["QmC"])
    assert "QmA" not in refused and "QmC" in refused
    with pytest.raises(ValueError, match="4 refused peers: at most 3"):
        refused.replace(["1", "2", "3", "4"])
    assert "QmC" in refused and len(refused) == 1  # unchanged by the refused call


@pytest.mark.integration
def test_a_refused_peer_cannot_join_a_group_this_averager_leads():
    dhts, averager = [], None
    try:
        for _ in range(3):
            dhts.append(hivemind.DHT(initial_peers=dhts[0].get_visible_maddrs() if dhts else None, start=True,
                                     host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, startup_timeout=60))
        averager = PseudoGradientAverager(1, dhts[0], "refusals", matchmaking_time_s=2.0, request_timeout_s=1.0,
                                          averaging_timeout_s=10.0)
        averager.refuse([dhts[1].peer_id.to_base58()])  # after the fork: the averager process reads shared memory

        async def first_answer(dht: hivemind.DHT) -> int:
            p2p = await dht.replicate_p2p()
            stub = PseudoGradientAverager.get_stub(p2p, averager.peer_id, namespace=averager.prefix)
            request = averaging_pb2.JoinRequest(schema_hash=b"x", expiration=get_dht_time() + 10, gather=b"",
                                                group_key="refusals.0b0")
            async for message in await stub.rpc_join_group(request):
                return message.code
            raise AssertionError("no answer")

        assert averager.refused_joins() == 0
        assert asyncio.run(first_answer(dhts[1])) == averaging_pb2.PROTOCOL_VIOLATION
        assert averager.refused_joins() == 1  # counted in the averager process, read here
        # not looking for a group now: hivemind's own answer to anyone else
        assert asyncio.run(first_answer(dhts[2])) == averaging_pb2.NOT_LOOKING_FOR_GROUP
        averager.refuse([])
        assert asyncio.run(first_answer(dhts[1])) == averaging_pb2.NOT_LOOKING_FOR_GROUP
    finally:
        if averager is not None:
            averager.shutdown()
        for d in dhts:
            d.shutdown()


def _dht(initial_peers=None):
    return start_dht(dict(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False),
                     60.0)


@pytest.mark.integration
def test_reads_of_the_averagers_keys_leave_out_refused_declarations():
    dht = _dht()
    try:
        refused, kept = PeerID(b"refused-leader"), PeerID(b"honest-leader")
        group, donors, other = "refusals.0b0101", "refusals.all_averagers", "refusals_members"
        for key in (group, donors, other):
            for peer in (refused, kept):
                assert dht.store(key, subkey=peer.to_bytes(), value=True, expiration_time=get_dht_time() + 60)

        async def in_a_loop(key):  # as hivemind's GroupKeyManager reads a group key
            return await dht.get(key, latest=True, return_future=True)

        def reads(key):
            return [dht.get(key, latest=True), asyncio.run(in_a_loop(key)),
                    dht.get(key, latest=True, return_future=True).result(30)]

        both = {refused.to_bytes(), kept.to_bytes()}
        assert all(set(found.value) == both for key in (group, donors, other) for found in reads(key))
        dht.refused.replace([refused.to_base58()])
        for key in (group, donors):
            assert all(set(found.value) == {kept.to_bytes()} for found in reads(key)), key
        assert all(set(found.value) == both for found in reads(other))  # not an averagers' key: as hivemind reads
        dht.refused.replace([])
        assert all(set(found.value) == both for found in reads(group))
    finally:
        dht.shutdown()


@pytest.mark.integration
def test_a_refused_peer_that_leads_first_gets_no_honest_follower():
    """The refused peer starts looking for a group first, so by hivemind's order (earlier declared expiration
    leads) the honest averagers would ask it first and follow it; with the refusal they form their own group."""
    dhts, averagers = [], []
    try:
        dhts.append(_dht())
        dhts += [_dht(dhts[0].get_visible_maddrs()) for _ in range(2)]
        # two honest averagers on the node's DHT with its set; the refused one on a plain hivemind DHT
        for i, dht in enumerate(dhts):
            averagers.append(PseudoGradientAverager(1, dht, "lead", matchmaking_time_s=3.0, request_timeout_s=2.0,
                                                    averaging_timeout_s=10.0,
                                                    refused=dht.refused if i < 2 else None))
        names = [a.peer_id.to_base58() for a in averagers]

        def groups(round_index: int) -> list[set]:
            for a in averagers:
                a.set_group_bits(group_bits(round_index))
            steps = [averagers[2].step(gather={}, timeout=12.0, wait=False)]
            time.sleep(1.0)  # its declaration is the earliest
            steps += [a.step(gather={}, timeout=12.0, wait=False) for a in averagers[:2]]
            out = []
            for step in steps[1:] + steps[:1]:
                try:
                    out.append({p.to_base58() for p in step.result(40)})
                except Exception:
                    out.append(set())
            return out

        assert groups(1) == [set(names)] * 3  # nobody refused: one group of three
        for dht in dhts[:2]:
            dht.refused.replace([names[2]])
        honest, refused = groups(2)[:2], groups(3)[2]
        assert honest == [set(names[:2])] * 2
        assert refused == set()  # it found nobody to average with
    finally:
        for a in averagers:
            a.shutdown()
        for d in dhts:
            d.shutdown()
