"""The swarm's consistency rules as pure functions: no network, no clock, no threads.

Every member of an averaging group sees the same all-gathered data, so these rules give every
member the same verdict. The daemon (daemon/rounds.py, daemon/transfer.py) feeds them what it
read from the DHT and from hivemind and acts on the value they return; docs/protocol.md states
the rules in prose. ``PeerProgress`` is whatever carries a member's published progress
(peers.records.MemberRecord in the daemon, a small dataclass in the unit tests).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import Dict, List, Optional, Protocol, Sequence, Set, Tuple

TRAINING, AVERAGING, SYNCING, JOINING = "TRAINING", "AVERAGING", "SYNCING", "JOINING"
ACTIVE_STATES = (TRAINING, AVERAGING)  # replicas that will average the round they are in


class PeerProgress(Protocol):
    """A member's published progress (the fields of peers.records.MemberRecord these rules read)."""

    peer_id: str
    state: str
    outer_step: int   # outer updates applied (version of theta)
    round: int        # round being computed
    inner_step: int
    global_params_digest: str
    num_stages: int
    result_step: int  # round of the last all-reduce result it reported


class Verdict(str, Enum):
    """What a member does with its all-reduce result."""

    APPLY = "apply"    # a strict majority of the group holds our result
    RESYNC = "resync"  # a strict majority holds another result: ours is partial or wrong
    SKIP = "skip"      # no result has a strict majority: nobody applies the round


def canonical_digest(digests: Dict[str, str]) -> Tuple[Optional[str], List[str]]:
    """The digest most members hold (ties: the one held by the smallest peer_id) and its holders.

    ``digests``: peer_id -> digest. Returns (None, []) for no digests."""
    if not digests:
        return None, []
    counts = Counter(digests.values())
    top = max(counts.values())
    candidates = {d for d, c in counts.items() if c == top}
    winner = digests[min(p for p, d in digests.items() if d in candidates)]
    return winner, sorted(p for p, d in digests.items() if d == winner)


def judge_result(mine: str, results: Dict[str, str], members: Optional[int] = None) -> Verdict:
    """The verdict on our all-reduce result, given the members' result digests (ours included).

    ``members``: the group's size (default ``len(results)``); a member that reported no digest
    counts against every digest. APPLY if ours is held by a strict majority of the members, RESYNC
    if another digest is, SKIP if none is: e.g. two members with a partial average each, or two
    members of which one failed and never reported (the other's result is then partial: hivemind's
    "received 50% of input tensors"). A partial average is never adopted by a tie-break or default.
    """
    canon, holders = canonical_digest(results)
    if 2 * len(holders) <= max(len(results), members or 0):
        return Verdict.SKIP
    return Verdict.APPLY if canon == mine else Verdict.RESYNC


class Standing(str, Enum):
    """Where our group's result stands among the groups hivemind's matchmaking formed for one round."""

    MAJORITY = "majority"  # our group holds a strict majority of the round's replicas: its update is the round's
    ADOPT = "adopt"        # another group's result is held by a strict majority: every other group adopts it
    WAIT = "wait"          # no majority yet, but one may still appear among the results not yet reported
    UNION = "union"        # no group can hold a majority and every group reported: all apply the union of results
    ALONE = "alone"        # no group can hold a majority, nor be united with: each applies its own


def union_groups(outside: Dict[str, str], sizes: Dict[str, int]) -> Dict[str, int]:
    """The other groups' results a UNION round combines: result digest -> weight.

    ``outside``: peer_id -> result digest, as for ``group_standing``; ``sizes``: peer_id -> how many
    contributions that member's group used (the ``inputs`` of its record; every member of a group
    publishes the same set). A digest counts only if a strict majority of its group holds it
    (2 x holders > the largest size its holders report), the condition under which that group's
    members APPLY it (``judge_result``); a member's partial result, which its group re-syncs from, is
    left out. Its weight is that size (its holder count where no holder lists inputs): every member
    reads the same number from any one holder's signed record, and a minority cannot inflate it past
    twice its holders. Sorted by digest, so every group combines in one order."""
    counts = Counter(outside.values())
    largest: Dict[str, int] = {}
    for peer, digest in outside.items():
        largest[digest] = max(largest.get(digest, 0), sizes.get(peer, 0))
    return {d: largest[d] or held for d, held in sorted(counts.items()) if 2 * held > largest[d]}


def group_standing(ours: int, replicas: int, outside: Dict[str, str], pending: int,
                   sizes: Optional[Dict[str, int]] = None) -> Tuple[Standing, Optional[str]]:
    """The rule that gives a split round one update (docs/protocol.md, "One update per round").

    ``ours``: members of our group holding our result; ``replicas``: replicas that take part in the round
    (ours included, from the membership records); ``outside``: peer_id -> result digest of this round,
    published by members outside our group; ``pending``: outside members of the round that have not
    published one yet; ``sizes``: peer_id -> contributions its group used (``union_groups``). A result
    that a strict majority of its own group holds counts with its group's size, so a record read late
    does not shrink a group. At most one result can be held by a strict majority, so every member of
    every group that sees it picks the same one. Without a possible majority, every group waits for
    the pending reports (WAIT), then unites with the groups that reported (UNION; ``union_groups``
    says which); ALONE when nobody outside reported. Returns (standing, the majority's result digest
    for ADOPT)."""
    counts = Counter(outside.values())
    valid = union_groups(outside, sizes or {})
    held = {d: max(c, valid.get(d, 0)) for d, c in counts.items()}
    replicas = max(replicas, ours + sum(held.values()) + pending)
    if 2 * ours > replicas:
        return Standing.MAJORITY, None
    for digest, n in sorted(held.items()):
        if 2 * n > replicas:
            return Standing.ADOPT, digest
    if pending:  # a majority may still appear, or the union needs the missing groups' results
        return Standing.WAIT, None
    return (Standing.UNION if outside else Standing.ALONE), None


def applied_majority(others: Sequence[PeerProgress], r: int, group: int) -> Optional[str]:
    """The theta digest that a strict majority of the live replicas already holds at outer step ``r``, or
    None. ``others``: the other members' records (outside our group of ``group`` members, which has not
    applied r yet); live replicas: ours plus every other active one. A member whose group settled late
    (its records read in a changed swarm) joins what most of the swarm applied instead of weighing
    results again."""
    return majority_theta(others, r, ours=group)


def majority_theta(others: Sequence[PeerProgress], step: int, ours: int = 0, our_digest: str = "") -> Optional[str]:
    """The theta digest at outer step ``step`` that a strict majority of the live replicas holds, or None.

    ``others``: the other members' records (only active ones count: TRAINING or AVERAGING); ``ours``: live
    replicas on our side that hold ``our_digest`` at ``step`` ("": they hold nothing there yet). At most one
    digest can pass, so every member that reads the same records names the same one, and a member that reads
    one record less or more can only fail to name it: a wrong read costs a round, never a fork."""
    live = ours + sum(m.state in ACTIVE_STATES for m in others)
    counts = Counter(m.global_params_digest for m in others if m.state in ACTIVE_STATES and m.outer_step == step)
    if our_digest:
        counts[our_digest] += ours
    for digest, n in sorted(counts.items()):
        if 2 * n > live:
            return digest
    return None


def prevailing_theta(others: Sequence[PeerProgress], step: int, ours: int = 0, our_digest: str = "") -> Optional[str]:
    """The theta the swarm converges on at outer step ``step``: ``majority_theta``, or, where no theta holds a
    strict majority and every live replica is at ``step`` (none behind that could still apply another theta,
    none ahead that has moved on, so the lineages' sizes are final), the one most of them hold, ties to the
    smallest digest: two equal halves of a split would otherwise each go on alone. Same arguments as
    ``majority_theta``; None where neither applies or one theta only is held. Every member that reads the same
    records names the same digest; a member that misses a record may name another while the sizes are equal,
    which costs a re-sync (the sizes are then unequal, and the rule holds again), not a fork."""
    digest = majority_theta(others, step, ours, our_digest)
    if digest is not None:
        return digest
    active = [m for m in others if m.state in ACTIVE_STATES]
    if any(m.outer_step != step for m in active):
        return None
    counts = Counter(m.global_params_digest for m in active)
    if our_digest:
        counts[our_digest] += ours
    if len(counts) < 2:
        return None
    return min(counts, key=lambda d: (-counts[d], d))


class Lineage(str, Enum):
    """Where our theta stands among the lineages a split round left (``lineage_standing``)."""

    STAY = "stay"  # no other theta holds, or can still reach, a strict majority of the live replicas
    JOIN = "join"  # a strict majority (or, every replica at our step, a plurality) holds another theta: re-sync
    WAIT = "wait"  # another theta, held by as many as ours, may still reach a majority with the replicas behind


def lineage_standing(others: Sequence[PeerProgress], step: int, our_digest: str,
                     alone: bool = False) -> Tuple[Lineage, Optional[str]]:
    """Our theta (``our_digest`` at outer step ``step``) against the other replicas' (``others``: their records;
    active ones count), ourselves included. A split round whose groups applied different updates leaves two
    lineages of theta; the next round's start digests reconcile only members that meet in one group, and a
    group's majority can be the swarm's minority (seen at 32 nodes: lineages of 21 and 3 members, then 10 and 5,
    went on side by side). JOIN (with that digest) when a strict majority holds another theta at ``step``. WAIT
    while another theta is held at ``step`` by at least as many as ours and could still reach a majority with the
    replicas not yet at ``step``: a small lineage settles its rounds sooner (a group of 2 is quick), so it would
    otherwise always look before the majority has applied (seen at 32 nodes: two members went on alone for three
    rounds, and the majority, finding the round applied, re-synced into their lineage). Where no lineage holds a
    majority and every live replica is at ``step`` (two equal halves, or three lineages), JOIN the one
    ``prevailing_theta`` names: the most holders, ties to the smallest digest. STAY otherwise. At most one theta
    can hold a strict majority, so the majority's members never JOIN, and a read that misses a record can only
    delay a JOIN to it; among equal lineages such a read costs a re-sync, never a fork.

    ``alone``: we applied outer step ``step`` alone (our all-reduce failed while nobody had applied the round:
    ``failure_action``). Then WAIT also while a strict majority of the live replicas is still behind ``step``:
    they are still in that round and will apply their own update, and a lone applier that went on would stay a
    round ahead of them for good, its matchmaking for each next round running out before they reach it, so that
    it applied every round alone (seen at 32 hosts in network namespaces, `make bench-upload`: one node applied
    rounds 2-5 alone while the other 31 united each). Once they hold another theta there, it JOINs theirs."""
    active = [m for m in others if m.state in ACTIVE_STATES]
    # the plurality case needs nobody behind, so it never meets the wait below: one call decides both JOINs
    digest = prevailing_theta(active, step, ours=1, our_digest=our_digest)
    if digest is not None:
        return (Lineage.STAY, None) if digest == our_digest else (Lineage.JOIN, digest)
    held = Counter(m.global_params_digest for m in active if m.outer_step == step)
    ours = 1 + held.pop(our_digest, 0)
    behind = sum(m.outer_step < step for m in active)
    if held and max(held.values()) >= ours and 2 * (max(held.values()) + behind) > 1 + len(active):
        return Lineage.WAIT, None
    if alone and 2 * behind > 1 + len(active):
        return Lineage.WAIT, None
    return Lineage.STAY, None


def chosen_union(proposals: Dict[str, Tuple[str, ...]]) -> Tuple[str, ...]:
    """The union of group results a split round applies, given each member's proposal (peer_id -> the
    sorted result digests it would unite; daemon/majority.py): the proposal most members made; on a tie
    the one with more groups, then the smallest. Every member that reads the same proposals picks the
    same; a group that decided before a late group reported gives way to the members that saw it."""
    if not proposals:
        return ()
    counts = Counter(proposals.values())
    return min(counts, key=lambda u: (-counts[u], -len(u), u))


def settings_conflict(ours: str, others: Dict[str, str]) -> Optional[Tuple[str, List[str]]]:
    """The settings digest (NodeConfig.swarm_settings) that a strict majority of the other live members of
    our stage publish, with its holders, when it is not ours; None when ours is theirs, or they disagree
    among themselves, or nobody published one. ``others``: peer_id -> digest ("" from a node that does
    not publish one: not counted). A joiner in conflict refuses to join (daemon/node.py): its outer steps
    would leave theta different from theirs after every round (start digests then force a re-sync)."""
    known = {p: d for p, d in others.items() if d}
    if not known:
        return None
    canon, holders = canonical_digest(known)
    if canon == ours or 2 * len(holders) <= len(known):
        return None
    return canon, holders


def in_round(others: Sequence[PeerProgress], r: int, delayed: bool) -> List[PeerProgress]:
    """Other replicas that take part in the all-reduce of round r, or are about to: a replica whose
    record still shows round r - 1 (finishing its all-reduce, or a record a moment old) starts round r
    next, so nobody goes solo or gives up on it. With delayed overlap a replica whose round r all-reduce
    is in flight already computes round r + 1."""
    window = (r - 1, r, r + 1) if delayed else (r - 1, r)
    return [m for m in others if m.state in ACTIVE_STATES and m.round in window]


def left_behind(others: Sequence[PeerProgress], r: int, delayed: bool) -> bool:
    """Round r no longer waits for us: no other replica takes part in it (``in_round``), or a strict majority
    of the live replicas, ours counted, already applied it (``applied_majority``). A late member then stops
    matchmaking and downloading and follows the update most of the swarm applied (daemon/majority.py,
    ``MajorityUpdate.follow``) instead of waiting for the round's slowest member to settle: in a 32-node run
    a member late to its round's only group waited 95 s for one straggler."""
    return not in_round(others, r, delayed) or applied_majority(others, r, 1) is not None


def someone_applied(others: Sequence[PeerProgress], r: int) -> bool:
    """Has a live replica already applied round r (its outer_step reached r)?"""
    return any(m.state in ACTIVE_STATES and m.outer_step >= r for m in others)


class StartAction(str, Enum):
    """How a round's pseudo-gradient leaves the node."""

    ALLREDUCE = "allreduce"        # average with the replicas that can take part
    SOLO = "solo"                  # nobody else could take part: apply our own pseudo-gradient
    ALREADY_DONE = "already_done"  # others applied this round without us: re-sync instead


def round_start_action(others: Sequence[PeerProgress], r: int, delayed: bool) -> StartAction:
    """Decide how to average round r. Solo only when nobody else could take part: no replica in this
    round and no whole-model replica syncing or joining (it may start this round). A syncing stage
    node waits for its replica's other stages, so it is not counted on. Deciding from possibly
    stale records is safe this way round: a wrong guess costs a failed matchmaking, not a split.

    ALREADY_DONE when a replica applied round r, unless fewer than half of the round's replicas (ours, those
    that applied it and those still in it) applied it: then we average with the others still in it, and the
    few that applied (e.g. one whose all-reduce failed and that applied its own) re-sync from our lineage
    before their next all-reduce (``lineage_standing``). Re-syncing to them instead copied one member's lone
    update into the swarm: at 32 nodes a member that applied round 1 alone sent 3 late members, then its
    lineage's joiners, to θ that the other 29 did not hold."""
    pending = [m for m in in_round(others, r, delayed) if m.outer_step < r]
    applied = sum(m.state in ACTIVE_STATES and m.outer_step >= r for m in others)
    if applied and not (pending and 2 * applied < 1 + applied + len(pending)):
        return StartAction.ALREADY_DONE
    expected = pending + [m for m in others if m.num_stages == 1 and m.state in (SYNCING, JOINING)]
    return StartAction.ALLREDUCE if expected else StartAction.SOLO


def undecided(others: Sequence[PeerProgress], missing: Set[str], r: int) -> List[str]:
    """Group members of round r whose result report is ``missing`` and who may still report it and APPLY:
    live, in a training state, theta not past r - 1 and no report of round r or later. Skipping while one
    of them may still apply would make the verdict one-sided: in a group of 2 the member that saw both
    reports applies and the one that missed its peer's skips, and their theta forks (seen in CI on loaded
    pipeline-stage nodes, whose report came 27 s after the all-reduce). A member that re-syncs, leaves or
    whose record expired is decided: it applies nothing of this round."""
    return sorted(m.peer_id for m in others if m.peer_id in missing and m.state in ACTIVE_STATES
                  and m.outer_step < r and m.result_step < r)


def failure_action(others: Sequence[PeerProgress], r: int) -> Verdict:
    """Round r's all-reduce failed (no group, or a peer dropped out). If another replica applied the
    round, ours would diverge: RESYNC. Otherwise APPLY our own pseudo-gradient (the round is applied
    alone, and the next joint round's start digests reconcile the replicas)."""
    return Verdict.RESYNC if someone_applied(others, r) else Verdict.APPLY


# ----------------------------------------------------------------------------- joining

class JoinKind(str, Enum):
    """Where a node's parameters come from when it (re-)enters the swarm."""

    DOWNLOAD = "download"  # adopt the downloaded state at JoinPoint.round / skip
    SEED = "seed"          # no replica trains yet: everyone starts from the shared seed
    CURRENT = "current"    # the swarm holds our parameters already: no download
    ALONE = "alone"        # no other live member holds our stage: ours are the newest there are
    WAIT = "wait"          # the donor's state is not usable yet: wait (``wait_for``) and fetch again
    REFETCH = "refetch"    # the donor moved on during the download: fetch a newer state at once


class WaitFor(str, Enum):
    NEXT_ROUND = "next_round"    # a member trains in a round after the donor's
    OUTER_STEP = "outer_step"    # a member's outer_step passes the donor's


@dataclass(frozen=True)
class JoinPoint:
    """The outcome of the join-point rule. ``round``: the round to compute next; ``skip``: inner
    steps of it already done by the swarm; ``keep_round``: the local progress of the current round
    is kept (re-based onto the new theta) and its pseudo-gradient is still ours to send;
    ``outer_step``: the outer step the node holds afterwards (ALONE may adopt round - 1);
    ``wait_for``/``after_step``: for WAIT, the condition on other members' records; ``late``: WAIT
    because the round's group already forms (``late_steps``)."""

    kind: JoinKind
    round: int = 0
    skip: int = 0
    keep_round: bool = False
    outer_step: int = 0
    wait_for: Optional[WaitFor] = None
    after_step: int = 0
    reason: str = ""
    late: bool = False


@dataclass(frozen=True)
class DonorMeta:
    """What a donor says about the state it served (validated before it gets here)."""

    outer_step: int
    donor_state: str
    donor_inner_step: int
    donor_round: int
    donor_peer_id: str = ""


def no_donor_join(initial: bool, keep_round: bool, waited_s: float, patience_s: float, outer_step: int,
                  round_: int, min_replicas: int, newest_seen: int = 0) -> Optional[JoinPoint]:
    """No live replica of our stage trains. A joiner starts from the seed (at once when min_replicas > 1:
    the swarm starts together; else after ``patience_s`` for records to appear); a re-syncing node
    continues from its own parameters after ``patience_s``. None: keep looking.

    ``newest_seen``: the newest outer step in any live member's record, syncing ones included. A joiner
    never starts from the seed while a member holds newer parameters: it waits for one to train again.
    (In a test every member of a trained swarm was re-syncing for a moment; a joiner with min_replicas 3
    saw three live members, none training, started from the seed and trained alone for 10 rounds.)"""
    if initial and newest_seen > outer_step:
        return None
    if initial and waited_s >= (0 if min_replicas > 1 else patience_s):
        return JoinPoint(JoinKind.SEED, round=round_, outer_step=outer_step)
    if not initial and waited_s >= patience_s:
        adopt = keep_round and outer_step < round_ - 1  # a stage that joined a replica ahead of it
        return JoinPoint(JoinKind.ALONE, round=round_, keep_round=keep_round,
                         outer_step=round_ - 1 if adopt else outer_step)
    return None


def current_join(active: Sequence[PeerProgress], outer_step: int, digest: str, inner_steps: int) -> Optional[JoinPoint]:
    """A joiner whose parameters the swarm already holds (a fresh swarm from one seed, or a current
    checkpoint) joins the most advanced of those members' round where it is; None if nobody holds them."""
    same = [m for m in active if m.outer_step == outer_step and m.global_params_digest == digest]
    if not same:
        return None
    return JoinPoint(JoinKind.CURRENT, round=max(m.round for m in same), outer_step=outer_step,
                     skip=min(max(m.inner_step for m in same), inner_steps - 1))


def donor_progress(meta: DonorMeta, live: Optional[PeerProgress], inner_steps: int) -> Optional[int]:
    """Inner steps to skip to join the donor's round where the donor is now, not where it was when the
    transfer began (a slow link can take several inner steps); None if the donor left that round."""
    if live is None or live.round < meta.donor_round:
        return meta.donor_inner_step
    if live.round > meta.donor_round:
        return None
    return min(max(meta.donor_inner_step, live.inner_step), inner_steps - 1)


def late_steps(inner_steps: int, step_s: float, window_s: float) -> int:
    """How many of a round's last inner steps its group already forms in: synchronous sparse rounds begin
    matchmaking once their inner steps have ``window_s`` seconds left (matchmaking_time + request_timeout,
    daemon/node.py), so a replica that starts later in the round cannot make its group.

    ``step_s``: seconds per inner step (0 or less: unknown, returns 0). Capped at half a round, so a
    joiner always has rounds it can join however fast the swarm steps."""
    if step_s <= 0:
        return 0
    return min(inner_steps // 2, math.ceil(window_s / step_s))


def join_point(meta: DonorMeta, live: Optional[PeerProgress], *, inner_steps: int, our_round: int,
               keep_round: bool, early_apply: bool, waited_for_result: bool, late: int = 0,
               ahead: bool = False) -> JoinPoint:
    """The join-point rule for a downloaded state.

    ``live``: the donor's current membership record (None if not seen); ``keep_round``: we finished
    this round's compute and need the parameters it starts from (outer step our_round - 1);
    ``early_apply``: donors apply a round's outer step mid-round (delayed overlap, whole-model nodes);
    ``waited_for_result``: we already waited once for a donor's mid-round result; ``late``: the round's
    last inner steps in which its group forms (``late_steps``): a joiner that would start there waits for
    the next round instead (it would miss the group, find the round gone on without it and re-sync: on a
    busy machine, again and again); ``ahead``: we can merge one missed outer update mid-round (synchronous
    sparse rounds with catch-up: daemon/join_ahead.py), so where the round's group has formed or is forming
    we compute the next round from the donor's theta at once (DOWNLOAD at donor_round + 1, skip 0, one
    outer step behind) instead of waiting for it to begin: a joiner that waited, then fetched the update,
    found the next round's short training window gone again (32 nodes on 2 cores: minutes of this).
    """
    if not keep_round and (meta.donor_state == AVERAGING or meta.donor_inner_step >= inner_steps):
        if ahead and meta.outer_step >= meta.donor_round - 1:
            return JoinPoint(JoinKind.DOWNLOAD, round=meta.donor_round + 1, outer_step=meta.outer_step,
                             reason=f"donor is finishing round {meta.donor_round}: computing round "
                                    f"{meta.donor_round + 1} ahead of its start")
        # the next round has begun once a member trains in it (outer_step may advance before that)
        return JoinPoint(JoinKind.WAIT, wait_for=WaitFor.NEXT_ROUND, after_step=meta.donor_round,
                         reason=f"donor is finishing round {meta.donor_round}; waiting for the next round")
    if not keep_round and early_apply and meta.outer_step < meta.donor_round - 1 and not waited_for_result:
        # Joining round donor_round needs theta_{donor_round - 1}, which the donor applies as soon as its
        # all-reduce is in. On a slow link waiting for it beats fetching it again at the round's end (too
        # late for matchmaking). Once only: with short rounds a fast link catches up at the round's end.
        return JoinPoint(JoinKind.WAIT, wait_for=WaitFor.OUTER_STEP, after_step=meta.outer_step,
                         reason=f"donor still averages round {meta.outer_step + 1}; waiting for its result")
    if keep_round and meta.outer_step < our_round - 1:
        return JoinPoint(JoinKind.WAIT, wait_for=WaitFor.OUTER_STEP, after_step=meta.outer_step,
                         reason=f"donor holds outer step {meta.outer_step}, round {our_round} needs {our_round - 1}; "
                                f"waiting")
    keep = keep_round and meta.outer_step == our_round - 1
    skip = 0 if keep else donor_progress(meta, live, inner_steps)
    if skip is None:
        return JoinPoint(JoinKind.REFETCH, reason=f"the donor finished round {meta.donor_round} during the "
                                                  f"download; fetching a newer state")
    round_ = our_round if keep else max(meta.donor_round, meta.outer_step + 1)
    if not keep and skip > 0 and skip >= inner_steps - late:
        if ahead and meta.outer_step >= round_ - 1:
            return JoinPoint(JoinKind.DOWNLOAD, round=round_ + 1, outer_step=meta.outer_step,
                             reason=f"donor is at inner step {skip} of {inner_steps}: computing round {round_ + 1} "
                                    f"ahead of its start")
        return JoinPoint(JoinKind.WAIT, wait_for=WaitFor.NEXT_ROUND, after_step=round_, late=True,
                         reason=f"donor is at inner step {skip} of {inner_steps}: round {round_}'s group is "
                                f"already forming; waiting for the next round")
    return JoinPoint(JoinKind.DOWNLOAD, round=round_, skip=skip, keep_round=keep, outer_step=meta.outer_step)


def wait_over(point: JoinPoint, others: Sequence[PeerProgress]) -> bool:
    """Does a WAIT join point stop waiting: its condition is met (``wait_satisfied``), or no member that trains
    is left to meet it (the donors finished or left: look for a state afresh rather than wait out a deadline)."""
    return wait_satisfied(point, others) or not any(m.state in ACTIVE_STATES for m in others)


def wait_satisfied(point: JoinPoint, others: Sequence[PeerProgress]) -> bool:
    """Is the condition a WAIT join point waits for met by some other member's record?"""
    if point.wait_for == WaitFor.NEXT_ROUND:
        return any(m.round > point.after_step and m.state == TRAINING for m in others)
    return any(m.outer_step > point.after_step for m in others)
