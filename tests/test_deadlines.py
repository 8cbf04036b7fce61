"""Deadlines from measurement (peers/deadlines.py): the link estimate and the deadlines it gives."""

from __future__ import annotations

import math

import pytest
from dilocox.peers.deadlines import FLOOR_S, MARGIN, LinkEstimate, LinkSnapshot, describe, download_deadline


def measured(mbit: float, latency_s: float = 0.02, batches: int = 12, nbytes: int = 4 << 20) -> LinkSnapshot:
    """A link after ``batches`` downloads of ``nbytes`` at ``mbit`` Mbit/s with ``latency_s`` to the first byte."""
    link = LinkEstimate()
    for _ in range(batches):
        link.observe(nbytes, latency_s + 8 * nbytes / (mbit * 1e6), latency_s)
    return link.snapshot()


@pytest.mark.parametrize("mbit", [1000, 100, 10])
def test_the_estimate_converges_to_the_effective_rate_a_lower_bound_on_the_link(mbit):
    s = measured(mbit)
    effective = 8 * (4 << 20) / (0.02 + 8 * (4 << 20) / (mbit * 1e6))  # latency counts against the rate
    assert s.bps == pytest.approx(effective, rel=1e-6) and s.bps < mbit * 1e6
    assert s.latency_s == pytest.approx(0.02) and s.samples == 12
    assert measured(mbit, latency_s=0.0005).bps == pytest.approx(mbit * 1e6, rel=0.02)


def test_deadlines_scale_with_bytes_and_rate_within_floor_and_cap():
    payload = 2 * 112_761  # two group-mates' sparse payloads of the tiny model
    big = 80 << 20         # two payloads of a model ~350x larger (80 MiB)
    chosen = {mbit: (download_deadline(measured(mbit), payload, 60.0), download_deadline(measured(mbit), big, 600.0))
              for mbit in (1000, 100, 10)}
    # small payloads: the floor everywhere; large ones: MARGIN x the transfer time, until the cap
    assert all(small == FLOOR_S for small, _ in chosen.values())
    assert chosen[1000][1] == FLOOR_S
    rate = {mbit: measured(mbit).bps for mbit in (100, 10)}
    assert chosen[100][1] == pytest.approx(MARGIN * (0.02 + 8 * big / rate[100]))
    assert chosen[10][1] == pytest.approx(MARGIN * (0.02 + 8 * big / rate[10]))  # 201 s
    assert download_deadline(measured(10), big, 120.0) == 120.0  # above the cap: the cap wins
    # a relayed download waits for the relay's own download first
    assert download_deadline(measured(100), big, 600.0, relayed=True) == pytest.approx(2 * chosen[100][1])
    assert 200 < chosen[10][1] < 205 and 20 < chosen[100][1] < 22
    # the cap bounds the floor too (tests run with caps of a few seconds)
    assert download_deadline(measured(100), payload, 2.0) == 2.0


def test_an_unmeasured_link_uses_the_cap_and_nonsense_is_ignored():
    link = LinkEstimate()
    assert download_deadline(link.snapshot(), 10 << 20, 60.0) == 60.0
    for args in ((1000, 0.0, 0.0), (1000, -1.0, 0.5), (1000, math.inf, 0.1), (1000, 1.0, 2.0), (-5, 1.0, 0.1)):
        link.observe(*args)
    assert link.snapshot() == LinkSnapshot()
    link.observe(100, 0.05, 0.05)  # a tiny batch: latency only
    assert link.snapshot().bps == 0 and link.snapshot().latency_s == 0.05
    assert "not measured" in describe(link.snapshot(), None, 60.0)


def test_the_status_line_names_the_measurement_and_the_cap():
    text = describe(measured(10, 0.0004), 7.5, 60.0)
    assert text == "downloads 7.5s (measured 10.0 Mbit/s, 0 ms to first byte, 12 rounds; cap 60s)"
