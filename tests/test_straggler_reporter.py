"""The rank-side health reporter (resilient/health_reporter.py) against a real etcd: the
windows it writes are what the detector reads, built from real TCP transport wait
counters; a failing etcd write never raises into the op."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from resilient.coordinator import MemberInfo, MemberSession, Store
from resilient.coordinator.health import read_health
from resilient.coordinator.straggler import window_features
from resilient.health_reporter import HealthReporter
from resilient.transport.shaping import ShapedTransport
from resilient.transport.tcp import TcpTransport

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_windows_carry_real_per_peer_waits_and_are_written_at_the_interval(etcd_session, job_name):
    store = Store(etcd_session.endpoints)
    a, b = TcpTransport("a", job_name), TcpTransport("b", job_name)
    addrs = {"a": a.address, "b": b.address}
    a.configure(1, "t", addrs)
    b.configure(1, "t", addrs)
    session = MemberSession.register(store, job_name, MemberInfo(member_id="a"), ttl=5.0)
    clock = Clock()
    rep = HealthReporter(store, job_name, "a", session.lease_id, a.stats, interval=1.0, clock=clock)
    slow_b = ShapedTransport(b, "delay=50ms")
    try:
        for op in range(3):
            buf = np.zeros(16, dtype=np.uint8)
            th = threading.Thread(target=lambda: slow_b.wait([slow_b.isend("a", np.ones(16, dtype=np.uint8), op, 0)]))
            th.start()
            a.wait([a.irecv("b", buf, op, 0)], timeout=20)
            th.join(20)
            assert buf.all()
            clock.t += 0.3
            assert not rep.op_done(1, 0.3)               # 0.3, 0.6, 0.9 s: under the interval
        clock.t += 0.2
        assert rep.op_done(1, 0.2)
        rec = read_health(store, job_name)["a"]
        assert rec["v"] == 1 and rec["member"] == "a" and rec["epoch"] == 1 and rec["seq"] == 1
        assert rec["ops"] == 4 and rec["window_s"] == pytest.approx(1.1)
        assert rec["wait_s"]["b"] >= 3 * 0.05 - 0.01          # each recv waited on b's 50 ms hold
        busy, op_s, ops = window_features(rec)
        assert ops == 4 and op_s == pytest.approx(1.1 / 4)
        # The next window starts from the new counters.
        clock.t += 1.5
        assert rep.op_done(2)
        rec2 = read_health(store, job_name)["a"]
        assert rec2["seq"] == 2 and rec2["ops"] == 1 and rec2["wait_s"] == {}
    finally:
        session.close()
        a.close()
        b.close()
        store.close()


def test_a_failed_write_is_swallowed_and_retried(etcd_session, job_name):
    store = Store(etcd_session.endpoints)
    clock = Clock()
    t = TcpTransport("a", job_name)
    rep = HealthReporter(store, job_name, "a", lease_id=999999, stats=t.stats, interval=1.0, clock=clock)
    try:
        clock.t = 2.0
        assert rep.op_done(1) is False                # lease 999999 does not exist: logged, not raised
        assert rep._ops == 1                          # the window keeps accumulating
        rep.lease_id = None
        clock.t = 3.0
        assert rep.op_done(1) is True
        assert read_health(store, job_name)["a"]["ops"] == 2
    finally:
        t.close()
        store.close()


def test_min_ops_holds_a_window_until_it_is_usable_or_five_intervals_passed():
    class _Store:                      # records puts (pure logic: when a window is written)
        def __init__(self) -> None:
            self.puts: list = []

        def put(self, key, value, lease=None) -> None:
            self.puts.append((key, value))

    from resilient.transport.base import TransportStats

    store, clock = _Store(), Clock()
    rep = HealthReporter(store, "job", "a", None, TransportStats(), interval=1.0, clock=clock, min_ops=3)
    clock.t = 1.5
    assert not rep.op_done(1) and not rep.op_done(1)      # 2 ops: interval passed, too few ops
    assert rep.op_done(1)                                  # the 3rd op completes the window
    clock.t = 7.0                                          # 5.5 intervals: written with 1 op
    assert rep.op_done(1) and len(store.puts) == 2
