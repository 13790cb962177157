"""Traffic shaping (resilient/transport/shaping.py): spec parsing, and the decorator over
real TCP transports on loopback sockets (three members in threads of this process)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from resilient.errors import ConfigError, TransportAborted, TransportError
from resilient.transport.shaping import ShapedTransport, ShapingSpec, parse_shaping, shaped_from_env
from resilient.transport.tcp import TcpTransport

pytestmark = pytest.mark.timeout(60)


def test_parse_every_item():
    s = parse_shaping("slow=3x, link=m2:2.5x; delay=5ms,bw=100MB/s,ref_bw=2GB/s,ref_lat=10us,drop=m3,link=m4:2")
    assert s.slow == 3.0 and s.links == {"m2": 2.5, "m4": 2.0}
    assert s.delay_s == pytest.approx(0.005) and s.bw == 100e6 and s.ref_bw == 2e9
    assert s.ref_lat == pytest.approx(10e-6) and s.drop == {"m3"} and s.active
    assert not parse_shaping("").active and not parse_shaping(None).active
    # hold: delay + (slow*link - 1) * (ref_lat + n/ref_bw) + n/bw
    n = 1_000_000
    assert s.hold_s("m2", n) == pytest.approx(0.005 + (7.5 - 1) * (10e-6 + n / 2e9) + n / 100e6)
    assert s.hold_s("m1", n) == pytest.approx(0.005 + 2 * (10e-6 + n / 2e9) + n / 100e6)


@pytest.mark.parametrize("text, words", [
    ("slow=3", None), ("slow=0.5x", "factor >= 1"), ("delay=5", "unit"), ("bw=fast", "bandwidth"),
    ("link=3x", "link=PEER:FACTOR"), ("warp=9", "unknown shaping item"), ("slow", "no '='"), ("drop=", "name the peer"),
])
def test_bad_specs_name_the_item_and_the_syntax(text, words):
    if words is None:
        assert parse_shaping(text).slow == 3.0   # "3" without x is accepted
        return
    with pytest.raises(ConfigError, match=words) as exc:
        parse_shaping(text)
    assert repr(text.split(",")[0]) in str(exc.value) and "slow=3x" in str(exc.value)


def test_from_env_leaves_the_transport_alone_without_a_spec():
    t = TcpTransport("a", "job")
    try:
        assert shaped_from_env(t, {}) is t
        s = shaped_from_env(t, {"RESILIENT_SHAPING": "delay=1ms"})
        assert isinstance(s, ShapedTransport) and s.spec.delay_s == pytest.approx(0.001)
        assert s.address == t.address and s.stats is t.stats
    finally:
        t.close()


@pytest.fixture
def trio():
    ts = [TcpTransport(f"m{i}", "shape-job") for i in range(3)]
    addrs = {t.member_id: t.address for t in ts}
    for t in ts:
        t.configure(1, "tok", addrs)
    yield ts
    for t in ts:
        t.close()


def _recv_in_thread(t, peer, bufs, results, tag0=0):
    def run():
        try:
            reqs = [t.irecv(peer, b, 1, tag0 + i) for i, b in enumerate(bufs)]
            t0 = time.monotonic()
            t.wait(reqs, timeout=30)
            results.append(("ok", time.monotonic() - t0))
        except BaseException as exc:
            results.append(("err", exc))
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def test_delay_holds_every_send_and_keeps_per_peer_order(trio):
    m0, m1, _ = trio
    s0 = ShapedTransport(m0, "delay=100ms,bw=50MB/s")
    sizes = [1_000_000, 10, 300_000, 4]          # differing holds: order must still hold
    outs = [np.full(n, i + 1, dtype=np.uint8) for i, n in enumerate(sizes)]
    ins = [np.zeros(n, dtype=np.uint8) for n in sizes]
    res: list = []
    th = _recv_in_thread(m1, "m0", ins, res)
    t0 = time.monotonic()
    reqs = [s0.isend("m1", o, 1, i) for i, o in enumerate(outs)]
    assert s0.wait(reqs, timeout=30)
    took = time.monotonic() - t0
    th.join(30)
    assert res and res[0][0] == "ok", res
    for i, b in enumerate(ins):
        assert (b == i + 1).all()
    # Serialised holds: 4 x 100 ms + 1.3 MB at 50 MB/s = 0.426 s at least (a lower bound:
    # the shaper can only make things later).
    assert took >= 4 * 0.1 + sum(sizes) / 50e6


def test_link_slowdown_applies_to_the_named_peer_only(trio):
    m0, m1, m2 = trio
    s0 = ShapedTransport(m0, "link=m2:3x,ref_lat=200ms")
    t0 = time.monotonic()
    fast = s0.isend("m1", np.ones(8, dtype=np.uint8), 1, 0)
    slow = s0.isend("m2", np.ones(8, dtype=np.uint8), 1, 0)
    assert fast.__class__.__name__ != "_Held"          # handed straight to TCP
    assert slow.__class__.__name__ == "_Held" and slow.inner is None
    res1, res2 = [], []
    b1, b2 = np.zeros(8, dtype=np.uint8), np.zeros(8, dtype=np.uint8)
    t1 = _recv_in_thread(m1, "m0", [b1], res1)
    t2 = _recv_in_thread(m2, "m0", [b2], res2)
    assert s0.wait([fast, slow], timeout=30)
    assert time.monotonic() - t0 >= 2 * 0.2           # (3 - 1) x ref_lat
    t1.join(30)
    t2.join(30)
    assert res1[0][0] == "ok" and res2[0][0] == "ok" and b1.all() and b2.all()


def test_drop_fails_requests_naming_the_peer(trio):
    m0, _, _ = trio
    s0 = ShapedTransport(m0, "drop=m2")
    with pytest.raises(TransportError, match="m2 is down"):
        s0.wait([s0.isend("m2", np.ones(4, dtype=np.uint8), 1, 0)], timeout=5)
    with pytest.raises(TransportError, match="m2 is down"):
        s0.wait([s0.irecv("m2", np.ones(4, dtype=np.uint8), 1, 0)], timeout=5)


def test_abort_fails_a_held_send_at_once(trio):
    m0, _, _ = trio
    s0 = ShapedTransport(m0, "delay=30s")
    req = s0.isend("m1", np.ones(4, dtype=np.uint8), 1, 0)
    threading.Timer(0.2, s0.abort, args=("epoch 2 removed m1",)).start()
    with pytest.raises(TransportAborted):
        s0.wait([req], timeout=20)
    assert req.inner is None                             # never handed on


def test_spec_file_slows_and_heals_a_running_transport(trio, tmp_path):
    m0, _, _ = trio
    path = tmp_path / "shaping"
    s0 = ShapedTransport(m0, None, spec_file=str(path))
    assert not s0.spec.active
    path.write_text("slow=3x")
    s0._file_checked = 0.0
    s0.isend("m1", np.ones(4, dtype=np.uint8), 1, 0)
    assert s0.spec.slow == 3.0
    path.unlink()
    s0._file_checked = 0.0
    s0._reload()
    assert not s0.spec.active
    assert isinstance(ShapingSpec().links, dict)


def test_jitter_scales_each_hold_within_its_band_reproducibly():
    assert parse_shaping("jitter=30%").jitter == pytest.approx(0.3) == parse_shaping("jitter=0.3").jitter
    for bad in ("jitter=1.5", "jitter=-1", "jitter=x", "seed=abc"):
        with pytest.raises(ConfigError, match="jitter|seed"):
            parse_shaping(bad)

    class _Inner:   # records nothing, accepts sends (pure logic: the computed due times)
        member_id, address, aborted = "m0", "x", False

        def isend(self, *a):
            return None

    holds = []
    for _ in range(2):
        t = ShapedTransport(_Inner(), "delay=10ms,jitter=30%,seed=7")
        bounds = []   # the hold lies in [due - t1, due - t0] (isend ran between t0 and t1)
        for i in range(50):
            t0 = time.monotonic()
            req = t.isend(f"p{i}", np.zeros(4, dtype=np.uint8), 0, i)
            t1 = time.monotonic()
            bounds.append((req.due - t1, req.due - t0))
        holds.append(bounds)
    assert all(0.007 - 1e-3 <= lo and hi <= 0.013 + 1e-3 for lo, hi in holds[0])
    assert max(lo for lo, _ in holds[0]) - min(hi for _, hi in holds[0]) > 0.003   # it does vary
    for (lo0, hi0), (lo1, hi1) in zip(*holds):                                   # same seed, same draws
        assert lo0 <= hi1 and lo1 <= hi0


def test_time_spent_transmitting_held_sends_is_busy_not_waiting():
    """A member whose own sends are held (slow NIC) while it waits on a receive is busy:
    that time must not be charged to the peer in ``wait_s`` (straggler detection)."""
    a, b = TcpTransport("a", "shapejob"), TcpTransport("b", "shapejob")
    addrs = {"a": a.address, "b": b.address}
    a.configure(1, "t", addrs)
    b.configure(1, "t", addrs)
    sa = ShapedTransport(a, "delay=2s")   # far longer than b's answer, even on a loaded box
    try:
        buf = np.zeros(8, dtype=np.uint8)
        send = sa.isend("b", np.ones(8, dtype=np.uint8), 0, 1)   # held 2 s
        recv = sa.irecv("b", buf, 0, 2)
        # a transport is driven by one thread at a time: each timer is joined before b is
        # used again
        t1 = threading.Timer(0.25, lambda: b.wait([b.isend("a", np.ones(8, dtype=np.uint8), 0, 2)], 5))
        t1.start()
        assert sa.wait([recv], timeout=5)                          # done at ~250 ms, while busy
        assert buf.all() and not send.done()                       # really while the send was held
        assert a.stats.wait_s_by_peer.get("b", 0.0) < 0.1          # not ~0.25 s of "waiting on b"
        assert sa.wait([send], timeout=5)
        t1.join(10)
        # idle waiting still counts: nothing held now, b answers >= 200 ms later
        recv2 = sa.irecv("b", buf, 0, 3)
        t2 = threading.Timer(0.2, lambda: b.wait([b.isend("a", np.ones(8, dtype=np.uint8), 0, 3)], 5))
        t2.start()
        w0 = a.stats.wait_s_by_peer.get("b", 0.0)
        assert sa.wait([recv2], timeout=5)
        t2.join(10)
        assert a.stats.wait_s_by_peer["b"] - w0 >= 0.15
        assert b.wait([b.irecv("a", np.zeros(8, dtype=np.uint8), 0, 1)], 5)
    finally:
        a.close()
        b.close()


def test_a_receive_sees_a_healed_link_without_any_send_in_between(trio, tmp_path):
    # the member that only waits to *receive* from a dropped peer re-posts receives; they
    # must read the healed spec file too (before the fix only isend re-read it, so a pure
    # receiver kept failing until op_timeout — found by the 5-seed chaos soak)
    m0, m1, _ = trio
    path = tmp_path / "shaping"
    path.write_text("drop=m1")
    s0 = ShapedTransport(m0, None, spec_file=str(path))
    with pytest.raises(TransportError, match="m1 is down"):
        s0.wait([s0.irecv("m1", np.ones(4, dtype=np.uint8), 1, 0)], timeout=5)
    path.write_text("")
    s0._file_checked = 0.0                    # the 0.2 s re-read interval has passed
    buf = np.zeros(4, dtype=np.uint8)
    req = s0.irecv("m1", buf, 1, 1)
    sent: list[bool] = []
    th = threading.Thread(target=lambda: sent.append(m1.wait([m1.isend("m0", np.full(4, 7, dtype=np.uint8), 1, 1)],
                                                             timeout=10)))
    th.start()  # m1's transport is driven by that thread only, m0's (through s0) by this one
    assert s0.wait([req], timeout=10) and buf.tolist() == [7, 7, 7, 7]
    th.join(15)
    assert sent == [True]
