"""Compact record signatures: an Ed25519 key per node, bound to its RSA identity, signs its frequent DHT records.

hivemind's ``RSASignatureValidator`` puts the owner's 2048-bit RSA public key in each protected subkey (388 bytes,
``[owner:ssh-rsa ...]``) and a 256-byte signature, base64 in ``[signature:...]``, in each value (356 bytes): about
750 of the 1,340 bytes a membership record costs on the wire. Every read of the members key returns every member's
record from each DHT peer asked, so at 32 members those markers were over half of the membership bytes (issue 29,
docs/protocol.md, "Membership records"). An Ed25519 key (RFC 8032: 32-byte public key, 64-byte signature) marks the
same ownership in 54 + 102 bytes.

The node's libp2p identity, and so its peer_id and its swarm certificate, stays RSA. The Ed25519 key is derived from
the RSA private key (HKDF-SHA256, RFC 5869), so a restarted node signs with the same key. It is bound to the peer_id
by a ``binding``: the Ed25519 key's signature over the run and the peer_id (proof that the binder holds that key, so
nobody can bind someone else's key to their own peer_id), stored under the binder's RSA subkey, which only the RSA
key's holder can write (``RSASignatureValidator``). Readers look a record's key up in the bindings they have checked
(``verify_binding``) and count the record only for that peer_id (peers/swarm.py).

``Ed25519SignatureValidator`` follows hivemind's ``RSASignatureValidator`` through its documented override points
(``RecordValidatorBase``: validate, sign_value, strip_value, priority, merge_with), with its own markers, which the
RSA validator's regular expressions do not match, and remembers its verdicts (peers/validation.py, ``VerdictCache``).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import re
from typing import Optional

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from dilocox.peers.validation import CACHE_RECORDS, VerdictCache
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey

PUBLIC_KEY_FORMAT = b"[ed25519:_key_]"
SIGNATURE_FORMAT = b"[ed25519-signature:_value_]"
PUBLIC_KEY_REGEX = re.escape(PUBLIC_KEY_FORMAT).replace(b"_key_", rb"([A-Za-z0-9+/=]+?)")
_PUBLIC_KEY_RE = re.compile(PUBLIC_KEY_REGEX)
_SIGNATURE_RE = re.compile(re.escape(SIGNATURE_FORMAT).replace(b"_value_", rb"([A-Za-z0-9+/=]+?)"))
_DERIVATION = b"dilocox membership-record signing key v1"
_BINDING = b"dilocox key binding v1\x00"


def derive_signing_key(identity: RSAPrivateKey) -> Ed25519PrivateKey:
    """The node's Ed25519 record-signing key: HKDF-SHA256 of its RSA identity's DER private key (the same key for
    the same identity file, so a restart needs no new binding)."""
    seed = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_DERIVATION).derive(identity.to_bytes())
    return Ed25519PrivateKey.from_private_bytes(seed)


def _raw_public(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def public_key_marker(key: Ed25519PrivateKey) -> bytes:
    """The subkey that marks ``key``'s records: ``[ed25519:<base64 of the 32-byte public key>]``."""
    return PUBLIC_KEY_FORMAT.replace(b"_key_", base64.b64encode(_raw_public(key)))


def _public_key_of(encoded: bytes) -> Optional[Ed25519PublicKey]:
    try:
        raw = base64.b64decode(encoded, validate=True)
        return Ed25519PublicKey.from_public_bytes(raw) if len(raw) == 32 else None
    except (binascii.Error, ValueError):
        return None


def _binding_message(run_id: str, peer_id: str) -> bytes:
    return _BINDING + run_id.encode() + b"\x00" + peer_id.encode()


def make_binding(key: Ed25519PrivateKey, run_id: str, peer_id: str) -> dict:
    """A binding of ``key`` to ``peer_id`` in run ``run_id``: {"peer_id", "key" (base64 public key), "proof"
    (base64 Ed25519 signature of the run and peer_id)}. Stored under the peer's RSA subkey (peers/swarm.py)."""
    return {"peer_id": peer_id, "key": base64.b64encode(_raw_public(key)).decode(),
            "proof": base64.b64encode(key.sign(_binding_message(run_id, peer_id))).decode()}


def verify_binding(run_id: str, peer_id: str, key: str, proof: str) -> Optional[bytes]:
    """The subkey marker of a binding's key if ``proof`` is that key's signature of ``run_id`` and ``peer_id``, else
    None. (That the binding came from ``peer_id`` is the RSA subkey's signature, checked by the DHT's validators;
    the caller checks that the RSA key is peer_id's.)"""
    public = _public_key_of(key.encode())
    if public is None:
        return None
    try:
        public.verify(base64.b64decode(proof.encode(), validate=True), _binding_message(run_id, peer_id))
    except (InvalidSignature, binascii.Error, ValueError):
        return None
    return PUBLIC_KEY_FORMAT.replace(b"_key_", key.encode())


class Ed25519SignatureValidator(RecordValidatorBase):
    """Protected records whose key or subkey holds ``[ed25519:<public key>]`` must carry that key's signature over
    the record (key, subkey, value without the signature, expiration time: the bytes hivemind's RSA validator
    signs) in ``[ed25519-signature:...]``; signs records marked with our own key. Verdicts are cached per record.
    Picklable (the DHT process receives it): the private key travels as its raw 32 bytes."""

    def __init__(self, private_key: Ed25519PrivateKey, cache_size: int = CACHE_RECORDS):
        self._private_key = private_key
        self.local_public_key = public_key_marker(private_key)
        self.verdicts = VerdictCache(cache_size)

    def __getstate__(self):
        raw = self._private_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                              serialization.NoEncryption())
        return {"raw": raw, "cache_size": self.verdicts.size}

    def __setstate__(self, state):
        self.__init__(Ed25519PrivateKey.from_private_bytes(state["raw"]), state["cache_size"])

    def validate(self, record: DHTRecord) -> bool:
        return self.verdicts.verdict(record, self._validate)

    def _validate(self, record: DHTRecord) -> bool:
        keys = _PUBLIC_KEY_RE.findall(record.key)
        if record.subkey is not None:
            keys += _PUBLIC_KEY_RE.findall(record.subkey)
        if not keys:
            return True  # not protected by an Ed25519 key
        if len(set(keys)) > 1:
            return False
        public = _public_key_of(keys[0])
        signatures = _SIGNATURE_RE.findall(record.value)
        if public is None or len(signatures) != 1:
            return False
        try:
            signature = base64.b64decode(signatures[0], validate=True)
            public.verify(signature, self._serialize(dataclasses.replace(record, value=self.strip_value(record))))
        except (InvalidSignature, binascii.Error, ValueError):
            return False
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        if self.local_public_key not in record.key and self.local_public_key not in (record.subkey or b""):
            return record.value
        signature = base64.b64encode(self._private_key.sign(self._serialize(record)))
        return record.value + SIGNATURE_FORMAT.replace(b"_value_", signature)

    def strip_value(self, record: DHTRecord) -> bytes:
        return _SIGNATURE_RE.sub(b"", record.value)

    @staticmethod
    def _serialize(record: DHTRecord) -> bytes:
        return MSGPackSerializer.dumps(dataclasses.astuple(record))

    @property
    def priority(self) -> int:
        return 10  # as hivemind's RSA validator: before the validators that deserialize the value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, Ed25519SignatureValidator)  # one signing key per DHT, as for RSA
