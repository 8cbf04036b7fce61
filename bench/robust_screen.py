"""centered-clip's opposition screen on synthetic sparse rows (``make bench-robust-screen``): what it stops, and the
knock-out it opens to colluders who see the honest rows.

Rows: ``sparse_rows`` (an honest direction plus ``spread`` x as much noise per row, each row the ``keep`` x n
largest of its own values, like top-k pseudo-gradients whose supports overlap in part). Five members, two of
them colluders, per cell and seed:

* ``sign-flip``: the colluders send -1000 x their own honest rows; ``ipm``: both send -2 x the honest mean
  (inner-product manipulation, Xie et al., arXiv 1903.03936);
* ``knock-out``: the colluders see the three honest rows a, b, c and both send m, with m_j the smallest honest
  value of coordinate j where a_j + c_j > 0, else the largest: the median then lies inside the honest values of
  every coordinate but against a and c, which the screen leaves out if their inner product with it is negative,
  and the rule then runs over b and the two colluders.

For ``centered-clip`` (with the screen) and ``centered-clip-plain``: the cosine of the aggregate with the honest mean
(1: the honest rows' own direction, < 0: turned around) and which rows the screen left out. Synthetic rows, no
training: this says what the rule does to vectors, not what a model loses (docs/results for that). Prints a table
and writes runs/bench/robust_screen.json.

    python -m bench.robust_screen --spreads 0.5 1 2 4 --keeps 0.1 0.3 --seeds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from dilocox.robust import aggregate, norm

ATTACKS = ("sign-flip", "ipm", "knock-out")


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


def attacked(attack: str, pool: dict) -> dict:
    """Five members from ``sparse_rows(5)``: the honest p0-p2 and the colluders l1, l2 of ``attack`` (sign-flip
    flips the colluders' own honest rows p3, p4)."""
    a, b, c = pool["p0"], pool["p1"], pool["p2"]
    if attack == "sign-flip":
        liars = [-1000.0 * pool["p3"], -1000.0 * pool["p4"]]
    elif attack == "ipm":
        liars = [-2.0 * (a + b + c) / 3] * 2
    elif attack == "knock-out":
        values = torch.stack([a, b, c])
        m = torch.where(a + c > 0, values.min(0).values, values.max(0).values)
        liars = [m, m.clone()]
    else:
        raise ValueError(f"unknown attack {attack!r}: expected one of {ATTACKS}")
    return dict(p0=a, p1=b, p2=c, l1=liars[0], l2=liars[1])


def cell(attack: str, spread: float, keep: float, seeds: int) -> dict:
    """Median cosine with the honest mean under both rules, and how often each kind of row was left out."""
    cos = {"centered-clip": [], "centered-clip-plain": []}
    honest_out = liars_out = 0
    for seed in range(seeds):
        rows = attacked(attack, sparse_rows(5, seed=seed, spread=spread, keep=keep))
        mean = (rows["p0"] + rows["p1"] + rows["p2"]) / 3
        for rule in cos:
            out, report = aggregate(rows, dict.fromkeys(rows, 1.0), rule)
            cos[rule].append(float(out @ mean) / (norm(out) * norm(mean)))
            if rule == "centered-clip":
                left = [p for p, s in report["clipped"].items() if s == 0.0]
                honest_out += sum(p.startswith("p") for p in left)
                liars_out += sum(p.startswith("l") for p in left)
    return dict(attack=attack, spread=spread, keep=keep, seeds=seeds,
                cos_screened=round(statistics.median(cos["centered-clip"]), 3),
                cos_plain=round(statistics.median(cos["centered-clip-plain"]), 3),
                honest_left_out=honest_out, colluders_left_out=liars_out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spreads", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    ap.add_argument("--keeps", type=float, nargs="+", default=[0.1, 0.3])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("runs/bench/robust_screen.json"))
    a = ap.parse_args(argv)
    rows = [cell(attack, s, k, a.seeds) for attack in ATTACKS for s in a.spreads for k in a.keeps]
    print(f"{'attack':<10} {'spread':>6} {'keep':>5} {'cos screened':>13} {'cos plain':>10} "
          f"{'honest out':>11} {'colluders out':>14}  (of {3 * a.seeds} / {2 * a.seeds})")
    for r in rows:
        print(f"{r['attack']:<10} {r['spread']:>6g} {r['keep']:>5g} {r['cos_screened']:>13} {r['cos_plain']:>10} "
              f"{r['honest_left_out']:>11} {r['colluders_left_out']:>14}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
