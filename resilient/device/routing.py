"""Per epoch: over which transport an op's device buffers travel (host-staged TCP or NCCL).

One responsibility: turn an epoch's member records into the :func:`choose_transport`
decision (logged once per epoch with its reason) and, when the decision is ``nccl``, give
a device op the transport it posts through: :class:`SplitTransport`, which sends the op's
device buffers over the epoch's :class:`~resilient.transport.nccl.NcclTransport` and every
other buffer (control messages, the chain's token, host buffers) over the op transport
(TCP / shared memory). Recovery transfers never use it: they go through host buffers over
TCP (``resilient/collectives/resume.py``).

A *device op* is one whose ledger stages (``Ledger.stage_elems > 0``: a CUDA tensor, or a
CPU tensor with forced staging, which is how this is tested without a GPU). Which buffers
are device buffers is the ``is_device`` predicate, the same on every member (default: a
CUDA tensor), so both ends of a pair route a message the same way.

Failure behaviour: a malformed member record raises
:class:`~resilient.errors.RecordError` (from :class:`DeviceRecord`) when the epoch is first
routed; ``prefer="nccl"`` where NCCL is impossible raises
:class:`~resilient.errors.ConfigError`. The NCCL transport is built lazily on the first
``nccl`` epoch (:class:`~resilient.errors.ConfigError` without a GPU or NCCL), configured
for each epoch it carries, and aborted by :meth:`DeviceRoute.on_epoch` when an epoch
removes one of its members (its pending requests fail with
:class:`~resilient.errors.TransportAborted`, which starts the op's recovery).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Mapping, Protocol, Sequence

import torch

from resilient.coordinator.membership import MemberInfo
from resilient.device.select import DeviceRecord, Preference, TransportChoice, choose_transport
from resilient.transport.base import Buffer, Request, Transport
from resilient.transport.nccl import EpochLike as NcclEpoch
from resilient.transport.nccl import NcclRequest, NcclTransport
from resilient.transport.rendezvous import BlobStore, ViewRendezvous
from resilient.transport.wrapper import WrappedTransport

log = logging.getLogger(__name__)

#: longest single wait on one side of a mixed wait (the other side progresses in between)
MIXED_SLICE_S = 0.005


class RoutedEpoch(NcclEpoch, Protocol):
    """What routing reads of an epoch (:class:`~resilient.coordinator.epoch.Epoch` is one):
    the NCCL transport's ``number`` and ``members``, and the token and member records."""

    @property
    def token(self) -> str: ...

    @property
    def infos(self) -> Mapping[str, object]: ...


class StagedLedger(Protocol):
    """What :meth:`DeviceRoute.op_transport` reads and sets of an op's ledger."""

    seq: int
    stage_elems: int


class PostingTransport(Protocol):
    """What a device op posts through (an algorithm's ``OpTransport`` plus op cancellation)."""

    def isend(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request: ...

    def irecv(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request: ...

    def wait(self, requests: Sequence[Request], timeout: float | None = None) -> bool: ...


def is_cuda_tensor(buf: Buffer) -> bool:
    """The default device-buffer predicate: a CUDA tensor."""
    return isinstance(buf, torch.Tensor) and buf.device.type == "cuda"


def records_of(epoch: RoutedEpoch) -> list[DeviceRecord]:
    """One :class:`DeviceRecord` per member of ``epoch`` from its member record (``host``,
    ``device``, the labels :data:`~resilient.device.select.UUID_LABEL` and
    :data:`~resilient.device.select.NCCL_LABEL`). A member without a member record (an
    in-memory view) counts as a CPU member. RecordError on a bad record."""
    out = []
    for m in epoch.members:
        info = epoch.infos.get(m)
        if isinstance(info, MemberInfo):
            out.append(DeviceRecord.from_member(m, info.host or "unknown", info.device, info.labels))
        else:
            out.append(DeviceRecord(m, "unknown", "cpu"))
    return out


class SplitTransport:
    """Device buffers over ``nccl``, everything else over ``host`` (see the module
    docstring). A wait over both kinds alternates short waits on each side, so neither
    side's progress waits on the other's completion."""

    def __init__(self, host: PostingTransport, nccl: NcclTransport, is_device: Callable[[Buffer], bool]) -> None:
        self.host, self.nccl, self.is_device = host, nccl, is_device

    def isend(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request:
        if self.is_device(buf):
            return self.nccl.isend(peer, buf, op_seq, tag, digest)
        return self.host.isend(peer, buf, op_seq, tag, digest)

    def irecv(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request:
        if self.is_device(buf):
            return self.nccl.irecv(peer, buf, op_seq, tag, digest)
        return self.host.irecv(peer, buf, op_seq, tag, digest)

    def wait(self, requests: Sequence[Request], timeout: float | None = None) -> bool:
        dev = [r for r in requests if isinstance(r, NcclRequest)]
        host = [r for r in requests if not isinstance(r, NcclRequest)]
        if not host or not dev:
            ok = (self.nccl if dev else self.host).wait(dev or host, timeout)
        else:
            deadline = None if timeout is None else time.monotonic() + timeout
            ok = False
            while True:
                left = MIXED_SLICE_S if deadline is None else max(0.0, min(MIXED_SLICE_S, deadline - time.monotonic()))
                d_ok = self.nccl.wait(dev, left)
                h_ok = self.host.wait(host, left)
                if d_ok and h_ok:
                    ok = True
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    break
        return ok


class DeviceRoute:
    """The per-epoch transport decision of one Communicator and the NCCL transport it owns.

    ``make_nccl``: builds the NCCL transport on the first ``nccl`` epoch (the Communicator
    passes one over its group view's epoch data), given this member's record;
    ``is_device``: which buffers are device
    buffers; ``prefer``: :func:`choose_transport`'s preference. Thread model: :meth:`for_op`
    on the op thread, :meth:`on_epoch` from the epoch watcher."""

    def __init__(self, member_id: str, make_nccl: Callable[[DeviceRecord], NcclTransport], *, prefer: Preference = "auto",
                 is_device: Callable[[Buffer], bool] = is_cuda_tensor) -> None:
        self.member_id = member_id
        self.make_nccl, self.prefer, self.is_device = make_nccl, prefer, is_device
        self._choices: dict[int, TransportChoice] = {}
        self._nccl: NcclTransport | None = None
        self._lock = threading.Lock()
        self.nccl_ops = 0        # device ops routed over NCCL (diagnostics, tests)

    @property
    def nccl(self) -> NcclTransport | None:
        """The NCCL transport, once an epoch chose NCCL."""
        return self._nccl

    def choice(self, epoch: RoutedEpoch) -> TransportChoice:
        """The decision for ``epoch`` (computed and logged once per epoch number)."""
        got = self._choices.get(epoch.number)
        if got is None:
            got = choose_transport(records_of(epoch), self.prefer)
            log.info("epoch %d: device ops over %s (%s)", epoch.number, got.kind, got.reason)
            self._choices = {n: c for n, c in self._choices.items() if n >= epoch.number - 1}
            self._choices[epoch.number] = got
        return got

    def for_op(self, epoch: RoutedEpoch, host: PostingTransport, seq: int = 0) -> SplitTransport | None:
        """The transport device op ``seq`` of ``epoch`` posts through: a
        :class:`SplitTransport` when the epoch chose NCCL (the NCCL transport configured
        for ``epoch``; restarted with generation ``seq`` if an op given up aborted it, as
        on every member), else None (the op stages through the host over ``host``; also
        when the aborted communicator cannot restart because a newer epoch is coming)."""
        if self.choice(epoch).kind != "nccl":
            return None
        with self._lock:
            if self._nccl is None:
                mine = next(r for r in records_of(epoch) if r.member == self.member_id)
                self._nccl = self.make_nccl(mine)
            nccl = self._nccl
        if nccl.epoch != epoch.number:
            nccl.configure(epoch.number, epoch.token, {m: m for m in epoch.members})
        elif nccl.aborted and not nccl.restart(seq):
            log.info("op #%d: the NCCL communicator of epoch %d is aborted and a newer epoch is coming: "
                     "host-staged", seq, epoch.number)
            return None
        self.nccl_ops += 1
        return SplitTransport(host, nccl, self.is_device)

    def op_transport(self, ledger: StagedLedger, epoch: RoutedEpoch, host: PostingTransport) -> PostingTransport:
        """What an op with ``ledger`` posts through in ``epoch``: ``host`` for a direct op
        (nothing staged) or a staged one whose epoch is not ``nccl``; for a device op of an
        ``nccl`` epoch the :class:`SplitTransport`, and the ledger stops staging
        (``stage_elems = 0``: its device buffers go to NCCL as they are)."""
        if ledger.stage_elems <= 0 or self.member_id not in epoch.members:
            return host
        split = self.for_op(epoch, host, ledger.seq)
        if split is None:
            return host
        ledger.stage_elems = 0
        return split

    def on_epoch(self, epoch: NcclEpoch) -> None:
        """Epoch-watcher callback: aborts the NCCL communicator when ``epoch`` removes one
        of its members (:meth:`NcclTransport.on_epoch`); never raises."""
        nccl = self._nccl
        if nccl is not None:
            nccl.on_epoch(epoch)

    def close(self) -> None:
        """Close the NCCL transport, if one was built (its communicator is aborted)."""
        with self._lock:
            nccl, self._nccl = self._nccl, None
        if nccl is not None:
            nccl.close()


class ErrorsToNccl(WrappedTransport):
    """``inner`` whose :meth:`post_error` and :meth:`cancel_op` also reach the route's NCCL
    transport (its waits learn of a peer's ERROR from the rendezvous, and an op given up
    is dropped there too). What the Communicator's op errors go through."""

    def __init__(self, inner: Transport, route: DeviceRoute) -> None:
        super().__init__(inner)
        self.route = route

    def cancel_op(self, op_seq: int) -> None:
        """Also aborts the NCCL communicator: every member gives the op up (each raises the
        op's error through here), so every member restarts it at the next device op
        (:meth:`DeviceRoute.for_op`), whatever of the op was still in flight."""
        self.inner.cancel_op(op_seq)
        nccl = self.route.nccl
        if nccl is not None and nccl.epoch >= 0:
            nccl.cancel_op(op_seq)
            nccl.abort(f"op #{op_seq} was given up")

    def post_error(self, peers: Sequence[str], op_seq: int, message: bytes, timeout: float = 2.0) -> None:
        self.inner.post_error(peers, op_seq, message, timeout)
        nccl = self.route.nccl
        if nccl is not None and nccl.epoch >= 0 and not nccl.closed:
            nccl.post_error([p for p in peers if p in nccl.members], op_seq, message, timeout)


def default_route(view: BlobStore) -> DeviceRoute:
    """The route a Communicator uses by default: the NCCL transport (real NCCL, this
    member's CUDA device) exchanges its unique id through ``view``'s epoch data."""
    def make(mine: DeviceRecord) -> NcclTransport:
        index = int(mine.device.partition(":")[2] or 0)
        return NcclTransport(view.member_id, ViewRendezvous(view), device=index)
    return DeviceRoute(view.member_id, make)
