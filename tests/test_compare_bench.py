"""bench.compare's summary: one row per (run, rate) with the median and range of its repeats."""

from bench.compare import summarize


def test_summarize_takes_the_median_and_range_of_repeats():
    rows = [dict(run="a_ddp", rate_mbit=10.0, tokens_per_s=150.0, compute_utilization=0.03, bytes_per_token=7500.0),
            *[dict(run="e_default", rate_mbit=10.0, tokens_per_s=t, compute_utilization=u, bytes_per_token=b,
                   bytes_per_token_reduction_vs_ddp=7500.0 / b)
              for t, u, b in [(3800.0, 0.96, 2.0), (3600.0, 0.91, 2.5), (3900.0, 0.97, 1.9)]]]
    ddp, default = summarize(rows)
    assert (ddp["repeats"], ddp["tokens_per_s"]) == (1, 150.0)
    assert default["repeats"] == 3
    assert (default["tokens_per_s"], default["spread"]["tokens_per_s"]) == (3800.0, [3600.0, 3900.0])
    assert (default["bytes_per_token"], default["spread"]["bytes_per_token"]) == (2.0, [1.9, 2.5])
    assert default["bytes_per_token_reduction_vs_ddp"] == 3750.0


def test_bytes_per_round_counts_between_round_ends_from_the_last_sample_before_each():
    from bench.traffic import bytes_per_round

    samples = [(0.0, 0), (1.0, 100), (2.0, 250), (3.0, 1000), (4.0, 1100)]
    assert bytes_per_round(samples, [1.5, 3.5]) == [900]  # 1000 at 3.5 minus 100 at 1.5
    assert bytes_per_round(samples, [0.5, 2.0, 4.0]) == [250, 850]


def test_averaging_starts_reads_the_times_of_the_nodes_log():
    from datetime import datetime

    from bench.traffic import averaging_starts

    log = ("2026-11-25 01:17:40,919 INFO dilocox.daemon.node: state TRAINING -> AVERAGING (outer step 0)\n"
           "2026-11-25 01:17:41,451 INFO dilocox.daemon.node: state AVERAGING -> TRAINING (outer step 1)\n")
    assert averaging_starts(log) == [datetime(2026, 11, 25, 1, 17, 40, 919000).timestamp()]

