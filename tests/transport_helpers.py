"""Shared helpers of the TCP transport tests: a configured pair of real transports on
loopback, and a send/receive completed on both sides at once."""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from resilient.transport.tcp import TcpTransport


@contextlib.contextmanager
def transport_pair(cls: type = TcpTransport, **kw: Any) -> Iterator[tuple[TcpTransport, TcpTransport, dict[str, str]]]:
    """Transports "a" and "b" (of class ``cls``) of job "job", both configured for epoch 1,
    token "tok"; closed on exit."""
    a, b = cls("a", "job", **kw), cls("b", "job", **kw)
    addrs = {"a": a.address, "b": b.address}
    try:
        a.configure(1, "tok", addrs)
        b.configure(1, "tok", addrs)
        yield a, b, addrs
    finally:
        a.close()
        b.close()


def both(a: Any, ra: Any, b: Any, rb: Any, timeout: float | None = None) -> None:
    """Wait for ``ra`` on ``a`` (in a thread) and ``rb`` on ``b``; fails if either is not
    done within ``timeout`` (None: the join still bounds the thread at 10 s)."""
    t = threading.Thread(target=lambda: a.wait([ra], timeout=timeout))
    t.start()
    assert b.wait([rb], timeout=timeout) is True
    t.join(10)
    assert not t.is_alive() and ra.done()
