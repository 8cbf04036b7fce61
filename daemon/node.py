"""One dilocox node: joins the swarm, syncs state, runs DiLoCo rounds, drains on request.

Runs in a worker thread (``Node.run``); the asyncio loop of daemon/main.py only reads the
StatusBoard and sets ``leave_requested``. A background heartbeat thread refreshes this node's
membership record.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import numpy as np
import torch

import dilocox
from daemon.config import NodeConfig
from daemon import staging, sync
from daemon.rounds import finish_on_leave, finish_round, run_round
from daemon.status import State, StatusBoard
from dilocox import exact_mean
from dilocox.checkpoint import load_latest_checkpoint, save_checkpoint
from dilocox.compression import CompressionConfig, Compressor
from dilocox.data import Corpus, ReplicaShard, validation_batches
from dilocox.diloco import InnerConfig, InnerLoop, OuterOptimizer, params_digest
from dilocox.model import ModelSpec, ModelSpecError
from dilocox.pipeline import PipelineBroken, PipelinedInnerLoop
from dilocox.stages import build_stage, layer_range
from dilocox.overlap import OuterSchedule
from peers.averaging import PseudoGradientAverager
from peers.identity import load_or_create_identity
from peers.replica import ReplicaRendezvous
from peers.swarm import MemberRecord, Swarm

logger = logging.getLogger("dilocox.node")


class Node:
    def __init__(self, cfg: NodeConfig, board: StatusBoard):
        self.cfg, self.board = cfg, board
        self.leave_requested = threading.Event()
        self.finished = threading.Event()
        self.exit_code = 0
        self.spec = ModelSpec.resolve(cfg.model)
        self.seq_len = cfg.seq_len or self.spec.seq_len
        self.batch_size = cfg.batch_size or self.spec.batch_size
        self.spec.llama["max_position_embeddings"] = max(self.seq_len, self.spec.llama["max_position_embeddings"])
        self.corpus = Corpus.from_spec(cfg.data, self.seq_len)  # fails fast on bad data (DataError)
        self.stage_index, self.num_stages = cfg.stage_index, cfg.num_stages
        layer_range(self.spec.llama["num_hidden_layers"], self.stage_index, self.num_stages)  # ModelSpecError
        if self.num_stages > 1 and self.batch_size % cfg.microbatches:
            raise ModelSpecError(f"microbatches={cfg.microbatches} must divide batch_size={self.batch_size}")
        self.rendezvous: Optional[ReplicaRendezvous] = None
        self.replica = None  # peers.replica.ReplicaGroup once our replica has all its stages
        self.H = cfg.inner_steps
        self.swarm: Optional[Swarm] = None
        self.averager: Optional[PseudoGradientAverager] = None  # serves state; also averages its buffer size
        self.averagers: dict[int, PseudoGradientAverager] = {}  # buffer size -> averager (one per rank)
        self.comm = ThreadPoolExecutor(max_workers=1, thread_name_prefix="comm")  # exchanges run here
        self._served_lock = threading.Lock()
        self._served = None
        self._donor_busy_until = 0.0  # monotonic time until which we serve no other joiner
        self._poke = threading.Event()
        self._result = (0, "")  # (round, digest) of the last averaged pseudo-gradient we hold
        self._metrics = None

    # ---------------------------------------------------------------- lifecycle
    def request_leave(self, reason: str = "requested") -> None:
        if not self.leave_requested.is_set():
            logger.info("leave requested (%s): draining", reason)
            self.leave_requested.set()

    def start(self) -> None:
        """Join the DHT and build model, optimizers and averager. Main thread only: hivemind's
        averager installs signal handlers while it forks. Raises on failure (after cleaning up)."""
        try:
            self._join()
            self._init_training()
        except BaseException:
            self.exit_code = 1
            self._drain()
            raise
        threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True).start()

    def run(self) -> None:
        """Thread target after ``start``: sync, train, drain. Sets exit_code (0 clean, 1 error)."""
        try:
            self._wait_for_replicas()
            if self.cfg.join:
                self.skip_steps = self._sync(initial=True)
            self._train()
        except Exception as e:
            logger.error("node failed: %s", e, exc_info=logger.isEnabledFor(logging.DEBUG))
            self.board.update(last_error=str(e))
            self.exit_code = 1
        finally:
            self._drain()
            self.finished.set()

    def _join(self) -> None:
        identity_path, key = load_or_create_identity(self.cfg.identity)
        self.swarm = Swarm(self.cfg.run_id, key, initial_peers=self.cfg.join, host_maddrs=self.cfg.listen,
                           announce_maddrs=self.cfg.announce, identity_path=identity_path,
                           startup_timeout_s=self.cfg.startup_timeout, ttl_s=3 * self.cfg.announce_period)
        maddrs = self.swarm.visible_maddrs()
        self.board.update(peer_id=self.swarm.peer_id, listen_maddrs=maddrs)
        logger.info("joined DHT as %s, listening on %s", self.swarm.peer_id, ", ".join(maddrs))
        print(f"join with: dilocox-node --join {maddrs[0]}", flush=True)

    def _drain(self) -> None:
        if self.board.snapshot().state != State.STOPPED:
            self._set_state(State.DRAINING)
        if self.averager is not None and self.exit_code == 0:
            self._checkpoint(force=True)
        self._poke.set()
        if self.swarm is not None:
            self.swarm.withdraw()
        self.comm.shutdown(wait=False, cancel_futures=True)
        for closer in (self.rendezvous, *self.averagers.values(), self.swarm):
            try:
                if closer is not None:
                    closer.shutdown()
            except Exception as e:
                logger.warning("shutdown of %s: %s", type(closer).__name__, e)
        if self._metrics:
            self._metrics.close()
        self._set_state(State.STOPPED)
        logger.info("stopped (exit code %d)", self.exit_code)

    def _heartbeat(self) -> None:
        while not self.finished.is_set() and self.board.snapshot().state not in (State.DRAINING, State.STOPPED):
            try:
                self._publish()
                self.board.update(swarm_size=len(self.swarm.members()))
            except Exception as e:
                logger.warning("membership refresh failed: %s", e)
            self._poke.wait(self.cfg.announce_period)
            self._poke.clear()

    def _publish(self) -> None:
        s = self.board.snapshot()
        self.swarm.publish(MemberRecord(
            peer_id=s.peer_id, run_id=self.cfg.run_id, state=s.state.value, outer_step=s.outer_step,
            round=self.round, inner_step=s.inner_step, inner_steps=self.H, tokens_per_second=s.tokens_per_second,
            loss=s.loss if math.isfinite(s.loss) else -1.0, global_params_digest=s.global_params_digest,
            result_step=self._result[0], result_digest=self._result[1], maddrs=s.listen_maddrs,
            stage_index=self.stage_index, num_stages=self.num_stages, replica_id=s.replica_id,
            rendezvous=self.rendezvous.rendezvous if self.rendezvous else "", replica_members=s.replica_members))

    def _set_state(self, state: State, **changes) -> None:
        previous = self.board.snapshot().state
        self.board.update(state=state, **changes)
        if previous != state:
            logger.info("state %s -> %s (outer step %d)", previous.value, state.value, self.board.snapshot().outer_step)
        self._poke.set()

    def _others(self):
        """Other live members holding our stage (of other replicas): the ones we average with."""
        return [m for m, _ in self.swarm.members() if m.peer_id != self.swarm.peer_id
                and m.stage_index == self.stage_index and m.num_stages == self.num_stages]

    # ---------------------------------------------------------------- state
    def _init_training(self) -> None:
        cfg = self.cfg
        total = cfg.total_steps or (cfg.max_outer_steps * self.H if cfg.max_outer_steps else 10_000)
        module = build_stage(self.spec, cfg.seed, self.stage_index, self.num_stages)  # only our layers
        inner_cfg = InnerConfig(lr=cfg.inner_lr, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2),
                                warmup_steps=cfg.warmup_steps, total_steps=total)
        if self.num_stages == 1:
            self.inner = InnerLoop(module, inner_cfg, device=cfg.device)
        else:  # attached to the replica's process group once the replica is formed (daemon/staging.py)
            self.inner = PipelinedInnerLoop(module, inner_cfg, cfg.microbatches, cfg.pipeline_schedule, cfg.device)
        self.outer = OuterOptimizer(self.inner.params, cfg.outer_lr, cfg.outer_momentum, cfg.nesterov)
        self.compressor = Compressor([tuple(p.shape) for p in self.outer.global_params], CompressionConfig(
            mode=cfg.compression, rank_min=cfg.rank_min, rank_max=cfg.rank_max, energy=cfg.rank_energy,
            block=cfg.quant_block, seed=cfg.seed))
        self.measured_bps = 0.0
        self.schedule = OuterSchedule(self.outer, cfg.overlap)
        self.pending = None  # delayed overlap: the all-reduce in flight
        self.round_log: list[tuple[float, float]] = []  # (monotonic time a round was applied, its compute_s)
        shard_key = cfg.data_seed if cfg.data_seed is not None else int.from_bytes(
            hashlib.sha256(self.swarm.peer_id.encode()).digest()[:4], "little")
        self.shard = ReplicaShard(self.corpus.train, self.seq_len, self.batch_size, cfg.seed, shard_key)
        if self.num_stages > 1:
            self.rendezvous = ReplicaRendezvous(self.swarm.peer_id, self.stage_index, self.num_stages,
                                                cfg.pipeline_addr, cfg.outer_round_deadline, shard_key, cfg.device)
        self.val_batches = validation_batches(self.corpus, self.seq_len, self.batch_size, cfg.eval_batches)
        self.step_bound = exact_mean.adam_step_bound(cfg.beta1, cfg.beta2)
        self.outer_step = 0
        self.resumed_from = 0  # outer step of the checkpoint we resumed from (0: none)
        if cfg.checkpoint_dir:
            self._resume(cfg.checkpoint_dir)
            Path(cfg.checkpoint_dir).mkdir(parents=True, exist_ok=True)
            metrics_path = Path(cfg.checkpoint_dir) / "metrics.jsonl"
            self._metrics = open(metrics_path, "a", encoding="utf-8")
        self.digest = params_digest(self.outer.global_params)
        self.round = self.outer_step + 1
        self.schedule.begin_round(self.inner.params)
        self._serve_snapshot()
        # one averager per buffer size the rank ladder needs (hivemind averagers have fixed tensors);
        # the largest also serves our state to joiners
        sizes = sorted({self.compressor.buffer_size(r) for r in self.compressor.cfg.ladder}, reverse=True)
        for size in sizes:
            self.averagers[size] = PseudoGradientAverager(
                size, self.swarm.dht, f"{cfg.run_id}_{staging.stage_tag(self)}pseudo_gradient_{cfg.compression}{size}",
                self._serve_state if size == sizes[0] else None,
                matchmaking_time_s=cfg.matchmaking_time, request_timeout_s=cfg.request_timeout,
                averaging_timeout_s=cfg.averaging_timeout)
        self.averager = self.averagers[sizes[0]]
        self.averager.set_priority(float(self.outer_step))
        self.board.update(outer_step=self.outer_step, inner_steps=self.H, global_params_digest=self.digest,
                          overlap=cfg.overlap, compression=cfg.compression, stage_index=self.stage_index,
                          num_stages=self.num_stages, memory=self.stage_memory())
        self.skip_steps = 0

    def stage_memory(self):
        """NodeStatus.memory: tensor bytes this node holds for its stage (daemon/staging.py)."""
        return staging.stage_memory(self.inner, self.outer, self.schedule, self.compressor)

    def start_digest(self) -> str:
        """Digest of everything a round must start from on every replica: theta and the shared
        compression state (rank, warm-start Q, scales)."""
        return f"{self.digest}/{self.compressor.digest()}"

    def bandwidth_bps(self) -> float:
        """Our link rate for the rank cap: configured, else the best all-reduce throughput seen
        (bytes sent / time in the all-reduce: a lower bound, as latency counts against it)."""
        return self.cfg.bandwidth_mbps * 1e6 if self.cfg.bandwidth_mbps else self.measured_bps

    def measure_bandwidth(self, result) -> None:
        if result.allreduce_s > 0:
            self.measured_bps = max(self.measured_bps, 8 * result.bytes_sent / result.allreduce_s)

    def _serve_snapshot(self) -> None:
        tensors = ([p.clone() for p in self.outer.global_params] + self.outer.momentum_buffers()
                   + [t.clone() for t in self.compressor.shared_tensors()])
        meta = dict(run_id=self.cfg.run_id, outer_step=self.outer_step, digest=self.digest,
                    num_params=len(self.outer.global_params), compression_rank=self.compressor.rank,
                    compression_digest=self.compressor.digest())
        with self._served_lock:
            self._served = (meta, tensors)
        if self.averager is not None:
            self.averager.set_priority(float(self.outer_step))

    def _serve_state(self):
        """Called by hivemind (host process) when a joiner downloads our state.

        A donor serves one joiner per transfer window (request_timeout + the state's bytes at our
        link rate); a joiner that asks meanwhile gets no state and hivemind moves it on to the next
        donor, so joiners arriving together spread over the donors (hivemind breaks priority ties at
        random, and skips a donor that fails mid-download)."""
        with self._served_lock:
            meta, tensors = self._served
            now = time.monotonic()
            if now < self._donor_busy_until:
                logger.info("state requested while serving another joiner: redirecting it to other donors")
                return None, []
            size = sum(t.numel() * t.element_size() for t in tensors)
            self._donor_busy_until = now + self.cfg.request_timeout + 8 * size / (self.bandwidth_bps() or 100e6)
        s = self.board.snapshot()
        return dict(meta, donor_state=s.state.value, donor_inner_step=s.inner_step, donor_round=self.round,
                    donor_peer_id=self.swarm.peer_id), tensors

    def _wait_for_replicas(self) -> None:
        if self.cfg.min_replicas <= 1:
            return
        self._set_state(State.SYNCING)
        logger.info("waiting for %d replicas to be live", self.cfg.min_replicas)
        live = lambda: 1 + sum(m.state not in (State.DRAINING.value, State.STOPPED.value) for m in self._others())  # noqa: E731
        while not self.leave_requested.is_set() and live() < self.cfg.min_replicas:
            time.sleep(0.3)

    def _sync(self, initial: bool, keep_round: bool = False) -> int:
        """Download the swarm's state (daemon/sync.py); returns inner steps to skip."""
        return sync.sync(self, initial, keep_round)

    # ---------------------------------------------------------------- training
    def _train(self) -> None:
        while not self.leave_requested.is_set():
            if self.cfg.max_outer_steps is not None and self.round > self.cfg.max_outer_steps:
                if self.pending is not None:  # delayed: the last round's all-reduce is still in flight
                    pending, self.pending = self.pending, None
                    finish_round(self, pending)
                logger.info("reached max_outer_steps=%d", self.cfg.max_outer_steps)
                return
            if self.num_stages > 1 and self.replica is None and not staging.form_replica(self):
                break  # asked to leave while our replica was incomplete
            skip, self.skip_steps = self.skip_steps, 0
            try:
                run_round(self, skip)
            except PipelineBroken as e:
                staging.replica_broken(self, str(e))
        if self.pending is not None:
            finish_on_leave(self, self.pending)

    def _resync(self, reason: str, keep_round: bool = False) -> None:
        """Download the swarm's state. keep_round: we finished this round's compute and want the
        parameters it starts from (delayed overlap), so no inner steps are skipped afterwards."""
        logger.warning("re-syncing from peers: %s", reason)
        self.skip_steps = self._sync(initial=False, keep_round=keep_round)

    # ---------------------------------------------------------------- persistence
    def _checkpoint(self, force: bool = False) -> None:
        if not self.cfg.checkpoint_dir or self.outer_step == 0:
            return
        if not force and self.outer_step % self.cfg.checkpoint_every:
            return
        state = dict(run_id=self.cfg.run_id, model=self.cfg.model, stage=self.cfg.stage, outer_step=self.outer_step,
                     global_params=self.outer.global_params, momentum=self.outer.momentum_buffers(),
                     inner_optimizer=self.inner.inner_optimizer.state_dict(),
                     compression=self.compressor.state_dict(),
                     shard_position=self.shard.position, shard_key=self.shard.shard_key, round=self.round,
                     rng=dict(torch=torch.get_rng_state(), python=random.getstate(), numpy=np.random.get_state()),
                     version=dilocox.__version__)
        path = save_checkpoint(Path(self.cfg.checkpoint_dir), self.outer_step, state)
        logger.info("checkpoint written: %s", path)

    def _resume(self, directory: Path) -> None:
        found = load_latest_checkpoint(Path(directory))
        if found is None:
            return
        path, state = found
        try:
            if (state.get("run_id"), state.get("model"), state.get("stage", "0/1")) != (
                    self.cfg.run_id, self.cfg.model, self.cfg.stage):
                raise ValueError(f"it belongs to run {state.get('run_id')!r} / model {state.get('model')!r} / "
                                 f"stage {state.get('stage', '0/1')!r}")
            self.outer.load_state(state["global_params"], state["momentum"])
            self.inner.load_params(self.outer.global_params)
            self.inner.inner_optimizer.load_state_dict(state["inner_optimizer"])
            if "compression" in state:
                self.compressor.load_state_dict(state["compression"])
        except (KeyError, ValueError) as e:
            logger.warning("ignoring checkpoint %s: %s", path, e)
            return
        self.shard.position = int(state["shard_position"])
        rng = state.get("rng", dict(torch=state.get("torch_rng")))
        torch.set_rng_state(rng["torch"])
        if "python" in rng:
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
        self.outer_step = int(state["outer_step"])
        self.resumed_from = self.outer_step
        logger.info("resumed from %s at outer step %d", path, self.outer_step)

    def record_metrics(self, record: dict) -> None:
        logger.info("round %s", json.dumps(record, sort_keys=True))
        if self._metrics:
            self._metrics.write(json.dumps(record, sort_keys=True) + "\n")
            self._metrics.flush()
