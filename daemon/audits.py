"""Audits: this node's part in the recomputation audits of sparse rounds (``--audit-rate``; dilocox/audit.py).

Per round r, on the training thread:

* ``commit(r)`` at the start of the round's inner steps: the start state S_r (the inner optimizer's state, the
  error-feedback buffer and, with SCAFFOLD, our c_i) is serialized, offered under ``state/r`` on its own
  ContributionServer, and its SHA-256, length and data position go into the round's gathered metadata
  (``gather_fields``): a commitment made before anyone knows who will audit the round.
* ``observe(r, result)`` once round r was applied: its contributions, gathered metadata and theta are kept for
  KEEP_ROUNDS rounds, and round r can be audited: the targets come from round r's contribution digests
  (``audit_targets`` over ``round_randomness``, at each peer's rate: ``rate_of``), and if we audit someone, the
  audit thread fetches its S_r, recomputes its H inner steps on its data and checks the contribution link at once;
  the error-feedback and optimizer links need its S_{r+1}, so the audit finishes when round r + 1 is observed
  (``audit``: PENDING until then, the replay kept on disk). A lie puts the peer into our ``accusations`` (published
  in our signed membership record) and into our exclusion votes (``verified``).
* ``review(members)``: an accusation another member published is checked by recomputing the same round here. If
  it holds, we vote against the accused too; if not, it counts against the accuser, and STRIKES of those make us
  vote against the accuser.

Audits run one at a time on the audit thread, checks of other members' accusations and the second stage of audits
first (URGENT), then the rounds drawn for us: a vote waits on the former, and a liar counts in every round it waits.

A vote excludes nobody by itself: a round's group drops a peer once most of the group votes against it, on every
member from the same round (daemon/exclusions.py, dilocox/exclusion.py); a certified swarm's operator is asked, in
the log, to revoke its certificate. A peer that does not serve its committed state is
logged and counted, not accused: a broken link looks the same (docs/security.md, "Audits").
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import logging
import math
import queue
import threading
import warnings
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import BinaryIO, Optional, Sequence

import safetensors.torch
import torch
from dilocox.peers.spill import Spill

from dilocox import audit
from dilocox.assignment import ASSIGNED_SEED, assigned_shard_key
from dilocox.sparse.wire import ContributionError

logger = logging.getLogger(__name__)
KEEP_ROUNDS = 4  # start states and round records kept: an audit of round r reads S_r, then S_{r+1}, or an accused round
STRIKES = 2  # accusations that did not hold up before the accuser is excluded
# the audit queue's order: what a vote waits on (checking another member's accusation, finishing an audit whose
# contribution link held) before the rounds drawn for us, and wait_idle's marker behind both
URGENT, ROUTINE, LAST = 0, 1, 2


class AuditOutcome(str, Enum):
    HONEST = "honest"            # every link within its threshold
    LIED = "lied"                # a link failed, or the committed state does not fit the model
    UNAVAILABLE = "unavailable"  # the peer did not serve its committed state in time
    SKIPPED = "skipped"          # not auditable here: a round we did not keep, a partial round, a missing commitment
    PENDING = "pending"          # the contribution link holds; the other links wait for the next round's commitment


@dataclass
class RoundRecord:
    """What a round we took part in leaves for audits: theta at its start, the group's gathered metadata (peer_id ->
    RoundGather), the contributions we aggregated (peer_id -> payload) and their digests (``RoundResult.inputs``, what
    members publish), and with SCAFFOLD the swarm's c at the round's start (empty without)."""

    theta: list
    gathered: dict
    contributions: dict
    inputs: dict
    control: list


def state_tensors(optimizer_state: dict, error: list[torch.Tensor],
                  control: Sequence[torch.Tensor] = ()) -> dict[str, torch.Tensor]:
    """A start state as named CPU tensors (safetensors' layout): ``opt.{i}.{key}`` for parameter i's inner-optimizer
    entries (a number as a 0-dim float64 tensor; None, SGD's absent momentum, left out), ``error.{j}`` for the
    error-feedback buffer and ``control.{j}`` for SCAFFOLD's c_i (none without). Views where the tensors are
    contiguous CPU ones: nothing is copied."""
    out = {}
    for i, entry in optimizer_state["state"].items():
        for key, value in entry.items():
            if value is not None:
                out[f"opt.{i}.{key}"] = value.detach().cpu().contiguous() if isinstance(value, torch.Tensor) \
                    else torch.tensor(float(value), dtype=torch.float64)
    out.update({f"error.{j}": e.detach().cpu().contiguous() for j, e in enumerate(error)})
    out.update({f"control.{j}": c.detach().cpu().contiguous() for j, c in enumerate(control)})
    return out


def write_state(path: Path, optimizer_state: dict, error: list[torch.Tensor],
                control: Sequence[torch.Tensor] = ()) -> None:
    """A start state written to ``path`` by safetensors (a JSON header and the raw tensor bytes, written as they lie
    in memory: no pickling, no serialized copy)."""
    safetensors.torch.save_file(state_tensors(optimizer_state, error, control), str(path))


def encode_state(optimizer_state: dict, error: list[torch.Tensor], control: Sequence[torch.Tensor] = ()) -> bytes:
    """``write_state``'s bytes in memory."""
    return safetensors.torch.save(state_tensors(optimizer_state, error, control))


def write_tensors(f: BinaryIO, tensors: list[torch.Tensor]) -> None:
    """fp32 tensors written to ``f`` back to back as raw little-endian bytes (``read_tensors`` maps them back)."""
    for t in tensors:
        f.write(t.detach().to("cpu", torch.float32).contiguous().numpy().data)


def read_tensors(buffer, shapes: list[tuple]) -> list[torch.Tensor]:
    """``write_tensors``'s tensors as views of ``buffer`` (bytes or a read-only map: no copy; not to be written)."""
    with warnings.catch_warnings():  # a read-only map: torch warns that writing to the views is undefined
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buffer, dtype=torch.float32)
    return [part.view(shape) for part, shape in zip(flat.split([math.prod(s) for s in shapes]), shapes)]


def _indexed(entries: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """Entries 0..n-1 in order; empty unless they are exactly those."""
    return [entries[j] for j in sorted(entries)] if sorted(entries) == list(range(len(entries))) else []


def decode_state(blob: bytes, params: list[torch.Tensor], param_groups: list,
                 control: bool = False) -> tuple[dict, list[torch.Tensor], list[torch.Tensor]]:
    """(inner optimizer state_dict with OUR ``param_groups``, error-feedback buffer, SCAFFOLD's c_i) from a peer's
    bytes; ``control``: the swarm trains with SCAFFOLD, so the state must hold a c_i (empty list without). Raises
    ValueError naming what does not fit ``params`` (shapes, non-finite values, missing or unexpected entries)."""
    try:
        raw = safetensors.torch.load(bytes(blob))
    except Exception as e:  # any header or layout problem of untrusted bytes (safetensors validates both)
        raise ValueError(f"start state does not load: {type(e).__name__}: {str(e)[:120]}") from e
    state: dict = {}
    flat: dict = {"error": {}, "control": {}}
    allowed = (("opt", True), ("error", False)) + ((("control", False),) if control else ())
    for name, value in raw.items():
        kind, _, rest = name.partition(".")
        index, _, key = rest.partition(".")
        if not index.isdigit() or (kind, bool(key)) not in allowed:
            raise ValueError(f"start state: unexpected entry {name[:80]!r}")
        if kind == "opt":
            state.setdefault(int(index), {})[key] = value
        else:
            flat[kind][int(index)] = value
    error, c_i = _indexed(flat["error"]), _indexed(flat["control"])
    audit_shapes = [tuple(p.shape) for p in params]
    if [tuple(getattr(e, "shape", ())) for e in error] != audit_shapes:
        raise ValueError("start state: the error-feedback buffer does not fit the model")
    if control and [tuple(c.shape) for c in c_i] != audit_shapes:
        raise ValueError("start state: the SCAFFOLD control variate c_i does not fit the model")
    per_param = {}
    for i, p in enumerate(params):
        entry = state.get(i, {}) if isinstance(state, dict) else {}
        for key, value in entry.items():
            if value is None:  # torch's SGD keeps momentum_buffer None without momentum
                continue
            if not isinstance(value, torch.Tensor) or not torch.isfinite(value).all():
                raise ValueError(f"start state: optimizer entry {i}/{key} is not a finite tensor")
            if value.dim() > 0 and tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"start state: optimizer entry {i}/{key} has shape {tuple(value.shape)}, "
                                 f"the parameter {tuple(p.shape)}")
        per_param[i] = {k: v.float() if isinstance(v, torch.Tensor) and k != "step" else v for k, v in entry.items()}
    if not all(torch.isfinite(e).all() for e in error):
        raise ValueError("start state: the error-feedback buffer holds NaN or Inf")
    if not all(torch.isfinite(c).all() for c in c_i):
        raise ValueError("start state: the SCAFFOLD control variate c_i holds NaN or Inf")
    return {"state": {i: v for i, v in per_param.items() if v}, "param_groups": copy.deepcopy(param_groups)}, \
        [e.float() for e in error], [c.float() for c in c_i]


def data_lie(cfg, peer: str, r: int, meta, meta_next) -> str:
    """Why ``peer``'s round r did not draw the data it had to (empty: it did), from its commitments of rounds r and
    r + 1 (``data_position``, ``shard_key``). Assigned data (``cfg.assigned_data``: dilocox/assignment.py): round r
    draws batches 0..H-1 of the stream assigned to (run_id, peer, r). Chosen data: a full round draws exactly H
    batches, so the next commitment continues the same stream at position + H, and after its first commitment a peer
    cannot pick its data (checked once ``meta_next`` is known; None: not yet)."""
    if cfg.assigned_data:
        key = assigned_shard_key(cfg.run_id, peer, r)
        if (meta.shard_key, meta.data_position) != (key, 0):
            return (f"its round {r} drew batches from position {meta.data_position} of shard {meta.shard_key}, not "
                    f"the data assigned to it (shard {key} from 0): data of its own choosing")
        return ""
    continued = (meta.shard_key, meta.data_position + cfg.inner_steps)
    if meta_next is not None and (meta_next.shard_key, meta_next.data_position) != continued:
        return (f"its data stream jumped from position {meta.data_position} of shard {meta.shard_key} to "
                f"{meta_next.data_position} of {meta_next.shard_key}")
    return ""


class Audits:
    """One node's audits. ``state``: daemon.replica_state.ReplicaState (whole model, sparse, DiLoCo or SCAFFOLD);
    ``server``: a ContributionServer of its own namespace for start states; ``me``: our peer_id; ``spill``: where
    the kept start states and thetas live (files mapped read-only, peers/spill.py: the page cache holds them, not
    the node's memory)."""

    def __init__(self, cfg, state, workload, server, me: str, spill: Optional[Spill] = None):
        self.cfg, self.state, self.workload, self.server, self.me = cfg, state, workload, server, me
        self.spill = spill or Spill()
        self.rate = cfg.audit_rate
        self.thresholds = audit.Thresholds()
        self._commits: dict[int, dict] = {}  # round -> our commitment (gather fields)
        self._thetas: dict[int, list] = {}   # round -> theta at its start (views of a spilled file)
        self._controls: dict[int, list] = {}  # round -> SCAFFOLD's c at its start (likewise; none without)
        self._rounds: dict[int, RoundRecord] = {}
        self._judged: set = set()  # (accused, round) checked here
        self._seen: dict[str, int] = {}  # peer_id -> the first round we saw it contribute (probation, ``rate_of``)
        self._replays: dict = {}  # (peer_id, round) -> its replay, on disk, while the audit waits for round + 1
        self._pending: dict[int, list] = {}  # round -> audits to finish once it is kept (``observe``)
        self._strikes: Counter = Counter()
        self._lock = threading.Lock()
        self.accusations: dict[str, int] = {}   # accused peer_id -> round we found it lied in (published)
        self._excluded: dict[str, str] = {}     # peer_id -> why we vote to exclude it (``verified``)
        self._found: dict[str, int] = {}        # peer_id -> the round its lie was in (for a slanderer: its accusation)
        self.outcomes: Counter = Counter()      # AuditOutcome -> audits done here (ours and verifications)
        # one audit at a time, on a daemon thread: a recomputation in flight never holds up the process's exit;
        # entries (priority, order, job), URGENT first (the module docstring says why)
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._stopping = threading.Event()
        threading.Thread(target=self._serve_jobs, name="audit", daemon=True).start()
        self._inner = None  # the recomputation's own model and optimizer, built for a run of audits, then let go
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="audit-commit")

    # ------------------------------------------------------------------ our commitments
    def commit(self, r: int, first_step: int) -> None:
        """Round r's start state, before its first inner step (``first_step``: inner steps skipped, e.g. by a joiner;
        such a round is not auditable and commits nothing)."""
        if first_step != 0:
            return
        st = self.state
        optimizer_state = st.inner.inner_optimizer.state_dict()  # references: written to the file now, not copied
        c_i = st.control.c_i if st.control is not None else []
        blob = self.spill.keep_path(lambda path: write_state(path, optimizer_state, st.compressor.error, c_i))
        self.server.offer(f"state/{r}", blob)
        shapes = [tuple(t.shape) for t in st.outer.global_params]
        theta = self.spill.keep(lambda f: write_tensors(f, st.outer.global_params))
        control = self.spill.keep(lambda f: write_tensors(f, st.control.c)) if st.control is not None else None
        # hashed beside the inner steps: the digest is only needed when the round's metadata is gathered
        digest = self._hasher.submit(lambda: hashlib.sha256(blob).hexdigest())
        with self._lock:
            self._commits[r] = dict(state_sha256=digest, state_bytes=len(blob),
                                    data_position=st.shard.position, shard_key=st.shard.shard_key)
            self._thetas[r] = read_tensors(theta, shapes)
            self._controls[r] = read_tensors(control, shapes) if control is not None else []
            for old in [k for k in self._commits if k <= r - KEEP_ROUNDS]:
                self._commits.pop(old)
                self._thetas.pop(old, None)
                self._controls.pop(old, None)

    def withdraw(self, r: int) -> None:
        """Round r's commitment no longer describes the round: a re-sync that kept the round's progress moved it
        onto another theta and zeroed the error feedback, so its contribution is not the one its start state
        recomputes to. Withdrawn before the round's metadata is gathered, the round goes out unauditable (as a
        joiner's partial round does) instead of honest work being accused (seen in tests/test_audit_swarm.py: a
        member that joined the prevailing lineage at round 4 was excluded for that round). No-op for an unknown r."""
        with self._lock:
            self._commits.pop(r, None)
            self._thetas.pop(r, None)
            self._controls.pop(r, None)

    def gather_fields(self, r: int) -> dict:
        """Round r's commitment for the gathered metadata (empty: none made); waits for its digest if it is still
        being computed."""
        with self._lock:
            fields = dict(self._commits.get(r, {}))
        if isinstance(fields.get("state_sha256"), Future):
            fields["state_sha256"] = fields["state_sha256"].result()
        return fields

    # ------------------------------------------------------------------ rounds and accusations
    def observe(self, r: int, result) -> None:
        """Round r was applied from ``result`` (peers.averaging.RoundResult): keep it; audit round r if its randomness
        draws us, and finish the audits of round r - 1 that waited for round r's commitments (``audit``)."""
        with self._lock:
            # the first round we see: in a swarm past its first probation, those already in it are not newcomers
            elder = not self._seen and r > self.cfg.audit_probation + 1
            for peer in result.inputs:
                self._seen.setdefault(peer, r - self.cfg.audit_probation if elder else r)
            theta = self._thetas.get(r)
            if theta is not None:
                self._rounds[r] = RoundRecord(theta, dict(result.gathered), dict(result.contributions),
                                              dict(result.inputs), self._controls.get(r, []))
            for old in [k for k in self._rounds if k <= r - KEEP_ROUNDS]:
                self._rounds.pop(old)
            for key in [k for k in self._replays if k[1] <= r - KEEP_ROUNDS]:
                self._replays.pop(key)
            waiting = self._pending.pop(r, []) if r in self._rounds else []
            for old in [k for k in self._pending if k <= r - KEEP_ROUNDS]:
                self._pending.pop(old)
            rec = self._rounds.get(r)
        for job in waiting:
            self._put(job, URGENT)
        if rec is None or not self.rate:
            return
        digests = rec.inputs  # the contributions' digests, the same on every member that used the same contributions
        for target in audit.audit_targets(sorted(digests), audit.round_randomness(r, digests),
                                          lambda peer: self.rate_of(peer, r)).get(self.me, []):
            if target not in self._excluded:
                self._put((r, target, None), ROUTINE)

    def rate_of(self, peer: str, r: int) -> float:
        """The rate ``peer``'s round r is audited at: 1 while it is on probation (its first ``audit_probation``
        rounds seen contributing here; a peer already contributing when we joined a swarm older than that counts as
        seen long before), ``audit_rate`` after."""
        first = self._seen.get(peer, r)
        return 1.0 if r - first < self.cfg.audit_probation else self.rate

    def review(self, members) -> None:
        """Check the accusations other members publish (``members``: peers.records.MemberRecord list). Where we kept the
        accused round we recompute it: a lie excludes the accused, an honest result counts against the accuser. Where
        we did not (we joined later, or skipped it), we audit the accused's latest round we kept instead: a lie there
        excludes it too, an honest result proves nothing about the accused round and counts against nobody."""
        for m in members:
            if m.peer_id in self._excluded:  # a liar's or slanderer's accusations cost us nothing more
                continue
            for accused, r in (getattr(m, "accusations", None) or {}).items():
                if accused == self.me or accused in self._excluded or (accused, r) in self._judged:
                    continue
                with self._lock:
                    kept = sorted(k for k in self._rounds if accused in self._rounds[k].contributions)
                if r in kept:
                    self._judged.add((accused, r))
                    self._put((r, accused, m.peer_id), URGENT)
                elif kept and (accused, -kept[-1]) not in self._judged:  # negative: a stand-in round
                    self._judged.add((accused, -kept[-1]))
                    self._put((kept[-1], accused, None), URGENT)

    def excluded(self, peer_id: str) -> Optional[str]:
        """Why we vote to exclude ``peer_id``, or None."""
        return self._excluded.get(peer_id)

    def verified(self) -> dict[str, int]:
        """Our exclusion votes: peer_id -> the round in which it lied, as found or checked here (any thread)."""
        with self._lock:
            return dict(self._found)

    def summary(self) -> dict:
        """For metrics.jsonl: peers we vote to exclude, our accusations, and audits done here by outcome."""
        return dict(audit_votes=sorted(self._excluded), audit_accusations=dict(self.accusations),
                    audit_outcomes={o.value: n for o, n in self.outcomes.items()})

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until every queued audit is done (True) or ``timeout_s`` passes (False)."""
        done = threading.Event()
        self._put(done, LAST)
        return done.wait(timeout_s)

    def shutdown(self) -> None:
        self._stopping.set()
        self._hasher.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ the audit thread
    def _put(self, job, priority: int) -> None:
        self._jobs.put((priority, next(self._order), job))

    def _serve_jobs(self) -> None:
        while not self._stopping.is_set():
            try:
                _, _, job = self._jobs.get(timeout=0.5)
            except queue.Empty:
                continue
            if isinstance(job, threading.Event):
                job.set()
            else:
                self._run(*job)
            if self._jobs.empty():  # the auditor's model and optimizer (16 bytes a parameter) only while auditing
                self._inner = None

    def _run(self, r: int, peer: str, accuser: Optional[str]) -> None:
        if self._stopping.is_set() or (accuser if accuser is not None else peer) in self._excluded:
            return  # a slanderer's accusation, or a peer we already vote against: nothing to learn
        try:
            outcome, stats = self.audit(r, peer)
        except Exception as e:  # an audit must never take the node down
            logger.exception("audit of %s's round %d failed: %s", peer, r, e)
            return
        if outcome == AuditOutcome.PENDING:  # finished once round r + 1 is kept (``observe``)
            with self._lock:
                self._pending.setdefault(r + 1, []).append((r, peer, accuser))
            return
        self.outcomes[outcome] += 1
        what = f"round {r} of {peer}" + (f" (accused by {accuser})" if accuser else "")
        if outcome == AuditOutcome.LIED:
            self._judged.add((peer, r))
            self.accusations[peer] = r
            self._exclude(peer, r, f"its round {r} does not match its recomputation ({stats})")
        elif outcome == AuditOutcome.HONEST and accuser is not None:
            self._strikes[accuser] += 1
            logger.warning("audit: %s holds up on recomputation (%s): the accusation counts against %s (%d of %d)",
                           what, stats, accuser, self._strikes[accuser], STRIKES)
            if self._strikes[accuser] >= STRIKES:
                self._exclude(accuser, r, f"{STRIKES} of its accusations did not hold up")
        else:
            logger.info("audit of %s: %s %s", what, outcome.value, stats)

    def _exclude(self, peer: str, r: int, why: str) -> None:
        if peer in self._excluded:
            return
        with self._lock:
            self._excluded[peer], self._found[peer] = why, r
        logger.warning("audit: voting to exclude %s from later rounds: %s", peer, why)
        if self.cfg.authority:
            logger.warning("audit: the swarm authority's operator should revoke the certificate of %s", peer)

    def audit(self, r: int, peer: str) -> tuple[AuditOutcome, str]:
        """Recompute ``peer``'s round r (kept by ``observe``) and judge it: (outcome, its statistics as text).

        In two stages, so that most lies are found a round sooner: as soon as round r is kept, the round is replayed
        from its committed start state S_r and the contribution link is checked (a lie there is LIED at once); the
        error-feedback and optimizer links need S_{r+1}, committed in round r + 1, so until that round is kept the
        audit is PENDING, its replay kept on disk (``_replays``), and ``observe`` queues it again then."""
        with self._lock:
            rec, nxt = self._rounds.get(r), self._rounds.get(r + 1)
            replay = self._replays.get((peer, r))
        meta, meta_next = (rec.gathered.get(peer) if rec else None), (nxt.gathered.get(peer) if nxt else None)
        payload = rec.contributions.get(peer) if rec else None
        if meta is None or payload is None or not meta.state_sha256:
            return AuditOutcome.SKIPPED, "no commitment or contribution kept for it"
        if meta.client_mode:  # behind a NAT: nobody can dial it for its committed state, and no member relays that
            return AuditOutcome.SKIPPED, "a client (--client-mode): its committed state cannot be fetched"
        if nxt is not None and (meta_next is None or not meta_next.state_sha256):
            return AuditOutcome.SKIPPED, f"no commitment of round {r + 1} kept for it"
        lie = data_lie(self.cfg, peer, r, meta, meta_next)
        if lie:
            return AuditOutcome.LIED, lie
        inner = self._auditor()
        groups = inner.inner_optimizer.state_dict()["param_groups"]
        if replay is None:
            state = self._committed_state(peer, r, meta, inner, groups)
            if isinstance(state[0], AuditOutcome):
                return state
            opt, e_start, c_start = state
            shard = self.workload.shard(ASSIGNED_SEED if self.cfg.assigned_data else self.cfg.seed, meta.shard_key)
            batches = [shard.batch_at(meta.data_position + i) for i in range(self.cfg.inner_steps)]
            control = self._control_link(r, rec, c_start)
            delta, opt_rec = audit.recompute(inner, rec.theta, opt, batches, (r - 1) * self.cfg.inner_steps,
                                             control.correction() if control is not None else None)
        else:
            e_start, delta, opt_rec, c_start = self._load_replay(replay, inner, groups)
            control = self._control_link(r, rec, c_start)
        e_next = opt_next = None
        if nxt is not None:
            state = self._committed_state(peer, r + 1, meta_next, inner, groups)
            if isinstance(state[0], AuditOutcome):
                return state
            opt_next, e_next, c_next = state
            if control is not None:
                control = dataclasses.replace(control, next=c_next)
        try:
            report = audit.full_audit(payload, e_start, e_next, delta, opt_next, opt_rec, self.cfg.sparse_config(),
                                      self.thresholds, control)
        except ContributionError as e:
            return AuditOutcome.LIED, f"its contribution does not decode: {e}"
        stats = ", ".join([f"{k} {v:.3g}" for k, v in report.stats.items()] + [report.detail] * bool(report.detail))
        if report.verdict == audit.AuditVerdict.LIED:
            return AuditOutcome.LIED, stats
        if nxt is None:  # the contribution holds up so far: the other links once round r + 1 is kept
            kept = self.spill.keep_path(lambda path: safetensors.torch.save_file(
                {**{f"e.{i}": t.contiguous() for i, t in enumerate(e_start)},
                 **{f"d.{i}": t.contiguous() for i, t in enumerate(delta)},
                 **{f"c.{i}": t.contiguous() for i, t in enumerate(c_start)}, **state_tensors(opt_rec, [])}, str(path)))
            with self._lock:
                self._replays[(peer, r)] = kept
            return AuditOutcome.PENDING, stats
        return AuditOutcome.HONEST, stats

    def _control_link(self, r: int, rec: RoundRecord, c_start: Sequence[torch.Tensor]) -> Optional[audit.ControlLink]:
        """SCAFFOLD's part of the audit of round r (None for DiLoCo): our c at the round's start, the contributor's
        committed c_i, the round's lr_sum, and the factors an outer step may scale c_i by (1 and the quiet
        restart's)."""
        if self.state.control is None:
            return None
        return audit.ControlLink(rec.control, c_start, None, self.state.lr_sum(r),
                                 (1.0, self.state.control.quiet.factor))

    def _committed_state(self, peer: str, r: int, meta, inner, groups) -> tuple:
        """``peer``'s committed start state of round r, fetched and checked against its digest and length, then
        decoded for ``inner``: (optimizer state, error feedback, c_i: empty without SCAFFOLD), or
        (UNAVAILABLE / LIED, why)."""
        got, failed = self.server.fetch({peer: (meta.state_sha256, meta.state_bytes)}, f"state/{r}",
                                        self.cfg.averaging_timeout)
        if peer not in got:
            return AuditOutcome.UNAVAILABLE, f"state/{r}: {failed.get(peer, 'not served')}"
        try:
            return decode_state(got[peer], inner.params, groups, control=self.state.control is not None)
        except ValueError as e:
            return AuditOutcome.LIED, str(e)

    @staticmethod
    def _load_replay(kept, inner, groups) -> tuple[list, list, dict, list]:
        """A replay kept by ``audit``'s first stage (our own file): (e_r, the recomputed delta, the recomputed
        optimizer state, the committed c_i: empty without SCAFFOLD)."""
        raw = safetensors.torch.load(bytes(kept))
        state: dict = {}
        for name, value in raw.items():
            if name.startswith("opt."):
                _, index, key = name.split(".", 2)
                state.setdefault(int(index), {})[key] = value
        n = len(inner.params)
        return [raw[f"e.{i}"] for i in range(n)], [raw[f"d.{i}"] for i in range(n)], \
            {"state": state, "param_groups": groups}, [raw[f"c.{i}"] for i in range(n) if f"c.{i}" in raw]

    def _auditor(self):
        if self._inner is None:
            module = self.workload.build(self.cfg.seed, 0, 1)
            self._inner = self.workload.inner_loop(module, self.state.inner.config)
        return self._inner
