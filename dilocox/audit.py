"""Recomputation audits of sparse contributions: who audits whom, and whether a contribution was computed
honestly. The algorithm only; no network (docs/security.md, "Audits").

A replica's round-r contribution is a function of what others can know or be shown:

    Δ_r = θ_{r-1} - x_H,   x_0 = θ_{r-1},   x_{i+1} = InnerStep(x_i, s_i, batch(seed, shard_key, i))
    c_r = Encode(β e_r + Δ_r),   e_{r+1} = β e_r + Δ_r - Decode(c_r)       (dilocox/sparse/)

θ_{r-1} and c_r are known to the whole group. The batches are a seeded stream (dilocox/data.py, ``batch_at``).
The contributor *commits* (by digest, in its gathered metadata) to its start state S_r = (inner optimizer
state s_0, error-feedback buffer e_r) and serves it to an auditor on request. An audit of round r fetches
S_r and the next round's committed e_{r+1} and s_H, recomputes Δ_r, and checks three links:

* **contribution**: Decode(Encode(β e_r + Δ_r)) against Decode(c_r);
* **error feedback**: the claimed Δ_r = e_{r+1} - β e_r + Decode(c_r) against the recomputed Δ_r, unless e_{r+1}
  is e_r bit for bit (round r was not applied there) or zero (the contributor re-synced by download);
* **optimizer**: the committed s_H against the recomputed one;
* **control variate** (SCAFFOLD only: the start state also holds the contributor's c_i, and the inner steps are
  replayed with its correction c - c_i, c the swarm's control variate at the round's start, which every member
  holds): the committed c_i of round r + 1 against option II's update s (c_i - c + Δ_r / lr_sum)
  (dilocox/scaffold.py), for s = 1 or the quiet restart's factor, unless it is zero (a restart at zero, or a
  re-sync by download).

A liar that sends a c_r other than its honest one must either fail the contribution link, or commit an
e_r (or s_0) made up to fit, which breaks the error-feedback (or optimizer) link of round r-1. Each
round it lies is therefore caught by an audit of that round or the one before, with the audit's
probability. Bit-exactness fails across hardware (thread counts, TF32, bf16), so every link is a
relative L2 error compared with a threshold measured on honest peers (``make bench-audit``).

Two cheaper checks are measured beside it (bench/audit.py): the **prefix** check recomputes only the first
``s`` inner steps and compares their direction with the claimed Δ_r; the **loss-change** check, Templar's
Gauntlet inside the swarm, asks whether θ - Decode(c_r) lowers the loss on the contributor's own batches.

Shared randomness (``round_randomness``) comes from the round's result digests, fixed only after every
contribution is, so no peer can know in advance whether it will be audited. Source for the recomputation
idea: BTARD (Gorbunov et al., arXiv 2106.11257), which recomputes gradients from shared seeds.
"""

from __future__ import annotations

import copy
import hashlib
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Mapping, Optional, Sequence

import torch

from dilocox.scaffold import apply_correction_step
from dilocox.sparse.codec import SparseCodec
from dilocox.sparse.wire import SparseConfig, decode


class AuditCheck(str, Enum):
    RECOMPUTE = "recompute"      # all H inner steps, three links
    PREFIX = "prefix"            # the first s inner steps, direction only
    LOSS_CHANGE = "loss-change"  # does theta - Decode(c) lower the loss on the contributor's batches


class AuditVerdict(str, Enum):
    HONEST = "honest"  # every statistic within its threshold
    LIED = "lied"      # one is not: an accusation, with the report as evidence


@dataclass(frozen=True)
class Thresholds:
    """Where an honest peer's statistics end; measured by ``make bench-audit`` (docs/security.md).

    max_link_error: relative L2 error allowed on each link of a full recomputation;
    min_prefix_cosine: cosine between the first ``s`` steps' Δ and the claimed Δ;
    max_prefix_ratio: |log| of their norm ratio (after scaling the prefix by H / s) allowed, as a ratio;
    min_loss_drop: the least relative loss drop ``(L(θ) - L(θ - Decode(c))) / L(θ)`` an honest update gives."""

    max_link_error: float = 0.5
    min_prefix_cosine: float = 0.5
    max_prefix_ratio: float = 4.0
    min_loss_drop: float = 0.0


@dataclass(frozen=True)
class AuditReport:
    """One audit's outcome: the check, its verdict and the statistics it was decided by (the evidence)."""

    check: AuditCheck
    verdict: AuditVerdict
    stats: dict = field(default_factory=dict)
    detail: str = ""


def round_randomness(round_index: int, result_digests: Mapping[str, str]) -> bytes:
    """32 bytes every member derives alike from round ``round_index``'s result digests (peer_id -> hex digest),
    in sorted peer order: unknown to anyone until the last contribution of the round is fixed."""
    h = hashlib.sha256(b"dilocox-audit\0" + round_index.to_bytes(8, "little"))
    for peer in sorted(result_digests):
        h.update(peer.encode() + b"\0" + str(result_digests[peer]).encode() + b"\0")
    return h.digest()


def _uniform(randomness: bytes, label: str) -> float:
    """A number in [0, 1) from ``randomness`` and ``label``: 53 bits of SHA-256."""
    word = hashlib.sha256(randomness + label.encode()).digest()[:8]
    return (int.from_bytes(word, "little") >> 11) / float(1 << 53)


def audit_targets(members: Sequence[str], randomness: bytes, rate_of: Callable[[str], float]) -> dict[str, list[str]]:
    """auditor -> the group-mates it audits this round: each member t is audited with probability ``rate_of(t)``, by
    one auditor drawn uniformly from the others. The same on every member for the same ``members`` (any order),
    ``randomness`` and rates. Each member audits sum over t != it of rate_of(t) / (k - 1) group-mates a round on
    average (k members): the mean rate. Raises ValueError for a rate outside [0, 1]."""
    peers = sorted(set(members))
    out: dict[str, list[str]] = {}
    for target in peers:
        rate = rate_of(target)
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"audit rate must be in [0, 1], got {rate} for {target}")
        others = [p for p in peers if p != target]
        if others and _uniform(randomness, "audit?" + target) < rate:
            auditor = others[min(len(others) - 1, int(_uniform(randomness, "by?" + target) * len(others)))]
            out.setdefault(auditor, []).append(target)
    return out


def catch_probability(rate: float, group_size: int, liars: int = 1, rounds: int = 1) -> float:
    """Probability that a peer lying every round, audited at ``rate``, is audited by an honest group-mate within
    ``rounds`` rounds, when ``liars`` of ``group_size`` members lie together (colluders never accuse each other): the
    auditor is one of the k - 1 others, h = k - liars of them honest, so 1 - (1 - rate h / (k - 1)) ^ rounds."""
    if group_size < 2:
        return 0.0
    honest = group_size - liars
    return 1.0 - (1.0 - rate * honest / (group_size - 1)) ** rounds


def rounds_undetected(rate: float, group_size: int, liars: int = 1) -> float:
    """Expected rounds a peer lying every round contributes before an honest audit of its lie: the mean of a
    geometric draw with ``catch_probability(rate, group_size, liars)`` per round, counting the caught round (inf if
    that is 0). The accusation's check and the group's vote add rounds after it (docs/security.md)."""
    p = catch_probability(rate, group_size, liars)
    return 1.0 / p if p > 0 else math.inf


def audit_rate_for(group_size: int, liars: int = 1, rounds: int = 10, confidence: float = 0.99) -> float:
    """The least rate at which ``catch_probability(rate, group_size, liars, rounds) >= confidence``; raises
    ValueError when no rate reaches it (no honest member, or too few rounds)."""
    honest = group_size - liars
    need = 1.0 - (1.0 - confidence) ** (1.0 / rounds)
    rate = need * (group_size - 1) / honest if honest > 0 else math.inf
    if not (group_size >= 2 and rate <= 1.0):
        raise ValueError(f"no audit rate catches {liars} liar(s) of {group_size} within {rounds} rounds "
                         f"with probability {confidence}")
    return rate


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors flattened and concatenated, float64 (shapes [n])."""
    return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])


def relative_error(claimed: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> float:
    """||claimed - reference|| / ||reference|| in float64 (inf when the reference is zero and the claim is not)."""
    a, b = flatten(claimed), flatten(reference)
    den = float(b.norm())
    num = float((a - b).norm())
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def cosine(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """Cosine similarity in float64; 0 when either side is zero."""
    x, y = flatten(a), flatten(b)
    den = float(x.norm() * y.norm())
    return float(x @ y) / den if den > 0 else 0.0


def recompute(inner, theta: Sequence[torch.Tensor], optimizer_state: dict, batches: Sequence[tuple],
              first_step: int, correction: Optional[Sequence[torch.Tensor]] = None) -> tuple[list[torch.Tensor], dict]:
    """Replay inner steps on ``inner`` (a dilocox.diloco.InnerLoop of the contributor's architecture and
    InnerConfig): load θ and a copy of ``optimizer_state`` (an inner_optimizer ``state_dict``), run one
    inner_step per (inputs, targets) in ``batches`` at global steps ``first_step``, ``first_step + 1``, ...;
    ``correction``: SCAFFOLD's c - c_i (θ's shapes), stepped after each optimizer step as the contributor's node
    does (``apply_correction_step``). Returns (Δ = θ - x, fp32 tensors of θ's shapes; the optimizer's state_dict
    after the last step)."""
    inner.load_params(theta)
    inner.inner_optimizer.load_state_dict(copy.deepcopy(optimizer_state))  # load_state_dict may alias tensors
    after = None
    if correction is not None:
        def after(lr: float) -> None:
            apply_correction_step(inner.params, list(correction), lr)
    for i, (x, y) in enumerate(batches):
        inner.inner_step(x, y, global_step=first_step + i, after_step=after)
    delta = [t.detach().float() - p.detach().float() for t, p in zip(theta, inner.params)]
    return delta, copy.deepcopy(inner.inner_optimizer.state_dict())


@dataclass(frozen=True)
class ControlLink:
    """SCAFFOLD's part of an audit (dilocox/scaffold.py, option II). ``c``: the swarm's control variate at the
    round's start (every member holds the same); ``start`` / ``next``: the contributor's committed c_i of rounds r
    and r + 1 (``next`` None: not checked yet); ``lr_sum``: the sum of round r's inner learning rates (option II's
    K eta_l); ``scales``: the factors an outer step may scale c_i by after the update (1, and a quiet restart's
    factor). Lists of θ's shapes, fp32."""

    c: Sequence[torch.Tensor]
    start: Sequence[torch.Tensor]
    next: Optional[Sequence[torch.Tensor]]
    lr_sum: float
    scales: tuple = (1.0,)

    def correction(self) -> list[torch.Tensor]:
        """c - c_i: what the round's inner steps were corrected by."""
        return [c - ci for c, ci in zip(self.c, self.start)]

    def error(self, delta: Sequence[torch.Tensor]) -> tuple[float, str]:
        """(relative error of the committed next c_i against option II's update with the recomputed ``delta``, the
        form it took). Zero is the honest form of a restart at zero or a re-sync by download."""
        if all(not bool(n.any()) for n in self.next):
            return 0.0, "c_i reset"
        update = [ci - c + d / self.lr_sum for ci, c, d in zip(self.start, self.c, delta)]
        return min(relative_error(self.next, [s * u for u in update]) for s in self.scales if s > 0), ""


def _optimizer_tensors(state: dict) -> list[torch.Tensor]:
    """The float tensors of an optimizer state_dict's per-parameter state, in parameter then key order."""
    out = []
    for index in sorted(state.get("state", {})):
        for key in sorted(state["state"][index]):
            v = state["state"][index][key]
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
                out.append(v)
    return out


def full_audit(payload: bytes, error_start: Sequence[torch.Tensor], error_next: Optional[Sequence[torch.Tensor]],
               delta: Sequence[torch.Tensor], optimizer_next: Optional[dict], recomputed_optimizer: Optional[dict],
               cfg: SparseConfig, thresholds: Thresholds = Thresholds(),
               control: Optional[ControlLink] = None) -> AuditReport:
    """The RECOMPUTE check of one contribution. ``payload``: the contribution c_r as gathered; ``error_start``
    and ``error_next``: the committed e_r and e_{r+1} (None: that link is not checked); ``delta``: the
    recomputed Δ_r (``recompute``); ``optimizer_next`` / ``recomputed_optimizer``: the committed and the
    recomputed inner optimizer state after the round (None: not checked); ``control``: SCAFFOLD's c_i link (None:
    DiLoCo; its ``next`` None: not checked). The error-feedback link has three
    honest forms, told apart by the bits: e_{r+1} = e_r (the round was not applied there: skipped), e_{r+1} = 0 (the
    contributor re-synced by download, which resets the buffer) or the codec's update (``detail`` says which).
    Raises ContributionError if the payload does not decode (a malformed contribution is rejected before any
    audit)."""
    shapes = [tuple(d.shape) for d in delta]
    sent = decode(payload, shapes, cfg)
    codec = SparseCodec(shapes, cfg)
    codec.load_state_dict({"error": list(error_start)})
    honest_payload, _ = codec.prepare(delta)
    stats = dict(contribution_error=relative_error(sent, decode(honest_payload, shapes, cfg)))
    detail = ""
    if error_next is not None:
        if all(torch.equal(a, b) for a, b in zip(error_next, error_start)):
            detail, stats["error_feedback_error"] = "kept (round not applied there)", 0.0
        elif all(not bool(n.any()) for n in error_next):
            detail, stats["error_feedback_error"] = "reset (re-synced by download)", 0.0
        else:
            claimed = [n - cfg.beta * e + s for n, e, s in zip(error_next, error_start, sent)]
            stats["error_feedback_error"] = relative_error(claimed, delta)
    if optimizer_next is not None and recomputed_optimizer is not None:
        stats["optimizer_error"] = relative_error(_optimizer_tensors(optimizer_next),
                                                  _optimizer_tensors(recomputed_optimizer))
    if control is not None and control.next is not None:
        stats["control_variate_error"], form = control.error(delta)
        detail = ", ".join(x for x in (detail, form) if x)
    lied = any(not (v <= thresholds.max_link_error) for v in stats.values())  # NaN counts as a lie
    return AuditReport(AuditCheck.RECOMPUTE, AuditVerdict.LIED if lied else AuditVerdict.HONEST, stats, detail)


def prefix_audit(claimed_delta: Sequence[torch.Tensor], prefix_delta: Sequence[torch.Tensor], prefix_steps: int,
                 inner_steps: int, thresholds: Thresholds = Thresholds()) -> AuditReport:
    """The PREFIX check: the Δ of the first ``prefix_steps`` recomputed inner steps (``recompute`` over that many
    batches) against the claimed Δ_r (from the error-feedback link, or Decode(c_r) without it): cosine, and
    the norm ratio after scaling the prefix by inner_steps / prefix_steps."""
    cos = cosine(claimed_delta, prefix_delta)
    scaled = float(flatten(prefix_delta).norm()) * inner_steps / prefix_steps
    ratio = float(flatten(claimed_delta).norm()) / scaled if scaled > 0 else math.inf
    bound = thresholds.max_prefix_ratio
    ok = cos >= thresholds.min_prefix_cosine and 1.0 / bound <= ratio <= bound
    return AuditReport(AuditCheck.PREFIX, AuditVerdict.HONEST if ok else AuditVerdict.LIED,
                       dict(prefix_cosine=cos, prefix_norm_ratio=ratio))


@torch.no_grad()
def loss_change_audit(model: torch.nn.Module, loss_fn: Callable, theta: Sequence[torch.Tensor],
                      update: Sequence[torch.Tensor], batches: Sequence[tuple],
                      thresholds: Thresholds = Thresholds()) -> AuditReport:
    """The LOSS_CHANGE check: mean ``loss_fn(model, x, y)`` over the contributor's ``batches`` at θ and at
    θ - ``update`` (its decoded contribution); the relative drop must reach ``min_loss_drop``. ``model``'s
    parameters are overwritten."""
    params = list(model.parameters())
    model.eval()

    def loss_at(tensors) -> float:
        for p, t in zip(params, tensors):
            p.copy_(t)
        return sum(float(loss_fn(model, x, y)) for x, y in batches) / len(batches)

    before = loss_at(theta)
    after = loss_at([t - u for t, u in zip(theta, update)])
    drop = (before - after) / before if before > 0 else -math.inf
    ok = drop >= thresholds.min_loss_drop
    return AuditReport(AuditCheck.LOSS_CHANGE, AuditVerdict.HONEST if ok else AuditVerdict.LIED,
                       dict(loss_before=before, loss_after=after, loss_drop=drop))

