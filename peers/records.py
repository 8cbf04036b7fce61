"""The swarm's DHT records and the schema that validates them (hivemind's SchemaValidator): each member's
signed record (MemberRecord, under ``{run_id}_members``), the contributions a member used in a round
(InputsRecord, under ``{run_id}_inputs``), a node's key binding (KeyBinding, under ``{run_id}_key.{key}``) and
the authority's revocation lists. On the wire each field goes under a short name (``wire()``); a record naming
more than MAX_PEERS peers is refused. peers/swarm.py stores and reads them.
"""

from __future__ import annotations

import hashlib
from typing import Dict, List, Optional

import pydantic.v1 as pydantic
from dilocox.peers.signing import PUBLIC_KEY_REGEX
from hivemind.dht.schema import conbytes

MAX_PEERS = 1024  # peers a record's lists and maps may name


def at_most_max_peers(cls, value):
    if len(value) > MAX_PEERS:
        raise ValueError(f"{len(value)} peers: at most {MAX_PEERS}")
    return value


class _Record(pydantic.BaseModel):
    """A DHT record: on the wire (``wire()``) each field goes under its short name from the subclass's
    ``Config.fields`` aliases (a record's field names were 260 of its 536 bytes, and every read carries every
    member's record); in code, and when parsing, fields keep their own names. hivemind's SchemaValidator compares
    a value with its parse's ``dict(by_alias=True)``, so a record with the long names (a node of an earlier
    version) is refused as a type conversion."""

    class Config:
        extra = pydantic.Extra.forbid  # hivemind's SchemaValidator then refuses unknown fields
        allow_population_by_field_name = True

    def wire(self) -> dict:
        """The value to store: every field, defaults too (the SchemaValidator refuses a value its parse would
        change), under its short name."""
        return self.dict(by_alias=True)


class MemberRecord(_Record):
    """What a node tells the swarm about itself (refreshed every few seconds)."""

    peer_id: pydantic.StrictStr
    run_id: pydantic.StrictStr
    state: pydantic.StrictStr
    outer_step: pydantic.conint(ge=0)  # outer updates applied (version of theta)
    round: pydantic.conint(ge=0) = 0  # round being computed (its all-reduce has this group key)
    inner_step: pydantic.conint(ge=0)
    inner_steps: pydantic.conint(ge=1)
    tokens_per_second: pydantic.confloat(ge=0)
    loss: float
    global_params_digest: pydantic.StrictStr
    # digest of the averaged pseudo-gradient of round `result_step` (consistency check: docs/protocol.md)
    result_step: pydantic.conint(ge=0) = 0
    result_digest: pydantic.StrictStr = ""
    # pipeline stages (peers/replica.py): our stage, the replica we are in, and (stage 0) its rendezvous
    stage_index: pydantic.conint(ge=0) = 0
    num_stages: pydantic.conint(ge=1) = 1
    replica_id: pydantic.StrictStr = ""
    rendezvous: pydantic.StrictStr = ""
    replica_members: List[pydantic.StrictStr] = []
    # the swarm authority's certificate for peer_id (peers/admission.py); empty in an open swarm
    certificate: pydantic.constr(strict=True, max_length=4096) = ""
    # sparse round `result_step`: the contributions we used (inputs_digest of peer_id -> payload digest) and how
    # many; the map itself is published only when a group-mate's digest differs (InputsRecord)
    inputs_digest: pydantic.constr(strict=True, max_length=16) = ""
    num_inputs: pydantic.conint(ge=0, le=1024) = 0
    # split round `result_step` without a majority: the group results whose union we propose to apply
    # (daemon/majority.py); empty otherwise
    union: List[pydantic.constr(strict=True, max_length=16)] = []
    # reachability (peers/reachability.py): we accept no inbound connections; peers we could not dial lately
    client_mode: pydantic.StrictBool = False
    undialable: List[pydantic.constr(strict=True, max_length=64)] = []
    # 16 hex digits of the SHA-256 of the settings replicas must share (NodeConfig.swarm_settings); empty: unknown
    settings: pydantic.constr(strict=True, max_length=16) = ""
    # audits (daemon/audits.py): peer_id -> the round whose recomputation showed that peer lied
    accusations: Dict[pydantic.constr(strict=True, max_length=64), pydantic.conint(ge=1)] = {}

    _few_peers = pydantic.validator("undialable", "accusations", "union", allow_reuse=True)(at_most_max_peers)

    class Config:
        fields = {name: {"alias": short} for name, short in dict(
            peer_id="p", run_id="r", state="s", outer_step="o", round="rd", inner_step="i", inner_steps="H",
            tokens_per_second="t", loss="l", global_params_digest="g", result_step="rs", result_digest="rg",
            stage_index="si", num_stages="ns", replica_id="ri", rendezvous="rv", replica_members="rm",
            certificate="c", inputs_digest="id", num_inputs="ni", union="u", client_mode="cm", undialable="ud",
            settings="st", accusations="ac").items()}


class InputsRecord(_Record):
    """The contributions a member used in round ``result_step``: contributor peer_id -> the first 16 hex digits of
    the SHA-256 of its payload, so members can see a contributor that served different bytes to different
    peers. Published (under ``{run_id}_inputs``) only when a group-mate's ``inputs_digest`` differs from ours:
    in every record it made each read O(N^2) bytes (75% of a record at 32 members)."""

    peer_id: pydantic.StrictStr
    result_step: pydantic.conint(ge=0)
    inputs: Dict[pydantic.constr(strict=True, max_length=64), pydantic.constr(strict=True, max_length=16)]

    _few_peers = pydantic.validator("inputs", allow_reuse=True)(at_most_max_peers)

    class Config:
        fields = {"peer_id": {"alias": "p"}, "result_step": {"alias": "rs"}, "inputs": {"alias": "in"}}


def inputs_digest(inputs: Dict[str, str]) -> str:
    """16 hex digits of the SHA-256 of a round's inputs (peer_id -> payload digest), in peer_id order; "" if none.
    Members that used the same contributions publish the same digest."""
    if not inputs:
        return ""
    text = "\n".join(f"{peer}:{inputs[peer]}" for peer in sorted(inputs))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class KeyBinding(_Record):
    """A node's Ed25519 record-signing key bound to its peer_id (peers/signing.py, ``make_binding``), stored under
    its RSA subkey of ``{run_id}_key.{key}`` (``Swarm.binding_key``): ``key`` the base64 public key, ``proof`` its
    base64 signature of the run and peer_id."""

    peer_id: pydantic.constr(strict=True, max_length=64)
    key: pydantic.constr(strict=True, max_length=64)
    proof: pydantic.constr(strict=True, max_length=128)


SubkeyWithEd25519Key = conbytes(regex=b".*" + PUBLIC_KEY_REGEX + b".*")


class SwarmSchema(pydantic.BaseModel):
    members: Dict[SubkeyWithEd25519Key, Optional[MemberRecord]]
    inputs: Dict[SubkeyWithEd25519Key, Optional[InputsRecord]]
    # the authority's signed revocation lists, one subkey per serial (peers/admission.py verifies them)
    revocations: Dict[pydantic.conint(ge=0), pydantic.constr(strict=True, max_length=1 << 20)]
