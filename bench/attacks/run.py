"""``make bench-attacks``: every attack of bench/attacks/ against a swarm of real nodes, with and without
the default defense, beside a clean run with the same seed.

Each cell is a real swarm on loopback (tests/harness/localswarm.py): R replicas of the tiny model, M of them
running the daemon with ``--attack``; the same seed and data shards in every cell. Per cell: the
honest nodes' validation loss at the end (mean over honest nodes) and its change against the clean
run of the same defense, the backdoor success rate of an honest node's final parameters (the text
backdoor only), rounds the honest nodes skipped, re-synced or applied alone, honest nodes that crashed, and outer
steps at which honest nodes hold different parameters (a split). Writes runs/bench/attacks.{json,csv,png}. The swarm
assigns each replica's data per round (dilocox/assignment.py). Defenses: ``default`` (the daemon's: robust
aggregation and recomputation audits at 0.1 after a 5-round probation), ``robust`` (without audits), ``none``,
``audits-0.49``; audited cells also give the outer step at which each honest node's group excluded a liar, and
honest peers voted against or excluded (false exclusions).

    python -m bench.attacks.run --replicas 5 --malicious 1 2 --outer-steps 12
    python -m bench.attacks.run --defenses robust default --attacks inner-product sign-flip \
        --out runs/bench/attacks-audits/cells
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import signal
import statistics
import time
from pathlib import Path

import torch

from bench.attacks.backdoor import success_rate
from tests.harness.localswarm import REPO, LocalNode, digests_by_step, leave_all

ATTACKS = {
    "sign-flip": "bench.attacks.gradient:SignFlip",
    "scale": "bench.attacks.gradient:Scale",
    "noise": "bench.attacks.gradient:Noise",
    "weight-lie": "bench.attacks.protocol:WeightLie",
    "nan-codes": "bench.attacks.protocol:BadCodes",
    "out-of-range": "bench.attacks.malformed:OutOfRange",
    "replay": "bench.attacks.protocol:Replay",
    "wrong-start": "bench.attacks.protocol:WrongStart",
    "equivocation": "bench.attacks.protocol:Equivocate",
    "backdoor": "bench.attacks.backdoor:Backdoor",
    "inner-product": "bench.attacks.gradient:InnerProduct",
    "chosen-data": "bench.attacks.chosen:ChosenData",
    "ipm-0.5": "bench.attacks.collude:InnerProductHalf",
    "ipm-2": "bench.attacks.collude:InnerProductTwice",
    "ipm-0.5-uncommitted": "bench.attacks.collude:InnerProductHalfUncommitted",
    "alie": "bench.attacks.collude:LittleIsEnough",
    "min-max": "bench.attacks.collude:MinMax",
    "min-sum": "bench.attacks.collude:MinSum",
}
# issue 63's target table: every attack of 1 and 2 colluders of 5, 30 outer steps, 3 seeds
TARGETS = ["ipm-0.5", "ipm-2", "alie", "min-max", "min-sum", "sign-flip", "scale", "noise", "chosen-data"]
# default: the daemon's defaults (norm bound + CenteredClip, audits at 0.1 after a 5-round probation at rate 1, the
# group's exclusion vote, assigned data); robust: the same without audits; none: neither; audits-0.49: the rate that
# catches 2 liars of 5 within 10 rounds with probability 0.99 (dilocox.audit.audit_rate_for)
DEFENSES = {"none": ["--aggregation", "mean", "--norm-bound", "0", "--audit-rate", "0"], "default": [],
            "robust": ["--audit-rate", "0"], "audits-0.49": ["--audit-rate", "0.49"]}
COMMON = ["--model", "tiny", "--inner-steps", "20", "--warmup-steps", "10", "--request-timeout", "1",
          "--matchmaking-time", "2", "--averaging-timeout", "10", "--outer-round-deadline", "40",
          "--announce-period", "1", "--eval-batches", "4", "--listen", "/ip4/127.0.0.1/tcp/0",
          "--status-addr", "127.0.0.1:0"]


def run_cell(attack: str | None, malicious: int, defense: str, replicas: int, outer_steps: int, seed: int,
             out: Path) -> dict:
    name = f"{attack or 'clean'}-m{malicious if attack else 0}-{defense}"
    work = out / name
    shutil.rmtree(work, ignore_errors=True)
    args = COMMON + DEFENSES[defense] + ["--seed", str(seed), "--max-outer-steps", str(outer_steps),
                                         "--total-steps", str(20 * outer_steps), "--min-replicas", str(replicas),
                                         "--run-id", name.replace(".", "_")]
    nodes, started = [], time.monotonic()
    try:
        for r in range(replicas):
            extra = ["--join", nodes[0].join_maddr] if nodes else []  # the swarm assigns each round's data
            if attack and r >= replicas - malicious:
                extra += ["--attack", ATTACKS[attack]]
            side = dict(REDTEAM_COLLUDE_DIR=str(work / "collude"), REDTEAM_COLLUDERS=str(malicious))  # collude.py
            nodes.append(LocalNode(f"r{r}", work / f"r{r}", args + extra, env=side))
            if r == 0:
                nodes[0].wait_started()
        for n in nodes[1:]:
            n.wait_started()
        honest = nodes[:replicas - malicious] if attack else nodes
        codes = [n.proc.wait(outer_steps * 60) for n in honest]
    finally:
        leave_all([n for n in nodes if n.proc.poll() is None], 30)
        for n in nodes:
            n.terminate(signal.SIGKILL)
    rows = [n.metrics() for n in honest]
    liars = {r["peer_id"] for n in nodes if n not in honest for r in n.metrics()[:1]}
    excluded = [next((r["outer_step"] for r in rs if liars & set(r.get("excluded", ()))), None) for rs in rows]
    finals = [r[-1]["val_loss"] for r in rows if r]
    splits = sum(len(d) > 1 for d in digests_by_step(honest).values())
    cell = dict(attack=attack or "clean", malicious=malicious if attack else 0, defense=defense,
                honest_val_loss=statistics.mean(finals) if finals else float("nan"),
                skipped=sum(r["outcome"] == "skipped" for rs in rows for r in rs),
                crashed=sum(c != 0 for c in codes), splits=splits,
                dropped=sum(len(r.get("dropped", [])) for rs in rows for r in rs),
                # audits: outer step at which each honest node's group first excluded a liar (None: never); honest
                # peers any honest node voted against or saw excluded (false exclusions)
                liar_excluded_at=excluded if defense in ("default", "audits-0.49") else [],
                honest_excluded=len({p for rs in rows for r in rs
                                     for p in [*r.get("audit_votes", ()), *r.get("excluded", ())]} - liars),
                resynced=sum(r["outcome"] == "resynced" for rs in rows for r in rs),
                # rounds an honest node's group went on without it (its contribution lost, the swarm's update adopted)
                adopted=sum(r["outcome"] == "adopted" for rs in rows for r in rs),
                alone=sum(r["outcome"] == "applied_alone" for rs in rows for r in rs),
                seconds=round(time.monotonic() - started))
    if attack == "backdoor" or attack is None:
        cell["backdoor_rate"] = _backdoor_rate(honest[0].workdir / "ckpt", seed)
    return cell


def _backdoor_rate(ckpt: Path, seed: int) -> float:
    from dilocox.checkpoint import load_latest_checkpoint
    from dilocox.data import Corpus, validation_batches
    from dilocox.model import ModelSpec
    from dilocox.stages import build_stage

    found = load_latest_checkpoint(ckpt)
    if found is None:
        return float("nan")
    spec = ModelSpec.resolve("tiny")
    model = build_stage(spec, seed, 0, 1)
    with torch.no_grad():
        for p, t in zip(model.parameters(), found[1]["global_params"]):
            p.copy_(t)
    windows = torch.cat([x for x, _ in validation_batches(Corpus.from_spec("builtin:shakespeare", spec.seq_len),
                                                          spec.seq_len, spec.batch_size, 8)])[:64, :32]
    return success_rate(model, windows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=5)
    ap.add_argument("--malicious", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--attacks", nargs="*", default=list(ATTACKS), choices=list(ATTACKS),
                    help="none: the clean run alone (a control, e.g. with fewer --replicas)")
    ap.add_argument("--defenses", nargs="+", default=["default", "none"], choices=list(DEFENSES))
    ap.add_argument("--outer-steps", type=int, default=12)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench" / "attacks")
    a = ap.parse_args(argv)
    cells = []
    for defense in a.defenses:
        cells.append(run_cell(None, 0, defense, a.replicas, a.outer_steps, a.seed, a.out))
        print(json.dumps(cells[-1]), flush=True)
        for m in a.malicious:
            for attack in a.attacks:
                if defense == "none" and (m > 1 or attack not in ("backdoor", "sign-flip", "weight-lie")):
                    continue  # without the defense: the three that show what it is for, with one attacker
                cells.append(run_cell(attack, m, defense, a.replicas, a.outer_steps, a.seed, a.out))
                print(json.dumps(cells[-1]), flush=True)
    clean = {c["defense"]: c["honest_val_loss"] for c in cells if c["attack"] == "clean"}
    for c in cells:
        c["vs_clean"] = round(c["honest_val_loss"] / clean[c["defense"]] - 1, 4)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out.parent / "attacks.json").write_text(json.dumps(dict(args=vars(a), cells=cells), indent=1, default=str))
    with open(a.out.parent / "attacks.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=sorted({k for c in cells for k in c}))
        w.writeheader()
        w.writerows(cells)
    _plot(cells, a.out.parent / "attacks.png")


def _plot(cells: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels = [f"{c['attack']}\nm={c['malicious']} {c['defense']}" for c in cells]
    names = ["blue", "orange", "green", "red"]  # matplotlib's first colours, C0-C3
    defenses = list(dict.fromkeys(c["defense"] for c in cells))[:len(names)]
    colour = {d: f"C{i}" for i, d in enumerate(defenses)}
    ax.bar(range(len(cells)), [100 * c["vs_clean"] for c in cells],
           color=[colour.get(c["defense"], "C7") for c in cells])
    ax.axhline(2, color="k", ls="--", lw=0.8)
    ax.set_xticks(range(len(cells)), labels, rotation=70, fontsize=7)
    ax.set_ylabel("honest validation loss vs clean run (%)")
    ax.set_yscale("symlog")
    key = ", ".join(f"{names[i]}: {d}" for i, d in enumerate(defenses))
    ax.set_title(f"attacks on a real swarm, 5 replicas ({key}; dashed: +2%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
