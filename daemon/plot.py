"""Draw a node's run from its metrics.jsonl (one JSON object per outer round, written by daemon/node.py).

``plot_run(Path("ckpt"), Path("run.png"))`` writes one PNG with a panel per figure, against the outer step:
train and validation loss, tokens/s, bytes per round, group size, compression ratio, and round time by phase.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def load_rounds(path: Path) -> tuple[list[dict], int]:
    """Records of ``path`` by outer step (the last record of a step wins: a restarted node may redo one), and the
    number of lines skipped as malformed (not a JSON object with an integer outer_step). Blank lines are ignored.
    Raises ValueError naming the file when it cannot be read or holds no usable record."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError as e:
        raise ValueError(f"{path}: no such file (is the run directory a node's --checkpoint-dir?)") from e
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror}") from e
    by_step: dict[int, dict] = {}
    skipped, first_bad = 0, None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = record["outer_step"]
            if not isinstance(step, int) or isinstance(step, bool):
                raise TypeError("outer_step is not an integer")
        except (ValueError, KeyError, TypeError):
            skipped += 1
            first_bad = first_bad or number
            continue
        by_step[step] = record
    if skipped:
        logger.warning("%s: skipped %d malformed line(s), the first at line %d", path, skipped, first_bad)
    if not by_step:
        what = f"only malformed lines ({skipped}, the first at line {first_bad})" if skipped else "no records"
        raise ValueError(f"{path}: {what}")
    return [by_step[k] for k in sorted(by_step)], skipped


def _series(rounds: list[dict], key: str, scale: float = 1.0) -> list[float]:
    """``key`` of every round as floats (NaN where missing or not a number), times ``scale``."""
    out = []
    for r in rounds:
        v = r.get(key)
        out.append(float(v) * scale if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan)
    return out


def plot_run(run_dir: Path, out: Path) -> Path:
    """Read ``run_dir``/metrics.jsonl and write a PNG of the run to ``out``; returns ``out``.

    Raises ValueError naming the problem: ``run_dir`` missing or not a directory, metrics.jsonl missing, empty or
    without a usable line (malformed lines among good ones are skipped, counted in a warning and in the title),
    or ``out`` not writable."""
    run_dir, out = Path(run_dir), Path(out)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir}: {'not a directory' if run_dir.exists() else 'does not exist'}")
    path = run_dir / METRICS_FILE
    rounds, skipped = load_rounds(path)
    steps = [r["outer_step"] for r in rounds]

    fig = Figure(figsize=(13, 11), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    peer = next((r["peer_id"] for r in reversed(rounds) if isinstance(r.get("peer_id"), str)), "")
    title = f"{run_dir}: {len(rounds)} outer rounds" + (f", peer {peer[:16]}" if peer else "")
    fig.suptitle(title + (f" ({skipped} malformed line(s) skipped)" if skipped else ""))
    axes = fig.subplots(3, 2, sharex=True).flatten()

    ax = axes[0]
    ax.plot(steps, _series(rounds, "loss"), label="train (mean of the round)")
    val = [(s, v) for s, v in zip(steps, _series(rounds, "val_loss")) if math.isfinite(v)]  # measured rounds only
    if val:
        ax.plot(*zip(*val), marker="o", markersize=3, label="validation")
    ax.set(title="loss", ylabel="cross-entropy (nats/token)")
    ax.legend()

    ax = axes[1]
    ax.plot(steps, _series(rounds, "tokens_per_second"))
    ax.set(title="throughput", ylabel="tokens/s")

    ax = axes[2]
    largest = max((v for k in ("bytes_sent", "bytes_received") for v in _series(rounds, k) if math.isfinite(v)),
                  default=0.0)
    unit, scale = next((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("bytes", 1))
                       if largest >= s or s == 1)
    ax.plot(steps, _series(rounds, "bytes_sent", 1 / scale), label="sent")
    ax.plot(steps, _series(rounds, "bytes_received", 1 / scale), label="received")
    ax.set(title="network per round", ylabel=unit)
    ax.legend()

    ax = axes[3]
    ax.step(steps, _series(rounds, "group_size"), where="mid", label="group size")
    # rounds that did not apply a group mean, so gaps in averaging show up at a glance
    for outcome, marker in (("skipped", "x"), ("resynced", "v"), ("applied_alone", "s"), ("solo", ".")):
        hits = [(s, r.get("group_size", 0)) for s, r in zip(steps, rounds) if r.get("outcome") == outcome]
        if hits:
            ax.plot(*zip(*hits), linestyle="none", marker=marker, label=outcome)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(bottom=0)
    ax.set(title="group size", ylabel="replicas")
    ax.legend()

    ax = axes[4]
    ax.plot(steps, _series(rounds, "compression_ratio"))
    ax.set(title="compression ratio", ylabel="fp32 bytes / sent bytes", xlabel="outer step")

    ax = axes[5]
    for key, label in (("compute_s", "compute"), ("duration_s", "communication"), ("wait_s", "blocked")):
        ax.plot(steps, _series(rounds, key), label=label)
    ax.set(title="round time", ylabel="seconds", xlabel="outer step")
    ax.legend()

    axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))  # outer steps; the x axis is shared
    for ax in axes:
        ax.grid(alpha=0.3)
    try:
        fig.savefig(out, format="png")
    except OSError as e:
        raise ValueError(f"cannot write {out}: {e.strerror or e}") from e
    return out
