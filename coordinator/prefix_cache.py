"""Records under one etcd prefix kept in memory from a watch, O(change) per event.

:class:`PrefixCache` loads the prefix once by a paged read (1,000 keys per request, under
gRPC's 4 MiB receive limit at any size), then applies the watch's events; it re-reads
(paged) every ``resync_interval`` seconds and after the watch reports a compaction
(``resync`` event). Each key parses (:meth:`PrefixCache.parse`) into one or more
*entries* (id -> value: a rate record is one member's, a node health summary its ranks'),
and the cache keeps the ids whose entry changed or went since the caller last asked
(:meth:`PrefixCache.take_changed`), so a reader can work on the change alone.

Events at or below the revision of the last read are ignored, so a re-read and the watch
never apply an older value over a newer one; an event the watch applied while a re-read
was under way, newer than the revision that read saw, is kept over the read's older value
of its key; a re-read marks changed exactly the entries that differ from what the cache
held. Failure behaviour: a malformed record is skipped
(logged and counted, :func:`~.records.skip`) and its key's entries are forgotten; store
errors of a read propagate to the caller of :meth:`PrefixCache.refresh` (the next call
retries; the watch reconnects on its own). When two keys hold the same id, the last one
written wins until either changes.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import AbstractSet, Generic, TypeVar

from resilient.coordinator import records
from resilient.coordinator.directory import paged_snapshot
from resilient.coordinator.store import Store, WatchEvent, WatchHandle
from resilient.errors import RecordError

V = TypeVar("V")


class PrefixCache(Generic[V]):
    """See the module docstring. Subclasses define :meth:`parse`."""

    def __init__(self, store: Store, prefix: str, resync_interval: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.resync_interval, self._clock = store, resync_interval, clock
        self._prefix = prefix
        self._lock = threading.Lock()
        self._entries: dict[str, V] = {}
        self._of_key: dict[str, tuple[str, ...]] = {}   # key -> the ids it holds
        self._changed: set[str] = set()
        self._key_rev: dict[str, int] = {}   # key -> revision of the last event applied (pruned at each read)
        self._rev = 0                 # revision of the last paged read
        self._due = True              # next refresh() re-reads
        self._next_read = 0.0
        self._watch: WatchHandle | None = None
        self.reads = 0                # paged reads done (tests and the bench count them)

    def parse(self, key: str, raw: bytes) -> Mapping[str, V]:
        """The entries one record holds; raises :class:`~resilient.errors.RecordError`."""
        raise NotImplementedError

    def _noted(self, entry_id: str, value: V | None) -> None:
        """Called under the cache's lock for each entry set (``value``) or gone (None):
        a subclass keeps an index of its own here. The default does nothing."""

    def _entries_of(self, key: str, raw: bytes) -> Mapping[str, V]:
        try:
            return self.parse(key, raw)
        except RecordError as exc:
            records.skip(exc, key)
            return {}

    def refresh(self) -> None:
        """Start the watch on first use and re-read when due. Store errors propagate."""
        if self._due or self._clock() >= self._next_read:
            self._read()

    def _read(self) -> None:
        kvs, rev = paged_snapshot(self.store, self._prefix)
        fresh: dict[str, V] = {}
        of_key: dict[str, tuple[str, ...]] = {}
        for kv in kvs:
            got = self._entries_of(kv.key, kv.value)
            of_key[kv.key] = tuple(got)
            fresh.update(got)
        with self._lock:
            old = self._entries
            # events newer than this read's revision, applied while it ran: the watch's
            # value of their keys stands (the read saw an older one, or none)
            self._key_rev = {k: r for k, r in self._key_rev.items() if r > rev}
            for k in self._key_rev:
                for m in of_key.pop(k, ()):
                    fresh.pop(m, None)
                ids = self._of_key.get(k, ())
                for m in ids:
                    if m in old:
                        fresh[m] = old[m]
                if ids:
                    of_key[k] = ids
            moved = [m for m in old.keys() | fresh.keys() if old.get(m) != fresh.get(m)]
            self._changed.update(moved)
            for m in moved:
                self._noted(m, fresh.get(m))
            self._entries, self._of_key, self._rev, self._due = fresh, of_key, rev, False
            self._next_read = self._clock() + self.resync_interval
            self.reads += 1
        if self._watch is None:
            self._watch = self.store.watch_prefix(self._prefix, rev + 1, self._on_events)

    def _on_events(self, events: list[WatchEvent]) -> None:
        with self._lock:
            for ev in events:
                if ev.type == "resync":
                    self._due = True
                    continue
                if ev.mod_revision <= self._rev:
                    continue
                self._key_rev[ev.key] = ev.mod_revision
                got: Mapping[str, V] = self._entries_of(ev.key, ev.value) if ev.type == "put" else {}
                for m in self._of_key.pop(ev.key, ()):
                    if m not in got:
                        self._entries.pop(m, None)
                        self._changed.add(m)
                        self._noted(m, None)
                for m, v in got.items():
                    self._entries[m] = v
                    self._changed.add(m)
                    self._noted(m, v)
                if got:
                    self._of_key[ev.key] = tuple(got)

    def copy(self) -> dict[str, V]:
        """A copy of every entry (id -> value)."""
        with self._lock:
            return dict(self._entries)

    def take_changed(self) -> set[str]:
        """The ids whose entry changed or went since the last call (then forgotten)."""
        with self._lock:
            out, self._changed = self._changed, set()
            return out

    def requeue(self, ids: AbstractSet[str]) -> None:
        """Mark ``ids`` changed again: a consumer that took them (:meth:`take_changed`)
        and could not use them (its pass failed) hands them back for the next call."""
        with self._lock:
            self._changed.update(ids)

    def close(self) -> None:
        """Stop the watch (idempotent); the next :meth:`refresh` starts over with a read."""
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()
        with self._lock:
            for m in self._entries:
                self._noted(m, None)
            self._entries, self._of_key, self._changed, self._rev, self._due = {}, {}, set(), 0, True
            self._key_rev = {}
