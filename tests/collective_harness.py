"""Runs N collective_worker processes against a real etcd + coordinator (helpers for the
multi-process tests; every process started here is a ProcessPool child, ended here by PID)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from resilient.launcher.lease_reaper import LeaseReaper
from resilient.process_pool import DEVNULL, PIPE, STDOUT, ProcessPool, Spec

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "collective_worker.py"
PY = sys.executable


@contextmanager
def coordinator(etcd_endpoint: str, job: str, ttl: float = 2.0) -> Iterator[subprocess.Popen[str]]:
    """A ``resilient coordinator`` process for ``job``, up when this yields; stopped on exit."""
    with ProcessPool() as pool:
        proc = pool.start(Spec([PY, "-c", "import sys; from resilient.cli import main; sys.exit(main())",
                                "coordinator", "--etcd", etcd_endpoint, "--job", job, "--ttl", str(ttl),
                                "--metrics-port", "-1", "--log-level", "WARNING"],
                               stdout=PIPE, stderr=STDOUT, cwd=ROOT, name=f"coordinator-{job}"))
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("coordinator"), f"coordinator did not start: {line}"
        yield proc.popen


class Workers:
    """``world`` workers ``m0..m{world-1}``; :meth:`start` adds more (joiners).

    Fast detection, as the node agent does it: a :class:`LeaseReaper` reads the lease id
    each worker prints and, the moment the process exits with a failure, revokes that
    lease, so a SIGKILL costs milliseconds instead of the TTL. A SIGSTOPped worker does
    not exit: it is found by lease expiry."""

    def __init__(self, etcd_endpoint: str, job: str, world: int, ops: list, out: Path, seed: int = 0,
                 failpoints: dict[str, str] | None = None, ttl: float = 2.0, policy: str = "default",
                 revoke_on_exit: bool = True, hosts: dict[str, str] | None = None,
                 env: dict[str, str] | None = None, member_env: dict[str, dict[str, str]] | None = None) -> None:
        self.out, self.world, self.ops, self.seed = out, world, ops, seed
        self.env = env or {}       # extra environment of every worker (e.g. RESILIENT_STAGING)
        self.member_env = member_env or {}   # member -> extra environment of that worker only
        self.hosts = hosts or {}   # member -> emulated host label (RESILIENT_TEST_HOST)
        self.etcd, self.job, self.ttl, self.policy = etcd_endpoint, job, ttl, policy
        self.failpoints = failpoints or {}
        self.revoke_on_exit = revoke_on_exit
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.pool = ProcessPool()
        self.reaper = LeaseReaper(job, endpoints=etcd_endpoint)
        for i in range(world):
            self.start(f"m{i}")

    def start(self, mid: str, world: int | None = None, join: bool = False) -> subprocess.Popen[str]:
        env = dict(os.environ, PYTHONPATH=str(ROOT), **{**self.env, **self.member_env.get(mid, {})})
        env.pop("RESILIENT_FAILPOINTS", None)
        if mid in self.failpoints:
            env["RESILIENT_FAILPOINTS"] = self.failpoints[mid]
        env.pop("RESILIENT_TEST_HOST", None)
        if mid in self.hosts:
            env["RESILIENT_TEST_HOST"] = self.hosts[mid]
        cmd = [PY, str(WORKER), "--etcd", self.etcd, "--job", self.job, "--id", mid,
               "--world", str(world or self.world), "--out", str(self.out), "--ops", json.dumps(self.ops),
               "--seed", str(self.seed), "--ttl", str(self.ttl), "--policy", self.policy]
        if join:
            cmd.append("--join")
        (self.out / f"{mid}.stderr").unlink(missing_ok=True)
        child = self.pool.start(Spec(cmd, env=env, stdin=PIPE, stdout=PIPE if self.revoke_on_exit else DEVNULL,
                                     stderr=self.out / f"{mid}.stderr", cwd=ROOT, new_session=False, name=mid))
        self.procs[mid] = child.popen
        if self.revoke_on_exit:
            self.reaper.watch(child, mid, failures_only=True)
        return child.popen

    def records(self, mid: str) -> list[dict]:
        p = self.out / f"{mid}.jsonl"
        if not p.exists():
            return []
        return [json.loads(l) for l in p.read_text().splitlines() if l.strip()]

    def wait_done(self, mids: list[str], timeout: float) -> None:
        """Wait until each of ``mids`` wrote a record for every op (or exited)."""
        deadline = time.monotonic() + timeout
        while True:
            pending = [m for m in mids if self._last_seq(m) < len(self.ops) - 1 and self.procs[m].poll() is None]
            if not pending:
                return
            if time.monotonic() > deadline:
                tails = {m: (self.out / f"{m}.stderr").read_text()[-3000:] for m in pending}
                raise AssertionError(f"workers {pending} did not finish within {timeout}s: {tails}")
            time.sleep(0.05)

    def _last_seq(self, mid: str) -> int:
        recs = self.records(mid)
        return recs[-1]["seq"] if recs else -1

    def output(self, mid: str, seq: int) -> np.ndarray:
        return np.load(self.out / f"{mid}.{seq}.npy", allow_pickle=False)

    def close(self) -> None:
        """Tell every live worker to go (stdin EOF), give them 10 s, then end stragglers by
        PID (SIGKILL); reap them all."""
        for c in self.pool.running():
            if c.stdin is not None:
                try:
                    c.stdin.close()
                except OSError:
                    pass
        self.pool.stop(grace=10, sig=None)
        self.reaper.close()
