"""Swarm admission: an operator's Ed25519 authority certifies libp2p peer ids; nodes admit only certified peers.

Pure building block: files, signatures and checks, no network. Every failure is an ``AdmissionError`` whose
message names the file or field and the problem.

Formats (all times are integer unix seconds, UTC; all JSON is UTF-8):

- **Authority directory** ``DIR`` (``init_authority``):

  - ``DIR/authority.key``: the Ed25519 private key, PEM PKCS8, unencrypted, file mode 0600.
  - ``DIR/authority.pub``: its public key, PEM SubjectPublicKeyInfo (what nodes are given).
  - ``DIR/revoked.json``: the revocation list (below), once a peer has been revoked.

- **Authority fingerprint**: the first 16 hex characters (lowercase) of SHA-256 over the raw 32-byte public key.

- **Certificate** (a JSON object, written to a file as one line of canonical JSON plus a newline)::

      {"version": 1, "authority": <fingerprint>, "peer_id": <base58 libp2p peer id>, "role": "peer",
       "issued_at": <int s>, "expires_at": <int s>, "serial": <32 lowercase hex chars, random>,
       "signature": <base64 of the 64-byte Ed25519 signature>}

  The signature is over the canonical JSON of every other field:
  ``json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()``. Only role ``"peer"`` is accepted for
  now. A certificate is valid from ``issued_at - MAX_CLOCK_SKEW_S`` (so a peer whose clock is a little behind the
  operator's accepts a fresh certificate) until just before ``expires_at``. Accepted encoded size: at most
  ``MAX_CERTIFICATE_BYTES`` (4096) bytes.

- **Revocation list** ``DIR/revoked.json`` (a JSON object, canonical, one line plus a newline)::

      {"version": 1, "authority": <fingerprint>, "serial": <int >= 1, +1 per revoke>, "issued_at": <int s>,
       "revoked": <sorted list of distinct base58 peer ids>, "signature": <base64, over the rest as above>}

  A list never expires; a node adopts a list only if its serial is higher than the one it holds. Accepted
  encoded size: at most ``MAX_REVOCATIONS_BYTES`` (1 MiB, about 20,000 peer ids).

A **peer id** is accepted if it is the canonical base58 form of a libp2p multihash: sha2-256 (what RSA and
other large keys give, ``Qm...``, 34 bytes) or identity (Ed25519 and other small keys, ``12D3KooW...``).
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import json
import math
import os
import secrets
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from dilocox.peers.identity import load_or_create_identity
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

KEY_FILE = "authority.key"
PUB_FILE = "authority.pub"
REVOKED_FILE = "revoked.json"
VERSION = 1
ROLES = frozenset({"peer"})
MAX_CERTIFICATE_BYTES = 4096
MAX_REVOCATIONS_BYTES = 1 << 20
MAX_CLOCK_SKEW_S = 300  # a certificate is accepted this many seconds before its issued_at
MAX_TIMESTAMP = 253402300799  # 9999-12-31T23:59:59Z: keeps every time printable as an ISO date
MAX_PEER_ID_CHARS = 128  # real ones are 46 (Qm...) or 52 (12D3KooW...) characters
CACHE_SIZE = 1024  # verified (peer_id, certificate) pairs an Admission remembers

CERTIFICATE_FIELDS = ("version", "authority", "peer_id", "role", "issued_at", "expires_at", "serial", "signature")
REVOCATION_FIELDS = ("version", "authority", "serial", "issued_at", "revoked", "signature")
_BASE58 = frozenset("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz")
_HEX = frozenset("0123456789abcdef")
_SHA2_256, _IDENTITY = 0x12, 0x00  # multihash codes used by libp2p peer ids


class AdmissionError(ValueError):
    """A certificate, revocation list, key file or peer id is missing, malformed, or not acceptable."""


@dataclass(frozen=True)
class Certificate:
    """A verified certificate (fields as in the module docstring; times in unix seconds)."""

    version: int
    authority: str
    peer_id: str
    role: str
    issued_at: int
    expires_at: int
    serial: str
    signature: str

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def blob(self) -> str:
        """Compact canonical JSON of the whole certificate (what goes into membership records)."""
        return canonical_json(self.to_dict()).decode()


@dataclass(frozen=True)
class RevocationList:
    """A verified revocation list: ``serial`` (int, higher wins), ``issued_at`` (unix s), ``revoked`` peer ids."""

    serial: int
    issued_at: int
    revoked: frozenset
    authority: str
    signature: str

    def to_dict(self) -> dict:
        return {"version": VERSION, "authority": self.authority, "serial": self.serial, "issued_at": self.issued_at,
                "revoked": sorted(self.revoked), "signature": self.signature}

    @property
    def blob(self) -> str:
        """Compact canonical JSON of the signed list (what peers pass on to each other)."""
        return canonical_json(self.to_dict()).decode()


def canonical_json(value: Any) -> bytes:
    """The signed encoding: sorted keys, no spaces, UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def iso_utc(seconds: float) -> str:
    """Unix seconds as ISO 8601 UTC, ``YYYY-MM-DDTHH:MM:SSZ``."""
    return datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def fingerprint(public_key: Ed25519PublicKey) -> str:
    """First 16 hex chars of SHA-256 over the raw 32-byte Ed25519 public key."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------- peer ids


def _peer_id_problem(value: Any) -> str | None:
    """Why ``value`` is not a canonical base58 libp2p peer id, or None if it is one."""
    if not isinstance(value, str):
        return f"is a {type(value).__name__}, not a string"
    if not 1 <= len(value) <= MAX_PEER_ID_CHARS:
        return f"has {len(value)} characters (a libp2p peer id has 46 to {MAX_PEER_ID_CHARS})"
    if not _BASE58.issuperset(value):
        return "is not base58"
    raw = PeerID.from_base58(value).to_bytes()
    if PeerID(raw).to_base58() != value:
        return "is not in canonical base58 form"
    sha2 = len(raw) == 34 and raw[0] == _SHA2_256 and raw[1] == 32
    identity = 3 <= len(raw) <= 66 and raw[0] == _IDENTITY and raw[1] == len(raw) - 2
    if not (sha2 or identity):
        return "is not a sha2-256 or identity multihash"
    return None


def validate_peer_id(peer_id: Any, what: str = "peer id") -> str:
    """Return ``peer_id`` if it is a canonical base58 libp2p peer id; AdmissionError naming ``what`` otherwise."""
    problem = _peer_id_problem(peer_id)
    if problem:
        shown = f" {_show(peer_id)}" if isinstance(peer_id, str) else ""
        raise AdmissionError(f"{what}{shown} {problem}")
    return peer_id


def peer_id_of_identity(path: str | os.PathLike) -> str:
    """Base58 libp2p peer id of an identity file (peers/identity.py), creating the key if missing.

    Equal to what p2pd reports for ``--identity path``. Raises ``peers.identity.IdentityError``.
    """
    path, _ = load_or_create_identity(path)
    return PeerID.from_identity(Path(path).read_bytes()).to_base58()


def peer_id_of_public_key(public_key: bytes | rsa.RSAPublicKey) -> str:
    """Base58 libp2p peer id of an RSA public key: a ``cryptography`` key, or OpenSSH bytes (``ssh-rsa ...``, what
    hivemind's ``RSAPublicKey.to_bytes`` gives and DHT ``[owner:...]`` subkeys hold). AdmissionError if not RSA."""
    if isinstance(public_key, (bytes, bytearray)):
        try:
            public_key = serialization.load_ssh_public_key(bytes(public_key))
        except (ValueError, UnsupportedAlgorithm) as e:
            raise AdmissionError(f"not an OpenSSH public key: {e}") from None
    if not isinstance(public_key, rsa.RSAPublicKey):
        raise AdmissionError(f"need an RSA public key, got {type(public_key).__name__}")
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(bytes([_SHA2_256, 32]) + hashlib.sha256(encoded).digest()).to_base58()


# ------------------------------------------------------------------------------------------------------------- keys


def init_authority(directory: str | os.PathLike) -> Path:
    """Create ``DIR/authority.key`` (0600) and ``DIR/authority.pub``; return the path of authority.pub.

    Creates DIR if needed. AdmissionError if DIR/authority.key already exists (never overwritten); OSError if the
    files cannot be written.
    """
    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    key_path = directory / KEY_FILE
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    try:  # O_EXCL: two concurrent inits cannot both succeed, and an existing key is never replaced
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise AdmissionError(f"authority key {key_path} already exists; refusing to overwrite it") from None
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
        f.flush()
        os.fsync(f.fileno())
    pub_path = directory / PUB_FILE
    _write_atomic(pub_path, key.public_key().public_bytes(serialization.Encoding.PEM,
                                                          serialization.PublicFormat.SubjectPublicKeyInfo), 0o644)
    return pub_path


def load_authority_private(directory: str | os.PathLike) -> Ed25519PrivateKey:
    """The authority's private key from ``DIR/authority.key``; AdmissionError if missing, unreadable or not
    an unencrypted PEM Ed25519 key."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise AdmissionError(f"authority directory {directory} does not exist")
    path = directory / KEY_FILE
    data = _read_key_file(path, "authority key", f" (create one with `dilocox-ctl authority init {directory}`)")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise AdmissionError(f"authority key {path} is not an unencrypted PEM private key: {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise AdmissionError(f"authority key {path} holds a {type(key).__name__}; need Ed25519")
    return key


def load_authority_public(path: str | os.PathLike) -> Ed25519PublicKey:
    """The authority's public key from a PEM file (``authority.pub``; a directory means ``DIR/authority.pub``);
    AdmissionError if missing, unreadable or not Ed25519."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / PUB_FILE
    data = _read_key_file(path, "authority public key", "")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm) as e:
        raise AdmissionError(f"authority public key {path} is not a PEM public key: {e}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise AdmissionError(f"authority public key {path} holds a {type(key).__name__}; need Ed25519")
    return key


def _read_key_file(path: Path, what: str, hint: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(65537)
    except FileNotFoundError:
        raise AdmissionError(f"{what} {path} does not exist{hint}") from None
    except OSError as e:
        raise AdmissionError(f"{what} {path} cannot be read: {e.strerror or e}") from None
    if len(data) > 65536:
        raise AdmissionError(f"{what} {path} is over 64 KiB; not a key file")
    return data


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write via a temporary file in the same directory and os.replace, so readers see the old or the new file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _sign(key: Ed25519PrivateKey, fields: dict) -> str:
    return base64.b64encode(key.sign(canonical_json(fields))).decode()


# ----------------------------------------------------------------------------------------------------- certificates


def issue_certificate(directory: str | os.PathLike, peer_id: str, days: float = 365, role: str = "peer",
                      now: float | None = None) -> dict:
    """Sign a certificate for ``peer_id`` with the authority in ``directory``, valid ``days`` days from ``now``
    (unix s; default the current time). Returns the certificate as a dict (see the module docstring).

    AdmissionError if the authority cannot be loaded, ``peer_id`` is not a libp2p peer id, ``days`` is not a
    positive finite number (of at least one second) or the role is not accepted.
    """
    validate_peer_id(peer_id)
    if isinstance(days, bool) or not isinstance(days, (int, float)) or not math.isfinite(days) or days <= 0:
        raise AdmissionError(f"days must be a positive number, got {days!r}")
    if role not in ROLES:
        raise AdmissionError(f"role {_show(role)} is not accepted (accepted: {', '.join(sorted(ROLES))})")
    issued_at = int(time.time() if now is None else now)
    expires_at = issued_at + round(min(days, MAX_TIMESTAMP / 86400) * 86400)  # min(): no float overflow
    if expires_at <= issued_at:
        raise AdmissionError(f"days={days!r} is shorter than one second")
    if not (0 <= issued_at and expires_at <= MAX_TIMESTAMP):
        raise AdmissionError(f"validity from unix time {issued_at} for {days!r} days is outside 1970..9999")
    key = load_authority_private(directory)
    fields = {"version": VERSION, "authority": fingerprint(key.public_key()), "peer_id": peer_id, "role": role,
              "issued_at": issued_at, "expires_at": expires_at, "serial": secrets.token_hex(16)}
    return {**fields, "signature": _sign(key, fields)}


def write_certificate(cert: dict, path: str | os.PathLike) -> None:
    """Write ``cert`` to ``path`` (atomically, mode 0644) as one line of canonical JSON plus a newline.

    AdmissionError if ``cert`` is not shaped like a certificate (the signature is not checked); OSError on write.
    """
    fields = _certificate_fields(cert)
    _write_atomic(Path(path).expanduser(), canonical_json(fields) + b"\n", 0o644)


def read_certificate(path: str | os.PathLike) -> dict:
    """Read a certificate file and check its shape (not its signature: ``verify_certificate`` does that).

    AdmissionError naming the file if it is missing, unreadable, too large or malformed.
    """
    path = Path(path).expanduser()
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CERTIFICATE_BYTES + 2)  # +2: the trailing newline, and one byte to see it is too long
    except FileNotFoundError:
        raise AdmissionError(f"certificate {path} does not exist") from None
    except OSError as e:
        raise AdmissionError(f"certificate {path} cannot be read: {e.strerror or e}") from None
    try:
        return _certificate_fields(_parse(data.strip(), "certificate", MAX_CERTIFICATE_BYTES))
    except AdmissionError as e:
        raise AdmissionError(f"certificate {path}: {e}") from None


def verify_certificate(cert: dict | str | bytes, authority_public_key: Ed25519PublicKey, peer_id: str | None,
                       now: float) -> Certificate:
    """Check that ``cert`` is a well-formed certificate signed by ``authority_public_key``, issued for ``peer_id``
    (unless None), and valid at ``now`` (unix s). Returns the verified ``Certificate``.

    ``cert`` may come from the network: a dict, JSON text or UTF-8 bytes of at most 4096 bytes. Whatever it is,
    the only exception raised is AdmissionError, whose message says what is wrong (malformed field, other
    authority, bad signature, other peer, not yet valid, expired). Revocation is not checked here (``Admission``).
    """
    fields = _certificate_fields(_parse(cert, "certificate", MAX_CERTIFICATE_BYTES))
    expected = _fingerprint_of(authority_public_key)
    if fields["authority"] != expected:
        raise AdmissionError(f"certificate for peer {fields['peer_id']} is signed by another authority "
                             f"(fingerprint {fields['authority']}, expected {expected})")
    _check_signature(authority_public_key, fields, f"certificate for peer {fields['peer_id']}")
    if peer_id is not None and fields["peer_id"] != peer_id:
        raise AdmissionError(f"certificate issued for peer {fields['peer_id']}, not {_show_peer(peer_id)}")
    if now < fields["issued_at"] - MAX_CLOCK_SKEW_S:
        raise AdmissionError(f"certificate for peer {fields['peer_id']} is not valid before "
                             f"{iso_utc(fields['issued_at'])} (now {iso_utc(now)})")
    if now >= fields["expires_at"]:
        raise AdmissionError(f"certificate for peer {fields['peer_id']} expired on {iso_utc(fields['expires_at'])}")
    return Certificate(**fields)


def _certificate_fields(value: Any) -> dict:
    """The fields of a certificate-shaped JSON object, in CERTIFICATE_FIELDS order; AdmissionError otherwise."""
    fields = _exact_fields(value, CERTIFICATE_FIELDS, "certificate")
    m = "malformed certificate"
    _check_version(fields["version"], m)
    _check_hex(fields["authority"], 16, f"{m}: field 'authority'")
    problem = _peer_id_problem(fields["peer_id"])
    if problem:
        raise AdmissionError(f"{m}: field 'peer_id' {problem}")
    if not isinstance(fields["role"], str) or fields["role"] not in ROLES:
        raise AdmissionError(f"{m}: field 'role' is {_show(fields['role'])}; accepted: {', '.join(sorted(ROLES))}")
    for name in ("issued_at", "expires_at"):
        _check_time(fields[name], f"{m}: field {name!r}")
    if fields["expires_at"] <= fields["issued_at"]:
        raise AdmissionError(f"{m}: expires_at {fields['expires_at']} is not after issued_at {fields['issued_at']}")
    _check_hex(fields["serial"], 32, f"{m}: field 'serial'")
    _check_signature_text(fields["signature"], m)
    return fields


# --------------------------------------------------------------------------------------------------- revocations


def revoke(directory: str | os.PathLike, peer_id: str, now: float | None = None) -> dict:
    """Add ``peer_id`` to ``DIR/revoked.json`` (created if missing), bump its serial, re-sign it and replace the file
    atomically. Returns the new list as a dict. Revoking an already revoked peer still issues a new serial.

    AdmissionError if the authority cannot be loaded, ``peer_id`` is not a peer id, or the existing revoked.json is
    malformed or not signed by this authority. Not safe against two concurrent revokes on the same directory.
    """
    validate_peer_id(peer_id)
    key = load_authority_private(directory)
    path = Path(directory).expanduser() / REVOKED_FILE
    serial, revoked = 0, set()
    if path.exists():
        try:
            data = path.read_bytes()
        except OSError as e:
            raise AdmissionError(f"revocation list {path} cannot be read: {e.strerror or e}") from None
        try:
            current = verify_revocations(data.strip(), key.public_key())
        except AdmissionError as e:
            raise AdmissionError(f"revocation list {path}: {e}") from None
        serial, revoked = current.serial, set(current.revoked)
    fields = {"version": VERSION, "authority": fingerprint(key.public_key()), "serial": serial + 1,
              "issued_at": int(time.time() if now is None else now), "revoked": sorted(revoked | {peer_id})}
    signed = {**fields, "signature": _sign(key, fields)}
    _write_atomic(path, canonical_json(signed) + b"\n", 0o644)
    return signed


def verify_revocations(blob: dict | str | bytes, authority_public_key: Ed25519PublicKey) -> RevocationList:
    """Check that ``blob`` (a dict, JSON text or UTF-8 bytes of at most 1 MiB) is a well-formed revocation list
    signed by ``authority_public_key``; return it. Only AdmissionError is raised, whatever the input."""
    fields = _exact_fields(_parse(blob, "revocation list", MAX_REVOCATIONS_BYTES), REVOCATION_FIELDS,
                           "revocation list")
    m = "malformed revocation list"
    _check_version(fields["version"], m)
    _check_hex(fields["authority"], 16, f"{m}: field 'authority'")
    serial = fields["serial"]
    if type(serial) is not int or not 1 <= serial <= 2**53:
        raise AdmissionError(f"{m}: field 'serial' must be an integer from 1 to 2**53, got {_show(serial)}")
    _check_time(fields["issued_at"], f"{m}: field 'issued_at'")
    revoked = fields["revoked"]
    if not isinstance(revoked, list):
        raise AdmissionError(f"{m}: field 'revoked' must be a list of peer ids, got {type(revoked).__name__}")
    for i, item in enumerate(revoked):
        problem = _peer_id_problem(item)
        if problem:
            raise AdmissionError(f"{m}: revoked[{i}] {problem}")
        if i and revoked[i - 1] >= item:  # sorted and distinct: one canonical encoding per set
            raise AdmissionError(f"{m}: field 'revoked' is not sorted and free of duplicates at index {i}")
    _check_signature_text(fields["signature"], m)
    expected = _fingerprint_of(authority_public_key)
    if fields["authority"] != expected:
        raise AdmissionError(f"revocation list is signed by another authority "
                             f"(fingerprint {fields['authority']}, expected {expected})")
    if len(canonical_json(fields)) > MAX_REVOCATIONS_BYTES:  # a dict given directly skipped the size check
        raise AdmissionError(f"revocation list is over {MAX_REVOCATIONS_BYTES} bytes")
    _check_signature(authority_public_key, fields, f"revocation list serial {serial}")
    return RevocationList(serial=serial, issued_at=fields["issued_at"], revoked=frozenset(revoked),
                          authority=fields["authority"], signature=fields["signature"])


# ------------------------------------------------------------------------------------------------ parsing helpers


def _parse(value: Any, what: str, limit: int) -> Any:
    """A dict as is; JSON text or UTF-8 bytes of at most ``limit`` bytes parsed (no NaN, no duplicate keys)."""
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        if len(value) > limit:  # checked before encoding: every character is at least one byte
            raise AdmissionError(f"malformed {what}: over {limit} bytes")
        try:
            value = value.encode("utf-8")
        except UnicodeEncodeError:
            raise AdmissionError(f"malformed {what}: text is not encodable as UTF-8") from None
    elif isinstance(value, (bytes, bytearray)):
        value = bytes(value)
    else:
        raise AdmissionError(f"malformed {what}: expected a JSON object, text or bytes, got {type(value).__name__}")
    if len(value) > limit:
        raise AdmissionError(f"malformed {what}: {len(value)} bytes, over {limit}")
    try:
        return json.loads(value.decode("utf-8"), object_pairs_hook=_object_without_duplicates,
                          parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise AdmissionError(f"malformed {what}: not UTF-8") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, our hooks, too many digits; too deep nesting
        raise AdmissionError(f"malformed {what}: not JSON ({type(e).__name__}: {str(e)[:200]})") from None


def _object_without_duplicates(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key in object")
    return out


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


def _exact_fields(value: Any, names: tuple[str, ...], what: str) -> dict:
    if not isinstance(value, dict):
        raise AdmissionError(f"malformed {what}: expected a JSON object, got {type(value).__name__}")
    missing = [n for n in names if n not in value]
    if missing:
        raise AdmissionError(f"malformed {what}: missing field(s) {', '.join(missing)}")
    if len(value) != len(names):
        extra = sorted(_show(k) for k in value if k not in names)
        raise AdmissionError(f"malformed {what}: unexpected field(s) {', '.join(extra[:5])}")
    return {n: value[n] for n in names}


def _check_version(value: Any, m: str) -> None:
    if type(value) is not int or value != VERSION:
        raise AdmissionError(f"{m}: unsupported version {_show(value)} (expected {VERSION})")


def _check_hex(value: Any, length: int, where: str) -> None:
    if not isinstance(value, str) or len(value) != length or not _HEX.issuperset(value):
        raise AdmissionError(f"{where} must be {length} lowercase hex characters, got {_show(value)}")


def _check_time(value: Any, where: str) -> None:
    if type(value) is not int or not 0 <= value <= MAX_TIMESTAMP:  # type(): a bool is an int too
        raise AdmissionError(f"{where} must be integer unix seconds from 0 to {MAX_TIMESTAMP}, got {_show(value)}")


def _check_signature_text(value: Any, m: str) -> None:
    try:
        raw = base64.b64decode(value, validate=True) if isinstance(value, str) and len(value) == 88 else b""
    except (binascii.Error, ValueError):
        raw = b""
    # re-encoding must give the same text: one accepted spelling per signature
    if len(raw) != 64 or base64.b64encode(raw).decode() != value:
        raise AdmissionError(f"{m}: field 'signature' must be the base64 of 64 bytes")


def _check_signature(public_key: Ed25519PublicKey, fields: dict, what: str) -> None:
    unsigned = {k: v for k, v in fields.items() if k != "signature"}
    try:
        public_key.verify(base64.b64decode(fields["signature"]), canonical_json(unsigned))
    except InvalidSignature:
        raise AdmissionError(f"{what}: bad signature (a field was changed after signing, "
                             f"or it was signed with another key)") from None


def _fingerprint_of(public_key: Any) -> str:
    if not isinstance(public_key, Ed25519PublicKey):
        raise AdmissionError(f"authority public key must be Ed25519, got {type(public_key).__name__}")
    return fingerprint(public_key)


def _show_peer(value: Any) -> str:
    """A well-formed peer id as is, anything else through _show."""
    return value if _peer_id_problem(value) is None else _show(value)


def _show(value: Any, limit: int = 60) -> str:
    """repr of an untrusted value, cut short so a huge input cannot flood a log line."""
    text = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= limit else text[:limit] + "..."


# ------------------------------------------------------------------------------------------------------- Admission


class Admission:
    """This node's admission state: our verified certificate, the authority's key, the newest revocation list,
    and a cache of peers' verified certificates. Thread-safe.

    The constructor verifies our own certificate for ``peer_id`` at ``clock()`` (unix s) and raises AdmissionError
    if it is invalid, expired or revoked, so a node without a valid certificate can say so and exit.
    """

    def __init__(self, authority_public_key: Ed25519PublicKey, certificate: dict | str, peer_id: str,
                 revocations: RevocationList | None = None, clock: Callable[[], float] = time.time):
        self._key = authority_public_key
        self._fingerprint = _fingerprint_of(authority_public_key)
        self._clock = clock
        self._lock = threading.Lock()
        self._verified: collections.OrderedDict[tuple, Certificate] = collections.OrderedDict()
        self._own = verify_certificate(certificate, authority_public_key, peer_id, clock())
        self._revocations: RevocationList | None = None
        if revocations is not None:  # re-verified: a hand-built RevocationList must not bypass the signature
            self._revocations = verify_revocations(revocations.to_dict(), authority_public_key)
        if self.is_revoked(peer_id):
            raise AdmissionError(f"our certificate for peer {peer_id} is revoked "
                                 f"(revocation list serial {self._revocations.serial})")

    @property
    def peer_id(self) -> str:
        return self._own.peer_id

    @property
    def certificate(self) -> Certificate:
        return self._own

    @property
    def certificate_blob(self) -> str:
        """Compact canonical JSON of our certificate, to be put into membership records."""
        return self._own.blob

    @property
    def expires_at(self) -> int:
        """When our own certificate expires (unix s)."""
        return self._own.expires_at

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def revocations(self) -> RevocationList | None:
        with self._lock:
            return self._revocations

    @property
    def revocations_blob(self) -> str | None:
        """Compact canonical JSON of the revocation list we hold, to pass on to peers; None if we hold none."""
        with self._lock:
            return None if self._revocations is None else self._revocations.blob

    def is_revoked(self, peer_id: str) -> bool:
        with self._lock:
            return self._revocations is not None and peer_id in self._revocations.revoked

    def check(self, peer_id: str, certificate_blob: str) -> str | None:
        """None if ``peer_id`` may take part (its certificate verifies, is unexpired and not revoked), else why not.

        Successful verifications are cached per (peer_id, blob); expiry and revocation are re-checked every call.
        """
        if not isinstance(peer_id, str):
            return f"peer id is a {type(peer_id).__name__}, not a string"
        if not isinstance(certificate_blob, (str, bytes)) or not certificate_blob:
            return f"peer {_show_peer(peer_id)} sent no admission certificate"
        key = (peer_id, certificate_blob)
        with self._lock:
            cert = self._verified.get(key)
            if cert is not None:
                self._verified.move_to_end(key)
        now = self._clock()
        if cert is None:
            try:
                cert = verify_certificate(certificate_blob, self._key, peer_id, now)
            except AdmissionError as e:
                return str(e)
            with self._lock:
                self._verified[key] = cert
                while len(self._verified) > CACHE_SIZE:
                    self._verified.popitem(last=False)
        if now >= cert.expires_at:
            return f"certificate for peer {peer_id} expired on {iso_utc(cert.expires_at)}"
        with self._lock:
            revocations = self._revocations
        if revocations is not None and peer_id in revocations.revoked:
            return f"peer {peer_id} is revoked (revocation list serial {revocations.serial})"
        return None

    def update_revocations(self, blob: dict | str | bytes) -> bool:
        """Adopt the revocation list ``blob`` if it verifies and its serial is higher than ours; True if adopted.

        AdmissionError if it is malformed or not signed by our authority.
        """
        incoming = verify_revocations(blob, self._key)
        with self._lock:
            if self._revocations is not None and incoming.serial <= self._revocations.serial:
                return False
            self._revocations = incoming
            return True
