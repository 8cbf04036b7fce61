"""Thread-safe status board: the training thread writes, the gRPC service reads and watches."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import asdict, dataclass, field
from enum import Enum

from dilocox.proto.dilocox.v1 import node_pb2


class State(str, Enum):
    """Lifecycle: BOOTSTRAPPING -> JOINING -> SYNCING -> TRAINING <-> AVERAGING -> DRAINING -> STOPPED
    (docs/architecture.md). BOOTSTRAPPING: the --join peers have not let us into the DHT yet (retrying)."""

    BOOTSTRAPPING = "BOOTSTRAPPING"
    JOINING = "JOINING"
    SYNCING = "SYNCING"
    TRAINING = "TRAINING"
    AVERAGING = "AVERAGING"
    DRAINING = "DRAINING"
    STOPPED = "STOPPED"


ACTIVE_STATES = (State.TRAINING.value, State.AVERAGING.value)  # replicas that will average this round
GONE_STATES = (State.DRAINING.value, State.STOPPED.value)  # members that no longer take part (leaving or left)


@dataclass
class RoundInfo:
    outer_step: int = 0
    group_size: int = 0
    payload_bytes: int = 0
    duration_s: float = 0.0
    compression_ratio: float = 0.0  # fp32 size of our pseudo-gradient / payload_bytes (0: no payload)
    rank: int = 0
    compute_s: float = 0.0
    outcome: str = ""
    # the round's traffic by the time it was recorded: hivemind phases (estimates) + bytes under the round's keys
    # (a payload fetched after that counts in Status.bytes_sent only)
    bytes_sent: int = 0
    bytes_received: int = 0
    wait_s: float = 0.0  # time the training thread was blocked on this round's communication
    bits: int = 0  # bits per value of the codes sent (32 = fp32 exact)
    compression_error: float = 0.0  # ||M - C(M)|| / ||M|| of this node's contribution (before feedback)
    allreduce_s: float = 0.0  # time in the all-reduce itself (no matchmaking), all phases
    dropped: list[str] = field(default_factory=list)  # peer_ids left out of the mean (sparse rounds)
    download_deadline_s: float = 0.0  # sparse rounds: the measured deadline the downloads had
    link_mbps: float = 0.0  # sparse rounds: our measured download rate after the round (0: not measured)
    matchmaking_s: float = 0.0  # matchmaking time the round scheduled (peers/deadlines.py: RoundTimes)
    group_wait_s: float = 0.0  # how long the round could look for its group
    overlap_steps: int = 0  # overlapped rounds: inner steps of the next round computed before this update joined
    exchange_s: float = 0.0  # from the end of the round's inner steps until its exchange's result was complete
    encode_s: float = 0.0  # compressing our pseudo-gradient (error feedback, top-k, packing)
    group_s: float = 0.0  # the exchange's matchmaking and metadata phase (butterfly rounds: the whole all-reduce)
    gather_s: float = 0.0  # sparse rounds: downloading the group's contributions
    aggregate_s: float = 0.0  # sparse rounds: decoding, validating and aggregating them
    apply_s: float = 0.0  # the outer step and theta's digest and snapshot
    outsized: bool = False  # SCAFFOLD's quiet restart counts from this round (dilocox/scaffold.py QuietRestart)


@dataclass
class StageMemory:
    params_bytes: int = 0
    inner_optimizer_bytes: int = 0
    outer_optimizer_bytes: int = 0
    error_feedback_bytes: int = 0
    total_bytes: int = 0


@dataclass
class Status:
    peer_id: str = ""
    run_id: str = ""
    version: str = ""
    state: State = State.JOINING
    listen_maddrs: list[str] = field(default_factory=list)
    stage_index: int = 0
    num_stages: int = 1
    outer_step: int = 0
    inner_step: int = 0
    inner_steps: int = 0
    loss: float = math.nan
    initial_loss: float = math.nan
    val_loss: float = math.nan
    val_accuracy: float = math.nan  # image models: accuracy of theta on held-out images (NaN for text)
    tokens_per_second: float = 0.0
    tokens_total: int = 0
    bytes_sent: int = 0  # outer rounds' traffic since start, in a round's window or not (OuterRounds.bytes_sent_total)
    bytes_received: int = 0
    last_round: RoundInfo = field(default_factory=RoundInfo)
    global_params_digest: str = ""
    swarm_size: int = 0
    resyncs: int = 0
    sync_reason: str = ""  # while BOOTSTRAPPING or SYNCING: why the last attempt did not join
    sync_attempts: int = 0
    last_error: str = ""
    compute_utilization: float = 0.0
    overlap: str = "delayed"
    compression: str = "sparse"
    replica_id: str = ""
    replica_members: list[str] = field(default_factory=list)
    memory: StageMemory = field(default_factory=StageMemory)
    contributions_dropped: int = 0
    attack: str = ""
    admission: str = ""
    outer_algorithm: str = "diloco"
    client_mode: bool = False
    reachability: str = "reachable"  # peers/reachability.py: describe()
    deadlines: str = ""  # the deadlines in use and what they came from (peers/deadlines.py: describe())
    swarm_settings: str = ""  # what every replica must share (NodeConfig.swarm_settings); records carry its digest


class StatusBoard:
    """Holds the current Status; ``update`` bumps a version that watchers wait on."""

    def __init__(self, **initial):
        self._status = Status(**initial)
        self._cond = threading.Condition()
        self.version = 0
        self.started = time.monotonic()

    def update(self, **changes) -> None:
        with self._cond:
            for k, v in changes.items():
                if not hasattr(self._status, k):
                    raise AttributeError(f"Status has no field {k}")
                setattr(self._status, k, v)
            self.version += 1
            self._cond.notify_all()

    def snapshot(self) -> Status:
        with self._cond:
            s = Status(**{k: getattr(self._status, k) for k in Status.__dataclass_fields__})
            s.last_round = RoundInfo(**asdict(self._status.last_round))
            s.listen_maddrs = list(self._status.listen_maddrs)
            s.replica_members = list(self._status.replica_members)
            s.memory = StageMemory(**asdict(self._status.memory))
            return s

    def wait_change(self, seen_version: int, timeout_s: float) -> int:
        with self._cond:
            self._cond.wait_for(lambda: self.version != seen_version, timeout=timeout_s)
            return self.version

    def to_proto(self) -> node_pb2.NodeStatus:
        s = self.snapshot()
        fields = asdict(s)
        fields["state"] = s.state.value
        fields["last_round"] = node_pb2.RoundInfo(**fields["last_round"])
        fields["memory"] = node_pb2.StageMemory(**fields["memory"])
        fields["uptime_s"] = time.monotonic() - self.started
        return node_pb2.NodeStatus(**fields)
