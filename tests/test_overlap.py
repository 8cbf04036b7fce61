"""The one-step-delay schedule with an instant network tracks synchronous DiLoCo (pure math)."""

from __future__ import annotations

import pytest
import torch

from dilocox.diloco import OuterOptimizer
from dilocox.experimental.overlap import ExperimentalSchedule
from dilocox.overlap import OuterSchedule


def run(overlap: str, rounds: int = 40, replicas: int = 4, inner_steps: int = 10, seed: int = 0):
    """Non-IID least squares: replica r minimises 0.5 |A_r x - b_r|^2 with Adam inner steps.

    Each replica has its own OuterOptimizer + OuterSchedule (as on real nodes); the all-reduce
    is an instant mean. Returns (final global loss, initial global loss).
    """
    g = torch.Generator().manual_seed(seed)
    dim = 16
    problems = [(torch.randn(32, dim, generator=g), torch.randn(32, generator=g) + r) for r in range(replicas)]
    schedules = [OuterSchedule(OuterOptimizer([torch.zeros(dim)], 0.7, 0.9, True), overlap) for _ in range(replicas)]
    xs = [torch.nn.Parameter(torch.zeros(dim)) for _ in range(replicas)]
    opts = [torch.optim.Adam([x], lr=0.02) for x in xs]
    pending = None

    def global_loss(theta):
        return sum(0.5 * ((a @ theta - b) ** 2).mean() for a, b in problems).item() / replicas

    for sched, x in zip(schedules, xs):
        sched.begin_round([x])
    for _ in range(rounds):
        for x, opt, (a, b) in zip(xs, opts, problems):
            for _ in range(inner_steps):
                opt.zero_grad()
                (0.5 * ((a @ x - b) ** 2).mean()).backward()
                opt.step()
        mean = torch.stack([s.pseudo_gradient([x])[0] for s, x in zip(schedules, xs)]).mean(0)  # instant all-reduce
        to_apply, pending = (mean, None) if overlap == "none" else (pending, mean)
        for sched, x in zip(schedules, xs):
            if to_apply is not None:
                sched.apply([to_apply], [x])
            sched.begin_round([x])
    thetas = [s.outer.global_params[0] for s in schedules]
    assert all(torch.equal(t, thetas[0]) for t in thetas)
    a_all, b_all = torch.cat([a for a, _ in problems]), torch.cat([b for _, b in problems])
    best = torch.linalg.lstsq(a_all, b_all[:, None]).solution
    # excess loss over the optimum of the pooled problem: now, and at the start
    return global_loss(thetas[0]) - global_loss(best[:, 0]), global_loss(torch.zeros(dim)) - global_loss(best[:, 0])


def test_schedule_class_matches_the_reference_loop():
    outer = OuterOptimizer([torch.zeros(3)], outer_lr=0.5, outer_momentum=0.0, nesterov=False)
    schedule = OuterSchedule(outer, "delayed")
    x = [torch.tensor([1.0, 2.0, 3.0])]
    schedule.begin_round(x)
    x[0] -= torch.tensor([0.1, 0.2, 0.3])
    delta = schedule.pseudo_gradient(x)
    assert torch.allclose(delta[0], torch.tensor([0.1, 0.2, 0.3]))
    schedule.apply([torch.tensor([1.0, 1.0, 1.0])], x)
    # theta = 0 - 0.5 * 1; x = theta + (x_end - x_start)
    assert torch.allclose(x[0], torch.tensor([-0.6, -0.7, -0.8]))
    sync = OuterSchedule(OuterOptimizer([torch.zeros(3)], 0.5, 0.0, False), "none")
    sync.begin_round(x)
    sync.apply([torch.ones(3)], x)
    assert torch.allclose(x[0], torch.full((3,), -0.5))


def test_delayed_tracks_synchronous_with_an_instant_network():
    sync_excess, init_excess = run("none", rounds=60)
    delayed_excess, _ = run("delayed", rounds=60)
    assert sync_excess < 0.2 * init_excess  # synchronous DiLoCo closes >80% of the gap
    assert delayed_excess < 0.2 * init_excess  # so does the delayed schedule
    assert abs(delayed_excess - sync_excess) < 0.05 * init_excess, (delayed_excess, sync_excess, init_excess)


def test_theta_updated_mid_round_then_rebased_equals_apply_at_round_end():
    """rounds.finish_early: the outer step may run while the next round computes; the local re-base
    waits for the round's end. Same theta, same momentum, same local parameters as ``apply``."""
    g = torch.Generator().manual_seed(1)
    start, steps, delta = torch.randn(5, generator=g), torch.randn(2, 5, generator=g), torch.randn(5, generator=g)
    results = []
    for early in (False, True):
        schedule = OuterSchedule(OuterOptimizer([torch.zeros(5)], 0.7, 0.9, True), "delayed")
        x = [start.clone()]
        schedule.begin_round(x)
        x[0] -= steps[0]  # the first half of the round
        if early:
            schedule.update_theta([delta])
        x[0] -= steps[1]  # the second half
        if early:
            schedule.rebase(x)
        else:
            schedule.apply([delta], x)
        results.append((schedule.outer.global_params[0].clone(), schedule.outer.momentum_buffers()[0].clone(), x[0]))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert not torch.equal(results[0][0], torch.zeros(5))  # the outer step happened


def test_lookahead_is_the_step_without_side_effects():
    g = torch.Generator().manual_seed(2)
    for lr, mu, nesterov in ((0.7, 0.9, True), (0.7, 0.9, False), (4.0, 0.0, False)):
        outer = OuterOptimizer([torch.randn(6, generator=g)], lr, mu, nesterov)
        for _ in range(3):  # with and without a momentum buffer
            delta = [torch.randn(6, generator=g)]
            theta, momentum = outer.global_params[0].clone(), outer.momentum_buffers()[0].clone()
            ahead = outer.lookahead(delta)
            assert torch.equal(outer.global_params[0], theta) and torch.equal(outer.momentum_buffers()[0], momentum)
            outer.step(delta)
            assert torch.allclose(ahead[0], outer.global_params[0], atol=1e-6)


def test_proxy_start_leaves_theta_and_follows_its_rule():
    g = torch.Generator().manual_seed(3)
    own1, own2, mean1 = (torch.randn(4, generator=g) for _ in range(3))
    for proxy in ("none", "local", "eager"):
        outer = OuterOptimizer([torch.zeros(4)], 0.7, 0.9, True)
        schedule = ExperimentalSchedule(outer, "delayed", proxy)
        x = [torch.ones(4)]
        moved = schedule.start_from_proxy(x, [own1])  # round 1 sent; no mean yet
        assert moved == (proxy != "none")
        assert torch.equal(x[0], torch.ones(4) if proxy == "none" else outer.lookahead([own1])[0])
        schedule.update_theta([mean1], group_size=4)  # round 1's mean arrives
        theta = outer.global_params[0].clone()
        schedule.start_from_proxy(x, [own2])  # round 2 sent
        assert torch.equal(outer.global_params[0], theta)  # the proxy never touches theta
        if proxy == "local":
            assert torch.equal(x[0], outer.lookahead([own2])[0])
        elif proxy == "eager":  # Delta_1 + (c_2 - c_1) / M
            assert torch.allclose(x[0], outer.lookahead([mean1 + (own2 - own1) / 4])[0])
    assert not ExperimentalSchedule(OuterOptimizer([torch.zeros(4)]), "none", "eager").start_from_proxy(
        [torch.ones(4)], [own1])


# ---------------------------------------------------------------------------------------------------------------
# tau-step delays, merge rules and proxies against a reference written from the formulas (docs/algorithms.md,
# "Overlapped rounds"): replica r runs plain SGD on 0.5 |A_r x - b_r|^2, the outer step is SGD (lr eta, no
# momentum), the all-reduce an instant mean that lands tau inner steps into the next round.

def _problems(replicas: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, dim, generator=g), torch.randn(8, generator=g) + r) for r in range(replicas)]


def _grad(a, b, x):
    return a.T @ (a @ x - b) / len(b)


def _reference(problems, rounds, H, tau, eta, lr, merge="rebase", mix=0.5, proxy="none"):
    """x_r: local parameters, s_r: the reference a round's pseudo-gradient is measured from, theta the global
    parameters; every formula written out by hand."""
    dim = problems[0][0].shape[1]
    theta = torch.zeros(dim)
    xs = [theta.clone() for _ in problems]
    refs = [theta.clone() for _ in problems]
    starts = [theta.clone() for _ in problems]
    pending = None
    for _ in range(rounds):
        for k, (a, b) in enumerate(problems):
            for i in range(H):
                if i == tau and pending is not None and k == 0:
                    theta = theta - eta * pending  # theta_t = theta_{t-1} - eta Delta_t
                if i == tau and pending is not None:
                    if merge == "rebase":
                        xs[k] = theta + (xs[k] - starts[k])  # x <- theta_t + u
                    else:
                        xs[k] = mix * xs[k] + (1 - mix) * theta
                    refs[k] = theta.clone()
                xs[k] = xs[k] - lr * _grad(a, b, xs[k])
        if tau >= H and pending is not None:  # the update lands at the round's end
            theta = theta - eta * pending
            for k in range(len(problems)):
                xs[k] = theta + (xs[k] - starts[k]) if merge == "rebase" else mix * xs[k] + (1 - mix) * theta
                refs[k] = theta.clone()
        deltas = [refs[k] - xs[k] for k in range(len(problems))]
        mean = sum(deltas) / len(deltas)
        if tau == 0:
            theta = theta - eta * mean
            xs = [theta.clone() for _ in problems]
            refs = [theta.clone() for _ in problems]
            starts = [theta.clone() for _ in problems]
            continue
        pending = mean
        for k in range(len(problems)):
            if proxy == "local":  # lookahead from theta_{t-1} with our own pseudo-gradient
                xs[k] = theta - eta * deltas[k]
            starts[k] = xs[k].clone()
            refs[k] = xs[k].clone()
    if pending is not None:
        theta = theta - eta * pending
    return theta, xs


def _with_schedule(problems, rounds, H, tau, eta, lr, merge="rebase", mix=0.5, proxy="none"):
    """The same with OuterSchedule (ExperimentalSchedule for the mix merge and the eager proxy), one outer optimizer
    per replica (as on real nodes), driven the way bench/quality.py and the daemon drive it."""
    dim = problems[0][0].shape[1]
    overlap = "none" if tau == 0 else "delayed"
    outer = [OuterOptimizer([torch.zeros(dim)], eta, 0.0, False) for _ in problems]
    schedules = [OuterSchedule(o, overlap, proxy) if merge == "rebase" and proxy != "eager"
                 else ExperimentalSchedule(o, overlap, proxy, merge, mix) for o in outer]
    xs = [[torch.zeros(dim)] for _ in problems]
    for s, x in zip(schedules, xs):
        s.begin_round(x)
    pending = None
    for _ in range(rounds):
        for k, ((a, b), s, x) in enumerate(zip(problems, schedules, xs)):
            for i in range(H):
                if i == tau and pending is not None:
                    s.update_theta(pending)
                    s.merge(x)
                x[0] -= lr * _grad(a, b, x[0])
        if tau >= H and pending is not None:
            for s, x in zip(schedules, xs):
                s.update_theta(pending)
                s.merge(x)
        deltas = [s.pseudo_gradient(x)[0] for s, x in zip(schedules, xs)]
        mean = sum(deltas) / len(deltas)
        for k, (s, x) in enumerate(zip(schedules, xs)):
            if tau == 0:
                s.update_theta([mean])
                s.rebase(x)
            else:
                s.start_from_proxy(x, [deltas[k]])
            s.begin_round(x)
        pending = None if tau == 0 else [mean]
    for s in schedules:
        if pending is not None:
            s.update_theta(pending)
    thetas = [s.outer.global_params[0] for s in schedules]
    assert all(torch.equal(t, thetas[0]) for t in thetas)  # replicas stay bit-identical
    return thetas[0], [x[0] for x in xs]


@pytest.mark.parametrize("tau,merge,proxy", [(0, "rebase", "none"), (1, "rebase", "none"), (3, "rebase", "none"),
                                             (5, "rebase", "none"), (3, "mix", "none"), (5, "mix", "none"),
                                             (3, "rebase", "local"), (5, "rebase", "local")])
def test_overlapped_schedule_equals_the_reference(tau, merge, proxy):
    problems = _problems(3, 6, seed=11)
    ref_theta, ref_x = _reference(problems, 12, 5, tau, eta=0.9, lr=0.05, merge=merge, proxy=proxy)
    theta, xs = _with_schedule(problems, 12, 5, tau, eta=0.9, lr=0.05, merge=merge, proxy=proxy)
    assert torch.allclose(theta, ref_theta, atol=1e-5, rtol=0), (theta, ref_theta)
    for x, r in zip(xs, ref_x):
        assert torch.allclose(x, r, atol=1e-5, rtol=0)


def test_tau_zero_is_synchronous_and_tau_h_is_the_one_step_delay():
    """tau = 0 with the rebase merge equals synchronous DiLoCo, and tau = H (the merge at the round's end)
    equals DiLoCoX's one-step delay: x <- theta_t + (x_end - x_start), delta = x_start - x_end."""
    problems = _problems(2, 4, seed=5)
    sync_theta, _ = _reference(problems, 10, 4, 0, eta=0.7, lr=0.05)
    theta0, _ = _with_schedule(problems, 10, 4, 0, eta=0.7, lr=0.05)
    assert torch.allclose(theta0, sync_theta, atol=1e-5, rtol=0)
    delayed_theta, _ = _with_schedule(problems, 10, 4, 4, eta=0.7, lr=0.05)
    # the one-step delay written the old way: delta from the round's start, rebase at the round's end
    dim = 4
    theta = torch.zeros(dim)
    xs, starts, pending = [theta.clone() for _ in problems], [theta.clone() for _ in problems], None
    for _ in range(10):
        for k, (a, b) in enumerate(problems):
            for _ in range(4):
                xs[k] = xs[k] - 0.05 * _grad(a, b, xs[k])
        deltas = [s - x for s, x in zip(starts, xs)]
        if pending is not None:
            theta = theta - 0.7 * pending
            xs = [theta + (x - s) for x, s in zip(xs, starts)]
        pending = sum(deltas) / len(deltas)
        starts = [x.clone() for x in xs]
    theta = theta - 0.7 * pending
    assert torch.allclose(delayed_theta, theta, atol=1e-5, rtol=0)


def test_replicas_with_different_delays_hold_the_same_theta():
    """Adaptive overlap: each replica merges when its own exchange lands (tau differs per replica); theta,
    what digests, snapshots and checkpoints hold, depends only on the applied means, so it stays equal."""
    g = torch.Generator().manual_seed(4)
    schedules = [OuterSchedule(OuterOptimizer([torch.zeros(5)], 3.5, 0.0, False), "adaptive") for _ in range(3)]
    xs = [[torch.zeros(5)] for _ in range(3)]
    for s, x in zip(schedules, xs):
        s.begin_round(x)
    pending = None
    for t in range(1, 8):
        for k, (s, x) in enumerate(zip(schedules, xs)):
            tau = (k + t) % 4  # 0..3 of H = 4 inner steps
            for i in range(4):
                if i == tau and pending is not None:
                    s.update_theta(pending, 3, outer_step=t - 1)
                    s.merge(x)
                x[0] -= 0.01 * torch.randn(5, generator=g)
            if pending is not None and not s.merged:
                s.update_theta(pending, 3, outer_step=t - 1)
                s.merge(x)
        deltas = [s.pseudo_gradient(x)[0] for s, x in zip(schedules, xs)]
        pending = [sum(deltas) / 3]
        for s, x in zip(schedules, xs):
            s.begin_round(x)
    assert all(torch.equal(s.outer.global_params[0], schedules[0].outer.global_params[0]) for s in schedules)
    assert not torch.equal(xs[0][0], xs[1][0])  # the local trajectories differ


def test_merge_happens_once_per_round_and_rejects_bad_rules():
    outer = OuterOptimizer([torch.zeros(3)], 1.0, 0.0, False)
    s = OuterSchedule(outer, "adaptive")
    x = [torch.ones(3)]
    s.begin_round(x)
    x[0] -= 0.5
    s.update_theta([torch.full((3,), 0.25)])  # theta = -0.25
    s.merge(x)
    assert torch.equal(x[0], torch.full((3,), -0.75))  # theta + (x - start) = -0.25 - 0.5
    s.merge(x)
    s.rebase(x)  # the round's end: already merged, nothing changes
    assert torch.equal(x[0], torch.full((3,), -0.75))
    assert torch.equal(s.pseudo_gradient(x)[0], torch.full((3,), 0.5))  # measured from theta now
    for kwargs in (dict(overlap="sometimes"), dict(proxy="oracle"), dict(proxy="eager")):
        with pytest.raises(ValueError):
            OuterSchedule(OuterOptimizer([torch.zeros(3)]), **kwargs)  # eager: the experimental schedule's alone
    for kwargs in (dict(overlap="sometimes"), dict(proxy="oracle"), dict(merge="average"), dict(mix=1.5)):
        with pytest.raises(ValueError):
            ExperimentalSchedule(OuterOptimizer([torch.zeros(3)]), **kwargs)
