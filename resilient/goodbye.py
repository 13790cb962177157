"""The goodbye of a member that leaves: it lingers until the peers that shared its last op
have finished it (or died), bounded, before its lease is revoked.

Why: a member's lease revocation publishes an epoch without it, and an epoch change
aborts every peer's transport at once. A peer still reading the bytes of the last op
(they sit in its socket or shared-memory ring) loses them with the aborted connection
and finishes that op by recovery over the members still alive: exact over what it
reports, but with another contributor set than the members that left. So every member
that closes (:meth:`resilient.connection.ConnectedCommunicator.close`) first says
goodbye and lingers:

1. it reads ``goodbye/`` (:func:`prefix`), then puts ``goodbye/<member_id>`` on its own
   lease: ``{"address": <its transport address>, "seq": <its next op seq>}`` (JSON);
2. it waits until every *peer* (the other members of the Communicator's group) has put
   its own goodbye — it has finished all its ops, so it needs nothing of ours any more —
   or is no longer a member of the newest epoch (it died, or said goodbye and left),
   or ``timeout`` passed, or the caller's ``stop()`` holds (checked at each goodbye and
   epoch that arrives: ``Communicator.close`` stops when an epoch removes a member and a
   recovery of the last op may need this member's retained result — the peers in that
   recovery say goodbye only after it, so waiting for them would hold it up to the bound).
   The goodbyes arrive by an etcd watch started at the revision of
   the first read (none is missed, even one whose lease is already revoked again), the
   epochs by the epoch watcher: nothing polls.

The last member to finish finds every peer's goodbye in step 1 and does not wait; the
others leave as soon as they see its goodbye (one etcd round trip after it).

A goodbye counts only when its ``address`` is the peer's address in the group's epoch
(``addresses``): a record left by an earlier process of the same member id (a node's
shared lease outlives the process) is ignored. Records are JSON, validated; a malformed
one is ignored (logged) — it can only make this member wait longer, never shorter.

Failure behaviour: :func:`farewell` never raises for a peer (a dead or stopped peer
costs at most ``timeout``); etcd errors propagate (:class:`~resilient.errors.StoreError`,
:class:`~resilient.errors.LeaseExpired` when this member's lease is already gone) — the
caller (``ConnectedCommunicator``) logs them and leaves as it would without a goodbye.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from resilient.coordinator import keys

if TYPE_CHECKING:  # pragma: no cover
    from resilient.coordinator.epoch import Epoch
    from resilient.coordinator.store import KV, Store, WatchEvent

log = logging.getLogger(__name__)

__all__ = ["MAX_LINGER_S", "farewell", "linger_bound", "parse_record", "prefix", "record"]

#: the longest a closing member lingers for its peers (see :func:`linger_bound`)
MAX_LINGER_S = 10.0


def linger_bound(op_timeout: float | None) -> float:
    """How long a closing member waits for its peers' goodbyes: ``min(op_timeout, 10 s)``
    (a peer slower than ``op_timeout`` would be reported as a suspect anyway)."""
    return MAX_LINGER_S if op_timeout is None else max(0.0, min(float(op_timeout), MAX_LINGER_S))


def prefix(job: str) -> str:
    """``/resilient/<job>/goodbye/``: one key per member that closed."""
    return keys.root(job) + "goodbye/"


def record(address: str, seq: int) -> bytes:
    """A goodbye's value: the member's transport address and its next op seq."""
    return json.dumps({"address": address, "seq": int(seq)}).encode()


def parse_record(raw: bytes) -> str | None:
    """The address of a goodbye record, or None when ``raw`` is not one (wrong JSON, type
    or field): such a record is ignored, never trusted."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict):
        return None
    address, seq = doc.get("address"), doc.get("seq")
    if not isinstance(address, str) or not address or not isinstance(seq, int) or isinstance(seq, bool):
        return None
    return address


class _Said:
    """The peers whose (valid) goodbye was seen, filled from a snapshot and a watch."""

    def __init__(self, addresses: Mapping[str, str]) -> None:
        self._addresses = addresses
        self._lock = threading.Lock()
        self.members: set[str] = set()
        self.changed = threading.Event()

    def add(self, key: str, value: bytes) -> None:
        member = keys.last_segment(key)
        address = parse_record(value)
        if address is None:
            log.info("goodbye: ignoring a malformed record under %s", key)
        elif self._addresses.get(member) == address:
            with self._lock:
                self.members.add(member)
        self.changed.set()

    def add_all(self, kvs: Iterable[KV]) -> None:
        for kv in kvs:
            self.add(kv.key, kv.value)

    def seen(self) -> set[str]:
        with self._lock:
            return set(self.members)


def farewell(store: Store, job: str, member_id: str, lease_id: int, addresses: Mapping[str, str],
             seq: int, current: Callable[[], Epoch | None],
             subscribe: Callable[[Callable[[Epoch], None]], Callable[[], None]],
             timeout: float, stop: Callable[[], bool] | None = None) -> frozenset[str]:
    """Say goodbye as ``member_id`` (on ``lease_id``) and wait, at most ``timeout`` s, for
    the peers in ``addresses`` (member id -> transport address in the group's epoch; this
    member's own entry is its address and is not waited for) to have said theirs or to be
    out of the newest epoch (``current``: the epoch watcher's newest; ``subscribe``: its
    subscription, to wake on a new epoch). Returns the peers still owing their goodbye at
    the deadline (empty: every peer finished or is gone), or as soon as ``stop()`` is true
    while some still owe it. See the module docstring for the failure behaviour."""
    pfx = prefix(job)
    own = addresses.get(member_id, "")
    peers = {m for m in addresses if m != member_id}
    said = _Said(addresses)

    def pending() -> set[str]:
        epoch = current()
        alive = peers if epoch is None else peers & set(epoch.members)
        return alive - said.seen()

    kvs, revision = store.snapshot(pfx)
    said.add_all(kvs)
    if not pending():   # the last to finish: nobody to wait for (they wait for this put)
        store.put(pfx + keys.check_name("member id", member_id), record(own, seq), lease=lease_id)
        return frozenset()

    def on_events(events: list[WatchEvent]) -> None:
        for ev in events:
            if ev.type == "put":
                said.add(ev.key, ev.value)
            elif ev.type == "resync":   # history compacted away: read the prefix again
                said.add_all(store.get_prefix(pfx))
        said.changed.set()

    watch = store.watch_prefix(pfx, revision + 1, on_events)
    unsubscribe = subscribe(lambda _epoch: said.changed.set())
    try:
        store.put(pfx + keys.check_name("member id", member_id), record(own, seq), lease=lease_id)
        deadline = time.monotonic() + timeout
        while True:
            left = pending()
            remaining = deadline - time.monotonic()
            if left and stop is not None and stop():
                log.info("goodbye: %s stops waiting for %s (a recovery may need it)", member_id, sorted(left))
                return frozenset(left)
            if not left or remaining <= 0:
                if left:
                    log.info("goodbye: %s leaves without the goodbye of %s (waited %.1fs)", member_id,
                             sorted(left), timeout)
                return frozenset(left)
            said.changed.wait(remaining)
            said.changed.clear()
    finally:
        unsubscribe()
        watch.cancel()
