"""Pure math: the offset encoding makes hivemind's per-peer arithmetic agree bit for bit."""

from __future__ import annotations

import pytest
import torch

from dilocox import exact_mean


def hivemind_style_mean(contributions, weights):
    """What hivemind's butterfly does per part: the reducer averages once (TensorPartReducer),
    each peer then adds (mean - own) to its own tensor (allreduce.py / averager.py)."""
    acc = torch.zeros_like(contributions[0])
    for c, w in zip(contributions, weights):
        acc.add_(c, alpha=w)
    mean = acc.div_(sum(weights))
    return [c + (mean - c) for c in contributions]


def test_plain_fp32_mean_differs_between_peers():
    torch.manual_seed(0)
    xs = [torch.randn(10_000) * 10 ** torch.randint(-4, 2, (10_000,)) for _ in range(3)]
    results = hivemind_style_mean(xs, [1.0, 1.0, 1.0])
    assert not torch.equal(results[0], results[1])  # the problem the encoding solves


def test_offset_encoding_gives_bit_identical_means():
    torch.manual_seed(1)
    bound = 0.05
    offset = exact_mean.offset_for(bound)
    xs = [(torch.rand(20_000) * 2 - 1) * bound * torch.rand(20_000) for _ in range(4)]
    weights = [20.0, 20.0, 7.0, 13.0]
    encoded = [exact_mean.encode(x, offset)[0] for x in xs]
    results = [exact_mean.decode(r, offset) for r in hivemind_style_mean(encoded, weights)]
    for r in results[1:]:
        assert torch.equal(r, results[0])
    true = sum(w * x.double() for w, x in zip(weights, xs)) / sum(weights)
    assert (results[0].double() - true).abs().max() <= offset * 2**-22


def test_encode_reports_clipping():
    y, clipped = exact_mean.encode(torch.tensor([0.0, 1.0, -3.0]), offset=4.0)
    assert clipped == 1 and torch.equal(exact_mean.decode(y, 4.0), torch.tensor([0.0, 1.0, -1.0]))


def test_adamw_movement_stays_inside_the_bound():
    torch.manual_seed(2)
    p = torch.nn.Parameter(torch.randn(5000) * 0.02)
    start = p.detach().clone()
    lrs = [1e-3 * (i + 1) / 50 for i in range(50)]
    opt = torch.optim.AdamW([p], lr=lrs[0], betas=(0.9, 0.95), weight_decay=0.1)
    for i, lr in enumerate(lrs):
        opt.param_groups[0]["lr"] = lr
        # adversarial-ish gradients: long constant runs then sign flips and spikes
        g = torch.sign(torch.randn(5000)) * (1.0 if i % 10 else 100.0)
        p.grad = g if i < 25 else -g
        opt.step()
    moved = (p.detach() - start).abs().max().item()
    bound = exact_mean.pseudo_gradient_bound(sum(lrs), 0.1, start.abs().max().item(),
                                             exact_mean.adam_step_bound(0.9, 0.95))
    assert moved <= bound
    assert bound < 20 * sum(lrs)  # and it is not uselessly loose


def test_unbounded_betas_are_rejected():
    with pytest.raises(ValueError, match="beta1"):
        exact_mean.adam_step_bound(0.99, 0.9)


def test_clipped_sgd_movement_stays_inside_the_bound():
    """--inner-optimizer sgd: clipped gradients, momentum and coupled weight decay (exact_mean.inner_step_bound)."""
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(2000) * 0.5)
    start = p.detach().clone()
    lrs = [0.01] * 60
    opt = torch.optim.SGD([p], lr=lrs[0], momentum=0.9, weight_decay=0.01)
    for i, lr in enumerate(lrs):
        opt.param_groups[0]["lr"] = lr
        p.grad = torch.zeros(2000)
        p.grad[0] = 1e3  # the whole norm on one coordinate, always the same sign: the worst case per coordinate
        torch.nn.utils.clip_grad_norm_([p], 1.0)
        opt.step()
    moved = (p.detach() - start).abs().max().item()
    step_bound, decay = exact_mean.inner_step_bound("sgd", (0.9, 0.95), 0.9, 1.0)
    assert (step_bound, decay) == (pytest.approx(10.0), pytest.approx(10.0))
    bound = exact_mean.pseudo_gradient_bound(sum(lrs), 0.01 * decay, start.abs().max().item(), step_bound)
    assert moved <= bound and bound < 2 * moved  # holds, and is not uselessly loose
    with pytest.raises(ValueError, match="momentum"):
        exact_mean.sgd_step_bound(1.0, 1.0)
    with pytest.raises(ValueError, match="no step bound"):
        exact_mean.inner_step_bound("lion", (0.9, 0.95), 0.0, 1.0)
