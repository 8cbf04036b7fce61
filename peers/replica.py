"""Replica formation: S stage nodes on a fast local link become one pipeline (no central coordinator).

Protocol **(ours)**:
  * A stage-0 node founds a replica (replica_id = its peer_id). It hosts a ``torch.distributed
    .TCPStore`` at ``pipeline_addr`` and publishes that address in its DHT membership record.
  * The store holds an ``epoch`` counter. Stage k of epoch e is claimed atomically with
    ``compare_set("e{e}/slot{k}", "", peer_id)``: the store (the replica's own, not the swarm's)
    is the arbiter, so two nodes never hold one slot.
  * A stage-k node tries the replicas it finds in the DHT, those without a live stage-k member
    first, until a claim succeeds. When every slot is claimed the founder writes ``e{e}/go``
    (the members by stage and the replica's data shard key) and all members create the
    replica's process group (gloo; rank = stage index) on the store under prefix ``e{e}/pg``.
  * When the pipeline breaks (a stage node died, left or timed out), every survivor destroys the
    group; the founder bumps the epoch, so the dead node's slot is free again for a replacement.

The store and gloo are unauthenticated: ``pipeline_addr`` must be on a trusted local link.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Optional

import psutil
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class ReplicaGroup:
    """A formed replica: its id (founder's peer_id), epoch, member peer_ids by stage, data shard key."""

    replica_id: str
    epoch: int
    members: list[str]
    shard_key: int
    group: Optional[dist.ProcessGroup] = field(default=None, repr=False)


@dataclass
class Founder:
    """What a stage-k node needs to know about a replica it might join (from a DHT record)."""

    replica_id: str
    rendezvous: str  # HOST:PORT of the founder's TCPStore
    has_stage: bool  # a live member already holds our stage


def split_addr(addr: str) -> tuple[str, int]:
    host, port = addr.rsplit(":", 1)
    return host, int(port)


def use_interface_of(host: str) -> None:
    """Make gloo bind to the interface that holds ``host`` (GLOO_SOCKET_IFNAME); raises ValueError
    naming the address if no local interface has it."""
    if host in ("0.0.0.0", "", "::"):
        return
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and a.address == host for a in addrs):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return
    raise ValueError(f"pipeline address {host} is not an address of this machine")


class ReplicaRendezvous:
    """One stage node's side of replica formation. Blocking; call from the training thread.

    ``timeout_s`` bounds every store and process-group operation (gloo raises after it).
    """

    def __init__(self, peer_id: str, stage_index: int, num_stages: int, pipeline_addr: str, timeout_s: float,
                 shard_key: int, device: str = "cpu"):
        self.peer_id, self.stage_index, self.num_stages = peer_id, stage_index, num_stages
        self.timeout = timedelta(seconds=timeout_s)
        self.host, port = split_addr(pipeline_addr)
        use_interface_of(self.host)
        self.shard_key = shard_key
        # pipeline tensors on the GPU go through NCCL; the small CPU collectives through gloo
        self.backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
        self.store: Optional[dist.TCPStore] = None
        self.epoch = 0
        self.last: Optional[tuple[str, int]] = None  # (replica_id, epoch) we were last part of
        if stage_index == 0:
            try:
                self.store = dist.TCPStore(self.host, port, None, True, self.timeout, wait_for_workers=False)
            except Exception as e:
                raise ValueError(f"cannot host the replica rendezvous on {pipeline_addr}: {e}") from e
            self.rendezvous = f"{self.host}:{self.store.port}"
        else:
            self.rendezvous = ""

    # ------------------------------------------------------------ founder (stage 0)
    def _found(self, stop: Callable[[], bool]) -> Optional[ReplicaGroup]:
        self.epoch += 1
        self.store.set("epoch", str(self.epoch))
        slots = [f"e{self.epoch}/slot{k}" for k in range(1, self.num_stages)]
        while not self.store.check(slots):
            if stop():
                return None
            time.sleep(0.1)
        members = [self.peer_id] + [self.store.get(s).decode() for s in slots]
        self.store.set(f"e{self.epoch}/go", json.dumps(dict(members=members, shard_key=self.shard_key)))
        return self._init_group(ReplicaGroup(self.peer_id, self.epoch, members, self.shard_key), self.store)

    # ------------------------------------------------------------ joiner (stage k > 0)
    def _try_join(self, founder: Founder, stop: Callable[[], bool]) -> Optional[ReplicaGroup]:
        host, port = split_addr(founder.rendezvous)
        try:
            store = dist.TCPStore(host, port, None, False, timedelta(seconds=2), wait_for_workers=False)
            epoch = int(store.get("epoch"))
            if self.last is not None and self.last[0] == founder.replica_id and epoch <= self.last[1]:
                return None  # the founder has not noticed the break yet
            slot = f"e{epoch}/slot{self.stage_index}"
            if store.compare_set(slot, "", self.peer_id).decode() != self.peer_id:
                return None
            logger.info("claimed stage %d of replica %s (epoch %d); waiting for the other stages",
                        self.stage_index, founder.replica_id, epoch)
            go = f"e{epoch}/go"
            deadline = time.monotonic() + self.timeout.total_seconds()
            while not store.check([go]):
                if stop() or time.monotonic() > deadline or int(store.get("epoch")) != epoch:
                    return None
                time.sleep(0.1)
            plan = json.loads(store.get(go))
            store.set_timeout(self.timeout)
        except Exception as e:  # founder gone or unreachable: try the next one
            logger.debug("replica %s at %s: %s", founder.replica_id, founder.rendezvous, e)
            return None
        group = ReplicaGroup(founder.replica_id, epoch, list(plan["members"]), int(plan["shard_key"]))
        return self._init_group(group, store)

    def _init_group(self, replica: ReplicaGroup, store) -> Optional[ReplicaGroup]:
        try:
            dist.init_process_group(self.backend, store=dist.PrefixStore(f"e{replica.epoch}/pg", store),
                                    rank=self.stage_index, world_size=self.num_stages, timeout=self.timeout)
        except Exception as e:
            logger.warning("replica %s epoch %d: process group failed (%s)", replica.replica_id, replica.epoch, e)
            self.leave_group()
            self.last = (replica.replica_id, replica.epoch)
            return None
        replica.group = dist.group.WORLD
        self.last = (replica.replica_id, replica.epoch)
        return replica

    # ------------------------------------------------------------ both
    def form(self, founders: Callable[[], list[Founder]], stop: Callable[[], bool]) -> Optional[ReplicaGroup]:
        """Block until a replica with all stages is formed (returned) or ``stop()`` (None).

        ``founders()`` lists stage-0 records of the swarm with our num_stages (joiners only).
        """
        while not stop():
            if self.stage_index == 0:
                replica = self._found(stop)
            else:
                replica = None
                for founder in sorted(founders(), key=lambda f: (f.has_stage, f.replica_id)):
                    replica = self._try_join(founder, stop)
                    if replica is not None or stop():
                        break
                else:
                    time.sleep(0.5)
            if replica is not None:
                logger.info("replica %s formed (epoch %d): %s", replica.replica_id, replica.epoch,
                            ", ".join(replica.members))
                return replica
        return None

    @staticmethod
    def leave_group() -> None:
        """Destroy the replica's process group (after a failure, or before leaving)."""
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:
                logger.debug("destroying the process group: %s", e)

    def shutdown(self) -> None:
        self.leave_group()
        self.store = None
