"""Shared-memory links (resilient.transport.shm) and the hybrid transport that picks them for
same-host peers: TCP framing tests rerun over shared memory (the contract itself runs over
"shm" in tests/test_transport_contract.py), ring
wrap-around, refused descriptors and doorbell records, routing (same host: shm; other
host key or a plain TCP peer: TCP), and real child processes that are SIGKILLed (EOF fails
the requests naming the peer) and SIGSTOPped mid-message (only completely written bytes are
ever received; the abort wakes the waiting member). No segment is left in /dev/shm."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from resilient.errors import FrameError, TransportAborted, TransportError
from resilient.transport import shm
from resilient.transport.hybrid import HybridTransport, make_transport, split_address
from resilient.transport.tcp import TcpTransport

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transport_helpers import both, linked_child, transport_pair  # noqa: E402
from test_transport_tcp import (  # noqa: E402,F401  (rerun over shared memory: see the `pair` fixture)
    test_kept_connection_resyncs_after_mid_frame_abort, test_roundtrip_into_preallocated_buffer,
)

ROOT = Path(__file__).resolve().parents[1]


def _shm_names() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _mapped_rings() -> int:
    return sum("memfd:resilient-shm" in line for line in Path("/proc/self/maps").read_text().splitlines())


@pytest.fixture(autouse=True)
def no_leftovers():
    """Nothing of ours in /dev/shm; every ring this test mapped is unmapped when it ends."""
    before, rings = _shm_names(), _mapped_rings()
    yield
    assert _shm_names() <= before
    assert _mapped_rings() == rings


@pytest.fixture
def pair():
    with transport_pair(cls=HybridTransport) as p:
        a, b, _ = p
        assert a.is_shm_peer("b") and b.is_shm_peer("a")
        yield p
        for tr, peer in ((a, "b"), (b, "a")):   # every link that was opened is shared memory
            conn = tr._conns.get(peer)
            assert conn is None or conn.sock is None or isinstance(conn.sock, shm.ShmChannel)


def _channels(capacity: int = shm.MIN_CAPACITY) -> tuple[shm.ShmChannel, shm.ShmChannel]:
    s1, s2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return shm.ShmChannel(s1, capacity), shm.ShmChannel(s2, capacity)


def _pump_until(pred, *channels, rounds: int = 100_000) -> None:
    for _ in range(rounds):
        if pred():
            return
        for ch in channels:
            ch.pump()
    raise AssertionError("condition not reached")


def test_links_are_shared_memory_and_wrap_the_ring():
    a, b = _channels()
    try:
        rng = np.random.default_rng(1)
        data = rng.integers(0, 256, 5 * shm.MIN_CAPACITY + 17, dtype=np.uint8)
        out = np.zeros_like(data)
        sent = got = 0
        while got < len(data):  # odd write and read sizes: every wrap-around position
            if sent < len(data):
                try:
                    sent += a.send(memoryview(data)[sent:sent + int(rng.integers(1, 40_000))])
                except BlockingIOError:
                    pass
            try:
                got += b.recv_into(memoryview(out)[got:], int(rng.integers(1, 30_000)))
            except BlockingIOError:
                b.flush()
        assert (out == data).all()
        a.close()
        _pump_until(lambda: b.eof, b)
        assert b.recv_into(bytearray(1)) == 0   # EOF once everything announced was read
    finally:
        a.close()
        b.close()


def test_writer_is_held_by_a_reader_that_does_not_read():
    a, b = _channels()
    try:
        n = 0
        with pytest.raises(BlockingIOError):
            while True:
                n += a.send(bytes(4096))
        assert n == shm.MIN_CAPACITY  # never more than the reader credited
        got = b.recv_into(bytearray(1000))
        b.flush()   # small credits are batched until the reader would wait (the transport flushes then)
        _pump_until(lambda: a.has_room, a)
        assert a.send(bytes(4096)) == got
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("record", [b"X", b"D", b"C", b"S"])
def test_bad_doorbell_records_are_frame_errors(record):
    s1, s2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b = shm.ShmChannel(s2, shm.MIN_CAPACITY)
    try:
        s1.recv(64)
        if record == b"S":   # a setup whose descriptor is a pipe, not a sealed memfd
            r, w = os.pipe()
            socket.send_fds(s1, [shm._REC.pack(b"S", shm.MIN_CAPACITY)], [r])
            os.close(r)
            os.close(w)
        else:                # data before any setup / credit beyond what was written / junk
            s1.sendall(shm._REC.pack(record, 1 << 40))
        with pytest.raises(FrameError):
            _pump_until(lambda: False, b, rounds=1000)
    finally:
        s1.close()
        b.close()


def test_unsealed_or_short_memfd_is_refused():
    fd = os.memfd_create("resilient-shm-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, shm.MIN_CAPACITY)
    with pytest.raises(FrameError, match="sealed"):
        shm.map_peer_ring(fd, shm.MIN_CAPACITY)   # closes fd
    fd = shm.make_ring(shm.MIN_CAPACITY)
    with pytest.raises(FrameError, match="size"):
        shm.map_peer_ring(fd, 2 * shm.MIN_CAPACITY)


def test_routing_same_host_shm_else_tcp(monkeypatch):
    h, t = HybridTransport("a", "job"), TcpTransport("c", "job")
    far = HybridTransport("d", "job")
    _, key, name = split_address(far.address)
    far_addr = far.address.replace(key, "otherhost.1")   # another host: same socket name, other key
    try:
        addrs = {"a": h.address, "c": t.address, "d": far_addr}
        assert h.is_shm_peer("c") is False
        for tr in (h, t):
            tr.configure(1, "tok", addrs)
        far.configure(1, "tok", addrs)
        assert h.is_shm_peer("d") is False and not h.is_shm_peer("c")
        for peer, other in (("c", t), ("d", far)):
            x, y = np.arange(1000.0), np.zeros(1000)
            both(h, h.isend(peer, x, 1, 0), other, other.irecv("a", y, 1, 0), timeout=10)
            assert (x == y).all()
            assert not isinstance(h._conns[peer].sock, shm.ShmChannel)
    finally:
        for tr in (h, t, far):
            tr.close()
    monkeypatch.delenv("RESILIENT_TRANSPORT", raising=False)
    with make_transport("x", "job") as default:   # what members build: shm on one host
        assert type(default) is HybridTransport and split_address(default.address)[1] is not None
    monkeypatch.setenv("RESILIENT_SHM", "0")
    with HybridTransport("e", "job") as off:
        assert split_address(off.address)[1] is None
    monkeypatch.setenv("RESILIENT_TRANSPORT", "tcp")
    with make_transport("f", "job") as plain:
        assert type(plain) is TcpTransport
    monkeypatch.setenv("RESILIENT_TRANSPORT", "gloo")
    with pytest.raises(Exception, match="RESILIENT_TRANSPORT"):
        make_transport("g", "job")


_CHILD = (
    "import sys, time, numpy as np\n"
    "from resilient.transport.hybrid import HybridTransport\n"
    "a = HybridTransport('a', 'job'); print(a.address, flush=True)\n"
    "baddr = sys.stdin.readline().strip()\n"
    "a.configure(1, 't', {'a': a.address, 'b': baddr})\n"
    "a.send('b', np.zeros(8), 1, 0); print('SENT', flush=True)\n"
    "import os; x = np.resize(np.arange(1, 256, dtype=np.uint8), int(os.environ.get('MSG_BYTES', 32 << 20)))\n"
    "a.send('b', x, 1, 1); time.sleep(600)\n")


@contextlib.contextmanager
def _child(b: HybridTransport, **env: str):
    with linked_child(b, _CHILD, env=dict(os.environ, PYTHONPATH=str(ROOT), **env), cwd=ROOT) as p:
        assert isinstance(b._conns["a"].sock, shm.ShmChannel)
        yield p


def test_sigkilled_shm_peer_fails_requests_naming_it():
    b = HybridTransport("b", "job")
    try:
        with _child(b) as p:
            p.signal(signal.SIGKILL)
            p.wait(30)
            y = np.zeros(32 << 20, np.uint8)
            with pytest.raises(TransportError, match="member a"):
                b.recv_into("a", y, 1, 1)
            # whatever arrived before the kill is exact: a prefix of the message, never a torn byte
            x = np.resize(np.arange(1, 256, dtype=np.uint8), 32 << 20)   # no zero byte
            k = b.stats.received_by_peer["a"] - 64
            assert (y[:k] == x[:k]).all() and not y[k:].any()
    finally:
        b.close()


def test_sigstopped_shm_peer_never_tears_a_chunk_and_abort_wakes_the_wait():
    b = HybridTransport("b", "job")
    n = 256 << 20   # a 1 MiB ring and a 256 MiB message: far more than can pass before the stop
    try:
        with _child(b, MSG_BYTES=str(n), RESILIENT_SHM_RING=str(1 << 20)) as p:
            y = np.zeros(n, np.uint8)
            r = b.irecv("a", y, 1, 1)
            deadline = time.monotonic() + 30
            while b.stats.received_by_peer["a"] <= 64 and time.monotonic() < deadline:
                b.wait([r], timeout=1e-4)   # short rounds: stop reading as soon as bytes arrive
            p.signal(signal.SIGSTOP)            # wherever it is in copying into the ring
            b.wait([r], timeout=0.3)            # drains what was announced before the stop
            got = b.stats.received_by_peer["a"] - 64
            x = np.resize(np.arange(1, 256, dtype=np.uint8), n)   # no zero byte
            assert (y[:got] == x[:got]).all() and not y[got:].any()
            assert 0 < got < len(y) and not r.done()   # the stopped writer holds the op, no more
            threading.Timer(0.2, b.abort, args=("epoch 2 removed a",)).start()
            with pytest.raises(TransportAborted, match="epoch 2"):
                b.wait([r])
    finally:
        b.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make certificates")
def test_mutual_tls_keeps_same_host_pairs_on_tls(tmp_path):
    from test_transport_hardening_tls import _ca, _leaf

    _ca(tmp_path, "ca")
    a = HybridTransport("a", "job", tls=_leaf(tmp_path, "ca", "a"))
    b = HybridTransport("b", "job", tls=_leaf(tmp_path, "ca", "b"))
    try:
        assert split_address(a.address)[1] is None   # no shm suffix: certificates cannot be checked on it
        addrs = {"a": a.address, "b": b.address}
        a.configure(1, "tok", addrs)
        b.configure(1, "tok", addrs)
        x, y = np.arange(1000.0), np.zeros(1000)
        both(a, a.isend("b", x, 1, 0), b, b.irecv("a", y, 1, 0), timeout=20)
        assert (x == y).all() and not isinstance(a._conns["b"].sock, shm.ShmChannel)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_a_link_dialled_in_an_older_epoch_and_not_acknowledged_is_redialled_by_configure(kind):
    """The dialler ``a`` sends a small message in epoch 2 (it fits the socket buffer or the
    ring: counted sent) to ``b``, already in epoch 3 but not progressing, and moves to
    epoch 3 before ``b`` has read the link. ``b`` will refuse that link's epoch-2 HELLO; an
    epoch-3 message written into it would be lost although counted sent. ``configure``
    drops the link it dialled that ``b`` never acknowledged, so the epoch-3 message goes
    over a new link and arrives. A link ``b`` did acknowledge is kept across epochs."""
    cls = HybridTransport if kind == "shm" else TcpTransport
    a, b = cls("a", "job"), cls("b", "job")
    addrs = {"a": a.address, "b": b.address}
    try:
        b.configure(3, "t3", addrs)
        a.configure(2, "t2", addrs)
        stale = a.isend("b", np.ones(8), 1, 0)
        assert a.wait([stale], timeout=10) is True      # written: the kernel or the ring took it
        assert not getattr(a._conns["b"], "accepted", False)   # b has not even accepted the connection
        a.configure(3, "t3", addrs)
        x = np.arange(8, dtype=np.float64)
        y = np.zeros(8)
        fresh = a.isend("b", x, 1, 0)
        assert a.wait([fresh], timeout=10) is True
        assert b.wait([b.irecv("a", y, 1, 0)], timeout=10) is True, "the epoch-3 message was lost"
        assert np.array_equal(y, x)
        # the epoch-2 link, refused by b: at its HELLO, or (shared memory) already at the
        # ring's setup when a has closed it first
        refused = {k: v for k, v in b.stats.dropped.items() if k in ("hello_refused", "shm_setup")}
        assert sum(refused.values()) == 1, b.stats.dropped
        if kind == "shm":
            assert isinstance(a._conns["b"].sock, shm.ShmChannel)
        # acknowledged now: the link survives the next epoch (no redial, no refusal)
        wait_for_ack = time.monotonic() + 10
        while not a._conns["b"].accepted and time.monotonic() < wait_for_ack:
            a.idle(0.05)
        link = a._conns["b"]
        assert link.accepted
        a.configure(4, "t4", addrs)
        b.configure(4, "t4", addrs)
        both(a, a.isend("b", x * 2, 1, 0), b, b.irecv("a", y, 1, 0), timeout=10)
        assert np.array_equal(y, x * 2)
        assert a._conns["b"] is link
        assert sum(v for k, v in b.stats.dropped.items() if k in ("hello_refused", "shm_setup")) == 1
    finally:
        a.close()
        b.close()
