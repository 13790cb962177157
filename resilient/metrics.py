"""Rank-side Prometheus metrics and the node agent's multiprocess ``/metrics`` endpoint.

Every rank (worker process) records into the families of :class:`RankMetrics`; the node
agent (``resilient-run``) serves one ``/metrics`` for all its workers through
prometheus-client's multiprocess mode (docs/design.md §6):

1. the agent calls :func:`prepare_multiprocess_dir` *before* it spawns workers and puts
   :func:`worker_env` into each worker's environment (prometheus-client chooses its
   file-backed value class when it is first imported, so the variable must be in the
   worker's environment from the start);
2. the agent serves the merged view with :func:`serve_node_metrics`;
3. when a worker exits the agent calls :func:`mark_worker_dead` with its pid, so the
   ``live*`` gauges (epoch, world size) stop reporting the dead process. Counters and
   histograms of a dead worker keep counting in the sums, as Prometheus counters must never
   go backwards.

Naming follows the Prometheus rules in REFERENCE.md: everything under ``resilient_``, base
units (seconds, bytes) as suffix, counters exposed with ``_total``, and labels only with
the bounded value sets below (never ranks, member ids, job ids, tensor names). A label
value outside its set raises :class:`MetricLabelError` naming the allowed values: it is a
programming error, caught in tests, not something to hide under an ``other`` bucket.

Failure behaviour: recording a metric never touches the network; it writes to process
memory, or in multiprocess mode to an mmap'ed file in ``PROMETHEUS_MULTIPROC_DIR`` (a full
or vanished directory raises ``OSError`` from prometheus-client at the recording call).
A scrape reads the files of every process that ever wrote there, dead ones included, and
skips none; a dead peer or a dead etcd therefore changes nothing here.

The coordinator's own families (members by state, epochs published, leader status,
detection latency) live in ``resilient.coordinator.metrics``.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, TypeVar

from resilient.errors import ConfigError, MetricLabelError

if TYPE_CHECKING:   # pragma: no cover - prometheus-client loads when metrics are first created
    from prometheus_client import CollectorRegistry, Info
    from prometheus_client.metrics import MetricWrapperBase

    from resilient.coordinator.metrics import MetricsServer

    M = TypeVar("M", bound=MetricWrapperBase)

#: The one application prefix of every family (REFERENCE.md, Prometheus naming).
NAMESPACE = "resilient"

#: Default port of a node agent's ``/metrics`` (the Helm chart's ``workers.metricsPort``).
DEFAULT_NODE_METRICS_PORT = 9400
#: Default port of a coordinator's ``/metrics`` and ``/healthz`` (``coordinator.metricsPort``).
DEFAULT_COORDINATOR_METRICS_PORT = 9401

#: Bounded label values. Adding a value here is the only way to use a new one.
COLLECTIVE_OPS: tuple[str, ...] = (
    "allreduce", "broadcast", "allgather", "reduce_scatter", "barrier", "send", "recv",
)
RECOVERY_CAUSES: tuple[str, ...] = (
    "member_lost",        # a peer's lease was revoked (its process exited; fast path)
    "lease_expired",      # a peer hung or its node vanished; its lease ran out
    "suspect_confirmed",  # a peer reported it, the coordinator confirmed against lease state
    "demoted",            # the straggler detector moved a slow member off the ring
    "joined",             # a new member was admitted (the world grew)
)
COMPRESSION_CHOICES: tuple[str, ...] = ("fp32", "q8", "q4", "q2")  # the automatic switch's arms
ETCD_METHODS: tuple[str, ...] = (
    "get", "put", "delete", "txn", "lease_grant", "lease_keepalive", "lease_revoke", "watch",
)

# Exponential buckets (factor 2 / 4): from sub-millisecond to minutes. prometheus-client's
# defaults stop at 10 s, too short for rendezvous and recovery (REFERENCE.md).
def exponential_buckets(start: float, factor: float, count: int) -> tuple[float, ...]:
    """``count`` bucket bounds ``start * factor**k``; raises :class:`ConfigError` on nonsense."""
    if start <= 0 or factor <= 1 or count < 1:
        raise ConfigError(
            f"exponential_buckets(start={start}, factor={factor}, count={count}): need "
            "start > 0, factor > 1 and count >= 1"
        )
    return tuple(float(f"{start * factor ** k:.6g}") for k in range(count))


#: 10 ms .. ~655 s (about 11 minutes): recovery and detection times.
RECOVERY_BUCKETS = exponential_buckets(0.01, 2.0, 17)
#: 10 us .. ~168 s: one collective, from a tiny barrier to a multi-GB allreduce.
COLLECTIVE_BUCKETS = exponential_buckets(1e-5, 4.0, 13)
#: 100 us .. ~105 s: time blocked on a peer, one etcd request.
WAIT_BUCKETS = exponential_buckets(1e-4, 4.0, 11)


def _check(metric: str, label: str, value: str, allowed: Iterable[str], constant: str) -> str:
    allowed = tuple(allowed)
    if value not in allowed:
        raise MetricLabelError(
            f"{metric}: {label}={value!r} is not one of {', '.join(allowed)}; labels carry "
            f"only bounded values: use one of these or add it to resilient.metrics.{constant}"
        )
    return value


@dataclass
class RankMetrics:
    """The rank-side metric families, registered in ``registry``.

    Create one per process (see :func:`rank_metrics`); tests pass a fresh
    ``prometheus_client.CollectorRegistry``. In multiprocess mode the registry only decides
    which in-process registry lists them; the values go to the shared directory either way.
    Each ``record_*``/``set_*`` method validates its label and raises
    :class:`MetricLabelError` for a value outside the bounded set.
    """

    registry: CollectorRegistry | None = None
    families: dict[str, MetricWrapperBase] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram, Info

        reg = REGISTRY if self.registry is None else self.registry
        self.registry = reg

        def add(metric: M) -> M:
            self.families[metric._name] = metric
            return metric

        self.collective_duration = add(Histogram(
            "collective_duration_seconds",
            "Wall time of one collective on this rank, from call to completion (recovery included).",
            ["op"], namespace=NAMESPACE, buckets=COLLECTIVE_BUCKETS, registry=reg))
        self.collective_bytes = add(Counter(
            "collective_bytes",
            "Payload bytes handed to collectives on this rank (the input tensor size).",
            ["op"], namespace=NAMESPACE, registry=reg))
        self.recoveries = add(Counter(
            "recoveries",
            "Ops finished by the survivors after a membership change, by cause.",
            ["cause"], namespace=NAMESPACE, registry=reg))
        self.ops_resumed = add(Counter(
            "ops_resumed",
            "Ops this rank finished from its ledger after a failure interrupted them (resumed, not rerun).",
            namespace=NAMESPACE, registry=reg))
        self.recovery_duration = add(Histogram(
            "recovery_duration_seconds",
            "Time from noticing a failure to the interrupted op completing on this rank.",
            namespace=NAMESPACE, buckets=RECOVERY_BUCKETS, registry=reg))
        self.recovery_resent_bytes = add(Counter(
            "recovery_resent_bytes",
            "Bytes this rank sent after a failure to finish the interrupted op.",
            namespace=NAMESPACE, registry=reg))
        self.recovery_saved_bytes = add(Counter(
            "recovery_saved_bytes",
            "Bytes a from-scratch restart of the interrupted op would have sent on top of "
            "what the ledger-based resume sent.",
            namespace=NAMESPACE, registry=reg))
        # live* modes: a dead worker's value disappears once mark_worker_dead() ran.
        self.epoch = add(Gauge(
            "rank_epoch",
            "Epoch number this rank is operating in (max over the node's live workers).",
            namespace=NAMESPACE, multiprocess_mode="livemax", registry=reg))
        self.world_size = add(Gauge(
            "world_size",
            "Members in the epoch this rank is operating in (most recent live value).",
            namespace=NAMESPACE, multiprocess_mode="livemostrecent", registry=reg))
        self.peer_wait = add(Histogram(
            "peer_wait_seconds",
            "Time this rank was blocked waiting for a peer's data.",
            namespace=NAMESPACE, buckets=WAIT_BUCKETS, registry=reg))
        self.etcd_request_duration = add(Histogram(
            "etcd_request_duration_seconds",
            "Latency of one etcd request from this rank, retries included.",
            ["method"], namespace=NAMESPACE, buckets=WAIT_BUCKETS, registry=reg))
        self.etcd_retries = add(Counter(
            "etcd_retries",
            "etcd requests retried after a transient error.",
            ["method"], namespace=NAMESPACE, registry=reg))
        self.compression_decisions = add(Counter(
            "compression_decisions",
            "Allreduces the automatic compression switch ran, by the arm it agreed on (fp32 = uncompressed).",
            ["choice"], namespace=NAMESPACE, registry=reg))
        self.compression_bits = add(Gauge(
            "compression_bits",
            "Wire bits per element the automatic switch chose for the last allreduce (32 = uncompressed).",
            namespace=NAMESPACE, multiprocess_mode="livemostrecent", registry=reg))
        # Info is not supported by prometheus-client's multiprocess mode: in-process only.
        self.build_info: Info | None = None
        if not _multiprocess_enabled():
            from importlib import metadata

            build_info = self.build_info = add(Info(
                "build", "Version of resilient-collectives on this rank.",
                namespace=NAMESPACE, registry=reg))
            try:
                version = metadata.version("resilient-collectives")
            except metadata.PackageNotFoundError:
                version = "unknown"
            build_info.info({"version": version})
        # Pre-create every labelled child so dashboards see zeros instead of gaps.
        for op in COLLECTIVE_OPS:
            self.collective_duration.labels(op)
            self.collective_bytes.labels(op)
        for cause in RECOVERY_CAUSES:
            self.recoveries.labels(cause)
        for choice in COMPRESSION_CHOICES:
            self.compression_decisions.labels(choice)
        for method in ETCD_METHODS:
            self.etcd_request_duration.labels(method)
            self.etcd_retries.labels(method)

    # -- recording -----------------------------------------------------------------------

    def record_collective(self, op: str, seconds: float, nbytes: int) -> None:
        """One finished collective: its wall time and its payload size."""
        _check("resilient_collective_duration_seconds", "op", op, COLLECTIVE_OPS, "COLLECTIVE_OPS")
        self.collective_duration.labels(op).observe(seconds)
        self.collective_bytes.labels(op).inc(nbytes)

    def record_recovery(self, cause: str, seconds: float, resent_bytes: int, saved_bytes: int) -> None:
        """One op finished by the survivors: why, how long it took, bytes resent and saved."""
        _check("resilient_recoveries_total", "cause", cause, RECOVERY_CAUSES, "RECOVERY_CAUSES")
        if resent_bytes < 0 or saved_bytes < 0:
            raise ConfigError(
                f"record_recovery: resent_bytes={resent_bytes}, saved_bytes={saved_bytes} must "
                "be >= 0 (saved = bytes a restart would send minus bytes resent, floored at 0)"
            )
        self.recoveries.labels(cause).inc()
        self.recovery_duration.observe(seconds)
        self.recovery_resent_bytes.inc(resent_bytes)
        self.recovery_saved_bytes.inc(saved_bytes)

    def record_membership_recovery(self, cause: str) -> None:
        """This rank adopted an epoch that removed members of its group (one per epoch,
        whether or not an op was in flight): ``resilient_recoveries_total{cause}``."""
        _check("resilient_recoveries_total", "cause", cause, RECOVERY_CAUSES, "RECOVERY_CAUSES")
        self.recoveries.labels(cause).inc()

    def record_op_resumed(self, seconds: float, resent_bytes: int, saved_bytes: int) -> None:
        """One interrupted op finished from the ledger: ``resilient_ops_resumed_total``,
        its recovery time, bytes resent and bytes saved versus a restart."""
        if resent_bytes < 0 or saved_bytes < 0:
            raise ConfigError(
                f"record_op_resumed: resent_bytes={resent_bytes}, saved_bytes={saved_bytes} must "
                "be >= 0 (saved = bytes a restart would send minus bytes resent, floored at 0)"
            )
        self.ops_resumed.inc()
        self.recovery_duration.observe(seconds)
        self.recovery_resent_bytes.inc(resent_bytes)
        self.recovery_saved_bytes.inc(saved_bytes)

    def record_compression_decision(self, choice: str) -> None:
        """One allreduce of the automatic switch: ``resilient_compression_decisions_total{choice}``
        and ``resilient_compression_bits`` (32 for fp32)."""
        _check("resilient_compression_decisions_total", "choice", choice, COMPRESSION_CHOICES, "COMPRESSION_CHOICES")
        self.compression_decisions.labels(choice).inc()
        self.compression_bits.set(32 if choice == "fp32" else int(choice[1:]))

    def set_epoch(self, number: int, world_size: int) -> None:
        """The epoch this rank now operates in and its member count."""
        self.epoch.set(number)
        self.world_size.set(world_size)

    def record_peer_wait(self, seconds: float) -> None:
        """Time blocked on a peer (feeds straggler dashboards; no peer label: unbounded)."""
        self.peer_wait.observe(seconds)

    def record_etcd_request(self, method: str, seconds: float, retries: int = 0) -> None:
        """One etcd request: its latency (retries included) and how often it was retried."""
        _check("resilient_etcd_request_duration_seconds", "method", method, ETCD_METHODS, "ETCD_METHODS")
        self.etcd_request_duration.labels(method).observe(seconds)
        if retries:
            self.etcd_retries.labels(method).inc(retries)


_PROCESS_METRICS: RankMetrics | None = None


def rank_metrics() -> RankMetrics:
    """This process's :class:`RankMetrics` in the default registry (created on first use)."""
    global _PROCESS_METRICS
    if _PROCESS_METRICS is None:
        _PROCESS_METRICS = RankMetrics()
    return _PROCESS_METRICS


# -- node agent: multiprocess mode ------------------------------------------------------

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_enabled() -> bool:
    """Whether this process writes metrics for a node agent's multiprocess ``/metrics``
    (``resilient-run --metrics-port`` sets ``PROMETHEUS_MULTIPROC_DIR`` for its workers)."""
    return bool(os.environ.get(MULTIPROC_ENV) or os.environ.get("prometheus_multiproc_dir"))


_multiprocess_enabled = multiprocess_enabled


def prepare_multiprocess_dir(path: str | os.PathLike[str]) -> str:
    """Create (or empty) the directory the node's workers write their metrics to.

    Call once in the node agent before spawning any worker; stale files from an earlier run
    would otherwise be merged into this run's numbers. Raises :class:`ConfigError` when the
    path exists and is not a directory, or cannot be created/written.
    """
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"metrics directory {path!r} exists and is not a directory; "
                          f"point {MULTIPROC_ENV} at an empty directory")
    try:
        os.makedirs(path, exist_ok=True)
        for name in os.listdir(path):
            if name.endswith(".db"):
                os.unlink(os.path.join(path, name))
        probe = os.path.join(path, ".write-probe")
        with open(probe, "w"):
            pass
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"metrics directory {path!r} is not usable ({exc.strerror}); "
                          f"give {MULTIPROC_ENV} a writable directory (an emptyDir in Kubernetes)"
                          ) from exc
    return path


def worker_env(path: str | os.PathLike[str]) -> dict[str, str]:
    """Environment entries that make a worker write its metrics into ``path``."""
    return {MULTIPROC_ENV: os.fspath(path)}


def mark_worker_dead(pid: int, path: str | os.PathLike[str]) -> None:
    """Drop the live gauges of the exited worker ``pid`` (its counters keep counting)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, os.fspath(path))  # type: ignore[no-untyped-call]  # unannotated upstream


@dataclass
class NodeMetricsServer:
    """A running ``/metrics`` HTTP server for one node; ``close()`` stops it."""

    port: int
    path: str
    _server: MetricsServer = field(repr=False)

    def close(self) -> None:
        self._server.close()

    def __enter__(self) -> "NodeMetricsServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _MergedRegistry:
    """``render()`` for :class:`~resilient.coordinator.metrics.MetricsServer`: the workers'
    multiprocess files merged at each scrape."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def serve_node_metrics(path: str | os.PathLike[str], port: int = DEFAULT_NODE_METRICS_PORT,
                       addr: str = "0.0.0.0") -> NodeMetricsServer:
    """Serve the merged metrics of every worker writing into ``path`` on ``addr:port``.

    ``port=0`` picks a free port (see ``.port``). The server runs in a daemon thread of the
    calling process and reads the files at each scrape, so workers that start, die or
    restart later are picked up without telling it. It is the coordinator's bounded
    server (:class:`~resilient.coordinator.metrics.MetricsServer`: a few handler threads,
    a per-connection timeout, ``503`` beyond that), so idle connections cannot pile up
    threads in the node agent. Raises :class:`ConfigError` when the port is taken or
    ``path`` is not a directory.
    """
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    from resilient.coordinator.metrics import MetricsServer

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ConfigError(f"metrics directory {path!r} does not exist; call "
                          "prepare_multiprocess_dir() before serve_node_metrics()")
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)  # type: ignore[no-untyped-call]  # unannotated upstream
    try:
        server = MetricsServer(_MergedRegistry(registry), lambda: (True, ""), host=addr, port=port)
    except OSError as exc:
        raise ConfigError(f"cannot serve /metrics on {addr}:{port} ({exc.strerror}); pick "
                          "another --metrics-port or stop what holds it") from exc
    return NodeMetricsServer(port=server.port, path=path, _server=server)


def remove_multiprocess_dir(path: str | os.PathLike[str]) -> None:
    """Delete the directory made by :func:`prepare_multiprocess_dir` (agent shutdown)."""
    shutil.rmtree(os.fspath(path), ignore_errors=True)
