"""Node identity: one RSA key file gives both the libp2p peer_id and the DHT record signing key.

The file is libp2p's protobuf ``PrivateKey`` (type RSA, DER body), exactly what
``hivemind.P2P.generate_identity`` writes and p2pd reads, so ``--identity PATH`` pins the
peer_id across restarts and the same key signs the key binding of the Ed25519 key derived from it
(``hivemind.dht.crypto.RSASignatureValidator``; peers/signing.py), which signs the membership records.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

TEMPORARY_PREFIX = "dilocox-id-"
OWNER_FILE = "owner.pid"  # the pid of the node that made a temporary identity, so a later start can tell it is gone
STALE_AFTER_S = 300.0  # a directory this young may be a node still starting: never swept
UNOWNED_AFTER_S = 86400.0  # a directory without OWNER_FILE (made before it existed) is swept after a day


class IdentityError(ValueError):
    """The identity file cannot be created or is not an RSA libp2p private key."""


def _process_gone(pid: int) -> bool:
    """Whether no process ``pid`` exists (``kill(pid, 0)``: ESRCH). Another user's process counts as alive."""
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.ESRCH
    return False


def sweep_temporary_identities(root: str | os.PathLike | None = None, now: float | None = None) -> list[Path]:
    """Remove the temporary identities (``dilocox-id-*`` directories) that nodes killed before their exit left in
    ``root`` (default: ``tempfile.gettempdir()``), and return them.

    A node removes its own at exit (daemon/node.py), but not after SIGKILL or a second Ctrl-C; one left a day is
    a few KB, a node restarted by a supervisor for weeks leaves thousands. Swept: directories of this user, older
    than ``STALE_AFTER_S`` seconds (mtime, against ``now``, Unix seconds), whose ``OWNER_FILE`` names a process
    that no longer exists, or that have no ``OWNER_FILE`` and are older than ``UNOWNED_AFTER_S``. A pid reused
    by another process only keeps a directory longer. A directory that cannot be read or removed is left as it
    is: the sweep never fails a start."""
    root = Path(root if root is not None else tempfile.gettempdir())
    now = time.time() if now is None else now
    swept = []
    try:
        candidates = [d for d in root.iterdir() if d.name.startswith(TEMPORARY_PREFIX)]
    except OSError:
        return swept
    for directory in candidates:
        try:
            info = directory.lstat()
            if not directory.is_dir() or directory.is_symlink() or info.st_uid != os.getuid():
                continue
            age = now - info.st_mtime
            owner = directory / OWNER_FILE
            if age < STALE_AFTER_S:
                continue
            if owner.exists():
                if not _process_gone(int(owner.read_text().strip())):
                    continue
            elif age < UNOWNED_AFTER_S:
                continue
            shutil.rmtree(directory)
            swept.append(directory)
        except (OSError, ValueError):
            continue
    return swept


def temporary_identity_path() -> Path:
    """A new private directory (``dilocox-id-*``, mode 0700, in ``tempfile.gettempdir()``) holding
    ``OWNER_FILE`` with our pid, and the path of the key file to make in it. Sweeps stale ones first."""
    sweep_temporary_identities()
    directory = Path(tempfile.mkdtemp(prefix=TEMPORARY_PREFIX))
    (directory / OWNER_FILE).write_text(f"{os.getpid()}\n")
    return directory / "identity.key"


def is_new_identity(path: str | os.PathLike | None) -> bool:
    """Whether ``load_or_create_identity(path)`` makes a new key: no path given, or no file there yet. Nobody
    else can hold such a key, so asking the swarm whether a peer already does is pointless."""
    return path is None or not Path(path).expanduser().exists()


def load_or_create_identity(path: str | os.PathLike | None) -> tuple[str, RSAPrivateKey]:
    """Return (identity file path, signing key); create the file (mode 0400) if it does not exist.

    With ``path=None`` a fresh identity is written to a private temporary directory (``temporary_identity_path``),
    which the caller removes when done with it (the node does at exit: daemon/node.py); ones left by killed
    nodes are swept at the next such start (``sweep_temporary_identities``).
    """
    if path is None:
        path = temporary_identity_path()
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
