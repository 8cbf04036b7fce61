"""PipelineReplica: a node that holds one pipeline stage, inside its replica.

The replica's stage nodes run inner steps in lockstep through the pipeline (dilocox/pipeline.py);
everything else is per stage: stage k of every replica averages only with stage k of the others
(its own averager prefix, ``stage_tag``), with the overlap and compression of a whole-model node.

If a stage node dies or leaves, the survivors' next pipeline or replica collective fails
(PipelineBroken): the node calls ``pause`` and drops the round's progress (nothing of it is sent),
applies an all-reduce already finished in delayed mode, and waits for the missing stage (state
SYNCING, the replica "paused"). A replacement downloads its stage's state from the same stage of
another replica and claims the free slot (peers/replica.py); stale stages catch up by re-syncing.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.distributed as dist
from dilocox.daemon.config import NodeConfig
from dilocox.daemon.progress import ProgressTracker
from dilocox.daemon.replica_state import ReplicaState
from dilocox.daemon.status import GONE_STATES
from dilocox.peers.replica import Founder, ReplicaGroup, ReplicaRendezvous

logger = logging.getLogger(__name__)


def stage_tag(stage_index: int, num_stages: int) -> str:
    """Averager prefix part that keeps stage k of S apart from other stages ("" for whole models)."""
    return "" if num_stages == 1 else f"stage{stage_index}of{num_stages}_"


class PipelineReplica:
    """Replica membership of a stage node (``cfg.num_stages > 1``)."""

    def __init__(self, cfg: NodeConfig, state: ReplicaState, progress: ProgressTracker, shard_key: int):
        self.cfg, self.state, self.progress = cfg, state, progress
        self.rendezvous = ReplicaRendezvous(progress.peer_id, cfg.stage_index, cfg.num_stages, cfg.pipeline_addr,
                                            cfg.outer_round_deadline, shard_key, state.inner.device)
        self.group: Optional[ReplicaGroup] = None  # set once our replica has all its stages

    @property
    def formed(self) -> bool:
        return self.group is not None

    @property
    def rendezvous_addr(self) -> str:
        """What a stage-0 node publishes in its membership record ("" for other stages)."""
        return self.rendezvous.rendezvous

    def _founders(self) -> list[Founder]:
        members = [m for m in self.progress.members()
                   if m.num_stages == self.cfg.num_stages and m.state not in GONE_STATES]
        holders = {m.replica_id for m in members
                   if m.stage_index == self.cfg.stage_index and m.peer_id != self.progress.peer_id}
        return [Founder(m.peer_id, m.rendezvous, m.peer_id in holders)  # a founder's replica_id is its peer_id
                for m in members if m.stage_index == 0 and m.rendezvous]

    def form(self, cancelled: Callable[[], bool]) -> Optional[ReplicaGroup]:
        """Block until our replica has all its stages (the group) or ``cancelled()`` (None)."""
        logger.info("stage %d/%d: looking for a replica", self.cfg.stage_index, self.cfg.num_stages)
        group = self.rendezvous.form(self._founders, cancelled)
        if group is None:
            return None
        self.state.inner.attach(group.group)
        self.group = group
        if self.cfg.data_seed is None:  # every stage must draw the same batches: the replica's shard
            self.state.shard.shard_key = group.shard_key
        return group

    def agree_round(self, skip: int) -> int:
        """Start of a round: all stages adopt the largest (round, inner steps to skip, data position)
        of the replica, so they run the same steps on the same batches. Returns the skip."""
        st = self.state
        mine = torch.tensor([st.round, skip, st.shard.position], dtype=torch.float64)
        agreed = [int(v) for v in st.inner.all_reduce(mine, op=dist.ReduceOp.MAX)]
        if agreed[0] != st.round:
            logger.info("replica agrees on round %d (we were at %d)", agreed[0], st.round)
        st.round, skip, st.shard.position = agreed
        return skip

    def pause(self, reason: str) -> None:
        """Drop the pipeline and this round's partial progress (it never leaves the node)."""
        logger.warning("replica %s paused: %s", self.group.replica_id if self.group else "?", reason)
        self.state.inner.detach()
        self.rendezvous.leave_group()
        self.group = None
        self.state.rebase_and_begin()

    def shutdown(self) -> None:
        self.rendezvous.shutdown()
