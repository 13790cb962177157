"""Bounded bookkeeping of accepted connections that have not completed their handshake.

Anyone who can reach a member's listener can open connections to it; until a HELLO with
the right job, epoch token and member id arrives such a connection is not a member link
and must cost the member almost nothing. :class:`PendingHandshakes` keeps them in arrival
order and enforces, across all of them:

* a count cap (``max_pending``): accepting one more evicts an older one — first those
  that have not sent a complete HELLO yet (half-open, slow), then the oldest parked one;
* a byte cap (``max_bytes``) on HELLO payload buffers, reserved before a buffer is
  allocated (a header can announce at most :data:`~resilient.transport.frames.MAX_HELLO_PAYLOAD`);
* a deadline: ``timeout_s`` from accept to a complete HELLO, ``parked_timeout_s`` for a
  HELLO naming an epoch this member has not reached yet (parked until ``configure``).

The registry only decides; the transport closes what it returns (and counts it).
Failure behaviour: a bad limit in the environment raises
:class:`~resilient.errors.ConfigError` naming the variable; nothing here does I/O except
:func:`peer_closed`, which never raises.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Generic, Hashable, Iterator, Mapping, TypeVar

from resilient.errors import ConfigError

T = TypeVar("T", bound=Hashable)

_ENV = {
    "max_pending": "RESILIENT_TCP_MAX_PENDING",
    "max_bytes": "RESILIENT_TCP_PENDING_BYTES",
    "timeout_s": "RESILIENT_TCP_HANDSHAKE_TIMEOUT",
    "parked_timeout_s": "RESILIENT_TCP_PARKED_TIMEOUT",
}


@dataclass(frozen=True)
class HandshakeLimits:
    """Caps on not-yet-validated connections (see the module docstring)."""

    max_pending: int = 64
    max_bytes: int = 256 << 10
    timeout_s: float = 10.0
    parked_timeout_s: float = 60.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "HandshakeLimits":
        """Defaults overridden by ``RESILIENT_TCP_MAX_PENDING``, ``RESILIENT_TCP_PENDING_BYTES``,
        ``RESILIENT_TCP_HANDSHAKE_TIMEOUT`` and ``RESILIENT_TCP_PARKED_TIMEOUT`` (seconds);
        :class:`ConfigError` on a value that is not a positive number."""
        env = os.environ if environ is None else environ
        values: dict[str, float | int] = {}
        for name, var in _ENV.items():
            raw = env.get(var)
            if raw is None or raw == "":
                continue
            kind = int if name in ("max_pending", "max_bytes") else float
            try:
                v = kind(raw)
            except ValueError:
                v = 0
            if v <= 0:
                raise ConfigError(f"{var}={raw!r} must be a positive {'integer' if kind is int else 'number'}")
            values[name] = v
        return cls(**values)  # type: ignore[arg-type]


class PendingHandshakes(Generic[T]):
    """Accepted, not yet validated connections, oldest first (not thread-safe: only the
    transport's progressing thread uses it)."""

    def __init__(self, limits: HandshakeLimits) -> None:
        self.limits = limits
        self._deadline: dict[T, float] = {}   # insertion order == arrival order
        self._parked: set[T] = set()
        self._bytes: dict[T, int] = {}
        self.total_bytes = 0

    def __len__(self) -> int:
        return len(self._deadline)

    def __contains__(self, conn: object) -> bool:
        return conn in self._deadline

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._deadline))

    def add(self, conn: T, now: float) -> list[T]:
        """Register a freshly accepted connection; returns the ones evicted to stay under
        ``max_pending`` (the caller closes them)."""
        evicted = []
        while len(self._deadline) >= self.limits.max_pending:
            victim = self._victim(exclude=conn)
            if victim is None:
                break
            self.remove(victim)
            evicted.append(victim)
        self._deadline[conn] = now + self.limits.timeout_s
        return evicted

    def _victim(self, exclude: T) -> T | None:
        """Oldest connection without a complete HELLO, else the oldest parked one."""
        parked = None
        for c in self._deadline:
            if c == exclude:
                continue
            if c not in self._parked:
                return c
            if parked is None:
                parked = c
        return parked

    def remove(self, conn: T) -> None:
        """Forget ``conn`` (validated, refused or closed) and release its bytes; idempotent."""
        self._deadline.pop(conn, None)
        self._parked.discard(conn)
        self.release(conn)

    def reserve(self, conn: T, nbytes: int) -> list[T] | None:
        """Reserve ``nbytes`` of HELLO buffer for ``conn``, evicting others (oldest first,
        as :meth:`add`) until it fits; returns the evicted ones, or None when ``nbytes``
        alone exceeds ``max_bytes`` (the caller refuses ``conn``)."""
        if nbytes > self.limits.max_bytes:
            return None
        self.release(conn)
        evicted = []
        while self.total_bytes + nbytes > self.limits.max_bytes:
            victim = next((c for c in self._bytes if c != conn), None)
            if victim is None:
                break
            self.remove(victim)
            evicted.append(victim)
        self._bytes[conn] = nbytes
        self.total_bytes += nbytes
        return evicted

    def release(self, conn: T) -> None:
        self.total_bytes -= self._bytes.pop(conn, 0)

    def park(self, conn: T, now: float) -> None:
        """``conn`` sent a HELLO for a future epoch: it waits (once) up to ``parked_timeout_s``."""
        if conn in self._deadline and conn not in self._parked:
            self._parked.add(conn)
            self._deadline[conn] = now + self.limits.parked_timeout_s

    def is_parked(self, conn: T) -> bool:
        return conn in self._parked

    def expired(self, now: float) -> list[T]:
        """Connections past their deadline (still registered: the caller removes them)."""
        return [c for c, d in self._deadline.items() if d <= now]

    def next_deadline(self) -> float | None:
        return min(self._deadline.values(), default=None)


def peer_closed(sock: socket.socket) -> bool:
    """Whether the remote end of ``sock`` has closed or reset it (a non-blocking peek:
    EOF or an error means closed; no data or pending data means open). Never raises."""
    try:  # the raw socket's recv, also for a TLS socket (its own refuses flags)
        return socket.socket.recv(sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):
        return True
