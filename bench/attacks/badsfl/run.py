"""``python -m bench.attacks.badsfl.run``: BadSFL (arXiv 2411.16167) against FedAvg and SCAFFOLD, with defenses.

Every setting is one in-process federation (sim.py: the daemon's InnerLoop, OuterOptimizer, ControlVariates
and robust.aggregate) started from the same pre-trained model, with the same clients sampled in the same
rounds and the same data order; settings differ only in algorithm, attack and defense. Per round: PTA
(clean test accuracy of theta) and BTA (the fraction of the test set's bright sneakers classified as Bag).
Table: PTA at the end and its mean over the last 20 rounds, the highest BTA during injection, BTA at the end,
and persistence: rounds after injection stops until BTA falls below 90% and below 50% ("> n": not within the n
remaining rounds; 0: already below when it stopped). Writes <out>/badsfl.json, badsfl.csv (one row per setting
and round) and badsfl.png (BTA and PTA per round per setting).

    python -m bench.attacks.badsfl.run                  # the full benchmark (2 workers, < 60 min on 2 cores)
    python -m bench.attacks.badsfl.run --quick          # a smoke run (< 60 s)
    python -m bench.attacks.badsfl.run --settings scaffold scaffold+badsfl --outer nesterov

Defenses: ``cclip-nb2``: centered-clip + norm bound 2 on the pseudo-gradients (dc still averaged plainly);
``nb2``: norm bounding alone (mean); ``derived``: c derived from the aggregate (no dc channel: the daemon);
``c-decay``: c <- 0.8 c after every update; ``default`` (the daemon's for --outer-algorithm scaffold): derived c +
norm bound 2 + mean; ``derived-cclip-nb2``: derived c + norm bound 2 + centered-clip (the earlier default:
it cost about 4 points of clean accuracy over 3 seeds, docs/security.md). The published baselines the BadSFL
paper compares against (defenses.py): ``flame`` (FLAME), ``dp-prune`` (weak DP, then pruning of the deployed
model), ``sparsefed`` (SparseFed's clipped server-side top-k). ``reset-c`` is a probe: the server's c becomes the
benign clients' mean c_i at the end of the attack window.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import multiprocessing as mp
import time
from pathlib import Path

import torch

from bench.attacks.badsfl.attacks import AttackKnobs
from bench.attacks.badsfl.sim import FederatedData, Setting, SimConfig, pretrained, run_setting

OUT = Path("runs/bench")
DEFAULT_DEFENSE = dict(c_mode="derived", norm_bound=2.0)  # the daemon's for --outer-algorithm scaffold (mean)
# ... and with its quiet restart of c (dilocox.scaffold.QuietRestart at the daemon's flags)
DAEMON_SCAFFOLD = dict(DEFAULT_DEFENSE, c_reset_quiet=3, c_quiet_factor=0.5, c_quiet_rounds=5, c_outsized=4.0,
                       c_quiet_every=20)
OLD_DEFAULT = dict(c_mode="derived", rule="centered-clip", norm_bound=2.0)  # the earlier default
SETTINGS = [
    *[Setting(f"fedavg{'' if a == 'none' else '+' + a}", algorithm="fedavg", attack=a)
      for a in ("none", "blackbox", "neurotoxin", "badsfl")],
    *[Setting(f"scaffold{'' if a == 'none' else '+' + a}", attack=a)
      for a in ("none", "blackbox", "neurotoxin", "badsfl")],
    Setting("scaffold+badsfl/cclip-nb2", attack="badsfl", rule="centered-clip", norm_bound=2.0),
    # the DiLoCo default's aggregation on label shards, with and without its opposition screen (dilocox/robust.py)
    Setting("fedavg/cclip-nb2", algorithm="fedavg", rule="centered-clip", norm_bound=2.0),
    Setting("fedavg/cclip-nb2-unscreened", algorithm="fedavg", rule="centered-clip-plain", norm_bound=2.0),
    Setting("scaffold+badsfl/nb2", attack="badsfl", norm_bound=2.0),
    Setting("scaffold+badsfl/derived", attack="badsfl", c_mode="derived"),
    Setting("scaffold+badsfl/c-decay", attack="badsfl", c_decay=0.2),
    Setting("scaffold+badsfl/default", attack="badsfl", **DEFAULT_DEFENSE),
    Setting("scaffold/default", **DEFAULT_DEFENSE),
    # the default with c and every c_i restarted at zero every 10 rounds (sim.py, c_reset)
    Setting("scaffold+badsfl/default-reset10", attack="badsfl", c_reset=10, **DEFAULT_DEFENSE),
    Setting("scaffold/default-reset10", c_reset=10, **DEFAULT_DEFENSE),
    # the default with c derived from the unclipped contributions only (sim.py, c_unclipped)
    Setting("scaffold+badsfl/default-unclipped", attack="badsfl", c_unclipped=True, **DEFAULT_DEFENSE),
    Setting("scaffold/default-unclipped", c_unclipped=True, **DEFAULT_DEFENSE),
    # the default with a contribution over the norm bound dropped, not clipped (sim.py, norm_drop)
    Setting("scaffold+badsfl/default-drop", attack="badsfl", norm_drop=True, **DEFAULT_DEFENSE),
    Setting("scaffold/default-drop", norm_drop=True, **DEFAULT_DEFENSE),
    # the default with c and every c_i restarted once, 3 rounds after the last outsized contribution (sim.py)
    Setting("scaffold+badsfl/default-quiet3", attack="badsfl", c_reset_quiet=3, **DEFAULT_DEFENSE),
    Setting("scaffold/default-quiet3", c_reset_quiet=3, **DEFAULT_DEFENSE),
    # ... or halved in each of the 5 rounds from then (c - mean c_i shrinks 32-fold, without the restart's jump), a
    # contribution outsized from 4 x the bound (8 x the lower median; quiet3 restarted twice without an attack)
    Setting("scaffold+badsfl/default-quiet3-half5", attack="badsfl", c_reset_quiet=3, c_quiet_factor=0.5,
            c_quiet_rounds=5, c_outsized=4.0, **DEFAULT_DEFENSE),
    Setting("scaffold/default-quiet3-half5", c_reset_quiet=3, c_quiet_factor=0.5, c_quiet_rounds=5, c_outsized=4.0,
            **DEFAULT_DEFENSE),
    # half5 (the daemon's default) that also restarts c at zero every 10 rounds while outsized rounds come, so a
    # long attack cannot build c up for 30 rounds (reset10 lost 1.1-3.9 points under attack, half5 0.3-5.6)
    Setting("scaffold+badsfl/default-quiet3-half5-every10", attack="badsfl", c_reset_quiet=3, c_quiet_factor=0.5,
            c_quiet_rounds=5, c_outsized=4.0, c_quiet_every=10, **DEFAULT_DEFENSE),
    Setting("scaffold/default-quiet3-half5-every10", c_reset_quiet=3, c_quiet_factor=0.5, c_quiet_rounds=5,
            c_outsized=4.0, c_quiet_every=10, **DEFAULT_DEFENSE),
    # ... every 20: fewer rounds during the attack without a c to offset the boosted update, a longer build-up
    Setting("scaffold+badsfl/default-quiet3-half5-every20", attack="badsfl", c_reset_quiet=3, c_quiet_factor=0.5,
            c_quiet_rounds=5, c_outsized=4.0, c_quiet_every=20, **DEFAULT_DEFENSE),
    # the default with a looser norm bound, 3 x the lower median (the bound of 2 cost seed 1 6.3 points without an
    # attack: it clipped an honest one-class client in 38 of 100 rounds); without an attack the quiet restart never
    # fires, so scaffold/default-nb3 is that default's no-attack run
    Setting("scaffold+badsfl/default-nb3-quiet3-half5-every20", attack="badsfl", c_reset_quiet=3, c_quiet_factor=0.5,
            c_quiet_rounds=5, c_outsized=4.0, c_quiet_every=20, c_mode="derived", norm_bound=3.0),
    Setting("scaffold/default-nb3", c_mode="derived", norm_bound=3.0),
    # ... or by 0.8 in each of 15 rounds (to 3.5%): half5 still dropped PTA to 30-36% a few rounds after it
    Setting("scaffold+badsfl/default-quiet3-slow15", attack="badsfl", c_reset_quiet=3, c_quiet_factor=0.8,
            c_quiet_rounds=15, c_outsized=4.0, **DEFAULT_DEFENSE),
    Setting("scaffold/derived", c_mode="derived"),
    Setting("scaffold+blackbox/derived", attack="blackbox", c_mode="derived"),
    Setting("scaffold+badsfl/derived-cclip-nb2", attack="badsfl", **OLD_DEFAULT),
    Setting("scaffold/derived-cclip-nb2", **OLD_DEFAULT),
    # a probe, not a defense: the server's c set to the benign clients' mean c_i once the attack stops (sim.py,
    # c_reset_after_attack), so what persists after is what theta and the c_i hold, not the c the attacker moved
    Setting("scaffold+blackbox/reset-c", attack="blackbox", c_reset_after_attack=True),
    # the daemon's whole default for --outer-algorithm scaffold (derived c, norm bound 2, mean, the quiet restart:
    # default-quiet3-half5-every20), alone and with the robust learning rate on theta (dilocox/sign_agreement.py,
    # threshold ceil(0.35 k): 4 of 10 or 11 contributions; rlr2: ceil(0.15 k), 2), reversed (rlr, the paper's) or
    # dropped (mask) where fewer agree, in every round or (gated) in rounds with an outsized contribution only (the
    # quiet restart's c_outsized: 4 x the bound), or (drop4) with an outsized contribution left out instead of
    # clipped, against every attack
    *[Setting(f"scaffold{'' if a == 'none' else '+' + a}/{name}", attack=a, **DAEMON_SCAFFOLD, **extra)
      for name, extra in (("daemon", {}), ("daemon-rlr", dict(sign_rule="flip", min_agreement=0.35)),
                          ("daemon-mask", dict(sign_rule="mask", min_agreement=0.35)),
                          ("daemon-rlr-gated", dict(sign_rule="flip", min_agreement=0.35, sign_when="outsized")),
                          ("daemon-rlr2-gated", dict(sign_rule="flip", min_agreement=0.15, sign_when="outsized")),
                          ("daemon-drop4", dict(outsized_drop=True)),
                          ("daemon-drop4-rlr-gated", dict(outsized_drop=True, sign_rule="flip", min_agreement=0.35,
                                                          sign_when="outsized")))
      for a in ("none", "blackbox", "neurotoxin", "badsfl")],
    # the DiLoCo default's rule (centered-clip after a norm bound of 2, the screen) against the baselines, alone and
    # with the robust learning rate gated on outsized rounds (4 x the bound), as --robust-lr flip sets it
    *[Setting(f"fedavg+{a}/cclip-nb2{tail}", algorithm="fedavg", attack=a, rule="centered-clip", norm_bound=2.0,
              **extra)
      for tail, extra in (("", {}), ("-rlr-gated", dict(sign_rule="flip", min_agreement=0.35, sign_when="outsized",
                                                         c_outsized=4.0)))
      for a in ("blackbox", "neurotoxin")],
    # the published defenses the BadSFL paper compares against (defenses.py), with the paper's dc channel, against
    # BadSFL and the baselines
    *[Setting(f"scaffold{a}/{d}", attack=a[1:] or "none", defense=d)
      for d in ("flame", "dp-prune", "sparsefed") for a in ("+badsfl", "+blackbox", "+neurotoxin", "")],
]
BY_NAME = {s.name: s for s in SETTINGS}
QUICK = dict(clients=6, per_round=3, rounds=6, attack_start=2, attack_stop=4, inner_steps=2, batch_size=16,
             pretrain_rounds=2, train_subset=3000, eval_images=500,
             knobs=AttackKnobs(lookahead_rounds=2, gan_steps=2, gan_batch=16, gan_per_batch=8))
CHANGES = [
    "model: the daemon's CNN (46,730 parameters) on Fashion-MNIST, not ResNet-18 on CIFAR-10",
    "trigger: bright sneakers (class 7, mean intensity in the top quintile) -> Bag (8), not green cars -> a label",
    "local training: K = 20 AdamW steps (batch 64, constant lr 1e-3, the daemon's InnerLoop) per round, not local "
    "SGD epochs; SCAFFOLD's correction in update units (apply_correction_step)",
    "pre-training: {pretrain_rounds} rounds of clean FedAvg on an IID split of the same 20 clients (the paper starts "
    "from a converged model; on the label-sorted split FedAvg reaches only ~50% in 30-40 rounds)",
    "generator: a conditional generator trained against the frozen global model (no discriminator), 20 steps per "
    "attack round, 32 generated images per attacker batch",
    "look-ahead: P_j = (w_p + (n-1) w_g)/n - j s c with s = the round's learning-rate sum (j counts rounds)",
    "kept: 20 clients, 10 per round (the attacker forced in during injection), label-sorted shards (label-shards:2), "
    "injection rounds 10-40 of 100, j = 10",
]


def persistence(curve: list[dict], stop: int, rounds: int, threshold: float) -> int | str:
    """Rounds after round ``stop`` until BTA < threshold: the first such round r gives r - stop (0: BTA was already
    below at ``stop``); "> n" when it stays at or above through the last of the n remaining rounds."""
    by_round = {p["round"]: p["bta"] for p in curve}
    if by_round.get(stop, 0.0) < threshold:
        return 0
    for r in range(stop + 1, rounds + 1):
        if by_round[r] < threshold:
            return r - stop
    return f"> {rounds - stop}"


def summarize(result: dict, cfg: SimConfig) -> dict:
    curve, s = result["curve"], result["setting"]
    window = [p["bta"] for p in curve if cfg.attack_start <= p["round"] <= cfg.attack_stop]
    after5 = [p["bta"] for p in curve if p["round"] == min(cfg.rounds, cfg.attack_stop + 5)]
    return dict(setting=s["name"], algorithm=s["algorithm"], attack=s["attack"], c_mode=s["c_mode"] if
                s["algorithm"] == "scaffold" else "-", rule=s["rule"], norm_bound=s["norm_bound"], c_decay=s["c_decay"],
                c_reset=s.get("c_reset", 0),
                pta_start=round(curve[0]["pta"], 4), pta_end=round(curve[-1]["pta"], 4),
                pta_last20=round(sum(p["pta"] for p in curve[-20:]) / len(curve[-20:]), 4),
                bta_max_injection=round(max(window), 4) if window else None,
                bta_mean_injection=round(sum(window) / len(window), 4) if window else None,
                bta_stop_plus_5=round(after5[0], 4) if after5 else None, bta_end=round(curve[-1]["bta"], 4),
                persist_below_90=persistence(curve, cfg.attack_stop, cfg.rounds, 0.9) if s["attack"] != "none" else "-",
                persist_below_50=persistence(curve, cfg.attack_stop, cfg.rounds, 0.5) if s["attack"] != "none" else "-",
                seconds=result["seconds"])


def _job(args):
    cfg, setting, cache_dir = args
    torch.set_num_threads(1)
    return run_setting(cfg, setting, cache_dir)


def run(cfg: SimConfig, settings: list[Setting], out: Path, workers: int) -> dict:
    """Pre-train (cached), run every setting (``workers`` processes), write the outputs; returns the report."""
    torch.set_num_threads(1)
    started = time.monotonic()
    cache_dir = out / "badsfl"
    data = FederatedData(cfg)
    pretrained(cfg, data, cache_dir)  # once, before the workers look for it
    print(f"data: {json.dumps(data.describe())}", flush=True)
    # the slowest (badsfl) first, so the last worker to finish is not left with one
    jobs = [(cfg, s, cache_dir) for s in sorted(settings, key=lambda s: s.attack != "badsfl")]
    results = []
    if workers <= 1:
        for job in jobs:
            results.append(run_setting(job[0], job[1], job[2], data))
            print(f"{results[-1]['setting']['name']:>28}: {results[-1]['seconds']:.0f}s", flush=True)
    else:
        with mp.get_context("spawn").Pool(workers) as pool:
            for r in pool.imap_unordered(_job, jobs):
                results.append(r)
                print(f"{r['setting']['name']:>28}: {r['seconds']:.0f}s", flush=True)
    order = {s.name: i for i, s in enumerate(settings)}
    results.sort(key=lambda r: order[r["setting"]["name"]])
    rows = [summarize(r, cfg) for r in results]
    changes = [c.format(pretrain_rounds=cfg.pretrain_rounds) for c in CHANGES]
    report = dict(config=_plain(dataclasses.asdict(cfg)), data=data.describe(), changes_from_paper=changes,
                  rows=rows, verdicts=verdicts(rows, cfg), runs=results,
                  seconds=round(time.monotonic() - started, 1), workers=workers)
    write(report, out)
    print_table(report)
    return report


def _plain(obj):
    return json.loads(json.dumps(obj, default=str))


def verdicts(rows: list[dict], cfg: SimConfig) -> dict:
    """The questions the benchmark answers, from the table (None where a setting was not run)."""
    by = {r["setting"]: r for r in rows}

    def rounds(value) -> float:
        return float(value[2:]) + 1 if isinstance(value, str) and value.startswith(">") else float(value)

    out = {}
    if "scaffold+badsfl" in by and "scaffold+blackbox" in by:
        bad, box = by["scaffold+badsfl"], by["scaffold+blackbox"]
        out["badsfl_vs_blackbox_persistence_below_50"] = [bad["persist_below_50"], box["persist_below_50"]]
        out["paper_shape_3x"] = rounds(bad["persist_below_50"]) >= 3 * max(1.0, rounds(box["persist_below_50"]))
    if "scaffold+badsfl/default" in by and "scaffold" in by:
        d = by["scaffold+badsfl/default"]
        out["default_bta_stop_plus_5"] = d["bta_stop_plus_5"]
        out["default_bta_below_10pct_within_5"] = d["bta_stop_plus_5"] is not None and d["bta_stop_plus_5"] < 0.1
        # PTA swings by 10 points from round to round on label shards: compare means of the last 20 rounds
        out["default_pta_vs_clean_points"] = round(100 * (d["pta_last20"] - by["scaffold"]["pta_last20"]), 2)
    if "scaffold/default" in by and "scaffold" in by:
        out["default_clean_pta_cost_points"] = round(100 * (by["scaffold/default"]["pta_last20"]
                                                            - by["scaffold"]["pta_last20"]), 2)
    if "scaffold" in by and "fedavg" in by:
        out["clean_pta_last20_scaffold_vs_fedavg"] = [by["scaffold"]["pta_last20"], by["fedavg"]["pta_last20"]]
    return out


def write(report: dict, out: Path, stem: str = "badsfl", plotted: list[dict] | None = None, title: str = "",
          bta_label: str = "BTA: bright sneakers -> Bag (%)") -> None:
    """<out>/<stem>.json (the report), <stem>.csv (one row per run and round) and <stem>.png (BTA and PTA per round
    of ``plotted``, default every run). A run's name is its ``label``, else its setting's name."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
    train = any("bta_train" in p for r in report["runs"] for p in r["curve"])
    with open(out / f"{stem}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "round", "pta", "bta"] + (["bta_train"] if train else []) + ["injecting"])
        for r in report["runs"]:
            for p in r["curve"]:
                w.writerow([_name(r), p["round"], round(p["pta"], 4), round(p["bta"], 4)]
                           + ([round(p["bta_train"], 4)] if train else []) + [int(bool(p.get("injecting")))])
    plot(report["config"], report["runs"] if plotted is None else plotted, out / f"{stem}.png",
         title or "BadSFL vs baselines on label-sharded Fashion-MNIST (20 clients, 10 per round, 1 attacker)",
         bta_label)


def _name(run: dict) -> str:
    return run.get("label") or run["setting"]["name"]


def plot(cfg: dict, runs: list[dict], path: Path, title: str, bta_label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(11, 9), sharex=True)
    styles = {"none": "-", "blackbox": "--", "neurotoxin": ":", "badsfl": "-"}
    for k, r in enumerate(runs):
        s = r["setting"]
        rounds = [p["round"] for p in r["curve"]]
        kw = dict(color=f"C{k % 10}", ls=styles[s["attack"]], lw=2.2 if s["attack"] == "badsfl" else 1.2,
                  label=_name(r))
        axes[0].plot(rounds, [100 * p["bta"] for p in r["curve"]], **kw)
        axes[1].plot(rounds, [100 * p["pta"] for p in r["curve"]], **kw)
    for ax in axes:
        ax.axvspan(cfg["attack_start"], cfg["attack_stop"], color="k", alpha=0.07)
        ax.grid(alpha=0.3)
    for y in (50, 90):
        axes[0].axhline(y, color="k", lw=0.6, ls="--")
    axes[0].set_ylabel(bta_label)
    axes[1].set_ylabel("PTA: clean test accuracy (%)")
    axes[1].set_xlabel(f"round (injection {cfg['attack_start']}-{cfg['attack_stop']}, shaded)")
    axes[0].legend(fontsize=7, ncol=3)
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(report: dict) -> None:
    print("\nchanges from the paper's setting:")
    for c in report["changes_from_paper"]:
        print(f"  - {c}")
    cols = ["setting", "pta_end", "pta_last20", "bta_max_injection", "bta_stop_plus_5", "bta_end", "persist_below_90",
            "persist_below_50", "seconds"]
    print("\n" + " | ".join(f"{c:>17}" if i else f"{c:<28}" for i, c in enumerate(cols)))
    for r in report["rows"]:
        cells = []
        for i, c in enumerate(cols):
            v = r[c]
            v = f"{100 * v:.1f}%" if isinstance(v, float) and c.startswith(("pta", "bta")) else str(v)
            cells.append(f"{v:>17}" if i else f"{v:<28}")
        print(" | ".join(cells))
    print("\nverdicts:", json.dumps(report["verdicts"]))
    print(f"total {report['seconds']:.0f}s with {report['workers']} workers")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few rounds, 6 clients, 3,000 images (< 60 s)")
    ap.add_argument("--settings", nargs="+", choices=list(BY_NAME), default=list(BY_NAME))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--outer", choices=["sgd1", "nesterov"], default="sgd1",
                    help="outer step: sgd1 (FedAvg, lr 1, no momentum) or DiLoCo's Nesterov (0.7, 0.9)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    kw = dict(QUICK) if a.quick else {}
    kw.update(outer=a.outer, seed=a.seed)
    if a.rounds:
        kw["rounds"] = a.rounds
    run(SimConfig(**kw), [BY_NAME[n] for n in a.settings], a.out, a.workers)


if __name__ == "__main__":
    main()
