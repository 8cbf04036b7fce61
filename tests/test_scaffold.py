"""SCAFFOLD control variates: option II's identity, convergence where FedAvg drifts, the derived-c variant, state."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dilocox.diloco import InnerConfig, InnerLoop, params_digest
from dilocox.scaffold import ControlVariates, QuietRestart, Restart, apply_correction, apply_correction_step

M, D, K = 4, 5, 10  # clients, dimensions, local steps


def _quadratics():
    """Non-IID clients: f_i(y) = 0.5 ||A_i y - b_i||^2 with differently scaled A_i and shifted b_i."""
    gen = torch.Generator().manual_seed(0)
    A = [torch.randn(8, D, generator=gen) * s for s in (0.3, 0.6, 1.0, 1.3)]
    b = [torch.randn(8, generator=gen) * 3 + 2 * i for i in range(M)]
    hessian = sum(a.T @ a for a in A)
    x_star = torch.linalg.solve(hessian, sum(a.T @ bb for a, bb in zip(A, b)))  # optimum of mean_i f_i
    lipschitz = max(float(torch.linalg.eigvalsh(a.T @ a).max()) for a in A)
    return A, b, x_star, 0.3 / lipschitz


def _local_round(x, A, b, cv, lrs, corrected=True, via_step=False, optimizer="sgd"):
    """K inner steps from x on one client; returns (delta = x - y, gradients g_k, update directions u_k)."""
    y = torch.nn.Parameter(x.clone())
    opt = (torch.optim.SGD([y], lr=lrs[0]) if optimizer == "sgd"
           else torch.optim.AdamW([y], lr=lrs[0], weight_decay=0.1))
    corr = cv.correction()
    grads, directions = [], []
    for lr in lrs:
        for group in opt.param_groups:
            group["lr"] = lr
        (0.5 * ((A @ y - b) ** 2).sum()).backward()
        grads.append(y.grad.clone())
        if corrected and not via_step:
            apply_correction([y], corr)
        before = y.detach().clone()
        opt.step()
        directions.append((before - y.detach()) / lr)  # the optimizer's own update direction u_k
        if corrected and via_step:
            apply_correction_step([y], corr, lr)
        opt.zero_grad(set_to_none=True)
    return [x - y.detach()], grads, directions


def _run(rounds, scaffold, participating=None):
    A, b, x_star, eta = _quadratics()
    x = torch.zeros(D)
    cvs = [ControlVariates([x]) for _ in range(M)]
    for r in range(rounds):
        members = range(M) if participating is None else participating(r)
        deltas, dcs = [], []
        for i in members:
            delta, _, _ = _local_round(x, A[i], b[i], cvs[i], [eta] * K, corrected=scaffold)
            deltas.append(delta[0])
            dcs.append(cvs[i].client_update(delta, K, K * eta)[0])
        x = x - torch.stack(deltas).mean(0)  # eta_g = 1: x <- x + mean(dy)
        for cv in cvs:  # every member applies the same server step
            cv.server_update([torch.stack(dcs).mean(0)], len(deltas), M)
    return x, x_star, cvs


def test_option_two_control_variate_is_the_mean_gradient_along_the_trajectory():
    """With corrected SGD steps y <- y - eta (g_k - c_i + c): x - y = eta sum_k g_k + K eta (c - c_i), so
    c_i+ = c_i - c + (x - y) / (K eta) = (1/K) sum_k g_k exactly."""
    A, b, _, eta = _quadratics()
    x, _, cvs = _run(3, scaffold=True)  # a few rounds first, so c and c_i are not zero
    assert all(float(cv.c_i[0].norm()) > 0.1 for cv in cvs) and float(cvs[0].c[0].norm()) > 1e-3
    for i in range(M):
        old_ci = cvs[i].c_i[0].clone()
        delta, grads, _ = _local_round(x, A[i], b[i], cvs[i], [eta] * K)
        dc = cvs[i].client_update(delta, K, K * eta)
        mean_grad = torch.stack(grads).mean(0)
        assert torch.allclose(cvs[i].c_i[0], mean_grad, atol=1e-5, rtol=1e-5)
        assert torch.allclose(dc[0], mean_grad - old_ci, atol=1e-5, rtol=1e-5)


def test_lr_sum_makes_c_i_the_lr_weighted_mean_update_direction():
    """(ours) with a schedule lr_k and any optimizer, stepping the correction in update units gives
    c_i+ = sum_k lr_k u_k / lr_sum; for SGD u_k = g_k, and both ways of applying the correction agree."""
    A, b, _, eta = _quadratics()
    x, _, cvs = _run(2, scaffold=True)
    lrs = [eta * f for f in (0.2, 0.6, 1.0, 1.0, 0.8, 0.5, 0.3)]
    lr_sum = sum(lrs)
    for optimizer in ("sgd", "adamw"):
        cv = ControlVariates([x])
        cv.load_state_dict(cvs[1].state_dict())
        delta, grads, directions = _local_round(x, A[1], b[1], cv, lrs, via_step=True, optimizer=optimizer)
        cv.client_update(delta, len(lrs), lr_sum)
        expected = sum(lr * u for lr, u in zip(lrs, directions)) / lr_sum
        assert torch.allclose(cv.c_i[0], expected, atol=1e-5, rtol=1e-4), optimizer
        if optimizer == "sgd":
            assert torch.allclose(expected, sum(lr * g for lr, g in zip(lrs, grads)) / lr_sum, atol=1e-5)
            via_grad, _, _ = _local_round(x, A[1], b[1], cvs[1], lrs, via_step=False)
            assert torch.allclose(via_grad[0], delta[0], atol=1e-6)


def test_scaffold_converges_where_fedavg_drifts():
    x, x_star, cvs = _run(50, scaffold=True)
    fedavg, _, _ = _run(50, scaffold=False)
    scaffold_error, fedavg_error = float((x - x_star).norm()), float((fedavg - x_star).norm())
    assert scaffold_error < 1e-3 and fedavg_error > 0.3 and fedavg_error > 100 * scaffold_error
    assert len({cv.digest() for cv in cvs}) == 1  # the shared c is bit-identical on every member


def test_partial_participation_also_converges():
    x, x_star, _ = _run(80, scaffold=True, participating=lambda r: [(r + j) % M for j in range(2)])
    assert float((x - x_star).norm()) < 1e-2


@pytest.mark.parametrize("members", [[0, 1, 2, 3], [1, 3]])
def test_derived_c_equals_option_two_for_honest_clients(members):
    A, b, _, eta = _quadratics()
    x, _, cvs = _run(3, scaffold=True)
    derived = ControlVariates([x])
    derived.load_state_dict(cvs[0].state_dict())
    deltas, dcs = [], []
    for i in members:
        delta, _, _ = _local_round(x, A[i], b[i], cvs[i], [eta] * K)
        deltas.append(delta[0])
        dcs.append(cvs[i].client_update(delta, K, K * eta)[0])
    cvs[0].server_update([torch.stack(dcs).mean(0)], len(members), M)
    derived.derive_c_from_aggregate([torch.stack(deltas).mean(0)], K * eta, len(members), M)
    assert torch.allclose(derived.c[0], cvs[0].c[0], atol=1e-6)
    # a liar's dc moves option II's c; the derived c only sees the pseudo-gradients
    lied = ControlVariates([x])
    lied.load_state_dict(cvs[0].state_dict())
    lied.server_update([torch.full((D,), 1e3)], 1, M)
    assert float((lied.c[0] - cvs[0].c[0]).norm()) > 100


def test_correction_is_c_minus_c_i_and_skips_missing_grads():
    cv = ControlVariates([torch.zeros(2, 3), torch.zeros(4)])
    cv.load_state_dict({"c": [torch.ones(2, 3), torch.full((4,), 2.0)], "c_i": [torch.zeros(2, 3), torch.ones(4)]})
    corr = cv.correction()
    assert torch.equal(corr[0], torch.ones(2, 3)) and torch.equal(corr[1], torch.ones(4))
    p, q = torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((2, 3), 0.5)
    apply_correction([p, q], corr)
    assert torch.equal(p.grad, torch.full((2, 3), 1.5)) and q.grad is None
    apply_correction_step([p, q], corr, lr=0.1)
    assert torch.allclose(p.detach(), torch.full((2, 3), -0.1)) and torch.equal(q.detach(), torch.zeros(4))
    with pytest.raises(ValueError, match="expected 2 tensors"):
        apply_correction([p, q], corr[:1])
    with pytest.raises(ValueError, match="tensor 1 has shape"):
        apply_correction([p, q], [corr[0], torch.ones(5)])


def test_state_dict_round_trip_and_validation():
    shapes = [torch.zeros(3, 2), torch.zeros(5)]
    cv = ControlVariates(shapes)
    assert cv.digest() == ControlVariates(shapes).digest()
    zero_digest = cv.digest()
    cv.server_update([torch.ones(3, 2), torch.arange(5.0)], 1, 4)
    assert torch.allclose(cv.c[1], torch.arange(5.0) / 4) and cv.digest() != zero_digest
    cv.client_update([torch.ones(3, 2), torch.ones(5)], inner_steps=5, lr_sum=0.5)
    state = cv.state_dict()
    restored = ControlVariates(shapes)
    restored.load_state_dict(state)
    assert restored.digest() == cv.digest()
    assert all(torch.equal(a, b) for a, b in zip(restored.c_i, cv.c_i))
    state["c"][0].fill_(7.0)  # the state is a copy
    assert cv.c[0].max() < 7.0
    bad = [
        ({"c": cv.c}, "lacks 'c_i'"),
        ({"c": cv.c[:1], "c_i": cv.c_i}, "control variate c: expected 2 tensors"),
        ({"c": cv.c, "c_i": [torch.zeros(2, 3), torch.zeros(5)]}, "control variate c_i: tensor 0 has shape"),
        ({"c": [torch.full((3, 2), float("nan")), torch.zeros(5)], "c_i": cv.c_i}, "c: tensor 0 holds NaN"),
        ({"c": cv.c, "c_i": [torch.zeros(3, 2), torch.tensor([0, 0, float("inf"), 0, 0])]}, "c_i: tensor 1 holds"),
        ({"c": "x", "c_i": cv.c_i}, "list of tensors"),
        ([], "must be a dict"),
    ]
    for state, message in bad:
        with pytest.raises(ValueError, match=message):
            restored.load_state_dict(state)
    assert restored.digest() == cv.digest()  # a refused state changes nothing


def test_reset_every_restarts_c_and_c_i_at_its_multiples_only():
    params = [torch.zeros(3), torch.zeros(2, 2)]
    cv = ControlVariates(params, reset_every=5)
    for step in range(1, 11):
        cv.client_update([torch.ones(3), torch.ones(2, 2)], 4, 0.4)
        cv.derive_c_from_aggregate([torch.ones(3), torch.ones(2, 2)], 0.4, 1, 1)
        assert (cv.outer_step_done(step) == Restart.PERIODIC) == (step % 5 == 0)
        held = sum(float(t.abs().sum()) for t in cv.c + cv.c_i)
        assert (held == 0) == (step % 5 == 0)
    assert ControlVariates(params).outer_step_done(10) == Restart.NONE  # 0: never
    with pytest.raises(ValueError, match="reset_every must be >= 0"):
        ControlVariates(params, reset_every=-1)


def _held(cv: ControlVariates) -> float:
    return sum(float(t.abs().sum()) for t in cv.c + cv.c_i)


def test_the_quiet_restart_follows_the_last_outsized_round_only():
    """QuietRestart: a contribution scaled below 1 / outsized marks its round; c and c_i restart (or shrink) from Q
    rounds after the last marked round, for ``rounds`` rounds; ordinary clipping never triggers it."""
    params = [torch.zeros(3), torch.zeros(2, 2)]

    def rounds(quiet, scales_by_round, total=12, reset_every=0):
        cv, acted = ControlVariates(params, reset_every, quiet), []
        for t in range(1, total + 1):
            cv.client_update([torch.ones(3), torch.ones(2, 2)], 4, 0.4)
            cv.derive_c_from_aggregate([torch.ones(3), torch.ones(2, 2)], 0.4, 1, 1)
            before = _held(cv)
            done = cv.outer_step_done(t, cv.quiet.is_outsized(scales_by_round.get(t, {})))
            if done == Restart.QUIET:
                assert _held(cv) == pytest.approx(quiet.factor * before)  # c and c_i together: 0 or shrunk
                acted.append(t)
            elif done == Restart.DURING_ATTACK:
                assert _held(cv) == 0.0
                acted.append(-t)
            else:
                assert _held(cv) == (0.0 if done == Restart.PERIODIC else before)
        return acted

    outsized, clipped = {"m": 0.9 / 2.0}, {"h": 1.1 / 2.0}  # a boosted update; an honest outlier (outsized 2)
    attack = {t: outsized for t in (2, 3, 4)} | {6: clipped}
    restart = dict(factor=0.0, rounds=1, outsized=2.0, every=0)  # once, at zero
    assert rounds(QuietRestart(3, **restart), attack) == [7]
    assert rounds(QuietRestart(3, 0.5, 3, 2.0, every=0), attack) == [7, 8, 9]
    assert rounds(QuietRestart(3, **restart), {t: clipped for t in range(1, 12)}) == []
    assert rounds(QuietRestart(0, **restart), attack) == []  # off
    assert rounds(QuietRestart(2, **restart), {2: outsized, 5: outsized}) == [4, 7]  # each episode once
    assert rounds(QuietRestart(3), attack) == []  # the defaults: not outsized under 4 x the bound ...
    assert rounds(QuietRestart(3), {2: {"m": 0.9 / 4.0}}, total=25) == [5, 6, 7, 8, 9, -20]  # ... halved over it
    assert rounds(QuietRestart(3, **restart), attack, reset_every=7) == []  # both at 7: the periodic one reported
    assert not QuietRestart().is_outsized([0.01]) and QuietRestart(1).is_outsized([0.01])
    # every 10 (negative: a restart at zero while outsized rounds come, after each multiple of 10 with one among its
    # last 10), then the halvings once they stop
    long_attack = {t: outsized for t in range(8, 34, 2)}  # rounds 8, 10, ..., 32
    assert rounds(QuietRestart(3, 0.5, 5, 2.0, every=10), long_attack, total=45) == [-10, -20, -30, 35, 36, 37, 38,
                                                                                     39, -40]
    assert rounds(QuietRestart(3, 0.5, 5, 2.0, every=10), {}, total=45) == []  # no attack: never
    assert rounds(QuietRestart(3, 0.5, 5, 2.0, every=10), {12: outsized}, total=45) == [15, 16, 17, 18, 19, -20]


@pytest.mark.parametrize("kwargs, message", [
    (dict(after=-1), "after must be >= 0"), (dict(after=1, factor=1.0), "factor must lie in"),
    (dict(after=1, factor=-0.1), "factor must lie in"), (dict(after=1, rounds=0), "rounds must be >= 1"),
    (dict(after=1, outsized=1.0), "outsized must be"), (dict(after=1, outsized=float("inf")), "outsized must be"),
    (dict(after=1, every=-1), "every must be >= 0"),
])
def test_a_bad_quiet_restart_is_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        QuietRestart(**kwargs)


def test_a_pending_quiet_restart_is_shared_state_digested_checkpointed_and_validated():
    """Two members with the same c but different pending restarts would part at the restart: the digest tells
    them apart now. With none pending the digest is c's alone, as before the quiet restart existed."""
    params = [torch.zeros(3), torch.zeros(2, 2)]
    quiet = QuietRestart(3, factor=0.0, rounds=1, every=0)
    cv = ControlVariates(params, quiet=quiet)
    cv.derive_c_from_aggregate([torch.ones(3), torch.ones(2, 2)], 0.4, 1, 1)
    plain = cv.digest()
    assert plain == params_digest(cv.c)
    cv.outer_step_done(5, outsized=True)
    assert cv.last_outsized == 5 and cv.digest() != plain
    restored = ControlVariates(params, quiet=quiet)
    restored.load_state_dict(cv.state_dict())
    assert restored.last_outsized == 5 and restored.digest() == cv.digest()
    restored.load_state_dict({"c": cv.c, "c_i": cv.c_i})  # a checkpoint from before: none pending
    assert restored.last_outsized is None and restored.digest() == plain
    for bad in (-1, "5", True, 2.5):
        with pytest.raises(ValueError, match="last_outsized"):
            restored.load_state_dict(dict(cv.state_dict(), last_outsized=bad))
    assert ControlVariates(params).outer_step_done(5, outsized=True) == Restart.NONE  # off: nothing pending
    for t in (6, 7, 8):
        cv.outer_step_done(t)
    assert cv.last_outsized is None and _held(cv) == 0.0  # restarted after step 8, then nothing left to share


def test_scale_shrinks_c_and_every_c_i_alike_and_reset_zeroes_them():
    """c - c_i scales by the factor (so does c - mean c_i across members that scale at one outer step)."""
    params = [torch.zeros(3), torch.zeros(2, 2)]
    cv = ControlVariates(params)
    cv.client_update([torch.ones(3), 2 * torch.ones(2, 2)], 4, 0.4)
    cv.derive_c_from_aggregate([3 * torch.ones(3), torch.ones(2, 2)], 0.4, 1, 2)
    before = [t.clone() for t in cv.correction()]
    cv.scale(0.5)
    assert all(torch.allclose(a, 0.5 * b) for a, b in zip(cv.correction(), before))
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="scale factor must lie in"):
            cv.scale(bad)
    cv.reset()
    assert sum(float(t.abs().sum()) for t in cv.c + cv.c_i) == 0


def test_updates_reject_bad_arguments():
    cv = ControlVariates([torch.zeros(3)])
    good = [torch.ones(3)]
    for kwargs, message in [
        (dict(pseudo_gradient=[torch.ones(4)], inner_steps=1, lr_sum=1.0), "pseudo-gradient: tensor 0 has shape"),
        (dict(pseudo_gradient=[torch.tensor([1.0, float("nan"), 0.0])], inner_steps=1, lr_sum=1.0), "NaN"),
        (dict(pseudo_gradient=good, inner_steps=0, lr_sum=1.0), "inner_steps must be >= 1"),
        (dict(pseudo_gradient=good, inner_steps=3, lr_sum=0.0), "lr_sum"),
        (dict(pseudo_gradient=good, inner_steps=3, lr_sum=float("inf")), "lr_sum"),
    ]:
        with pytest.raises(ValueError, match=message):
            cv.client_update(**kwargs)
    with pytest.raises(ValueError, match="1 <= participating <= total"):
        cv.server_update(good, 0, 4)
    with pytest.raises(ValueError, match="1 <= participating <= total"):
        cv.derive_c_from_aggregate(good, 1.0, 5, 4)
    with pytest.raises(ValueError, match="aggregated pseudo-gradient"):
        cv.derive_c_from_aggregate([torch.ones(2)], 1.0, 1, 4)
    assert torch.equal(cv.c[0], torch.zeros(3)) and torch.equal(cv.c_i[0], torch.zeros(3))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_inner_loop_with_sgd_is_algorithm_1(momentum):
    """--inner-optimizer sgd through the node's own code path (InnerLoop.inner_step + the after-step correction,
    as ReplicaState.inner_step runs it) against Algorithm 1 of arXiv 1910.06378 written out on tensors:
      y <- y - eta (g(y) - c_i + c)  (K times),  c_i+ = c_i - c + (x - y) / (K eta)   (option II).
    With momentum, the correction stays outside the momentum buffer b <- mu b + g, as BadSFL's public code
    applies it (w -= lr (c - c_i) after each optimizer step): y <- y - eta b - eta (c - c_i)."""
    gen = torch.Generator().manual_seed(1)
    model = torch.nn.Linear(6, 3)
    x = [p.detach().clone() for p in model.parameters()]
    batches = [(torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)) for _ in range(K)]
    eta = 0.1
    cv = ControlVariates(x)
    cv.load_state_dict({"c": [torch.randn(t.shape, generator=gen) for t in x],
                        "c_i": [torch.randn(t.shape, generator=gen) for t in x]})
    c, c_i = [t.clone() for t in cv.c], [t.clone() for t in cv.c_i]

    def loss_fn(m, inputs, targets):
        return F.cross_entropy(m(inputs), targets)

    # the reference: plain tensors and autograd, no torch.optim
    y, b = [t.clone() for t in x], [torch.zeros_like(t) for t in x]
    for inputs, targets in batches:
        leaves = [t.clone().requires_grad_(True) for t in y]
        g = torch.autograd.grad(F.cross_entropy(F.linear(inputs, *leaves), targets), leaves)
        b = [momentum * bk + gk for bk, gk in zip(b, g)] if momentum else list(g)
        y = [yk - eta * bk - eta * (ck - cik) for yk, bk, ck, cik in zip(y, b, c, c_i)]
    expected_ci = [cik - ck + (xk - yk) / (K * eta) for cik, ck, xk, yk in zip(c_i, c, x, y)]

    config = InnerConfig(lr=eta, weight_decay=0.0, optimizer="sgd", momentum=momentum, warmup_steps=0,
                         min_lr_ratio=1.0, max_grad_norm=1e9)
    inner = InnerLoop(model, config, loss_fn=loss_fn)
    assert isinstance(inner.inner_optimizer, torch.optim.SGD)
    correction = cv.correction()
    for i, (inputs, targets) in enumerate(batches):
        inner.inner_step(inputs, targets, global_step=i,
                         after_step=lambda lr: apply_correction_step(inner.params, correction, lr))
    for got, want in zip(inner.params, y):
        assert torch.allclose(got.detach(), want, atol=1e-5), (got, want)
    delta = [xk - p.detach() for xk, p in zip(x, inner.params)]
    dc = cv.client_update(delta, K, sum(config.lr_at(i) for i in range(K)))
    for got, want in zip(cv.c_i, expected_ci):
        assert torch.allclose(got, want, atol=1e-4)
    assert all(torch.allclose(d, ci_new - ci_old, atol=1e-4) for d, ci_new, ci_old in zip(dc, cv.c_i, c_i))
    if momentum == 0.0:  # option II is then exactly the mean gradient along the trajectory, shifted by c_i - c
        mean_grad = [torch.zeros_like(t) for t in x]
        y = [t.clone() for t in x]
        for inputs, targets in batches:
            leaves = [t.clone().requires_grad_(True) for t in y]
            g = torch.autograd.grad(F.cross_entropy(F.linear(inputs, *leaves), targets), leaves)
            mean_grad = [m + gk / K for m, gk in zip(mean_grad, g)]
            y = [yk - eta * (gk - cik + ck) for yk, gk, ck, cik in zip(y, g, c, c_i)]
        assert all(torch.allclose(a, m, atol=1e-4) for a, m in zip(cv.c_i, mean_grad))


def test_inner_optimizer_names_are_checked():
    model = torch.nn.Linear(2, 2)
    assert isinstance(InnerLoop(model, InnerConfig()).inner_optimizer, torch.optim.AdamW)
    with pytest.raises(ValueError, match="inner optimizer 'lion'"):
        InnerLoop(model, InnerConfig(optimizer="lion"))
    with pytest.raises(ValueError, match="momentum must be in"):
        InnerLoop(model, InnerConfig(optimizer="sgd", momentum=1.5))
