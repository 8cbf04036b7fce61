"""Robust learning rate: each coordinate's outer step keeps, reverses or drops its sign by how many agree on it.

Ozdayi, Kantarcioglu and Gel, "Defending against backdoors in federated learning with robust learning rate",
AAAI 2021 (arXiv 2007.03767), eq. 3: for coordinate j of the round's k contributions Delta_i,

    s_j = |sum_i sign(Delta_i,j)|,    eta_j = +eta if s_j >= theta else -eta,

and the server applies eta (.) aggregate. A backdoor needs coordinates that only its sender pushes steadily
(weights reading a trigger no honest image holds); there the honest contributors' signs disagree, so s_j is
small and the step on that coordinate is reversed (``SignRule.FLIP``, the paper's rule: it moves theta away from
what the attacker pushed, so a backdoor that got in is unlearned) or left out (``SignRule.MASK``: nothing is
applied there, so nothing new gets in, and nothing is unlearned).

``SignPolicy`` is the rule as a swarm setting (the daemon's ``--robust-lr``): it can act only in rounds where the
norm bound scaled a contribution far down (an attacker's boosted update), so a swarm without an attack pays nothing.

In a sparse round (dilocox/sparse/aggregate.py) the rows are the decoded values on the union of the sent positions,
zero where a member sent nothing, so a position few members sent has low agreement and is reversed too: every-round
use there reverses most positions one member alone chose (measured only on the BadSFL harness's dense rounds;
docs/security.md).

Here theta = ``ceil(min_agreement * k)`` so one setting serves groups of any size (the paper fixes theta for 10
agents a round; its theta = 4 of 10 is ``min_agreement`` 0.35 to 0.4). Signs and integer sums are exact, so every
member of a group computes the same mask bit for bit from the same contributions, whatever its hardware.

Errors: ValueError for no rows, rows of different lengths, an unknown rule, or ``min_agreement`` outside (0, 1].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Sequence

import torch


class SignRule(str, Enum):
    """What a coordinate whose sign agreement is under the threshold gets."""

    OFF = "off"    # the aggregate as the robust rule returned it
    FLIP = "flip"  # -1 x its value: the paper's robust learning rate
    MASK = "mask"  # 0


def threshold(min_agreement: float, k: int) -> int:
    """theta = ceil(``min_agreement`` x k) >= 1: the least |sum of signs| a coordinate of k contributions needs."""
    if not 0.0 < min_agreement <= 1.0 or math.isnan(min_agreement):
        raise ValueError(f"min_agreement {min_agreement!r}: expected a fraction in (0, 1]")
    if k < 1:
        raise ValueError("no contribution to count signs of")
    return max(1, math.ceil(min_agreement * k - 1e-12))


def agreement(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """int32 [d]: |sum_i sign(row_i)| per coordinate (a zero counts 0) over k flat rows of one length d."""
    if not rows:
        raise ValueError("no contribution to count signs of")
    d = rows[0].numel()
    total = torch.zeros(d, dtype=torch.int32)
    for row in rows:
        if row.numel() != d:
            raise ValueError(f"contributions of {d} and {row.numel()} values: expected one length")
        total += torch.sign(row.reshape(-1)).to(torch.int32)
    return total.abs_()


def learning_rate_signs(rows: Sequence[torch.Tensor], min_agreement: float, rule: SignRule | str) -> torch.Tensor:
    """float64 [d]: the per-coordinate factor eta_j / eta: 1 where the agreement reaches ``threshold``, else -1
    (``FLIP``) or 0 (``MASK``); all ones for ``OFF``."""
    rule = SignRule(rule)
    if rule is SignRule.OFF:
        return torch.ones(rows[0].numel() if rows else 0, dtype=torch.float64)
    low = agreement(rows) < threshold(min_agreement, len(rows))
    out = torch.ones(low.shape, dtype=torch.float64)
    out[low] = -1.0 if rule is SignRule.FLIP else 0.0
    return out


def apply(aggregate: torch.Tensor, rows: Sequence[torch.Tensor], min_agreement: float,
          rule: SignRule | str) -> tuple[torch.Tensor, int]:
    """(``aggregate`` with each coordinate multiplied by its ``learning_rate_signs`` factor, the number of
    coordinates under the threshold). ``aggregate``: flat [d], the robust rule's output over ``rows``; unchanged
    (the same tensor) for ``OFF``. Adding +0.0 keeps -0.0 out of the result (robust.py's canonical zeros)."""
    rule = SignRule(rule)
    if rule is SignRule.OFF:
        return aggregate, 0
    factors = learning_rate_signs(rows, min_agreement, rule)
    if factors.numel() != aggregate.numel():
        raise ValueError(f"aggregate of {aggregate.numel()} values over contributions of {factors.numel()}")
    low = int((factors != 1.0).sum())
    return (aggregate.reshape(-1) * factors.to(aggregate.dtype) + 0.0).reshape(aggregate.shape), low


class When(str, Enum):
    """In which rounds a ``SignPolicy`` acts."""

    ALWAYS = "always"
    OUTSIZED = "outsized"  # rounds where the norm bound scaled a contribution below 1 / outsized


@dataclass(frozen=True)
class SignPolicy:
    """The robust learning rate as a swarm setting: ``rule`` on coordinates under ``ceil(min_agreement x k)``, in
    every round or (``when`` = OUTSIZED) only in rounds with an outsized contribution: one the norm bound scaled
    by less than 1 / ``outsized`` (an attacker's boosted update; without an attack no round is outsized and the
    policy costs nothing). A scale of 0 is a contribution the opposition screen left out, not an outsized one.

    Errors: ValueError for ``min_agreement`` outside (0, 1] or ``outsized`` < 1."""

    rule: SignRule = SignRule.FLIP
    min_agreement: float = 0.35
    when: When = When.OUTSIZED
    outsized: float = 4.0

    def __post_init__(self):
        object.__setattr__(self, "rule", SignRule(self.rule))
        object.__setattr__(self, "when", When(self.when))
        threshold(self.min_agreement, 1)
        if not self.outsized >= 1.0:
            raise ValueError(f"outsized {self.outsized!r}: expected a factor >= 1")

    def acts(self, scales: Iterable[float]) -> bool:
        """Whether a round whose rule scaled its contributions by ``scales`` (those below 1 suffice) gets the rule."""
        if self.rule is SignRule.OFF:
            return False
        return self.when is When.ALWAYS or any(0.0 < float(s) < 1.0 / self.outsized for s in scales)

    def apply(self, aggregate: torch.Tensor, rows: Sequence[torch.Tensor],
              scales: Iterable[float]) -> tuple[torch.Tensor, int]:
        """``apply`` (module function) with this policy's rule where ``acts(scales)``; else (aggregate, 0)."""
        if not self.acts(scales):
            return aggregate, 0
        return apply(aggregate, rows, self.min_agreement, self.rule)
