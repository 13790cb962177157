"""Op probes (``Transport.probe``), run over every transport of the contract suite.

Two members that called different collectives at one op number, with no data between
them, must both fail that op with ``OpMismatch`` once probed; a peer that is merely
slower (in our op with our digest, or in an earlier op) must never be failed by a probe.
The PROBE frame's validation is unit-tested here too: a bad one raises ``FrameError``
naming the peer, and on a live link it is refused without losing the link or the data
behind it. The real-process test (broadcasts from different roots) is
tests/test_collectives_multiproc.py::test_mismatched_inputs_raise_everywhere_and_next_op_works.
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from resilient.errors import FrameError, OpMismatch
from resilient.transport import frames
from resilient.transport.base import Request, Transport
from resilient.transport.tags import control_seq, p2p_seq
from resilient.transport.tcp import TcpTransport

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_transport_contract import HANG_GUARD_S, World, _make, world  # noqa: E402,F401 - the fixture

assert world  # the fixture is used by name below

DA, DB = 0x1111_AAAA, 0x2222_BBBB


def _in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, dict[str, object]]:
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["r"] = fn()
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            out["r"] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, out


def _until_answered(t: Transport, reqs: list[Request], of: Transport | None = None) -> None:
    """Wait in short slices (each must time out, raising nothing) until ``t`` read an
    answer to its probe (``of`` given: until ``of`` published its probe, nccl's record
    for another op than ours); the requests stay pending."""
    deadline = time.monotonic() + HANG_GUARD_S
    while (t if of is None else of).stats.probes.get("answers" if of is None else "sent", 0) < 1:
        assert time.monotonic() < deadline, f"no probe answer within {HANG_GUARD_S}s: {t.stats.probes}"
        assert t.wait(reqs, timeout=0.05) is False


def _probe_then_wait(t: Transport, peer: str, reqs: list[Request]) -> object:
    t.probe([peer])
    return t.wait(reqs, timeout=HANG_GUARD_S)


def test_probes_fail_an_op_called_differently_on_both_sides_with_no_data(world: World) -> None:
    ra = world.a.irecv("b", np.zeros(4, np.int64), 5, 0, DA)
    rb = world.b.irecv("a", np.zeros(4, np.int64), 5, 0, DB)
    th, out = _in_thread(lambda: _probe_then_wait(world.b, "a", [rb]))
    with pytest.raises(OpMismatch) as got:
        _probe_then_wait(world.a, "b", [ra])
    th.join(HANG_GUARD_S)
    assert isinstance(out["r"], OpMismatch), out
    assert (got.value.peer, got.value.op_seq, got.value.theirs, got.value.ours) == ("b", 5, DB, DA)
    assert (out["r"].peer, out["r"].theirs, out["r"].ours) == ("a", DA, DB)
    # the op is failed on each side (a later request of it fails at once); after the op
    # loop's cancel_op the transport carries the next op
    with pytest.raises(OpMismatch):
        world.a.wait([world.a.irecv("b", np.zeros(4, np.int64), 5, 1, DA)], timeout=HANG_GUARD_S)
    world.a.cancel_op(5)
    world.b.cancel_op(5)
    x, y = np.arange(4, dtype=np.int64), np.zeros(4, np.int64)
    th, out = _in_thread(lambda: world.a.wait([world.a.isend("b", x, 6, 0, DA)], timeout=HANG_GUARD_S))
    assert world.b.wait([world.b.irecv("a", y, 6, 0, DA)], timeout=HANG_GUARD_S)
    th.join(HANG_GUARD_S)
    assert out["r"] is True and (y == x).all()


def test_one_probe_fails_the_op_on_both_sides(world: World) -> None:
    """Only ``a`` probes: ``b`` judges the query, ``a`` the answer."""
    if world.kind == "nccl":
        pytest.skip("nccl carries no frame besides the ordered messages: its probe is a rendezvous record each "
                    "waiting side publishes, so each side judges the other's record (the test above), not an answer")
    ra = world.a.irecv("b", np.zeros(4, np.int64), 5, 0, DA)
    rb = world.b.irecv("a", np.zeros(4, np.int64), 5, 0, DB)
    th, out = _in_thread(lambda: world.b.wait([rb], timeout=HANG_GUARD_S))
    with pytest.raises(OpMismatch):
        _probe_then_wait(world.a, "b", [ra])
    th.join(HANG_GUARD_S)
    assert isinstance(out["r"], OpMismatch), out
    assert world.a.stats.probes == {"sent": 1, "answers": 1, "mismatch": 1}
    assert world.b.stats.probes == {"mismatch": 1, "answered": 1}


def _slow_peer_round(w: World, a_ops: tuple[int, int], b_ops: tuple[int, int]) -> None:
    """``a`` waits on op ``a_ops[0]`` (digest ``a_ops[1]``), ``b`` on ``b_ops``; both probe,
    and both keep waiting (nothing raised) until ``a`` read the answer; then each sends
    the other what it waits for."""
    (sa, da), (sb, db) = a_ops, b_ops
    ya, yb = np.zeros(4, np.int64), np.zeros(4, np.int64)
    ra, rb = w.a.irecv("b", ya, sa, 0, da), w.b.irecv("a", yb, sb, 0, db)
    answered = threading.Event()

    def side_b() -> object:
        w.b.probe(["a"])   # nccl: b's record is what a reads (tcp: a's query is answered)
        deadline = time.monotonic() + HANG_GUARD_S
        while not answered.is_set():
            assert time.monotonic() < deadline
            got = w.b.wait([rb], timeout=0.05)
            assert got is False or answered.is_set()   # a's data may arrive once it was answered
        s = w.b.isend("a", np.full(4, 2, np.int64), sa, 0, da)
        return w.b.wait([rb, s], timeout=HANG_GUARD_S)

    th, out = _in_thread(side_b)
    w.a.probe(["b"])
    _until_answered(w.a, [ra], of=w.b if w.kind == "nccl" and sa != sb else None)
    answered.set()
    s = w.a.isend("b", np.full(4, 1, np.int64), sb, 0, db)
    done = w.a.wait([ra, s], timeout=HANG_GUARD_S)
    th.join(HANG_GUARD_S)
    assert done is True, (ra.done(), s.done(), out)
    assert out["r"] is True, out
    assert (ya == 2).all() and (yb == 1).all()
    assert "mismatch" not in w.a.stats.probes and "mismatch" not in w.b.stats.probes


def test_a_probe_of_a_peer_in_the_same_op_with_our_digest_changes_nothing(world: World) -> None:
    _slow_peer_round(world, (7, DA), (7, DA))


def test_a_probe_of_a_peer_still_in_an_earlier_op_changes_nothing(world: World) -> None:
    _slow_peer_round(world, (9, DA), (8, DB))


def test_point_to_point_and_control_requests_are_not_probed(world: World) -> None:
    """Only collective ops have a descriptor to compare: with only p2p/control requests
    pending, a member neither asks nor answers."""
    ra = world.a.irecv("b", np.zeros(4, np.int64), p2p_seq(3), 0, DA)
    rb = world.b.irecv("a", np.zeros(4, np.int64), control_seq(3) if world.kind != "nccl" else p2p_seq(3), 0, DB)
    world.a.probe(["b"])
    assert world.a.wait([ra], timeout=0.1) is False
    assert world.b.wait([rb], timeout=0.1) is False
    assert world.a.stats.probes == {} and world.b.stats.probes == {}


# -- the frame ------------------------------------------------------------------------------


def test_a_probe_frame_round_trips_and_a_bad_one_names_the_peer() -> None:
    raw = frames.encode_probe(3, frames.Probe(41, DA, answer=True))
    h = frames.decode_header(raw)
    assert len(raw) == frames.HEADER_SIZE and (h.kind, h.epoch, h.length) == (frames.PROBE, 3, 0)
    assert frames.check_probe(h, "m1") == frames.Probe(41, DA, True)
    bad = {
        "payload": frames.Header(frames.PROBE, 3, 41, frames.PROBE_QUERY, 16, DA),
        "tag": frames.Header(frames.PROBE, 3, 41, 7, 0, DA),
        "namespace": frames.Header(frames.PROBE, 3, p2p_seq(41), frames.PROBE_QUERY, 0, DA),
        "kind": frames.Header(frames.DATA, 3, 41, 0, 0, DA),
    }
    for what, hdr in bad.items():
        with pytest.raises(FrameError, match="member m1 sent a bad PROBE frame") as exc:
            frames.check_probe(frames.decode_header(frames.encode_header(hdr)), "m1")
        assert {"payload": "16 payload bytes", "tag": "tag 7", "namespace": "not a collective op",
                "kind": "is not PROBE"}[what] in str(exc.value)
    with pytest.raises(FrameError, match="PROBE frame announces a payload"):
        frames.decode_header(frames.encode_header(
            frames.Header(frames.PROBE, 3, 41, 0, frames.MAX_CONTROL_PAYLOAD + 1, DA)))


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_a_bad_probe_frame_on_a_live_link_is_refused_and_nothing_is_lost(kind: str) -> None:
    w = _make(kind)
    try:
        w.configure(1)
        a, b = w.a, w.b
        assert isinstance(a, TcpTransport) and isinstance(b, TcpTransport)
        x, y = np.arange(8, dtype=np.int64), np.zeros(8, np.int64)
        th, out = _in_thread(lambda: a.wait([a.isend("b", x, 1, 0, DA)], timeout=HANG_GUARD_S))
        assert b.wait([b.irecv("a", y, 1, 0, DA)], timeout=HANG_GUARD_S)   # the link is up
        th.join(HANG_GUARD_S)
        conn = a._conns["b"]
        for hdr in (frames.Header(frames.PROBE, 1, 2, 7, 0, DA), frames.Header(frames.PROBE, 1, 2, 0, 16, DA)):
            raw = frames.encode_header(hdr) + bytes(hdr.length)
            conn.raw_out.append(memoryview(raw))
        early = a.isend("b", x + 100, 2, 0, DA)      # behind the bad frames, before its receive is posted
        th, out = _in_thread(lambda: a.wait([early, a.isend("b", x + 200, 2, 1, DA)], timeout=HANG_GUARD_S))
        y1, y2 = np.zeros(8, np.int64), np.zeros(8, np.int64)
        assert b.wait([b.irecv("a", y1, 2, 0, DA), b.irecv("a", y2, 2, 1, DA)], timeout=HANG_GUARD_S)
        th.join(HANG_GUARD_S)
        assert out["r"] is True
        assert (y1 == x + 100).all() and (y2 == x + 200).all()
        assert b.stats.dropped == {"bad_probe": 2}   # refused, counted; the link was not closed
        assert b.stats.probes == {}
    finally:
        w.a.close()
        w.b.close()


# -- the waiting side (resilient/collectives/op_context.py) ----------------------------------


def test_wait_op_probes_a_lasting_wait_and_both_members_raise() -> None:
    """Two members in OpContext's wait loop over TCP, different digests at op 3, no data:
    each wait probes after ``probe_interval`` and both end with OpMismatch, no suspect
    reported (the probe came well before op_timeout)."""
    from resilient.collectives.op_context import probe_interval, wait_op

    assert probe_interval(None) == 1.0 and probe_interval(30.0) == 1.0 and probe_interval(0.4) == 0.1
    w = _make("tcp")
    suspects: list[tuple[str, str]] = []
    try:
        w.configure(1)
        ra = w.a.irecv("b", np.zeros(4, np.int64), 3, 0, DA)
        rb = w.b.irecv("a", np.zeros(4, np.int64), 3, 0, DB)
        th, out = _in_thread(lambda: wait_op(w.b, [rb], 3, 0.4, lambda p, why: suspects.append((p, why))))
        with pytest.raises(OpMismatch):
            wait_op(w.a, [ra], 3, 0.4, lambda p, why: suspects.append((p, why)))
        th.join(HANG_GUARD_S)
        assert isinstance(out["r"], OpMismatch) and suspects == []
        # each side judged the mismatch: from the answer to its own probe, from the peer's
        # probe, or both (the two probes may cross), so once or twice
        assert w.a.stats.probes.get("mismatch") in (1, 2) and w.b.stats.probes.get("mismatch") in (1, 2)
    finally:
        w.a.close()
        w.b.close()


def test_wait_op_over_a_stand_in_reports_suspects_and_never_probes() -> None:
    """A transport that is not a full Transport (a test's stand-in, a device op's split
    transport) is waited on in slices of op_timeout: each pending peer reported once."""
    from resilient.collectives.op_context import wait_op

    class Req(Request):
        def __init__(self, peer: str) -> None:
            self.peer, self.nbytes, self.op_seq, self.n = peer, 0, 1, 0

        def done(self) -> bool:
            return self.n >= 3

        @property
        def error(self) -> BaseException | None:
            return None

    class StandIn:
        def __init__(self, reqs: list[Req]) -> None:
            self.reqs, self.timeouts = reqs, []   # type: list[Req], list[float | None]

        def wait(self, requests: object, timeout: float | None = None) -> bool:
            self.timeouts.append(timeout)
            for r in self.reqs:
                r.n += 1
            return all(r.done() for r in self.reqs)

    reqs = [Req("p"), Req("q")]
    t, seen = StandIn(reqs), []   # type: StandIn, list[str]
    wait_op(t, reqs, 1, 5.0, lambda p, why: seen.append(p))
    assert t.timeouts == [5.0, 5.0, 5.0] and seen == ["p", "q"]


def test_a_lasting_wait_queues_one_probe_query_per_link() -> None:
    """Probes that cannot go out yet (a 64 MiB frame is half written: ``b`` reads
    nothing) are not queued once per interval."""
    w = _make("tcp")
    try:
        w.configure(1)
        a = w.a
        assert isinstance(a, TcpTransport)
        big = a.isend("b", np.zeros(8 << 20, np.int64), 5, 0, DA)
        a.irecv("b", np.zeros(4, np.int64), 5, 1, DA)
        assert a.wait([big], timeout=0.3) is False        # the socket buffers are full, b reads nothing
        conn = a._conns["b"]
        for _ in range(3):
            a.probe(["b"])
            assert a.wait([big], timeout=0.05) is False

        def probes() -> int:
            return sum(1 for m in conn.raw_out if len(m) == frames.HEADER_SIZE
                       and frames.decode_header(m).kind == frames.PROBE)

        assert probes() == 1 and a.stats.probes == {"sent": 1}
    finally:
        w.a.close()
        w.b.close()
