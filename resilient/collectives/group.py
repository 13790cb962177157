"""What the communicator needs from the control plane: :class:`GroupView`.

The data plane sees etcd only through this small protocol, so pure-logic unit tests can
use an in-memory view while every test that claims a feature works uses
:class:`EtcdGroupView` over :mod:`resilient.coordinator` (a real etcd + coordinator).

Failure behaviour: :meth:`GroupView.wait_blobs` (and ``wait_blobs_until``) raises ``EpochChanged`` (a
cancellation signal, :class:`~resilient.errors.Cancelled`) as soon as an epoch newer than the one waited on is
published — the caller re-plans on the newer epoch — and ``TimeoutError`` naming the
missing members after ``timeout``; etcd unreachable surfaces as
:class:`~resilient.errors.StoreUnavailable` after the store's retry budget.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, TypeVar

if TYPE_CHECKING:
    from resilient.coordinator.epoch import EpochPlan


class HasAddress(Protocol):
    @property
    def address(self) -> str: ...


class EpochLike(Protocol):
    """What the data plane reads of an epoch (:class:`resilient.coordinator.epoch.Epoch`
    is one): the plan is typed and validated when the epoch is parsed."""

    @property
    def number(self) -> int: ...
    @property
    def members(self) -> tuple[str, ...]: ...
    @property
    def token(self) -> str: ...
    @property
    def infos(self) -> Mapping[str, HasAddress]: ...
    @property
    def roles(self) -> Mapping[str, str]: ...
    @property
    def plan(self) -> EpochPlan: ...
    @property
    def cause(self) -> str: ...
    @property
    def added(self) -> tuple[str, ...]: ...


class BlobView(Protocol):
    """The part of a :class:`GroupView` a ledger-status exchange uses."""

    def current(self) -> EpochLike | None: ...

    def put_blob(self, epoch: int, name: str, payload: bytes) -> None: ...

    def wait_blobs(self, epoch: int, name: str, members: Iterable[str], timeout: float) -> dict[str, bytes]: ...

    def any_blob(self, epoch: int, name: str) -> bool:
        """Whether some member has put ``name`` in ``epoch`` (one key-only read)."""
        ...


_R = TypeVar("_R")


class AgreementView(BlobView, Protocol):
    """A :class:`BlobView` that can also wait on a condition over one blob's payloads
    (the join agreement's: the root's record, or every old member's)."""

    def wait_blobs_until(self, epoch: int, name: str, done: Callable[[Mapping[str, bytes]], _R | None],
                         timeout: float) -> _R:
        """Until ``done`` (member id -> payload of every ``name`` put in ``epoch`` so far,
        called after each change) returns non-None; returns that. Raises what ``done``
        raises, ``EpochChanged`` and ``TimeoutError`` as :meth:`BlobView.wait_blobs`."""
        ...


class GroupView(AgreementView, Protocol):
    """The whole contract between the data plane and the control plane. Every method
    may raise :class:`~resilient.errors.StoreUnavailable` when etcd stays unreachable;
    see the module docstring for the waits."""

    member_id: str

    def wait_for(self, pred: Callable[[EpochLike], bool], timeout: float) -> EpochLike: ...

    def subscribe(self, callback: Callable[[EpochLike], None]) -> Callable[[], None]: ...

    def report_suspect(self, suspect_id: str, reason: str) -> None: ...

    def session_lost(self) -> bool: ...

    def peer_alive(self, member_id: str) -> bool:
        """Whether ``member_id`` still holds its lease (True when it cannot be told)."""
        ...

    def leave(self, reason: str = "left") -> None:
        """End this member's membership now (peers see an epoch without it)."""
        ...

    def request_readmission(self, seen_epoch: int) -> None:
        """Ask the coordinator to re-admit this (evicted) member; ``seen_epoch``: the
        newest epoch without it."""
        ...


def addresses_of(epoch: EpochLike) -> dict[str, str]:
    """member id -> transport address for every member of ``epoch``."""
    return {m: epoch.infos[m].address for m in epoch.members}


class EtcdGroupView:
    """:class:`GroupView` over the etcd control plane (``resilient.coordinator``)."""

    def __init__(self, store: Any, job: str, session: Any, watcher: Any) -> None:
        self.store, self.job, self.session, self.watcher = store, job, session, watcher
        self.member_id: str = session.member_id
        #: peer_alive's memory: rank id -> its node (from the last read of every node
        #: record) and the ids no node record listed
        self._node_of: dict[str, str] = {}
        self._gone: set[str] = set()

    def current(self) -> EpochLike | None:
        epoch: EpochLike | None = self.watcher.current()
        return epoch

    def wait_for(self, pred: Callable[[EpochLike], bool], timeout: float) -> EpochLike:
        epoch: EpochLike = self.watcher.wait_for(pred, timeout)
        return epoch

    def subscribe(self, callback: Callable[[EpochLike], None]) -> Callable[[], None]:
        unsubscribe: Callable[[], None] = self.watcher.subscribe(callback)
        return unsubscribe

    def report_suspect(self, suspect_id: str, reason: str) -> None:
        from resilient.coordinator.membership import report_suspect

        report_suspect(self.store, self.job, self.member_id, suspect_id, reason)

    def put_blob(self, epoch: int, name: str, payload: bytes) -> None:
        from resilient.coordinator.epoch import EpochData

        EpochData(self.store, self.job, epoch).put(self.member_id, name, payload)

    def wait_blobs(self, epoch: int, name: str, members: Iterable[str], timeout: float) -> dict[str, bytes]:
        from resilient.coordinator.epoch import EpochData

        return EpochData(self.store, self.job, epoch).wait_all(name, members, timeout)

    def wait_blobs_until(self, epoch: int, name: str, done: Callable[[Mapping[str, bytes]], _R | None],
                         timeout: float) -> _R:
        from resilient.coordinator.epoch import EpochData

        return EpochData(self.store, self.job, epoch).wait_until(name, done, timeout)

    def any_blob(self, epoch: int, name: str) -> bool:
        from resilient.coordinator.epoch import EpochData

        return EpochData(self.store, self.job, epoch).any(name)

    def session_lost(self) -> bool:
        return bool(self.session.lost.is_set())

    def peer_alive(self, member_id: str) -> bool:
        """Whether ``member_id`` still holds its lease: its ``members/<id>`` key exists,
        or — a rank of a node agent (docs/scale.md, "Node-level membership") — a live
        ``nodes/<node>`` record (on the node lease) lists it. The rank's node is found
        once by reading every node record (paged) and remembered, so later calls read one
        key; an id no record listed is remembered as gone. A malformed node record is
        skipped (logged and counted) and its ranks read as not alive, as the coordinator's
        directory treats them. True when etcd cannot be asked (the caller then treats the
        peer as alive); never raises."""
        from resilient.coordinator import keys
        from resilient.coordinator.directory import rank_nodes, read_node

        try:
            if self.store.get(keys.member(self.job, member_id)) is not None:
                return True
            if member_id in self._gone:
                return False
            node = self._node_of.get(member_id)
            if node is None:
                self._node_of = rank_nodes(self.store, self.job)
                node = self._node_of.get(member_id)
                if node is None:
                    self._gone.add(member_id)
                    return False
            rec = read_node(self.store, self.job, node)
            return rec is not None and any(r.member_id == member_id for r in rec.ranks)
        except Exception:  # noqa: BLE001 - etcd unreachable: no evidence of death
            return True

    def leave(self, reason: str = "left") -> None:
        """End this member's membership now (revoke its lease): peers see an epoch
        without it at once. Raises StoreUnavailable if etcd cannot be reached."""
        self.session.close(revoke=True, reason=reason)

    def request_readmission(self, seen_epoch: int) -> None:
        """``readmit/<member>`` on this member's lease (coordinator/eviction.py); raises
        StoreUnavailable if etcd cannot be reached."""
        from resilient.coordinator.eviction import request_readmission

        request_readmission(self.store, self.job, self.member_id, seen_epoch, self.session.lease_id)
