"""``dist.new_group(ranks)`` on the resilient backend: a resilient Communicator per group.

torch calls the backend's creator only on the group's members, with a store shared by
them (a prefix of the job's rendezvous store) and the member's rank in the group. Here
each member:

1. opens a fresh TCP transport for the group (own op sequence, own abort: the world's
   ops and the group's never meet on a socket);
2. publishes ``{"member", "address"}`` under its group rank in that store and reads the
   others' (JSON, validated; nothing unpickled); group rank 0 also publishes a random
   group id, which namespaces the group's records in etcd;
3. builds a :class:`~resilient.collectives.Communicator` over a :class:`SubgroupView` —
   the job's epochs restricted to the group's members, with the group transport's
   addresses — and checks that its rank there is the one torch gave it.

**Contributor contract when a group loses a member** (the same as the world's): an op in
flight when a member dies is finished by the group's survivors and is exact over
``work.contributors`` (or raises a named :class:`~resilient.errors.CollectiveError`:
``DataLost`` when a piece exists nowhere, ``GroupChanged`` for ops with one buffer per
member when the group shrank before they started); later ops of the group run over its
survivors, and the group's ``rank()``/``size()`` are live. A group never gains members:
joiners belong to the world only — create a new group after a membership change to
include them. torch keeps its own global-to-group rank table from creation time, so
after a loss pass group-relative ranks (``group_src=``/``group_dst=``) or recreate the
group.

Failure behaviour: a malformed record in the store -> :class:`~resilient.errors.ConfigError`
naming it; the group's rank order differing from torch's (members registered out of rank
order) -> ConfigError; a member that never publishes -> the store's timeout error
(torch's ``timeout`` of ``new_group``).
"""
from __future__ import annotations

import dataclasses
import json
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence, cast

from resilient.collectives.group import EpochLike, EtcdGroupView, GroupView
from resilient.errors import ConfigError
from resilient.settings import Settings
from resilient.torch_backend.communicator_engine import CommunicatorEngine
from resilient.torch_backend.views import FilteredView, replace_epoch

if TYPE_CHECKING:  # pragma: no cover
    from _typeshed import DataclassInstance

_KEY = "resilient-subgroup/"


class SubgroupView(FilteredView):
    """A GroupView of the job restricted to ``members`` (see the module docstring):
    epochs show only those members (in ring order), their ``infos`` carry the group
    transport's ``addresses``, and blob names are prefixed with the group id."""

    def __init__(self, inner: GroupView, members: Iterable[str], addresses: dict[str, str], group_id: str) -> None:
        super().__init__(inner)
        self.members = frozenset(members)
        self.addresses = dict(addresses)
        self.group_id = group_id
        #: ``keep(world_members) -> members``: a rule that drops more members than those the
        #: epoch lacks (an HSDP replicate group drops every member of a broken replica group:
        #: :mod:`resilient.fsdp.layout`); applied to the whole epoch, so every member of the
        #: group derives the same membership from the same epoch
        self.keep: Callable[[Sequence[str]], Sequence[str]] | None = None

    def filter_epoch(self, epoch: EpochLike) -> EpochLike:
        kept = epoch.members if self.keep is None else self.keep(epoch.members)
        members = tuple(m for m in kept if m in self.members)
        infos = {m: dataclasses.replace(cast("DataclassInstance", epoch.infos[m]), address=self.addresses[m])
                 for m in members if m in epoch.infos}
        return replace_epoch(epoch, members=members, infos=infos, roles={}, plan={},
                             added=tuple(m for m in epoch.added if m in members))

    def blob_name(self, name: str) -> str:
        return f"g-{self.group_id}-{name}"


class SubgroupEngine(CommunicatorEngine):
    """The group's engine: its own Communicator and transport (its closer); the job's
    session and epoch watcher are the world engine's (closing the group leaves them alone)."""


def _record(raw: bytes, rank: int) -> dict[str, Any]:
    try:
        rec = json.loads(bytes(raw).decode())
        if isinstance(rec, dict) and isinstance(rec.get("member"), str) and isinstance(rec.get("address"), str):
            return rec
    except (ValueError, UnicodeDecodeError):
        pass
    raise ConfigError(f"new_group: the store record of group rank {rank} is not a resilient member record "
                      f"({bytes(raw)[:80]!r}); was the group created with another backend under the same name?")


def create(world: CommunicatorEngine, store: Any, rank: int, size: int, timeout: timedelta) -> SubgroupEngine:
    """Build this member's engine of a new group (see the module docstring)."""
    from resilient.collectives import Communicator
    from resilient.transport.tcp import TcpTransport

    store.set_timeout(timeout)
    if rank == 0:
        store.set(_KEY + "id", uuid.uuid4().hex[:12])
    group_id = bytes(store.get(_KEY + "id")).decode()
    if not group_id.isalnum():
        raise ConfigError(f"new_group: the group id in the store is not valid ({group_id[:40]!r})")
    transport = TcpTransport(world.member_id, f"{world.job}/{group_id}", host=Settings.from_env().host)
    try:
        store.set(f"{_KEY}{rank}", json.dumps({"member": world.member_id, "address": transport.address}))
        recs = [_record(store.get(f"{_KEY}{r}"), r) for r in range(size)]
        members = [r["member"] for r in recs]
        view = SubgroupView(EtcdGroupView(world.store, world.job, world.session, world.watcher), members,
                            {r["member"]: r["address"] for r in recs}, group_id)
        comm = Communicator(view, transport, joining=False, epoch_timeout=timeout.total_seconds())
    except BaseException:
        transport.close()
        raise
    engine = SubgroupEngine(comm, world.watcher, world.session, world.member_id, closers=[transport],
                            store=world.store, job=world.job, transport=transport)
    if comm.rank != rank:
        engine.close()
        raise ConfigError(f"new_group: torch gave this member group rank {rank}, but the group's ring order "
                          f"{comm.members} puts it at {comm.rank}; the world's ranks must follow the job's ring "
                          "(init_process_group with the rank each member registered with)")
    return engine
