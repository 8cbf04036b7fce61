"""Assigned data: the swarm, not the contributor, chooses what a replica trains on in each round.

In a text swarm without ``--data-seed``, replica ``peer_id``'s batches in round r are batches 0..H-1 of the stream
``ReplicaShard(seed=ASSIGNED_SEED, shard_key=assigned_shard_key(run_id, peer_id, r))`` over the swarm's training
corpus (dilocox/data.py): a function of (run id, peer id, round) that any member can compute. An auditor
(daemon/audits.py) recomputes a round on exactly these batches, so a contributor that trains on data of its own
choosing (poisoned text, one narrow slice, a stream ground for a favourable shard key) fails the audit even if it
trains honestly on it, as Templar assigns pages per window (there checked by validators, here inside the swarm).
A peer id is fixed by its key, so grinding keys picks one round's data at most, and the next round's is another
hash. Image clients keep their private shares (``--num-clients``): nothing can be assigned there, and audits check
only that a round's stream continues the last (docs/security.md, "Assigned data").
"""

from __future__ import annotations

import hashlib

ASSIGNED_SEED = 0  # the stream seed of assigned batches: the same on every member, whatever its --seed
DOMAIN = b"dilocox-assigned-data/1"


def assigned_shard_key(run_id: str, peer_id: str, round_index: int) -> int:
    """The shard key of round ``round_index``'s batches for ``peer_id`` in swarm ``run_id``: the first 8 bytes of
    SHA-256(DOMAIN, run_id, peer_id, round_index) as a little-endian integer below 2^63 (``RoundGather.shard_key``'s
    range). Raises ValueError for a negative round."""
    if round_index < 0:
        raise ValueError(f"round must be >= 0, got {round_index}")
    digest = hashlib.sha256(b"\0".join([DOMAIN, run_id.encode(), peer_id.encode(), str(round_index).encode()]))
    return int.from_bytes(digest.digest()[:8], "little") & ((1 << 63) - 1)
