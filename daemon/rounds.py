"""One DiLoCo round of a node: H inner steps, pseudo-gradient all-reduce, checks, outer step.

overlap = "none": round r's all-reduce finishes before round r+1 starts. overlap = "delayed"
(DiLoCoX): round r's all-reduce runs on the node's communication thread (and hivemind's averager
process) while round r+1 computes; its outer step is applied at the end of round r+1 with the
re-base rule of dilocox/overlap.py. Every round's pseudo-gradient goes through the node's
Compressor (dilocox/compression.py): one all-reduce phase, or two for PowerSGD low rank.

Consistency (DESIGN.md): a round's averaged pseudo-gradient is applied only if
  1. this node started the round from the parameters most of its group started from
     (``start_digest`` in the all-gathered metadata), and
  2. its averaged result is bit-identical to most of the group's (result digests exchanged
     through the membership records), which catches hivemind's partial results.
Otherwise nothing is applied and the node re-syncs from peers.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from daemon import staging
from daemon.status import ACTIVE_STATES, RoundInfo, State
from dilocox import exact_mean
from dilocox.compression import CompressionRound
from dilocox.pipeline import PipelineBroken
from dilocox.diloco import params_digest
from peers.averaging import (RoundCancelled, RoundFailed, RoundGather, RoundResult, canonical_digest, exchange,
                             group_limits, judge_result)

if TYPE_CHECKING:
    from daemon.node import Node

logger = logging.getLogger("dilocox.node")


def _inner_steps(node: "Node", skip: int) -> tuple[list[float], float, int] | None:
    """Run inner steps skip..H-1; None if the node was asked to leave mid-round.

    A stage node first agrees with its replica on round, skip and data position and measures the
    replica's validation loss (pipeline collectives happen only here, in the same order on every
    stage). Raises PipelineBroken if a stage fails or another stage leaves."""
    staged = node.num_stages > 1
    if staged:
        skip = staging.agree_round(node, skip)
        node.board.update(val_loss=node.inner.evaluate(node.val_batches))
    t, losses, start = node.round - 1, [], time.monotonic()
    node._set_state(State.TRAINING, inner_step=skip)
    for i in range(skip, node.H):
        if node.leave_requested.is_set() and not staged:
            return None
        x, y = node.shard.next_batch()
        step_start = time.monotonic()
        # a stage node's leave request travels with the step, so every stage stops after the same step
        loss = node.inner.inner_step(x, y, global_step=t * node.H + i, stop=node.leave_requested.is_set())
        if node.inner.stop_requested:
            if node.leave_requested.is_set():
                return None
            raise PipelineBroken("another stage of the replica is leaving")
        tokens_per_s = x.numel() / max(time.monotonic() - step_start, 1e-9)
        losses.append(loss)
        if node.pending is not None and not staged:
            finish_early(node, node.pending)
        s = node.board.snapshot()
        ema = tokens_per_s if s.tokens_per_second == 0 else 0.9 * s.tokens_per_second + 0.1 * tokens_per_s
        node.board.update(inner_step=i + 1, loss=sum(losses[-10:]) / len(losses[-10:]),
                          tokens_total=s.tokens_total + x.numel(), tokens_per_second=ema,
                          initial_loss=loss if math.isnan(s.initial_loss) else s.initial_loss)
    return losses, time.monotonic() - start, skip


def _in_round(node: "Node", r: int) -> list:
    """Other replicas that take part in the all-reduce of round r (delayed: some already compute r+1)."""
    window = (r,) if node.cfg.overlap == "none" else (r, r + 1)
    return [m for m in node._others() if m.state in ACTIVE_STATES and m.round in window]


def _someone_applied(node: "Node", r: int) -> bool:
    return any(m.state in ACTIVE_STATES and m.outer_step >= r for m in node._others())


def _exchange_result_digests(node: "Node", result_step: int, digest: str, peers: set[str]) -> dict[str, str]:
    """Publish our result digest, collect the group's (bounded by request_timeout)."""
    node._result = (result_step, digest)
    node._publish()
    found = {node.swarm.peer_id: digest}
    deadline = time.monotonic() + node.cfg.request_timeout
    while time.monotonic() < deadline:
        for m in node._others():
            if m.peer_id in peers and m.result_step == result_step:
                found[m.peer_id] = m.result_digest
        if set(found) >= peers:
            break
        time.sleep(0.1)
    return found


@dataclass
class PendingRound:
    """Round ``index`` being averaged: ``future`` runs peers.averaging.exchange on the node's
    communication thread (None: a solo round)."""

    index: int
    pseudo_gradient: list
    compression: Optional[CompressionRound]
    future: Optional[Future]
    compute_s: float
    losses: list[float]
    started: float
    cancel: threading.Event = field(default_factory=threading.Event)
    early: Optional[RoundInfo] = None  # theta already updated mid-round (delayed); the local part is due
    early_tried: bool = False


def run_round(node: "Node", skip: int) -> None:
    """Compute round r = node.round, then average it (none) or start averaging it (delayed)."""
    done = _inner_steps(node, skip)
    if done is None:
        node.schedule.rebase(node.inner.params)  # abandon the round: nothing leaves this node
        return
    losses, compute_s, skip = done
    r = node.round  # a stage node may have adopted its replica's round
    pseudo_gradient = node.schedule.pseudo_gradient(node.inner.params)  # before any re-base
    if not all(torch.isfinite(g).all() for g in pseudo_gradient):
        node._resync("pseudo-gradient holds NaN/Inf (diverged replica); not sent")
        return
    if node.pending is not None:  # delayed: apply round r-1 (normally finished long ago)
        previous, node.pending = node.pending, None
        finish_round(node, previous)
    if node.outer_step != r - 1:  # we missed theta_{r-1} (joined late, failed round): fetch it
        node._resync(f"round {r} needs the parameters of outer step {r - 1}", keep_round=True)
        if node.outer_step != r - 1:
            return
    pending = _start(node, r, pseudo_gradient, node.H - skip, compute_s, losses)
    if pending is None:
        return
    if node.cfg.overlap == "none":
        finish_round(node, pending)
    else:
        node.pending = pending
        node.round = r + 1
        node.schedule.begin_round(node.inner.params)


def _start(node: "Node", r: int, pseudo_gradient, weight: int, compute_s: float, losses) -> Optional[PendingRound]:
    cfg = node.cfg
    node._set_state(State.AVERAGING)
    started = time.monotonic()
    if _someone_applied(node, r):
        node._resync(f"round {r} was already completed by others")
        return None
    # Solo only when nobody else could take part: a replica in this round or one that is syncing
    # (it may start this round). Deciding from possibly stale records is safe this way round.
    # (a syncing stage node waits for its replica's other stages, so it is not counted on)
    expected = _in_round(node, r) + [m for m in node._others() if m.num_stages == 1
                                     and m.state in (State.SYNCING.value, State.JOINING.value)]
    if not expected:
        return PendingRound(r, pseudo_gradient, None, None, compute_s, losses, started)
    lr_sum = sum(node.inner.config.lr_at((r - 1) * node.H + i) for i in range(node.H))
    bounds = [exact_mean.pseudo_gradient_bound(lr_sum, cfg.weight_decay, float(p.abs().max()), node.step_bound)
              for p in node.outer.global_params]  # shared: offsets of values sent in fp32
    compression = node.compressor.begin(pseudo_gradient, bounds, r)
    gather = RoundGather(outer_step=r - 1, start_digest=node.start_digest(), weight=float(weight),
                         bandwidth_bps=node.bandwidth_bps(), compute_s=compute_s)
    averager = node.averagers[node.compressor.buffer_size()]
    p = PendingRound(r, pseudo_gradient, compression, None, compute_s, losses, started)
    p.future = node.comm.submit(exchange, averager, compression, r, gather,
                                cfg.outer_round_deadline - cfg.averaging_timeout, p.cancel,
                                lambda: not _in_round(node, r))
    return p


def finish_early(node: "Node", p: PendingRound) -> None:
    """Delayed overlap, between inner steps of round p.index + 1: once round p.index's all-reduce
    is in (or it was solo), check it and update theta now rather than at the round's end, so that
    this node serves theta_{p.index} to joiners during the round. A joiner then starts round
    p.index + 1 from the parameters its all-reduce needs instead of chasing them (issue 4/5 note).
    A failed all-reduce is applied as at the round's end (our own pseudo-gradient, if nobody else
    applied the round). Tried once per round; a round that needs a re-sync is left to the round's end."""
    if p.early_tried or (p.future is not None and (not p.future.done()
                                                   or isinstance(p.future.exception(), RoundCancelled))):
        return
    p.early_tried = True
    finish_round(node, p, early=True)


def finish_round(node: "Node", p: PendingRound, early: bool = False) -> bool:
    """Wait for round p.index, check it, apply it; False if nothing was applied.

    early (see finish_early): update theta, outer_step and the served state only, or do nothing
    if the round needs a re-sync; a later call does the local re-base and records the round."""
    if p.early is not None:
        return _finish_locally(node, p, p.early)
    waited_from = time.monotonic()
    if not early:
        node._set_state(State.AVERAGING)
    outcome, group_size, averaged, result = "solo", 1, p.pseudo_gradient, None
    if p.future is not None:
        try:
            while not p.future.done():  # poll so a leave request cancels the exchange
                if node.leave_requested.is_set():
                    p.cancel.set()
                time.sleep(0.02)
            result = p.future.result()
        except RoundCancelled:
            return False
        except RoundFailed as e:
            if _someone_applied(node, p.index):
                if early:
                    return False
                node._resync(f"round {p.index} went on without us ({e})")
                return False
            logger.warning("round %d: %s; applying our own pseudo-gradient", p.index, e)
        else:
            starts = {q: g.start_digest for q, g in result.gathered.items()
                      if g is not None and g.outer_step == p.index - 1}
            canon, _ = canonical_digest(starts)
            if canon != node.start_digest():
                if early:
                    return False
                node._resync(f"round {p.index}: we started from {node.start_digest()}, the group from {canon}")
                return False
            # every member that started from the same parameters contributed to this average
            group_size = sum(d == canon for d in starts.values())
            result_digest = params_digest(result.tensors)
            results = _exchange_result_digests(node, p.index, result_digest, set(starts))
            verdict = judge_result(result_digest, results, members=len(starts))
            if verdict == "skip":
                # e.g. two replicas, one with a partial average: nobody can tell which is right, so every
                # member consumes the round without an update (theta_r = theta_{r-1}) and all stay aligned
                logger.warning("round %d: no majority among all-reduce results %s; skipped by the whole group",
                               p.index, sorted(set(results.values())))
                averaged, outcome = None, "skipped"
            elif verdict == "resync":
                if early:
                    return False
                canon, _ = canonical_digest(results)
                # hivemind can return part of the average ("received 79% results") and still succeed
                node._resync(f"round {p.index}: all-reduce result {result_digest} differs from the group's {canon} "
                             f"(partial result?); not applied")
                if node.outer_step == p.index:  # the group's result of this round, downloaded instead
                    _record(node, _info(p, group_size, "resynced", result, waited_from), p.losses)
                return False
            else:
                averaged, outcome = result.tensors, "applied"
                node.measure_bandwidth(result)
                # from all-gathered figures only, so every member picks the same rank (and averager)
                p.compression.decide_rank(*group_limits(result.gathered), group_size)
                node.compressor.commit(p.compression)
    if averaged is not None:  # else no outer step (skipped): only the local trajectory is re-based
        node.schedule.update_theta(averaged)
    node.outer_step, node.digest = p.index, params_digest(node.outer.global_params)
    node._serve_snapshot()
    info = _info(p, group_size, outcome, result, waited_from)
    if early:
        p.early = info
        node.board.update(outer_step=node.outer_step, global_params_digest=node.digest)
        node._poke.set()  # publish the new outer_step: joiners waiting for it download now
        return True
    return _finish_locally(node, p, info)


def _finish_locally(node: "Node", p: PendingRound, info: RoundInfo) -> bool:
    """Re-base the local parameters on theta (already updated) and record the round."""
    node.schedule.rebase(node.inner.params)
    node.schedule.begin_round(node.inner.params)
    if node.cfg.overlap == "none":
        node.round = p.index + 1
    _record(node, info, p.losses)
    return True


def finish_on_leave(node: "Node", p: PendingRound) -> None:
    """Leaving with an all-reduce in flight (delayed): let it finish (bounded by averaging_timeout) so
    the group is not left with a partial average, and apply it so the checkpoint holds it."""
    node.pending = None
    if p.future is not None and not p.future.done():
        try:
            p.future.result(timeout=node.cfg.averaging_timeout)
        except Exception:
            p.cancel.set()
            return
    finish_round(node, p)


def _info(p: PendingRound, group_size: int, outcome: str, result: Optional[RoundResult],
          waited_from: float) -> RoundInfo:
    now = time.monotonic()
    info = RoundInfo(outer_step=p.index, group_size=group_size, duration_s=now - p.started, compute_s=p.compute_s,
                     outcome=outcome, wait_s=now - waited_from)
    if result is not None:
        stats = p.compression.stats
        info.payload_bytes, info.bytes_sent, info.bytes_received = result.payload_bytes, result.bytes_sent, result.bytes_received
        info.compression_ratio = result.fp32_bytes_sent / max(result.bytes_sent, 1)
        info.rank, info.bits, info.compression_error = stats.rank, stats.bits, stats.relative_error
        info.allreduce_s = result.allreduce_s
    return info


def _record(node: "Node", info: RoundInfo, losses: list[float] | None = None) -> None:
    """Publish the finished round in status, checkpoint, and metrics (duration_s excludes evaluation)."""
    losses = losses or [math.nan]
    # a stage node measures its replica's val loss at round start (pipeline collectives stay in lockstep)
    val_loss = node.inner.evaluate(node.val_batches) if node.num_stages == 1 else node.board.snapshot().val_loss
    node.round_log.append((time.monotonic(), info.compute_s))
    del node.round_log[:-11]
    utilization = 0.0
    if len(node.round_log) >= 2:  # compute of the rounds completed in the window / the window's wall time
        window = node.round_log[-1][0] - node.round_log[0][0]
        utilization = min(1.0, sum(c for _, c in node.round_log[1:]) / window) if window > 0 else 0.0
    s = node.board.snapshot()
    node._set_state(State.TRAINING, outer_step=node.outer_step, inner_step=node.skip_steps,
                    compute_utilization=utilization,
                    global_params_digest=node.digest, val_loss=val_loss, last_round=info, memory=node.stage_memory(),
                    bytes_sent=s.bytes_sent + info.bytes_sent, bytes_received=s.bytes_received + info.bytes_received)
    node._checkpoint()
    node.record_metrics(dict(asdict(info), peer_id=node.swarm.peer_id, digest=node.digest, val_loss=val_loss,
                             loss=sum(losses) / len(losses), tokens_total=s.tokens_total,
                             tokens_per_second=s.tokens_per_second, overlap=node.cfg.overlap,
                             compute_utilization=utilization, time=time.time()))
