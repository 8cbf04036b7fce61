"""A lone node trains about as fast as a bare transformers loop of its model (bench/node_overhead.py, short run).

The full measurement is ``make bench-node-overhead`` (H = 100); this keeps a short one in CI's reach. The bound is
on the rate per inner step, loose enough for a shared 2-core machine and tight enough to catch what once cost a
third of the speed (glibc's mmap threshold fixed by hand: 0.62; a second OpenMP team: 0.87). Between metrics rows,
H = 10 leaves every round's evaluation (about 1.5 s) in the figure, so that bound is lower."""

import pytest

from bench import node_overhead

pytestmark = [pytest.mark.integration, pytest.mark.swarm]


def test_a_lone_node_trains_near_the_speed_of_a_bare_loop(tmp_path, capsys):
    code = node_overhead.main(["--model", "llama-20m", "--inner-steps", "10", "--rounds", "2", "--repeats", "1",
                               "--threads", "2", "--timeout", "300", "--min-step-ratio", "0.85", "--min-ratio", "0.7",
                               "--out", str(tmp_path / "overhead.json")])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
