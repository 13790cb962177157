"""TCP transport over real loopback sockets: framing of every dtype, resync of kept
connections after a mid-frame abort, refused handshakes, corrupt frames, peer death (a
real child process, SIGKILLed). What every transport does (delivery, abort, close, stats,
cancel_op, post_error, digests) is in tests/test_transport_contract.py."""
from __future__ import annotations

import socket
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from resilient.errors import FrameError, OpMismatch, TransportAborted, TransportError
from resilient.transport import frames
from resilient.transport.tcp import TcpTransport

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transport_helpers import both, linked_child, transport_pair  # noqa: E402


@pytest.fixture
def pair():
    with transport_pair() as p:
        yield p


_both = both


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float16])
def test_roundtrip_into_preallocated_buffer(pair, dtype):
    a, b, _ = pair
    x = (torch.arange(100_003) % 251).to(dtype)
    y = torch.zeros_like(x)
    _both(a, a.isend("b", x, 1, 7), b, b.irecv("a", y, 1, 7))
    assert torch.equal(x, y)
    assert a.stats.bytes_sent == b.stats.bytes_received == x.numel() * x.element_size()






def test_kept_connection_resyncs_after_mid_frame_abort(pair):
    a, b, addrs = pair
    big = np.ones(32 << 20, np.uint8)
    sink = np.zeros_like(big)
    s = a.isend("b", big, 0, 0)
    r = b.irecv("a", sink, 0, 0)
    b.wait([r], timeout=0.005)
    a.wait([s], timeout=0.005)
    a.abort("x")
    b.abort("x")
    for tr, req in ((a, s), (b, r)):
        with pytest.raises(TransportAborted):
            tr.wait([req])
    conn_before = a._conns["b"].sock
    a.configure(2, "tok2", addrs)
    b.configure(2, "tok2", addrs)
    z = np.arange(1000, dtype=np.int64)
    rz = np.zeros_like(z)
    _both(a, a.isend("b", z, 0, 5), b, b.irecv("a", rz, 0, 5))
    assert (z == rz).all()
    assert a._conns["b"].sock is conn_before  # the connection was kept, not rebuilt




def test_wrong_token_is_refused():
    a, b = TcpTransport("a", "job"), TcpTransport("b", "job")
    got: list = []

    def receive() -> None:   # b's progress thread: it must refuse a's HELLO
        try:
            got.append(b.wait([b.irecv("a", np.zeros(1), 1, 0)], timeout=5))
        except (TransportError, TransportAborted) as exc:  # the abort below is a cancellation signal
            got.append(exc)

    th = threading.Thread(target=receive, daemon=True)
    try:
        addrs = {"a": a.address, "b": b.address}
        a.configure(1, "good", addrs)
        b.configure(1, "bad", addrs)
        th.start()
        with pytest.raises(TransportError):
            a.send("b", np.zeros(1 << 22), 1, 0)
    finally:
        b.abort("test over")    # thread-safe: ends b's wait before b is closed
        th.join(10)
        a.close()
        b.close()
    assert not th.is_alive() and got and got[0] is not True, got   # nothing was received from a


def test_corrupt_header_is_a_frame_error(pair):
    with pytest.raises(FrameError):
        frames.decode_header(b"X" * frames.HEADER_SIZE)
    raw = bytearray(frames.encode_header(frames.Header(frames.DATA, 1, 2, 3, 4)))
    raw[20] ^= 0xFF
    with pytest.raises(FrameError, match="checksum"):
        frames.decode_header(bytes(raw))
    # on the wire: a valid HELLO then garbage -> the waiting receive fails, nothing is written
    a, b, addrs = pair
    host, port = b.address.split(":")
    s = socket.create_connection((host, int(port)))
    hello = frames.encode_json({"job": "job", "epoch": 1, "token": "tok", "member": "a"})
    s.sendall(frames.encode_header(frames.Header(frames.HELLO, 1, 0, 0, len(hello))) + hello + b"\x00" * 48)
    y = np.zeros(4, np.float32)
    with pytest.raises((FrameError, TransportError)):
        b.recv_into("a", y, 1, 0)
    assert not y.any()
    s.close()


def test_peer_killed_fails_requests_naming_it(tmp_path):
    b = TcpTransport("b", "job")
    code = (
        "import sys, time, numpy as np\n"
        "from resilient.transport.tcp import TcpTransport\n"
        "a = TcpTransport('a', 'job'); print(a.address, flush=True)\n"
        "baddr = sys.stdin.readline().strip()\n"
        "a.configure(1, 't', {'a': a.address, 'b': baddr})\n"
        "a.send('b', np.zeros(8), 1, 0); print('SENT', flush=True); time.sleep(600)\n")
    try:
        with linked_child(b, code) as p:
            p.signal(signal.SIGKILL)
            with pytest.raises(TransportError, match="member a"):
                b.recv_into("a", np.zeros(8), 1, 1)
    finally:
        b.close()


def test_a_link_refused_for_a_stale_epoch_is_dialled_again_in_the_new_one():
    """The dialler sent its HELLO in epoch 2, moved to epoch 3 before the peer (already in
    epoch 3) refused it: the next request dials again with epoch 3's HELLO and is delivered
    (the link stayed failed for the whole epoch before: a survivor hang after a kill)."""
    a, b = TcpTransport("a", "job"), TcpTransport("b", "job")
    addrs = {"a": a.address, "b": b.address}
    got: list = []
    y = np.zeros(1000)

    def receive() -> None:   # b's progress: refuses the epoch-2 HELLO, then gets op 2
        try:
            got.append(b.wait([b.irecv("a", y, 2, 0)], timeout=10))
        except (TransportError, TransportAborted) as exc:
            got.append(exc)

    th = threading.Thread(target=receive, daemon=True)
    try:
        b.configure(3, "t3", addrs)
        a.configure(2, "t2", addrs)
        # dials with epoch 2's HELLO; 32 MiB cannot all fit in the socket buffers, so it is
        # still being written (offset > 0, kept across configure) when b refuses the link
        first = a.isend("b", np.ones(1 << 22), 1, 0)
        a.configure(3, "t3", addrs)                 # before b has read (and refused) it
        th.start()
        with pytest.raises(TransportError):
            a.wait([first], timeout=10)             # b refused the stale HELLO: reset / EPIPE
        x = np.arange(1000, dtype=np.float64)
        assert a.wait([a.isend("b", x, 2, 0)], timeout=10) is True   # what the retrying layer re-posts
        th.join(10)
        assert got == [True], got
        assert np.array_equal(y, x)
        assert b.stats.dropped.get("hello_refused") == 1
    finally:
        b.abort("test over")
        th.join(10)
        a.close()
        b.close()
