"""Write state machine of the TCP transport: finish connecting, then frames in order.

One responsibility: drain a link's outgoing queue — the rest of a cut frame's header and
its zero padding first (a frame half sent when an abort cut it is completed, so the
peer's byte stream never desynchronises), then control frames (HELLO/ERROR) only at a
frame boundary, then DATA frames written with ``sendmsg`` straight from the caller's
buffer (TLS: header, then payload, in chunks of at most ``TLS_CHUNK``).

Failure behaviour: a failed connect or send fails the link's requests with a
:class:`~resilient.errors.TransportError` naming the peer; would-block returns.
"""
from __future__ import annotations

import errno
import os
import socket
import ssl

from resilient.errors import TransportError
from resilient.transport.tcp_conn import SCRATCH, WOULD_BLOCK, Conn
from resilient.transport.tcp_handshake import TcpHandshake


class TcpWriting(TcpHandshake):
    """Writing frames (see the module docstring)."""

    def _try_write(self, conn: Conn) -> None:
        sock = conn.sock
        if sock is None or conn.failed is not None or not conn.handshaken:
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
        if sock is None:
            return
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
                    n = self._send(conn, self._zeros(min(conn.pad, SCRATCH)))
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
        except WOULD_BLOCK:
            return
        except OSError as exc:
            self._fail_conn(conn, TransportError(f"connection to member {conn.peer} failed while sending: {exc}"))

    _zero_buf: memoryview | None = None

    def _zeros(self, n: int) -> memoryview:
        if TcpWriting._zero_buf is None:
            TcpWriting._zero_buf = memoryview(bytes(SCRATCH))
        return TcpWriting._zero_buf[:n]
