"""The attack x colluders x seed table of several ``bench.attacks.run`` outputs, one defense: a markdown table (each
cell: honest validation loss vs its own clean run, and the outer step at which the honest nodes' groups excluded the
liars) and a PNG of grouped bars with the +2% target.

    python -m bench.attacks.table runs/bench/attacks-s7/attacks.json runs/bench/attacks-s11/attacks.json \
        --defense default --png docs/img/attacks-screen-30.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(paths: list[Path], defense: str) -> dict:
    """{(attack, colluders): {seed: cell}} from ``bench.attacks.run``'s attacks.json files (clean runs left out)."""
    table: dict = {}
    for path in paths:
        report = json.loads(path.read_text())
        seed = report["args"]["seed"]
        for c in report["cells"]:
            if c["defense"] == defense and c["attack"] != "clean":
                table.setdefault((c["attack"], c["malicious"]), {})[seed] = c
    return table


def markdown(table: dict, seeds: list[int]) -> str:
    head = "| attack | colluders | " + " | ".join(f"seed {s}" for s in seeds) + " | excluded at |\n"
    head += "|---|---|" + "---|" * len(seeds) + "---|\n"
    lines = []
    for (attack, m), by_seed in table.items():
        cells = []
        for s in seeds:
            c = by_seed.get(s)
            v = None if c is None else 100 * c["vs_clean"]
            cells.append("-" if v is None else (f"**{v:+.2f}%**" if v > 2 else f"{v:+.2f}%"))
        steps = [sorted({x for x in by_seed[s]["liar_excluded_at"] if x is not None}) if s in by_seed else []
                 for s in seeds]
        lines.append(f"| {attack} | {m} | " + " | ".join(cells) + " | "
                     + ", ".join("/".join(map(str, st)) or "-" for st in steps) + " |")
    return head + "\n".join(lines)


def plot(table: dict, seeds: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(table)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(seeds)
    for i, s in enumerate(seeds):
        xs = [j + (i - (len(seeds) - 1) / 2) * width for j in range(len(keys))]
        ys = [100 * table[k][s]["vs_clean"] if s in table[k] else 0.0 for k in keys]
        ax.bar(xs, ys, width, label=f"seed {s}", color=f"C{i}")
    ax.axhline(2, color="k", ls="--", lw=0.8)
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xticks(range(len(keys)), [f"{a}\n{m} of 5" for a, m in keys], rotation=60, fontsize=8)
    ax.set_ylabel("honest validation loss vs clean run (%)")
    if max(abs(y) for y in ax.dataLim.intervaly) > 20:  # an outlier would flatten the rest: linear to 5%, then log
        ax.set_yscale("symlog", linthresh=5)
    ax.set_ylim(min(-3.0, ax.get_ylim()[0]), max(3.0, ax.get_ylim()[1]))  # the +2% line always in view
    ax.set_title(f"{title} (dashed: the +2% target)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", type=Path, nargs="+", help="attacks.json files, one per seed")
    ap.add_argument("--defense", default="default")
    ap.add_argument("--png", type=Path)
    ap.add_argument("--title", default="colluders against the defaults, 30 outer steps, 5 real nodes")
    a = ap.parse_args(argv)
    table = load(a.reports, a.defense)
    seeds = sorted({s for by_seed in table.values() for s in by_seed})
    print(markdown(table, seeds))
    if a.png:
        plot(table, seeds, a.png, a.title)


if __name__ == "__main__":
    main()
