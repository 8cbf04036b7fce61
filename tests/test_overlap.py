"""The one-step-delay schedule with an instant network tracks synchronous DiLoCo (pure math)."""

from __future__ import annotations

import torch

from dilocox.diloco import OuterOptimizer
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
        schedule = OuterSchedule(outer, "delayed", proxy)
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
    assert not OuterSchedule(OuterOptimizer([torch.zeros(4)]), "none", "eager").start_from_proxy([torch.ones(4)],
                                                                                               [own1])
