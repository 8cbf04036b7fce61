"""Attacks on what a malicious replica says about its contribution.

* ``WeightLie``: claims weight 1e6 (its replica alone would decide a weighted mean);
* ``BadCodes``: a NaN scale in its sparse payload, announced as is;
* ``Replay``: serves the contribution it sent 5 rounds earlier (valid bytes, stale content);
* ``WrongStart``: claims to start from parameters no one holds;
* ``Equivocate``: serves its honest payload to some group-mates and a sign-flipped, scaled one to the
  others (different bytes to different peers).
"""

from __future__ import annotations

import struct

from dilocox.daemon.redteam import Attack

from dilocox.sparse import HEADER_BYTES


class WeightLie(Attack):
    name = "weight-lie"

    def gather(self, fields: dict, round_index: int) -> dict:
        return dict(fields, weight=1e6)


class BadCodes(Attack):
    name = "nan-codes"

    def contribution(self, payload: bytes, round_index: int) -> bytes:
        return payload[:HEADER_BYTES] + struct.pack("<f", float("nan")) + payload[HEADER_BYTES + 4:]


class Replay(Attack):
    name = "replay"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.sent: dict[int, bytes] = {}

    def contribution(self, payload: bytes, round_index: int) -> bytes:
        self.sent[round_index] = payload
        return self.sent.get(round_index - 5, payload)


class WrongStart(Attack):
    name = "wrong-start-digest"

    def gather(self, fields: dict, round_index: int) -> dict:
        return dict(fields, start_digest="0" * 16 + "/" + fields["start_digest"].split("/")[-1])


class Equivocate(Attack):
    name = "equivocation"

    def payload(self, payload: bytes, requester: str, key: str) -> bytes:
        if sum(requester.encode()) % 2:
            return payload
        out = bytearray(payload)
        # flip every 2-bit code's sign bit (the top bit): each sent value changes sign
        codes = len(payload) - self._codes_start(payload)
        for i in range(len(out) - codes, len(out)):
            out[i] ^= 0b10101010
        return bytes(out)

    @staticmethod
    def _codes_start(payload: bytes) -> int:
        from dilocox.sparse import HEADER, SparseConfig, layout

        _, _, bits, _, total, chunk, topk = HEADER.unpack_from(payload)
        lay = layout(total, SparseConfig(chunk=chunk, topk=topk, bits=bits))
        return lay.total - lay.code_bytes
