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

Each :class:`CoordinatorMetrics` has its own registry, so several coordinators in one
process (tests) do not collide.
"""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

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

    def set_straggler_scores(self, scores: dict[str, float]) -> None:
        """Publish the max and median of ``scores`` (member id -> score; empty -> 0)."""
        import statistics

        vals = sorted(float(v) for v in scores.values())
        self.straggler_score.labels(stat="max").set(vals[-1] if vals else 0.0)
        self.straggler_score.labels(stat="median").set(statistics.median(vals) if vals else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """Serves ``/metrics`` and ``/healthz`` on ``host:port`` (port 0: a free one; see
    :attr:`port`). ``healthy()`` decides /healthz: 200 ``ok`` or 503 with its reason."""

    def __init__(self, metrics: CoordinatorMetrics, healthy: Callable[[], tuple[bool, str]],
                 host: str = "127.0.0.1", port: int = 0) -> None:
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
        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
