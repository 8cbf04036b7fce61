"""Deadlines from measurement (peers/deadlines.py): the link estimate and the deadlines it gives."""

from __future__ import annotations

import math

import pytest
from dilocox.peers.deadlines import (
    FLOOR_S,
    GROUP_WAIT_FLOOR_S,
    LAG_WINDOW,
    MARGIN,
    MATCHMAKING_FLOOR_S,
    MATCHMAKING_TRIPS,
    LinkEstimate,
    LinkSnapshot,
    RoundDeadlines,
    RoundTimes,
    describe,
    download_deadline,
    group_download_deadline,
    matchmaking_floor,
)


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


def round_deadlines(latency_s: float = 0.02, lags=(0.0,), mm_cap: float = 15.0, wait_cap: float = 240.0,
                    request_timeout: float = 5.0) -> RoundDeadlines:
    """RoundDeadlines after a measured link (``latency_s`` to the first byte) and one round per compute lag."""
    link = LinkEstimate()
    for _ in range(4):
        link.observe(1 << 20, latency_s + 0.1, latency_s)
    d = RoundDeadlines(link, matchmaking_cap_s=mm_cap, group_wait_cap_s=wait_cap, request_timeout_s=request_timeout)
    for lag in lags:
        d.observe_group(10.0, [10.0, 10.0 + lag, 9.0])
    return d


def test_matchmaking_follows_latency_within_floor_and_cap():
    assert matchmaking_floor(15.0, 5.0) == MATCHMAKING_FLOOR_S == 6.0
    assert matchmaking_floor(15.0, 8.0) == 9.0      # longer than a request: hivemind warns otherwise
    assert matchmaking_floor(4.0, 1.0) == 4.0       # never above the flag
    assert round_deadlines(0.02).current().matchmaking_s == MATCHMAKING_FLOOR_S  # loopback, LAN, WAN alike
    relay = round_deadlines(0.8).current().matchmaking_s  # a satellite hop or a relay across continents
    assert relay == pytest.approx(MARGIN * MATCHMAKING_TRIPS * 0.8) and MATCHMAKING_FLOOR_S < relay < 15.0
    assert round_deadlines(3.0).current().matchmaking_s == 15.0  # the flag caps it


def test_the_group_wait_covers_the_slowest_members_compute_lag():
    fast = round_deadlines(lags=(0.0,)).current()
    assert fast.measured and fast.group_wait_s == GROUP_WAIT_FLOOR_S  # 3 x (6 + 0) < the floor
    slow = round_deadlines(lags=(30.0,)).current()
    assert slow.group_wait_s == pytest.approx(MARGIN * (MATCHMAKING_FLOOR_S + 30.0))  # 108 s
    assert round_deadlines(lags=(200.0,)).current().group_wait_s == 240.0  # the cap
    # the largest lag of the last LAG_WINDOW rounds counts: one fast round does not forget a slow member
    d = round_deadlines(lags=(30.0,) + (0.0,) * (LAG_WINDOW - 1))
    assert d.current().group_wait_s == pytest.approx(108.0)
    d.observe_group(10.0, [10.0])
    assert d.current().group_wait_s == GROUP_WAIT_FLOOR_S
    # flags below the floors (tests run with a few seconds) stay as they are
    small = round_deadlines(lags=(0.0,), mm_cap=4.0, wait_cap=22.0, request_timeout=1.0).current()
    assert (small.matchmaking_s, small.group_wait_s) == (4.0, 22.0)


def test_round_deadlines_use_the_flags_until_measured_and_ignore_nonsense():
    caps = RoundTimes(15.0, 240.0, measured=False)
    flags_only = RoundDeadlines(None, matchmaking_cap_s=15.0, group_wait_cap_s=240.0, request_timeout_s=5.0)
    flags_only.observe_group(10.0, [50.0])
    assert flags_only.current() == caps and flags_only.floor_s == 15.0  # no link: the averager keeps the flag
    d = RoundDeadlines(LinkEstimate(), matchmaking_cap_s=15.0, group_wait_cap_s=240.0, request_timeout_s=5.0)
    d.observe_group(10.0, [50.0])
    assert d.current() == caps  # a group, but no download measured yet
    d = round_deadlines(lags=())
    assert d.current() == caps  # a link, but no group yet
    for own, group in ((0.0, [5.0]), (math.inf, [5.0]), (10.0, [math.nan, -1.0, math.inf]), (10.0, [])):
        d.observe_group(own, group)
    assert d.current() == caps
    assert "(flags; not measured yet)" in d.describe(None, 60.0)


def test_the_round_status_line_names_each_deadline_and_its_source():
    text = round_deadlines(lags=(30.0,)).describe(7.5, 60.0)
    assert text.startswith("matchmaking 6.0s (cap 15s), round 115.5s (group wait 108.0s for a compute lag of "
                           "30.0s, cap 240s; plus downloads), downloads 7.5s (measured "), text


def test_a_group_waits_as_long_as_its_slowest_or_unmeasured_member_needs():
    """Every member computes the same deadline from the links the group announced, so they all stop waiting
    for a member that died at about the same time (a joiner's unmeasured link makes it the cap)."""
    fast, slow, big = measured(1000), measured(10), 80 << 20
    assert group_download_deadline([fast, slow], big, 600.0) == download_deadline(slow, big, 600.0) > 200
    assert group_download_deadline([slow, fast], big, 600.0, relayed=True) == download_deadline(slow, big, 600.0,
                                                                                                relayed=True)
    assert group_download_deadline([fast, LinkSnapshot()], 1000, 8.0) == 8.0  # a joiner: the cap
    assert group_download_deadline([fast, fast], 1000, 8.0) == FLOOR_S
    assert group_download_deadline([], 1000, 8.0) == 8.0


def test_a_state_download_seeds_the_rate_until_a_round_is_measured():
    """A joiner's state download (80 MB in 8 s here) gives its first rounds a download deadline from a rate
    instead of the cap, which its whole group would wait; matchmaking keeps the flags, and a round's own
    measurement then takes over. Nonsense and a state too small to time are ignored."""
    link = LinkEstimate()
    for args in ((80 << 20, 0.0), (80 << 20, -1.0), (80 << 20, math.inf), (100, 1.0)):
        link.seed(*args)
    assert link.snapshot() == LinkSnapshot()
    link.seed(80 << 20, 8.0)
    seeded = link.snapshot()
    assert seeded.samples == 0 and seeded.latency_s == 0.0 and seeded.bps == pytest.approx(8 * (80 << 20) / 8.0)
    assert download_deadline(seeded, 1 << 20, 60.0) == FLOOR_S  # 0.1 s at that rate, x MARGIN: the floor
    assert download_deadline(seeded, 200 << 20, 60.0) == pytest.approx(MARGIN * 20.0)
    assert "the state download's 83.9 Mbit/s; no round measured yet" in describe(seeded, 5.0, 60.0)
    d = RoundDeadlines(link, matchmaking_cap_s=15.0, group_wait_cap_s=240.0, request_timeout_s=5.0)
    d.observe_group(10.0, [12.0])
    assert d.current() == RoundTimes(15.0, 240.0, measured=False)  # no latency known: the flags
    link.seed(1 << 20, 8.0)  # a second sync before any round: the newest state download
    assert link.snapshot().bps == pytest.approx(8 * (1 << 20) / 8.0)
    link.observe(1 << 20, 0.3, 0.1)  # the first round: its latency, its rate blended with the seed
    after = link.snapshot()
    assert after.samples == 1 and after.latency_s == 0.1
    link.seed(80 << 20, 0.001)  # once a round is measured, a state download changes nothing
    assert link.snapshot() == after
