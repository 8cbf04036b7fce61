"""Node configuration: pydantic model filled from defaults < TOML file < DILOCOX_* env < flags.

Every field can come from ``--config FILE.toml`` (top-level keys), an environment variable
``DILOCOX_<FIELD>`` (lists comma-separated) or a flag ``--field-name``. Unknown keys in the file
and unknown ``DILOCOX_*`` variables are errors. Timeouts are seconds and must satisfy
request_timeout < matchmaking_time < averaging_timeout < outer_round_deadline
(docs/operations.md, "Timeouts").
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tomllib
import typing
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# the aggregation rules' version (dilocox/robust.py: RULES_VERSION), written here so that --help imports no torch
RULES_VERSION = 2
ENV_PREFIX = "DILOCOX_"


ENV_EXTRA = {"DILOCOX_CONFIG"}  # names the config file itself


def tokenizer_digest(spec: str) -> str:
    """The digest of the tokenizer.json that ``spec`` names (dilocox/tokenizer.py's, read without loading the
    tokenizers library). Raises ValueError naming the path when it cannot be read."""
    from dilocox.tokenizer import file_digest, tokenizer_file  # numpy only where a tokenizer file is configured

    path = tokenizer_file(spec)
    try:
        return file_digest(path.read_bytes())
    except OSError as e:
        raise ValueError(f"tokenizer {spec!r}: cannot read {path} ({e.strerror}); expected 'bytes', a "
                         f"tokenizer.json or a folder holding one") from e


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
# sparse SCAFFOLD keeps the constant outer lr it was measured with; dense SCAFFOLD keeps DiLoCo's 0.7 (Nesterov 0.9)
SCAFFOLD_SPARSE_OUTER = dict(outer_lr=3.5, outer_lr_final=3.5)
# SCAFFOLD with a norm bound restarts c during an attack and shrinks it after (dilocox.scaffold.QuietRestart's
# defaults: restarted every 20 rounds while contributions over 4 x the bound come, halved in 5 rounds from 3 after
# the last one): under BadSFL, clean accuracy 0.0 / +2.4 / +1.3 points from SCAFFOLD without an attack on 3 seeds,
# against -17.6 / -4.7 / -15.6 without it; without an attack it never fired (make bench-badsfl-paper-quiet)
# (written here, not imported, so that --help imports no torch; tests/test_config.py checks they match)
SCAFFOLD_QUIET_AFTER = 3
SCAFFOLD_QUIET = dict(factor=0.5, rounds=5, outsized=4.0, every=20)


class NodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @property
    def stage_index(self) -> int:
        return int(self.stage.split("/")[0])

    @property
    def num_stages(self) -> int:
        return int(self.stage.split("/")[1])

    @property
    def gathers(self) -> bool:
        """Rounds exchange contributions through the nodes' contribution servers (peers/contributions.py) rather than
        a butterfly all-reduce: sparse (all-gathered) and shared (reduce-scattered on a shared index set)."""
        return self.compression in ("sparse", "shared")

    @property
    def matches_early(self) -> bool:
        """Rounds form their group during their last inner steps: synchronous sparse or shared rounds of whole
        models (their matchmaking needs nothing of the butterfly's per-phase data)."""
        return self.gathers and self.num_stages == 1

    @property
    def early_window_s(self) -> float:
        """Seconds before a round's inner steps end at which its early matchmaking begins."""
        return self.matchmaking_time + self.request_timeout

    @property
    def schedule_steps(self) -> int:
        """T: the inner cosine schedule's length in inner steps (``total_steps``, else max_outer_steps * H, else
        10000); the outer learning rate ramps over its ceil(T / H) rounds (dilocox/diloco.py: OuterOptimizer)."""
        return self.total_steps or (self.max_outer_steps * self.inner_steps if self.max_outer_steps else 10_000)

    @property
    def ramp_rounds(self) -> int:
        """ceil(T / H): the rounds the outer learning rate ramps over (OuterOptimizer's ``ramp_steps``)."""
        return max(1, -(-self.schedule_steps // self.inner_steps))

    def swarm_settings(self) -> str:
        """The settings every replica of a swarm must share for theta to stay bit-identical and codes to decode
        (docs/operations.md, "Nodes of one swarm must agree on"), as one line. Not in it: what separates swarms
        already (run_id, stages, compression, model and rank_max name the DHT keys and averager prefixes), the
        seed (a joiner downloads theta), and per-node choices (sparse_beta, data, timeouts, devices, a synthetic
        workload's STEP_S)."""
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
        if self.audit_rate:
            parts.append(f"audits={self.audit_rate!r}")
        if self.outer_algorithm == "scaffold" and self.scaffold_reset_every:
            parts.append(f"scaffold_reset_every={self.scaffold_reset_every}")
        if self.outer_algorithm == "scaffold" and self.scaffold_reset_quiet:
            parts.append(f"scaffold_reset_quiet={self.scaffold_reset_quiet}(factor={self.scaffold_quiet_factor!r},"
                         f"rounds={self.scaffold_quiet_rounds},outsized={self.scaffold_outsized!r},"
                         f"every={self.scaffold_quiet_every})")
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

    def sparse_config(self):
        """The ``dilocox.sparse.SparseConfig`` of the ``sparse_*`` fields (what ``--compression sparse`` encodes)."""
        from dilocox.sparse import SparseConfig  # torch: only when a codec is built, not for --help

        return SparseConfig(chunk=self.sparse_chunk, topk=self.sparse_topk, bits=self.sparse_bits,
                            beta=self.sparse_beta, rice=self.sparse_rice)

    def shared_config(self):
        """The ``dilocox.shared_index.SharedIndexConfig`` of ``--compression shared``: the union of proposals, P of
        ``shared_topk`` per chunk of ``sparse_chunk``, values at ``sparse_bits``, results at ``shared_result_bits``."""
        from dilocox.shared_index import SharedIndexConfig  # torch: only when a codec is built, not for --help

        return SharedIndexConfig(chunk=self.sparse_chunk, topk=self.shared_topk, bits=self.sparse_bits,
                                 result_bits=self.shared_result_bits, beta=self.sparse_beta, selection="union")

    # swarm and identity
    run_id: str = Field("dilocox", pattern=r"^[A-Za-z0-9_-]{1,64}$",
                        description="swarm name; nodes with another run_id never average with us")
    join: list[str] = Field(default_factory=list,
                            description="multiaddr of a running peer (repeatable); none starts a new swarm")
    listen: list[str] = Field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"],
                              description="multiaddr to listen on (repeatable)")
    announce: list[str] = Field(default_factory=list, description="multiaddr others should dial (repeatable)")
    client_mode: bool = Field(False, description="behind a NAT or firewall: accept no inbound connections (hivemind's "
                                                 "client mode for the DHT and the averagers); this node still trains, "
                                                 "sends its contribution and gets the result, but never serves its "
                                                 "state to joiners nor reduces for others; pipeline stages still "
                                                 "need direct links")
    auto_relay: bool = Field(False, description="look for a public peer to relay inbound connections (libp2p "
                                                "circuit relay, hivemind's use_auto_relay)")
    identity: Optional[Path] = Field(None, description="libp2p RSA key file; created if missing; pins the peer_id")
    authority: Optional[Path] = Field(None, description="the swarm authority's public key (authority.pub): only peers "
                                                        "it certified take part; none: an open swarm")
    certificate: Optional[Path] = Field(None, description="this node's certificate from the swarm authority "
                                                          "(dilocox-ctl authority issue)")
    revocations: Optional[Path] = Field(None, description="the authority's revoked.json: read at start and whenever "
                                                          "it changes, and passed on to the swarm")
    status_addr: str = Field("127.0.0.1:50051", pattern=r"^([^:\s]+:\d{1,5}|unix:/\S+)$",
                             description="gRPC HOST:PORT (port 0 picks a free one), or unix:/PATH: a local socket, "
                                         "guarded by file permissions and reachable from other network namespaces")
    operator_token_file: Optional[Path] = Field(
        None, description="file holding the operator token (created with a random one if missing): Leave needs it; "
                          "required when status_addr is not loopback")
    status_read: Literal["open", "token"] = Field("open", description="whether reading status and peers needs the "
                                                                      "operator token too")
    # data and model
    data: str = Field("builtin:shakespeare", description="text file (.txt, .md, .jsonl, .jsonl.gz), a directory of "
                                                         "them, a folder from `dilocox-ctl data prepare`, "
                                                         "builtin:shakespeare, or an image dataset (fashion-mnist, "
                                                         "mnist: --model cnn or simple-cnn)")
    tokenizer: str = Field("bytes", description="bytes (UTF-8, 256 ids), or a Hugging Face tokenizer.json or a folder "
                                                 "holding one; the model's vocabulary follows it and its SHA-256 "
                                                 "joins the swarm settings")
    text_field: str = Field("text", min_length=1, description="the field holding a document's text in .jsonl data")
    model: str = Field("small", description="preset (tiny, small, llama-20m, llama-150m, llama-1b), a .json/.toml "
                                            "LlamaConfig file (a Hugging Face config.json too), or cnn / "
                                            "simple-cnn (28x28 images; simple-cnn: BadSFL's conv10-conv20-fc50)")
    workload: Optional[str] = Field(None, pattern=r"^synthetic:\S+$",
                                    description="EMULATED workload for measuring scale, never quality: "
                                                "synthetic:PARAMS:STEP_S, a model of PARAMS fp32 values (e.g. 25M) "
                                                "whose inner step sleeps STEP_S seconds and writes a deterministic "
                                                "update (dilocox/synthetic.py); replaces --model and --data")
    partition: str = Field("iid", description="image data: how the training set is split among num_clients clients "
                                              "(iid, label-shards:K, classes:K, dirichlet:ALPHA; seeded by seed)")
    num_clients: int = Field(1, ge=1, description="image data: clients the training set is split among; this node "
                                                   "trains client data_seed mod num_clients")
    seed: int = Field(0, description="model initialisation seed (must match across the swarm)")
    data_seed: Optional[int] = Field(None, description="this replica's data shard key (default: derived from peer_id)")
    data_parts: int = Field(1, ge=1, description="text: cut the training stream into this many disjoint contiguous "
                                                 "parts; this replica trains part data_seed mod data_parts (1: "
                                                 "windows drawn from the whole stream)")
    batch_size: Optional[int] = Field(None, ge=1, description="sequences per inner step (default: model preset)")
    seq_len: Optional[int] = Field(None, ge=8, description="tokens per sequence (default: model preset)")
    device: str = Field("cpu", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
                        description="where the inner steps run: cpu, cuda[:N], or auto (cuda where one is visible); "
                                    "theta, the error feedback and the round-start copy stay in host memory")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="bf16: forward and backward under autocast, "
                                                                   "fp32 master weights and optimizer state")
    micro_batch_size: Optional[int] = Field(None, ge=1, description="sequences per forward/backward; gradients "
                                                                    "accumulate up to batch_size (default: "
                                                                    "the whole batch at once)")
    activation_checkpointing: bool = Field(False, description="recompute each decoder layer's activations in the "
                                                              "backward pass (less memory, ~1/3 more compute)")
    # pipeline stages (DiLoCoX): a replica spans num_stages nodes on a fast local link
    stage: str = Field("0/1", pattern=r"^\d+/\d+$",
                       description="K/S: hold pipeline stage K of S (0/1: the whole model)")
    pipeline_addr: str = Field("127.0.0.1:0", pattern=r"^[^\s]+:\d{1,5}$",
                               description="HOST:PORT on the replica's local link: stage 0 hosts the rendezvous there, "
                                           "every stage binds its pipeline traffic to HOST "
                                           "(unauthenticated: trusted link only)")
    microbatches: int = Field(4, ge=1, description="pipeline microbatches per inner step (must divide batch_size)")
    pipeline_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    # DiLoCo
    inner_steps: int = Field(100, ge=1, description="H: inner steps per outer step")
    local_epochs: Optional[float] = Field(None, gt=0, description="set H in passes over a client's data instead: "
                                                                  "H = ceil(E * mean share / batch), the share being "
                                                                  "the training images / num_clients (tokens / "
                                                                  "data_parts for text); not with inner_steps")
    min_replicas: int = Field(1, ge=1,
                              description="wait until this many replicas (us included) are live before the first round")
    max_outer_steps: Optional[int] = Field(None, ge=1, description="stop after this many outer steps")
    inner_optimizer: Literal["adamw", "sgd"] = Field(
        "adamw", description="adamw (DiLoCo's) or sgd (torch SGD with inner_momentum: SCAFFOLD's, whose control "
                             "variates estimate gradients only under SGD; docs/algorithms.md)")
    inner_momentum: float = Field(0.9, ge=0, lt=1, description="momentum of inner_optimizer=sgd (ignored by adamw)")
    inner_lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(100, ge=0)
    total_steps: Optional[int] = Field(None, ge=1,
                                       description="cosine schedule length (default: max_outer_steps * H, else 10000)")
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, gt=0, lt=1)
    outer_lr: Optional[float] = Field(None, gt=0, description="outer learning rate (default: per compression, "
                                                              "see docs/algorithms.md)")
    outer_lr_final: Optional[float] = Field(
        None, gt=0, description="outer learning rate at the end of the cosine schedule, reached linearly from outer_lr "
                                "(default: per compression when outer_lr is unset too, else outer_lr: constant)")
    outer_momentum: Optional[float] = Field(None, ge=0, lt=1, description="outer momentum (default: per compression)")
    nesterov: Optional[bool] = Field(None, description="Nesterov outer momentum (default: per compression)")
    outer_algorithm: Literal["diloco", "scaffold"] = Field(
        "diloco", description="scaffold: SCAFFOLD control variates correct each inner step for client drift "
                              "(non-IID data); c is derived from the aggregated pseudo-gradients")
    scaffold_reset_every: int = Field(
        0, ge=0, description="with --outer-algorithm scaffold: every member restarts c and its c_i at zero after "
                             "every outer step that is a multiple of this (0: never). A robust rule that clips an "
                             "update leaves its effect in c for good; a restart takes it out (docs/security.md)")
    scaffold_reset_quiet: Optional[int] = Field(
        None, ge=0, description="with --outer-algorithm scaffold: every member shrinks c and its c_i by "
                                "--scaffold-quiet-factor (0: restarts them at zero) this many outer steps after the "
                                "last round with an outsized contribution, i.e. once an attack has stopped (0: never; "
                                f"default: {SCAFFOLD_QUIET_AFTER} with a norm bound, else 0; docs/security.md)")
    scaffold_quiet_factor: float = Field(
        SCAFFOLD_QUIET["factor"], ge=0, lt=1,
        description="--scaffold-reset-quiet: multiply c and c_i by this (0: restart at zero)")
    scaffold_quiet_rounds: int = Field(
        SCAFFOLD_QUIET["rounds"], ge=1, description="--scaffold-reset-quiet: in this many outer steps in a row")
    scaffold_outsized: float = Field(
        SCAFFOLD_QUIET["outsized"], gt=1,
        description="--scaffold-reset-quiet: a contribution the norm bound scaled by less than 1 / this (its norm "
                    "over this many times the bound) makes its round outsized")
    scaffold_quiet_every: int = Field(
        SCAFFOLD_QUIET["every"], ge=0,
        description="--scaffold-reset-quiet: while outsized rounds keep coming, also restart c and c_i at zero after "
                    "every outer step that is a multiple of this with an outsized round among its last this many "
                    "(0: off)")
    overlap: Literal["none", "delayed", "adaptive"] = Field(
        "none", description="none: synchronous DiLoCo (a sparse round forms its group during its last inner steps); "
                            "delayed: DiLoCoX one-step delay, round t's update joins the local parameters at the "
                            "end of round t+1; adaptive: round t's all-gather runs while round t+1 computes and its "
                            "update joins the local parameters as soon as it is in (the delay follows the link; "
                            "docs/algorithms.md, \"Overlapped rounds\")")
    overlap_proxy: Literal["none", "local"] = Field(
        "local", description="overlapped rounds: while a round's update is in flight, start the next round from "
                             "theta advanced by our own contribution (local: a lookahead the merge undoes, "
                             "measured in docs/algorithms.md) or from where the last round ended (none)")
    overlap_wait: float = Field(0.05, ge=0, le=1,
                                description="adaptive: at a round's end, wait for its exchange up to this fraction of "
                                            "the round's compute time; if it lands in time the next round starts "
                                            "from its update (synchronous quality, utilization >= 1 - this), "
                                            "else it is overlapped")
    compression: Literal["none", "fp16", "int8", "adaptive", "sparse", "shared"] = Field(
        "sparse",
        description="pseudo-gradient codes: none (fp32), fp16 (16-bit), int8 (8-bit), adaptive (low rank + 8-bit), "
                    "sparse (top-k per chunk + 2-bit + error feedback, all-gathered), shared (the members agree on "
                    "one index set, the union of their proposals, and reduce-scatter 2-bit values on it: an upload "
                    "per node that does not grow with the group; synchronous whole-model DiLoCo rounds only)")
    sparse_chunk: int = Field(4096, ge=2, lt=2**32, description="sparse: values per chunk")
    sparse_topk: int = Field(128, ge=1, description="sparse: values sent per chunk")
    sparse_bits: int = Field(2, description="sparse: bits per sent value (1: a sign, 2, 4 or 8)")
    sparse_beta: float = Field(0.9, ge=0, le=1, description="sparse: error-feedback decay per outer step "
                                "(0.9: measured, docs/algorithms.md)")
    sparse_rice: bool = Field(True, description="sparse: Rice-coded index gaps (else fixed-width indices)")
    shared_topk: int = Field(256, ge=1, description="shared: positions per chunk of the round's index set (the "
                                                    "union of the members' proposals, topk / k each)")
    shared_result_bits: int = Field(4, description="shared: bits per value of a reducer's result (0: fp32, 1, 2, 4, "
                                                   "8); what it drops the reducer keeps for its next result")
    aggregation: Optional[Literal["mean", "centered-clip", "trimmed-mean", "median"]] = Field(
        None, description="how a sparse round's contributions are combined (dilocox/robust.py; default: "
                          "centered-clip for sparse, mean otherwise and with --outer-algorithm scaffold)")
    norm_bound: Optional[float] = Field(None, ge=0, description="sparse: clip each contribution to this multiple of "
                                                                "the group's lower median norm first (0: off; "
                                                                "default: 2 for sparse, 0 otherwise)")
    audit_rate: float = Field(0.0, ge=0, le=1, description="sparse: probability that a member recomputes a drawn "
                              "group-mate's round and accuses it if it lied (dilocox/audit.py; 0: off; 0.57 catches "
                              "2 colluding liars of 5 within 10 rounds with probability 0.99)")
    rank_min: int = Field(1, ge=1, description="adaptive: lowest PowerSGD rank")
    rank_max: int = Field(8, ge=1, description="adaptive: highest PowerSGD rank (also the first round's)")
    rank_energy: float = Field(0.5, gt=0, le=1,
                               description="adaptive: fraction of pseudo-gradient energy the rank must keep")
    bandwidth_mbps: Optional[float] = Field(None, gt=0, description="link rate for the rank cap (default: measured)")
    quant_block: int = Field(256, ge=8, description="values per quantization scale")
    # timeouts (seconds)
    request_timeout: float = Field(5.0, gt=0)
    matchmaking_time: float = Field(15.0, gt=0)
    max_group_size: Optional[int] = Field(
        None, ge=2, description="the most replicas in one round's group (hivemind's target_group_size); a larger "
                                "round splits into groups that apply the union of their results (sparse rounds with "
                                "catch-up: docs/protocol.md, 'One update per round'); default: no limit")
    averaging_timeout: float = Field(60.0, gt=0)
    outer_round_deadline: float = Field(300.0, gt=0)
    adaptive_deadlines: bool = Field(True, description="sparse rounds: wait for downloads as long as the measured "
                                                       "link needs for their bytes (3x, at least 5 s), match for "
                                                       "3x four request latencies (at least 6 s) and look for a "
                                                       "group for 3x (matchmaking + the slowest member's compute "
                                                       "lag) (at least 60 s), each flag the cap; off: the flags")
    startup_timeout: float = Field(60.0, gt=0, description="p2pd start-up and DHT bootstrap")
    sync_deadline: Optional[float] = Field(None, gt=0, description="give up joining the DHT or syncing after this many "
                                                                   "seconds (exit 1); none: keep trying")
    catch_up_steps: int = Field(16, ge=0, description="sparse rounds: applied outer updates kept (within a state "
                                                      "download's bytes) to serve joiners that replay the steps "
                                                      "missed during their download (0: none kept; a joiner that "
                                                      "missed steps downloads again)")
    announce_period: float = Field(5.0, gt=0, description="membership record refresh interval")
    # bookkeeping
    checkpoint_dir: Optional[Path] = None
    checkpoint_every: int = Field(5, ge=1, description="outer steps between checkpoints")
    eval_batches: int = Field(4, ge=1, description="validation batches per measurement")
    eval_every: int = Field(1, ge=1, description="outer steps between validation measurements (the last outer "
                                                 "step of max_outer_steps is always measured)")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = Field(
        "text", description="text lines, or one JSON object per line (time, level, logger, message, peer_id, state, "
                            "outer_step, inner_step)")
    metrics_addr: Optional[str] = Field(None, pattern=r"^[^:\s]+:\d{1,5}$",
                                        description="serve Prometheus metrics at http://HOST:PORT/metrics (port 0 "
                                                    "picks a free one); none: off")
    attack: Optional[str] = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
                                  description="red team only: MODULE:CLASS, an Attack plugged into this node "
                                              "(daemon/redteam.py)")

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
            if data.get("scaffold_reset_quiet") is None:  # on where it can act: SCAFFOLD with a norm bound
                quiet = data.get("outer_algorithm") == "scaffold" and _nonzero(data.get("norm_bound"))
                data = {**data, "scaffold_reset_quiet": SCAFFOLD_QUIET_AFTER if quiet else 0}
        return data

    @model_validator(mode="after")
    def _check(self) -> "NodeConfig":
        chain = ["request_timeout", "matchmaking_time", "averaging_timeout", "outer_round_deadline"]
        values = [getattr(self, n) for n in chain]
        for (a, va), (b, vb) in zip(zip(chain, values), zip(chain[1:], values[1:])):
            if not va < vb:
                raise ValueError(f"timeouts must satisfy {' < '.join(chain)}; got {a}={va} >= {b}={vb}")
        k, num = (int(v) for v in self.stage.split("/"))
        if num < 1 or k >= num:
            raise ValueError(f"stage {self.stage!r}: need K < S (stages are numbered 0 .. S-1)")
        if self.rank_min > self.rank_max:
            raise ValueError(f"rank_min={self.rank_min} must be <= rank_max={self.rank_max}")
        host = self.status_addr.rsplit(":", 1)[0].strip("[]")
        local = self.status_addr.startswith("unix:") or host in ("127.0.0.1", "localhost", "::1")
        if not local and self.operator_token_file is None:
            raise ValueError(f"status_addr {self.status_addr} is not loopback: set operator_token_file, so that only "
                             f"an operator can make the node leave")
        if self.status_read == "token" and self.operator_token_file is None:
            raise ValueError("status_read=token needs operator_token_file")
        if self.tokenizer != "bytes":
            tokenizer_digest(self.tokenizer)  # a clear error now for a missing or unreadable file
        if (self.authority is None) != (self.certificate is None):
            raise ValueError("authority and certificate go together: a certified swarm needs both, an open one neither")
        if self.revocations is not None and self.authority is None:
            raise ValueError("revocations need an authority")
        if (self.aggregation != "mean" or self.norm_bound) and not self.gathers:
            raise ValueError(f"aggregation={self.aggregation} / norm_bound={self.norm_bound} need compression=sparse "
                             f"or shared: a butterfly all-reduce sums parts on reducers, which a robust rule cannot "
                             f"trust")
        if self.scaffold_reset_quiet and (self.outer_algorithm != "scaffold" or not self.norm_bound):
            raise ValueError("scaffold_reset_quiet needs outer_algorithm=scaffold and a norm bound (compression="
                             "sparse, norm_bound > 0): a round is outsized when the bound scales a contribution")
        if self.sparse_bits not in (1, 2, 4, 8):
            raise ValueError(f"sparse_bits must be 1, 2, 4 or 8; got {self.sparse_bits}")
        if self.compression == "sparse" and self.sparse_topk > self.sparse_chunk:
            raise ValueError(f"sparse_topk={self.sparse_topk} must be <= sparse_chunk={self.sparse_chunk}")
        if self.compression == "shared":
            if self.shared_topk > self.sparse_chunk:
                raise ValueError(f"shared_topk={self.shared_topk} must be <= sparse_chunk={self.sparse_chunk}")
            if self.shared_result_bits not in (0, 1, 2, 4, 8):
                raise ValueError(f"shared_result_bits must be 0 (fp32), 1, 2, 4 or 8; got {self.shared_result_bits}")
            if self.overlap != "none" or self.stage != "0/1" or self.outer_algorithm != "diloco" or self.audit_rate:
                raise ValueError("compression=shared runs synchronous DiLoCo rounds of whole models (overlap=none, "
                                 "stage 0/1, outer_algorithm=diloco, no audit_rate): an overlapped round's proxy "
                                 "and an audit need a member's contribution before the round's index set exists")
        if self.audit_rate and (self.compression != "sparse" or self.overlap != "none" or self.stage != "0/1"
                                or self.outer_algorithm != "diloco" or self.workload):
            raise ValueError("audit_rate needs synchronous sparse rounds of whole models trained with DiLoCo on a real "
                             "workload (compression=sparse, overlap=none, stage 0/1, outer_algorithm=diloco, no "
                             "workload): only those contributions can be recomputed (docs/security.md, Audits)")
        if self.local_epochs is not None and ("inner_steps" in self.model_fields_set or self.workload):
            raise ValueError("local_epochs sets H from the data: give it or inner_steps, not both, and not with an "
                             "emulated workload (it has no data)")
        if self.inner_optimizer == "adamw" and self.beta1**2 >= self.beta2:
            raise ValueError(f"beta1^2 must be < beta2 (bounded AdamW update); "
                             f"got beta1={self.beta1}, beta2={self.beta2}")
        return self


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
    """One ``--field-name`` flag per config field; absent flags stay absent (argparse.SUPPRESS)."""
    parser.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="TOML file with config fields")
    for name, field in NodeConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        kwargs = dict(dest=name, default=argparse.SUPPRESS, help=field.description)
        if _is_list(name):
            parser.add_argument(flag, action="append", metavar="MULTIADDR", **kwargs)
        elif _is_bool(name):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        else:
            parser.add_argument(flag, metavar=name.upper(), **kwargs)


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


def _from_file(path: Path) -> dict:
    try:
        values = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from e
    unknown = sorted(set(values) - set(NodeConfig.model_fields))
    if unknown:
        raise ConfigError(f"config file {path}: unknown field(s) {', '.join(unknown)}")
    return values


def load_config(flags: dict, environ: typing.Mapping[str, str] | None = None) -> NodeConfig:
    """Merge sources (flag beats env beats file beats default) and validate; raises ConfigError."""
    environ = os.environ if environ is None else environ
    flags = dict(flags)
    config_path = flags.pop("config", None) or environ.get("DILOCOX_CONFIG")
    sources: dict[str, str] = {}
    merged: dict = {}
    layers = [(_from_file(Path(config_path)), f"file {config_path}")] if config_path else []
    layers += [(_from_env(environ), "env"), (flags, "flag")]
    for values, source in layers:
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
