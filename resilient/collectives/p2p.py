"""Point-to-point ``send``/``recv`` of a Communicator (``Communicator.send``/``recv``, and so
the torch backend's ``dist.send``/``recv``), matched whatever order the two ranks post them
in (``isend``/``irecv`` and ``dist.batch_isend_irecv``).

One responsibility: turn a send or receive into a transport request such that the ops
of one batch are on the wire together. torch issues ``batch_isend_irecv`` on a backend
like this one as a series of ``isend``/``irecv`` calls (its coalescing path is for the
C++ process groups), so a batch reaches us as single ops.

Why not one op-thread job per transfer that holds the thread until it is done: the
transport has one user, the Communicator's op thread, which runs one job at a time, so two
ranks that both post ``[irecv, isend]`` would wait in their irecv forever, the isends
queued behind it. Here each call is **registered** at once on the
caller's thread — its per-pair, per-direction sequence number taken in program order,
which is what pairs a send with its receive — and **posted** by whichever op-thread job
runs first: a job posts every op registered and not yet posted, and while it waits for
its own transfer keeps posting ops registered meanwhile (polling every 1–50 ms). Each
op's handle completes when its own transfer does; a batch is complete when all of its
handles are.

An **any-source receive** (``recv(src=None)``, :meth:`PointToPoint.recv_any`) registers a
*speculative* receive of every other member's next message (the transport takes a message
into it only if it fits, and leaves one that does not for a later receive); the first to
complete is the result. The others stay posted, each holding its peer's next message for
the next receive from that peer: one with the same descriptors takes it over as it is,
one with other descriptors withdraws it (``Transport.cancel_recv``; if its message has
already arrived, that message fits the any-source receive's descriptors, not the new
receive's, which fails with :class:`~resilient.errors.InputMismatch` and the message stays
for the next). So a pair's messages keep their order and none is dropped or taken twice.

Across an epoch change (a member died): the Communicator aborts the transport when an
epoch removes a member, which fails every pending request, those between live peers too.
The op-thread job that sees it (or finds the Communicator's epoch moved under it) **adopts
the new epoch itself** (:meth:`~resilient.collectives.Communicator.catch_up`: the entry
the next collective would make, ledger-status round among the survivors included), puts
its sent marks (:mod:`.p2p_marks`) and posts again, in the new epoch and under the same
sequence numbers, every op that had not finished; so both peers agree on the numbering
whatever each had finished, and a pipeline that only runs send/recv after a death keeps
going. Per op:

* its peer is not in the new epoch -> :class:`~resilient.errors.PeerLost` naming the peer
  and the epoch (a receive posted on a peer that then dies included: it never hangs);
* a receive whose message the sender had finished in the old epoch but that had not
  arrived (the transport drops an older epoch's frames) ->
  :class:`~resilient.errors.DataLost` naming the pair and the message number; the pair's
  later messages are unaffected;
* otherwise it completes in the new epoch.

A receive that did not complete is never reported done, so a partly written tensor is never
handed out as a result (its ``wait()`` raises). A link that breaks before the epoch comes
(:class:`~resilient.errors.TransportError` naming the peer) waits for the coordinator's
verdict up to ``epoch_timeout``: an epoch without the peer -> PeerLost; none -> the
TransportError. A sender's marks not published within ``epoch_timeout`` (it runs no
point-to-point op in the new epoch) -> :class:`~resilient.errors.CollectiveError` naming
it. A peer rank outside the group -> ConfigError, unless the group was that large
before and shrank (a member died; the ranks are the live group's): then
:class:`~resilient.errors.PeerLost` at issue, a CollectiveError a training loop already
handles, saying to read ``dist.get_rank()``/``get_world_size()`` again. A transfer with no progress for
``op_timeout`` seconds gets its peer reported suspect (as the Communicator's own
point-to-point does) and keeps waiting: the coordinator's verdict (an epoch that removes
the peer, or none) ends it.
"""
from __future__ import annotations

import json
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

import torch

from resilient.collectives.group import EpochLike
from resilient.collectives.ops import OpResult
from resilient.collectives.work import Work
from resilient.errors import (
    CollectiveError, ConfigError, EpochChanged, FrameError, InputMismatch, OpMismatch, PeerLost, PeerReportedError,
    RecordError, TransportAborted, TransportError, UnsupportedOperation,
)
from resilient.collectives import p2p_marks, tags
from resilient.transport.base import Request, Transport

#: first sequence number of point-to-point ops (their namespace, :mod:`.tags`)
P2P_SEQ_BASE = tags.p2p_seq(0)
_SEQ_MASK = (1 << 40) - 1
_POLL_MIN_S, _POLL_MAX_S = 0.001, 0.05
#: how long posting a speculative receive waits for its peer's sent marks before it is
#: left registered for the next pass (a peer that runs no send/recv must not stall it)
_SPEC_MARKS_WAIT_S = 0.05


class _NotYet(Exception):
    """A speculative receive's peer has not published its sent marks yet: post it later."""


class _P2PView(Protocol):
    """The group view as point-to-point uses it (suspects, the sent-marks blobs)."""

    def report_suspect(self, suspect_id: str, reason: str) -> None: ...

    def current(self) -> EpochLike | None: ...

    def put_blob(self, epoch: int, name: str, payload: bytes) -> None: ...

    def wait_blobs(self, epoch: int, name: str, members: Iterable[str], timeout: float) -> dict[str, bytes]: ...


class P2PHost(Protocol):
    """What :class:`PointToPoint` needs from the Communicator."""

    @property
    def member_id(self) -> str: ...
    @property
    def op_timeout(self) -> float | None: ...
    @property
    def epoch_timeout(self) -> float: ...
    @property
    def transport(self) -> Transport: ...
    @property
    def view(self) -> _P2PView: ...
    @property
    def epoch(self) -> EpochLike: ...

    @property
    def members(self) -> list[str]: ...

    def run_on_op_thread(self, fn: Callable[[], OpResult], async_op: bool = True) -> Work: ...

    def catch_up(self) -> None: ...


@dataclass
class _Op:
    peer: str
    buf: torch.Tensor
    n: int          # the pair's message number (program order)
    tag: int
    digest: int
    is_send: bool
    req: Request | None = None
    error: BaseException | None = None
    #: posted by an any-source receive on a peer, not claimed yet (:meth:`PointToPoint.recv_any`)
    speculative: bool = False
    #: a speculative receive of the same message, with other descriptors, this one takes over
    replaces: "_Op | None" = None

    @property
    def seq(self) -> int:
        return P2P_SEQ_BASE | (self.n & _SEQ_MASK)


def _digest(t: torch.Tensor) -> int:
    return zlib.crc32(json.dumps({"k": "p2p", "shape": list(t.shape), "dtype": str(t.dtype)},
                                 sort_keys=True).encode())


class PointToPoint:
    """The point-to-point ops of one Communicator (see the module docstring). Sequence
    numbers start at 0 with each Communicator, as on every peer (a rebuilt Communicator,
    ``CommunicatorEngine.rebuild``, has a fresh instance)."""

    def __init__(self, host: P2PHost) -> None:
        self.host = host
        self._lock = threading.Lock()
        self._registered: list[_Op] = []
        self._counts: dict[tuple[str, str], int] = {}
        #: op thread only: ops posted and not known finished; the epoch they are posted in;
        #: the peers' sent marks in that epoch (None: the first epoch, where none are needed)
        self._posted: list[_Op] = []
        self._epoch = host.epoch.number
        self._marks: dict[str, int] | None = None
        #: per peer, the speculative receives of any-source receives no receive has claimed
        #: yet, in message order (each holds that peer's next message, or waits for it)
        self._spec: dict[str, list[_Op]] = {}
        #: the largest group this member has been in (a rank below it was valid once)
        self._peak = len(host.members)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        """Send ``tensor`` to rank ``dst`` of the live group (``tensor`` must not change
        until the handle completes)."""
        return self._register(tensor, dst, tag, True)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        """Receive into ``tensor`` from rank ``src`` (written only when complete, for a
        non-contiguous ``tensor``; otherwise in place as bytes arrive)."""
        return self._register(tensor, src, tag, False)

    def recv_any(self, tensor: torch.Tensor, tag: int) -> Work:
        """Receive into ``tensor`` the first message that arrives, from any other member
        (``recv(src=None)``); the handle's contributors name the sender. A speculative
        receive is posted on every peer (``Transport.irecv_speculative``): the first to
        complete is taken, and each other one holds that peer's next message for the next
        receive from it (any-source or not; one with other descriptors withdraws it and
        posts its own: nothing is delivered twice or dropped). A peer that dies is left
        out; when none is left the handle fails with :class:`~resilient.errors.PeerLost`.
        Raises :class:`~resilient.errors.UnsupportedOperation` on a transport that
        matches by posting order alone (NCCL)."""
        if tensor.device.type != "cpu":
            raise UnsupportedOperation("an any-source receive of a device tensor", "pass src=<rank>")
        digest, me = _digest(tensor), self.host.member_id
        with self._lock:
            for peer in self.host.members:
                if peer != me and not self._spec.get(peer):
                    self._speculate(peer, tensor, tag, digest)
        return self.host.run_on_op_thread(lambda: self._drive_any(tensor, int(tag), digest), async_op=True)

    def _speculate(self, peer: str, like: torch.Tensor, tag: int, digest: int) -> None:
        """(Lock held.) Register a speculative receive of ``peer``'s next message."""
        key = (peer, self.host.member_id)
        n = self._counts.get(key, 0)
        self._counts[key] = n + 1
        op = _Op(peer, torch.empty(like.shape, dtype=like.dtype), n, int(tag), digest, False, speculative=True)
        self._registered.append(op)
        self._spec.setdefault(peer, []).append(op)

    def _register(self, tensor: torch.Tensor, peer_rank: int, tag: int, is_send: bool) -> Work:
        members: Sequence[str] = self.host.members
        self._peak = max(self._peak, len(members))
        if len(members) <= peer_rank < self._peak:
            raise PeerLost(f"rank {peer_rank} is not in this {len(members)}-member group any more: the group "
                           f"shrank from {self._peak} members (epoch {self.host.epoch.number}: a member died or "
                           "was removed); ranks are those of the live group: read dist.get_rank() and "
                           "dist.get_world_size() again", epoch=self.host.epoch.number)
        if not 0 <= peer_rank < len(members):
            raise ConfigError(f"rank {peer_rank} is not in this {len(members)}-member group (epoch "
                              f"{self.host.epoch.number}; ranks are those of the live group, dist.get_rank())")
        peer, me = members[peer_rank], self.host.member_id
        if tensor.is_contiguous() and tensor.device.type == "cpu":
            buf = tensor.detach()
        else:   # the transports move host bytes: a CUDA tensor goes through a host copy
            buf = tensor.detach().contiguous().cpu() if is_send else torch.empty(tensor.shape, dtype=tensor.dtype)
        key = (me, peer) if is_send else (peer, me)
        digest = _digest(tensor)
        with self._lock:
            held = None if is_send else self._spec.get(peer)
            if held:   # an any-source receive holds this peer's next message: take it over
                spec = held.pop(0)
                spec.speculative = False
                if (spec.digest, spec.tag, spec.buf.nbytes) == (digest, int(tag), buf.nbytes):
                    op = spec
                else:  # other descriptors: withdrawn and posted again as ours (on the op thread)
                    op = _Op(peer, buf, spec.n, int(tag), digest, False, replaces=spec)
                    self._registered.append(op)
            else:
                n = self._counts.get(key, 0)
                self._counts[key] = n + 1
                op = _Op(peer, buf, n, int(tag), digest, is_send)
                self._registered.append(op)
        return self.host.run_on_op_thread(lambda: self._drive(op, tensor), async_op=True)

    # -- op thread -----------------------------------------------------------------------

    def _post_registered(self) -> bool:
        """Post every registered op (in registration order); True if any. An op whose peer
        left the epoch, or a receive whose message was lost in an epoch change, gets its
        error instead. TransportAborted/EpochChanged (the epoch moved while reading a
        peer's marks) leave the unposted ops registered."""
        with self._lock:
            ops, self._registered = self._registered, []
        tr, members = self.host.transport, set(self.host.epoch.members)
        later: list[_Op] = []
        try:
            while ops:
                op = ops[0]
                if op.error is None and op.replaces is not None:
                    op.error = self._take_over(op, op.replaces)
                if op.error is None:
                    try:
                        op.error = self._refusal(op, members)
                    except _NotYet:
                        later.append(ops.pop(0))
                        continue
                if op.error is None:
                    post = tr.isend if op.is_send else (tr.irecv_speculative if op.speculative else tr.irecv)
                    op.req = post(op.peer, op.buf, op.seq, op.tag, op.digest)
                    self._posted.append(op)
                ops.pop(0)
        finally:
            if ops or later:
                with self._lock:
                    self._registered[:0] = later + ops
        return True

    def _take_over(self, op: _Op, spec: _Op) -> BaseException | None:
        """(Op thread.) ``op`` receives the message ``spec`` (a speculative receive with
        other descriptors) was posted for: withdraw ``spec`` if nothing of it arrived
        (None: ``op`` is posted in its place); else that message fits ``spec``, not
        ``op``: it is kept for the next receive from the peer and ``op`` fails."""
        tr = self.host.transport
        if spec.req is None or spec.error is not None or spec.req.error is not None or tr.cancel_recv(spec.req):
            with self._lock:
                if spec in self._registered:
                    self._registered.remove(spec)
            self._posted = [o for o in self._posted if o is not spec]
            spec.error = spec.error or TransportAborted("withdrawn: a receive with other descriptors took it over")
            return None
        with self._lock:
            spec.speculative = True
            self._spec.setdefault(spec.peer, []).insert(0, spec)
        return InputMismatch(f"point-to-point receive from {op.peer} of {tuple(op.buf.shape)} {op.buf.dtype} "
                             f"(tag {op.tag}): that member's next message is {tuple(spec.buf.shape)} "
                             f"{spec.buf.dtype} (tag {spec.tag}), as an earlier any-source receive asked; it is "
                             "kept for the next receive from that member")

    def _refusal(self, op: _Op, members: set[str]) -> BaseException | None:
        """Why ``op`` cannot run in the current epoch (None: it can)."""
        if op.peer not in members:
            return PeerLost(f"point-to-point {'send to' if op.is_send else 'receive from'} {op.peer}: it is not in "
                            f"epoch {self._epoch} (it died or was removed from the job)", op.peer, self._epoch)
        if op.is_send or self._marks is None:
            return None
        if op.peer not in self._marks:
            try:
                marks = self._read_marks(op.peer, _SPEC_MARKS_WAIT_S if op.speculative else None)
            except CollectiveError as exc:
                return exc
            self._marks[op.peer] = marks.get(self.host.member_id, 0)
        return p2p_marks.lost_message(op.peer, self.host.member_id, op.n, self._marks[op.peer], self._epoch)

    def _read_marks(self, peer: str, soon: float | None = None) -> dict[str, int]:
        """``peer``'s sent marks in the current epoch. Raises TransportAborted when the
        epoch moves meanwhile, CollectiveError after ``epoch_timeout`` (:class:`_NotYet`
        after ``soon`` seconds, when given)."""
        timeout = self.host.epoch_timeout if soon is None else soon
        deadline = time.monotonic() + timeout
        while True:
            try:
                raw = self.host.view.wait_blobs(self._epoch, p2p_marks.BLOB, [peer], max(0.0, deadline - time.monotonic()))
                return p2p_marks.decode(raw[peer], f"epochs/{self._epoch}/data/{p2p_marks.BLOB}/{peer}")
            except EpochChanged:
                if self.host.transport.aborted:
                    raise TransportAborted(f"epoch {self._epoch} was superseded") from None
                # a newer epoch that only adds members (not ours yet): keep waiting
            except RecordError as exc:
                raise CollectiveError(f"the point-to-point marks of {peer} in epoch {self._epoch} are malformed: "
                                      f"{exc}") from None
            except TimeoutError:
                if soon is not None:
                    raise _NotYet(peer) from None
                raise CollectiveError(f"{peer} did not publish its point-to-point marks for epoch {self._epoch} "
                                      f"within {timeout}s: it has run no send/recv since the group changed, so this "
                                      f"receive cannot tell whether its message was lost with the old epoch; the "
                                      f"receive must be matched by a send {peer} issues after the change") from None

    def _adopt(self) -> None:
        """The epoch moved (the transport was aborted, or a collective entered a newer
        one): enter the newest epoch, publish our sent marks there and queue every op that
        did not finish to be posted again (same numbers)."""
        self.host.catch_up()
        e = self.host.epoch
        if e.number == self._epoch:
            return
        me = self.host.member_id
        with self._lock:
            unfinished = [op for op in self._posted if op.error is None and not (op.req is not None and op.req.done())]
            for op in unfinished:
                op.req = None
            self._registered[:0] = unfinished
            marks = {peer: n for (src, peer), n in self._counts.items() if src == me}
            for op in self._registered:
                if op.is_send and op.error is None:
                    marks[op.peer] = min(marks[op.peer], op.n)
        self._posted = []
        self._epoch, self._marks = e.number, {}
        self.host.view.put_blob(e.number, p2p_marks.BLOB,
                                p2p_marks.encode({p: n for p, n in marks.items() if p in e.members}))

    def _await_verdict(self, op: _Op, exc: TransportError) -> None:
        """A link to ``op.peer`` failed before any epoch said so: wait (up to
        ``epoch_timeout``) for the coordinator's verdict, an epoch without the peer
        (returns: the caller adopts it); none -> re-raise ``exc``."""
        deadline = time.monotonic() + self.host.epoch_timeout
        while time.monotonic() < deadline:
            newest = self.host.view.current()
            if self.host.transport.aborted or (newest is not None and newest.number > self._epoch
                                               and op.peer not in newest.members):
                return
            time.sleep(0.01)
        raise exc

    def _drive(self, op: _Op, target: torch.Tensor) -> OpResult:
        """Op thread: wait for ``op``'s transfer, posting ops registered meanwhile and
        following the epoch (see the module docstring)."""
        try:
            self._wait(op)
        except BaseException as exc:
            if op.error is None:  # never posted again: its handle failed (the peer's marks say so)
                op.error = exc
            with self._lock:
                self._registered = [o for o in self._registered if o is not op]
            raise
        finally:
            self._posted = [o for o in self._posted if o is not op]
        if not op.is_send and op.buf is not target:
            target.copy_(op.buf)
        return OpResult((op.peer,))

    def _follow(self) -> bool:
        """(Op thread.) Adopt a newer epoch, post what was registered meanwhile; True if
        anything was posted (or failed instead)."""
        if self.host.transport.aborted or self.host.epoch.number != self._epoch:
            self._adopt()
        return bool(self._registered) and self._post_registered()

    def _drive_any(self, target: torch.Tensor, tag: int, digest: int) -> OpResult:
        """Op thread: wait until a speculative receive of ``target``'s descriptors
        completes on some peer, claim it and copy its message into ``target`` (see
        :meth:`recv_any`). A message that arrives first and does not fit raises
        :class:`~resilient.errors.InputMismatch` (as gloo's any-source receive fails on a
        size mismatch); it stays for the next receive from its sender."""
        tr, poll, turn = self.host.transport, _POLL_MIN_S, 0
        while True:
            try:
                if self._follow():
                    poll = _POLL_MIN_S
                op, pending, waiting = self._claim_any(target, tag, digest)
                if op is not None:
                    break
                misfit = next((r for r in pending if r.misfit()), None)
                if misfit is not None:
                    raise InputMismatch(f"any-source receive of {tuple(target.shape)} {target.dtype} (tag {tag}): the "
                                        f"message that came first, from {misfit.peer}, has other descriptors (shape, "
                                        "dtype or tag); it is kept for the next receive from that member")
                if not pending and not waiting:
                    raise PeerLost(f"any-source receive: no other member is left in epoch {self._epoch}",
                                   "", self._epoch)
                live = [r for r in pending if r.error is None]
                if live:
                    turn += 1
                    tr.wait([live[turn % len(live)]], timeout=poll)  # progresses every link's I/O
                else:
                    tr.idle(poll)   # links down: the coordinator's epoch decides
            except TransportAborted:
                continue
            except (OpMismatch, PeerReportedError, FrameError):
                raise
            except TransportError:
                continue  # a broken link to one peer: the others may still deliver; the epoch decides
            poll = min(_POLL_MAX_S, poll * 2)
        self._posted = [o for o in self._posted if o is not op]
        if op.error is not None:
            raise op.error
        target.copy_(op.buf)
        return OpResult((op.peer,))

    def _claim_any(self, target: torch.Tensor, tag: int, digest: int) -> tuple[_Op | None, list[Request], bool]:
        """(Op thread.) The speculative receive an any-source receive takes: the earliest
        completed (or failed other than by its peer's loss), removed from the held ones; else
        None, the requests still pending and whether a receive waits to be posted. A live
        peer with none held gets one."""
        me, members = self.host.member_id, self.host.epoch.members
        pending: list[Request] = []
        best: _Op | None = None
        waiting = False
        with self._lock:
            for peer in members:
                if peer == me:
                    continue
                held = self._spec.get(peer)
                if not held:
                    self._speculate(peer, target, tag, digest)
                    waiting = True
                    continue
                op = held[0]
                if (op.digest, op.tag) != (digest, tag):
                    continue   # that peer's next message is another any-source receive's
                if isinstance(op.error, PeerLost):
                    held.pop(0)
                    continue
                if op.error is not None:
                    best = op
                    break
                if op.req is None:
                    waiting = True   # registered, not posted yet (its peer's marks are awaited)
                    continue
                if op.req.done() and op.req.error is None:
                    if best is None or (op.req.done_at() or 0.0) < (best.req.done_at() or 0.0):  # type: ignore[union-attr]
                        best = op
                else:
                    pending.append(op.req)
            if best is not None:
                self._spec[best.peer].remove(best)
                best.speculative = False
        return best, pending, waiting

    def _wait(self, op: _Op) -> None:
        tr, timeout = self.host.transport, self.host.op_timeout
        poll = _POLL_MIN_S
        last_progress = time.monotonic()
        while True:
            try:
                if self._follow():
                    poll = _POLL_MIN_S
                if op.error is not None:
                    raise op.error
                if op.req is None:  # registered on the caller's thread before this job was queued
                    raise AssertionError("point-to-point op was not posted")
                if tr.wait([op.req], timeout=poll):
                    return
            except TransportAborted:
                continue  # the next pass adopts the new epoch and posts again
            except (OpMismatch, PeerReportedError, FrameError):
                raise
            except TransportError as exc:  # the link to a peer broke: wait for the coordinator's verdict
                if op.req is None or op.req.error is None:
                    raise
                self._await_verdict(op, exc)
                continue
            poll = min(_POLL_MAX_S, poll * 2)
            if timeout is not None and time.monotonic() - last_progress >= timeout:
                last_progress = time.monotonic()
                try:
                    self.host.view.report_suspect(op.peer, f"point-to-point with {op.peer} waited more than {timeout}s")
                except Exception:  # noqa: BLE001 - the report is advisory; keep waiting
                    pass
