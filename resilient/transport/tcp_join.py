"""Join-agreement messages of the TCP transport (and of the hybrid transport's shm links).

One responsibility: carry :mod:`resilient.collectives.join_agreement`'s tree messages
(a JOIN frame, :func:`~resilient.transport.frames.encode_join`: one member's subtree
maximum for a growing epoch) between members, as :class:`~resilient.transport.base.JoinCarrier`.

* :meth:`TcpJoining.post_join` and :meth:`TcpJoining.join_links` may be called from any
  thread (the epoch watcher's): they queue and write the wake-up pipe; the frames go out
  (and links to the tree neighbours this side dials are opened) from the progressing
  thread at its next :meth:`~resilient.transport.tcp.TcpTransport._progress`, i.e. while
  the op thread waits on an op or idles the transport.
* A JOIN frame is read wherever it arrives in the byte stream and whatever epoch it
  names (the agreement of epoch ``n`` runs while members are still in an older one), and
  handed to the handler of :meth:`TcpJoining.on_join` on the progressing thread.

Failure behaviour: nothing here raises to the caller except :meth:`post_join` with a seq
that is no op seq (:class:`~resilient.errors.FrameError`). A frame for a peer not (yet)
in this transport's epoch stays queued until it is, or until this transport is past the
agreement's epoch (then the agreement is over and the frame is dropped); a peer whose
link failed drops the frame (``stats.dropped["join_undeliverable"]``): the agreement then
ends in a newer epoch or a timeout, never in a wrong seq. A bad JOIN frame is refused
(``stats.dropped["bad_join"]``, logged) without closing the link; a handler that raises
is logged and counted (``stats.dropped["join_handler"]``).
"""
from __future__ import annotations

import os
from typing import Callable, Sequence

from resilient.errors import FrameError
from resilient.transport import frames
from resilient.transport.tcp_conn import Conn
from resilient.transport.tcp_write import TcpWriting


class TcpJoining(TcpWriting):
    """Sending and serving JOIN frames (see the module docstring)."""

    def post_join(self, peer: str, epoch: int, seq: int) -> None:
        frame = frames.encode_join(epoch, seq)
        with self._join_lock:
            self._join_out.append((peer, epoch, frame))
        self._wake()

    def join_links(self, peers: Sequence[str]) -> None:
        with self._join_lock:
            self._join_dial.update(peers)
        self._wake()

    def on_join(self, handler: Callable[[str, int, int], None] | None) -> None:
        self._join_handler = handler

    def drop_join(self, handler: Callable[[str, int, int], None]) -> None:
        if self._join_handler == handler:
            self._join_handler = None

    def joins_pending(self) -> bool:
        with self._join_lock:
            if self._join_out:
                return True
        return any(conn.failed is None and any(self._is_join(mv) for mv in conn.raw_out) for conn in self._conns.values())

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"j")
        except (BlockingIOError, OSError):
            pass

    @staticmethod
    def _is_join(mv: memoryview) -> bool:
        if len(mv) != frames.HEADER_SIZE:
            return False
        try:
            return frames.decode_header(mv).kind == frames.JOIN
        except FrameError:
            return False

    def _flush_joins(self) -> None:
        """On the progressing thread: queue the posted JOIN frames on their links and open
        the links asked for (see the module docstring). Runs at every progress: with
        nothing posted (always, without the tree agreement) it returns before the lock."""
        if not self._join_out and not self._join_dial:
            return   # a racing post is seen at the next progress (it also writes the wake-up pipe)
        with self._join_lock:
            if not self._join_out and not self._join_dial:
                return
            out, self._join_out = self._join_out, []
            dial, self._join_dial = self._join_dial, set()
        if self._closed:
            return
        keep: list[tuple[str, int, bytes]] = []
        for peer, epoch, frame in out:
            if epoch < self._epoch:
                continue  # this side is past the agreement's epoch: the agreement is over
            if peer not in self._addresses:
                keep.append((peer, epoch, frame))  # a member of a newer epoch: sent once we are there
                continue
            conn = self._link_to(peer)
            if conn is None:
                self._note("join_undeliverable", f"dropped a join message to member {peer}: its link failed")
                continue
            conn.raw_out.append(memoryview(frame))
            if conn.sock is not None:
                self._try_write(conn)
        for peer in dial:
            if peer in self._addresses and peer not in self._conns and self.member_id < peer:
                self._dial(peer)
        if keep:
            with self._join_lock:
                self._join_out[:0] = keep

    def _link_to(self, peer: str) -> Conn | None:
        """``peer``'s link: the live one, a new dial (we dial higher ids), or a placeholder
        the peer's dial will take over; None when the link failed."""
        conn = self._conns.get(peer)
        if conn is None and self.member_id < peer:
            conn = self._dial(peer)
        if conn is None:
            conn = Conn(None, peer, self._addresses[peer])  # the peer dials us; frames wait for its link
            conn.handshaken = False
            self._conns[peer] = conn
        return None if conn.failed is not None else conn

    def _on_join(self, conn: Conn, h: frames.Header) -> None:
        """A JOIN header was read from ``conn`` (the caller discards its payload)."""
        peer = conn.peer or "?"
        try:
            epoch, seq = frames.check_join(h, peer)
        except FrameError as exc:
            self._note("bad_join", f"refused a frame of member {peer}, link kept: {exc}")
            return
        handler = self._join_handler
        if handler is None:
            return
        try:
            handler(peer, epoch, seq)
        except Exception as exc:  # noqa: BLE001 - a bad message never fails the link or the op
            self._note("join_handler", f"join message of member {peer} for epoch {epoch} refused: {exc}")
