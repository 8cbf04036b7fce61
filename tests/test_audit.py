"""Recomputation audits (dilocox/audit.py): who audits whom, how often a liar is caught, and that each link of a
full recomputation passes an honest contribution recomputed under other float settings and fails each lie."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from dilocox import audit
from dilocox.audit import AuditVerdict
from dilocox.data import Corpus, ReplicaShard
from dilocox.diloco import InnerConfig, InnerLoop
from dilocox.model import ModelSpec
from dilocox.scaffold import ControlVariates
from dilocox.sparse import SparseCodec, SparseConfig, decode
from dilocox.stages import build_stage

SPARSE = SparseConfig(chunk=4096, topk=128, bits=2, beta=0.9, rice=True)
H = 6


def test_targets_are_the_same_for_every_member_and_never_self():
    members = [f"peer{i}" for i in range(7)]
    rand = audit.round_randomness(3, {p: f"{i:016x}" for i, p in enumerate(members)})

    def everyone(peer):
        return 1.0

    targets = audit.audit_targets(members, rand, everyone)
    assert targets == audit.audit_targets(list(reversed(members)), rand, everyone)
    audited = [t for ts in targets.values() for t in ts]
    assert sorted(audited) == members and all(t != a for a, ts in targets.items() for t in ts)  # each once, not self
    assert audit.audit_targets(members, rand, lambda peer: 0.0) == {}
    assert audit.audit_targets(["alone"], rand, everyone) == {}
    # per-target rates: a newcomer on probation is audited every round, the others at the low rate
    assert "peer6" in [t for ts in audit.audit_targets(members, rand, lambda p: 1.0 if p == "peer6" else 0.0).values()
                       for t in ts]
    other = audit.round_randomness(4, {p: f"{i:016x}" for i, p in enumerate(members)})
    assert audit.audit_targets(members, other, everyone) != targets  # another round's digests draw other auditors
    with pytest.raises(ValueError, match="audit rate"):
        audit.audit_targets(members, rand, lambda peer: 1.5)


def test_the_rate_and_the_catch_probability_agree_with_a_count():
    """The drawn targets audit a fixed liar by an honest member about as often as catch_probability says (2 colluders
    of 5), and each member audits the mean rate's worth of group-mates a round."""
    members, liars, rate = [f"p{i}" for i in range(5)], {"p3", "p4"}, 0.6
    caught, load = 0, 0
    for r in range(3000):
        targets = audit.audit_targets(members, audit.round_randomness(r, {"x": str(r)}), lambda peer: rate)
        caught += any("p4" in ts and a not in liars for a, ts in targets.items())
        load += len(targets.get("p0", []))
    assert abs(caught / 3000 - audit.catch_probability(rate, 5, 2)) < 0.03
    assert abs(load / 3000 - rate) < 0.03
    p = audit.audit_rate_for(5, liars=2, rounds=10, confidence=0.99)
    assert audit.catch_probability(p, 5, 2, rounds=10) == pytest.approx(0.99)
    assert 0.45 < p < 0.55 and audit.audit_rate_for(5, liars=1) < p
    assert audit.rounds_undetected(0.1, 5, 1) == pytest.approx(10.0)  # 0.1 x 4/4 a round
    assert audit.rounds_undetected(1.0, 5, 2) == pytest.approx(4 / 3) and audit.rounds_undetected(0.0, 5) == math.inf
    with pytest.raises(ValueError, match="no audit rate"):
        audit.audit_rate_for(5, liars=4, rounds=1)


@pytest.fixture(scope="module")
def setting():
    torch.manual_seed(0)
    spec = ModelSpec.resolve("tiny")
    corpus = Corpus.from_spec("builtin:shakespeare", spec.seq_len)
    cfg = InnerConfig(lr=4e-4, warmup_steps=2, total_steps=10 * H)
    inner = InnerLoop(build_stage(spec, 0, 0, 1), cfg)
    shard = ReplicaShard(corpus.train, spec.seq_len, spec.batch_size, 0, 3)
    theta = [p.detach().clone() for p in inner.params]
    codec = SparseCodec([tuple(p.shape) for p in theta], SPARSE)
    batches = [shard.batch_at(i) for i in range(2 * H)]
    # round 0 trains to give the optimizer and error feedback a state; round 1 is the audited one
    for i, (x, y) in enumerate(batches[:H]):
        inner.inner_step(x, y, global_step=i)
    delta0 = [t - p.detach() for t, p in zip(theta, inner.params)]
    sent0 = decode(codec.encode(delta0), [tuple(t.shape) for t in theta], SPARSE)
    theta = [p.detach().clone() for p in inner.params]
    start = (copy.deepcopy(inner.inner_optimizer.state_dict()), [e.clone() for e in codec.error])
    delta, opt_after = audit.recompute(inner, theta, start[0], batches[H:], H)
    payload, e_next = codec.prepare(delta)
    e_next = _shaped(e_next, delta)
    auditor = InnerLoop(build_stage(spec, 0, 0, 1), InnerConfig(**{**cfg.__dict__, "precision": "bf16"}))
    return dict(theta=theta, start=start, batches=batches[H:], delta=delta, payload=payload, opt_after=opt_after,
                e_next=e_next, auditor=auditor, delta0=delta0, sent0=sent0, shapes=[tuple(t.shape) for t in delta])


def _shaped(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.reshape(d.shape) for t, d in zip(flat.split([d.numel() for d in like]), like)]


def _full(s, payload, e_start, e_next):
    delta, opt = audit.recompute(s["auditor"], s["theta"], s["start"][0], s["batches"], H)
    return audit.full_audit(payload, e_start, e_next, delta, s["opt_after"], opt, SPARSE)


def test_an_honest_contribution_recomputed_in_bf16_passes_every_link(setting):
    s = setting
    report = _full(s, s["payload"], s["start"][1], s["e_next"])
    assert report.verdict == AuditVerdict.HONEST, report.stats
    assert report.stats["error_feedback_error"] < 0.05 and report.stats["optimizer_error"] < 0.05
    # the recomputation left the committed optimizer state as it was
    again = _full(s, s["payload"], s["start"][1], s["e_next"])
    assert again.stats == report.stats


def _lie(s, scale):
    codec = SparseCodec(s["shapes"], SPARSE)
    codec.load_state_dict({"error": s["start"][1]})
    payload, e_next = codec.prepare([scale * d for d in s["delta"]])
    return payload, _shaped(e_next, s["delta"])


@pytest.mark.parametrize("scale", [-1000.0, 100.0, -0.5])
def test_a_lie_fails_the_contribution_and_error_feedback_links(setting, scale):
    s = setting
    payload, e_next = _lie(s, scale)
    report = _full(s, payload, s["start"][1], e_next)
    assert report.verdict == AuditVerdict.LIED
    assert report.stats["contribution_error"] > 1.0 and report.stats["error_feedback_error"] > 1.0


def test_a_liar_that_fits_its_error_feedback_breaks_the_previous_link(setting):
    """Committing e_r' = (beta e_r + lie - honest) / beta makes the lie the honest encoding of round r (the
    contribution and error-feedback links of round r hold), but e_r' is not what round r-1 left: the audit of
    round r-1, whose committed e_r is now e_r', fails its error-feedback link."""
    s = setting
    lie = [-0.5 * d for d in s["delta"]]
    fake = [(SPARSE.beta * e + v - d) / SPARSE.beta for e, v, d in zip(s["start"][1], lie, s["delta"])]
    payload, e_next = _lie(s, -0.5)
    report = _full(s, payload, fake, e_next)
    assert report.stats["contribution_error"] < 0.5 and report.stats["error_feedback_error"] < 0.05
    # round r-1 (here the first round, e_{r-1} = 0) as the liar's commitments claim it: e_r' - 0 + Decode(c_{r-1})
    claimed = [f + c for f, c in zip(fake, s["sent0"])]
    assert audit.relative_error(claimed, s["delta0"]) > audit.Thresholds().max_link_error


def test_honest_training_on_data_of_its_own_choosing_fails_recomputation_on_the_assigned_batches(setting):
    """A contributor that trains honestly, but on batches it picked (here another stream of the same corpus: a slice
    it favours), commits an honest-looking start state; recomputed on the batches the swarm assigned it
    (dilocox/assignment.py), its contribution does not fit. (A committed stream other than the assigned one is caught
    before any recomputation: daemon/audits.py ``data_lie``. This one commits the assigned stream and trains on its
    own.)"""
    s = setting
    spec = ModelSpec.resolve("tiny")
    corpus = Corpus.from_spec("builtin:shakespeare", spec.seq_len)
    chosen = ReplicaShard(corpus.train, spec.seq_len, spec.batch_size, 0, 99)
    cheat = InnerLoop(build_stage(spec, 0, 0, 1), InnerConfig(lr=4e-4, warmup_steps=2, total_steps=10 * H))
    delta, _ = audit.recompute(cheat, s["theta"], s["start"][0], [chosen.batch_at(i) for i in range(H)], H)
    codec = SparseCodec(s["shapes"], SPARSE)
    codec.load_state_dict({"error": s["start"][1]})
    payload, e_next = codec.prepare(delta)
    report = _full(s, payload, s["start"][1], _shaped(e_next, delta))
    assert report.verdict == AuditVerdict.LIED, report.stats
    assert report.stats["contribution_error"] > audit.Thresholds().max_link_error, report.stats


def test_the_cheap_checks(setting):
    s = setting
    prefix, _ = audit.recompute(s["auditor"], s["theta"], s["start"][0], s["batches"][:2], H)
    sent = decode(s["payload"], s["shapes"], SPARSE)
    claimed = [n - SPARSE.beta * e + c for n, e, c in zip(s["e_next"], s["start"][1], sent)]
    assert audit.prefix_audit(claimed, prefix, 2, H).verdict == AuditVerdict.HONEST
    assert audit.prefix_audit([-c for c in claimed], prefix, 2, H).verdict == AuditVerdict.LIED
    assert audit.prefix_audit([100 * c for c in claimed], prefix, 2, H).verdict == AuditVerdict.LIED
    loss_fn = s["auditor"].loss_fn
    honest = audit.loss_change_audit(s["auditor"].model, loss_fn, s["theta"], s["delta"], s["batches"][:2])
    assert honest.verdict == AuditVerdict.HONEST and honest.stats["loss_drop"] > 0
    flipped = audit.loss_change_audit(s["auditor"].model, loss_fn, s["theta"], [-d for d in s["delta"]],
                                      s["batches"][:2])
    assert flipped.verdict == AuditVerdict.LIED


def test_a_round_the_contributor_did_not_apply_or_a_reset_is_honest(setting):
    """A skipped round never entered the contributor's error feedback (e_{r+1} = e_r), and a re-sync by download
    zeroes it: both are honest forms of the link, told apart by the bits; any other buffer must follow the codec."""
    s = setting
    delta, opt = audit.recompute(s["auditor"], s["theta"], s["start"][0], s["batches"], H)
    kept = audit.full_audit(s["payload"], s["start"][1], s["start"][1], delta, s["opt_after"], opt, SPARSE)
    assert kept.verdict == AuditVerdict.HONEST and kept.stats["error_feedback_error"] == 0.0 and "kept" in kept.detail
    zero = [torch.zeros_like(e) for e in s["start"][1]]
    reset = audit.full_audit(s["payload"], s["start"][1], zero, delta, s["opt_after"], opt, SPARSE)
    assert reset.verdict == AuditVerdict.HONEST and "reset" in reset.detail
    other = [e * 0.5 for e in s["start"][1]]
    assert audit.full_audit(s["payload"], s["start"][1], other, delta, s["opt_after"], opt, SPARSE).verdict \
        == AuditVerdict.LIED


@pytest.fixture(scope="module")
def scaffold(setting):
    """An honest SCAFFOLD round from the same start: c (the swarm's) and the contributor's c_i in the units of
    AdamW's update direction (dilocox/scaffold.py), the inner steps corrected by c - c_i, and c_i's option-II update
    as the node computes it (``ControlVariates.client_update``)."""
    s = setting
    gen = torch.Generator().manual_seed(5)
    control = ControlVariates(s["theta"])
    control.c = [0.5 * torch.randn(t.shape, generator=gen) for t in s["theta"]]
    control.c_i = [0.5 * torch.randn(t.shape, generator=gen) for t in s["theta"]]
    c, c_start = [t.clone() for t in control.c], [t.clone() for t in control.c_i]
    contributor = InnerLoop(build_stage(ModelSpec.resolve("tiny"), 0, 0, 1), s["auditor"].config.__class__(
        **{**s["auditor"].config.__dict__, "precision": "fp32"}))
    delta, opt_after = audit.recompute(contributor, s["theta"], s["start"][0], s["batches"], H, control.correction())
    lr_sum = sum(contributor.config.lr_at(H + i) for i in range(H))
    control.client_update(delta, H, lr_sum)
    codec = SparseCodec(s["shapes"], SPARSE)
    codec.load_state_dict({"error": s["start"][1]})
    payload, e_next = codec.prepare(delta)
    link = audit.ControlLink(c, c_start, [t.clone() for t in control.c_i], lr_sum, (1.0, 0.5))
    return dict(delta=delta, payload=payload, e_next=_shaped(e_next, delta), opt_after=opt_after, link=link)


def _scaffold_audit(s, sc, payload, link, correction=None):
    correction = link.correction() if correction is None else correction
    delta, opt = audit.recompute(s["auditor"], s["theta"], s["start"][0], s["batches"], H, correction)
    return audit.full_audit(payload, s["start"][1], sc["e_next"], delta, sc["opt_after"], opt, SPARSE, control=link)


def test_an_honest_scaffold_round_recomputed_in_bf16_passes_every_link_with_its_correction(setting, scaffold):
    s, sc = setting, scaffold
    report = _scaffold_audit(s, sc, sc["payload"], sc["link"])
    assert report.verdict == AuditVerdict.HONEST, report.stats
    assert report.stats["control_variate_error"] < 0.05 and report.stats["contribution_error"] < 0.2
    # the correction matters: replayed without it (as DiLoCo), the same contribution does not fit
    plain = _scaffold_audit(s, sc, sc["payload"], sc["link"], [torch.zeros_like(t) for t in s["theta"]])
    assert plain.verdict == AuditVerdict.LIED and plain.stats["contribution_error"] > 0.5, plain.stats
    # a restart at zero and a quiet restart's shrink are honest forms of the next c_i
    zero = dataclasses.replace(sc["link"], next=[torch.zeros_like(t) for t in s["theta"]])
    assert _scaffold_audit(s, sc, sc["payload"], zero).verdict == AuditVerdict.HONEST
    half = dataclasses.replace(sc["link"], next=[0.5 * t for t in sc["link"].next])
    assert _scaffold_audit(s, sc, sc["payload"], half).verdict == AuditVerdict.HONEST


def test_a_made_up_control_variate_fails_its_link(setting, scaffold):
    """BadSFL's attacker (arXiv 2411.16167) tampers with its c_i: a committed next c_i other than option II's update
    fails the control-variate link; a start c_i other than the one the round was corrected with fails the
    contribution link (the replay steps with the committed one)."""
    s, sc = setting, scaffold
    crafted = dataclasses.replace(sc["link"], next=[2.0 * t + 0.3 for t in sc["link"].next])
    report = _scaffold_audit(s, sc, sc["payload"], crafted)
    assert report.verdict == AuditVerdict.LIED and report.stats["control_variate_error"] > 0.5, report.stats
    other_start = dataclasses.replace(sc["link"], start=[-t for t in sc["link"].start])
    report = _scaffold_audit(s, sc, sc["payload"], other_start)
    assert report.verdict == AuditVerdict.LIED and report.stats["contribution_error"] > 0.5, report.stats
