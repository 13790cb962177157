"""Connection lifecycle of the TCP transport: state, selector masks, closing one link.

One responsibility: :class:`TcpLinks` owns the transport's state (listener, wake-up
pipe, selector, member links, pending handshakes, the op guard) and the operations every
state machine above it needs on a link: register its selector interest, serve it
guarded, close it (failing its requests) and count why. The state machines are layered
on top: :mod:`~resilient.transport.tcp_handshake` (accept, TLS, HELLO),
:mod:`~resilient.transport.tcp_match` (matching early frames with receives),
:mod:`~resilient.transport.tcp_read` (reading and routing frames),
:mod:`~resilient.transport.tcp_write` (writing frames); :mod:`~resilient.transport.tcp`
is the public transport.

Failure behaviour: whatever a served connection raises closes that connection only
(:meth:`TcpLinks._guarded`: ``stats.dropped["protocol_error"|"internal_error"]``); closing
fails its requests with a :class:`~resilient.errors.TransportError` naming the cause.
"""
from __future__ import annotations

import abc
import logging
import os
import secrets
import selectors
import socket
import ssl
import threading
from typing import Callable, Protocol

from resilient.errors import FrameError, TransportError
from resilient.settings import Settings
from resilient.transport import frames
from resilient.transport.base import TransportStats
from resilient.transport.handshake import HandshakeLimits, PendingHandshakes
from resilient.transport.ops import OpGuard
from resilient.transport.tcp_conn import ACCEPT_PAUSE_S, SCRATCH, TLS_CHUNK, Conn
from resilient.transport.tls import TlsConfig

log = logging.getLogger("resilient.transport.tcp")


class Listener(Protocol):
    """A listening socket (TCP, or the shared-memory transport's unix listener)."""

    def accept(self) -> tuple[socket.socket, object]: ...

    def fileno(self) -> int: ...

    def close(self) -> None: ...


class TcpLinks(abc.ABC):
    """State and link lifecycle shared by the TCP state machines (see the module doc)."""

    member_id: str

    def __init__(self, member_id: str, job: str, host: str = "127.0.0.1", port: int = 0,
                 connect_timeout: float = 10.0, limits: HandshakeLimits | None = None,
                 early_cap: int | None = None, tls: TlsConfig | None | bool = True) -> None:
        self.member_id = member_id
        self.job = job
        self.connect_timeout = connect_timeout
        self.limits = limits or HandshakeLimits.from_env()
        settings = Settings.from_env()  # RESILIENT_TCP_EARLY_CAP, RESILIENT_SELECTOR, RESILIENT_TCP_SOCKBUF
        #: bytes of frames buffered per connection before their receive is posted; beyond it the
        #: connection is not read until a receive is posted (a header never allocates on trust)
        self.early_cap = settings.tcp_early_cap if early_cap is None else early_cap
        self._sockbuf = settings.tcp_sockbuf
        self._session = secrets.token_hex(16)  # identifies this dialler's links; never published
        #: mutual TLS (``tls=True``: from the environment, see :mod:`resilient.transport.tls`;
        #: None/False: plain TCP)
        self.tls = TlsConfig.from_env() if tls is True else (tls or None)
        self._tls_ctx = self.tls.contexts() if self.tls is not None else None
        self._stats = TransportStats()
        self._sel = settings.make_selector()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, "listener")
        #: every listening socket (a subclass may add others); all are paused together
        self._listeners: list[Listener] = [self._listener]
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._host = host
        self._port = self._listener.getsockname()[1]
        self._epoch = -1
        self._token = ""
        self._addresses: dict[str, str] = {}
        self._conns: dict[str, Conn] = {}
        self._accepting: PendingHandshakes[Conn] = PendingHandshakes(self.limits)
        self._accept_paused_until: float | None = None
        self._accept_pause = ACCEPT_PAUSE_S
        self._fd_warned = False
        self._abort_lock = threading.Lock()
        self._abort_reason: str | None = None
        self._abort_handled = False
        self._ops = OpGuard()
        self._scratch = memoryview(bytearray(SCRATCH))
        self._spare: dict[int, list[bytearray]] = {}   # reusable early-arrival buffers by size
        self._spare_bytes = 0
        self._closed = False
        #: join agreement frames (:mod:`~resilient.transport.tcp_join`): posted from any thread
        self._join_lock = threading.Lock()
        self._join_out: list[tuple[str, int, bytes]] = []  # (peer, agreement epoch, frame)
        self._join_dial: set[str] = set()
        self._join_handler: Callable[[str, int, int], None] | None = None

    @property
    def epoch(self) -> int:
        return self._epoch

    def _send(self, conn: Conn, mv: memoryview) -> int:
        sock = conn.sock
        assert sock is not None
        return sock.send(mv[:TLS_CHUNK] if isinstance(sock, ssl.SSLSocket) else mv)

    def _tune(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in ((socket.SO_SNDBUF, socket.SO_RCVBUF) if self._sockbuf > 0 else ()):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, self._sockbuf)
            except OSError:  # pragma: no cover - capped by the kernel
                pass

    def _guarded(self, conn: Conn, fn: Callable[[Conn], None]) -> None:
        """Run ``fn(conn)``; whatever it raises closes ``conn`` only (counted, logged)."""
        try:
            fn(conn)
        except FrameError as exc:
            self._drop_conn(conn, "protocol_error", f"protocol error: {exc}")
        except Exception as exc:  # noqa: BLE001 - MemoryError, struct.error, a bug: never wedge the member
            self._drop_conn(conn, "internal_error", f"{type(exc).__name__} while serving it: {exc}")

    def _drop_conn(self, conn: Conn, reason: str, why: str) -> None:
        who = f"member {conn.peer}" if conn.handshaken else f"unauthenticated connection {conn.origin or '?'}"
        self._note(reason, f"closed the connection from/to {who}: {why}")
        self._fail_conn(conn, TransportError(f"connection to {who} closed: {why}"))

    def _note(self, reason: str, message: str) -> None:
        """Count a dropped/refused connection; log the 1st, 10th, 100th... of each reason."""
        self._stats.add_dropped(reason)
        n = self._stats.dropped[reason]
        if str(n).rstrip("0") == "1":  # 1, 10, 100, ...
            log.warning("transport %s: %s (%s #%d)", self.member_id, message, reason, n)

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
                if conn.wants_write() and conn.handshaken:
                    mask |= selectors.EVENT_WRITE
            if mask != conn.mask:
                if conn.mask == 0:
                    self._sel.register(conn.sock, mask, conn)
                elif mask == 0:
                    self._sel.unregister(conn.sock)
                else:
                    self._sel.modify(conn.sock, mask, conn)
                conn.mask = mask

    def _fail_conn(self, conn: Conn, exc: BaseException) -> None:
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

    def _close_sock(self, conn: Conn) -> None:
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

    def _drop(self, conn: Conn) -> None:
        self._fail_conn(conn, TransportError(f"connection to member {conn.peer} closed: it is not in epoch {self._epoch}"))
        if conn.peer is not None and self._conns.get(conn.peer) is conn:
            del self._conns[conn.peer]

    @abc.abstractmethod
    def _read(self, conn: Conn) -> None:
        """Read what ``conn`` has (:mod:`~resilient.transport.tcp_read`)."""

    @abc.abstractmethod
    def _try_write(self, conn: Conn) -> None:
        """Write what ``conn`` has queued, as far as the socket takes it (:mod:`~resilient.transport.tcp_write`)."""

    @abc.abstractmethod
    def _on_probe(self, conn: Conn, h: frames.Header) -> None:
        """A PROBE header was read from ``conn`` (:mod:`~resilient.transport.tcp_probe`)."""

    @abc.abstractmethod
    def _on_join(self, conn: Conn, h: frames.Header) -> None:
        """A JOIN header was read from ``conn`` (:mod:`~resilient.transport.tcp_join`)."""
