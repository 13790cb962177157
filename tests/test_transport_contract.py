"""The transport contract (resilient/transport/base.py), run over every transport.

Like gloo runs each test over every transport, each test here runs over: TCP, the
hybrid transport (shared-memory links on one host), TCP wrapped by shaping
(``delay=1ms``), TCP wrapped by the retrying transport, and NCCL over its fake api
(tests/nccl_fake.py) with an in-process rendezvous. Real loopback/unix sockets and
shared memory for the CPU transports; two members ``a`` < ``b`` configured for epoch 1.

NCCL matches messages by posting order only, so the tests of tag/namespace matching and
of late-message discarding do not apply to it (:func:`require`); everything else does
(its digests travel in a per-message header, its ERROR reports through the rendezvous). Per-transport behaviour (handshake hardening,
TLS, shared-memory rings, shaping holds, retries, NCCL's unique-id exchange) stays in
that transport's own test file.
"""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest

from resilient.errors import TransportAborted, TransportError
from resilient.transport.base import OpMismatch, PeerReportedError, Request, Transport
from resilient.transport.hybrid import HybridTransport
from resilient.transport.nccl import NcclTransport
from resilient.transport.rendezvous import LocalRendezvous
from resilient.transport.retrying import RetryingTransport
from resilient.transport.shaping import ShapedTransport
from resilient.transport.tags import control_seq
from resilient.transport.tcp import TcpTransport

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nccl_fake import Fabric, FakeNccl  # noqa: E402

HANG_GUARD_S = 20.0   # only guards against a hang; behaviour is asserted, not speed


@dataclass
class World:
    """Transports of members ``a`` and ``b`` and what the kind supports."""

    a: Transport
    b: Transport
    kind: str
    features: frozenset[str]
    rendezvous: LocalRendezvous | None = None
    closers: list[Callable[[], None]] = field(default_factory=list)

    def configure(self, epoch: int) -> None:
        addrs = {"a": self.a.address, "b": self.b.address}
        if self.rendezvous is not None:
            self.rendezvous.supersede(epoch)
        for t in (self.a, self.b):
            t.configure(epoch, f"tok{epoch}", addrs)


def _tcp(member: str) -> Transport:
    return TcpTransport(member, "job", tls=None)


def _make(kind: str) -> World:
    every = frozenset({"namespaces", "late_discard", "post_error", "digest", "speculative"})
    if kind == "tcp":
        return World(_tcp("a"), _tcp("b"), kind, every)
    if kind == "shm":
        a, b = HybridTransport("a", "job", tls=None), HybridTransport("b", "job", tls=None)
        return World(a, b, kind, every)
    if kind == "shaped":
        return World(ShapedTransport(_tcp("a"), "delay=1ms"), ShapedTransport(_tcp("b"), "delay=1ms"), kind, every)
    if kind == "retrying":
        def wrap(m: str) -> Transport:
            return RetryingTransport(_tcp(m), give_up_s=HANG_GUARD_S, on_suspect=lambda peer, why: None,
                                     is_member=lambda peer: True)
        return World(wrap("a"), wrap("b"), kind, every)
    assert kind == "nccl"
    fabric, rdv = Fabric(), LocalRendezvous()
    a = NcclTransport("a", rdv, api=FakeNccl(fabric, "a"), connect_timeout=HANG_GUARD_S)
    b = NcclTransport("b", rdv, api=FakeNccl(fabric, "b"), connect_timeout=HANG_GUARD_S)
    return World(a, b, kind, frozenset({"post_error", "digest"}), rendezvous=rdv)


KINDS = ["tcp", "shm", "shaped", "retrying", "nccl"]


@pytest.fixture(params=KINDS)
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    w = _make(request.param)
    w.configure(1)
    try:
        yield w
    finally:
        w.a.close()
        w.b.close()


#: why NCCL cannot carry a feature (it matches messages by posting order per pair, not by tag)
WHY_NOT = {
    "namespaces": "NCCL matches by posting order, not by tag, so a control message cannot be kept aside "
                  "for a receive posted later",
    "late_discard": "NCCL matches by posting order: a cancelled op's message still in flight meets the next "
                    "receive, whose header check then fails it (TransportError) instead of discarding it",
    "speculative": "NCCL matches by posting order: a posted receive takes the next message whatever it is, so "
                   "one that does not fit cannot be left for a later receive (any-source receives raise "
                   "UnsupportedOperation there)",
}


def require(w: World, feature: str) -> None:
    """Skip for a transport that cannot carry ``feature``."""
    if feature not in w.features:
        pytest.skip(f"{w.kind} does not carry {feature}: {WHY_NOT.get(feature, '')}")


def both(w: World, sends: list[Request], recvs: list[Request]) -> None:
    """``a`` waits for ``sends`` (in a thread) while ``b`` waits for ``recvs``: both done."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["a"] = w.a.wait(sends, timeout=HANG_GUARD_S)
        except BaseException as exc:  # noqa: BLE001 - reported below
            out["a"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert w.b.wait(recvs, timeout=HANG_GUARD_S) is True
    t.join(HANG_GUARD_S)
    assert not t.is_alive() and out["a"] is True, out.get("a")


def _waits_in_thread(t: Transport, reqs: list[Request]) -> tuple[threading.Thread, dict[str, object]]:
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["r"] = t.wait(reqs)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            out["r"] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, out


# -- delivery -----------------------------------------------------------------------------


def test_send_recv_by_tag_into_the_posted_buffer(world: World) -> None:
    x = np.arange(1000, dtype=np.int64)
    y = np.zeros_like(x)
    empty_out, empty_in = np.zeros(0, np.float32), np.zeros(0, np.float32)
    both(world, [world.a.isend("b", x, 1, 7), world.a.isend("b", empty_out, 1, 8)],
         [world.b.irecv("a", y, 1, 7), world.b.irecv("a", empty_in, 1, 8)])
    assert (x == y).all()


def test_a_large_message_arrives_whole(world: World) -> None:
    x = np.random.default_rng(0).integers(0, 256, 24 << 20, dtype=np.uint8)   # wraps the shm ring
    y = np.zeros_like(x)
    both(world, [world.a.isend("b", x, 2, 0)], [world.b.irecv("a", y, 2, 0)])
    assert np.array_equal(x, y)


def test_control_frames_arriving_first_never_meet_op_data(world: World) -> None:
    """A control frame sent before an op's data is kept aside for the control receive,
    posted last; the data receive, posted first, gets the data."""
    require(world, "namespaces")
    ctl, data = np.full(8, 1, np.uint8), np.full(8, 2, np.uint8)
    th, out = _waits_in_thread(world.a, [world.a.isend("b", ctl, control_seq(1), 3), world.a.isend("b", data, 5, 7)])
    got_data, got_ctl = np.zeros(8, np.uint8), np.zeros(8, np.uint8)
    assert world.b.wait([world.b.irecv("a", got_data, 5, 7)], timeout=HANG_GUARD_S)
    assert world.b.wait([world.b.irecv("a", got_ctl, control_seq(1), 3)], timeout=HANG_GUARD_S)
    th.join(HANG_GUARD_S)
    assert out["r"] is True
    assert (got_data == 2).all() and (got_ctl == 1).all()


def test_stats_count_payload_bytes_and_waits_by_peer(world: World) -> None:
    x = np.ones(4096, np.uint8)
    both(world, [world.a.isend("b", x, 3, 0)], [world.b.irecv("a", np.zeros_like(x), 3, 0)])
    sa, sb = world.a.stats, world.b.stats
    assert sa.bytes_sent == sa.sent_by_peer["b"] == 4096
    assert sb.bytes_received == sb.received_by_peer["a"] == 4096
    assert sb.wait_s_by_peer["a"] >= 0.0
    assert sb.snapshot()["received_by_peer"] == {"a": 4096}


def test_a_wait_that_times_out_returns_false_and_keeps_the_request(world: World) -> None:
    y = np.zeros(8, np.int64)
    req = world.b.irecv("a", y, 4, 0)
    assert world.b.wait([req], timeout=0.05) is False
    assert not req.done() and req.error is None
    both(world, [world.a.isend("b", np.arange(8, dtype=np.int64), 4, 0)], [req])
    assert y.tolist() == list(range(8))


# -- abort and close ----------------------------------------------------------------------


def test_abort_wakes_a_blocked_wait_and_configure_clears_it(world: World) -> None:
    req = world.b.irecv("a", np.zeros(4, np.float32), 5, 0)    # a never sends it
    th, out = _waits_in_thread(world.b, [req])                   # no timeout: only an abort ends it
    timer = threading.Timer(0.1, world.b.abort, args=("epoch 2 removed a",))
    timer.start()
    th.join(HANG_GUARD_S)
    timer.join()
    assert not th.is_alive(), "abort() did not wake the wait"
    assert isinstance(out["r"], TransportAborted) and "epoch 2 removed a" in str(out["r"])
    assert world.b.aborted
    with pytest.raises(TransportAborted):                        # posts after the abort fail too
        world.b.wait([world.b.irecv("a", np.zeros(4, np.float32), 6, 0)])
    world.a.abort("epoch 2")                                      # the epoch change reaches every member
    world.configure(2)
    assert not world.b.aborted
    x, y = np.arange(4, dtype=np.float32), np.zeros(4, np.float32)
    both(world, [world.a.isend("b", x, 0, 1)], [world.b.irecv("a", y, 0, 1)])
    assert (x == y).all()


def test_close_fails_pending_and_later_requests_and_is_idempotent(world: World) -> None:
    pending = world.b.irecv("a", np.zeros(4, np.float32), 7, 0)
    world.b.close()
    world.b.close()
    assert world.b.closed
    with pytest.raises(TransportError):
        world.b.wait([pending], timeout=HANG_GUARD_S)
    with pytest.raises(TransportError):
        world.b.wait([world.b.irecv("a", np.zeros(4, np.float32), 8, 0)], timeout=HANG_GUARD_S)


# -- op-level guarantees ------------------------------------------------------------------


def test_cancel_op_fails_its_requests_and_keeps_the_transport_usable(world: World) -> None:
    req = world.b.irecv("a", np.zeros(4, np.float32), 9, 0)
    world.b.cancel_op(9)
    with pytest.raises(TransportAborted, match="cancelled"):
        world.b.wait([req], timeout=HANG_GUARD_S)
    x, y = np.arange(4, dtype=np.float32), np.zeros(4, np.float32)
    both(world, [world.a.isend("b", x, 10, 0)], [world.b.irecv("a", y, 10, 0)])
    assert (x == y).all()


def test_messages_of_a_cancelled_op_are_discarded_on_arrival(world: World) -> None:
    require(world, "late_discard")
    world.b.cancel_op(11)
    late, x = np.full(4, 9.0, np.float32), np.arange(4, dtype=np.float32)
    y = np.zeros(4, np.float32)
    both(world, [world.a.isend("b", late, 11, 0), world.a.isend("b", x, 12, 0)], [world.b.irecv("a", y, 12, 0)])
    assert (x == y).all()


def test_post_error_fails_the_peers_requests_of_that_op(world: World) -> None:
    require(world, "post_error")
    req = world.b.irecv("a", np.zeros(4, np.float32), 13, 0)
    world.a.post_error(["b"], 13, b"inputs differ: shape (4,) vs (5,)")
    with pytest.raises(PeerReportedError, match="inputs differ") as info:
        world.b.wait([req], timeout=HANG_GUARD_S)
    assert info.value.peer == "a" and info.value.op_seq == 13
    with pytest.raises(PeerReportedError):                        # later requests of the op too
        world.b.wait([world.b.irecv("a", np.zeros(4, np.float32), 13, 1)], timeout=HANG_GUARD_S)


def test_a_digest_mismatch_fails_the_receive_and_its_op(world: World) -> None:
    require(world, "digest")
    th, _ = _waits_in_thread(world.a, [world.a.isend("b", np.zeros(4, np.float32), 14, 0, digest=1)])
    with pytest.raises(OpMismatch) as info:
        world.b.wait([world.b.irecv("a", np.zeros(4, np.float32), 14, 0, digest=2)], timeout=HANG_GUARD_S)
    assert (info.value.theirs, info.value.ours) == (1, 2)
    with pytest.raises(OpMismatch):
        world.b.wait([world.b.irecv("a", np.zeros(4, np.float32), 14, 1, digest=2)], timeout=HANG_GUARD_S)
    th.join(HANG_GUARD_S)


# -- speculative receives (any-source) ------------------------------------------------------


def test_a_speculative_receive_takes_a_message_that_fits(world: World) -> None:
    require(world, "speculative")
    x, y = np.arange(16, dtype=np.int64), np.zeros(16, np.int64)
    both(world, [world.a.isend("b", x, 6, 2, digest=11)], [world.b.irecv_speculative("a", y, 6, 2, digest=11)])
    assert (x == y).all()


def test_a_message_that_does_not_fit_waits_for_the_receive_posted_after_cancel(world: World) -> None:
    """A speculative receive posted for 8 int64 meets 4 int32 of another descriptor: it takes
    nothing (still pending), is cancelled, and the receive that fits gets the message whole."""
    require(world, "speculative")
    x = np.arange(4, dtype=np.int32)
    spec_buf = np.full(8, -1, np.int64)
    spec = world.b.irecv_speculative("a", spec_buf, 7, 0, digest=21)
    th, out = _waits_in_thread(world.a, [world.a.isend("b", x, 7, 0, digest=22)])
    deadline = time.monotonic() + HANG_GUARD_S
    while not spec.misfit():                                # the message arrives, and does not fit
        assert time.monotonic() < deadline, "the message never reached the speculative receive"
        world.b.wait([spec], timeout=0.01)
    assert not spec.done() and spec.error is None and (spec_buf == -1).all()
    assert world.b.cancel_recv(spec) is True
    assert isinstance(spec.error, TransportAborted) and world.b.cancel_recv(spec) is False
    y = np.zeros(4, np.int32)
    assert world.b.wait([world.b.irecv("a", y, 7, 0, digest=22)], timeout=HANG_GUARD_S)
    th.join(HANG_GUARD_S)
    assert out["r"] is True and (y == x).all()


def test_a_cancelled_receive_leaves_the_next_message_to_the_next_receive(world: World) -> None:
    require(world, "speculative")
    spec = world.b.irecv_speculative("a", np.zeros(8, np.uint8), 8, 0, digest=5)
    assert world.b.cancel_recv(spec) is True             # nothing sent yet
    x, y = np.arange(8, dtype=np.uint8), np.zeros(8, np.uint8)
    both(world, [world.a.isend("b", x, 8, 0, digest=5)], [world.b.irecv("a", y, 8, 0, digest=5)])
    assert (x == y).all()


def test_a_completed_receive_cannot_be_cancelled(world: World) -> None:
    x, y = np.arange(8, dtype=np.uint8), np.zeros(8, np.uint8)
    req = world.b.irecv("a", y, 9, 0)
    both(world, [world.a.isend("b", x, 9, 0)], [req])
    assert world.b.cancel_recv(req) is False and req.done() and req.error is None


def test_nccl_refuses_a_speculative_receive() -> None:
    from resilient.errors import UnsupportedOperation

    w = _make("nccl")
    try:
        w.configure(1)
        with pytest.raises(UnsupportedOperation, match="any-source"):
            w.b.irecv_speculative("a", np.zeros(4, np.uint8), 1, 0)
    finally:
        w.a.close()
        w.b.close()


def test_a_speculative_receive_does_not_hold_back_other_ops(world: World) -> None:
    """A speculative receive still waiting for its message (an any-source receive's, left
    on a peer that has not sent) is passed by another op's frames, before and after
    their receive is posted; its own message still reaches it."""
    require(world, "speculative")
    spec_buf = np.zeros(4, np.int64)
    spec = world.b.irecv_speculative("a", spec_buf, 10, 0, digest=3)
    early, late = np.arange(8, dtype=np.uint8), np.arange(6, dtype=np.uint8) + 50
    th, out = _waits_in_thread(world.a, [world.a.isend("b", early, 11, 0)])
    got_early = np.zeros(8, np.uint8)
    assert world.b.wait([world.b.irecv("a", got_early, 11, 0)], timeout=HANG_GUARD_S)
    th.join(HANG_GUARD_S)
    got_late = np.zeros(6, np.uint8)
    posted = world.b.irecv("a", got_late, 12, 0)
    both(world, [world.a.isend("b", late, 12, 0)], [posted])
    assert (got_early == early).all() and (got_late == late).all() and not spec.done() and not spec.misfit()
    x = np.arange(4, dtype=np.int64) + 7
    both(world, [world.a.isend("b", x, 10, 0, digest=3)], [spec])
    assert (spec_buf == x).all()
