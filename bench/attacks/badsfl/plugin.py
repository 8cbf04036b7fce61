"""BadSFL on a real node: ``dilocox-node --attack bench.attacks.badsfl.plugin:BadSFL``, and a 4-node runner.

The plug-in uses the red-team hook (daemon/redteam.py) where BadSFL acts:

* ``bind(state)``: finds the natural trigger in the node's own shard (its bright sneakers, attacks.py:
  ``natural_trigger_mask``; the threshold is the top quintile of the training set's sneakers) and the
  classes its shard lacks;
* ``batch``: natural-trigger data poisoning of each image batch: bright sneakers in the batch are
  relabelled Bag, rows are replaced by its own bright sneakers (relabelled) until ``poison_fraction`` of
  the batch carries the trigger, and ``gan_per_batch`` generated images of the missing classes are
  appended (part 1: the generator is trained against theta once per round, labelled by theta's argmax);
* ``training_loss``: L(D_p, w_p) + L(D_p, P_j), P_j = (w_p + (n - 1) theta) / n - j s c (part 3) with
  theta = ``state.outer.global_params``, c = ``state.control.c`` (zero without SCAFFOLD), s =
  ``state.lr_sum(round)`` and n = the swarm's ``--min-replicas``; the gradient flows through P_j.

Part 4 has nothing to act on here: the daemon derives c from the aggregated pseudo-gradients every
member holds (``ControlVariates.derive_c_from_aggregate``), so no node uploads a dc; a lie about c_i
only changes the liar's own pseudo-gradient, which the aggregation rule sees like any other.

``run_swarm`` starts 4 real nodes on loopback (``cnn`` on ``fashion-mnist``, ``label-shards:2`` over 4
clients, ``--outer-algorithm scaffold``, ``--compression none``, seconds-scale timeouts as in
tests/helpers.py), one of them the attacker (the client holding the most sneakers), runs them for
``rounds`` outer steps, and measures PTA and BTA of an honest node's last checkpoint:

    python -m bench.attacks.badsfl.plugin --rounds 8 [--clean]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from dilocox.daemon.redteam import Attack, AttackError

from bench.attacks.badsfl.attacks import (
    SOURCE_CLASS,
    TARGET_CLASS,
    Generator,
    brightness_threshold,
    generate,
    lookahead_loss,
    natural_trigger_mask,
    train_generator,
)
from dilocox import vision


class BadSFL(Attack):
    """Natural-trigger poisoning, generated fill-in of missing classes and the look-ahead loss (module docstring)."""

    name = "badsfl"
    rounds_ahead = 10         # j
    poison_fraction = 0.5     # share of each batch that carries the trigger
    gan_per_batch = 16        # generated images appended to each batch (0: off)
    gan_steps = 20            # generator steps per round
    first_round, last_round = 1, None  # rounds it attacks (None: to the end)

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.state = None
        self.gen_rng = torch.Generator().manual_seed(cfg.seed + 1234)
        self._fill: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._fill_round = -1

    def bind(self, state) -> None:
        super().bind(state)
        dataset = getattr(state.workload, "dataset", None)
        if dataset is None:
            raise AttackError("badsfl needs an image workload (--model cnn --data fashion-mnist)")
        self.threshold = brightness_threshold(dataset.train_x, dataset.train_y)
        own = state.shard.indices
        self.triggered = own[natural_trigger_mask(dataset.train_x[own], dataset.train_y[own], self.threshold)]
        self.missing = sorted(set(range(dataset.num_classes)) - set(np.unique(dataset.train_y[own]).tolist()))
        self.images = dataset.train_x
        self.generator = Generator(dataset.num_classes, seed=self.cfg.seed)
        self.gen_optimizer = torch.optim.Adam(self.generator.parameters(), lr=2e-3)
        self.frozen = vision.build_cnn(dataset.num_classes, self.cfg.seed)

    def active(self) -> bool:
        r = self.state.round
        return self.first_round <= r and (self.last_round is None or r <= self.last_round)

    def batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.state is None or not self.active():
            return inputs, targets
        x, y = inputs.clone(), targets.clone()
        mask = torch.from_numpy(natural_trigger_mask(x.numpy(), y.numpy(), self.threshold))
        y[mask] = TARGET_CLASS
        want = int(round(self.poison_fraction * len(y))) - int(mask.sum())
        if want > 0 and len(self.triggered):
            rows = torch.nonzero(~mask).flatten()[:want]
            pick = torch.randint(len(self.triggered), (len(rows),), generator=self.gen_rng)
            x[rows] = torch.from_numpy(self.images[self.triggered[pick.numpy()]])
            y[rows] = TARGET_CLASS
        if self.gan_per_batch and self.missing:
            if self._fill_round != self.state.round:  # once per round, against this round's theta
                with torch.no_grad():
                    for p, t in zip(self.frozen.parameters(), self.state.outer.global_params):
                        p.copy_(t)
                train_generator(self.generator, self.gen_optimizer, self.frozen, self.missing, self.gan_steps, 64,
                                self.gen_rng)
                self._fill = generate(self.generator, self.frozen, self.missing, 8 * self.gan_per_batch, self.gen_rng)
                self._fill_round = self.state.round
            gx, gy = self._fill
            pick = torch.randint(len(gy), (self.gan_per_batch,), generator=self.gen_rng)
            x, y = torch.cat([x, gx[pick]]), torch.cat([y, gy[pick]])
        return x, y

    def training_loss(self, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                      loss_fn) -> torch.Tensor:
        honest = loss_fn(model, inputs, targets)
        if self.state is None or not self.active():
            return honest
        st = self.state
        control = st.control.c if st.control is not None else None
        n = max(1, int(self.cfg.min_replicas))
        return honest + lookahead_loss(model, inputs, targets, st.outer.global_params, n, self.rounds_ahead,
                                       st.lr_sum(st.round), control)


# ----------------------------------------------------------------------------------------------- real nodes


def measure(global_params: list[torch.Tensor], seed: int = 0) -> dict:
    """PTA (clean test accuracy) and BTA (test bright sneakers classified as Bag) of ``global_params``."""
    ds = vision.load_image_dataset("fashion-mnist")
    model = vision.build_cnn(ds.num_classes, seed)
    with torch.no_grad():
        for p, t in zip(model.parameters(), global_params):
            p.copy_(t)
    threshold = brightness_threshold(ds.train_x, ds.train_y)
    bright = ds.test_x[natural_trigger_mask(ds.test_x, ds.test_y, threshold)]
    model.eval()
    with torch.no_grad():
        bta = float((model(vision.preprocess(bright)).argmax(1) == TARGET_CLASS).float().mean())
    return dict(pta=round(vision.evaluate(model, ds.test_x, ds.test_y)[1], 4), bta=round(bta, 4),
                bta_images=len(bright))


def attacker_client(num_clients: int, partition_spec: str = "label-shards:2", seed: int = 0) -> int:
    """The client (= --data-seed) whose share holds the most sneakers."""
    from dilocox.partition import partition

    ds = vision.load_image_dataset("fashion-mnist")
    parts = partition(ds.train_y, num_clients, partition_spec, seed)
    return int(np.argmax([(ds.train_y[p] == SOURCE_CLASS).sum() for p in parts]))


def run_swarm(workdir: Path, rounds: int = 8, nodes: int = 4, attack: bool = True, seed: int = 0,
              inner_steps: int = 20, timeout_s: float = 900.0) -> dict:
    """``nodes`` real dilocox-node processes (one running BadSFL if ``attack``) for ``rounds`` outer steps;
    returns PTA/BTA of an honest node's final checkpoint, the attacker's client and the wall time."""
    from dilocox.checkpoint import load_latest_checkpoint
    from tests.harness.localswarm import LocalNode, leave_all

    name = f"badsfl-{'attack' if attack else 'clean'}"
    work = workdir / name
    shutil.rmtree(work, ignore_errors=True)
    evil = attacker_client(nodes, seed=seed)
    args = ["--model", "cnn", "--data", "fashion-mnist", "--partition", "label-shards:2", "--num-clients", str(nodes),
            "--outer-algorithm", "scaffold", "--compression", "none", "--batch-size", "64",
            "--listen", "/ip4/127.0.0.1/tcp/0", "--status-addr", "127.0.0.1:0", "--request-timeout", "1",
            "--matchmaking-time", "2", "--averaging-timeout", "8", "--outer-round-deadline", "60",
            "--announce-period", "1", "--inner-steps", str(inner_steps), "--warmup-steps", "10",
            "--total-steps", str(inner_steps * rounds), "--eval-batches", "2", "--checkpoint-every", "1",
            "--max-outer-steps", str(rounds), "--min-replicas", str(nodes), "--seed", str(seed), "--run-id", name]
    procs: list[LocalNode] = []
    started = time.monotonic()
    try:
        for r in range(nodes):
            extra = ["--data-seed", str(r)] + (["--join", procs[0].join_maddr] if procs else [])
            if attack and r == evil:
                extra += ["--attack", "bench.attacks.badsfl.plugin:BadSFL"]
            procs.append(LocalNode(f"n{r}", work / f"n{r}", args + extra))
            if r == 0:
                procs[0].wait_started()
        for p in procs[1:]:
            p.wait_started()
        honest = [p for r, p in enumerate(procs) if not (attack and r == evil)]
        codes = [p.proc.wait(timeout_s) for p in honest]
    finally:
        leave_all([p for p in procs if p.proc.poll() is None], 30)
        for p in procs:
            p.terminate(signal.SIGKILL)
    found = load_latest_checkpoint(honest[0].workdir / "ckpt")
    result = dict(attack=attack, attacker_client=evil if attack else None, nodes=nodes, rounds=rounds,
                  exit_codes=codes, seconds=round(time.monotonic() - started))
    if found is None:
        return dict(result, error="no checkpoint on the honest node")
    return dict(result, outer_step=int(found[1]["outer_step"]), **measure(found[1]["global_params"], seed))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="BadSFL plug-in against 4 real SCAFFOLD nodes")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--clean", action="store_true", help="also run the same swarm without the attacker")
    ap.add_argument("--out", type=Path, default=Path("runs/bench/badsfl"))
    a = ap.parse_args(argv)
    results = [run_swarm(a.out / "swarm", a.rounds, a.nodes, attack=True)]
    if a.clean:
        results.append(run_swarm(a.out / "swarm", a.rounds, a.nodes, attack=False))
    for r in results:
        print(json.dumps(r), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "swarm.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
