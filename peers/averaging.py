"""Pseudo-gradient all-reduce and state download over hivemind's DecentralizedAverager.

* Matchmaking: the averager's prefix is ``{run_id}_[stage{K}of{S}_]pseudo_gradient_{compression}{size}``;
  each phase's group bits are the round index as 16 bits, the phase digit and (from phase 1 on) 15
  bits of the previous phase's mean digest (``ButterflyTransport``), so only replicas finishing the same round
  from the same earlier result average together (docs/protocol.md).
* Transport: butterfly all-reduce of one flat buffer of codes (dilocox.quantize / exact_mean),
  shipped losslessly by peers/codec.py, so every member of a group gets the bit-identical mean;
  the caller checks that with digests. A compressed round runs one all-reduce per phase
  (``ButterflyTransport``): PowerSGD's P, then Q, each with its own group key.
* State: ``get_current_state`` (the documented override point) serves the node's global
  parameters, outer momentum and metadata to joiners; ``state_sharing_priority`` is the donor's
  outer_step so joiners download from the most advanced peer.
* Refusals: ``refuse`` names peers (those the node's group excluded) that a group this averager leads does not take
  in as followers (``rpc_join_group``, hivemind's handler of join requests; peers/refusals.py). Given the node's
  DHT's set (``SupervisedDHT.refused``), the same peers are also never asked to lead: their declarations are left
  out of the averager's reads of its group keys (peers/dht.py).
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Dict, List, Optional, Sequence, Tuple

import pydantic.v1 as pydantic
import torch
from dilocox.peers import lifecycle
from dilocox.peers.codec import NarrowingCompression, narrowest_dtype
from dilocox.peers.records import at_most_max_peers
from dilocox.peers.refusals import RefusedPeers
from dilocox.peers.transport import Hooks
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time

from dilocox.compression import CompressionRound
from dilocox.diloco import params_digest

if TYPE_CHECKING:
    from dilocox.peers.transport import RoundInput

logger = logging.getLogger(__name__)
GROUP_BITS = 16


LEFT_BEHIND = "the round left us behind (no replica left in it, or most applied it)"  # why ``abandon`` gave up


class RoundFailed(RuntimeError):
    """No group was found, or the all-reduce failed, before the round deadline."""


class RoundCancelled(RuntimeError):
    """The node asked to leave while this round was in flight; nothing was applied."""


class RoundGather(pydantic.BaseModel):
    """Metadata every member sends with its pseudo-gradient (all-gathered by hivemind)."""

    outer_step: pydantic.conint(ge=0)  # version of theta the sender holds (round index - 1)
    start_digest: pydantic.StrictStr  # digest of that theta
    weight: pydantic.confloat(gt=0)
    # for the adaptive rank's bandwidth cap, which every member must compute from the same figures
    bandwidth_bps: pydantic.confloat(ge=0) = 0.0  # the sender's measured link rate (0: unknown)
    compute_s: pydantic.confloat(ge=0) = 0.0      # the sender's compute time for one round
    client_mode: pydantic.StrictBool = False  # the sender accepts no inbound connections: fetch via a relay
    # the sender's measured download link (peers/deadlines.py; 0: not measured): the group's download deadline
    # is the longest any member needs, so that all members stop waiting for a missing payload together
    link_bps: pydantic.confloat(ge=0, allow_inf_nan=False) = 0.0
    link_latency_s: pydantic.confloat(ge=0, allow_inf_nan=False) = 0.0
    # audits (daemon/audits.py): the sender's commitment to its round start state, served as ``state/<round>``,
    # and where its round's batches begin in its data stream (empty / 0: no commitment)
    state_sha256: pydantic.constr(strict=True, regex=r"^([0-9a-f]{64})?$") = ""
    state_bytes: pydantic.conint(ge=0, le=1 << 40) = 0
    data_position: pydantic.conint(ge=0) = 0
    shard_key: pydantic.conint(ge=0, lt=1 << 63) = 0
    # the group's exclusion vote (dilocox/exclusion.py): peer_id -> the round in which the sender found, or checked by
    # recomputing it, that the peer lied
    exclusion_votes: Dict[pydantic.constr(strict=True, max_length=64), pydantic.conint(ge=1)] = {}

    _few_votes = pydantic.validator("exclusion_votes", allow_reuse=True)(at_most_max_peers)


def group_limits(gathered: Dict[str, Optional[RoundGather]]) -> Tuple[float, float]:
    """(slowest known bandwidth in bit/s, shortest round compute time in s) over the group; 0 = unknown."""
    metas = [g for g in gathered.values() if g is not None]
    rates = [g.bandwidth_bps for g in metas if g.bandwidth_bps > 0]
    times = [g.compute_s for g in metas if g.compute_s > 0]
    return (min(rates) if rates else 0.0), (min(times) if times else 0.0)


@dataclass
class PhaseResult:
    mean: torch.Tensor                # the group's weighted mean of the codes (bit-identical on every member)
    gathered: Dict[str, Any]          # peer_id -> the gather dict it sent with this phase
    allreduce_s: float                # time from the start of the all-reduce to its end (no matchmaking)
    bytes_sent: int                   # estimate: (n-1)/n of our buffer as encoded + fp32 deltas we return as a
    bytes_received: int               # reducer; received mirrors it (hivemind headers not counted)


def _nothing_since() -> int:
    return 0


@dataclass
class RoundResult:
    """One round's exchange, as a transport returns it. Byte counts are for this node: ``bytes_sent`` /
    ``bytes_received`` are the round's traffic until the exchange returned (hivemind's phases: estimates, see
    PhaseResult; contribution rounds: what the contribution server sent under the round's keys and the payloads
    fetched); ``sent_since()`` adds what went under the round's keys after that (group-mates that fetched our
    payload or result later), read when the round is recorded (daemon/rounds.py)."""

    tensors: Sequence[torch.Tensor]  # the averaged pseudo-gradient: dense tensors, or a SparseAggregate reading as them
    gathered: Dict[str, Optional[RoundGather]]  # peer_id -> metadata of phase 1 (None if malformed)
    payload_bytes: int               # our encoded contribution, all phases (what one reducer would receive)
    bytes_sent: int
    bytes_received: int
    allreduce_s: float
    fp32_bytes_sent: int             # what the same round would send uncompressed (fp32 both ways)
    fp32_bytes: int = 0              # our pseudo-gradient as fp32 (4 bytes a value; 0: not stated)
    sent_since: Callable[[], int] = _nothing_since  # bytes sent under the round's keys after the exchange returned
    dropped: Dict[str, str] = field(default_factory=dict)  # peer_id -> why its contribution was not used
    # peer_id -> why: the members the group's exclusion vote left out of this round (dilocox/exclusion.py), also in
    # ``dropped``; the same on every member of the group
    excluded: Dict[str, str] = field(default_factory=dict)
    inputs: Dict[str, str] = field(default_factory=dict)   # sparse: peer_id -> digest of the payload used
    contributions: Dict[str, bytes] = field(default_factory=dict)  # sparse: peer_id -> the payload used (audits)
    # sparse: peer_id -> digest (as in ``inputs``) of the payload it committed to when it fetched ours, where we did not
    # use that payload (peers/contributions.py, "Commitments"): what it claimed, for the equivocation check
    claimed: Dict[str, str] = field(default_factory=dict)
    download_deadline_s: float = 0.0  # sparse: the deadline the downloads had (peers/deadlines.py; 0: none)
    link_bps: float = 0.0  # sparse: our measured download rate after this round (bit/s; 0: not measured)
    scales: Dict[str, float] = field(default_factory=dict)  # sparse: peer_id -> scale < 1 the norm bound gave it
    phases: Dict[str, float] = field(default_factory=dict)  # seconds per phase: matchmaking, gather, aggregate
    finished_at: float = field(default_factory=time.monotonic)  # time.monotonic() when the result was complete

    def release(self) -> None:
        """The aggregate was applied (and whatever serves it keeps its own copy): drop ``tensors``, a full
        fp32 copy of the parameters, before the round is recorded and checkpointed."""
        self.tensors = []


def group_bits(round_index: int) -> str:
    return format(round_index % (1 << GROUP_BITS), f"0{GROUP_BITS}b")


@dataclass(frozen=True)
class PhaseControl:
    """When a phase's group forms and what ends it (``PseudoGradientAverager.run_phase``).

    ``deadline_s``: seconds the group may take to form (matchmaking and its retries; hivemind's step timeout);
    ``cancel``: set to end the phase (RoundCancelled); ``abandon()``: the give-up rule, polled every
    ``check_every_s`` seconds until the all-reduce begins (RoundFailed); ``ready``: match now, all-reduce once this
    future is done (hivemind's ``require_trigger``: a round can form its group while its last inner steps
    compute); ``scheduled_in_s``: when the all-reduce should begin, seconds from now (hivemind's
    ``scheduled_time``)."""

    deadline_s: float
    cancel: threading.Event
    abandon: Optional[Callable[[], bool]] = None
    ready: Optional[Future] = None
    scheduled_in_s: Optional[float] = None
    check_every_s: float = 1.0


class PseudoGradientAverager(DecentralizedAverager):
    """A flat fp32 buffer averaged with hivemind's butterfly all-reduce, phase by phase.

    Blocking calls; run them off the event loop. ``state_provider`` (on one averager per node)
    serves the node's state to joiners (``get_current_state``, hivemind's documented override).
    ``refused``: the set ``refuse`` writes (made before this averager forks); the node passes its DHT's, so that
    one ledger refuses a peer as a follower here and as a leader or donor in the DHT's reads.
    """

    def __init__(self, size: int, dht: DHT, prefix: str,
                 state_provider: Optional[Callable[[], Tuple[dict, List[torch.Tensor]]]] = None, *,
                 matchmaking_time_s: float, request_timeout_s: float, averaging_timeout_s: float,
                 part_size_bytes: int = DEFAULT_PART_SIZE_BYTES, target_group_size: Optional[int] = None,
                 refused: Optional[RefusedPeers] = None, **averager_kwargs):
        self._state_provider = state_provider
        # hivemind's control pipe is not thread-safe: the comm thread (step, set_group_bits) and the
        # training thread (priority, state download) must not write to it at once (it corrupts the stream)
        self._pipe_lock = threading.Lock()
        self._allreduce_timeout = averaging_timeout_s
        self.size, self.part_elements = size, max(1, part_size_bytes // 4)
        # states streamed whole to joiners, counted in the averager process and read in this one: shared memory
        # made before the fork below
        self._states_served = mp.get_context("fork").Value("L", 0)
        # shared with the averager process, which answers join requests (and, the DHT's, reads declarations)
        self._refused = refused if refused is not None else RefusedPeers()
        lifecycle.before_fork()  # start=True below forks
        super().__init__(
            [torch.zeros(max(size, 1), dtype=torch.float32)],
            dht,
            start=True,
            prefix=prefix,
            target_group_size=target_group_size,  # None: hivemind forms groups of any size
            min_group_size=2,
            initial_group_bits=group_bits(0),
            min_matchmaking_time=matchmaking_time_s,
            request_timeout=request_timeout_s,
            allreduce_timeout=averaging_timeout_s,
            next_chunk_timeout=request_timeout_s * 2,
            compression=NarrowingCompression(),
            part_size_bytes=part_size_bytes,
            # a client (no inbound connections) cannot serve its state: hivemind refuses it
            allow_state_sharing=state_provider is not None and not dht.client_mode,
            # joiners read donors' priorities (outer steps) from these declarations; a few seconds of staleness
            # costs nothing (the downloaded state is checked), each declaration a DHT store
            declare_state_period=max(15.0, matchmaking_time_s),
            **averager_kwargs,
        )

    def run(self):
        """The averager process (multiprocessing's override point): supervised, see peers/lifecycle.py."""
        lifecycle.supervise_child()
        super().run()

    def shutdown(self) -> None:
        """hivemind's pipe shutdown, then bounded: the process is terminated and killed if it lingers."""
        if self.is_alive():
            super().shutdown()
        lifecycle.end_process(self, grace_s=3.0)

    def get_current_state(self):
        """Serve (metadata, tensors) to a joiner; runs in this (host) process (hivemind contract)."""
        metadata, tensors = self._state_provider()
        return metadata, tensors, None

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's handler of a joiner's state download (averager process), counting the streams that sent a
        state to their end (``states_served``). A request that got nothing (state sharing off, the donor busy:
        ``get_current_state`` gave no tensors) or whose joiner broke off mid-stream is not counted."""
        sent = False
        async for message in super().rpc_download_state(request, context):
            sent = True
            yield message
        if sent:
            with self._states_served.get_lock():
                self._states_served.value += 1

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's handler of a follower's join request (averager process): a peer in ``refuse``'s set is
        answered PROTOCOL_VIOLATION (hivemind's follower then asks its next leader), any other as hivemind does."""
        if context.remote_id.to_base58() in self._refused:
            self._refused.refused()
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    def refuse(self, peer_ids) -> None:
        """Refuse exactly ``peer_ids`` (base58 strings) as followers in matchmaking from now on (peers/refusals.py);
        any thread. Raises ValueError past ``refusals.CAPACITY`` peers."""
        self._refused.replace(peer_ids)

    def refused_joins(self) -> int:
        """Join requests refused since start (``rpc_join_group``); readable from this process."""
        return self._refused.refusals

    def states_served(self) -> int:
        """States streamed whole to joiners since start (``rpc_download_state``); readable from this process."""
        return self._states_served.value

    def run_phase(self, bits: str, codes: torch.Tensor, gather: dict, weight: float,
                  control: PhaseControl) -> PhaseResult:
        """All-reduce ``codes`` (fp32, at most ``size`` values; the rest of the buffer is zeros) with the
        peers matched under group key ``prefix.0b{bits}``; ``gather``: our metadata, all-gathered with the group's;
        ``weight``: ours in the mean; ``control``: how long the group may take to form and what ends the phase.

        Raises RoundCancelled when ``control.cancel`` is set or ``control.ready`` fails, RoundFailed on no group /
        failure / deadline, or when ``control.abandon()`` (polled every ``check_every_s`` before the all-reduce
        begins) returns True.
        """
        deadline_s, cancel, abandon, check_every_s = control.deadline_s, control.cancel, control.abandon, \
            control.check_every_s
        ready, scheduled_in_s = control.ready, control.scheduled_in_s
        if codes.numel() > self.size:
            raise ValueError(f"{codes.numel()} codes do not fit the {self.size}-value buffer")
        with self._pipe_lock:
            self.set_group_bits(bits)
        with self.get_tensors() as tensors:
            tensors[0].zero_()
            tensors[0][: codes.numel()].copy_(codes)
            encoded = sum(c.numel() * narrowest_dtype(c).itemsize for c in tensors[0].split(self.part_elements))
        scheduled = None if scheduled_in_s is None else get_dht_time() + max(0.0, scheduled_in_s)
        try:
            with self._pipe_lock:
                step_control = self.step(gather=gather, weight=weight, timeout=deadline_s, allow_retries=True,
                                         wait=False, require_trigger=ready is not None, scheduled_time=scheduled)
        except Exception as e:
            raise RoundFailed(f"could not start averaging: {e!r}") from e
        started = time.monotonic()
        next_check = started + self.matchmaking_kwargs["min_matchmaking_time"]
        give_up = started + deadline_s + self._allreduce_timeout + 5.0  # hivemind's own deadline, plus slack
        began = None
        while not step_control.done():
            if cancel.is_set():
                step_control.cancel()
                raise RoundCancelled("left during averaging")
            if time.monotonic() > give_up:  # e.g. the averager process stopped answering
                step_control.cancel()
                raise RoundFailed(f"no answer from the averager within {give_up - started:.0f}s")
            if ready is not None and not step_control.triggered and ready.done():
                if ready.cancelled() or ready.exception() is not None:
                    step_control.cancel()
                    raise RoundCancelled("the round was abandoned before its contribution was ready")
                step_control.allow_allreduce()
            if began is None and step_control.began_allreduce:
                began = time.monotonic()
            if abandon is not None and began is None and time.monotonic() >= next_check:
                next_check = time.monotonic() + check_every_s
                if abandon():
                    step_control.cancel()
                    raise RoundFailed(f"abandoned after {time.monotonic() - started:.1f}s: {LEFT_BEHIND}")
            time.sleep(0.01)
        try:
            gathered_raw = step_control.result()
        except BaseException as e:  # hivemind reports failures as exceptions on the StepControl
            raise RoundFailed(f"averaging failed: {e!r}") from e
        if not gathered_raw:
            raise RoundFailed("averaging returned no group")
        with self.get_tensors() as tensors:
            mean = tensors[0][: codes.numel()].clone()
        n = len(gathered_raw)
        sent = int((n - 1) / n * (encoded + 4 * self.size))  # our parts + fp32 deltas we return as a reducer
        return PhaseResult(mean, {p.to_base58(): d for p, d in gathered_raw.items()},
                           time.monotonic() - (began or started), sent, sent)

    def download_state(self, timeout_s: float) -> Optional[Tuple[Any, List[torch.Tensor]]]:
        """(metadata, tensors) from the highest-priority donor that serves one, or None if nobody did
        within ``timeout_s`` (seconds).

        hivemind tries the donors in priority order (ties broken at random) and moves on when one
        fails or stops sending for ``next_chunk_timeout``, e.g. a donor that dies mid-download."""
        with self._pipe_lock:
            future = self.load_state_from_peers(wait=False, timeout=timeout_s)
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            logger.warning("no donor finished sending its state within %.0fs", timeout_s)
            return None

    def set_priority(self, value: float) -> None:
        """``state_sharing_priority`` (joiners download from the highest), under the pipe lock."""
        if self.client_mode:
            return  # nobody downloads from a client (hivemind raises if it is set)
        with self._pipe_lock:
            self.state_sharing_priority = value

    def share_state(self, allowed: bool) -> None:
        """Declare (or withdraw) this node as a state donor: hivemind's public ``allow_state_sharing``, under
        the pipe lock. A node others cannot dial withdraws, so joiners do not wait on it; no-op for a client."""
        if self.client_mode or self._state_provider is None:
            return
        with self._pipe_lock:
            self.allow_state_sharing = allowed


def _stats(data: Any) -> dict:
    """A peer's energy statistics for the rank rule, or {} if malformed (every member drops the same)."""
    stats = data.get("stats") if isinstance(data, dict) else None
    if not isinstance(stats, dict) or "captured" not in stats:
        return {}
    try:
        captured = {str(k): [float(x) for x in v] for k, v in stats["captured"].items()}
        total = float(stats["total"])
    except (TypeError, ValueError, KeyError, AttributeError):
        return {}
    values = [x for v in captured.values() for x in v] + [total]
    if not all(math.isfinite(x) and x >= 0 for x in values):
        return {}
    return dict(captured=captured, total=total)


class ButterflyTransport:
    """Dense codes (fp32, int8, PowerSGD) by hivemind's butterfly all-reduce (peers/transport.py's Transport).

    ``averagers``: buffer size -> averager, one per rank of the compressor's ladder (hivemind averagers have
    fixed tensors); ``hooks.gather``: the red-team hook on our phase-0 metadata (daemon/redteam.py)."""

    def __init__(self, averagers: Dict[int, PseudoGradientAverager],
                 hooks: Hooks = Hooks()):
        self.averagers, self.hooks = averagers, hooks

    def exchange(self, rnd: RoundInput) -> RoundResult:
        """Average round ``rnd.index``'s compressed pseudo-gradient (a CompressionRound), phase by phase (PowerSGD:
        P, then Q), on the averager of its buffer size; each phase waits up to the round's group wait.

        Phase k's group key is ``<round as 16 bits><k>`` plus, from phase 1 on, 15 bits of the digest of
        the previous phase's mean, so a phase only ever mixes peers that hold the same earlier result.
        Raises RoundCancelled / RoundFailed as ``PseudoGradientAverager.run_phase`` does."""
        code: CompressionRound = rnd.contribution
        averager, tamper_gather = self.averagers[code.buffer_size()], self.hooks.gather
        round_index, meta, deadline_s = rnd.index, rnd.gather, rnd.times.group_wait_s
        extra, sent, received, allreduce_s, payload = "", 0, 0, 0.0, 0
        metas: Dict[str, Optional[RoundGather]] = {}
        for phase in range(code.num_phases):
            before = code.stats.payload_bytes
            codes, stats = code.phase_payload()
            payload += code.stats.payload_bytes - before
            gather = dict(meta.dict(), stats=stats) if phase == 0 else dict(stats=stats)
            if phase == 0 and tamper_gather is not None:
                gather = tamper_gather(gather, round_index)
            res = averager.run_phase(group_bits(round_index) + str(phase) + extra, codes, gather, meta.weight,
                                     PhaseControl(deadline_s, rnd.cancel, rnd.abandon if phase == 0 else None))
            if phase == 0:
                for peer, data in res.gathered.items():
                    try:
                        metas[peer] = RoundGather.parse_obj({k: v for k, v in data.items() if k != "stats"})
                    except (pydantic.ValidationError, TypeError, AttributeError):
                        metas[peer] = None  # a peer sent malformed metadata: it cannot vote
            peers = sorted(res.gathered)
            weights = [metas[p].weight if metas.get(p) is not None else 1.0 for p in peers]
            code.phase_done(res.mean, [_stats(res.gathered[p]) for p in peers], weights)
            extra = format(int(params_digest([res.mean])[:4], 16) >> 1, "015b")
            sent, received = sent + res.bytes_sent, received + res.bytes_received
            allreduce_s += res.allreduce_s
        n, numel = max(len(metas), 1), sum(t.numel() for t in code.m)
        return RoundResult(code.result(), metas, payload, sent, received, allreduce_s, int(2 * (n - 1) / n * 4 * numel),
                           fp32_bytes=4 * numel, phases=dict(allreduce=allreduce_s))

