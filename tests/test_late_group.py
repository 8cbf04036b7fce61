"""A replica that looks for a group after every other replica of its round has one gives up at once.

Real hivemind peers on loopback. Two replicas match early (their group forms while their last inner steps
would compute, hivemind's ``require_trigger``) and hold it; a third starts looking afterwards. hivemind closes
a group once it is assembled, so the third is never taken in. Its ``RoundWatch`` learns that from the others'
``grouped`` reports and raises RoundLate (the node then re-syncs and computes the next round ahead instead of
waiting out the round: dilocox.consensus.groups_formed_without_us), while the two finish their all-reduce.
"""

import threading
import time
from concurrent.futures import Future

import hivemind
import pytest
import torch
from dilocox.peers.averaging import Abandon, PseudoGradientAverager, RoundGather, RoundLate, RoundWatch

pytestmark = [pytest.mark.integration]


def test_a_replica_whose_round_mates_all_formed_their_group_gives_up_with_round_late():
    size, dhts, averagers = 1024, [], []
    try:
        for _ in range(3):
            dht = hivemind.DHT(initial_peers=dhts[0].get_visible_maddrs() if dhts else None, start=True,
                               host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, startup_timeout=60)
            dhts.append(dht)
            averagers.append(PseudoGradientAverager(size, dht, "late", matchmaking_time_s=2.0, request_timeout_s=1.0,
                                                    averaging_timeout_s=20.0))
        grouped = {0: [], 1: [], 2: []}  # each replica's grouped(...) reports, in order
        ready = [Future(), Future()]
        results, errors = [None] * 3, [None] * 3

        def run(i, watch, ready_i=None):
            gather = RoundGather(outer_step=0, start_digest="same", weight=1.0).dict()
            try:
                results[i] = averagers[i].run_phase("0" * 17, torch.full((size,), float(i)), gather, 1.0, 30,
                                                    threading.Event(), watch, check_every_s=0.5, ready=ready_i)
            except Exception as e:  # noqa: BLE001 - asserted below
                errors[i] = e

        early = [threading.Thread(target=run, args=(i, RoundWatch(grouped=grouped[i].append), ready[i]))
                 for i in range(2)]
        for t in early:
            t.start()
        deadline = time.monotonic() + 30
        while not (grouped[0] and grouped[1]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert grouped[0] == [True] and grouped[1] == [True], f"the two replicas never formed their group: {grouped}"

        looked: list[bool] = []
        began = time.monotonic()

        def abandon(in_group: bool):
            looked.append(in_group)
            # the others' records say grouped; give hivemind 4 s to take us in all the same (it must not)
            return Abandon.GROUPS_FORMED if time.monotonic() - began > 4.0 and not in_group else None

        late = threading.Thread(target=run, args=(2, RoundWatch(abandon, grouped[2].append)))
        late.start()
        late.join(30)
        assert isinstance(errors[2], RoundLate), errors[2]
        assert "every other replica of the round is in a group already" in str(errors[2])
        assert looked and not any(looked) and grouped[2] == [], "a formed group took in a latecomer"

        for f in ready:  # the two replicas' contributions are ready: their all-reduce runs without the third
            f.set_result(True)
        for t in early:
            t.join(40)
        assert errors[:2] == [None, None], errors
        assert all(len(r.gathered) == 2 for r in results[:2])
        assert torch.allclose(results[0].mean[:size], torch.full((size,), 0.5))
    finally:
        for a in averagers:
            a.shutdown()
        for d in dhts:
            d.shutdown()
