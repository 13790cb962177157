"""Helpers for the control-plane tests: real member and coordinator processes, waits on
conditions with deadlines, and clean-up by PID."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from typing import Callable, TypeVar

from resilient.process_pool import PIPE, ProcessPool, Spec

T = TypeVar("T")
PY = sys.executable


def wait_until(pred: Callable[[], T], timeout: float, what: str, interval: float = 0.02) -> T:
    """Poll ``pred`` until it returns something truthy; AssertionError naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class Proc:
    """A child process (a :class:`ProcessPool` child of its own) whose stdout and stderr
    lines are collected by threads."""

    def __init__(self, args: list[str], env: dict | None = None) -> None:
        self.args = args
        self._pool = ProcessPool()
        self.child = self._pool.start(Spec(args, env={**os.environ, **(env or {})}, stdout=PIPE, stderr=PIPE))
        self.popen, self.pid = self.child.popen, self.child.pid
        self.lines: list[str] = []
        self.err: list[str] = []
        self._t = threading.Thread(target=self._pump, args=(self.child.stdout, self.lines), daemon=True)
        self._e = threading.Thread(target=self._pump, args=(self.child.stderr, self.err), daemon=True)
        self._t.start()
        self._e.start()

    @staticmethod
    def _pump(stream, sink: list[str]) -> None:
        for line in stream:
            sink.append(line.rstrip("\n"))

    def wait_line(self, pattern: str, timeout: float) -> re.Match:
        rx = re.compile(pattern)

        def find():
            for line in list(self.lines):
                m = rx.search(line)
                if m:
                    return m
            if self.popen.poll() is not None:
                raise AssertionError(f"{self.args} exited {self.popen.returncode}; stderr:\n" + "\n".join(self.err[-30:]))
            return None

        return wait_until(find, timeout, f"{pattern!r} from {self.args[:4]}")

    def signal(self, sig: int) -> None:
        self._pool.signal(self.child, sig)

    def stop(self, timeout: float = 10) -> int:
        """SIGTERM (+ SIGCONT, in case it is stopped), then SIGKILL after ``timeout``; reaps it."""
        (rc,) = self._pool.stop(grace=timeout)
        self._t.join(timeout=2)
        self._e.join(timeout=2)
        return rc


def member_proc(endpoints: str, job: str, member_id: str, ttl: float = 2.0, **kw) -> Proc:
    args = [PY, "-m", "resilient.coordinator.member_process", "--etcd", endpoints, "--job", job,
            "--id", member_id, "--ttl", str(ttl)]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return Proc(args)


def coordinator_proc(endpoints: str, job: str, cid: str, ttl: float = 2.0, *extra: str) -> Proc:
    return Proc([PY, "-c", "import sys; from resilient.cli import main; sys.exit(main())", "coordinator",
                 "--etcd", endpoints, "--job", job, "--id", cid, "--ttl", str(ttl), "--metrics-host", "127.0.0.1",
                 "--metrics-port", "0", *extra])


def resilient_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-c", "import sys; from resilient.cli import main; sys.exit(main())", *args],
                          capture_output=True, text=True, timeout=timeout)


class CoordinatorThread:
    """An in-process :class:`Coordinator` on its own thread (with a Store of its own)."""

    def __init__(self, endpoints, job: str, cid: str = "c-test", **config) -> None:
        from resilient.coordinator import Coordinator, CoordinatorConfig, Store

        self.store = Store(endpoints)
        self.coordinator = Coordinator(self.store, job, cid, CoordinatorConfig(**config))
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.coordinator.run, args=(self.stop_event,), daemon=True)
        self.thread.start()

    def wait_reconciles(self, n: int, timeout: float = 10) -> None:
        """Wait until ``n`` more reconcile passes have completed."""
        target = self.coordinator.reconciles + n
        wait_until(lambda: self.coordinator.reconciles >= target, timeout, f"{n} reconcile passes")

    def close(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=15)
        self.store.close()
