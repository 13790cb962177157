"""The node agent's one ``nodes/<node>`` record: its live ranks, on the node lease.

:class:`NodeMembers` holds the ranks that registered through the agent channel and
writes the node's :class:`~resilient.coordinator.directory.NodeRecord` on every change:
``add`` puts the record with the new rank; ``remove`` puts it without the rank **and**
``departed/<member id>`` (the cause the coordinator reports, detection path ``revoke``) in
one transaction — the siblings stay in the record, untouched. The node's ``labels`` are
the entries every rank shares (written once); a rank's own labels and host are written
only where they differ (docs/scale.md, "Node-level membership").

Failure behaviour: the store's errors propagate (:class:`~resilient.errors.StoreError`)
and the in-memory set is changed only after the write succeeded, so a failed ``remove``
can be retried and a failed ``add`` leaves the rank unregistered. Thread-safe (the agent
calls it from the channel's reader threads and its main loop).
"""
from __future__ import annotations

import json
import threading
import time

from resilient.coordinator import keys
from resilient.coordinator.directory import NodeRecord
from resilient.coordinator.membership import MemberInfo
from resilient.coordinator.store import Put, Store


class NodeMembers:
    """``add(info)``, ``remove(member_id, reason) -> bool``, ``ids()``,
    ``registered_here(member_id)``; ``writes``."""

    def __init__(self, store: Store, job: str, node: str, host: str, lease: int, ttl: float) -> None:
        self.store, self.job, self.node, self.host = store, job, keys.check_name("node id", node), host
        self.lease, self.ttl = lease, float(ttl)
        self._ranks: dict[str, MemberInfo] = {}
        self._seen: set[str] = set()   # every id ever registered here
        self._lock = threading.Lock()
        self.writes = 0

    def _record(self, ranks: dict[str, MemberInfo]) -> Put:
        infos = sorted(ranks.values(), key=lambda i: (i.local_rank, i.member_id))
        common = dict(infos[0].labels) if infos else {}
        for i in infos[1:]:
            common = {k: v for k, v in common.items() if i.labels.get(k) == v}
        rec = NodeRecord(self.node, self.host, common, tuple(infos), self.ttl)
        return Put(keys.node(self.job, self.node), rec.to_json(), lease=self.lease)

    def add(self, info: MemberInfo) -> None:
        """Register ``info`` (replacing a rank of the same id) in the node record."""
        with self._lock:
            ranks = {**self._ranks, info.member_id: info}
            self.store.txn([], [self._record(ranks)])
            self._ranks = ranks
            self._seen.add(info.member_id)
            self.writes += 1

    def registered_here(self, member_id: str) -> bool:
        """Whether ``member_id`` ever registered through this record (it may be gone)."""
        with self._lock:
            return member_id in self._seen

    def remove(self, member_id: str, reason: str) -> bool:
        """Drop ``member_id`` from the record and mark it departed (one transaction);
        False if it was not registered."""
        with self._lock:
            if member_id not in self._ranks:
                return False
            ranks = {m: i for m, i in self._ranks.items() if m != member_id}
            marker = json.dumps({"lease": self.lease, "reason": reason, "at": time.time()}).encode()
            self.store.txn([], [self._record(ranks), Put(keys.departed_of(self.job, member_id), marker)])
            self._ranks = ranks
            self.writes += 1
            return True

    def ids(self) -> set[str]:
        with self._lock:
            return set(self._ranks)
