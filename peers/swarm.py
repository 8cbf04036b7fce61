"""DHT membership: join a swarm, publish this node's signed, expiring record, list live members.

Records live under the DHT key ``{run_id}_members``, one subkey per node holding the node's Ed25519
public key marker, so ``Ed25519SignatureValidator`` lets only the owner write it (peers/signing.py:
its key is bound to the node's RSA peer_id under ``{run_id}_key.{its key}``, which ``RSASignatureValidator``
protects), and ``SchemaValidator`` rejects values that do not parse as ``MemberRecord``
(peers/records.py; hivemind/dht/schema.py). A record expires ``ttl_s`` after it was stored; a node that stops
refreshing drops out.
The DHT process itself is peers/dht.py's SupervisedDHT.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import threading
import time
from typing import Callable, Dict, List, Optional

import pydantic.v1 as pydantic
from dilocox.peers import lifecycle
from dilocox.peers.admission import Admission, AdmissionError, peer_id_of_public_key
from dilocox.peers.bootstrap import JoinAbandoned, keep_trying
from dilocox.peers.dht import MEMBER_READ_BEAM, MEMBER_REPLICAS, MEMBER_SEARCH_S, SupervisedDHT, start_dht
from dilocox.peers.nearstore import SearchSchedule, read_near, store_near
from dilocox.peers.records import MAX_PEERS, InputsRecord, KeyBinding, MemberRecord, SwarmSchema
from dilocox.peers.signing import (
    Ed25519SignatureValidator,
    derive_signing_key,
    make_binding,
    verify_binding,
)
from dilocox.peers.validation import CachedSchemaValidator, CachedSignatureValidator
from hivemind.utils import ValueWithExpiration, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.multiaddr import Multiaddr

logger = logging.getLogger(__name__)
OWNER_RE = re.compile(rb"\[owner:(.+?)\]")  # hivemind's RSASignatureValidator subkey marker
TRAFFIC_COUNTS = ("reads", "read_searches", "publishes", "searches", "inputs_published", "inputs_reads",
                  "binding_reads")
# key bindings (peers/signing.py), one DHT key each (``Swarm.binding_key``): stored for BINDING_TTL_S, stored again
# every BINDING_REFRESH_S; a record signed by a key we have no binding for makes us read that key's binding, again
# after 1, 2, 4 ... BINDING_BACKOFF_MAX_S while it has none
BINDING_TTL_S, BINDING_REFRESH_S, BINDING_BACKOFF_MAX_S = 900.0, 120.0, 8.0
MAX_BINDINGS = 4096  # bindings a node remembers (the oldest go first)


async def _get_many(_dht, node, keys: List[str], beam: int) -> dict:
    """Runs in the DHT process (``DHT.run_coroutine``): hivemind's ``DHTNode.get_many`` of ``keys``, latest values,
    asking ``beam`` peers per key."""
    return await node.get_many(keys, sufficient_expiration_time=float("inf"), beam_size=beam, num_workers=beam)


@functools.lru_cache(maxsize=MAX_PEERS)
def _rsa_owner(subkey) -> Optional[str]:
    """The peer id of the RSA key in a subkey (hivemind's ``[owner:...]`` marker), or None."""
    found = OWNER_RE.search(subkey) if isinstance(subkey, bytes) else None
    try:
        return peer_id_of_public_key(found.group(1)) if found else None
    except AdmissionError:
        return None


class JoinError(RuntimeError):
    """The DHT could not start or could not reach any --join address (``requested``: a leave request
    stopped the attempts, which is no failure)."""

    def __init__(self, message: str, requested: bool = False):
        super().__init__(message)
        self.requested = requested


def parse_multiaddrs(addrs: List[str], what: str) -> List[Multiaddr]:
    """Parse multiaddrs, raising ValueError that names the bad one."""
    out = []
    for a in addrs:
        try:
            out.append(Multiaddr(a))
        except Exception as e:
            raise ValueError(f"{what}: {a!r} is not a valid multiaddr ({e})") from e
    return out


class Swarm:
    """One node's DHT and membership record. Blocking methods; call them off the event loop."""

    def __init__(self, run_id: str, private_key: RSAPrivateKey, *, initial_peers: List[str],
                 host_maddrs: List[str], announce_maddrs: List[str], identity_path: str,
                 startup_timeout_s: float = 30.0, ttl_s: float = 15.0, admission: Optional[Admission] = None,
                 client_mode: bool = False, auto_relay: bool = False, join_deadline_s: Optional[float] = None,
                 stop: Optional[threading.Event] = None, check_identity: bool = True,
                 on_join_failure: Callable[[int, str, float], None] = lambda attempt, reason, wait_s: None):
        """``admission``: with a swarm authority, records of peers without a valid certificate are ignored.
        ``client_mode``: hivemind's DHT client mode (no inbound requests; p2pd's DHT in client mode too).
        ``auto_relay``: p2pd looks for circuit relays among its peers to become reachable (hivemind's
        ``use_auto_relay``; relaying itself, ``use_relay``, is on in hivemind by default).
        With ``initial_peers``, a join that fails because they do not answer is retried with backoff
        (peers/bootstrap.py) until ``join_deadline_s`` seconds pass (None: for ever) or ``stop`` is set,
        calling ``on_join_failure(attempt, reason, seconds until the next)`` after each failed attempt.
        ``check_identity``: before the first attempt, hivemind asks the join peers whether another peer already
        holds our identity (``P2P.create(check_if_identity_free=...)``: it starts a second p2pd for the look-up);
        pointless for a key made for this start, so the node turns it off then.
        Raises JoinError (``requested`` set when ``stop`` ended the attempts)."""
        self.run_id, self.ttl_s, self.admission = run_id, ttl_s, admission
        self.key = f"{run_id}_members"
        self.revocations_key = f"{run_id}_revocations"
        self.inputs_key = f"{run_id}_inputs"
        self._refused: Dict[str, str] = {}  # peer_id -> why its record is ignored (logged once per reason)
        signer = CachedSignatureValidator(private_key)
        self.rsa_public_key = signer.local_public_key  # our subkey of the bindings
        self._signing_key = derive_signing_key(private_key)
        compact = Ed25519SignatureValidator(self._signing_key)
        self.public_key = compact.local_public_key  # our subkey of the members and inputs records
        parse_multiaddrs(initial_peers, "--join")
        parse_multiaddrs(host_maddrs, "--listen")
        parse_multiaddrs(announce_maddrs, "--announce")
        settings = dict(
            initial_peers=initial_peers or None,
            host_maddrs=host_maddrs,
            announce_maddrs=announce_maddrs or None,
            identity_path=identity_path,
            # both remember verdicts: a read returns the same signed records many times (peers/validation.py)
            record_validators=[CachedSchemaValidator(SwarmSchema, prefix=run_id), signer, compact],
            nat_port_map=False,  # UPnP discovery would multicast off the machine
            client_mode=client_mode,
            use_auto_relay=auto_relay,
            # AutoNAT needs several peers to dial back before it calls us private, and autorelay waits
            # for that verdict: a node told to use a relay is behind a NAT (hivemind's force_reachability)
            force_reachability="private" if auto_relay else None,
            startup_timeout=startup_timeout_s,
            check_if_identity_free=check_identity,
            num_replicas=MEMBER_REPLICAS,
            # hivemind's Kademlia caching (DHTNode's documented knobs): after each read that found a value, store that
            # whole value on the nearest peer lacking it (cache_nearest), and re-read cached values 5 s before they
            # expire with the default beam of 20 (cache_refresh_before_expiry). Every key here is read with
            # latest=True by whoever needs it, so both only moved whole dictionaries around: a members read at 32
            # members pushed its 48 KB on once more
            cache_nearest=0,
            cache_refresh_before_expiry=0,
        )
        where = ", ".join(initial_peers) or "new swarm"
        tried = []

        def attempt() -> SupervisedDHT:
            # hivemind's check that no other peer holds our identity dials it through the join peers; after a
            # failed attempt they may still hold our own dead attempt's addresses, and the dial hangs for minutes
            again = dict(check_if_identity_free=False) if tried else {}  # (after the first attempt)
            tried.append(True)
            return start_dht({**settings, **again}, startup_timeout_s)

        try:
            if initial_peers:  # a busy or briefly unreachable bootstrap peer is retried (peers/bootstrap.py)
                self.dht = keep_trying(attempt, deadline_s=join_deadline_s, stop=stop or threading.Event(),
                                       on_failure=on_join_failure)
            else:
                self.dht = start_dht(settings, startup_timeout_s)
        except JoinAbandoned as e:
            raise JoinError(f"could not join the DHT ({where}): {e}", requested=e.requested) from e
        except Exception as e:
            raise JoinError(f"could not start or join the DHT ({where}): {e}") from e
        self.peer_id = self.dht.peer_id.to_base58()
        self._lock = threading.Lock()  # one DHT pipe shared by our threads
        self._read_at = -math.inf  # monotonic time of the last DHT read of the records
        # one walk towards a key serves its publishes and reads alike: both go to the peers nearest it
        self._schedule = SearchSchedule(MEMBER_SEARCH_S, MEMBER_REPLICAS)
        self._traffic: Dict[str, int] = dict.fromkeys(TRAFFIC_COUNTS, 0)
        self._seen: Dict[bytes, object] = {}  # subkey -> the newest unexpired ValueWithExpiration read
        self._bound: Dict[bytes, str] = {self.public_key: self.peer_id}  # Ed25519 subkey -> its checked peer_id
        self._binding = make_binding(self._signing_key, run_id, self.peer_id)
        self._bound_at = -math.inf  # monotonic time we last stored our binding
        self._unbound: Dict[bytes, tuple[int, float]] = {}  # subkey bound to no peer_id -> (reads tried, next read)

    async def replicate_p2p(self):
        """A P2P client on this node's p2pd (hivemind's public ``DHT.replicate_p2p``), for RPC handlers of
        our own (peers/allgather.py). Its first call asks the DHT process for p2pd's address through
        the DHT's pipe, which our lock serializes with the other DHT calls."""
        with self._lock:
            return await self.dht.replicate_p2p()

    def visible_maddrs(self, latest: bool = False) -> List[str]:
        """Multiaddrs others can dial us at (hivemind's ``get_visible_maddrs``; ``latest``: ask p2pd again,
        e.g. for the ``/p2p-circuit`` addresses an auto-relay reservation adds)."""
        with self._lock:
            return [str(m) for m in self.dht.get_visible_maddrs(latest=latest)]

    def traffic(self) -> Dict[str, int]:
        """DHT operations on the run's keys since start (TRAFFIC_COUNTS): ``reads`` of the records, of which
        ``read_searches`` walked towards the key first (peers/nearstore.py, ``learn_nearest``; the rest asked the
        nearest peers straight), ``publishes`` of ours, of which ``searches`` walked first, ``inputs_published`` and
        ``inputs_reads`` (InputsRecord), ``binding_reads`` (peers/signing.py), and ``reads_by:{caller}`` for the
        reads of each caller named to ``members``. A read costs every record from each holder asked (one in turn,
        all MEMBER_REPLICAS when it holds none)."""
        with self._lock:
            return dict(self._traffic)

    def publish(self, record: MemberRecord) -> bool:
        """Store our signed record (True: at least one DHT peer, or our own storage, holds it).

        Directly on the MEMBER_REPLICAS nearest peers our routing table knows (peers/nearstore.py, ``store_near``),
        after a walk towards the key that teaches the routing table its nearest peers (``learn_nearest``: no peer
        answers with the records) when the key's last walk is MEMBER_SEARCH_S old or a direct store was refused or
        missed; with hivemind's search (``DHT.store``, beam MEMBER_REPLICAS) only when the stores after a walk
        were refused or missed too."""
        expiration = get_dht_time() + self.ttl_s
        value = record.wire()
        with self._lock:
            self._store_binding()
            self._traffic["publishes"] += 1
            # our own reads see our new record at once, without a DHT read: otherwise each publish would send the
            # next read to the DHT (reads at least as many as publishes, each every member's record)
            self._seen[self.public_key] = ValueWithExpiration(value, expiration)
            for search in self._schedule.attempts(self.key):
                self._traffic["searches"] += search
                accepted, tried = self.dht.run_coroutine(functools.partial(
                    store_near, key=self.key, subkey=self.public_key, value=value,
                    expiration_time=expiration, replicas=MEMBER_REPLICAS, search=search))
                if accepted == tried and tried > 0:
                    return True
                # a later expiration: a peer that took the store would refuse the same one again
                expiration = max(expiration + 1e-3, get_dht_time() + self.ttl_s)
                self._seen[self.public_key] = ValueWithExpiration(value, expiration)
            return bool(self.dht.store(self.key, subkey=self.public_key, value=value,
                                       expiration_time=expiration, beam_size=MEMBER_REPLICAS,
                                       num_workers=MEMBER_REPLICAS))

    def binding_key(self, subkey: bytes) -> str:
        """The DHT key of the binding of the Ed25519 key in a members subkey: ``{run_id}_key.{base64 key}``. Each
        binding under its own key, in the binder's RSA subkey, so a reader fetches the one it lacks: under one key
        for all, each read returned every member's binding (1.2 KB each), and at 32 nodes starting together a node
        made 20-30 such reads. (Keys outside the schema's fields pass hivemind's ``SchemaValidator``; readers parse
        ``KeyBinding`` themselves.)"""
        return f"{self.run_id}_key.{subkey[len(b'[ed25519:'):-1].decode()}"

    def _store_binding(self) -> None:
        """Store our key binding (peers/signing.py) if it was never stored or is BINDING_REFRESH_S old; before our
        first record, so readers that see the record find the binding. Under ``_lock``."""
        if time.monotonic() - self._bound_at < BINDING_REFRESH_S:
            return
        if self.dht.store(self.binding_key(self.public_key), subkey=self.rsa_public_key, value=self._binding,
                          expiration_time=get_dht_time() + BINDING_TTL_S, beam_size=MEMBER_REPLICAS,
                          num_workers=MEMBER_REPLICAS):
            self._bound_at = time.monotonic()
        else:
            logger.warning("could not store our record-signing key's binding; trying again with the next publish")

    def _learn_bindings(self) -> None:
        """Read the binding of each key that signs a record we hold and that we know no binding of, with backoff
        per key (1, 2, 4 ... BINDING_BACKOFF_MAX_S between reads while it has none). Under ``_lock``."""
        now = time.monotonic()
        unknown = [k for k in self._seen if k not in self._bound]
        self._unbound = {k: v for k, v in self._unbound.items() if k in unknown}
        due = [k for k in unknown if self._unbound.get(k, (0, 0.0))[1] <= now]
        if not due:
            return
        self._read_bindings(due)
        for k in due:
            if k not in self._bound:
                tries = self._unbound.get(k, (0, 0.0))[0] + 1
                self._unbound[k] = (tries, now + min(BINDING_BACKOFF_MAX_S, 2.0 ** (tries - 1)))

    def _read_bindings(self, subkeys: List[bytes]) -> None:
        """Read the bindings of these members subkeys' keys (one DHT read for all: hivemind's ``get_many``) and learn
        each whose RSA subkey is its peer_id's, whose key is the one its DHT key names and whose proof holds.
        Under ``_lock``."""
        self._traffic["binding_reads"] += 1
        keys = {self.binding_key(k): k for k in subkeys}
        found = self.dht.run_coroutine(functools.partial(_get_many, keys=list(keys), beam=MEMBER_READ_BEAM))
        for key, item in found.items():
            if item is None or not hasattr(item.value, "items"):
                continue
            for subkey, entry in item.value.items():
                try:
                    binding = KeyBinding.parse_obj(getattr(entry, "value", None))
                except pydantic.ValidationError:
                    continue
                if _rsa_owner(subkey) != binding.peer_id:
                    continue  # a binding for another peer_id than the RSA key that signed it
                if verify_binding(self.run_id, binding.peer_id, binding.key, binding.proof) == keys[key]:
                    self._bound[keys[key]] = binding.peer_id
        while len(self._bound) > MAX_BINDINGS:
            oldest = next(k for k in self._bound if k != self.public_key)
            del self._bound[oldest]

    def _read_dictionary(self, key: str):
        """The dictionary under ``key`` (the records, or the inputs): straight from one of the MEMBER_REPLICAS nearest
        peers the routing table knows, each in turn (peers/nearstore.py, ``read_near``), after a walk towards the key
        (``learn_nearest``, beam MEMBER_READ_BEAM: no peer answers with the dictionary) when the key's last walk is
        MEMBER_SEARCH_S old or no peer asked answered with it; with hivemind's search (``DHT.get``) only when no
        holder answered after a walk either (an empty key, or one held beyond the nearest peers). Under ``_lock``."""
        for search in self._schedule.attempts(key):
            self._traffic["read_searches"] += search and key == self.key
            # holders in turn: each answers with the whole dictionary (read_near)
            found, answers = self.dht.run_coroutine(functools.partial(
                read_near, key=key, replicas=MEMBER_REPLICAS, turn=self._schedule.turn(), search=search,
                beam_size=MEMBER_READ_BEAM))
            if answers > 0:
                return found
        return self.dht.get(key, latest=True, beam_size=MEMBER_READ_BEAM, num_workers=MEMBER_READ_BEAM)

    def members(self, max_age_s: float = 1.0, caller: str = "",
                since: Optional[float] = None) -> List[tuple[MemberRecord, float]]:
        """Live members (ours included) with seconds until their record expires; invalid records are skipped.

        A read asks one of the MEMBER_REPLICAS DHT peers nearest the key in turn (``_read_dictionary``) for every
        record of the run (about 0.4 KB each, signatures included), so reads are shared: one made less than
        ``max_age_s`` seconds ago is reused, and so is one made at or after ``since`` (a ``time.monotonic()``
        value: a read made after some event, however long ago). ``caller`` names who asked: a read it makes is
        also counted under ``reads_by:{caller}`` in ``traffic()``."""
        with self._lock:
            now_m = time.monotonic()
            if now_m - self._read_at >= max_age_s and (since is None or self._read_at < since):
                found = self._read_dictionary(self.key)
                self._read_at = now_m
                self._traffic["reads"] += 1
                if caller:
                    self._traffic[f"reads_by:{caller}"] = self._traffic.get(f"reads_by:{caller}", 0) + 1
                # A read can miss records that have not expired (it merges the subkeys of the DHT peers it
                # reached, and those need not hold every record, e.g. a peer that has just joined). A record
                # seen once counts until its expiration, as the DHT itself keeps it.
                if found is not None and isinstance(found.value, dict):
                    for subkey, item in found.value.items():
                        if getattr(item, "value", None) is not None and (
                                subkey not in self._seen or item.expiration_time > self._seen[subkey].expiration_time):
                            self._seen[subkey] = item
            now = get_dht_time()
            self._seen = {k: v for k, v in self._seen.items() if v.expiration_time > now}
            self._learn_bindings()
            seen = dict(self._seen)
        out = []
        for subkey, item in seen.items():
            value = item.value
            try:
                record = MemberRecord.parse_obj(value)
            except pydantic.ValidationError:
                continue
            if record.run_id != self.run_id:
                continue
            if self._owner(subkey) is None:
                continue  # a key whose binding we have not read (yet): a joiner's first records, or nobody's
            reason = self.refusal(subkey, record)
            if reason is not None:
                if self._refused.get(record.peer_id) != reason:
                    logger.warning("ignoring the membership record of %s: %s", record.peer_id, reason)
                    self._refused[record.peer_id] = reason
                continue
            self._refused.pop(record.peer_id, None)
            out.append((record, item.expiration_time - now))
        return out

    def refusal(self, subkey: bytes, record: MemberRecord) -> Optional[str]:
        """Why a record is not counted, or None. Its subkey holds the Ed25519 key that signed it (the DHT's
        ``Ed25519SignatureValidator`` checked the signature), and that key must be bound to the record's peer_id
        (peers/signing.py: a binding stored under peer_id's RSA key, with the Ed25519 key's proof): no peer can speak
        for another. With a swarm authority the certificate must admit that peer_id."""
        owner = self._owner(subkey)
        if owner != record.peer_id:
            return f"it claims peer_id {record.peer_id} but is signed by {owner or 'a key bound to no peer_id'}"
        if self.admission is not None:
            return self.admission.check(record.peer_id, record.certificate)
        return None

    def _owner(self, subkey) -> Optional[str]:
        """The peer id an Ed25519 subkey is bound to (``_read_bindings``), or None."""
        return self._bound.get(subkey) if isinstance(subkey, bytes) else None

    def publish_inputs(self, record: InputsRecord) -> bool:
        """Store the contributions we used in a round (InputsRecord) under our subkey of ``{run_id}_inputs``."""
        with self._lock:
            self._traffic["inputs_published"] += 1
            return bool(self.dht.store(self.inputs_key, subkey=self.public_key, value=record.wire(),
                                       expiration_time=get_dht_time() + self.ttl_s, beam_size=MEMBER_REPLICAS,
                                       num_workers=MEMBER_REPLICAS))

    def inputs_of(self, result_step: int) -> Dict[str, Dict[str, str]]:
        """peer_id -> the inputs it published for round ``result_step`` (InputsRecord), from one DHT read; records
        not signed by their peer_id's key are left out (callers look only at counted members' ones)."""
        with self._lock:
            self._traffic["inputs_reads"] += 1
            found = self._read_dictionary(self.inputs_key)
        out: Dict[str, Dict[str, str]] = {}
        if found is None or not isinstance(found.value, dict):
            return out
        for subkey, item in found.value.items():
            try:
                record = InputsRecord.parse_obj(getattr(item, "value", None))
            except pydantic.ValidationError:
                continue
            if record.result_step == result_step and self._owner(subkey) == record.peer_id:
                out[record.peer_id] = record.inputs
        return out

    def publish_revocations(self, serial: int, blob: str, ttl_s: float = 86400.0) -> bool:
        """Store a revocation list under our run (anyone may; readers verify the authority's signature)."""
        with self._lock:
            return bool(self.dht.store(self.revocations_key, subkey=int(serial), value=blob,
                                       expiration_time=get_dht_time() + ttl_s))

    def revocation_lists(self) -> List[str]:
        """Every revocation list stored under our run, highest serial first (unverified)."""
        with self._lock:
            found = self.dht.get(self.revocations_key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        out = []
        for subkey, item in sorted(found.value.items(), key=lambda kv: -kv[0] if isinstance(kv[0], int) else 0):
            if isinstance(getattr(item, "value", None), str):
                out.append(item.value)
        return out

    def shutdown(self) -> None:
        self.dht.shutdown()
        lifecycle.end_process(self.dht, grace_s=3.0)  # a DHT whose p2pd died may not answer the pipe


def wait_for(predicate, timeout_s: float, poll_s: float = 0.2):
    """Poll ``predicate()`` until it returns a truthy value or timeout_s passes; return the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(poll_s)
