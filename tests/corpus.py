"""Synthetic text documents for tokenizer and data tests: random sentences over a few words, the same for a seed."""

from __future__ import annotations

import numpy as np

WORDS = ("the swarm trains one model over slow links while peers come and go " * 3).split()


def documents(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(40, 120)))) + f". Document {i}.\n" for i in range(n)]
