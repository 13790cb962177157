"""The transport interface the collective algorithms are written against.

An algorithm never sees sockets, NCCL communicators or etcd: it posts tagged
point-to-point sends and receives of raw buffers to members of the current epoch and
waits on them. Layers:

* :class:`CoreTransport` — the small core (post send/recv with an opaque
  ``(op_seq, tag)``, wait, abort, close, stats); the top bits of ``op_seq`` are its
  namespace (:mod:`resilient.transport.tags`), which selects the matching channel;
* :class:`Transport` — the core plus the op-level guarantees (descriptor digests,
  :meth:`Transport.cancel_op`, :meth:`Transport.post_error`), implemented once for every
  transport: the bookkeeping in :mod:`resilient.transport.ops` (``OpGuard``), the two
  methods in :mod:`resilient.transport.op_layer` (``OpLayer``, the base of every
  concrete transport), which leaves a transport only the carrying of them.

Implementations: :mod:`resilient.transport.tcp` (CPU), :mod:`resilient.transport.hybrid`
(what members build: the TCP transport with shared-memory links between members on one
host, :mod:`resilient.transport.shm`), :mod:`resilient.transport.nccl` (GPUs); wrappers:
:mod:`resilient.transport.shaping` (slow/dropped links) and
:mod:`resilient.transport.retrying` (re-posting over a failed link). Every one of them
passes ``tests/test_transport_contract.py``.

Why the transport is ours (docs/design.md §3): when the coordinator publishes an epoch that
removes a peer, every blocked send/recv on every survivor must return *at once*, whatever
the peer's state (dead, SIGSTOPped, partitioned) — and the ledger needs to know exactly
which chunks arrived. Gloo's process groups (torch 2.13) keep a recv blocked on a hung
peer until their own timeout even after ``abort()``, and expose no chunk progress.

Contract every implementation keeps
-----------------------------------
* **Addressing.** Peers are member ids (strings) of the epoch passed to
  :meth:`Transport.configure`. A message is matched by ``(peer, op_seq, tag)``; messages
  between one ordered pair of members are delivered in the order they were posted, and
  the receiver posts its receives in the same order (algorithms are deterministic).
  Frames of the control namespace (:func:`control_seq`) are matched only with control
  receives, in their own order, so a control exchange never meets an op's data.
* **Buffers.** ``buf`` is a C-contiguous CPU ``torch.Tensor``/``numpy.ndarray`` or any
  object with the writable buffer protocol (a CUDA tensor for the NCCL transport).
  :meth:`irecv` writes straight into ``buf`` (no staging copy); the sizes must match
  exactly, otherwise :class:`~resilient.errors.FrameError`.
* **Epochs.** :meth:`configure` moves the transport to a new epoch. Connections to peers
  that are in both the old and the new epoch (same address) are kept; the others are
  closed and new ones opened lazily, with a handshake that carries job, epoch number,
  the epoch's token and the member id (a wrong token or job is refused). Data from an
  older epoch still in flight on a kept connection is discarded, never delivered.
* **Abort.** :meth:`abort` may be called from any thread (typically the epoch watcher's
  callback). Every request that is pending or waited on afterwards fails with
  :class:`~resilient.errors.TransportAborted` immediately (a wake-up pipe, not a
  timeout). The transport becomes usable again after the next :meth:`configure`.
* **Failures.** A peer that closes its connection or resets it makes the requests to and
  from it fail with :class:`~resilient.errors.TransportError` naming the peer; a corrupt
  frame raises :class:`~resilient.errors.FrameError`. Nothing received from the network
  is ever unpickled. A wait that passes ``timeout`` seconds returns ``False`` (the caller
  then reports the slow peer as suspect and keeps waiting or aborts) — it never raises by
  itself and never marks a request failed.
* **Unauthenticated peers.** Whoever can reach a listener may connect: until its HELLO
  is validated a connection costs a bounded share of descriptors, memory and time (caps
  and deadlines across connections), a HELLO never silently replaces a live link of the
  member it names, no announced frame length is allocated on trust, and nothing one
  connection does (a corrupt frame, an exception while serving it) fails more than that
  connection; each refusal or drop is counted in :attr:`TransportStats.dropped`.
* **Probes.** :meth:`Transport.probe` asks peers which op they are in (a waiting
  member calls it when a wait lasts, :mod:`resilient.collectives.op_context`): two members
  in one op with different descriptor digests both fail it with :class:`OpMismatch`,
  even when no data flows between them in that op; a peer that is merely slower is never
  failed by it. A bad probe frame is refused (counted in ``stats.dropped["bad_probe"]``)
  without closing the link.
* **Counters.** :attr:`stats` counts payload bytes sent/received (total and per peer) and
  the seconds the caller spent waiting on each peer (for straggler detection and for
  the ``resent_fraction`` of the recovery benchmark).
"""
from __future__ import annotations

import abc
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

from resilient.transport.ops import OpMismatch, PeerReportedError
from resilient.transport.tags import CONTROL_NAMESPACE, control_seq, is_control

# A C-contiguous tensor / ndarray / writable buffer-protocol object (the transports take
# whatever their device needs: CPU tensors/ndarrays for TCP, CUDA tensors for NCCL).
Buffer = Any

__all__ = [
    "Buffer", "CONTROL_NAMESPACE", "CoreTransport", "OpMismatch", "PeerReportedError", "Request", "Transport",
    "TransportStats", "buffer_nbytes", "control_seq", "is_control",
]


def buffer_nbytes(buf: Buffer) -> int:
    """Byte size of a tensor (any device) or buffer-protocol object."""
    if type(buf).__module__.startswith("torch"):
        return int(buf.numel() * buf.element_size())
    return memoryview(buf).nbytes


@dataclass
class TransportStats:
    """Byte and wait counters of one transport (monotonic; use :meth:`snapshot` to diff)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    sent_by_peer: dict[str, int] = field(default_factory=dict)
    received_by_peer: dict[str, int] = field(default_factory=dict)
    wait_s_by_peer: dict[str, float] = field(default_factory=dict)
    #: payload bytes of large DATA frames received from each peer, and the seconds from
    #: each such frame's header to its last byte (the link carrying it: a peer's lateness
    #: before a frame, and this member's waiting on it, are not in it)
    link_bytes_by_peer: dict[str, int] = field(default_factory=dict)
    link_s_by_peer: dict[str, float] = field(default_factory=dict)
    #: connections refused or dropped by the transport's hardening, by reason (e.g.
    #: ``handshake_timeout``, ``pending_evicted``, ``hello_refused``, ``link_taken``,
    #: ``protocol_error``, ``internal_error``, ``accept_emfile``)
    dropped: dict[str, int] = field(default_factory=dict)
    #: op probes (:meth:`Transport.probe`) by what happened: ``sent``, ``answered`` (a
    #: query this side answered), ``answers`` (answers read here), ``mismatch``
    probes: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_sent(self, peer: str, n: int) -> None:
        self.bytes_sent += n
        self.sent_by_peer[peer] = self.sent_by_peer.get(peer, 0) + n

    def add_received(self, peer: str, n: int) -> None:
        self.bytes_received += n
        self.received_by_peer[peer] = self.received_by_peer.get(peer, 0) + n

    def add_wait(self, peer: str, seconds: float) -> None:
        self.wait_s_by_peer[peer] = self.wait_s_by_peer.get(peer, 0.0) + seconds

    def add_link(self, peer: str, n: int, seconds: float) -> None:
        self.link_bytes_by_peer[peer] = self.link_bytes_by_peer.get(peer, 0) + n
        self.link_s_by_peer[peer] = self.link_s_by_peer.get(peer, 0.0) + seconds

    def add_dropped(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n

    def add_probe(self, what: str) -> None:
        self.probes[what] = self.probes.get(what, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able copy of the counters."""
        return {
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "sent_by_peer": dict(self.sent_by_peer),
            "received_by_peer": dict(self.received_by_peer),
            "wait_s_by_peer": dict(self.wait_s_by_peer),
            "link_bytes_by_peer": dict(self.link_bytes_by_peer),
            "link_s_by_peer": dict(self.link_s_by_peer),
            "dropped": dict(self.dropped),
            "probes": dict(self.probes),
        }


class Request(abc.ABC):
    """One posted send or receive. Completion is driven by :meth:`Transport.wait`."""

    peer: str
    nbytes: int
    op_seq: int
    #: a send (True) or a receive (False)
    is_send: bool = True

    @abc.abstractmethod
    def done(self) -> bool:
        """True once the whole buffer was sent/received (does not progress I/O)."""

    @property
    @abc.abstractmethod
    def error(self) -> BaseException | None:
        """The failure of this request, if it failed."""

    def touched(self) -> bool:
        """Whether any byte may have been written into a receive buffer (the ledger treats
        a touched, unfinished receive region as lost). Conservative default: True."""
        return True

    def done_at(self) -> float | None:
        """``time.monotonic()`` when the request completed, where the transport knows it."""
        return None

    def misfit(self) -> bool:
        """A speculative receive whose message arrived and does not fit it (the message
        waits for the receive posted after ``cancel_recv``)."""
        return False


class CoreTransport(abc.ABC):
    """The small core every transport implements: tagged point-to-point sends and
    receives of raw buffers within an epoch, wait, abort, close, counters (see the module
    docstring). ``op_seq`` and ``tag`` are opaque to the core except for their namespace
    (:mod:`resilient.transport.tags`), which selects the matching channel."""

    member_id: str

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """``host:port`` (or an implementation-specific string) peers use to reach us;
        published in this member's ``MemberInfo.address``."""

    @property
    @abc.abstractmethod
    def stats(self) -> TransportStats:
        """Byte and wait counters."""

    @abc.abstractmethod
    def configure(self, epoch: int, token: str, addresses: Mapping[str, str]) -> None:
        """Enter epoch ``epoch``: ``addresses`` maps every member of the epoch (this one
        included) to its address. Keeps connections to members present before and after,
        closes the rest, clears an abort. Does not block on peers (connections open
        lazily on first use)."""

    @abc.abstractmethod
    def isend(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request:
        """Post a send of the whole of ``buf`` to ``peer``. ``buf`` must stay unchanged
        until the request completes or fails. ``digest`` identifies the op descriptor
        (kind, shape, dtype, reduce op); the receiver compares it with its own."""

    @abc.abstractmethod
    def irecv(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request:
        """Post a receive of exactly ``nbytes(buf)`` bytes from ``peer`` into ``buf``. If
        the matching message carries a different ``digest``, the request fails with
        :class:`OpMismatch` (the ranks called different collectives at ``op_seq``)."""

    @abc.abstractmethod
    def wait(self, requests: Sequence[Request], timeout: float | None = None) -> bool:
        """Progress I/O until every request in ``requests`` is done: True. False when
        ``timeout`` passed first (requests stay posted). Raises
        :class:`~resilient.errors.TransportAborted` after :meth:`abort`,
        :class:`~resilient.errors.TransportError` when a peer of one of ``requests``
        failed, :class:`~resilient.errors.FrameError` on a corrupt frame."""

    @abc.abstractmethod
    def abort(self, reason: str) -> None:
        """Thread-safe, returns at once: every pending and future request fails with
        ``TransportAborted(reason)`` until the next :meth:`configure`."""

    @property
    @abc.abstractmethod
    def aborted(self) -> bool:
        """Whether an abort is in effect."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close every connection and the listener; idempotent. Pending requests fail
        with :class:`~resilient.errors.TransportError`, and so does every later post."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether :meth:`close` was called (a closed transport never recovers)."""

    def idle(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds while posted requests progress; return early
        once :meth:`abort` was called. Used by callers that hold no request of their own
        (a retry backing off). This default polls every 5 ms; transports with a wake-up
        mechanism override it to return within the syscall latency."""
        end = time.monotonic() + max(0.0, timeout)
        while not self.aborted:
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.005, left))


class JoinCarrier(Protocol):
    """A transport's side channel for join agreements
    (:mod:`resilient.collectives.join_agreement`; the TCP one: :mod:`~resilient.transport.tcp_join`).
    ``post_join``/``join_links`` may be called from any thread and return at once; the
    handler of ``on_join`` runs on the thread that progresses the transport, with
    ``(peer, agreement epoch, seq)`` (one handler per transport: the Communicator that
    runs on it now; ``drop_join(h)`` clears it only while it is ``h``, so a Communicator
    closed after its successor took the transport over leaves the successor's handler
    in place); ``joins_pending``: whether posted frames have not gone out yet
    (progressing thread only)."""

    def post_join(self, peer: str, epoch: int, seq: int) -> None: ...

    def join_links(self, peers: Sequence[str]) -> None: ...

    def on_join(self, handler: Callable[[str, int, int], None] | None) -> None: ...

    def drop_join(self, handler: Callable[[str, int, int], None]) -> None: ...

    def joins_pending(self) -> bool: ...


class Transport(CoreTransport):
    """A core transport with the op-level guarantees (digest checks, :meth:`cancel_op`,
    :meth:`post_error`); concrete transports get them from
    :class:`~resilient.transport.op_layer.OpLayer`, wrappers pass them on. Algorithms and
    the communicator use this interface."""

    @abc.abstractmethod
    def cancel_op(self, op_seq: int) -> None:
        """Drop every request of ``op_seq`` and discard its messages still arriving (used
        after an input mismatch; the transport stays usable for later ops)."""

    @abc.abstractmethod
    def post_error(self, peers: Sequence[str], op_seq: int, message: bytes, timeout: float = 2.0) -> None:
        """Send an ERROR message about ``op_seq`` to ``peers`` (best effort, bounded by
        ``timeout``); on the receivers every request of ``op_seq`` then fails with
        :class:`PeerReportedError` carrying ``message``."""

    @abc.abstractmethod
    def probe(self, peers: Sequence[str]) -> None:
        """Ask ``peers`` which collective op they are in, telling them ours: the newest
        op (collective namespace, non-zero digest) with a request pending here. Returns
        at once (the probes go out, and their answers are read, while requests are
        waited on). A peer in the same op with another descriptor digest fails that op
        with :class:`OpMismatch` on both sides (the ranks called different collectives,
        shapes or dtypes there, and no data between them would have shown it); a peer
        in another op, or in this op with our digest, changes nothing (it is slower, or
        waits for someone else). Never raises; a peer without a link, or with nothing
        pending, is not asked / does not answer."""

    def join_carrier(self) -> JoinCarrier | None:
        """The side channel join agreements travel over, None where this transport has
        none (NCCL: the agreement then uses one etcd key per old member)."""
        return None

    def irecv_speculative(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request:
        """Post a receive that takes ``peer``'s message of ``(op_seq, tag)`` only if it
        fits: the same digest, tag and length. A message that does not fit is neither
        delivered nor dropped: it stays buffered (the request stays pending, blocking that
        channel of the pair, as any unmatched receive does) until :meth:`cancel_recv`
        withdraws the request and a receive that fits is posted. What an any-source receive
        (``recv(src=None)``) posts on every peer. Raises
        :class:`~resilient.errors.UnsupportedOperation` where the transport matches by
        posting order alone (NCCL) and cannot leave a message for a later receive."""
        from resilient.errors import UnsupportedOperation

        raise UnsupportedOperation(f"an any-source receive on the {type(self).__name__}",
                                   "pass src=<rank>, or run point-to-point over the CPU transports")

    def cancel_recv(self, req: Request) -> bool:
        """Withdraw a posted receive no byte of which has arrived: True, and it fails
        with :class:`~resilient.errors.TransportAborted` (its message, should it come,
        meets the next receive posted for it). False when it cannot be withdrawn (done,
        failed, data arriving, or a transport that cannot): it stays as it was. Never
        raises."""
        return False

    # -- conveniences -------------------------------------------------------------------

    def send(self, peer: str, buf: Buffer, op_seq: int, tag: int) -> None:
        """Blocking :meth:`isend` (until sent or failed)."""
        self.wait([self.isend(peer, buf, op_seq, tag)])

    def recv_into(self, peer: str, buf: Buffer, op_seq: int, tag: int) -> None:
        """Blocking :meth:`irecv`."""
        self.wait([self.irecv(peer, buf, op_seq, tag)])

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
