"""NCCL transport: point-to-point over non-blocking NCCL communicators, abortable per epoch.

Why NCCL's C API through ctypes (and not one of the two obvious bindings)
--------------------------------------------------------------------------
* CuPy's ``cupy.cuda.nccl`` has no ``ncclCommInitRankConfig``: its communicators are
  *blocking*. In blocking mode the first ``ncclSend``/``ncclRecv`` to a peer sets up the
  connection inside ``ncclGroupEnd`` on the calling thread, so a dead or SIGSTOPped peer
  blocks that thread in C, and ``ncclCommAbort`` from another thread is not safe then.
* torch's ``ProcessGroupNCCL`` can be non-blocking (``Options().config.blocking = 0``, as
  torchft does), but it exchanges its unique id only through a c10d ``Store`` — not through
  ``epochs/<n>/`` in etcd — and a CPU-only torch build cannot even import it.
* ``ncclCommInitRankConfig`` with ``config.blocking = 0`` (NCCL >= 2.14) returns at once
  from every call; we poll ``ncclCommGetAsyncError`` and CUDA events from Python, so a wait
  is a loop that an :meth:`NcclTransport.abort` from any thread ends at once, and
  ``ncclCommAbort`` tears down the kernels of a hung peer. The ``ncclConfig_t`` we pass is
  the versioned v2.17 layout (size, magic, version say which fields exist), which newer
  NCCLs accept unchanged. The library comes from the ``nvidia-nccl-cu12`` wheel (the
  ``gpu`` extra; torch's CUDA builds ship it too) or ``$RESILIENT_NCCL_LIBRARY``.

Every NCCL/CUDA call goes through the small :class:`NcclApi` seam, and the unique id
travels through an injected :class:`~resilient.transport.rendezvous.Rendezvous` (members
pass :class:`~resilient.transport.rendezvous.EpochDataRendezvous`, i.e. etcd); the
transport logic (unique-id exchange, the state machine, abort on epoch change) is tested
on machines without a GPU with a fake api (``tests/test_nccl_transport.py``,
``tests/test_transport_contract.py``); the real :class:`CtypesNccl` runs only where a GPU
exists.

Model
-----
* One communicator per epoch, over the epoch's members sorted by member id (rank = index).
  The first of them creates the unique id and publishes its 128 raw bytes as its
  ``nccl-uid`` of the epoch in the rendezvous (with :class:`EpochDataRendezvous`:
  ``epochs/<n>/data/nccl-uid/<member>``); the others fetch it there. Nothing is pickled.
* :meth:`configure` keeps the communicator when the member set is unchanged and the
  communicator is healthy; otherwise the old one is aborted and a new one is created
  lazily at the next :meth:`wait` (the contract: configure never blocks on peers).
* Requests posted with :meth:`isend`/:meth:`irecv` are launched at the next :meth:`wait`,
  in one NCCL group (posting order), on the transport's own stream after it waited for
  the caller's current stream: every pending send, and the pending receives of each peer
  up to the last one waited on (a receive posted ahead, as the ring posts all of an op's
  receives up front, waits for a later group: a group completes only as a whole, so
  launching it early would tie this step to a later step's send). So a ring step that
  posts a send and a receive cannot deadlock.
* Messages are matched by order per pair of members, as the transport contract allows.
  Every message is a fixed-size header (:data:`HEADER`: op_seq, tag, descriptor digest,
  payload bytes; a small device buffer from :meth:`NcclApi.header`) followed by the
  payload, in the same group. On completion a receive compares the header with what it
  was posted with: a different digest fails the receive and its op with
  :class:`~resilient.transport.ops.OpMismatch` (as on TCP); a different op_seq/tag/size
  (the members posted in different orders) fails it with ``TransportError``. The
  op-level bookkeeping (cancelled and failed ops) is the shared
  :class:`~resilient.transport.ops.OpGuard`.

Failure behaviour
-----------------
* :meth:`abort` (any thread; typically :meth:`on_epoch` from the epoch watcher when an
  epoch removes a peer) calls ``ncclCommAbort``, fails every pending request with
  :class:`~resilient.errors.TransportAborted` and wakes the waiting thread at once.
* An NCCL async error (a peer's process died: ``ncclRemoteError``/``ncclSystemError``)
  fails the pending requests with :class:`~resilient.errors.TransportError`; the
  communicator is unusable until the next epoch.
* Unique-id exchange: if a newer epoch is published while waiting for the id the wait
  raises ``TransportAborted``; if the creator never publishes it within
  ``connect_timeout`` seconds, ``TransportError`` names it. A malformed id (not 128 bytes)
  raises ``TransportError``.
* :meth:`post_error` publishes the message as ``op-error-<seq>`` in the rendezvous (best
  effort; an unexpected NCCL message would break the order matching). A waiting peer
  polls the rendezvous for the ops it waits on (every :data:`ERROR_POLL_S`) and fails
  that op's requests with :class:`~resilient.transport.ops.PeerReportedError`; NCCL
  operations of the op already launched cannot be withdrawn, so the communicator is
  then aborted (usable again after the next :meth:`configure`).
* :meth:`probe` publishes our current op's digest as ``op-probe-<seq>``; a wait compares
  the records of the peers it waits on for ops it probed, and another digest fails that
  op with :class:`~resilient.transport.ops.OpMismatch` (the communicator aborted as for an
  ERROR report). A malformed record is logged and ignored.
"""
from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

from resilient.errors import ConfigError, TransportAborted, TransportError
from resilient.transport.base import Buffer, Request, TransportStats
from resilient.transport.op_layer import OpLayer
from resilient.transport.ops import ERROR_MESSAGE_CAP, OpGuard, OpMismatch, PeerReportedError
from resilient.transport.rendezvous import Rendezvous
from resilient.transport.tags import OP_NAMESPACE, namespace_of
# the NCCL seam and its ctypes binding (nccl_api.py); importable from here as before
from resilient.transport.nccl_api import (  # noqa: F401 - re-exported
    HEADER, NCCL_IN_PROGRESS, NCCL_SUCCESS, UID_BYTES, CtypesNccl, NcclApi, P2POp, _ConfigV21700, _UniqueId,
    find_nccl_library,
)

log = logging.getLogger(__name__)

UID_NAME = "nccl-uid"
POLL_S = 0.0002
#: longest single rendezvous wait for the unique id (an abort ends the setup within it)
UID_SLICE_S = 0.1
#: how often a wait looks in the rendezvous for a peer's ERROR report on its ops
ERROR_POLL_S = 0.05
#: an ``op-probe-<seq>`` record: the publisher's descriptor digest of that op
PROBE_RECORD = struct.Struct("<I")


# --------------------------------------------------------------------------------------
# the transport
# --------------------------------------------------------------------------------------


class _SetupTimeout(Exception):
    """Communicator setup did not finish before a deadline (internal)."""


@dataclass(eq=False)
class NcclRequest(Request):
    peer: str
    nbytes: int
    kind: str
    op_seq: int
    tag: int
    ptr: int
    buf: Any
    header: Any = None
    digest: int = 0
    launch: Any = None
    _done: bool = False
    _error: BaseException | None = None
    posted_at: float = field(default_factory=time.monotonic)

    def done(self) -> bool:
        return self._done

    @property
    def error(self) -> BaseException | None:
        return self._error


class EpochLike(Protocol):
    """What :meth:`NcclTransport.on_epoch` reads of an epoch."""

    @property
    def number(self) -> int: ...

    @property
    def members(self) -> Sequence[str]: ...


class EpochSource(Protocol):
    """What :meth:`NcclTransport.attach` subscribes to (an ``EpochWatcher``)."""

    def subscribe(self, callback: Callable[[EpochLike], None]) -> Callable[[], None]: ...


class NcclTransport(OpLayer):
    """See the module docstring. Thread model: one thread calls configure/isend/irecv/wait/
    cancel_op/post_error; :meth:`abort` and :meth:`on_epoch` from any thread."""

    def __init__(self, member_id: str, rendezvous: Rendezvous, api: NcclApi | None = None, device: int = 0,
                 connect_timeout: float = 60.0) -> None:
        self.member_id = member_id
        self.rendezvous = rendezvous
        self.api = api if api is not None else CtypesNccl(device)
        self.device = device
        self.connect_timeout = connect_timeout
        self._ops = OpGuard()
        self._stats = TransportStats()
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._epoch = -1
        self._members: tuple[str, ...] = ()
        self._comm: Any = None
        self._comm_epoch = -1
        self._ready = False
        self._uid: tuple[int, str, bytes] | None = None   # (epoch, name, unique id) once exchanged
        self._uid_name = UID_NAME                 # nccl-uid; nccl-uid-g<n> after restart(n)
        self._newest_seen = -1                    # newest epoch on_epoch saw
        self._abort_reason: str | None = None
        self._failed: str | None = None           # the communicator of this epoch failed
        self._pending: list[NcclRequest] = []     # posted, not completed (launched or not)
        self._probed: dict[tuple[int, int], int] = {}  # (epoch, op) -> digest published by :meth:`probe`
        self._closed = False
        self.state = "idle"                       # idle | configured | ready | aborted | closed

    # -- Transport properties ---------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"nccl://{socket.gethostname()}/cuda:{self.device}"

    @property
    def stats(self) -> TransportStats:
        return self._stats

    @property
    def aborted(self) -> bool:
        return self._abort_reason is not None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def members(self) -> tuple[str, ...]:
        """The current communicator's members, in NCCL rank order."""
        return self._members

    # -- epochs -------------------------------------------------------------------------------

    def configure(self, epoch: int, token: str, addresses: Mapping[str, str]) -> None:
        if self._closed:
            raise TransportError("configure() on a closed NCCL transport")
        members = tuple(sorted(addresses))
        if self.member_id not in members:
            raise ConfigError(f"member {self.member_id} is not in epoch {epoch} ({list(members)})")
        with self._lock:
            keep = (self._comm is not None and self._abort_reason is None and members == self._members)
            if not keep:
                self._drop_comm(f"epoch {epoch} changed the members to {list(members)}")
            for r in self._pending:
                r._error = TransportAborted(f"epoch changed to {epoch} before the request completed")
            self._pending.clear()
            self._epoch, self._members = int(epoch), members
            self._uid_name = UID_NAME
            self._abort_reason = None
            self._failed = None
            self._ops.reset()
            self._wake.clear()
            self.state = "ready" if keep else "configured"

    def _drop_comm(self, why: str) -> None:
        if self._comm is not None:
            log.info("%s: aborting NCCL communicator of epoch %d: %s", self.member_id, self._comm_epoch, why)
            try:
                self.api.abort(self._comm)
            except Exception:  # noqa: BLE001 - abort is best effort; the comm is dropped anyway
                log.exception("ncclCommAbort failed")
        self._comm, self._ready, self._comm_epoch = None, False, -1

    def restart(self, generation: int) -> bool:
        """After an abort within the epoch (an op given up: a mismatch, a peer's ERROR), a
        fresh communicator over the same members, its unique id exchanged as
        ``nccl-uid-g<generation>``: every member calls it with the same ``generation``
        (the Communicator passes the next op's sequence number). Returns False, changing
        nothing, when a newer epoch was seen already (the next :meth:`configure` rebuilds)
        or the transport is closed."""
        with self._lock:
            if self._closed or self._epoch < 0 or self._newest_seen > self._epoch:
                return False
            self._drop_comm(f"restart {generation} within epoch {self._epoch}")
            for r in self._pending:
                r._error = r._error or TransportAborted(f"the NCCL communicator restarted ({generation})")
            self._pending.clear()
            self._uid_name = f"{UID_NAME}-g{int(generation)}"
            self._abort_reason = self._failed = None
            self._ops.reset()
            self._wake.clear()
            self.state = "configured"
            return True

    def on_epoch(self, epoch: EpochLike) -> None:
        """Epoch-watcher callback: abort at once when ``epoch`` is newer than ours and
        removes one of our members (or us). Epochs that only add members do not abort:
        joiners are admitted at an op boundary, and :meth:`configure` rebuilds then."""
        self._newest_seen = max(self._newest_seen, epoch.number)
        if epoch.number <= self._epoch or not self._members:
            return
        gone = sorted(set(self._members) - set(epoch.members))
        if gone:
            self.abort(f"epoch {epoch.number} removed {gone}")

    def attach(self, watcher: EpochSource) -> Callable[[], None]:
        """Subscribe :meth:`on_epoch` to an :class:`~resilient.coordinator.epoch.EpochWatcher`;
        returns the unsubscribe function."""
        return watcher.subscribe(self.on_epoch)

    def abort(self, reason: str) -> None:
        with self._lock:
            if self._closed or self._abort_reason is not None:
                return
            self._abort_reason = reason
            self._drop_comm(reason)
            for r in self._pending:
                if not r._done and r._error is None:
                    r._error = TransportAborted(reason)
            self.state = "aborted"
            self._wake.set()

    # -- communicator setup -----------------------------------------------------------------

    def _exchange_uid(self, timeout: float, tick: Callable[[], None]) -> bytes:
        """The epoch's unique id: created and put by the first member, awaited by the
        others. Cached per epoch, so a wait that timed out and is retried never makes a
        second id. Raises :class:`_SetupTimeout` when ``timeout`` passes first and
        :class:`~resilient.errors.TransportAborted` when a newer epoch superseded ours."""
        if self._uid is not None and self._uid[:2] == (self._epoch, self._uid_name):
            return self._uid[2]
        creator = self._members[0]
        if creator == self.member_id:
            uid = self.api.unique_id()
            self.rendezvous.publish(self._epoch, self._uid_name, self.member_id, uid)
        else:
            uid = self._fetch_uid(creator, timeout, tick)
            if len(uid) != UID_BYTES:
                raise TransportError(f"malformed NCCL unique id from member {creator}: {len(uid)} bytes, "
                                     f"expected {UID_BYTES}")
        self._uid = (self._epoch, self._uid_name, uid)
        return uid

    def _fetch_uid(self, creator: str, timeout: float, tick: Callable[[], None]) -> bytes:
        """``creator``'s unique id of this epoch, fetched in slices of at most
        :data:`UID_SLICE_S` so that :meth:`abort` ends the wait within one slice (``tick``
        runs between slices)."""
        deadline = time.monotonic() + timeout
        while True:
            tick()
            self._raise_if_aborted()
            left = deadline - time.monotonic()
            try:
                return self.rendezvous.fetch(self._epoch, self._uid_name, creator, max(0.0, min(UID_SLICE_S, left)))
            except TimeoutError:
                if left <= UID_SLICE_S:
                    raise _SetupTimeout(f"member {creator} did not publish the NCCL unique id of epoch "
                                        f"{self._epoch} within {timeout:.1f}s (is it alive?)") from None

    def _ensure_comm(self, deadline: float, tick: Callable[[], None]) -> None:
        """Set up the epoch's communicator (``tick`` runs while waiting for peers)."""
        if self._ready:
            return
        if self._comm is None:
            uid = self._exchange_uid(max(0.1, deadline - time.monotonic()), tick)
            self._raise_if_aborted()
            with self._lock:
                self._raise_if_aborted()
                self._comm = self.api.init_comm(len(self._members), uid, self._members.index(self.member_id))
                self._comm_epoch = self._epoch
        while not self.api.comm_ready(self._comm):
            tick()
            self._raise_if_aborted()
            if time.monotonic() > deadline:
                raise _SetupTimeout(f"NCCL communicator of epoch {self._epoch} not ready in time; "
                                    f"members {list(self._members)}")
            self._wake.wait(POLL_S)
        self._raise_if_aborted()
        self._ready = True
        self.state = "ready"

    def _raise_if_aborted(self) -> None:
        if self._abort_reason is not None:
            raise TransportAborted(self._abort_reason)

    # -- requests -----------------------------------------------------------------------------

    def _post(self, kind: str, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int) -> NcclRequest:
        if self._epoch < 0:
            raise TransportError("post before configure(): the NCCL transport has no epoch yet")
        if peer not in self._members or peer == self.member_id:
            raise ConfigError(f"{kind} to {peer!r}: not another member of epoch {self._epoch} "
                              f"({list(self._members)})")
        ptr, nbytes = self.api.buffer(buf)
        head = HEADER.pack(int(op_seq), int(tag), int(digest) & (2**64 - 1), nbytes) if kind == "send" else None
        req = NcclRequest(peer=peer, nbytes=nbytes, kind=kind, op_seq=op_seq, tag=tag, ptr=ptr, buf=buf,
                          header=self.api.header(head), digest=int(digest) & (2**64 - 1))
        req.is_send = kind == "send"
        with self._lock:
            op_error = self._op_failure(op_seq)
            if self._closed:
                req._error = TransportError("transport is closed")
            elif op_error is not None:
                req._error = op_error
            elif self._abort_reason is not None:
                req._error = TransportAborted(self._abort_reason)
            else:
                self._pending.append(req)
        return req

    def isend(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request:
        return self._post("send", peer, buf, op_seq, tag, digest)

    def irecv(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request:
        return self._post("recv", peer, buf, op_seq, tag, digest)

    def _drop_op(self, op_seq: int, exc: BaseException) -> None:
        """Drops requests of ``op_seq`` that were not launched yet. Launched NCCL operations
        cannot be withdrawn: if any is still running, the communicator is aborted."""
        with self._lock:
            launched = [r for r in self._pending if r.op_seq == op_seq and r.launch is not None and not r._done]
            for r in self._pending:
                if r.op_seq == op_seq and r.launch is None:
                    r._error = exc
            self._pending = [r for r in self._pending if r.op_seq != op_seq or r.launch is not None]
        if launched:
            self.abort(f"op #{op_seq} cancelled with {len(launched)} NCCL operations in flight")

    def _error_frame(self, op_seq: int, message: bytes) -> bytes:
        return bytes(message)[:ERROR_MESSAGE_CAP]

    def _deliver_error(self, peers: Sequence[str], op_seq: int, frame: bytes, timeout: float) -> None:
        try:
            self.rendezvous.publish(self._epoch, f"op-error-{int(op_seq)}", self.member_id, frame)
        except Exception as exc:  # noqa: BLE001 - best effort by contract
            log.warning("post_error for op #%d not recorded: %s", op_seq, exc)

    def _launch_pending(self, waited: Sequence[NcclRequest]) -> None:
        """Launch every pending send and each peer's pending receives up to the last one
        in ``waited`` (see the module docstring), header before payload."""
        pending = [r for r in self._pending if r.launch is None and r._error is None]
        ids = {id(r) for r in waited}
        last: dict[str, int] = {}
        for i, r in enumerate(pending):
            if r.kind == "recv" and id(r) in ids:
                last[r.peer] = i
        todo = [r for i, r in enumerate(pending) if r.kind == "send" or i <= last.get(r.peer, -1)]
        if not todo:
            return
        ops: list[P2POp] = []
        for r in todo:
            rank = self._members.index(r.peer)
            hptr, hbytes = self.api.buffer(r.header)
            ops.append(P2POp(r.kind, hptr, hbytes, rank, r.header))
            ops.append(P2POp(r.kind, r.ptr, r.nbytes, rank, r.buf))
        handle = self.api.launch(self._comm, ops)
        for r in todo:
            r.launch = handle

    def _check_header(self, r: NcclRequest) -> None:
        """Compare a completed receive's header with what it was posted with (failing
        ``r`` and, for a digest, its op)."""
        op_seq, tag, digest, nbytes = HEADER.unpack(self.api.header_bytes(r.header))
        r._error = self._ops.check_digest(r.peer, r.op_seq, digest, r.digest)   # a different op first
        if r._error is None and (op_seq, tag, nbytes) != (r.op_seq, r.tag, r.nbytes):
            r._error = TransportError(
                f"message from {r.peer} is op #{op_seq} tag {tag} ({nbytes} bytes) but the receive posted in its "
                f"place is op #{r.op_seq} tag {r.tag} ({r.nbytes} bytes): the members posted in different orders "
                "(NCCL matches by posting order)")

    def _poll_errors(self, reqs: Sequence[NcclRequest]) -> None:
        """Look in the rendezvous, for the ops of ``reqs``, for peers' ERROR reports and,
        for the ops this member probed (:meth:`probe`), for their probe records: a report,
        or a record with another digest (:class:`OpMismatch`), fails that op's requests
        (aborting the communicator if any is in flight). A malformed probe record is
        logged, never used."""
        in_flight = False
        with self._lock:
            for peer, seq in sorted({(r.peer, r.op_seq) for r in reqs if not r._done}):
                if self._ops.error_of(seq) is not None:
                    continue
                frame = self._peek("op-error", peer, seq)
                ours = self._probed.get((self._epoch, seq))
                if frame is not None:
                    self._ops.peer_reported(peer, seq, frame)
                elif ours is not None:
                    self._judge_probe(peer, seq, ours, self._peek("op-probe", peer, seq))
                if self._ops.error_of(seq) is not None:
                    in_flight = self._fail_op(seq) or in_flight
        if in_flight:
            self.abort("a peer reported an error on, or probed with another descriptor, an op with NCCL "
                       "operations in flight")

    def _peek(self, name: str, peer: str, seq: int) -> bytes | None:
        """``peer``'s ``<name>-<seq>`` record of this epoch, or None (also when the store
        fails: it is asked again at the next poll)."""
        try:
            return self.rendezvous.peek(self._epoch, f"{name}-{int(seq)}", peer)
        except Exception as exc:  # noqa: BLE001 - asked again at the next poll
            log.debug("%s poll for op #%d failed: %s", name, seq, exc)
            return None

    def _fail_op(self, seq: int) -> bool:
        """Fail the pending requests of ``seq`` with its recorded error (lock held);
        whether any of them was in flight."""
        err = self._ops.error_of(seq)
        in_flight = False
        for r in self._pending:
            if r.op_seq == seq and not r._done:
                in_flight = in_flight or r.launch is not None
                r._error = err
        self._pending = [r for r in self._pending if r.op_seq != seq or r._done]
        return in_flight

    # -- op probes (no frames besides the ordered messages: through the rendezvous) ----------

    def probe(self, peers: Sequence[str]) -> None:
        """Publish our current op's digest as ``op-probe-<seq>`` in the rendezvous (once
        per op); a wait then compares the waited peers' records of that op
        (:meth:`_poll_errors`): the peer, when its wait lasts too, publishes its own.
        Best effort, never raises."""
        with self._lock:
            cur = max(((r.op_seq, r.digest) for r in self._pending
                       if not r._done and r._error is None and r.digest and namespace_of(r.op_seq) == OP_NAMESPACE),
                      default=None)
            if cur is None or (self._epoch, cur[0]) in self._probed:
                return
            self._probed = {k: v for k, v in self._probed.items() if k[0] == self._epoch}
            self._probed[(self._epoch, cur[0])] = cur[1]
            epoch = self._epoch
        try:
            self.rendezvous.publish(epoch, f"op-probe-{cur[0]}", self.member_id, PROBE_RECORD.pack(cur[1]))
            self._stats.add_probe("sent")
        except Exception as exc:  # noqa: BLE001 - best effort by contract
            log.warning("probe for op #%d not published: %s", cur[0], exc)

    def _judge_probe(self, peer: str, seq: int, ours: int, raw: bytes | None) -> None:
        """Compare ``peer``'s probe record of op ``seq`` (None: not published) with our
        digest ``ours``: another digest fails the op through the op guard."""
        if raw is None:
            return
        if len(raw) != PROBE_RECORD.size:
            log.warning("member %s published a bad probe record for op #%d (%d bytes, expected %d): ignored",
                        peer, seq, len(raw), PROBE_RECORD.size)
            return
        self._stats.add_probe("answers")
        if self._ops.check_digest(peer, seq, PROBE_RECORD.unpack(raw)[0], ours) is not None:
            self._stats.add_probe("mismatch")

    def wait(self, requests: Sequence[Request], timeout: float | None = None) -> bool:
        start = time.monotonic()
        deadline = start + (timeout if timeout is not None else float("inf"))
        reqs = [r for r in requests if isinstance(r, NcclRequest)]
        for r in reqs:
            if r._error is not None:
                raise r._error
        if all(r._done for r in reqs):
            return True
        self._raise_if_aborted()
        if self._failed is not None:
            raise TransportError(f"the NCCL communicator of epoch {self._epoch} failed ({self._failed}); "
                                 "it is usable again after the next epoch")
        setup_deadline = start + self.connect_timeout
        next_poll = 0.0

        def tick() -> None:
            nonlocal next_poll
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + ERROR_POLL_S
                self._poll_errors(reqs)
                self._raise_failed(reqs)

        try:
            self._ensure_comm(min(deadline, setup_deadline), tick)
        except _SetupTimeout as exc:
            if deadline < setup_deadline:
                return False                   # the caller's timeout, not a failed setup
            raise TransportError(f"{exc} (connect_timeout {self.connect_timeout:.0f}s)") from None
        try:
            next_poll = 0.0
            tick()
            with self._lock:
                self._raise_if_aborted()
                self._launch_pending(reqs)
            handles = {id(r.launch): r.launch for r in reqs if not r._done}
            while True:
                tick()
                self._raise_if_aborted()
                for key, h in list(handles.items()):
                    if self.api.progress(self._comm, h):
                        del handles[key]
                        self._complete(h)
                if not handles:
                    break
                if time.monotonic() > deadline:
                    return False
                self._wake.wait(POLL_S)
        except (TransportAborted, PeerReportedError, OpMismatch):
            raise
        except TransportError as exc:
            with self._lock:
                for r in self._pending:
                    r._error = r._error or exc
                self._pending.clear()
                self._failed = str(exc)
                self._drop_comm(str(exc))
            raise
        finally:
            waited = time.monotonic() - start
            for peer in {r.peer for r in reqs}:
                self._stats.add_wait(peer, waited)
        self._raise_failed(reqs)
        return True

    @staticmethod
    def _raise_failed(reqs: Sequence[NcclRequest]) -> None:
        for r in reqs:
            if r._error is not None:
                raise r._error

    def _complete(self, handle: Any) -> None:
        with self._lock:
            for r in self._pending:
                if r.launch is handle:
                    r._done = True
                    if r.kind == "recv":
                        self._check_header(r)
                    r.buf = r.header = None
                    (self._stats.add_sent if r.kind == "send" else self._stats.add_received)(r.peer, r.nbytes)
            self._pending = [r for r in self._pending if not r._done]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._drop_comm("transport closed")
            for r in self._pending:
                r._error = r._error or TransportError("transport closed")
            self._pending.clear()
            self._closed = True
            self.state = "closed"
            self._wake.set()
