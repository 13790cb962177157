"""Helpers of the torch backend's multi-process tests (tests/test_torch_*.py)."""
from __future__ import annotations

import subprocess


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
