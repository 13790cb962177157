"""Whether a process that called ``init_process_group("resilient", rank=r, world_size=n)``
outside ``resilient-run`` (mp.spawn, a supervisor's restart, torchrun) starts a job or
comes back into one that is already running.

One responsibility: the *start markers*. Every member started this way puts
``<job>/torch-started/<member>`` (on its lease, so it vanishes with the member) naming the
members of the epoch it started in. A process whose epoch holds a member whose marker does
not name it arrived after that member had started: it is a **joiner** (a restarted worker
whose peers are past their start), and the torch backend treats it exactly like one that
``resilient-run`` restarts (``RESILIENT_JOINER=1``): not admitted until
``resilient.elastic.State.sync()``, or it exits 0 at its first other collective saying
why (:func:`resilient.torch_backend.communicator_engine.leave_unadmitted`); never a hang
and never a value mixed from other ops. Processes that start together all name each other
(they all start in the first epoch of ``n`` members), so none of them is a joiner.

Failure behaviour: etcd errors propagate (StoreError: ``init_process_group`` fails rather
than guess); a malformed marker raises :class:`~resilient.errors.RecordError` naming the
key (nothing is unpickled).
"""
from __future__ import annotations

import json
from typing import Iterable, Protocol, Sequence

from resilient.coordinator import keys, records


class _KV(Protocol):
    @property
    def key(self) -> str: ...
    @property
    def value(self) -> bytes: ...


class MarkerStore(Protocol):
    """The etcd store as the markers use it."""

    def put(self, key: str, value: bytes | str, lease: int | None = None) -> int: ...

    def get_prefix(self, prefix: str) -> Sequence[_KV]: ...


def _prefix(job: str) -> str:
    return keys.root(job).rstrip("/") + "/torch-started/"


def mark_started(store: MarkerStore, job: str, member_id: str, members: Iterable[str], lease: int) -> None:
    """Record that ``member_id`` started in an epoch of ``members`` (on ``lease``)."""
    store.put(_prefix(job) + member_id, json.dumps({"members": sorted(members)}).encode(), lease=lease)


def started_without(store: MarkerStore, job: str, member_id: str, members: Iterable[str]) -> list[str]:
    """The members of ``members`` (other than ``member_id``) whose start marker does not
    name ``member_id``: they started before it joined (empty: it starts with them)."""
    others = set(members) - {member_id}
    before = []
    for kv in store.get_prefix(_prefix(job)):
        m = keys.last_segment(kv.key)
        if m in others and member_id not in records.fields("rendezvous", kv.value, kv.key).names("members"):
            before.append(m)
    return sorted(before)
