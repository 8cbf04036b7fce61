"""``make bench-audit``: recomputation audits (dilocox/audit.py) against liars, measured on real training.

R replicas of the tiny model train in one process (bench/federation.py) with the daemon's code for everything but
the transport (``InnerLoop`` with AdamW, the sparse codec with error feedback, CenteredClip with norm bound 2, the
SparseLoCo outer step): the setting of ``make bench-attacks``, minus the sockets. Whoever audits a replica
recomputes under bf16 autocast (``--auditor-precision bf16``, the default) while the replica trains in fp32, to
emulate honest peers on different hardware; ``--vary-threads`` also trains replica i on 1 + i % 2 threads and
audits it on the other count (on this CPU that alone gives the same bits).

Every contribution of every round is put through all three checks, so each check's statistics are known for
every honest and every lying node-round; the swarm acts on one check (``--check``, default recompute) for the
pairs ``audit_targets`` draws at ``--audit-rate`` from the round's result digests: a lie found by an honest
auditor excludes the liar from the next round on; a colluder accuses the honest peer it audits, the
accusation is checked by recomputation, and a second failed accusation excludes the accuser. Attacks
(malicious replicas are the last ones; colluders share their honest pseudo-gradients):

* ``sign-flip`` (-1000 x own), ``scale`` (100 x own), ``noise`` (Gaussian at the honest norm);
* ``ipm-0.5`` and ``ipm-2``: inner-product manipulation, -eps x the colluders' mean honest pseudo-gradient;
* ``ipm-0.5-fit``: the same, and it commits a made-up error-feedback buffer e_r with which its lie is
  exactly the honest encoding (the contribution link holds; the error-feedback link must catch it).

Per run: each check's statistic on honest and on lying node-rounds, false accusations, the round each liar
was excluded, the final validation loss of theta against the clean run of the same seed, and each check's
time against a round's compute. Writes <out>.{json,csv,png}.

    python -m bench.audit --seeds 0 1 2 --rounds 60 --attack-rounds 12 --workers 2 --spread-attacks sign-flip ipm-0.5
"""

from __future__ import annotations

import argparse
import copy
import csv
import hashlib
import json
import math
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import torch

from bench.federation import Contributions, Federation, Method
from dilocox import audit
from dilocox.data import Corpus, ReplicaShard, validation_batches
from dilocox.diloco import InnerConfig, InnerLoop, params_digest
from dilocox.model import ModelSpec
from dilocox.sparse import SparseCodec, SparseConfig, decode
from dilocox.stages import build_stage

OUT = Path("runs/bench/audit")
ATTACKS = ("sign-flip", "scale", "noise", "ipm-0.5", "ipm-2", "ipm-0.5-fit")
SPARSE = SparseConfig(chunk=4096, topk=128, bits=2, beta=0.9, rice=True)  # the daemon's defaults
H, PREFIX, LOSS_BATCHES = 20, 4, 4
# the daemon's round: the sparse codec, CenteredClip with norm bound 2, the SparseLoCo outer step (lr 2.5 -> 4.5)
METHOD = Method("audit", codec="sparse", outer_lr=2.5, outer_lr_final=4.5, outer_momentum=0.0, nesterov=False,
                sparse=SPARSE, aggregation="centered-clip", norm_bound=2.0)


def _lie(attack: str, own: list[torch.Tensor], colluders_mean: list[torch.Tensor], round_index: int):
    if attack == "sign-flip":
        return [-1000.0 * t for t in own]
    if attack == "scale":
        return [100.0 * t for t in own]
    if attack == "noise":
        g = torch.Generator().manual_seed(round_index)
        noise = [torch.randn(t.shape, generator=g) for t in own]
        return [n * (audit.flatten(own).norm() / audit.flatten(noise).norm()).float() for n in noise]
    eps = float(attack.split("-")[1])
    return [-eps * t for t in colluders_mean]


class Replica:
    """A replica of the federation (bench/federation.py's ``Replica``) that commits to its round-start state and
    draws round r's batches at fixed positions, so that an auditor can replay them; ``codec``: its sparse codec
    (the federation's, set once it is built)."""

    def __init__(self, index: int, spec, corpus, seed: int, inner_cfg: InnerConfig, malicious: bool,
                 threads: int = 1):
        self.index, self.malicious, self.threads = index, malicious, threads
        self.peer = f"r{index}"
        self.inner = InnerLoop(build_stage(spec, seed, 0, 1), inner_cfg)
        self.shard = ReplicaShard(corpus.train, spec.seq_len, spec.batch_size, seed, index)
        self.codec: SparseCodec | None = None
        self.committed = {}  # round -> (optimizer state, error-feedback buffer) it committed to at the round's start
        self.payloads = {}
        self.train_s = 0.0  # seconds of its last round's inner steps

    @property
    def params(self) -> list[torch.Tensor]:
        return self.inner.params

    def batches(self, r: int, count: int = H) -> list:
        return [self.shard.batch_at(r * H + j) for j in range(count)]

    def commit(self, r: int) -> None:
        """The start state of round r it commits to (a liar that fits its error feedback replaces it)."""
        self.committed[r] = [copy.deepcopy(self.inner.inner_optimizer.state_dict()),
                             [e.clone() for e in self.codec.error]]

    def inner_steps(self, t: int, first: int, end: int) -> None:
        """Round r = t - 1 (0-based here): commit its start state, then its steps from theta (the federation
        re-based the parameters at the last round's end)."""
        started, r = time.perf_counter(), t - 1
        torch.set_num_threads(self.threads)
        self.commit(r)
        batches = self.batches(r)
        for j in range(first, end):
            self.inner.inner_step(*batches[j], global_step=r * H + j)
        self.train_s = time.perf_counter() - started


class Liars(Contributions):
    """The malicious replicas' contributions (``_lie``), and every payload kept for the audits."""

    def __init__(self, reps: list[Replica], bad: set[int], attack: str | None):
        self.reps, self.bad, self.attack = reps, bad, attack
        self.honest: dict = {}  # the round's honest pseudo-gradients, by replica index

    def send(self, t, member, delta, deltas):
        self.honest = deltas
        if member not in self.bad:
            return delta
        liars = sorted(i for i in deltas if i in self.bad)
        mean_bad = [sum(ts) / len(liars) for ts in zip(*(deltas[i] for i in liars))]
        return _lie(self.attack, delta, mean_bad, t - 1)

    def encoded(self, t, member, payload, sent):
        rep, r = self.reps[member], t - 1
        if member in self.bad and self.attack.endswith("-fit"):  # commit e_r' with Encode(beta e_r' + honest) = lie
            rep.committed[r][1] = [(SPARSE.beta * e + s - d) / SPARSE.beta
                                   for e, s, d in zip(rep.codec.error, sent, self.honest[member])]
        rep.payloads[r] = payload


def _checks(rep: Replica, r: int, theta, auditor: InnerLoop, threads: int, shapes) -> tuple[dict, dict]:
    """All three checks of ``rep``'s round-r contribution: (reports by check, seconds by check)."""
    torch.set_num_threads(threads)
    opt, e_start = rep.committed[r]
    opt_next, e_next = rep.committed[r + 1]
    payload, sent = rep.payloads[r], decode(rep.payloads[r], shapes, SPARSE)
    reports, seconds = {}, {}
    t = time.perf_counter()
    delta, opt_rec = audit.recompute(auditor, theta, opt, rep.batches(r), r * H)
    reports["recompute"] = audit.full_audit(payload, e_start, e_next, delta, opt_next, opt_rec, SPARSE)
    seconds["recompute"] = time.perf_counter() - t
    t = time.perf_counter()
    prefix, _ = audit.recompute(auditor, theta, opt, rep.batches(r, PREFIX), r * H)
    claimed = [n - SPARSE.beta * e + s for n, e, s in zip(e_next, e_start, sent)]
    reports["prefix"] = audit.prefix_audit(claimed, prefix, PREFIX, H)
    seconds["prefix"] = time.perf_counter() - t
    t = time.perf_counter()
    reports["loss-change"] = audit.loss_change_audit(auditor.model, auditor.loss_fn, theta, sent,
                                                     rep.batches(r, LOSS_BATCHES))
    seconds["loss-change"] = time.perf_counter() - t
    return reports, seconds


def run(seed: int, attack: str | None, malicious: int, rounds: int, replicas: int, rate: float, check: str,
        auditor_precision: str, act: bool, vary_threads: bool = False) -> dict:
    torch.manual_seed(seed)
    spec = ModelSpec.resolve("tiny")
    corpus = Corpus.from_spec("builtin:shakespeare", spec.seq_len)
    inner_cfg = InnerConfig(lr=4e-4, weight_decay=0.1, warmup_steps=10, total_steps=H * rounds)
    bad = set(range(replicas - malicious, replicas)) if attack else set()
    reps = [Replica(i, spec, corpus, seed, inner_cfg, i in bad, 1 + i % 2 if vary_threads else 1)
            for i in range(replicas)]
    fed = Federation(METHOD, reps, inner_cfg, H, rounds, seed, contributions=Liars(reps, bad, attack))
    for rep, codec in zip(reps, fed.codecs["main"]):
        rep.codec = codec
    outer = fed.outer
    shapes = [tuple(p.shape) for p in outer.global_params]
    auditor = InnerLoop(build_stage(spec, seed, 0, 1), InnerConfig(**{**inner_cfg.__dict__,
                                                                       "precision": auditor_precision}))
    val = validation_batches(corpus, spec.seq_len, spec.batch_size, 8)
    active = set(range(replicas))
    excluded, strikes, rows, thetas, started = {}, {}, [], {}, time.monotonic()
    compute_s = []
    for r in range(rounds + 1):  # the last pass only commits the start state the audit of round rounds-1 reads
        theta = [p.clone() for p in outer.global_params]
        thetas[r] = theta
        if r < rounds and active:
            members = sorted(active)
            fed.round(r + 1, members)  # round r (0-based here): contributions, lies, aggregate, outer step
            compute_s.append(sum(reps[i].train_s for i in members) / len(members))
        else:
            for i in active:
                reps[i].commit(r)
        if r >= 1:  # round r-1's audits use the start states committed in round r: they finish during round r
            _audit_round(reps, r - 1, thetas.pop(r - 1), auditor, shapes, rows, active, excluded, strikes, rate,
                         check, act, vary_threads)
            for rep in reps:  # keep two rounds of commitments
                rep.committed.pop(r - 1, None)
                rep.payloads.pop(r - 1, None)
        if r == rounds or not active:
            break
    evaluator = InnerLoop(build_stage(spec, seed, 0, 1), inner_cfg)
    evaluator.load_params(outer.global_params)
    return dict(seed=seed, attack=attack or "clean", malicious=malicious if attack else 0, rounds=rounds,
                rate=rate, check=check, act=act, auditor_precision=auditor_precision,
                val_loss=evaluator.evaluate(val), theta=params_digest(outer.global_params),
                excluded={reps[i].peer: r for i, r in excluded.items()}, liars=[reps[i].peer for i in sorted(bad)],
                round_compute_s=statistics.median(compute_s), audits=rows,
                seconds=time.monotonic() - started)


def _audit_round(reps, r, theta, auditor, shapes, rows, active, excluded, strikes, rate, check, act,
                 vary: bool = False) -> None:
    """Every contribution of round r through every check (rows), then the swarm's actions for the drawn pairs."""
    verdicts = {}
    for rep in reps:
        if r not in rep.payloads or r + 1 not in rep.committed:  # excluded before it committed round r + 1
            continue
        reports, seconds = _checks(rep, r, theta, auditor, 3 - rep.threads if vary else 1, shapes)
        verdicts[rep.index] = reports[check].verdict
        rows.append(dict(round=r, peer=rep.peer, lying=rep.malicious,
                         **{f"{c}_lied": rep_.verdict == audit.AuditVerdict.LIED for c, rep_ in reports.items()},
                         **{k: v for rep_ in reports.values() for k, v in rep_.stats.items()},
                         **{f"{c}_s": s for c, s in seconds.items()}))
    if not act:
        return
    members = [reps[i].peer for i in sorted(verdicts)]
    digests = {reps[i].peer: hashlib.sha256(reps[i].payloads[r]).hexdigest() for i in verdicts}
    targets = audit.audit_targets(members, audit.round_randomness(r, digests), lambda peer: rate)
    for auditor_peer, target_peer in [(a, t) for a, ts in targets.items() for t in ts]:
        a, t = int(auditor_peer[1:]), int(target_peer[1:])
        if a not in active:
            continue
        accused = verdicts[t] == audit.AuditVerdict.LIED if not reps[a].malicious else not reps[t].malicious
        if not accused:
            continue
        if verdicts[t] == audit.AuditVerdict.LIED:  # any member recomputes and confirms
            active.discard(t)
            excluded.setdefault(t, r)
        else:  # the accusation does not hold up: it counts against the accuser
            strikes[a] = strikes.get(a, 0) + 1
            if strikes[a] >= 2:
                active.discard(a)
                excluded.setdefault(a, r)


def _job(args):
    return run(**args)


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (attack, malicious): per check, the share of lying node-rounds it flagged and the honest
    node-rounds it flagged (false accusations), exclusions and the loss against the clean run."""
    clean = {r["seed"]: r["val_loss"] for r in runs if r["attack"] == "clean" and r["act"]}
    rows = []
    for key in sorted({(r["attack"], r["malicious"], r["act"]) for r in runs}):
        mine = [r for r in runs if (r["attack"], r["malicious"], r["act"]) == key]
        audits = [a for r in mine for a in r["audits"]]
        honest, lying = [a for a in audits if not a["lying"]], [a for a in audits if a["lying"]]
        row = dict(attack=key[0], malicious=key[1], audits_act=key[2], seeds=len(mine),
                   honest_node_rounds=len(honest), lying_node_rounds=len(lying))
        for c in ("recompute", "prefix", "loss-change"):
            row[f"{c}_false"] = sum(a[f"{c}_lied"] for a in honest)
            row[f"{c}_power"] = round(sum(a[f"{c}_lied"] for a in lying) / len(lying), 3) if lying else ""
            row[f"{c}_cost"] = round(statistics.median(a[f"{c}_s"] for a in audits) /
                                     statistics.median(r["round_compute_s"] for r in mine), 3) if audits else ""
        liars = [(r, p) for r in mine for p in r["liars"]]
        caught = [r["excluded"][p] for r, p in liars if p in r["excluded"]]
        row["liars_excluded"] = f"{len(caught)}/{len(liars)}" if liars else ""
        row["excluded_after_rounds_max"] = max(caught) + 1 if caught else ""
        row["honest_excluded"] = sum(p not in r["liars"] for r in mine for p in r["excluded"])
        row["val_loss_vs_clean"] = round(statistics.mean(r["val_loss"] / clean[r["seed"]] - 1 for r in mine), 4) \
            if all(r["seed"] in clean for r in mine) else ""
        row["worst_link_error_honest"] = round(max((max(a.get(k, 0) for k in ("contribution_error",
                                                "error_feedback_error", "optimizer_error")) for a in honest),
                                               default=0), 4)
        rows.append(row)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--replicas", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=60, help="rounds of the clean runs (5 x 60 = 300 node-rounds)")
    ap.add_argument("--attack-rounds", type=int, default=12)
    ap.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=ATTACKS)
    ap.add_argument("--malicious", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--audit-rate", type=float, default=None,
                    help="default: the least rate that catches 2 colluders of the group within 10 rounds at 99%%")
    ap.add_argument("--check", default="recompute", choices=["recompute", "prefix", "loss-change"])
    ap.add_argument("--auditor-precision", default="bf16", choices=["fp32", "bf16"],
                    help="bf16: the auditor recomputes under bf16 autocast (threads alone give the same bits here)")
    ap.add_argument("--no-audit-baseline", action="store_true", help="also run each attack with no audits")
    ap.add_argument("--workers", type=int, default=1, help="runs in parallel (2 skews the check costs)")
    ap.add_argument("--vary-threads", action="store_true",
                    help="replica i trains on 1 + i %% 2 threads, its auditor on the other count")
    ap.add_argument("--spread-attacks", nargs="*", default=None, choices=ATTACKS,
                    help="attacks run on every seed (default: all); the others on the first seed only")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    rate = a.audit_rate if a.audit_rate is not None else audit.audit_rate_for(a.replicas, max(a.malicious))
    common = dict(replicas=a.replicas, rate=rate, check=a.check, auditor_precision=a.auditor_precision,
                  vary_threads=a.vary_threads)
    # the short clean runs and the attacks first, the long clean runs (false accusations) last
    jobs = [dict(seed=s, attack=None, malicious=0, rounds=a.attack_rounds, act=True, **common) for s in a.seeds]
    spread = a.attacks if a.spread_attacks is None else a.spread_attacks
    for s in a.seeds:
        for m in a.malicious:
            for atk in (a.attacks if s == a.seeds[0] else [x for x in a.attacks if x in spread]):
                for act in ([True, False] if a.no_audit_baseline else [True]):
                    jobs.append(dict(seed=s, attack=atk, malicious=m, rounds=a.attack_rounds, act=act, **common))
    jobs += [dict(seed=s, attack=None, malicious=0, rounds=a.rounds, act=True, **common) for s in a.seeds]
    done_path = a.out.with_suffix(".runs.jsonl")  # each finished run, so an interrupted bench resumes
    a.out.parent.mkdir(parents=True, exist_ok=True)
    runs = [json.loads(line) for line in done_path.read_text().splitlines()] if done_path.exists() else []
    key = lambda j: (j["seed"], j["attack"] or "clean", j["malicious"], j["rounds"], j["act"])  # noqa: E731
    finished = {key(r) for r in runs}
    jobs = [j for j in jobs if key(j) not in finished]
    with mp.get_context("spawn").Pool(a.workers) as pool:
        for r in pool.imap_unordered(_job, jobs):
            runs.append(r)
            with open(done_path, "a") as f:
                f.write(json.dumps(r, default=str) + "\n")
            print(f"seed {r['seed']} {r['attack']:>12} m{r['malicious']} rounds {r['rounds']} act {r['act']}: "
                  f"val {r['val_loss']:.4f} excluded {r['excluded']} ({r['seconds']:.0f}s)", flush=True)
    # the loss comparison is at equal rounds: the long clean runs only count honest node-rounds
    for r in runs:
        if r["attack"] == "clean" and r["rounds"] != a.attack_rounds:
            r["attack"] = "clean-long"
    rows = summarize(runs)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    settings = dict(vars(a), out=str(a.out), rate=rate, workload="tiny (133,440 params), real training",
                    inner_steps=H, prefix_steps=PREFIX, loss_batches=LOSS_BATCHES, sparse=SPARSE.__dict__)
    a.out.with_suffix(".json").write_text(json.dumps(dict(settings=settings, rows=rows, runs=runs), indent=1,
                                                     default=str))
    with open(a.out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for row in rows:
        print(row)
    plot(runs, a.out.with_suffix(".png"))


def plot(runs: list[dict], path: Path) -> None:
    """Each check's statistic for honest node-rounds and per attack, with the threshold as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    th = audit.Thresholds()
    panels = [("recompute: worst link error", lambda a: max(a.get("contribution_error", 0),
                                                            a.get("error_feedback_error", 0),
                                                            a.get("optimizer_error", 0)), th.max_link_error, True),
              ("prefix: cosine to the claimed delta", lambda a: a["prefix_cosine"], th.min_prefix_cosine, False),
              ("loss-change: relative loss drop", lambda a: a["loss_drop"], th.min_loss_drop, False)]
    groups = [("honest", lambda r, a: not a["lying"])] + [
        (f"{atk} m{m}", lambda r, a, atk=atk, m=m: a["lying"] and r["attack"] == atk and r["malicious"] == m)
        for atk, m in sorted({(r["attack"], r["malicious"]) for r in runs if r["liars"]})]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.5))
    for ax, (title, stat, line, log) in zip(axes, panels):
        for k, (name, keep) in enumerate(groups):
            ys = [stat(a) for r in runs for a in r["audits"] if keep(r, a)]
            ys = [y for y in ys if math.isfinite(y)]
            ax.scatter([k + (j % 7 - 3) * 0.05 for j in range(len(ys))], [max(y, 1e-4) if log else y for y in ys],
                       s=6, alpha=0.5, color="C0" if k == 0 else "C3")
        ax.axhline(max(line, 1e-4) if log else line, color="k", ls="--", lw=1)
        ax.set_xticks(range(len(groups)), [g[0] for g in groups], rotation=60, ha="right", fontsize=8)
        ax.set_yscale("log" if log else "symlog" if "loss" in title else "linear")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    fig.suptitle("audit statistics per node-round (tiny model, 5 replicas, real training; "
                 "auditor on another thread count); dashed: threshold")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
