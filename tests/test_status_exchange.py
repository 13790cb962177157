"""The ledger-status exchange of a recovery (resilient/collectives/status_exchange.py) and
the transport's control channel it rides on, over real TCP transports on loopback. The
etcd side is an in-memory view here (its real path runs in every multi-process recovery
test: test_collectives_multiproc, test_collectives_faults, test_chaos_real)."""
from __future__ import annotations

import json
import threading
import time

import pytest

from resilient.collectives.status_exchange import MAX_STATUS_BYTES, StatusExchange
from resilient.errors import FrameError
from resilient.collectives.tags import STATUS_EXCHANGE, control_seq, tag
from resilient.transport.tcp import TcpTransport


class _View:
    """put_blob/wait_blobs/current in memory. ``etcd_works=False``: wait_blobs never
    completes (times out), so only the transport path can deliver."""

    def __init__(self, etcd_works: bool) -> None:
        self.etcd_works = etcd_works
        self.cond = threading.Condition()
        self.blobs: dict[tuple[int, str], bytes] = {}

    def put_blob(self, epoch, name, payload):
        with self.cond:
            self.blobs[(epoch, name)] = payload
            self.cond.notify_all()

    def wait_blobs(self, epoch, name, members, timeout):
        members = list(members)
        if not self.etcd_works:
            raise TimeoutError("this view's etcd path never delivers")
        with self.cond:
            if not self.cond.wait_for(lambda: all((epoch, m) in self.blobs for m in members), timeout):
                raise TimeoutError("missing")
            return {m: self.blobs[(epoch, m)] for m in members}

    def current(self):
        return None


class _MemberView:
    """One member's window on the shared _View (put_blob keys by member)."""

    def __init__(self, shared: _View, me: str) -> None:
        self.shared, self.me = shared, me

    def put_blob(self, epoch, name, payload):
        self.shared.put_blob(epoch, self.me, payload)

    def wait_blobs(self, epoch, name, members, timeout):
        return self.shared.wait_blobs(epoch, name, members, timeout)

    def current(self):
        return None


@pytest.fixture
def trio():
    trs = {m: TcpTransport(m, "job") for m in ("a", "b", "c")}
    addrs = {m: t.address for m, t in trs.items()}
    for t in trs.values():
        t.configure(1, "tok", addrs)
    yield trs
    for t in trs.values():
        t.close()


def _status(member: str, size: int = 50) -> bytes:
    return json.dumps({"member": member, "pad": "x" * size}).encode()


def _run_all(trs, rings, view, epoch=1, timeout=10.0):
    out, errors = {}, []

    def one(m):
        try:
            x = StatusExchange(_MemberView(view, m), trs[m], epoch, rings[m], m, _status(m, 10 + len(m)))
            out[m] = x.run(timeout, lambda: None)
            assert x.wait_published()
        except BaseException as exc:  # surfaced below
            errors.append((m, exc))

    ths = [threading.Thread(target=one, args=(m,)) for m in rings]
    for th in ths:
        th.start()
    for th in ths:
        th.join(timeout + 5)
    assert not any(th.is_alive() for th in ths), "an exchange hung"
    return out, errors


def test_control_frames_never_meet_an_ops_data(trio):
    a, b = trio["a"], trio["b"]
    ctl = bytearray(b"control!")
    data = bytearray(b"op-data-")
    # sent in the order control, data; the data receive is posted first and alone
    sends = [a.isend("b", ctl, control_seq(1), 3), a.isend("b", data, 5, 7)]
    got_data = bytearray(8)
    assert b.wait([b.irecv("a", got_data, 5, 7)], timeout=5)
    assert got_data == data
    got_ctl = bytearray(8)
    assert b.wait([b.irecv("a", got_ctl, control_seq(1), 3)], timeout=5)   # kept aside meanwhile
    assert got_ctl == ctl
    # and the other way round: data first on the wire, the control receive posted first
    sends += [a.isend("b", data, 6, 7), a.isend("b", ctl, control_seq(2), 3)]
    r_ctl, r_data = b.irecv("a", bytearray(8), control_seq(2), 3), b.irecv("a", bytearray(8), 6, 7)
    assert b.wait([r_ctl, r_data], timeout=5)
    assert a.wait(sends, timeout=5)


@pytest.fixture(params=["direct", "ring"])
def mode(request, monkeypatch):
    """direct: every survivor sends to every other; ring: summaries go around the ring."""
    import resilient.collectives.status_exchange as sx

    monkeypatch.setattr(sx, "DIRECT_MAX", 16 if request.param == "direct" else 1)
    return request.param


def test_every_survivor_gets_every_summary_over_the_transport(trio, mode):
    ring = ["a", "b", "c"]
    view = _View(etcd_works=False)   # only the transport path can deliver
    out, errors = _run_all(trio, {m: ring for m in ring}, view, timeout=5.0)
    assert not errors, errors
    for m in ring:
        assert out[m] == {x: _status(x, 10 + len(x)) for x in ring}
    assert {k for k in view.blobs} == {(1, m) for m in ring}   # published for observers too


def test_etcd_path_completes_when_survivors_disagree_on_the_ring(trio, mode):
    # c is already in the next op over a grown group and lists a member the others do not
    trs = dict(trio)
    rings = {"a": ["a", "b"], "b": ["a", "b", "c"], "c": ["a", "b", "c"]}
    view = _View(etcd_works=True)
    out, errors = _run_all(trs, rings, view, timeout=5.0)
    assert not errors, errors
    assert out["a"] == {m: _status(m, 10 + len(m)) for m in ("a", "b")}
    for m in ("b", "c"):
        assert out[m] == {x: _status(x, 10 + len(x)) for x in ("a", "b", "c")}
    # leftovers of epoch 1's exchange were cancelled: the next one works over the ring
    out2, errors2 = _run_all(trs, {m: ["a", "b", "c"] for m in "abc"}, _View(etcd_works=False), epoch=2, timeout=5.0)
    assert not errors2, errors2


def test_a_corrupt_length_frame_is_rejected_without_decoding(trio):
    a, b = trio["a"], trio["b"]
    view = _View(etcd_works=False)
    seq = control_seq(1)
    import struct

    a.isend("b", struct.pack("<Q", MAX_STATUS_BYTES + 1), seq, tag(0, 0, STATUS_EXCHANGE))
    x = StatusExchange(_MemberView(view, "b"), b, 1, ["a", "b"], "b", _status("b"))
    t0 = time.monotonic()
    with pytest.raises(FrameError, match="limit"):
        x.run(5.0, lambda: None)
    assert time.monotonic() - t0 < 5.0


def test_a_summary_naming_another_member_is_rejected(trio):
    a, b = trio["a"], trio["b"]
    view = _View(etcd_works=False)
    seq = control_seq(1)
    import struct

    body = _status("c")
    a.isend("b", struct.pack("<Q", len(body)), seq, tag(0, 0, STATUS_EXCHANGE))
    a.isend("b", body, seq, tag(0, 1, STATUS_EXCHANGE))
    x = StatusExchange(_MemberView(view, "b"), b, 1, ["a", "b"], "b", _status("b"))
    with pytest.raises(FrameError, match="where 'a'"):
        x.run(5.0, lambda: None)
