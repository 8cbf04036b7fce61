"""``plot_run`` (daemon/plot.py): a PNG from a node's metrics.jsonl, and clear errors on bad input."""

from __future__ import annotations

import json
import logging
import math
import random
from pathlib import Path

import pytest
from dilocox.daemon.plot import plot_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _round(step: int, rng: random.Random) -> dict:
    """A record shaped like daemon/node.py's _record (RoundInfo fields + losses, throughput, time)."""
    outcome = "skipped" if step % 17 == 0 else ("resynced" if step == 23 else "applied")
    return {
        "outer_step": step, "group_size": 3 if outcome == "applied" else 1, "payload_bytes": 40_000,
        "duration_s": 2.0 + rng.random(), "compression_ratio": 40.0 + rng.random(), "rank": 0,
        "compute_s": 10.0 + rng.random(), "outcome": outcome, "bytes_sent": 80_000 + rng.randrange(5000),
        "bytes_received": 160_000 + rng.randrange(5000), "wait_s": 0.3, "bits": 2, "compression_error": 0.6,
        "allreduce_s": 1.1, "dropped": [], "peer_id": "QmSyntheticPeer", "digest": f"{step:016x}",
        "loss": 4.0 * math.exp(-step / 30) + 1.5 + 0.05 * rng.random(),
        "val_loss": (4.1 * math.exp(-step / 30) + 1.6) if step % 5 == 0 else float("nan"),
        "tokens_total": step * 51_200, "tokens_per_second": 2000 + 100 * rng.random(), "overlap": "none",
        "compute_utilization": 0.8, "time": 1.7e9 + 12 * step,
    }


def _write(run_dir: Path, lines: list[str]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return run_dir


def _good_lines(n: int) -> list[str]:
    rng = random.Random(0)
    return [json.dumps(_round(step, rng), sort_keys=True) for step in range(1, n + 1)]  # NaN as node.py writes it


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 10_000, len(data)


def test_synthetic_run_makes_a_png(tmp_path):
    run_dir = _write(tmp_path / "ckpt", _good_lines(60))
    out = plot_run(run_dir, tmp_path / "run.png")
    assert out == tmp_path / "run.png"
    _assert_png(out)


def test_malformed_lines_are_skipped_and_counted(tmp_path, caplog):
    lines = _good_lines(20)
    lines[3] = "{not json"
    lines[7] = json.dumps({"loss": 1.0})  # no outer_step
    lines[9] = "[1, 2]"  # not an object
    lines.insert(12, "")  # blank lines are not malformed
    run_dir = _write(tmp_path / "ckpt", lines)
    with caplog.at_level(logging.WARNING, logger="dilocox.daemon.plot"):
        _assert_png(plot_run(run_dir, tmp_path / "run.png"))
    assert "skipped 3 malformed line(s), the first at line 4" in caplog.text


def test_a_single_round_plots(tmp_path):
    _assert_png(plot_run(_write(tmp_path / "ckpt", _good_lines(1)), tmp_path / "one.png"))


@pytest.mark.parametrize("case, match", [
    ("missing_dir", "does not exist"),
    ("file_not_dir", "not a directory"),
    ("no_file", "no such file"),
    ("empty", "no records"),
    ("blank", "no records"),
    ("all_malformed", r"only malformed lines \(2, the first at line 1\)"),
])
def test_bad_input_is_a_value_error(tmp_path, case, match):
    run_dir = tmp_path / "ckpt"
    if case == "file_not_dir":
        run_dir.write_text("x")
    elif case == "no_file":
        run_dir.mkdir()
    elif case == "empty":
        _write(run_dir, [])
    elif case == "blank":
        (run_dir.mkdir(), (run_dir / "metrics.jsonl").write_text("\n\n  \n"))
    elif case == "all_malformed":
        _write(run_dir, ["garbage", json.dumps({"outer_step": "seven"})])
    with pytest.raises(ValueError, match=match):
        plot_run(run_dir, tmp_path / "out.png")
    assert not (tmp_path / "out.png").exists()


def test_unwritable_output_is_a_value_error(tmp_path):
    run_dir = _write(tmp_path / "ckpt", _good_lines(3))
    with pytest.raises(ValueError, match="cannot write"):
        plot_run(run_dir, tmp_path / "no-such-dir" / "run.png")
