"""All-gather of compressed contributions inside an averaging group, over hivemind's P2P API.

Sparse contributions (dilocox/sparse/) cannot be summed part by part in hivemind's butterfly
all-reduce, so a sparse round (``AllGatherTransport``) is:

1. **matchmaking** through the node's averager (hivemind forms the group under the round's group
   key and all-gathers each member's metadata: a ``RoundGather`` plus the SHA-256 and length of its
   payload); the all-reduce itself runs on a one-value buffer and carries nothing;
2. **download**: every member fetches every other member's payload directly from it
   (``ContributionServer.rpc_contribution``: peers/contributions.py) and checks length and digest
   against the gathered metadata, so a member that sends different bytes to different peers is
   caught by whoever got the others. A member nobody can dial (``--client-mode``, or a direct dial
   that failed: peers/reachability.py) is fetched through a **relay**: a reachable member serves
   the copy it fetched (over the connection the NAT'd member opened to it), checked against the
   same digest. Clients never dial clients; a peer whose dial failed is not dialed again for a
   while, so the round does not wait on it;
3. **aggregation**: every member validates the same bytes and runs the same deterministic
   reduction (``dilocox.sparse.aggregate``: sorted peer order, float64), so equal inputs give a
   bit-identical mean everywhere. Contributions whose metadata is malformed, whose start digest
   is not the group's, whose weight is outside (0, H], that could not be fetched or that fail the
   codec's validation are dropped, and the drop is reported (``RoundResult.dropped``).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from concurrent.futures import Future
from typing import Callable, Dict, NamedTuple, Optional, Tuple, TypeVar

import pydantic.v1 as pydantic
import torch
from dilocox.peers.averaging import (
    PhaseControl,
    PseudoGradientAverager,
    RoundFailed,
    RoundGather,
    RoundResult,
    group_bits,
)
from dilocox.peers.contributions import ContributionServer
from dilocox.peers.deadlines import LinkSnapshot, group_download_deadline
from dilocox.peers.transport import Hooks, RoundInput, Screen, matchmaking_schedule

from dilocox.consensus import canonical_digest
from dilocox.exclusion import group_exclusions
from dilocox.sparse.aggregate import aggregate_sparse
from dilocox.sparse.compressor import SparseRound

logger = logging.getLogger(__name__)

T = TypeVar("T")
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
# The downloads after the all-gather are given up once they have lasted this long and nobody else is in the round.
# A group waits its download deadline, up to --averaging-timeout, for a payload that may never come: in run P
# (docs/protocol.md) a joiner's group, with no measured link, waited 60 s on a group-mate that had left the
# round. The grace keeps a member whose mates finished first (and moved on) from losing a joint round.
ABANDON_GRACE_S = 15.0
# A round cancelled while its downloads run (we leave, or re-sync) still finishes them if it can within this; then
# they end, so a leave does not wait out the download deadline (compose stop: SIGKILL 10 s after SIGTERM).
CANCEL_GRACE_S = 5.0


def after(predicate: Callable[..., T], delay_s: float, before: T = False) -> Callable[..., T]:
    """A predicate that answers ``before``, without calling ``predicate``, until ``delay_s`` seconds (monotonic
    clock) after it was made, and ``predicate(*args)`` from then on. ``abandon`` reads the membership records (a
    DHT read), so a download that ends within the grace never pays for one."""
    start = time.monotonic()
    return lambda *args: predicate(*args) if time.monotonic() - start >= delay_s else before


def held_for(event: threading.Event, delay_s: float) -> Callable[[], bool]:
    """A predicate that is True once ``event`` has been seen set (at its calls) for ``delay_s`` seconds."""
    since: list[float] = []

    def check() -> bool:
        if not event.is_set():
            return False
        if not since:
            since.append(time.monotonic())
        return time.monotonic() - since[0] >= delay_s
    return check


def download_stop(cancel: threading.Event, abandon: Optional[Callable[[], bool]],
                  abandon_grace_s: float = ABANDON_GRACE_S) -> Callable[[], bool]:
    """When a round's downloads end early: ``cancel`` held for CANCEL_GRACE_S (we leave, or the round was dropped),
    or the give-up rule ``abandon`` holds after ``abandon_grace_s`` (the round went on without us)."""
    cancelled = held_for(cancel, CANCEL_GRACE_S)
    gave_up = None if abandon is None else after(abandon, abandon_grace_s)
    return lambda: cancelled() or (gave_up is not None and gave_up())


class SparseGather(pydantic.BaseModel):
    """What every member all-gathers in a sparse round beside its RoundGather fields. A round matched
    before its contribution existed (``early``) announces no digest: its payloads are checked against
    the codec's exact length and the round's result digests (docs/protocol.md)."""

    payload_sha256: Optional[pydantic.constr(regex=SHA256_HEX.pattern)] = None
    payload_bytes: Optional[pydantic.conint(ge=0)] = None


class Screened(NamedTuple):
    """What ``screen_gathered`` found: ``metas`` peer_id -> its RoundGather, or None if malformed, not admitted or
    excluded (it cannot vote); ``announced`` peer_id -> (payload sha256 or None if not announced, length to expect);
    ``dropped`` peer_id -> why its contribution is dropped; ``excluded`` peer_id -> why the group's exclusion vote
    left it out (also in ``dropped``)."""

    metas: Dict[str, Optional[RoundGather]]
    announced: Dict[str, Tuple[Optional[str], int]]
    dropped: Dict[str, str]
    excluded: Dict[str, str]


def screen_gathered(gathered: Dict[str, object], round_index: int, max_weight: float, payload_bytes: int,
                    admitted: Optional[Callable[[str], Optional[str]]] = None, committed: bool = False) -> Screened:
    """The rules every member applies to the group's gathered metadata before any download.

    ``gathered``: peer_id -> the dict it sent (untrusted); ``payload_bytes``: the codec's largest valid
    payload length; ``admitted(peer_id)``: None if the peer may take part, else why not (a certified swarm; such a
    peer neither votes nor contributes). Dropped: malformed metadata; a member the group's exclusion vote leaves out
    of this round (dilocox/exclusion.py: a strict majority of the members with valid metadata voted against it); a
    start other than the group's canonical start digest among members at outer step ``round_index - 1``
    (dilocox.consensus.canonical_digest), including any other outer step; a weight above ``max_weight``; with
    ``committed`` (an audited swarm), a contribution without a start-state commitment (``state_sha256``), which no
    audit could check (docs/security.md, Audits). Pure: every member that sees the same gathered data drops the same
    peers."""
    metas: Dict[str, Optional[RoundGather]] = {}
    announced: Dict[str, Tuple[Optional[str], int]] = {}
    dropped: Dict[str, str] = {}
    for peer, data in gathered.items():
        refusal = admitted(peer) if admitted is not None else None
        if refusal is not None:
            metas[peer], dropped[peer] = None, f"not admitted: {refusal}"
            continue
        try:
            fields = dict(data)
            metas[peer] = RoundGather.parse_obj({k: fields.pop(k) for k in RoundGather.__fields__ if k in fields})
            extra = SparseGather.parse_obj(fields)
        except (pydantic.ValidationError, TypeError, ValueError, AttributeError) as e:
            metas[peer] = None
            dropped[peer] = f"malformed metadata ({str(e).splitlines()[0][:120]})"
            continue
        if extra.payload_sha256 is None:
            announced[peer] = (None, payload_bytes)
        elif extra.payload_bytes is None or extra.payload_bytes > payload_bytes:
            metas[peer], dropped[peer] = None, (f"announced a payload of {extra.payload_bytes} bytes; at most "
                                                f"{payload_bytes} are valid")
            continue
        else:
            announced[peer] = (extra.payload_sha256, extra.payload_bytes)
    excluded = group_exclusions({p: m.exclusion_votes for p, m in metas.items() if m is not None}, round_index)
    for peer, why in excluded.items():
        metas[peer], dropped[peer] = None, why
    starts = {p: m.start_digest for p, m in metas.items() if m is not None and m.outer_step == round_index - 1}
    canon, _ = canonical_digest(starts)
    for peer, m in metas.items():
        if m is None or peer in dropped:
            continue
        if starts.get(peer) != canon:
            dropped[peer] = f"started from other parameters (outer step {m.outer_step}, digest {m.start_digest})"
        elif not m.weight <= max_weight:
            dropped[peer] = f"weight {m.weight} exceeds the round's {max_weight:g} inner steps"
        elif committed and not m.state_sha256:
            dropped[peer] = "no start-state commitment in an audited swarm: its round could not be audited"
    return Screened(metas, announced, dropped, excluded)


class AllGatherTransport:
    """Sparse contributions by all-gather (module docstring; peers/transport.py's Transport).

    ``averager``: matches the group and all-gathers its metadata (a one-value buffer); ``server``: offers our
    payload and fetches the others' (peers/contributions.py); ``me``: our peer_id (our payload is used as is, not
    fetched); ``screen``: which contributions count and how they combine (max weight H, rule, norm bound,
    admission; the server's admission where ``screen.admitted`` is None). Downloads wait as long as the group's
    announced links need for their bytes (peers/deadlines.py), at most ``fetch_timeout_s`` (always that, without
    ``adaptive_deadline``); ``request_timeout_s``: one request, added to the group wait of a scheduled round;
    ``hooks``: the red-team hooks on our gathered metadata and on the payload we announce and serve."""

    def __init__(self, averager: PseudoGradientAverager, server: ContributionServer, me: str, screen: Screen, *,
                 request_timeout_s: float, fetch_timeout_s: float, hooks: Hooks = Hooks(),
                 adaptive_deadline: bool = True, abandon_grace_s: float = ABANDON_GRACE_S):
        self.averager, self.server, self.me, self.screen, self.hooks = averager, server, me, screen, hooks
        self.request_timeout_s, self.fetch_timeout_s = request_timeout_s, fetch_timeout_s
        self.adaptive_deadline, self.abandon_grace_s = adaptive_deadline, abandon_grace_s

    def exchange(self, rnd_in: RoundInput) -> RoundResult:
        """Average round ``rnd_in.index``'s sparse contribution by all-gather; blocking.

        ``rnd_in.contribution``: the round's SparseRound, or a Future that will hold it (**early** matchmaking:
        the group forms while the round's last inner steps compute, its all-reduce begins once the future is
        done, about ``ready_in_s`` seconds from now; no payload digest can be announced then). Raises
        RoundCancelled / RoundFailed as ``PseudoGradientAverager.run_phase`` does (``abandon`` also ends the
        downloads once they have lasted ``abandon_grace_s`` seconds), and RoundFailed when no contribution but
        ours could be used (the caller then treats the round as a failed all-reduce)."""
        averager, server, me, screen = self.averager, self.server, self.me, self.screen
        rnd, round_index, meta = rnd_in.contribution, rnd_in.index, rnd_in.gather
        cancel, abandon, abandon_grace_s = rnd_in.cancel, rnd_in.abandon, self.abandon_grace_s
        scheduled_in_s, deadline_s = matchmaking_schedule(rnd_in.times, rnd_in.ready_in_s, self.request_timeout_s)
        max_weight, rule, norm_bound, admitted = screen.max_weight, screen.rule, screen.norm_bound, screen.admitted
        sign, drop_outsized = screen.sign, screen.drop_outsized
        tamper_gather, tamper_contribution = self.hooks.gather, self.hooks.contribution
        fetch_timeout_s, adaptive_deadline = self.fetch_timeout_s, self.adaptive_deadline
        key = group_bits(round_index) + "0"
        mine: Dict[str, bytes] = {}

        def offer(r: SparseRound) -> bytes:
            payload = r.payload if tamper_contribution is None else tamper_contribution(r.payload, round_index)
            server.offer(key, payload, committed=True)  # served only to members that committed theirs
            mine["payload"] = payload
            return payload

        if isinstance(rnd, Future):
            offered: Future = Future()  # done only once our payload is offered: the all-reduce may start then

            def on_ready(f: Future) -> None:
                try:
                    offer(f.result())
                    offered.set_result(True)
                except BaseException as e:  # cancelled or failed: the step is cancelled (run_phase)
                    offered.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))

            rnd.add_done_callback(on_ready)
            gather = dict(meta.dict())
            ready = offered
        else:
            payload = offer(rnd)
            gather = dict(meta.dict(), payload_sha256=hashlib.sha256(payload).hexdigest(), payload_bytes=len(payload))
            ready = None
        if tamper_gather is not None:
            gather = tamper_gather(gather, round_index)
        called = time.monotonic()
        res = averager.run_phase(key, torch.zeros(1), gather, meta.weight,
                                 PhaseControl(deadline_s, cancel, abandon, ready, scheduled_in_s))
        server.add_traffic(res.bytes_sent, res.bytes_received)
        started = time.monotonic()
        rnd = rnd.result() if isinstance(rnd, Future) else rnd
        payload = mine["payload"]
        metas, announced, dropped, excluded = screen_gathered(res.gathered, round_index, max_weight,
                                                              rnd.codec.payload_bytes(), admitted or server.admitted,
                                                              screen.committed)
        wanted = {p: announced[p] for p in announced if p != me and p not in dropped}
        # clients (no inbound connections) never dial clients: a reachable member relays between them
        clients = frozenset(p for p, m in metas.items() if m is not None and m.client_mode)
        relays = tuple(sorted(p for p in wanted if p not in clients))
        no_direct = clients if meta.client_mode else frozenset()
        # the group's deadline, from every member's announced link: all stop waiting for a missing payload together
        links = [LinkSnapshot(m.link_bps, m.link_latency_s, int(m.link_bps > 0)) for m in metas.values()
                 if m is not None]
        fetch_s = group_download_deadline(links, sum(size for _, size in announced.values()), fetch_timeout_s,
                                          relayed=len(clients) > 1) if adaptive_deadline else fetch_timeout_s
        stop = download_stop(cancel, abandon, abandon_grace_s)
        got, failed = server.fetch(wanted, key, fetch_s, relays, no_direct, stop=stop,
                                   commitment=hashlib.sha256(payload).hexdigest())
        fetched = time.monotonic()
        dropped.update(failed)
        digests = {p: hashlib.sha256(b).hexdigest() for p, b in got.items()}  # each payload hashed once
        dropped.update(broken_commitments(digests, lambda p: server.commitment(key, p)))
        got = {p: b for p, b in got.items() if p not in dropped}
        claimed = {p: c[:16] for p in wanted if p not in got and (c := server.commitment(key, p)) is not None}
        if me in announced and me not in dropped:
            got[me] = payload
        weights = {p: metas[p].weight for p in got}
        shapes = rnd.codec.shapes
        try:
            mean, rejected, scaled = aggregate_sparse(got, weights, shapes, rnd.codec.cfg, rule=rule,
                                                      norm_bound=norm_bound, sign=sign,
                                                      drop_outsized=drop_outsized)
        except ValueError as e:
            _log_drops(round_index, dropped)  # why nothing was left, ours included
            raise RoundFailed(f"no usable contribution: {e}") from e
        dropped.update(rejected)
        _log_drops(round_index, dropped)
        n = max(len(res.gathered), 1)
        numel = sum(t.numel() for t in rnd.codec.error)
        # our payload (and copies we relayed) under the round's key, whenever fetched: a slower mate may fetch it
        # after we return, which sent_since counts once the round is recorded
        served, sent_since = server.sent_under([key])
        sent = served + res.bytes_sent
        received = sum(len(b) for p, b in got.items() if p != me) + res.bytes_received
        inputs = {p: (digests.get(p) or hashlib.sha256(b).hexdigest())[:16] for p, b in got.items() if p not in dropped}
        return RoundResult(mean, metas, len(payload), sent, received, res.allreduce_s + time.monotonic() - started,
                           int(2 * (n - 1) / n * 4 * numel), fp32_bytes=4 * numel, sent_since=sent_since,
                           dropped=dropped, excluded=excluded, inputs=inputs,
                           contributions={p: b for p, b in got.items() if p not in dropped}, claimed=claimed,
                           download_deadline_s=fetch_s,
                           link_bps=server.link.snapshot().bps, scales=scaled,
                           phases=dict(matchmaking=started - called, gather=fetched - started,
                                       aggregate=time.monotonic() - fetched))


def broken_commitments(digests: Dict[str, str], committed: Callable[[str], Optional[str]]) -> Dict[str, str]:
    """peer_id -> why, for each member of ``digests`` (peer_id -> the SHA-256 hex of the payload we got from it) whose
    payload is not the one it committed to when it fetched from us (``committed(peer_id)``: the SHA-256 it sent, or
    None if it asked us nothing): peers/contributions.py, "Commitments"."""
    broken = {}
    for peer, digest in digests.items():
        commitment = committed(peer)
        if commitment is not None and digest != commitment:
            broken[peer] = (f"its payload is not the one it committed to ({commitment[:12]}..) when it fetched ours "
                            f"(a rushing or equivocating member)")
    return broken


def _log_drops(round_index: int, dropped: Dict[str, str]) -> None:
    for peer, reason in sorted(dropped.items()):
        logger.warning("round %d: dropped the contribution of %s: %s", round_index, peer, reason)
