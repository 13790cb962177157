"""``resilient-run``: parse torchrun's flags, set up the control plane, run the agent.

Order of work: validate the flags (nothing started on bad input: exit 2 with the cause
and the fix); with ``--standalone`` start a local etcd and coordinator; connect to etcd
(a wrong endpoint fails within the store's bounded retry budget, exit 1); host the
workers' TCPStore when this node is the master; rendezvous (node ranks through etcd);
serve ``/metrics`` when asked; run the :class:`~resilient.launcher.agent.Agent`. Every
exit path (normal, failure, signal, exception) stops what was started, in reverse order,
by PID: workers, node lease, TCPStore, metrics server, coordinator, etcd.
"""
from __future__ import annotations

import logging
import sys
import tempfile
from contextlib import ExitStack
from typing import TYPE_CHECKING, Sequence

from resilient.errors import ConfigError, ResilientError
from resilient.settings import Settings

if TYPE_CHECKING:  # pragma: no cover
    from resilient.launcher.args import LaunchConfig

log = logging.getLogger("resilient.launcher")

DEFAULT_JOIN_TIMEOUT = 600.0


class _Signaled(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _setup_logging() -> None:
    level = Settings.from_env().log_level
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[resilient-run] %(levelname)s %(message)s"))
    root = logging.getLogger("resilient")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def run(cfg: LaunchConfig) -> int:
    """Run one node agent for ``cfg``; returns the process exit code."""
    from resilient.launcher.agent import Agent, ControlPlane, install_signal_handlers
    from resilient.launcher.env import Placement
    from resilient.launcher.logs import WorkerLogs
    from resilient.launcher.rendezvous import NodeRendezvous, LeaseKeeper, host_tcp_store, local_address

    agent: Agent | None = None

    def on_signal(signum: int) -> None:
        if agent is not None:
            agent.request_stop(signum)
        else:
            raise _Signaled(signum)

    previous = install_signal_handlers(cfg.signals_to_handle, on_signal)
    with ExitStack() as stack:
        try:
            endpoints = list(cfg.etcd)
            access = cfg.etcd_access
            if cfg.standalone:
                from resilient.launcher.standalone import StandaloneControlPlane

                plane = StandaloneControlPlane(cfg.job, min_members=cfg.nproc_per_node)
                stack.callback(plane.stop)
                plane.start()
                endpoints, access = plane.endpoints, plane.access
            control = None
            if endpoints:
                from resilient.coordinator import keys

                store = access.open_store(endpoints, retry_timeout=float(cfg.rdzv_conf.get("etcd_timeout", 10)))
                stack.callback(store.close)
                store.revision(keys.root(cfg.job))  # fail fast (bounded) on a wrong endpoint or TLS file
                keeper = LeaseKeeper(store, cfg.lease_ttl)
                stack.callback(keeper.stop)
                control = ControlPlane(store, endpoints, cfg.job, cfg.lease_ttl, keeper)

            if cfg.standalone:
                # loopback only; MASTER_ADDR stays torchrun's "localhost" (its client tries every address)
                tcp, port = host_tcp_store("localhost", 0, bind="127.0.0.1")
                stack.callback(lambda: tcp)  # keep a reference until exit
                placement = Placement(0, 1, cfg.nproc_per_node, "localhost", port, cfg.run_id)
            elif cfg.elastic_nodes:
                assert control is not None  # elastic --nnodes MIN:MAX needs etcd (checked by the flags)
                addr = local_address(cfg.local_addr)
                tcp, port = host_tcp_store(addr, 0)
                rdzv = NodeRendezvous(control.store, cfg.job, control.keeper, cfg.lease_ttl)
                stack.callback(rdzv.leave)
                slot = rdzv.join(
                    cfg.min_nodes, cfg.max_nodes, cfg.nproc_per_node, addr, port,
                    join_timeout=float(cfg.rdzv_conf.get("join_timeout", DEFAULT_JOIN_TIMEOUT)),
                    last_call=float(cfg.rdzv_conf.get("last_call_timeout", 0)),
                )
                if (slot.master_addr, slot.master_port) == (addr, port):
                    stack.callback(lambda: tcp)
                else:
                    del tcp  # another node hosts the workers' store
                placement = Placement(slot.group_rank, slot.group_world_size, cfg.nproc_per_node,
                                      slot.master_addr, slot.master_port, cfg.run_id, slot.joiner)
            else:
                port = cfg.master_port if cfg.master_port is not None else 29500
                if cfg.node_rank == 0:
                    tcp, port = host_tcp_store(cfg.master_addr, port)
                    stack.callback(lambda: tcp)
                placement = Placement(cfg.node_rank, cfg.max_nodes, cfg.nproc_per_node,
                                      cfg.master_addr, port, cfg.run_id)

            metrics_dir = None
            if cfg.metrics_port is not None:
                from resilient import metrics

                metrics_dir = metrics.prepare_multiprocess_dir(tempfile.mkdtemp(prefix="resilient-metrics-"))
                stack.callback(metrics.remove_multiprocess_dir, metrics_dir)
                server = metrics.serve_node_metrics(metrics_dir, cfg.metrics_port, addr=cfg.metrics_host)
                stack.callback(server.close)
                log.info("serving /metrics on %s:%d", cfg.metrics_host, server.port)

            logs = WorkerLogs(cfg.log_dir, cfg.run_id, cfg.role, cfg.redirects, cfg.tee,
                              cfg.local_ranks_filter, cfg.duplicate_stdout_filters,
                              cfg.duplicate_stderr_filters)
            stack.callback(logs.close)
            agent = Agent(cfg, placement, logs, control, metrics_dir)
            if control is not None:
                agent.base_env.update(access.child_env())  # workers reach etcd as this agent does
            log.info("group rank %d of %d, %d workers, world size %d, master %s:%d%s",
                     placement.group_rank, placement.group_world_size, cfg.nproc_per_node,
                     placement.world_size, placement.master_addr, placement.master_port,
                     f", etcd {','.join(endpoints)}, job {cfg.job}" if endpoints else "")
            return agent.run()
        except _Signaled as sig:
            log.warning("received signal %d before the workers started; cleaning up", sig.signum)
            return 128 + sig.signum
        finally:
            agent = None
            for signum, handler in previous.items():
                import signal

                signal.signal(signum, handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of ``resilient-run``."""
    from resilient.launcher.args import parse

    _setup_logging()
    try:
        cfg = parse(argv)
    except ConfigError as exc:
        print(f"resilient-run: error: {exc}", file=sys.stderr)
        return 2
    try:
        return run(cfg)
    except ConfigError as exc:
        print(f"resilient-run: error: {exc}", file=sys.stderr)
        return 2
    except ResilientError as exc:
        print(f"resilient-run: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
