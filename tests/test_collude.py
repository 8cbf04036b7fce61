"""The colluding red-team attacks (bench/attacks/collude.py): what each crafts from the colluders' pooled honest
pseudo-gradients, and the pooling itself through the bench's side-channel directory."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from bench.attacks.collude import InnerProductHalf, InnerProductTwice, LittleIsEnough, MinMax, MinSum


def _attack(cls, tmp_path, monkeypatch, colluders=2):
    monkeypatch.setenv("REDTEAM_COLLUDE_DIR", str(tmp_path))
    monkeypatch.setenv("REDTEAM_COLLUDERS", str(colluders))
    return cls(SimpleNamespace(run_id="run"))


def test_each_craft_from_the_pool(tmp_path, monkeypatch):
    torch.manual_seed(0)
    pool = torch.randn(2, 1000) + 1.0
    mu, sigma = pool.mean(0), pool.std(0, unbiased=False)
    assert torch.allclose(_attack(InnerProductHalf, tmp_path, monkeypatch).craft(pool), -0.5 * mu)
    assert torch.allclose(_attack(InnerProductTwice, tmp_path, monkeypatch).craft(pool), -2.0 * mu)
    # ALIE, n = 5, m = 2: s = 1, z = Phi^-1(4/5)
    assert torch.allclose(_attack(LittleIsEnough, tmp_path, monkeypatch).craft(pool), mu - 0.8416 * sigma, atol=1e-3)
    mm = _attack(MinMax, tmp_path, monkeypatch).craft(pool)
    assert float(torch.cdist(mm[None], pool).max()) <= float(torch.cdist(pool, pool).max()) * (1 + 1e-4)
    assert not torch.allclose(mm, mu) and float(torch.dot(mm - mu, sigma)) < 0  # pushed against the spread
    ms = _attack(MinSum, tmp_path, monkeypatch).craft(pool)
    assert float((torch.cdist(ms[None], pool) ** 2).sum()) <= float((torch.cdist(pool, pool) ** 2).sum(1).max()) * \
        (1 + 1e-4)
    # one colluder: no spread to hide in, min-max sends its honest update
    alone = _attack(MinMax, tmp_path, monkeypatch, colluders=1).craft(pool[:1])
    assert torch.allclose(alone, pool[0], atol=1e-5)


def test_colluders_pool_their_honest_updates_through_the_side_channel(tmp_path, monkeypatch):
    a, b = (_attack(InnerProductHalf, tmp_path, monkeypatch) for _ in range(2))
    mine = {a: [torch.full((2, 3), 1.0)], b: [torch.full((2, 3), 3.0)]}
    sent = {}
    threads = [threading.Thread(target=lambda x=x: sent.__setitem__(x, x.pseudo_gradient(mine[x], 4))) for x in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for x in (a, b):  # both send -0.5 x the pool's mean (2.0), in the parameters' shapes
        assert [tuple(t.shape) for t in sent[x]] == [(2, 3)] and torch.allclose(sent[x][0], torch.full((2, 3), -1.0))
