"""Record validators that remember verdicts (peers/validation.py): same verdicts as hivemind's, each record
checked once, a changed record checked afresh, a merged schema empties the cache."""

from __future__ import annotations

import dataclasses

import pytest
from dilocox.peers.records import KeyBinding, MemberRecord, SwarmSchema
from dilocox.peers.signing import Ed25519SignatureValidator, derive_signing_key
from dilocox.peers.validation import CachedSchemaValidator, CachedSignatureValidator, VerdictCache
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer


def _member_record(validators: CompositeValidator, signer: RSASignatureValidator, outer_step: int,
                   expiration_time: float = 2e9) -> DHTRecord:
    """An RSA-signed record as hivemind's DHT stores it (a key binding, the swarm's RSA-protected record, under a key
    the schema has no field for: key id, serialized subkey and value, then signed); ``outer_step`` tells versions
    apart."""
    value = KeyBinding(peer_id="QmPeer", key="a" * 44, proof=f"step{outer_step}").dict()
    record = DHTRecord(key=DHTID.generate(source="run_key.aaaa").to_bytes(),
                       subkey=MSGPackSerializer.dumps(signer.local_public_key),
                       value=MSGPackSerializer.dumps(value), expiration_time=expiration_time)
    return dataclasses.replace(record, value=validators.sign_value(record))


def test_cached_validators_give_hivemind_verdicts_once_per_record():
    key = RSAPrivateKey()
    signer, schema = CachedSignatureValidator(key), CachedSchemaValidator(SwarmSchema, prefix="run")
    ours = CompositeValidator([schema, signer])
    plain = CompositeValidator([SchemaValidator(SwarmSchema, prefix="run"), RSASignatureValidator(key)])
    record = _member_record(ours, signer, outer_step=3)
    assert plain.validate(record) and ours.validate(record)
    for _ in range(5):  # the same record returned by five DHT peers
        assert ours.validate(dataclasses.replace(record))
    assert (signer.verdicts.misses, signer.verdicts.hits) == (1, 5)
    assert (schema.verdicts.misses, schema.verdicts.hits) == (1, 5)

    # a forged copy: the signature of step 3 over the value of step 4
    forged_value = MSGPackSerializer.dumps(KeyBinding(**{**MSGPackSerializer.loads(
        RSASignatureValidator().strip_value(record)), "proof": "step4"}).dict())
    signature = record.value[len(RSASignatureValidator().strip_value(record)):]
    forged = dataclasses.replace(record, value=forged_value + signature)
    assert not plain.validate(forged)
    assert not ours.validate(forged) and not ours.validate(forged)  # refused, and refused again from the cache
    assert signer.verdicts.misses == 2

    # a republication (new expiration time) is a new record: checked afresh
    again = _member_record(ours, signer, outer_step=3, expiration_time=2e9 + 1)
    assert ours.validate(again) and signer.verdicts.misses == 3


def test_a_malformed_value_is_refused_by_the_cached_schema_validator():
    signer = Ed25519SignatureValidator(derive_signing_key(RSAPrivateKey()))
    schema = CachedSchemaValidator(SwarmSchema, prefix="run")
    ours = CompositeValidator([schema, signer])
    value = MemberRecord(peer_id="QmPeer", run_id="run", state="TRAINING", outer_step=3, inner_step=1,
                         inner_steps=20, tokens_per_second=1.0, loss=2.0, global_params_digest="d").wire()
    record = DHTRecord(key=DHTID.generate(source="run_members").to_bytes(),
                       subkey=MSGPackSerializer.dumps(signer.local_public_key),
                       value=MSGPackSerializer.dumps(value), expiration_time=2e9)
    record = dataclasses.replace(record, value=ours.sign_value(record))
    assert ours.validate(record)
    stripped = signer.strip_value(record)
    bad = dataclasses.replace(record, value=MSGPackSerializer.dumps({"peer_id": 5}))
    assert schema.validate(dataclasses.replace(record, value=stripped))
    assert not schema.validate(bad) and not schema.validate(bad)
    assert (schema.verdicts.misses, schema.verdicts.hits) == (2, 2)


def test_records_travel_under_short_names_and_the_long_names_are_refused():
    """MemberRecord.wire(): the fields' short names (peers/records.py, ``_Record``), which hivemind's SchemaValidator
    accepts; the same record under the field names (how nodes before 2026-12-02 stored it) is refused."""
    schema = SchemaValidator(SwarmSchema, prefix="run")
    record = MemberRecord(peer_id="QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", run_id="run", state="AVERAGING",
                          outer_step=12, round=13, inner_step=240, inner_steps=20, tokens_per_second=1234.5,
                          loss=2.3, global_params_digest="0123456789abcdef", result_step=12,
                          result_digest="0123456789abcdef", settings="0123456789abcdef")

    subkey = MSGPackSerializer.dumps(Ed25519SignatureValidator(derive_signing_key(RSAPrivateKey())).local_public_key)

    def stored(value: dict) -> DHTRecord:
        return DHTRecord(key=DHTID.generate(source="run_members").to_bytes(), subkey=subkey,
                         value=MSGPackSerializer.dumps(value), expiration_time=2e9)
    short, long = MSGPackSerializer.dumps(record.wire()), MSGPackSerializer.dumps(record.dict())
    assert schema.validate(stored(record.wire())) and MemberRecord.parse_obj(record.wire()) == record
    assert not schema.validate(stored(record.dict()))
    assert len(short) < 0.55 * len(long), (len(short), len(long))  # 238 of 458 bytes


def test_merging_a_schema_empties_the_cache_and_the_cache_stays_bounded():
    schema = CachedSchemaValidator(SwarmSchema, prefix="run", allow_extra_keys=False)
    unknown = DHTRecord(key=b"elsewhere", subkey=b"", value=b"", expiration_time=2e9)
    assert not schema.validate(unknown) and not schema.validate(unknown)
    assert schema.verdicts.hits == 1
    # the merged validator allows extra keys (hivemind's default), so the verdict changes: the cache must not hide it
    assert schema.merge_with(SchemaValidator(SwarmSchema, prefix="other"))
    assert schema.validate(unknown) and schema.verdicts.misses == 2

    cache = VerdictCache(size=3)
    checks = []
    for i in [1, 2, 3, 1, 4, 2]:  # 1 is used again before 4 arrives, so 2 is the one evicted
        cache.verdict(DHTRecord(key=bytes([i]), subkey=b"", value=b"", expiration_time=0.0),
                      lambda r: checks.append(r.key) or True)
    assert checks == [b"\x01", b"\x02", b"\x03", b"\x04", b"\x02"]
    with pytest.raises(ValueError, match="at least one record"):
        VerdictCache(size=0)


def test_a_union_proposal_in_a_record_is_bounded():
    """``union`` (daemon/majority.py) comes from peers: digests of 16 hex digits, at most 1024 of them."""
    import pydantic.v1 as pydantic

    base = dict(peer_id="QmPeer", run_id="run", state="TRAINING", outer_step=1, inner_step=1, inner_steps=20,
                tokens_per_second=1.0, loss=2.0, global_params_digest="d", result_step=1, result_digest="a" * 16)
    assert MemberRecord(**base, union=["a" * 16, "b" * 16]).union == ["a" * 16, "b" * 16]
    for bad, why in ((["a" * 17], "at most 16"), ([f"{i:016x}" for i in range(1025)], "at most 1024"),
                     ([7], "str")):
        with pytest.raises(pydantic.ValidationError, match=why):
            MemberRecord(**base, union=bad)
