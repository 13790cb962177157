"""A simulated etcd for bench/scale.py: the :class:`~resilient.coordinator.store.Store`
interface the coordinator and the delta readers use, on a virtual clock, enforcing
etcd's limits and counting what a real etcd would do.

* Limits: a request over :data:`MAX_REQUEST` (etcd's ``--max-request-bytes`` 1.5 MiB)
  fails with etcd's message ``request is too large``; a response over
  :data:`MAX_RESPONSE` (the client's 4 MiB gRPC receive limit) fails with gRPC's
  ``received message larger than max``; expired leases are revoked at most
  :data:`REVOKES_PER_S` per second, checked every :data:`EXPIRY_TICK` s (etcd's lessor).
* Latencies (:class:`Latency`) are added to the virtual clock by each call.
  ``bench/calibrate_sim.py`` fits them to the real etcd here (medians of get, range
  read per MB, put, put per MB, txn, lease calls and watch delivery) and writes
  ``bench/sim_params.json``, which bench/scale.py loads when present; the defaults are
  estimates for a local etcd 3.4, consistent with ``bench/control_plane.py``.
* Counters: raft writes (puts, successful txns, deletes, revokes, grants, expiries), key
  writes (ops inside txns), keep-alives, bytes written, watch events delivered; a model of
  the DB size (live bytes plus the history kept since the last compaction).

Watch callbacks run synchronously right after the change (the bench adds the delivery
latency itself). Pure in-memory; never touches the network.
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from resilient.coordinator.store import KV, Compare, Delete, Put, Store, WatchEvent
from resilient.errors import LeaseExpired, StoreError

MAX_REQUEST = int(1.5 * 1024 * 1024)
MAX_RESPONSE = 4 * 1024 * 1024
REVOKES_PER_S = 1000
EXPIRY_TICK = 0.5
#: etcd's minimum lease TTL, seconds (ceil(1.5 x the default 1 s election timeout))
MIN_LEASE_TTL = 2


class Clock:
    """Virtual time (seconds) and a timer heap. ``timer_cpu``: process CPU seconds spent
    in timers so far (the bench subtracts it from a measured call during which timers
    ran: they are the agents', not the caller's)."""

    def __init__(self) -> None:
        self.now = 1_000_000.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._running = False
        self.timer_cpu = 0.0

    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), fn))

    def run_until(self, t: float) -> None:
        """Run every timer due by ``t`` in time order (a timer that itself takes time,
        nested, only moves the clock: the outer loop runs the rest, a little late)."""
        if self._running:
            self.now = max(self.now, t)
            return
        self._running = True
        try:
            while self._heap and self._heap[0][0] <= t:
                when, _, fn = heapq.heappop(self._heap)
                self.now = max(self.now, when)
                c0 = time.process_time()
                try:
                    fn()
                finally:
                    self.timer_cpu += time.process_time() - c0
        finally:
            self._running = False
        self.now = max(self.now, t)

    def advance(self, dt: float) -> None:
        """Time passes for the caller; everybody else's timers run meanwhile."""
        self.run_until(self.now + dt)


@dataclass
class Latency:
    """Seconds per call (virtual). The defaults are estimates for a local etcd 3.4;
    ``bench/calibrate_sim.py`` measures them here and bench/scale.py loads its file."""

    read: float = 0.0004          # a small range
    read_per_mb: float = 0.012    # plus, per MB returned
    write: float = 0.0020         # a put / txn (one raft entry, fsync'd)
    write_per_mb: float = 0.010
    lease: float = 0.0006         # grant / revoke / ttl
    watch: float = 0.0008         # etcd -> watcher, one event
    txn: float = 0.0020           # a transaction (compares + ops), plus write_per_mb of its ops


@dataclass
class Counters:
    raft_writes: int = 0
    key_writes: int = 0
    main_key_writes: int = 0      # by the bench's main flow (not by timers: agents' keep-alives, summaries)
    bytes_written: int = 0
    keepalives: int = 0
    watch_events: int = 0
    revokes: int = 0
    expiries: int = 0
    history_bytes: int = 0        # since the last compaction

    def snapshot(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Lease:
    ttl: float
    expires: float
    keys: set[str] = field(default_factory=set)


class _Watch:
    def __init__(self, store: "SimStore", prefix: str, is_prefix: bool,
                 cb: Callable[[list[WatchEvent]], None]) -> None:
        self.store, self.prefix, self.is_prefix, self.cb = store, prefix, is_prefix, cb

    def matches(self, key: str) -> bool:
        return key.startswith(self.prefix) if self.is_prefix else key == self.prefix

    def cancel(self) -> None:
        self.store._watches.discard(self)


class SimStore:
    """See the module docstring. ``retry_timeout`` mirrors the real Store's attribute."""

    retry_timeout = 10.0

    def __init__(self, clock: Clock, latency: Latency | None = None) -> None:
        self.clock = clock
        self.lat = latency or Latency()
        self.c = Counters()
        self._kv: dict[str, KV] = {}
        self._sorted: list[str] = []
        self._rev = 1
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(0x1000)
        self._watches: set[_Watch] = set()
        self._expiry_scheduled = False
        self.live_bytes = 0

    # -- helpers ------------------------------------------------------------------------

    def _cost(self, base: float, per_mb: float, nbytes: int) -> None:
        self.clock.advance(base + per_mb * nbytes / 1e6)

    def _range(self, prefix: str) -> list[KV]:
        i = bisect.bisect_left(self._sorted, prefix)
        out = []
        while i < len(self._sorted) and self._sorted[i].startswith(prefix):
            out.append(self._kv[self._sorted[i]])
            i += 1
        return out

    def _respond(self, kvs: list[KV]) -> None:
        size = sum(len(k.key) + len(k.value) + 32 for k in kvs)
        if size > MAX_RESPONSE:
            raise StoreError(f"grpc: received message larger than max ({size} vs. {MAX_RESPONSE})")
        self._cost(self.lat.read, self.lat.read_per_mb, size)

    def _emit(self, ev: WatchEvent) -> None:
        for w in list(self._watches):
            if w.matches(ev.key):
                self.c.watch_events += 1
                w.cb([ev])

    def _apply_put(self, key: str, value: bytes, lease: int | None) -> WatchEvent:
        if lease is not None and lease not in self._leases:
            raise LeaseExpired(f"lease {lease:x} is gone; cannot write {key}")
        old = self._kv.get(key)
        if old is None:
            bisect.insort(self._sorted, key)
        else:
            self.live_bytes -= len(old.key) + len(old.value)
            if old.lease and old.lease in self._leases:
                self._leases[old.lease].keys.discard(key)
        kv = KV(key, value, old.create_revision if old else self._rev, self._rev, (old.version + 1) if old else 1,
                lease or 0)
        self._kv[key] = kv
        if lease:
            self._leases[lease].keys.add(key)
        self.live_bytes += len(key) + len(value)
        self.c.key_writes += 1
        self.c.main_key_writes += not self.clock._running
        self.c.bytes_written += len(key) + len(value)
        self.c.history_bytes += len(key) + len(value)
        return WatchEvent("put", key, value, kv.mod_revision, kv.create_revision, kv.lease)

    def _apply_delete(self, key: str) -> WatchEvent | None:
        old = self._kv.pop(key, None)
        if old is None:
            return None
        self._sorted.pop(bisect.bisect_left(self._sorted, key))
        self.live_bytes -= len(old.key) + len(old.value)
        if old.lease and old.lease in self._leases:
            self._leases[old.lease].keys.discard(key)
        self.c.key_writes += 1
        self.c.main_key_writes += not self.clock._running
        self.c.history_bytes += len(key)
        return WatchEvent("delete", key, b"", self._rev)

    def _check_request(self, nbytes: int) -> None:
        if nbytes > MAX_REQUEST:
            raise StoreError(f"etcdserver: request is too large ({nbytes} bytes > {MAX_REQUEST})")

    # -- the Store interface -------------------------------------------------------------

    def get(self, key: str) -> KV | None:
        kv = self._kv.get(key)
        self._respond([kv] if kv else [])
        return kv

    def get_with_revision(self, key: str) -> tuple[KV | None, int]:
        return self.get(key), self._rev

    def get_prefix(self, prefix: str) -> list[KV]:
        return self.snapshot(prefix)[0]

    def snapshot(self, prefix: str) -> tuple[list[KV], int]:
        kvs = self._range(prefix)
        self._respond(kvs)
        return kvs, self._rev

    def snapshot_page(self, prefix: str, start: str, limit: int, revision: int = 0,
                      keys_only: bool = False) -> tuple[list[KV], int, bool]:
        i = bisect.bisect_left(self._sorted, start)
        out: list[KV] = []
        while i < len(self._sorted) and self._sorted[i].startswith(prefix) and len(out) < limit:
            kv = self._kv[self._sorted[i]]
            out.append(dataclasses.replace(kv, value=b"") if keys_only else kv)
            i += 1
        more = i < len(self._sorted) and self._sorted[i].startswith(prefix)
        self._respond(out)
        return out, revision or self._rev, more

    def put(self, key: str, value: bytes | str, lease: int | None = None) -> int:
        value = value if isinstance(value, bytes) else value.encode()
        self._check_request(len(key) + len(value))
        self._rev += 1
        ev = self._apply_put(key, value, lease)
        self.c.raft_writes += 1
        self._cost(self.lat.write, self.lat.write_per_mb, len(value))
        self._emit(ev)
        return self._rev

    def delete(self, key: str) -> bool:
        self._rev += 1
        ev = self._apply_delete(key)
        self.c.raft_writes += 1
        self._cost(self.lat.write, 0, 0)
        if ev:
            self._emit(ev)
        return ev is not None

    def delete_prefix(self, prefix: str) -> int:
        keys_ = [k.key for k in self._range(prefix)]
        self._rev += 1
        evs = [self._apply_delete(k) for k in keys_]
        self.c.raft_writes += 1
        self._cost(self.lat.write, 0, 0)
        for ev in evs:
            self._emit(ev)
        return len(keys_)

    def _holds(self, c: Compare) -> bool:
        kv = self._kv.get(c.key)
        actual = 0 if kv is None else {"create": kv.create_revision, "mod": kv.mod_revision,
                                       "version": kv.version}.get(c.target, None)
        if c.target == "value":
            actual = kv.value if kv else b""
        want = c.operand
        return bool({"==": actual == want, "!=": actual != want, ">": actual > want, "<": actual < want}[c.op])

    def txn(self, compare: Iterable[Compare], success: Iterable[Put | Delete],
            failure: Iterable[Put | Delete] = ()) -> bool:
        compare, success, failure = list(compare), list(success), list(failure)
        size = sum(len(o.key) + len(getattr(o, "value", b"")) for o in success + failure)
        self._check_request(size)
        ok = all(self._holds(c) for c in compare)
        ops = success if ok else failure
        self._cost(self.lat.txn, self.lat.write_per_mb, size)
        if not ops:
            return ok
        self._rev += 1
        evs: list[WatchEvent] = []
        for op in ops:
            if isinstance(op, Put):
                evs.append(self._apply_put(op.key, op.value, op.lease))
            elif op.range_end is not None:
                for k in [k for k in self._sorted if op.key <= k < op.range_end]:
                    evs.append(self._apply_delete(k))
            elif op.prefix:
                for k in [kv.key for kv in self._range(op.key)]:
                    evs.append(self._apply_delete(k))
            else:
                evs.append(self._apply_delete(op.key))
        self.c.raft_writes += 1
        for ev in evs:
            if ev is not None:
                self._emit(ev)
        return ok

    # the real Store's, on this txn
    cas = Store.cas
    create = Store.create

    # -- leases --------------------------------------------------------------------------

    def grant(self, ttl: float) -> int:
        lid = next(self._lease_ids)
        # the client rounds up to whole seconds (Store.grant), etcd raises it to its minimum
        self._leases[lid] = _Lease(float(max(MIN_LEASE_TTL, math.ceil(ttl))), 0.0)
        self._leases[lid].expires = self.clock.now + self._leases[lid].ttl
        self.c.raft_writes += 1
        self._cost(self.lat.lease, 0, 0)
        self._schedule_expiry()
        return lid

    def keepalive(self, lease_id: int, budget: float | None = None) -> float:
        """One refresh (as sent on a multiplexed keep-alive stream: not a raft write)."""
        lease = self._leases.get(lease_id)
        self.c.keepalives += 1
        if lease is None:
            raise LeaseExpired(f"lease {lease_id:x} expired or was revoked")
        lease.expires = self.clock.now + lease.ttl
        return lease.ttl

    def _drop_lease(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id)
        self._rev += 1
        evs = [self._apply_delete(k) for k in sorted(lease.keys)]
        self.c.raft_writes += 1
        for ev in evs:
            if ev is not None:
                self._emit(ev)

    def revoke(self, lease_id: int) -> bool:
        self._cost(self.lat.lease, 0, 0)
        if lease_id not in self._leases:
            return False
        self.c.revokes += 1
        self._drop_lease(lease_id)
        return True

    def lease_ttl(self, lease_id: int) -> tuple[float, float] | None:
        lease = self._leases.get(lease_id)
        self._cost(self.lat.lease, 0, 0)
        if lease is None:
            return None
        return max(0.0, lease.expires - self.clock.now), lease.ttl

    def _schedule_expiry(self) -> None:
        if not self._expiry_scheduled:
            self._expiry_scheduled = True
            tick = (int(self.clock.now / EXPIRY_TICK) + 1) * EXPIRY_TICK
            self.clock.at(tick, self._expire)

    def _expire(self) -> None:
        """etcd's lessor: every tick, revoke expired leases, at most REVOKES_PER_S/s."""
        self._expiry_scheduled = False
        now = self.clock.now
        due = [lid for lid, lease in self._leases.items() if lease.expires <= now]
        for lid in due[: int(REVOKES_PER_S * EXPIRY_TICK)]:
            self.c.expiries += 1
            self._drop_lease(lid)
        if self._leases:
            self._schedule_expiry()

    # -- watches -------------------------------------------------------------------------

    def watch_prefix(self, prefix: str, start_revision: int | None, callback: Callable[[list[WatchEvent]], None],
                     prev_kv: bool = False, is_prefix: bool = True) -> _Watch:
        w = _Watch(self, prefix, is_prefix, callback)
        self._watches.add(w)
        return w

    def watch_key(self, key: str, start_revision: int | None,
                  callback: Callable[[list[WatchEvent]], None]) -> _Watch:
        return self.watch_prefix(key, start_revision, callback, is_prefix=False)

    def revision(self, within: str = "/resilient/") -> int:
        return self._rev

    def compact(self) -> None:
        self.c.history_bytes = 0

    def close(self) -> None:
        self._watches.clear()
