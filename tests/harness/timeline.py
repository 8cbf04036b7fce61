"""One fault trial as a picture: nodes x time, with the events and every round each node recorded.

``plot_timeline(timeline, path)`` draws one row per node: a marker per round at its wall-clock time,
coloured by the group that averaged it (1 = solo or alone) and labelled with its outer step every few
rounds, hollow when it was not applied (skipped, re-synced), and a vertical line per event (kill,
leave, join, restart, burst) with the node it hit. ``timeline``: ``{"start": t0, "events": [[t,
event, node]], "rounds": {node: [[t, outer_step, group_size, outcome]]}}`` (times in seconds since
the epoch), as ``bench.faults.trial`` returns it.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

SIZE_COLORS = ["#999999", "#fdae61", "#74add1", "#4575b4", "#1a9850", "#762a83", "#000000"]  # 1, 2, ... 7+
EVENT_COLORS = {"kill": "tab:red", "leave": "tab:orange", "join": "tab:green", "restart": "tab:blue",
                "burst": "tab:gray"}


def plot_timeline(timeline: dict, path: Path, title: str = "") -> Path:
    """Write the PNG; returns ``path``. Raises ValueError if the timeline has no node rows."""
    rounds = timeline.get("rounds") or {}
    if not rounds:
        raise ValueError("the timeline has no rounds to draw")
    t0 = timeline.get("start") or min(r[0] for rows in rounds.values() for r in rows)
    names = sorted(rounds, key=lambda n: (len(n), n))
    fig = Figure(figsize=(11, 0.55 * len(names) + 2.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    sizes = sorted({r[2] for rows in rounds.values() for r in rows})
    # fixed colours per group size, so trials compare (grey: alone)
    palette = {size: SIZE_COLORS[min(size, len(SIZE_COLORS)) - 1] for size in sizes}
    for y, name in enumerate(names):
        for t, step, size, outcome in rounds[name]:
            applied = outcome in ("applied", "adopted", "united", "solo", "applied_alone")
            ax.scatter(t - t0, y, s=28, marker="o", color=palette.get(size, "black") if applied else "none",
                       edgecolors=palette.get(size, "black"), linewidths=1.0, zorder=3)
            if step % 5 == 0:
                ax.annotate(str(step), (t - t0, y), textcoords="offset points", xytext=(0, 6), ha="center",
                            fontsize=6, color="#555555")
    for t, event, node in timeline.get("events", []):
        color = EVENT_COLORS.get(event, "black")
        ax.axvline(t - t0, color=color, linestyle="--", linewidth=1.0, zorder=1)
        ax.annotate(f"{event} {node}".strip(), (t - t0, len(names) - 0.4), rotation=90, fontsize=7, color=color,
                    va="bottom", ha="right")
    for size, color in palette.items():
        ax.scatter([], [], color=color, label=f"group of {size}")
    ax.scatter([], [], color="none", edgecolors="black", label="not applied")
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(-0.7, len(names) + 1.2)
    ax.set_xlabel("seconds since the trial began")
    ax.set_title(title or "fault trial: rounds per node (colour: group size) and events")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
