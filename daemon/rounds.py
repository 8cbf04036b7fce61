"""One DiLoCo round of a node: H inner steps, pseudo-gradient all-reduce, checks, outer step.

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
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch

from daemon.status import ACTIVE_STATES, RoundInfo, State
from dilocox import exact_mean
from dilocox.diloco import params_digest
from peers.averaging import RoundCancelled, RoundFailed, RoundGather, canonical_digest

if TYPE_CHECKING:
    from daemon.node import Node

logger = logging.getLogger("dilocox.node")


def _inner_steps(node: "Node", skip: int) -> tuple[list[float], float] | None:
    """Run inner steps skip..H-1; None if the node was asked to leave mid-round."""
    t, losses, start = node.outer_step, [], time.monotonic()
    node._set_state(State.TRAINING, inner_step=skip)
    for i in range(skip, node.H):
        if node.leave_requested.is_set():
            return None
        x, y = node.shard.next_batch()
        step_start = time.monotonic()
        loss = node.inner.inner_step(x, y, global_step=t * node.H + i)
        tokens_per_s = x.numel() / max(time.monotonic() - step_start, 1e-9)
        losses.append(loss)
        s = node.board.snapshot()
        ema = tokens_per_s if s.tokens_per_second == 0 else 0.9 * s.tokens_per_second + 0.1 * tokens_per_s
        node.board.update(inner_step=i + 1, loss=sum(losses[-10:]) / len(losses[-10:]),
                          tokens_total=s.tokens_total + x.numel(), tokens_per_second=ema,
                          initial_loss=loss if math.isnan(s.initial_loss) else s.initial_loss)
    return losses, time.monotonic() - start


def _others_in_round(node: "Node", t: int) -> list:
    return [m for m in node._others() if m.state in ACTIVE_STATES and m.outer_step == t]


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


def run_round(node: "Node", skip: int) -> None:
    t, cfg = node.outer_step, node.cfg
    done = _inner_steps(node, skip)
    if done is None:
        node.inner.load_params(node.outer.global_params)  # abandon the round: nothing leaves this node
        return
    losses, compute_s = done
    steps_done = node.H - skip
    pseudo_gradient = node.outer.pseudo_gradient(node.inner.params)
    if not all(torch.isfinite(g).all() for g in pseudo_gradient):
        node._resync("pseudo-gradient holds NaN/Inf (diverged replica); not sent")
        return

    comm_start = time.monotonic()
    node._set_state(State.AVERAGING)
    payload = sent = received = 0
    others = node._others()
    if any(m.state in ACTIVE_STATES and m.outer_step > t for m in others):
        node._resync(f"round {t + 1} was already completed by others")
        return
    # Solo only when nobody else could take part: a replica in this round or one that is syncing
    # (it may start this round). Deciding from possibly stale records is safe this way round.
    expected = [m for m in others if (m.state in ACTIVE_STATES and m.outer_step == t)
                or m.state in (State.SYNCING.value, State.JOINING.value)]
    outcome, group_size, averaged = "solo", 1, pseudo_gradient
    if expected:
        lr_sum = sum(node.inner.config.lr_at(t * node.H + i) for i in range(node.H))
        offsets = [exact_mean.offset_for(exact_mean.pseudo_gradient_bound(
            lr_sum, cfg.weight_decay, float(p.abs().max()), node.step_bound)) for p in node.outer.global_params]
        encoded, clipped = zip(*(exact_mean.encode(g, c) for g, c in zip(pseudo_gradient, offsets)))
        if sum(clipped):
            logger.warning("%d pseudo-gradient entries exceeded the AdamW bound and were clipped", sum(clipped))
        gather = RoundGather(outer_step=t, start_digest=node.digest, weight=float(steps_done))
        try:
            result = node.averager.run_round(
                t, encoded, gather, deadline_s=cfg.outer_round_deadline - cfg.averaging_timeout,
                cancel=node.leave_requested, abandon=lambda: not _others_in_round(node, t))
        except RoundCancelled:
            node.inner.load_params(node.outer.global_params)
            return
        except RoundFailed as e:
            if any(m.state in ACTIVE_STATES and m.outer_step > t for m in node._others()):
                node._resync(f"round {t + 1} went on without us ({e})")
                return
            logger.warning("round %d: %s; applying our own pseudo-gradient", t + 1, e)
        else:
            starts = {p: g.start_digest for p, g in result.gathered.items() if g is not None and g.outer_step == t}
            canon, _ = canonical_digest(starts)
            if canon != node.digest:
                node._resync(f"round {t + 1}: we started from {node.digest}, the group from {canon}")
                return
            # every member that started from the same parameters contributed to this average
            group_size = sum(d == canon for d in starts.values())
            payload, sent, received = result.payload_bytes, result.bytes_sent, result.bytes_received
            result_digest = params_digest(result.tensors)
            results = _exchange_result_digests(node, t + 1, result_digest, set(starts))
            canon, holders = canonical_digest(results)
            if 2 * len(holders) <= len(results):
                # e.g. two replicas, one with a partial average: nobody can tell which is right, so nobody applies
                logger.warning("round %d: no majority among all-reduce results %s; skipped by the whole group",
                               t + 1, sorted(set(results.values())))
                node.inner.load_params(node.outer.global_params)
                return
            if canon != result_digest:
                # hivemind can return part of the average ("received 79% results") and still succeed
                node._resync(f"round {t + 1}: all-reduce result {result_digest} differs from the group's {canon} "
                             f"(partial result?); not applied")
                if node.outer_step == t + 1:  # the group's result of this round, downloaded instead
                    _record(node, RoundInfo(outer_step=t + 1, group_size=group_size, payload_bytes=payload,
                                            duration_s=time.monotonic() - comm_start, compression_ratio=1.0,
                                            compute_s=compute_s, outcome="resynced", bytes_sent=sent,
                                            bytes_received=received), losses)
                return
            averaged = [exact_mean.decode(a, c) for a, c in zip(result.tensors, offsets)]
            outcome = "applied"

    node.outer.step(averaged)
    node.inner.load_params(node.outer.global_params)
    node.outer_step, node.digest = t + 1, params_digest(node.outer.global_params)
    node._serve_snapshot()
    _record(node, RoundInfo(outer_step=t + 1, group_size=group_size, payload_bytes=payload,
                            duration_s=time.monotonic() - comm_start, compression_ratio=1.0 if payload else 0.0,
                            compute_s=compute_s, outcome=outcome, bytes_sent=sent, bytes_received=received), losses)


def _record(node: "Node", info: RoundInfo, losses: list[float]) -> None:
    """Publish the finished round in status, checkpoint, and metrics (duration_s excludes evaluation)."""
    val_loss = node.inner.evaluate(node.val_batches)
    s = node.board.snapshot()
    node._set_state(State.TRAINING, outer_step=node.outer_step, inner_step=node.skip_steps,
                    global_params_digest=node.digest, val_loss=val_loss, last_round=info,
                    bytes_sent=s.bytes_sent + info.bytes_sent, bytes_received=s.bytes_received + info.bytes_received)
    node._checkpoint()
    node.record_metrics(dict(asdict(info), peer_id=node.swarm.peer_id, digest=node.digest, val_loss=val_loss,
                             loss=sum(losses) / len(losses), tokens_total=s.tokens_total,
                             tokens_per_second=s.tokens_per_second, time=time.time()))
