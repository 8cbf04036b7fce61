"""A node that holds one pipeline stage: forming its replica, round agreement, pausing on failure.

The replica's stage nodes run inner steps in lockstep through the pipeline (dilocox/pipeline.py);
everything else is per stage: stage k of every replica averages only with stage k of the others
(its own averager prefix, ``stage_tag``), with the overlap and compression of a whole-model node.

If a stage node dies or leaves, the survivors' next pipeline or replica collective fails
(PipelineBroken): they abandon the round's progress (nothing of it is sent), apply an all-reduce
already finished in delayed mode, and wait for the missing stage (state SYNCING, the replica
"paused"). A replacement downloads its stage's state from the same stage of another replica and
claims the free slot (peers/replica.py); stale stages catch up through the usual re-sync.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from daemon.status import StageMemory, State
from dilocox.stages import tensor_bytes
from peers.replica import Founder

if TYPE_CHECKING:
    from daemon.node import Node

logger = logging.getLogger("dilocox.node")
_GONE = (State.DRAINING.value, State.STOPPED.value)


def stage_tag(node: "Node") -> str:
    """Averager prefix part that keeps stage k of S apart from other stages ("" for whole models)."""
    return "" if node.num_stages == 1 else f"stage{node.stage_index}of{node.num_stages}_"


def stage_memory(inner, outer, schedule, compressor) -> StageMemory:
    """Tensor bytes held for a stage: parameters, AdamW state, outer state, error feedback.

    ``inner``: InnerLoop, ``outer``: OuterOptimizer, ``schedule``: OuterSchedule, ``compressor``:
    Compressor. Counts storage without copying anything (called once per round)."""
    inner_state = [t for st in inner.inner_optimizer.state.values() for t in st.values()
                   if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not inner_state:  # AdamW allocates lazily at the first step: exp_avg + exp_avg_sq, fp32
        inner_state = [p for p in inner.params for _ in range(2)]
    theta = tensor_bytes(outer.global_params)  # the momentum buffer has theta's shapes (fp32), once allocated or not
    m = StageMemory(params_bytes=tensor_bytes(inner.params), inner_optimizer_bytes=tensor_bytes(inner_state),
                    outer_optimizer_bytes=2 * theta + tensor_bytes(schedule.round_start),
                    error_feedback_bytes=tensor_bytes(compressor.error))
    m.total_bytes = m.params_bytes + m.inner_optimizer_bytes + m.outer_optimizer_bytes + m.error_feedback_bytes
    return m


def _founders(node: "Node") -> list[Founder]:
    members = [m for m, _ in node.swarm.members() if m.num_stages == node.num_stages and m.state not in _GONE]
    holders = {m.replica_id for m in members if m.stage_index == node.stage_index and m.peer_id != node.swarm.peer_id}
    return [Founder(m.peer_id, m.rendezvous, m.peer_id in holders)  # a founder's replica_id is its peer_id
            for m in members if m.stage_index == 0 and m.rendezvous]


def form_replica(node: "Node") -> bool:
    """Block until our replica has all its stages (True) or we are asked to leave (False)."""
    node._set_state(State.SYNCING, replica_id="", replica_members=[])
    logger.info("stage %d/%d: looking for a replica", node.stage_index, node.num_stages)
    replica = node.rendezvous.form(lambda: _founders(node), node.leave_requested.is_set)
    if replica is None:
        return False
    node.inner.attach(replica.group)
    node.replica = replica
    if node.cfg.data_seed is None:  # every stage must draw the same batches: the replica's shard
        node.shard.shard_key = replica.shard_key
    node.board.update(replica_id=replica.replica_id, replica_members=replica.members)
    node._poke.set()
    return True


def agree_round(node: "Node", skip: int) -> int:
    """Start of a round: all stages adopt the largest (round, inner steps to skip, data position)
    of the replica, so they run the same steps on the same batches. Returns the skip."""
    mine = torch.tensor([node.round, skip, node.shard.position], dtype=torch.float64)
    agreed = [int(v) for v in node.inner.all_reduce(mine, op=dist.ReduceOp.MAX)]
    if agreed[0] != node.round:
        logger.info("replica agrees on round %d (we were at %d)", agreed[0], node.round)
    node.round, skip, node.shard.position = agreed
    return skip


def replica_broken(node: "Node", reason: str) -> None:
    """Pause: drop the pipeline, keep only finished work, then wait for the replica to re-form."""
    from daemon.rounds import finish_round  # rounds imports this module

    logger.warning("replica %s paused: %s", node.replica.replica_id if node.replica else "?", reason)
    node.inner.detach()
    node.rendezvous.leave_group()
    node.replica = None
    node.board.update(replica_id="", replica_members=[])
    node.schedule.rebase(node.inner.params)  # this round's partial progress never leaves the node
    node.schedule.begin_round(node.inner.params)
    if node.pending is not None:  # delayed: the previous round was complete; apply it
        pending, node.pending = node.pending, None
        finish_round(node, pending)
