"""The Prometheus exporter (daemon/metrics.py): real HTTP scrapes of a real StatusBoard, and the Grafana dashboard's
queries against the names it exports."""

from __future__ import annotations

import json
import math
import re
import socket
import statistics
import time
import urllib.request
from pathlib import Path

import pytest
from dilocox.daemon.metrics import METRICS, check_metrics_addr, start_metrics_server, stop_metrics_server
from dilocox.daemon.status import RoundInfo, StageMemory, State, StatusBoard
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[1] / "docker" / "grafana-dashboard.json"
TOKENS_PER_STEP = 4 * 128  # batch_size * seq_len
SCRAPES = 1000


def _board() -> StatusBoard:
    board = StatusBoard(run_id="metrics-test", version="0.1.0", inner_steps=100)
    board.update(peer_id="QmTestPeer", state=State.TRAINING, outer_step=7, inner_step=40, loss=3.25,
                 tokens_per_second=1234.5, tokens_total=37 * TOKENS_PER_STEP, bytes_sent=10_000,
                 bytes_received=20_000, swarm_size=4, resyncs=2, compute_utilization=0.83, contributions_dropped=1,
                 compression="sparse", overlap="none", admission="authority",
                 memory=StageMemory(params_bytes=100, total_bytes=300),
                 last_round=RoundInfo(outer_step=7, group_size=3, payload_bytes=4096, duration_s=2.5,
                                      compression_ratio=41.5, rank=0, compute_s=10.25, outcome="applied", wait_s=0.5,
                                      bits=2, compression_error=0.62, allreduce_s=1.75))
    return board  # val_loss stays NaN: never measured


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape; the parser raises on anything malformed."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _expected(board: StatusBoard) -> dict[tuple[str, tuple], float]:
    s = board.snapshot()
    r = s.last_round
    plain = {
        "dilocox_outer_step": s.outer_step, "dilocox_inner_step": s.inner_step,
        "dilocox_inner_steps_per_round": s.inner_steps, "dilocox_inner_steps_total": s.tokens_total // TOKENS_PER_STEP,
        "dilocox_loss": s.loss, "dilocox_validation_loss": s.val_loss, "dilocox_tokens_total": s.tokens_total,
        "dilocox_tokens_per_second": s.tokens_per_second, "dilocox_network_sent_bytes_total": s.bytes_sent,
        "dilocox_network_received_bytes_total": s.bytes_received, "dilocox_group_size": r.group_size,
        "dilocox_round_payload_bytes": r.payload_bytes, "dilocox_compression_ratio": r.compression_ratio,
        "dilocox_compression_rank": r.rank, "dilocox_compression_bits": r.bits,
        "dilocox_compression_error": r.compression_error, "dilocox_resyncs_total": s.resyncs,
        "dilocox_swarm_peers": s.swarm_size, "dilocox_contributions_dropped_total": s.contributions_dropped,
        "dilocox_compute_utilization": s.compute_utilization,
    }
    out = {(name, ()): float(v) for name, v in plain.items()}
    for phase, v in (("compute", r.compute_s), ("communication", r.duration_s), ("blocked", r.wait_s),
                     ("allreduce", r.allreduce_s)):
        out[("dilocox_round_phase_seconds", (("phase", phase),))] = v
    for st in State:
        out[("dilocox_state", (("state", st.value),))] = 1.0 if st == s.state else 0.0
    out[("dilocox_round_outcome", (("outcome", "applied"),))] = 1.0
    out[("dilocox_round_outcome", (("outcome", "skipped"),))] = 0.0
    out[("dilocox_memory_bytes", (("part", "total"),))] = 300.0
    info = {"peer_id": s.peer_id, "run_id": s.run_id, "version": s.version, "compression": s.compression,
            "overlap": s.overlap, "admission": s.admission, "outer_algorithm": s.outer_algorithm,
            "stage": "0/1"}
    out[("dilocox_info", tuple(sorted(info.items())))] = 1.0
    return out


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.fixture
def exporter():
    board = _board()
    server, port = start_metrics_server(board, "127.0.0.1:0", tokens_per_step=TOKENS_PER_STEP)
    try:
        yield board, port
    finally:
        stop_metrics_server(server)


def test_scrapes_parse_and_match_the_board(exporter):
    board, port = exporter
    errors, latencies, mismatches = 0, [], []
    for i in range(SCRAPES):
        # the board moves between scrapes: each scrape must show the board as it is then
        board.update(tokens_total=(37 + i) * TOKENS_PER_STEP, outer_step=7 + i // 100)
        expected = _expected(board)
        start = time.perf_counter()
        try:
            got = _scrape(port)
        except Exception as e:  # counted: the assertion below reports how many
            errors += 1
            mismatches.append(f"scrape {i}: {type(e).__name__}: {e}")
            continue
        latencies.append(time.perf_counter() - start)
        wrong = [k for k, v in expected.items() if k not in got or not _same(got[k], v)]
        if wrong:
            mismatches.append(f"scrape {i}: {[(k, expected[k], got.get(k)) for k in wrong[:3]]}")
        assert got[("dilocox_uptime_seconds", ())] >= 0
    median_ms = statistics.median(latencies) * 1000
    print(f"\n{SCRAPES} scrapes, {errors} errors, median {median_ms:.2f} ms, "
          f"p99 {sorted(latencies)[int(0.99 * len(latencies))] * 1000:.2f} ms")
    assert errors == 0 and not mismatches, mismatches[:5]
    assert median_ms < 50


def test_names_follow_conventions(exporter):
    _, port = exporter
    names = {name for name, _ in _scrape(port)}
    ours = {n for n in names if n.startswith("dilocox_")}
    assert ours == set(METRICS), ours ^ set(METRICS)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        families = list(text_string_to_metric_families(reply.read().decode()))
    for family in families:
        if family.name.startswith("dilocox"):
            for sample in family.samples:  # only counters end in _total, and every counter does
                assert sample.name.endswith("_total") == (family.type == "counter"), (sample.name, family.type)


def test_board_before_training_exports_nan_and_zeroes():
    board = StatusBoard(run_id="fresh")
    server, port = start_metrics_server(board, "127.0.0.1:0")
    try:
        got = _scrape(port)
    finally:
        stop_metrics_server(server)
    assert math.isnan(got[("dilocox_loss", ())]) and math.isnan(got[("dilocox_validation_loss", ())])
    assert got[("dilocox_state", (("state", "JOINING"),))] == 1.0
    assert ("dilocox_inner_steps_total", ()) not in got  # no tokens_per_step: not derivable
    assert got[("dilocox_tokens_total", ())] == 0.0


def test_busy_port_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for attempt in (check_metrics_addr, lambda addr: start_metrics_server(StatusBoard(), addr)):
            with pytest.raises(OSError, match=rf"metrics address 127\.0\.0\.1:{port} is not available"):
                attempt(f"127.0.0.1:{port}")
    check_metrics_addr(f"127.0.0.1:{port}")  # free again


@pytest.mark.parametrize("addr", ["9100", "127.0.0.1", "127.0.0.1:http", "127.0.0.1:70000", ":9100"])
def test_malformed_address_is_a_value_error(addr):
    with pytest.raises(ValueError, match="metrics address"):
        start_metrics_server(StatusBoard(), addr)
    with pytest.raises(ValueError, match="metrics address"):
        check_metrics_addr(addr)


def test_stop_closes_the_port():
    server, port = start_metrics_server(StatusBoard(), "127.0.0.1:0")
    stop_metrics_server(server)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        query = var.get("query")
        exprs.append(query["query"] if isinstance(query, dict) else (query if var["type"] == "query" else ""))
    return [e for e in exprs if e]


def test_dashboard_queries_use_exported_names(exporter):
    _, port = exporter
    exported = {name for name, _ in _scrape(port)}
    dash = json.loads(DASHBOARD.read_text())
    assert 36 <= dash["schemaVersion"] <= 41
    assert any(v["type"] == "datasource" and v["query"] == "prometheus" for v in dash["templating"]["list"])
    used = set()
    for expr in _dashboard_exprs():
        names = set(re.findall(r"\bdilocox_[A-Za-z0-9_]+", expr))
        assert names, f"query without a dilocox metric: {expr}"
        used |= names
    assert used <= exported, sorted(used - exported)
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("loss", "tokens/s", "network", "group size", "compression ratio", "state", "resyncs",
                  "contributions dropped", "compute utilization"):
        assert topic in titles, topic
