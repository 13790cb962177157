"""Every ``RESILIENT_*`` environment variable, in one place.

:class:`Settings` is a frozen dataclass built on demand from an environment mapping
(default ``os.environ``) by :meth:`Settings.from_env`; nothing is read at import time, so a
process (or a test) that changes its environment sees the change at the next read. Each
field is typed and validated. Variables with a dedicated parser of their own (etcd access,
transport TLS, handshake limits, link shaping, failpoints, lease keeper, op log, launcher
flags) are listed in :data:`DELEGATED` with the module that parses them; both lists make
the one table of docs/settings.md (:func:`markdown_table`, checked by tests/test_settings.py).

Failure behaviour: a malformed value raises :class:`~resilient.errors.ConfigError` naming
the variable, the value and the fix; nothing is guessed. Launcher flags that *set* these
variables for workers (resilient/launcher/env.py) keep doing so.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import selectors
from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping, TypeVar, cast

from resilient.errors import ConfigError

T = TypeVar("T")
TransportMode = Literal["auto", "tcp"]

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
_LOG_LEVELS = ("CRITICAL", "FATAL", "ERROR", "WARNING", "WARN", "INFO", "DEBUG", "NOTSET")


def _var(name: str, default: str, meaning: str) -> dict[str, str]:
    return {"env": name, "default": default, "meaning": meaning}


@dataclass(frozen=True)
class Settings:
    """The ``RESILIENT_*`` settings of one environment (see the module docstring). Field
    metadata: ``env`` (the variable), ``default`` (as written in the table), ``meaning``."""

    etcd: str | None = field(default=None, metadata=_var(
        "RESILIENT_ETCD", "unset", "etcd endpoints `host:port[,host:port...]` of the control plane"))
    job: str | None = field(default=None, metadata=_var(
        "RESILIENT_JOB", "unset", "job name: the etcd prefix `/resilient/<job>/`"))
    member_id: str | None = field(default=None, metadata=_var(
        "RESILIENT_MEMBER_ID", "unset (a generated id)", "this worker's member id (set by `resilient-run`)"))
    lease_id: int | None = field(default=None, metadata=_var(
        "RESILIENT_LEASE_ID", "unset (own lease)", "decimal id of the etcd lease the agent granted this worker"))
    lease_ttl: float = field(default=5.0, metadata=_var(
        "RESILIENT_LEASE_TTL", "5", "seconds a silent member keeps its lease (> 0)"))
    joiner: bool = field(default=False, metadata=_var(
        "RESILIENT_JOINER", "0", "`1`: this worker joins a running group (a restarted worker)"))
    host: str = field(default="127.0.0.1", metadata=_var(
        "RESILIENT_HOST", "127.0.0.1", "address the data-plane listener binds and advertises"))
    host_label: str | None = field(default=None, metadata=_var(
        "RESILIENT_HOST_LABEL", "unset (the host name)", "the host this member counts as in hierarchical plans "
        "(the chaos runner's emulated hosts)"))
    transport: TransportMode = field(default="auto", metadata=_var(
        "RESILIENT_TRANSPORT", "auto", "`auto` (shared memory on one host, TCP across hosts) or `tcp`"))
    shm: bool = field(default=True, metadata=_var(
        "RESILIENT_SHM", "1", "`0`: no shared-memory links under `auto`"))
    shm_ring: int = field(default=8 << 20, metadata=_var(
        "RESILIENT_SHM_RING", "8388608", "bytes of each shared-memory ring (65536..1073741824)"))
    tcp_sockbuf: int = field(default=4 << 20, metadata=_var(
        "RESILIENT_TCP_SOCKBUF", "4194304", "SO_SNDBUF/SO_RCVBUF bytes of data sockets (0: the kernel's)"))
    tcp_early_cap: int = field(default=256 << 20, metadata=_var(
        "RESILIENT_TCP_EARLY_CAP", "268435456", "bytes of early (not yet posted) messages buffered per transport"))
    selector: str = field(default="DefaultSelector", metadata=_var(
        "RESILIENT_SELECTOR", "DefaultSelector", "`selectors` class the TCP transport polls with"))
    nccl_library: str | None = field(default=None, metadata=_var(
        "RESILIENT_NCCL_LIBRARY", "unset (wheel, then system)", "path of `libnccl.so.2` for the NCCL transport"))
    node_lease: bool = field(default=True, metadata=_var(
        "RESILIENT_NODE_LEASE", "1", "`0` (or `resilient-run --no-node-lease`): one etcd lease per worker instead of "
        "the launcher's node agent (one node lease and record, the local channel; docs/scale.md)"))
    log_level: str = field(default="INFO", metadata=_var(
        "RESILIENT_LOG_LEVEL", "INFO", "log level of `resilient-run` (`DEBUG`, `INFO`, `WARNING`, ...)"))
    staging: bool = field(default=False, metadata=_var(
        "RESILIENT_STAGING", "0", "`1`: CPU tensors take the host-staged data path of CUDA tensors (docs/cuda.md)"))
    shm_direct: bool = field(default=True, metadata=_var(
        "RESILIENT_SHM_DIRECT", "1", "CPU allreduces and reduce-scatters between members of one host take the direct "
        "shared-memory algorithms; `0`: the ring over shared-memory links instead (docs/hierarchy.md)"))
    stream_copy: bool = field(default=True, metadata=_var(
        "RESILIENT_STREAM_COPY", "1", "large CPU copies of the direct shared-memory allreduce and of results handed "
        "back use streaming stores (where the optional C extension was built); `0`: torch's copy (docs/bench.md)"))
    qcodec: bool = field(default=True, metadata=_var(
        "RESILIENT_QCODEC", "1", "the compressed allreduce's codec runs in the optional C extension where it was "
        "built (the same bits and wire bytes as the torch code); `0`: the torch code (docs/compression.md)"))
    fsdp_peer_copy: bool = field(default=True, metadata=_var(
        "RESILIENT_FSDP_PEER_COPY", "1", "plain FSDP (a 1-D mesh) keeps each member's shards and optimizer state in "
        "a peer's memory after every step, so a lost member's shards survive; `0`: no copy (no per-step cost, no "
        "memory for it; a lost member's shards are lost: checkpoint) (docs/fsdp.md)"))
    join_tree: bool = field(default=True, metadata=_var(
        "RESILIENT_JOIN_TREE", "1", "a growing epoch's op seq is agreed along a tree of the old members over the "
        "data plane, its root writing one etcd key; `0`: one `joinseq` key per old member (docs/scale.md)"))
    join_tree_stall: float = field(default=1.0, metadata=_var(
        "RESILIENT_JOIN_TREE_STALL", "1", "seconds an old member waits for the join tree's result before it writes a "
        "covering `joinseq` record if its subtree is incomplete (the members around a stall complete the agreement; "
        "> 0, docs/scale.md)"))
    ledger_etcd_max: int = field(default=64, metadata=_var(
        "RESILIENT_LEDGER_ETCD_MAX", "64", "up to this many survivors a recovery's ledger summaries also go through "
        "etcd from the start (`epochs/<n>/data/ledger/`); beyond it only as a fallback (>= 0, docs/scale.md)"))
    ledger_direct_max: int = field(default=16, metadata=_var(
        "RESILIENT_LEDGER_DIRECT_MAX", "16", "up to this many survivors each sends its ledger summary to every other "
        "(one hop); beyond it the summaries go up a tree to one planner and each survivor receives only its own "
        "recovery decision (>= 0, docs/scale.md)"))
    ledger_tree_fanout: int = field(default=16, metadata=_var(
        "RESILIENT_LEDGER_TREE_FANOUT", "16", "children per survivor in that tree (>= 1)"))
    ledger_etcd_after: float = field(default=10.0, metadata=_var(
        "RESILIENT_LEDGER_ETCD_AFTER", "10", "seconds (at least 1 ms per survivor) the transport exchange of ledger "
        "summaries gets before a survivor falls back to etcd, beyond `RESILIENT_LEDGER_ETCD_MAX` (> 0)"))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """The settings of ``environ`` (default: this process's environment, read now).
        Raises :class:`ConfigError` naming the first malformed variable and its fix."""
        env = os.environ if environ is None else environ
        d = cls()

        def get(name: str, parse: Callable[[str, str], T], default: T) -> T:
            raw = env.get(name)
            return default if raw is None else parse(name, raw)

        return cls(
            etcd=get("RESILIENT_ETCD", _text, d.etcd),
            job=get("RESILIENT_JOB", _text, d.job),
            member_id=get("RESILIENT_MEMBER_ID", _text, d.member_id),
            lease_id=get("RESILIENT_LEASE_ID", _lease_id, d.lease_id),
            lease_ttl=get("RESILIENT_LEASE_TTL", _positive_float, d.lease_ttl),
            joiner=get("RESILIENT_JOINER", _flag, d.joiner),
            host=get("RESILIENT_HOST", _nonempty, d.host),
            host_label=get("RESILIENT_HOST_LABEL", _text, d.host_label),
            transport=get("RESILIENT_TRANSPORT", _transport, d.transport),
            shm=get("RESILIENT_SHM", _flag, d.shm),
            shm_ring=get("RESILIENT_SHM_RING", _ring_bytes, d.shm_ring),
            tcp_sockbuf=get("RESILIENT_TCP_SOCKBUF", _nonnegative_int, d.tcp_sockbuf),
            tcp_early_cap=get("RESILIENT_TCP_EARLY_CAP", _nonnegative_int, d.tcp_early_cap),
            selector=get("RESILIENT_SELECTOR", _selector, d.selector),
            nccl_library=get("RESILIENT_NCCL_LIBRARY", _text, d.nccl_library),
            node_lease=get("RESILIENT_NODE_LEASE", _flag, d.node_lease),
            log_level=get("RESILIENT_LOG_LEVEL", _log_level, d.log_level),
            staging=get("RESILIENT_STAGING", _flag, d.staging),
            shm_direct=get("RESILIENT_SHM_DIRECT", _flag, d.shm_direct),
            stream_copy=get("RESILIENT_STREAM_COPY", _flag, d.stream_copy),
            qcodec=get("RESILIENT_QCODEC", _flag, d.qcodec),
            fsdp_peer_copy=get("RESILIENT_FSDP_PEER_COPY", _flag, d.fsdp_peer_copy),
            join_tree=get("RESILIENT_JOIN_TREE", _flag, d.join_tree),
            join_tree_stall=get("RESILIENT_JOIN_TREE_STALL", _positive_float, d.join_tree_stall),
            ledger_etcd_max=get("RESILIENT_LEDGER_ETCD_MAX", _nonnegative_int, d.ledger_etcd_max),
            ledger_direct_max=get("RESILIENT_LEDGER_DIRECT_MAX", _nonnegative_int, d.ledger_direct_max),
            ledger_tree_fanout=get("RESILIENT_LEDGER_TREE_FANOUT", _positive_int, d.ledger_tree_fanout),
            ledger_etcd_after=get("RESILIENT_LEDGER_ETCD_AFTER", _positive_float, d.ledger_etcd_after),
        )

    def make_selector(self) -> selectors.BaseSelector:
        """A new selector of the configured class."""
        factory = cast(Callable[[], selectors.BaseSelector], getattr(selectors, self.selector))
        return factory()


# -- parsers: (variable, raw value) -> value, or ConfigError naming both and the fix ---------

def _bad(name: str, raw: str, fix: str) -> ConfigError:
    return ConfigError(f"{name}={raw!r}: {fix} (or unset {name} for the default)")


def _text(name: str, raw: str) -> str | None:
    """Any text; empty means unset."""
    return raw or None


def _nonempty(name: str, raw: str) -> str:
    if not raw.strip():
        raise _bad(name, raw, "give a non-empty value")
    return raw


def _flag(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise _bad(name, raw, "use 1 or 0")


def _int(name: str, raw: str, lo: int, hi: int = (1 << 63) - 1) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise _bad(name, raw, f"give a whole number in {lo}..{hi}" if hi < (1 << 63) - 1 else f"give a whole number >= {lo}")
    return value


def _ring_bytes(name: str, raw: str) -> int:
    return _int(name, raw, 64 << 10, 1 << 30)  # resilient.transport.shm's MIN_CAPACITY..MAX_CAPACITY


def _nonnegative_int(name: str, raw: str) -> int:
    return _int(name, raw, 0)


def _positive_int(name: str, raw: str) -> int:
    return _int(name, raw, 1)


def _lease_id(name: str, raw: str) -> int | None:
    return _int(name, raw, 0) if raw.strip() else None


def _positive_float(name: str, raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise _bad(name, raw, "give a number of seconds > 0") from None
    if not value > 0 or value == float("inf"):
        raise _bad(name, raw, "give a number of seconds > 0")
    return value


def _transport(name: str, raw: str) -> TransportMode:
    if raw == "auto":
        return "auto"
    if raw == "tcp":
        return "tcp"
    raise ConfigError(f"{name}={raw!r}: use 'auto' (shared memory on one host, TCP across hosts) or 'tcp'")


def _selector(name: str, raw: str) -> str:
    cls = getattr(selectors, raw, None)
    if not (isinstance(cls, type) and issubclass(cls, selectors.BaseSelector)) or raw == "BaseSelector":
        raise _bad(name, raw, "name a class of the selectors module: DefaultSelector, EpollSelector, "
                              "PollSelector or SelectSelector")
    return raw


def _log_level(name: str, raw: str) -> str:
    level = raw.strip().upper()
    if level not in _LOG_LEVELS or not isinstance(logging.getLevelName(level), int):
        raise _bad(name, raw, f"use one of {', '.join(_LOG_LEVELS)}")
    return level


#: variables parsed by a dedicated module of their own: (variable, parsed by, meaning)
DELEGATED: tuple[tuple[str, str, str], ...] = (
    ("RESILIENT_ETCD_CA_CERT", "resilient.coordinator.etcd_access", "CA bundle that verifies etcd's server certificate"),
    ("RESILIENT_ETCD_CERT", "resilient.coordinator.etcd_access", "client certificate for etcd (with `RESILIENT_ETCD_KEY`)"),
    ("RESILIENT_ETCD_KEY", "resilient.coordinator.etcd_access", "private key of `RESILIENT_ETCD_CERT`"),
    ("RESILIENT_ETCD_USER", "resilient.coordinator.etcd_access", "etcd user name (authentication)"),
    ("RESILIENT_ETCD_PASSWORD", "resilient.coordinator.etcd_access", "etcd password (prefer the file)"),
    ("RESILIENT_ETCD_PASSWORD_FILE", "resilient.coordinator.etcd_access", "file holding the etcd password"),
    ("RESILIENT_TLS_CA", "resilient.transport.tls", "CA bundle of mutual TLS between members"),
    ("RESILIENT_TLS_CERT", "resilient.transport.tls", "this member's TLS certificate"),
    ("RESILIENT_TLS_KEY", "resilient.transport.tls", "private key of `RESILIENT_TLS_CERT`"),
    ("RESILIENT_TLS_VERIFY_MEMBER", "resilient.transport.tls", "check the peer's member id in its certificate"),
    ("RESILIENT_TCP_HANDSHAKE_TIMEOUT", "resilient.transport.handshake", "seconds an unauthenticated connection may take"),
    ("RESILIENT_TCP_MAX_PENDING", "resilient.transport.handshake", "unauthenticated connections held at once"),
    ("RESILIENT_TCP_PENDING_BYTES", "resilient.transport.handshake", "bytes buffered for unauthenticated connections"),
    ("RESILIENT_TCP_PARKED_TIMEOUT", "resilient.transport.handshake", "seconds a HELLO for a future epoch is parked"),
    ("RESILIENT_SHAPING", "resilient.transport.shaping", "link shaping spec (chaos, benches)"),
    ("RESILIENT_SHAPING_FILE", "resilient.transport.shaping", "file holding a link shaping spec"),
    ("RESILIENT_FAILPOINTS", "resilient.collectives.failpoints", "failpoints `name=action[;...]` (tests, chaos)"),
    ("RESILIENT_LEASE_KEEPER", "resilient.coordinator.membership", "`agent`: the launcher keeps the worker's lease alive"),
    ("RESILIENT_HEARTBEAT_FILE", "resilient.coordinator.membership", "file a worker touches for the agent's hang check"),
    ("RESILIENT_AGENT_SOCKET", "resilient.agent_channel",
     "the node agent's local channel (set by `resilient-run` unless `RESILIENT_NODE_LEASE=0`)"),
    ("RESILIENT_OP_LOG", "resilient.torch_backend.op_log", "path: one JSON line per torch-backend op"),
    ("RESILIENT_EXIT_MARKER", "resilient.script_exit", "set by `resilient-run`: where a worker marks its script started and finished"),
    ("RESILIENT_FAIL_FAST", "resilient.launcher.args", "`1`: `resilient-run --fail-fast` (torchrun's behaviour)"),
)


def variables() -> list[str]:
    """Every ``RESILIENT_*`` variable resilient reads, in table order."""
    return [f.metadata["env"] for f in dataclasses.fields(Settings)] + [name for name, _, _ in DELEGATED]


def markdown_table() -> str:
    """The table of docs/settings.md, generated from :class:`Settings` and :data:`DELEGATED`."""
    rows = ["| variable | type | default | meaning | parsed by |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(Settings):
        m = f.metadata
        kind = str(f.type).replace(" | ", " or ").replace("TransportMode", "auto or tcp")
        rows.append(f"| `{m['env']}` | {kind} | {m['default']} | {m['meaning']} | `Settings.{f.name}` |")
    for name, module, meaning in DELEGATED:
        rows.append(f"| `{name}` | | | {meaning} | `{module}` |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # pragma: no cover - `python -m resilient.settings` prints the table
    print(markdown_table(), end="")
