"""Per-connection state of the TCP transport: one request, one link, buffer views.

One responsibility: the data the TCP state machines share — :class:`TcpRequest` (a
posted send/receive and its progress), :class:`Conn` (a socket and its framing state,
touched only by the progressing thread), :func:`as_memoryview` and the transport's
tunables. No I/O happens here.

Failure behaviour: :func:`as_memoryview` raises :class:`~resilient.errors.TransportError`
for a CUDA or non-contiguous buffer; :meth:`TcpRequest.fail` keeps the first error.
"""
from __future__ import annotations

import collections
import errno
import os
import socket
import ssl
import time

from resilient.errors import TransportError
from resilient.transport import frames
from resilient.transport.base import Buffer, Request

SOCK_BUF = 4 << 20   # default; RESILIENT_TCP_SOCKBUF (resilient.settings) sets it per transport
SCRATCH = 1 << 20
#: bytes of early-arrival buffers kept for reuse
SPARE_CAP = 32 << 20
#: bytes of frames buffered per connection before their receive is posted; beyond it the
#: connection is not read until a receive is posted (a header never allocates on trust)
EARLY_CAP = 256 << 20   # default; RESILIENT_TCP_EARLY_CAP (resilient.settings) sets it per transport
#: connections accepted per progress round (a connect flood cannot starve member links,
#: nor evict, in one round, pending handshakes that have not been read yet)
ACCEPT_BATCH = 16
#: accept pauses after EMFILE/ENFILE with nothing to evict: first and longest pause
ACCEPT_PAUSE_S, ACCEPT_PAUSE_MAX_S = 0.05, 1.0
FD_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: "try again later" from a non-blocking plain or TLS socket
WOULD_BLOCK = (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError)
#: largest TLS write (without partial writes a record batch is retried whole)
TLS_CHUNK = 256 << 10


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


class TcpRequest(Request):
    """A posted send or receive on a TCP link; ``offset`` bytes of the frame (header
    included, for a send) are through."""

    __slots__ = ("peer", "nbytes", "op_seq", "tag", "digest", "mv", "offset", "_done", "_error", "is_send", "t_done", "header", "started",
                 "speculative", "misfit_seen")

    def __init__(self, peer: str, mv: memoryview, op_seq: int, tag: int, digest: int, is_send: bool) -> None:
        self.peer, self.mv, self.op_seq, self.tag, self.digest, self.is_send = peer, mv, op_seq, tag, digest, is_send
        self.nbytes = len(mv)
        self.offset = 0
        self._done = False
        self._error: BaseException | None = None
        self.t_done = 0.0
        self.header = b""
        self.started = False
        #: a receive that takes only a message that fits (``Transport.irecv_speculative``)
        self.speculative = False
        self.misfit_seen = False

    def done(self) -> bool:
        return self._done

    def misfit(self) -> bool:
        return self.misfit_seen

    def fits(self, h: "frames.Header") -> bool:
        """Whether the frame ``h`` is this receive's message: same op, tag, length and digest."""
        return (h.op_seq, h.tag, h.length, h.digest) == (self.op_seq, self.tag, self.nbytes, self.digest)

    def touched(self) -> bool:
        return self.started or self._done

    def done_at(self) -> float | None:
        return self.t_done if self._done else None

    @property
    def error(self) -> BaseException | None:
        return self._error

    def _finish(self) -> None:
        self._done = True
        self.t_done = time.monotonic()

    def _fail(self, exc: BaseException) -> None:
        if not self._done and self._error is None:
            self._error = exc


class Conn:
    """One socket and its framing state (only touched by the progressing thread)."""

    def __init__(self, sock: socket.socket | None, peer: str | None, address: str | None) -> None:
        self.sock: socket.socket | None = sock
        self.peer = peer
        self.address = address
        self.connecting = False
        self.handshaken = peer is not None  # acceptor side: False until HELLO validated
        self.hello: frames.Hello | None = None  # acceptor: parsed HELLO waiting for our epoch
        self.sendq: collections.deque[TcpRequest] = collections.deque()
        self.raw_out: collections.deque[memoryview] = collections.deque()  # HELLO / ERROR frames
        self.pad = 0
        self.pad_head: memoryview | None = None  # rest of a cut frame's header, sent before its padding
        self.recvq: collections.deque[TcpRequest] = collections.deque()
        self.unexpected: collections.deque[tuple[frames.Header, bytearray]] = collections.deque()
        self.hdr = bytearray(frames.HEADER_SIZE)
        self.hdr_got = 0
        self.cur: frames.Header | None = None
        self.target: memoryview | None = None  # where the current payload goes
        self.target_req: TcpRequest | None = None
        self.target_got = 0
        self.frame_at = 0.0   # when the current payload's target was set (its first bytes may follow)
        self.discard = 0
        self.parked = False   # member link: a header of a future epoch waits for configure()
        self.stalled = False  # member link: a header waits for its receive (early_cap reached)
        self.early_bytes = 0  # bytes of ``unexpected`` payloads (and one being read into)
        self.session = ""     # acceptor: the dialler's HELLO session
        self.hello_epoch = -1  # dialler: the epoch its HELLO carried
        self.accepted = False  # dialler: the acceptor acknowledged its HELLO (an empty HELLO back)
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
