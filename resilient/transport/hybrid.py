"""Shared memory for members on one host, TCP across hosts: the transport members build.

:class:`HybridTransport` is the TCP transport (:mod:`resilient.transport.tcp`: framing,
matching by ``(peer, op_seq, tag)``, control namespace, ``cancel_op``, ERROR messages,
HELLO with job/epoch/token, abort by wake-up pipe, padding of cut frames, hardening of
unauthenticated links) whose links to members *on the same host* are
:class:`~resilient.transport.shm.ShmChannel` s instead of TCP sockets. The framing code
cannot tell the difference, so every guarantee of the contract in
:mod:`resilient.transport.base` holds unchanged on either kind of link, and one
``selectors`` loop progresses both (a mixed wait never polls).

Selection. The transport listens on TCP *and* on an abstract unix socket, and publishes
``host:port#shm=<host key>/<socket name>``; the host key is the kernel's boot id plus
the network namespace (an abstract unix socket is reachable exactly within one network
namespace of one boot). A member dials a peer whose address carries its own host key
over shared memory, any other peer over TCP; a peer without the suffix (a plain
:class:`~resilient.transport.tcp.TcpTransport`) is dialled over TCP. Shared memory is
off (TCP only, no suffix) with ``RESILIENT_SHM=0``, and while mutual TLS is configured
(a unix link between processes of one user carries no certificate to verify).

Failure behaviour: as :class:`~resilient.transport.tcp.TcpTransport`; a shared-memory
link whose peer dies fails like a reset TCP connection (EOF of its doorbell socket), a
malformed doorbell record or ring descriptor closes that link only
(``stats.dropped["protocol_error"]``), a connection from another user's process is
refused (``stats.dropped["shm_uid"]``). :func:`make_transport` raises
:class:`~resilient.errors.ConfigError` for an unknown ``RESILIENT_TRANSPORT``.
"""
from __future__ import annotations

import os
import secrets
import selectors
import socket
from pathlib import Path
from typing import Any

from resilient.errors import TransportError
from resilient.settings import Settings
from resilient.transport import shm
from resilient.transport.tcp import TcpTransport
from resilient.transport.tcp_conn import Conn

_SUFFIX = "#shm="
_BOTH = selectors.EVENT_READ | selectors.EVENT_WRITE


def host_key() -> str | None:
    """Boot id and network namespace of this process (None where /proc does not say)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:16]
        net = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return None
    return f"{boot}.{net}" if boot else None


def split_address(address: str) -> tuple[str, str | None, str | None]:
    """``(tcp host:port, host key, unix socket name)`` of a published address (the last
    two None for a TCP-only address)."""
    tcp, sep, rest = address.partition(_SUFFIX)
    if not sep:
        return tcp, None, None
    key, _, name = rest.partition("/")
    return tcp, key or None, name or None


class HybridTransport(TcpTransport):
    """:class:`TcpTransport` whose same-host links go through shared memory (see the
    module docstring). Same constructor; ``shm_capacity`` is each outgoing ring's size."""

    def __init__(self, member_id: str, job: str, host: str = "127.0.0.1", port: int = 0,
                 shm_capacity: int | None = None, **kw: Any) -> None:
        super().__init__(member_id, job, host=host, port=port, **kw)
        settings = Settings.from_env()  # RESILIENT_SHM, RESILIENT_SHM_RING
        self._shm_capacity = settings.shm_ring if shm_capacity is None else shm_capacity
        self._host_key = host_key() if settings.shm and self.tls is None else None
        self._shm_listener: shm.ShmListener | None = None
        if self._host_key is not None:
            name = f"resilient-{os.getpid()}-{secrets.token_hex(8)}"
            self._shm_listener = shm.ShmListener(name, self._shm_capacity, on_refused=self._stats.add_dropped)
            self._sel.register(self._shm_listener, selectors.EVENT_READ, "listener")
            self._listeners.append(self._shm_listener)

    @property
    def address(self) -> str:
        tcp = super().address
        if self._shm_listener is None:
            return tcp
        return f"{tcp}{_SUFFIX}{self._host_key}/{self._shm_listener.name}"

    def is_shm_peer(self, peer: str) -> bool:
        """Whether the link to ``peer`` of the current epoch is (or will be) shared memory."""
        _, key, name = split_address(self._addresses.get(peer, ""))
        return self._host_key is not None and key == self._host_key and name is not None

    # -- links ----------------------------------------------------------------------------

    def _open_link(self, peer: str, address: str) -> tuple[socket.socket, int]:
        tcp, _, name = split_address(address)
        if self.is_shm_peer(peer) and name is not None:
            return shm.connect(name, self._shm_capacity)
        return super()._open_link(peer, tcp)

    def _tune(self, sock: socket.socket) -> None:
        if sock.family != socket.AF_UNIX:
            super()._tune(sock)

    def _start_tls(self, conn: Conn, server_side: bool) -> None:
        if not isinstance(conn.sock, shm.ShmChannel):
            super()._start_tls(conn, server_side)

    # -- progress -------------------------------------------------------------------------

    def _progress(self, timeout: float | None) -> None:
        # Doorbell records read while writing (credits share the socket with data
        # announcements) leave no readable event behind: read such links first.
        if self._read_announced():
            timeout = 0.0
        self._flush_doorbells()
        super()._progress(timeout)

    def _flush_doorbells(self) -> None:
        """Send every batched credit before this thread may block in ``select``."""
        for conn in list(self._conns.values()):
            ch = conn.sock
            if isinstance(ch, shm.ShmChannel) and conn.failed is None and ch.doorbell_pending:
                try:
                    ch.flush()
                except OSError as exc:
                    self._fail_conn(conn, TransportError(f"connection to member {conn.peer} failed while sending: {exc}"))

    def _read_announced(self) -> bool:
        progressed = False
        for conn in list(self._conns.values()) + list(self._accepting):
            ch = conn.sock
            if (isinstance(ch, shm.ShmChannel) and conn.failed is None and ch.buffered and not conn.parked
                    and not conn.stalled and conn.hello is None):
                before = ch.consumed
                self._guarded(conn, self._read)
                progressed = progressed or ch.consumed != before or conn.failed is not None
        return progressed

    def _serve(self, conn: Conn, mask: int) -> None:
        ch = conn.sock
        if isinstance(ch, shm.ShmChannel):
            ch.pump()
            ch.flush()
            # data announcements and credits arrive on one socket: do both sides each time
            mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if ch.has_room else 0)
        super()._serve(conn, mask)

    def _update_masks(self) -> None:
        super()._update_masks()
        for conn in list(self._conns.values()) + list(self._accepting):
            ch = conn.sock
            if not isinstance(ch, shm.ShmChannel) or conn.failed is not None:
                continue
            # credits and EOF must be seen even while the link is parked or stalled; write
            # interest only when the ring has room (credits come as readable events)
            mask = selectors.EVENT_READ if not ch.eof else conn.mask & selectors.EVENT_READ
            if ch.doorbell_pending or (conn.mask & selectors.EVENT_WRITE and ch.has_room):
                mask |= selectors.EVENT_WRITE
            if mask != conn.mask:
                if conn.mask == 0:
                    self._sel.register(ch, mask, conn)
                elif mask == 0:
                    self._sel.unregister(ch)
                else:
                    self._sel.modify(ch, mask, conn)
                conn.mask = mask


def make_transport(member_id: str, job: str, host: str = "127.0.0.1", **kw: Any) -> TcpTransport:
    """The transport a member uses: ``RESILIENT_TRANSPORT=auto`` (default: shared memory
    to same-host peers, TCP to the others) or ``tcp`` (TCP only). :class:`ConfigError`
    for another value."""
    if Settings.from_env().transport == "auto":
        return HybridTransport(member_id, job, host=host, **kw)
    return TcpTransport(member_id, job, host=host, **kw)
