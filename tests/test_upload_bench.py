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


def test_earlier_runs_merge_into_one_table_and_plot_a_later_row_replacing_an_earlier_and_bad_files_refused(tmp_path):
    import pytest

    from bench.upload import main, merged_rows

    def row(k, workload, tx):
        return dict(nodes=k, workload=workload, scheme="shared", default_payload_bytes=100,
                    steady_tx_bytes_per_node_round=tx, steady_max_tx_bytes_per_node_round=tx,
                    tx_bytes_per_node_round=tx, transport_sent_bytes=200, round_s=7.5, group_sizes=[k],
                    digests_agree=True, membership={})

    (tmp_path / "a.json").write_text(json.dumps(dict(emulated=True, rows=[row(8, "synthetic:4M:0.25", 500),
                                                                           row(16, "synthetic:4M:0.25", 900)])))
    (tmp_path / "b.json").write_text(json.dumps(dict(emulated=True, rows=[row(16, "synthetic:4M:0.25", 700),
                                                                           row(8, "synthetic:25M:0.5", 280)])))
    rows = merged_rows([tmp_path / "a.json", tmp_path / "b.json"])
    assert [(r["nodes"], r["workload"], r["steady_tx_bytes_per_node_round"]) for r in rows] == [
        (8, "synthetic:25M:0.5", 280), (8, "synthetic:4M:0.25", 500), (16, "synthetic:4M:0.25", 700)]
    assert main(["--plot-from", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "upload.png").stat().st_size > 1000
    assert "| 16 | 4M | shared | 0.001 MB | 7.00 |" in (tmp_path / "o" / "upload.md").read_text()
    (tmp_path / "c.json").write_text(json.dumps(dict(rows=[])))
    with pytest.raises(ValueError, match="c.json: not marked as an emulated workload"):
        merged_rows([tmp_path / "c.json"])
    (tmp_path / "d.json").write_text("{")
    with pytest.raises(ValueError, match="d.json: not a bench.upload result"):
        merged_rows([tmp_path / "d.json"])
