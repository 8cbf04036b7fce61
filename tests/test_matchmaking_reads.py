"""SupervisedDHT paces matchmaking's reads of a group key (peers/dht.py).

hivemind's matchmaking re-reads its group key after every look at its leader queue; a leader waiting
for its declared time did that once per DHT round trip, about 1 MB per node and round at 10 Mbit/s
(bench.compare). The reads an averager awaits are now spaced GROUP_READ_INTERVAL_S apart per key.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from dilocox.peers.dht import GROUP_READ_INTERVAL_S
from dilocox.peers.identity import load_or_create_identity
from dilocox.peers.swarm import Swarm
from hivemind.utils import get_dht_time

pytestmark = pytest.mark.integration  # hivemind peers (p2pd) or node processes: make test, not make check


@pytest.fixture
def swarm(tmp_path):
    _, key = load_or_create_identity(tmp_path / "id.key")
    s = Swarm("paced", key, initial_peers=[], host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
              identity_path=str(tmp_path / "id.key"))
    yield s
    s.shutdown()


def test_reads_of_a_group_key_are_spaced_and_others_are_not(swarm):
    dht = swarm.dht
    group = "paced_pseudo_gradient_sparse1.0b0101"
    assert dht.store(group, subkey=b"leader", value=True, expiration_time=get_dht_time() + 30)

    async def reads(key: str, n: int):
        out, started = [], time.monotonic()
        for _ in range(n):
            out.append(await dht.get(key, latest=True, return_future=True))  # as hivemind's GroupKeyManager
        return out, time.monotonic() - started

    found, elapsed = asyncio.run(reads(group, 5))
    assert all(f is not None and f.value[b"leader"].value is True for f in found)  # the value, as hivemind's get
    assert elapsed >= 4 * GROUP_READ_INTERVAL_S - 0.05
    other = "elsewhere"  # not a group key (no .0b bits): hivemind's own get, unpaced
    assert dht.store(other, value=1, expiration_time=get_dht_time() + 30)
    found, elapsed = asyncio.run(reads(other, 5))
    assert [f.value for f in found] == [1] * 5
    assert elapsed < 2 * GROUP_READ_INTERVAL_S
    assert dht.get(group, latest=True).value[b"leader"].value is True  # a blocking read is not paced either
