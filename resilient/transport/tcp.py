"""TCP transport: non-blocking sockets progressed by the waiting thread, abortable at once.

Design (see :mod:`resilient.transport.base` for the contract):

* One listener per member; one connection per unordered pair, dialled by the member
  whose id sorts lower and opened lazily on the first request. The dialler's first frame
  is HELLO {job, epoch, token, member, session}; the acceptor checks job and token of
  *its* epoch (a HELLO from a newer epoch is parked until this side reaches it; an older
  one is refused by closing the connection).
* Hardening against whoever can reach the listener (:mod:`resilient.transport.handshake`):
  connections that have not completed a HELLO are capped in number and buffered bytes
  (across connections) and closed after a deadline; a HELLO is refused unless its job
  matches and its member id sorts below ours (only lower ids dial); a parked HELLO is
  watched for EOF; a second HELLO for a member whose link is live is refused (the token
  proves membership of the epoch, not identity) unless it comes from the same dialling
  transport (``session``) or the old link is really closed; EMFILE/ENFILE on accept
  evicts the oldest pending handshake or pauses accepting with a back-off (logged once).
  On member links, frames that arrive before their receive is posted are buffered up to
  ``early_cap`` bytes per connection; beyond that the connection stops being read until
  the receive is posted (TCP flow control holds the sender), so an announced length is
  never allocated on trust, and a DATA frame whose length differs from the posted
  receive is a protocol error for that connection only. Any exception while serving one
  connection (``MemoryError`` included) drops that connection and is counted in
  :attr:`TransportStats.dropped`; it never escapes into another connection's wait.
* No I/O thread: :meth:`TcpTransport.wait` runs a ``selectors`` loop in the calling
  thread, progressing every posted request (sends of later slices keep flowing while
  an earlier one is awaited). Payloads are written with ``sendmsg`` straight from the
  caller's buffer and read with ``recv_into`` straight into the destination buffer;
  4 MiB socket buffers and ``TCP_NODELAY``.
* :meth:`abort` sets a flag and writes one byte to a wake-up pipe that is part of every
  ``select`` — a blocked wait returns within the syscall latency, whatever the peer does.
  A frame half sent when aborted is completed with zero padding on the next use of a
  kept connection, and a frame half received is discarded, so the byte stream never
  desynchronises; frames of an older epoch or a cancelled op are discarded on arrival.
* A message that arrives before its receive is posted is buffered (one copy); when the
  receive is posted it is matched first.

Failure behaviour: EOF/reset on a connection fails every request to/from that peer with
:class:`~resilient.errors.TransportError` naming it (the communicator then reports the
peer as suspect and waits for the coordinator's verdict); a corrupt or unexpected frame
(:class:`~resilient.errors.FrameError`) or any other exception while serving a
connection closes that connection only, failing its requests with a
:class:`~resilient.errors.TransportError` that names the cause. :meth:`TcpTransport.configure`
raises :class:`~resilient.errors.FrameError` for an epoch number outside 0..2**64-1.
"""
from __future__ import annotations

import collections
import errno
import hmac
import logging
import os
import secrets
import selectors
import socket
import ssl
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from resilient.errors import FrameError, TransportAborted, TransportError
from resilient.transport import frames
from resilient.collectives.tags import same_namespace
from resilient.transport.base import (
    Buffer, OpMismatch, PeerReportedError, Request, Transport, TransportStats, is_control,
)
from resilient.transport.handshake import HandshakeLimits, PendingHandshakes, peer_closed
from resilient.transport.tls import TlsConfig, names_of

log = logging.getLogger(__name__)

SOCK_BUF = int(os.environ.get("RESILIENT_TCP_SOCKBUF", 4 << 20))
_SCRATCH = 1 << 20
#: bytes of early-arrival buffers kept for reuse
SPARE_CAP = 32 << 20
#: bytes of frames buffered per connection before their receive is posted; beyond it the
#: connection is not read until a receive is posted (a header never allocates on trust)
EARLY_CAP = int(os.environ.get("RESILIENT_TCP_EARLY_CAP", 256 << 20))
#: connections accepted per progress round (a connect flood cannot starve member links,
#: nor evict, in one round, pending handshakes that have not been read yet)
ACCEPT_BATCH = 16
#: accept pauses after EMFILE/ENFILE with nothing to evict: first and longest pause
ACCEPT_PAUSE_S, ACCEPT_PAUSE_MAX_S = 0.05, 1.0
#: ERROR messages kept per op, and ops with a kept error per epoch
ERROR_MESSAGE_CAP, ERRORS_PER_EPOCH = 4096, 4096
_FD_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: "try again later" from a non-blocking plain or TLS socket
_WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)
#: largest TLS write (without partial writes a record batch is retried whole)
_TLS_CHUNK = 256 << 10


def as_memoryview(buf: Buffer) -> memoryview:
    """A flat writable byte view of a contiguous CPU tensor, ndarray or buffer object."""
    if type(buf).__module__.startswith("torch"):
        import torch  # noqa: PLC0415 - only when a tensor is passed

        if buf.device.type != "cpu":
            raise TransportError(f"the TCP transport needs CPU tensors, got one on {buf.device}")
        if not buf.is_contiguous():
            raise TransportError("transport buffers must be contiguous; copy with .contiguous() first")
        if buf.numel() == 0:
            return memoryview(bytearray())
        buf = buf.reshape(-1).view(torch.uint8).numpy()
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise TransportError("transport buffers must be C-contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


class _Req(Request):
    __slots__ = ("peer", "nbytes", "op_seq", "tag", "digest", "mv", "offset", "_done", "_error", "is_send", "t_done", "header", "started")

    def __init__(self, peer: str, mv: memoryview, op_seq: int, tag: int, digest: int, is_send: bool) -> None:
        self.peer, self.mv, self.op_seq, self.tag, self.digest, self.is_send = peer, mv, op_seq, tag, digest, is_send
        self.nbytes = len(mv)
        self.offset = 0
        self._done = False
        self._error: BaseException | None = None
        self.t_done = 0.0
        self.header = b""
        self.started = False

    def done(self) -> bool:
        return self._done

    def touched(self) -> bool:
        return self.started or self._done

    @property
    def error(self) -> BaseException | None:
        return self._error

    def _finish(self) -> None:
        self._done = True
        self.t_done = time.monotonic()

    def _fail(self, exc: BaseException) -> None:
        if not self._done and self._error is None:
            self._error = exc


class _Conn:
    """One socket and its framing state (only touched by the progressing thread)."""

    def __init__(self, sock: socket.socket, peer: str | None, address: str | None) -> None:
        self.sock = sock
        self.peer = peer
        self.address = address
        self.connecting = False
        self.handshaken = peer is not None  # acceptor side: False until HELLO validated
        self.hello: dict | None = None  # acceptor: parsed HELLO waiting for our epoch
        self.sendq: collections.deque[_Req] = collections.deque()
        self.raw_out: collections.deque[memoryview] = collections.deque()  # HELLO / ERROR frames
        self.pad = 0
        self.pad_head: memoryview | None = None  # rest of a cut frame's header, sent before its padding
        self.recvq: collections.deque[_Req] = collections.deque()
        self.unexpected: collections.deque[tuple[frames.Header, bytearray]] = collections.deque()
        self.hdr = bytearray(frames.HEADER_SIZE)
        self.hdr_got = 0
        self.cur: frames.Header | None = None
        self.target: memoryview | None = None  # where the current payload goes
        self.target_req: _Req | None = None
        self.target_got = 0
        self.discard = 0
        self.parked = False   # member link: a header of a future epoch waits for configure()
        self.stalled = False  # member link: a header waits for its receive (early_cap reached)
        self.early_bytes = 0  # bytes of ``unexpected`` payloads (and one being read into)
        self.session = ""     # acceptor: the dialler's HELLO session
        self.origin = ""      # acceptor: remote address, for logs
        self.quiet = False    # parked HELLO that sent more bytes: no longer watched for EOF
        self.tls_handshaking = False  # TLS: handshake not finished (no frame I/O yet)
        self.tls_want_write = False
        self.failed: BaseException | None = None
        self.mask = 0

    def wants_write(self) -> bool:
        if self.tls_handshaking:
            return self.tls_want_write
        return self.connecting or bool(self.raw_out) or self.pad > 0 or self.pad_head is not None or bool(self.sendq)


class TcpTransport(Transport):
    """The CPU transport. Thread model: one thread at a time calls configure/isend/irecv/
    wait/cancel_op/post_error (the communicator's op thread); :meth:`abort` from any."""

    def __init__(self, member_id: str, job: str, host: str = "127.0.0.1", port: int = 0,
                 connect_timeout: float = 10.0, limits: HandshakeLimits | None = None,
                 early_cap: int = EARLY_CAP, tls: TlsConfig | None | bool = True) -> None:
        self.member_id = member_id
        self.job = job
        self.connect_timeout = connect_timeout
        self.limits = limits or HandshakeLimits.from_env()
        self.early_cap = early_cap
        self._session = secrets.token_hex(16)  # identifies this dialler's links; never published
        #: mutual TLS (``tls=True``: from the environment, see :mod:`resilient.transport.tls`;
        #: None/False: plain TCP)
        self.tls = TlsConfig.from_env() if tls is True else (tls or None)
        self._tls_ctx = self.tls.contexts() if self.tls is not None else None
        self._stats = TransportStats()
        self._sel = getattr(selectors, os.environ.get("RESILIENT_SELECTOR", "DefaultSelector"))()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, "listener")
        #: every listening socket (a subclass may add others); all are paused together
        self._listeners: list[Any] = [self._listener]
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._host = host
        self._port = self._listener.getsockname()[1]
        self._epoch = -1
        self._token = ""
        self._addresses: dict[str, str] = {}
        self._conns: dict[str, _Conn] = {}
        self._accepting: PendingHandshakes[_Conn] = PendingHandshakes(self.limits)
        self._accept_paused_until: float | None = None
        self._accept_pause = ACCEPT_PAUSE_S
        self._fd_warned = False
        self._abort_lock = threading.Lock()
        self._abort_reason: str | None = None
        self._abort_handled = False
        self._op_errors: dict[int, BaseException] = {}
        self._cancelled: set[int] = set()
        self._posted_errors: dict[int, bytes] = {}
        self._scratch = memoryview(bytearray(_SCRATCH))
        self._spare: dict[int, list[bytearray]] = {}   # reusable early-arrival buffers by size
        self._spare_bytes = 0
        self._closed = False

    # -- properties -------------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"{self._host}:{self._port}"

    @property
    def stats(self) -> TransportStats:
        return self._stats

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def aborted(self) -> bool:
        return self._abort_reason is not None

    # -- epoch ------------------------------------------------------------------------

    def configure(self, epoch: int, token: str, addresses: Mapping[str, str]) -> None:
        frames.check_u64("epoch", epoch)
        if epoch < self._epoch:
            raise TransportError(f"configure: epoch {epoch} is older than the current {self._epoch}")
        self._handle_abort()  # turn half-done frames into padding/discards first
        self._epoch, self._token = epoch, token
        addresses = dict(addresses)
        for peer, conn in list(self._conns.items()):
            if conn.failed is not None or addresses.get(peer) != self._addresses.get(peer) or peer not in addresses:
                self._drop(conn)
                continue
            for req in list(conn.sendq):
                if req.offset == 0:
                    conn.sendq.remove(req)
            conn.recvq.clear()
            if conn.target_req is not None:
                self._to_discard(conn)
            self._filter_unexpected(conn, lambda h: h.epoch >= epoch)
            conn.parked = conn.stalled = False
        self._addresses = addresses
        self._op_errors.clear()
        self._cancelled.clear()
        self._posted_errors.clear()
        with self._abort_lock:
            self._abort_reason = None
            self._abort_handled = False
        for conn in self._accepting:
            if conn.hello is not None:
                self._guarded(conn, self._validate_hello)
        for conn in list(self._conns.values()):
            if conn.cur is not None and conn.sock is not None and conn.failed is None:
                self._guarded(conn, self._read)
        self._update_masks()

    # -- posting ----------------------------------------------------------------------

    def isend(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request:
        req = _Req(peer, as_memoryview(buf), op_seq, tag, digest, True)
        conn = self._conn_for(req)
        if conn is not None:
            req.header = frames.encode_header(frames.Header(frames.DATA, self._epoch, op_seq, tag, req.nbytes, digest))
            conn.sendq.append(req)
            self._try_write(conn)
        return req

    def irecv(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request:
        req = _Req(peer, as_memoryview(buf), op_seq, tag, digest, False)
        conn = self._conn_for(req)
        if conn is not None:
            conn.recvq.append(req)
            self._match_unexpected(conn)
            if conn.stalled and conn.sock is not None and conn.failed is None:
                conn.stalled = False  # the waiting header may be this receive's (or fit now)
                self._guarded(conn, self._read)
        return req

    def _conn_for(self, req: _Req) -> _Conn | None:
        if self._closed:
            req._fail(TransportError("transport is closed"))
            return None
        if self._abort_reason is not None:
            req._fail(TransportAborted(self._abort_reason))
            return None
        if req.op_seq in self._op_errors:
            req._fail(self._op_errors[req.op_seq])
            return None
        if req.peer == self.member_id or req.peer not in self._addresses:
            req._fail(TransportError(f"member {req.peer!r} is not a peer in epoch {self._epoch}"))
            return None
        conn = self._conns.get(req.peer)
        if conn is None and self.member_id < req.peer:
            conn = self._dial(req.peer)
        if conn is None:
            # The peer dials us; the request waits for its connection to arrive.
            conn = _Conn(None, req.peer, self._addresses[req.peer])  # placeholder
            conn.handshaken = False
            self._conns[req.peer] = conn
        if conn.failed is not None:
            req._fail(conn.failed)
            return None
        return conn

    def _open_link(self, peer: str, address: str) -> tuple[socket.socket, int]:
        """A non-blocking socket that started connecting to ``peer`` at ``address``, and
        the errno of ``connect_ex`` (subclasses route some peers over other links)."""
        host, _, port = address.rpartition(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._tune(sock)
        sock.setblocking(False)
        return sock, sock.connect_ex((host, int(port)))

    def _dial(self, peer: str) -> _Conn:
        sock, err = self._open_link(peer, self._addresses[peer])
        conn = _Conn(sock, peer, self._addresses[peer])
        if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            sock.close()
            conn.sock = None
            conn.failed = TransportError(f"cannot connect to member {peer} at {self._addresses[peer]}: {os.strerror(err)}")
        else:
            conn.connecting = err != 0
            hello = frames.Hello(self.job, self._epoch, self._token, self.member_id, self._session)
            conn.raw_out.append(memoryview(frames.encode_hello(hello)))
            conn.raw_out.extend(memoryview(m) for m in self._posted_errors.values())
            self._sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
            conn.mask = selectors.EVENT_READ | selectors.EVENT_WRITE
            if not conn.connecting and self._tls_ctx is not None:
                self._start_tls(conn, server_side=False)
        self._conns[peer] = conn
        return conn

    # -- TLS --------------------------------------------------------------------------

    def _start_tls(self, conn: _Conn, server_side: bool) -> None:
        """Wrap ``conn``'s connected socket for mutual TLS; the handshake then runs
        non-blocking in :meth:`_tls_step` before any frame is read or written."""
        assert self._tls_ctx is not None and conn.sock is not None
        if conn.mask:
            self._sel.unregister(conn.sock)
            conn.mask = 0
        ctx = self._tls_ctx[0 if server_side else 1]
        conn.sock = ctx.wrap_socket(conn.sock, server_side=server_side, do_handshake_on_connect=False)
        conn.tls_handshaking, conn.tls_want_write = True, not server_side

    def _tls_step(self, conn: _Conn) -> bool:
        """Advance the TLS handshake of ``conn``; True once it is done. A failed handshake
        (no or a foreign certificate, plain TCP, EOF) or, with ``verify_member``, an
        acceptor whose certificate does not name the member we dialled closes ``conn``."""
        sock = conn.sock
        assert isinstance(sock, ssl.SSLSocket) and self.tls is not None
        try:
            sock.do_handshake()
        except ssl.SSLWantReadError:
            conn.tls_want_write = False
            return False
        except ssl.SSLWantWriteError:
            conn.tls_want_write = True
            return False
        except (ssl.SSLError, OSError, ValueError) as exc:
            self._drop_conn(conn, "tls_refused", f"TLS handshake failed: {exc}")
            return False
        conn.tls_handshaking = conn.tls_want_write = False
        if conn.handshaken and self.tls.verify_member and conn.peer not in names_of(sock.getpeercert()):
            self._drop_conn(conn, "tls_identity", f"its certificate does not name member {conn.peer}")
            return False
        return True

    def _send(self, conn: _Conn, mv: memoryview) -> int:
        sock = conn.sock
        assert sock is not None
        return sock.send(mv[:_TLS_CHUNK] if isinstance(sock, ssl.SSLSocket) else mv)

    @staticmethod
    def _tune(sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in ((socket.SO_SNDBUF, socket.SO_RCVBUF) if SOCK_BUF > 0 else ()):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
            except OSError:  # pragma: no cover - capped by the kernel
                pass

    # -- abort / cancel / errors --------------------------------------------------------

    def abort(self, reason: str) -> None:
        with self._abort_lock:
            if self._abort_reason is None:
                self._abort_reason = reason
        try:
            os.write(self._wake_w, b"!")
        except (BlockingIOError, OSError):
            pass

    def _handle_abort(self) -> None:
        """In the progressing thread: fail requests, turn half frames into padding."""
        if self._abort_reason is None or self._abort_handled:
            return
        self._abort_handled = True
        exc = TransportAborted(self._abort_reason)
        for conn in self._conns.values():
            self._cut(conn, exc, lambda r: True)

    def _cut(self, conn: _Conn, exc: BaseException, which) -> None:
        keep: collections.deque[_Req] = collections.deque()
        for req in conn.sendq:
            if not which(req):
                keep.append(req)
                continue
            req._fail(exc)
            if req.offset > 0:  # half written: finish the frame (header first) with zeros
                hl = len(req.header)
                if req.offset < hl:
                    conn.pad_head = memoryview(req.header)[req.offset:]
                conn.pad += req.nbytes - max(0, req.offset - hl)
        conn.sendq = keep
        for req in [r for r in conn.recvq if which(r)]:
            req._fail(exc)
            conn.recvq.remove(req)
        if conn.target_req is not None and which(conn.target_req):
            conn.target_req._fail(exc)
            self._to_discard(conn)

    def _to_discard(self, conn: _Conn) -> None:
        req = conn.target_req
        if req is not None and req in conn.recvq:
            conn.recvq.remove(req)
        conn.discard = len(conn.target) - conn.target_got if conn.target is not None else 0
        conn.target, conn.target_req, conn.cur = None, None, None
        conn.target_got = 0

    def cancel_op(self, op_seq: int) -> None:
        self._cancelled.add(op_seq)
        exc = self._op_errors.get(op_seq) or TransportAborted(f"op #{op_seq} was cancelled")
        for conn in self._conns.values():
            self._cut(conn, exc, lambda r: r.op_seq == op_seq)
            self._filter_unexpected(conn, lambda h: h.op_seq != op_seq)
        self._update_masks()

    def post_error(self, peers: Sequence[str], op_seq: int, message: bytes, timeout: float = 2.0) -> None:
        header = frames.encode_header(frames.Header(frames.ERROR, self._epoch, op_seq, 0, len(message)))
        self._posted_errors[op_seq] = header + message  # also sent on connections opened later
        conns = []
        for peer in peers:
            if peer == self.member_id or peer not in self._addresses or self._closed:
                continue
            conn = self._conns.get(peer)
            if conn is None and self.member_id < peer:
                conn = self._dial(peer)
            if conn is None or conn.failed is not None:
                continue  # no connection and the peer dials us: it learns through the others (relay)
            conn.raw_out.append(memoryview(header + message))
            self._try_write(conn)
            conns.append(conn)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(c.raw_out and c.failed is None and c.sock is not None for c in conns):
            self._progress(0.05)

    # -- progress ---------------------------------------------------------------------

    def wait(self, requests: Sequence[Request], timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        t0 = time.monotonic()
        try:
            while True:
                if self._abort_reason is not None:
                    self._handle_abort()
                    raise TransportAborted(self._abort_reason)
                pending = False
                for req in requests:
                    if req.error is not None:
                        raise req.error
                    if not req.done():
                        pending = True
                        err = self._op_errors.get(req.op_seq)  # type: ignore[attr-defined]
                        if err is not None:
                            raise err
                if not pending:
                    return True
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._progress(remaining)
        finally:
            for req in requests:
                if not req.is_send and req.done():  # type: ignore[attr-defined]
                    self._stats.add_wait(req.peer, max(0.0, req.t_done - t0))  # type: ignore[attr-defined]

    def idle(self, timeout: float) -> None:
        """Progress I/O for up to ``timeout`` seconds; returns as soon as :meth:`abort` is
        called (its wake-up byte ends the ``select``)."""
        if self._abort_reason is None and not self._closed:
            self._progress(max(0.0, timeout))

    def _progress(self, timeout: float | None) -> None:
        self._update_masks()
        timer = self._next_timer()
        if timer is not None:
            left = max(0.0, timer - time.monotonic())
            timeout = left if timeout is None else min(timeout, left)
        events = self._sel.select(timeout)
        accept = False
        for key, mask in events:
            data = key.data
            if data == "wake":
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
            elif data == "listener":
                accept = True  # after the connections: read pending HELLOs before evicting any
            else:
                conn: _Conn = data
                if conn.failed is not None or conn.sock is None:
                    continue
                self._guarded(conn, lambda c, m=mask: self._serve(c, m))
        if accept:
            self._accept()
        self._timers()
        self._update_masks()

    def _serve(self, conn: _Conn, mask: int) -> None:
        if conn.tls_handshaking and not self._tls_step(conn):
            return
        if not conn.handshaken and conn.hello is not None:  # a parked HELLO: only watch for EOF
            self._watch_parked(conn)
            return
        if mask & selectors.EVENT_WRITE:
            self._try_write(conn)
        if mask & selectors.EVENT_READ and conn.failed is None:
            self._read(conn)

    def _guarded(self, conn: _Conn, fn: Callable[[_Conn], None]) -> None:
        """Run ``fn(conn)``; whatever it raises closes ``conn`` only (counted, logged)."""
        try:
            fn(conn)
        except FrameError as exc:
            self._drop_conn(conn, "protocol_error", f"protocol error: {exc}")
        except Exception as exc:  # noqa: BLE001 - MemoryError, struct.error, a bug: never wedge the member
            self._drop_conn(conn, "internal_error", f"{type(exc).__name__} while serving it: {exc}")

    def _drop_conn(self, conn: _Conn, reason: str, why: str) -> None:
        who = f"member {conn.peer}" if conn.handshaken else f"unauthenticated connection {conn.origin or '?'}"
        self._note(reason, f"closed the connection from/to {who}: {why}")
        self._fail_conn(conn, TransportError(f"connection to {who} closed: {why}"))

    def _note(self, reason: str, message: str) -> None:
        """Count a dropped/refused connection; log the 1st, 10th, 100th... of each reason."""
        self._stats.add_dropped(reason)
        n = self._stats.dropped[reason]
        if str(n).rstrip("0") == "1":  # 1, 10, 100, ...
            log.warning("transport %s: %s (%s #%d)", self.member_id, message, reason, n)

    def _next_timer(self) -> float | None:
        t = self._accepting.next_deadline()
        if self._accept_paused_until is not None:
            t = self._accept_paused_until if t is None else min(t, self._accept_paused_until)
        return t

    def _timers(self) -> None:
        """Reap handshakes past their deadline; resume accepting after a pause."""
        now = time.monotonic()
        for conn in self._accepting.expired(now):
            parked = self._accepting.is_parked(conn)
            self._drop_conn(conn, "parked_timeout" if parked else "handshake_timeout",
                            f"no {'configure() for its epoch' if parked else 'complete HELLO'} within "
                            f"{self.limits.parked_timeout_s if parked else self.limits.timeout_s}s")
        if self._accept_paused_until is not None and now >= self._accept_paused_until and not self._closed:
            self._accept_paused_until = None
            for listener in self._listeners:
                self._sel.register(listener, selectors.EVENT_READ, "listener")

    def _update_masks(self) -> None:
        for conn in list(self._conns.values()) + list(self._accepting):
            if conn.sock is None or conn.failed is not None:
                continue
            if conn.tls_handshaking:
                mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.tls_want_write else 0)
            elif not conn.handshaken and conn.hello is not None:
                mask = 0 if conn.quiet else selectors.EVENT_READ  # parked HELLO: EOF watch
            else:
                mask = 0 if conn.parked or conn.stalled else selectors.EVENT_READ
                if conn.wants_write() and conn.handshaken_or_dialer():
                    mask |= selectors.EVENT_WRITE
            if mask != conn.mask:
                if conn.mask == 0:
                    self._sel.register(conn.sock, mask, conn)
                elif mask == 0:
                    self._sel.unregister(conn.sock)
                else:
                    self._sel.modify(conn.sock, mask, conn)
                conn.mask = mask

    def _fail_conn(self, conn: _Conn, exc: BaseException) -> None:
        if conn.failed is None:
            conn.failed = exc
        for req in list(conn.sendq) + list(conn.recvq) + ([conn.target_req] if conn.target_req else []):
            req._fail(conn.failed)
        conn.sendq.clear()
        conn.recvq.clear()
        conn.raw_out.clear()
        conn.unexpected.clear()
        conn.early_bytes = 0
        conn.target = conn.target_req = conn.cur = None
        self._close_sock(conn)
        self._accepting.remove(conn)

    def _close_sock(self, conn: _Conn) -> None:
        if conn.sock is not None:
            if conn.mask:
                try:
                    self._sel.unregister(conn.sock)
                except (KeyError, ValueError):
                    pass
            conn.mask = 0
            try:
                conn.sock.close()
            except OSError:
                pass
            conn.sock = None

    def _drop(self, conn: _Conn) -> None:
        self._fail_conn(conn, TransportError(f"connection to member {conn.peer} closed: it is not in epoch {self._epoch}"))
        if conn.peer is not None and self._conns.get(conn.peer) is conn:
            del self._conns[conn.peer]

    # -- accept / handshake -----------------------------------------------------------

    def _accept(self) -> None:
        for listener in list(self._listeners):
            if self._accept_paused_until is None:
                self._accept_from(listener)

    def _accept_from(self, listener: Any) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _FD_ERRNOS and self._out_of_descriptors(exc):
                    continue
                return  # ECONNABORTED and the like: the next round tries again
            self._accept_pause = ACCEPT_PAUSE_S
            conn = _Conn(sock, None, None)
            conn.handshaken = False
            conn.origin = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            for old in self._accepting.add(conn, time.monotonic()):
                self._drop_conn(old, "pending_evicted", f"more than {self.limits.max_pending} pending handshakes")
            try:
                self._tune(sock)
                sock.setblocking(False)
                self._sel.register(sock, selectors.EVENT_READ, conn)
                conn.mask = selectors.EVENT_READ
                if self._tls_ctx is not None:
                    self._start_tls(conn, server_side=True)
            except (OSError, ValueError) as exc:
                self._drop_conn(conn, "internal_error", f"cannot set up the accepted socket: {exc}")
                continue
            self._guarded(conn, self._read)  # its HELLO is usually there already

    def _out_of_descriptors(self, exc: OSError) -> bool:
        """EMFILE/ENFILE on accept: close the oldest pending handshake (True: accept
        again) or, with none, stop accepting for a growing pause (False). Logged
        once per transport (then only counted in ``stats.dropped["accept_emfile"]``); never
        spins on a listener that stays readable."""
        self._stats.add_dropped("accept_emfile")
        if not self._fd_warned:
            self._fd_warned = True
            log.warning("transport %s: accept() failed (%s): out of file descriptors; closing pending handshakes "
                        "and pausing accepts (raise the limit with `ulimit -n`)", self.member_id, exc)
        victim = next(iter(self._accepting), None)
        if victim is not None:
            self._drop_conn(victim, "pending_evicted", "out of file descriptors")
            return True
        self._accept_paused_until = time.monotonic() + self._accept_pause
        self._accept_pause = min(ACCEPT_PAUSE_MAX_S, self._accept_pause * 2)
        for listener in self._listeners:
            try:
                self._sel.unregister(listener)
            except (KeyError, ValueError):
                pass
        return False

    def _watch_parked(self, conn: _Conn) -> None:
        """A parked HELLO's socket is readable: closed by its peer (reap it) or the
        dialler already sent frames (keep them unread; stop watching)."""
        if peer_closed(conn.sock):
            self._drop_conn(conn, "parked_closed", "the peer closed it while its HELLO was parked")
        else:
            conn.quiet = True

    def _validate_hello(self, conn: _Conn) -> None:
        h = conn.hello
        assert h is not None
        member = h.member
        if h.job != self.job:
            self._drop_conn(conn, "hello_refused", f"HELLO for job {h.job[:80]!r}, this is {self.job!r}")
            return
        if not member < self.member_id:
            self._drop_conn(conn, "hello_refused", f"HELLO from {member[:80]!r}: only members whose id sorts "
                                                   f"below {self.member_id!r} dial it")
            return
        if h.epoch > self._epoch:
            self._accepting.park(conn, time.monotonic())  # token checked once we reach that epoch
            return
        if (h.epoch < self._epoch or not hmac.compare_digest(h.token.encode(), self._token.encode())
                or member not in self._addresses):
            self._drop_conn(conn, "hello_refused", f"HELLO from {member[:80]!r}: epoch {h.epoch}/token/member "
                                                   f"does not match epoch {self._epoch}")
            return
        if self.tls is not None and self.tls.verify_member and member not in names_of(conn.sock.getpeercert()):
            self._drop_conn(conn, "tls_identity", f"HELLO naming member {member[:80]!r}, which its certificate "
                                                  f"does not name")
            return
        old = self._conns.get(member)
        live = old is not None and old.sock is not None and old.failed is None
        if live and not (h.session and h.session == old.session) and not peer_closed(old.sock):
            self._drop_conn(conn, "link_taken", f"HELLO naming member {member}, whose link from "
                                                f"{old.origin or '?'} is live (the epoch token proves membership, not "
                                                f"identity; a genuine reconnect is accepted once the old link is closed)")
            return
        self._accepting.remove(conn)
        conn.peer, conn.address, conn.handshaken, conn.hello = member, self._addresses[member], True, None
        conn.session, conn.quiet = h.session, False
        if old is not None:
            if old.sock is None and old.failed is None:  # placeholder with waiting requests
                conn.sendq, conn.recvq, conn.raw_out = old.sendq, old.recvq, old.raw_out
                for req in conn.sendq:
                    if not req.header:
                        req.header = frames.encode_header(frames.Header(frames.DATA, self._epoch, req.op_seq, req.tag, req.nbytes, req.digest))
            else:
                self._fail_conn(old, TransportError(f"member {member} reconnected; the old connection is closed"))
        conn.raw_out.extend(memoryview(m) for m in self._posted_errors.values())
        self._conns[member] = conn

    # -- writing ----------------------------------------------------------------------

    def _try_write(self, conn: _Conn) -> None:
        sock = conn.sock
        if sock is None or conn.failed is not None or not conn.handshaken_or_dialer():
            return
        if conn.connecting:
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err == 0:
                try:
                    sock.getpeername()
                except OSError:
                    return  # still connecting
                conn.connecting = False
            elif err in (errno.EINPROGRESS, errno.EALREADY):
                return
            else:
                self._fail_conn(conn, TransportError(f"cannot connect to member {conn.peer} at {conn.address}: {os.strerror(err)}"))
                return
            if self._tls_ctx is not None:
                self._start_tls(conn, server_side=False)
        if conn.tls_handshaking and not self._tls_step(conn):
            return
        sock = conn.sock
        try:
            while True:
                # Control frames (HELLO/ERROR) go out only at a frame boundary: never inside
                # the padding of a cut frame or a half-written DATA frame (that would
                # desynchronise the peer's byte stream).
                if conn.pad_head is not None:
                    n = self._send(conn, conn.pad_head)
                    conn.pad_head = conn.pad_head[n:] if n < len(conn.pad_head) else None
                    if n == 0:
                        return
                    continue
                if conn.pad > 0:
                    n = self._send(conn, self._zeros(min(conn.pad, _SCRATCH)))
                    conn.pad -= n
                    if n == 0:
                        return
                    continue
                if conn.raw_out and not (conn.sendq and conn.sendq[0].offset > 0):
                    mv = conn.raw_out[0]
                    n = self._send(conn, mv)
                    if n < len(mv):
                        conn.raw_out[0] = mv[n:]
                        return
                    conn.raw_out.popleft()
                    continue
                if not conn.sendq:
                    return
                req = conn.sendq[0]
                hl = len(req.header)
                if req.offset < hl:
                    head = memoryview(req.header)[req.offset:]
                    tls = isinstance(sock, ssl.SSLSocket)  # no sendmsg: header, then payload
                    n = sock.sendmsg([head, req.mv]) if req.nbytes and not tls else self._send(conn, head)
                    payload = max(0, req.offset + n - hl)
                else:
                    n = self._send(conn, req.mv[req.offset - hl:])
                    payload = n
                req.offset += n
                if payload:
                    self._stats.add_sent(req.peer, payload)
                if req.offset >= hl + req.nbytes:
                    conn.sendq.popleft()
                    req._finish()
                elif n == 0:
                    return
        except _WOULD_BLOCK:
            return
        except OSError as exc:
            self._fail_conn(conn, TransportError(f"connection to member {conn.peer} failed while sending: {exc}"))

    _zero_buf: memoryview | None = None

    def _zeros(self, n: int) -> memoryview:
        if TcpTransport._zero_buf is None:
            TcpTransport._zero_buf = memoryview(bytes(_SCRATCH))
        return TcpTransport._zero_buf[:n]

    # -- reading ----------------------------------------------------------------------

    def _read(self, conn: _Conn) -> None:
        """Read what ``conn`` has. Raises :class:`FrameError` on a bad or unexpected frame
        (the caller's :meth:`_guarded` closes the connection); EOF/reset fail it here."""
        if conn.tls_handshaking and not self._tls_step(conn):
            return
        sock = conn.sock
        try:
            while sock is not None and conn.failed is None and not conn.parked and not conn.stalled:
                if conn.discard > 0:
                    n = sock.recv_into(self._scratch, min(conn.discard, _SCRATCH))
                    if n == 0:
                        raise EOFError
                    conn.discard -= n
                    continue
                if conn.target is not None:
                    n = sock.recv_into(conn.target[conn.target_got:]) if conn.target_got < len(conn.target) else 0
                    if n == 0 and conn.target_got < len(conn.target):
                        raise EOFError
                    conn.target_got += n
                    if conn.target_req is not None and n:
                        self._stats.add_received(conn.peer or "?", n)
                    if conn.target_got >= len(conn.target):
                        self._payload_done(conn)
                    continue
                if conn.cur is not None:  # a header parked until configure() or matched late
                    self._route(conn)
                    continue
                if conn.hello is not None:  # a parked HELLO: nothing more is read before configure()
                    return
                if conn.hdr_got < frames.HEADER_SIZE:
                    n = sock.recv_into(memoryview(conn.hdr)[conn.hdr_got:])
                    if n == 0:
                        raise EOFError
                    conn.hdr_got += n
                    if conn.hdr_got < frames.HEADER_SIZE:
                        continue
                    conn.hdr_got = 0
                    conn.cur = frames.decode_header(conn.hdr)
                    continue
                return
        except _WOULD_BLOCK:
            return
        except FrameError:
            raise
        except EOFError:
            self._fail_conn(conn, TransportError(f"member {conn.peer or '(handshaking)'} closed the connection"))
        except OSError as exc:
            self._fail_conn(conn, TransportError(f"connection to member {conn.peer} failed while receiving: {exc}"))

    def _route(self, conn: _Conn) -> None:
        """A header was read: decide where its payload goes. Nothing is allocated for an
        announced length beyond the caps (HELLO: the pending-handshake byte budget; early
        DATA: ``early_cap``); a header that does not fit waits (``stalled``)."""
        h = conn.cur
        assert h is not None
        if not conn.handshaken:
            if h.kind != frames.HELLO:
                raise FrameError("the first frame on a connection must be HELLO")
            evicted = self._accepting.reserve(conn, h.length)
            if evicted is None:
                raise FrameError(f"HELLO of {h.length} bytes exceeds the pending-handshake budget")
            for old in evicted:
                self._drop_conn(old, "pending_evicted", f"pending HELLOs over {self.limits.max_bytes} bytes")
            conn.target, conn.target_got, conn.target_req = memoryview(bytearray(h.length)), 0, None
            return
        if h.kind in (frames.HELLO, frames.ERROR):
            conn.target, conn.target_got, conn.target_req = memoryview(bytearray(h.length)), 0, None
            return
        if h.epoch < self._epoch or h.op_seq in self._cancelled:
            conn.discard, conn.cur = h.length, None
            return
        if h.epoch > self._epoch:
            conn.parked = True  # resume after configure(); header is kept in conn.cur
            return
        req = self._head_recv(conn, is_control(h.op_seq))
        if req is None:
            self._buffer_early(conn, h)
            return
        if same_namespace(h.op_seq, req.op_seq) and h.op_seq != req.op_seq:
            if h.op_seq < req.op_seq:
                conn.discard, conn.cur = h.length, None  # left over from an op this side already ended
            else:  # a later op's frame (the sender finished or abandoned this op): keep it for that op
                self._buffer_early(conn, h)
            return
        self._check_match(conn, req, h)
        if req.error is not None:
            conn.recvq.remove(req)
            conn.discard, conn.cur = h.length, None
            return
        conn.target, conn.target_got, conn.target_req = req.mv, 0, req
        req.started = True

    def _buffer_early(self, conn: _Conn, h: frames.Header) -> None:
        """Read a frame whose receive is not posted into a spare buffer, if it fits the
        connection's ``early_cap``; else stop reading until a receive is posted."""
        if conn.early_bytes + h.length > self.early_cap:
            conn.stalled = True
            return
        conn.early_bytes += h.length
        conn.target, conn.target_got, conn.target_req = memoryview(self._spare_buf(h.length)), 0, None

    def _check_match(self, conn: _Conn, req: _Req, h: frames.Header) -> None:
        if h.digest != req.digest:
            exc = OpMismatch(conn.peer or "?", req.op_seq, h.digest, req.digest)
            self._op_errors.setdefault(req.op_seq, exc)
            req._fail(exc)
        elif (h.op_seq, h.tag) != (req.op_seq, req.tag) or h.length != req.nbytes:
            raise FrameError(
                f"member {conn.peer} sent op #{h.op_seq} tag {h.tag:#x} ({h.length} bytes) where op #{req.op_seq} "
                f"tag {req.tag:#x} ({req.nbytes} bytes) was expected: the ranks disagree on the algorithm")

    def _payload_done(self, conn: _Conn) -> None:
        h, target, req = conn.cur, conn.target, conn.target_req
        conn.cur, conn.target, conn.target_req, conn.target_got = None, None, None, 0
        assert h is not None and target is not None
        if not conn.handshaken:
            self._accepting.release(conn)
            conn.hello = frames.decode_hello(target)
            self._validate_hello(conn)
            return
        if h.kind == frames.HELLO:
            return
        if h.kind == frames.ERROR:
            if h.epoch >= self._epoch and (h.op_seq in self._op_errors or len(self._op_errors) < ERRORS_PER_EPOCH):
                self._op_errors.setdefault(h.op_seq, PeerReportedError(conn.peer or "?", h.op_seq,
                                                                       bytes(target[:ERROR_MESSAGE_CAP])))
            return
        if req is not None:
            if conn.recvq and conn.recvq[0] is req:
                conn.recvq.popleft()
            else:
                conn.recvq.remove(req)
            req._finish()
        else:
            conn.unexpected.append((h, target.obj))  # type: ignore[arg-type]
            self._match_unexpected(conn)

    def _match_unexpected(self, conn: _Conn) -> None:
        """Match buffered early frames with posted receives: per channel (data, control)
        in arrival order against posting order; a frame for a later op, or one with no
        receive of its channel posted, stays buffered (and so do the frames behind it on
        that channel)."""
        if not conn.unexpected or not conn.recvq:
            return
        kept: collections.deque[tuple[frames.Header, bytearray]] = collections.deque()
        blocked: set[bool] = set()
        while conn.unexpected:
            h, payload = conn.unexpected.popleft()
            ctl = is_control(h.op_seq)
            req = None if ctl in blocked else self._head_recv(conn, ctl)
            same_ns = req is not None and same_namespace(h.op_seq, req.op_seq)
            if req is None or (same_ns and h.op_seq > req.op_seq):
                blocked.add(ctl)  # for a later op, or nothing posted yet: ``req`` waits
                kept.append((h, payload))
                continue
            conn.early_bytes -= len(payload)
            if h.epoch < self._epoch or h.op_seq in self._cancelled or (same_ns and h.op_seq < req.op_seq):
                self._spare_return(payload)  # stale: an op this side already ended
                continue
            try:
                self._check_match(conn, req, h)
            except FrameError as exc:
                conn.unexpected = kept
                self._drop_conn(conn, "protocol_error", f"protocol error: {exc}")
                return
            conn.recvq.remove(req)
            if req.error is None:
                req.started = True
                req.mv[:] = payload
                self._stats.add_received(req.peer, len(payload))
                req._finish()
            self._spare_return(payload)
        conn.unexpected = kept

    @staticmethod
    def _head_recv(conn: _Conn, control: bool) -> _Req | None:
        """The oldest posted receive of a channel: control frames (:func:`is_control`)
        match control receives only, so a control exchange never disturbs an op's data."""
        q = conn.recvq
        if q and is_control(q[0].op_seq) == control:
            return q[0]
        for r in q:
            if is_control(r.op_seq) == control:
                return r
        return None

    def _filter_unexpected(self, conn: _Conn, keep: Callable[[frames.Header], bool]) -> None:
        """Drop buffered early frames for which ``keep(header)`` is false."""
        kept = collections.deque((h, p) for h, p in conn.unexpected if keep(h))
        for h, p in conn.unexpected:
            if not keep(h):
                self._spare_return(p)
        conn.unexpected = kept
        conn.early_bytes = sum(len(p) for _, p in kept) + (
            len(conn.target) if conn.target is not None and conn.target_req is None and conn.cur is not None
            and conn.cur.kind == frames.DATA else 0)

    def _spare_buf(self, n: int) -> bytearray:
        """A buffer of ``n`` bytes for a DATA frame that arrived before its receive was
        posted: reused from earlier ones when possible (a fresh zero-filled megabyte costs
        about as much as copying it twice)."""
        free = self._spare.get(n)
        if free:
            self._spare_bytes -= n
            return free.pop()
        return bytearray(n)

    def _spare_return(self, buf: bytearray) -> None:
        n = len(buf)
        if n >= 4096 and self._spare_bytes + n <= SPARE_CAP:
            self._spare.setdefault(n, []).append(buf)
            self._spare_bytes += n

    # -- shutdown ---------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in list(self._conns.values()) + list(self._accepting):
            self._fail_conn(conn, TransportError("transport closed"))
        self._conns.clear()
        for listener in self._listeners:
            try:
                self._sel.unregister(listener)
            except (KeyError, ValueError):
                pass
            listener.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._sel.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


def _handshaken_or_dialer(self: _Conn) -> bool:
    return self.handshaken


_Conn.handshaken_or_dialer = _handshaken_or_dialer  # type: ignore[attr-defined]
