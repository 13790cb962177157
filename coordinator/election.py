"""Lease-backed leader election for coordinators: the ``leader`` key.

A candidate grants a lease of ``ttl`` seconds and creates ``leader`` on it (a
create-if-absent transaction); whoever succeeds leads until its lease is gone. Standbys
watch the key and try again the moment it is deleted (resignation, revocation, or lease
expiry after the leader was killed or hung — so takeover takes about one ``ttl``).

Leadership is *proved* to etcd, not assumed: :attr:`LeaderElection.leader_revision` is the
``create_revision`` of our ``leader`` key, and every epoch publication compares it in the
same transaction, so a deposed leader (paused, partitioned, lease expired) can never
publish even if it still believes it leads.

Failure behaviour: while etcd is unreachable a leader keeps trying to refresh its lease
and does not step down on its own (etcd extends leases when it comes back; and it cannot
publish meanwhile anyway). When etcd answers that the lease is gone, :attr:`lost` is set.
"""
from __future__ import annotations

import logging
import threading
import time

from resilient.coordinator import keys
from resilient.coordinator.membership import KEEPALIVE_FRACTION
from resilient.coordinator.store import Compare, Store
from resilient.errors import LeaseExpired, StoreError, StoreUnavailable

log = logging.getLogger(__name__)


def current_leader(store: Store, job: str) -> str | None:
    """The id of the current leader, or None (also for a value that is not a valid id:
    skipped, logged and counted as a bad ``leader`` record)."""
    from resilient.coordinator import records
    from resilient.errors import RecordError

    kv = store.get(keys.leader(job))
    if kv is None:
        return None
    value = kv.value.decode("utf-8", "replace")
    if not records.is_id(value):
        records.skip(RecordError(f"bad leader record at {kv.key}: {value[:80]!r} is not a valid coordinator id",
                                 "leader", kv.key))
        return None
    return value


class LeaderElection:
    """One candidate. ``campaign(stop)`` blocks until it leads (True) or ``stop`` is set
    (False); then ``lost`` is set if leadership ends; ``resign()`` hands it over at once."""

    def __init__(self, store: Store, job: str, candidate_id: str, ttl: float = 5.0) -> None:
        self.store = store
        self.job = job
        self.candidate_id = keys.check_name("coordinator id", candidate_id)
        self.ttl = ttl
        self.key = keys.leader(job)
        self.lease_id: int | None = None
        self.leader_revision = 0
        self.lost = threading.Event()
        #: monotonic time of the last successful etcd call of this candidate (for /healthz)
        self.last_contact = 0.0
        self._stop_keepalive = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def is_leader(self) -> bool:
        return self.leader_revision != 0 and not self.lost.is_set()

    def leader_compare(self) -> Compare:
        """The comparison that holds only while we lead (for publishing transactions)."""
        return Compare(self.key, "create", "==", self.leader_revision)

    def campaign(self, stop: threading.Event) -> bool:
        changed = threading.Event()
        while not stop.is_set():
            try:
                if self.lease_id is None or self.store.lease_ttl(self.lease_id) is None:
                    self.lease_id = self.store.grant(self.ttl)
                if self.store.create(self.key, self.candidate_id.encode(), lease=self.lease_id):
                    kv = self.store.get(self.key)
                    if kv is not None and kv.lease == self.lease_id:
                        self._become_leader(kv.create_revision, kv.lease)
                        return True
                    continue
                kv = self.store.get(self.key)
                self.last_contact = time.monotonic()
                if kv is None:
                    continue
                changed.clear()
                watch = self.store.watch_key(
                    self.key, kv.mod_revision + 1,
                    lambda evs: changed.set() if any(e.type == "delete" for e in evs) else None,
                )
                try:
                    # Poll too, in case the watch is reconnecting when the key goes.
                    while not stop.is_set() and not changed.wait(max(0.1, self.ttl / 2)):
                        if self.store.get(self.key) is None:
                            break
                        self.last_contact = time.monotonic()
                finally:
                    watch.cancel()
            except LeaseExpired:
                self.lease_id = None
            except StoreUnavailable as exc:
                log.warning("election: etcd unreachable, retrying: %s", exc)
                stop.wait(0.5)
        return False

    def _become_leader(self, revision: int, lease: int) -> None:
        """We hold the leader key (created at ``revision``) on ``lease``: keep it alive."""
        self.leader_revision = revision
        self.lost.clear()
        self._stop_keepalive.clear()
        self._thread = threading.Thread(target=self._keepalive, args=(lease,), name="leader-keepalive",
                                        daemon=True)
        self._thread.start()
        log.info("coordinator %s leads job %s (revision %d)", self.candidate_id, self.job, revision)

    def _keepalive(self, lease: int) -> None:
        interval = max(0.1, self.ttl * KEEPALIVE_FRACTION)
        while not self._stop_keepalive.wait(interval):
            try:
                self.store.keepalive(lease, budget=interval)
            except LeaseExpired:
                log.warning("coordinator %s: leader lease gone; stepping down", self.candidate_id)
                self.lease_id = None
                self.lost.set()
                return
            except StoreError as exc:
                log.warning("coordinator %s: leader keep-alive failed, retrying: %s", self.candidate_id, exc)

    def step_down(self) -> None:
        """Forget leadership locally (after ``lost`` or a failed leader check)."""
        self._stop_keepalive.set()
        self.lost.set()
        self.leader_revision = 0

    def resign(self) -> None:
        """Stop leading (or campaigning) and revoke the lease so a standby takes over now.
        Never raises for an unreachable etcd (the lease then expires after ``ttl``)."""
        self._stop_keepalive.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self.lease_id is not None:
            try:
                self.store.revoke(self.lease_id)
            except StoreError as exc:
                log.warning("resign: could not revoke the leader lease: %s", exc)
        self.lease_id = None
        self.leader_revision = 0
        self.lost.set()
