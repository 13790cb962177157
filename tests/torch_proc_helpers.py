"""Helpers of the torch backend's multi-process tests (tests/test_torch_*.py)."""
from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path


def revoke_lease_on_exit(p: subprocess.Popen, etcd: str, job: str) -> None:
    """Read ``p``'s stdout for its ``LEASE <member> <lease>`` line and revoke that lease the
    moment ``p`` exits (what resilient-run's agent does), so the coordinator removes the
    member at once. Best effort: if the revoke fails, the lease TTL removes it."""
    lease = None
    assert p.stdout is not None
    for line in p.stdout:
        if line.startswith("LEASE "):
            lease = line.split()[1:]
    p.wait()
    if lease:
        from resilient.coordinator import Store
        from resilient.coordinator.membership import revoke_member

        st = Store(etcd)
        try:
            revoke_member(st, job, lease[0], int(lease[1]), reason=f"exited {p.returncode}")
        except Exception:  # noqa: BLE001 - the TTL removes it anyway
            pass
        finally:
            st.close()


def wait_then_kill(procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait for every process (``timeout`` s each, TimeoutExpired propagates); SIGKILL and
    reap whichever of them is still running on the way out."""
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def worker_env(root: Path, etcd: str, job: str) -> dict[str, str]:
    """The environment of a worker started as mp.spawn would (``init_process_group(rank=,
    world_size=)``, no resilient-run): this checkout on the path, the job's etcd, a 2 s
    lease, and none of the launcher's or the failpoints' variables."""
    env = dict(os.environ, PYTHONPATH=f"{root}:{root / 'tests'}", RESILIENT_ETCD=etcd, RESILIENT_JOB=job,
               RESILIENT_LEASE_TTL="2", OMP_NUM_THREADS="1")
    for k in ("RESILIENT_MEMBER_ID", "RESILIENT_FAILPOINTS", "RANK", "WORLD_SIZE", "RESILIENT_JOINER", "RESTARTED"):
        env.pop(k, None)
    return env


def start_worker(argv: list[str], err: Path, env: dict[str, str], cwd: Path, etcd: str, job: str) -> subprocess.Popen:
    """Start ``argv`` (stdout piped for its LEASE line, stderr to ``err``) and revoke its
    lease the moment it exits (:func:`revoke_lease_on_exit`, on a daemon thread)."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(err, "w"),  # noqa: SIM115
                         text=True, env=env, cwd=cwd)
    threading.Thread(target=revoke_lease_on_exit, args=(p, etcd, job), daemon=True).start()
    return p


def err_logs(d: Path, tail: int = 3000) -> str:
    """The tails of every ``*.err`` file under ``d`` (a failing test's message)."""
    return "\n".join(f"--- {f.name}\n{f.read_text()[-tail:]}" for f in sorted(d.glob("*.err")))


def wait_files(d: Path, names: list[str], procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait until every file ``names`` exists under ``d``; AssertionError when one of
    ``procs`` exits first or after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not all((d / n).exists() for n in names):
        assert all(p.poll() is None for p in procs), f"a worker exited before {names} were written:\n{err_logs(d)}"
        assert time.monotonic() < deadline, f"{names} not all written within {timeout}s:\n{err_logs(d)}"
        time.sleep(0.02)
