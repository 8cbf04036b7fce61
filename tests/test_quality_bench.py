"""bench/quality.py's in-process replicas: a few rounds of each codec path train, report honest payload
sizes, and give the same curve for the same seed (identical data order and init)."""

from __future__ import annotations

import pytest

from bench.quality import METHODS, run

SMALL = dict(replicas=2, inner_steps=3, outer_steps=3, model="tiny", eval_every=1, eval_batches=2,
             data="builtin:shakespeare")


def test_codecs_train_and_report_their_payload():
    fp32 = run(METHODS["fp32"], 7, **SMALL)
    curve = [p["val_loss"] for p in fp32["curve"]]
    assert curve[-1] < curve[0] - 0.05, curve  # 9 inner steps, still in the warm-up
    assert fp32["compression_ratio"] == 1.0 and fp32["payload_bytes"] == fp32["fp32_bytes"]
    sparse = run(METHODS["sparse"], 7, **SMALL)
    assert sparse["compression_ratio"] > 100  # indices, codes, scales and header all counted
    adaptive = run(METHODS["adaptive-delayed"], 7, **SMALL)
    assert 1 < adaptive["compression_ratio"] < sparse["compression_ratio"]
    for r in (sparse, adaptive):
        assert r["curve"][-1]["val_loss"] < r["curve"][0]["val_loss"], r["curve"]


def test_same_seed_same_curve():
    a, b = (run(METHODS["int8"], 3, **SMALL) for _ in range(2))
    assert [p["val_loss"] for p in a["curve"]] == [p["val_loss"] for p in b["curve"]]


def test_the_default_row_is_the_daemons_default_configuration():
    """bench.quality.DEFAULT names the row whose flags the daemon's defaults equal, so the quality table's
    'default' line measures what a user gets."""
    import argparse

    from dilocox.daemon.config import add_flags, load_config

    from bench.quality import DEFAULT, daemon_flags

    parser = argparse.ArgumentParser()
    add_flags(parser)
    explicit = load_config(vars(parser.parse_args(daemon_flags(METHODS[DEFAULT]))), environ={})
    assert explicit == load_config({}, environ={})


def test_the_measured_shared_row_is_the_daemons_shared_configuration():
    """--compression shared's defaults are the union row measured with the reducer's feedback at 8 replicas
    (shared-union-k256-r4-a3.1-5.6-rf), so bench.quality_swarm can confirm it on real nodes."""
    import argparse

    from dilocox.daemon.config import add_flags, load_config

    from bench.quality import daemon_flags

    parser = argparse.ArgumentParser()
    add_flags(parser)
    explicit = load_config(vars(parser.parse_args(daemon_flags(METHODS["shared-union-k256-r4-a3.1-5.6-rf"]))), {})
    assert explicit == load_config({"compression": "shared"}, environ={})
    with pytest.raises(ValueError, match="ablation of the benchmark only"):
        daemon_flags(METHODS["shared-union-k256-r4-a3.1-5.6-rfp"])


def test_a_resparsified_aggregate_trains_and_its_upload_does_not_grow_with_the_group():
    """The default with its aggregate cut to 2 x topk per chunk (dilocox/experimental/resparsify.py): it trains, and a
    member's upload is (payload + result) x (k - 1) / k, below the all-gather's (k - 1) x payload at k = 4."""
    from bench.quality import DEFAULT

    four = dict(SMALL, replicas=4)
    plain, cut = run(METHODS[DEFAULT], 7, **four), run(METHODS[f"{DEFAULT}-gtopk2"], 7, **four)
    assert plain["upload_bytes"] == 3 * plain["payload_bytes"]
    assert 1.5 * cut["payload_bytes"] < cut["upload_bytes"] < 2.5 * cut["payload_bytes"]
    assert abs(cut["compression_ratio"] / plain["compression_ratio"] - 1) < 0.01  # Rice: lengths vary a little
    assert cut["curve"][-1]["val_loss"] < cut["curve"][0]["val_loss"], cut["curve"]
    assert cut["curve"][-1]["val_loss"] != plain["curve"][-1]["val_loss"]  # the cut changed what was applied


def test_rounds_on_a_shared_index_set_train_and_their_upload_stays_flat_as_the_group_grows():
    """The default on the leader's index set (dilocox/experimental/selections.py): it trains, and a member's upload,
    (values + result + index set) x (k - 1) / k, grows by (k - 1) / k from 2 to 4 members where the
    all-gather's grows 3-fold."""
    method = METHODS["shared-leader-k128-r8"]
    two, four = run(method, 7, **SMALL), run(method, 7, **dict(SMALL, replicas=4))
    assert abs(four["upload_bytes"] / two["upload_bytes"] - 1.5) < 0.05  # (3/4) / (1/2), index sets vary a little
    assert four["upload_bytes"] < 2 * four["payload_bytes"]
    assert four["compression_ratio"] > 100
    for r in (two, four):
        assert r["curve"][-1]["val_loss"] < r["curve"][0]["val_loss"], r["curve"]
