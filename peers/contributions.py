"""A node's contribution server: serves its payloads to its group-mates and fetches theirs, over hivemind's P2P API.

``ContributionServer`` is a ``hivemind.p2p.ServicerBase`` (hivemind's documented way to add P2P RPCs) on a replica of
the DHT's P2P, with its own asyncio loop in a thread of the main process:

* ``rpc_contribution``: a group-mate asks for the payload we offer under a key (a round's group key), or, as a
  relay, for the copy we fetched of another member's (a member nobody can dial: peers/reachability.py);
* ``rpc_exchange``: a group-mate pushes an upload with its request (a reduce-scatter round's proposal or values:
  peers/reducescatter.py), kept in ``uploads`` (peers/uploads.py), and gets our offer under the key back;
* ``fetch`` / ``start_fetch``: our downloads of a set of group-mates' payloads, each checked against its announced
  length and SHA-256, through relays when the peer cannot be dialed; ``PendingFetch`` holds ones in flight.

What goes over the wire is counted two ways: by key (``served_bytes``: our payloads, relayed copies and pushed
uploads under the key or upload name they went under, whenever they went: a round attributes its bytes by its keys,
``sent_under``) and in all (``traffic``: every byte sent and received, in a round or not).

Every request is checked first: the requester must be admitted (a certified swarm: peers/admission.py), an upload
must fit ``max_upload_bytes``, and a refused request is answered with an error naming the reason; the server keeps
serving.

**Commitments.** A payload offered under a committed key (``offer(committed=True)``: a sparse round's all-gather) is
served, and so are our copies under that key, only to a request that carries the requester's commitment: the
SHA-256 of its own payload under the key (``fetch(commitment=...)``). The first commitment a requester sends under a
key is kept (``commitment``; a different second one is refused), and the round drops a member whose payload does not
match the commitment it sent us. So no member sees another's row before its own is fixed: a member matched early
announces no digest in matchmaking, and without this it could fetch the honest rows first and craft its own against
them (a rushing attack on the robust rule). Where it commits one payload to us and serves another to someone else,
the members' input digests differ (daemon/checks.py: equivocation).

The rounds that use it are in peers/allgather.py (all-gather) and peers/reducescatter.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import mmap
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import AsyncIterator, Callable, Dict, Iterable, Optional, Tuple

from dilocox.peers.averaging import LEFT_BEHIND, RoundFailed
from dilocox.peers.deadlines import LinkEstimate
from dilocox.peers.reachability import DialLog
from dilocox.peers.uploads import Uploads
from dilocox.proto.dilocox.v1.swarm_pb2 import ContributionChunk, ContributionRequest
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase

from dilocox.sparse.wire import ContributionError

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # pieces of a payload on the wire (hivemind's unary limit is 4 MiB; streams have none)
NOT_HELD = "not held"  # a relay's answer when it has no copy (yet) of the asked member's contribution
RELAY_WAIT_S = 2.0     # a relay waits this long for its copy before answering NOT_HELD
RELAY_POLL_S = 0.5     # a fetcher asks the relays again after this pause while none holds a copy
COPY_KEYS = 2          # rounds whose fetched contributions are kept to relay
COMMITTED_KEYS = 8     # committed keys whose requesters' commitments are kept: a few rounds' worth
EMPTY_RETRIES = 2      # an empty stream without an error is asked for again this often (see _Empty)
# a member asked for its own contribution before offering it waits this long for the offer: group-mates whose
# compute ended first, or an early round's all-gather, can ask while it still encodes (seconds at 100M values)
OFFER_WAIT_S = 60.0
SENT_KEYS = 4096  # keys and upload names whose bytes sent are kept (served_bytes): hundreds of rounds' worth
UPLOAD_KEYS = 4  # keys a requester's uploads are kept under: two rounds' proposals and values
MAX_UPLOAD_BYTES = 256 << 20  # the most a group-mate may push with one request (rpc_exchange)
# tamper(payload, requester peer_id, key) -> bytes: the red-team hook's view of what we serve
Tamper = Callable[[bytes, str, str], bytes]


class ContributionServer(ServicerBase):
    """Serves this node's contributions to its group-mates and fetches theirs; a fetch can push an upload with
    its request (``rpc_exchange``: a reduce-scatter round's proposals and values, kept in ``uploads``).

    Runs its own asyncio loop in a thread of the main process, on a replica of the DHT's P2P
    (``replicate_p2p``: the DHT's public ``replicate_p2p``, called once in that loop).
    ``namespace`` keeps swarms and stages apart (the averager's prefix). Offers are kept for the
    last ``keep`` keys, so a slow group-mate can still fetch a round's payload after we moved on.
    """

    def __init__(self, replicate_p2p: Callable[[], "asyncio.Future[P2P]"], namespace: str, *,
                 keep: int = 4, tamper: Optional[Tamper] = None, startup_timeout_s: float = 30.0,
                 admitted: Optional[Callable[[str], Optional[str]]] = None, max_bytes: Optional[int] = None,
                 offer_wait_s: float = OFFER_WAIT_S, left: Optional[Callable[[str], bool]] = None):
        """``admitted(peer_id)``: None if that peer may fetch our contributions, else why not (a certified
        swarm: peers/admission.py); None for an open swarm. ``left(peer_id)``: True once that peer has left the
        swarm (no live membership record, or one that says it is leaving; a blocking read, run off our loop):
        a fetch then stops asking the relays for its payload when none of them holds a copy, instead of
        asking until the deadline (a member that leaves mid-round never serves it). None: never.
        ``max_bytes``: the oldest offers are also dropped
        while all of them together hold more (the newest is always kept). ``offer_wait_s``: how long a request
        for a key we have not offered yet waits for the offer (0: answer at once, e.g. for keys that may never
        come, such as the applied update of a round we skipped)."""
        self.namespace, self.keep, self.tamper, self.admitted, self.left = namespace, keep, tamper, admitted, left
        self.max_bytes, self.offer_wait_s = max_bytes, offer_wait_s
        self._refused: Dict[str, str] = {}
        self._offers: "OrderedDict[str, bytes]" = OrderedDict()
        self._copies: "OrderedDict[str, Dict[str, bytes]]" = OrderedDict()  # key -> owner -> checked payload
        # committed key -> requester -> the SHA-256 of its own payload it sent with its first request under the key
        self._commitments: "OrderedDict[str, Dict[str, str]]" = OrderedDict()
        self.dials = DialLog()
        self.link = LinkEstimate()  # our download rate and latency, measured on every round's downloads
        # key or upload name -> bytes sent under it (served, relayed or pushed), the newest SENT_KEYS
        self._sent: "OrderedDict[str, int]" = OrderedDict()
        self._sent_total = self._received_total = 0  # every byte, whatever its key (traffic)
        self.uploads = Uploads(UPLOAD_KEYS)  # what group-mates pushed with their requests (rpc_exchange)
        self.max_upload_bytes = MAX_UPLOAD_BYTES
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="contributions", daemon=True)
        self._thread.start()
        self._p2p: P2P = self._call(self._setup(replicate_p2p), startup_timeout_s)
        self.peer_id = self._p2p.peer_id.to_base58()

    async def _setup(self, replicate_p2p) -> P2P:
        p2p = await replicate_p2p()
        await self.add_p2p_handlers(p2p, namespace=self.namespace)
        return p2p

    def _call(self, coro, timeout_s: float):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    # ------------------------------------------------------------------ serving
    def offer(self, key: str, payload: bytes | mmap.mmap, committed: bool = False) -> None:
        """Serve ``payload`` under ``key`` (a round's group key) from now on: bytes, or a read-only map of a file
        (peers/spill.py), served as it is, without a copy. ``committed``: it, and our copies under ``key``, go only
        to requests that carry a commitment (module docstring)."""
        with self._lock:
            if committed and key not in self._commitments:
                self._commitments[key] = {}
                while len(self._commitments) > COMMITTED_KEYS:
                    self._commitments.popitem(last=False)
            self._offers[key] = payload if isinstance(payload, (bytes, mmap.mmap)) else bytes(payload)
            self._offers.move_to_end(key)
            while len(self._offers) > self.keep or (self.max_bytes is not None and len(self._offers) > 1 and
                                                    sum(map(len, self._offers.values())) > self.max_bytes):
                self._offers.popitem(last=False)

    def commitment(self, key: str, peer: str) -> Optional[str]:
        """The SHA-256 (hex) of its own payload that ``peer`` sent with its first request under committed ``key``,
        or None (it asked us nothing under it, or the key is not committed or too old)."""
        with self._lock:
            return self._commitments.get(key, {}).get(peer)

    def _commit(self, key: str, requester: str, commitment: str) -> Optional[str]:
        """None if ``requester`` may be served under ``key``; else why not (no valid commitment, or another one
        than its first under the key)."""
        with self._lock:
            table = self._commitments.get(key)
            if table is None:
                return None
            if len(commitment) != 64 or any(ch not in "0123456789abcdef" for ch in commitment):
                return "no commitment: a request under this key must carry the SHA-256 of the requester's own payload"
            first = table.setdefault(requester, commitment)
        if first != commitment:
            logger.warning("refused %s under %r: it committed to %s.., now to %s..", requester[:16], key[:40],
                           first[:12], commitment[:12])
            return f"a different commitment: {requester[:16]} committed to another payload under this key"
        return None

    def served_bytes(self, key: str) -> int:
        """Bytes sent under ``key`` so far, at any time and to all requesters: our payload, our copies of others'
        (as a relay), and uploads pushed under that name with a fetch (``fetch(uploads=...)``). Kept for the
        newest SENT_KEYS keys and names."""
        with self._lock:
            return self._sent.get(key, 0)

    def sent_under(self, keys: Iterable[str]) -> Tuple[int, Callable[[], int]]:
        """(bytes sent under ``keys`` so far, ``served_bytes`` summed; a function answering the bytes sent under them
        since this call): a round's payloads until its exchange returns, and those group-mates fetch after it
        (peers/averaging.py ``RoundResult.sent_since``). Each byte is in one of the two."""
        keys = tuple(keys)
        with self._lock:
            then = sum(self._sent.get(k, 0) for k in keys)

        def since() -> int:
            with self._lock:
                return max(0, sum(self._sent.get(k, 0) for k in keys) - then)
        return then, since

    def traffic(self) -> Tuple[int, int]:
        """(bytes sent, bytes received) since this server started: every piece of a payload, copy or upload handed
        to a stream or read from one, in a round or not (refused or cut transfers too), plus ``add_traffic``'s.
        Protocol framing and error answers are not counted."""
        with self._lock:
            return self._sent_total, self._received_total

    def add_traffic(self, sent: int, received: int) -> None:
        """Count bytes moved for the rounds over this server by other means (hivemind's metadata phase: its
        estimate, peers/averaging.py ``PhaseResult``) in ``traffic``."""
        with self._lock:
            self._sent_total += int(sent)
            self._received_total += int(received)

    def offered(self, key: str) -> bool:
        """Whether we serve a payload under ``key`` (``offer``; the oldest are dropped, see ``keep``)."""
        with self._lock:
            return key in self._offers

    def _count_sent(self, key: str, n: int) -> None:
        with self._lock:
            self._sent_total += n
            self._sent[key] = self._sent.get(key, 0) + n
            self._sent.move_to_end(key)
            while len(self._sent) > SENT_KEYS:
                self._sent.popitem(last=False)

    def _count_received(self, n: int) -> None:
        with self._lock:
            self._received_total += n

    async def rpc_contribution(self, request: ContributionRequest,
                               context: P2PContext) -> AsyncIterator[ContributionChunk]:
        """A group-mate asks for our contribution under ``request.key``: the payload in order, in
        pieces of CHUNK_BYTES, or one message with ``error`` set."""
        requester = context.remote_id.to_base58()  # authenticated by libp2p
        refusal = self._refusal(requester)
        if refusal is not None:
            yield ContributionChunk(error=f"not admitted: {refusal}")
            return
        if request.owner and request.owner != self.peer_id:
            payload = await self._copy(request.key, request.owner)
            if payload is None:
                yield ContributionChunk(error=f"{NOT_HELD}: no copy of {request.owner[:16]}'s contribution")
                return
            why = self._commit(request.key, requester, request.commitment)  # we hold a copy once ours is offered
            if why is not None:
                yield ContributionChunk(error=why)
                return
            async for chunk in self._pieces(payload, request.key):
                yield chunk
            return
        async for chunk in self._serve_own(request.key, requester, commitment=request.commitment):
            yield chunk

    async def rpc_exchange(self, requests: AsyncIterator[ContributionRequest],
                           context: P2PContext) -> AsyncIterator[ContributionChunk]:
        """A group-mate pushes an upload (``upload`` of the request stream's messages, in order; the first names
        the ``key``) and asks for our contribution under that key: a reduce-scatter round's proposal with the
        request for our union, its values with the request for our result (peers/uploads.py). The upload is kept
        for ``uploads.collect``; the answer is ``rpc_contribution``'s. Refused with ``error`` set: a requester
        not admitted, an upload over ``max_upload_bytes``, a different second upload under the same key."""
        requester = context.remote_id.to_base58()
        refusal = self._refusal(requester)
        if refusal is not None:
            # read (and drop) what it is sending first: a stream closed while the requester still writes reaches
            # it as a broken pipe instead of this answer
            received = 0
            async for request in requests:
                received += len(request.upload)
                if received > self.max_upload_bytes:
                    break
            yield ContributionChunk(error=f"not admitted: {refusal}")
            return
        key, upload = None, bytearray()
        async for request in requests:
            key = request.key if key is None else key
            upload += request.upload
            self._count_received(len(request.upload))
            if len(upload) > self.max_upload_bytes:
                yield ContributionChunk(error=f"upload over {self.max_upload_bytes} bytes")
                return
        if key is None:
            yield ContributionChunk(error="an exchange without a request")
            return
        why = self.uploads.put(key, requester, bytes(upload))
        if why is not None:
            logger.warning("refused an upload of %s under %r: %s", requester[:16], key[:40], why)
            yield ContributionChunk(error=f"upload refused: {why}")
            return
        # our union or result exists only once every member's upload is in (or our collect gave up): wait for it as
        # long as the requester does, whatever offer_wait_s says (that is for payloads that may never come)
        async for chunk in self._serve_own(key, requester, max(self.offer_wait_s, OFFER_WAIT_S)):
            yield chunk

    def _refusal(self, requester: str) -> Optional[str]:
        refusal = self.admitted(requester) if self.admitted is not None else None
        if refusal is not None and self._refused.get(requester) != refusal:
            logger.warning("refused our contribution to %s: %s", requester, refusal)
            self._refused[requester] = refusal
        return refusal

    async def _serve_own(self, key: str, requester: str, wait_s: Optional[float] = None,
                         commitment: str = "") -> AsyncIterator[ContributionChunk]:
        payload = await self._own(key, wait_s)
        if payload is None:
            yield ContributionChunk(error=f"no contribution under key {key[:40]!r}")
            return
        why = self._commit(key, requester, commitment)  # once offered: the offer says whether the key is committed
        if why is not None:
            yield ContributionChunk(error=why)
            return
        if self.tamper is not None:
            payload = self.tamper(payload, requester, key)
        async for chunk in self._pieces(payload, key):
            yield chunk

    async def _pieces(self, payload: bytes, key: str) -> AsyncIterator[ContributionChunk]:
        for i in range(0, max(len(payload), 1), CHUNK_BYTES):
            piece = payload[i:i + CHUNK_BYTES]
            self._count_sent(key, len(piece))  # as handed to the stream: a stream cut early counts what it carried
            yield ContributionChunk(data=piece, total_bytes=len(payload) if i == 0 else 0)

    async def _own(self, key: str, wait_s: Optional[float] = None) -> Optional[bytes]:
        """Our contribution under ``key``, waiting up to ``wait_s`` (default ``offer_wait_s``) for ``offer`` (the
        requester's own deadline usually ends the wait first, by cancelling the call)."""
        deadline = time.monotonic() + (self.offer_wait_s if wait_s is None else wait_s)
        while True:
            with self._lock:
                payload = self._offers.get(key)
            if payload is not None or time.monotonic() >= deadline:
                return payload
            await asyncio.sleep(0.05)

    async def _copy(self, key: str, owner: str) -> Optional[bytes]:
        """Our checked copy of ``owner``'s contribution under ``key``, waiting up to RELAY_WAIT_S for it."""
        deadline = time.monotonic() + RELAY_WAIT_S
        while True:
            with self._lock:
                payload = self._copies.get(key, {}).get(owner)
            if payload is not None or time.monotonic() >= deadline:
                return payload
            await asyncio.sleep(0.1)

    def _keep_copy(self, key: str, owner: str, payload: bytes) -> None:
        with self._lock:
            self._copies.setdefault(key, {})[owner] = payload
            self._copies.move_to_end(key)
            while len(self._copies) > COPY_KEYS:
                self._copies.popitem(last=False)

    # ------------------------------------------------------------------ fetching
    def fetch(self, wanted: Dict[str, Tuple[Optional[str], int]], key: str, timeout_s: float,
              relays: Tuple[str, ...] = (),
              no_direct: frozenset = frozenset(), stop: Optional[Callable[[], bool]] = None,
              check_every_s: float = 1.0,
              uploads: Optional[Dict[str, Tuple[str, bytes]]] = None,
              commitment: str = "") -> Tuple[Dict[str, bytes], Dict[str, str]]:
        """Download the payloads of ``wanted`` (peer_id -> (sha256 hex, exact length in bytes), or (None,
        the largest valid length) when nothing was announced) under ``key``, all at once, within
        ``timeout_s`` seconds. A peer is dialed directly unless it is in ``no_direct`` or a dial to it
        failed recently (``dials``); else, or when that fails, its contribution is asked of ``relays``
        (members that may hold a copy), in order. Returns (peer_id -> payload whose length and digest
        match, peer_id -> why it was not accepted). A wanted length of 0 accepts an empty payload.

        ``uploads``: peer_id -> (name, bytes) pushed to that peer with the request (``rpc_exchange``: the peer
        ``collect``s it; directly only, never through a relay), counted in ``served_bytes(name)`` and passed
        through ``tamper`` with that name. ``commitment``: the SHA-256 (hex) of our own payload under ``key``, sent
        with every request (a committed key's servers answer nothing else; module docstring).
        ``stop()``, polled every ``check_every_s`` seconds, ends the wait early: the downloads in flight are
        cancelled and RoundFailed is raised (the round went on without us; waiting on a group-mate that
        left it would only delay our re-sync)."""
        return self.start_fetch(wanted, key, timeout_s, relays, no_direct, uploads,
                                commitment).result(stop, check_every_s)

    def start_fetch(self, wanted: Dict[str, Tuple[Optional[str], int]], key: str, timeout_s: float,
                    relays: Tuple[str, ...] = (), no_direct: frozenset = frozenset(),
                    uploads: Optional[Dict[str, Tuple[str, bytes]]] = None, commitment: str = "") -> "PendingFetch":
        """``fetch`` without waiting: the downloads run on our loop while the caller does something else (a
        reducer collects the uploads its group-mates push while its own go out); ``PendingFetch.result``
        waits for them."""
        if not wanted:
            return PendingFetch(None, {}, key, timeout_s)
        future = asyncio.run_coroutine_threadsafe(
            self._fetch_all(wanted, key, timeout_s, tuple(relays), no_direct, dict(uploads or {}), commitment),
            self._loop)
        return PendingFetch(future, wanted, key, timeout_s)

    async def _fetch_all(self, wanted, key, timeout_s, relays, no_direct, uploads, commitment) -> Dict[str, object]:
        peers, timings = sorted(wanted), []
        started = time.monotonic()
        outcomes = await asyncio.gather(*[asyncio.wait_for(self._fetch_one(p, *wanted[p], key, relays, no_direct,
                                                                           timings, uploads.get(p), commitment),
                                                          timeout_s)
                                          for p in peers], return_exceptions=True)
        if timings:  # the direct downloads that succeeded measure our link (peers/deadlines.py); waits on a
            # dead peer or a relay's copy are no measure of it
            self.link.observe(sum(n for n, _, _ in timings), max(done for _, _, done in timings) - started,
                              min(first for _, first, _ in timings) - started)
        out: Dict[str, object] = {}
        for peer, o in zip(peers, outcomes):
            if isinstance(o, bytes):
                out[peer] = o
            elif isinstance(o, asyncio.TimeoutError):
                out[peer] = f"not received within {timeout_s:.0f}s"
            else:
                out[peer] = f"not received: {o}"
        return out

    async def _fetch_one(self, peer: str, sha256: Optional[str], size: int, key: str, relays: Tuple[str, ...],
                         no_direct: frozenset, timings: list, upload: Optional[Tuple[str, bytes]] = None,
                         commitment: str = "") -> bytes:
        """``peer``'s payload, from itself or from a relay (module docstring); ``upload`` (name, bytes) goes to
        the peer itself with the request. Raises ContributionError if the peer itself served bad bytes or no
        source could serve it."""
        sources = [peer] if peer not in no_direct and self.dials.worth_dialing(peer) else []
        if upload is None:
            sources += [r for r in relays if r not in (peer, self.peer_id)]
        errors: Dict[str, str] = {}
        empty = 0
        while sources:
            for src in list(sources):
                try:
                    payload = await self._download(src, peer, sha256, size, key, timings, upload, commitment)
                except _NotHeld:
                    continue  # the relay has no copy yet: ask again after a pause
                except _Empty as e:
                    empty += 1
                    if empty <= EMPTY_RETRIES:  # a stream cut before its first byte: ask again after a pause
                        logger.info("the download of %s's contribution from %s was cut (%s); asking again",
                                    peer, src, e)
                        continue
                    if src == peer:
                        raise ContributionError(f"empty payload: {e}, {empty} times") from e
                    sources.remove(src)
                    errors[src] = str(e)
                    continue
                except ContributionError as e:
                    if src == peer:
                        raise  # the contributor itself served bad bytes
                    sources.remove(src)  # a relay that serves bad bytes is not asked again
                    errors[src] = str(e)
                    continue
                except Exception as e:  # not reached: p2pd could not dial it, or the stream broke
                    if "dial" in str(e).lower():  # p2pd's "failed to dial ... all dials failed" (ControlFailure)
                        self.dials.failed(src)
                    sources.remove(src)
                    errors[src] = f"{type(e).__name__}: {str(e)[:120]}"
                    continue
                if src == peer:
                    self.dials.succeeded(peer)
                else:
                    logger.info("fetched %s's contribution via relay %s", peer, src)
                self._keep_copy(key, peer, payload)
                return payload
            if sources and peer not in sources and self.left is not None and \
                    await asyncio.get_running_loop().run_in_executor(None, self.left, peer):
                # copies only come from the contributor, directly or through members that got one: gone, and no
                # member we asked in this pass holds one, nobody ever will
                raise ContributionError("it left the swarm before anyone we asked got a copy")
            if sources:
                await asyncio.sleep(RELAY_POLL_S)
        raise ContributionError("neither the peer nor a relay served it (" +
                                ("; ".join(f"{s[:12]}: {e}" for s, e in errors.items()) or "no relay") + ")")

    async def _download(self, src: str, peer: str, sha256: Optional[str], size: int, key: str,
                        timings: list, upload: Optional[Tuple[str, bytes]] = None, commitment: str = "") -> bytes:
        """One payload from ``src`` (``peer``'s own, or a relay's copy), pushing ``upload`` with the request. A
        direct download that succeeds appends (bytes, monotonic time of its first byte, of its last) to
        ``timings``."""
        first = None
        stub = self.get_stub(self._p2p, PeerID.from_base58(src), namespace=self.namespace)
        buf = bytearray()
        total = 0  # the length the server stated (0: an older server stated none)
        if upload is None:
            answer = await stub.rpc_contribution(ContributionRequest(key=key, owner="" if src == peer else peer,
                                                                     commitment=commitment))
        else:
            answer = await stub.rpc_exchange(self._upload_stream(key, src, *upload))
        async for chunk in answer:
            if chunk.error:
                if chunk.error.startswith(NOT_HELD):
                    raise _NotHeld(chunk.error)
                raise ContributionError(f"the peer answered: {chunk.error[:200]}")
            first = first or time.monotonic()
            total = total or chunk.total_bytes
            buf += chunk.data
            self._count_received(len(chunk.data))
            if len(buf) > size:
                raise ContributionError(f"oversized payload: more than the {size} bytes expected")
        if not buf and size == 0:
            return b""
        if not buf:  # never a valid payload: hivemind ends a stream cut before a response as an empty one
            raise _Empty("the stream ended before its first byte")
        if total and len(buf) < total:  # ... and one cut part-way as a short one
            raise _Empty(f"the stream ended after {len(buf)} of the {total} bytes stated")
        if sha256 is not None:  # else nothing was announced: the codec checks the exact length
            if len(buf) != size:
                raise ContributionError(f"truncated payload: {len(buf)} of the {size} bytes expected")
            if hashlib.sha256(buf).hexdigest() != sha256:
                raise ContributionError("the bytes do not match the digest announced in matchmaking")
        else:  # ... but the peer may have committed to them when it fetched from us
            committed = self.commitment(key, peer)
            if committed is not None and hashlib.sha256(buf).hexdigest() != committed:
                raise ContributionError("the bytes do not match the commitment it sent when it fetched ours")
        if src == peer and first is not None:
            timings.append((len(buf), first, time.monotonic()))
        return bytes(buf)

    async def _upload_stream(self, key: str, dest: str, name: str,
                             payload: bytes) -> AsyncIterator[ContributionRequest]:
        if self.tamper is not None:
            payload = self.tamper(payload, dest, name)
        for i in range(0, max(len(payload), 1), CHUNK_BYTES):
            piece = payload[i:i + CHUNK_BYTES]
            self._count_sent(name, len(piece))
            yield ContributionRequest(key=key if i == 0 else "", upload=piece)

    def shutdown(self) -> None:
        """Stop serving; the P2P replica's connection to p2pd is closed with the loop."""
        if not self._loop.is_running():
            return
        try:
            self._call(self._close(), 5.0)
        except Exception as e:  # p2pd may be gone already (the DHT shut down first)
            logger.debug("closing the contribution server: %s", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)

    async def _close(self) -> None:
        try:
            await self.remove_p2p_handlers(self._p2p, namespace=self.namespace)
        finally:
            await self._p2p.shutdown()  # a replica owns no p2pd: this closes our connections to it
            await asyncio.sleep(0.05)  # let the transports finish closing on this loop


class PendingFetch:
    """Downloads in flight (``ContributionServer.start_fetch``)."""

    def __init__(self, future: Optional[Future], wanted: Dict[str, Tuple[Optional[str], int]], key: str,
                 timeout_s: float):
        self._future, self._wanted, self._key, self._timeout_s = future, wanted, key, timeout_s
        self._give_up = time.monotonic() + timeout_s + 5.0

    def cancel(self) -> None:
        if self._future is not None:
            self._future.cancel()

    def result(self, stop: Optional[Callable[[], bool]] = None,
               check_every_s: float = 1.0) -> Tuple[Dict[str, bytes], Dict[str, str]]:
        """(peer_id -> payload, peer_id -> why not), as ``ContributionServer.fetch`` returns; blocking. ``stop()``
        is polled every ``check_every_s`` seconds: True cancels the downloads and raises RoundFailed."""
        if self._future is None:
            return {}, {}
        began = time.monotonic()
        try:
            while True:
                try:
                    results = self._future.result(max(0.0, min(check_every_s, self._give_up - time.monotonic())))
                    break
                except FutureTimeout:
                    if time.monotonic() >= self._give_up:
                        raise
                    if stop is not None and stop():
                        self._future.cancel()
                        raise RoundFailed(f"abandoned after {time.monotonic() - began:.1f}s of downloads under "
                                          f"{self._key!r}: {LEFT_BEHIND}") from None
        except FutureTimeout:  # our event loop is starved (32 nodes on 2 cores): a failed fetch
            self._future.cancel()  # the caller asks again or elsewhere; an exception here ended a node (seen at 32)
            return {}, {peer: f"not received within {self._timeout_s + 5.0:.0f}s (our transport did not answer in "
                              "time)" for peer in self._wanted}
        got, failed = {}, {}
        for peer, outcome in results.items():
            if isinstance(outcome, bytes):
                got[peer] = outcome
            else:
                failed[peer] = outcome
        return got, failed


class _NotHeld(Exception):
    """A relay has no copy of the asked contribution (yet)."""


class _Empty(Exception):
    """A download ended without a byte, or before the length the server stated, and without an error.
    hivemind's stream reader treats a closed connection as the end of the stream, so a stream cut under load
    looks like an empty or short payload; in an early-matched round (no digest) it would be dropped by us
    alone, and the group's results differ. It is asked for again (EMPTY_RETRIES)."""
