"""Splitting a labelled dataset across federated clients: IID, label shards, Dirichlet.

A partition spec is one of:
  * ``iid``: a seeded permutation of all samples cut into num_clients parts whose sizes differ by at
    most one;
  * ``label-shards:K``: the pathological non-IID split of FedAvg (McMahan et al., arXiv 1602.05629,
    sec. 3), the one our BadSFL reproduction (arXiv 2411.16167) uses: sort the samples by label
    (stable), cut them into num_clients * K contiguous shards, give each client K shards chosen by a
    seeded permutation. Fashion-MNIST (60,000 train, 6,000 per class): 100 clients x K=2 -> 200
    shards of 300 (FedAvg's setting); 20 clients x K=2 -> 40 shards of 1,500, each inside one class
    (6,000 / 1,500 = 4 shards per class), so every client holds 2 classes, or 1 when both its shards
    come from the same class; 20 clients x K=10 -> 200 shards of 300, up to 10 classes each;
  * ``classes:K``: NIID-Bench's "#C=K" quantity-based label skew (Li et al., arXiv 2102.02079,
    sec. 4.1): every client holds exactly K distinct labels. The labels are dealt from a seeded
    permutation, client i taking entries (iK + j) mod L, j < K, of it (L labels), so each label has an
    owner once num_clients * K >= L (required); each label's samples are shuffled and split equally
    among its owners;
  * ``dirichlet:ALPHA``: label-distribution skew of NIID-Bench (Li et al., arXiv 2102.02079, sec. 4.1;
    after Yurochkin et al., arXiv 1905.12022): for each class k, p_k ~ Dir(ALPHA, ..., ALPHA) over the
    num_clients clients, and client j gets a p_{k,j} fraction of class k's (shuffled) samples (the
    floor of the cumulative fractions sets the cuts). Small ALPHA (0.1)
    gives clients few classes, large ALPHA (100) approaches IID. A client may get no samples at
    all when ALPHA is small or clients are many: callers that need data on every client check.

Every split is a pure function of (labels, num_clients, spec, seed): numpy.random.default_rng(seed)
is the only randomness. The returned index arrays are int64, sorted ascending, pairwise disjoint, and
together cover all N samples (label shards whose count does not divide N differ in size by one
sample instead of dropping the remainder).
"""

from __future__ import annotations

import math

import numpy as np
import torch

KINDS = ("iid", "label-shards", "classes", "dirichlet")


def local_epochs_to_steps(epochs: float, train_samples: int, clients: int, batch_size: int) -> int:
    """K (= H, inner steps per round) for ``epochs`` passes over a client's mean share of the training set:
    ceil(epochs * (train_samples / clients) / batch_size), at least 1. Samples are images, or tokens with
    ``batch_size`` in tokens per step. Label shards give every client the same share; under Dirichlet
    splits the mean share sets one K for all, as a swarm's rounds need one H (the aggregation weights stay
    equal). Raises ValueError for epochs <= 0, clients < 1 or batch_size < 1."""
    if not epochs > 0 or clients < 1 or batch_size < 1 or train_samples < 0:
        raise ValueError(f"need epochs > 0, clients >= 1, batch_size >= 1 and train_samples >= 0; got {epochs}, "
                         f"{clients}, {batch_size}, {train_samples}")
    return max(1, math.ceil(epochs * (train_samples / clients) / batch_size))


def _labels_array(labels: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    labels = np.asarray(labels)
    if labels.ndim != 1 or len(labels) == 0:
        raise ValueError(f"labels must be a non-empty 1-D array, got shape {labels.shape}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be integers, got {labels.dtype}")
    return labels.astype(np.int64)


def _parse(spec: str) -> tuple[str, float | int | None]:
    kind, sep, arg = spec.partition(":")
    if kind not in KINDS:
        raise ValueError(f"unknown partition kind {kind!r} in {spec!r} (known: iid, label-shards:K, classes:K, "
                         f"dirichlet:ALPHA)")
    if kind == "iid":
        if sep:
            raise ValueError(f"partition 'iid' takes no parameter, got {spec!r}")
        return kind, None
    if not arg:
        raise ValueError(f"partition {kind!r} needs a parameter: {kind}:{'ALPHA' if kind == 'dirichlet' else 'K'}")
    if kind in ("label-shards", "classes"):
        try:
            k = int(arg)
        except ValueError:
            raise ValueError(f"{kind}:K needs an integer K, got {arg!r}") from None
        if k < 1:
            what = "shards" if kind == "label-shards" else "labels"
            raise ValueError(f"{kind}:K needs K >= 1 {what} per client, got {k}")
        return kind, k
    try:
        alpha = float(arg)
    except ValueError:
        raise ValueError(f"dirichlet:ALPHA needs a number, got {arg!r}") from None
    if not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"dirichlet:ALPHA needs a finite ALPHA > 0, got {arg!r}")
    return kind, alpha


def partition(labels: np.ndarray | torch.Tensor, num_clients: int, spec: str, seed: int) -> list[np.ndarray]:
    """Split sample indices 0..N-1 among ``num_clients`` clients according to ``spec`` (module docstring).

    labels: integer [N]. Returns num_clients int64 index arrays (sorted, disjoint, covering 0..N-1).
    Raises ValueError naming the problem: unknown kind or malformed parameter, K < 1, ALPHA not > 0,
    num_clients < 1, more clients (iid) or shards (label-shards) than samples, labels not integer 1-D.
    """
    kind, arg = _parse(spec)
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    y = _labels_array(labels)
    n = len(y)
    rng = np.random.default_rng(seed)
    if kind == "iid":
        if num_clients > n:
            raise ValueError(f"iid: {num_clients} clients but only {n} samples")
        parts = np.array_split(rng.permutation(n), num_clients)
    elif kind == "label-shards":
        num_shards = num_clients * int(arg)
        if num_shards > n:
            raise ValueError(f"label-shards:{arg}: {num_clients} x {arg} = {num_shards} shards but only {n} samples")
        shards = np.array_split(np.argsort(y, kind="stable"), num_shards)
        owner = rng.permutation(num_shards).reshape(num_clients, int(arg))
        parts = [np.concatenate([shards[s] for s in row]) for row in owner]
    elif kind == "classes":
        parts = _by_classes(y, num_clients, int(arg), rng)
    else:
        buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for k in np.unique(y):
            idx = rng.permutation(np.flatnonzero(y == k))
            p = rng.dirichlet(np.full(num_clients, float(arg)))
            # floor of cumulative proportions: cuts are monotone and the last client takes the rest
            cuts = np.floor(np.cumsum(p)[:-1] * len(idx)).astype(np.int64)
            for j, piece in enumerate(np.split(idx, cuts)):
                buckets[j].append(piece)
        parts = [np.concatenate(b) for b in buckets]
    return [np.sort(p).astype(np.int64) for p in parts]


def _by_classes(y: np.ndarray, num_clients: int, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    """classes:K (module docstring): K labels per client, each label's samples split equally among its owners."""
    labels = np.unique(y)
    if k > len(labels):
        raise ValueError(f"classes:{k}: only {len(labels)} labels to choose from")
    if num_clients * k < len(labels):
        raise ValueError(f"classes:{k}: {num_clients} clients x {k} labels cannot own all {len(labels)} labels")
    dealt = rng.permutation(labels)
    owned = [[dealt[(i * k + j) % len(labels)] for j in range(k)] for i in range(num_clients)]
    owners = {int(c): [i for i in range(num_clients) if c in owned[i]] for c in labels}
    buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in labels:
        idx = rng.permutation(np.flatnonzero(y == c))
        for i, piece in zip(owners[int(c)], np.array_split(idx, len(owners[int(c)]))):
            buckets[i].append(piece)
    return [np.concatenate(b) if b else np.zeros(0, np.int64) for b in buckets]
