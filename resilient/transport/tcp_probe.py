"""Op probes of the TCP transport (and of the hybrid transport's shared-memory links).

One responsibility: :meth:`TcpProbing.probe` and the handling of a PROBE frame
(:func:`~resilient.transport.frames.check_probe`). Two members that call different
collectives (or shapes, dtypes, reduce ops) at the same op number normally meet a digest
mismatch on the first DATA frame between them; when no data flows between them in that
op (a broadcast from different roots, say) both would wait forever. So a member whose
wait lasts (:mod:`resilient.collectives.op_context`) asks the peers it waits on which
op they are in, telling them its own: a PROBE query carries the asker's current op and
descriptor digest, the peer compares it with its own and answers with its current op
and digest, which the asker compares in turn. A PROBE is read wherever it arrives in the
byte stream — it is routed by its kind before any matching, so it never takes part in
the in-order matching of DATA frames with receives (:mod:`~resilient.transport.tcp_match`).

*Current op* is the newest op of the collective namespace with a request pending on
this transport (a non-zero digest; point-to-point and control requests do not count):
it needs no bookkeeping of its own, and a member between ops, or whose requests are all
done, has none (it neither asks nor answers, and judges nothing).

Failure behaviour: nothing here raises. A peer in the same op with another digest fails
that op through the op guard with :class:`~resilient.errors.OpMismatch` (every request of
the op then raises it, :meth:`~resilient.transport.ops.OpGuard.check_digest`); a peer in
another op, or in ours with our digest, changes nothing; a bad PROBE frame
(:class:`~resilient.errors.FrameError` naming the peer) is counted in
``stats.dropped["bad_probe"]`` and logged, and its payload is discarded, so the link and
every frame on it are kept. A probe of another epoch is ignored.
"""
from __future__ import annotations

import itertools
from typing import Sequence

from resilient.errors import FrameError
from resilient.transport import frames
from resilient.transport.tags import OP_NAMESPACE, namespace_of
from resilient.transport.tcp_conn import Conn
from resilient.transport.tcp_write import TcpWriting


class TcpProbing(TcpWriting):
    """Sending op probes and serving the PROBE frames read (see the module docstring)."""

    def probe(self, peers: Sequence[str]) -> None:
        cur = self._current_op()
        if cur is None or self._closed or self._abort_reason is not None:
            return
        frame = frames.encode_probe(self._epoch, frames.Probe(cur[0], cur[1], answer=False))
        for peer in peers:
            conn = self._conns.get(peer)
            if conn is None or conn.sock is None or conn.failed is not None or not conn.handshaken:
                continue  # no link yet (the peer dials us): the peer's own probe covers the pair
            if self._query_queued(conn):
                continue  # the last one has not gone out (a long frame ahead of it): one is enough
            conn.raw_out.append(memoryview(frame))
            self._stats.add_probe("sent")
            self._try_write(conn)

    @staticmethod
    def _query_queued(conn: Conn) -> bool:
        """Whether a whole PROBE query still waits in ``conn``'s control queue (a lasting
        wait behind a long DATA frame queues one query, not one per interval)."""
        for mv in conn.raw_out:
            if len(mv) == frames.HEADER_SIZE:
                try:
                    h = frames.decode_header(mv)
                except FrameError:
                    continue
                if h.kind == frames.PROBE and h.tag == frames.PROBE_QUERY:
                    return True
        return False

    def _current_op(self) -> tuple[int, int] | None:
        """``(op_seq, digest)`` of the newest collective op with a request pending here."""
        best: tuple[int, int] | None = None
        for conn in self._conns.values():
            current = [conn.target_req] if conn.target_req is not None else []
            for req in itertools.chain(conn.sendq, conn.recvq, current):
                if (req.digest and not req.done() and req.error is None and namespace_of(req.op_seq) == OP_NAMESPACE
                        and (best is None or req.op_seq > best[0])):
                    best = (req.op_seq, req.digest)
        return best

    def _on_probe(self, conn: Conn, h: frames.Header) -> None:
        """A PROBE header was read from ``conn`` (the caller discards its payload):
        judge it against our current op, answer a query (written at once where the link
        takes it, at the next frame boundary otherwise)."""
        peer = conn.peer or "?"
        try:
            probe = frames.check_probe(h, peer)
        except FrameError as exc:
            self._note("bad_probe", f"refused a frame of member {peer}, link kept: {exc}")
            return
        if h.epoch != self._epoch:
            return  # the peer is in another epoch: nothing of ours to compare
        if probe.answer:
            self._stats.add_probe("answers")
        cur = self._current_op()
        if cur is None:
            return
        seq, digest = cur
        if seq == probe.op_seq and self._ops.check_digest(peer, seq, probe.digest, digest) is not None:
            self._stats.add_probe("mismatch")
        if not probe.answer:
            conn.raw_out.append(memoryview(frames.encode_probe(self._epoch, frames.Probe(seq, digest, answer=True))))
            self._stats.add_probe("answered")
            self._try_write(conn)  # now: a mismatch may end this side's wait before the next round
