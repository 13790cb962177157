"""Shared helpers of the TCP transport tests: a configured pair of real transports on
loopback, and a send/receive completed on both sides at once."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any, Iterator, Mapping

import numpy as np

from resilient.process_pool import PIPE, Child, ProcessPool, Spec
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


@contextlib.contextmanager
def linked_child(b: Any, code: str, env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike[str] | None = None) -> Iterator[Child]:
    """``python -c code`` as the peer "a" of ``b``, linked (see :func:`link_child`); the
    child is SIGKILLed (SIGCONT first, should the test have stopped it) and reaped on exit."""
    with ProcessPool() as pool:
        child = pool.start(Spec([sys.executable, "-c", code], env=env, cwd=cwd, stdin=PIPE, stdout=PIPE,
                                new_session=False, name="peer a"))
        try:
            link_child(b, child)
            yield child
        finally:
            child.signal(signal.SIGCONT)
            pool.stop(grace=0, sig=signal.SIGKILL)


def link_child(b: Any, p: Child) -> None:
    """Configure ``b`` with the child peer "a" (``p`` prints its address, reads ``b``'s on
    stdin, sends one 8-double message as op 1 tag 0 and prints ``SENT``) and receive that
    message: the link is up when this returns."""
    assert p.stdout is not None and p.stdin is not None
    aaddr = p.stdout.readline().strip()
    b.configure(1, "t", {"a": aaddr, "b": b.address})
    p.stdin.write(b.address + "\n")
    p.stdin.flush()
    b.recv_into("a", np.zeros(8), 1, 0)
    assert p.stdout.readline().strip() == "SENT"


def both(a: Any, ra: Any, b: Any, rb: Any, timeout: float | None = None) -> None:
    """Wait for ``ra`` on ``a`` (in a thread) and ``rb`` on ``b``; fails if either is not
    done within ``timeout`` (None: the join still bounds the thread at 10 s)."""
    t = threading.Thread(target=lambda: a.wait([ra], timeout=timeout))
    t.start()
    assert b.wait([rb], timeout=timeout) is True
    t.join(10)
    assert not t.is_alive() and ra.done()
