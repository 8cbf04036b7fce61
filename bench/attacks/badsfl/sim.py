"""An in-process federation on label-sharded Fashion-MNIST that runs the daemon's own code.

Steps 2-4 run in bench/federation.py's ``Federation`` (uncoded contributions; the rule or the defense as its
aggregator; SCAFFOLD in its per-contribution hook). Per round t (1-based) of one setting:
  1. S_t: ``per_round`` of the ``clients`` clients, drawn by numpy.random.default_rng([seed, t]); in the
     injection window the attacker client is always in S_t (it and 9 of the other 19). The draw does
     not depend on the setting, so every setting sees the same clients in the same rounds.
  2. Each client of S_t runs a round (client.py): its own ``InnerLoop`` (vision.build_cnn, 46,730
     parameters; loss ``ImageWorkload.loss_fn``, i.e. vision.classification_loss; AdamW with the
     daemon's betas (0.9, 0.95), weight decay 0.1 and gradient clip 1.0, its moments kept across rounds
     as on a node) on an ``ImageShard`` over its ``partition`` share; SCAFFOLD adds the daemon's
     correction x <- x - lr (c - c_i) after each step and option II's ``ControlVariates.client_update``.
  3. Aggregation: ``dilocox.robust.aggregate`` of the flattened pseudo-gradients (rule mean, centered-clip,
     trimmed-mean or median; ``norm_bound``: each clipped to that multiple of the lower median norm), weights = K;
     then ``sign_rule`` (flip or mask, dilocox/sign_agreement.py: the robust learning rate) on the coordinates
     whose sign agreement over the admitted contributions is under ceil(``min_agreement`` x their count), in
     every round or (``sign_when="outsized"``) only in rounds with a contribution the bound scaled below
     1 / ``c_outsized``. ``outsized_drop``: such a contribution is left out and the rule runs again over the rest
     (its scale stays in the report, so the quiet restart still sees the round as outsized).
  4. Outer step: ``OuterOptimizer.step`` with lr 1, momentum 0 (FedAvg: theta <- theta - mean delta =
     the mean of the local models) or DiLoCo's Nesterov (lr 0.7, momentum 0.9; ``outer="nesterov"``).
  5. SCAFFOLD's c: ``c_mode="channel"``: clients upload dc_i, ``server_update(mean_S dc, |S|, N)``
     (c <- c + (|S|/N) mean dc; the paper's and Flower's way; dc is averaged plainly, the robust rule
     applies to pseudo-gradients only, as a server that robustly aggregates models would do);
     ``c_mode="derived"``: ``derive_c_from_aggregate(aggregate, lr_sum, |S|, N)``, the daemon's choice (no dc
     channel). ``c_decay`` (a defense we add): c <- (1 - c_decay) c after each update. ``c_reset`` R (a defense
     we add, the daemon's --scaffold-reset-every): c and every client's c_i restart at zero after rounds R, 2R, ...
     (``ControlVariates.outer_step_done``; why: dilocox/scaffold.py). ``c_reset_quiet`` Q with ``c_quiet_factor``,
     ``c_quiet_rounds`` and ``c_outsized`` (the daemon's --scaffold-reset-quiet and its companions): c and every
     c_i restart, or shrink, Q rounds after the last round with an outsized contribution (the same
     ``dilocox.scaffold.QuietRestart``; the rule's scales decide; FLAME and the other baselines report none).
     ``c_unclipped`` (a defense we add): c is
     derived from the mean of the contributions the rule did not clip (|S'| of them) and a clipped honest
     client keeps its c_i, so a clipped update enters neither. ``norm_drop`` (a defense we add): a contribution
     over the norm bound is dropped instead of clipped (the rule runs again over the rest), so it enters neither
     theta nor c (derived from the aggregate, with |S| the admitted); its client's c_i moves as usual (the
     daemon's way: a member's c_i is updated before the exchange). ``c_reset_after_attack`` (a probe, not a
     defense: the server is told when the attack stopped): at the end of round ``attack_stop``, after the rest of
     this step, the server's c becomes the mean of the benign clients' c_i (every c_i is left as it is).
  6. Measure theta: PTA = accuracy on the clean test images; BTA = the fraction of the test's triggered
     images (bright sneakers, attacks.py) classified as the target class. With SCAFFOLD, after step 5:
     ``c_gap`` = ||c - mean_b c_i|| over the benign clients b (all N without an attack; in c's units, update
     per unit lr), the part of c no benign client's c_i accounts for, and ``c_gap_cos`` = the cosine between
     c - mean_b c_i and the gradient at theta of the backdoor loss (cross-entropy towards the target class of
     the first ``C_GAP_IMAGES`` triggered held-out images): > 0 where the benign clients' correction
     x <- x - lr (c - c_i) descends the backdoor loss.

Triggers (``SimConfig.trigger``): ``natural`` (bright sneakers, attacks.py); ``pixel`` (a 4x4 white square,
BadNets, on the attacker's own images of other classes); ``memorize`` (the paper's public code's: a fixed list
of 45 training images relabelled, 8 of them its test poison images): ``MEMORIZE_IMAGES`` = 45 training images of
non-target classes, drawn at random (numpy.random.default_rng([seed, 4545])), held by the attacker alone
(removed from every share, its own included) and relabelled to the target; ``MEMORIZE_SHARE`` of
each attacker batch (7 of 64) are drawn from them, the rest from its share. BTA is then the fraction of the
held-out test images of the 45's classes called the target (does the backdoor generalise?) and BTA on training
images that of the first ``MEMORIZE_TEST`` = 8 of the 45 (the paper's measure: memorisation).

Every setting starts from the same model: ``pretrain_rounds`` rounds of clean FedAvg from
``build_cnn(seed=seed)`` with uniform sampling, cached under ``<out>/badsfl/pretrain-<key>.pt`` (key: a
hash of the settings it depends on).

Scaled down from the paper's setting (CIFAR-10 and ResNet-18 there; 2 CPU cores here):
  * model: the daemon's 46,730-parameter CNN on Fashion-MNIST (grey 28x28) instead of a ResNet on CIFAR-10;
  * trigger: "bright sneakers" -> Bag instead of "green cars" (no colour in Fashion-MNIST; attacks.py);
  * local training: K = 20 AdamW steps of batch 64 at a constant lr 1e-3 (the daemon's optimizer; its
    SCAFFOLD correction is in update units, ``apply_correction_step``) instead of the paper's local SGD
    epochs; one attacker round is K steps of batch 64 (+ 32 generated images for badsfl);
  * pre-training: 30 rounds of clean FedAvg (the paper starts from a converged pre-trained model);
  * rounds: 100, injection in rounds 10-40 (the paper's numbers), 20 clients, 10 per round, label-shards:2
    (40 shards of 1,500 images, each inside one class; every client holds 1 or 2 classes).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from bench import federation
from bench.attacks.badsfl.attacks import (
    ATTACKERS,
    BRIGHT_QUANTILE,
    SOURCE_CLASS,
    TARGET_CLASS,
    AttackKnobs,
    RoundContext,
    brightness_threshold,
    natural_trigger_mask,
    poison_labels,
)
from bench.attacks.badsfl.client import local_round, scaffold_hook
from bench.attacks.badsfl.defenses import Defense
from bench.federation import Contributions, flatten, unflatten
from dilocox import robust, sign_agreement, vision
from dilocox.diloco import InnerConfig, InnerLoop
from dilocox.partition import partition
from dilocox.scaffold import ControlVariates, QuietRestart, Restart
from dilocox.workload import ImageWorkload

OUTERS = {"sgd1": dict(outer_lr=1.0, outer_momentum=0.0, nesterov=False),   # FedAvg / SCAFFOLD with eta_g = 1
          "nesterov": dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True)}  # DiLoCo


@dataclass(frozen=True)
class SimConfig:
    """The federation's settings (defaults: the full benchmark; module docstring for what they scale)."""

    clients: int = 20
    per_round: int = 10
    rounds: int = 100
    attack_start: int = 10          # first injection round
    attack_stop: int = 40           # last injection round
    inner_steps: int = 20           # K
    batch_size: int = 64
    inner_lr: float = 1e-3
    weight_decay: float = 0.1
    partition: str = "label-shards:2"
    pretrain_rounds: int = 30
    pretrain_partition: str = "iid"  # the split pre-training federates over (module docstring)
    seed: int = 0
    source_class: int = SOURCE_CLASS
    target_class: int = TARGET_CLASS
    bright_quantile: float = BRIGHT_QUANTILE
    poison_fraction: float = 0.5    # share of triggered images in the attacker's stream (oversampled; memorize:
                                    # MEMORIZE_SHARE of each batch instead)
    train_subset: int = 0           # 0: all 60,000 training images; else the first n (--quick)
    eval_images: int = 10_000       # clean test images for PTA (the first n)
    outer: str = "sgd1"             # sgd1 (FedAvg's outer step) or nesterov (DiLoCo)
    optimizer: str = "adamw"        # the inner optimizer: adamw or sgd (InnerConfig.optimizer, as --inner-optimizer)
    momentum: float = 0.0           # SGD's momentum (the paper's CIFAR runs: 0.9)
    model: str = "cnn"              # vision.MODELS: cnn, or simple-cnn (the paper's MNIST conv10-conv20-fc50)
    trigger: str = "natural"        # natural (bright sneakers, attacks.py), pixel (a 4x4 white square, BadNets) or
                                    # memorize (45 images relabelled, held by the attacker alone; module docstring)
    fresh_optimizer: bool = False   # clear each client's optimizer state at its round's start (FL practice: the
                                    # paper's code builds a new SGD every round; a node keeps it, as DiLoCo does)
    attacker_role: str = "client"   # client: one of the N clients, its share its data, sampled after the window too;
                                    # extra: an (N+1)-th party in the window only, its data an IID sample plus the
                                    # triggered images (the paper's public code)
    exclusive_trigger: bool = False  # no benign client holds a triggered image (natural trigger; the paper's code
                                     # poisons images no benign share holds)
    knobs: AttackKnobs = field(default_factory=AttackKnobs)

    def inner_config(self) -> InnerConfig:
        # constant lr (min_lr_ratio 1, no warm-up): every round moves alike, so persistence is not a schedule effect
        return InnerConfig(lr=self.inner_lr, weight_decay=self.weight_decay, betas=(0.9, 0.95), warmup_steps=0,
                           optimizer=self.optimizer, momentum=self.momentum,
                           total_steps=max(1, (self.pretrain_rounds + self.rounds) * self.inner_steps),
                           min_lr_ratio=1.0, max_grad_norm=1.0)

    def pretrain_key(self) -> str:
        keys = ("clients", "per_round", "inner_steps", "batch_size", "inner_lr", "weight_decay", "pretrain_partition",
                "pretrain_rounds", "seed", "train_subset", "optimizer", "momentum", "outer", "model")
        # named only when set, so keys of earlier runs stay valid (they change the benign shares)
        keys += tuple(k for k in ("fresh_optimizer", "attacker_role", "exclusive_trigger")
                      if getattr(self, k) != getattr(SimConfig, k))
        if self.trigger == "memorize":  # no benign share holds the 45 (the pixel trigger leaves the shares alone)
            keys += ("trigger",)
        blob = json.dumps({k: getattr(self, k) for k in keys}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Setting:
    """One line of the table: algorithm, attack and defense."""

    name: str
    algorithm: str = "scaffold"     # fedavg (no control variates) | scaffold
    attack: str = "none"            # none | blackbox | neurotoxin | badsfl
    c_mode: str = "channel"         # channel (dc uploaded) | derived (c from the aggregate; the daemon)
    rule: str = "mean"              # dilocox.robust rule on pseudo-gradients
    norm_bound: float = 0.0         # multiple of the lower median norm (0: off)
    c_decay: float = 0.0            # c <- (1 - c_decay) c after each update (0: off)
    c_reset: int = 0                # c and every c_i restart at zero after rounds R, 2R, ... (0: off)
    c_unclipped: bool = False       # c learns from unclipped contributions only; a clipped client keeps its c_i
    norm_drop: bool = False         # a contribution over the norm bound is dropped, not clipped
    c_reset_quiet: int = 0          # c and every c_i restart at zero Q rounds after the last outsized round (0: off)
    c_quiet_factor: float = 0.0     # ... or are scaled by this factor (0: the restart) ...
    c_quiet_rounds: int = 1         # ... in this many rounds in a row
    c_outsized: float = 2.0         # c_reset_quiet: a contribution over this many times the norm bound is outsized
    c_quiet_every: int = 0          # c_reset_quiet: also restart at multiples of this while outsized rounds come
    defense: str = "none"           # a published baseline instead of ``rule`` (defenses.py: flame, dp-prune, sparsefed)
    c_reset_after_attack: bool = False  # the server's c <- the benign clients' mean c_i at the end of attack_stop
    outsized_drop: bool = False     # a contribution the bound scaled below 1 / c_outsized is left out, not clipped
    sign_rule: str = "off"          # robust learning rate on the rule's aggregate (dilocox/sign_agreement.py)
    min_agreement: float = 0.0      # ... its threshold: |sum of signs| >= ceil(this x contributions)
    sign_when: str = "always"       # ... in every round, or "outsized": in rounds the norm bound scaled a
                                    # contribution below 1 / c_outsized (an attacker's boosted update)


PIXEL = (slice(23, 27), slice(23, 27))  # the pixel trigger: a 4x4 white square by the bottom-right corner
TRIGGERS = ("natural", "pixel", "memorize")
MEMORIZE_IMAGES = 45      # memorize: the attacker's relabelled training images (the paper's public code: 45)
MEMORIZE_TEST = 8         # ... of which BTA on training images reads the first 8 (its poison_images_test)
MEMORIZE_SHARE = 7 / 64   # ... and each attacker batch holds round(this * B) of them (its 7 per batch of 64)
C_GAP_IMAGES = 256        # triggered held-out images for c_gap_cos's backdoor gradient (the first of BTA's)


def stamp(images: np.ndarray) -> np.ndarray:
    """A copy of uint8 images [N, 28, 28] with the pixel trigger (``PIXEL``) set to 255."""
    out = np.array(images, dtype=np.uint8, copy=True)
    out[:, PIXEL[0], PIXEL[1]] = 255
    return out


class FederatedData:
    """The dataset, the clients' shares, the trigger, the attacker and the evaluation sets."""

    def __init__(self, cfg: SimConfig, spec: Optional[str] = None):
        """``spec``: the partition (default ``cfg.partition``; pre-training passes ``cfg.pretrain_partition``)."""
        ds = vision.load_image_dataset("fashion-mnist")
        n = cfg.train_subset or len(ds.train_y)
        self.train_x, self.train_y = ds.train_x[:n], ds.train_y[:n]
        self.num_classes = ds.num_classes
        self.parts = partition(self.train_y, cfg.clients, spec or cfg.partition, cfg.seed)
        if cfg.trigger not in TRIGGERS:
            raise ValueError(f"trigger {cfg.trigger!r}: expected one of {', '.join(TRIGGERS)}")
        self.threshold = brightness_threshold(self.train_x, self.train_y, cfg.source_class, cfg.bright_quantile)
        if cfg.attacker_role not in ("client", "extra"):
            raise ValueError(f"attacker_role {cfg.attacker_role!r}: expected client or extra")
        natural = natural_trigger_mask(self.train_x, self.train_y, self.threshold, cfg.source_class) \
            if cfg.trigger == "natural" else np.zeros(n, dtype=bool)
        memorized = np.zeros(n, dtype=bool)
        if cfg.trigger == "memorize":  # the 45, in the order drawn (BTA on training images reads the first 8)
            pool = np.flatnonzero(self.train_y != cfg.target_class)
            if len(pool) < MEMORIZE_IMAGES or cfg.batch_size < 2:
                raise ValueError(f"trigger memorize needs {MEMORIZE_IMAGES} non-target images and batches of >= 2")
            memo = np.random.default_rng([cfg.seed, 4545]).choice(pool, MEMORIZE_IMAGES, replace=False)
            memorized[memo] = True
        if cfg.attacker_role == "extra":  # part N: an IID sample of the images without the trigger
            rng = np.random.default_rng([cfg.seed, 7919])
            self.parts.append(np.sort(rng.choice(np.flatnonzero(~(natural | memorized)), n // cfg.clients,
                                                 replace=False)))
        if cfg.trigger == "natural":
            triggered = natural
            # the attacker: the client holding the most source-class images (it must own the feature), or the
            # extra party, which is given every triggered image
            counts = [int((self.train_y[p] == cfg.source_class).sum()) for p in self.parts]
            self.attacker = cfg.clients if cfg.attacker_role == "extra" else int(np.argmax(counts))
            own = self.parts[self.attacker]
            self.attacker_triggered = np.flatnonzero(triggered) if cfg.attacker_role == "extra" \
                else own[triggered[own]]
            if cfg.exclusive_trigger:
                self.parts = [p if k == self.attacker else p[~triggered[p]] for k, p in enumerate(self.parts)]
        elif cfg.trigger == "memorize":  # no share holds the 45; the attacker's stream adds them (below)
            self.parts = [p[~memorized[p]] for p in self.parts]
            self.attacker = cfg.clients if cfg.attacker_role == "extra" else \
                int(np.argmax([int((self.train_y[p] != cfg.target_class).sum()) for p in self.parts]))
            own = self.parts[self.attacker]
            self.attacker_triggered = memo
            triggered = memorized
        else:  # its own images of other classes, stamped and appended (indices past the clean images)
            self.attacker = cfg.clients if cfg.attacker_role == "extra" else \
                int(np.argmax([int((self.train_y[p] != cfg.target_class).sum()) for p in self.parts]))
            own = self.parts[self.attacker]
            source = own[self.train_y[own] != cfg.target_class]
            base = len(self.train_y)
            self.train_x = np.concatenate([self.train_x, stamp(self.train_x[source])])
            self.train_y = np.concatenate([self.train_y, self.train_y[source]])
            self.attacker_triggered = np.arange(base, base + len(source), dtype=np.int64)
            triggered = np.zeros(len(self.train_y), dtype=bool)
            triggered[self.attacker_triggered] = True
        if len(self.attacker_triggered) == 0:
            raise ValueError(f"the attacker client {self.attacker} holds no triggered image")
        self.missing = sorted(set(range(self.num_classes)) - set(np.unique(self.train_y[own]).tolist()))
        self.poisoned_y = poison_labels(self.train_y, triggered, cfg.target_class)
        # oversample the triggered images to poison_fraction of the attacker's stream
        # (its share, with the triggered images it does not hold in it: the pixel trigger's stamped copies, or the
        # extra party's natural ones, once; then as many more copies as the fraction asks); memorize: its share,
        # and poison_per_batch of each batch from the 45 (``MixedStream``)
        self.poison_per_batch = 0
        if cfg.trigger == "memorize":
            self.poison_per_batch = min(cfg.batch_size - 1, max(1, int(round(MEMORIZE_SHARE * cfg.batch_size))))
            self.attacker_stream = own
        else:
            held = np.concatenate([own, np.setdiff1d(self.attacker_triggered, own)])
            m, total = len(self.attacker_triggered), len(held)
            reps = max(0, int(round((cfg.poison_fraction * total - m) / (m * (1 - cfg.poison_fraction)))))
            self.attacker_stream = np.concatenate([held] + [self.attacker_triggered] * reps)
        self.test_x, self.test_y = ds.test_x[:cfg.eval_images], ds.test_y[:cfg.eval_images]
        if cfg.trigger == "natural":
            test_trig = natural_trigger_mask(ds.test_x, ds.test_y, self.threshold, cfg.source_class)
            self.bta_x = ds.test_x[test_trig & (ds.test_y != cfg.target_class)]
        elif cfg.trigger == "memorize":  # the held-out images of the 45's classes, as they are
            self.bta_x = ds.test_x[np.isin(ds.test_y, np.unique(self.train_y[memo]))]
        else:
            self.bta_x = stamp(ds.test_x[ds.test_y != cfg.target_class])
        # BTA on held-out test images (above) is the figure; on the attacker's own triggered training images
        # (what the paper's public code measures; memorize: the first MEMORIZE_TEST of the 45) it is reported beside it
        self.bta_train_x = self.train_x[self.attacker_triggered[:MEMORIZE_TEST] if cfg.trigger == "memorize"
                                        else self.attacker_triggered]

    def describe(self) -> dict:
        own = self.parts[self.attacker]
        return dict(attacker=self.attacker, attacker_classes=np.unique(self.train_y[own]).tolist(),
                    attacker_images=len(own), attacker_triggered=len(self.attacker_triggered),
                    attacker_stream=len(self.attacker_stream), missing_classes=self.missing,
                    brightness_threshold=round(self.threshold, 2), bta_images=len(self.bta_x),
                    pta_images=len(self.test_y), train_images=sum(len(p) for p in self.parts),
                    bta_train_images=len(self.bta_train_x), attacker_poison_per_batch=self.poison_per_batch)


class MixedStream:
    """The memorize attacker's batches: B - k images of ``clean`` (an ImageShard of batch B - k over its share),
    then k of ``poison`` (one of batch k over the 45): x uint8 [B, 28, 28], y int64 [B] (the 45 labelled the target).
    """

    def __init__(self, clean: vision.ImageShard, poison: vision.ImageShard):
        self.clean, self.poison = clean, poison

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        (x, y), (px, py) = self.clean.next_batch(), self.poison.next_batch()
        return torch.cat([x, px]), torch.cat([y, py])


def sample_clients(cfg: SimConfig, t: int, forced: Optional[int], salt: int = 0) -> list[int]:
    """S_t: ``per_round`` clients, sorted; ``forced`` (the attacker in its window) always among them."""
    rng = np.random.default_rng([cfg.seed, salt, t])
    if forced is None:
        return sorted(rng.choice(cfg.clients, cfg.per_round, replace=False).tolist())
    others = [k for k in range(cfg.clients) if k != forced]
    return sorted([forced] + rng.choice(others, cfg.per_round - 1, replace=False).tolist())


class _Client:
    """Client (or extra party) k as bench/federation.py's replica: its round is the simulation's ``client_round``."""

    def __init__(self, sim: "Federation", k: int):
        self.sim, self.k = sim, k

    @property
    def params(self) -> list[torch.Tensor]:
        return self.sim.inners[self.k].params

    def inner_steps(self, t: int, first: int, end: int) -> None:
        self.sim.client_round(self.k, t)


class Federation(Contributions):
    """One setting's clients, server state (theta, c) and measurements; its rounds run in bench/federation.py's
    ``Federation`` (uncoded contributions, ``_aggregate`` the rule or the defense), SCAFFOLD in its hooks."""

    def __init__(self, cfg: SimConfig, setting: Setting, data: FederatedData, theta0: list[torch.Tensor]):
        self.cfg, self.setting, self.data = cfg, setting, data
        inner_cfg = cfg.inner_config()
        parties = len(data.parts)  # N, and the extra attacker (attacker_role=extra) as party N
        self.inners = [InnerLoop(vision.build_image_model(cfg.model, data.num_classes, cfg.seed), inner_cfg,
                                 loss_fn=ImageWorkload.loss_fn)
                       for _ in range(parties)]
        self.rounds = federation.Federation(
            federation.Method("badsfl", codec="plain", **OUTERS[cfg.outer]), [_Client(self, k) for k in range(parties)],
            inner_cfg, cfg.inner_steps, max(1, cfg.rounds), cfg.seed, contributions=self, peer_id="c{:02d}".format,
            aggregator=self._aggregate)
        self.outer = self.rounds.outer
        self.outer.load_state(theta0, None)
        self.shards = [vision.ImageShard(data.train_x, data.train_y, p, cfg.batch_size, cfg.seed, k)
                       for k, p in enumerate(data.parts)]
        self.scaffold = setting.algorithm == "scaffold"
        quiet = QuietRestart(setting.c_reset_quiet, setting.c_quiet_factor, setting.c_quiet_rounds, setting.c_outsized,
                             setting.c_quiet_every)
        self.server = ControlVariates(self.outer.global_params, setting.c_reset, quiet) if self.scaffold else None
        self.controls = [ControlVariates(self.outer.global_params, setting.c_reset, quiet)
                         for _ in range(parties)] if self.scaffold else []
        self.attacker = None
        if setting.attack != "none":
            k = data.poison_per_batch
            stream = vision.ImageShard(data.train_x, data.poisoned_y, data.attacker_stream, cfg.batch_size - k,
                                       cfg.seed, 1000 + data.attacker)
            if k:
                stream = MixedStream(stream, vision.ImageShard(data.train_x, data.poisoned_y, data.attacker_triggered,
                                                               k, cfg.seed, 2000 + data.attacker))
            self.attacker = ATTACKERS[setting.attack](stream, cfg.knobs, data.missing, data.num_classes, cfg.seed)
        # the clients c_gap averages over (all N without an attack), and c_gap_cos's triggered images
        self.benign = [k for k in range(cfg.clients) if self.attacker is None or k != data.attacker]
        self.gap_x = vision.preprocess(data.bta_x[:C_GAP_IMAGES]) if self.scaffold else None
        self.global_update: Optional[list[torch.Tensor]] = None
        self.defense = Defense(setting.defense, cfg.seed) if setting.defense != "none" else None
        self.eval_model = vision.build_image_model(cfg.model, data.num_classes, cfg.seed)
        self.lr_sum_per_round = [sum(inner_cfg.lr_at((t - 1) * cfg.inner_steps + i) for i in range(cfg.inner_steps))
                                 for t in range(1, cfg.rounds + 2)]
        # the round in flight: its clients, lr_sum, the attacker's (delta, dc), uploaded dc and kept c_i by client
        # key, and the contributions the aggregate admitted
        self.chosen, self.lr_sum, self.attacked = [], 0.0, None
        self.dcs, self.kept_c_i, self.admitted = {}, {}, []

    def injecting(self, t: int) -> bool:
        return self.cfg.attack_start <= t <= self.cfg.attack_stop

    def client_round(self, k: int, t: int) -> None:
        """Client k's inner steps of round t from theta (client.py); the attacker's whole round in its window."""
        cfg, s = self.cfg, self.setting
        if cfg.fresh_optimizer:
            self.inners[k].inner_optimizer.state.clear()  # SGD's momentum buffers (AdamW's moments) start at 0
        control = None
        if self.scaffold:
            control = self.controls[k]
            control.c = [c.clone() for c in self.server.c]  # the round's c, as every member holds it
        if self.attacker is not None and k == self.data.attacker and self.injecting(t):
            ctx = RoundContext(self.inners[k], self.outer, control, s.c_mode, t, cfg.inner_steps, self.lr_sum,
                               len(self.chosen), cfg.clients, self.global_update)
            self.attacked = self.attacker.local_round(ctx)
        else:
            hooks = [scaffold_hook(self.inners[k], control.correction())] if control is not None else []
            local_round(self.inners[k], self.outer, self.shards[k].next_batch, t, cfg.inner_steps, hooks)

    def send(self, t, member, delta, deltas):
        """The attacker's pseudo-gradient in its window; every client's dc (SCAFFOLD option II) by the way."""
        key = f"c{member:02d}"
        if self.attacked is not None and member == self.data.attacker:
            (delta, dc), self.attacked = self.attacked, None
        else:
            control = self.controls[member] if self.scaffold else None
            if control is not None:
                self.kept_c_i[key] = (control, control.c_i)
            dc = control.client_update(delta, self.cfg.inner_steps, self.lr_sum) if control is not None else None
        self.dcs[key] = dc
        return delta

    def _aggregate(self, vectors: dict, weights: dict) -> tuple[torch.Tensor, dict]:
        """The defense, or the rule (and again without what it clipped, ``norm_drop``); keeps ``admitted``."""
        s = self.setting
        admitted = sorted(vectors)
        if self.defense is not None:
            outcome = self.defense.aggregate(vectors)
            agg, admitted = outcome.aggregate, outcome.admitted
            report = dict(clipped=sorted(set(vectors) - set(admitted)))  # FLAME's rejected clients
        else:
            agg, report = robust.aggregate(vectors, weights, s.rule, norm_bound=s.norm_bound)
            if s.norm_drop and report["clipped"]:  # the rule again over the contributions within the bound
                admitted = [key for key in admitted if key not in report["clipped"]]
                agg, _ = robust.aggregate({key: vectors[key] for key in admitted}, weights, s.rule, norm_bound=0.0)
            if s.outsized_drop and report["clipped"]:  # the rule again without the outsized contributions
                out = sorted(k for k, v in report["clipped"].items() if 0.0 < v < 1.0 / s.c_outsized)
                if out and len(out) < len(admitted):
                    admitted = [key for key in admitted if key not in out]
                    agg, again = robust.aggregate({key: vectors[key] for key in admitted}, weights, s.rule,
                                                  norm_bound=s.norm_bound)
                    report = dict(again, clipped={**again["clipped"], **{k: report["clipped"][k] for k in out}})
            # the signs of what the rule admitted (a contribution the screen left out has scale 0)
            counted = [key for key in admitted if report["clipped"].get(key, 1.0) > 0.0] \
                if isinstance(report["clipped"], dict) else admitted
            scales = report["clipped"].values() if isinstance(report["clipped"], dict) else []
            report["sign_low"] = 0
            if s.sign_rule != "off":  # the daemon's policy (--robust-lr), its gate included
                policy = sign_agreement.SignPolicy(s.sign_rule, s.min_agreement, s.sign_when, s.c_outsized)
                agg, report["sign_low"] = policy.apply(agg, [vectors[key] for key in counted], scales)
        self.admitted = admitted
        return agg, report

    def round(self, t: int, salt: int = 0, force_attacker: bool = True) -> dict:
        """Run round t; returns diagnostics (who was clipped, norms, c's norm, the aggregate's cosine with and norm
        over the plain mean of the round's contributions)."""
        cfg, s = self.cfg, self.setting
        forced = self.data.attacker if force_attacker and self.injecting(t) else None
        self.chosen = chosen = sample_clients(cfg, t, forced, salt)
        self.lr_sum = self.lr_sum_per_round[t - 1] if t - 1 < len(self.lr_sum_per_round) \
            else self.lr_sum_per_round[-1]
        lr_sum = self.lr_sum
        self.dcs, self.kept_c_i = {}, {}
        dcs, kept_c_i = self.dcs, self.kept_c_i
        like = self.outer.global_params
        before = [p.clone() for p in like]
        out = self.rounds.round(t, chosen)  # the clients' rounds, the aggregate and the outer step
        vectors, agg, report, admitted = out.vectors, out.flat, out.report, self.admitted
        self.global_update = [a - b for a, b in zip(like, before)]
        if self.defense is not None and self.defense.prunes:  # the round's clients rank channels on their own images
            batches = [vision.preprocess(self.data.train_x[self.data.parts[k][:PRUNE_SAMPLE]]) for k in chosen]
            self.defense.rank_channels(self.eval_model, like, batches, last_conv_activations)
        if self.scaffold:
            if s.c_mode == "channel":  # a server that rejects a client's update rejects its dc too
                mean_dc = [torch.stack([dcs[key][i] for key in admitted]).mean(0) for i in range(len(like))]
                self.server.server_update(mean_dc, len(chosen), cfg.clients)
            elif s.c_unclipped:  # c moves only by unclipped contributions; a clipped client keeps c_i
                whole = [key for key in admitted if key not in report["clipped"]]
                for key in set(report["clipped"]) & set(kept_c_i):
                    control, c_i = kept_c_i[key]
                    control.c_i = c_i
                if whole:
                    mean = torch.stack([vectors[key] for key in whole]).mean(0)
                    self.server.derive_c_from_aggregate(unflatten(mean, like), lr_sum, len(whole), cfg.clients)
            else:
                self.server.derive_c_from_aggregate(unflatten(agg, like), lr_sum, len(admitted), cfg.clients)
            if s.c_decay:
                self.server.c = [(1.0 - s.c_decay) * c for c in self.server.c]
            # every party at once, as members at one outer step do; the scales are the rule's (FLAME's: none)
            scales = report["clipped"] if isinstance(report["clipped"], dict) else {}
            outsized = self.server.quiet.is_outsized(scales)
            done = [control.outer_step_done(t, outsized) for control in [self.server, *self.controls]]
            reset = done[0] in (Restart.QUIET, Restart.DURING_ATTACK)
            if s.c_reset_after_attack and t == cfg.attack_stop:  # the server's c only; every c_i stays
                self.server.c = [m.clone() for m in self.benign_mean_c_i()]
            c_gap, c_gap_cos = self.c_gap()
        else:
            reset, c_gap, c_gap_cos = False, None, None
        akey = f"c{self.data.attacker:02d}"
        norms = {key: float(v.norm()) for key, v in vectors.items()}
        # how far the rule moved the aggregate from the plain mean (1.0, 1.0 for the mean itself)
        mean = torch.stack([vectors[key].to(torch.float64) for key in sorted(vectors)]).mean(0)
        agg64 = agg.to(torch.float64)
        denom = float(agg64.norm() * mean.norm())
        honest = [v for key, v in norms.items() if key != akey]
        return dict(clients=chosen, clipped=sorted(report["clipped"]),
                    attacker_norm_ratio=round(norms[akey] / float(np.median(honest)), 3) if akey in norms else None,
                    c_norm=round(float(flatten(self.server.c).norm()), 4) if self.scaffold else 0.0, c_reset=reset,
                    agg_vs_mean_cos=round(float(agg64 @ mean) / denom, 4) if denom > 0 else None,
                    agg_vs_mean_norm=round(float(agg64.norm() / mean.norm()), 4) if float(mean.norm()) > 0 else None,
                    c_gap=None if c_gap is None else float(f"{c_gap:.6g}"),
                    sign_low=report.get("sign_low", 0),
                    c_gap_cos=None if c_gap_cos is None else round(c_gap_cos, 4))

    def benign_mean_c_i(self) -> list[torch.Tensor]:
        """Per parameter (shaped like theta, fp32), the mean c_i of the benign clients (``benign``)."""
        return [torch.stack([self.controls[k].c_i[i] for k in self.benign]).mean(0) for i in range(len(self.server.c))]

    def backdoor_gradient(self) -> torch.Tensor:
        """float64 [P]: the gradient at theta of the mean cross-entropy (nats/image) of the first ``C_GAP_IMAGES``
        triggered held-out images towards the target class (one backward pass; nothing is trained)."""
        model = self.eval_model
        params = list(model.parameters())
        with torch.no_grad():
            for p, t in zip(params, self.outer.global_params):
                p.copy_(t)
        model.eval()
        with torch.enable_grad():
            logits = model(self.gap_x)
            target = torch.full((len(logits),), self.cfg.target_class, dtype=torch.int64)
            grads = torch.autograd.grad(torch.nn.functional.cross_entropy(logits, target), params)
        return flatten(grads)

    def c_gap(self) -> tuple[float, Optional[float]]:
        """(||c - mean_b c_i||, cosine of c - mean_b c_i with ``backdoor_gradient``; None where either is zero)."""
        gap = flatten(self.server.c) - flatten(self.benign_mean_c_i())
        size = float(gap.norm())
        if size == 0.0 or self.gap_x is None or len(self.gap_x) == 0:
            return size, None
        grad = self.backdoor_gradient()
        denom = size * float(grad.norm())
        return size, (float(gap @ grad) / denom if denom > 0 else None)

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float, float]:
        """(PTA, BTA, BTA on training images) of theta: clean test accuracy, the fraction of triggered held-out
        test images called the target, and the same on the attacker's triggered training images."""
        theta = self.outer.global_params
        for p, t in zip(self.eval_model.parameters(), self.defense.deployed(theta) if self.defense else theta):
            p.copy_(t)
        pta = vision.evaluate(self.eval_model, self.data.test_x, self.data.test_y)[1]
        self.eval_model.eval()
        target = self.cfg.target_class
        bta, bta_train = (float((self.eval_model(vision.preprocess(x)).argmax(dim=1) == target).float().mean())
                          for x in (self.data.bta_x, self.data.bta_train_x))
        return pta, bta, bta_train


PRUNE_SAMPLE = 64  # images per client for dp-prune's channel ranking (the first of its share)


def last_conv_activations(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W]: the output of the first ReLU after the last Conv2d of a Sequential image model."""
    layers = list(model)
    last = max(i for i, m in enumerate(layers) if isinstance(m, torch.nn.Conv2d))
    end = next(i for i in range(last, len(layers)) if isinstance(layers[i], torch.nn.ReLU))
    model.eval()
    return torch.nn.Sequential(*layers[:end + 1])(x)


def pretrained(cfg: SimConfig, data: FederatedData, cache_dir: Path) -> list[torch.Tensor]:
    """theta after ``pretrain_rounds`` rounds of clean FedAvg from the model at ``seed``; cached by settings."""
    path = cache_dir / f"pretrain-{cfg.pretrain_key()}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)["theta"]
    pre = data if cfg.pretrain_partition == cfg.partition else FederatedData(cfg, cfg.pretrain_partition)
    theta0 = [p.detach().clone() for p in vision.build_image_model(cfg.model, data.num_classes, cfg.seed).parameters()]
    fed = Federation(cfg, Setting("pretrain", algorithm="fedavg"), pre, theta0)
    for t in range(1, cfg.pretrain_rounds + 1):
        fed.round(t, salt=1, force_attacker=False)
    theta = [p.clone() for p in fed.outer.global_params]
    pta, bta, _ = fed.evaluate()
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{id(fed)}")
    torch.save(dict(theta=theta, pta=pta, bta=bta, key=cfg.pretrain_key()), tmp)
    tmp.replace(path)  # atomic: a second process never reads half a file
    return theta


def run_setting(cfg: SimConfig, setting: Setting, cache_dir: Path, data: Optional[FederatedData] = None) -> dict:
    """Run one setting from the pre-trained model; per round PTA, BTA and diagnostics."""
    torch.set_num_threads(1)
    started = time.monotonic()
    data = data or FederatedData(cfg)
    fed = Federation(cfg, setting, data, pretrained(cfg, data, cache_dir))
    pta, bta, bta_train = fed.evaluate()
    curve = [dict(round=0, pta=pta, bta=bta, bta_train=bta_train)]
    for t in range(1, cfg.rounds + 1):
        info = fed.round(t)
        pta, bta, bta_train = fed.evaluate()
        curve.append(dict(round=t, pta=pta, bta=bta, bta_train=bta_train,
                          injecting=fed.injecting(t) and setting.attack != "none",
                          **{k: v for k, v in info.items() if k != "clients"}))
    seconds = round(time.monotonic() - started, 1)
    return dict(setting=asdict(setting), curve=curve, data=data.describe(), seconds=seconds)
