"""Compact record signatures (peers/signing.py): Ed25519 keys bound to RSA peer_ids sign the membership records.

Unit tests of the validator and the bindings, then real Swarms on loopback: a record signed by one peer's key that
claims another's peer_id is not counted, and a binding of another peer's key without that key's proof is ignored."""

from __future__ import annotations

import base64
import dataclasses
import pickle
import time

import pytest
from dilocox.peers.identity import load_or_create_identity
from dilocox.peers.records import MemberRecord, SwarmSchema
from dilocox.peers.signing import (
    Ed25519SignatureValidator,
    derive_signing_key,
    make_binding,
    public_key_marker,
    verify_binding,
)
from dilocox.peers.swarm import Swarm
from dilocox.peers.validation import CachedSchemaValidator, CachedSignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

RUN = "sign"


def _record(peer_id: str = "QmPeer", outer_step: int = 3) -> MemberRecord:
    return MemberRecord(peer_id=peer_id, run_id=RUN, state="TRAINING", outer_step=outer_step, inner_step=1,
                        inner_steps=20, tokens_per_second=1.0, loss=2.0, global_params_digest="d" * 64)


def _signed(validators: CompositeValidator, subkey: bytes, value: dict, expiration_time: float = 2e9) -> DHTRecord:
    """A record as hivemind's DHT stores it under ``{RUN}_members``: key id, serialized subkey and value, signed."""
    record = DHTRecord(key=DHTID.generate(source=f"{RUN}_members").to_bytes(), subkey=MSGPackSerializer.dumps(subkey),
                       value=MSGPackSerializer.dumps(value), expiration_time=expiration_time)
    return dataclasses.replace(record, value=validators.sign_value(record))


def _validators(rsa: RSAPrivateKey) -> tuple[CompositeValidator, Ed25519SignatureValidator]:
    """The node's validators (peers/swarm.py): schema, RSA and Ed25519."""
    compact = Ed25519SignatureValidator(derive_signing_key(rsa))
    return CompositeValidator([CachedSchemaValidator(SwarmSchema, prefix=RUN), CachedSignatureValidator(rsa),
                               compact]), compact


def test_a_signed_record_validates_and_a_tampered_or_foreign_one_does_not():
    ours, compact = _validators(RSAPrivateKey())
    record = _signed(ours, compact.local_public_key, _record().wire())
    assert ours.validate(record)
    assert ours.validate(dataclasses.replace(record))  # the same record again: the cached verdict
    # the value of step 4 under the signature of step 3
    stripped = compact.strip_value(record)
    forged = MSGPackSerializer.dumps(_record(outer_step=4).wire()) + record.value[len(stripped):]
    assert not ours.validate(dataclasses.replace(record, value=forged))
    # another node's key signs a record under our subkey
    theirs, _ = _validators(RSAPrivateKey())
    other = Ed25519SignatureValidator(derive_signing_key(RSAPrivateKey()))
    foreign = _signed(CompositeValidator([other]), other.local_public_key, _record().wire())
    assert not theirs.validate(dataclasses.replace(foreign, subkey=record.subkey))
    # unsigned, twice signed, two keys in one subkey, a subkey that is no Ed25519 key: refused
    unsigned = dataclasses.replace(record, value=stripped)
    assert not ours.validate(unsigned)
    assert not ours.validate(dataclasses.replace(record, value=record.value + record.value[len(stripped):]))
    both = MSGPackSerializer.dumps(compact.local_public_key + other.local_public_key)
    assert not ours.validate(dataclasses.replace(record, subkey=both))
    assert not ours.validate(dataclasses.replace(record, subkey=MSGPackSerializer.dumps(b"[ed25519:AAAA]")))
    # a republication (new expiration time) is checked afresh and holds
    assert ours.validate(_signed(ours, compact.local_public_key, _record().wire(), expiration_time=2e9 + 1))


def test_a_compact_record_is_about_half_the_bytes_of_an_rsa_signed_one():
    rsa = RSAPrivateKey()
    ours, compact = _validators(rsa)
    signer = CachedSignatureValidator(rsa)
    record = _signed(ours, compact.local_public_key, _record().wire())
    # the RSA-signed record of before: the subkey held the RSA key, the value its signature
    rsa_signed = DHTRecord(record.key, MSGPackSerializer.dumps(signer.local_public_key),
                           MSGPackSerializer.dumps(_record().wire()), record.expiration_time)
    rsa_signed = dataclasses.replace(rsa_signed, value=signer.sign_value(rsa_signed))
    compact_bytes, rsa_bytes = len(record.subkey) + len(record.value), len(rsa_signed.subkey) + len(rsa_signed.value)
    assert compact_bytes < 0.6 * rsa_bytes, (compact_bytes, rsa_bytes)
    assert len(record.subkey) + len(record.value) - len(MSGPackSerializer.dumps(_record().wire())) < 170


def test_the_signing_key_follows_the_identity_and_survives_pickling():
    rsa = RSAPrivateKey()
    assert public_key_marker(derive_signing_key(rsa)) == public_key_marker(derive_signing_key(rsa))
    assert public_key_marker(derive_signing_key(rsa)) != public_key_marker(derive_signing_key(RSAPrivateKey()))
    compact = Ed25519SignatureValidator(derive_signing_key(rsa))
    copy = pickle.loads(pickle.dumps(compact))  # as the DHT process receives it
    assert copy.local_public_key == compact.local_public_key
    record = _signed(CompositeValidator([copy]), copy.local_public_key, _record().wire())
    assert compact.validate(record)


def test_a_binding_holds_only_for_its_key_run_and_peer_id():
    key = derive_signing_key(RSAPrivateKey())
    b = make_binding(key, RUN, "QmPeer")
    assert verify_binding(RUN, "QmPeer", b["key"], b["proof"]) == public_key_marker(key)
    assert verify_binding(RUN, "QmOther", b["key"], b["proof"]) is None  # another peer_id
    assert verify_binding("other-run", "QmPeer", b["key"], b["proof"]) is None
    other = make_binding(derive_signing_key(RSAPrivateKey()), RUN, "QmPeer")
    assert verify_binding(RUN, "QmPeer", b["key"], other["proof"]) is None  # another key's proof
    for bad_key, bad_proof in (("not base64!", b["proof"]), (base64.b64encode(b"short").decode(), b["proof"]),
                               (b["key"], "not base64!"), (b["key"], "")):
        assert verify_binding(RUN, "QmPeer", bad_key, bad_proof) is None


@pytest.fixture
def swarms(tmp_path):
    started = []

    def start(name: str) -> Swarm:
        path, key = load_or_create_identity(tmp_path / f"{name}.key")
        initial = [] if not started else started[0].visible_maddrs()
        s = Swarm(RUN, key, initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
                  identity_path=path, ttl_s=30.0, check_identity=False)
        started.append(s)
        return s
    yield start
    for s in started:
        s.shutdown()


def _wait_for_members(swarm: Swarm, peers: set[str], timeout_s: float = 20.0) -> dict[str, int]:
    """peer_id -> outer_step of the members ``swarm`` counts, once ``peers`` are among them (at most ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = {r.peer_id: r.outer_step for r, _ in swarm.members(max_age_s=0.0)}
        if peers <= set(seen) or time.monotonic() > deadline:
            return seen
        time.sleep(0.3)


@pytest.mark.integration
def test_a_record_claiming_another_peer_id_is_not_counted(swarms):
    a, b, c = swarms("a"), swarms("b"), swarms("c")
    assert b.publish(_record(b.peer_id, outer_step=3))
    assert c.publish(_record(c.peer_id, outer_step=1))
    assert _wait_for_members(a, {b.peer_id, c.peer_id}) == {b.peer_id: 3, c.peer_id: 1}
    # c now speaks for b, with its own key (bound to c): the DHT takes it (c's signature holds), a ignores it
    assert c.publish(_record(b.peer_id, outer_step=9))
    seen = _wait_for_members(a, {b.peer_id})
    assert seen == {b.peer_id: 3}, seen  # b as b says; c, whose record now claims b, not counted
    assert a.refusal(c.public_key, _record(b.peer_id)) == \
        f"it claims peer_id {b.peer_id} but is signed by {c.peer_id}"


@pytest.mark.integration
def test_a_binding_without_its_keys_proof_or_under_another_rsa_key_binds_nothing(swarms, tmp_path):
    a, b, d = swarms("a"), swarms("b"), swarms("d")
    d_key = derive_signing_key(load_or_create_identity(tmp_path / "d.key")[1])  # d's own Ed25519 key
    assert d.publish(_record(d.peer_id, outer_step=1))  # stores d's binding, then its record
    # d replaces its binding by one of b's key to d, with a proof made by d's key, not b's, and stores the same
    # where b's binding goes
    key_of_b = b.public_key[len(b"[ed25519:"):-1].decode()
    expires = get_dht_time() + 1000  # later than d's own binding's, so it takes its place
    forged = {"peer_id": d.peer_id, "key": key_of_b, "proof": make_binding(d_key, RUN, d.peer_id)["proof"]}
    for where in (d.binding_key(d.public_key), d.binding_key(b.public_key)):
        assert d.dht.store(where, subkey=d.rsa_public_key, value=forged, expiration_time=expires)
    seen = _wait_for_members(a, {d.peer_id}, timeout_s=4.0)
    assert d.peer_id not in seen, seen  # d's record: its key is bound by nothing that holds
    assert b.publish(_record(b.peer_id, outer_step=3))
    assert _wait_for_members(a, {b.peer_id}) == {b.peer_id: 3}  # b's key was not bound to d
    # under its own RSA key, d binds its own key, with a true proof, to b's peer_id, and speaks for b
    as_b = make_binding(d_key, RUN, b.peer_id)
    assert verify_binding(RUN, b.peer_id, as_b["key"], as_b["proof"]) is not None
    assert d.dht.store(d.binding_key(d.public_key), subkey=d.rsa_public_key, value=as_b, expiration_time=expires + 1)
    assert d.publish(_record(b.peer_id, outer_step=9))
    e = swarms("e")  # a reader that learns every binding afresh
    seen = _wait_for_members(e, {b.peer_id})
    assert seen == {b.peer_id: 3}, seen
    assert e.refusal(d.public_key, _record(b.peer_id)).endswith("signed by a key bound to no peer_id")
