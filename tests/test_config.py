"""Config precedence and validation (flag > env > file > default; unknown names are errors)."""

from __future__ import annotations

import argparse
import math
import os

import pytest
from dilocox.daemon.config import ConfigError, add_flags, load_config
from dilocox.daemon.config_sections import DEFAULT_AUDIT_RATE, IMAGE_DATA, data_digest


def parse(argv):
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return vars(parser.parse_args(argv))


def test_precedence(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('inner_steps = 7\nouter_lr = 0.5\nrun_id = "fromfile"\njoin = ["/ip4/127.0.0.1/tcp/1"]\n')
    env = {"DILOCOX_OUTER_LR": "0.4", "DILOCOX_RUN_ID": "fromenv"}
    cfg = load_config(parse(["--config", str(f), "--run-id", "fromflag"]), env)
    assert (cfg.inner_steps, cfg.outer_lr, cfg.run_id) == (7, 0.4, "fromflag")
    assert cfg.join == ["/ip4/127.0.0.1/tcp/1"] and cfg.outer_momentum == 0.0  # the default codec's (sparse)
    cfg = load_config(parse(["--join", "/a", "--join", "/b", "--no-nesterov"]), {"DILOCOX_LISTEN": "/x,/y"})
    assert cfg.join == ["/a", "/b"] and cfg.listen == ["/x", "/y"] and cfg.nesterov is False


def test_outer_optimizer_defaults_follow_the_compression_and_explicit_values_win():
    sparse = load_config({}, {})
    assert (sparse.compression, sparse.outer_momentum, sparse.nesterov) == ("sparse", 0.0, False)
    assert sparse.outer_lr > 1  # plain SGD on error-feedback means takes a larger step (docs/algorithms.md)
    assert sparse.outer_lr_final > sparse.outer_lr  # ramped up over the cosine schedule (measured)
    assert load_config(parse(["--outer-lr", "3"]), {}).outer_lr_final == 3.0  # a chosen lr stays constant
    ramp = load_config(parse(["--outer-lr", "1", "--outer-lr-final", "2"]), {})
    assert (ramp.outer_lr, ramp.outer_lr_final) == (1.0, 2.0)
    dense = load_config(parse(["--compression", "int8"]), {})
    assert (dense.outer_lr, dense.outer_momentum, dense.nesterov) == (0.7, 0.9, True)  # DiLoCo's recipe
    assert dense.outer_lr_final is None  # constant
    mixed = load_config(parse(["--compression", "sparse", "--outer-momentum", "0.5"]), {"DILOCOX_OUTER_LR": "2"})
    assert (mixed.outer_lr, mixed.outer_momentum, mixed.nesterov) == (2.0, 0.5, False)
    with pytest.raises(ConfigError, match="sparse_bits"):
        load_config(parse(["--sparse-bits", "3"]), {})
    with pytest.raises(ConfigError, match="sparse_topk"):
        load_config(parse(["--sparse-topk", "64", "--sparse-chunk", "32"]), {})


def test_shared_compression_takes_its_measured_outer_lr_and_refuses_what_it_cannot_run():
    shared = load_config(parse(["--compression", "shared"]), {})
    assert (shared.outer_lr, shared.outer_lr_final, shared.aggregation, shared.norm_bound) == \
        (3.1, 5.6, "centered-clip", 2.0)
    c = shared.shared_config()
    assert (c.topk, c.bits, c.result_bits, c.selection.value) == (256, 2, 4, "union")
    assert "codes=shared(chunk=4096,topk=256,bits=2,result_bits=4" in shared.swarm_settings()
    for flags, message in ((["--overlap", "delayed"], "compression=shared runs synchronous DiLoCo rounds"),
                           (["--shared-result-bits", "3"], "shared_result_bits must be"),
                           (["--shared-topk", "8192"], "shared_topk=8192 must be <= sparse_chunk")):
        with pytest.raises(ConfigError, match=message):
            load_config(parse(["--compression", "shared", *flags]), {})


def test_scaffold_defaults_to_the_norm_bounded_mean_and_explicit_rules_win():
    # CenteredClip cost SCAFFOLD clean accuracy on label shards (docs/security.md); DiLoCo keeps it
    assert (load_config({}, {}).aggregation, load_config({}, {}).norm_bound) == ("centered-clip", 2.0)
    scaffold = load_config(parse(["--outer-algorithm", "scaffold"]), {})
    assert (scaffold.aggregation, scaffold.norm_bound, scaffold.outer_lr, scaffold.outer_lr_final) == \
        ("mean", 2.0, 1.0, 1.0)
    # dense SCAFFOLD keeps DiLoCo's outer step: lr 3.5 under Nesterov 0.9 diverged (tests/test_scaffold_node.py)
    dense = load_config(parse(["--outer-algorithm", "scaffold", "--compression", "none"]), {})
    assert (dense.outer_lr, dense.outer_lr_final, dense.outer_momentum, dense.nesterov) == (0.7, None, 0.9, True)
    chosen = load_config(parse(["--outer-algorithm", "scaffold", "--aggregation", "centered-clip"]), {})
    assert chosen.aggregation == "centered-clip"
    from_env = load_config({}, {"DILOCOX_OUTER_ALGORITHM": "scaffold"})
    assert from_env.aggregation == "mean"


def test_config_file_from_env(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("inner_steps = 3\n")
    assert load_config({}, {"DILOCOX_CONFIG": str(f)}).inner_steps == 3


@pytest.mark.parametrize("flags,env,message", [
    ({}, {"DILOCOX_NOPE": "1"}, "unknown environment variable DILOCOX_NOPE"),
    ({"inner_steps": "0"}, {}, "--inner-steps"),
    ({"request_timeout": "20"}, {}, "request_timeout"),
    ({"beta1": "0.99", "beta2": "0.9"}, {}, "beta1"),
    ({"status_addr": "nohost"}, {}, "--status-addr"),
])
def test_errors_name_the_problem(flags, env, message):
    with pytest.raises(ConfigError, match=message):
        load_config(flags, env)


def test_bad_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("inner_steps = [\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config({"config": f}, {})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config({"config": tmp_path / "missing.toml"}, {})


def test_swarm_settings_cover_what_replicas_must_share_and_nothing_per_node():
    base = load_config(parse(["--total-steps", "3000", "--inner-steps", "30"]), {})
    assert "lr=2.5->4.5 over 100 rounds" in base.swarm_settings() and len(base.settings_digest()) == 16
    # per-node choices: the digest stays (the seed and data too where nobody audits: --audit-rate 0)
    for flags in (["--sparse-beta", "0.95"], ["--matchmaking-time", "10"], ["--max-outer-steps", "7"],
                  ["--run-id", "other"], ["--checkpoint-dir", "/tmp/x"]):
        cfg = load_config(parse(["--total-steps", "3000", "--inner-steps", "30", *flags]), {})
        assert cfg.settings_digest() == base.settings_digest(), flags
    unaudited = load_config(parse(["--total-steps", "3000", "--inner-steps", "30", "--audit-rate", "0"]), {})
    for flags in (["--seed", "3"], ["--data-seed", "5"]):
        cfg = load_config(parse(["--total-steps", "3000", "--inner-steps", "30", "--audit-rate", "0", *flags]), {})
        assert cfg.settings_digest() == unaudited.settings_digest(), flags
    # what changes theta's outer steps or the codes: the digest changes
    for flags in (["--outer-lr", "2.5"], ["--outer-lr-final", "5"], ["--total-steps", "6000"],
                  ["--inner-steps", "20"], ["--inner-lr", "2e-3"], ["--aggregation", "median"],
                  ["--norm-bound", "3"], ["--sparse-topk", "64"], ["--outer-algorithm", "scaffold"],
                  ["--inner-optimizer", "sgd"]):
        args = ["--total-steps", "3000", "--inner-steps", "30", *flags]
        cfg = load_config(parse(args if "--total-steps" not in flags else ["--inner-steps", "30", *flags]), {})
        assert cfg.settings_digest() != base.settings_digest(), flags
    # without --total-steps the schedule, and so the outer lr ramp, spans max_outer_steps rounds
    short = load_config(parse(["--inner-steps", "30", "--max-outer-steps", "20"]), {})
    assert short.schedule_steps == 600 and "over 20 rounds" in short.swarm_settings()
    assert load_config(parse(["--inner-steps", "30"]), {}).schedule_steps == 10_000


def test_with_audits_the_data_and_how_it_is_drawn_are_swarm_settings(tmp_path):
    """An auditor recomputes a member's round on the member's data: with --audit-rate, members must hold the same
    data (its digest, wherever it lies) and draw it alike (assigned, or chosen streams of one seed)."""
    from dilocox import vision

    assert set(IMAGE_DATA) == set(vision.SPECS)
    text = tmp_path / "a" / "corpus.txt"
    text.parent.mkdir()
    text.write_text("to be or not to be\n" * 50)
    copy = tmp_path / "b" / "corpus.txt"
    copy.parent.mkdir()
    copy.write_text(text.read_text())

    def settings(*flags):
        return load_config(parse(["--audit-rate", "0.5", *flags]), {}).swarm_settings()

    assert load_config(parse([]), {}).assigned_data and "data=assigned" in settings()
    assert settings("--data", str(text)) == settings("--data", str(copy))  # the same bytes elsewhere
    other = tmp_path / "other.txt"
    other.write_text("other text\n" * 50)
    assert settings("--data", str(text)) != settings("--data", str(other))
    # a member that picks its stream cannot join an assigned swarm, and chosen streams share their seed
    assert settings("--data-seed", "3") != settings() and "chosen(seed=0)" in settings("--data-seed", "3")
    assert settings("--data-seed", "3") == settings("--data-seed", "4") != settings("--data-seed", "3", "--seed", "1")
    assert not load_config(parse(["--data", "mnist", "--model", "cnn"]), {}).assigned_data  # private client shares
    assert data_digest(str(tmp_path / "missing")) != data_digest("builtin:shakespeare")  # a spec names itself
    (tmp_path / "locked").mkdir()
    (tmp_path / "locked" / "x.txt").write_text("x")
    (tmp_path / "locked" / "x.txt").chmod(0)
    if os.geteuid() != 0:
        with pytest.raises(ValueError, match="cannot read"):
            data_digest(str(tmp_path / "locked"))


def test_scaffold_leaves_outsized_contributions_out_by_default_and_it_is_a_swarm_setting():
    base = ["--outer-algorithm", "scaffold"]
    for flags, factor in ((base, 4.0), ([*base, "--norm-bound", "0"], 0.0), ([], 0.0),
                          ([*base, "--drop-outsized", "0"], 0.0), (["--drop-outsized", "8"], 8.0)):
        assert load_config(parse(flags), {}).drop_outsized == factor, flags
    assert "drop_outsized=4.0" in load_config(parse(base), {}).swarm_settings()
    assert "drop_outsized" not in load_config(parse([]), {}).swarm_settings()
    digests = {load_config(parse([*base, *flags]), {}).settings_digest()
               for flags in ([], ["--drop-outsized", "0"], ["--drop-outsized", "8"])}
    assert len(digests) == 3
    for flags in (["--drop-outsized", "1"], ["--drop-outsized", "4", "--norm-bound", "0"],
                  ["--drop-outsized", "4", "--compression", "int8"]):
        with pytest.raises(ConfigError, match="drop_outsized"):
            load_config(parse(flags), {})


def test_the_robust_learning_rate_is_a_swarm_setting_that_needs_all_gathered_rounds():
    base = ["--outer-algorithm", "scaffold"]
    assert "robust_lr" not in load_config(parse(base), {}).swarm_settings()
    flip = load_config(parse([*base, "--robust-lr", "flip"]), {})
    assert "robust_lr=flip(agreement=0.35,when=outsized:4.0)" in flip.swarm_settings()
    digests = {load_config(parse([*base, *flags]), {}).settings_digest() for flags in (
        [], ["--robust-lr", "flip"], ["--robust-lr", "mask"], ["--robust-lr", "flip", "--robust-lr-agreement", "0.2"],
        ["--robust-lr", "flip", "--robust-lr-when", "always"], ["--robust-lr", "flip", "--robust-lr-outsized", "8"])}
    assert len(digests) == 6  # each changes the aggregate's bits: replicas must agree on it
    assert load_config(parse(["--robust-lr", "flip", "--robust-lr-when", "always", "--norm-bound", "0"]), {})
    for flags, message in ((["--robust-lr", "flip", "--compression", "int8"], "needs compression=sparse"),
                           (["--robust-lr", "flip", "--compression", "shared"], "needs compression=sparse"),
                           (["--robust-lr", "flip", "--norm-bound", "0"], "a norm bound"),
                           (["--robust-lr", "reverse"], "--robust-lr: Input should be"),
                           (["--robust-lr", "flip", "--robust-lr-agreement", "0"], "--robust-lr-agreement"),
                           (["--robust-lr", "flip", "--robust-lr-outsized", "1"], "--robust-lr-outsized")):
        with pytest.raises(ConfigError, match=message):
            load_config(parse(flags), {})


def test_scaffold_quiet_restart_flags_are_swarm_settings_and_need_a_norm_bound():
    base = ["--outer-algorithm", "scaffold"]
    quiet = load_config(parse([*base, "--scaffold-reset-quiet", "3", "--scaffold-quiet-factor", "0.5",
                               "--scaffold-quiet-rounds", "5", "--scaffold-outsized", "4"]), {})
    assert "scaffold_reset_quiet=3(factor=0.5,rounds=5,outsized=4.0,every=20)" in quiet.swarm_settings()
    assert quiet.swarm_settings() == load_config(parse(base), {}).swarm_settings()  # those are the defaults
    digests = {load_config(parse([*base, *flags]), {}).settings_digest() for flags in (
        [], ["--scaffold-reset-quiet", "0"], ["--scaffold-reset-quiet", "2"], ["--scaffold-quiet-factor", "0"],
        ["--scaffold-quiet-rounds", "2"], ["--scaffold-outsized", "3"], ["--scaffold-quiet-every", "5"])}
    assert len(digests) == 7  # each changes when c restarts: replicas must agree on it
    # on by default where it can act (SCAFFOLD with a norm bound), and nowhere else
    for flags, after in ((base, 3), ([*base, "--norm-bound", "0"], 0), ([*base, "--compression", "int8"], 0),
                         ([], 0), ([*base, "--scaffold-reset-quiet", "0"], 0)):
        assert load_config(parse(flags), {}).scaffold_reset_quiet == after, flags
    from dilocox.daemon.config import SCAFFOLD_QUIET

    from dilocox.scaffold import QuietRestart
    assert QuietRestart(1) == QuietRestart(1, **SCAFFOLD_QUIET)  # the daemon's defaults are the rule's
    for flags, message in ((["--scaffold-reset-quiet", "3"], "needs outer_algorithm=scaffold"),
                           ([*base, "--scaffold-reset-quiet", "3", "--norm-bound", "0"], "and a norm bound"),
                           ([*base, "--scaffold-reset-quiet", "3", "--compression", "int8"], "and a norm bound"),
                           ([*base, "--scaffold-quiet-factor", "1"], "--scaffold-quiet-factor"),
                           ([*base, "--scaffold-outsized", "1"], "--scaffold-outsized")):
        with pytest.raises(ConfigError, match=message):
            load_config(parse(flags), {})


def test_inner_optimizer_flags():
    sgd = load_config(parse(["--inner-optimizer", "sgd", "--inner-momentum", "0.5", "--beta1", "0.99",
                             "--beta2", "0.9"]), {})  # betas are adamw's: not checked for sgd
    assert "inner=sgd(lr=0.001,warmup=100,wd=0.1,momentum=0.5)" in sgd.swarm_settings()
    other = load_config(parse(["--inner-optimizer", "sgd", "--inner-momentum", "0.9"]), {})
    assert other.settings_digest() != sgd.settings_digest()
    base = load_config(parse([]), {})  # adamw ignores --inner-momentum
    assert load_config(parse(["--inner-momentum", "0.5"]), {}).settings_digest() == base.settings_digest()
    assert "inner=adamw(" in base.swarm_settings() and "betas=0.9/0.95" in base.swarm_settings()
    with pytest.raises(ConfigError, match="--inner-momentum: Input should be less than 1"):
        load_config(parse(["--inner-optimizer", "sgd", "--inner-momentum", "1.0"]), {})
    with pytest.raises(ConfigError, match="--inner-optimizer: Input should be 'adamw' or 'sgd'"):
        load_config(parse(["--inner-optimizer", "lion"]), {})


def test_audit_rate_flag():
    on = load_config(parse(["--audit-rate", "0.6"]), {})
    assert on.audit_rate == 0.6 and "audits=0.6(probation=5)" in on.swarm_settings()
    # on by default where rounds can be recomputed, off elsewhere (and with --audit-rate 0)
    assert load_config(parse([]), {}).audit_rate == DEFAULT_AUDIT_RATE == 0.1
    assert "audits" not in load_config(parse(["--audit-rate", "0"]), {}).swarm_settings()
    for flags in (["--overlap", "adaptive"], ["--compression", "adaptive"], ["--compression", "shared"],
                  ["--outer-algorithm", "scaffold"], ["--stage", "0/2"], ["--workload", "synthetic:1M:0.1"]):
        assert load_config(parse(flags), {}).audit_rate == 0.0, flags
    for flags in (["--overlap", "adaptive"], ["--compression", "adaptive"], ["--stage", "0/2"],
                  ["--workload", "synthetic:1M:0.1"]):
        with pytest.raises(ConfigError, match="audit_rate needs synchronous sparse rounds"):
            load_config(parse(["--audit-rate", "0.5", *flags]), {})
    # SCAFFOLD's rounds are audited when asked (its start state commits c_i: dilocox/audit.py)
    assert load_config(parse(["--audit-rate", "0.5", "--outer-algorithm", "scaffold"]), {}).audit_rate == 0.5
    with pytest.raises(ConfigError, match="--audit-rate: Input should be less than or equal to 1"):
        load_config(parse(["--audit-rate", "1.5"]), {})


def test_the_rules_version_in_the_settings_is_the_aggregations():
    """Nodes whose aggregates differ in the last bits must not share a swarm: the settings line carries
    dilocox/robust.py's RULES_VERSION (config.py keeps a copy so that --help imports no torch)."""
    from dilocox.daemon import config

    from dilocox import robust

    assert config.RULES_VERSION == robust.RULES_VERSION
    assert f"rules=v{robust.RULES_VERSION}" in config.NodeConfig().swarm_settings()


def test_local_epochs_set_h_from_the_data():
    """--local-epochs E: H = ceil(E * a client's mean share / batch), the same on every node of the swarm."""
    from dilocox.daemon.cli import resolve_local_epochs

    from dilocox.vision import DEBIAN_FASHION_MNIST

    with pytest.raises(ConfigError, match="give it or inner_steps, not both"):
        load_config(parse(["--local-epochs", "2", "--inner-steps", "10"]), {})
    with pytest.raises(ConfigError, match="not with an emulated workload"):
        load_config(parse(["--local-epochs", "2", "--workload", "synthetic:1M:0.1"]), {})
    with pytest.raises(ConfigError, match="--local-epochs: Input should be greater than 0"):
        load_config(parse(["--local-epochs", "0"]), {})
    # text: the builtin corpus cut into 4 parts, 4 x 64 tokens per step
    text = load_config(parse(["--local-epochs", "0.5", "--model", "tiny", "--data-parts", "4", "--batch-size", "4",
                              "--seq-len", "64"]), {})
    resolved, workload = resolve_local_epochs(text)
    tokens = len(workload.corpus.train)
    assert resolved.inner_steps == math.ceil(0.5 * tokens / 4 / 256) > 1
    assert resolved.local_epochs is None and f"H={resolved.inner_steps} " in resolved.swarm_settings()
    if DEBIAN_FASHION_MNIST.is_dir():  # BadSFL's MNIST setting: 2 epochs of 60,000 / 20 images at batch 64
        image = load_config(parse(["--local-epochs", "2", "--model", "simple-cnn", "--data", "fashion-mnist",
                                   "--num-clients", "20", "--partition", "label-shards:1", "--batch-size", "64"]), {})
        assert resolve_local_epochs(image)[0].inner_steps == 94  # ceil(2 * 3,000 / 64)


# [section] tables in a config file (daemon/config_sections.py; docs/configuration.md)

def _toml(value) -> str:
    """A TOML literal for what model_dump(mode="json") holds (strings, numbers, booleans, lists of strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def test_a_sectioned_file_gives_the_same_config_as_a_flat_one(tmp_path):
    from dilocox.daemon.config import FIELD_SECTION

    # every field given, none at its default where that is allowed: each section's table must take all its fields
    cfg = load_config(parse(["--run-id", "tables", "--join", "/ip4/10.0.0.1/tcp/1", "--inner-steps", "30",
                             "--outer-lr", "1.5", "--outer-lr-final", "2", "--compression", "sparse",
                             "--sparse-topk", "64", "--model", "tiny", "--data-parts", "3", "--request-timeout", "4",
                             "--stage", "0/1", "--checkpoint-dir", str(tmp_path / "ck"), "--log-format", "json",
                             "--no-sparse-rice", "--audit-rate", "0.5", "--min-replicas", "2"]), {})
    values = cfg.model_dump(mode="json", exclude_none=True)
    flat = tmp_path / "flat.toml"
    flat.write_text("".join(f"{k} = {_toml(v)}\n" for k, v in values.items()))
    tables: dict[str, list[str]] = {}
    for k, v in values.items():
        tables.setdefault(FIELD_SECTION[k], []).append(f"{k} = {_toml(v)}\n")
    sectioned = tmp_path / "sectioned.toml"
    sectioned.write_text("".join(f"[{t}]\n{''.join(lines)}\n" for t, lines in tables.items()))
    assert len(tables) == 11 and "[outer]\n" in sectioned.read_text()
    from_flat, from_tables = load_config({"config": flat}, {}), load_config({"config": sectioned}, {})
    assert from_tables == from_flat == cfg
    assert (from_tables.outer_lr, from_tables.sparse_rice, from_tables.data_parts) == (1.5, False, 3)
    assert from_tables.settings_digest() == cfg.settings_digest()
    # top-level keys and tables in one file; a section named as its field holds that field
    mixed = tmp_path / "mixed.toml"
    mixed.write_text('run_id = "mixed"\n[model]\nmodel = "tiny"\n[outer]\nouter_lr = 0.7\n'
                     '[training]\ninner_steps = 9\n')
    got = load_config({"config": mixed}, {})
    assert (got.run_id, got.model, got.outer_lr, got.outer_lr_final, got.inner_steps) == ("mixed", "tiny", 0.7, 0.7, 9)


@pytest.mark.parametrize("text,message", [
    ("[outer]\nouter_lr = 0.7\ninner_steps = 100\n",
     r"c\.toml: table \[outer\] has no field inner_steps: it belongs in \[training\]"),
    ("[training]\nsparse_topk = 64\n", r"table \[training\] has no field sparse_topk: it belongs in \[compression\]"),
    ("[optimizer]\nlr = 0.1\n", r"c\.toml: unknown table \[optimizer\] \(tables: network, control, security"),
    ("[outer]\nouter_rl = 0.7\n", r"table \[outer\] has no field outer_rl \(no config field of that name; did you mean "
                                  r"outer_lr \(in \[outer\]\)\?\)"),
    ("[outer.schedule]\nouter_lr = 0.7\n", r"table \[outer\] has no field schedule"),
    ("inner_steps = 5\n[training]\ninner_steps = 6\n",
     r"inner_steps is given twice: at the top level and in table \[training\]"),
    ("nope = 1\n", r"c\.toml: unknown field\(s\) nope"),
    ('model = "tiny"\n[model]\nseed = 1\n', r"not valid TOML.*a file with a \[model\] table gives the field model "
                                           r"inside that table"),
    ("[training]\ninner_steps = 0\n",
     r"inner_steps in file \S*c\.toml, table \[training\]: Input should be greater than or equal to 1"),
    ("[rounds]\nrequest_timeout = 20.0\n", "timeouts must satisfy request_timeout < matchmaking_time"),
])
def test_a_bad_table_names_the_file_the_table_and_the_key(tmp_path, text, message):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config({"config": f}, {})


def test_flags_and_env_override_a_table_value(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[training]\ninner_steps = 7\n[outer]\nouter_lr = 0.5\n[network]\nrun_id = "fromfile"\n'
                 'join = ["/ip4/127.0.0.1/tcp/1"]\n')
    cfg = load_config(parse(["--config", str(f), "--run-id", "fromflag"]),
                      {"DILOCOX_OUTER_LR": "0.4", "DILOCOX_RUN_ID": "fromenv"})
    assert (cfg.inner_steps, cfg.outer_lr, cfg.run_id, cfg.join) == (7, 0.4, "fromflag", ["/ip4/127.0.0.1/tcp/1"])
    cfg = load_config(parse(["--inner-steps", "8"]), {"DILOCOX_CONFIG": str(f), "DILOCOX_JOIN": "/a,/b"})
    assert (cfg.inner_steps, cfg.outer_lr, cfg.run_id, cfg.join) == (8, 0.5, "fromfile", ["/a", "/b"])


def test_every_field_belongs_to_exactly_one_section():
    from dilocox.daemon.config import NodeConfig
    from dilocox.daemon.config_sections import SECTIONS

    names = [name for model in SECTIONS.values() for name in model.model_fields]
    assert sorted(names) == sorted(NodeConfig.model_fields), "a field in no section, in two, or only in NodeConfig"
    assert len(SECTIONS) == len(set(SECTIONS)) >= 8
    for section, model in SECTIONS.items():
        assert model.model_fields and model.summary().endswith("."), section
        assert issubclass(NodeConfig, model), section


def test_a_sections_own_rules_live_on_it_and_rules_across_sections_on_nodeconfig():
    from dilocox.daemon.config import NodeConfig
    from dilocox.daemon.config_sections import CompressionSection, RoundsSection, SecuritySection
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="timeouts must satisfy"):
        RoundsSection(request_timeout=20)
    with pytest.raises(ValidationError, match="rank_min=9 must be <= rank_max=8"):
        CompressionSection(rank_min=9)
    # a robust rule needs gathered rounds: a rule across security and compression, NodeConfig's
    assert SecuritySection(aggregation="median").aggregation == "median"
    with pytest.raises(ValidationError, match="need compression=sparse or shared"):
        NodeConfig(aggregation="median", compression="int8")
    # several broken rules: the first is named, in the order the rules had before sections
    with pytest.raises(ConfigError, match="timeouts must satisfy"):
        load_config(parse(["--request-timeout", "20", "--stage", "2/2", "--rank-min", "9", "--beta1", "0.99"]), {})
    with pytest.raises(ConfigError, match="stage '2/2'"):
        load_config(parse(["--stage", "2/2", "--rank-min", "9", "--status-read", "token"]), {})


def test_help_lists_the_flags_by_section(capsys):
    from dilocox.daemon.cli import node_main
    from dilocox.daemon.config_sections import SECTIONS

    with pytest.raises(SystemExit) as done:
        node_main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    starts = {section: text.index(f"\n{section}:\n  {model.summary()[:30]}") for section, model in SECTIONS.items()}
    assert list(starts) == sorted(starts, key=starts.get)  # listed in SECTIONS' order
    ends = dict(zip(starts, [*sorted(starts.values())[1:], len(text)]))
    for section, model in SECTIONS.items():
        block = text[starts[section]:ends[section]]
        for name in model.model_fields:
            assert f"  --{name.replace('_', '-')}" in block, (section, name)


def test_the_configuration_doc_lists_each_sections_fields_and_its_example_loads(tmp_path):
    """docs/configuration.md: the row of each [section] names exactly its fields; the sectioned example is valid."""
    import re
    from pathlib import Path

    from dilocox.daemon.config_sections import SECTIONS

    doc = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    for section, model in SECTIONS.items():
        rows = [line for line in doc.splitlines() if line.startswith(f"| `[{section}]` | `")]
        assert len(rows) == 1, section
        assert re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", rows[0])) == list(model.model_fields), section
    example = doc.split("## A sectioned file\n\n```toml\n", 1)[1].split("```", 1)[0]
    f = tmp_path / "node.toml"
    f.write_text(re.sub(r'tokenizer = ".*"', 'tokenizer = "bytes"', example))  # the doc's tokenizer file is not here
    cfg = load_config({"config": f}, {})
    assert (cfg.model, cfg.inner_steps, cfg.data_parts, cfg.min_replicas, cfg.log_format) == \
        ("llama-150m", 500, 8, 4, "json")


def test_the_gathers_wire_version_separates_sparse_swarms_that_would_refuse_each_others_requests():
    """A node that sends no commitment with its requests gets no row from one that asks for it
    (peers/contributions.py, "Commitments"): sparse swarms carry the all-gather's version, other modes do not."""
    from dilocox.daemon import config

    assert f"gather=v{config.GATHER_VERSION}" in load_config(parse([]), {}).swarm_settings()
    for mode in ("none", "shared"):
        assert "gather=" not in load_config(parse(["--compression", mode]), {}).swarm_settings()
