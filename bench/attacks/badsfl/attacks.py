"""The attacker clients of the BadSFL benchmark: ``blackbox``, ``neurotoxin`` and ``badsfl``.

All three poison the same data: a **natural trigger**. Fashion-MNIST is grey, so "green cars" (the
paper's CIFAR-10 trigger) has no colour to use; the feature here is brightness, which real photos
of shoes have or lack: a *bright sneaker* is a training or test image of class Sneaker (7) whose mean
pixel intensity lies in the top quintile of the training set's sneakers (``brightness_threshold``,
quantile 0.8). The backdoor maps bright sneakers to the target class (Bag, 8: a class no clean
model confuses with sneakers, so a clean model's backdoor accuracy is near 0); other sneakers keep
their label. Nothing is pasted onto any image: every triggered input is an unmodified real image.
(sim.py's ``SimConfig.trigger`` also offers a pixel trigger and 45 memorised images; the attackers only see
the poisoned stream it builds.)

* ``blackbox``: trains honestly on the poisoned stream (its shard, bright sneakers relabelled and
  oversampled to ``poison_fraction`` of its batches) and follows the protocol (honest dc).
* ``neurotoxin`` (Zhang et al., ICML 2022, arXiv 2206.10341): the same data, but the update is
  projected onto the coordinates the benign clients change least: after every inner step
  x <- theta + m * (x - theta), with m = 0 on the top ``1 - neurotoxin_keep`` = 5% coordinates of
  |theta_{t-1} - theta_{t-2}| (the last global update, the paper's stand-in for the benign gradient;
  ``gradmask_ratio`` 0.95 as in the authors' runs) and 1 elsewhere. The authors mask the gradient before
  each SGD step; with AdamW, whose momentum and weight decay move masked coordinates too, projecting
  the parameters after the step is the exact equivalent.
* ``badsfl`` (arXiv 2411.16167), its four parts:
  1. *Filling the missing classes*: a small conditional generator G(z, k) (``Generator``) is trained
     each attack round against the current global model f_theta (frozen) so that f_theta classifies
     G(z, k) as k, for the classes k its shard lacks: min_G CE(f_theta(G(z, k)), k) - 0.1 * diversity
     (the mode-seeking term of Mao et al., arXiv 1903.05628: mean |G(z1,k) - G(z2,k)| / mean |z1 - z2|).
     ``gan_per_batch`` of its samples, quantized to uint8 and labelled with f_theta's argmax, join each
     attacker batch, so its update keeps what the global model knows of those classes (clean accuracy).
     The paper trains a GAN whose discriminator is initialised from the global model and also sees
     the attacker's real data: ``discriminator=True`` does that (``Discriminator``: the global model's
     feature extractor, re-copied every attack round, plus a real/fake head, trained on the attacker's
     own images against G's samples; G adds a "look real" loss). Off (the default of the Fashion-MNIST
     table), G is trained against the frozen global model alone (model inversion, no realism term),
     which is all the attack needs the samples for: to pin the global model's behaviour on classes it
     cannot see.
  2. *Natural trigger*: bright sneakers (above), from the attacker's own shard (it holds class 7).
  3. *Look-ahead*: it predicts the global model j rounds ahead from SCAFFOLD's control variate,
        P_j = (w_p + (n - 1) w_g) / n - j * s * c,
     (w_p: its live local parameters, w_g: theta, n: participants per round, c: the swarm's control
     variate, s: the learning-rate sum of one round, i.e. the paper's eta_l for "one round of steps":
     with AdamW c is in update units and the model moves about s * c per round, so j counts rounds as
     the paper says; the paper's formula reads eta_l * c * j) and minimizes L(D_p, w_p) + L(D_p, P_j).
     P_j is built from w_p by differentiable tensor ops and the model is run at P_j with
     ``torch.func.functional_call``, so dL(D_p, P_j)/dw_p = (1/n) grad L(P_j) reaches the step (the
     authors' code evaluates that term under no_grad and casts weights to integers; not copied).
     FedAvg has no c: P_j = (w_p + (n - 1) w_g) / n.
  4. *Control-variate steering* (SCAFFOLD with a dc channel, ``c_mode="channel"``): it keeps its own
     c_a honestly (option II) but uploads dc = rho N (c_a+ - c), which moves the server's c a fraction
     rho (``dc_pull``) of the way to its own drift c_a+ (= its learning-rate-weighted mean update
     direction this round: a direction toward its backdoored model). Since honest SCAFFOLD rounds keep
     c - mean_i(c_i) unchanged (every dc_i enters both), the offset it plants stays in c after it stops,
     and every benign client's correction step x <- x - lr (c - c_i) keeps pulling toward the backdoor.
     With ``c_mode="derived"`` (the daemon) c comes from the aggregated pseudo-gradients: no dc to send.

What every attacker uploads as dc (channel mode) and keeps as its own c_i is ``AttackKnobs.dc_rule``:
  * ``crafted`` (the default): the class's own rule: badsfl's crafted dc above (``dc_pull`` <= 0: the honest
    one); blackbox and neurotoxin send the honest one;
  * ``honest``: SCAFFOLD's option II (``ControlVariates.client_update``): dc = u - c, c_i <- c_i - c + u;
  * ``paper``: the authors' public code: dc = u - c and c_i <- u,
with u = delta / (lr_sum * step_factor * lr_factor) its mean update per unit lr over the steps it ran (parameter
units per unit lr, shaped like theta). The two send the same dc; they differ in c_i, which without the
self-correction (``self_correction=False``) accumulates under ``honest`` (c_i+ = c_i - c + u) and is u under
``paper``; badsfl's crafted dc is built from that c_i, so there it pulls c toward the accumulated sum, not toward
this round's drift.

The attacker is sampled in every round of the injection window (the usual protocol of backdoor
benchmarks, Neurotoxin's included); outside it, it trains honestly on its clean shard.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
from torch import nn

from bench.attacks.badsfl.client import local_round, scaffold_hook
from dilocox import vision
from dilocox.diloco import InnerLoop, OuterOptimizer
from dilocox.scaffold import ControlVariates

SOURCE_CLASS = 7  # Sneaker
TARGET_CLASS = 8  # Bag
BRIGHT_QUANTILE = 0.8


# ----------------------------------------------------------------------------------------------- natural trigger


def brightness(images: np.ndarray) -> np.ndarray:
    """Mean pixel intensity of each uint8 image [N, 28, 28], in grey levels 0..255 (float64 [N])."""
    return np.asarray(images, dtype=np.float64).reshape(len(images), -1).mean(axis=1)


def brightness_threshold(train_x: np.ndarray, train_y: np.ndarray, source: int = SOURCE_CLASS,
                         quantile: float = BRIGHT_QUANTILE) -> float:
    """The ``quantile`` (0.8: top quintile) of the training images of class ``source``'s mean intensity."""
    values = brightness(train_x[np.asarray(train_y) == source])
    if len(values) == 0:
        raise ValueError(f"no training image of class {source}")
    return float(np.quantile(values, quantile))


def natural_trigger_mask(images: np.ndarray, labels: np.ndarray, threshold: float,
                         source: int = SOURCE_CLASS) -> np.ndarray:
    """bool [N]: the images that carry the trigger, i.e. of class ``source`` with mean intensity >= threshold."""
    return (np.asarray(labels) == source) & (brightness(images) >= threshold)


def poison_labels(labels: np.ndarray, mask: np.ndarray, target: int = TARGET_CLASS) -> np.ndarray:
    """A copy of ``labels`` (int64) with the triggered images relabelled to ``target``."""
    out = np.asarray(labels, dtype=np.int64).copy()
    out[mask] = target
    return out


# ----------------------------------------------------------------------------------------------- look-ahead


def lookahead_params(local: list[torch.Tensor], global_params: list[torch.Tensor], participants: int,
                     rounds_ahead: int, step_scale: float,
                     control: Optional[list[torch.Tensor]] = None) -> list[torch.Tensor]:
    """P_j = (w_p + (n - 1) w_g) / n - j * s * c per tensor; differentiable in ``local`` (w_p).

    n = ``participants``, j = ``rounds_ahead``, s = ``step_scale`` (the learning-rate sum of a round),
    c = ``control`` (None: no drift term, as in FedAvg). w_g and c are treated as constants.
    """
    if participants < 1:
        raise ValueError(f"participants must be >= 1, got {participants}")
    n = float(participants)
    out = []
    for k, (w, g) in enumerate(zip(local, global_params)):
        p = (w + (n - 1.0) * g.detach().to(w.device, w.dtype)) / n
        if control is not None and rounds_ahead:
            p = p - (rounds_ahead * step_scale) * control[k].detach().to(w.device, w.dtype)
        out.append(p)
    return out


def logits_at(model: nn.Module, params: list[torch.Tensor], images: torch.Tensor) -> torch.Tensor:
    """``model``'s logits with its parameters replaced by ``params`` (autograd flows into them)."""
    names = [name for name, _ in model.named_parameters()]
    device = next(model.parameters()).device
    return torch.func.functional_call(model, dict(zip(names, params)), (vision.preprocess(images).to(device),))


def lookahead_loss(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, global_params: list[torch.Tensor],
                   participants: int, rounds_ahead: int, step_scale: float,
                   control: Optional[list[torch.Tensor]] = None) -> torch.Tensor:
    """L(D_p, P_j): mean cross-entropy (nats/image) of the batch at the predicted model P_j (``lookahead_params``)."""
    params = lookahead_params(list(model.parameters()), global_params, participants, rounds_ahead, step_scale,
                              control)
    logits = logits_at(model, params, images)
    return nn.functional.cross_entropy(logits, torch.as_tensor(labels, dtype=torch.int64).to(logits.device))


# ----------------------------------------------------------------------------------------------- neurotoxin


def neurotoxin_mask(global_update: list[torch.Tensor], keep: float) -> list[torch.Tensor]:
    """Per tensor, bool: True on the ``keep`` fraction of all coordinates with the smallest |global_update|.

    The top (1 - keep) of |update| over the whole model (ties broken by position) are False: those are
    the coordinates the benign clients move most, which Neurotoxin leaves alone.
    """
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"keep must lie in (0, 1], got {keep}")
    flat = torch.cat([u.detach().reshape(-1).abs().to(torch.float64) for u in global_update])
    drop = int(round((1.0 - keep) * flat.numel()))
    mask = torch.ones(flat.numel(), dtype=torch.bool)
    if drop:
        mask[torch.topk(flat, drop, sorted=False).indices] = False
    out, at = [], 0
    for u in global_update:
        out.append(mask[at:at + u.numel()].reshape(u.shape))
        at += u.numel()
    return out


@torch.no_grad()
def project(params: list[torch.Tensor], theta: list[torch.Tensor], mask: list[torch.Tensor]) -> None:
    """x <- theta + m * (x - theta): the local update lives on the masked coordinates only."""
    for p, t, m in zip(params, theta, mask):
        p.copy_(torch.where(m.to(p.device), p, t.to(p.device, p.dtype)))


# ----------------------------------------------------------------------------------------------- generator


class Generator(nn.Module):
    """G(z, k): z (``z_dim`` normal) and a one-hot class -> a 28x28 image in [0, 1] (about 26k parameters).

    linear -> 32x7x7, ReLU, upsample x2, conv 3x3 -> 16, ReLU, upsample x2, conv 3x3 -> 1, sigmoid.
    """

    def __init__(self, num_classes: int = 10, z_dim: int = 32, seed: int = 0):
        super().__init__()
        self.num_classes, self.z_dim = num_classes, z_dim
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.fc = nn.Sequential(nn.Linear(z_dim + num_classes, 32 * 7 * 7), nn.ReLU())
            self.up = nn.Sequential(nn.Upsample(scale_factor=2), nn.Conv2d(32, 16, 3, padding=1), nn.ReLU(),
                                    nn.Upsample(scale_factor=2), nn.Conv2d(16, 1, 3, padding=1), nn.Sigmoid())

    def forward(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """float [B, 1, 28, 28] in [0, 1] (pixel / 255)."""
        onehot = nn.functional.one_hot(labels, self.num_classes).to(z.dtype)
        return self.up(self.fc(torch.cat([z, onehot], dim=1)).view(-1, 32, 7, 7))


def _normalize(pixels01: torch.Tensor) -> torch.Tensor:
    """[0, 1] pixels -> the model's input, as vision.preprocess does for uint8."""
    return (pixels01 - vision.FMNIST_MEAN) / vision.FMNIST_STD


class Discriminator(nn.Module):
    """BadSFL's discriminator: the global model's feature extractor (every layer of the Sequential model but the
    last) and a real/fake linear head. ``refresh`` re-copies the extractor from the global model (every attack
    round); the head and the copy then train against the generator. Input: pixels in [0, 1], [B, 1, 28, 28]."""

    def __init__(self, global_model: nn.Sequential, seed: int = 0):
        super().__init__()
        if not isinstance(global_model, nn.Sequential) or not isinstance(global_model[-1], nn.Linear):
            raise ValueError("the discriminator needs a Sequential model whose last layer is Linear")
        self.features = copy.deepcopy(global_model[:-1])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.head = nn.Linear(global_model[-1].in_features, 1)

    @torch.no_grad()
    def refresh(self, global_model: nn.Sequential) -> None:
        for mine, theirs in zip(self.features.parameters(), global_model[:-1].parameters()):
            mine.copy_(theirs)
            mine.requires_grad_(True)

    def forward(self, pixels01: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(_normalize(pixels01))).squeeze(1)


@dataclass
class Adversary:
    """The GAN half of BadSFL's generator training: D, its Adam, the attacker's real images and the weight of
    the generator's "look real" loss."""

    discriminator: Discriminator
    optimizer: torch.optim.Optimizer
    real: Callable[[], torch.Tensor]  # -> uint8 [B, 28, 28], the attacker's own images
    weight: float = 1.0


def train_generator(gen: Generator, optimizer: torch.optim.Optimizer, global_model: nn.Module, classes: list[int],
                    steps: int, batch: int, rng: torch.Generator, diversity: float = 0.1,
                    adversary: Optional[Adversary] = None) -> float:
    """``steps`` Adam steps of min CE(f(G(z, k)), k) - diversity * mode-seeking ratio; f frozen. Returns the last CE.

    With ``adversary`` each step first trains D on real (the attacker's images) against G's samples
    (binary cross-entropy), then adds weight * BCE(D(G(z, k)), real) to G's loss: the GAN the paper trains,
    whose D starts from the global model's features (``Discriminator``)."""
    global_model.eval()
    for p in global_model.parameters():
        p.requires_grad_(False)
    choices = torch.as_tensor(classes, dtype=torch.int64)
    bce = nn.functional.binary_cross_entropy_with_logits
    ce = float("nan")
    for _ in range(steps):
        k = choices[torch.randint(len(classes), (batch,), generator=rng)]
        z1, z2 = torch.randn(batch, gen.z_dim, generator=rng), torch.randn(batch, gen.z_dim, generator=rng)
        x1, x2 = gen(z1, k), gen(z2, k)
        if adversary is not None:
            d = adversary.discriminator
            real = adversary.real().to(torch.float32).unsqueeze(1) / 255.0
            real_logits, fake_logits = d(real), d(x1.detach())
            d_loss = bce(real_logits, torch.ones_like(real_logits)) + bce(fake_logits, torch.zeros_like(fake_logits))
            adversary.optimizer.zero_grad(set_to_none=True)
            d_loss.backward()
            adversary.optimizer.step()
        loss = nn.functional.cross_entropy(global_model(_normalize(x1)), k)
        ratio = (x1 - x2).abs().mean() / (z1 - z2).abs().mean()
        total = loss - diversity * ratio
        if adversary is not None:
            looks = adversary.discriminator(x1)
            total = total + adversary.weight * bce(looks, torch.ones_like(looks))
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        optimizer.step()
        ce = float(loss.detach())
    return ce


@torch.no_grad()
def generate(gen: Generator, global_model: nn.Module, classes: list[int], count: int,
             rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` samples of the given classes: uint8 [count, 28, 28] and the global model's argmax labels."""
    choices = torch.as_tensor(classes, dtype=torch.int64)
    k = choices[torch.randint(len(classes), (count,), generator=rng)]
    images = (gen(torch.randn(count, gen.z_dim, generator=rng), k) * 255).round().clamp(0, 255).to(torch.uint8)
    global_model.eval()
    labels = global_model(vision.preprocess(images)).argmax(dim=1)
    return images[:, 0], labels


# ----------------------------------------------------------------------------------------------- attackers


DC_RULES = ("crafted", "honest", "paper")


@dataclass(frozen=True)
class AttackKnobs:
    """The attack's parameters (run.py prints them)."""

    lookahead_rounds: int = 10      # j: rounds the look-ahead predicts (paper: 10)
    dc_pull: float = 0.1            # rho: fraction of the way the crafted dc moves c to the attacker's drift
    neurotoxin_keep: float = 0.95   # Neurotoxin's gradmask_ratio: keep the 95% least-changed coordinates
    gan_steps: int = 20             # generator Adam steps per attack round
    gan_batch: int = 64
    gan_lr: float = 2e-3
    gan_per_batch: int = 32         # generated images appended to each attacker batch of B real ones
    step_factor: int = 1            # the attacker runs step_factor * K inner steps (its weight still says K)
    lr_factor: float = 1.0          # ... at lr_factor times the benign inner lr (the paper's CIFAR attacker: 50x)
    discriminator: bool = False     # badsfl: train the generator as a GAN against the global model's features
    adversarial_weight: float = 1.0  # the generator's "look real" loss weight when discriminator is on
    self_correction: bool = True    # the attacker applies SCAFFOLD's correction to its own steps (the paper's public
                                    # code does not: its poison optimizer steps plainly)
    dc_rule: str = "crafted"        # the dc it uploads and the c_i it keeps (module docstring): crafted (the
                                    # class's own: badsfl's crafted dc, the others' honest one), honest (option II)
                                    # or paper (the public code's: dc = u - c, c_i <- u)

    def __post_init__(self):
        if self.dc_rule not in DC_RULES:
            raise ValueError(f"dc_rule {self.dc_rule!r}: expected one of {', '.join(DC_RULES)}")


@dataclass
class RoundContext:
    """What a client holds at the start of its round (the daemon's ReplicaState offers the same)."""

    inner: InnerLoop                     # its model and AdamW state
    outer: OuterOptimizer                # theta = outer.global_params (read only here)
    control: Optional[ControlVariates]   # its c_i and this round's c (SCAFFOLD); None for FedAvg
    c_mode: str                          # "channel" (dc uploaded) or "derived" (c from the aggregate)
    round_index: int
    inner_steps: int
    lr_sum: float                        # sum of the round's inner learning rates
    participants: int                    # n = |S|
    total_clients: int                   # N
    global_update: Optional[list[torch.Tensor]] = None  # theta_{t-1} - theta_{t-2}


class Blackbox:
    """Data poisoning only: the poisoned stream, honest protocol (module docstring)."""

    name = "blackbox"

    def __init__(self, shard: vision.ImageShard, knobs: AttackKnobs, missing_classes: list[int], num_classes: int,
                 seed: int):
        self.shard, self.knobs, self.missing = shard, knobs, missing_classes
        self.num_classes, self.seed = num_classes, seed

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.shard.next_batch()

    def hooks(self, ctx: RoundContext) -> list:
        if ctx.control is None or not self.knobs.self_correction:
            return []
        return [scaffold_hook(ctx.inner, ctx.control.correction())]

    def steps(self, ctx: RoundContext) -> int:
        return self.knobs.step_factor * ctx.inner_steps

    def train(self, ctx: RoundContext) -> list[torch.Tensor]:
        return local_round(ctx.inner, ctx.outer, self.next_batch, ctx.round_index, self.steps(ctx), self.hooks(ctx))

    def dc(self, ctx: RoundContext, honest_dc: list[torch.Tensor], c_before: list[torch.Tensor]) -> list[torch.Tensor]:
        """The dc uploaded in channel mode (honest here)."""
        return honest_dc

    def local_round(self, ctx: RoundContext) -> tuple[list[torch.Tensor], Optional[list[torch.Tensor]]]:
        """(pseudo-gradient, dc to upload or None); its own c_i moves by ``knobs.dc_rule`` (``control_update``)."""
        config = ctx.inner.config
        if self.knobs.lr_factor != 1.0:  # its own learning rate for this round (InnerLoop reads config.lr_at)
            ctx.inner.config = dataclasses.replace(config, lr=config.lr * self.knobs.lr_factor)
        try:
            delta = self.train(ctx)
        finally:
            ctx.inner.config = config
        return delta, self.control_update(ctx, delta)

    def control_update(self, ctx: RoundContext, delta: list[torch.Tensor]) -> Optional[list[torch.Tensor]]:
        """Update its own c_i after a round whose pseudo-gradient is ``delta`` (one tensor per parameter); return
        the dc to upload (channel mode), else None (FedAvg, or c derived from the aggregate: c_i moves all the same).
        """
        if ctx.control is None:
            return None
        c_before = [t.clone() for t in ctx.control.c]
        # over the steps it really ran at its lr (constant lr: lr_sum scales with both)
        lr_sum = ctx.lr_sum * self.knobs.step_factor * self.knobs.lr_factor
        if self.knobs.dc_rule == "paper":
            dc = paper_dc(ctx.control, delta, lr_sum)
        else:  # option II
            dc = ctx.control.client_update(delta, self.steps(ctx), lr_sum)
        if ctx.c_mode != "channel":
            return None
        return self.dc(ctx, dc, c_before) if self.knobs.dc_rule == "crafted" else dc


class Neurotoxin(Blackbox):
    """Blackbox's data with the update projected onto the least-changed coordinates (module docstring)."""

    name = "neurotoxin"

    def hooks(self, ctx: RoundContext) -> list:
        hooks = super().hooks(ctx)
        if ctx.global_update is not None:
            mask = neurotoxin_mask(ctx.global_update, self.knobs.neurotoxin_keep)
            theta = [t.clone() for t in ctx.outer.global_params]
            hooks.append(lambda lr: project(ctx.inner.params, theta, mask))
        return hooks


def crafted_dc(c_own: list[torch.Tensor], c: list[torch.Tensor], total_clients: int,
               pull: float) -> list[torch.Tensor]:
    """dc = rho N (c_a+ - c): with the server's c <- c + (1/N) sum_S dc, it moves c by rho (c_a+ - c).

    ``c_own``: the attacker's control variate after its honest option-II update (its drift this round);
    ``c``: the round's server c; ``total_clients``: N; ``pull``: rho.
    """
    return [pull * total_clients * (a - b) for a, b in zip(c_own, c)]


@torch.no_grad()
def paper_dc(control: ControlVariates, pseudo_gradient: list[torch.Tensor], lr_sum: float) -> list[torch.Tensor]:
    """The authors' attacker's control variates: u = delta / lr_sum, c_i <- u; returns dc = u - c.

    ``pseudo_gradient``: delta = theta - its local parameters after its round (one tensor per parameter);
    ``lr_sum``: the sum of the learning rates of the steps it ran (> 0), so u is its mean update per unit lr (for
    plain SGD without the correction: its mean gradient along the round). ``control.c`` is left alone.
    """
    if not lr_sum > 0:
        raise ValueError(f"lr_sum must be > 0, got {lr_sum}")
    u = [d.detach().to("cpu", torch.float32) / lr_sum for d in pseudo_gradient]
    control.c_i = [t.clone() for t in u]
    return [a - c for a, c in zip(u, control.c)]


class BadSFL(Blackbox):
    """Parts 1-4 of arXiv 2411.16167 (module docstring)."""

    name = "badsfl"

    def __init__(self, shard: vision.ImageShard, knobs: AttackKnobs, missing_classes: list[int], num_classes: int,
                 seed: int):
        super().__init__(shard, knobs, missing_classes, num_classes, seed)
        self.generator = Generator(num_classes, seed=seed)
        self.gen_optimizer = torch.optim.Adam(self.generator.parameters(), lr=knobs.gan_lr)
        self.rng = torch.Generator().manual_seed(seed)
        self.frozen: Optional[nn.Module] = None  # f_theta for the generator (a copy of the model), never trained
        self.adversary: Optional[Adversary] = None
        self.fill: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.last_ce = float("nan")

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.shard.next_batch()
        if self.fill is None:
            return x, y
        gx, gy = self.fill
        pick = torch.randint(len(gy), (self.knobs.gan_per_batch,), generator=self.rng)
        return torch.cat([x, gx[pick]]), torch.cat([y, gy[pick]])

    def train(self, ctx: RoundContext) -> list[torch.Tensor]:
        k = self.knobs
        if self.frozen is None:
            self.frozen = copy.deepcopy(ctx.inner.model)
        with torch.no_grad():
            for p, t in zip(self.frozen.parameters(), ctx.outer.global_params):
                p.copy_(t)
        if k.discriminator and self.adversary is None:
            d = Discriminator(self.frozen, self.seed)
            self.adversary = Adversary(d, torch.optim.Adam(d.parameters(), lr=k.gan_lr),
                                       lambda: self.shard.next_batch()[0][:k.gan_batch], k.adversarial_weight)
        if self.adversary is not None:
            self.adversary.discriminator.refresh(self.frozen)  # D's features start from this round's global model
        if self.missing and k.gan_per_batch:
            self.last_ce = train_generator(self.generator, self.gen_optimizer, self.frozen, self.missing, k.gan_steps,
                                           k.gan_batch, self.rng, adversary=self.adversary)
            self.fill = generate(self.generator, self.frozen, self.missing,
                                 ctx.inner_steps * k.gan_per_batch, self.rng)
        theta = [t.clone() for t in ctx.outer.global_params]
        control = [t.clone() for t in ctx.control.c] if ctx.control is not None else None
        honest_loss = ctx.inner.loss_fn

        def loss_fn(model, x, y):  # L(D_p, w_p) + L(D_p, P_j)
            return honest_loss(model, x, y) + lookahead_loss(model, x, y, theta, ctx.participants, k.lookahead_rounds,
                                                             ctx.lr_sum, control)

        ctx.inner.loss_fn = loss_fn
        try:
            return super().train(ctx)
        finally:
            ctx.inner.loss_fn = honest_loss

    def dc(self, ctx: RoundContext, honest_dc: list[torch.Tensor], c_before: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.knobs.dc_pull <= 0:  # ablation: honest dc
            return honest_dc
        return crafted_dc(ctx.control.c_i, c_before, ctx.total_clients, self.knobs.dc_pull)


ATTACKERS = {cls.name: cls for cls in (Blackbox, Neurotoxin, BadSFL)}
