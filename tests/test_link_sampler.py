"""bench.compare's steady-round bytes: a host's tx between the end of its first round and of its last, per round,
so start-up traffic (the DHT join, the wait for the other replicas) is not charged to the rounds."""

from __future__ import annotations

import math

import pytest

from bench.compare import sent_at, steady_bytes_per_round

# host 0 sends 100 B/s after t = 10 (a start-up burst of 5000 B before); host 1 sends 50 B/s from t = 0
SAMPLES = [(float(t), {0: 5000 + 100 * max(t - 10, 0) if t >= 10 else 500 * t, 1: 50 * t}) for t in range(0, 61, 2)]


def test_counters_are_interpolated_between_samples_and_refused_outside():
    assert sent_at(SAMPLES, 1, 3.0) == pytest.approx(150.0)
    assert sent_at(SAMPLES, 0, 21.0) == pytest.approx(6100.0)
    with pytest.raises(ValueError, match="no samples around"):
        sent_at(SAMPLES, 0, 61.0)


def test_start_up_is_left_out_and_hosts_are_averaged():
    rounds0 = [{"time": t} for t in (20.0, 30.0, 40.0, 50.0)]  # 3 steady rounds of 10 s: 1000 B each
    rounds1 = [{"time": t} for t in (21.0, 41.0)]  # 1 steady round of 20 s: 1000 B
    assert steady_bytes_per_round(SAMPLES, [rounds0, rounds1]) == pytest.approx(1000.0)
    assert math.isnan(steady_bytes_per_round(SAMPLES, [rounds0[:1]]))


def test_the_busiest_host_is_the_max_over_hosts():
    rounds0 = [{"time": t} for t in (20.0, 30.0)]  # 1000 B in its round
    rounds1 = [{"time": t} for t in (20.0, 30.0)]  # 500 B
    assert steady_bytes_per_round(SAMPLES, [rounds0, rounds1], max) == pytest.approx(1000.0)
    assert steady_bytes_per_round(SAMPLES, [rounds0, rounds1]) == pytest.approx(750.0)


def test_hosts_without_samples_are_left_out():
    rounds = [{"time": t} for t in (20.0, 30.0)]
    assert steady_bytes_per_round(SAMPLES, [rounds, rounds, rounds]) == pytest.approx(
        steady_bytes_per_round(SAMPLES, [rounds, rounds]))
    assert math.isnan(steady_bytes_per_round([], [rounds]))
