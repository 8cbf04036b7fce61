"""Keeps this node's admission state current: the authority's revocation lists and our own certificate.

With ``--authority`` a node holds a ``peers.admission.Admission``. ``RevocationKeeper.tick`` runs on the
heartbeat thread (daemon/progress.py) and:
  * re-reads ``--revocations FILE`` when the file changes (the operator's ``dilocox-ctl authority
    revoke`` rewrote it) and adopts a list with a higher serial;
  * every ``every`` beats, reads the lists stored in the DHT under the run, adopts the newest one that
    the authority signed, and stores the newest it holds, so every node learns a revocation within
    about ``every`` heartbeats of one node learning it;
  * asks the node to leave when our own certificate is revoked or has expired.
A revoked peer's membership record is ignored from then on (peers/swarm.py), so it drops out of
every group's decisions and downloads (docs/security.md).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable, Optional

from dilocox.peers.admission import (
    Admission,
    AdmissionError,
    fingerprint,
    iso_utc,
    load_authority_public,
    peer_id_of_identity,
    read_certificate,
    verify_revocations,
)
from dilocox.peers.swarm import Swarm

logger = logging.getLogger(__name__)


def load_admission(cfg, identity_path: str) -> Optional[Admission]:
    """With ``cfg.authority`` (NodeConfig): our verified certificate and the authority's key. AdmissionError (a
    ValueError: the node exits 2) names the problem. None: an open swarm, which is logged."""
    if cfg.authority is None:
        logger.warning("open swarm: no --authority, so any peer that knows the run id can take part")
        return None
    authority = load_authority_public(cfg.authority)
    revocations = None
    if cfg.revocations is not None and Path(cfg.revocations).exists():
        revocations = verify_revocations(Path(cfg.revocations).read_text(encoding="utf-8"), authority)
    try:
        admission = Admission(authority, read_certificate(cfg.certificate), peer_id_of_identity(identity_path),
                              revocations)
    except AdmissionError as e:
        raise AdmissionError(f"this node cannot take part in the swarm of authority {fingerprint(authority)}: "
                             f"{e}") from None
    logger.info("certified by authority %s until %s", admission.fingerprint, iso_utc(admission.expires_at))
    return admission


def describe_admission(admission: Optional[Admission]) -> str:
    """NodeStatus.admission: 'open', or the authority's fingerprint and our certificate's expiry."""
    if admission is None:
        return "open"
    return f"authority {admission.fingerprint}, certified until {iso_utc(admission.expires_at)}"


class RevocationKeeper:
    def __init__(self, swarm: Swarm, admission: Admission, path: Optional[Path], leave: Callable[[str], None],
                 every: int = 6):
        self.swarm, self.admission, self.path, self.leave, self.every = swarm, admission, path, leave, every
        self._mtime: Optional[float] = None
        self._beats = 0
        self._left = False

    def tick(self) -> None:
        """One heartbeat's share of the work (never raises: problems are logged)."""
        self._beats += 1
        self._read_file()
        if self._beats % self.every == 1 or self.every == 1:
            self._exchange()
        self._check_self()

    def _read_file(self) -> None:
        if self.path is None:
            return
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            return  # not written yet: nothing is revoked
        if mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            self._adopt(self.path.read_text(encoding="utf-8"), f"file {self.path}")
        except (OSError, UnicodeDecodeError) as e:
            logger.warning("cannot read revocations %s: %s", self.path, e)

    def _exchange(self) -> None:
        try:
            for blob in self.swarm.revocation_lists():
                self._adopt(blob, "the swarm")
            held = self.admission.revocations
            if held is not None:
                self.swarm.publish_revocations(held.serial, held.blob)
        except Exception as e:  # the DHT may be slow or shutting down: next beat
            logger.debug("revocation exchange: %s", e)

    def _adopt(self, blob: str, source: str) -> None:
        try:
            if self.admission.update_revocations(blob):
                held = self.admission.revocations
                logger.warning("adopted revocation list %d from %s: %d peer(s) revoked", held.serial, source,
                               len(held.revoked))
        except AdmissionError as e:
            logger.warning("ignoring a revocation list from %s: %s", source, e)

    def _check_self(self) -> None:
        if self._left:
            return
        me = self.admission.peer_id
        if self.admission.is_revoked(me):
            reason = f"our certificate is revoked (revocation list {self.admission.revocations.serial})"
        elif time.time() >= self.admission.expires_at:
            reason = f"our certificate expired on {iso_utc(self.admission.expires_at)}"
        else:
            return
        self._left = True
        logger.error("%s: leaving the swarm", reason)
        self.leave(reason)
