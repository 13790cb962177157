"""Hardening of the TCP transport against whoever can reach a member's listener (issue 14),
over real loopback sockets: a raw socket plays the attacker against real transports.

Pending handshakes are capped in number and bytes and reaped at a deadline; a parked
(future-epoch) HELLO is watched for EOF; HELLOs that break the dial rule, the job or the
token are refused; a HELLO naming a member whose link is live is refused (the real link
keeps working) while a genuine reconnect after the old link closed is accepted; a DATA
header announcing 2**40 bytes allocates nothing and fails only its connection; any
exception while serving a connection drops that connection, never the member."""
from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from resilient.transport.retrying import RetryingTransport
from resilient.errors import FrameError, TransportError
from resilient.transport import frames
from resilient.transport.handshake import HandshakeLimits
from resilient.transport.tcp import TcpTransport

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transport_helpers import both, transport_pair  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _connect(t: TcpTransport) -> socket.socket:
    host, port = t.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    return s


def _pump(t: TcpTransport, cond, timeout: float = 10.0, what: str = "condition") -> None:
    """Progress ``t`` until ``cond()`` holds; fail after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        t.idle(0.02)


def _closed_by_peer(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _hello(member: str, epoch: int = 1, token: str = "tok", job: str = "job") -> bytes:
    return frames.encode_hello(frames.Hello(job, epoch, token, member, "attacker"))


def _both(a, ra, b, rb) -> None:
    both(a, ra, b, rb, timeout=10)


def _exchange(a: TcpTransport, b: TcpTransport, seq: int) -> None:
    x = np.arange(1000, dtype=np.int64) + seq
    y = np.zeros_like(x)
    _both(a, a.isend("b", x, seq, 0), b, b.irecv("a", y, seq, 0))
    assert (x == y).all()


@pytest.fixture
def pair():
    with transport_pair(limits=HandshakeLimits(max_pending=8, max_bytes=16 << 10, timeout_s=0.5,
                                               parked_timeout_s=1.0)) as p:
        yield p


def test_pending_handshakes_are_capped_and_the_oldest_evicted(pair):
    a, b, _ = pair
    socks = [_connect(b) for _ in range(20)]
    try:
        _pump(b, lambda: b.stats.dropped.get("pending_evicted", 0) >= 12, what="12 evictions")
        assert len(b._accepting) <= 8
        assert all(_closed_by_peer(s) for s in socks[:12])   # the oldest went first
        _exchange(a, b, 1)                                    # the member link still works
    finally:
        for s in socks:
            s.close()


def test_silent_connection_is_reaped_at_the_handshake_deadline(pair):
    _, b, _ = pair
    s = _connect(b)
    try:
        _pump(b, lambda: len(b._accepting) == 1, what="the accept")
        _pump(b, lambda: b.stats.dropped.get("handshake_timeout", 0) == 1, what="the deadline")
        assert _closed_by_peer(s) and len(b._accepting) == 0
    finally:
        s.close()


def test_oversized_hello_header_is_refused_without_allocating(pair):
    _, b, _ = pair
    s = _connect(b)
    huge = struct_header(frames.HELLO, 1 << 20)
    try:
        s.sendall(huge)
        _pump(b, lambda: b.stats.dropped.get("protocol_error", 0) == 1, what="the refusal")
        assert b._accepting.total_bytes == 0
    finally:
        s.close()


def struct_header(kind: int, length: int, epoch: int = 1, op_seq: int = 0) -> bytes:
    """A well-formed header (valid checksum) announcing ``length`` bytes, built by hand so
    that lengths the encoder would never produce can be sent."""
    import struct
    import zlib
    body = struct.pack("<4sBBHQQQQI", frames.MAGIC, frames.VERSION, kind, 0, epoch, op_seq, 0, length, 0)
    return body + struct.pack("<I", zlib.crc32(body))


def test_pending_hello_bytes_are_capped_across_connections(pair):
    _, b, _ = pair   # 16 KiB budget: four 4 KiB HELLOs at most, whatever the count cap
    socks = [_connect(b) for _ in range(6)]
    try:
        for s in socks:
            s.sendall(struct_header(frames.HELLO, frames.MAX_HELLO_PAYLOAD))  # ...and never the payload
        _pump(b, lambda: b.stats.dropped.get("pending_evicted", 0) >= 2, what="byte-cap evictions")
        assert b._accepting.total_bytes <= 16 << 10
    finally:
        for s in socks:
            s.close()


def test_parked_hello_is_reaped_on_eof_and_refused_at_its_epoch(pair):
    a, b, addrs = pair
    gone, stays = _connect(b), _connect(b)
    try:
        gone.sendall(_hello("a", epoch=5, token="guess"))
        stays.sendall(_hello("a", epoch=2, token="guess"))
        _pump(b, lambda: sum(1 for c in b._accepting if c.hello is not None) == 2, what="two parked HELLOs")
        gone.close()   # parked, then the peer goes away: noticed without any configure()
        _pump(b, lambda: b.stats.dropped.get("parked_closed", 0) == 1, what="the EOF reap")
        a.configure(2, "tok2", addrs)
        b.configure(2, "tok2", addrs)   # now its token is checked: wrong
        assert b.stats.dropped.get("hello_refused", 0) == 1 and _closed_by_peer(stays)
        _exchange(a, b, 2)
    finally:
        stays.close()


def test_hello_from_a_higher_id_or_other_job_is_refused(pair):
    _, b, _ = pair
    s1, s2 = _connect(b), _connect(b)
    try:
        s1.sendall(_hello("z"))             # "z" > "b": it never dials b
        s2.sendall(_hello("a", job="other"))
        _pump(b, lambda: b.stats.dropped.get("hello_refused", 0) == 2, what="two refusals")
    finally:
        s1.close()
        s2.close()


def test_impersonating_hello_does_not_replace_a_live_link(pair):
    a, b, _ = pair
    _exchange(a, b, 1)                      # the real link a->b is up
    s = _connect(b)
    try:
        s.sendall(_hello("a") + struct_header(frames.DATA, 1 << 40, op_seq=2))   # right token, a's name
        _pump(b, lambda: b.stats.dropped.get("link_taken", 0) == 1, what="the refusal")
        assert _closed_by_peer(s)
        _exchange(a, b, 2)                  # the real link still carries op 2
    finally:
        s.close()


def test_genuine_reconnect_after_the_old_link_closed(pair):
    a, b, addrs = pair
    _exchange(a, b, 1)
    a.close()                               # the old link really dies (b has not noticed yet)
    a2 = TcpTransport("a", "job")
    suspects: list = []
    rb = RetryingTransport(b, give_up_s=10, on_suspect=lambda p, why: suspects.append(p), is_member=lambda p: True)
    try:
        a2.configure(1, "tok", addrs | {"a": a2.address})
        x, y = np.arange(10, dtype=np.int64), np.zeros(10, np.int64)
        # b's receive may land on the old link first: it fails there and is re-posted
        # (the communicator's retry path) onto the new one
        _both(a2, a2.isend("b", x, 3, 0), rb, rb.irecv("a", y, 3, 0))
        assert (x == y).all() and "link_taken" not in b.stats.dropped
    finally:
        a2.close()


def test_huge_data_header_allocates_nothing_and_fails_only_its_connection(pair):
    a, b, _ = pair
    c = TcpTransport("c", "job")            # b's other peer: must be unaffected
    addrs = {"a": a.address, "b": b.address, "c": c.address, "0": "127.0.0.1:1"}
    s = _connect(b)
    try:
        for t in (a, b, c):
            t.configure(2, "tok", addrs)
        # an epoch-token holder claims member "0" (no live link) and announces 2**40 bytes
        s.sendall(_hello("0", epoch=2) + struct_header(frames.DATA, 1 << 40, epoch=2, op_seq=7))
        _pump(b, lambda: "0" in b._conns and b._conns["0"].stalled, what="the stalled header")
        assert b._conns["0"].early_bytes == 0          # nothing was allocated for it
        x, y = np.arange(10, dtype=np.int64), np.zeros(10, np.int64)   # b still serves b<->c
        _both(b, b.isend("c", x, 7, 0), c, c.irecv("b", y, 7, 0))
        r = b.irecv("0", np.zeros(4, np.int64), 7, 0)   # the posted receive is 32 bytes: protocol error
        with pytest.raises(TransportError, match="protocol error"):
            b.wait([r], timeout=5)
        assert b.stats.dropped.get("protocol_error") == 1
        _exchange(a, b, 8)                              # and every other link works on
    finally:
        s.close()
        c.close()


def test_an_exception_serving_one_connection_drops_only_it(pair, monkeypatch):
    a, b, addrs = pair
    c = TcpTransport("0c", "job")           # sorts below "b": it dials b
    addrs = addrs | {"0c": c.address}
    try:
        for t in (a, b, c):
            t.configure(2, "tok", addrs)
        real = b._spare_buf

        def boom(n: int) -> bytearray:      # an early frame from c: the allocation fails
            if n == 80:
                raise MemoryError("injected")
            return real(n)

        monkeypatch.setattr(b, "_spare_buf", boom)
        s = c.isend("b", np.zeros(10, np.int64), 1, 0)
        c.wait([s], timeout=5)
        _pump(b, lambda: b.stats.dropped.get("internal_error", 0) == 1, what="the drop")
        with pytest.raises(TransportError, match="MemoryError"):
            b.recv_into("0c", np.zeros(10, np.int64), 1, 0)
        _exchange(a, b, 3)                  # the member is not wedged: later waits work
    finally:
        c.close()


def test_configure_with_an_epoch_beyond_u64_is_a_frame_error(pair):
    a, _, addrs = pair
    with pytest.raises(FrameError, match="64-bit"):
        a.configure(1 << 64, "tok", addrs)
    assert a.epoch == 1
