"""The sections of a node's configuration, one pydantic model per concept (as torchtitan's JobConfig).

Each section holds its fields, their descriptions and the rules that concern it alone; ``NodeConfig``
(daemon/config.py) inherits from all of them, so every field stays ``cfg.<field>``, and keeps the rules
that span sections. A ``--config`` file may give a section's fields in a ``[section]`` table
(``SECTIONS`` names them); flags and ``DILOCOX_*`` variables stay flat. Units: seconds for times,
bytes for sizes, outer steps for ``*_every``. Imports no torch (``--help`` reads it).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

# SCAFFOLD with a norm bound restarts c during an attack and shrinks it after (dilocox.scaffold.QuietRestart's
# defaults: restarted every 20 rounds while contributions over 4 x the bound come, halved in 5 rounds from 3 after
# the last one): under BadSFL, clean accuracy 0.0 / +2.4 / +1.3 points from SCAFFOLD without an attack on 3 seeds,
# against -17.6 / -4.7 / -15.6 without it; without an attack it never fired (make bench-badsfl-paper-quiet)
# (written here, not imported, so that --help imports no torch; tests/test_config.py checks they match)
SCAFFOLD_QUIET_AFTER = 3
SCAFFOLD_QUIET = dict(factor=0.5, rounds=5, outsized=4.0, every=20)
# SCAFFOLD's default --drop-outsized: a contribution over 4 x the norm bound (8 x the lower median norm) is left out;
# no honest one-class client reached it in 3 seeds of the BadSFL harness (docs/security.md)
SCAFFOLD_DROP_OUTSIZED = 4.0


DEFAULT_AUDIT_RATE = 0.1  # after the probation: about 0.1 rounds of compute a round per member (docs/security.md)
IMAGE_DATA = ("fashion-mnist", "mnist")  # dilocox/vision.py's SPECS (tests/test_config.py checks they match)


@functools.lru_cache(maxsize=8)
def data_digest(spec: str) -> str:
    """16 hex digits of a SHA-256 naming the training data ``spec`` holds, equal on machines that hold the same data
    wherever it lies: a prepared folder's index.json (dilocox/shards.py), a file's bytes, a folder's files (relative
    names and bytes, sorted), else the spec itself (builtin:, hf:, the image datasets). Reads the data once a
    process (cached). Raises ValueError naming the path when it cannot be read."""
    path = Path(spec)
    h = hashlib.sha256()
    try:
        if (path / "index.json").is_file():
            h.update(b"prepared\0" + (path / "index.json").read_bytes())
        elif path.is_file() or path.is_dir():
            files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
            for f in files:
                h.update(b"file\0" + str(f.relative_to(path) if f != path else "").encode() + b"\0")
                with f.open("rb") as stream:
                    for block in iter(lambda: stream.read(1 << 20), b""):
                        h.update(block)
        else:
            h.update(b"spec\0" + spec.encode())
    except OSError as e:
        raise ValueError(f"data {spec!r}: cannot read {e.filename} ({e.strerror})") from e
    return h.hexdigest()[:16]


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


class Section(BaseModel):
    """A section's model: unknown fields are errors and assignments are validated, as in NodeConfig. The first
    line of a section's docstring is its one-line description (--help, docs/configuration.md)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @classmethod
    def summary(cls) -> str:
        """The section's one-line description: its docstring's first line."""
        lines = (cls.__doc__ or "").strip().splitlines()
        return lines[0] if lines else ""


class NetworkSection(Section):
    """Which swarm, and how to reach it: peers, addresses, NAT, identity, start-up and join timeouts (seconds)."""

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
    startup_timeout: float = Field(60.0, gt=0, description="p2pd start-up and DHT bootstrap")
    sync_deadline: Optional[float] = Field(None, gt=0, description="give up joining the DHT or syncing after this many "
                                                                   "seconds (exit 1); none: keep trying")
    announce_period: float = Field(5.0, gt=0, description="membership record refresh interval")


class ControlSection(Section):
    """The local control endpoint (gRPC status, peers, Leave) and who may use it.

    Raises (validation) when a non-loopback status_addr or status_read=token comes without an operator token file.
    """

    status_addr: str = Field("127.0.0.1:50051", pattern=r"^([^:\s]+:\d{1,5}|unix:/\S+)$",
                             description="gRPC HOST:PORT (port 0 picks a free one), or unix:/PATH: a local socket, "
                                         "guarded by file permissions and reachable from other network namespaces")
    operator_token_file: Optional[Path] = Field(
        None, description="file holding the operator token (created with a random one if missing): Leave needs it; "
                          "required when status_addr is not loopback")
    status_read: Literal["open", "token"] = Field("open", description="whether reading status and peers needs the "
                                                                      "operator token too")

    @model_validator(mode="after")
    def _check_control(self):
        host = self.status_addr.rsplit(":", 1)[0].strip("[]")
        local = self.status_addr.startswith("unix:") or host in ("127.0.0.1", "localhost", "::1")
        if not local and self.operator_token_file is None:
            raise ValueError(f"status_addr {self.status_addr} is not loopback: set operator_token_file, so that only "
                             f"an operator can make the node leave")
        if self.status_read == "token" and self.operator_token_file is None:
            raise ValueError("status_read=token needs operator_token_file")
        return self


class SecuritySection(Section):
    """Who may join (authority, certificates, revocations) and how contributions are combined and checked.

    Raises (validation) when authority and certificate do not come together, or revocations come without an
    authority. Whether a robust rule or audits can run depends on the compression (NodeConfig's rules).
    """

    authority: Optional[Path] = Field(None, description="the swarm authority's public key (authority.pub): only peers "
                                                        "it certified take part; none: an open swarm")
    certificate: Optional[Path] = Field(None, description="this node's certificate from the swarm authority "
                                                          "(dilocox-ctl authority issue)")
    revocations: Optional[Path] = Field(None, description="the authority's revoked.json: read at start and whenever "
                                                          "it changes, and passed on to the swarm")
    aggregation: Optional[Literal["mean", "centered-clip", "centered-clip-plain", "trimmed-mean", "median"]] = Field(
        None, description="how a sparse round's contributions are combined (dilocox/robust.py; default: "
                          "centered-clip for sparse, mean otherwise and with --outer-algorithm scaffold; "
                          "centered-clip-plain: without the screen that leaves out a minority pointing against the "
                          "group's median, for strongly non-IID data)")
    norm_bound: Optional[float] = Field(None, ge=0, description="sparse: clip each contribution to this multiple of "
                                                                "the group's lower median norm first (0: off; "
                                                                "default: 2 for sparse, 0 otherwise)")
    audit_rate: Optional[float] = Field(
        None, ge=0, le=1, description="probability that a group-mate's round is recomputed by a member drawn to audit "
        "it, who accuses it if it lied (dilocox/audit.py; each member spends about this many rounds of compute a round "
        "on audits; 0.49 catches 2 colluding liars of 5 within 10 rounds with probability 0.99; 0: off; default: "
        f"{DEFAULT_AUDIT_RATE} for synchronous sparse DiLoCo rounds of whole models on a real workload, else off; "
        "SCAFFOLD's such rounds are audited only when set)")
    audit_probation: int = Field(5, ge=0, description="with audits: a peer's first rounds seen contributing are "
                                 "audited at rate 1 (a newcomer that lies is caught in its first rounds), later ones "
                                 "at audit_rate")
    drop_outsized: Optional[float] = Field(
        None, ge=0, description="sparse rounds with a norm bound: leave out a contribution the bound would scale by "
        "less than 1 / this (its norm over this many times the bound; an attacker's boosted update) instead of "
        "clipping it into the aggregate, and run the rule again over the others; the round still counts as "
        f"outsized (0: off; default: {SCAFFOLD_DROP_OUTSIZED:g} with --outer-algorithm scaffold and a norm bound, "
        "else 0; docs/security.md)")
    robust_lr: Literal["off", "flip", "mask"] = Field(
        "off", description="the robust learning rate on a sparse round's aggregate (dilocox/sign_agreement.py; "
        "Ozdayi et al., AAAI 2021): a coordinate whose contributions' signs agree less than --robust-lr-agreement is "
        "reversed (flip: theta moves away from what a lone pusher, e.g. a backdoor, wants) or left out (mask); "
        "off: never")
    robust_lr_agreement: float = Field(
        0.35, gt=0, le=1, description="--robust-lr: a coordinate needs |sum of the k contributions' signs| >= "
                                      "ceil(this x k) (0.35: 4 of 10 or 11, 2 of 3 to 5)")
    robust_lr_when: Literal["always", "outsized"] = Field(
        "outsized", description="--robust-lr: in every round, or only in rounds where the norm bound scaled a "
                                "contribution by less than 1 / --robust-lr-outsized (an attacker's boosted update; a "
                                "swarm without one pays nothing)")
    robust_lr_outsized: float = Field(4.0, gt=1, description="--robust-lr-when outsized: the factor")
    attack: Optional[str] = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
                                  description="red team only: MODULE:CLASS, an Attack plugged into this node "
                                              "(daemon/redteam.py)")

    @model_validator(mode="after")
    def _check_security(self):
        if (self.authority is None) != (self.certificate is None):
            raise ValueError("authority and certificate go together: a certified swarm needs both, an open one neither")
        if self.revocations is not None and self.authority is None:
            raise ValueError("revocations need an authority")
        return self


class ModelSection(Section):
    """What is trained: the model, its tokenizer, its initialisation seed, or an emulated workload.

    Raises (validation) when a tokenizer file is configured that cannot be read.
    """

    model: str = Field("small", description="preset (tiny, small, llama-20m, llama-150m, llama-1b), a .json/.toml "
                                            "LlamaConfig file (a Hugging Face config.json too), or cnn / "
                                            "simple-cnn (28x28 images; simple-cnn: BadSFL's conv10-conv20-fc50)")
    tokenizer: str = Field("bytes", description="bytes (UTF-8, 256 ids), or a Hugging Face tokenizer.json or a folder "
                                                 "holding one; the model's vocabulary follows it and its SHA-256 "
                                                 "joins the swarm settings")
    workload: Optional[str] = Field(None, pattern=r"^synthetic:\S+$",
                                    description="EMULATED workload for measuring scale, never quality: "
                                                "synthetic:PARAMS:STEP_S, a model of PARAMS fp32 values (e.g. 25M) "
                                                "whose inner step sleeps STEP_S seconds and writes a deterministic "
                                                "update (dilocox/synthetic.py); replaces --model and --data")
    seed: int = Field(0, description="model initialisation seed (must match across the swarm)")

    @model_validator(mode="after")
    def _check_model(self):
        if self.tokenizer != "bytes":
            tokenizer_digest(self.tokenizer)  # a clear error now for a missing or unreadable file
        return self


class DataSection(Section):
    """What this replica trains on and which share of it."""

    data: str = Field("builtin:shakespeare", description="text file (.txt, .md, .jsonl, .jsonl.gz), a directory of "
                                                         "them, a folder from `dilocox-ctl data prepare`, "
                                                         "builtin:shakespeare, or an image dataset (fashion-mnist, "
                                                         "mnist: --model cnn or simple-cnn)")
    text_field: str = Field("text", min_length=1, description="the field holding a document's text in .jsonl data")
    partition: str = Field("iid", description="image data: how the training set is split among num_clients clients "
                                              "(iid, label-shards:K, classes:K, dirichlet:ALPHA; seeded by seed)")
    num_clients: int = Field(1, ge=1, description="image data: clients the training set is split among; this node "
                                                   "trains client data_seed mod num_clients")
    data_seed: Optional[int] = Field(None, description="pick this replica's own data stream (shard key); unset, the "
                                                       "swarm assigns text data per round from run_id, peer_id and "
                                                       "the round, which audits check (dilocox/assignment.py); image "
                                                       "clients: derived from peer_id")
    data_parts: int = Field(1, ge=1, description="text: cut the training stream into this many disjoint contiguous "
                                                 "parts; this replica trains part data_seed mod data_parts (1: "
                                                 "windows drawn from the whole stream)")


class TrainingSection(Section):
    """The inner loop: steps per round, inner optimizer and schedule, batch, device and precision.

    Raises (validation) when AdamW's betas allow an unbounded update (beta1^2 >= beta2).
    """

    inner_steps: int = Field(100, ge=1, description="H: inner steps per outer step")
    local_epochs: Optional[float] = Field(None, gt=0, description="set H in passes over a client's data instead: "
                                                                  "H = ceil(E * mean share / batch), the share being "
                                                                  "the training images / num_clients (tokens / "
                                                                  "data_parts for text); not with inner_steps")
    inner_optimizer: Literal["adamw", "sgd"] = Field(
        "adamw", description="adamw (DiLoCo's) or sgd (torch SGD with inner_momentum: SCAFFOLD's, whose control "
                             "variates estimate gradients only under SGD; docs/algorithms.md)")
    inner_momentum: float = Field(0.9, ge=0, lt=1, description="momentum of inner_optimizer=sgd (ignored by adamw)")
    inner_lr: float = Field(1e-3, gt=0, description="inner learning rate at the top of the cosine schedule")
    warmup_steps: int = Field(100, ge=0, description="inner steps of linear learning-rate warm-up")
    total_steps: Optional[int] = Field(None, ge=1,
                                       description="cosine schedule length (default: max_outer_steps * H, else 10000)")
    weight_decay: float = Field(0.1, ge=0, description="inner optimizer's decoupled weight decay")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW's first-moment decay (beta1^2 < beta2)")
    beta2: float = Field(0.95, gt=0, lt=1, description="AdamW's second-moment decay")
    batch_size: Optional[int] = Field(None, ge=1, description="sequences per inner step (default: model preset)")
    seq_len: Optional[int] = Field(None, ge=8, description="tokens per sequence (default: model preset)")
    micro_batch_size: Optional[int] = Field(None, ge=1, description="sequences per forward/backward; gradients "
                                                                    "accumulate up to batch_size (default: "
                                                                    "the whole batch at once); on a pipeline "
                                                                    "stage, sequences per pipeline micro-batch, "
                                                                    "in place of microbatches (must divide "
                                                                    "batch_size)")
    device: str = Field("cpu", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
                        description="where the inner steps run: cpu, cuda[:N], or auto (cuda where one is visible); "
                                    "theta, the error feedback and the round-start copy stay in host memory")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="bf16: forward and backward under "
                                                                           "autocast, fp32 master weights and "
                                                                           "optimizer state (pipeline stages also "
                                                                           "pass activations and their gradients "
                                                                           "in bf16); auto: bf16 on a CUDA "
                                                                           "device with native bf16, else fp32")
    activation_checkpointing: bool = Field(False, description="recompute each decoder layer's activations in the "
                                                              "backward pass (less memory, ~1/3 more compute)")
    compile: bool = Field(False, description="torch.compile each decoder layer at start (for GPUs: fuses the "
                                             "norms, rotary embeddings and residual adds; the first steps wait "
                                             "tens of seconds for the compiler)")

    @model_validator(mode="after")
    def _check_training(self):
        if self.inner_optimizer == "adamw" and self.beta1**2 >= self.beta2:
            raise ValueError(f"beta1^2 must be < beta2 (bounded AdamW update); "
                             f"got beta1={self.beta1}, beta2={self.beta2}")
        return self


class PipelineSection(Section):
    """DiLoCoX pipeline stages: a replica spans S nodes on a fast local link.

    Raises (validation) when stage K/S has K >= S.
    """

    stage: str = Field("0/1", pattern=r"^\d+/\d+$",
                       description="K/S: hold pipeline stage K of S (0/1: the whole model)")
    pipeline_addr: str = Field("127.0.0.1:0", pattern=r"^[^\s]+:\d{1,5}$",
                               description="HOST:PORT on the replica's local link: stage 0 hosts the rendezvous there, "
                                           "every stage binds its pipeline traffic to HOST "
                                           "(unauthenticated: trusted link only)")
    microbatches: int = Field(4, ge=1, description="pipeline microbatches per inner step (must divide batch_size)")
    pipeline_schedule: Literal["1f1b", "gpipe"] = Field("1f1b", description="microbatch order across stages")

    @property
    def stage_index(self) -> int:
        """K of stage K/S."""
        return int(self.stage.split("/")[0])

    @property
    def num_stages(self) -> int:
        """S of stage K/S: the nodes one replica spans."""
        return int(self.stage.split("/")[1])

    @model_validator(mode="after")
    def _check_pipeline(self):
        k, num = (int(v) for v in self.stage.split("/"))
        if num < 1 or k >= num:
            raise ValueError(f"stage {self.stage!r}: need K < S (stages are numbered 0 .. S-1)")
        return self


class OuterSection(Section):
    """The outer step: optimizer, learning-rate ramp, SCAFFOLD, overlapped rounds, run length in outer steps.

    Unset outer_lr, outer_lr_final, outer_momentum and nesterov take the compression's measured defaults
    (NodeConfig, OUTER_DEFAULTS).
    """

    max_outer_steps: Optional[int] = Field(None, ge=1, description="stop after this many outer steps")
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
    max_delay_steps: Optional[int] = Field(
        None, ge=0, description="adaptive: the most inner steps of the next round by which a round's update may join "
                                "late; at that step the node waits for the exchange (none: a tenth of inner_steps, "
                                "at least 1, where the measured quality held; more for links that need it)")
    overlap_wait: float = Field(0.05, ge=0, le=1,
                                description="adaptive: at a round's end, wait for its exchange up to this fraction of "
                                            "the round's compute time; if it lands in time the next round starts "
                                            "from its update (synchronous quality, utilization >= 1 - this), "
                                            "else it is overlapped")


class CompressionSection(Section):
    """How pseudo-gradients are coded on the wire: sparse, shared, low-rank or quantized codes.

    Raises (validation) on rank_min > rank_max, sparse_bits not 1, 2, 4 or 8, or a top-k over the chunk, and
    for compression=shared a result width not 0, 1, 2, 4 or 8.
    """

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
    rank_min: int = Field(1, ge=1, description="adaptive: lowest PowerSGD rank")
    rank_max: int = Field(8, ge=1, description="adaptive: highest PowerSGD rank (also the first round's)")
    rank_energy: float = Field(0.5, gt=0, le=1,
                               description="adaptive: fraction of pseudo-gradient energy the rank must keep")
    bandwidth_mbps: Optional[float] = Field(None, gt=0, description="link rate for the rank cap (default: measured)")
    quant_block: int = Field(256, ge=8, description="values per quantization scale")

    @property
    def gathers(self) -> bool:
        """Rounds exchange contributions through the nodes' contribution servers (peers/contributions.py) rather than
        a butterfly all-reduce: sparse (all-gathered) and shared (reduce-scattered on a shared index set)."""
        return self.compression in ("sparse", "shared")

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

    @model_validator(mode="after")
    def _check_compression(self):
        if self.rank_min > self.rank_max:
            raise ValueError(f"rank_min={self.rank_min} must be <= rank_max={self.rank_max}")
        if self.sparse_bits not in (1, 2, 4, 8):
            raise ValueError(f"sparse_bits must be 1, 2, 4 or 8; got {self.sparse_bits}")
        if self.compression == "sparse" and self.sparse_topk > self.sparse_chunk:
            raise ValueError(f"sparse_topk={self.sparse_topk} must be <= sparse_chunk={self.sparse_chunk}")
        if self.compression == "shared":
            if self.shared_topk > self.sparse_chunk:
                raise ValueError(f"shared_topk={self.shared_topk} must be <= sparse_chunk={self.sparse_chunk}")
            if self.shared_result_bits not in (0, 1, 2, 4, 8):
                raise ValueError(f"shared_result_bits must be 0 (fp32), 1, 2, 4 or 8; got {self.shared_result_bits}")
        return self


class RoundsSection(Section):
    """How an outer round's group forms and how long it waits (seconds), and what it keeps for joiners.

    Raises (validation) unless request_timeout < matchmaking_time < averaging_timeout < outer_round_deadline
    (docs/operations.md, "Timeouts").
    """

    min_replicas: int = Field(1, ge=1,
                              description="wait until this many replicas (us included) are live before the first round")
    max_group_size: Optional[int] = Field(
        None, ge=2, description="the most replicas in one round's group (hivemind's target_group_size); a larger "
                                "round splits into groups that apply the union of their results (sparse rounds with "
                                "catch-up: docs/protocol.md, 'One update per round'); default: no limit")
    request_timeout: float = Field(5.0, gt=0, description="seconds one request to a peer may take")
    matchmaking_time: float = Field(15.0, gt=0, description="seconds a round looks for its group")
    averaging_timeout: float = Field(60.0, gt=0, description="seconds a round's exchange may take once its "
                                                           "group has formed")
    outer_round_deadline: float = Field(300.0, gt=0, description="seconds a whole outer round may take before "
                                                                 "it is given up")
    adaptive_deadlines: bool = Field(True, description="sparse rounds: wait for downloads as long as the measured "
                                                       "link needs for their bytes (3x, at least 5 s), match for "
                                                       "3x four request latencies (at least 6 s) and look for a "
                                                       "group for 3x (matchmaking + the slowest member's compute "
                                                       "lag) (at least 60 s), each flag the cap; off: the flags")
    catch_up_steps: int = Field(16, ge=0, description="sparse rounds: applied outer updates kept (within a state "
                                                      "download's bytes) to serve joiners that replay the steps "
                                                      "missed during their download (0: none kept; a joiner that "
                                                      "missed steps downloads again)")

    @property
    def early_window_s(self) -> float:
        """Seconds before a round's inner steps end at which its early matchmaking begins."""
        return self.matchmaking_time + self.request_timeout

    @model_validator(mode="after")
    def _check_rounds(self):
        chain = ["request_timeout", "matchmaking_time", "averaging_timeout", "outer_round_deadline"]
        values = [getattr(self, n) for n in chain]
        for (a, va), (b, vb) in zip(zip(chain, values), zip(chain[1:], values[1:])):
            if not va < vb:
                raise ValueError(f"timeouts must satisfy {' < '.join(chain)}; got {a}={va} >= {b}={vb}")
        return self


class NodeSection(Section):
    """This node's bookkeeping: checkpoints, validation measurements, metrics and logs."""

    checkpoint_dir: Optional[Path] = Field(None, description="folder of checkpoints and metrics.jsonl; resumed "
                                                             "from at start; none: no checkpoints")
    checkpoint_every: int = Field(5, ge=1, description="outer steps between checkpoints")
    eval_batches: int = Field(4, ge=1, description="validation batches per measurement")
    eval_every: int = Field(1, ge=1, description="outer steps between validation measurements (the last outer "
                                                 "step of max_outer_steps is always measured)")
    metrics_addr: Optional[str] = Field(None, pattern=r"^[^:\s]+:\d{1,5}$",
                                        description="serve Prometheus metrics at http://HOST:PORT/metrics (port 0 "
                                                    "picks a free one); none: off")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="least severe level logged")
    log_format: Literal["text", "json"] = Field(
        "text", description="text lines, or one JSON object per line (time, level, logger, message, peer_id, state, "
                            "outer_step, inner_step)")


# the [section] tables of a config file, in the order --help and docs/configuration.md list them
SECTIONS: dict[str, type[Section]] = {
    "network": NetworkSection,
    "control": ControlSection,
    "security": SecuritySection,
    "model": ModelSection,
    "data": DataSection,
    "training": TrainingSection,
    "pipeline": PipelineSection,
    "outer": OuterSection,
    "compression": CompressionSection,
    "rounds": RoundsSection,
    "node": NodeSection,
}
