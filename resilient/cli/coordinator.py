"""``resilient coordinator --etcd URL[,URL...] --job NAME``: run one coordinator.

Start several for standbys: one leads (lease-backed election), the others take over within
about ``--ttl`` seconds when it dies. Serves ``/metrics`` and ``/healthz`` on
``--metrics-host:--metrics-port`` (0: a free port; -1: off) and prints the URL on start.
SIGTERM/SIGINT: resign leadership at once (a standby takes over immediately) and exit 0.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from typing import TYPE_CHECKING

from resilient.cli.status import add_etcd_arguments, store_from_args

if TYPE_CHECKING:  # pragma: no cover - the coordinator package is imported when the command runs
    from resilient.coordinator.policy import HealthPolicy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_etcd_arguments(parser)
    parser.add_argument("--id", default=None, help="coordinator id (default: host-pid)")
    parser.add_argument("--ttl", type=float, default=5.0,
                        help="leader lease seconds: takeover time after the leader dies (default 5)")
    parser.add_argument("--debounce-ms", type=float, default=20.0,
                        help="wait after a member loss before publishing, to batch (default 20)")
    parser.add_argument("--join-debounce-ms", type=float, default=250.0,
                        help="wait after a join, restarted by further joins up to 4x (default 250)")
    parser.add_argument("--min-members", type=int, default=1,
                        help="members needed before the first epoch (default 1)")
    parser.add_argument("--metrics-host", default="0.0.0.0", help="address for /metrics and /healthz")
    parser.add_argument("--metrics-port", type=int, default=9401,
                        help="port for /metrics and /healthz (default 9401; 0 = any free port; -1 = off)")
    parser.add_argument("--straggler-policy", choices=("off", "demote", "deadline", "evict"), default="demote",
                        help="demote: confirmed stragglers move to a leaf position (their input still "
                             "counts; promoted back when healthy) and slow links are kept out of the ring; "
                             "deadline (opt-in): like demote, but an op finishes without a leaf whose input "
                             "has not arrived --leaf-deadline-ms after the ring is done (every member then "
                             "reports contributors without it); evict (opt-in): a confirmed slow member is "
                             "published out of the next epoch (cause evicted; its lease stays, it gets Evicted and "
                             "may call comm.rejoin()) and re-admitted after --evict-hold-s (cause readmitted), on "
                             "probation: slow again within 60 s doubles the hold (up to 600 s); never more than "
                             "(n-1)//2 members out; off: health records are ignored (default demote)")
    parser.add_argument("--leaf-deadline-ms", type=float, default=None,
                        help="with --straggler-policy deadline: how long a leaf's parent waits for the leaf's "
                             "input after its own ring is done (default 10; published in the epoch plan)")
    parser.add_argument("--evict-hold-s", type=float, default=None,
                        help="with --straggler-policy evict: seconds an evicted member stays out before it may "
                             "rejoin (default 30; doubled on a relapse, capped at 600)")
    parser.add_argument("--link-band", type=float, default=0.25,
                        help="hysteresis of measured link speeds: a member's speed in the plan changes only when a "
                             "measurement differs from it by more than this fraction (default 0.25)")
    parser.add_argument("--no-measure-links", action="store_true",
                        help="plan with declared link_bps labels only, not the health reporters' measurements")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")


#: ``--leaf-deadline-ms`` default (see :func:`health_policy_from_args`)
DEFAULT_LEAF_DEADLINE_MS = 10.0


def health_policy_from_args(args: argparse.Namespace) -> HealthPolicy:
    """The health policy of ``args`` (parsed by a parser :func:`add_arguments` set up).
    ``--straggler-policy``: ``demote`` -> a :class:`StragglerPolicy` with the default
    :class:`StragglerConfig` (sustained >= 10 % shift for 3 windows to suspect, 5 clear
    windows to promote back); ``off`` -> :func:`no_demotion`.

    Why ``demote`` is the default: demotion is lossless (the leaf path keeps the member's
    input in every result and ``contributors``), it needs a sustained shift over several
    windows (one hiccup never flaps the ring), promotion back has its own hysteresis, and
    without health records (no reporter running) it never acts. ``off`` is for A/B runs
    (``bench/straggler.py``) and for jobs that must never re-plan for health.

    ``deadline`` is opt-in because it is lossy: a late leaf's contribution is dropped from
    that op (reported in ``contributors``, never silently). Its default grace,
    :data:`DEFAULT_LEAF_DEADLINE_MS` = 10 ms after the parent's ring is done, is a few
    32 KiB sub-slices at the slowest link this project benchmarks (20 MB/s: 1.6 ms each)
    plus scheduling noise of a loaded host: an input that is merely in flight is kept,
    one that has not been sent is not waited for (docs/straggler.md has the measurements).
    ``evict`` (opt-in, :mod:`resilient.coordinator.eviction`): the same detection, but a
    confirmed slow member is taken out of the epoch for ``--evict-hold-s`` (default 30)
    and re-admitted through the joiner path once it calls ``comm.rejoin()``.

    Raises :class:`~resilient.errors.ConfigError` for ``--leaf-deadline-ms`` without
    ``deadline`` or outside [0, 600000], and for ``--evict-hold-s`` without ``evict`` or
    negative."""
    from resilient.coordinator.health import StragglerPolicy, no_demotion
    from resilient.coordinator.straggler import StragglerConfig
    from resilient.errors import ConfigError

    # every flag is defined by add_arguments (defaults included): read them as typed values
    policy: str = args.straggler_policy
    deadline_ms: float | None = args.leaf_deadline_ms
    if deadline_ms is not None and policy != "deadline":
        raise ConfigError(f"--leaf-deadline-ms only applies to --straggler-policy deadline (got {policy}); "
                          "add --straggler-policy deadline or drop --leaf-deadline-ms")
    hold_s: float | None = args.evict_hold_s
    if hold_s is not None and policy != "evict":
        raise ConfigError(f"--evict-hold-s only applies to --straggler-policy evict (got {policy}); "
                          "add --straggler-policy evict or drop --evict-hold-s")
    if policy == "evict":
        from resilient.coordinator.eviction import EvictionConfig, EvictPolicy

        ev = EvictionConfig() if hold_s is None else EvictionConfig(
            hold_s=hold_s, max_hold_s=max(EvictionConfig.max_hold_s, hold_s))
        return EvictPolicy(StragglerConfig(), ev)
    if policy == "off":
        return no_demotion
    if policy == "deadline":
        return StragglerPolicy(StragglerConfig(),
                               leaf_deadline_ms=DEFAULT_LEAF_DEADLINE_MS if deadline_ms is None else deadline_ms)
    return StragglerPolicy(StragglerConfig())


def run(args: argparse.Namespace) -> int:
    from resilient.coordinator.metrics import CoordinatorMetrics, MetricsServer
    from resilient.coordinator.service import Coordinator, CoordinatorConfig
    from resilient.errors import ConfigError

    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    config = CoordinatorConfig(ttl=args.ttl, debounce=args.debounce_ms / 1000.0,
                               join_debounce=args.join_debounce_ms / 1000.0, min_members=args.min_members,
                               measure_links=not args.no_measure_links, link_band=args.link_band)
    config.validate()
    store = store_from_args(args)
    from resilient.coordinator import keys

    # fail fast (StoreUnavailable after --etcd-timeout) on a wrong endpoint; ConfigError naming
    # the file on a TLS problem. Reads inside the job's prefix: the coordinator's etcd role
    # needs nothing else (docs/security.md).
    store.revision(keys.root(args.job))
    metrics = CoordinatorMetrics()
    coordinator = Coordinator(store, args.job, coordinator_id=args.id, config=config, metrics=metrics,
                              health_policy=health_policy_from_args(args))
    server = None
    if args.metrics_port >= 0:
        try:
            server = MetricsServer(metrics, coordinator.healthy, args.metrics_host, args.metrics_port)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {args.metrics_host}:{args.metrics_port}: {exc}; "
                              f"pick another --metrics-port (0 = any free port, -1 = off)") from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    url = "off"
    if server is not None:   # socketserver types the address str | bytes; AF_INET gives str
        host = server.host
        url = f"http://{host.decode() if isinstance(host, bytes) else host}:{server.port}"
    print(f"coordinator {coordinator.id} job {args.job} etcd {args.etcd} metrics {url}", flush=True)
    failure: list[BaseException] = []

    def main_loop() -> None:
        try:
            coordinator.run(stop)
        except BaseException as exc:  # re-raised in the main thread
            failure.append(exc)

    # The loop runs in a thread so that the main thread stays free for signals.
    worker = threading.Thread(target=main_loop, name="coordinator", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.2)
    if server:
        server.close()
    store.close()
    if failure:
        raise failure[0]
    return 0
