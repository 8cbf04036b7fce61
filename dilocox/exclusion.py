"""The group's exclusion vote: which members of a round count for nothing, decided alike by every member.

A member that found (or checked by recomputing it) that a peer lied in round k votes to exclude it: its round's
gathered metadata lists ``peer_id -> k`` (peers/averaging.py ``RoundGather.exclusion_votes``). In round r a member
p is excluded when a strict majority of the group's members with valid metadata (p itself counted, and only votes
for a round k < r) list it. The gathered metadata is the same bytes on every member of the group (hivemind's
all-gather, checked by the payload digests), so every member drops the same peers in the same round: no member
aggregates other contributions than the rest because it verified a lie a round earlier or later (the split of
``make bench-attacks-audits``: an immediate local exclusion made members aggregate different sets, skip rounds and
re-sync). A minority of colluders cannot exclude an honest member; a group in which colluders hold the majority is
beyond this rule (docs/security.md, "Exclusion").
"""

from __future__ import annotations

from typing import Mapping


def group_exclusions(votes: Mapping[str, Mapping[str, int]], round_index: int) -> dict[str, str]:
    """Members excluded from round ``round_index`` by the group's vote.

    ``votes``: each member with valid metadata -> its votes (peer_id -> the round the voter found that peer lied in;
    a vote for a later round, or for round_index itself, does not count yet). Returns peer_id -> why, for each member
    of ``votes`` that more than half of ``votes``'s members vote against. Pure: equal inputs give equal answers."""
    counts: dict[str, list[int]] = {}
    for voter, listed in votes.items():
        for peer, found in listed.items():
            if peer != voter and peer in votes and found < round_index:
                counts.setdefault(peer, []).append(found)
    n = len(votes)
    return {peer: f"excluded by {len(found)} of the group's {n} members: it lied in round {min(found)}"
            for peer, found in sorted(counts.items()) if 2 * len(found) > n}
