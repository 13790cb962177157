"""Runs N collective_worker processes against a real etcd + coordinator (helpers for the
multi-process tests; every process started here is ended here, by PID)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
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
    def __init__(self, etcd_endpoint: str, job: str, world: int, ops: list, out: Path, seed: int = 0,
                 failpoints: dict[str, str] | None = None, ttl: float = 2.0, policy: str = "default") -> None:
        self.out, self.world, self.ops, self.seed = out, world, ops, seed
        self.procs: dict[str, subprocess.Popen] = {}
        for i in range(world):
            mid = f"m{i}"
            env = dict(os.environ, PYTHONPATH=str(ROOT))
            env.pop("RESILIENT_FAILPOINTS", None)
            if failpoints and mid in failpoints:
                env["RESILIENT_FAILPOINTS"] = failpoints[mid]
            self.procs[mid] = subprocess.Popen(
                [PY, str(WORKER), "--etcd", etcd_endpoint, "--job", job, "--id", mid, "--world", str(world),
                 "--out", str(out), "--ops", json.dumps(ops), "--seed", str(seed), "--ttl", str(ttl), "--policy", policy],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(out / f"{mid}.stderr", "w"), cwd=ROOT, env=env, text=True)

    def records(self, mid: str) -> list[dict]:
        p = self.out / f"{mid}.jsonl"
        if not p.exists():
            return []
        return [json.loads(l) for l in p.read_text().splitlines() if l.strip()]

    def wait_done(self, mids: list[str], timeout: float) -> None:
        """Wait until each of ``mids`` wrote a record for every op (or exited)."""
        deadline = time.monotonic() + timeout
        while True:
            pending = [m for m in mids if len(self.records(m)) < len(self.ops) and self.procs[m].poll() is None]
            if not pending:
                return
            if time.monotonic() > deadline:
                tails = {m: (self.out / f"{m}.stderr").read_text()[-3000:] for m in pending}
                raise AssertionError(f"workers {pending} did not finish within {timeout}s: {tails}")
            time.sleep(0.05)

    def output(self, mid: str, seq: int) -> np.ndarray:
        return np.load(self.out / f"{mid}.{seq}.npy", allow_pickle=False)

    def close(self) -> None:
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
