"""Rank side of straggler detection: turn :class:`~resilient.transport.base.TransportStats`
deltas into ``health/<member>`` windows (format: :mod:`resilient.coordinator.health`) at a
low rate (default one write per second per member; with ``min_ops`` a window also waits
for that many ops, up to 5 intervals, so slow ops still give the detector usable windows —
it ignores windows of fewer than ``StragglerConfig.min_ops``, default 3).

Usage (the communicator's op loop, or a training loop around it)::

    reporter = HealthReporter(store, job, member_id, lease_id, transport.stats)
    ...
    reporter.op_done(epoch_number, seconds_this_op)   # after every collective

Per-link throughput (issue 16): a window also carries ``link_bps`` = {peer: bytes/s}.
Each window measures, per peer, the payload bytes of the large frames received from it
over the seconds from each frame's header to its last byte (the transport's
``stats.link_*_by_peer``; :func:`link_rates`, only peers with at least
``LINK_MIN_BYTES``): the time the link was carrying them. Until the fourteenth session
the figure was the bytes over the time this member *waited* on the peer's receives; that
counts a peer's lateness (still in an earlier phase of the op, descheduled) as link time
and a frame that arrived while this member was busy elsewhere as free, and on a loaded
host single windows of a 60 Mbit/s link read 27–58, of a 30 Mbit/s link 19–67
(``bench/hierarchy.py``, one op per window): the coordinator re-planned the shards on
the swings, up to 10 epochs in 15 s. A frame's own arrival time is neither; it errs
fast only when this member did not read for a while and found a frame already in the
socket buffer. The record carries, per peer, the **median of its figures in the last**
``LINK_WINDOWS`` (7) windows, once at least ``LINK_MIN_WINDOWS`` (5) of them measured
it: single swings move nothing, and a real change shows when most of the last windows
see it, in one step. The coordinator turns these into member speeds, link classes and
shard weights (:func:`resilient.coordinator.link_classes.speeds_from_health`).

No thread: the write happens inside :meth:`op_done` when ``interval`` has passed, so a
member that stops doing ops stops reporting (its last window goes stale and the detector
ignores it; a hung member is the lease's business, not the detector's). Also records
``resilient_peer_wait_seconds`` when rank metrics are available.

At scale (docs/scale.md) pass ``sink``: the window goes to that callable instead of
etcd — e.g. :meth:`~resilient.coordinator.health.NodeHealthAggregator.maybe_flush` of
the node's aggregator, which writes one summary per node at a low rate — so no per-rank
write per second reaches etcd.

Failure behaviour: a failed write (etcd unreachable, lease gone) is logged once per
outage and swallowed — health reporting must never fail a collective; the window keeps
accumulating and the next successful write covers it. :meth:`op_done` never raises.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from resilient.transport.base import TransportStats

if TYPE_CHECKING:  # pragma: no cover - the coordinator package is imported lazily here
    from resilient.coordinator.straggler import HealthRecord

log = logging.getLogger(__name__)

#: a peer needs this many bytes received in a window for a ``link_bps`` figure
LINK_MIN_BYTES = 64 << 10
#: ``link_bps`` is the median of a peer's figures in this many latest windows ...
LINK_WINDOWS = 7
#: ... once at least this many of them measured the peer
LINK_MIN_WINDOWS = 5


class HealthReporter:
    def __init__(self, store: Any, job: str, member_id: str, lease_id: int | None, stats: TransportStats,
                 interval: float = 1.0, extra: dict[str, Any] | None = None,
                 clock: Callable[[], float] = time.monotonic, min_ops: int = 1,
                 sink: Callable[[HealthRecord], object] | None = None) -> None:
        self.store, self.job, self.member_id, self.lease_id = store, job, member_id, lease_id
        self.stats = stats
        self.interval = float(interval)
        self.min_ops = max(1, int(min_ops))
        self.extra = dict(extra or {})
        self._clock = clock
        self._start = clock()
        self._wait0 = dict(stats.wait_s_by_peer)
        self._link0 = (dict(stats.link_bytes_by_peer), dict(stats.link_s_by_peer))
        self._ops = 0
        self._op_times: list[float] = []
        self.seq = 0
        self._links: deque[dict[str, float]] = deque(maxlen=LINK_WINDOWS)   # the written windows' figures
        self._failing = False
        self._sink = sink

    def op_done(self, epoch: int, op_seconds: float | None = None) -> bool:
        """Count one finished op; write a window if ``interval`` has passed. Returns True
        when a record was written."""
        self._ops += 1
        if op_seconds is not None:
            self._op_times.append(float(op_seconds))
        now = self._clock()
        age = now - self._start
        if age < self.interval or (self._ops < self.min_ops and age < 5 * self.interval):
            return False
        from resilient.coordinator.health import make_record, write_health

        waits = dict(self.stats.wait_s_by_peer)
        delta = {p: s - self._wait0.get(p, 0.0) for p, s in waits.items()}
        self.seq += 1
        link = (dict(self.stats.link_bytes_by_peer), dict(self.stats.link_s_by_peer))
        extra = dict(self.extra)
        figures = link_rates(link[0], self._link0[0], {p: s - self._link0[1].get(p, 0.0) for p, s in link[1].items()})
        links = link_medians([*self._links, figures][-LINK_WINDOWS:])
        if links:
            extra["link_bps"] = links
        rec = make_record(self.member_id, epoch, self.seq, self._ops, now - self._start, delta,
                          self._op_times, **extra)
        try:
            if self._sink is not None:
                self._sink(rec)
            else:
                write_health(self.store, self.job, self.member_id, rec, self.lease_id)
        except Exception as exc:  # never fail a collective for health reporting
            if not self._failing:
                log.warning("health report of %s failed (will retry next window): %s", self.member_id, exc)
            self._failing = True
            return False
        self._failing = False
        self._record_metrics(sum(v for v in delta.values() if v > 0))
        self._start, self._wait0, self._ops, self._op_times = now, waits, 0, []
        self._link0 = link
        self._links.append(figures)
        return True

    @staticmethod
    def _record_metrics(wait_s: float) -> None:
        try:
            from resilient.metrics import rank_metrics

            rank_metrics().record_peer_wait(wait_s)
        except Exception:  # metrics are optional here (no prometheus dir, other process model)
            pass


def link_rates(received: dict[str, int], received0: dict[str, int], seconds: dict[str, float]) -> dict[str, float]:
    """``{peer: bytes/s}`` for one window: the bytes of the peer's large frames since
    ``received0`` over the seconds those frames took to arrive (``seconds``: the window's
    deltas of ``stats.link_s_by_peer``); peers with fewer than :data:`LINK_MIN_BYTES` or
    under 1 ms are left out."""
    out = {}
    for p, n in received.items():
        b, w = n - received0.get(p, 0), seconds.get(p, 0.0)
        if b >= LINK_MIN_BYTES and w >= 1e-3:
            out[p] = round(b / w, 1)
    return out


def link_medians(windows: list[dict[str, float]], min_windows: int = LINK_MIN_WINDOWS) -> dict[str, float]:
    """``{peer: bytes/s}``: the median of each peer's figures in ``windows`` (one
    :func:`link_rates` dict per window), for the peers measured in at least
    ``min_windows`` of them."""
    by_peer: dict[str, list[float]] = {}
    for w in windows:
        for p, v in w.items():
            by_peer.setdefault(p, []).append(v)
    return {p: round(statistics.median(vs), 1) for p, vs in sorted(by_peer.items()) if len(vs) >= min_windows}
