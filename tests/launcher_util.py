"""Helpers for the launcher tests: run resilient-run as a real process, wait on files."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable

from resilient.process_pool import STDOUT, ProcessPool, Spec, pid_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
RESILIENT_RUN = os.path.join(os.path.dirname(sys.executable), "resilient-run")


def wait_for(cond: Callable[[], object], timeout: float, what: str, interval: float = 0.02) -> object:
    """Poll ``cond`` until it returns something truthy; fail the test naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def read_dump(dump_dir: str, local_rank: int, restart: int) -> dict | None:
    path = os.path.join(dump_dir, f"{local_rank}.{restart}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def private_tmpdir() -> str:
    """A short TMPDIR of its own for one resilient-run (the agent's unix socket goes in it),
    for the caller to remove: a SIGKILLed agent cannot remove its run directory itself."""
    return tempfile.mkdtemp(prefix="rrun-", dir="/tmp")


def alive(pid: int) -> bool:
    """A process with this pid exists and is not a zombie."""
    return pid_state(pid) not in (None, "Z", "X")


class Launcher:
    """``resilient-run`` in its own process group (a :class:`ProcessPool` child);
    :meth:`close` ends it and its workers by PID."""

    def __init__(self, args: list[str], dump_dir: str, extra_env: dict[str, str] | None = None) -> None:
        os.makedirs(dump_dir, exist_ok=True)
        self.dump_dir = dump_dir
        env = dict(os.environ, DUMP_DIR=dump_dir, PYTHONPATH=ROOT, RESILIENT_LOG_LEVEL="INFO")
        # a TMPDIR of its own (short: the agent's unix socket goes in it), removed by close():
        # a SIGKILLed agent cannot remove its run directory itself
        self._tmp: str | None = None
        if "TMPDIR" not in (extra_env or {}):
            self._tmp = env["TMPDIR"] = private_tmpdir()
        env.update(extra_env or {})
        self.log_path = os.path.join(dump_dir, "agent.log")
        self._log = open(self.log_path, "w")
        self._pool = ProcessPool()
        self.proc = self._pool.start(Spec([RESILIENT_RUN, *args], env=env, stdout=self._log, stderr=STDOUT)).popen
        self.worker_pids: set[int] = set()

    def dump(self, local_rank: int, restart: int = 0, timeout: float = 60) -> dict:
        d = wait_for(lambda: read_dump(self.dump_dir, local_rank, restart), timeout,
                     f"local rank {local_rank} (restart {restart}) to start; agent log:\n{self.output()}")
        self.worker_pids.add(int(d["PID"]))
        return d

    def output(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"resilient-run did not exit within {timeout}s:\n{self.output()}") from None

    def close(self) -> None:
        self._pool.stop(grace=0, sig=signal.SIGKILL)
        for pid in self.worker_pids:   # the agent's children, in sessions of their own
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self._log.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
