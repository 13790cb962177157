"""Shared plumbing of the data-plane benchmarks (bench/collectives.py, bench/recovery.py).

Driver side: :class:`BenchCluster` starts a real local etcd, a real coordinator process
(``resilient coordinator``) and N real member processes (the bench script itself in
``--worker`` mode), children of one :class:`~resilient.process_pool.ProcessPool`. Like the
node agent, the driver grants each member's lease and revokes it the moment it sees that
process exit (:meth:`BenchCluster.watch_exit`, a
:class:`~resilient.launcher.lease_reaper.LeaseReaper`). Every process started here is
ended here, by PID (its own session), also on errors.

Worker side: :func:`join` registers the member on the lease it was given, waits for the
epoch with the whole world and returns a :class:`Communicator` over a TCP transport.
Workers speak to the driver with one JSON object per stdout line; the driver answers
on stdin ("go"-style lines), so driver and workers proceed in lockstep without sleeps.

Failure behaviour: a worker that dies or prints something that is not JSON makes the
driver raise :class:`BenchError` with the worker's stderr tail; a worker whose stdin
closes (driver gone) exits. A SIGTERM to the driver ends it like Ctrl-C: every process the
cluster started (members, coordinator, etcd) is stopped on the way out.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

from resilient.launcher.lease_reaper import LeaseReaper
from resilient.process_pool import DEVNULL, PIPE, Child, ProcessPool, Spec

ROOT = Path(__file__).resolve().parents[1]


class BenchError(RuntimeError):
    """A benchmark could not run (a member died unexpectedly, a timeout)."""


def parse_size(text: str) -> int:
    """``64K`` / ``1M`` / ``16M`` / ``1G`` / ``4096`` -> bytes (binary multiples)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise SystemExit(f"bad size {text!r}: use bytes or a K/M/G suffix, e.g. 64K,1M,16M") from None


def busbw(size_bytes: int, seconds: float, n: int) -> float:
    """Allreduce bus bandwidth in bytes/s, NCCL tests' definition: 2(n-1)/n * size / time."""
    return 2 * (n - 1) / n * size_bytes / seconds


def median(xs: list[float]) -> float:
    return statistics.median(xs)


class BenchCluster:
    """etcd + coordinator + ``world`` worker processes of ``script --worker``. A subclass
    may place etcd (:attr:`etcd_host`) and each member (:meth:`member_prefix`, e.g. ``ip
    netns exec``; :meth:`member_args`) elsewhere; :attr:`ready` holds every member's
    ``ready`` message."""

    etcd_host = "127.0.0.1"
    join_debounce_ms = 100
    ready_timeout = 120.0
    #: extra ``resilient coordinator`` arguments (e.g. ``--no-measure-links``)
    coordinator_args: list[str] = []

    def __init__(self, script: str, world: int, job: str = "bench", ttl: float = 30.0,
                 worker_args: list[str] | None = None, env_for: Callable[[str], dict[str, str]] | None = None) -> None:
        self.script, self.world, self.job, self.ttl = script, world, job, ttl
        self.worker_args = worker_args or []
        self.env_for = env_for or (lambda mid: {})
        self.procs: dict[str, subprocess.Popen[str]] = {}   # member -> its process (as subprocess sees it)
        self.ready: dict[str, dict[str, Any]] = {}
        self._children: dict[str, Child] = {}
        self.leases: dict[str, int] = {}
        self.exit_at: dict[str, float] = {}
        self._tmp = tempfile.TemporaryDirectory(prefix="resilient-bench-")
        self._etcd = None
        self._pool = ProcessPool()
        self._coord: Child | None = None
        self._reaper: LeaseReaper | None = None
        self._old_term: Any = None

    # -- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> "BenchCluster":
        from resilient.coordinator import LocalEtcd

        # SIGTERM ends the run like Ctrl-C, so that __exit__ stops every process started
        # here (by default Python dies at once and leaves the coordinator running)
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._old_term = signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            self._etcd = LocalEtcd(host=self.etcd_host).start()
            self.store = self._etcd.access.open_store(self._etcd.endpoints)
            self._reaper = LeaseReaper(self.job, store=self.store)
            self._coord = self._pool.start(Spec(
                [sys.executable, "-c", "import sys; from resilient.cli import main; sys.exit(main())",
                 "coordinator", "--etcd", self._etcd.endpoint_arg, "--job", self.job, "--ttl", str(self.ttl),
                 "--metrics-port", "-1", "--log-level", "WARNING", "--join-debounce-ms", str(self.join_debounce_ms),
                 *self.coordinator_args],
                stdout=DEVNULL, stderr=self._path("coordinator.stderr"), cwd=ROOT,
                env={**os.environ, **self._etcd.access.child_env()}, name="coordinator"))
            for i in range(self.world):
                self._spawn(f"m{i}")
            self.ready = {mid: self.expect(mid, "ready", timeout=self.ready_timeout) for mid in self.procs}
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _path(self, name: str) -> Path:
        return Path(self._tmp.name) / name

    def _spawn(self, mid: str) -> None:
        lease = self.store.grant(self.ttl)
        self.leases[mid] = lease
        env = dict(os.environ, PYTHONPATH=str(ROOT), **self._etcd.access.child_env(), **self.env_for(mid))
        if "RESILIENT_FAILPOINTS" not in self.env_for(mid):
            env.pop("RESILIENT_FAILPOINTS", None)
        cmd = [*self.member_prefix(mid), sys.executable, self.script, "--worker", "--etcd", self._etcd.endpoint_arg,
               "--job", self.job, "--id", mid, "--lease-id", str(lease), "--world", str(self.world),
               *self.member_args(mid)]
        child = self._pool.start(Spec(cmd, stdin=PIPE, stdout=PIPE, stderr=self._path(f"{mid}.stderr"),
                                      cwd=ROOT, env=env, name=mid))
        self._children[mid], self.procs[mid] = child, child.popen

    def member_prefix(self, mid: str) -> list[str]:
        """What member ``mid``'s command line starts with (nothing: this host)."""
        return []

    def member_args(self, mid: str) -> list[str]:
        """Member ``mid``'s extra arguments (``worker_args``)."""
        return self.worker_args

    def watch_exit(self, mid: str, on_exit: Callable[[str, float], None] | None = None) -> None:
        """Like the node agent: when ``mid``'s process exits, record the wall time and
        revoke its lease at once (then call ``on_exit(mid, t_exit)``)."""
        def record(child: Child) -> None:
            t = child.exit_time
            assert t is not None   # set when the child was reaped
            self.exit_at[mid] = t
            if on_exit is not None:
                on_exit(mid, t)

        assert self._reaper is not None   # made on __enter__
        self._reaper.watch(self._children[mid], mid, self.leases[mid], then=record)

    def close(self) -> None:
        """Members: stdin closed (they leave), SIGKILL (their group) 10 s later; then the
        coordinator (SIGTERM, SIGKILL 10 s later) and etcd."""
        members = list(self._children.values())
        for c in members:
            if c.alive() and c.stdin is not None:
                try:
                    c.stdin.close()
                except OSError:
                    pass
        self._pool.stop(grace=10, sig=None, children=members)
        self._pool.stop(grace=10)
        if self._reaper is not None:
            self._reaper.close()
        if self._etcd is not None:
            self._etcd.stop()
            self._etcd = None
        self._tmp.cleanup()
        if self._old_term is not None:   # the SIGTERM handling __enter__ installed
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    # -- talking to workers -------------------------------------------------------------

    def stderr_tail(self, mid: str, n: int = 3000) -> str:
        try:
            return (Path(self._tmp.name) / f"{mid}.stderr").read_text()[-n:]
        except OSError:
            return ""

    def send(self, mids: list[str], line: str) -> None:
        for mid in mids:
            stdin = self.procs[mid].stdin
            assert stdin is not None   # members are started with a stdin pipe
            stdin.write(line + "\n")
            stdin.flush()

    def expect(self, mid: str, event: str, timeout: float = 300) -> dict[str, Any]:
        """The next JSON line of ``mid`` (must carry ``"event": event``)."""
        p = self._children[mid]
        stdout = p.stdout
        assert stdout is not None   # members are started with a stdout pipe
        result: list[str] = []
        th = threading.Thread(target=lambda: result.append(stdout.readline()), daemon=True)
        th.start()
        th.join(timeout)
        if not result or not result[0]:
            raise BenchError(f"member {mid} sent no {event!r} within {timeout}s (exit code {p.returncode}): "
                             f"{self.stderr_tail(mid)}")
        try:
            msg = json.loads(result[0])
        except ValueError:
            raise BenchError(f"member {mid} printed {result[0]!r} instead of a JSON line: {self.stderr_tail(mid)}") from None
        if msg.get("event") != event:
            raise BenchError(f"member {mid} sent {msg} where {event!r} was expected: {self.stderr_tail(mid)}")
        return msg

    def expect_all(self, mids: list[str], event: str, timeout: float = 300) -> dict[str, dict[str, Any]]:
        return {m: self.expect(m, event, timeout) for m in mids}


# -- worker side ------------------------------------------------------------------------

def worker_argparser(description: str):
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--etcd", help=argparse.SUPPRESS)
    ap.add_argument("--job", default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--id", help=argparse.SUPPRESS)
    ap.add_argument("--lease-id", type=int, help=argparse.SUPPRESS)
    return ap


def rank_worker_argparser(description: str):
    """The parser of a benchmark whose driver starts copies of its own script by rank
    (``--worker --rank N --etcd ... --job ...``; hidden from ``--help``)."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--etcd", default="", help=argparse.SUPPRESS)
    ap.add_argument("--job", default="", help=argparse.SUPPRESS)
    return ap


def join(args: Any, **comm_kwargs: Any) -> tuple[Any, Any, Any, int]:
    """Worker: register on the driver's lease, wait for the full world; (comm, transport,
    session, index). ``comm.close()`` also closes the transport, the session and the store."""
    import resilient

    # RESILIENT_ETCD_* TLS/credentials and RESILIENT_TRANSPORT from the environment
    comm = resilient.connect(args.etcd, args.job, args.id, world=args.world, timeout=120, lease_id=args.lease_id,
                             **comm_kwargs)
    return comm, comm.transport, comm.session, int(args.id.lstrip("m"))


def emit(event: str, **fields: Any) -> None:
    """Worker: one JSON line to the driver."""
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def wait_go() -> str:
    """Worker: block until the driver writes a line (EOF: the driver is gone -> exit)."""
    line = sys.stdin.readline()
    if not line:
        os._exit(0)
    return line.strip()
