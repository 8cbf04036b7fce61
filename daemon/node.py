"""One dilocox node: joins the swarm, syncs state, runs DiLoCo rounds, drains on request.

The node wires its components (docs/architecture.md) and holds the training loop (``_train``):
  * ReplicaState (daemon/replica_state.py): parameters, optimizers, compressor, outer step, round;
  * ProgressTracker (daemon/progress.py): heartbeat thread, membership records, result digests;
  * OuterRounds (daemon/rounds.py): all-reduce, checks and outer step; returns outcomes;
  * StateTransfer (daemon/transfer.py): serves state to joiners, downloads it, gives a JoinPoint;
  * PipelineReplica (daemon/staging.py): a stage node's replica (``--stage K/S``, S > 1).
``start`` runs on the main thread (hivemind forks its processes there); ``run`` is the training
thread's target. The asyncio loop of daemon/cli.py only reads the StatusBoard and calls
``request_leave``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Optional

import torch
from dilocox.daemon.admission import RevocationKeeper, describe_admission, load_admission
from dilocox.daemon.audits import KEEP_ROUNDS, Audits
from dilocox.daemon.config import NodeConfig
from dilocox.daemon.exclusions import Exclusions
from dilocox.daemon.join_ahead import JoinAhead
from dilocox.daemon.outcomes import Finished, RoundOutcome
from dilocox.daemon.progress import ProgressTracker
from dilocox.daemon.redteam import load_attack
from dilocox.daemon.replica_state import ReplicaState
from dilocox.daemon.rounds import OuterRounds
from dilocox.daemon.staging import PipelineReplica, stage_tag
from dilocox.daemon.status import GONE_STATES, RoundInfo, State, StatusBoard
from dilocox.daemon.transfer import StateTransfer, result_key, update_key
from dilocox.peers import deadlines, malloc, reachability
from dilocox.peers.admission import Admission
from dilocox.peers.allgather import AllGatherTransport
from dilocox.peers.averaging import ButterflyTransport, PseudoGradientAverager
from dilocox.peers.contributions import ContributionServer
from dilocox.peers.deadlines import RoundDeadlines
from dilocox.peers.identity import is_new_identity, load_or_create_identity
from dilocox.peers.reducescatter import ReduceScatterTransport
from dilocox.peers.refusals import CAPACITY as REFUSED_CAPACITY
from dilocox.peers.spill import Spill, spill_directory
from dilocox.peers.swarm import Swarm
from dilocox.peers.transport import Hooks, Screen, Transport

from dilocox import threads
from dilocox.assignment import assigned_shard_key
from dilocox.catchup import write
from dilocox.checkpoint import load_latest_checkpoint, save_checkpoint
from dilocox.consensus import JoinKind, Lineage, lineage_standing, settings_conflict
from dilocox.diloco import host_losses
from dilocox.model import ModelSpecError
from dilocox.pipeline import PipelineBroken, pipeline_microbatches
from dilocox.prefetch import Prefetcher
from dilocox.sign_agreement import SignPolicy
from dilocox.stages import layer_range
from dilocox.tokenizer import load_tokenizer
from dilocox.workload import make_workload

logger = logging.getLogger(__name__)
SHARED_KEEP = 8  # offers kept by a shared-compression node: its union and result, four rounds of them
RESULT_ROUNDS = 2  # rounds whose group result we serve: a slow group may still be uniting the last one
_RECORDED = (RoundOutcome.APPLIED, RoundOutcome.ADOPTED, RoundOutcome.UNITED, RoundOutcome.SOLO,
             RoundOutcome.APPLIED_ALONE, RoundOutcome.SKIPPED)


SETTINGS_WAIT_S = 3.0  # a joiner waits this long for the records of its stage's members before it compares


class SettingsConflict(ValueError):
    """Our swarm settings (NodeConfig.swarm_settings) differ from those most live members of our stage
    publish: joining would split theta after every round. Exit code 2 (bad input)."""


def _device_peak_bytes() -> int:
    """Peak CUDA memory allocated by this process so far (torch.cuda.max_memory_allocated), 0 without a GPU."""
    return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() and torch.cuda.is_initialized() \
        else 0


class Node:
    def __init__(self, cfg: NodeConfig, board: StatusBoard, workload=None):
        """Checks the model, data and stage split (raises DataError / ModelSpecError naming the problem).
        ``workload``: the one ``cfg`` describes, when the caller has loaded it already (--local-epochs)."""
        self.cfg, self.board = cfg, board
        self.leave_requested = threading.Event()
        self.finished = threading.Event()
        self.exit_code = 0
        # fails fast on a bad model, data or partition (ModelSpecError, DataError, VisionDataError, ValueError)
        self.workload = workload or make_workload(cfg.model, cfg.data, cfg.seq_len, cfg.batch_size, cfg.eval_batches,
                                      cfg.partition, cfg.num_clients, cfg.seed, cfg.workload,
                                      load_tokenizer(cfg.tokenizer), cfg.text_field, cfg.data_parts)
        self.staged = cfg.num_stages > 1
        if self.workload.kind == "text":
            layer_range(self.workload.spec.llama["num_hidden_layers"], cfg.stage_index, cfg.num_stages)
        elif self.staged:
            raise ModelSpecError(f"the {cfg.model if self.workload.kind == 'image' else 'synthetic'} workload has no "
                                 f"pipeline stages: use --stage 0/1")
        if self.staged:  # the batch's pipeline micro-batches: --micro-batch-size sequences each, else --microbatches
            pipeline_microbatches(self.workload.batch_size, cfg.microbatches, cfg.micro_batch_size or 0,
                                  cfg.num_stages, cfg.pipeline_schedule)
        self.H = cfg.inner_steps
        self.attack = load_attack(cfg.attack, cfg)  # AttackError on a bad spec
        self.swarm: Optional[Swarm] = None
        self._temporary_identity: Optional[Path] = None  # no --identity: a key for this run only, removed at exit
        self.state: Optional[ReplicaState] = None
        self._prompted: Optional[tuple] = None  # _prompt_fields at our last poke
        self.progress: Optional[ProgressTracker] = None
        self.transfer: Optional[StateTransfer] = None
        self.rounds: Optional[OuterRounds] = None
        self.pipeline: Optional[PipelineReplica] = None
        self.admission: Optional[Admission] = None  # the swarm authority's view (None: an open swarm)
        self.averagers: dict[int, PseudoGradientAverager] = {}  # buffer size -> averager (one per rank)
        self.contributions: Optional[ContributionServer] = None  # sparse rounds: all-gather of payloads
        self.updates: Optional[ContributionServer] = None  # sparse rounds: applied updates, for catch-up
        self.results: Optional[ContributionServer] = None  # sparse rounds: our group's result of a split round
        self.audit_states: Optional[ContributionServer] = None  # --audit-rate: our committed round start states
        self.audits: Optional[Audits] = None
        self.ahead: Optional[JoinAhead] = None  # merges the update a node that joined ahead misses
        self._reachability = reachability.Reachability.REACHABLE  # the last verdict (peers/reachability.py)
        self.skip_steps = 0  # inner steps of the next round the swarm has already done (joiners)
        self._applied_alone_at = -1  # the outer step our last APPLIED_ALONE round reached (-1: none)
        self.resumed_from = 0  # outer step of the checkpoint we resumed from (0: none)
        self.round_log: list[tuple[float, float]] = []  # (monotonic time a round was recorded, its compute_s)
        self.settings_digest = cfg.settings_digest()  # published in our membership record
        self._conflicting: set[str] = set()  # members whose other swarm settings we logged already
        self._settings_checked = False  # our own settings passed the join check (``_check_settings``)
        self._metrics = None

    # ---------------------------------------------------------------- lifecycle
    def request_leave(self, reason: str = "requested") -> None:
        if not self.leave_requested.is_set():
            logger.info("leave requested (%s): draining", reason)
            self.leave_requested.set()

    def start(self) -> None:
        """Join the DHT and build the components. Main thread only: hivemind's averager installs
        signal handlers while it forks. Raises on failure (after cleaning up)."""
        try:
            self._join()
            self._build()
        except BaseException:
            self.exit_code = 1
            self._drain()
            raise
        self.progress.start()

    def run(self) -> None:
        """Thread target after ``start``: sync, train, drain. Sets exit_code (0 clean, 1 error)."""
        threads.claim_for_training()  # torch's CPU threads are this thread's alone (dilocox/threads.py)
        try:
            self._wait_for_replicas()
            self._check_settings()
            if self.cfg.join:
                self.skip_steps = self._sync(initial=True)
            self._train()
        except SettingsConflict as e:
            logger.error("not joining: %s", e)
            self.board.update(last_error=str(e))
            self.exit_code = 2
        except Exception as e:
            logger.error("node failed: %s", e, exc_info=logger.isEnabledFor(logging.DEBUG))
            self.board.update(last_error=str(e))
            self.exit_code = 1
        finally:
            self._drain()
            self.finished.set()

    def _join(self) -> None:
        # a key made now (no --identity, or a new file) is nobody else's: hivemind's check for a peer already
        # holding it would start a second p2pd and dial the swarm for nothing (peers/swarm.py)
        fresh = is_new_identity(self.cfg.identity)
        identity_path, key = load_or_create_identity(self.cfg.identity)
        if self.cfg.identity is None:
            self._temporary_identity = Path(identity_path).parent
        self.admission = load_admission(self.cfg, identity_path)
        self.board.update(admission=describe_admission(self.admission))
        self.swarm = Swarm(self.cfg.run_id, key, initial_peers=self.cfg.join, host_maddrs=self.cfg.listen,
                           announce_maddrs=self.cfg.announce, identity_path=identity_path,
                           startup_timeout_s=self.cfg.startup_timeout, ttl_s=3 * self.cfg.announce_period,
                           admission=self.admission, client_mode=self.cfg.client_mode,
                           auto_relay=self.cfg.auto_relay, join_deadline_s=self.cfg.sync_deadline,
                           stop=self.leave_requested, check_identity=not fresh,
                           on_join_failure=self._on_join_failure)
        self._set_state(State.JOINING, sync_reason="", sync_attempts=0)
        maddrs = self.swarm.visible_maddrs()
        self.board.update(peer_id=self.swarm.peer_id, listen_maddrs=maddrs, client_mode=self.cfg.client_mode,
                          reachability="client" if self.cfg.client_mode else "reachable")
        logger.info("joined DHT as %s, listening on %s", self.swarm.peer_id, ", ".join(maddrs))
        print(f"join with: dilocox-node --join {maddrs[0]}", flush=True)

    def _on_join_failure(self, attempt: int, reason: str, wait_s: float) -> None:
        """The --join peers did not let us in (busy or unreachable): shown in status, retried after wait_s."""
        logger.warning("joining the DHT failed (attempt %d: %s); trying again in %.1fs", attempt, reason, wait_s)
        self._set_state(State.BOOTSTRAPPING, sync_reason=reason, sync_attempts=attempt)

    def _build(self) -> None:
        cfg = self.cfg
        prefix = f"{cfg.run_id}_{stage_tag(cfg.stage_index, cfg.num_stages)}pseudo_gradient_{cfg.compression}"
        if cfg.gathers:
            # hivemind forks each averager's process: forked after the replica's tensors exist, the child would keep
            # the original of every page the training thread later rewrites (about 16 bytes per parameter). The
            # sparse rounds' one-value matchmaking averager needs no shapes, so it is forked before them.
            self._make_averagers(prefix, [1])
        shard_key = cfg.data_seed if cfg.data_seed is not None else int.from_bytes(
            hashlib.sha256(self.swarm.peer_id.encode()).digest()[:4], "little")
        loss_fn = None
        if self.attack is not None:
            honest = self.workload.loss_fn

            def loss_fn(model, x, y):
                return self.attack.training_loss(model, x, y, honest)

        self.state = ReplicaState(cfg, self.workload, shard_key, loss_fn)
        if self.attack is not None:
            self.attack.bind(self.state)
        if cfg.checkpoint_dir:
            self._resume(Path(cfg.checkpoint_dir))
            Path(cfg.checkpoint_dir).mkdir(parents=True, exist_ok=True)
            self._metrics = open(Path(cfg.checkpoint_dir) / "metrics.jsonl", "a", encoding="utf-8")
        self.state.begin_round()
        keeper = RevocationKeeper(self.swarm, self.admission, cfg.revocations, self.request_leave) \
            if self.admission is not None else None
        self.progress = ProgressTracker(self.swarm, self._describe, cfg.stage_index, cfg.num_stages,
                                        cfg.announce_period, self._on_refresh,
                                        keeper.tick if keeper else (lambda: None))
        if self.staged:
            self.pipeline = PipelineReplica(cfg, self.state, self.progress, shard_key)
        self.transfer = StateTransfer(cfg, self.state, self.progress, self._donor_progress,
                                      self.leave_requested.is_set, self.workload.samples_per_step)
        self.transfer.on_attempt = lambda reason, n: self.board.update(sync_reason=reason, sync_attempts=n)
        self.state.snapshot()
        sizes = self.state.averager_sizes()
        if not self.averagers:
            self._make_averagers(prefix, sizes)
        if cfg.gathers:
            self.contributions = ContributionServer(self.swarm.replicate_p2p, prefix,
                                                    keep=SHARED_KEEP if cfg.compression == "shared" else 4,
                                                    startup_timeout_s=cfg.startup_timeout,
                                                    tamper=self.attack.payload if self.attack else None,
                                                    admitted=self.progress.admitted if self.admission else None,
                                                    left=self._left)
            if cfg.catch_up_steps:  # applied updates for joiners that missed them (dilocox/catchup.py); more
                # bytes of them than a state download holds would be slower to replay than to download again
                self.updates = ContributionServer(self.swarm.replicate_p2p, f"{prefix}_updates",
                                                  keep=cfg.catch_up_steps, startup_timeout_s=cfg.startup_timeout,
                                                  admitted=self.progress.admitted if self.admission else None,
                                                  max_bytes=self.state.state_bytes(), offer_wait_s=0.0)
                self.spill = Spill(spill_directory(cfg.checkpoint_dir))  # served for rounds: on disk (peers/spill.py)
                self.state.on_applied = lambda u: self.updates.offer(update_key(u.outer_step),
                                                                     self.spill.keep(partial(write, u)))
                # a group's result while a split round is settled, for the other groups to unite (daemon/majority.py)
                self.results = ContributionServer(self.swarm.replicate_p2p, f"{prefix}_results", keep=RESULT_ROUNDS,
                                                  startup_timeout_s=cfg.startup_timeout, offer_wait_s=0.0,
                                                  admitted=self.progress.admitted if self.admission else None,
                                                  max_bytes=self.state.state_bytes())
            if cfg.audit_rate:  # recomputation audits (daemon/audits.py)
                self.audit_states = ContributionServer(self.swarm.replicate_p2p, f"{prefix}_audit", keep=KEEP_ROUNDS,
                                                       startup_timeout_s=cfg.startup_timeout, offer_wait_s=0.0,
                                                       admitted=self.progress.admitted if self.admission else None)
                self.audits = Audits(cfg, self.state, self.workload, self.audit_states, self.swarm.peer_id,
                                     Spill(spill_directory(cfg.checkpoint_dir)))
        # sparse whole-model rounds derive matchmaking and the group wait from measurement (flags as caps);
        # all-reduce rounds and pipeline stages keep the flags
        measured = self.contributions.link if self.contributions and cfg.adaptive_deadlines and not self.staged \
            else None
        self.deadlines = RoundDeadlines(measured, matchmaking_cap_s=cfg.matchmaking_time,
                                        group_wait_cap_s=cfg.outer_round_deadline - cfg.averaging_timeout,
                                        request_timeout_s=cfg.request_timeout)
        # synchronous sparse whole-model rounds with catch-up: a (re-)joiner computes the next round while the
        # swarm finishes the current one and merges its update mid-round (daemon/join_ahead.py); such a round
        # starts from theta_{r-2}, which an auditor would not replay, so it commits nothing (_inner_steps)
        if self.updates is not None and cfg.overlap == "none" and not self.staged:
            self.ahead = JoinAhead(self.state, self.progress, self.transfer.fetch_update, self._published_step,
                                   ThreadPoolExecutor(max_workers=1, thread_name_prefix="join-ahead"))
        self.transfer.attach(self.averagers[sizes[0]], self.updates, self.results, ahead=self.ahead is not None,
                             link=self.contributions.link if self.contributions else None)
        self.state.on_snapshot = self.transfer.published
        self.exclusions = Exclusions(lambda: self.state.round, self.audits.verified if self.audits else None,
                                     self.contributions.admitted if self.contributions is not None else None,
                                     on_ledger=self._refuse_in_matchmaking)
        self.progress.ignore(self.exclusions.excluded)  # an excluded peer's records count for nothing here
        self.rounds = OuterRounds(cfg, self.state, self.progress, self._make_transport(sizes), self.leave_requested,
                                  self.deadlines, self.exclusions, self.contributions, self.attack,
                                  fetch_update=self.transfer.fetch_update if self.updates is not None else None,
                                  audits=self.audits,
                                  fetch_result=self.transfer.fetch_result if self.results is not None else None,
                                  offer_result=self._offer_result if self.results is not None else None)
        self.board.update(outer_step=self.state.outer_step, inner_steps=self.H, global_params_digest=self.state.digest,
                          overlap=cfg.overlap, outer_algorithm=cfg.outer_algorithm, compression=cfg.compression,
                          stage_index=cfg.stage_index,
                          attack=self.attack.name if self.attack else "",
                          num_stages=cfg.num_stages, memory=self.state.memory())

    def _make_transport(self, sizes: list[int]) -> Transport:
        """The transport of this node's rounds (peers/transport.py), for its compression: dense codes by butterfly
        all-reduce on the averager of each buffer size, sparse by all-gather and shared by reduce-scatter on the
        one-value averager (``sizes[0]``) and the contribution server. Its screen takes up to H inner steps of
        weight, the configured rule and norm bound, and asks the exclusions who may contribute."""
        cfg = self.cfg
        hooks = Hooks(self.attack.gather, self.attack.contribution) if self.attack is not None else Hooks()
        if not cfg.gathers:
            return ButterflyTransport(self.averagers, hooks)
        sign = SignPolicy(cfg.robust_lr, cfg.robust_lr_agreement, cfg.robust_lr_when, cfg.robust_lr_outsized) \
            if cfg.robust_lr != "off" else None
        screen = Screen(float(cfg.inner_steps), cfg.aggregation, cfg.norm_bound, self.exclusions.admitted, sign,
                        cfg.drop_outsized, committed=bool(cfg.audit_rate))
        averager, me = self.averagers[sizes[0]], self.progress.peer_id
        if cfg.compression == "shared":
            return ReduceScatterTransport(averager, self.contributions, me, screen,
                                          request_timeout_s=cfg.request_timeout,
                                          fetch_timeout_s=cfg.averaging_timeout, hooks=hooks)
        return AllGatherTransport(averager, self.contributions, me, screen, request_timeout_s=cfg.request_timeout,
                                  fetch_timeout_s=cfg.averaging_timeout, hooks=hooks,
                                  adaptive_deadline=cfg.adaptive_deadlines)

    def _offer_result(self, index: int, result) -> None:
        """Serve our group's result of round ``index`` (an AppliedUpdate whose digest is the result's) to the
        other groups of a split round (daemon/majority.py)."""
        self.results.offer(result_key(index), self.spill.keep(partial(write, result)))

    def _refuse_in_matchmaking(self, peers: list[str]) -> None:
        """Groups this node leads take none of ``peers`` (the exclusion ledger) in as followers, and its averagers
        never ask one of them to lead or serve state: one set, the DHT's, shared by every averager."""
        if len(peers) > REFUSED_CAPACITY:
            logger.warning("%d excluded peers: matchmaking refuses the first %d", len(peers), REFUSED_CAPACITY)
        self.swarm.dht.refused.replace(peers[:REFUSED_CAPACITY])

    def _make_averagers(self, prefix: str, sizes: list[int]) -> None:
        """One averager per buffer size the rank ladder needs (hivemind averagers have fixed tensors), or one for
        the matchmaking of sparse rounds; the largest also serves our state to joiners (none before the node is
        built). Its minimum matchmaking time: the floor of measured deadlines (sparse whole-model rounds), else
        the flag (peers/deadlines.py)."""
        cfg = self.cfg
        measured = cfg.gathers and cfg.adaptive_deadlines and not self.staged
        floor_s = deadlines.matchmaking_floor(cfg.matchmaking_time, cfg.request_timeout) if measured \
            else cfg.matchmaking_time

        def serve():
            return self.transfer.serve() if self.transfer is not None else (None, [])

        for size in sizes:
            self.averagers[size] = PseudoGradientAverager(
                size, self.swarm.dht, f"{prefix}{size}", serve if size == sizes[0] else None,
                matchmaking_time_s=floor_s, request_timeout_s=cfg.request_timeout,
                averaging_timeout_s=cfg.averaging_timeout, target_group_size=cfg.max_group_size,
                refused=self.swarm.dht.refused)

    def _drain(self) -> None:
        if self.board.snapshot().state != State.STOPPED:
            self._set_state(State.DRAINING)
        if self.rounds is not None and self.exit_code == 0:
            self._checkpoint(force=True)
        if self.progress is not None:
            self.progress.stop()
        if self.rounds is not None:
            self.rounds.shutdown()
        for closer in (self.ahead, self.pipeline, self.audits, self.contributions, self.updates, self.results,
                       self.audit_states, *self.averagers.values(), self.swarm):
            try:
                if closer is not None:
                    closer.shutdown()
            except Exception as e:
                logger.warning("shutdown of %s: %s", type(closer).__name__, e)
        if self._metrics:
            self._metrics.close()
        if self._temporary_identity is not None:  # nobody uses it again: a restart without --identity makes another
            shutil.rmtree(self._temporary_identity, ignore_errors=True)
        self._set_state(State.STOPPED)
        logger.info("stopped (exit code %d)", self.exit_code)

    def _describe(self) -> dict:
        """Our membership record's fields (ProgressTracker adds the result digest)."""
        s, cfg = self.board.snapshot(), self.cfg
        return dict(peer_id=s.peer_id, run_id=cfg.run_id, state=s.state.value, outer_step=s.outer_step,
                    round=self.state.round, inner_step=s.inner_step, inner_steps=self.H,
                    tokens_per_second=s.tokens_per_second, loss=s.loss if math.isfinite(s.loss) else -1.0,
                    global_params_digest=s.global_params_digest,
                    stage_index=cfg.stage_index, num_stages=cfg.num_stages, replica_id=s.replica_id,
                    rendezvous=self.pipeline.rendezvous_addr if self.pipeline else "",
                    replica_members=s.replica_members,
                    certificate=self.admission.certificate_blob if self.admission else "",
                    client_mode=cfg.client_mode,
                    undialable=self.contributions.dials.undialable() if self.contributions else [],
                    settings=self.settings_digest,
                    accusations=dict(self.audits.accusations) if self.audits else {})

    def _deadlines(self, info: RoundInfo) -> str:
        """Status line: the deadlines in use (measured, or the flags) and what they came from."""
        cfg = self.cfg
        flags = f"matchmaking {cfg.matchmaking_time:g}s, round {cfg.outer_round_deadline:g}s (flags), "
        if self.contributions is None:
            return flags + f"all-reduce {cfg.averaging_timeout:g}s (flag)"
        if self.deadlines.link is None:  # pipeline stages, or --no-adaptive-deadlines
            return flags + deadlines.describe(self.contributions.link.snapshot(), info.download_deadline_s or None,
                                              cfg.averaging_timeout)
        return self.deadlines.describe(info.download_deadline_s or None, cfg.averaging_timeout)

    @staticmethod
    def _live_settings(others: list) -> dict[str, str]:
        """peer_id -> settings digest of those of ``others`` (ProgressTracker.others) that still take part."""
        return {m.peer_id: m.settings for m in others if m.state not in GONE_STATES}

    def _settings_conflict(self, others: list) -> Optional[str]:
        """Why our swarm settings conflict with those of the other live members of our stage (None: they do
        not; the rule is dilocox/consensus.py: settings_conflict)."""
        live = self._live_settings(others)
        found = settings_conflict(self.settings_digest, live)
        if found is None:
            return None
        digest, holders = found
        return (f"{len(holders)} of the {len(live)} other live members of our stage ({', '.join(holders[:3])}"
                f"{', ...' if len(holders) > 3 else ''}) run swarm settings {digest}; ours are {self.settings_digest}: "
                f"{self.cfg.swarm_settings()}. Replicas with other settings leave theta different after every outer "
                f"step. Start this node with the swarm's settings (`dilocox-ctl status` on a member prints them as "
                f"swarm_settings; docs/operations.md, \"Nodes of one swarm must agree on\")")

    def _check_settings(self) -> None:
        """Before joining: raise SettingsConflict if the live members of our stage run other swarm settings.
        A joiner waits up to SETTINGS_WAIT_S for their records; a running node only warns (``_on_refresh``), so
        that no set of peers can make a member that trains with the swarm leave."""
        if self.cfg.join:
            self.progress.wait(lambda others: bool(others), SETTINGS_WAIT_S, self.leave_requested.is_set)
        problem = self._settings_conflict(self.progress.others())
        if problem is not None:
            raise SettingsConflict(problem)
        self._settings_checked = True

    def _on_refresh(self, swarm_size: int) -> None:
        """Heartbeat thread, every few beats: the swarm's size and our reachability (peers/reachability.py), and
        a warning when newly seen members of our stage run other swarm settings than most (they refuse to join)."""
        members = self.progress.members(max_age_s=3 * self.cfg.announce_period) if self.progress else []
        others = self.progress.others(max_age_s=3 * self.cfg.announce_period) if self.progress else []  # same read
        differ = {p: d for p, d in self._live_settings(others).items() if d and d != self.settings_digest}
        if self._settings_checked and set(differ) - self._conflicting:  # a joiner's own check says it all
            logger.warning("member(s) %s publish other swarm settings (%s) than ours (%s: %s); such a node refuses "
                           "to join a swarm most of whose members differ from it", ", ".join(sorted(differ)),
                           ", ".join(sorted(set(differ.values()))), self.settings_digest, self.cfg.swarm_settings())
            self._conflicting |= set(differ)
        verdict, reporters = reachability.verdict(self.swarm.peer_id, self.cfg.client_mode,
                                                  [(m.peer_id, m.undialable) for m in members])
        text = reachability.describe(verdict, reporters)
        unreachable = verdict == reachability.Reachability.UNREACHABLE
        if text != self.board.snapshot().reachability and unreachable:
            logger.warning("%s; not serving our state to joiners meanwhile", text)
        if self.transfer is not None and unreachable != (self._reachability == reachability.Reachability.UNREACHABLE):
            self.transfer.offer_state(not unreachable)  # joiners cannot dial us
        self._reachability = verdict
        self.board.update(swarm_size=swarm_size, reachability=text)
        if self.cfg.auto_relay:  # a relay reservation adds /p2p-circuit addresses after start-up
            self.board.update(listen_maddrs=self.swarm.visible_maddrs(latest=True))

    def _donor_progress(self) -> tuple[str, int]:
        s = self.board.snapshot()
        return s.state.value, s.inner_step

    def _left(self, peer_id: str) -> bool:
        """True when ``peer_id`` has no live membership record, or one that says it is leaving or has left."""
        return not any(m.peer_id == peer_id and m.state not in GONE_STATES for m in self.progress.members())

    def _set_state(self, state: State, **changes) -> None:
        """Set our state (and other status fields); publish our record at once when a field others act on
        (``_prompt_fields``) differs from the last one published so, the rest with the next heartbeat."""
        previous = self.board.snapshot().state
        self.board.update(state=state, **changes)
        prompt = self._prompt_fields()
        if previous != state:
            logger.info("state %s -> %s (outer step %d)", previous.value, state.value, prompt[1])
        if self.progress is not None and prompt != self._prompted:
            self._prompted = prompt
            self.progress.poke()

    def _prompt_fields(self) -> tuple:
        """The record's fields other members act on (state, outer_step, round, theta's digest): a change is
        published at once. A poke per call published twice per round a record in which only inner_step had
        changed (bench.upload at 16 nodes: 5 DHT stores a node-round)."""
        s = self.board.snapshot()
        return s.state, s.outer_step, self.state.round if self.state else None, s.global_params_digest

    def _wait_for_replicas(self) -> None:
        if self.cfg.min_replicas <= 1:
            return
        self._set_state(State.SYNCING)
        logger.info("waiting for %d replicas to be live", self.cfg.min_replicas)
        self.progress.wait(lambda others: 1 + sum(m.state not in GONE_STATES for m in others) >= self.cfg.min_replicas,
                           float("inf"), self.leave_requested.is_set)

    # ---------------------------------------------------------------- training
    def _train(self) -> None:
        """The training loop: one round per iteration until asked to leave or max_outer_steps."""
        while not self.leave_requested.is_set():
            if self.cfg.max_outer_steps is not None and self.state.round > self.cfg.max_outer_steps:
                last = self.rounds.take_pending()  # delayed: the last round's all-reduce is still in flight
                if last is not None:
                    self._settle(self.rounds.finish(last))
                logger.info("reached max_outer_steps=%d", self.cfg.max_outer_steps)
                return
            if self.staged and not self.pipeline.formed and not self._form_replica():
                break  # asked to leave while our replica was incomplete
            skip, self.skip_steps = self.skip_steps, 0
            try:
                self._round(skip)
            except PipelineBroken as e:
                self._pause_replica(str(e))
        self._settle(self.rounds.finish_on_leave())

    def _round(self, skip: int) -> None:
        """Compute round r = state.round, then average it (none) or start averaging it (delayed)."""
        try:
            done = self._inner_steps(skip)
        except PipelineBroken:
            self.rounds.cancel_early()
            raise
        if done is None:
            self.rounds.cancel_early()
            self.state.drop_progress()  # abandon the round: nothing leaves this node
            return
        losses, compute_s, skip = done
        malloc.trim()  # the inner steps' freed activations back to the kernel before the round's buffers
        r = self.state.round  # a stage node may have adopted its replica's round
        # synchronous sparse rounds fold theta - x into the error feedback when encoding it (OuterRounds.folds):
        # it is read here only where something needs it first
        pseudo_gradient = None if self.rounds.folds() else self.state.pseudo_gradient(final=True)

        def held() -> list[torch.Tensor]:
            """The pseudo-gradient before anything moves theta or x (a re-sync keeps the round's progress as it)."""
            nonlocal pseudo_gradient
            if pseudo_gradient is None:
                pseudo_gradient = self.state.pseudo_gradient(final=True)
            return pseudo_gradient

        if not (self.state.progress_finite() if pseudo_gradient is None else
                all(torch.isfinite(g).all() for g in pseudo_gradient)):
            self._resync("pseudo-gradient holds NaN/Inf (diverged replica); not sent")
            return
        if pseudo_gradient is not None:
            self.state.end_round_control(pseudo_gradient, skip)  # SCAFFOLD's c_i (no-op for DiLoCo)
        previous = self.rounds.take_pending()
        if previous is not None:  # delayed: apply round r-1 (normally finished long ago)
            held()
            self._set_state(State.AVERAGING)
            self._settle(self.rounds.finish(previous))
            if self.state.round > r:  # settling r-1 re-synced us past round r: our compute of r is superseded
                return
        if self.ahead is not None and self.ahead.behind():  # joined ahead: theta_{r-1} should be served soon
            held()
            self.ahead.wait(self.cfg.outer_round_deadline, self.leave_requested.is_set)
        if self.state.outer_step != r - 1:  # we missed theta_{r-1} (joined late, failed round): fetch it
            held()
            self._resync(f"round {r} needs the parameters of outer step {r - 1}", keep_round=True)
            if self.state.outer_step != r - 1:
                return
        checked_at = time.monotonic()
        lineage = None if self.staged else self._lineage(r - 1, alone=self._applied_alone_at == r - 1)
        if lineage is not None:  # a split round left us in a minority lineage of theta: join the prevailing one
            held()
            self._resync(f"round {r}: the live replicas' prevailing theta at outer step {r - 1} is {lineage} (a "
                         f"strict majority's, or the largest lineage's), ours is {self.state.digest}", keep_round=True)
            if self.state.outer_step != r - 1:
                return
        self._set_state(State.AVERAGING)
        # the round's start may decide from the lineage check's read (nothing but our state change came between)
        started = self.rounds.start(pseudo_gradient, self.H - skip, compute_s, losses,
                                    read_since=checked_at if lineage is None and not self.staged else None)
        del pseudo_gradient  # encoded: synchronous rounds do not hold it through the exchange (OuterRounds.start)
        if isinstance(started, Finished):
            self._settle(started)
        elif self.cfg.overlap == "none":
            self._settle(self.rounds.finish(started))
        else:
            self.rounds.hold(started)
            # adaptive: a short wait (a fraction of the round's compute) buys a synchronous round when it lands
            round_compute_s = compute_s * self.H / max(1, self.H - skip)
            self.rounds.wait_briefly(self.rounds.overlap_budget_s(round_compute_s, self.cfg.overlap_wait))

    def _lineage(self, step: int, alone: bool = False) -> Optional[str]:
        """The theta digest the live replicas converge on at outer step ``step`` (a strict majority's, or with every
        replica at the step the largest lineage's) when it is not ours (dilocox.consensus.lineage_standing), waiting
        up to averaging_timeout while the replicas behind us may still make another theta the majority (``alone``:
        we applied ``step`` alone, so also while most of them are still behind it); None: ours stands."""
        deadline = time.monotonic() + self.cfg.averaging_timeout
        while True:
            standing, digest = lineage_standing(self.progress.others(), step, self.state.digest, alone)
            if standing != Lineage.WAIT or time.monotonic() >= deadline or self.leave_requested.is_set():
                return digest
            time.sleep(0.5)

    def _inner_steps(self, skip: int) -> Optional[tuple[list[float], float, int]]:
        """Run inner steps skip..H-1; None if asked to leave mid-round.

        A stage node first agrees with its replica on round, skip and data position and measures the
        replica's validation loss (pipeline collectives happen only here, in the same order on every
        stage). Raises PipelineBroken if a stage fails or another stage leaves. Batches are drawn ahead on
        a thread of their own (dilocox/prefetch.py; the shard's position counts those consumed). The losses
        stay on the device and are read every ``every`` steps and at the round's end, one host sync each:
        the status board's loss and tokens/s change then, its inner step at every step."""
        every = 10
        st = self.state
        if self.staged:
            skip = self.pipeline.agree_round(skip)
            if st.round % self.cfg.eval_every == 0 or st.round == self.cfg.max_outer_steps:
                val_loss, val_accuracy = st.evaluate()
                self.board.update(val_loss=val_loss, val_accuracy=val_accuracy)
        losses, start = [], time.monotonic()
        if self.cfg.assigned_data:  # the swarm chooses the round's batches (dilocox/assignment.py)
            st.assign_data(assigned_shard_key(self.cfg.run_id, self.swarm.peer_id, st.round), skip)
        # the round's start state, committed before anyone knows who audits it; a round computed ahead (from
        # theta_{r-2}) goes out unauditable, as a joiner's partial round does
        if self.audits is not None and not (self.ahead is not None and self.ahead.behind()):
            self.audits.commit(st.round, skip)
        self._set_state(State.TRAINING, inner_step=skip)
        pin = torch.device(getattr(st.inner, "device", "cpu")).type == "cuda"
        read, mark, window_tokens = 0, time.monotonic(), 0  # losses[:read] are floats; the window since mark
        with Prefetcher(st.shard, self.H - skip, pin=pin) as batches:
            for i in range(skip, self.H):
                if self.leave_requested.is_set() and not self.staged:
                    return None
                x, y = batches.next_batch()
                if self.attack is not None:
                    x, y = self.attack.batch(x, y)
                # a stage node's leave request travels with the step, so every stage stops after the same step
                loss = st.inner_step(x, y, i, stop=self.leave_requested.is_set())
                if st.inner.stop_requested:
                    if self.leave_requested.is_set():
                        return None
                    raise PipelineBroken("another stage of the replica is leaving")
                losses.append(loss)
                window_tokens += x.numel()
                if not self.staged and self.rounds.finish_early(i + 1 - skip):
                    self._published_step()
                behind = self.ahead is not None and not self.ahead.merge()  # joined ahead: theta_{r-1} not in yet
                s = self.board.snapshot()
                update = dict(inner_step=i + 1, tokens_total=s.tokens_total + x.numel())
                ema = s.tokens_per_second
                if (i + 1 - skip) % every == 0 or i + 1 == self.H:
                    # on a GPU the read waits for the steps queued so far: the window's wall time is their compute
                    losses[read:] = host_losses(losses[read:])
                    now = time.monotonic()
                    rate, steps = window_tokens / max(now - mark, 1e-9), len(losses) - read
                    ema = rate if ema == 0 else ema + (1 - 0.9 ** steps) * (rate - ema)  # 0.9 per step
                    update.update(loss=sum(losses[-10:]) / len(losses[-10:]), tokens_per_second=ema,
                                  initial_loss=losses[read] if math.isnan(s.initial_loss) else s.initial_loss)
                    read, mark, window_tokens = len(losses), now, 0
                self.board.update(**update)
                if not self.staged and not behind and self.rounds.early_wanted():
                    # form the round's group during its last inner steps: matchmaking takes matchmaking_time;
                    # before the first read, the rate so far (on a GPU: of steps queued, an overestimate)
                    speed = ema or window_tokens / max(time.monotonic() - mark, 1e-9)
                    eta_s = (self.H - i - 1) * x.numel() / speed
                    if eta_s <= self.rounds.early_window_s():
                        self.rounds.begin_early(self.H - skip, time.monotonic() - start + eta_s, eta_s)
        return losses, time.monotonic() - start, skip

    def _published_step(self) -> None:
        """Theta moved mid-round (overlap's early apply, a merge after joining ahead): publish the new outer
        step, so joiners waiting for it download now."""
        self.board.update(outer_step=self.state.outer_step, global_params_digest=self.state.digest)
        self.progress.poke()

    def _settle(self, finished: Optional[Finished]) -> None:
        """Act on a round's outcome: record it, or re-sync (and record a re-sync that fetched it)."""
        if finished is None:
            return
        # the next round's lineage check waits for the swarm after a round applied alone (consensus.lineage_standing)
        self._applied_alone_at = self.state.outer_step if finished.outcome == RoundOutcome.APPLIED_ALONE else -1
        if finished.outcome == RoundOutcome.RESYNC:
            self._resync(finished.reason)
            if finished.info is not None and self.state.outer_step == finished.index:
                self._record(finished.info, finished.losses)
        elif finished.outcome in _RECORDED:
            self._record(finished.info, finished.losses)
        if finished.behind:
            self._rejoin(finished.index)
        if self.audits is not None:
            if finished.result is not None:
                self.audits.observe(finished.index, finished.result)
            self.audits.review(self.progress.others())
        malloc.trim()  # the round's freed buffers: their pages back to the kernel (peers/malloc.py)

    def _rejoin(self, index: int) -> None:
        """Round ``index`` went on without us and we applied the update most of the swarm applied: skip to the
        members' inner step of the round they compute now (no download), as a re-sync would."""
        point = self.transfer.in_phase()
        if point is None or point.round != self.state.round:
            return  # nobody holds our theta, or they are further on: the next round's start sorts it out
        self.skip_steps = point.skip
        logger.info("round %d went on without us: applied the swarm's update; joining round %d at inner step %d",
                    index, point.round, point.skip)

    def _form_replica(self) -> bool:
        """Block until our replica has all its stages (True) or we are asked to leave (False)."""
        self._set_state(State.SYNCING, replica_id="", replica_members=[])
        group = self.pipeline.form(self.leave_requested.is_set)
        if group is None:
            return False
        self.board.update(replica_id=group.replica_id, replica_members=group.members)
        self.progress.poke()
        return True

    def _pause_replica(self, reason: str) -> None:
        """A stage died or left: drop the round, apply an all-reduce that already finished (delayed)."""
        self.pipeline.pause(reason)
        self.board.update(replica_id="", replica_members=[])
        previous = self.rounds.take_pending()
        if previous is not None:
            self._settle(self.rounds.finish(previous))

    # ---------------------------------------------------------------- state transfer
    def _resync(self, reason: str, keep_round: bool = False) -> None:
        """Download the swarm's state. keep_round: we finished this round's compute and want the
        parameters it starts from (delayed overlap), so no inner steps are skipped afterwards."""
        logger.warning("re-syncing from peers: %s", reason)
        self.rounds.cancel_early()
        self.skip_steps = self._sync(initial=False, keep_round=keep_round)

    def _sync(self, initial: bool, keep_round: bool = False) -> int:
        """Enter the swarm at the transfer's join point; returns inner steps to skip."""
        self._set_state(State.SYNCING, sync_reason="", sync_attempts=0)
        point, downloaded = self.transfer.sync(initial, keep_round)
        self.board.update(sync_reason="", sync_attempts=0)
        st, what = self.state, f"stage {self.cfg.stage_index}/{self.cfg.num_stages}" if self.staged else "the model"
        if point.kind == JoinKind.SEED:
            logger.info("no replica is training yet: starting from seed %d", self.cfg.seed)
        elif point.kind == JoinKind.CURRENT:
            st.round = point.round
            logger.info("the swarm holds our parameters (outer step %d, digest %s): no download; "
                        "joining the current round at inner step %d", st.outer_step, st.digest, point.skip)
        elif point.kind == JoinKind.ALONE and point.outer_step != st.outer_step:
            logger.warning("no other replica holds %s: continuing from our parameters of outer step %d as step %d",
                           what, st.outer_step, point.outer_step)
            st.claim_outer_step(point.outer_step)
            self.board.update(outer_step=st.outer_step)
        elif point.kind == JoinKind.ALONE:
            logger.warning("no other replica holds %s: continuing from our parameters", what)
        elif point.kind == JoinKind.DOWNLOAD:
            if initial and self.resumed_from and point.outer_step > self.resumed_from:
                logger.warning("our checkpoint holds outer step %d, the swarm is at %d: catching up from peers",
                               self.resumed_from, point.outer_step)
            d = downloaded
            st.adopt(d.theta, d.momentum, d.meta.compression_rank, d.compression_shared, d.meta.outer_step,
                     d.meta.digest, point.round, point.keep_round, d.control, d.meta.control_last_outsized)
            self.rounds.drop_pending()  # its result is part of (or superseded by) the downloaded state
            if point.keep_round and self.audits is not None:
                self.audits.withdraw(st.round)  # the round now continues another theta with a reset error feedback
            resyncs = self.board.snapshot().resyncs + (0 if initial else 1)
            self.board.update(outer_step=st.outer_step, global_params_digest=st.digest, resyncs=resyncs)
            logger.info("synced state of outer step %d (digest %s); round %d, skipping %d inner steps",
                        st.outer_step, st.digest, st.round, point.skip)
        return point.skip

    # ---------------------------------------------------------------- persistence
    def _checkpoint(self, force: bool = False) -> None:
        if not self.cfg.checkpoint_dir or self.state.outer_step == 0:
            return
        if not force and self.state.outer_step % self.cfg.checkpoint_every:
            return
        path = save_checkpoint(Path(self.cfg.checkpoint_dir), self.state.outer_step, self.state.checkpoint_state())
        logger.info("checkpoint written: %s", path)

    def _resume(self, directory: Path) -> None:
        found = load_latest_checkpoint(directory)
        if found is None:
            return
        path, saved = found
        try:
            self.state.restore(saved)
        except ValueError as e:  # restore() turns whatever a damaged file causes into ValueError
            logger.warning("ignoring checkpoint %s: %s", path, e)
            return
        self.resumed_from = self.state.outer_step
        logger.info("resumed from %s at outer step %d", path, self.state.outer_step)

    def _bits_per_byte(self, val_loss: float) -> float:
        """Validation loss in bits per UTF-8 byte (text workloads; comparable across tokenizers), else NaN."""
        corpus = getattr(self.workload, "corpus", None)
        return corpus.bits_per_byte(val_loss) if corpus is not None else math.nan

    def _record(self, info: RoundInfo, losses: list[float]) -> None:
        """Publish a finished round in status, checkpoint, and metrics (duration_s excludes evaluation)."""
        st, losses = self.state, losses or [math.nan]
        # a stage node measures its replica's val loss at round start (pipeline collectives stay in lockstep)
        measure = st.outer_step % self.cfg.eval_every == 0 or st.outer_step == self.cfg.max_outer_steps
        # evaluation is time the round does not train (compute_utilization counts it): --eval-every spaces it
        snap = self.board.snapshot()
        val_loss, val_accuracy = st.evaluate() if measure and not self.staged else (snap.val_loss, snap.val_accuracy)
        self.round_log.append((time.monotonic(), info.compute_s))
        del self.round_log[:-11]
        utilization = 0.0
        if len(self.round_log) >= 2:  # compute of the rounds completed in the window / the window's wall time
            window = self.round_log[-1][0] - self.round_log[0][0]
            utilization = min(1.0, sum(c for _, c in self.round_log[1:]) / window) if window > 0 else 0.0
        s = self.board.snapshot()
        self._set_state(State.TRAINING, outer_step=st.outer_step, inner_step=self.skip_steps,
                        compute_utilization=utilization, global_params_digest=st.digest, val_loss=val_loss,
                        val_accuracy=val_accuracy, last_round=info, memory=st.memory(),
                        bytes_sent=self.rounds.bytes_sent_total(s.bytes_sent + info.bytes_sent),
                        bytes_received=self.rounds.bytes_received_total(s.bytes_received + info.bytes_received),
                        contributions_dropped=s.contributions_dropped + len(info.dropped),
                        deadlines=self._deadlines(info))
        self._checkpoint()
        record = dict(asdict(info), peer_id=self.swarm.peer_id, digest=st.digest, val_loss=val_loss,
                      val_accuracy=val_accuracy, val_bits_per_byte=self._bits_per_byte(val_loss),
                      control_digest=st.control.digest() if st.control else "",
                      loss=sum(losses) / len(losses), tokens_total=s.tokens_total,
                      tokens_per_second=s.tokens_per_second, overlap=self.cfg.overlap,
                      compute_utilization=utilization, device_peak_bytes=_device_peak_bytes(), time=time.time(),
                      membership=self.swarm.traffic(), excluded=self.exclusions.ledger(),
                      refused_joins=sum(a.refused_joins() for a in self.averagers.values()),
                      **(self.audits.summary() if self.audits else {}))
        logger.info("round %s", json.dumps(record, sort_keys=True))
        if self._metrics:
            self._metrics.write(json.dumps(record, sort_keys=True) + "\n")
            self._metrics.flush()
