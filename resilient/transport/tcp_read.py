"""Read/routing state machine of the TCP transport: headers, payloads, where they go.

One responsibility: read what a link has, straight into the destination — a posted
receive's buffer (zero copy), an early-frame buffer (:mod:`~resilient.transport.tcp_match`),
a HELLO buffer within the pending-handshake budget, or the scratch buffer for bytes to
discard (an older epoch, a cancelled op, the rest of a frame cut by an abort). A header
of a future epoch parks the link until ``configure``; one that does not fit
``early_cap`` stalls it until its receive is posted (TCP flow control holds the sender).

Failure behaviour: EOF or a reset fails the link's requests with a
:class:`~resilient.errors.TransportError` naming the peer; a bad or unexpected frame
raises :class:`~resilient.errors.FrameError` (the caller's guard closes that link only);
a peer's ERROR frame fails that op's requests through the op guard. A PROBE frame is
handed to :meth:`TcpReading._on_probe` (:mod:`~resilient.transport.tcp_probe`) as soon
as its header is read, before any matching; a bad one is refused there without closing
the link. A JOIN frame likewise goes to :meth:`TcpReading._on_join`
(:mod:`~resilient.transport.tcp_join`), whatever epoch it names.
"""
from __future__ import annotations

import time

from resilient.errors import FrameError, TransportError
from resilient.transport import frames
from resilient.transport.tags import is_control, same_namespace
from resilient.transport.tcp_conn import SCRATCH, WOULD_BLOCK, Conn
from resilient.transport.tcp_handshake import TcpHandshake
from resilient.transport.tcp_match import TcpMatching


#: DATA frames at least this large count in ``stats.link_*_by_peer`` (a smaller one's
#: few milliseconds say more about scheduling than about the link)
LINK_FRAME_BYTES = 64 << 10


class TcpReading(TcpMatching, TcpHandshake):
    """Reading and routing frames (see the module docstring)."""

    def _read(self, conn: Conn) -> None:
        """Read what ``conn`` has. Raises :class:`FrameError` on a bad or unexpected frame
        (the caller's :meth:`_guarded` closes the connection); EOF/reset fail it here."""
        if conn.tls_handshaking and not self._tls_step(conn):
            return
        sock = conn.sock
        try:
            while sock is not None and conn.failed is None and not conn.parked and not conn.stalled:
                if conn.discard > 0:
                    n = sock.recv_into(self._scratch, min(conn.discard, SCRATCH))
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
                    if conn.target is not None:
                        conn.frame_at = time.monotonic()
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
        except WOULD_BLOCK:
            return
        except FrameError:
            raise
        except EOFError:
            self._fail_conn(conn, TransportError(f"member {conn.peer or '(handshaking)'} closed the connection"))
        except OSError as exc:
            self._fail_conn(conn, TransportError(f"connection to member {conn.peer} failed while receiving: {exc}"))

    def _route(self, conn: Conn) -> None:
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
        if h.kind == frames.PROBE:  # outside the matching: a probe never waits for a receive
            conn.discard, conn.cur = h.length, None
            self._on_probe(conn, h)
            return
        if h.kind == frames.JOIN:  # outside the matching and of any epoch: a join agreement's message
            conn.discard, conn.cur = h.length, None
            self._on_join(conn, h)
            return
        if h.epoch < self._epoch or self._ops.cancelled(h.op_seq):
            conn.discard, conn.cur = h.length, None
            return
        if h.epoch > self._epoch:
            conn.parked = True  # resume after configure(); header is kept in conn.cur
            return
        req = self._recv_for(conn, h)
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

    def _payload_done(self, conn: Conn) -> None:
        h, target, req = conn.cur, conn.target, conn.target_req
        conn.cur, conn.target, conn.target_req, conn.target_got = None, None, None, 0
        assert h is not None and target is not None
        if h.kind == frames.DATA and h.length >= LINK_FRAME_BYTES and conn.peer is not None:
            self._stats.add_link(conn.peer, h.length, time.monotonic() - conn.frame_at)
        if not conn.handshaken:
            self._accepting.release(conn)
            conn.hello = frames.decode_hello(target)
            self._validate_hello(conn)
            return
        if h.kind == frames.HELLO:  # the acceptor's acknowledgement of our HELLO
            conn.accepted = True
            return
        if h.kind == frames.ERROR:
            if h.epoch >= self._epoch:
                self._ops.peer_reported(conn.peer or "?", h.op_seq, target)
            return
        if req is not None:
            if conn.recvq and conn.recvq[0] is req:
                conn.recvq.popleft()
            else:
                conn.recvq.remove(req)
            req._finish()
        else:
            early = target.obj  # the spare buffer of :meth:`_buffer_early`
            assert isinstance(early, bytearray)
            conn.unexpected.append((h, early))
            self._match_unexpected(conn)

    def _to_discard(self, conn: Conn) -> None:
        req = conn.target_req
        if req is not None and req in conn.recvq:
            conn.recvq.remove(req)
        conn.discard = len(conn.target) - conn.target_got if conn.target is not None else 0
        conn.target, conn.target_req, conn.cur = None, None, None
        conn.target_got = 0
