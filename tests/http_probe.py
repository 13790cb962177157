"""Helpers for tests that flood an HTTP endpoint with idle connections."""
from __future__ import annotations

import socket


def mark_refused(conns: list[socket.socket], refused: set[int]) -> int:
    """Add to ``refused`` the index of every connection that has been answered ``503``
    (read without blocking); return how many are refused so far."""
    for i, c in enumerate(conns):
        if i in refused:
            continue
        c.setblocking(False)
        try:
            if c.recv(64).startswith(b"HTTP/1.0 503"):
                refused.add(i)
        except BlockingIOError:
            pass
    return len(refused)
