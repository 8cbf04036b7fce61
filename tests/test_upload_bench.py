"""bench/upload.py's reading of the nodes' metrics: membership operations per node-round (Swarm.traffic)."""

from __future__ import annotations

import json

import pytest

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
    assert "by caller" not in table([row])  # no reads_by counts (runs before them)


def test_membership_reads_are_broken_down_by_caller_most_first(tmp_path):
    _node(tmp_path / "h0", [{"reads": 5, "reads_by:rounds.start": 2},
                            {"reads": 8, "reads_by:rounds.start": 3, "reads_by:majority.check": 2},
                            {"reads": 12, "reads_by:rounds.start": 4, "reads_by:majority.check": 5}])
    ops = membership_ops(tmp_path)
    assert ops["reads_by:majority.check"] == 3.0 and ops["reads_by:rounds.start"] == 1.0
    row = dict(nodes=1, workload="synthetic:4M:0.25", scheme="shared", default_payload_bytes=100,
               steady_tx_bytes_per_node_round=300, steady_max_tx_bytes_per_node_round=450,
               tx_bytes_per_node_round=350, transport_sent_bytes=200, round_s=7.5, group_sizes=[1],
               digests_agree=True, membership=dict(ops, publishes=0, searches=0))
    assert "- k = 1, 4M values, shared: majority.check 3.00, rounds.start 1.00" in table([row])


def test_earlier_runs_merge_into_one_table_and_plot_a_later_row_replacing_an_earlier_and_bad_files_refused(tmp_path):
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


def test_the_payload_fit_splits_upload_into_a_part_per_payload_byte_and_a_fixed_part():
    from bench.upload import payload_fit, table

    def row(k, workload, payload, tx):
        return dict(nodes=k, workload=workload, scheme="shared", default_payload_bytes=payload,
                    steady_tx_bytes_per_node_round=tx, steady_max_tx_bytes_per_node_round=tx,
                    tx_bytes_per_node_round=tx, transport_sent_bytes=2.5 * payload, round_s=7.5, group_sizes=[k],
                    digests_agree=True, membership={})

    # k = 8: tx = 2.5 p + 100 KB at p = 137 KB and 854 KB; 3x from 100 / 0.5 = 200 KB on
    # k = 32: three payloads, slope 3.2 (over the target): no payload meets 3x; k = 16 has one payload: no fit
    rows = [row(8, "synthetic:4M:0.25", 137e3, 2.5 * 137e3 + 100e3), row(8, "synthetic:25M:0.5", 854e3,
                                                                         2.5 * 854e3 + 100e3),
            row(16, "synthetic:4M:0.25", 137e3, 600e3),
            *(row(32, f"synthetic:{m}M:0.25", m * 34e3, 3.2 * m * 34e3 + 50e3) for m in (4, 8, 12))]
    fits = {f["nodes"]: f for f in payload_fit(rows)}
    assert set(fits) == {8, 32}
    assert fits[8]["slope"] == pytest.approx(2.5) and fits[8]["fixed_bytes"] == pytest.approx(100e3)
    assert fits[8]["payload_at_target"] == pytest.approx(200e3)
    assert fits[8]["payloads"] == [137e3, 854e3]
    assert fits[32]["slope"] == pytest.approx(3.2) and fits[32]["payload_at_target"] is None
    text = table(rows)
    assert "| 8 | shared | 137 KB, 854 KB | 2.50 | 100 KB | 200 KB |" in text
    assert "| 32 | shared | 136 KB, 272 KB, 408 KB | 3.20 | 50 KB | never (slope >= 3) |" in text
    assert payload_fit(rows[2:3]) == []


def test_runs_at_two_payload_sizes_merge_into_a_fit_table_and_its_plot(tmp_path):
    from bench.upload import main

    def row(workload, payload, tx):
        return dict(nodes=16, workload=workload, scheme="shared", default_payload_bytes=payload,
                    steady_tx_bytes_per_node_round=tx, steady_max_tx_bytes_per_node_round=tx,
                    tx_bytes_per_node_round=tx, transport_sent_bytes=2.5 * payload, round_s=7.5, group_sizes=[16],
                    digests_agree=True, membership={})

    (tmp_path / "a.json").write_text(json.dumps(dict(emulated=True, rows=[row("synthetic:4M:0.25", 137e3, 540e3)])))
    (tmp_path / "b.json").write_text(json.dumps(dict(emulated=True, rows=[row("synthetic:25M:0.5", 854e3, 2.4e6)])))
    assert main(["--plot-from", str(tmp_path / "a.json"), "--out", str(tmp_path / "one")]) == 0
    assert not (tmp_path / "one" / "upload-payloads.png").exists()  # one payload size: nothing to fit
    assert main(["--plot-from", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "upload-payloads.png").stat().st_size > 1000
    fits = json.loads((tmp_path / "o" / "upload.json").read_text())["fits"]
    assert [f["nodes"] for f in fits] == [16] and fits[0]["payloads"] == [137e3, 854e3]
    assert "| 16 | shared | 137 KB, 854 KB |" in (tmp_path / "o" / "upload.md").read_text()
