"""Revoke a member's lease the moment its process exits: the node agent's fast detection
path (``departed/<member>`` + lease revoke, :func:`~resilient.coordinator.membership.revoke_member`)
for the drivers that start members without ``resilient-run`` — benchmarks and tests.

One responsibility: :meth:`LeaseReaper.watch` follows one child of a
:class:`~resilient.process_pool.ProcessPool`; when it has exited, the reaper revokes its
lease, so the coordinator removes the member in milliseconds instead of after the lease
TTL. The lease id is either known (the driver granted it) or read from the member's
stdout line ``LEASE <member> <lease id>`` (the member registered its own lease).

Failure behaviour: a revoke that fails (etcd unreachable, any store error) is logged and
ignored — the lease then expires after its TTL, the slow path, exactly as for the node
agent; a member that printed no ``LEASE`` line is not revoked. A member that hangs is not
found here (it does not exit): its lease expiry removes it.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable

from resilient.process_pool import Child, describe_exit

if TYPE_CHECKING:  # pragma: no cover - the etcd client is imported only when a revoke happens
    from resilient.coordinator.store import Store

log = logging.getLogger(__name__)


def parse_lease_line(line: str) -> tuple[str, int] | None:
    """``"LEASE m1 7587"`` -> ``("m1", 7587)``; ``None`` for any other line."""
    parts = line.split()
    if len(parts) != 3 or parts[0] != "LEASE":
        return None
    try:
        return parts[1], int(parts[2])
    except ValueError:
        return None


class LeaseReaper:
    """Revokes the leases of members of ``job`` as their processes exit. ``store`` is
    used as given (not closed here); without one, a :class:`Store` over ``endpoints`` is
    opened at the first revoke and closed by :meth:`close`."""

    def __init__(self, job: str, store: Store | None = None, endpoints: str | None = None) -> None:
        if store is None and endpoints is None:
            raise ValueError("LeaseReaper needs a store or etcd endpoints")
        self.job, self._store, self._endpoints = job, store, endpoints
        self._own_store: Store | None = None
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def watch(self, child: Child, member: str | None = None, lease: int | None = None,
              failures_only: bool = False, lines: list[str] | None = None,
              then: Callable[[Child], None] | None = None) -> threading.Thread:
        """Follow ``child`` in a daemon thread: if ``lease`` is not given, read its stdout to
        the end for its ``LEASE`` line (other lines go to ``lines`` when given); once it has
        exited, revoke the lease (with ``failures_only``: only after a non-zero exit code or
        a signal), then call ``then(child)``."""
        t = threading.Thread(target=self._follow, args=(child, member, lease, failures_only, lines, then),
                             name=f"reaper:{member or child.name}", daemon=True)
        self._threads.append(t)
        t.start()
        return t

    def _follow(self, child: Child, member: str | None, lease: int | None, failures_only: bool,
                lines: list[str] | None, then: Callable[[Child], None] | None) -> None:
        if lease is None and child.stdout is not None:
            named = member
            for line in child.stdout:   # the last LEASE line counts (a member may register again)
                found = parse_lease_line(line)
                if found is not None:
                    member, lease = named or found[0], found[1]
                elif lines is not None:
                    lines.append(line)
        child.pool.wait(children=[child])
        rc = child.returncode
        if rc is not None and member is not None and lease is not None and not (failures_only and rc == 0):
            self.revoke(member, lease, describe_exit(rc))
        if then is not None:
            then(child)

    def revoke(self, member: str, lease: int, reason: str) -> bool:
        """``departed/<member>`` + revoke ``lease`` now; ``False`` (logged) if that failed."""
        from resilient.coordinator.membership import revoke_member

        try:
            revoke_member(self._store_now(), self.job, member, lease, reason=reason)
            return True
        except Exception as exc:  # noqa: BLE001 - the lease expires after its TTL instead
            log.warning("could not revoke lease %x of member %s (%s); it expires after its TTL", lease, member, exc)
            return False

    def _store_now(self) -> Store:
        if self._store is not None:
            return self._store
        with self._lock:
            if self._own_store is None:
                from resilient.coordinator.store import Store

                assert self._endpoints is not None  # checked in __init__
                self._own_store = Store(self._endpoints)
            return self._own_store

    def close(self, timeout: float = 5.0) -> None:
        """Wait up to ``timeout`` s for each watch to finish, then close the store opened here."""
        for t in self._threads:
            t.join(timeout)
        with self._lock:
            own, self._own_store = self._own_store, None
        if own is not None:
            try:
                own.close()
            except Exception:  # noqa: BLE001 - closing a client of a stopped etcd
                pass
