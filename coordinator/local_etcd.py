"""Start and stop real local ``etcd`` processes: one member or a small cluster.

Used by the test-suite, benchmarks, ``resilient-run --standalone``, ``make demo`` and the
chaos runner. Every port is a free loopback port chosen at start; every process started
here is stopped by PID in :meth:`LocalEtcd.stop` (also on ``with`` exit), and its data
directory is removed.

Options for the security tests and the standalone mode: ``tls=`` (:class:`TlsFiles`)
serves the client URLs over https, optionally requiring client certificates; ``auth=True``
turns etcd authentication on with a ``root`` user whose generated password lives in a
file of mode 0600 inside the member's private (0700) directory, so another local user can
neither read the password nor anything in etcd; ``extra_args`` go to every member (e.g.
``--auth-token-ttl``). :attr:`LocalEtcd.access` is what a client needs (TLS files, user,
password file). Passwords are hashed with ``--bcrypt-cost 4`` (the fastest): they are
random 256-bit secrets, so slow hashing would only slow every client's start.

Failure behaviour: if ``etcd`` is not on PATH, :class:`~resilient.errors.ConfigError` says
how to install it. If a member does not answer its health endpoint within ``start_timeout``
(a port raced away, a bad flag), every member started so far is stopped and
:class:`~resilient.errors.StoreUnavailable` carries the tail of that member's log.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Sequence

from resilient.coordinator.etcd_access import EtcdAccess
from resilient.errors import ConfigError, StoreUnavailable

#: the user :class:`LocalEtcd` creates with ``auth=True``
ROOT_USER = "root"


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS etcd: ``ca`` signed the server certificate (and the client one);
    with ``client_cert``/``client_key``, etcd requires client certificates signed by ``ca``."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str | None = None
    client_key: str | None = None

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca)
        if self.client_cert:
            ctx.load_cert_chain(self.client_cert, self.client_key)
        return ctx


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]   # (host, port) for AF_INET
        return port


def die_with_parent(args: Sequence[str]) -> tuple[list[str], Callable[[], None] | None]:
    """``(args, preexec_fn)`` for a Popen whose child Linux SIGKILLs when the thread that
    started it dies, so a test runner or agent killed by a timeout or a signal never leaves
    an etcd or coordinator behind (the parent-death signal follows the forking *thread*:
    ask for it only from a thread that lives as long as the child, the main thread).

    With util-linux's ``setpriv`` (Debian: always there) the child is
    ``setpriv --pdeathsig KILL <args>``, which sets the signal and execs ``args`` (same
    pid) — no ``preexec_fn``: a ``preexec_fn`` makes Popen fork the whole process and run
    Python in the child, and in a parent with gRPC threads (an etcd client) gRPC's fork
    handlers can abort that child before it execs (seen as an etcd that "exited during
    start-up" with status -6). Without ``setpriv`` it falls back to a ``prctl`` preexec."""
    setpriv = shutil.which("setpriv")
    if setpriv is not None:
        return [setpriv, "--pdeathsig", "KILL", *args], None
    return list(args), _prctl_pdeathsig


def _prctl_pdeathsig() -> None:  # pragma: no cover - runs in the forked child
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def etcd_binary() -> str:
    path = shutil.which("etcd")
    if path is None:
        raise ConfigError(
            "the `etcd` binary is not on PATH; install it (Debian: `apt-get install etcd-server`, "
            "or `make setup`), or point resilient at an existing etcd with --etcd/--rdzv-endpoint"
        )
    return path


@dataclass
class EtcdMember:
    """One etcd process of a :class:`LocalEtcd` cluster."""

    name: str
    client_port: int
    peer_port: int
    data_dir: str
    log_path: str
    proc: subprocess.Popen[bytes] | None = None
    host: str = "127.0.0.1"
    scheme: str = "http"

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        """``host:port`` form used by resilient's ``--etcd`` flags."""
        return f"{self.host}:{self.client_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, "r", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


@dataclass
class LocalEtcd:
    """A local etcd of ``size`` members on free loopback ports.

    >>> with LocalEtcd() as etcd:            # doctest: +SKIP
    ...     store = Store(etcd.endpoints)
    """

    size: int = 1
    host: str = "127.0.0.1"
    heartbeat_ms: int = 100
    election_ms: int = 1000
    start_timeout: float = 20.0
    tls: TlsFiles | None = None
    auth: bool = False
    extra_args: Sequence[str] = ()
    members: list[EtcdMember] = field(default_factory=list)
    _root: str | None = None
    password_file: str | None = None

    @property
    def access(self) -> EtcdAccess:
        """TLS files and credentials a client of this etcd needs (empty when plain)."""
        tls = self.tls
        return EtcdAccess(ca_cert=tls.ca if tls else None, cert=tls.client_cert if tls else None,
                          key=tls.client_key if tls else None,
                          user=ROOT_USER if self.password_file else None, password_file=self.password_file)

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    @property
    def endpoint_arg(self) -> str:
        """Comma-separated endpoints, as accepted by ``--etcd``."""
        return ",".join(self.endpoints)

    def __enter__(self) -> "LocalEtcd":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> "LocalEtcd":
        binary = etcd_binary()
        root = self._root = tempfile.mkdtemp(prefix="resilient-etcd-")  # mode 0700: data, logs, password
        for attempt in range(3):
            self.members = [
                EtcdMember(
                    name=f"etcd{i}",
                    client_port=free_port(self.host),
                    peer_port=free_port(self.host),
                    data_dir=os.path.join(root, f"attempt{attempt}", f"etcd{i}"),
                    log_path=os.path.join(root, f"etcd{i}.{attempt}.log"),
                    host=self.host,
                    scheme="https" if self.tls else "http",
                )
                for i in range(self.size)
            ]
            for m in self.members:
                self._spawn(binary, m, state="new")
            try:
                self.wait_healthy(self.members)
            except StoreUnavailable as exc:
                last = exc
                self._kill_all()
                continue
            try:
                if self.auth:
                    self._enable_auth(root)
            except BaseException:
                self.stop()
                raise
            return self
        self.stop()
        raise last

    def _enable_auth(self, root: str) -> None:
        """Create ``root`` with a random password (written to a 0600 file in the data
        folder ``root``) and turn auth on."""
        password = secrets.token_urlsafe(32)
        path = os.path.join(root, "root.password")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password)
        with EtcdAccess(ca_cert=self.access.ca_cert, cert=self.access.cert, key=self.access.key).open_store(
                self.endpoints) as store:
            store.add_role("root")
            store.add_user(ROOT_USER, password, ["root"])
            store.enable_auth()
        self.password_file = path

    def _initial_cluster(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    def _spawn(self, binary: str, m: EtcdMember, state: str) -> None:
        os.makedirs(m.data_dir, mode=0o700, exist_ok=True)
        args = [
            binary,
            "--name", m.name,
            "--data-dir", m.data_dir,
            "--listen-client-urls", m.client_url,
            "--advertise-client-urls", m.client_url,
            "--listen-peer-urls", m.peer_url,
            "--initial-advertise-peer-urls", m.peer_url,
            "--initial-cluster", self._initial_cluster(),
            "--initial-cluster-state", state,
            "--initial-cluster-token", f"resilient-{os.getpid()}-{id(self)}",
            "--heartbeat-interval", str(self.heartbeat_ms),
            "--election-timeout", str(self.election_ms),
            "--log-level", "warn",
            "--bcrypt-cost", "4",
        ]
        if self.tls is not None:
            args += ["--cert-file", self.tls.server_cert, "--key-file", self.tls.server_key]
            if self.tls.client_cert:
                args += ["--client-cert-auth", "--trusted-ca-file", self.tls.ca]
        args += list(self.extra_args)
        log = open(m.log_path, "ab")
        # Own process group, so that a test's Ctrl-C does not reach it first and so that
        # stop() can signal exactly the processes we started.
        # The parent-death signal follows the *thread* that forks, so it is only asked for
        # from the main thread (a chaos injector thread restarting a member ends early).
        on_main = threading.current_thread() is threading.main_thread()
        argv, preexec = die_with_parent(args) if on_main else (args, None)
        m.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                  preexec_fn=preexec)
        log.close()

    def wait_healthy(self, members: Sequence[EtcdMember], timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.start_timeout)
        context = self.tls.context() if self.tls else None
        pending = list(members)
        while pending:
            m = pending[0]
            if not m.running:
                raise StoreUnavailable(f"etcd member {m.name} exited during start-up:\n{m.log_tail()}")
            try:
                with urllib.request.urlopen(f"{m.client_url}/health", timeout=1.0, context=context) as r:
                    if b'"health":"true"' in r.read().replace(b" ", b""):
                        pending.pop(0)
                        continue
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise StoreUnavailable(
                    f"etcd member {m.name} did not become healthy within "
                    f"{timeout or self.start_timeout:.0f}s:\n{m.log_tail()}"
                )
            time.sleep(0.05)

    # -- fault injection helpers (chaos, tests) ------------------------------------------

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to member ``index`` and reap it (SIGKILL by default)."""
        proc = self.members[index].proc
        if proc is not None and proc.poll() is None:   # EtcdMember.running
            proc.send_signal(sig)
            proc.wait(timeout=10)

    def restart(self, index: int, wait: bool = True) -> None:
        """Start member ``index`` again on its old ports and data (after :meth:`kill`)."""
        m = self.members[index]
        if m.running:
            return
        self._spawn(etcd_binary(), m, state="existing" if self.size > 1 else "new")
        if wait:
            self.wait_healthy([m])

    def stop(self) -> None:
        """Stop every member started here (SIGTERM, then SIGKILL) and remove their data."""
        self._kill_all()
        if self._root:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None
            self.password_file = None

    def _kill_all(self) -> None:
        for m in self.members:
            if m.proc is not None and m.proc.poll() is None:
                m.proc.terminate()
        for m in self.members:
            if m.proc is not None:
                try:
                    m.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    m.proc.kill()
                    m.proc.wait(timeout=5)
