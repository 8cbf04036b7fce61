"""Colluding attacks on the pseudo-gradient: the malicious replicas pool their honest pseudo-gradients and send one
crafted update each round, sized to hide inside what robust aggregation lets through.

The colluders share through a directory (the bench's side channel: ``REDTEAM_COLLUDE_DIR``, with
``REDTEAM_COLLUDERS`` of them): each writes its honest pseudo-gradient for round r, waits up to ``WAIT_S`` for the
others', and crafts from the pool G (m x d, flattened fp32; mu its mean, sigma its coordinate-wise spread):

* ``InnerProductHalf`` / ``InnerProductTwice``: -eps mu with eps 0.5 / 2 (IPM: Xie et al., arXiv 1903.03936);
  ``InnerProductHalfUncommitted``: the same without a start-state commitment (no audit could check it);
* ``LittleIsEnough``: mu - z sigma, z = Phi^-1((n - s) / n), s = floor(n/2 + 1) - m for a group of n
  (ALIE: Baruch et al., arXiv 1902.06156);
* ``MinMax`` / ``MinSum``: mu + gamma p with p = -sigma / ||sigma||, gamma the largest that keeps the update's largest
  distance (min-max) or sum of squared distances (min-sum) to the pool within the pool's own (Shejwalkar and
  Houmansadr, NDSS 2021).

Colluders know only their own honest updates, not the honest members'. With one colluder sigma is taken as |mu| (one
sample has no spread), and min-max / min-sum then have no room (gamma = 0: an honest update).
"""

from __future__ import annotations

import math
import os
import time
import uuid
from pathlib import Path
from statistics import NormalDist

import torch
from dilocox.daemon.redteam import Attack

WAIT_S = 20.0  # the longest a colluder waits for the others' honest pseudo-gradients of a round


class Colluding(Attack):
    """Shares its honest pseudo-gradient with the other colluders and sends ``craft(pool)``."""

    group_size = 5  # n: the swarm the bench runs

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.folder = Path(os.environ.get("REDTEAM_COLLUDE_DIR", "/tmp/dilocox-collude")) / cfg.run_id
        self.folder.mkdir(parents=True, exist_ok=True)
        self.colluders = int(os.environ.get("REDTEAM_COLLUDERS", "1"))
        self.me = uuid.uuid4().hex

    def pseudo_gradient(self, tensors: list[torch.Tensor], round_index: int) -> list[torch.Tensor]:
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        pool = torch.stack(self._share(flat, round_index))
        out = self.craft(pool)
        return [part.view_as(t) for part, t in zip(out.split([t.numel() for t in tensors]), tensors)]

    def _share(self, flat: torch.Tensor, round_index: int) -> list[torch.Tensor]:
        mine = self.folder / f"r{round_index}-{self.me}.pt"
        torch.save(flat, mine.with_suffix(".tmp"))
        mine.with_suffix(".tmp").rename(mine)
        deadline = time.monotonic() + WAIT_S
        while True:
            found = sorted(self.folder.glob(f"r{round_index}-*.pt"))
            if len(found) >= self.colluders or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        pool = []
        for f in found:
            try:
                pool.append(torch.load(f, weights_only=True))
            except (OSError, RuntimeError, EOFError):  # being written by a slower colluder: use the rest
                continue
        return pool or [flat]

    @staticmethod
    def spread(pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu = pool.mean(0)
        sigma = pool.std(0, unbiased=False) if len(pool) > 1 else mu.abs()
        return mu, sigma

    def craft(self, pool: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class InnerProductHalf(Colluding):
    name = "ipm-shared-0.5"
    eps = 0.5

    def craft(self, pool: torch.Tensor) -> torch.Tensor:
        return -self.eps * pool.mean(0)


class InnerProductTwice(InnerProductHalf):
    name = "ipm-shared-2"
    eps = 2.0


class LittleIsEnough(Colluding):
    name = "alie"

    def craft(self, pool: torch.Tensor) -> torch.Tensor:
        n, m = self.group_size, self.colluders
        s = math.floor(n / 2 + 1) - m
        z = NormalDist().inv_cdf(min(max((n - s) / n, 0.5), 0.999))
        mu, sigma = self.spread(pool)
        return mu - z * sigma


class MinMax(Colluding):
    name = "min-max"

    def distance(self, update: torch.Tensor, pool: torch.Tensor) -> float:
        return float(torch.cdist(update[None], pool).max())

    def bound(self, pool: torch.Tensor) -> float:
        return float(torch.cdist(pool, pool).max())

    def craft(self, pool: torch.Tensor) -> torch.Tensor:
        mu, sigma = self.spread(pool)
        p = -sigma / sigma.norm().clamp_min(1e-12)
        limit, lo, hi = self.bound(pool), 0.0, float(mu.norm()) * 10 + 1e-6
        for _ in range(30):  # the largest gamma whose update stays within the pool's own spread
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.distance(mu + mid * p, pool) <= limit else (lo, mid)
        return mu + lo * p


class MinSum(MinMax):
    name = "min-sum"

    def distance(self, update: torch.Tensor, pool: torch.Tensor) -> float:
        return float((torch.cdist(update[None], pool) ** 2).sum())

    def bound(self, pool: torch.Tensor) -> float:
        return float((torch.cdist(pool, pool) ** 2).sum(1).max())


class InnerProductHalfUncommitted(InnerProductHalf):
    """``ipm-0.5`` that commits no start state, so that no audit could check it: where the swarm audits, every member
    leaves its contributions out (peers/allgather.py ``screen_gathered``)."""

    name = "ipm-shared-0.5-uncommitted"

    def gather(self, fields: dict, round_index: int) -> dict:
        return {**fields, "state_sha256": "", "state_bytes": 0}
