"""A reducer that returns only part of its results (a hivemind hazard: docs/operations.md) is detected, never applied.

Three real hivemind peers on loopback average 8-bit integer codes (the wire form of compressed
pseudo-gradients, sent as uint8 by peers/codec.py); one of them, as a reducer, stops streaming
averaged parts after the first one. hivemind then reports success with
'received N% results' on the others; the result digests disagree and ``judge_result`` tells
every member not to apply it.
"""

import threading
from typing import AsyncIterator

import hivemind
import pytest
import torch
from dilocox.peers.averaging import PhaseControl, PseudoGradientAverager, RoundGather
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from dilocox.consensus import Verdict, judge_result
from dilocox.diloco import params_digest

pytestmark = [pytest.mark.integration, pytest.mark.swarm]


class TruncatingAverager(PseudoGradientAverager):
    """A faulty peer: as a reducer it streams back only the first averaged part, then hangs up."""

    async def rpc_aggregate_part(  # hivemind registers RPC handlers by their annotations
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        sent = 0
        async for message in super().rpc_aggregate_part(stream, context):
            if sent >= 1:
                return
            yield message
            sent += 1


# hivemind names RPC protocols after the servicer class: the faulty peer must look like an honest one
FaultyPeer = type("PseudoGradientAverager", (TruncatingAverager,), {})


def test_partial_result_is_detected_and_not_applied():
    size = 64 * 1024  # 256 KiB of fp32 buffer: several 16 KiB parts per reducer
    dhts, averagers = [], []
    try:
        for i in range(3):
            dht = hivemind.DHT(initial_peers=dhts[0].get_visible_maddrs() if dhts else None, start=True,
                               host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, startup_timeout=60)
            dhts.append(dht)
            cls = FaultyPeer if i == 2 else PseudoGradientAverager
            averagers.append(cls(size, dht, "partial", matchmaking_time_s=3.0, request_timeout_s=1.0,
                                 averaging_timeout_s=20.0, part_size_bytes=16 * 1024))
        inputs = [128.0 + torch.randint(-63, 64, (size,)).float() for _ in range(3)]
        results = [None] * 3

        def run(i):
            gather = RoundGather(outer_step=0, start_digest="same", weight=1.0).dict()
            results[i] = averagers[i].run_phase("0" * 17, inputs[i], gather, 1.0, PhaseControl(30, threading.Event()))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(r is not None for r in results), "hivemind reported the round as a success on every peer"
        assert all(len(r.gathered) == 3 for r in results)
        assert all(r.bytes_sent < 0.7 * 2 * 2 / 3 * 4 * size for r in results)  # uint8 up, fp32 back
        digests = {str(i): params_digest([r.mean]) for i, r in enumerate(results)}
        honest = [params_digest([r.mean]) for r in results[:2]]
        assert honest[0] != honest[1], "the honest peers should each have missed the faulty reducer's parts"
        verdicts = [judge_result(digests[str(i)], digests) for i in range(3)]
        assert verdicts == [Verdict.SKIP] * 3, (verdicts, digests)  # the other verdicts: tests/test_consensus.py
    finally:
        for a in averagers:
            a.shutdown()
        for d in dhts:
            d.shutdown()
