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
from typing import Any, Callable

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
                conn.sendall(memoryview(self.area.numpy()))
            return
        pos = 0
        for t, (_, _, off, n) in zip(self.tensors, self._table):
            if off > pos:
                conn.sendall(bytes(off - pos))  # alignment padding
            if n:
                conn.sendall(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
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
        """Accept the source's stream and return the state object (its tensors are views of
        one freshly allocated buffer). ``into(structure)`` may name, by tensor index,
        existing tensors to receive straight into (no copy; e.g. the model's parameters);
        each must match its entry's dtype and shape and be contiguous, else it is ignored.
        See the module docstring for failures."""
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
                with conn:
                    conn.settimeout(max(1.0, deadline - time.monotonic()))
                    got = self._read_one(conn, into)
                    if got is not None:
                        return got
        finally:
            self.close()

    def _read_one(self, conn: socket.socket, into: Callable[[Any], dict[int, torch.Tensor]] | None) -> Any:
        try:
            magic, token, hlen, nbytes = _PREFIX.unpack(_recv_exact(conn, _PREFIX.size))
        except DataLost:
            return None  # a stray connection that closed early: keep waiting for the source
        if magic != MAGIC or token != self.token:
            return None
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
                _recv_into(conn, memoryview(area.numpy()))
            return assemble(header, area)
        # the rest into one buffer, each target straight into its own memory
        area = torch.empty(nbytes, dtype=torch.uint8)
        spans = sorted((table[i][2], table[i][3], t) for i, t in targets.items())
        pos = 0
        for off, n, t in spans:
            if off < pos or off + n > nbytes:
                raise FrameError(f"state stream tensor at offset {off} (+{n}) overlaps or runs past the end")
            if off > pos:
                _recv_into(conn, memoryview(area.numpy())[pos:off])
            if n:
                _recv_into(conn, memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()))
            pos = off + n
        if nbytes > pos:
            _recv_into(conn, memoryview(area.numpy())[pos:nbytes])
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


def serve(snapshot: Snapshot, host: str, port: int, token: int, timeout: float = 120.0) -> threading.Thread:
    """Stream ``snapshot`` to the receiver at ``host:port`` from a daemon thread (started,
    returned, and kept in ``snapshot.threads``). Never raises into the caller; errors go to
    ``snapshot.errors``."""

    def run() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout) as conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.sendall(_PREFIX.pack(MAGIC, token, len(snapshot.header), snapshot.nbytes) + snapshot.header)
                snapshot.send_to(conn)
        except OSError as exc:
            snapshot.errors.append(f"{host}:{port}: {exc}")

    t = threading.Thread(target=run, name=f"state-stream-{port}", daemon=True)
    snapshot.threads.append(t)
    t.start()
    return t


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
