"""Command-line flags of ``resilient-run``: torchrun's flags, its defaults, ``PET_*`` env.

The parser mirrors ``torch.distributed.run.get_args_parser`` of torch 2.13 flag for flag
(both ``--nproc-per-node`` and ``--nproc_per_node`` spellings, the same defaults and the
same ``PET_<FLAG>`` environment defaults), so a torchrun command line works unchanged; it
does not import torch (the agent starts fast). ``tests/test_launcher_args.py`` compares
it against ``python -m torch.distributed.run --help`` so a new torchrun flag cannot slip
by. Our own flags are ``--etcd``, ``--job``, ``--lease-ttl``, ``--no-node-lease``, ``--metrics-port``,
``--metrics-host``, ``--fail-fast`` and the etcd TLS/credential flags ``--etcd-ca-cert``, ``--etcd-cert``,
``--etcd-key``, ``--etcd-user``, ``--etcd-password-file``, ``--etcd-password`` (defaults from
``RESILIENT_ETCD_*``; see :mod:`resilient.coordinator.etcd_access`), which the workers receive
too. ``--rdzv-id``/``--job`` must be a valid job id (see :func:`check_job_name`).

One default differs from torchrun on purpose: a worker that dies with no restarts left
does not stop its siblings (they go on with the survivors; see
:mod:`resilient.launcher.agent`). ``--fail-fast`` (``PET_FAIL_FAST=1`` or
``RESILIENT_FAIL_FAST=1``) restores torchrun's stop-everything behaviour.

:func:`parse` turns argv into a validated :class:`LaunchConfig`; bad input raises
:class:`~resilient.errors.ConfigError` naming the flag, the cause and the fix, before
anything is started.
"""
from __future__ import annotations

import argparse
import math
import os
import uuid
from dataclasses import dataclass, field
from typing import Sequence

from resilient.coordinator.etcd_access import EtcdAccess, add_arguments as add_etcd_access_arguments
from resilient.errors import ConfigError
from resilient.settings import Settings

DEFAULT_MASTER_PORT = 29500
DEFAULT_LEASE_TTL = 5.0
ETCD_BACKENDS = ("etcd", "etcd-v2", "etcd_v2")
SUPPORTED_BACKENDS = ("static",) + ETCD_BACKENDS


class EnvDefault(argparse.Action):
    """Like torch's ``argparse_util.env``: default from ``PET_<DEST>`` before ``default``."""

    def __init__(self, dest: str, default: object = None, required: bool = False, **kwargs: object) -> None:
        default = os.environ.get(f"PET_{dest.upper()}", default)
        if default:
            required = False
        super().__init__(dest=dest, default=default, required=required, **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)


class EnvFlag(argparse.Action):
    """Like torch's ``argparse_util.check_env``: a store-true flag, default from ``PET_<DEST>``
    (``1``/``0``)."""

    def __init__(self, dest: str, default: bool = False, alt_env: str | None = None, **kwargs: object) -> None:
        name = f"PET_{dest.upper()}"
        if name not in os.environ and alt_env and alt_env in os.environ:
            name = alt_env  # our own spelling (RESILIENT_...), used when PET_... is unset
        raw = os.environ.get(name, "1" if default else "0")
        try:
            value = bool(int(raw))
        except ValueError:
            raise ConfigError(f"{name}={raw!r} must be 0 or 1") from None
        super().__init__(dest=dest, const=True, default=value, nargs=0, **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, self.const)


def _comma_separated_list(value: str) -> list[str]:
    placeholder = "<COMMA_PLACEHOLDER>"
    return [item.replace(placeholder, ",") for item in value.replace(",,", placeholder).split(",")]


def _spellings(name: str) -> list[str]:
    """``--foo-bar`` and ``--foo_bar`` (torchrun accepts both)."""
    dash = f"--{name}"
    under = f"--{name.replace('-', '_')}"
    return [dash] if dash == under else [dash, under]


EPILOG = """examples:
  resilient-run --standalone --nproc-per-node 4 train.py           # one node, etcd and coordinator started for you
  resilient-run --nnodes 2 --nproc-per-node 8 --rdzv-backend etcd \\
      --rdzv-endpoint 10.0.0.1:2379 --rdzv-id train --local-addr 10.0.0.2 train.py   # each node (docs/multinode.md)
  resilient-run --standalone --nproc-per-node 4 --max-restarts 1 train.py          # a dead worker rejoins

Every flag is documented in docs/launcher.md; torchrun's spellings (--nproc_per_node) and PET_* variables work."""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the help, the examples epilog as written."""


def build_parser() -> argparse.ArgumentParser:
    """The ``resilient-run`` parser (torchrun's flags plus ours)."""
    p = argparse.ArgumentParser(
        prog="resilient-run",
        description=(
            "Drop-in replacement for torchrun: the per-node agent of resilient. Spawns the "
            "workers with torchrun's environment plus RESILIENT_ETCD/JOB/LEASE_ID/MEMBER_ID/"
            "LEASE_TTL and RESILIENT_AGENT_SOCKET, vouches for its workers in one etcd lease and "
            "one record per node (--no-node-lease: one lease per worker), removes a worker "
            "the moment it dies and restarts only that worker (as a joiner) within "
            "--max-restarts. Unlike "
            "torchrun, a worker that dies with no restarts left does NOT stop the others: "
            "they finish the work without it and the job exits 0 (non-zero if a worker "
            "exited with an error code, or if no worker finished); --fail-fast restores "
            "torchrun's behaviour."
        ),
        epilog=EPILOG,
        formatter_class=_Formatter,
    )

    from resilient.version import version_line

    p.add_argument("--version", action="version", version=version_line("resilient-run"))

    def add(name: str, *, short: str | None = None, flag: bool = False, **kw: object) -> None:
        opts = ([short] if short else []) + _spellings(name)
        if flag:
            p.add_argument(*opts, action=EnvFlag, **kw)  # type: ignore[arg-type]
        else:
            p.add_argument(*opts, action=EnvDefault, **kw)  # type: ignore[arg-type]

    g = p.add_argument_group("size (torchrun)")
    add("nnodes", type=str, default="1:1",
        help="Number of nodes, or MIN:MAX. With --rdzv-backend etcd the agents register under "
             "/resilient/<job>/slots/ in etcd, wait for MIN nodes and admit later ones up to MAX.")
    add("nproc-per-node", type=str, default="1",
        help="Workers per node: an int, or auto, cpu, gpu, xpu.")

    g = p.add_argument_group("rendezvous (torchrun)")
    add("rdzv-backend", type=str, default="static",
        help="static (no etcd unless --etcd is given; ranks from --node-rank) or etcd (HOST:PORT "
             "in --rdzv-endpoint is the etcd of the control plane). c10d is not used: "
             "resilient's rendezvous is etcd.")
    add("rdzv-endpoint", type=str, default="",
        help="Rendezvous endpoint HOST:PORT; with --rdzv-backend etcd: etcd client endpoint(s).")
    add("rdzv-id", type=str, default="none", help="User-defined job id (TORCHELASTIC_RUN_ID; default of --job).")
    add("rdzv-conf", type=str, default="",
        help="Extra rendezvous configuration k1=v1,k2=v2. Understood: join_timeout (seconds to "
             "wait for MIN nodes, default 600), last_call_timeout (seconds to wait for more "
             "nodes after MIN, default 0).")
    add("standalone", flag=True,
        help="Start a local etcd and a resilient coordinator on free ports, stop both on exit. "
             "--rdzv-backend/--rdzv-endpoint/--rdzv-id are assigned automatically (as torchrun).")

    g = p.add_argument_group("workers (torchrun)")
    add("max-restarts", type=int, default=0,
        help="How many times each worker may be restarted after it fails. Only the failed "
             "worker is restarted, as a joiner (RESILIENT_JOINER=1); its siblings keep running. "
             "When a worker has no restarts left its siblings still keep running (see "
             "--fail-fast).")
    add("monitor-interval", type=float, default=0.1, help="Seconds between checks of the workers.")
    add("start-method", type=str, default="spawn", choices=["spawn", "fork", "forkserver"],
        help="Accepted for compatibility; workers are always fresh processes (as torchrun with "
             "a script entrypoint).")
    add("event-log-handler", type=str, default="null", help="Accepted for compatibility (torchrun event handler name).")
    add("role", type=str, default="default", help="User-defined role of the workers (ROLE_NAME).")
    add("module", short="-m", flag=True, help="Run the training script as a module, like 'python -m'.")
    add("no-python", flag=True, help="Execute the training script directly instead of with 'python'.")
    add("run-path", flag=True,
        help="Run the training script (an absolute path) as a path; equivalent to the default "
             "here since every worker is its own process.")
    add("log-dir", type=str, default=None,
        help="Base directory for worker logs: <log-dir>/<run id>_<random>/attempt_<restart "
             "count>/<local rank>/{stdout.log,stderr.log,error.json}, as torchrun.")
    add("redirects", short="-r", type=str, default="0",
        help="Redirect std streams to the log dir: 0 none, 1 stdout, 2 stderr, 3 both; or per "
             "local rank, e.g. 0:1,1:2.")
    add("tee", short="-t", type=str, default="0",
        help="Like --redirects, and also print the lines to the console prefixed [<role><local rank>]:.")
    add("local-ranks-filter", type=str, default="",
        help="Only show the console output of these local ranks (e.g. 0,1); log files are unaffected.")
    add("duplicate-stdout-filters", type=_comma_separated_list, default=[],
        help="Also copy tee'd stdout lines containing any of these strings to "
             "filtered_stdout.log in the attempt dir (',,' escapes a comma).")
    add("duplicate-stderr-filters", type=_comma_separated_list, default=[],
        help="As --duplicate-stdout-filters, for stderr (filtered_stderr.log).")

    g = p.add_argument_group("static rendezvous (torchrun)")
    add("node-rank", type=int, default=0, help="Rank of this node with --rdzv-backend static.")
    add("master-addr", type=str, default="127.0.0.1",
        help="Address of the node of group rank 0 (static rendezvous); MASTER_ADDR of the workers.")
    add("master-port", type=int, default=None,
        help="Port of the TCPStore the group-rank-0 agent hosts for the workers (static "
             "rendezvous; default 29500); MASTER_PORT of the workers.")
    add("local-addr", type=str, default=None,
        help="Address of this node, published to the other agents (default: this host's FQDN).")
    p.add_argument(*_spellings("logs-specs"), type=str, default=None,
                   help="Accepted for compatibility; only torchrun's default logs layout is implemented.")
    p.add_argument(*_spellings("numa-binding"), type=str, default=None,
                   choices=["node", "socket", "exclusive", "core-complex"],
                   help="Accepted for compatibility; CPU binding is not applied by resilient-run.")
    add("signals-to-handle", type=str, default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        help="Signals the agent forwards to the workers before it exits.")
    add("shutdown-timeout", type=int, default=None,
        help="Seconds to wait for workers after forwarding a signal before SIGKILL "
             "(default: TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30).")
    add("virtual-local-rank", flag=True,
        help="LOCAL_RANK=0 for every worker and CUDA_VISIBLE_DEVICES set to its own GPU.")

    g = p.add_argument_group("resilient (ours)")
    add("etcd", type=str, default=None,
        help="etcd endpoints HOST:PORT[,HOST:PORT...] of the control plane (RESILIENT_ETCD of "
             "the workers). Default: --rdzv-endpoint when --rdzv-backend is etcd; started "
             "locally with --standalone.")
    add("job", type=str, default=None,
        help="Job name: the etcd prefix /resilient/<job>/ (RESILIENT_JOB). Default: --rdzv-id.")
    add("lease-ttl", type=float, default=DEFAULT_LEASE_TTL,
        help="Seconds a worker's etcd lease lives without keep-alive (a hung/SIGSTOPped worker "
             "is removed after this); RESILIENT_LEASE_TTL. With the node agent (the default) it is the "
             "node's liveness bound: the node lease is granted floor(TTL - 0.5) s (etcd revokes "
             "expired leases up to 0.5 s late) so a silent node is declared dead within TTL; "
             "under 2.5 s it is granted as given and the bound is TTL + 0.5 s (a warning says so).")
    add("node-health-interval", type=float, default=1.0,
        help="With the node agent (the default): the least seconds between two of the agent's "
             "health/<node> summaries. A summary is written when a rank's health changes (at once when "
             "a rank turns slow), within --health-write-budget (docs/scale.md).")
    add("health-write-budget", type=float, default=10.0,
        help="With the node agent: health summary writes per second for the whole job (give every "
             "node the same); each node's share is this divided by the job's node count (docs/scale.md).")
    g.add_argument("--no-node-lease", "--no_node_lease", dest="no_node_lease", action="store_true",
                   help="One etcd lease per worker, kept alive by the worker itself, instead of the default "
                        "node agent (one lease and one nodes/<node> record per node; resilient.connect() "
                        "joins through the agent's local channel, which relays epochs and checks each "
                        "rank's beats: docs/scale.md). Same as RESILIENT_NODE_LEASE=0. Only with etcd.")
    add("metrics-port", type=int, default=None,
        help="Serve Prometheus /metrics of this agent on this port (0: a free port; default: off).")
    add("metrics-host", type=str, default=None,
        help="Address the agent's /metrics listens on (PET_METRICS_HOST). Default: 127.0.0.1 with "
             "--standalone (every listener of a standalone job is on loopback), else 0.0.0.0.")
    add_etcd_access_arguments(g)
    add("fail-fast", flag=True, alt_env="RESILIENT_FAIL_FAST",
        help="torchrun's behaviour: when a worker fails with no restarts left, stop every other "
             "worker (SIGTERM, --shutdown-timeout, SIGKILL) and exit 1 with torchrun's failure "
             "summary. Default: off, the survivors go on without it (env PET_FAIL_FAST or "
             "RESILIENT_FAIL_FAST=1).")

    p.add_argument("training_script", type=str,
                   help="The training script (or module with -m, or program with --no-python), "
                        "followed by its arguments.")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


@dataclass
class LaunchConfig:
    """Validated launch settings (what the agent acts on)."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    rdzv_backend: str
    rdzv_endpoint: str
    run_id: str
    rdzv_conf: dict[str, str]
    standalone: bool
    max_restarts: int
    monitor_interval: float
    role: str
    node_rank: int
    master_addr: str
    master_port: int | None
    local_addr: str | None
    log_dir: str | None
    redirects: str
    tee: str
    local_ranks_filter: set[int] | None
    duplicate_stdout_filters: list[str]
    duplicate_stderr_filters: list[str]
    signals_to_handle: list[str]
    shutdown_timeout: float
    virtual_local_rank: bool
    etcd: list[str]
    job: str
    lease_ttl: float
    metrics_port: int | None
    metrics_host: str = "0.0.0.0"
    node_health_interval: float = 1.0
    health_write_budget: float = 10.0
    #: the node agent (one node lease, the local channel); off: --no-node-lease / RESILIENT_NODE_LEASE=0
    node_lease: bool = True
    cmd: list[str] = field(default_factory=list)
    etcd_access: EtcdAccess = field(default_factory=EtcdAccess)  # TLS files, credentials
    fail_fast: bool = False

    @property
    def uses_etcd(self) -> bool:
        return bool(self.etcd) or self.standalone

    @property
    def elastic_nodes(self) -> bool:
        """Group ranks come from etcd (not from --node-rank)."""
        return self.rdzv_backend in ETCD_BACKENDS or self.standalone


def parse_min_max_nnodes(value: str) -> tuple[int, int]:
    parts = value.split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--nnodes {value!r} is not N or MIN:MAX; use e.g. --nnodes 2 or --nnodes 1:4") from None
    if not 0 < lo <= hi:
        raise ConfigError(f"--nnodes {value!r}: need 0 < MIN <= MAX, e.g. --nnodes 1:4")
    return lo, hi


def local_world_size(value: str) -> int:
    """``--nproc-per-node``: an int, or auto/cpu/gpu/xpu as torchrun (imports torch only then)."""
    try:
        n = int(value)
    except ValueError:
        if value not in ("auto", "cpu", "gpu", "xpu"):
            raise ConfigError(f"--nproc-per-node {value!r}: use an integer or one of auto, cpu, gpu, xpu") from None
        import torch

        if value == "cpu" or (value == "auto" and not torch.accelerator.is_available()):
            return torch._utils.cpu_count() or 1
        if value == "auto":
            return torch.accelerator.device_count()
        mod = torch.cuda if value == "gpu" else torch.xpu
        if not mod.is_available():
            raise ConfigError(f"--nproc-per-node {value}: no {value.upper()} is available; give a number instead")
        return int(mod.device_count())
    if n < 1:
        raise ConfigError(f"--nproc-per-node {value!r} must be at least 1")
    return n


def parse_rdzv_conf(value: str) -> dict[str, str]:
    conf: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in value.split(","))):
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--rdzv-conf item {item!r} is not key=value; use e.g. --rdzv-conf join_timeout=60")
        conf[key.strip()] = val.strip()
    return conf


def _parse_ranks_filter(value: str) -> set[int] | None:
    if not value:
        return None
    try:
        ranks = {int(v) for v in value.split(",")}
    except ValueError:
        raise ConfigError(f"--local-ranks-filter {value!r} must be comma-separated integers, e.g. 0,1,2") from None
    return ranks


def parse_endpoints(value: str, flag: str) -> list[str]:
    """``host:port[,host:port]`` (an ``http://`` prefix is tolerated) -> ``["host:port", ...]``,
    parsed by :func:`resilient.coordinator.store.parse_endpoints`; ConfigError naming ``flag``."""
    from resilient.coordinator.store import parse_endpoints as parse

    try:
        pairs = parse(value)
    except ConfigError as exc:
        raise ConfigError(f"{flag} {value!r} is not HOST:PORT[,HOST:PORT] ({exc}); use e.g. {flag} 127.0.0.1:2379") from None
    return [f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in pairs]


def check_job_name(value: str, flag: str) -> str:
    """The job id of ``--rdzv-id``/``--job``, checked like every other entry point does
    (``resilient.coordinator.keys.check_name``: it becomes the etcd prefix
    ``/resilient/<job>/`` and a log directory name); ConfigError naming the flag and the rule."""
    from resilient.coordinator.keys import check_name

    try:
        return check_name("job name", value)
    except ConfigError as exc:
        raise ConfigError(f"{flag} {value!r} is not a valid job id: use 1-128 characters from letters, digits, "
                          "'.', '_' and '-', starting with a letter or digit (it becomes the etcd prefix "
                          f"/resilient/<job>/ and part of log paths); e.g. {flag} my-job-1") from exc


def worker_command(args: argparse.Namespace) -> list[str]:
    """The worker command line, as torchrun builds it (``python -u [-m] script args``)."""
    import sys

    if args.no_python and not args.run_path:
        if args.module:
            raise ConfigError("don't use both --no-python and --module; drop one of them")
        return [args.training_script, *args.training_script_args]
    cmd = [os.getenv("PYTHON_EXEC", sys.executable), "-u"]
    if args.module and not args.run_path:
        cmd.append("-m")
    return cmd + [args.training_script, *args.training_script_args]


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """Validate parsed flags into a :class:`LaunchConfig` (raises ``ConfigError``)."""
    lo, hi = parse_min_max_nnodes(args.nnodes)
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts} must be >= 0")
    if args.monitor_interval <= 0:
        raise ConfigError(f"--monitor-interval {args.monitor_interval} must be > 0")
    if not (math.isfinite(args.lease_ttl) and args.lease_ttl > 0):
        raise ConfigError(f"--lease-ttl {args.lease_ttl} must be a finite number of seconds > 0")
    if not (math.isfinite(args.node_health_interval) and args.node_health_interval > 0):
        raise ConfigError(f"--node-health-interval {args.node_health_interval} must be > 0 seconds")
    if not (math.isfinite(args.health_write_budget) and args.health_write_budget > 0):
        raise ConfigError(f"--health-write-budget {args.health_write_budget} must be > 0 writes/s")
    backend = args.rdzv_backend
    endpoint = args.rdzv_endpoint
    run_id = args.rdzv_id
    if args.standalone:
        backend, endpoint, run_id = "etcd", "", str(uuid.uuid4())
    elif backend not in SUPPORTED_BACKENDS:
        raise ConfigError(
            f"--rdzv-backend {backend!r} is not supported by resilient-run: its rendezvous is etcd. "
            "Use --rdzv-backend etcd --rdzv-endpoint HOST:2379, or --standalone on one node, or "
            "--rdzv-backend static with --master-addr/--master-port/--node-rank."
        )
    etcd: list[str] = []
    if args.etcd:
        etcd = parse_endpoints(args.etcd, "--etcd")
    elif backend in ETCD_BACKENDS and not args.standalone:
        if not endpoint:
            raise ConfigError("--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT (the etcd client endpoint)")
        etcd = parse_endpoints(endpoint, "--rdzv-endpoint")
    if backend == "static" and hi != lo:
        raise ConfigError(f"--nnodes {args.nnodes}: a MIN:MAX range needs --rdzv-backend etcd (or --standalone)")
    if backend == "static" and not 0 <= args.node_rank < hi:
        raise ConfigError(f"--node-rank {args.node_rank} must be in [0, {hi}) for --nnodes {args.nnodes}")
    if args.standalone and hi > 1:
        raise ConfigError("--standalone runs one node; for several nodes use --rdzv-backend etcd --rdzv-endpoint HOST:PORT")
    job = check_job_name(args.job, "--job") if args.job else check_job_name(run_id, "--rdzv-id")
    shutdown = args.shutdown_timeout
    if shutdown is None:
        shutdown = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30))
    from resilient.launcher.logs import parse_std  # validates --redirects/--tee

    parse_std(args.redirects, "--redirects")
    parse_std(args.tee, "--tee")
    import signal

    sigs = [s.strip() for s in args.signals_to_handle.split(",") if s.strip()]
    for s in sigs:
        if not hasattr(signal, s):
            raise ConfigError(f"--signals-to-handle: {s!r} is not a signal name; use e.g. SIGTERM,SIGINT")
    return LaunchConfig(
        min_nodes=lo,
        max_nodes=hi,
        nproc_per_node=local_world_size(args.nproc_per_node),
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        run_id=run_id,
        rdzv_conf=parse_rdzv_conf(args.rdzv_conf),
        standalone=args.standalone,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        role=args.role,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        local_addr=args.local_addr,
        log_dir=args.log_dir,
        redirects=args.redirects,
        tee=args.tee,
        local_ranks_filter=_parse_ranks_filter(args.local_ranks_filter),
        duplicate_stdout_filters=[f for f in args.duplicate_stdout_filters if f],
        duplicate_stderr_filters=[f for f in args.duplicate_stderr_filters if f],
        signals_to_handle=sigs,
        shutdown_timeout=float(shutdown),
        virtual_local_rank=args.virtual_local_rank,
        etcd=etcd,
        job=job,
        lease_ttl=args.lease_ttl,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host or ("127.0.0.1" if args.standalone else "0.0.0.0"),
        node_health_interval=args.node_health_interval,
        health_write_budget=args.health_write_budget,
        node_lease=Settings.from_env().node_lease and not args.no_node_lease,
        cmd=worker_command(args),
        etcd_access=EtcdAccess.from_args(args),
        fail_fast=args.fail_fast,
    )


def parse(argv: Sequence[str] | None = None) -> LaunchConfig:
    """Parse and validate ``argv`` (``sys.argv[1:]`` when None)."""
    return config_from_args(build_parser().parse_args(argv))
