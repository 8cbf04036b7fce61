from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchStatusRequest(_message.Message):
    __slots__ = ("interval_s",)
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    interval_s: float
    def __init__(self, interval_s: _Optional[float] = ...) -> None: ...

class ListPeersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("accepted", "state")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    state: str
    def __init__(self, accepted: _Optional[bool] = ..., state: _Optional[str] = ...) -> None: ...

class RoundInfo(_message.Message):
    __slots__ = ("outer_step", "group_size", "payload_bytes", "duration_s", "compression_ratio", "rank", "compute_s", "outcome", "bytes_sent", "bytes_received", "wait_s", "bits", "compression_error", "allreduce_s", "dropped", "download_deadline_s", "link_mbps", "matchmaking_s", "group_wait_s", "overlap_steps", "exchange_s", "encode_s", "group_s", "gather_s", "aggregate_s", "apply_s", "outsized")
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_RATIO_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_ERROR_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCE_S_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    LINK_MBPS_FIELD_NUMBER: _ClassVar[int]
    MATCHMAKING_S_FIELD_NUMBER: _ClassVar[int]
    GROUP_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_STEPS_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_S_FIELD_NUMBER: _ClassVar[int]
    ENCODE_S_FIELD_NUMBER: _ClassVar[int]
    GROUP_S_FIELD_NUMBER: _ClassVar[int]
    GATHER_S_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_S_FIELD_NUMBER: _ClassVar[int]
    APPLY_S_FIELD_NUMBER: _ClassVar[int]
    OUTSIZED_FIELD_NUMBER: _ClassVar[int]
    outer_step: int
    group_size: int
    payload_bytes: int
    duration_s: float
    compression_ratio: float
    rank: int
    compute_s: float
    outcome: str
    bytes_sent: int
    bytes_received: int
    wait_s: float
    bits: int
    compression_error: float
    allreduce_s: float
    dropped: _containers.RepeatedScalarFieldContainer[str]
    download_deadline_s: float
    link_mbps: float
    matchmaking_s: float
    group_wait_s: float
    overlap_steps: int
    exchange_s: float
    encode_s: float
    group_s: float
    gather_s: float
    aggregate_s: float
    apply_s: float
    outsized: bool
    def __init__(self, outer_step: _Optional[int] = ..., group_size: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., duration_s: _Optional[float] = ..., compression_ratio: _Optional[float] = ..., rank: _Optional[int] = ..., compute_s: _Optional[float] = ..., outcome: _Optional[str] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., wait_s: _Optional[float] = ..., bits: _Optional[int] = ..., compression_error: _Optional[float] = ..., allreduce_s: _Optional[float] = ..., dropped: _Optional[_Iterable[str]] = ..., download_deadline_s: _Optional[float] = ..., link_mbps: _Optional[float] = ..., matchmaking_s: _Optional[float] = ..., group_wait_s: _Optional[float] = ..., overlap_steps: _Optional[int] = ..., exchange_s: _Optional[float] = ..., encode_s: _Optional[float] = ..., group_s: _Optional[float] = ..., gather_s: _Optional[float] = ..., aggregate_s: _Optional[float] = ..., apply_s: _Optional[float] = ..., outsized: _Optional[bool] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("peer_id", "run_id", "version", "state", "listen_maddrs", "stage_index", "num_stages", "outer_step", "inner_step", "inner_steps", "loss", "tokens_per_second", "tokens_total", "bytes_sent", "bytes_received", "last_round", "global_params_digest", "swarm_size", "uptime_s", "val_loss", "resyncs", "last_error", "initial_loss", "compute_utilization", "overlap", "compression", "replica_id", "replica_members", "memory", "contributions_dropped", "attack", "admission", "val_accuracy", "outer_algorithm", "sync_reason", "sync_attempts", "client_mode", "reachability", "deadlines", "swarm_settings")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LISTEN_MADDRS_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_PARAMS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SWARM_SIZE_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    VAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    INITIAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    ATTACK_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    VAL_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    OUTER_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    SYNC_REASON_FIELD_NUMBER: _ClassVar[int]
    SYNC_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_MODE_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINES_FIELD_NUMBER: _ClassVar[int]
    SWARM_SETTINGS_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    run_id: str
    version: str
    state: str
    listen_maddrs: _containers.RepeatedScalarFieldContainer[str]
    stage_index: int
    num_stages: int
    outer_step: int
    inner_step: int
    inner_steps: int
    loss: float
    tokens_per_second: float
    tokens_total: int
    bytes_sent: int
    bytes_received: int
    last_round: RoundInfo
    global_params_digest: str
    swarm_size: int
    uptime_s: float
    val_loss: float
    resyncs: int
    last_error: str
    initial_loss: float
    compute_utilization: float
    overlap: str
    compression: str
    replica_id: str
    replica_members: _containers.RepeatedScalarFieldContainer[str]
    memory: StageMemory
    contributions_dropped: int
    attack: str
    admission: str
    val_accuracy: float
    outer_algorithm: str
    sync_reason: str
    sync_attempts: int
    client_mode: bool
    reachability: str
    deadlines: str
    swarm_settings: str
    def __init__(self, peer_id: _Optional[str] = ..., run_id: _Optional[str] = ..., version: _Optional[str] = ..., state: _Optional[str] = ..., listen_maddrs: _Optional[_Iterable[str]] = ..., stage_index: _Optional[int] = ..., num_stages: _Optional[int] = ..., outer_step: _Optional[int] = ..., inner_step: _Optional[int] = ..., inner_steps: _Optional[int] = ..., loss: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., tokens_total: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., last_round: _Optional[_Union[RoundInfo, _Mapping]] = ..., global_params_digest: _Optional[str] = ..., swarm_size: _Optional[int] = ..., uptime_s: _Optional[float] = ..., val_loss: _Optional[float] = ..., resyncs: _Optional[int] = ..., last_error: _Optional[str] = ..., initial_loss: _Optional[float] = ..., compute_utilization: _Optional[float] = ..., overlap: _Optional[str] = ..., compression: _Optional[str] = ..., replica_id: _Optional[str] = ..., replica_members: _Optional[_Iterable[str]] = ..., memory: _Optional[_Union[StageMemory, _Mapping]] = ..., contributions_dropped: _Optional[int] = ..., attack: _Optional[str] = ..., admission: _Optional[str] = ..., val_accuracy: _Optional[float] = ..., outer_algorithm: _Optional[str] = ..., sync_reason: _Optional[str] = ..., sync_attempts: _Optional[int] = ..., client_mode: _Optional[bool] = ..., reachability: _Optional[str] = ..., deadlines: _Optional[str] = ..., swarm_settings: _Optional[str] = ...) -> None: ...

class StageMemory(_message.Message):
    __slots__ = ("params_bytes", "inner_optimizer_bytes", "outer_optimizer_bytes", "error_feedback_bytes", "total_bytes")
    PARAMS_BYTES_FIELD_NUMBER: _ClassVar[int]
    INNER_OPTIMIZER_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTER_OPTIMIZER_BYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FEEDBACK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    params_bytes: int
    inner_optimizer_bytes: int
    outer_optimizer_bytes: int
    error_feedback_bytes: int
    total_bytes: int
    def __init__(self, params_bytes: _Optional[int] = ..., inner_optimizer_bytes: _Optional[int] = ..., outer_optimizer_bytes: _Optional[int] = ..., error_feedback_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("peer_id", "state", "outer_step", "inner_step", "tokens_per_second", "loss", "global_params_digest", "expires_in_s", "client_mode", "undialable_by")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_PARAMS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    CLIENT_MODE_FIELD_NUMBER: _ClassVar[int]
    UNDIALABLE_BY_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    state: str
    outer_step: int
    inner_step: int
    tokens_per_second: float
    loss: float
    global_params_digest: str
    expires_in_s: float
    client_mode: bool
    undialable_by: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, peer_id: _Optional[str] = ..., state: _Optional[str] = ..., outer_step: _Optional[int] = ..., inner_step: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., loss: _Optional[float] = ..., global_params_digest: _Optional[str] = ..., expires_in_s: _Optional[float] = ..., client_mode: _Optional[bool] = ..., undialable_by: _Optional[_Iterable[str]] = ...) -> None: ...

class ListPeersResponse(_message.Message):
    __slots__ = ("peers",)
    PEERS_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    def __init__(self, peers: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ...) -> None: ...
