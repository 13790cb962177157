"""A side channel that streams a state snapshot to a joiner while the others keep training.

At a joiner's admission ``State.sync()`` (see :mod:`resilient.elastic.state`) the joiner
opens a :class:`StateReceiver` (a listening TCP socket on the data-plane host, a random
64-bit token) and tells the group its endpoint and token through one small allreduce.
The source member wraps its state at that step boundary in a :class:`Snapshot` (either
one memory copy of every tensor, or — what ``State`` does for parameters and optimizer
state — the live tensors themselves, which it keeps unchanged until the stream is done)
and :func:`serve` streams it from a background thread; the source's training thread
returns to training right away. The joiner receives straight into one buffer, checks the
token and the sizes, and loads the state (no pickle anywhere: the header is the codec's
JSON, the rest raw tensor bytes).

Wire format (little endian): ``b"RSTATE01"``, token ``u64``, header length ``u64``,
area length ``u64``, the header (:func:`resilient.torch_backend.codec.split`), the
tensor area.

Failure behaviour: a connection whose magic or token is wrong is closed and the receiver
keeps waiting for the right one; no (right) connection before the deadline raises
``TimeoutError``; a stream cut short (the source died) raises
:class:`~resilient.errors.DataLost`; a header that does not parse raises
:class:`~resilient.errors.FrameError`. On the serving side a failed send is recorded in
``Snapshot.errors`` (the joiner sees it as a cut stream); it never raises into training.
"""
from __future__ import annotations

import ipaddress
import json
import secrets
import socket
import struct
import threading
import time
from typing import Any, Callable, Sequence

import torch

from resilient.errors import DataLost, FrameError, ResilientTimeout
from resilient.torch_backend.codec import assemble, pack_into, split

MAGIC = b"RSTATE01"
_PREFIX = struct.Struct("<8sQQQ")
_MAX_HEADER = 256 << 20


class Snapshot:
    """The state at one step boundary: ``header`` (codec JSON) and its tensors. With
    ``copy=True`` they are copied into one buffer (``area``) at once, so the caller may
    change the live tensors right away. With ``copy=False`` they are sent from the live
    tensors themselves (no copy): the caller must not change them until :meth:`join`
    returns (``State`` holds ``optimizer.step()`` back for that)."""

    def __init__(self, obj: Any, copy: bool = True) -> None:
        self.header, tensors, self._nbytes = split(obj)
        self._table = json.loads(self.header)["t"]
        self.area: torch.Tensor | None = None
        self.tensors: list[torch.Tensor] = tensors
        if copy:
            self.area = torch.empty(self._nbytes, dtype=torch.uint8)
            pack_into(self.header, tensors, self.area)
            self.tensors = []
        self.errors: list[str] = []
        self.threads: list[threading.Thread] = []

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def send_to(self, conn: socket.socket) -> None:
        """Write the tensor area to ``conn`` (from the copy, or tensor by tensor)."""
        if self.area is not None:
            if self._nbytes:
                conn.sendall(_view(self.area))
            return
        pos = 0
        for t, (_, _, off, n) in zip(self.tensors, self._table):
            if off > pos:
                conn.sendall(bytes(off - pos))  # alignment padding
            if n:
                conn.sendall(_view(t.reshape(-1).view(torch.uint8)))
            pos = off + n
        if self._nbytes > pos:
            conn.sendall(bytes(self._nbytes - pos))

    def join(self, timeout: float | None = None) -> None:
        """Wait for every stream started by :func:`serve` (tests; shutdown)."""
        for t in self.threads:
            t.join(timeout)


def endpoint_words(host: str, port: int) -> tuple[int, int]:
    """``(ipv4 as int, port)``: how an endpoint travels in an int64 collective. Raises
    ValueError for a host that is not an IPv4 address (the caller falls back)."""
    return int(ipaddress.IPv4Address(socket.gethostbyname(host))), port


class StateReceiver:
    """The joiner's end: a listening socket on ``host`` (port chosen by the OS) and a
    random token (what the source must present)."""

    def __init__(self, host: str) -> None:
        self.token = secrets.randbits(63) or 1
        self._sock = socket.create_server((host, 0))
        self.host, self.port = host, self._sock.getsockname()[1]

    def close(self) -> None:
        self._sock.close()

    def receive(self, timeout: float, into: Callable[[Any], dict[int, torch.Tensor]] | None = None) -> Any:
        """Accept the source's stream and return the state object of its first frame (its
        tensors are views of one freshly allocated buffer). ``into(structure)`` may name,
        by tensor index, existing tensors to receive straight into (no copy; e.g. the
        model's parameters); each must match its entry's dtype and shape and be
        contiguous, else it is ignored. See the module docstring for failures."""
        obj, rest = self.receive_first(timeout, into)
        rest.close()
        return obj

    def receive_first(self, timeout: float, into: Callable[[Any], dict[int, torch.Tensor]] | None = None
                      ) -> tuple[Any, "NextPart"]:
        """As :meth:`receive`, and the connection kept open for the frames that follow
        (:class:`NextPart`; close it when done)."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ResilientTimeout(f"no state stream arrived at {self.host}:{self.port} within {timeout:.0f}s "
                                           "(did the source member die before it connected?)")
                self._sock.settimeout(left)
                try:
                    conn, _ = self._sock.accept()
                except socket.timeout:
                    continue
                try:
                    conn.settimeout(max(1.0, deadline - time.monotonic()))
                    got = self._read_one(conn, into)
                except BaseException:
                    conn.close()
                    raise
                if got is not None:
                    return got[0], NextPart(conn, self.token)
                conn.close()
        finally:
            self.close()

    def _read_one(self, conn: socket.socket, into: Callable[[Any], dict[int, torch.Tensor]] | None
                  ) -> tuple[Any] | None:
        try:
            magic, token, hlen, nbytes = _PREFIX.unpack(_recv_exact(conn, _PREFIX.size))
        except DataLost:
            return None  # a stray connection that closed early: keep waiting for the source
        if magic != MAGIC or token != self.token:
            return None
        return (_read_frame(conn, hlen, nbytes, into),)


class NextPart:
    """The open stream after its first frame: :meth:`read` returns the next frame's state
    object (then closes). Failure behaviour: the stream cut short -> DataLost; no next
    frame within ``timeout`` -> DataLost (as a cut stream); a frame with a foreign magic or token, or a bad
    header -> FrameError."""

    def __init__(self, conn: socket.socket, token: int) -> None:
        self._conn, self._token = conn, token

    def read(self, timeout: float) -> Any:
        try:
            self._conn.settimeout(timeout)
            magic, token, hlen, nbytes = _PREFIX.unpack(_recv_exact(self._conn, _PREFIX.size))
            if magic != MAGIC or token != self._token:
                raise FrameError("the state stream's next part has a foreign magic or token")
            return _read_frame(self._conn, hlen, nbytes, None)
        finally:
            self.close()

    def close(self) -> None:
        self._conn.close()


def _read_frame(conn: socket.socket, hlen: int, nbytes: int,
                into: Callable[[Any], dict[int, torch.Tensor]] | None) -> Any:
    """One frame's header and tensor area (after its prefix), see StateReceiver.receive."""
    if hlen > _MAX_HEADER:
        raise FrameError(f"state stream header of {hlen} bytes exceeds {_MAX_HEADER}")
    header = bytes(_recv_exact(conn, hlen))
    targets: dict[int, torch.Tensor] = {}
    if into is not None:
        try:
            parsed = json.loads(header)
            table = parsed["t"]
            for i, t in into(parsed["s"]).items():
                dtype_name, shape, _, n = table[i]
                if (str(t.dtype).replace("torch.", "") == dtype_name and list(t.shape) == list(shape)
                        and t.is_contiguous() and t.device.type == "cpu" and t.numel() * t.element_size() == n):
                    targets[i] = t
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise FrameError(f"state stream header is not valid: {exc}") from None
    if not targets:
        area = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            _recv_into(conn, _view(area))
        return assemble(header, area)
    # the rest into one buffer, each target straight into its own memory
    area = torch.empty(nbytes, dtype=torch.uint8)
    spans = sorted((table[i][2], table[i][3], t) for i, t in targets.items())
    pos = 0
    for off, n, t in spans:
        if off < pos or off + n > nbytes:
            raise FrameError(f"state stream tensor at offset {off} (+{n}) overlaps or runs past the end")
        if off > pos:
            _recv_into(conn, _view(area)[pos:off])
        if n:
            _recv_into(conn, _view(t.detach().reshape(-1).view(torch.uint8)))
        pos = off + n
    if nbytes > pos:
        _recv_into(conn, _view(area)[pos:nbytes])
    obj = assemble(header, area)
    return _substitute(obj, parsed["s"], targets)


def _substitute(obj: Any, structure: Any, targets: dict[int, torch.Tensor]) -> Any:
    """Put the received-into tensors where :func:`assemble` placed views of the area."""
    if isinstance(structure, dict):
        if "__t__" in structure:
            return targets.get(int(structure["__t__"]), obj)
        if "__d__" in structure:
            return {k: _substitute(obj[k], v, targets) for k, v in structure["__d__"]}
        if "__u__" in structure:
            return tuple(_substitute(o, v, targets) for o, v in zip(obj, structure["__u__"]))
    if isinstance(structure, list):
        return [_substitute(o, v, targets) for o, v in zip(obj, structure)]
    return obj


def serve(parts: Snapshot | Sequence[Snapshot], host: str, port: int, token: int,
          timeout: float = 120.0) -> threading.Thread:
    """Stream ``parts`` (one snapshot, or several sent in order over one connection, each a
    frame of its own) to the receiver at ``host:port`` from a daemon thread (started,
    returned, and kept in every part's ``threads``). Never raises into the caller; errors
    go to every part's ``errors``."""
    seq = [parts] if isinstance(parts, Snapshot) else list(parts)

    def run() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout) as conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for part in seq:
                    conn.sendall(_PREFIX.pack(MAGIC, token, len(part.header), part.nbytes) + part.header)
                    part.send_to(conn)
        except OSError as exc:
            for part in seq:
                part.errors.append(f"{host}:{port}: {exc}")

    t = threading.Thread(target=run, name=f"state-stream-{port}", daemon=True)
    for part in seq:
        part.threads.append(t)
    t.start()
    return t


def _view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU uint8 tensor, writable, without a copy."""
    return t.numpy().data


def _recv_into(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        try:
            n = conn.recv_into(view[got:])
        except OSError as exc:
            raise DataLost(f"the state stream broke after {got} of {len(view)} bytes: {exc} (the source member "
                           "died? the joiner restarts and is synced again)") from None
        if n == 0:
            raise DataLost(f"the state stream ended after {got} of {len(view)} bytes (the source member died? "
                           "the joiner restarts and is synced again)")
        got += n


def _recv_exact(conn: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    if n:
        _recv_into(conn, memoryview(buf))
    return buf
