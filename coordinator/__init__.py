"""The control plane (import name ``resilient.coordinator``): etcd store adapter,
membership and epochs, leader election, the ring/tree planner and the coordinator service.

The names below are imported lazily (on first use), so importing a light submodule such
as :mod:`resilient.coordinator.local_etcd` or :mod:`resilient.coordinator.planner` does
not load the etcd client.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "Store": "store", "KV": "store", "WatchEvent": "store", "WatchHandle": "store",
    "Compare": "store", "Put": "store", "Delete": "store", "parse_endpoints": "store",
    "MemberInfo": "membership", "MemberSession": "membership", "report_suspect": "membership",
    "revoke_member": "membership", "read_members": "membership",
    "Epoch": "epoch", "EpochWatcher": "epoch", "EpochData": "epoch", "EpochChanged": "epoch",
    "read_epoch": "epoch",
    "LeaderElection": "election", "current_leader": "election",
    "Plan": "planner", "plan": "planner",
    "Coordinator": "service", "CoordinatorConfig": "service",
    "CoordinatorMetrics": "metrics",
    "LocalEtcd": "local_etcd",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'resilient.coordinator' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # pragma: no cover - the lazy names above, for the type checker ("X as X": re-exported)
    from .election import LeaderElection as LeaderElection, current_leader as current_leader
    from resilient.errors import EpochChanged as EpochChanged

    from .epoch import Epoch as Epoch, EpochData as EpochData, EpochWatcher as EpochWatcher, read_epoch as read_epoch
    from .local_etcd import LocalEtcd as LocalEtcd
    from .membership import (MemberInfo as MemberInfo, MemberSession as MemberSession, read_members as read_members,
                             report_suspect as report_suspect, revoke_member as revoke_member)
    from .metrics import CoordinatorMetrics as CoordinatorMetrics
    from .planner import Plan as Plan, plan as plan
    from .service import Coordinator as Coordinator, CoordinatorConfig as CoordinatorConfig
    from .store import (KV as KV, Compare as Compare, Delete as Delete, Put as Put, Store as Store,
                        WatchEvent as WatchEvent, WatchHandle as WatchHandle, parse_endpoints as parse_endpoints)
