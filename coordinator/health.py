"""Health records: ``health/<member_id>``, written by each member at a low rate.

A record is a JSON object; the fields the straggler detector will read are
``waited_on_s`` (rolling seconds its peers waited on it per op, a list), ``ops`` (count)
and ``at`` (wall time). The detector itself (median/MAD scoring with hysteresis, DESIGN
§2) is a :data:`HealthPolicy`: a pure function from every member's record to the set of
members to demote. Until it lands the coordinator uses :func:`no_demotion`.

Records live on the member's lease, so a dead member's health goes with it. Failure
behaviour: :func:`write_health` raises :class:`~resilient.errors.LeaseExpired` when the
lease is gone and :class:`~resilient.errors.StoreUnavailable` when etcd is unreachable;
:func:`read_health` skips malformed records.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Callable, Mapping

from resilient.coordinator import keys
from resilient.coordinator.store import Store

log = logging.getLogger(__name__)

HealthPolicy = Callable[[Mapping[str, dict]], "set[str]"]


def no_demotion(records: Mapping[str, dict]) -> set[str]:
    """The default policy: nobody is demoted."""
    return set()


def write_health(store: Store, job: str, member_id: str, record: dict, lease_id: int | None) -> None:
    """Write ``member_id``'s health record (``at`` is filled in if absent)."""
    body = dict(record)
    body.setdefault("at", time.time())
    store.put(keys.health_of(job, member_id), json.dumps(body, separators=(",", ":")).encode(), lease=lease_id)


def read_health(store: Store, job: str) -> dict[str, dict]:
    """Every member's health record."""
    out: dict[str, dict] = {}
    for kv in store.get_prefix(keys.health(job)):
        try:
            rec = json.loads(kv.value)
            if isinstance(rec, dict):
                out[keys.last_segment(kv.key)] = rec
                continue
        except ValueError:
            pass
        log.warning("ignoring malformed health record %s", kv.key)
    return out
