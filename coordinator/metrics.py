"""Coordinator metrics (Prometheus) and its small HTTP endpoint: ``/metrics``, ``/healthz``.

Names (base units, ``resilient_`` prefix):

* ``resilient_coordinator_members{state}`` — gauge; state = active | joining | demoted
* ``resilient_epochs_published_total`` — counter (by this process)
* ``resilient_epoch`` — gauge, the current epoch number as this coordinator last saw it
* ``resilient_coordinator_is_leader`` — gauge, 1 while this process leads
* ``resilient_detection_latency_seconds{path}`` — histogram, path = revoke | lease_expiry |
  suspect | join: from the triggering event (revoke, suspect report, the moment the
  coordinator saw the lease expire or the member register) to the epoch being published;
  exponential buckets from 5 ms to ~11 min.
* ``resilient_bad_records_total{kind}`` — counter: malformed records read from etcd and
  skipped by this process, kind = member | epoch | health | scores | readmit | departed |
  suspect | eviction | leader | node | rendezvous (:mod:`.records`).

The HTTP endpoint serves at most :data:`MAX_HTTP_THREADS` requests at once and closes a
connection that has not sent its request within :data:`HTTP_TIMEOUT_S` seconds.

Each :class:`CoordinatorMetrics` has its own registry, so several coordinators in one
process (tests) do not collide.
"""
from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Protocol, TypeAlias

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: 5 ms * 2**k for k = 0..17: 5 ms ... ~655 s
LATENCY_BUCKETS = tuple(0.005 * 2 ** k for k in range(18))
MEMBER_STATES = ("active", "joining", "demoted")
DETECTION_PATHS = ("revoke", "lease_expiry", "suspect", "join")


class CoordinatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.members = Gauge("resilient_coordinator_members", "Members known to the coordinator, by state",
                             ["state"], registry=self.registry)
        self.epochs_published = Counter("resilient_epochs_published", "Epochs published by this coordinator",
                                        registry=self.registry)
        self.epoch = Gauge("resilient_epoch", "Current epoch number", registry=self.registry)
        self.is_leader = Gauge("resilient_coordinator_is_leader", "1 while this coordinator leads",
                               registry=self.registry)
        self.detection_latency = Histogram(
            "resilient_detection_latency_seconds",
            "Seconds from a membership event (revoke, lease expiry, suspect report, join) to the epoch",
            ["path"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        # Bounded labels only (member ids change with every restart): who is slow is in
        # `resilient status`; here the distribution, for alerting and the dashboard.
        self.straggler_score = Gauge(
            "resilient_straggler_score",
            "Straggler scores of the live members (busy time per op relative to the median; 0 = typical), "
            "by statistic: max or median",
            ["stat"], registry=self.registry)
        for stat in ("max", "median"):
            self.straggler_score.labels(stat=stat).set(0)
        for state in MEMBER_STATES:
            self.members.labels(state=state).set(0)
        for path in DETECTION_PATHS:
            self.detection_latency.labels(path=path)
        from resilient.coordinator.records import BadRecordCollector

        #: ``resilient_bad_records_total{kind}``: malformed etcd records skipped by this process
        self.registry.register(BadRecordCollector())

    def set_straggler_scores(self, scores: dict[str, float]) -> None:
        """Publish the max and median of ``scores`` (member id -> score; empty -> 0)."""
        import statistics

        vals = sorted(float(v) for v in scores.values())
        self.straggler_score.labels(stat="max").set(vals[-1] if vals else 0.0)
        self.straggler_score.labels(stat="median").set(statistics.median(vals) if vals else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


#: Most requests served at once; more connections are answered 503 and closed at once.
MAX_HTTP_THREADS = 8
#: Seconds a connection may take to send its request (and to take the answer).
HTTP_TIMEOUT_S = 5.0

#: What socketserver hands a server per connection: a TCP server's is the socket itself.
_Request: TypeAlias = "socket.socket | tuple[bytes, socket.socket]"
#: A client's address: ``(host, port)``, or ``(host, port, flowinfo, scope_id)`` over IPv6.
_ClientAddress: TypeAlias = "tuple[str, int] | tuple[str, int, int, int]"


class BoundedHTTPServer(ThreadingHTTPServer):
    """A :class:`ThreadingHTTPServer` that runs at most ``max_threads`` handler threads:
    a connection that arrives while all are busy gets ``503`` and is closed by the
    accepting thread (it never waits for a slot), so idle or slow clients cannot pile up
    threads. Pair it with a handler ``timeout`` (socket timeout per connection)."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 max_threads: int = MAX_HTTP_THREADS) -> None:
        self._slots = threading.BoundedSemaphore(max_threads)
        super().__init__(address, handler)

    def process_request(self, request: _Request, client_address: _ClientAddress) -> None:
        if not self._slots.acquire(blocking=False):
            sock = request if isinstance(request, socket.socket) else request[1]
            try:
                sock.settimeout(0.5)
                sock.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 5\r\n"
                             b"Connection: close\r\n\r\nbusy\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: _Request, client_address: _ClientAddress) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class BoundedHTTPServer6(BoundedHTTPServer):
    """:class:`BoundedHTTPServer` on an IPv6 address (such as ``::1``)."""

    address_family = socket.AF_INET6


class MetricsSource(Protocol):
    """What :class:`MetricsServer` serves at ``/metrics``: :class:`CoordinatorMetrics`, or a
    node agent's merged worker metrics (:func:`resilient.metrics.serve_node_metrics`)."""

    def render(self) -> bytes:
        """The exposition-format text of every metric (Prometheus' ``generate_latest``)."""
        ...


class MetricsServer:
    """Serves ``/metrics`` and ``/healthz`` on ``host:port`` (port 0: a free one; see
    :attr:`port`). ``healthy()`` decides /healthz: 200 ``ok`` or 503 with its reason.

    At most ``max_threads`` requests are served at once (:class:`BoundedHTTPServer`)
    and a connection that sends no complete request within ``timeout`` seconds is
    closed, so a flood of idle connections holds neither threads nor sockets for long."""

    def __init__(self, metrics: MetricsSource, healthy: Callable[[], tuple[bool, str]],
                 host: str = "127.0.0.1", port: int = 0, timeout: float = HTTP_TIMEOUT_S,
                 max_threads: int = MAX_HTTP_THREADS) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server API
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, code, ctype = outer.metrics.render(), 200, CONTENT_TYPE_LATEST
                elif path == "/healthz":
                    ok, why = outer.healthy()
                    body, code, ctype = (why or "ok").encode() + b"\n", 200 if ok else 503, "text/plain"
                else:
                    body, code, ctype = b"not found: try /metrics or /healthz\n", 404, "text/plain"
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.metrics = metrics
        self.healthy = healthy
        Handler.timeout = timeout   # socket timeout of every connection (StreamRequestHandler)
        server_cls: type[BoundedHTTPServer] = BoundedHTTPServer
        if ":" in host:   # an IPv6 literal such as ::1
            server_cls = BoundedHTTPServer6
        self._server = server_cls((host, port), Handler, max_threads)
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
