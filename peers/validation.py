"""DHT record validators that remember their verdicts.

hivemind validates every copy of a record that a DHT peer returns (``DHTProtocol.call_find`` runs the
DHT's record validators on each one), and a read of the membership key returns every member's record,
about 1 KB and RSA-signed, from each of the several DHT peers it asks. A record is republished only
once per announce period, so the same bytes arrive many times in between: at 12 nodes the DHT process
spent about 60% of its busy time in ``RSASignatureValidator`` and ``SchemaValidator``, and the DHT
processes of a 12-node swarm took a whole core of this 2-core machine (docs/operations.md, "CPU per
node").

Both verdicts are pure functions of the record (key, subkey, value with its signature, expiration
time): the RSA check verifies the signature over exactly those bytes, the schema check parses them.
So the first verdict on a record stands for every later copy of the same record. A publication with a
new expiration time is a new record and is checked afresh. These classes extend hivemind's validators
through their documented override point, ``validate`` (hivemind/dht/validation.py).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey

# records a validator remembers: several announce periods of a swarm of a few hundred members
CACHE_RECORDS = 1024


class VerdictCache:
    """Bounded LRU of record -> verdict. ``hits`` and ``misses`` count lookups (for tests and profiling)."""

    def __init__(self, size: int = CACHE_RECORDS):
        if size < 1:
            raise ValueError(f"a verdict cache needs room for at least one record, got {size}")
        self.size = size
        self.hits = self.misses = 0
        self._verdicts: OrderedDict[DHTRecord, bool] = OrderedDict()

    def verdict(self, record: DHTRecord, check: Callable[[DHTRecord], bool]) -> bool:
        """``check(record)``, computed once per distinct record while it stays among the ``size`` most recent."""
        known = self._verdicts.get(record)
        if known is not None:
            self._verdicts.move_to_end(record)
            self.hits += 1
            return known
        self.misses += 1
        ok = bool(check(record))
        self._verdicts[record] = ok
        if len(self._verdicts) > self.size:
            self._verdicts.popitem(last=False)
        return ok

    def clear(self) -> None:
        self._verdicts.clear()


class CachedSignatureValidator(RSASignatureValidator):
    """hivemind's ``RSASignatureValidator`` (signs with ``private_key``; records whose key or subkey holds an
    ``[owner:...]`` public key must carry that key's signature) with a ``VerdictCache``."""

    def __init__(self, private_key: Optional[RSAPrivateKey] = None, cache_size: int = CACHE_RECORDS):
        super().__init__(private_key)
        self.verdicts = VerdictCache(cache_size)

    def validate(self, record: DHTRecord) -> bool:
        return self.verdicts.verdict(record, super().validate)


class CachedSchemaValidator(SchemaValidator):
    """hivemind's ``SchemaValidator`` with a ``VerdictCache``. Merging another schema in (hivemind merges schema
    validators added to one DHT) can change verdicts, so it empties the cache."""

    def __init__(self, *args, cache_size: int = CACHE_RECORDS, **kwargs):
        super().__init__(*args, **kwargs)
        self.verdicts = VerdictCache(cache_size)

    def validate(self, record: DHTRecord) -> bool:
        return self.verdicts.verdict(record, super().validate)

    def merge_with(self, other: RecordValidatorBase) -> bool:
        merged = super().merge_with(other)
        if merged:
            self.verdicts.clear()
        return merged
