"""Swarm.members(): a DHT read that misses an unexpired record does not make that member vanish.

A read merges the subkeys held by the DHT peers it reaches, which need not hold every record (seen on
CI when a third peer joined a 2-node swarm: one node read no other member, applied its round alone 24 ms
after entering it, and the two replicas spent six rounds apart).
"""

from __future__ import annotations

import time

import pytest
from dilocox.peers.identity import load_or_create_identity
from dilocox.peers.records import MemberRecord
from dilocox.peers.swarm import Swarm

pytestmark = pytest.mark.integration  # hivemind peers (p2pd) or node processes: make test, not make check


class PartialReads:
    """The real DHT, except that reads (searching, and direct) answer an empty dictionary while ``hide`` is set."""

    def __init__(self, dht):
        self.dht, self.hide = dht, False

    def get(self, key, latest=False, **kwargs):
        found = self.dht.get(key, latest=latest)
        if self.hide and found is not None:
            found.value.clear()
        return found

    def run_coroutine(self, coro, **kwargs):  # the direct reads (peers/nearstore.py, read_near) come this way
        result = self.dht.run_coroutine(coro, **kwargs)
        if self.hide and isinstance(result, tuple) and len(result) == 2 and result[0] is not None:
            result[0].value.clear()
        return result

    def __getattr__(self, name):
        return getattr(self.dht, name)


@pytest.fixture
def swarm(tmp_path):
    _, key = load_or_create_identity(tmp_path / "id.key")
    s = Swarm("view", key, initial_peers=[], host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
              identity_path=str(tmp_path / "id.key"), ttl_s=2.0)
    yield s
    s.shutdown()


def test_a_read_that_misses_an_unexpired_record_keeps_the_member(swarm):
    record = MemberRecord(peer_id=swarm.peer_id, run_id="view", state="TRAINING", outer_step=3, inner_step=1,
                          inner_steps=20, tokens_per_second=1.0, loss=2.0, global_params_digest="d")
    assert swarm.publish(record)
    assert [m.outer_step for m, _ in swarm.members(max_age_s=0)] == [3]
    reads = PartialReads(swarm.dht)
    swarm.dht = reads
    reads.hide = True
    assert [m.outer_step for m, _ in swarm.members(max_age_s=0)] == [3]  # still within its 2 s expiry
    time.sleep(2.5)
    assert swarm.members(max_age_s=0) == []  # expired: gone, as the DHT would drop it
