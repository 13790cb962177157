"""The coordinator's health records, kept from a watch on ``health/`` (no O(N) read per pass).

:class:`HealthCache` is a :class:`~.prefix_cache.PrefixCache` of ``health/``: each key
expands into member records (:func:`.health.expand_health`: a node summary into its
ranks'), loaded by one paged read, then updated per watch event; re-read every
:data:`HEALTH_RESYNC_S` seconds or after a compacted watch. :meth:`HealthCache.records`
hands a pass every record plus the members changed since the previous pass
(:class:`~.straggler.HealthRecords`), so the straggler detector works on the change;
:meth:`HealthCache.linked` the records that carry measured link speeds.

Failure behaviour: malformed records are skipped (logged and counted); store errors of a
read propagate to the caller (the next pass retries).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

from resilient.coordinator import keys
from resilient.coordinator.health import expand_health
from resilient.coordinator.link_classes import LINK_LABEL
from resilient.coordinator.prefix_cache import PrefixCache
from resilient.coordinator.store import Store
from resilient.coordinator.straggler import HealthRecord, HealthRecords

#: seconds between the health cache's paged re-reads (a safety net: the watch keeps it current)
HEALTH_RESYNC_S = 300.0
#: up to this many changed records are fetched for a pass at once; more are looked up one by one
PREFETCH_MAX = 4096


class HealthCache(PrefixCache[HealthRecord]):
    """See the module docstring."""

    def __init__(self, store: Store, job: str, resync_interval: float = HEALTH_RESYNC_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(store, keys.health(job), resync_interval, clock)
        self._linked: dict[str, HealthRecord] = {}

    def parse(self, key: str, raw: bytes) -> Mapping[str, HealthRecord]:
        return expand_health(key, raw, self._prefix)

    def _noted(self, entry_id: str, value: HealthRecord | None) -> None:
        if value is not None and isinstance(value.get(LINK_LABEL), Mapping):
            self._linked[entry_id] = value
        else:
            self._linked.pop(entry_id, None)

    def records(self) -> HealthRecords:
        """Every record and the members changed since the previous call: a view that
        looks a record up in the cache (O(1)) and copies them all only when iterated.
        Store errors propagate."""
        self.refresh()
        with self._lock:   # the changed records, fetched under one lock (unless many: looked up when read)
            changed, self._changed = self._changed, set()
            fetched = {m: self._entries.get(m) for m in changed} if len(changed) <= PREFETCH_MAX else {}
        return _CacheRecords(self, changed, fetched)

    def lookup(self, member: str) -> HealthRecord | None:
        """``member``'s current record (None: none)."""
        with self._lock:
            return self._entries.get(member)

    def linked(self) -> dict[str, HealthRecord]:
        """The records carrying ``link_bps`` (what link measurement reads). Store errors
        propagate."""
        self.refresh()
        with self._lock:
            return dict(self._linked)



class _CacheRecords(HealthRecords):
    """:class:`~.straggler.HealthRecords` over a :class:`HealthCache`: the changed
    members' records as fetched with ``changed`` (a record that changes again is in the
    next pass's ``changed``); any other lookup reads the cache's current record;
    iteration and length use one copy of every record, made on first need."""

    def __init__(self, cache: HealthCache, changed: set[str], fetched: dict[str, HealthRecord | None]) -> None:
        super().__init__({}, changed)
        self._cache = cache
        self._fetched = fetched
        self._copy: dict[str, HealthRecord] | None = None

    def _all(self) -> dict[str, HealthRecord]:
        if self._copy is None:
            self._copy = self._cache.copy()
        return self._copy

    def __getitem__(self, member: str) -> HealthRecord:
        if self._copy is not None:
            rec = self._copy.get(member)
        elif member in self._fetched:
            rec = self._fetched[member]
        else:
            rec = self._cache.lookup(member)
        if rec is None:
            raise KeyError(member)
        return rec

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())
