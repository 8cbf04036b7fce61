"""centered-clip's opposition screen on synthetic sparse rows (``make bench-robust-screen``): what it stops, and the
knock-out it opens to colluders who see the honest rows.

Rows: ``sparse_rows`` (an honest direction plus ``spread`` x as much noise per row, each row the ``keep`` x n
largest of its own values, like top-k pseudo-gradients whose supports overlap in part). Groups of k members, c of
them colluders (``--groups K:C``; default five with two, and the even groups a member that misses a round leaves),
per cell and seed:

* ``none``: the "colluders" send their own honest rows: a clean group, where any row left out or group given
  nothing is the screen's false positive (the cosine is then with the mean of the first k - c rows);
* ``sign-flip``: the colluders send -1000 x their own honest rows; ``ipm``: all send -2 x the honest mean
  (inner-product manipulation, Xie et al., arXiv 1903.03936);
* ``knock-out``: the colluders see the honest rows and all send m, with m_j the smallest honest value of
  coordinate j where the sum of every other honest row (h0, h2, ...) is positive there, else the largest: the
  median then lies inside the honest values of every coordinate but against those rows (in a group of five with
  three honest rows a, b, c: against a and c), which the screen leaves out if their inner product with it is
  negative, and the rule then runs over the rest and the colluders.

For ``centered-clip`` (with the screen) and ``centered-clip-plain``: the cosine of the aggregate with the honest mean
(1: the honest rows' own direction, 0: nothing applied, < 0: turned around), which rows the screen left out and
how often it applied nothing. Synthetic rows, no
training: this says what the rule does to vectors, not what a model loses (docs/results for that). Prints a table
and writes runs/bench/robust_screen.json and .png.

    python -m bench.robust_screen --spreads 0.5 1 2 4 --keeps 0.1 0.3 --seeds 5 --groups 5:2 4:1 4:2 6:2 6:3
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from dilocox.robust import aggregate, norm

ATTACKS = ("none", "sign-flip", "ipm", "knock-out")


def sparse_rows(k: int, n: int = 4000, seed: int = 0, keep: float = 0.1, spread: float = 2.0) -> dict:
    """k rows like top-k pseudo-gradients (float64, n values): one direction plus ``spread`` x as much noise, each
    row the ``keep`` x n largest values of its own (so the supports overlap only in part); keys p0, p1, ..."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=g, dtype=torch.float64)
    out = {}
    for i in range(k):
        r = base + spread * torch.randn(n, generator=g, dtype=torch.float64)
        top = r.abs().topk(int(keep * n)).indices
        out[f"p{i}"] = torch.zeros(n, dtype=torch.float64).index_copy_(0, top, r[top])
    return out


def attacked(attack: str, pool: dict, colluders: int) -> dict:
    """The members of ``pool`` (``sparse_rows(k)``): honest rows h0, h1, ... and ``colluders`` colluders l0, l1, ...
    of ``attack`` (sign-flip flips the colluders' own honest rows, the last of the pool; knock-out targets every
    other honest row, h0, h2, ...)."""
    rows = [pool[p] for p in sorted(pool, key=lambda p: int(p[1:]))]
    honest = rows[:len(rows) - colluders]
    if attack == "none":
        liars = rows[len(honest):]
    elif attack == "sign-flip":
        liars = [-1000.0 * r for r in rows[len(honest):]]
    elif attack == "ipm":
        liars = [-2.0 * sum(honest) / len(honest)] * colluders
    elif attack == "knock-out":
        values = torch.stack(honest)
        m = torch.where(sum(honest[::2]) > 0, values.min(0).values, values.max(0).values)
        liars = [m.clone() for _ in range(colluders)]
    else:
        raise ValueError(f"unknown attack {attack!r}: expected one of {ATTACKS}")
    return {**{f"h{i}": r for i, r in enumerate(honest)}, **{f"l{i}": r for i, r in enumerate(liars)}}


def cell(attack: str, k: int, colluders: int, spread: float, keep: float, seeds: int) -> dict:
    """Median and smallest cosine with the honest mean under both rules, how often each kind of row was left out and
    how often the screen applied nothing."""
    cos = {"centered-clip": [], "centered-clip-plain": []}
    honest_out = liars_out = nothing = 0
    for seed in range(seeds):
        rows = attacked(attack, sparse_rows(k, seed=seed, spread=spread, keep=keep), colluders)
        mean = sum(r for p, r in rows.items() if p.startswith("h")) / (k - colluders)
        for rule in cos:
            out, report = aggregate(rows, dict.fromkeys(rows, 1.0), rule)
            size = norm(out)
            cos[rule].append(float(out @ mean) / (size * norm(mean)) if size else 0.0)
            if rule == "centered-clip":
                left = [p for p, s in report["clipped"].items() if s == 0.0]
                nothing += not size
                honest_out += 0 if not size else sum(p.startswith("h") for p in left)
                liars_out += 0 if not size else sum(p.startswith("l") for p in left)
    return dict(attack=attack, k=k, colluders=colluders, spread=spread, keep=keep, seeds=seeds,
                cos_screened=round(statistics.median(cos["centered-clip"]), 3),
                min_screened=round(min(cos["centered-clip"]), 3),
                cos_plain=round(statistics.median(cos["centered-clip-plain"]), 3),
                min_plain=round(min(cos["centered-clip-plain"]), 3),
                honest_left_out=honest_out, colluders_left_out=liars_out, nothing_applied=nothing)


def plot(rows: list[dict], path: Path) -> None:
    """One bar pair per group and attack: the median over the cells of each rule's median cosine, with the smallest
    cosine of any cell as a tick (the PNG beside the table)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((r["k"], r["colluders"], r["attack"]) for r in rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.8 * len(keys)), 3.8))
    for offset, (rule, color) in enumerate((("screened", "tab:blue"), ("plain", "tab:gray"))):
        cells = [[r for r in rows if (r["k"], r["colluders"], r["attack"]) == key] for key in keys]
        xs = [i + (offset - 0.5) * 0.38 for i in range(len(keys))]
        ax.bar(xs, [statistics.median(r[f"cos_{rule}"] for r in c) for c in cells], 0.38, color=color,
               label=f"centered-clip{'' if rule == 'screened' else '-plain'}")
        ax.scatter(xs, [min(r[f"min_{rule}"] for r in c) for c in cells], marker="_", color="black", s=60, zorder=3)
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(keys)), [f"{k}:{c}\n{a}" for k, c, a in keys], fontsize=7)
    ax.set_ylim(-1.05, 1.05)
    ax.set_ylabel("cosine with the honest mean")
    ax.set_title("synthetic sparse rows (no training): group k:colluders; bar = median, tick = smallest", fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spreads", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    ap.add_argument("--keeps", type=float, nargs="+", default=[0.1, 0.3])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--groups", nargs="+", default=["5:2", "4:1", "4:2", "6:2", "6:3"], metavar="K:COLLUDERS",
                    help="group sizes and colluders among them")
    ap.add_argument("--out", type=Path, default=Path("runs/bench/robust_screen.json"))
    a = ap.parse_args(argv)
    groups = []
    for g in a.groups:
        k, _, c = g.partition(":")
        if not (k.isdigit() and c.isdigit() and 0 < int(c) < int(k)):
            ap.error(f"--groups {g!r}: expected K:COLLUDERS with 0 < COLLUDERS < K")
        groups.append((int(k), int(c)))
    rows = [cell(attack, k, c, s, kp, a.seeds) for k, c in groups for attack in ATTACKS for s in a.spreads
            for kp in a.keeps]
    print(f"cosine with the honest mean: median (smallest) of {a.seeds} seeds; rows left out and groups with nothing "
          "applied, summed over seeds")
    print(f"{'k:c':<5} {'attack':<10} {'spread':>6} {'keep':>5} {'screened':>15} {'plain':>15} "
          f"{'honest out':>11} {'colluders out':>14} {'nothing':>8}")
    for r in rows:
        print(f"{r['k']}:{r['colluders']:<3} {r['attack']:<10} {r['spread']:>6g} {r['keep']:>5g} "
              f"{r['cos_screened']:>7} ({r['min_screened']:>6}) {r['cos_plain']:>7} ({r['min_plain']:>6}) "
              f"{r['honest_left_out']:>11} {r['colluders_left_out']:>14} {r['nothing_applied']:>8}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rows, indent=1))
    plot(rows, a.out.with_suffix(".png"))
    print(f"wrote {a.out} and {a.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
