"""Helpers of the torch backend's multi-process tests (tests/test_torch_*.py)."""
from __future__ import annotations

import os
import signal
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
