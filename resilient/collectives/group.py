"""What the communicator needs from the control plane: :class:`GroupView`.

The data plane sees etcd only through this small protocol, so pure-logic unit tests can
use an in-memory view while every test that claims a feature works uses
:class:`EtcdGroupView` over :mod:`resilient.coordinator` (a real etcd + coordinator).

Failure behaviour: :meth:`GroupView.wait_blobs` raises ``EpochChanged`` (a
cancellation signal, :class:`~resilient.errors.Cancelled`) as soon as an epoch newer than the one waited on is
published — the caller re-plans on the newer epoch — and ``TimeoutError`` naming the
missing members after ``timeout``; etcd unreachable surfaces as
:class:`~resilient.errors.StoreUnavailable` after the store's retry budget.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol


class EpochLike(Protocol):
    number: int
    members: tuple[str, ...]
    token: str
    infos: dict[str, Any]  # member id -> object with ``.address``


class GroupView(Protocol):
    member_id: str

    def current(self) -> EpochLike | None: ...

    def wait_for(self, pred: Callable[[EpochLike], bool], timeout: float) -> EpochLike: ...

    def subscribe(self, callback: Callable[[EpochLike], None]) -> Callable[[], None]: ...

    def report_suspect(self, suspect_id: str, reason: str) -> None: ...

    def put_blob(self, epoch: int, name: str, payload: bytes) -> None: ...

    def wait_blobs(self, epoch: int, name: str, members: Iterable[str], timeout: float) -> dict[str, bytes]: ...

    def session_lost(self) -> bool: ...


def addresses_of(epoch: EpochLike) -> dict[str, str]:
    """member id -> transport address for every member of ``epoch``."""
    return {m: epoch.infos[m].address for m in epoch.members}


class EtcdGroupView:
    """:class:`GroupView` over the etcd control plane (``resilient.coordinator``)."""

    def __init__(self, store: Any, job: str, session: Any, watcher: Any) -> None:
        self.store, self.job, self.session, self.watcher = store, job, session, watcher
        self.member_id: str = session.member_id

    def current(self) -> Any:
        return self.watcher.current()

    def wait_for(self, pred: Callable[[Any], bool], timeout: float) -> Any:
        return self.watcher.wait_for(pred, timeout)

    def subscribe(self, callback: Callable[[Any], None]) -> Callable[[], None]:
        return self.watcher.subscribe(callback)

    def report_suspect(self, suspect_id: str, reason: str) -> None:
        from resilient.coordinator import report_suspect

        report_suspect(self.store, self.job, self.member_id, suspect_id, reason)

    def put_blob(self, epoch: int, name: str, payload: bytes) -> None:
        from resilient.coordinator import EpochData

        EpochData(self.store, self.job, epoch).put(self.member_id, name, payload)

    def wait_blobs(self, epoch: int, name: str, members: Iterable[str], timeout: float) -> dict[str, bytes]:
        from resilient.coordinator import EpochData

        return EpochData(self.store, self.job, epoch).wait_all(name, members, timeout)

    def session_lost(self) -> bool:
        return bool(self.session.lost.is_set())

    def peer_alive(self, member_id: str) -> bool:
        """Whether ``member_id`` still holds its lease (its member key exists). True when
        etcd cannot be asked (the caller then treats the peer as alive)."""
        from resilient.coordinator import keys

        try:
            return self.store.get(keys.member(self.job, member_id)) is not None
        except Exception:  # noqa: BLE001 - etcd unreachable: no evidence of death
            return True

    def leave(self, reason: str = "left") -> None:
        """End this member's membership now (revoke its lease): peers see an epoch
        without it at once. Raises StoreUnavailable if etcd cannot be reached."""
        self.session.close(revoke=True, reason=reason)
