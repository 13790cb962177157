"""Helpers of the torch backend's multi-process tests (tests/test_torch_*.py)."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Mapping, Sequence

from resilient.launcher.lease_reaper import LeaseReaper
from resilient.process_pool import PIPE, Child, ProcessPool, Spec


class RankProcs:
    """Rank processes of one job, each followed by a :class:`LeaseReaper` (what
    resilient-run's agent does): the ``LEASE <member> <lease>`` line a rank prints names
    the lease revoked the moment it exits, so the coordinator removes the member at once
    (best effort: if the revoke fails, the lease TTL removes it). Leaving the ``with``
    block SIGKILLs and reaps whichever rank still runs."""

    def __init__(self, etcd: str, job: str) -> None:
        self.pool = ProcessPool()
        self.reaper = LeaseReaper(job, endpoints=etcd)
        self.children: list[Child] = []

    def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: str | os.PathLike[str],
              stderr: str | os.PathLike[str]) -> Child:
        """Start one rank (stderr to the file ``stderr``, written afresh)."""
        if os.path.exists(stderr):
            os.unlink(stderr)
        child = self.pool.start(Spec(argv, env=env, cwd=cwd, stdout=PIPE, stderr=stderr, new_session=False))
        self.reaper.watch(child)
        self.children.append(child)
        return child

    def wait(self, timeout: float) -> list[int]:
        """Every rank's exit code (``ResilientTimeout`` if one still runs after ``timeout`` s)."""
        return self.pool.wait(timeout)

    def __enter__(self) -> RankProcs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.stop(grace=0, sig=signal.SIGKILL)
        self.reaper.close(10)


def worker_env(root: Path, etcd: str, job: str) -> dict[str, str]:
    """The environment of a worker started as mp.spawn would (``init_process_group(rank=,
    world_size=)``, no resilient-run): this checkout on the path, the job's etcd, a 2 s
    lease, and none of the launcher's or the failpoints' variables."""
    env = dict(os.environ, PYTHONPATH=f"{root}:{root / 'tests'}", RESILIENT_ETCD=etcd, RESILIENT_JOB=job,
               RESILIENT_LEASE_TTL="2", OMP_NUM_THREADS="1")
    for k in ("RESILIENT_MEMBER_ID", "RESILIENT_FAILPOINTS", "RANK", "WORLD_SIZE", "RESILIENT_JOINER", "RESTARTED"):
        env.pop(k, None)
    return env


def err_logs(d: Path, tail: int = 3000) -> str:
    """The tails of every ``*.err`` file under ``d`` (a failing test's message)."""
    return "\n".join(f"--- {f.name}\n{f.read_text()[-tail:]}" for f in sorted(d.glob("*.err")))


def wait_files(d: Path, names: list[str], procs: Sequence[Child], timeout: float) -> None:
    """Wait until every file ``names`` exists under ``d``; AssertionError when one of
    ``procs`` exits first or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not all((d / n).exists() for n in names):
        assert all(p.alive() for p in procs), f"a worker exited before {names} were written:\n{err_logs(d)}"
        assert time.monotonic() < deadline, f"{names} not all written within {timeout}s:\n{err_logs(d)}"
        time.sleep(0.02)
