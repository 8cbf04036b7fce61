"""bench/upload.py's reading of the nodes' metrics: membership operations per node-round (Swarm.traffic)."""

from __future__ import annotations

import json

from bench.upload import membership_ops, table


def _node(folder, counts):
    f = folder / "ckpt" / "metrics.jsonl"
    f.parent.mkdir(parents=True)
    f.write_text("".join(json.dumps(dict(bytes_sent=1, membership=c)) + "\n" for c in counts))


def test_membership_operations_are_counted_per_node_round_after_the_first_round(tmp_path):
    # the first row (start-up: joining, syncing) is left out; rows hold cumulative counts
    _node(tmp_path / "h0", [dict(reads=50, publishes=20, searches=3), dict(reads=56, publishes=24, searches=3),
                            dict(reads=60, publishes=28, searches=4)])
    _node(tmp_path / "h1", [dict(reads=9, publishes=9, searches=1), dict(reads=10, publishes=10, searches=1),
                            dict(reads=18, publishes=14, searches=1)])
    ops = membership_ops(tmp_path)
    assert ops == dict(reads=6.0, publishes=4.0, searches=0.5)  # (4 + 8) / 2, (4 + 4) / 2, (1 + 0) / 2
    assert membership_ops(tmp_path / "nothing") == {}
    row = dict(nodes=2, workload="synthetic:4M:0.25", scheme="shared", default_payload_bytes=100,
               steady_tx_bytes_per_node_round=300, steady_max_tx_bytes_per_node_round=450,
               tx_bytes_per_node_round=350, transport_sent_bytes=200,
               round_s=7.5, group_sizes=[2], digests_agree=True, membership=ops)
    assert "| 6.0 / 4.0 (0.50) |" in table([row])
    assert "| 3.00 | 4.50 | 3.50 |" in table([row])  # mean, busiest node, start-up included
