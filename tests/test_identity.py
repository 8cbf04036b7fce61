"""Temporary identities: a node started without --identity makes one, and a later start sweeps the ones that
killed nodes left behind (peers/identity.py). Real directories and real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from dilocox.peers import identity
from dilocox.peers.identity import (
    OWNER_FILE,
    STALE_AFTER_S,
    TEMPORARY_PREFIX,
    UNOWNED_AFTER_S,
    load_or_create_identity,
    sweep_temporary_identities,
)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _identity_dir(root, name, pid=None, age_s=0.0, now=None):
    d = root / f"{TEMPORARY_PREFIX}{name}"
    d.mkdir(mode=0o700)
    (d / "identity.key").write_bytes(b"key")
    if pid is not None:
        (d / OWNER_FILE).write_text(f"{pid}\n")
    t = (now or time.time()) - age_s
    os.utime(d, (t, t))
    return d


def test_the_sweep_removes_only_identities_whose_node_is_gone_and_that_are_old_enough(tmp_path):
    now = time.time()
    old = STALE_AFTER_S + 60
    dead = _dead_pid()
    gone = _identity_dir(tmp_path, "gone", pid=dead, age_s=old, now=now)
    live = _identity_dir(tmp_path, "live", pid=os.getpid(), age_s=old, now=now)
    young = _identity_dir(tmp_path, "young", pid=dead, age_s=10, now=now)  # may be a node still starting
    legacy_old = _identity_dir(tmp_path, "legacy-old", age_s=UNOWNED_AFTER_S + 60, now=now)
    legacy_new = _identity_dir(tmp_path, "legacy-new", age_s=old, now=now)
    garbled = _identity_dir(tmp_path, "garbled", age_s=old, now=now)
    (garbled / OWNER_FILE).write_text("not a pid")
    other = tmp_path / "something-else"
    other.mkdir()
    os.utime(other, (now - UNOWNED_AFTER_S * 2,) * 2)
    a_file = tmp_path / f"{TEMPORARY_PREFIX}file"
    a_file.write_text("x")

    swept = sweep_temporary_identities(tmp_path, now=now)

    assert sorted(swept) == sorted([gone, legacy_old])
    assert not gone.exists() and not legacy_old.exists()
    for kept in (live, young, legacy_new, garbled, other, a_file):
        assert kept.exists(), kept


def test_the_sweep_of_a_missing_root_finds_nothing(tmp_path):
    assert sweep_temporary_identities(tmp_path / "absent") == []


def test_a_fresh_identity_names_its_owner_and_sweeps_what_killed_nodes_left(tmp_path, monkeypatch):
    monkeypatch.setattr(identity.tempfile, "tempdir", str(tmp_path))
    left = _identity_dir(tmp_path, "killed", pid=_dead_pid(), age_s=STALE_AFTER_S + 60)

    path, key = load_or_create_identity(None)

    directory = os.path.dirname(path)
    assert os.path.basename(directory).startswith(TEMPORARY_PREFIX)
    assert os.path.dirname(directory) == str(tmp_path)
    assert open(os.path.join(directory, OWNER_FILE)).read().strip() == str(os.getpid())
    assert oct(os.stat(directory).st_mode & 0o777) == "0o700"
    assert key.get_public_key() is not None
    assert not left.exists()
    # ours is never swept while we live, however old
    os.utime(directory, (time.time() - UNOWNED_AFTER_S * 2,) * 2)
    assert sweep_temporary_identities(tmp_path) == []
