"""Point-to-point ``send``/``recv`` of the torch backend, matched whatever order the two
ranks post them in (``isend``/``irecv`` and ``dist.batch_isend_irecv``).

One responsibility: turn a send or receive into a transport request such that the ops
of one batch are on the wire together. torch issues ``batch_isend_irecv`` on a backend
like this one as a series of ``isend``/``irecv`` calls (its coalescing path is for the
C++ process groups), so a batch reaches us as single ops.

Why not ``Communicator.send``/``recv``: the transport has one user, the Communicator's
op thread, which runs one op at a time, and those calls keep the thread until their own
transfer is done. Two ranks that both post ``[irecv, isend]`` then wait in their irecv
forever, the isends queued behind it. Here each call is **registered** at once on the
caller's thread — its per-pair, per-direction sequence number taken in program order,
which is what pairs a send with its receive — and **posted** by whichever op-thread job
runs first: a job posts every op registered and not yet posted, and while it waits for
its own transfer keeps posting ops registered meanwhile (polling every 1–50 ms). Each
op's handle completes when its own transfer does; a batch is complete when all of its
handles are.

Failure behaviour: a peer that dies mid-transfer ends the wait with a named
:class:`~resilient.errors.TransportError`: :class:`~resilient.errors.TransportAborted`
naming the epoch that removed it (the Communicator aborts the transport when an epoch
removes a member: every pending request then fails, on every link), or a TransportError
naming the peer when its link breaks first. A receive that did not complete is never
reported done, so a partly written tensor is never handed out as a result (its
``wait()`` raises). Until a collective (``dist.barrier()`` will do) takes the survivors
into the new epoch, later point-to-point ops fail at once with the same
TransportAborted. A peer rank outside the group -> ConfigError. A transfer with no
progress for ``op_timeout`` seconds gets its peer reported suspect (as the
Communicator's own point-to-point does) and keeps waiting: the coordinator's verdict
(an epoch that removes the peer, or none) ends it.
"""
from __future__ import annotations

import json
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from resilient.collectives.communicator import OpResult
from resilient.collectives.work import Work
from resilient.errors import ConfigError
from resilient.transport.base import Request, Transport

#: first sequence number of point-to-point ops (the Communicator's own p2p space; the
#: torch backend is its only user on a given transport, see the module docstring)
P2P_SEQ_BASE = 1 << 62
_SEQ_MASK = (1 << 40) - 1
_POLL_MIN_S, _POLL_MAX_S = 0.001, 0.05


class _SuspectSink(Protocol):
    def report_suspect(self, suspect_id: str, reason: str) -> None: ...


class P2PHost(Protocol):
    """What :class:`PointToPoint` needs from the Communicator (read-only)."""

    @property
    def member_id(self) -> str: ...
    @property
    def op_timeout(self) -> float | None: ...
    @property
    def transport(self) -> Transport: ...
    @property
    def view(self) -> _SuspectSink: ...

    @property
    def members(self) -> list[str]: ...

    def run_on_op_thread(self, fn: Callable[[], OpResult], async_op: bool = True) -> Work: ...


@dataclass
class _Op:
    peer: str
    buf: torch.Tensor
    seq: int
    tag: int
    digest: int
    is_send: bool
    req: Request | None = None


def _digest(t: torch.Tensor) -> int:
    return zlib.crc32(json.dumps({"k": "p2p", "shape": list(t.shape), "dtype": str(t.dtype)},
                                 sort_keys=True).encode())


class PointToPoint:
    """The point-to-point ops of one Communicator (see the module docstring). Sequence
    numbers start at 0 with each Communicator, as on every peer (a rebuilt Communicator
    gets a fresh instance)."""

    def __init__(self, host: P2PHost) -> None:
        self.host = host
        self._lock = threading.Lock()
        self._registered: list[_Op] = []
        self._counts: dict[tuple[str, str], int] = {}

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        """Send ``tensor`` to rank ``dst`` of the live group (``tensor`` must not change
        until the handle completes)."""
        return self._register(tensor, dst, tag, True)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        """Receive into ``tensor`` from rank ``src`` (written only when complete, for a
        non-contiguous ``tensor``; otherwise in place as bytes arrive)."""
        return self._register(tensor, src, tag, False)

    def _register(self, tensor: torch.Tensor, peer_rank: int, tag: int, is_send: bool) -> Work:
        members: Sequence[str] = self.host.members
        if not 0 <= peer_rank < len(members):
            raise ConfigError(f"rank {peer_rank} is not in this {len(members)}-member group")
        peer, me = members[peer_rank], self.host.member_id
        if tensor.is_contiguous() and tensor.device.type == "cpu":
            buf = tensor.detach()
        else:   # the transports move host bytes: a CUDA tensor goes through a host copy
            buf = tensor.detach().contiguous().cpu() if is_send else torch.empty(tensor.shape, dtype=tensor.dtype)
        key = (me, peer) if is_send else (peer, me)
        with self._lock:
            n = self._counts.get(key, 0)
            self._counts[key] = n + 1
            op = _Op(peer, buf, P2P_SEQ_BASE | (n & _SEQ_MASK), int(tag), _digest(tensor), is_send)
            self._registered.append(op)
        return self.host.run_on_op_thread(lambda: self._drive(op, tensor), async_op=True)

    def _post_registered(self) -> bool:
        """Op thread: post every registered op (in registration order); True if any."""
        with self._lock:
            ops, self._registered = self._registered, []
        tr = self.host.transport
        for op in ops:
            op.req = (tr.isend(op.peer, op.buf, op.seq, op.tag, op.digest) if op.is_send
                      else tr.irecv(op.peer, op.buf, op.seq, op.tag, op.digest))
        return bool(ops)

    def _drive(self, op: _Op, target: torch.Tensor) -> OpResult:
        """Op thread: wait for ``op``'s transfer, posting ops registered meanwhile."""
        tr, timeout = self.host.transport, self.host.op_timeout
        poll = _POLL_MIN_S
        last_progress = time.monotonic()
        while True:
            if self._post_registered():
                poll = _POLL_MIN_S
            if op.req is None:  # registered on the caller's thread before this job was queued
                raise AssertionError("point-to-point op was not posted")
            if tr.wait([op.req], timeout=poll):
                break
            poll = min(_POLL_MAX_S, poll * 2)
            if timeout is not None and time.monotonic() - last_progress >= timeout:
                last_progress = time.monotonic()
                try:
                    self.host.view.report_suspect(op.peer, f"point-to-point with {op.peer} waited more than {timeout}s")
                except Exception:  # noqa: BLE001 - the report is advisory; keep waiting
                    pass
        if not op.is_send and op.buf is not target:
            target.copy_(op.buf)
        return OpResult((op.peer,))
