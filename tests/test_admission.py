"""Swarm admission (peers/admission.py): certificates, revocation lists, Admission, and the dilocox-ctl commands."""

from __future__ import annotations

import json
import os
import stat

import hivemind
import pytest
from dilocox.daemon import ctl
from dilocox.peers import admission
from dilocox.peers.admission import Admission, AdmissionError, verify_certificate, verify_revocations
from dilocox.peers.identity import load_or_create_identity
from hypothesis import assume, given
from hypothesis import strategies as st

NOW = 1_790_000_000  # 2026-09-21T14:13:20Z
DAY = 86400


def random_peer_id() -> str:
    """A well-formed sha2-256 libp2p peer id (Qm...) without generating an RSA key."""
    return hivemind.p2p.PeerID(bytes([0x12, 0x20]) + os.urandom(32)).to_base58()


@pytest.fixture(scope="module")
def authority(tmp_path_factory):
    directory = tmp_path_factory.mktemp("authority")
    pub = admission.init_authority(directory)
    return directory, admission.load_authority_public(pub)


@pytest.fixture(scope="module")
def other_authority(tmp_path_factory):
    directory = tmp_path_factory.mktemp("other")
    return directory, admission.load_authority_public(admission.init_authority(directory))


def test_issue_write_read_verify_round_trip(authority, tmp_path):
    directory, pub = authority
    assert stat.S_IMODE(os.stat(directory / "authority.key").st_mode) == 0o600
    peer = random_peer_id()
    cert = admission.issue_certificate(directory, peer, days=30, now=NOW)
    assert cert["issued_at"] == NOW and cert["expires_at"] == NOW + 30 * DAY and cert["role"] == "peer"
    assert cert["authority"] == admission.fingerprint(pub) and len(cert["serial"]) == 32
    admission.write_certificate(cert, tmp_path / "peer.cert")
    text = (tmp_path / "peer.cert").read_text()
    assert text.count("\n") == 1 and text.endswith("\n")
    assert admission.read_certificate(tmp_path / "peer.cert") == cert
    for form in (cert, json.dumps(cert), text.encode()):
        verified = verify_certificate(form, pub, peer, NOW + DAY)
        assert verified.peer_id == peer and verified.expires_at == NOW + 30 * DAY
    assert verify_certificate(cert, pub, None, NOW).to_dict() == cert  # None: any peer


def test_init_refuses_to_overwrite_an_authority(authority):
    directory, _ = authority
    key_before = (directory / "authority.key").read_bytes()
    with pytest.raises(AdmissionError, match="already exists"):
        admission.init_authority(directory)
    assert (directory / "authority.key").read_bytes() == key_before


def test_expired_certificate_is_refused(authority):
    directory, pub = authority
    peer = random_peer_id()
    cert = admission.issue_certificate(directory, peer, days=1, now=NOW)
    verify_certificate(cert, pub, peer, NOW + DAY - 1)
    with pytest.raises(AdmissionError, match=r"expired on 2026-09-22T14:13:20Z"):
        verify_certificate(cert, pub, peer, NOW + DAY)


def test_not_yet_valid_certificate_is_refused(authority):
    directory, pub = authority
    peer = random_peer_id()
    cert = admission.issue_certificate(directory, peer, now=NOW)
    verify_certificate(cert, pub, peer, NOW - admission.MAX_CLOCK_SKEW_S)  # a clock slightly behind is tolerated
    with pytest.raises(AdmissionError, match=r"not valid before 2026-09-21T14:13:20Z"):
        verify_certificate(cert, pub, peer, NOW - DAY)


def test_certificate_of_another_peer_is_refused(authority):
    directory, pub = authority
    a, b = random_peer_id(), random_peer_id()
    cert = admission.issue_certificate(directory, a, now=NOW)
    with pytest.raises(AdmissionError, match=f"issued for peer {a}, not {b}$"):
        verify_certificate(cert, pub, b, NOW)


def test_certificate_of_another_authority_is_refused(authority, other_authority):
    _, pub = authority
    other_dir, other_pub = other_authority
    peer = random_peer_id()
    cert = admission.issue_certificate(other_dir, peer, now=NOW)
    expected = f"fingerprint {admission.fingerprint(other_pub)}, expected {admission.fingerprint(pub)}"
    with pytest.raises(AdmissionError, match=f"signed by another authority \\({expected}\\)"):
        verify_certificate(cert, pub, peer, NOW)
    forged = {**cert, "authority": admission.fingerprint(pub)}  # claiming our authority does not help
    with pytest.raises(AdmissionError, match="bad signature"):
        verify_certificate(forged, pub, peer, NOW)


def test_tampered_certificate_is_refused(authority):
    directory, pub = authority
    peer = random_peer_id()
    cert = admission.issue_certificate(directory, peer, days=1, now=NOW)
    with pytest.raises(AdmissionError, match="bad signature"):
        verify_certificate({**cert, "expires_at": cert["expires_at"] + 365 * DAY}, pub, peer, NOW)


def test_bad_peer_ids_and_arguments_are_refused_at_issue(authority):
    directory, _ = authority
    for bad in ("", "not-a-peer-id", "0OIl", "Qm" + "1" * 44, random_peer_id() + "x", " " + random_peer_id()):
        with pytest.raises(AdmissionError, match="peer id"):
            admission.issue_certificate(directory, bad, now=NOW)
    for days in (0, -1, float("nan"), float("inf"), 1e-9):
        with pytest.raises(AdmissionError, match="days"):
            admission.issue_certificate(directory, random_peer_id(), days=days, now=NOW)
    with pytest.raises(AdmissionError, match="role 'admin' is not accepted"):
        admission.issue_certificate(directory, random_peer_id(), role="admin", now=NOW)


def test_admission_check_caches_but_rechecks_expiry(authority):
    directory, pub = authority
    now = [float(NOW)]
    me, peer = random_peer_id(), random_peer_id()
    node = Admission(pub, admission.issue_certificate(directory, me, now=NOW), me, clock=lambda: now[0])
    blob = json.dumps(admission.issue_certificate(directory, peer, days=2, now=NOW))
    assert node.check(peer, blob) is None and node.check(peer, blob) is None
    assert "issued for peer" in node.check(random_peer_id(), blob)
    assert "sent no admission certificate" in node.check(peer, "")
    now[0] += 2 * DAY
    assert "expired on" in node.check(peer, blob)  # the cached verification does not outlive the certificate


def test_revoked_peer_is_refused_after_update(tmp_path_factory):
    directory = tmp_path_factory.mktemp("revoking")  # its own authority: revoked.json starts empty here
    pub = admission.load_authority_public(admission.init_authority(directory))
    me, bad, good = random_peer_id(), random_peer_id(), random_peer_id()
    node = Admission(pub, admission.issue_certificate(directory, me, now=NOW), me, clock=lambda: NOW + 1)
    blobs = {p: admission.issue_certificate(directory, p, now=NOW) for p in (bad, good)}
    assert node.check(bad, json.dumps(blobs[bad])) is None and node.revocations_blob is None
    listed = admission.revoke(directory, bad, now=NOW)
    assert listed["serial"] == 1 and listed["revoked"] == [bad]
    assert node.update_revocations((directory / "revoked.json").read_bytes())
    assert node.is_revoked(bad) and not node.is_revoked(good)
    assert "revoked" in node.check(bad, json.dumps(blobs[bad]))
    assert node.check(good, json.dumps(blobs[good])) is None
    assert verify_revocations(node.revocations_blob, pub).revoked == frozenset({bad})


def test_revocation_list_with_lower_or_equal_serial_is_not_adopted(tmp_path, other_authority):
    pub = admission.load_authority_public(admission.init_authority(tmp_path))
    me, first, second = random_peer_id(), random_peer_id(), random_peer_id()
    node = Admission(pub, admission.issue_certificate(tmp_path, me, now=NOW), me, clock=lambda: NOW)
    one = admission.revoke(tmp_path, first, now=NOW)
    two = admission.revoke(tmp_path, second, now=NOW)
    assert two["serial"] == 2 and two["revoked"] == sorted([first, second])
    assert node.update_revocations(json.dumps(two))
    assert not node.update_revocations(json.dumps(one)) and not node.update_revocations(json.dumps(two))
    assert node.revocations.serial == 2 and node.is_revoked(first)
    with pytest.raises(AdmissionError, match="bad signature"):
        node.update_revocations({**two, "serial": 3, "revoked": [first]})  # un-revoking by a forged higher serial
    other_dir, _ = other_authority
    foreign = admission.revoke(other_dir, random_peer_id(), now=NOW)
    with pytest.raises(AdmissionError, match="signed by another authority"):
        node.update_revocations(json.dumps(foreign))
    assert node.revocations.serial == 2


def test_admission_refuses_our_own_invalid_certificate(authority):
    directory, pub = authority
    me = random_peer_id()
    cert = admission.issue_certificate(directory, me, days=1, now=NOW)
    with pytest.raises(AdmissionError, match="expired on"):
        Admission(pub, cert, me, clock=lambda: NOW + 2 * DAY)
    with pytest.raises(AdmissionError, match="issued for peer"):
        Admission(pub, json.dumps(cert), random_peer_id(), clock=lambda: NOW)
    with pytest.raises(AdmissionError, match="malformed certificate"):
        Admission(pub, "{}", me, clock=lambda: NOW)
    node = Admission(pub, cert, me, clock=lambda: NOW)
    assert node.expires_at == NOW + DAY and verify_certificate(node.certificate_blob, pub, me, NOW).serial


def test_admission_refuses_our_own_revoked_certificate(tmp_path):
    pub = admission.load_authority_public(admission.init_authority(tmp_path))
    me = random_peer_id()
    cert = admission.issue_certificate(tmp_path, me, now=NOW)
    revoked = verify_revocations(json.dumps(admission.revoke(tmp_path, me, now=NOW)), pub)
    with pytest.raises(AdmissionError, match="revoked"):
        Admission(pub, cert, me, revocations=revoked, clock=lambda: NOW)


def test_huge_deep_and_odd_inputs_raise_admission_error(authority):
    _, pub = authority
    for blob in ("[" * 10**6, "[" * 4000 + "]" * 4000, b"{" * 3000, "x" * 10**7, b"\xff\xfe", "\ud800",
                 '{"a": NaN}', '{"version": 1, "version": 1}', 1, None, ["version"], bytearray(b"{}")):
        with pytest.raises(AdmissionError):
            verify_certificate(blob, pub, None, NOW)
        with pytest.raises(AdmissionError):
            verify_revocations(blob, pub)


def test_load_authority_errors_name_the_file(tmp_path):
    with pytest.raises(AdmissionError, match="does not exist"):
        admission.load_authority_public(tmp_path / "missing.pub")
    with pytest.raises(AdmissionError, match="authority directory .* does not exist"):
        admission.load_authority_private(tmp_path / "nowhere")
    (tmp_path / "authority.pub").write_text("not a key\n")
    with pytest.raises(AdmissionError, match="authority.pub is not a PEM public key"):
        admission.load_authority_public(tmp_path)
    with pytest.raises(AdmissionError, match="authority.key does not exist"):
        admission.load_authority_private(tmp_path)


def test_cli_init_peer_id_issue_revoke(tmp_path, capsys):
    auth = tmp_path / "auth"
    assert ctl.main(["authority", "init", str(auth)]) == 0
    assert capsys.readouterr().out.strip() == str(auth / "authority.pub")
    pub = admission.load_authority_public(auth / "authority.pub")
    assert ctl.main(["peer-id", "--identity", str(tmp_path / "node.key")]) == 0
    peer = capsys.readouterr().out.strip()
    assert admission.validate_peer_id(peer) == peer and (tmp_path / "node.key").exists()
    assert ctl.main(["--addr", "127.0.0.1:1", "peer-id", "--identity", str(tmp_path / "node.key")]) == 0
    assert capsys.readouterr().out.strip() == peer  # same file, same id; --addr is ignored
    cert_path = tmp_path / "node.cert"
    assert ctl.main(["authority", "issue", str(auth), "--peer-id", peer, "--days", "7", "--out", str(cert_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and peer in out and "Z" in out
    cert = verify_certificate(admission.read_certificate(cert_path), pub, peer, cert_path.stat().st_mtime)
    assert cert.expires_at - cert.issued_at == 7 * DAY
    assert ctl.main(["authority", "revoke", str(auth), "--peer-id", peer]) == 0
    assert "serial 1, 1 peer(s) revoked" in capsys.readouterr().out
    assert verify_revocations((auth / "revoked.json").read_text(), pub).revoked == {peer}
    assert ctl.main(["authority", "init", str(auth)]) == 2
    assert "already exists" in capsys.readouterr().err


def test_cli_errors_exit_2(tmp_path, capsys):
    peer = random_peer_id()
    cert = str(tmp_path / "x.cert")
    assert ctl.main(["authority", "issue", str(tmp_path / "nowhere"), "--peer-id", peer, "--out", cert]) == 2
    assert capsys.readouterr().err.startswith("dilocox-ctl: authority directory")
    assert ctl.main(["authority", "init", str(tmp_path / "auth")]) == 0
    assert ctl.main(["authority", "issue", str(tmp_path / "auth"), "--peer-id", "garbage!", "--out", cert]) == 2
    assert "peer id 'garbage!' is not base58" in capsys.readouterr().err
    assert ctl.main(["authority", "revoke", str(tmp_path / "auth"), "--peer-id", "Qm"]) == 2
    assert ctl.main(["peer-id", "--identity", str(tmp_path / "no" / "dir" / "id.key")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not os.path.exists(cert)


@pytest.mark.integration
def test_peer_id_of_identity_matches_the_dht(tmp_path):
    path = tmp_path / "identity.key"
    expected = admission.peer_id_of_identity(path)
    assert admission.peer_id_of_identity(path) == expected  # reads the file it created
    _, key = load_or_create_identity(path)
    assert admission.peer_id_of_public_key(key.get_public_key().to_bytes()) == expected
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(path),
                       nat_port_map=False, startup_timeout=60)
    try:
        assert dht.peer_id.to_base58() == expected
    finally:
        dht.shutdown()


# ------------------------------------------------------------------------------------------- property tests

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=50),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=20), children, max_size=5),
    max_leaves=30)


@pytest.fixture(scope="module")
def signed(authority):
    directory, pub = authority
    peer = random_peer_id()
    cert = admission.issue_certificate(directory, peer, now=NOW)
    revocations = admission.revoke(directory, random_peer_id(), now=NOW)
    return pub, peer, cert, revocations


@given(blob=st.binary(max_size=5000))
def test_random_bytes_are_refused_with_admission_error(signed, blob):
    """Random bytes are never a valid certificate or revocation list: each is refused, and with AdmissionError
    alone (another exception type would escape pytest.raises and fail the test too)."""
    pub, peer, _, _ = signed
    with pytest.raises(AdmissionError):
        verify_certificate(blob, pub, peer, NOW)
    with pytest.raises(AdmissionError):
        verify_revocations(blob, pub)


@given(value=json_values)
def test_random_json_values_raise_only_admission_error(signed, value):
    pub, peer, _, _ = signed
    for form in (value, json.dumps(value)):
        with pytest.raises(AdmissionError):
            verify_certificate(form, pub, peer, NOW)
        with pytest.raises(AdmissionError):
            verify_revocations(form, pub)


@given(field=st.sampled_from(admission.CERTIFICATE_FIELDS + ("extra",)), value=json_values, drop=st.booleans())
def test_single_field_mutations_of_a_certificate_are_refused(signed, field, value, drop):
    pub, peer, cert, _ = signed
    mutated = dict(cert)
    if drop and field in mutated:
        del mutated[field]
    else:
        assume(json.dumps(value) != json.dumps(cert.get(field)))  # a real change (1.0 and true count as changes)
        mutated[field] = value
    for form in (mutated, json.dumps(mutated)):
        with pytest.raises(AdmissionError):
            verify_certificate(form, pub, peer, NOW)


@given(field=st.sampled_from(admission.REVOCATION_FIELDS + ("extra",)), value=json_values, drop=st.booleans())
def test_single_field_mutations_of_a_revocation_list_are_refused(signed, field, value, drop):
    pub, _, _, revocations = signed
    mutated = dict(revocations)
    if drop and field in mutated:
        del mutated[field]
    else:
        assume(json.dumps(value) != json.dumps(revocations.get(field)))
        mutated[field] = value
    for form in (mutated, json.dumps(mutated)):
        with pytest.raises(AdmissionError):
            verify_revocations(form, pub)
