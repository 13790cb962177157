"""Per-epoch rendezvous for transports that need an out-of-band exchange (NCCL's unique id).

One responsibility: the small :class:`Rendezvous` protocol a transport is given (publish
this member's bytes under a name for an epoch; fetch another member's, or peek whether it
is there) and its implementations: :class:`EpochDataRendezvous` over the job's
``epochs/<n>/data/`` keys in etcd, :class:`ViewRendezvous` over the same keys through a
Communicator's group view (what members use), and :class:`LocalRendezvous`, in one
process (several transports of one test or one process).

Failure behaviour (every implementation): :meth:`Rendezvous.fetch` raises
:class:`~resilient.errors.TransportAborted` naming the newer epoch when one supersedes
``epoch`` while waiting (the member waited for may never publish), and
:class:`TimeoutError` naming the member when ``timeout`` passes first; store errors
propagate from :meth:`Rendezvous.publish`. Payloads are raw bytes, never unpickled.
"""
from __future__ import annotations

import threading
import time
from typing import Iterable, Protocol

from resilient.coordinator import keys
from resilient.coordinator.epoch import EpochData
from resilient.coordinator.store import Store
from resilient.errors import ConfigError, EpochChanged, TransportAborted


class Rendezvous(Protocol):
    """Exchange of small byte strings between the members of one epoch."""

    def publish(self, epoch: int, name: str, member: str, payload: bytes) -> None:
        """Make ``payload`` available as ``member``'s ``name`` of ``epoch``."""

    def fetch(self, epoch: int, name: str, member: str, timeout: float) -> bytes:
        """``member``'s ``name`` of ``epoch``, waiting up to ``timeout`` seconds for it."""

    def peek(self, epoch: int, name: str, member: str) -> bytes | None:
        """``member``'s ``name`` of ``epoch`` if it was published, else None (no wait)."""


class EpochDataRendezvous:
    """:class:`Rendezvous` over ``epochs/<n>/data/<name>/<member>`` of ``job`` in etcd
    (:class:`~resilient.coordinator.epoch.EpochData`)."""

    def __init__(self, store: Store, job: str) -> None:
        self.store, self.job = store, job

    def publish(self, epoch: int, name: str, member: str, payload: bytes) -> None:
        EpochData(self.store, self.job, epoch).put(member, name, payload)

    def fetch(self, epoch: int, name: str, member: str, timeout: float) -> bytes:
        try:
            return bytes(EpochData(self.store, self.job, epoch).wait_all(name, [member], timeout)[member])
        except EpochChanged as exc:
            raise TransportAborted(f"epoch {exc.newest} superseded epoch {epoch} during the rendezvous") from None

    def peek(self, epoch: int, name: str, member: str) -> bytes | None:
        kv = self.store.get(keys.epoch_data_of(self.job, epoch, name, member))
        return None if kv is None else bytes(kv.value)


class BlobStore(Protocol):
    """The epoch-data part of a group view (:class:`~resilient.collectives.group.GroupView`)."""

    member_id: str

    def put_blob(self, epoch: int, name: str, payload: bytes) -> None: ...

    def wait_blobs(self, epoch: int, name: str, members: Iterable[str], timeout: float) -> dict[str, bytes]: ...


class ViewRendezvous:
    """:class:`Rendezvous` over a group view's epoch data (``epochs/<n>/data/`` of the job
    for :class:`~resilient.collectives.group.EtcdGroupView`); this member publishes only
    its own entries (ConfigError for another member's)."""

    #: a view has no cheap point read (a peek is a snapshot plus watches): at most one
    #: peek per entry per this many seconds; the others answer None at once
    PEEK_EVERY_S = 0.5

    def __init__(self, view: BlobStore) -> None:
        self.view = view
        self._peeked: dict[tuple[int, str, str], float] = {}

    def publish(self, epoch: int, name: str, member: str, payload: bytes) -> None:
        if member != self.view.member_id:
            raise ConfigError(f"member {self.view.member_id} cannot publish {name!r} as member {member}")
        self.view.put_blob(epoch, name, payload)

    def fetch(self, epoch: int, name: str, member: str, timeout: float) -> bytes:
        try:
            return bytes(self.view.wait_blobs(epoch, name, [member], timeout)[member])
        except EpochChanged as exc:
            raise TransportAborted(f"epoch {exc.newest} superseded epoch {epoch} during the rendezvous") from None

    def peek(self, epoch: int, name: str, member: str) -> bytes | None:
        now, key = time.monotonic(), (epoch, name, member)
        if now - self._peeked.get(key, -self.PEEK_EVERY_S) < self.PEEK_EVERY_S:
            return None
        if len(self._peeked) > 1024:
            self._peeked.clear()
        self._peeked[key] = now
        try:
            return self.fetch(epoch, name, member, 0.0)
        except (TimeoutError, TransportAborted):
            return None


class LocalRendezvous:
    """:class:`Rendezvous` between transports of one process (a dict and a condition)."""

    def __init__(self) -> None:
        self._data: dict[tuple[int, str, str], bytes] = {}
        self._cond = threading.Condition()
        self._newest = -1

    def publish(self, epoch: int, name: str, member: str, payload: bytes) -> None:
        with self._cond:
            self._data[(epoch, name, member)] = bytes(payload)
            self._cond.notify_all()

    def supersede(self, epoch: int) -> None:
        """Epoch ``epoch`` exists now: waits for older epochs end with TransportAborted."""
        with self._cond:
            self._newest = max(self._newest, epoch)
            self._cond.notify_all()

    def fetch(self, epoch: int, name: str, member: str, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        with self._cond:
            while (epoch, name, member) not in self._data:
                if self._newest > epoch:
                    raise TransportAborted(f"epoch {self._newest} superseded epoch {epoch} during the rendezvous")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"member {member} did not publish {name!r} of epoch {epoch} within {timeout:.1f}s")
                self._cond.wait(left)
            return self._data[(epoch, name, member)]

    def peek(self, epoch: int, name: str, member: str) -> bytes | None:
        with self._cond:
            return self._data.get((epoch, name, member))
