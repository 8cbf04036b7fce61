"""The published baselines the BadSFL paper compares against (bench/attacks/badsfl/defenses.py): their rules on
hand-made updates, and one round of each inside the harness."""

from __future__ import annotations

import pytest
import torch

from bench.attacks.badsfl.defenses import Defense, flame_clusters, median_norm
from dilocox import vision

pytest.importorskip("sklearn", reason="the bench extra (scikit-learn's HDBSCAN) is installed by make install")


def _updates(honest: int, bad: int, d: int = 400, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(d, generator=g, dtype=torch.float64)
    out = {f"h{i}": base + 0.3 * torch.randn(d, generator=g, dtype=torch.float64) for i in range(honest)}
    # the attackers share a direction of their own, 10x longer
    evil = torch.randn(d, generator=g, dtype=torch.float64)
    out.update({f"m{i}": 10 * (evil + 0.1 * torch.randn(d, generator=g, dtype=torch.float64)) for i in range(bad)})
    return out


def test_flame_admits_the_honest_cluster_only():
    updates = _updates(honest=7, bad=3)
    admitted = flame_clusters(updates)
    # HDBSCAN may leave an honest outlier out too; never an attacker, and always a majority (n/2 + 1)
    assert all(k.startswith("h") for k in admitted) and len(admitted) >= 6, admitted
    out = Defense("flame").aggregate(updates)
    assert out.admitted == admitted
    # every admitted update clipped to the median norm, so the mean is no longer than it
    assert float(out.aggregate.norm()) <= out.clip * 1.01
    assert out.clip == pytest.approx(median_norm(updates))
    # noise at lambda S_t per coordinate: the aggregate is not the plain mean of the admitted ones
    assert out.detail["sigma"] == pytest.approx(0.001 * out.clip)


def test_flame_admits_a_majority_and_leaves_a_round_of_two_alone():
    g = torch.Generator().manual_seed(1)
    orthogonal = {f"c{i}": torch.randn(2000, generator=g, dtype=torch.float64) for i in range(5)}
    assert len(flame_clusters(orthogonal)) >= 3  # a cluster is at least a majority
    assert flame_clusters(_updates(honest=1, bad=1)) == ["h0", "m0"]
    with pytest.raises(ValueError, match="no client"):
        Defense("flame").aggregate({})
    with pytest.raises(ValueError, match="expected one of"):
        Defense("krum")


def test_sparsefed_applies_the_top_k_of_its_accumulator_and_keeps_the_rest():
    d = Defense("sparsefed", sparse_fraction=0.25)
    v = torch.tensor([4.0, -3.0, 2.0, 1.0], dtype=torch.float64)
    out = d.aggregate({"a": v, "b": v.clone()})
    assert out.aggregate.tolist() == [4.0, 0.0, 0.0, 0.0]  # k = 1 of 4; the norms equal the median: no clipping
    assert d.error.tolist() == [0.0, -3.0, 2.0, 1.0]
    out = d.aggregate({"a": v, "b": v.clone()})
    assert out.aggregate.tolist() == [0.0, -6.0, 0.0, 0.0]  # the withheld -3 came back with the new -3
    # a long update is clipped to the median norm before it reaches the accumulator
    d2 = Defense("sparsefed", sparse_fraction=1.0)
    long = {"a": v, "b": v.clone(), "c": 100 * v}
    assert float(d2.aggregate(long).aggregate.norm()) == pytest.approx(float(v.norm()))


def test_dp_prune_zeroes_the_least_active_channels_of_the_deployed_model_only():
    model = vision.build_image_model("simple-cnn", 10, 0)
    params = [p.detach().clone() for p in model.parameters()]
    conv = 2  # the second convolution's weight [20, 10, 5, 5]; its bias follows
    params[conv][3].zero_()
    params[conv + 1][3] = -5.0  # channel 3 is dead on any input: ReLU(-5) = 0
    d = Defense("dp-prune", prune_fraction=0.1)
    x = vision.preprocess(torch.randint(0, 255, (8, 28, 28), dtype=torch.uint8))
    from bench.attacks.badsfl.sim import last_conv_activations
    d.rank_channels(model, params, [x, x], last_conv_activations)
    assert len(d.pruned) == 2 and 3 in d.pruned
    deployed = d.deployed(params)
    for c in d.pruned:
        assert deployed[conv][c].abs().sum() == 0 and deployed[conv + 1][c] == 0
    assert params[conv + 1][3] == -5.0  # training goes on from the unpruned theta
    assert Defense("flame").deployed(params) is params


def test_every_quiet_restart_setting_of_the_harness_is_one_the_daemon_accepts():
    """The harness's quiet restart is dilocox.scaffold.QuietRestart, the daemon's (tests/test_scaffold.py tests the
    rule); each setting's knobs must be valid for it, and match the daemon flags of the same name."""
    from dilocox.daemon.config import NodeConfig

    from bench.attacks.badsfl.run import SETTINGS
    from dilocox.scaffold import QuietRestart

    quiet = [s for s in SETTINGS if s.c_reset_quiet]
    assert len(quiet) >= 4
    for s in quiet:
        QuietRestart(s.c_reset_quiet, s.c_quiet_factor, s.c_quiet_rounds, s.c_outsized, s.c_quiet_every)
        cfg = NodeConfig(model="tiny", data="x", outer_algorithm="scaffold", scaffold_reset_quiet=s.c_reset_quiet,
                         scaffold_quiet_factor=s.c_quiet_factor, scaffold_quiet_rounds=s.c_quiet_rounds,
                         scaffold_outsized=s.c_outsized, scaffold_quiet_every=s.c_quiet_every, norm_bound=s.norm_bound)
        assert cfg.norm_bound == s.norm_bound > 0 and cfg.aggregation == s.rule == "mean"  # the default's rule
    assert {s.norm_bound for s in quiet} >= {NodeConfig(model="tiny", data="x").norm_bound}
