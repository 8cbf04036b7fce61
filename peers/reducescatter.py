"""Reduce-scatter rounds on a shared index set: an upload per member that does not grow with the group.

In an all-gather round (peers/allgather.py) each member serves its contribution to each of its k - 1
group-mates, (k - 1) x payload per round. Here the members first agree on one index set P (the union
of their proposals, dilocox/shared_index.py), so every member's values live on the same positions and
can be summed range by range:

1. **proposals and unions** (key ``{key}/u``): each member takes its ceil(topk / k) largest |beta e + delta| per
   chunk (``proposal_positions``) and pushes the part in range j to reducer j with its request for j's union (an
   index set alone, Rice-coded as a contribution's indices, ``encode_proposal``; ``ContributionServer.rpc_exchange``,
   peers/uploads.py). Reducer j collects the proposals of its range, serves their union (``encode_union``: one
   Rice-coded set over the range) as the answer, and every member so has every range's union. P is their
   concatenation, the same on every member. A proposal that does not come in time or does not read is left out of
   its union (and reported); a range whose union a member cannot fetch or read is left out of its P (a reducer
   that left: every member misses it alike, so all still hold one P). A reducer does not wait for a member whose
   membership record says it left or has expired (``gone``: it crashed), nor, in step 2, for the values of one
   that sent it no proposal.
2. **values and results** (key ``{key}/r``): P's chunks are split into k fixed ranges (``chunk_ranges``); member
   j (sorted peer-id order) reduces range j. Every member pushes its values there (``pack_values`` at cfg.bits:
   the receiver holds P, so no index is sent) to reducer j with its request for j's result. Reducer j runs the
   robust rule on its range (``reduce``; norm bound and centered-clip on the range's norms, as BTARD's butterfly
   clipping), quantizes it at cfg.result_bits keeping what that drops (``ReducerFeedback``, DoubleSqueeze), and
   answers with it; every member applies P's values. A range whose result cannot be had gets no update, and each
   member puts back in its buffer what it sent there (its reducer left mid-round).

So each pair of members makes two libp2p calls a round (one per step), where pulling each payload made four:
a call costs about 1 KB of framing on the wire whatever it carries.

Upload per member and round, with V its values, R the result, I its proposal (topk / k indices per
chunk) and U the union coded once (up to topk per chunk, about 6 bits per index at 256 of 4096): each
goes to k - 1 members a k-th at a time, (k - 1) / k x (V + R + I + U), flat in k.

What a member checks: lengths (each range's exact byte count follows from P), scales and codes
(``unpack_values``), proposals and unions (``dilocox.sparse.decode_positions``: count, range and order),
and that each union holds its own proposal (a reducer that leaves positions out is logged).
A reducer drops a member whose values do not parse and reports it. A reducer could serve different
results to different members, or a wrong one: ``RangeResults.digests`` (SHA-256 of each range's result
bytes) are what members compare to catch the first, as they compare theta digests after applying; the
second needs an audit of the range (a member re-fetching its inputs), which is not built here. This
module is the transport (``ReduceScatter``) and the daemon's round over it (``ReduceScatterTransport``,
``--compression shared``; docs/algorithms.md, "Shared index sets").
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Collection, Dict, Mapping, Optional, Sequence

import numpy as np
import torch
from dilocox.peers.allgather import after, download_stop, screen_gathered
from dilocox.peers.averaging import (
    PhaseControl,
    PseudoGradientAverager,
    RoundFailed,
    RoundGather,
    RoundResult,
    group_bits,
)
from dilocox.peers.contributions import ContributionServer
from dilocox.peers.transport import Hooks, RoundInput, Screen, matchmaking_schedule

from dilocox.shared_index import (
    ReducerFeedback,
    SharedIndexConfig,
    SharedIndexMember,
    decode_proposal,
    decode_union,
    encode_proposal,
    encode_union,
    pack_values,
    proposal_bytes,
    proposal_config,
    proposal_positions,
    range_slices,
    reduce,
    union_bytes_bound,
    unpack_values,
    value_range,
    values_bytes,
)
from dilocox.sparse.wire import ContributionError

logger = logging.getLogger(__name__)
# a reducer's wait asks who left (a read of the membership records) only after this long: a healthy round's waits
# end sooner and read nothing, a member that left mid-round is let go a few seconds later
LEAVER_GRACE_S = 5.0


@dataclass(frozen=True)
class RangeResults:
    """One member's outcome of a reduce-scatter round.

    ``positions``: P (sorted flat int64); ``applied``: fp32 on P, what the member adds to its pseudo-gradient
    mean (the same bits on every member that got the same results); ``digests``: reducer peer_id -> SHA-256
    hex of its range's result bytes; ``dropped``: as a reducer, member -> why its proposal or values were not
    used;
    ``sent_bytes`` / ``received_bytes``: payload bytes served / fetched under the round's keys until the round
    returned (``ContributionServer.served_bytes``); ``sent_since()``: those sent under them since (members still
    fetching our result);
    ``phases``: seconds per step (propose: proposals and unions, reduce, gather); ``missing``: reducer -> why its
    range got no update (no union: left out of P; no result: our values there went back to our buffer)."""

    positions: np.ndarray
    applied: np.ndarray
    digests: Dict[str, str]
    dropped: Dict[str, str]
    sent_bytes: int
    received_bytes: int
    phases: Dict[str, float] = field(default_factory=dict)
    missing: Dict[str, str] = field(default_factory=dict)
    sent_since: Callable[[], int] = lambda: 0


@dataclass(frozen=True)
class RangeRound:
    """One member's inputs to a reduce-scatter round: ``group`` (peer_ids, ours included; their order does not
    matter), the round's ``key``; ``m``: our beta e + delta (flat fp32, ``member.accumulate``); ``member``'s
    buffer becomes m minus what we sent, or stays as it was if the round fails; ``weights``: every member's weight
    (from matchmaking); ``feedback``: our reducer's buffer (kept across rounds; None: the result's quantization
    error is dropped)."""

    group: Sequence[str]
    key: str
    member: SharedIndexMember
    m: torch.Tensor
    weights: Mapping[str, float]
    feedback: Optional[ReducerFeedback] = None


@dataclass
class _Agreed:
    """What step 1 leaves step 2: the sorted group, P, what we sent on it, bytes fetched so far, step times, the
    members whose proposal did not come and the ranges that got no union."""

    group: list
    positions: np.ndarray
    sent: np.ndarray
    received: int
    phases: Dict[str, float]
    unproposed: Dict[str, str]
    missing: Dict[str, str]


class ReduceScatter:
    """The reduce-scatter of one member (module docstring, steps 1 and 2) over ``server`` (keeps at least 2 offers),
    as peer ``me``. ``timeout_s``: seconds a reducer waits for its group-mates' proposals, and again for their
    values; a member waits twice that for each union and each result (the reducer's wait, then its answer).
    ``rule`` / ``norm_bound``: how a reducer combines its range (dilocox/robust.py)."""

    def __init__(self, server: ContributionServer, me: str, timeout_s: float, rule: str = "mean",
                 norm_bound: float = 0.0):
        self.server, self.me, self.timeout_s, self.rule, self.norm_bound = server, me, timeout_s, rule, norm_bound

    def run(self, rr: RangeRound, stop: Optional[Callable[[], bool]] = None,
            gone: Optional[Callable[[Collection[str]], Collection[str]]] = None) -> RangeResults:
        """Run one round; blocking. A range whose union or result could not be fetched or read gets no update
        (``RangeResults.missing``; without a result, what we sent there goes back to our buffer). ``stop()``,
        polled about once a second during each wait (``PendingFetch.result``, ``Uploads.collect``), gives the
        round up: the round went on without us. ``gone(peers)``, polled as often while a reducer waits for
        uploads, names those of the awaited ``peers`` known to have left (``Uploads.collect``): their proposals
        and values are not waited for. A member whose proposal did not come (or did not read) is not waited for
        again for its values: our range's result leaves it out, as ``dropped`` says. Raises RoundFailed when
        ``stop()`` held or no other member's range could be had, ValueError for a group without us, a member
        without a weight, fewer chunks than members or a server that keeps too few offers."""
        server, me, timeout_s = self.server, self.me, self.timeout_s
        group, key, member, m, weights = rr.group, rr.key, rr.member, rr.m, rr.weights
        cfg: SharedIndexConfig = member.cfg
        group = sorted(set(group))
        if me not in group:
            raise ValueError(f"we ({me[:16]}) are not in the group")
        k, n = len(group), m.numel()
        if server.keep < 2:
            raise ValueError(f"the contribution server keeps {server.keep} offers; a round needs 2 (union, result)")
        if -(-n // cfg.chunk) < k:
            raise ValueError(f"{n} values make {-(-n // cfg.chunk)} chunks; a round of {k} needs a chunk per reducer")
        if set(group) - set(weights):
            raise ValueError(f"no weight for {sorted(set(group) - set(weights))[:3]}")
        others, rank = [p for p in group if p != me], group.index(me)
        ranges = [value_range(n, cfg.chunk, k, j) for j in range(k)]
        t0 = time.monotonic()
        lo, hi = ranges[rank]
        mine = proposal_positions(m, cfg, k)
        most = [k * proposal_config(cfg, k).topk * -(-(b - a) // cfg.chunk) for a, b in ranges]  # k proposals' worth
        # our proposal for each range goes to its reducer with our request for the range's union
        pending = server.start_fetch(
            {group[j]: (None, union_bytes_bound(*ranges[j], most[j])) for j in range(k) if j != rank}, f"{key}/u",
            2 * timeout_s, uploads={group[j]: (f"{key}/p{j}", encode_proposal(mine, *ranges[j], cfg, k))
                                    for j in range(k) if j != rank})
        try:
            got, unproposed = server.uploads.collect(f"{key}/u", {p: proposal_bytes(lo, hi, cfg, k) for p in others},
                                                     timeout_s, stop=stop, gone=gone)
        except BaseException:
            pending.cancel()
            raise
        received = sum(map(len, got.values()))
        proposals = [mine[(mine >= lo) & (mine < hi)]]
        for p, payload in got.items():
            try:
                proposals.append(decode_proposal(payload, lo, hi, cfg, k))
            except ContributionError as e:
                unproposed[p] = f"its proposal does not read: {e}"
        union = np.unique(np.concatenate(proposals))
        server.offer(f"{key}/u", encode_union(union, lo, hi))
        got, missing = pending.result(stop=stop)
        received += sum(map(len, got.values()))
        parts = []
        for j, (a, b) in enumerate(ranges):
            if j == rank:
                parts.append(union)
                continue
            try:
                if group[j] in missing:
                    raise ContributionError(missing[group[j]])
                parts.append(decode_union(got[group[j]], a, b, most[j]))
            except ContributionError as e:
                # its range is left out of P: every member that misses it too applies the same update (a member
                # that got it has another P, and the round's result digests tell them apart)
                missing[group[j]] = f"no union: {e}"
                logger.warning("round %s: no union from %s (%s): its range is left out of this round", key,
                               group[j][:16], e)
                parts.append(np.zeros(0, dtype=np.int64))
                continue
            left_out = np.setdiff1d(mine[(mine >= a) & (mine < b)], parts[-1])
            if len(left_out):  # a reducer may pick its range's positions; it is told to take every proposal
                logger.warning("round %s: the union of %s leaves out %d of our proposed positions", key, group[j][:16],
                               len(left_out))
        positions = np.concatenate(parts)
        before = member.error.clone()
        sent = member.contribute(m, positions)
        phases = dict(propose=time.monotonic() - t0)
        try:
            return self._reduce_and_gather(rr, _Agreed(group, positions, sent, received, phases, unproposed, missing),
                                           stop, gone)
        except BaseException:
            member.error = before  # a failed round changes nothing: the caller decides what becomes of m
            raise

    def _reduce_and_gather(self, rr: RangeRound, agreed: _Agreed, stop: Optional[Callable[[], bool]],
                           gone: Optional[Callable[[Collection[str]], Collection[str]]]) -> RangeResults:
        """Step 2 of the module docstring, once P is known: our values on each range go to its reducer with
        our request for its result, while we collect our range's values and serve its result."""
        server, me, timeout_s, m, member, weights = self.server, self.me, self.timeout_s, rr.m, rr.member, rr.weights
        key, cfg, feedback = rr.key, rr.member.cfg, rr.feedback
        group, positions, sent, received, phases = agreed.group, agreed.positions, agreed.sent, agreed.received, \
            agreed.phases
        unproposed, missing = agreed.unproposed, agreed.missing
        k, rank, n = len(group), group.index(me), m.numel()
        slices = range_slices(positions, n, cfg.chunk, k)
        ours = m[torch.from_numpy(positions)].numpy()
        t0 = time.monotonic()
        # every other reducer is asked, an empty range too (its result is empty): each waits for every member's values
        pending = server.start_fetch(
            {group[j]: (None, values_bytes(positions[sl], n, cfg, cfg.result_bits)) for j, sl in enumerate(slices)
             if j != rank}, f"{key}/r", 2 * timeout_s,
            uploads={group[j]: (f"{key}/v{j}", pack_values(ours[sl], positions[sl], n, cfg.chunk, cfg.bits)[0])
                     for j, sl in enumerate(slices) if j != rank})
        mine = slices[rank]
        size = values_bytes(positions[mine], n, cfg)
        try:
            # a member that sent no proposal here (late, gone, unreadable) is not waited for a second time
            awaited = {p: size for p in group if p != me and p not in unproposed}
            got, dropped = server.uploads.collect(f"{key}/r", awaited, timeout_s, stop=stop, gone=gone)
        except BaseException:
            pending.cancel()
            raise
        dropped.update({p: f"no proposal for our range: {why}" for p, why in unproposed.items() if p not in dropped})
        received += sum(map(len, got.values()))
        rows = {me: sent[mine]}
        for p, payload in got.items():
            try:
                rows[p] = unpack_values(payload, positions[mine], n, cfg.chunk, cfg.bits)
            except ContributionError as e:
                dropped[p] = f"its values do not read: {e}"
        peers = sorted(rows)
        red = reduce([rows[p] for p in peers], [float(weights[p]) for p in peers], positions[mine], n, cfg,
                     self.rule, self.norm_bound, feedback)
        server.offer(f"{key}/r", red.payload)
        phases["reduce"] = time.monotonic() - t0
        t0 = time.monotonic()
        got, failed = pending.result(stop=stop)
        received += sum(map(len, got.values()))
        applied = np.zeros(len(positions), dtype=np.float32)
        applied[mine] = red.applied
        digests = {me: hashlib.sha256(red.payload).hexdigest()}
        for j, sl in enumerate(slices):
            if j == rank or sl.stop == sl.start:  # (an empty range has no update)
                continue
            try:
                if group[j] in failed:
                    raise ContributionError(failed[group[j]])
                applied[sl] = unpack_values(got[group[j]], positions[sl], n, cfg.chunk, cfg.result_bits)
            except ContributionError as e:
                # its range gets no update; what we sent there goes back to our buffer, as if never sent
                missing[group[j]] = f"no result: {e}"
                logger.warning("round %s: no result from %s (%s): its range gets no update this round", key,
                               group[j][:16], e)
                member.restore(positions[sl], sent[sl])
                continue
            digests[group[j]] = hashlib.sha256(got[group[j]]).hexdigest()
        if len(missing) == k - 1 and k > 1:
            raise RoundFailed("no union or result from any other member: " +
                              "; ".join(f"{p[:16]}: {why}" for p, why in sorted(missing.items())))
        phases["gather"] = time.monotonic() - t0
        keys = [f"{key}/u", f"{key}/r"] + [f"{key}/{x}{j}" for j in range(k) if j != rank for x in "pv"]
        served, sent_since = server.sent_under(keys)
        return RangeResults(positions, applied, digests, dropped, served, received, phases, missing, sent_since)


def round_key(round_index: int) -> str:
    """The contribution keys' prefix of a reduce-scatter round: one per outer step, so keys of two rounds a slow
    member still fetches never meet."""
    return f"rs{int(round_index)}"


class ReduceScatterTransport:
    """``--compression shared`` rounds (module docstring; peers/transport.py's Transport).

    ``averager``: matches the group and all-gathers its metadata (a one-value buffer, as an all-gather round);
    ``server``: carries the proposals, unions, values and results (keeps at least 2 offers); ``me``: our peer_id;
    ``screen``: which members count (max weight H, admission) and how a reducer combines its range (rule, norm
    bound); ``fetch_timeout_s``: a reducer's wait for its group-mates' uploads (``ReduceScatter``);
    ``request_timeout_s``: one request, added to the group wait of a scheduled round; ``hooks.gather``: the
    red-team hook on our gathered metadata."""

    def __init__(self, averager: PseudoGradientAverager, server: ContributionServer, me: str, screen: Screen, *,
                 request_timeout_s: float, fetch_timeout_s: float,
                 hooks: Hooks = Hooks()):
        self.averager, self.server, self.me, self.screen, self.hooks = averager, server, me, screen, hooks
        self.request_timeout_s, self.fetch_timeout_s = request_timeout_s, fetch_timeout_s
        self.reduction = ReduceScatter(server, me, fetch_timeout_s, screen.rule, screen.norm_bound)

    def exchange(self, rnd_in: RoundInput) -> RoundResult:
        """One round, blocking: the group forms by matchmaking and all-gathers its metadata, every member screens
        it by the same rules (peers/allgather.py: ``screen_gathered``; no payload is announced), and the members
        that pass run ``ReduceScatter`` among themselves under ``round_key(index)``.

        ``rnd_in.contribution``: the round's SharedRound, or a Future that will hold it (early matchmaking, as
        AllGatherTransport). Its ``member`` and ``feedback`` copies hold the buffers the round leaves
        (SharedCompressor.commit adopts them if the round is applied). Returns the mean pseudo-gradient as
        tensors of the model's shapes (zero off P); ``dropped``: the members the screen left out (the same on
        every member; what a reducer dropped of its range is logged). A member whose start the screen left out
        gets zeros and the group's metadata (its caller's start-digest check re-syncs it). Raises RoundCancelled
        / RoundFailed as ``run_phase`` does, and RoundFailed when no other member's range could be had.
        ``rnd_in.gone(peers)``: those of the awaited ``peers`` whose membership records say they left (DRAINING,
        STOPPED) or have expired (a crash), asked only once a wait has lasted LEAVER_GRACE_S (it may read the
        DHT): a member that leaves mid-round then costs its group-mates seconds, not two fetch timeouts, and one
        that crashes about a record's lifetime, not a fetch timeout."""
        averager, server, me, screen = self.averager, self.server, self.me, self.screen
        rnd, round_index, meta = rnd_in.contribution, rnd_in.index, rnd_in.gather
        cancel, abandon, gone, tamper_gather = rnd_in.cancel, rnd_in.abandon, rnd_in.gone, self.hooks.gather
        scheduled_in_s, deadline_s = matchmaking_schedule(rnd_in.times, rnd_in.ready_in_s, self.request_timeout_s)
        max_weight, admitted, fetch_timeout_s = screen.max_weight, screen.admitted, self.fetch_timeout_s
        key = group_bits(round_index) + "0"
        gather = dict(meta.dict())
        if tamper_gather is not None:
            gather = tamper_gather(gather, round_index)
        ready = None
        if isinstance(rnd, Future):
            ready = Future()  # the all-reduce may start once our round exists (nothing is offered before P)

            def on_ready(f: Future) -> None:
                try:
                    f.result()
                    ready.set_result(True)
                except BaseException as e:  # cancelled or failed: the step is cancelled (run_phase)
                    ready.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))

            rnd.add_done_callback(on_ready)
        called = time.monotonic()
        res = averager.run_phase(key, torch.zeros(1), gather, meta.weight,
                                 PhaseControl(deadline_s, cancel, abandon, ready, scheduled_in_s))
        server.add_traffic(res.bytes_sent, res.bytes_received)
        started = time.monotonic()
        rnd = rnd.result() if isinstance(rnd, Future) else rnd
        metas, _, dropped, _ = screen_gathered(res.gathered, round_index, max_weight, 0, admitted or server.admitted)
        group = sorted(p for p, m in metas.items() if m is not None and p not in dropped)
        if me not in group:
            if metas.get(me) is None:
                raise RoundFailed(f"the group left us out: {dropped.get(me, 'no metadata of ours came back')}")
            # our start is not the group's: the members did not count us, and the caller's start-digest check re-syncs
            # us (as after an all-gather round we started from other parameters)
            return RoundResult([torch.zeros(s) for s in rnd.shapes], metas, 0, res.bytes_sent, res.bytes_received,
                               res.allreduce_s, 0, fp32_bytes=4 * rnd.m.numel(), dropped=dropped,
                               phases=dict(matchmaking=started - called))
        for peer, why in sorted(dropped.items()):
            logger.warning("round %d: left %s out of the reduce-scatter: %s", round_index, peer, why)
        # as the all-gather's downloads: after ABANDON_GRACE_S the give-up rule may end the fetches (the round went on
        # without us; waiting out the fetch timeouts on members that moved on would only delay our re-sync), and so
        # does ``cancel`` (we leave) after CANCEL_GRACE_S: a leave in a stalled round waited out both fetch timeouts
        stop = download_stop(cancel, abandon)
        out = self.reduction.run(RangeRound(group, round_key(round_index), rnd.member, rnd.m,
                                            {p: metas[p].weight for p in group}, rnd.feedback),
                                 stop=stop, gone=None if gone is None else after(gone, LEAVER_GRACE_S, before=()))
        for peer, why in sorted(out.dropped.items()):
            logger.warning("round %d: as reducer of our range, dropped %s: %s", round_index, peer, why)
        n, cfg = rnd.m.numel(), rnd.cfg
        contribution = values_bytes(out.positions, n, cfg) + sum(
            proposal_bytes(*value_range(n, cfg.chunk, len(group), j), cfg, len(group)) for j in range(len(group)))
        rnd.settle(contribution)
        flat = torch.zeros(n)
        flat[torch.from_numpy(out.positions)] = torch.from_numpy(out.applied)
        tensors, offset = [], 0
        for shape in rnd.shapes:
            size = math.prod(shape)
            tensors.append(flat[offset:offset + size].view(shape))
            offset += size
        return RoundResult(tensors, metas, contribution, out.sent_bytes + res.bytes_sent,
                           out.received_bytes + res.bytes_received, res.allreduce_s + time.monotonic() - started,
                           int(2 * (len(group) - 1) / max(len(group), 1) * 4 * n), fp32_bytes=4 * n,
                           sent_since=out.sent_since, dropped=dropped,
                           download_deadline_s=fetch_timeout_s, link_bps=server.link.snapshot().bps,
                           inputs=_inputs(metas, group),
                           phases=dict(out.phases, matchmaking=started - called, gather=sum(out.phases.values())))


def _inputs(metas: Mapping[str, RoundGather], group: Sequence[str]) -> Dict[str, str]:
    """The round's contributors as membership records list them (``RoundResult.inputs``): peer_id -> a digest of
    its gathered start and weight, the same on every member of the group (no member holds another's whole
    contribution here). What counts a group's contributions when a split round's groups unite
    (daemon/majority.py): without it each member counted the holders of a result it had seen so far, and the
    groups of one round united with different weights (five thetas at outer step 2 of a 32-node run)."""
    return {p: hashlib.sha256(f"{metas[p].start_digest}/{metas[p].weight!r}".encode()).hexdigest()[:16]
            for p in group}
