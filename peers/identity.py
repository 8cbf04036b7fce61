"""Node identity: one RSA key file gives both the libp2p peer_id and the DHT record signing key.

The file is libp2p's protobuf ``PrivateKey`` (type RSA, DER body), exactly what
``hivemind.P2P.generate_identity`` writes and p2pd reads, so ``--identity PATH`` pins the
peer_id across restarts and the same key signs the key binding of the Ed25519 key derived from it
(``hivemind.dht.crypto.RSASignatureValidator``; peers/signing.py), which signs the membership records.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey


class IdentityError(ValueError):
    """The identity file cannot be created or is not an RSA libp2p private key."""


def is_new_identity(path: str | os.PathLike | None) -> bool:
    """Whether ``load_or_create_identity(path)`` makes a new key: no path given, or no file there yet. Nobody
    else can hold such a key, so asking the swarm whether a peer already does is pointless."""
    return path is None or not Path(path).expanduser().exists()


def load_or_create_identity(path: str | os.PathLike | None) -> tuple[str, RSAPrivateKey]:
    """Return (identity file path, signing key); create the file (mode 0400) if it does not exist.

    With ``path=None`` a fresh identity is written to a private temporary directory (``dilocox-id-*``, mode 0700),
    which the caller removes when done with it (the node does at exit: daemon/node.py).
    """
    if path is None:
        path = Path(tempfile.mkdtemp(prefix="dilocox-id-")) / "identity.key"
    path = Path(path).expanduser()
    if not path.exists():
        if not path.parent.is_dir():
            raise IdentityError(f"identity directory {path.parent} does not exist")
        P2P.generate_identity(str(path))
    try:
        message = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        if message.key_type != crypto_pb2.KeyType.RSA:
            raise IdentityError(f"identity {path} holds a {crypto_pb2.KeyType.Name(message.key_type)} key; need RSA")
        der_key = serialization.load_der_private_key(message.data, password=None)
    except IdentityError:
        raise
    except Exception as e:  # protobuf DecodeError, ValueError from cryptography, OSError
        raise IdentityError(f"identity {path} is not a libp2p RSA private key: {e}") from e
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der_key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
    )})
    return str(path), key
