"""A certified swarm on real nodes: certified peers train together, a node without a valid certificate is
told so and exits 2, a foreign peer that tries anyway never takes part, and a revocation reaches the
running swarm through the DHT."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from dilocox.daemon import ctl

from tests.harness.localswarm import REPO, node_env
from tests.helpers import FAST, digests_by_step, start

pytestmark = pytest.mark.integration


def _ctl(*args) -> None:
    assert ctl.main(list(args)) == 0, args


def _certify(tmp_path, authority, name: str, days: str = "30"):
    key, cert = tmp_path / f"{name}.key", tmp_path / f"{name}.cert"
    from dilocox.peers.admission import peer_id_of_identity

    _ctl("authority", "issue", str(authority), "--peer-id", peer_id_of_identity(key), "--days", days,
         "--out", str(cert))
    return ["--identity", str(key), "--certificate", str(cert)]


def _refused(tmp_path, args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dilocox.daemon.cli", *args], capture_output=True, text=True,
                          timeout=120, env=node_env(), cwd=REPO)


def _wait_logged(nodes, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not any(text in n.err_path.read_text() for n in nodes):
        assert time.monotonic() < deadline, f"no node logged {text!r}:\n" + "\n".join(n.log_tail() for n in nodes)
        time.sleep(0.5)


def test_certified_swarm(tmp_path):
    authority = tmp_path / "authority"
    _ctl("authority", "init", str(authority))
    pub = authority / "authority.pub"
    args = FAST + ["--run-id", "certified", "--authority", str(pub)]
    revoked = authority / "revoked.json"
    a = start(tmp_path, "a", args + _certify(tmp_path, authority, "a") + ["--min-replicas", "2",
                                                                         "--revocations", str(revoked)])
    b = start(tmp_path, "b", args + _certify(tmp_path, authority, "b") + ["--min-replicas", "2", "--join",
                                                                         a.join_maddr])
    # a node of the same run without any certificate: an open-swarm node that tries anyway
    foreign = start(tmp_path, "foreign", FAST + ["--run-id", "certified", "--join", a.join_maddr])
    nodes = [a, b, foreign]
    try:
        assert a.status().admission.startswith("authority ") and foreign.status().admission == "open"
        for n in (a, b):
            n.wait_for(lambda p: len(p.metrics()) >= 3, 150, "three rounds")
        for n in (a, b):
            rows = n.metrics()
            assert all(r["group_size"] == 2 and r["outcome"] == "applied" for r in rows[:3]), rows
        # the refusal is logged with its reason by whichever honest node read the foreign record or was
        # asked by it (a node reads the records when a round needs them, so not necessarily both)
        foreign_id = foreign.status().peer_id
        _wait_logged([a, b], f"ignoring the membership record of {foreign_id}", 60)
        _wait_logged([a, b], "sent no admission certificate", 60)
        assert all(len(d) == 1 for d in digests_by_step([a, b]).values())
        # the foreign peer averages with nobody: every round it records is its own
        assert all(r["group_size"] == 1 for r in foreign.metrics()), foreign.metrics()

        # refused at start, exit 2, with the reason
        wrong_peer = _certify(tmp_path, authority, "c")  # c's certificate ...
        wrong_peer[1] = str(tmp_path / "d.key")          # ... presented by another identity
        expired = _certify(tmp_path, authority, "e", days="0.00001")
        for extra, reason in ((["--authority", str(pub)], "authority and certificate go together"),
                              (wrong_peer, "issued for peer"), (expired, "expired")):
            done = _refused(tmp_path, args + extra + ["--join", a.join_maddr])
            assert done.returncode == 2 and reason in done.stderr, (done.returncode, done.stderr[-800:])

        # revoke b: a reads the operator's file, the swarm learns it through the DHT, b leaves
        from dilocox.peers.admission import peer_id_of_identity

        _ctl("authority", "revoke", str(authority), "--peer-id", peer_id_of_identity(tmp_path / "b.key"))
        assert b.proc.wait(90) == 0
        assert "our certificate is revoked" in b.err_path.read_text()
        a.wait_for(lambda p: "adopted revocation list 1" in p.err_path.read_text(), 30, "the revocation")
    finally:
        for n in nodes:
            n.terminate(signal.SIGKILL)
