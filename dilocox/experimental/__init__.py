"""Research code that only the benchmarks run (bench/quality.py, bench/audit.py): variants measured against the
daemon's algorithms and kept to reproduce those measurements. Nothing in dilocox/ outside this package, peers/ or
daemon/ imports it (tests/test_layout.py).

``overlap``: the eager proxy and the mix merge of overlapped rounds; ``resparsify``: global top-k of a round's
aggregate; ``selections``: the leader and random index sets of shared-index rounds, the union computed in one
place, and the reduction by ranges.
"""
