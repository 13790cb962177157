"""Runs N collective_worker processes against a real etcd + coordinator (helpers for the
multi-process tests; every process started here is ended here, by PID)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "collective_worker.py"
PY = sys.executable


@contextmanager
def coordinator(etcd_endpoint: str, job: str, ttl: float = 2.0):
    proc = subprocess.Popen([PY, "-c", "import sys; from resilient.cli import main; sys.exit(main())", "coordinator", "--etcd", etcd_endpoint, "--job", job,
                             "--ttl", str(ttl), "--metrics-port", "-1", "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("coordinator"), f"coordinator did not start: {line}"
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Workers:
    """``world`` workers ``m0..m{world-1}``; :meth:`start` adds more (joiners).

    Fast detection, as the node agent does it: a thread per worker reads the lease id the
    worker prints and, the moment the process exits, revokes that lease
    (``resilient.coordinator.membership.revoke_member``), so a SIGKILL costs milliseconds
    instead of the TTL. A SIGSTOPped worker does not exit: it is found by lease expiry."""

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
        self.procs: dict[str, subprocess.Popen] = {}
        self.exited_at: dict[str, float] = {}
        self._threads: list[threading.Thread] = []
        self._store = None
        for i in range(world):
            self.start(f"m{i}")

    def start(self, mid: str, world: int | None = None, join: bool = False) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=str(ROOT), **self.env, **self.member_env.get(mid, {}))
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
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=open(self.out / f"{mid}.stderr", "w"), cwd=ROOT, env=env, text=True)
        self.procs[mid] = proc
        t = threading.Thread(target=self._watch, args=(mid, proc), daemon=True, name=f"watch:{mid}")
        t.start()
        self._threads.append(t)
        return proc

    def _watch(self, mid: str, proc: subprocess.Popen) -> None:
        """Read the worker's stdout; when it exits, revoke its lease at once."""
        lease = None
        for line in proc.stdout:
            if line.startswith("LEASE "):
                lease = int(line.split()[2])
        rc = proc.wait()
        self.exited_at[mid] = time.monotonic()
        if lease is None or not self.revoke_on_exit or rc == 0:
            return
        from resilient.coordinator import Store
        from resilient.coordinator.membership import revoke_member

        try:
            if self._store is None:
                self._store = Store(self.etcd)
            revoke_member(self._store, self.job, mid, lease, reason=f"exited with {rc}")
        except Exception:  # noqa: BLE001 - the TTL path still removes it
            pass

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
        """Tell every live worker to go (stdin EOF), then end stragglers by PID."""
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
        for t in self._threads:
            t.join(5)
        if self._store is not None:
            try:
                self._store.close()
            except Exception:  # noqa: BLE001
                pass
