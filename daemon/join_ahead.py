"""Join ahead: compute the next round while the swarm finishes the current one, merge its update mid-round.

A joiner (or a re-syncing node) whose donor is finishing round r (its group formed, or forming) holds
theta_{r-1}. Waiting for round r + 1 to begin, then fetching update r, took longer than the short training
window of round r + 1 at 32 nodes on 2 cores, so such a node chased the swarm for minutes
(dilocox.consensus.join_point, ``ahead``). Instead it computes round r + 1 from theta_{r-1} at once, and as
soon as a live member serves the update of outer step r (``update/{r}``, dilocox/catchup.py) this component
applies it by the outer rule, bit-identical with what the members applied, before the round's exchange
begins. Local parameters are left alone: the round's pseudo-gradient is measured from where the round
began, as for a kept round (``keep_round``), one outer step stale, as in DiLoCoX's one-step delay
(arXiv 2506.21263, sec. 3.2).

Only synchronous sparse rounds of whole models (catch-up serves their updates; ``NodeConfig``:
``overlap == "none"``, one stage). The update's theta digest must be one a live member's signed record
holds at that outer step, as for any catch-up (daemon/transfer.py, ``vouch``), and a strict majority of the live
replicas must hold it (``majority_theta``): the round may have been split, and a group's own result is not the
round's update until most of the swarm holds it.

The look-up (a read of the records, a fetch of a few MB, its checks) runs on ``executor`` (the node gives it a
thread of its own), so the inner steps go on meanwhile; only the apply, one outer step, runs on the training
thread. Looked up on the training thread, each poll blocked the inner steps for a DHT read: at 32 nodes on 2
cores a round computed ahead took 32-89 s against the swarm's 20 s (docs/protocol.md, "Swarm size", run L).
"""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import Executor, Future
from typing import Callable, Optional

from dilocox.catchup import AppliedUpdate
from dilocox.consensus import ACTIVE_STATES, majority_theta

logger = logging.getLogger(__name__)
POLL_S = 1.0  # between asks for the missed update: each reads the records and may fetch a few MB
SOURCES = 2  # holders asked per attempt (daemon/majority.py, FETCH_SOURCES)


class JoinAhead:
    """Merges the one outer update a node computing ahead is missing (``merge``), or waits for it (``wait``)."""

    def __init__(self, state, progress, fetch: Callable[[list[str], int], Optional[AppliedUpdate]],
                 on_merged: Callable[[], None] = lambda: None, executor: Optional[Executor] = None):
        """``state``: the ReplicaState (daemon/replica_state.py); ``progress``: the membership records
        (daemon/progress.py); ``fetch(peer_ids, outer_step)``: the update one of them applied at that step
        (daemon/transfer.py, ``fetch_update``); ``on_merged()``: publish the new outer step; ``executor``: where
        the look-ups run (None: on the caller's thread, within ``merge``)."""
        self.state, self.progress, self.fetch, self.on_merged = state, progress, fetch, on_merged
        self.executor = executor
        self._lookup: Optional[Future] = None  # the look-up in flight: an AppliedUpdate to apply, or None
        self._next_try = 0.0
        self._forked_at = -1  # an outer step whose update does not continue our theta: no source can help
        self.merged = 0  # updates merged mid-round since start

    def behind(self) -> bool:
        """Do we compute round r holding theta_{r-2} (joined ahead), so the exchange cannot begin yet?"""
        return self.state.outer_step == self.state.round - 2

    def merge(self, now: Optional[float] = None) -> bool:
        """Apply the missed update once a live member serves it (looked up at most every POLL_S, on ``executor``).
        True when not behind (any more); False while the update is not to be had, still being looked up, or
        failed its checks (logged)."""
        if not self.behind():
            return True
        now = time.monotonic() if now is None else now
        st, step = self.state, self.state.outer_step + 1
        if self._lookup is None and now >= self._next_try and step != self._forked_at:
            self._next_try = now + POLL_S
            if self.executor is None:
                self._lookup = Future()
                self._lookup.set_result(self._find(step, st.digest))
            else:
                self._lookup = self.executor.submit(self._find, step, st.digest)
        if self._lookup is None or not self._lookup.done():
            return False
        lookup, self._lookup = self._lookup, None
        if lookup.exception() is not None:  # a fetch that broke: logged, asked again after POLL_S
            logger.warning("looking up the update of outer step %d failed: %r", step, lookup.exception())
        update = lookup.result() if lookup.exception() is None else None
        if update is None or update.outer_step != step or update.parent_digest != st.digest:
            return False  # nothing yet, or our theta moved meanwhile (a re-sync): look again
        with st.changing():
            st.apply_outer(update.aggregate, step, update.group_size, update.outsized)
        if st.digest != update.digest:  # same theta, aggregate and rule give the same bits; if not, re-sync follows
            logger.error("merging the update of outer step %d gave theta %s, its members hold %s", step, st.digest,
                         update.digest)
        self.merged += 1
        logger.info("merged the update of outer step %d mid-round (joined ahead): round %d starts its exchange from "
                    "theta %s", step, st.round, st.digest)
        self.on_merged()
        return True

    def _find(self, step: int, digest: str) -> Optional[AppliedUpdate]:
        """The update of outer step ``step`` that continues theta ``digest`` and leads to the theta a strict majority
        of the live replicas hold there, fetched from SOURCES members that hold it or are past it; None if not to be
        had (yet). Reads the records and the network only: nothing of the replica changes here."""
        records = [m for m in self.progress.others() if m.state in ACTIVE_STATES]
        # the theta a strict majority of the live replicas holds at the step: in a split round a group may apply
        # its own result, then give way to the union (seen at 32 nodes: a joiner merged such a result and re-synced
        # 13 s later), and no other result can be held by a majority
        held = majority_theta(records, step)
        sources = [m.peer_id for m in records if not m.client_mode and
                   (m.outer_step > step or (m.outer_step == step and m.global_params_digest == held))]
        if held is None or not sources:
            return None
        random.shuffle(sources)
        update = self.fetch(sources[:SOURCES], step)
        if update is None:
            return None
        if update.parent_digest != digest or update.digest != held:
            logger.warning("the update of outer step %d served to us continues theta %s and leads to %s; ours is "
                           "%s and most members hold %s: not merged", step, update.parent_digest, update.digest,
                           digest, held)
            if update.parent_digest != digest and update.digest == held:
                # the members' theta_{r-1} is not ours (we took a state from a lineage that forked): stop asking;
                # the round's end re-syncs, keeping the round's progress
                self._forked_at = step
            return None
        return update

    def forked(self) -> bool:
        """Does the update we miss continue another theta than ours (our state came from a lineage that forked)?
        Then no source can help: only a re-sync can."""
        return self.behind() and self._forked_at == self.state.outer_step + 1

    def wait(self, timeout_s: float, cancelled: Callable[[], bool]) -> bool:
        """``merge`` until it succeeds, ``timeout_s`` passes, ``cancelled()`` or we are ``forked()``; True when no
        longer behind. (Waiting on a fork held a joiner at 32 nodes for the whole 300 s outer_round_deadline
        before its re-sync.)"""
        deadline = time.monotonic() + timeout_s
        while not self.merge():
            if self.forked() or time.monotonic() >= deadline or cancelled():
                return False
            time.sleep(0.1)
        return True

    def shutdown(self) -> None:
        """Stop the look-ups (a node leaving): one in flight ends by its fetch's own timeout, unwaited for."""
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
