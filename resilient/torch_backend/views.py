"""A :class:`~resilient.collectives.group.GroupView` that shows the job's epochs through a
filter: the one base of the torch backend's views (:class:`~.communicator_engine.AdmittedView`,
:class:`~.subgroup.SubgroupView`).

:class:`FilteredView` implements every method of the ``GroupView`` protocol explicitly:
the epoch reads (``current``, ``wait_for``, ``subscribe``) pass each epoch through
:meth:`FilteredView.filter_epoch`; blob names (``put_blob``, ``wait_blobs``,
``wait_blobs_until``) through :meth:`FilteredView.blob_name`; the
membership calls (``report_suspect``, ``session_lost``, ``peer_alive``, ``leave``,
``request_readmission``) go to the inner view unchanged.

Failure behaviour: none of its own; every call raises what the inner view raises
(``StoreUnavailable``, ``EpochChanged``, ``TimeoutError`` — see the protocol).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable, Iterable, TypeVar, cast

from resilient.collectives.group import EpochLike, GroupView

if TYPE_CHECKING:  # pragma: no cover
    from _typeshed import DataclassInstance

_R = TypeVar("_R")


def replace_epoch(epoch: EpochLike, **changes: object) -> EpochLike:
    """A copy of ``epoch`` with ``changes`` (every epoch the control plane publishes, and
    every test double of one, is a dataclass; the protocol cannot say so)."""
    record = cast("DataclassInstance", epoch)
    return cast(EpochLike, dataclasses.replace(record, **changes))


class FilteredView:
    """``inner`` with each epoch passed through :meth:`filter_epoch` (identity here) and
    each blob name through :meth:`blob_name` (identity here); see the module docstring."""

    def __init__(self, inner: GroupView) -> None:
        self.inner = inner
        self.member_id: str = inner.member_id

    # -- what a subclass changes ------------------------------------------------------

    def filter_epoch(self, epoch: EpochLike) -> EpochLike:
        return epoch

    def blob_name(self, name: str) -> str:
        return name

    # -- GroupView ----------------------------------------------------------------------

    def _filter(self, epoch: EpochLike | None) -> EpochLike | None:
        return None if epoch is None else self.filter_epoch(epoch)

    def current(self) -> EpochLike | None:
        return self._filter(self.inner.current())

    def wait_for(self, pred: Callable[[EpochLike], bool], timeout: float) -> EpochLike:
        return self.filter_epoch(self.inner.wait_for(lambda e: pred(self.filter_epoch(e)), timeout))

    def subscribe(self, callback: Callable[[EpochLike], None]) -> Callable[[], None]:
        return self.inner.subscribe(lambda e: callback(self.filter_epoch(e)))

    def put_blob(self, epoch: int, name: str, payload: bytes) -> None:
        self.inner.put_blob(epoch, self.blob_name(name), payload)

    def wait_blobs(self, epoch: int, name: str, members: Iterable[str], timeout: float) -> dict[str, bytes]:
        return self.inner.wait_blobs(epoch, self.blob_name(name), members, timeout)

    def any_blob(self, epoch: int, name: str) -> bool:
        return self.inner.any_blob(epoch, self.blob_name(name))

    def wait_blobs_until(self, epoch: int, name: str, done: Callable[[Mapping[str, bytes]], _R | None],
                         timeout: float) -> _R:
        return self.inner.wait_blobs_until(epoch, self.blob_name(name), done, timeout)

    def report_suspect(self, suspect_id: str, reason: str) -> None:
        self.inner.report_suspect(suspect_id, reason)

    def session_lost(self) -> bool:
        return self.inner.session_lost()

    def peer_alive(self, member_id: str) -> bool:
        return self.inner.peer_alive(member_id)

    def leave(self, reason: str = "left") -> None:
        self.inner.leave(reason)

    def request_readmission(self, seen_epoch: int) -> None:
        self.inner.request_readmission(seen_epoch)
