"""A pixel-trigger backdoor node against real SCAFFOLD swarms, and its BTA curve beside the harness's.

``PixelBackdoor`` (``dilocox-node --attack bench.attacks.badsfl.pixel_node:PixelBackdoor``) is the harness's
black-box client attacker (sim.py, ``trigger="pixel"``) on a real node: in rounds ``first_round``..``last_round``
half of each of its batches are its own images of other classes stamped with the 4x4 white square (sim.py
``stamp``) and labelled ``TARGET_CLASS``; ``BoostedPixelBackdoor`` also multiplies its pseudo_gradient by 30 in
those rounds (the paper's 5 x lr and 6 x steps, taken as their product). Outside the window it trains honestly.

``run_swarm`` starts ``nodes`` real dilocox-node processes on loopback (``cnn`` on ``fashion-mnist``,
``label-shards:2`` over ``nodes`` clients, ``--outer-algorithm scaffold`` with every other aggregation flag at its
default: sparse compression, norm bound 2, mean, ``--drop-outsized 4``, the quiet restart), one of them the
attacker (the client with the most images of other classes, as sim.py picks it), and reads PTA and BTA of an
honest node's theta after every outer step from its checkpoints. ``harness_curve`` runs the same federation in
sim.py (every client in every round, no pre-training, the daemon's aggregation rules, dense pseudo-gradients).
``RUNS`` names each run's node flags (appended; the last of a repeated flag wins) and its harness setting.

    python -m bench.attacks.badsfl.pixel_node --seeds 0        # every run of RUNS; make bench-badsfl-node
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import signal
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from dilocox.daemon.redteam import Attack, AttackError

from bench.attacks.badsfl.attacks import TARGET_CLASS, AttackKnobs
from bench.attacks.badsfl.run import BY_NAME, persistence
from bench.attacks.badsfl.sim import SimConfig, run_setting, stamp
from dilocox import vision

FIRST, LAST = 10, 40  # the harness's attack window (rounds, inclusive)
BOOST = 30.0


class PixelBackdoor(Attack):
    """Pixel-trigger data poisoning in rounds FIRST..LAST (module docstring); ``boost`` scales its pseudo_gradient
    in those rounds."""

    name = "pixel-backdoor"
    poison_fraction = 0.5
    boost = 1.0
    first_round, last_round = FIRST, LAST

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.state = None
        self.rng = torch.Generator().manual_seed(cfg.seed + 4242)

    def bind(self, state) -> None:
        super().bind(state)
        dataset = getattr(state.workload, "dataset", None)
        if dataset is None:
            raise AttackError("pixel-backdoor needs an image workload (--model cnn --data fashion-mnist)")
        own = state.shard.indices
        source = own[dataset.train_y[own] != TARGET_CLASS]
        if len(source) == 0:
            raise AttackError("pixel-backdoor: this node's shard holds no image of another class to stamp")
        self.stamped = torch.from_numpy(stamp(dataset.train_x[source]))

    def active(self, round_index: Optional[int] = None) -> bool:
        r = self.state.round if round_index is None else round_index
        return self.first_round <= r <= self.last_round

    def batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.state is None or not self.active():
            return inputs, targets
        x, y = inputs.clone(), targets.clone()
        rows = torch.randperm(len(y), generator=self.rng)[:int(round(self.poison_fraction * len(y)))]
        pick = torch.randint(len(self.stamped), (len(rows),), generator=self.rng)
        x[rows] = self.stamped[pick].to(x.dtype)
        y[rows] = TARGET_CLASS
        return x, y

    def pseudo_gradient(self, tensors: list[torch.Tensor], round_index: int) -> list[torch.Tensor]:
        if self.boost == 1.0 or not self.active(round_index):
            return tensors
        return [t * self.boost for t in tensors]


class BoostedPixelBackdoor(PixelBackdoor):
    """``PixelBackdoor`` whose pseudo_gradient is 30 x in the attack window (module docstring)."""

    name = "pixel-backdoor-boosted"
    boost = BOOST


# ----------------------------------------------------------------------------------------------- measuring


class Probe:
    """PTA and BTA of a theta on the first ``images`` test images: clean accuracy, and the fraction of those not of
    the target class that, stamped, are classified as it."""

    def __init__(self, images: int = 2000, seed: int = 0) -> None:
        ds = vision.load_image_dataset("fashion-mnist")
        self.x, self.y = ds.test_x[:images], ds.test_y[:images]
        self.triggered = vision.preprocess(stamp(self.x[self.y != TARGET_CLASS]))
        self.model = vision.build_cnn(ds.num_classes, seed)

    def __call__(self, params: list[torch.Tensor]) -> tuple[float, float]:
        with torch.no_grad():
            for p, t in zip(self.model.parameters(), params):
                p.copy_(t)
            self.model.eval()
            bta = float((self.model(self.triggered).argmax(1) == TARGET_CLASS).float().mean())
        return vision.evaluate(self.model, self.x, self.y)[1], bta


def attacker_client(nodes: int, seed: int, spec: str = "label-shards:2") -> int:
    """The client (= --data-seed) holding the most images of classes other than the target (sim.py's pick)."""
    from dilocox.partition import partition

    ds = vision.load_image_dataset("fashion-mnist")
    parts = partition(ds.train_y, nodes, spec, seed)
    return int(np.argmax([(ds.train_y[p] != TARGET_CLASS).sum() for p in parts]))


def run_swarm(work: Path, attack: Optional[str], seed: int, rounds: int = 60, nodes: int = 4, inner_steps: int = 20,
              extra: tuple[str, ...] = (), timeout_s: float = 1800.0) -> dict:
    """``nodes`` real nodes, one running ``attack`` (MODULE:CLASS, or None), for ``rounds`` outer steps; the curve
    of PTA/BTA per outer step on an honest node, and the rounds whose aggregate left a contribution out."""
    from dilocox.checkpoint import load_latest_checkpoint
    from tests.harness.localswarm import LocalNode, leave_all

    shutil.rmtree(work, ignore_errors=True)
    evil = attacker_client(nodes, seed) if attack else -1
    args = ["--model", "cnn", "--data", "fashion-mnist", "--partition", "label-shards:2", "--num-clients", str(nodes),
            "--outer-algorithm", "scaffold", "--batch-size", "64", "--inner-lr", "1e-3", "--weight-decay", "0.1",
            "--listen", "/ip4/127.0.0.1/tcp/0", "--status-addr", "127.0.0.1:0", "--request-timeout", "1",
            "--matchmaking-time", "2", "--averaging-timeout", "8", "--outer-round-deadline", "60",
            "--announce-period", "1", "--inner-steps", str(inner_steps), "--warmup-steps", "0",
            "--total-steps", str(1_000_000), "--eval-batches", "1", "--checkpoint-every", "1",
            "--max-outer-steps", str(rounds), "--min-replicas", str(nodes), "--seed", str(seed),
            "--run-id", f"pixel-{seed}", *extra]
    probe, curve, procs = Probe(seed=seed), {}, []
    started = time.monotonic()
    try:
        for r in range(nodes):
            more = ["--data-seed", str(r)] + (["--join", procs[0].join_maddr] if procs else [])
            procs.append(LocalNode(f"n{r}", work / f"n{r}", args + more + (["--attack", attack] if r == evil else [])))
            if r == 0:
                procs[0].wait_started()
        for p in procs[1:]:
            p.wait_started()
        honest = next(p for r, p in enumerate(procs) if r != evil)
        while honest.proc.poll() is None and time.monotonic() - started < timeout_s:
            read_new(honest.workdir / "ckpt", curve, probe)
            time.sleep(0.2)
        codes = [p.proc.wait(max(1.0, timeout_s - (time.monotonic() - started))) for p in procs if p is honest]
    finally:
        leave_all([p for p in procs if p.proc.poll() is None], 30)
        for p in procs:
            p.terminate(signal.SIGKILL)
    found = load_latest_checkpoint(honest.workdir / "ckpt")
    if found is not None:
        curve[int(found[1]["outer_step"])] = probe(found[1]["global_params"])
    rows = honest.metrics()
    left_out = sorted({r["outer_step"] for r in rows if r.get("outcome") == "applied" and r.get("outsized")})
    return dict(attack=attack, attacker_client=evil, seed=seed, exit_codes=codes, outsized_rounds=left_out,
                seconds=round(time.monotonic() - started),
                curve=[dict(round=s, pta=pta, bta=bta, injecting=bool(attack) and FIRST <= s <= LAST)
                       for s, (pta, bta) in sorted(curve.items())])


def read_new(directory: Path, curve: dict, probe: Probe) -> None:
    """PTA/BTA of every checkpoint in ``directory`` (the node keeps its newest 3) whose outer step ``curve`` lacks;
    a file removed or half-written while read is left for the next call or the end."""
    for path in sorted(directory.glob("step-*.pt")):
        try:
            state = torch.load(path, weights_only=True)
        except Exception:  # rotated away or still being written
            continue
        if int(state["outer_step"]) not in curve:
            curve[int(state["outer_step"])] = probe(state["global_params"])


def harness_config(seed: int, rounds: int = 60, nodes: int = 4, inner_steps: int = 20) -> SimConfig:
    """sim.py's federation as ``run_swarm`` runs it: every client in every round, no pre-training, the pixel
    attacker as a client, 2,000 test images."""
    return SimConfig(clients=nodes, per_round=nodes, rounds=rounds, attack_start=FIRST, attack_stop=LAST,
                     inner_steps=inner_steps, pretrain_rounds=0, seed=seed, trigger="pixel", eval_images=2000,
                     knobs=AttackKnobs(self_correction=True))


def harness_curve(seed: int, setting: str, boost: bool, cache: Path, **kw) -> dict:
    """One harness run (``setting`` of run.py's BY_NAME) of ``harness_config``; ``boost``: the paper's 5 x lr and
    6 x steps."""
    cfg = harness_config(seed, **kw)
    if boost:
        cfg = dataclasses.replace(cfg, knobs=dataclasses.replace(cfg.knobs, lr_factor=5.0, step_factor=6))
    return run_setting(cfg, BY_NAME[setting], cache)


DENSE_SGD1 = ("--compression", "none", "--outer-lr", "1", "--outer-momentum", "0", "--no-nesterov")
RUNS = {  # label -> (attack class or None, node flags, harness setting or None, boosted)
    "clean": (None, (), "scaffold/daemon-drop4", False),
    "pixel": ("PixelBackdoor", (), "scaffold+blackbox/daemon-drop4", False),
    "pixel-boosted": ("BoostedPixelBackdoor", (), "scaffold+blackbox/daemon-drop4", True),
    "pixel-boosted/no-drop": ("BoostedPixelBackdoor", ("--drop-outsized", "0"), "scaffold+blackbox/daemon", True),
    # where the node and the harness differ: the node's sparse codes (top-k with error feedback) against the
    # harness's dense pseudo-gradients (both at outer lr 1): the node with the harness's outer step (dense codes: no
    # robust rule; c derived from the aggregate, as the node does), sparse codes at an explicit outer lr 1 (the
    # default since outer lr 3.5 made theta swing), and both without control variates (FedAvg: the node's DiLoCo
    # path at the same outer step)
    "pixel/dense-lr1": ("PixelBackdoor", DENSE_SGD1, "scaffold+blackbox/derived", False),
    "pixel/sparse-lr1": ("PixelBackdoor", ("--outer-lr", "1"), None, False),
    "pixel/fedavg-dense-lr1": ("PixelBackdoor", DENSE_SGD1 + ("--outer-algorithm", "diloco"), "fedavg+blackbox",
                               False),
}


def summarize(label: str, source: str, seed: int, curve: list[dict], rounds: int) -> dict:
    late = [p["pta"] for p in curve if p["round"] > rounds - 20]
    at = {p["round"]: p["bta"] for p in curve}
    for r in range(min(at) + 1, rounds + 1):  # a round the poll missed reads as the one before it
        at.setdefault(r, at[r - 1])
    curve = [dict(round=r, bta=b) for r, b in sorted(at.items())]
    during = [b for r, b in at.items() if FIRST <= r <= LAST]
    return dict(run=label, source=source, seed=seed, bta_window_max=round(100 * max(during), 1) if during else None,
                bta_end=round(100 * at.get(rounds, float("nan")), 1),
                pta_last20=round(100 * float(np.mean(late)), 1) if late else None,
                to_50=persistence(curve, LAST, rounds, 0.5) if rounds in at and LAST in at else "n/a")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--no-harness", action="store_true", help="the real swarms only")
    ap.add_argument("--out", type=Path, default=Path("runs/bench/badsfl-node"))
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    done = a.out / "runs.jsonl"
    have = {(r["run"], r["source"], r["seed"]) for r in map(json.loads, done.read_text().splitlines())} \
        if done.exists() else set()
    for seed in a.seeds:
        for label in a.runs:
            cls, flags, setting, boost = RUNS[label]
            todo = [("node", lambda: run_swarm(a.out / "swarm" / label.replace("/", "-"),
                                               cls and f"bench.attacks.badsfl.pixel_node:{cls}", seed, a.rounds,
                                               a.nodes, extra=flags))]
            if not a.no_harness and setting is not None:
                todo.append(("harness", lambda: harness_curve(seed, setting, boost, a.out / "cache",
                                                              rounds=a.rounds, nodes=a.nodes)))
            for source, go in todo:
                if (label, source, seed) in have:
                    continue
                result = go()
                row = dict(run=label, source=source, seed=seed, curve=result["curve"],
                           **{k: result[k] for k in ("outsized_rounds", "exit_codes", "seconds") if k in result})
                with open(done, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(summarize(label, source, seed, row["curve"], a.rounds)), flush=True)
    rows = [json.loads(line) for line in done.read_text().splitlines()]
    table = [summarize(r["run"], r["source"], r["seed"], r["curve"], a.rounds) for r in rows]
    (a.out / "badsfl-node.json").write_text(json.dumps(dict(config=dataclasses.asdict(
        harness_config(a.seeds[0], a.rounds, a.nodes)), table=table), indent=1, default=str))
    plot(rows, a.out / "badsfl-node.png", a.nodes)
    for row in table:
        print(row)


def plot(rows: list[dict], path: Path, nodes: int) -> None:
    """BTA and PTA per round: one colour per run, solid for the real swarm, dashed for the harness."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    colours = {label: f"C{k}" for k, label in enumerate(RUNS)}
    for r in rows:
        kw = dict(color=colours[r["run"]], ls="-" if r["source"] == "node" else "--", lw=1.2,
                  label=f"{r['run']} {r['source']} s{r['seed']}")
        rounds = [p["round"] for p in r["curve"]]
        axes[0].plot(rounds, [100 * p["bta"] for p in r["curve"]], **kw)
        axes[1].plot(rounds, [100 * p["pta"] for p in r["curve"]], **kw)
    for ax in axes:
        ax.axvspan(FIRST, LAST, color="k", alpha=0.07)
        ax.grid(alpha=0.3)
    axes[0].axhline(50, color="k", lw=0.6, ls="--")
    axes[0].set_ylabel("BTA: stamped test images -> target (%)")
    axes[1].set_ylabel("PTA: clean test accuracy (%)")
    axes[1].set_xlabel(f"outer step (attack {FIRST}-{LAST}, shaded)")
    axes[0].legend(fontsize=7, ncol=2)
    axes[0].set_title(f"Pixel backdoor: {nodes} real nodes (solid) vs the harness (dashed); flags per run: RUNS")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

if __name__ == "__main__":
    main()
