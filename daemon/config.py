"""Node configuration: pydantic model filled from defaults < TOML file < DILOCOX_* env < flags.

``NodeConfig`` is made of sections (daemon/config_sections.py, one model per concept, as torchtitan's
JobConfig) and reads flat: every field is ``cfg.<field>``. A ``--config FILE.toml`` gives fields in
``[section]`` tables or as top-level keys (both in one file is fine; a field given twice is an error);
an environment variable ``DILOCOX_<FIELD>`` (lists comma-separated) or a flag ``--field-name`` gives
one field, without its section. Unknown tables, keys and ``DILOCOX_*`` variables, and a key in another
section's table, are errors (``ConfigError``). Timeouts are seconds and must satisfy
request_timeout < matchmaking_time < averaging_timeout < outer_round_deadline
(docs/operations.md, "Timeouts"; docs/configuration.md).
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import os
import re
import tomllib
import typing
from pathlib import Path
from typing import Optional

from dilocox.daemon.config_sections import (
    DEFAULT_AUDIT_RATE,
    IMAGE_DATA,
    SCAFFOLD_DROP_OUTSIZED,
    SCAFFOLD_QUIET_AFTER,
    SECTIONS,
    CompressionSection,
    ControlSection,
    DataSection,
    ModelSection,
    NetworkSection,
    NodeSection,
    OuterSection,
    PipelineSection,
    RoundsSection,
    SecuritySection,
    TrainingSection,
    data_digest,
    tokenizer_digest,
)
from dilocox.daemon.config_sections import SCAFFOLD_QUIET as SCAFFOLD_QUIET
from pydantic import ConfigDict, ValidationError, model_validator

# the aggregation rules' version (dilocox/robust.py: RULES_VERSION), written here so that --help imports no torch
RULES_VERSION = 4
# the all-gather's wire rules, for the same reason (2: a row goes only to a request carrying the requester's own
# payload's SHA-256, peers/contributions.py "Commitments": a node without it is refused every row)
GATHER_VERSION = 2
ENV_PREFIX = "DILOCOX_"


ENV_EXTRA = {"DILOCOX_CONFIG"}  # names the config file itself


class ConfigError(ValueError):
    """A configuration problem, with a message that names the field, variable or file."""


# outer optimizer and aggregation per compression mode, from make bench-quality and make bench-attacks
# (docs/algorithms.md, "Choosing the default"; docs/security.md)
OUTER_DEFAULTS = {
    "none": dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True,  # DiLoCo's recipe
                 aggregation="mean", norm_bound=0.0),  # butterfly all-reduce: reducers sum parts, no robust rule
    # SparseLoCo: error feedback, no momentum; the outer lr ramps 2.5 -> 4.5 over the cosine schedule
    "sparse": dict(outer_lr=2.5, outer_lr_final=4.5, outer_momentum=0.0, nesterov=False,
                   aggregation="centered-clip", norm_bound=2.0),
    # the union of the members' proposals at 8 in-process replicas: +1.70% of fp32's loss at 1.25 x sparse's ramp
    # (make bench-quality-shared, the -rf rows; docs/algorithms.md, "A reduce-scatter transport")
    "shared": dict(outer_lr=3.1, outer_lr_final=5.6, outer_momentum=0.0, nesterov=False,
                   aggregation="centered-clip", norm_bound=2.0),
}
# SCAFFOLD on non-IID shards: CenteredClip cost 4 points of clean accuracy over 3 seeds, the plain mean after
# norm bounding about 1, and c derived from the aggregate is what stops BadSFL (make bench-badsfl; docs/security.md)
SCAFFOLD_DEFAULTS = dict(aggregation="mean")
# sparse SCAFFOLD: the constant outer lr 1 its defenses were measured with (the BadSFL harness); 3.5 made theta swing
# once the correction worked (4 label-shard nodes, 2 seeds: PTA 44-51% against 52-55%; docs/algorithms.md, SCAFFOLD).
# Dense SCAFFOLD keeps DiLoCo's 0.7 (Nesterov 0.9)
SCAFFOLD_SPARSE_OUTER = dict(outer_lr=1.0, outer_lr_final=1.0)


# Pydantic runs the rules of the bases listed last first: rounds, pipeline, compression, control, model,
# security, training (the order of the rules before sections), then NodeConfig's own, which span sections.
# The bases' order does not change which flags, fields or tables there are.
class NodeConfig(TrainingSection, SecuritySection, ModelSection, ControlSection, CompressionSection, PipelineSection,
                 RoundsSection, OuterSection, DataSection, NetworkSection, NodeSection):
    """A node's whole configuration: the fields of every section of ``SECTIONS``, read as ``cfg.<field>``, with
    the rules that span sections. Construction raises pydantic's ValidationError; ``load_config`` turns it into a
    ConfigError that names the source of each bad value."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @property
    def matches_early(self) -> bool:
        """Rounds form their group during their last inner steps: synchronous sparse or shared rounds of whole
        models (their matchmaking needs nothing of the butterfly's per-phase data)."""
        return self.gathers and self.num_stages == 1

    @property
    def schedule_steps(self) -> int:
        """T: the inner cosine schedule's length in inner steps (``total_steps``, else max_outer_steps * H, else
        10000); the outer learning rate ramps over its ceil(T / H) rounds (dilocox/diloco.py: OuterOptimizer)."""
        return self.total_steps or (self.max_outer_steps * self.inner_steps if self.max_outer_steps else 10_000)

    @property
    def ramp_rounds(self) -> int:
        """ceil(T / H): the rounds the outer learning rate ramps over (OuterOptimizer's ``ramp_steps``)."""
        return max(1, -(-self.schedule_steps // self.inner_steps))

    @property
    def assigned_data(self) -> bool:
        """Round r's batches are assigned by the swarm (dilocox/assignment.py): text data, whole models, no
        --data-seed (a replica that picks its stream, and image clients, which hold private shares, choose theirs)."""
        return self.data_seed is None and self.num_stages == 1 and not self.workload and self.data not in IMAGE_DATA

    def swarm_settings(self) -> str:
        """The settings every replica of a swarm must share for theta to stay bit-identical and codes to decode
        (docs/operations.md, "Nodes of one swarm must agree on"), as one line. Not in it: what separates swarms
        already (run_id, stages, compression, model and rank_max name the DHT keys and averager prefixes), the
        seed (a joiner downloads theta), and per-node choices (sparse_beta, data, timeouts, devices, a synthetic
        workload's STEP_S). With audits the data is in it (its digest, and whether it is assigned, else the seed its
        streams are drawn with): an auditor recomputes a member's round on the member's data."""
        outer = f"lr={self.outer_lr!r}" if self.outer_lr_final in (None, self.outer_lr) else \
            f"lr={self.outer_lr!r}->{self.outer_lr_final!r} over {self.ramp_rounds} rounds"
        parts = [f"H={self.inner_steps} T={self.schedule_steps}"]
        if self.workload:  # STEP_S is the emulated machine's speed, a per-node choice: "synthetic:PARAMS" only
            parts.append(f"workload={self.workload.strip().rsplit(':', 1)[0]}")
        elif self.tokenizer != "bytes":  # ids must mean the same text on every replica
            parts.append(f"tokenizer=sha256:{tokenizer_digest(self.tokenizer)}")
        shape = f"betas={self.beta1!r}/{self.beta2!r}" if self.inner_optimizer == "adamw" else \
            f"momentum={self.inner_momentum!r}"
        parts += [f"inner={self.inner_optimizer}(lr={self.inner_lr!r},warmup={self.warmup_steps},"
                  f"wd={self.weight_decay!r},{shape})",
                  f"outer=sgd({outer},momentum={self.outer_momentum!r},nesterov={self.nesterov})",
                  f"algorithm={self.outer_algorithm} aggregation={self.aggregation}(norm_bound={self.norm_bound!r},"
                  f"rules=v{RULES_VERSION})"]
        if self.compression == "sparse":
            parts.append(f"gather=v{GATHER_VERSION}")
        if self.audit_rate:  # an auditor recomputes a member's round on the member's data: the same data, drawn alike
            data = "assigned" if self.assigned_data else f"chosen(seed={self.seed})"
            parts.append(f"audits={self.audit_rate!r}(probation={self.audit_probation}) "
                         f"data={data}:sha256:{data_digest(self.data)}")
        if self.outer_algorithm == "scaffold" and self.scaffold_reset_every:
            parts.append(f"scaffold_reset_every={self.scaffold_reset_every}")
        if self.outer_algorithm == "scaffold" and self.scaffold_reset_quiet:
            parts.append(f"scaffold_reset_quiet={self.scaffold_reset_quiet}(factor={self.scaffold_quiet_factor!r},"
                         f"rounds={self.scaffold_quiet_rounds},outsized={self.scaffold_outsized!r},"
                         f"every={self.scaffold_quiet_every})")
        if self.drop_outsized:  # it changes which contributions the aggregate holds
            parts.append(f"drop_outsized={self.drop_outsized!r}")
        if self.robust_lr != "off":  # dilocox/sign_agreement.py: it changes the aggregate's bits
            when = "always" if self.robust_lr_when == "always" else f"outsized:{self.robust_lr_outsized!r}"
            parts.append(f"robust_lr={self.robust_lr}(agreement={self.robust_lr_agreement!r},when={when})")
        if self.compression == "sparse":
            parts.append(f"codes=sparse(chunk={self.sparse_chunk},topk={self.sparse_topk},bits={self.sparse_bits},"
                         f"rice={self.sparse_rice})")
        elif self.compression == "shared":
            parts.append(f"codes=shared(chunk={self.sparse_chunk},topk={self.shared_topk},bits={self.sparse_bits},"
                         f"result_bits={self.shared_result_bits},beta={self.sparse_beta!r})")
        else:
            parts.append(f"codes={self.compression}(rank_min={self.rank_min},rank_energy={self.rank_energy!r},"
                         f"quant_block={self.quant_block})")
        return " ".join(parts)

    def settings_digest(self) -> str:
        """First 16 hex digits of the SHA-256 of ``swarm_settings()``: what membership records carry."""
        return hashlib.sha256(self.swarm_settings().encode()).hexdigest()[:16]

    @classmethod
    def _auditable(cls, data: dict) -> bool:
        """Whether the raw settings ``data`` describe rounds audited by default: synchronous sparse DiLoCo rounds of
        whole models on a real workload (the fields left out take their defaults). SCAFFOLD's rounds can be audited
        too, with an explicit ``audit_rate`` (docs/security.md, Audits, says why not by default)."""
        def get(name):
            value = data.get(name)
            return cls.model_fields[name].default if value is None else value
        return (get("compression"), get("overlap"), get("stage"), get("outer_algorithm"), get("workload")) == \
            ("sparse", "none", "0/1", "diloco", None)

    @model_validator(mode="before")
    @classmethod
    def _outer_defaults(cls, data):
        """outer_lr / outer_lr_final / outer_momentum / nesterov / aggregation / norm_bound left unset take the
        measured default of the compression (OUTER_DEFAULTS; docs/algorithms.md): outer momentum does not mix
        with sparse error feedback, and only all-gathered (sparse) rounds can aggregate robustly. SCAFFOLD
        aggregates with the mean (SCAFFOLD_DEFAULTS; docs/security.md). An outer_lr set without an
        outer_lr_final is constant."""
        if isinstance(data, dict):
            compression = data.get("compression", cls.model_fields["compression"].default)
            # an invalid compression is reported by its own field's validation
            defaults = OUTER_DEFAULTS.get(compression, OUTER_DEFAULTS["none"]) if isinstance(compression, str) \
                else OUTER_DEFAULTS["none"]
            if data.get("outer_algorithm") == "scaffold":
                defaults = {**defaults, **SCAFFOLD_DEFAULTS,
                            **(SCAFFOLD_SPARSE_OUTER if compression == "sparse" else {})}
            if data.get("outer_lr") is not None:  # a chosen outer lr is constant unless a final one is chosen too
                defaults = {**defaults, "outer_lr_final": data["outer_lr"]}
            for name, value in defaults.items():
                if data.get(name) is None:
                    data = {**data, name: value}
            if data.get("audit_rate") is None:  # on where rounds can be recomputed (_check)
                data = {**data, "audit_rate": DEFAULT_AUDIT_RATE if cls._auditable(data) else 0.0}
            quiet = data.get("outer_algorithm") == "scaffold" and _nonzero(data.get("norm_bound"))
            if data.get("scaffold_reset_quiet") is None:  # on where it can act: SCAFFOLD with a norm bound
                data = {**data, "scaffold_reset_quiet": SCAFFOLD_QUIET_AFTER if quiet else 0}
            if data.get("drop_outsized") is None:  # likewise
                data = {**data, "drop_outsized": SCAFFOLD_DROP_OUTSIZED if quiet else 0.0}
        return data

    @model_validator(mode="after")
    def _check(self) -> "NodeConfig":
        if (self.aggregation != "mean" or self.norm_bound) and not self.gathers:
            raise ValueError(f"aggregation={self.aggregation} / norm_bound={self.norm_bound} need compression=sparse "
                             f"or shared: a butterfly all-reduce sums parts on reducers, which a robust rule cannot "
                             f"trust")
        if self.drop_outsized and (self.drop_outsized <= 1 or self.compression != "sparse" or not self.norm_bound):
            raise ValueError(f"drop_outsized={self.drop_outsized} needs a factor > 1, compression=sparse and a norm "
                             f"bound (norm_bound > 0): a contribution is outsized when the bound scales it by less "
                             f"than 1 / the factor")
        if self.robust_lr != "off" and (self.compression != "sparse"
                                        or (self.robust_lr_when == "outsized" and not self.norm_bound)):
            raise ValueError("robust_lr needs compression=sparse (every member holds every contribution to count "
                             "their signs) and, with robust_lr_when=outsized, a norm bound (norm_bound > 0): a round "
                             "is outsized when the bound scales a contribution")
        if self.scaffold_reset_quiet and (self.outer_algorithm != "scaffold" or not self.norm_bound):
            raise ValueError("scaffold_reset_quiet needs outer_algorithm=scaffold and a norm bound (compression="
                             "sparse, norm_bound > 0): a round is outsized when the bound scales a contribution")
        if self.compression == "shared" and (self.overlap != "none" or self.stage != "0/1"
                                             or self.outer_algorithm != "diloco" or self.audit_rate):
            raise ValueError("compression=shared runs synchronous DiLoCo rounds of whole models (overlap=none, "
                             "stage 0/1, outer_algorithm=diloco, no audit_rate): an overlapped round's proxy "
                             "and an audit need a member's contribution before the round's index set exists")
        if self.audit_rate and (self.compression != "sparse" or self.overlap != "none" or self.stage != "0/1"
                                or self.workload):
            raise ValueError("audit_rate needs synchronous sparse rounds of whole models on a real workload "
                             "(compression=sparse, overlap=none, stage 0/1, no workload): only those contributions "
                             "can be recomputed (docs/security.md, Audits)")
        if self.local_epochs is not None and ("inner_steps" in self.model_fields_set or self.workload):
            raise ValueError("local_epochs sets H from the data: give it or inner_steps, not both, and not with an "
                             "emulated workload (it has no data)")
        return self


# field name -> the section (config file table) that holds it
FIELD_SECTION = {name: section for section, model in SECTIONS.items() for name in model.model_fields}
# sections named as one of their fields: a file with the [table] must give that field inside it (TOML allows a
# name once per table)
_TABLE_FIELDS = sorted(set(SECTIONS) & set(FIELD_SECTION))


def _nonzero(value) -> bool:
    """A norm bound given as a number or a flag's string is set (> 0); anything unreadable counts as unset (its
    field's validation names it)."""
    try:
        return float(value) > 0
    except (TypeError, ValueError):
        return False


def _is_list(name: str) -> bool:
    return typing.get_origin(NodeConfig.model_fields[name].annotation) is list


def _is_bool(name: str) -> bool:
    return NodeConfig.model_fields[name].annotation in (bool, Optional[bool])


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--field-name`` flag per config field, listed in one argument group per section (its one-line
    description under it); absent flags stay absent (argparse.SUPPRESS)."""
    parser.add_argument("--config", type=Path, default=argparse.SUPPRESS,
                        help="TOML file of config fields: [section] tables named as the groups below, or top-level "
                             "keys (docs/configuration.md)")
    for section, model in SECTIONS.items():
        group = parser.add_argument_group(section, model.summary())
        for name, field in model.model_fields.items():
            flag = "--" + name.replace("_", "-")
            kwargs = dict(dest=name, default=argparse.SUPPRESS, help=field.description)
            if _is_list(name):
                group.add_argument(flag, action="append", metavar="MULTIADDR", **kwargs)
            elif _is_bool(name):
                group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
            else:
                group.add_argument(flag, metavar=name.upper(), **kwargs)


def _from_env(environ: typing.Mapping[str, str]) -> dict:
    values = {}
    for var, raw in environ.items():
        if not var.startswith(ENV_PREFIX) or var in ENV_EXTRA:
            continue
        name = var[len(ENV_PREFIX):].lower()
        if name not in NodeConfig.model_fields:
            raise ConfigError(f"unknown environment variable {var} (no config field {name!r})")
        values[name] = [v for v in raw.split(",") if v] if _is_list(name) else raw
    return values


def _toml_hint(text: str) -> str:
    """Why a file that mixes a top-level ``model = ...`` with a ``[model]`` table is not valid TOML ("" if not)."""
    for name in _TABLE_FIELDS:
        if re.search(rf"^\s*\[\s*{name}\s*\]", text, re.M) and re.search(rf"^\s*{name}\s*=", text, re.M):
            return f" (a file with a [{name}] table gives the field {name} inside that table)"
    return ""


def _where(table: str) -> str:
    return f"in table [{table}]" if table else "at the top level"


def _from_file(path: Path) -> tuple[dict, dict[str, str]]:
    """The file's fields, and the table each came from ("": a top-level key). Raises ConfigError naming the file,
    the table and the key for an unknown table or key, a key in another section's table, or a field given twice."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}{_toml_hint(text)}") from e
    values: dict = {}
    tables: dict[str, str] = {}
    problems: list[str] = []
    unknown = []

    def put(name: str, value, table: str) -> None:
        if name in values:
            problems.append(f"{name} is given twice: {_where(tables[name])} and {_where(table)}")
        values[name], tables[name] = value, table

    for key, value in raw.items():
        if isinstance(value, dict) and (key in SECTIONS or key not in FIELD_SECTION):  # a [table]
            if key not in SECTIONS:
                problems.append(f"unknown table [{key}] (tables: {', '.join(SECTIONS)})")
                continue
            for name, item in value.items():
                if name in SECTIONS[key].model_fields:
                    put(name, item, key)
                elif name in FIELD_SECTION:
                    problems.append(f"table [{key}] has no field {name}: it belongs in [{FIELD_SECTION[name]}]")
                else:
                    close = difflib.get_close_matches(name, list(FIELD_SECTION), n=1)
                    hint = f"; did you mean {close[0]} (in [{FIELD_SECTION[close[0]]}])?" if close else ""
                    problems.append(f"table [{key}] has no field {name} (no config field of that name{hint})")
        elif key in FIELD_SECTION:
            put(key, value, "")
        else:
            unknown.append(key)
    if unknown:
        problems.insert(0, f"unknown field(s) {', '.join(sorted(unknown))}")
    if problems:
        raise ConfigError(f"config file {path}: {'; '.join(problems)}")
    return values, tables


def load_config(flags: dict, environ: typing.Mapping[str, str] | None = None) -> NodeConfig:
    """Merge sources (flag beats env beats file beats default; a file's tables and top-level keys are one
    source) and validate; raises ConfigError naming each bad value's flag, variable, or file and table."""
    environ = os.environ if environ is None else environ
    flags = dict(flags)
    config_path = flags.pop("config", None) or environ.get("DILOCOX_CONFIG")
    sources: dict[str, str] = {}
    merged: dict = {}
    if config_path:
        values, tables = _from_file(Path(config_path))
        merged.update(values)
        sources.update({k: f"file {config_path}" + (f", table [{t}]" if t else "") for k, t in tables.items()})
    for values, source in ((_from_env(environ), "env"), (flags, "flag")):
        merged.update(values)
        sources.update({k: source for k in values})
    try:
        return NodeConfig(**merged)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            name = str(err["loc"][0]) if err["loc"] else ""
            where = sources.get(name, "")
            labels = {"flag": f"--{name.replace('_', '-')}", "env": f"{ENV_PREFIX}{name.upper()}"}
            label = labels.get(where, name or "config")
            if where.startswith("file"):
                label = f"{name} in {where}"
            problems.append(f"{label}: {err['msg']}")
        raise ConfigError("invalid configuration: " + "; ".join(problems)) from e
