"""Shared-memory links between members on one host: a byte stream through two rings.

A :class:`ShmChannel` is a connected unix-domain stream socket that behaves, for the
transport's framing code, like a non-blocking TCP socket (``send``/``sendmsg``/
``recv_into`` raising :class:`BlockingIOError` when they would block, ``0`` from
``recv_into`` at EOF), but whose bytes travel through shared memory:

* **Rings.** Each side creates its *outgoing* ring: an anonymous ``memfd`` of
  ``capacity`` bytes, sealed against shrinking and growing, and passes the descriptor to
  the peer over the unix socket (``SCM_RIGHTS``) in the first doorbell record. The
  segment has no name anywhere (nothing in ``/dev/shm``), so the kernel frees it when the
  last process that maps it exits: a SIGKILLed member leaves no segment behind.
* **Doorbells.** The unix socket carries only 9-byte records: ``S`` (setup: the ring's
  capacity, with its descriptor), ``D n`` (``n`` more bytes were written into my ring, in
  order) and ``C n`` (I consumed ``n`` bytes of your ring: you may overwrite them).
  A writer copies bytes into free ring space *first* and sends the ``D`` record after:
  the reader never reads a byte that was not completely written (no torn chunk, whatever
  the writer does meanwhile: a SIGSTOPped writer simply announces nothing). A writer
  only overwrites what the reader credited, so a slow or stopped reader holds the writer
  (flow control), exactly like a full TCP window.
* **Waiting.** The socket's descriptor is what the transport's ``selectors`` loop
  watches (next to its abort wake-up pipe): data and credits arrive as readable events,
  a SIGKILLed peer as EOF (the kernel closes its end). Nothing spins.

Failure behaviour: a malformed doorbell record, a setup without exactly one descriptor,
or a descriptor that is not a sealed memfd of the announced size raises
:class:`~resilient.errors.FrameError` (the transport then closes this link only); an
announced length beyond the ring or a credit beyond what was written is a
:class:`~resilient.errors.FrameError` too. Errors of the socket itself are the usual
:class:`OSError` subclasses. Nothing received is unpickled; the peer's ring is mapped
read-only.
"""
from __future__ import annotations

import array
import errno
import fcntl
import mmap
import os
import socket
import stat
import struct
from typing import Any, Iterable

from resilient.errors import FrameError

#: bytes of each outgoing ring (per directed pair)
DEFAULT_CAPACITY = 8 << 20  # RESILIENT_SHM_RING (resilient.settings) sets it per transport
MIN_CAPACITY, MAX_CAPACITY = 64 << 10, 1 << 30
_REC = struct.Struct("<cQ")
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_RECV = 1 << 16


def make_ring(capacity: int) -> int:
    """A sealed anonymous shared-memory file of ``capacity`` bytes (its descriptor)."""
    if not MIN_CAPACITY <= capacity <= MAX_CAPACITY:
        raise ValueError(f"shared-memory ring of {capacity} bytes: use {MIN_CAPACITY}..{MAX_CAPACITY} "
                         "(RESILIENT_SHM_RING)")
    fd = os.memfd_create("resilient-shm", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, capacity)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_peer_ring(fd: int, capacity: int) -> mmap.mmap:
    """Map the peer's ring read-only after checking it is a sealed memfd of exactly
    ``capacity`` bytes (so it can never shrink under us: no SIGBUS). Closes ``fd``.
    :class:`FrameError` otherwise."""
    try:
        if not MIN_CAPACITY <= capacity <= MAX_CAPACITY:
            raise FrameError(f"peer announced a shared-memory ring of {capacity} bytes")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != capacity:
            raise FrameError("peer's shared-memory descriptor is not a ring of the announced size")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            raise FrameError(f"peer's shared-memory descriptor is not a memfd: {exc}") from exc
        if seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) != fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW:
            raise FrameError("peer's shared-memory ring is not sealed against resizing")
        return mmap.mmap(fd, capacity, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)


def _copy_ring(ring: memoryview, cap: int, pos: int, data: memoryview, into_ring: bool) -> None:
    """Copy ``data`` to (``into_ring``) or from the ring at stream position ``pos``,
    wrapping at the end."""
    at = pos % cap
    first = min(len(data), cap - at)
    if into_ring:
        ring[at:at + first] = data[:first]
        if first < len(data):
            ring[:len(data) - first] = data[first:]
    else:
        data[:first] = ring[at:at + first]
        if first < len(data):
            data[first:] = ring[:len(data) - first]


def _flat(buf: Any) -> memoryview:
    mv = memoryview(buf)
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


class ShmChannel(socket.socket):
    """A connected unix stream socket whose stream bytes go through shared-memory rings
    (see the module docstring). Built from a connected ``sock`` (taken over); sends its
    setup record at once. One thread drives it (the transport's progressing thread)."""

    def __init__(self, sock: socket.socket, capacity: int = DEFAULT_CAPACITY) -> None:
        super().__init__(sock.family, sock.type, sock.proto, fileno=sock.detach())
        self.setblocking(False)
        self._cap = capacity
        fd = make_ring(capacity)
        try:
            self._out = mmap.mmap(fd, capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            socket.socket.sendmsg(self, [_REC.pack(b"S", capacity)],
                                  [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        finally:
            os.close(fd)  # the mapping (and the peer's copy of the descriptor) keep it alive
        self._out_mv = memoryview(self._out)
        self._written = 0       # bytes written into my ring (stream position)
        self._credited = 0      # of those, bytes the peer consumed
        self._in: mmap.mmap | None = None
        self._in_mv: memoryview | None = None
        self._in_cap = 0
        self._announced = 0     # bytes the peer announced in its ring
        self._consumed = 0      # of those, bytes I read
        self._rx = bytearray()  # a partial doorbell record
        self._tx = bytearray()  # doorbell bytes not sent yet (the socket was full)
        self._credit = 0        # consumed bytes not credited yet (sent by :meth:`flush`)
        self._eof = False
        self.chunk = max(MIN_CAPACITY // 2, capacity // 4)  # largest single write: keeps both sides busy

    # -- doorbells ------------------------------------------------------------------------

    def pump(self) -> None:
        """Read every doorbell record that arrived (data announcements, credits, EOF)."""
        while not self._eof:
            try:
                data, anc, flags, _ = socket.socket.recvmsg(self, _RECV, socket.CMSG_SPACE(4))
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionResetError:  # the peer closed with doorbells unread: EOF all the same
                self._eof = True          # (what it announced was completely written)
                break
            fds = self._descriptors(anc, flags)
            if not data:
                for fd in fds:
                    os.close(fd)
                self._eof = True
                break
            self._records(data, fds)
            if len(data) < _RECV and not anc:  # drained (a descriptor ends a read early)
                break

    @staticmethod
    def _descriptors(anc: Iterable[tuple[int, int, bytes]], flags: int) -> list[int]:
        fds: list[int] = []
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(payload[:len(payload) - len(payload) % a.itemsize])
                fds.extend(a)
        if flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise FrameError("peer sent more descriptors than a shared-memory setup carries")
        return fds

    def _records(self, data: bytes, fds: list[int]) -> None:
        self._rx += data
        n = len(self._rx) - len(self._rx) % _REC.size
        try:
            for off in range(0, n, _REC.size):
                kind, value = _REC.unpack_from(self._rx, off)
                if kind == b"S":
                    if self._in is not None or len(fds) != 1:
                        raise FrameError("shared-memory setup record without exactly one descriptor, or twice")
                    self._in = map_peer_ring(fds.pop(), value)
                    self._in_mv, self._in_cap = memoryview(self._in), value
                elif kind == b"D":
                    if self._in is None or self._announced + value - self._consumed > self._in_cap:
                        raise FrameError("peer announced more shared-memory bytes than its ring holds")
                    self._announced += value
                elif kind == b"C":
                    if self._credited + value > self._written:
                        raise FrameError("peer credited more shared-memory bytes than were written")
                    self._credited += value
                else:
                    raise FrameError(f"unknown shared-memory doorbell record {kind!r}")
            if fds:
                raise FrameError("peer sent a descriptor outside a shared-memory setup record")
        finally:
            for fd in fds:
                os.close(fd)
        del self._rx[:n]

    def _ring(self, kind: bytes, n: int) -> None:
        self._tx += _REC.pack(kind, n)
        self.flush()

    def flush(self) -> None:
        """Send queued doorbell records (and the pending credit) as far as the socket
        takes them. The transport calls it before every ``select``, so no credit is held
        back while this side waits."""
        if self._credit:
            self._tx += _REC.pack(b"C", self._credit)
            self._credit = 0
        while self._tx:
            try:
                n = socket.socket.send(self, self._tx)
            except (BlockingIOError, InterruptedError):
                return
            del self._tx[:n]

    # -- state ------------------------------------------------------------------------------

    @property
    def doorbell_pending(self) -> bool:
        """Doorbell records wait for the socket to become writable."""
        return bool(self._tx) or self._credit > 0

    @property
    def has_room(self) -> bool:
        """The ring has free space (a write would not block on credits)."""
        return self._written - self._credited < self._cap

    @property
    def buffered(self) -> bool:
        """Announced bytes wait to be read, or EOF was seen (a read would not block)."""
        return self._announced > self._consumed or self._eof

    @property
    def consumed(self) -> int:
        """Bytes read from the peer's ring so far."""
        return self._consumed

    @property
    def eof(self) -> bool:
        """The peer closed its end (EOF seen by :meth:`pump`)."""
        return self._eof

    # -- the socket interface the transport uses --------------------------------------------

    def sendmsg(self, buffers: Iterable[Any], *unused: Any) -> int:
        """Copy a prefix of ``buffers`` into free ring space and announce it: the number of
        bytes taken; :class:`BlockingIOError` while the ring is full;
        :class:`BrokenPipeError` once the peer closed."""
        buffers = list(buffers)
        room = min(self._cap - (self._written - self._credited), self.chunk)
        if room < min(self.chunk, sum(memoryview(b).nbytes for b in buffers)):
            self.pump()  # credits first (a dead peer shows up here or as EPIPE of the doorbell)
            if self._eof:
                raise BrokenPipeError("peer closed the shared-memory link")
            room = min(self._cap - (self._written - self._credited), self.chunk)
        if room <= 0:
            raise BlockingIOError("shared-memory ring full")
        total = 0
        for buf in buffers:
            mv = _flat(buf)[:room - total]
            if len(mv):
                _copy_ring(self._out_mv, self._cap, self._written + total, mv, True)
                total += len(mv)
            if total >= room:
                break
        if total:
            self._written += total
            self._ring(b"D", total)
        return total

    def send(self, data: Any, *unused: Any) -> int:
        return self.sendmsg([data])

    def recv_into(self, buf: Any, nbytes: int = 0, *unused: Any) -> int:
        """Copy up to ``nbytes`` (default: all of ``buf``) announced bytes into ``buf`` and
        credit them; 0 at EOF with nothing announced left; :class:`BlockingIOError` when
        nothing is announced yet."""
        mv = _flat(buf)
        want = min(nbytes or len(mv), len(mv))
        if self._announced - self._consumed < want:
            self.pump()
        avail = self._announced - self._consumed
        if avail <= 0:
            if self._eof:
                return 0
            raise BlockingIOError("no shared-memory bytes announced")
        k = min(want, avail)
        assert self._in_mv is not None
        _copy_ring(self._in_mv, self._in_cap, self._consumed, mv[:k], False)
        self._consumed += k
        self._credit += k
        if self._credit >= self.chunk // 2 or self._consumed == self._announced:
            self.flush()  # else batched: the next read or the transport's pre-select flush sends it
        return k

    def close(self) -> None:
        for name in ("_out_mv", "_in_mv"):
            mv = getattr(self, name, None)
            if mv is not None:
                mv.release()
                setattr(self, name, None)
        for name in ("_out", "_in"):
            m = getattr(self, name, None)
            if m is not None:
                m.close()
                setattr(self, name, None)
        super().close()


class ShmListener:
    """A listening unix socket in the abstract namespace (no file to clean up) whose
    :meth:`accept` returns :class:`ShmChannel` links from processes of this user only."""

    def __init__(self, name: str, capacity: int = DEFAULT_CAPACITY, backlog: int = 128,
                 on_refused: Any = None) -> None:
        self.name = name
        self.capacity = capacity
        self._on_refused = on_refused
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + name)
        self._sock.listen(backlog)
        self._sock.setblocking(False)

    def fileno(self) -> int:
        return self._sock.fileno()

    def accept(self) -> tuple[ShmChannel, str]:
        """The next link; :class:`BlockingIOError` when none waits. A connection from
        another user is closed and counted (``on_refused("shm_uid")``)."""
        while True:
            sock, _ = self._sock.accept()
            pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                  struct.calcsize("3i")))
            if uid != os.getuid():
                sock.close()
                if self._on_refused is not None:
                    self._on_refused("shm_uid")
                continue
            try:
                return ShmChannel(sock, self.capacity), f"shm:pid={pid}"
            except OSError:  # EMFILE/ENOMEM creating the ring, or the peer went away
                sock.close()
                if self._on_refused is not None:
                    self._on_refused("shm_setup")

    def close(self) -> None:
        self._sock.close()


def connect(name: str, capacity: int = DEFAULT_CAPACITY) -> tuple[socket.socket, int]:
    """Connect to the :class:`ShmListener` ``name``: (channel, 0), or (the unconnected
    socket, errno) when the connect failed (a unix connect never completes later)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    err = sock.connect_ex("\0" + name)
    if err == errno.EAGAIN:  # backlog full: a unix connect does not complete later
        err = errno.ECONNREFUSED
    if err != 0:
        return sock, err
    try:
        return ShmChannel(sock, capacity), 0
    except OSError as exc:  # EMFILE/ENOMEM creating the ring, or the peer went away
        sock.close()
        return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), exc.errno or errno.EIO
