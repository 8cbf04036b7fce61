"""ProgressTracker: this node's view of the swarm's progress, like hivemind's ``ProgressTracker``.

A heartbeat thread publishes this node's signed membership record (peers/swarm.py) when
``announce_period`` seconds have passed since its last publish of any kind, or at once when poked (a
state change others wait for). The record's
contents come from a callback the node supplies; the tracker adds the last all-reduce result
digest, which it also collects from the other members of a group (docs/protocol.md, verdicts).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from typing import Callable, Dict, List, Optional

from dilocox.peers.records import InputsRecord, MemberRecord, inputs_digest
from dilocox.peers.swarm import Swarm

logger = logging.getLogger(__name__)
DIGEST_POLL_S = (0.25, 1.0)  # waits between reads for the group's result digests: first, and at most
UNSTORED_BEATS = 3  # heartbeats in a row whose record no DHT peer took before the log says the swarm cannot see us


def reader(depth: int = 2) -> str:
    """``module.function`` of the first caller ``depth`` frames up or beyond that is not this module's ``members``
    or ``others`` (which pass reads through), for counting membership reads by caller: the breakdown of a round's
    reads that bench.upload reports. Walks the stack from ``inspect.currentframe()``, only when asked."""
    frame = inspect.currentframe()
    for _ in range(depth):
        frame = frame.f_back if frame is not None else None
    while frame is not None and frame.f_globals.get("__name__") == __name__ and \
            frame.f_code.co_name in ("members", "others"):
        frame = frame.f_back
    if frame is None:
        return "unknown"
    module = frame.f_globals.get("__name__", "?").rsplit(".", 1)[-1]
    return f"{module}.{getattr(frame.f_code, 'co_qualname', frame.f_code.co_name)}"


class ProgressTracker:
    """Membership records of one node. ``describe()`` returns this node's MemberRecord fields
    (without ``result_step`` / ``result_digest``); it and ``on_refresh(swarm_size)`` are called from
    the heartbeat thread."""

    def __init__(self, swarm: Swarm, describe: Callable[[], dict], stage_index: int, num_stages: int,
                 announce_period_s: float, on_refresh: Callable[[int], None] = lambda swarm_size: None,
                 on_beat: Callable[[], None] = lambda: None):
        """``on_beat()``: more work for the heartbeat thread after each refresh (e.g. revocation lists)."""
        self.swarm, self._describe, self._on_refresh, self._on_beat = swarm, describe, on_refresh, on_beat
        self.stage_index, self.num_stages = stage_index, num_stages
        self.announce_period_s = announce_period_s
        # a read of the records costs every member's record (~1 KB each, signed) from every DHT peer asked:
        # waits that last seconds or more re-read at most once a second (pokes make changes visible at once)
        self.poll_s = min(1.0, announce_period_s)
        self._result = (0, "")  # (round, digest) of the last averaged pseudo-gradient we hold
        self._exchanged: tuple[int, float] = (-1, 0.0)  # (round, monotonic time) of our last digest exchange
        self._inputs: Dict[str, str] = {}  # that round's contributions we used: peer_id -> payload digest
        self._union: List[str] = []  # that round's group results we propose to unite (daemon/majority.py)
        self._poke = threading.Event()
        self._published_at = -float("inf")  # monotonic time of our last publish (heartbeat or direct)
        self._unstored = 0  # heartbeats in a row whose record no DHT peer (nor our own storage) took
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ignored: Callable[[str], Optional[str]] = lambda peer_id: None

    def ignore(self, excluded: Callable[[str], Optional[str]]) -> None:
        """Leave out of ``others`` every member for which ``excluded(peer_id)`` gives a reason (a peer its group
        excluded: daemon/exclusions.py), so that no decision made from the records counts it."""
        self._ignored = excluded

    @property
    def peer_id(self) -> str:
        return self.swarm.peer_id

    def start(self) -> None:
        self._thread = threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the heartbeat and publish a last record in state STOPPED, so peers stop counting us
        before it expires. It keeps our last result digest: a group-mate may still be collecting it
        (withdrawing the record at once split a swarm whose last round one member skipped for want
        of the leaver's digest)."""
        self._stop.set()
        self._poke.set()
        if self._thread is not None:
            self._thread.join(timeout=self.announce_period_s + 5)
        try:
            self.swarm.publish(MemberRecord(**{**self._describe(), "state": "STOPPED"}, **self._result_fields()))
        except Exception as e:  # leaving must not fail because the DHT is already gone
            logger.warning("could not publish our last membership record: %s", e)

    def poke(self) -> None:
        """Publish now (e.g. joiners wait for our new outer_step)."""
        self._poke.set()

    def publish(self) -> bool:
        """Publish our record now; True if a DHT peer (or our own storage) holds it (``Swarm.publish``)."""
        self._published_at = time.monotonic()
        return self.swarm.publish(MemberRecord(**self._describe(), **self._result_fields()))

    def _note_stored(self, stored: bool) -> None:
        """Warn once when UNSTORED_BEATS heartbeats in a row found no DHT peer to hold our record, and say when one
        holds it again. Until then the swarm cannot see us: DHT peers of another dilocox version refuse a record
        of another schema (hivemind's ``SchemaValidator``), or none is reachable."""
        if stored:
            if self._unstored >= UNSTORED_BEATS:
                logger.info("our membership record is stored again after %d refused or missed heartbeats",
                            self._unstored)
            self._unstored = 0
            return
        self._unstored += 1
        if self._unstored == UNSTORED_BEATS:
            logger.warning("no DHT peer took our membership record at the last %d heartbeats: the swarm cannot see "
                           "this node (DHT peers that run another dilocox version refuse records of another schema; "
                           "or none is reachable)", UNSTORED_BEATS)

    def _result_fields(self) -> dict:
        step, digest = self._result
        return dict(result_step=step, result_digest=digest, inputs_digest=inputs_digest(self._inputs),
                    num_inputs=len(self._inputs), union=self._union)

    def _heartbeat(self) -> None:
        beats = 0
        while not self._stop.is_set():
            try:
                self._note_stored(self.publish())
                # a read costs every member's record from every DHT peer asked (more than our store): the
                # swarm size in status is refreshed every 6th beat, rounds read when they need to
                if beats % 6 == 0:
                    self._on_refresh(len(self.swarm.members(max_age_s=3 * self.announce_period_s,
                                                             caller="progress.heartbeat")))
                beats += 1
                self._on_beat()
            except Exception as e:
                logger.warning("membership refresh failed: %s", e)
            self._wait_for_beat()

    def _wait_for_beat(self) -> None:
        """Until a poke, a stop, or ``announce_period_s`` after our last publish. A direct publish (a round's
        result digest, a union proposal) refreshes the record too: beating on a fixed clock after it was a
        store on MEMBER_REPLICAS DHT peers (about 9 KB sent) with nothing new, one or two per round."""
        while not self._stop.is_set():
            left = self._published_at + self.announce_period_s - time.monotonic()
            if self._poke.wait(max(0.0, left)):
                self._poke.clear()
                return
            if time.monotonic() - self._published_at >= self.announce_period_s:
                return

    def members(self, max_age_s: float = 1.0, since: Optional[float] = None) -> List[MemberRecord]:
        """Every live member of the run (ours included), from a DHT read at most ``max_age_s`` old or made at or
        after ``since`` (``time.monotonic()``; ``Swarm.members``). A read it makes is counted under the function
        that asked (``Swarm.traffic``'s ``reads_by``; ``reader``)."""
        return [m for m, _ in self.swarm.members(max_age_s, caller=reader(), since=since)]

    def others(self, max_age_s: float = 1.0, since: Optional[float] = None) -> List[MemberRecord]:
        """Other live members holding our stage (of other replicas): the ones we average with (``members``), less
        those excluded (``ignore``)."""
        return [m for m in self.members(max_age_s, since) if m.peer_id != self.peer_id
                and m.stage_index == self.stage_index and m.num_stages == self.num_stages
                and self._ignored(m.peer_id) is None]

    def exchanged_at(self, result_step: int) -> Optional[float]:
        """``time.monotonic()`` when the result-digest exchange of round ``result_step`` began reading (after our
        publish), None if our last exchange was of another round. The decisions that follow an exchange (the
        inputs check, the verdict's look at the unreported, the majority's first poll) pass it as ``since`` and
        share the exchange's last read: each asked for one at most 0.2-0.5 s old, and with 32 nodes on 2 cores the
        steps between them took longer, so each made a read of its own (``reads_by`` at 32 nodes: 1.8 a
        node-round for the three)."""
        step, at = self._exchanged
        return at if step == result_step else None

    def admitted(self, peer_id: str) -> Optional[str]:
        """None if ``peer_id`` has a counted membership record (certified, unrevoked, signed by its own key:
        peers/swarm.py), else why it may not take part."""
        if any(m.peer_id == peer_id for m in self.members()):
            return None
        return "no certified membership record"

    def exchange_result_digests(self, result_step: int, digest: str, peers: set[str],
                                timeout_s: float, inputs: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """Publish our result digest of round ``result_step`` (and, for a sparse round, the digests of the
        contributions we used) and collect the group's (``peers``), waiting at most ``timeout_s`` and not for
        members whose records have expired (``skip_expired``); peer_id -> digest for those that reported (ours
        included)."""
        self._result, self._inputs, self._union = (result_step, digest), dict(inputs or {}), []
        self.publish()
        # the group's members end the round within a fraction of a second of each other: a read at once after our
        # publish found some of their digests and not all in nearly every round, and the next read found the rest
        pause = max(0.0, min(DIGEST_POLL_S[0], timeout_s))
        time.sleep(pause)
        self._exchanged = (result_step, time.monotonic())
        return self.collect_result_digests(result_step, peers, max(0.0, timeout_s - pause), skip_expired=True)

    def collect_result_digests(self, result_step: int, peers: set[str], timeout_s: float,
                               skip_expired: bool = False) -> Dict[str, str]:
        """Read the result digests of round ``result_step`` that ``peers`` reported, ours included (published by
        ``exchange_result_digests``), waiting at most ``timeout_s`` for the missing ones; publishes nothing.
        ``skip_expired``: stop waiting once every missing one has no live record (it expired: no heartbeat for
        ``3 x announce_period``, the node crashed; a node that leaves keeps its STOPPED record with its digest)."""
        found = {self.peer_id: self._result[1]} if self._result[0] == result_step else {}
        deadline = time.monotonic() + timeout_s
        pause = DIGEST_POLL_S[0]
        while True:
            live = set()
            for m in self.others(max_age_s=0.2):  # the whole group waits for the slowest digest: read afresh
                live.add(m.peer_id)
                if m.peer_id in peers and m.result_step == result_step:
                    found[m.peer_id] = m.result_digest
            missing = peers - set(found)
            if not missing or time.monotonic() >= deadline or (skip_expired and not missing & live):
                return found
            # short waits first (the group waits for the slowest digest), then longer: each read costs every
            # member's record from each DHT peer asked, and this was a third of a node's reads per round
            time.sleep(pause)
            pause = min(2 * pause, DIGEST_POLL_S[1])

    def propose_union(self, result_step: int, digests: List[str]) -> None:
        """Publish the group results of round ``result_step`` (our last result's round) whose union we propose
        to apply (daemon/majority.py)."""
        if self._result[0] == result_step:
            self._union = sorted(digests)
            self.publish()

    def input_conflicts(self, result_step: int, inputs: Dict[str, str], timeout_s: float) -> Dict[str, str]:
        """Contributors of round ``result_step`` that another member used with other bytes than we did
        (``inputs``: peer_id -> payload digest): peer_id -> the member whose inputs show it. Only the
        contributor can have caused that, by serving different bytes to different peers.

        Records carry only a digest of the inputs (``inputs_digest``). Where a member's differs from ours and so
        does its result, both publish the map itself (``Swarm.publish_inputs``: each sees the other's digests
        differ) and this waits up to ``timeout_s`` for theirs; nothing is published or read when all agree. A
        member with our result but another inputs digest is not asked: the same result came from the same
        contributions, and a lie there must not make every round wait."""
        ours = inputs_digest(inputs)
        our_result = self._result[1] if self._result[0] == result_step else None
        differing = {m.peer_id for m in self.others(max_age_s=0.2, since=self.exchanged_at(result_step))
                     if m.result_step == result_step
                     and m.inputs_digest and m.inputs_digest != ours and m.result_digest != our_result}
        if not differing or not inputs:
            return {}
        self.swarm.publish_inputs(InputsRecord(peer_id=self.peer_id, result_step=result_step, inputs=inputs))
        deadline = time.monotonic() + timeout_s
        while True:
            found = {p: d for p, d in self.swarm.inputs_of(result_step).items() if p in differing}
            if set(found) >= differing or time.monotonic() >= deadline:
                break
            time.sleep(self.poll_s)
        conflicts: Dict[str, str] = {}
        for member, theirs in sorted(found.items()):
            for peer, d in theirs.items():
                if peer in inputs and inputs[peer] != d and peer != member:
                    conflicts.setdefault(peer, member)
        return conflicts

    def wait(self, predicate: Callable[[List[MemberRecord]], bool], timeout_s: float,
             cancelled: Callable[[], bool]) -> bool:
        """Poll ``predicate(others())`` until it holds (True), ``timeout_s`` passes or ``cancelled()``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not cancelled():
            if predicate(self.others()):
                return True
            time.sleep(self.poll_s)
        return False
