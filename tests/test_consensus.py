"""The consistency rules (dilocox/consensus.py) with fake peer records: verdicts, round start,
failure handling and the join point. Pure functions, so these run in milliseconds; the swarm tests
check that the daemon acts on them."""

from __future__ import annotations

import pytest

from dilocox.consensus import (
    DonorMeta,
    JoinKind,
    Standing,
    StartAction,
    Verdict,
    WaitFor,
    canonical_digest,
    current_join,
    donor_progress,
    failure_action,
    group_standing,
    in_round,
    join_point,
    judge_result,
    late_steps,
    no_donor_join,
    round_start_action,
    settings_conflict,
    undecided,
    wait_over,
    wait_satisfied,
)
from tests.fakes.records import Peer

H = 20


# ---------------------------------------------------------------- verdicts

def test_canonical_digest_majority_then_smallest_peer_id():
    assert canonical_digest({}) == (None, [])
    assert canonical_digest({"a": "x", "b": "y", "c": "y"}) == ("y", ["b", "c"])
    # a tie goes to the digest of the smallest peer_id, so every member picks the same
    assert canonical_digest({"b": "y", "a": "x"}) == ("x", ["a"])


@pytest.mark.parametrize("mine, results, members, verdict", [
    ("x", {"0": "x", "1": "x", "2": "x"}, None, Verdict.APPLY),
    ("y", {"0": "x", "1": "x", "2": "y"}, None, Verdict.RESYNC),    # ours is the partial one
    ("x", {"0": "x", "1": "y"}, None, Verdict.SKIP),                # 1:1, nobody can tell
    ("x", {"0": "x"}, 2, Verdict.SKIP),                             # the other never reported
    ("x", {"0": "x", "1": "x"}, 3, Verdict.APPLY),                  # 2 of 3 is a strict majority
    ("x", {"0": "x", "1": "x"}, 4, Verdict.SKIP),                   # 2 of 4 is not
    ("x", {"0": "x", "1": "y", "2": "z"}, None, Verdict.SKIP),
])
def test_judge_result(mine, results, members, verdict):
    assert judge_result(mine, results, members) == verdict


# ---------------------------------------------------------------- round start and failure

@pytest.mark.parametrize("others, conflict", [
    ({}, None),                                          # alone: nothing to compare
    ({"b": "ours"}, None),
    ({"b": "X"}, ("X", ["b"])),                          # the one other member differs: refuse
    ({"b": "X", "c": "X", "d": "ours"}, ("X", ["b", "c"])),
    ({"b": "X", "c": "ours"}, None),                     # no strict majority of others against us
    ({"b": "X", "c": "Y", "d": "Z"}, None),              # they disagree among themselves
    ({"b": "", "c": "X"}, ("X", ["c"])),                 # a record without a digest is not counted
    ({"b": "", "c": ""}, None),
])
def test_settings_conflict_needs_a_strict_majority_of_the_others(others, conflict):
    assert settings_conflict("ours", others) == conflict


def test_solo_only_when_nobody_could_take_part():
    assert round_start_action([], 5, delayed=False) == StartAction.SOLO
    assert round_start_action([Peer(round=5)], 5, delayed=False) == StartAction.ALLREDUCE
    # delayed: a replica already computing round 6 still averages round 5
    assert round_start_action([Peer(round=6)], 5, delayed=True) == StartAction.ALLREDUCE
    assert round_start_action([Peer(round=6)], 5, delayed=False) == StartAction.SOLO
    # a replica whose record still shows the previous round comes next: going solo would split the round
    assert round_start_action([Peer(round=4, state="AVERAGING")], 5, delayed=False) == StartAction.ALLREDUCE
    assert round_start_action([Peer(round=3)], 5, delayed=False) == StartAction.SOLO
    # a whole-model replica that is syncing may start this round: wait for it in matchmaking
    assert round_start_action([Peer(state="SYNCING", round=3)], 5, delayed=False) == StartAction.ALLREDUCE
    # a syncing stage node waits for its replica's other stages: not counted on
    assert round_start_action([Peer(state="SYNCING", round=3, num_stages=2)], 5, delayed=False) == StartAction.SOLO
    assert round_start_action([Peer(state="DRAINING", round=5)], 5, delayed=False) == StartAction.SOLO


def test_round_already_applied_by_others_needs_resync():
    assert round_start_action([Peer(outer_step=5, round=6)], 5, delayed=True) == StartAction.ALREADY_DONE
    # one member applied round 5 alone while 3 others still compute it: average with them, not re-sync to it
    late = [Peer(peer_id=f"p{i}", outer_step=4, round=5) for i in range(3)]
    assert round_start_action([Peer(outer_step=5, round=6)] + late, 5, delayed=False) == StartAction.ALLREDUCE
    # two of four applied it (half, with us): the round went on without us
    assert round_start_action([Peer(outer_step=5, round=6)] * 2 + late[:1], 5, delayed=False) == \
        StartAction.ALREADY_DONE
    assert round_start_action([Peer(outer_step=5, round=6)] * 2 + late, 5, delayed=False) == StartAction.ALLREDUCE
    assert failure_action([Peer(outer_step=5)], 5) == Verdict.RESYNC
    assert failure_action([Peer(outer_step=4)], 5) == Verdict.APPLY  # applied alone: nobody has round 5
    assert failure_action([Peer(outer_step=9, state="STOPPED")], 5) == Verdict.APPLY


def test_a_group_mate_without_a_report_is_undecided_until_it_reports_moves_on_or_stops():
    missing = {"a", "b", "c", "d", "e"}
    others = [Peer(peer_id="a", outer_step=4, round=6),              # computing round 6, round 5 not checked yet
              Peer(peer_id="b", outer_step=4, result_step=5),        # reported round 5 (read too late for us)
              Peer(peer_id="c", outer_step=5),                       # applied or consumed round 5
              Peer(peer_id="d", outer_step=4, state="SYNCING"),      # dropped the round for a re-sync
              Peer(peer_id="e", outer_step=4, state="STOPPED"),      # left
              Peer(peer_id="z", outer_step=4)]                       # its report is in (not missing)
    assert undecided(others, missing, 5) == ["a"]
    assert undecided(others, missing | {"z"}, 5) == ["a", "z"]
    assert undecided([], missing, 5) == []  # records expired: nobody can still apply


def test_in_round_window():
    peers = [Peer("a", round=5), Peer("b", round=6), Peer("c", round=7), Peer("d", round=5, state="SYNCING"),
             Peer("e", round=4), Peer("f", round=3)]
    # e still finishes round 4 (or its record is a moment old): it starts round 5 next
    assert [p.peer_id for p in in_round(peers, 5, delayed=False)] == ["a", "e"]
    assert [p.peer_id for p in in_round(peers, 5, delayed=True)] == ["a", "b", "e"]


def test_a_member_is_left_behind_once_nobody_else_is_in_the_round_or_most_replicas_applied_it():
    from dilocox.consensus import left_behind

    in_it = [Peer(f"a{i}", outer_step=4, round=5, global_params_digest="d4") for i in range(3)]
    applied = [Peer(f"b{i}", outer_step=5, round=6, inner_step=2, global_params_digest="d5") for i in range(3)]
    assert not left_behind(in_it + applied, 5, delayed=False)  # 3 of 7 applied: the round still waits for its group
    assert left_behind(in_it[:1] + applied, 5, delayed=False)  # 3 of 5 (ours counted) hold d5 at step 5
    assert left_behind(applied, 5, delayed=False)  # nobody else is in round 5 (the rule before this one)
    # a majority needs one theta: two lineages that applied the round do not make us late while others are in it
    split = applied[:2] + [Peer("c", outer_step=5, round=6, global_params_digest="other")]
    assert not left_behind(in_it[:1] + split, 5, delayed=False)
    assert not left_behind([Peer(f"s{i}", state="SYNCING", outer_step=5, round=6, global_params_digest="d5")
                            for i in range(4)] + in_it[:1], 5, delayed=False)  # syncing replicas do not count


# ---------------------------------------------------------------- joining

def test_no_donor_joiner_starts_from_seed_after_patience():
    assert no_donor_join(True, False, 1.0, 6.0, 0, 1, min_replicas=1) is None
    assert no_donor_join(True, False, 6.0, 6.0, 0, 1, min_replicas=1).kind == JoinKind.SEED
    assert no_donor_join(True, False, 0.0, 6.0, 0, 1, min_replicas=2).kind == JoinKind.SEED  # the swarm starts together


def test_a_joiner_never_starts_from_the_seed_while_a_syncing_member_holds_newer_parameters():
    # every member of a trained swarm re-syncing at once: wait for one to train, however long, and whatever
    # min_replicas says (from the seed the joiner trained alone for 10 rounds in a test)
    for min_replicas in (1, 3):
        assert no_donor_join(True, False, 600.0, 6.0, 0, 1, min_replicas, newest_seen=7) is None
    assert no_donor_join(True, False, 0.0, 6.0, 0, 1, 3, newest_seen=0).kind == JoinKind.SEED
    assert no_donor_join(True, False, 6.0, 6.0, 7, 8, 1, newest_seen=7).kind == JoinKind.SEED  # its checkpoint
    # a re-syncing node is not a joiner: after patience it continues from its own parameters, as before
    assert no_donor_join(False, False, 6.0, 6.0, 3, 5, 1, newest_seen=7).kind == JoinKind.ALONE


def test_no_donor_resync_continues_alone_and_may_claim_the_previous_step():
    assert no_donor_join(False, False, 1.0, 6.0, 3, 5, 1) is None
    alone = no_donor_join(False, False, 6.0, 6.0, 3, 5, 1)
    assert (alone.kind, alone.outer_step) == (JoinKind.ALONE, 3)
    # a stage that joined a replica ahead of it: its round 5 needs outer step 4, ours are the newest
    claim = no_donor_join(False, True, 6.0, 6.0, 3, 5, 1)
    assert (claim.kind, claim.outer_step, claim.keep_round) == (JoinKind.ALONE, 4, True)


def test_current_join_takes_the_most_advanced_holder():
    peers = [Peer("a", outer_step=4, global_params_digest="d4", round=5, inner_step=7),
             Peer("b", outer_step=4, global_params_digest="d4", round=5, inner_step=12),
             Peer("c", outer_step=3, global_params_digest="d3", round=4, inner_step=19)]
    point = current_join(peers, 4, "d4", H)
    assert (point.kind, point.round, point.skip) == (JoinKind.CURRENT, 5, 12)
    assert current_join(peers, 4, "other", H) is None
    assert current_join([Peer(inner_step=H)], 4, "d4", H).skip == H - 1  # never skip the whole round


def meta(**kw):
    base = dict(outer_step=4, donor_state="TRAINING", donor_inner_step=6, donor_round=5, donor_peer_id="a")
    base.update(kw)
    return DonorMeta(**base)


def plan(m, live=None, **kw):
    args = dict(inner_steps=H, our_round=1, keep_round=False, early_apply=False, waited_for_result=False)
    args.update(kw)
    return join_point(m, live, **args)


def test_join_at_the_donors_current_inner_step():
    point = plan(meta(), Peer("a", round=5, inner_step=9))  # the donor went on during the transfer
    assert (point.kind, point.round, point.skip, point.keep_round) == (JoinKind.DOWNLOAD, 5, 9, False)
    assert plan(meta(), None).skip == 6  # donor's record not seen: its metadata's step


def test_join_refetches_when_the_donor_left_that_round():
    assert plan(meta(), Peer("a", round=6, inner_step=1)).kind == JoinKind.REFETCH
    assert donor_progress(meta(), Peer("a", round=4), H) == 6  # stale record: use the metadata


def test_join_waits_for_the_next_round_when_the_donor_is_averaging():
    for m in (meta(donor_state="AVERAGING"), meta(donor_inner_step=H)):
        point = plan(m)
        assert (point.kind, point.wait_for, point.after_step) == (JoinKind.WAIT, WaitFor.NEXT_ROUND, 5)
    point = plan(meta(donor_state="AVERAGING"))
    assert not wait_satisfied(point, [Peer(round=5), Peer(round=6, state="AVERAGING")])
    assert wait_satisfied(point, [Peer(round=6, state="TRAINING")])
    # the wait also ends when no member that trains is left (the donors finished their run or left)
    assert not wait_over(point, [Peer(round=5)]) and wait_over(point, [Peer(round=5, state="STOPPED")])
    assert wait_over(point, [])


def test_join_waits_once_for_a_mid_round_result():
    stale = meta(outer_step=3, donor_round=5)  # the donor still averages round 4
    point = plan(stale, early_apply=True)
    assert (point.kind, point.wait_for, point.after_step) == (JoinKind.WAIT, WaitFor.OUTER_STEP, 3)
    assert wait_satisfied(point, [Peer(outer_step=4)]) and not wait_satisfied(point, [Peer(outer_step=3)])
    # once only, and never without the mid-round apply: then join round 5 and catch up at its end
    assert plan(stale, early_apply=True, waited_for_result=True).kind == JoinKind.DOWNLOAD
    assert plan(stale, early_apply=False).round == 5


def test_keep_round_needs_exactly_the_previous_step():
    # we computed round 5 and need theta_4 to send its pseudo-gradient
    assert plan(meta(outer_step=3), keep_round=True, our_round=5).kind == JoinKind.WAIT
    point = plan(meta(outer_step=4), keep_round=True, our_round=5)
    assert (point.kind, point.keep_round, point.skip, point.round) == (JoinKind.DOWNLOAD, True, 0, 5)
    # the donor is further ahead: our round is lost, join the donor's round
    ahead = plan(meta(outer_step=6, donor_round=7), Peer("a", round=7, inner_step=9), keep_round=True, our_round=5)
    assert (ahead.keep_round, ahead.round, ahead.skip) == (False, 7, 9)


def test_join_waits_for_the_next_round_when_its_group_is_forming():
    # synchronous sparse rounds match during their last inner steps: a joiner starting there misses the group
    assert late_steps(H, step_s=0.5, window_s=3.0) == 6 and late_steps(H, 0.0, 3.0) == 0
    assert late_steps(H, step_s=0.01, window_s=3.0) == H // 2  # fast steps: still half a round to join in
    point = plan(meta(donor_inner_step=H - 6), late=6)
    assert (point.kind, point.wait_for, point.after_step) == (JoinKind.WAIT, WaitFor.NEXT_ROUND, 5)
    assert point.late and "group is already forming" in point.reason
    assert not plan(meta(donor_state="AVERAGING"), late=6).late
    assert plan(meta(donor_inner_step=H - 7), late=6).kind == JoinKind.DOWNLOAD
    # the donor went on during the transfer: its live step counts
    assert plan(meta(donor_inner_step=2), Peer("a", round=5, inner_step=H - 1), late=6).kind == JoinKind.WAIT
    assert plan(meta(donor_inner_step=0), late=H).kind == JoinKind.DOWNLOAD  # a round's start is always joinable
    # keeping our round (we computed it) never waits for the next one
    assert plan(meta(outer_step=4, donor_inner_step=H - 1), keep_round=True, our_round=5, late=6).kind == \
        JoinKind.DOWNLOAD


def test_join_ahead_computes_the_next_round_where_the_group_has_formed_or_is_forming():
    # the donor averages round 5, or is in the last inner steps in which its group forms: round 6 from theta_4
    for m, late in ((meta(donor_state="AVERAGING"), 0), (meta(donor_inner_step=H), 0), (meta(donor_inner_step=H - 6),
                                                                                        6)):
        point = plan(m, late=late, ahead=True)
        assert (point.kind, point.round, point.skip, point.outer_step, point.keep_round) == \
            (JoinKind.DOWNLOAD, 6, 0, 4, False), point
    # where a round can still be joined, join it where the donor is; a kept round never goes ahead
    assert (plan(meta(), ahead=True).round, plan(meta(), ahead=True).skip) == (5, 6)
    assert plan(meta(outer_step=4, donor_state="AVERAGING"), keep_round=True, our_round=5, ahead=True).keep_round
    # more than one outer step behind the donor's round (a delayed donor): no merge can cover it, so wait
    assert plan(meta(outer_step=3, donor_state="AVERAGING"), ahead=True).kind == JoinKind.WAIT


# ---------------------------------------------------------------- split rounds: one update per round

@pytest.mark.parametrize("ours, replicas, outside, pending, expected", [
    (5, 8, {"x": "B", "y": "B", "z": "B"}, 0, (Standing.MAJORITY, None)),  # 5 of 8: ours is the round's
    (3, 8, {"c": "M", "d": "M", "e": "M", "f": "M", "g": "M"}, 0, (Standing.ADOPT, "M")),
    (3, 8, {"c": "M", "d": "M", "e": "M"}, 2, (Standing.WAIT, None)),  # M may still reach 5 of 8
    (3, 8, {"c": "M", "d": "M"}, 3, (Standing.WAIT, None)),  # the 3 pending may join M, or form a group
    (4, 8, {"c": "M", "d": "M", "e": "M", "f": "M"}, 0, (Standing.UNION, None)),  # a tie: nobody has a majority
    (3, 9, {"c": "M", "d": "M", "e": "N", "f": "N", "g": "O", "h": "O"}, 0, (Standing.UNION, None)),
    (3, 9, {"c": "M", "d": "M", "e": "N"}, 3, (Standing.WAIT, None)),  # no majority, but the union needs them
    (1, 2, {}, 1, (Standing.WAIT, None)),  # half can never be a strict majority, but it may report a result
    (1, 2, {}, 0, (Standing.ALONE, None)),  # nobody outside reported: nothing to unite with
    (2, 3, {}, 0, (Standing.MAJORITY, None)),
    # replicas counts at least everyone seen: a stale count cannot make two majorities
    (3, 3, {"c": "M", "d": "M", "e": "M", "f": "M"}, 0, (Standing.ADOPT, "M")),
])
def test_group_standing(ours, replicas, outside, pending, expected):
    assert group_standing(ours, replicas, outside, pending) == expected


def test_a_group_read_in_part_counts_with_its_size():
    """32 replicas: our group of 15 reads only 10 records of the other group's 17; those records list its 17
    contributions, so it is the majority (adopted): by holder counts alone our 15 of 25 would keep its own
    while that group keeps its own too, two updates in one round."""
    outside = {f"b{i}": "B" for i in range(10)}
    sizes = {p: 17 for p in outside}
    assert group_standing(15, 25, outside, 0) == (Standing.MAJORITY, None)  # by holder counts alone
    assert group_standing(15, 25, outside, 0, sizes) == (Standing.ADOPT, "B")
    # and that group, reading all of ours, keeps its own
    assert group_standing(17, 32, {f"a{i}": "A" for i in range(15)}, 0, {f"a{i}": 15 for i in range(15)}) == (
        Standing.MAJORITY, None)


def test_at_most_one_group_of_a_round_keeps_its_own_update():
    """Every split of n replicas into groups: at most one group applies its own when another is ADOPTing or
    MAJORITY, and every group that adopts adopts the majority's result, so one update per round remains."""
    import itertools

    for n in range(2, 10):
        for sizes in {tuple(sorted(c)) for k in range(1, min(n, 4) + 1)
                      for c in itertools.product(range(1, n + 1), repeat=k) if sum(c) == n}:
            digests = [f"g{i}" for i in range(len(sizes))]
            members = [(d, i) for d, size in zip(digests, sizes) for i in range(size)]
            verdicts = {}
            for d, size in zip(digests, sizes):
                outside = {f"{o}{i}": o for o, i in members if o != d}
                verdicts[d] = group_standing(size, n, outside, 0)
            own = [d for d, (st, _) in verdicts.items() if st in (Standing.MAJORITY, Standing.ALONE)]
            adopted = {m for st, m in verdicts.values() if st == Standing.ADOPT}
            united = [d for d, (st, _) in verdicts.items() if st == Standing.UNION]
            if adopted:
                assert own == list(adopted) and len(adopted) == 1 and not united, (sizes, verdicts)
            else:  # no majority: every group unites (or the only group keeps its own)
                assert len(united) == len(sizes) or own == digests == ["g0"], (sizes, verdicts)
            assert all(st != Standing.WAIT for st, _ in verdicts.values())  # nothing pending: nobody waits


@pytest.mark.parametrize("outside, sizes, expected", [
    # two other groups, each all holding its result: both count, weighted by contributions, sorted by digest
    ({"c": "N", "d": "N", "e": "M", "f": "M", "g": "M"}, {"c": 2, "d": 2, "e": 3, "f": 3, "g": 3},
     {"M": 3, "N": 2}),
    # a member of a group of 3 with a partial result (1 holder of 3): its group re-syncs it, we leave it out;
    # the group's weight is its 3 contributions although only 2 holders' records were read
    ({"c": "M", "d": "M", "e": "P"}, {"c": 3, "d": 3, "e": 3}, {"M": 3}),
    # a holder of 3 seen alone is not a majority of its group (yet): left out
    ({"c": "M"}, {"c": 3}, {}),
    # a lone member that claims a group of 5 holds no majority of it: left out
    ({"c": "X"}, {"c": 5}, {}),
    # a lone member that claims no group is a group of one: weight 1; two that list none: 2 holders
    ({"c": "X"}, {}, {"X": 1}),
    ({"c": "X", "d": "X"}, {}, {"X": 2}),
])
def test_union_groups(outside, sizes, expected):
    from dilocox.consensus import union_groups

    got = union_groups(outside, sizes)
    assert got == expected and list(got) == sorted(expected)


def test_chosen_union_is_the_proposal_most_members_made_then_the_larger():
    from dilocox.consensus import chosen_union

    assert chosen_union({}) == ()
    early, late = ("a", "b", "c"), ("a", "b", "c", "d")
    assert chosen_union({**{f"e{i}": early for i in range(7)}, **{f"l{i}": late for i in range(21)}}) == late
    assert chosen_union({"x": early, "y": late}) == late  # a tie: the one that saw more groups
    assert chosen_union({"x": ("a", "c"), "y": ("a", "b")}) == ("a", "b")  # then the smallest


def test_applied_majority_is_a_theta_most_live_replicas_hold_at_that_step():
    from dilocox.consensus import applied_majority

    def peer(name, step, digest, state="TRAINING"):
        return Peer(peer_id=name, state=state, outer_step=step, round=step + 1, global_params_digest=digest)

    ahead = [peer(f"a{i}", 2, "D") for i in range(20)]
    assert applied_majority(ahead + [peer(f"b{i}", 1, "C") for i in range(9)], 2, 2) == "D"  # 20 of 31
    assert applied_majority(ahead[:14] + [peer(f"b{i}", 1, "C") for i in range(15)], 2, 2) is None  # 14 of 31
    assert applied_majority(ahead, 3, 2) is None  # nobody is at step 3
    assert applied_majority([peer(f"s{i}", 2, "D", "SYNCING") for i in range(20)], 2, 2) is None  # not active


def test_a_minority_lineage_joins_the_majoritys_theta_and_waits_while_it_may_still_form():
    """After a split round: 21 replicas hold theta A at outer step 8, 3 hold B (seen at 32 nodes). Each member of B
    finds A held by a strict majority of the live replicas, itself included, and re-syncs; A's members stay."""
    from dilocox.consensus import Lineage, lineage_standing, majority_theta

    def peer(name, step, digest, state="TRAINING"):
        return Peer(peer_id=name, state=state, outer_step=step, round=step + 1, global_params_digest=digest)

    a = [peer(f"a{i}", 8, "A") for i in range(21)]
    b = [peer(f"b{i}", 8, "B") for i in range(3)]
    assert lineage_standing(a + b[1:], 8, "B") == (Lineage.JOIN, "A")  # a member of B
    assert lineage_standing(a[1:] + b, 8, "A") == (Lineage.STAY, None)  # a member of A
    # 12 against 12 (ours included), every replica at step 8: no strict majority; the smaller digest prevails
    halves = a[:12] + b + [peer(f"c{i}", 8, "B") for i in range(8)]
    assert lineage_standing(halves, 8, "B") == (Lineage.JOIN, "A")
    assert lineage_standing(halves[1:] + [peer("b9", 8, "B")], 8, "A") == (Lineage.STAY, None)
    # a member of A that misses one of A's records reads 11 against 12, a strict majority of what it reads, and
    # joins B (as the majority rule alone did before): a re-sync, after which B holds 13 of 24
    assert lineage_standing(halves[2:] + [peer("b9", 8, "B")], 8, "A") == (Lineage.JOIN, "B")
    # one replica ahead (it applied step 9 already) or behind: the sizes at step 8 are not final, nobody moves
    assert lineage_standing(halves + [peer("n", 9, "N")], 8, "B") == (Lineage.STAY, None)
    # B is quicker (a small group settles sooner): 10 of A are still at step 7 and may yet apply A
    behind = [peer(f"w{i}", 7, "P") for i in range(10)]
    assert lineage_standing(a[:10] + behind + b[1:], 8, "B") == (Lineage.WAIT, None)
    assert lineage_standing(a[:10] + behind + b[1:], 8, "A") == (Lineage.STAY, None)  # ours can only grow
    assert lineage_standing(a[:3] + behind[:2] + b[1:], 8, "B") == (Lineage.WAIT, None)  # 3 + 2 of 6 could be A
    assert lineage_standing(a[:2] + behind[:1] + b[1:], 8, "B") == (Lineage.STAY, None)  # 2 + 1 of 6 cannot
    # no split in sight: members behind us are not waited for
    assert lineage_standing(behind + b[1:], 8, "B") == (Lineage.STAY, None)
    # re-syncing members hold no vote and are not live replicas
    syncing = [peer(f"s{i}", 8, "S", "SYNCING") for i in range(5)]
    assert lineage_standing(a[:10] + syncing + b[1:], 8, "B") == (Lineage.JOIN, "A")
    assert majority_theta(a + b, 8) == "A" and majority_theta(a[:12] + b * 4, 8) is None  # 12 of 24 each
    assert majority_theta(a, 9) is None


def test_the_prevailing_theta_is_the_majoritys_else_with_every_replica_at_the_step_the_largest_lineages():
    """dilocox.consensus.prevailing_theta: what lineage_standing joins and StateTransfer.vouch adopts."""
    from dilocox.consensus import Lineage, lineage_standing, prevailing_theta

    def peers(prefix, n, digest, step=8, state="TRAINING"):
        return [Peer(peer_id=f"{prefix}{i}", state=state, outer_step=step, round=step + 1,
                     global_params_digest=digest) for i in range(n)]

    assert prevailing_theta(peers("a", 7, "E") + peers("b", 5, "D"), 8) == "E"  # a strict majority, digest aside
    three = peers("a", 5, "F") + peers("b", 5, "C") + peers("c", 4, "B")  # 14 replicas, none holds 8
    assert prevailing_theta(three, 8) == "C"  # the most holders, the tie to the smaller digest
    for digest, standing in (("F", (Lineage.JOIN, "C")), ("C", (Lineage.STAY, None)), ("B", (Lineage.JOIN, "C"))):
        me = next(i for i, m in enumerate(three) if m.global_params_digest == digest)  # a member of that lineage
        assert lineage_standing(three[:me] + three[me + 1:], 8, digest) == standing, digest
    assert prevailing_theta(three, 8, ours=1, our_digest="F") == "F"  # ours breaks the tie: 6 against 5
    # nothing to converge on: one theta only, nobody at the step, or a replica behind or ahead of it
    assert prevailing_theta(peers("a", 3, "A"), 8) == "A" and prevailing_theta(peers("a", 3, "A"), 9) is None
    assert prevailing_theta(three + peers("w", 1, "P", step=7), 8) is None
    assert prevailing_theta(three + peers("n", 1, "N", step=9), 8) is None
    # re-syncing members hold no vote and are not live replicas
    assert prevailing_theta(three + peers("s", 3, "B", state="SYNCING"), 8) == "C"


def test_a_lone_applier_ahead_of_most_replicas_waits_for_them_then_joins_their_theta():
    """A member whose all-reduce failed applied outer step 2 alone while the other replicas were still in that
    round (seen at 32 hosts: it then ran a round ahead of them for good, applying every round alone). At its
    next round's lineage check it waits while most replicas are behind step 2, and joins the theta they apply."""
    from dilocox.consensus import Lineage, lineage_standing

    def peer(name, step, digest, state="TRAINING"):
        return Peer(peer_id=name, state=state, outer_step=step, round=step + 1, global_params_digest=digest)

    behind = [peer(f"w{i}", 1, "P") for i in range(31)]
    assert lineage_standing(behind, 2, "L") == (Lineage.STAY, None)  # as before for any other member ahead
    assert lineage_standing(behind, 2, "L", alone=True) == (Lineage.WAIT, None)
    # they applied step 2 (one theta, the union of their groups): a strict majority holds it, ours is alone
    done = [peer(f"w{i}", 2, "S") for i in range(31)]
    assert lineage_standing(done, 2, "L", alone=True) == (Lineage.JOIN, "S")
    # 15 of them applied S, 16 are still behind: S may yet become the majority, so still wait
    assert lineage_standing(done[:15] + behind[15:], 2, "L", alone=True) == (Lineage.WAIT, None)
    # not a majority behind us (most went on with us or left): nothing to wait for, ours stands
    assert lineage_standing(behind[:3] + [peer(f"o{i}", 2, "L") for i in range(7)], 2, "L", alone=True) == \
        (Lineage.STAY, None)
    assert lineage_standing(behind[:1], 2, "L", alone=True) == (Lineage.STAY, None)  # a pair: half is not most
    assert lineage_standing([peer("s", 1, "P", state="SYNCING")] * 5, 2, "L", alone=True) == (Lineage.STAY, None)
