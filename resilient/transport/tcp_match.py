"""Matching of the TCP transport: frames that arrived before their receive was posted.

One responsibility: per channel (the data and the control namespace,
:mod:`~resilient.transport.tags`), buffered early frames are matched in arrival order
with posted receives in posting order; a frame for a later op waits for that op's
receive, a stale one (an older epoch, a cancelled op, an op this side already ended) is
dropped; the descriptor digest is compared through the op guard
(:mod:`~resilient.transport.ops`). Early-frame buffers are reused up to
:data:`~resilient.transport.tcp_conn.SPARE_CAP` bytes.

A speculative receive (``Transport.irecv_speculative``) takes only a frame that fits it
(op, tag, length and digest); one that does not stays buffered for the receive posted
after ``cancel_recv``.

Failure behaviour: a digest mismatch fails the receive (and its op) with
:class:`~resilient.transport.ops.OpMismatch`; a frame whose op/tag/length differs from the
receive it must match raises :class:`~resilient.errors.FrameError` (the connection is
closed as a protocol error); nothing else raises.
"""
from __future__ import annotations

import collections
from typing import Callable

from resilient.errors import FrameError
from resilient.transport import frames
from resilient.transport.tags import is_control, same_namespace
from resilient.transport.tcp_conn import SPARE_CAP, Conn, TcpRequest
from resilient.transport.tcp_links import TcpLinks


class TcpMatching(TcpLinks):
    """Early frames against posted receives (see the module docstring)."""

    def _buffer_early(self, conn: Conn, h: frames.Header) -> None:
        """Read a frame whose receive is not posted into a spare buffer, if it fits the
        connection's ``early_cap``; else stop reading until a receive is posted."""
        if conn.early_bytes + h.length > self.early_cap:
            conn.stalled = True
            return
        conn.early_bytes += h.length
        conn.target, conn.target_got, conn.target_req = memoryview(self._spare_buf(h.length)), 0, None

    def _check_match(self, conn: Conn, req: TcpRequest, h: frames.Header) -> None:
        mismatch = self._ops.check_digest(conn.peer or "?", req.op_seq, h.digest, req.digest)
        if mismatch is not None:
            req._fail(mismatch)
        elif (h.op_seq, h.tag) != (req.op_seq, req.tag) or h.length != req.nbytes:
            raise FrameError(
                f"member {conn.peer} sent op #{h.op_seq} tag {h.tag:#x} ({h.length} bytes) where op #{req.op_seq} "
                f"tag {req.tag:#x} ({req.nbytes} bytes) was expected: the ranks disagree on the algorithm")

    def _match_unexpected(self, conn: Conn) -> None:
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
            req = None if ctl in blocked else self._recv_for(conn, h)
            same_ns = req is not None and same_namespace(h.op_seq, req.op_seq)
            if req is None or (same_ns and h.op_seq > req.op_seq):
                blocked.add(ctl)  # for a later op, or nothing posted yet: ``req`` waits
                kept.append((h, payload))
                continue
            conn.early_bytes -= len(payload)
            if h.epoch < self._epoch or self._ops.cancelled(h.op_seq) or (same_ns and h.op_seq < req.op_seq):
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
    def _recv_for(conn: Conn, h: frames.Header) -> TcpRequest | None:
        """The posted receive the frame ``h`` meets: the oldest of its channel (control
        frames, :func:`is_control`, match control receives only, so a control exchange never
        disturbs an op's data), passing speculative receives of other messages. None when
        none is posted, or when the speculative receive of this very message does not fit
        it: the frame then waits for the receive that withdraws it (``cancel_recv``), and that
        speculative receive is marked (``misfit``)."""
        control = is_control(h.op_seq)
        for r in conn.recvq:
            if is_control(r.op_seq) != control:
                continue
            if r.speculative:
                if r.op_seq != h.op_seq:
                    continue
                if not r.fits(h):
                    r.misfit_seen = True
                    return None
            return r
        return None

    def _filter_unexpected(self, conn: Conn, keep: Callable[[frames.Header], bool]) -> None:
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
