"""Many leases kept alive over **one** multiplexed keep-alive stream (docs/scale.md).

``Store.keepalive`` opens a new ``LeaseKeepAlive`` stream per refresh (simple, and fine
for a handful of leases). A node agent holds one lease; a process that holds many (the
real-etcd scale bench, an agent for several jobs) uses :class:`LeaseMux`: one
bidirectional gRPC stream for all of them (or ``streams`` of them, dealt the refreshes in
turn). About 4-5x cheaper for etcd than a stream per refresh.

The streams run on grpc's asyncio API in one thread of the mux's own: a write and a read
cost one event-loop step each, and the completions of several streams are handled in one
wake-up. The threaded API hands every message between three threads (writer, reader,
gRPC's poller): measured on the 2-core development machine, 180 us of client CPU per
keep-alive against 80 us here with 8 streams (docs/scale.md, "Real etcd").

Schedule: time is cut into ticks of :data:`TICK` s. A lease of TTL ``t`` is refreshed
every ``interval_ticks(t)`` ticks, the largest whole number of ticks not longer than
``t *`` :data:`~.membership.KEEPALIVE_FRACTION` (never less than one tick), and leases are
dealt round-robin over the ticks of their interval, so each tick carries the same share
(``N / interval_ticks``) whatever order they were added in. A tick's refreshes go onto
the streams as one batch, back to back: one wake-up of the sender per tick, not per lease.

**One refresh in flight per lease.** A refresh that comes due while the lease's previous
one is still unanswered is not sent then; it is sent as soon as that answer is read
(counted in ``deferred``). etcd answers a stream's renews in order, so a second renew
queued behind an unanswered one only adds work: an etcd that falls behind (CPU-starved,
or its apply loop busy: a 3.4 ``LeaseRenew`` waits for the applied index) would otherwise
be sent 3N / TTL renews per second however slowly it answers, its queue and every
answer's delay would grow until leases expired. With one in flight the offered rate
follows the answer rate, and N leases survive as long as etcd answers N / TTL renews per
second (a third of the schedule), each within the TTL of its send. Normally answers come
back in milliseconds and nothing is deferred.

**Margin.** etcd keeps a lease for its TTL ``t`` after the last refresh *it received*.
Refreshes leave every ``I <= t / 3`` s, so a lease is lost only if one refresh reaches
etcd more than ``t - I >= 2t / 3`` s later than it was due (relative to the one before):
a refresh delay of up to a third of the TTL (the design's tolerance) leaves another third
of the TTL, ``t / 3`` (1.33 s for the 4 s node lease of a 5 s liveness bound), to spare.
A lease's first refresh leaves within ``I`` of :meth:`LeaseMux.add`, so a lease added
right after its grant has the same margin.

Failure behaviour: when the stream breaks (etcd restart, network) it is reopened and
every lease is refreshed again at once (etcd extends a lease by its TTL on each refresh,
so a short outage loses nothing); a stream that stays silent for two refresh intervals
while refreshes are outstanding is cancelled and reopened the same way. A response with
TTL <= 0 means the lease is gone: it is dropped, counted in ``lost`` and its ``on_lost``
callback runs (in the mux's thread: it must not block) once. A lease whose refresh is
still unanswered when its TTL (counted from the last answered send) runs out is not
declared lost for that: etcd answers every renew it was sent, TTL > 0 if it renewed the
lease in time, TTL 0 if the lease had expired, so the mux waits for that answer (up to a
second TTL, then it is reported lost: counted in ``lost_unanswered``, etcd's TTL 0 in
``lost_by_etcd``). Taking such a lease as lost at once (the rule before) turned late
answers from an overloaded etcd into real losses, since a lease taken as lost is not
refreshed again: 19,274 of 20,495 losses at 12,500 leases and load 15 were of leases
etcd still held (docs/scale.md). A lease past its TTL with no refresh in flight (after a
reconnect) is reported lost and not refreshed, because etcd's ``Renew`` of an expired
lease blocks the stream until its lessor revokes the lease (up to 1,000 revokes/s),
which stalls every other lease on the stream and let one expiry cascade into thousands
(docs/scale.md, "Real etcd"); an exception from the callback is logged. :meth:`LeaseMux.close` stops the thread within about a second.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc
import grpc.aio
import pyetcd
from pyetcd import etcdrpc

from resilient.coordinator import etcd_wire as wire
from resilient.coordinator.membership import KEEPALIVE_FRACTION
from resilient.coordinator.store import _GRPC_OPTIONS, Store

log = logging.getLogger(__name__)

#: the scheduler's tick, seconds: refreshes due in one tick are sent as one batch
TICK = 0.05


def interval_ticks(ttl: float, tick: float = TICK) -> int:
    """Ticks between two refreshes of a lease of ``ttl`` seconds: the most whole ticks
    that fit in ``ttl * KEEPALIVE_FRACTION`` (at least one), so a refresh never leaves
    later than a third of the TTL after the one before. Pure."""
    return max(1, math.floor(ttl * KEEPALIVE_FRACTION / tick + 1e-9))


@dataclass
class _Lease:
    every: int                                  # ticks between refreshes
    on_lost: Callable[[int], None] | None
    request: etcdrpc.LeaseKeepAliveRequest      # built once, sent every refresh
    gen: int                                    # wheel entries of an older add() are stale
    ttl: float = 0.0                            # seconds, as added


class RefreshWheel:
    """The schedule in the module docstring, without I/O or clock (``now_tick`` comes in):
    ``add`` places a lease round-robin in the ticks of its interval, ``due`` pops every
    lease due up to ``now_tick`` and books its next refresh. Pure logic (unit-tested)."""

    def __init__(self) -> None:
        self.leases: dict[int, _Lease] = {}
        self._buckets: dict[int, list[tuple[int, int]]] = {}   # tick -> [(lease id, gen)]
        self._ticks: list[int] = []                            # heap of ticks that have a bucket
        self._rr: dict[int, int] = {}                          # interval -> next phase to deal
        self._gen = itertools.count()

    def _book(self, tick: int, lid: int, gen: int) -> None:
        bucket = self._buckets.get(tick)
        if bucket is None:
            bucket = self._buckets[tick] = []
            heapq.heappush(self._ticks, tick)
        bucket.append((lid, gen))

    def add(self, lid: int, ttl: float, on_lost: Callable[[int], None] | None, now_tick: int) -> None:
        every = interval_ticks(ttl)
        lease = _Lease(every, on_lost, etcdrpc.LeaseKeepAliveRequest(ID=lid), next(self._gen), ttl)
        self.leases[lid] = lease
        phase = self._rr.get(every, 0)
        self._rr[every] = (phase + 1) % every
        self._book(now_tick + 1 + phase, lid, lease.gen)   # first refresh within one interval

    def remove(self, lid: int) -> _Lease | None:
        return self.leases.pop(lid, None)

    def due(self, now_tick: int) -> list[etcdrpc.LeaseKeepAliveRequest]:
        """The refreshes due at or before ``now_tick`` (each lease once), rebooked one
        interval after ``now_tick`` (a late tick delays the next refresh, never doubles it)."""
        out: list[etcdrpc.LeaseKeepAliveRequest] = []
        while self._ticks and self._ticks[0] <= now_tick:
            for lid, gen in self._buckets.pop(heapq.heappop(self._ticks)):
                lease = self.leases.get(lid)
                if lease is None or lease.gen != gen:
                    continue
                out.append(lease.request)
                self._book(now_tick + lease.every, lid, gen)
        return out

    def next_tick(self) -> int | None:
        """The earliest tick with a refresh booked (stale entries included), or None."""
        return self._ticks[0] if self._ticks else None

    def rebook_all(self, now_tick: int) -> None:
        """Every lease due at ``now_tick`` (after the stream was reopened)."""
        self._buckets.clear()
        self._ticks.clear()
        for lid, lease in self.leases.items():
            lease.gen = next(self._gen)
            self._book(now_tick, lid, lease.gen)

    def shortest_interval_ticks(self) -> int | None:
        return min((lease.every for lease in self.leases.values()), default=None)


class LeaseMux:
    """``add(lease_id, ttl, on_lost)``, ``remove(lease_id)``, ``close()``; counters
    ``sent``, ``received``, ``reconnects``, ``batches``; ``lost`` (ids found gone).
    ``streams``: keep-alive streams to open (1 for a node agent; a process with thousands
    of leases spends less CPU per keep-alive with several, docs/scale.md)."""

    def __init__(self, store: Store, streams: int = 1) -> None:
        if streams < 1:
            raise ValueError(f"LeaseMux needs at least one stream, not {streams}")
        self.store = store
        self.streams = streams
        self._lock = threading.Lock()
        self._wheel = RefreshWheel()
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self.sent = self.received = self.reconnects = self.batches = 0
        #: leases found gone by etcd's answer (TTL <= 0) / taken as lost because no refresh
        #: was answered for the whole TTL (``lost`` holds both)
        self.lost_by_etcd = self.lost_unanswered = 0
        #: the slowest answer (seconds from a refresh's send to its answer being read) and the
        #: latest the sender woke after its due tick, since the last :meth:`take_lags`
        self._max_answer_lag = self._max_send_lag = 0.0
        self._abandoned = 0
        self._last_rx = time.monotonic()
        self._wake_at = 0                           # the tick the sender sleeps until
        self._ep = 0
        self.lost: set[int] = set()
        # lease id -> when etcd may drop it (the oldest unanswered refresh's send + its TTL);
        # lease id -> send time of its oldest unanswered refresh
        self._safe_until: dict[int, float] = {}
        self._pending: dict[int, float] = {}
        # leases whose refresh came due while one was still unanswered (not sent: one in
        # flight per lease), and the refreshes to send as soon as that answer is read
        self._deferred: set[int] = set()
        self._resend: list[etcdrpc.LeaseKeepAliveRequest] = []
        #: refreshes not sent because the lease's previous one was still unanswered
        self.deferred = 0
        self._loop = asyncio.new_event_loop()
        self._wakeup: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),),
                                        name="lease-mux", daemon=True)
        self._thread.start()

    def _tick(self) -> int:
        return int((time.monotonic() - self._t0) / TICK)

    def add(self, lease_id: int, ttl: float, on_lost: Callable[[int], None] | None = None) -> None:
        """Keep ``lease_id`` alive from now on; its first refresh leaves within one interval
        (``interval_ticks(ttl)`` ticks), dealt round-robin with the other leases'."""
        with self._lock:
            self._wheel.add(lease_id, ttl, on_lost, self._tick())
            self._safe_until[lease_id] = time.monotonic() + ttl
            self._pending.pop(lease_id, None)
            self._deferred.discard(lease_id)
            nxt = self._wheel.next_tick()
            early = nxt is not None and nxt < self._wake_at
        if early:
            self._poke()

    def remove(self, lease_id: int) -> None:
        """Stop refreshing ``lease_id`` (it expires after its TTL unless revoked)."""
        with self._lock:
            self._wheel.remove(lease_id)
            self._safe_until.pop(lease_id, None)
            self._pending.pop(lease_id, None)
            self._deferred.discard(lease_id)

    def __len__(self) -> int:
        return len(self._wheel.leases)

    def _poke(self) -> None:
        wake = self._wakeup
        if wake is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(wake.set)
            except RuntimeError:   # the loop just closed (close() raced us)
                pass

    def _channel(self) -> grpc.aio.Channel:
        """An asyncio channel to the store's next endpoint, with the store's TLS settings."""
        target = self.store.endpoints[self._ep % len(self.store.endpoints)]
        self._ep += 1
        if self.store.ca_cert:
            creds = pyetcd.MultiEndpointEtcd3Client.get_secure_creds(self.store.ca_cert, self.store.cert_key,
                                                                      self.store.cert_cert)
            return grpc.aio.secure_channel(target, creds, options=_GRPC_OPTIONS)
        return grpc.aio.insecure_channel(target, options=_GRPC_OPTIONS)

    async def _main(self) -> None:
        self._wakeup = asyncio.Event()
        while not self._stop.is_set():
            channel = self._channel()
            try:
                await self._serve(channel)
            except Exception as exc:   # the stream broke: reopen, refresh everyone at once
                if self._stop.is_set():
                    break
                self.reconnects += 1
                log.warning("lease keep-alive stream broke (%s); reopening", exc or type(exc).__name__)
                self._abandoned = self.sent - self.received   # what the old streams owed is not awaited
                with self._lock:
                    self._wheel.rebook_all(self._tick())
                    self._pending.clear()   # unanswered sends keep their deadline in _safe_until
                    self._deferred.clear()
                    self._resend.clear()
                await asyncio.sleep(0.2)
            finally:
                await channel.close()

    async def _serve(self, channel: grpc.aio.Channel) -> None:
        """Run the streams until one breaks (raises) or the mux is closed (returns)."""
        stub = etcdrpc.LeaseStub(channel)
        calls = [stub.LeaseKeepAlive(metadata=self.store._client.metadata) for _ in range(self.streams)]
        tasks = [asyncio.ensure_future(self._read(c)) for c in calls]
        tasks.append(asyncio.ensure_future(self._send(calls)))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()    # raises the stream's error
            if not self._stop.is_set():
                raise ConnectionError("etcd ended a keep-alive stream")
        finally:
            for c in calls:
                c.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, call: "grpc.aio.StreamStreamCall[object, wire.LeaseKeepAliveResponse]") -> None:
        async for resp in call:
            self.received += 1
            self._last_rx = now = time.monotonic()
            if resp.TTL <= 0:
                self.lost_by_etcd += resp.ID in self._safe_until
                self._gone(resp.ID)
            else:
                sent = self._pending.pop(resp.ID, None)
                if sent is not None and now - sent > self._max_answer_lag:
                    self._max_answer_lag = now - sent
                if sent is not None and resp.ID in self._safe_until:
                    self._safe_until[resp.ID] = sent + resp.TTL
                if resp.ID in self._deferred:   # its refresh came due meanwhile: send it now
                    self._deferred.discard(resp.ID)
                    lease = self._wheel.leases.get(resp.ID)
                    if lease is not None:
                        self._resend.append(lease.request)
                        if self._wakeup is not None:
                            self._wakeup.set()

    async def _send(self, calls: "list[grpc.aio.StreamStreamCall[object, wire.LeaseKeepAliveResponse]]") -> None:
        wakeup = self._wakeup
        assert wakeup is not None
        while not self._stop.is_set():
            late = time.monotonic() - (self._t0 + self._wake_at * TICK)
            if late > self._max_send_lag:
                self._max_send_lag = late
            now = self._tick()
            with self._lock:
                batch = self._wheel.due(now)
                if self._resend:
                    batch += self._resend
                    self._resend = []
                nxt = self._wheel.next_tick()
                self._wake_at = now + 10 if nxt is None else nxt
            batch = self._unexpired(batch)
            if batch:
                self.sent += len(batch)
                self.batches += 1
                k = len(calls)
                await asyncio.gather(*(self._write(c, batch[i::k]) for i, c in enumerate(calls)))
            self._watchdog(time.monotonic())
            wait = (self._t0 + self._wake_at * TICK) - time.monotonic()
            wakeup.clear()
            try:
                await asyncio.wait_for(wakeup.wait(), min(max(wait, 0.001), 0.5))
            except asyncio.TimeoutError:
                pass

    def _unexpired(self, batch: list[etcdrpc.LeaseKeepAliveRequest]) -> list[etcdrpc.LeaseKeepAliveRequest]:
        """The refreshes of ``batch`` to send: those of leases etcd still holds for sure and
        with no refresh in flight. A lease with one in flight is deferred (sent once the
        answer is read), or reported lost when that answer is later than ``safe_until``
        plus as long again. A lease past ``safe_until`` with none in flight (after a
        reconnect) is reported lost instead of refreshed: etcd's ``Renew`` of an expired
        lease blocks its stream until the lessor revokes it, which would hold up every
        other lease's refresh on that stream behind it."""
        now = time.monotonic()
        keep: list[etcdrpc.LeaseKeepAliveRequest] = []
        gone: list[int] = []
        for req in batch:
            lid = req.ID
            safe_until = self._safe_until.get(lid, now)
            if lid in self._pending:
                # the last refresh is still unanswered: wait for etcd's answer (a renew it
                # took in time answers TTL > 0, one too late TTL 0) and send this one then;
                # given up only if no answer comes within a further TTL
                lease = self._wheel.leases.get(lid)
                if lease is None or now >= safe_until + lease.ttl:
                    gone.append(lid)
                else:
                    self._deferred.add(lid)
                    self.deferred += 1
                continue
            if now >= safe_until - TICK:   # etcd may have dropped it: a renew could block the stream
                gone.append(lid)
                continue
            self._pending[lid] = now
            keep.append(req)
        self.lost_unanswered += sum(1 for lid in gone if lid in self._safe_until)
        for lid in gone:
            log.warning("lease %x: no refresh answered for its whole TTL; taking it as lost", lid)
            self._gone(lid)
        return keep

    @staticmethod
    async def _write(call: "grpc.aio.StreamStreamCall[object, wire.LeaseKeepAliveResponse]",
                     requests: list[etcdrpc.LeaseKeepAliveRequest]) -> None:
        for r in requests:
            await call.write(r)

    def take_lags(self) -> tuple[float, float]:
        """``(slowest answer, latest sender wake-up)`` in seconds since the last call, then
        reset: how late etcd's answers were read, and how late this process's event loop ran
        (a starved CPU shows in the second). For diagnostics (bench/scale_real.py)."""
        lags = (self._max_answer_lag, max(0.0, self._max_send_lag))
        self._max_answer_lag = self._max_send_lag = 0.0
        return lags

    def _watchdog(self, now: float) -> None:
        """A stream whose answers stopped (refreshes outstanding, nothing back for two
        refresh intervals) is given up: raises, and the streams are reopened."""
        with self._lock:
            shortest = self._wheel.shortest_interval_ticks()
        if (shortest is not None and self.sent > self.received + self._abandoned
                and now - self._last_rx > 2 * shortest * TICK):
            self._last_rx = now
            raise TimeoutError(f"lease keep-alive stream silent for {2 * shortest * TICK:.1f}s")

    def _gone(self, lease_id: int) -> None:
        with self._lock:
            entry = self._wheel.remove(lease_id)
            self._safe_until.pop(lease_id, None)
            self._pending.pop(lease_id, None)
            self._deferred.discard(lease_id)
        if entry is None:
            return
        self.lost.add(lease_id)
        log.warning("lease %x is gone (expired or revoked)", lease_id)
        if entry.on_lost is not None:
            try:
                entry.on_lost(lease_id)
            except Exception:
                log.exception("on_lost callback for lease %x failed", lease_id)

    def close(self) -> None:
        """Stop refreshing every lease and end the streams (the leases expire after their TTL)."""
        self._stop.set()
        self._poke()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()
