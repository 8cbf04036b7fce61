"""Fetching the swarm's state: a joiner's first download, and a re-sync after a failed round.

A donor serves theta, outer momentum and the shared compression state through hivemind's
``load_state_from_peers`` (peers/averaging.py); everything that arrives is checked here before
it replaces ours (it comes from another machine). The joiner picks the round and inner step to
join at from the donor's metadata and its live membership record.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Optional

import pydantic.v1 as pydantic

from daemon.status import ACTIVE_STATES, State
from dilocox.compression import Compressor
from dilocox.diloco import check_shapes, params_digest
from dilocox.stages import tensor_bytes

if TYPE_CHECKING:
    from daemon.node import Node

logger = logging.getLogger("dilocox.node")


class SyncError(RuntimeError):
    """No peer served a usable state before the deadline."""


class StateMeta(pydantic.BaseModel):
    """Metadata a donor sends with its state (validated: it comes from another machine)."""

    run_id: pydantic.StrictStr
    outer_step: pydantic.conint(ge=0)
    digest: pydantic.StrictStr
    num_params: pydantic.conint(ge=1)
    donor_state: pydantic.StrictStr
    donor_inner_step: pydantic.conint(ge=0)
    donor_round: pydantic.conint(ge=0)
    compression_rank: pydantic.conint(ge=0) = 0
    compression_digest: pydantic.StrictStr = ""
    donor_peer_id: pydantic.StrictStr = ""


def sync(node: "Node", initial: bool, keep_round: bool = False) -> int:
    """Download theta, outer momentum and outer_step from a peer; returns inner steps to skip.

    A joiner must never average its random init into the swarm (issue 2): it trains only from
    a downloaded state, except when no replica is training anywhere (then everyone starts from
    the shared seed, which is the same state).
    """
    node._set_state(State.SYNCING)
    transfer_s = state_transfer_s(node)
    deadline = time.monotonic() + node.cfg.outer_round_deadline + transfer_s
    first_seen, waited_for_result = time.monotonic(), False
    while not node.leave_requested.is_set():
        if time.monotonic() > deadline:
            raise SyncError(f"no peer served a usable state within "
                            f"{node.cfg.outer_round_deadline + transfer_s:.0f}s")
        active = [m for m in node._others() if m.state in ACTIVE_STATES]
        if not active:
            patience = 0 if node.cfg.min_replicas > 1 else 2 * node.cfg.announce_period + 2
            if initial and time.monotonic() - first_seen >= patience:
                logger.info("no replica is training yet: starting from seed %d", node.cfg.seed)
                return 0
            if not initial and time.monotonic() - first_seen >= 2 * node.cfg.announce_period + 2:
                _continue_alone(node, keep_round)
                return 0
            time.sleep(0.3)
            continue
        same = [m for m in active if m.outer_step == node.outer_step and m.global_params_digest == node.digest]
        if initial and same:
            # e.g. a fresh swarm started from the same seed, or a restart whose checkpoint is current
            skip = min(max(m.inner_step for m in same), node.H - 1)
            node.round = max(m.round for m in same)
            logger.info("the swarm holds our parameters (outer step %d, digest %s): no download; "
                        "joining the current round at inner step %d", node.outer_step, node.digest, skip)
            return skip
        if initial and node.resumed_from and not same:
            ahead = max(m.outer_step for m in active)
            if ahead > node.outer_step:
                logger.warning("our checkpoint holds outer step %d, the swarm is at %d: catching up from peers",
                               node.outer_step, ahead)
                node.resumed_from = 0  # say it once
        # hivemind fails a donor that stalls for next_chunk_timeout and tries the next one; this
        # bound only guards against a hang, so it allows the whole state at the slowest link
        got = node.averager.download_state(timeout_s=node.cfg.averaging_timeout + transfer_s)
        if got is None:
            time.sleep(0.5)
            continue
        try:
            meta = StateMeta.parse_obj(got[0])
            n = len(node.outer.global_params)
            if meta.run_id != node.cfg.run_id or meta.num_params != n:
                raise ValueError(f"state for run {meta.run_id!r} with {meta.num_params} parameter tensors "
                                 f"does not fit ours ({node.cfg.run_id!r}, {n})")
            if len(got[1]) < 2 * n:  # hivemind returns what arrived when a donor's stream ends early
                raise ValueError(f"truncated state: {len(got[1])} of at least {2 * n} tensors arrived "
                                 f"(the donor stopped mid-transfer?)")
            check_shapes(node.outer.global_params, got[1][:n], "downloaded parameters")
            check_shapes(node.outer.global_params, got[1][n:2 * n], "downloaded momentum")
            if params_digest(got[1][:n]) != meta.digest:
                raise ValueError("downloaded parameters do not match the donor's digest")
            shared = Compressor(node.compressor.shapes, node.compressor.cfg)
            shared.load_shared(meta.compression_rank, got[1][2 * n:])
            if shared.digest() != meta.compression_digest:
                raise ValueError("downloaded compression state does not match the donor's digest")
        except (pydantic.ValidationError, ValueError) as e:
            logger.warning("rejected a downloaded state: %s", e)
            time.sleep(0.5)
            continue
        if not keep_round and (meta.donor_state == State.AVERAGING.value or meta.donor_inner_step >= node.H):
            logger.info("donor is finishing round %d; waiting for the next round", meta.donor_round)
            # the next round has begun once a member trains in it (its outer_step may advance before:
            # rounds.finish_early applies a result mid-round)
            _wait(node, lambda: any(m.round > meta.donor_round and m.state == State.TRAINING.value
                                   for m in node._others()), 3 * node.cfg.outer_round_deadline)
            continue
        if not keep_round and node.cfg.overlap == "delayed" and node.num_stages == 1 \
                and meta.outer_step < meta.donor_round - 1 and not waited_for_result:
            # The donor applies round donor_round-1 as soon as its all-reduce is in (rounds.finish_early).
            # Joining round donor_round needs those parameters: on a slow link, waiting for them beats
            # fetching them again at the round's end (too late for matchmaking). Once only: with short
            # rounds the all-reduce ends with the round, and a fast link catches up at the round's end.
            waited_for_result = True
            logger.info("donor still averages round %d; waiting for its result", meta.outer_step + 1)
            _wait(node, lambda: any(m.outer_step > meta.outer_step for m in node._others()), node.cfg.outer_round_deadline)
            continue
        if keep_round and meta.outer_step < node.round - 1:
            logger.info("donor holds outer step %d, round %d needs %d; waiting", meta.outer_step,
                        node.round, node.round - 1)
            _wait(node, lambda: any(m.outer_step > meta.outer_step for m in node._others()), node.cfg.outer_round_deadline)
            continue
        keep_round = keep_round and meta.outer_step == node.round - 1
        skip = 0 if keep_round else _donor_progress(node, meta)
        if skip is None:
            logger.info("the donor finished round %d during the download; fetching a newer state", meta.donor_round)
            continue
        node.outer.load_state(got[1][:n], got[1][n:2 * n])
        node.compressor.load_shared(meta.compression_rank, got[1][2 * n:])
        if keep_round:  # x <- theta + this round's local progress; its pseudo-gradient is still ours to send
            node.schedule.rebase(node.inner.params)
        else:
            node.inner.load_params(node.outer.global_params)
            node.schedule.begin_round(node.inner.params)
            node.round = max(meta.donor_round, meta.outer_step + 1)
        node.outer_step, node.digest = meta.outer_step, meta.digest
        if node.pending is not None:
            node.pending.cancel.set()
        node.pending = None  # its result is part of (or superseded by) the downloaded state
        node._serve_snapshot()
        resyncs = node.board.snapshot().resyncs + (0 if initial else 1)
        node.board.update(outer_step=node.outer_step, global_params_digest=node.digest, resyncs=resyncs)
        logger.info("synced state of outer step %d (digest %s); round %d, skipping %d inner steps",
                    node.outer_step, node.digest, node.round, skip)
        return skip
    return 0

def _continue_alone(node: "Node", keep_round: bool) -> None:
    """No other live member holds our stage (e.g. the only other copy died): ours are the newest
    parameters there are. A round that needs outer step round-1 takes ours as that step (a
    stage that joined a replica ahead of it, after that replica's stage-0 node died)."""
    what = f"stage {node.stage_index}/{node.num_stages}" if node.num_stages > 1 else "the model"
    if keep_round and node.outer_step < node.round - 1:
        logger.warning("no other replica holds %s: continuing from our parameters of outer step %d as step %d",
                       what, node.outer_step, node.round - 1)
        node.outer_step = node.round - 1
        node._serve_snapshot()
        node.board.update(outer_step=node.outer_step)
    else:
        logger.warning("no other replica holds %s: continuing from our parameters", what)

def _donor_progress(node: "Node", meta: StateMeta) -> Optional[int]:
    """Inner steps to skip to join the donor's round where the donor is now, not where it was
    when the transfer began (a slow link can take several inner steps); None if the donor has
    left that round meanwhile (the state would be stale)."""
    live = next((m for m in node._others() if m.peer_id == meta.donor_peer_id), None)
    if live is None or live.round < meta.donor_round:
        return meta.donor_inner_step
    if live.round > meta.donor_round:
        return None
    return min(max(meta.donor_inner_step, live.inner_step), node.H - 1)

def state_transfer_s(node: "Node") -> float:
    """Seconds to move our state (theta, momentum, shared compression state) at the slowest link
    this project supports (100 Mbit/s), or at ``bandwidth_mbps`` when that is lower."""
    rate = min(100e6, node.cfg.bandwidth_mbps * 1e6) if node.cfg.bandwidth_mbps else 100e6
    return 8 * 2 * tensor_bytes(node.outer.global_params) / rate

def _wait(node: "Node", predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not node.leave_requested.is_set():
        if predicate():
            return True
        time.sleep(0.2)
    return False
