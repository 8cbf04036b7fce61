"""ReplicaState: everything one node holds of its replica's training, and nothing else.

Parameters, inner and outer optimizers, the outer schedule (synchronous or one-step delay), the
compressor, the data shard, the outer step and round, digests, served snapshots and checkpoint
contents. No threads, no network, no status board: the components in daemon/ read and change it
through these methods, and only the training thread calls the mutating ones (the donor snapshot
is copied under a lock because hivemind reads it from another thread).
"""

from __future__ import annotations

import copy
import logging
import math
import random
import threading
from typing import Callable, Mapping, Optional, Sequence, Union

import numpy as np
import torch
from dilocox.daemon.config import NodeConfig
from dilocox.daemon.status import StageMemory

import dilocox
from dilocox import exact_mean
from dilocox.assignment import ASSIGNED_SEED
from dilocox.catchup import AppliedUpdate, Replayed, replay
from dilocox.compression import CompressionConfig, DenseCompressor
from dilocox.diloco import InnerConfig, OuterOptimizer, params_digest, resolve_precision, training_device
from dilocox.overlap import OuterSchedule
from dilocox.pipeline import PipelinedInnerLoop
from dilocox.scaffold import ControlVariates, QuietRestart, Restart, apply_correction_step
from dilocox.shared_round import SharedCompressor
from dilocox.sparse.compressor import SparseCompressor
from dilocox.stages import tensor_bytes
from dilocox.synthetic import SyntheticInnerLoop

logger = logging.getLogger(__name__)


def stage_memory(inner, outer, schedule, compressor) -> StageMemory:
    """Tensor bytes held for a stage: parameters, inner_optimizer state, outer state, error feedback.

    ``inner``: InnerLoop, ``outer``: OuterOptimizer, ``schedule``: OuterSchedule, ``compressor``:
    Compressor. Counts storage without copying anything (called once per round)."""
    inner_state = [t for st in inner.inner_optimizer.state.values() for t in st.values()
                   if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not inner_state:  # allocated lazily at the first step: AdamW's exp_avg + exp_avg_sq, SGD's momentum buffer
        kept = dict(adamw=2, sgd=1 if inner.config.momentum else 0).get(inner.config.optimizer, 0)
        inner_state = [p for p in inner.params for _ in range(kept)]
    theta = tensor_bytes(outer.global_params)  # the momentum buffer has theta's shapes (fp32), once allocated or not
    momentum = theta if outer.has_momentum else 0  # momentum-free outer SGD (the sparse default) keeps none
    start = 0 if schedule.aliased else tensor_bytes(schedule.round_start)  # synchronous rounds: theta is the start
    m = StageMemory(params_bytes=tensor_bytes(inner.params), inner_optimizer_bytes=tensor_bytes(inner_state),
                    outer_optimizer_bytes=theta + momentum + start,
                    error_feedback_bytes=tensor_bytes(compressor.error))
    m.total_bytes = m.params_bytes + m.inner_optimizer_bytes + m.outer_optimizer_bytes + m.error_feedback_bytes
    return m


def _numpy_state() -> tuple:
    """numpy's global RNG state with its key array as a list (checkpoints load with weights_only=True)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return name, keys.tolist(), int(pos), int(has_gauss), float(gauss)


class ReplicaState:
    """One node's share of its replica: stage ``cfg.stage_index`` of ``cfg.num_stages``.

    ``outer_step``: outer updates applied to theta (its version); ``round``: the round being
    computed (its all-reduce's group key); ``digest``: hex digest of theta (docs/protocol.md).
    """

    def __init__(self, cfg: NodeConfig, workload, shard_key: int, loss_fn=None):
        """``workload``: dilocox.workload.TextWorkload or ImageWorkload (model, loss, batches); ``loss_fn``
        replaces its training loss (the red-team hook, daemon/redteam.py)."""
        self.cfg, self.H, self.workload = cfg, cfg.inner_steps, workload
        total = cfg.schedule_steps
        self.ramp_steps = cfg.ramp_rounds  # the outer lr ramp spans the cosine schedule
        module = workload.build(cfg.seed, cfg.stage_index, cfg.num_stages)  # only our layers
        # text models: written into checkpoints so `dilocox-ctl export` can rebuild a Hugging Face model
        self.architecture = workload.architecture(module) if hasattr(workload, "architecture") else None
        device = training_device(cfg.device)
        inner_cfg = InnerConfig(lr=cfg.inner_lr, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2),
                                optimizer=cfg.inner_optimizer, momentum=cfg.inner_momentum,
                                warmup_steps=cfg.warmup_steps, total_steps=total,
                                precision=resolve_precision(cfg.precision, device),
                                micro_batch_size=cfg.micro_batch_size or 0, compile=cfg.compile)
        if hasattr(module, "activation_checkpointing"):  # decoder stages (dilocox/stages.py)
            module.activation_checkpointing = cfg.activation_checkpointing
        if cfg.num_stages == 1:
            self.inner = workload.inner_loop(module, inner_cfg, device=device, loss_fn=loss_fn, seed=cfg.seed,
                                             shard_key=shard_key)
        else:  # attached to the replica's process group once the replica is formed (daemon/staging.py)
            self.inner = PipelinedInnerLoop(module, inner_cfg, cfg.microbatches, cfg.pipeline_schedule, device)
        self.outer = OuterOptimizer(self.inner.params, cfg.outer_lr, cfg.outer_momentum, cfg.nesterov,
                                    cfg.outer_lr_final, self.ramp_steps)
        shapes = [tuple(p.shape) for p in self.outer.global_params]
        if cfg.compression == "sparse":
            self.compressor = SparseCompressor(shapes, cfg.sparse_config())
        elif cfg.compression == "shared":
            self.compressor = SharedCompressor(shapes, cfg.shared_config())
        else:
            self.compressor = DenseCompressor(shapes, CompressionConfig(
                mode=cfg.compression, rank_min=cfg.rank_min, rank_max=cfg.rank_max, energy=cfg.rank_energy,
                block=cfg.quant_block, seed=cfg.seed))
        self.schedule = OuterSchedule(self.outer, cfg.overlap, cfg.overlap_proxy if cfg.overlap != "none" else "none")
        self.shard = workload.shard(cfg.seed, shard_key)
        self.val_batches = workload.val_batches()
        # SCAFFOLD (dilocox/scaffold.py): c shared by the swarm (digested, served, checkpointed), c_i local
        self.control = ControlVariates(self.outer.global_params, cfg.scaffold_reset_every, self._quiet()) \
            if cfg.outer_algorithm == "scaffold" else None
        self._correction: Optional[list[torch.Tensor]] = None
        self.step_bound, self.decay_factor = exact_mean.inner_step_bound(
            inner_cfg.optimizer, inner_cfg.betas, inner_cfg.momentum, inner_cfg.max_grad_norm)
        self.outer_step = 0
        self.round = 1
        self.digest = params_digest(self.outer.global_params)
        # theta, momentum, c and the shared compression state change only under this lock (training thread);
        # ``served`` copies them under it when a joiner asks, so no second copy of theta is held between requests
        self._theta_lock = threading.RLock()
        self.on_snapshot: Callable[[], None] = lambda: None  # e.g. raise our donor priority
        self.on_applied: Callable[[AppliedUpdate], None] = lambda update: None  # e.g. serve it for catch-up

    def _quiet(self) -> QuietRestart:
        cfg = self.cfg
        return QuietRestart(cfg.scaffold_reset_quiet, cfg.scaffold_quiet_factor, cfg.scaffold_quiet_rounds,
                            cfg.scaffold_outsized, cfg.scaffold_quiet_every)

    # ------------------------------------------------------------------ reading
    def outsized(self, scales: Mapping[str, float]) -> bool:
        """Whether a round whose rule scaled contributions by ``scales`` (peer_id -> scale < 1) had an outsized
        one, for SCAFFOLD's quiet restart (``--scaffold-reset-quiet``); False without it."""
        return self.control is not None and self.control.quiet.is_outsized(scales)

    @property
    def params(self) -> list[torch.Tensor]:
        """The local (inner) parameters, on the training device."""
        return self.inner.params

    def start_digest(self) -> str:
        """Digest of everything a round must start from on every replica: theta and the shared
        compression state (rank, warm-start Q, scales), and SCAFFOLD's swarm control variate c."""
        digest = f"{self.digest}/{self.compressor.digest()}"
        return f"{digest}/{self.control.digest()}" if self.control is not None else digest

    def averager_sizes(self) -> list[int]:
        """All-reduce buffer sizes this node needs, largest first: one per rank of the adaptive ladder,
        or a single one-value buffer for sparse and shared rounds (matchmaking only; peers/allgather.py)."""
        return self.compressor.averager_sizes()

    def memory(self) -> StageMemory:
        return stage_memory(self.inner, self.outer, self.schedule, self.compressor)

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """(validation loss in nats/token or nats/image, accuracy or NaN for text) of theta, the global
        parameters, on the held-out batches. The model
        holds the local parameters, which differ from theta during a delayed round: they are swapped out
        for the evaluation and put back bit for bit (a stage node evaluates with its replica's stages,
        which swap at the same point of their collective order)."""
        if isinstance(self.inner, SyntheticInnerLoop):  # its loss reads theta directly: no swap, no extra copy
            return self.inner.evaluate_params(self.outer.global_params), math.nan
        local = [p.detach().clone() for p in self.inner.params]
        self.inner.load_params(self.outer.global_params)
        try:
            return self.inner.evaluate(self.val_batches), self.workload.accuracy(self.inner.model, self.val_batches)
        finally:
            self.inner.load_params(local)

    def lr_sum(self, r: int, first: int = 0) -> float:
        """Sum of the inner learning rates of round r's steps first..H-1 (schedule: InnerConfig.lr_at)."""
        return sum(self.inner.config.lr_at((r - 1) * self.H + i) for i in range(first, self.H))

    def pseudo_gradient_bounds(self, r: int) -> list[float]:
        """Per-tensor bound on |pseudo_gradient| for round r (the offsets of values sent in fp32;
        every replica computes the same, dilocox/exact_mean.py)."""
        lr_sum = self.lr_sum(r)
        return [exact_mean.pseudo_gradient_bound(lr_sum, self.cfg.weight_decay * self.decay_factor,
                                                  float(p.abs().max()), self.step_bound)
                for p in self.outer.global_params]

    def assign_data(self, shard_key: int, position: int) -> None:
        """Draw the round's batches from the assigned stream ``shard_key`` (dilocox/assignment.py), from batch
        ``position`` on (the inner steps a joiner skips)."""
        self.shard = self.workload.shard(ASSIGNED_SEED, shard_key)
        self.shard.position = position

    def state_bytes(self) -> int:
        """Bytes of theta + momentum, what a state transfer moves (the compression state is small)."""
        return 2 * tensor_bytes(self.outer.global_params)

    # ------------------------------------------------------------------ the round's trajectory
    def inner_step(self, inputs: torch.Tensor, targets: torch.Tensor, i: int,
                   stop: bool = False) -> Union[float, torch.Tensor]:
        """Inner step i (0-based) of the current round; returns the loss (nats/token): a 0-dim tensor on the
        training device from a whole model (InnerLoop: not read back, so no host sync), a float from a pipeline
        stage or the synthetic workload (dilocox.diloco.host_losses reads either). With SCAFFOLD, each
        step is followed by the drift correction x <- x - lr (c - c_i) (dilocox/scaffold.py)."""
        after = None
        if self.control is not None:
            correction = self._correction

            def after(lr: float) -> None:
                apply_correction_step(self.inner.params, correction, lr)

        return self.inner.inner_step(inputs, targets, global_step=(self.round - 1) * self.H + i, stop=stop,
                                     after_step=after)

    def begin_round(self) -> None:
        """The round's (re)start: the pseudo-gradient is measured from here, and SCAFFOLD's correction c - c_i is
        read now, from the c the last outer step left, and stays fixed for the round's inner steps."""
        self.schedule.begin_round(self.inner.params)
        if self.control is not None:
            self._correction = self.control.correction()

    def end_round_control(self, pseudo_gradient: Sequence[torch.Tensor], first_step: int) -> None:
        """SCAFFOLD, option II (ours: K eta_l = the learning rates of the steps done): c_i <- c_i - c +
        delta / lr_sum. No-op for DiLoCo."""
        if self.control is not None and first_step < self.H:
            self.control.client_update(list(pseudo_gradient), self.H - first_step, self.lr_sum(self.round, first_step))

    def pseudo_gradient(self, final: bool = False) -> list[torch.Tensor]:
        """delta = x(start of round) - x(now), CPU fp32 (dilocox/overlap.py). ``final``: the round's own read at
        its end (synchronous rounds then keep no copy of theta when it changes: ``OuterSchedule.theta_changing``)."""
        return self.schedule.pseudo_gradient(self.inner.params, final)

    def folds(self) -> bool:
        """Whether the round's contribution is folded into the error feedback in place (``fold_contribution``):
        sparse compression, synchronous rounds, DiLoCo (SCAFFOLD's c_i update reads the pseudo-gradient)."""
        return isinstance(self.compressor, SparseCompressor) and not self.schedule.overlapped \
            and self.control is None

    def fold_contribution(self):
        """The round's sparse contribution computed from theta and x without holding the pseudo-gradient
        (``SparseCompressor.fold``; only where ``folds``). Until the round is applied (``compressor.commit``) or
        not (``abandon``), neither theta nor the parameters may change. Raises ValueError for a pseudo-gradient
        that is not finite (the error feedback is then zeroed)."""
        return self.compressor.fold(self.schedule.reference(final=True), self.inner.params)

    def abandon(self, compression) -> None:
        """The round of ``compression`` (a compressor's round, or None) was not applied: a folded contribution
        gives back to the error feedback what it took (``SparseCompressor.abandon``); other rounds never
        changed it."""
        if compression is not None and isinstance(self.compressor, SparseCompressor):
            self.compressor.abandon(compression)

    def progress_finite(self) -> bool:
        """Whether the local parameters hold only finite values (theta does: every update is checked), read
        slice by slice (no mask of the parameters' size)."""
        return all(bool(torch.isfinite(part).all()) for p in self.inner.params
                   for part in p.detach().reshape(-1).split(1 << 22))

    def drop_progress(self) -> None:
        """Abandon the current round's local progress (re-base onto theta); nothing of it is sent."""
        self.schedule.rebase(self.inner.params)

    def start_from_proxy(self, own: Sequence[torch.Tensor]) -> bool:
        """Overlapped rounds, with the round's update in flight: start the next round from theta advanced by
        ``own`` (our share of it; ``OuterSchedule.start_from_proxy``), before ``begin_round``. False: no proxy."""
        return self.schedule.start_from_proxy(self.inner.params, list(own))

    def merge_local(self) -> None:
        """Adaptive overlap, mid-round: fold the latest theta into the local parameters now
        (``OuterSchedule.merge``); the round's pseudo-gradient is measured from theta from then on."""
        self.schedule.merge(self.inner.params)

    def rebase_and_begin(self) -> None:
        """The round's end after an outer update: re-base the local parameters, start the next round
        (``begin_round``: with SCAFFOLD, the next round steps with the c that update gave)."""
        self.schedule.rebase(self.inner.params)
        self.begin_round()

    def apply_outer(self, averaged: Optional[Sequence[torch.Tensor]], index: int, group_size: int = 1,
                    outsized: bool = False) -> None:
        """theta_index = outer_optimizer(theta_{index-1}, averaged); None: the round is consumed
        without an update (skipped), theta_index = theta_{index-1}. Local parameters are untouched.
        ``outsized``: the round had an outsized contribution (``outsized``; SCAFFOLD's quiet restart counts
        from it). ``on_applied`` gets the update, for joiners that missed it (dilocox/catchup.py)."""
        parent = self.digest
        with self._theta_lock:
            if averaged is not None:  # read tensor by tensor: a sparse aggregate is never made dense whole
                self.schedule.update_theta(averaged, group_size, outer_step=index)
                if self.control is not None:  # c from the aggregate every member holds: no channel of its own
                    self.control.derive_c_from_aggregate(list(averaged), self.lr_sum(index), 1, 1)
            if self.control is not None:  # --scaffold-reset-every, --scaffold-reset-quiet
                restart = self.control.outer_step_done(index, outsized)
                if restart != Restart.NONE:
                    shrunk = restart == Restart.QUIET and self.control.quiet.factor
                    logger.info("outer step %d: SCAFFOLD's c and c_i %s (%s restart)", index,
                                f"scaled by {self.control.quiet.factor:g}" if shrunk else "restarted at zero",
                                restart.value)
            self.outer_step, self.digest = index, params_digest(self.outer.global_params)
        self.snapshot()
        self.on_applied(AppliedUpdate(index, parent, self.digest, max(1, group_size), averaged, outsized))

    # ------------------------------------------------------------------ state transfer
    def snapshot(self) -> None:
        """Theta, momentum and the shared compression state changed: tell donors (``on_snapshot``).
        Nothing is copied here: ``served`` copies the state when a joiner asks for it."""
        self.on_snapshot()

    def changing(self) -> threading.RLock:
        """The lock held while theta or the shared state changes: ``with state.changing(): ...`` groups changes
        that must be served together (e.g. the compressor's new shared state and the outer step)."""
        return self._theta_lock

    def served(self) -> tuple[dict, list[torch.Tensor]]:
        """(meta, tensors): a consistent copy of theta, the outer momentum (zeros when the outer optimizer
        keeps none: stride-0 views of one zero, no memory), SCAFFOLD's c and the shared compression state, taken
        under the lock that every change to them holds (any thread; transient memory: one copy of theta while it
        is served)."""
        with self._theta_lock:
            control = [c.clone() for c in self.control.c] if self.control is not None else []
            # no momentum (the sparse default): zeros as stride-0 views, serialized one tensor at a time, never held
            momentum = self.outer.momentum_buffers() if self.outer.has_momentum else \
                [torch.zeros((), dtype=p.dtype).expand_as(p) for p in self.outer.global_params]
            tensors = ([p.clone() for p in self.outer.global_params] + momentum + control
                       + [t.clone() for t in self.compressor.shared_tensors()])
            meta = dict(run_id=self.cfg.run_id, outer_step=self.outer_step, digest=self.digest,
                        num_params=len(self.outer.global_params), compression_rank=self.compressor.rank,
                        compression_digest=self.compressor.digest(),
                        control_digest=self.control.digest() if self.control is not None else "",
                        control_last_outsized=self.control.last_outsized if self.control is not None else None)
        return meta, tensors

    def adopt(self, theta: list[torch.Tensor], momentum: list[torch.Tensor], compression_rank: int,
              compression_shared: list[torch.Tensor], outer_step: int, digest: str, round_: int,
              keep_round: bool, control: Optional[list[torch.Tensor]] = None,
              control_last_outsized: Optional[int] = None) -> None:
        """Take a downloaded (already validated) state. keep_round: x <- theta + this round's local
        progress, whose pseudo-gradient is still ours to send; else x <- theta and round ``round_`` begins.
        ``control``: the swarm's SCAFFOLD c (our c_i starts again from zero: it belonged to another trajectory),
        ``control_last_outsized`` its pending quiet restart."""
        with self._theta_lock:
            self.schedule.theta_changing()
            self.outer.load_state(theta, momentum)
            if self.control is not None:
                self.control.load_state_dict(dict(c=control, c_i=[torch.zeros_like(c) for c in control],
                                                  last_outsized=control_last_outsized))
            self.compressor.load_shared(compression_rank, compression_shared)
            if keep_round:
                self.schedule.rebase(self.inner.params)
                if self.control is not None:  # the round's remaining steps correct with the downloaded c
                    self._correction = self.control.correction()
            else:
                self.inner.load_params(self.outer.global_params)
                self.begin_round()  # with SCAFFOLD: the downloaded c, our c_i zero
                self.round = round_
            self.outer_step, self.digest = outer_step, digest
        self.snapshot()

    def replay(self, theta: list[torch.Tensor], momentum: list[torch.Tensor], control: Optional[list[torch.Tensor]],
               outer_step: int, updates: Sequence[AppliedUpdate], last_outsized: Optional[int] = None) -> Replayed:
        """A downloaded state (theta, momentum, SCAFFOLD's c and its pending quiet restart ``last_outsized`` at
        ``outer_step``) with ``updates`` applied by
        our outer optimizer's rule on scratch copies; nothing of ours changes. Raises CatchUpError
        (dilocox/catchup.py) if an update does not continue the state or replays to another digest."""
        cfg = self.cfg
        outer = OuterOptimizer(theta, cfg.outer_lr, cfg.outer_momentum, cfg.nesterov, cfg.outer_lr_final,
                               self.ramp_steps)
        outer.load_state(theta, momentum)
        scratch = None
        if self.control is not None:
            scratch = ControlVariates(theta, cfg.scaffold_reset_every, self._quiet())
            scratch.load_state_dict(dict(c=control, c_i=[torch.zeros_like(c) for c in control],
                                         last_outsized=last_outsized))
        return replay(outer, outer_step, updates, scratch, self.lr_sum)

    def claim_outer_step(self, outer_step: int) -> None:
        """Take our theta as ``outer_step`` (no other copy of our stage exists to say otherwise)."""
        with self._theta_lock:
            self.outer_step = outer_step
        self.snapshot()

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> dict:
        cfg = self.cfg
        return dict(run_id=cfg.run_id, model=cfg.model, stage=cfg.stage, outer_step=self.outer_step,
                    global_params=self.outer.global_params,
                    # momentum-free outer SGD (the sparse default) keeps no buffer: none written, none restored
                    momentum=self.outer.momentum_buffers() if self.outer.has_momentum else None,
                    inner_optimizer=self.inner.inner_optimizer.state_dict(), inner_optimizer_name=cfg.inner_optimizer,
                    compression=self.compressor.state_dict(),
                    control=self.control.state_dict() if self.control is not None else None,
                    shard_position=self.shard.position, shard_key=self.shard.shard_key, round=self.round,
                    rng=dict(torch=torch.get_rng_state(), python=random.getstate(), numpy=_numpy_state()),
                    version=dilocox.__version__, architecture=self.architecture)

    def restore(self, state: dict) -> None:
        """Load a checkpoint's contents, all or nothing: raises ValueError (naming the problem) and leaves
        everything as it was if the checkpoint belongs to another run, model or stage, or any part of it
        does not fit (checkpoints are files: a damaged one must not crash the node or half-load)."""
        cfg = self.cfg
        if not isinstance(state, dict):
            raise ValueError(f"it holds a {type(state).__name__}, not a dict")
        owner = (state.get("run_id"), state.get("model"), state.get("stage", "0/1"))
        if owner != (cfg.run_id, cfg.model, cfg.stage):
            raise ValueError(f"it belongs to run {owner[0]!r} / model {owner[1]!r} / stage {owner[2]!r}")
        before = (self.checkpoint_state(), [p.detach().clone() for p in self.inner.params])
        # theta is loaded in place (OuterOptimizer.load_state): keep a copy, not the live tensors, to roll back to
        before[0]["global_params"] = [p.detach().clone() for p in before[0]["global_params"]]
        before[0]["compression"] = copy.deepcopy(before[0]["compression"])  # the sparse codec's are live views
        try:
            with self._theta_lock:
                self.schedule.theta_changing()
                self._restore(state)
        except Exception as e:  # anything a damaged file can make the loaders raise
            saved, params = before
            self._restore(saved)
            self.inner.load_params(params)
            raise ValueError(f"it does not fit this node ({type(e).__name__}: {e})") from None

    def _restore(self, state: dict) -> None:
        outer_step = int(state["outer_step"])
        if outer_step < 0:
            raise ValueError(f"outer_step {outer_step} is negative")
        self.outer.load_state(state["global_params"], state["momentum"])
        self.inner.load_params(self.outer.global_params)
        saved = state.get("inner_optimizer_name", "adamw")  # files written before --inner-optimizer: AdamW
        if saved != self.cfg.inner_optimizer:
            raise ValueError(f"its inner optimizer state is {saved}'s; this node runs --inner-optimizer "
                             f"{self.cfg.inner_optimizer}")
        optimizer = self.inner.inner_optimizer
        configured = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        optimizer.load_state_dict(state["inner_optimizer"])
        for group, settings in zip(optimizer.param_groups, configured):  # the flags win over the file's betas etc.
            group.update(settings)
        if "compression" in state:
            self.compressor.load_state_dict(state["compression"])
        if self.control is not None:
            if state.get("control") is None:
                raise ValueError("it holds no SCAFFOLD control variates (written with --outer-algorithm diloco?)")
            self.control.load_state_dict(state["control"])
        self.shard.position = int(state["shard_position"])
        rng = state.get("rng", dict(torch=state.get("torch_rng")))
        torch.set_rng_state(rng["torch"])
        if "python" in rng:
            random.setstate(rng["python"])
            name, keys, pos, has_gauss, gauss = rng["numpy"]
            np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
        self.outer_step = outer_step
        self.round = self.outer_step + 1
        self.digest = params_digest(self.outer.global_params)
