"""Handshake state machine of the TCP transport: dial, accept, TLS, HELLO validation.

One responsibility: turn sockets into member links. The dialler (the member whose id
sorts lower) opens the link and sends HELLO {job, epoch, token, member, session}; the
acceptor caps and times out unauthenticated connections
(:mod:`~resilient.transport.handshake`), runs mutual TLS when configured, parks a HELLO of
a newer epoch until ``configure`` reaches it, refuses a wrong job/token/member, and never
lets a HELLO replace a live link of the member it names (unless it comes from the same
dialling transport, ``session``, or the old link is really closed). A HELLO it accepts is
acknowledged at once with an empty HELLO frame (:data:`ACK`), the first frame the
acceptor writes on the link; the dialler marks the link ``accepted``.

Failure behaviour: every refusal closes the connection and is counted in
``stats.dropped`` (``hello_refused``, ``link_taken``, ``tls_refused``, ``tls_identity``,
``handshake_timeout``, ``parked_timeout``, ``parked_closed``, ``pending_evicted``,
``accept_emfile``); EMFILE/ENFILE on accept evicts the oldest pending handshake or pauses
accepting with a growing back-off; a dial that fails at once fails the link's requests.
"""
from __future__ import annotations

import errno
import hmac
import os
import selectors
import socket
import ssl
import time

from resilient.errors import TransportError
from resilient.transport import frames
from resilient.transport.handshake import peer_closed
from resilient.transport.tcp_conn import ACCEPT_BATCH, ACCEPT_PAUSE_MAX_S, ACCEPT_PAUSE_S, FD_ERRNOS, Conn
from resilient.transport.tcp_links import Listener, TcpLinks, log
from resilient.transport.tls import names_of

#: the acceptor's answer to a HELLO it accepted: a HELLO frame with no payload
ACK = frames.encode_header(frames.Header(frames.HELLO, 0, 0, 0, 0))


class TcpHandshake(TcpLinks):
    """Dialling, accepting and validating member links (see the module docstring)."""

    def _open_link(self, peer: str, address: str) -> tuple[socket.socket, int]:
        """A non-blocking socket that started connecting to ``peer`` at ``address``, and
        the errno of ``connect_ex`` (subclasses route some peers over other links)."""
        host, _, port = address.rpartition(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._tune(sock)
        sock.setblocking(False)
        return sock, sock.connect_ex((host, int(port)))

    def _dial(self, peer: str) -> Conn:
        sock, err = self._open_link(peer, self._addresses[peer])
        conn = Conn(sock, peer, self._addresses[peer])
        if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            sock.close()
            conn.sock = None
            conn.failed = TransportError(f"cannot connect to member {peer} at {self._addresses[peer]}: {os.strerror(err)}")
        else:
            conn.connecting = err != 0
            hello = frames.Hello(self.job, self._epoch, self._token, self.member_id, self._session)
            conn.hello_epoch = self._epoch
            conn.raw_out.append(memoryview(frames.encode_hello(hello)))
            conn.raw_out.extend(memoryview(m) for m in self._ops.posted())
            self._sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
            conn.mask = selectors.EVENT_READ | selectors.EVENT_WRITE
            if not conn.connecting and self._tls_ctx is not None:
                self._start_tls(conn, server_side=False)
        self._conns[peer] = conn
        return conn

    def _start_tls(self, conn: Conn, server_side: bool) -> None:
        """Wrap ``conn``'s connected socket for mutual TLS; the handshake then runs
        non-blocking in :meth:`_tls_step` before any frame is read or written."""
        assert self._tls_ctx is not None and conn.sock is not None
        if conn.mask:
            self._sel.unregister(conn.sock)
            conn.mask = 0
        ctx = self._tls_ctx[0 if server_side else 1]
        conn.sock = ctx.wrap_socket(conn.sock, server_side=server_side, do_handshake_on_connect=False)
        conn.tls_handshaking, conn.tls_want_write = True, not server_side

    def _tls_step(self, conn: Conn) -> bool:
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

    def _accept(self) -> None:
        for listener in list(self._listeners):
            if self._accept_paused_until is None:
                self._accept_from(listener)

    def _accept_from(self, listener: Listener) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in FD_ERRNOS and self._out_of_descriptors(exc):
                    continue
                return  # ECONNABORTED and the like: the next round tries again
            self._accept_pause = ACCEPT_PAUSE_S
            conn = Conn(sock, None, None)
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

    def _watch_parked(self, conn: Conn) -> None:
        """A parked HELLO's socket is readable: closed by its peer (reap it) or the
        dialler already sent frames (keep them unread; stop watching)."""
        if conn.sock is None or peer_closed(conn.sock):
            self._drop_conn(conn, "parked_closed", "the peer closed it while its HELLO was parked")
        else:
            conn.quiet = True

    def _validate_hello(self, conn: Conn) -> None:
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
        if self.tls is not None and self.tls.verify_member and member not in names_of(
                conn.sock.getpeercert() if isinstance(conn.sock, ssl.SSLSocket) else None):
            self._drop_conn(conn, "tls_identity", f"HELLO naming member {member[:80]!r}, which its certificate "
                                                  f"does not name")
            return
        old = self._conns.get(member)
        if (old is not None and old.sock is not None and old.failed is None
                and not (h.session and h.session == old.session) and not peer_closed(old.sock)):
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
        # The acknowledgement (an empty HELLO), first and at once: the dialler tells a link
        # accepted from one refused before it could notice (see TcpTransport.configure).
        conn.raw_out.appendleft(memoryview(ACK))
        conn.raw_out.extend(memoryview(m) for m in self._ops.posted())
        self._conns[member] = conn
        self._try_write(conn)

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
