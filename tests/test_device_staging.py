"""The host-staged schedule (resilient.device.staging) with the CPU buffer ops.

The fake wire below is a unit-test double: a request completes only when the pipeline
waits on it (so the order of copies, posts and completions is deterministic and logged),
a send captures its staging slot's bytes at completion (a slot reused too early would
show up as wrong data), and a receive fills its slot at completion from the peer's data.
"""
from __future__ import annotations

from typing import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.device import CpuOps
from resilient.device.staging import PieceState, RecvMode, StageChunk, StagingPipeline, plan_chunks
from resilient.errors import ConfigError, TransportError


class Req:
    def __init__(self, wire: "Wire", kind: str, chunk: StageChunk, stage: torch.Tensor) -> None:
        self.wire, self.kind, self.chunk, self.stage, self._done = wire, kind, chunk, stage, False

    def done(self) -> bool:
        return self._done

    def complete(self) -> None:
        if self._done:
            return
        w, c = self.wire, self.chunk
        if w.fail_at == (self.kind, c.index):
            raise TransportError(f"peer died during {self.kind} of chunk {c.index}")
        if self.kind == "send":
            w.sent[c.index] = self.stage.clone()
        else:
            self.stage.copy_(w.peer[c.start:c.end])
        self._done = True
        w.log.append((f"{self.kind}-done", c.index))


class Wire:
    def __init__(self, peer: torch.Tensor | None = None, fail_at: tuple[str, int] | None = None) -> None:
        self.peer, self.fail_at = peer, fail_at
        self.log: list[tuple[str, int]] = []
        self.sent: dict[int, torch.Tensor] = {}

    def post_send(self, chunk: StageChunk, stage: torch.Tensor) -> Req:
        self.log.append(("send", chunk.index))
        return Req(self, "send", chunk, stage)

    def post_recv(self, chunk: StageChunk, stage: torch.Tensor) -> Req:
        self.log.append(("recv", chunk.index))
        return Req(self, "recv", chunk, stage)

    def wait(self, reqs: Sequence[Req]) -> None:   # type: ignore[override]
        for r in reqs:
            r.complete()


class LoggingOps(CpuOps):
    """CPU ops that log each staging copy (the k-th D2H/H2D is chunk k: chunks go in order)."""

    def __init__(self, wire: Wire) -> None:
        self.wire, self.n = wire, {"d2h": 0, "h2d": 0}

    def _log(self, kind: str) -> None:
        self.wire.log.append((kind, self.n[kind]))
        self.n[kind] += 1

    def to_host(self, host_dst, src):
        self._log("d2h")
        return super().to_host(host_dst, src)

    def from_host(self, dst, host_src):
        self._log("h2d")
        return super().from_host(dst, host_src)


def pipeline(wire: Wire, chunks, slots: int = 2, dtype=torch.float32) -> StagingPipeline:
    return StagingPipeline(LoggingOps(wire), chunks, dtype, wire.wait, slots=slots)  # type: ignore[arg-type]


# -- chunk plan --------------------------------------------------------------------------


def test_chunks_cut_pieces_without_straddling_them():
    chunks = plan_chunks([(0, 10), (10, 10), (10, 13)], 4)
    assert [(c.piece, c.start, c.end) for c in chunks] == [(0, 0, 4), (0, 4, 8), (0, 8, 10), (2, 10, 13)]
    assert [c.index for c in chunks] == [0, 1, 2, 3]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.integers(1, 17))
def test_chunks_cover_every_piece_exactly_in_order(lengths, size):
    pieces, s = [], 0
    for n in lengths:
        pieces.append((s, s + n))
        s += n
    chunks = plan_chunks(pieces, size)
    assert all(0 < c.numel <= size for c in chunks)
    for p, (a, b) in enumerate(pieces):
        mine = [c for c in chunks if c.piece == p]
        assert sum(c.numel for c in mine) == b - a
        assert all(a <= c.start < c.end <= b for c in mine)
    assert [c.start for c in chunks] == sorted(c.start for c in chunks)


def test_bad_plans_are_refused():
    with pytest.raises(ConfigError, match="chunk_elems must be >= 1"):
        plan_chunks([(0, 4)], 0)
    with pytest.raises(ConfigError, match="0 <= start <= end"):
        plan_chunks([(5, 4)], 2)
    with pytest.raises(ConfigError, match="nothing to stage"):
        StagingPipeline(CpuOps(), plan_chunks([(0, 0)], 2), torch.float32, Wire().wait)


# -- send ---------------------------------------------------------------------------------


def test_send_delivers_every_chunk_and_copies_ahead_while_sends_are_in_flight():
    src = torch.arange(22, dtype=torch.float32)
    chunks = plan_chunks([(0, 12), (12, 22)], 4)         # 3 + 3 chunks
    wire = Wire()
    pl = pipeline(wire, chunks, slots=2)
    pl.send(src, wire.post_send)
    assert sorted(wire.sent) == list(range(len(chunks)))
    for c in chunks:
        assert torch.equal(wire.sent[c.index], src[c.start:c.end]), f"chunk {c.index} was overwritten in its slot"
    log = wire.log
    for k in range(len(chunks) - 1):   # chunk k+1 is copied before chunk k's send completed
        assert log.index(("d2h", k + 1)) < log.index(("send-done", k)), log
    for k in range(len(chunks)):       # a chunk is sent only after its copy
        assert log.index(("d2h", k)) < log.index(("send", k))
    for k in range(2, len(chunks)):    # two slots: chunk k reuses chunk k-2's slot after its send
        assert log.index(("send-done", k - 2)) < log.index(("d2h", k))
    assert pl.stats.max_slots_busy == 2 and pl.stats.d2h == len(chunks) and pl.stats.posted == len(chunks)
    assert pl.stats.overlapped_copies >= len(chunks) - 2


def test_one_slot_sends_strictly_one_after_another():
    src = torch.arange(9, dtype=torch.float32)
    wire = Wire()
    pl = pipeline(wire, plan_chunks([(0, 9)], 3), slots=1)
    pl.send(src, wire.post_send)
    assert wire.log == [("d2h", 0), ("send", 0), ("send-done", 0), ("d2h", 1), ("send", 1), ("send-done", 1),
                        ("d2h", 2), ("send", 2), ("send-done", 2)]
    assert pl.stats.overlapped_copies == 0


# -- receive ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(RecvMode))
def test_receive_modes_land_the_right_values_and_mark_every_chunk(mode):
    peer = torch.arange(20, dtype=torch.float32) * 10
    own = torch.arange(20, dtype=torch.float32)
    dst = torch.full((20,), 1000.0)
    chunks = plan_chunks([(0, 8), (8, 20)], 3)
    wire = Wire(peer)
    pl = pipeline(wire, chunks, slots=3)
    pl.recv(dst, wire.post_recv, mark=5, mode=mode, op="sum", own=own)
    want = {RecvMode.COPY: peer, RecvMode.ACCUMULATE: peer + 1000.0, RecvMode.COMBINE: peer + own}[mode]
    assert torch.equal(dst, want)
    assert pl.reducer.marks.finished(mark=5) == tuple(range(len(chunks)))
    assert pl.settle(5) == {0: PieceState.COMPLETE, 1: PieceState.COMPLETE}
    log = wire.log
    assert log[:3] == [("recv", 0), ("recv", 1), ("recv", 2)]          # posted ahead, in order
    for k in range(3, len(chunks)):        # a slot is re-posted only after its H2D copy
        assert log.index(("h2d", k - 3)) < log.index(("recv", k))
    assert pl.stats.overlapped_copies >= len(chunks) - 3


def test_combine_needs_the_members_input():
    wire = Wire(torch.zeros(4))
    with pytest.raises(ConfigError, match="own="):
        pipeline(wire, plan_chunks([(0, 4)], 2)).recv(torch.zeros(4), wire.post_recv, 1, RecvMode.COMBINE)
    assert wire.log == []


@pytest.mark.parametrize("mode", list(RecvMode))
def test_abort_mid_receive_leaves_marks_and_piece_states_exact(mode):
    # pieces: [0,6) = chunks 0,1 ; [6,12) = chunks 2,3 ; [12,18) = chunks 4,5
    peer = torch.arange(18, dtype=torch.float32) + 100
    dst = torch.ones(18)
    chunks = plan_chunks([(0, 6), (6, 12), (12, 18)], 3)
    wire = Wire(peer, fail_at=("recv", 3))
    pl = pipeline(wire, chunks, slots=2)
    with pytest.raises(TransportError, match="chunk 3"):
        pl.recv(dst, wire.post_recv, mark=9, mode=mode, own=torch.ones(18))
    assert pl.reducer.marks.finished(mark=9) == (0, 1, 2)
    assert pl.written == {0, 1, 2}
    assert pl.settle(9) == {0: PieceState.COMPLETE, 1: PieceState.LOST, 2: PieceState.UNTOUCHED}
    want = peer if mode is RecvMode.COPY else peer + 1          # dst and own are ones
    assert torch.equal(dst[:9], want[:9])            # every marked chunk holds its final value
    assert torch.equal(dst[9:], torch.ones(9))       # chunk 3's partial bytes stayed in host staging


def test_marks_of_an_earlier_op_do_not_count_as_this_ops():
    wire = Wire(torch.ones(4))
    pl = pipeline(wire, plan_chunks([(0, 4)], 2))
    pl.recv(torch.zeros(4), wire.post_recv, mark=1)
    assert pl.settle(2) == {0: PieceState.LOST}        # written by op 1, not finished for op 2


def test_abort_mid_send_raises_and_leaves_the_device_buffer_alone():
    src = torch.arange(12, dtype=torch.float32)
    wire = Wire(fail_at=("send", 1))
    pl = pipeline(wire, plan_chunks([(0, 12)], 3), slots=2)
    with pytest.raises(TransportError, match="chunk 1"):
        pl.send(src, wire.post_send)
    assert torch.equal(src, torch.arange(12, dtype=torch.float32))
    assert sorted(wire.sent) == [0] and pl.written == set() and pl.reducer.marks.finished() == ()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=5).filter(any), st.integers(1, 9), st.integers(1, 4))
def test_any_plan_and_slot_count_round_trips_exactly(lengths, size, slots):
    pieces, s = [], 0
    for n in lengths:
        pieces.append((s, s + n))
        s += n
    chunks = plan_chunks(pieces, size)
    src = torch.randn(s)
    wire = Wire()
    pipeline(wire, chunks, slots=slots).send(src, wire.post_send)
    wire.peer = torch.cat([wire.sent[c.index] for c in chunks])
    dst = torch.zeros(s)
    pl = pipeline(wire, chunks, slots=slots)
    pl.recv(dst, wire.post_recv, mark=3)
    assert torch.equal(dst, src)
    assert pl.stats.max_slots_busy <= slots
    assert set(pl.settle(3).values()) == {PieceState.COMPLETE}


# -- exchange: two members in two threads ---------------------------------------------------


class Mailbox:
    """Thread-safe double of a transport between members: a send is done when posted
    (its bytes copied into the mailbox); a receive completes in ``wait`` once the
    matching send arrived, or raises after a deadline (a deadlocked schedule fails)."""

    class Req:
        def __init__(self, key: tuple[str, str, int], stage: torch.Tensor | None) -> None:
            self.key, self.stage, self._done = key, stage, stage is None

        def done(self) -> bool:
            return self._done

        def fill(self, data: torch.Tensor) -> None:
            assert self.stage is not None
            self.stage.copy_(data)
            self._done = True

    def __init__(self) -> None:
        import threading

        self.cond = threading.Condition()
        self.box: dict[tuple[str, str, int], torch.Tensor] = {}

    def sender(self, me: str, to: str):
        def post(chunk: StageChunk, stage: torch.Tensor) -> "Mailbox.Req":
            with self.cond:
                self.box[(me, to, chunk.index)] = stage.clone()
                self.cond.notify_all()
            return self.Req((me, to, chunk.index), None)
        return post

    def receiver(self, me: str, frm: str):
        def post(chunk: StageChunk, stage: torch.Tensor) -> "Mailbox.Req":
            return self.Req((frm, me, chunk.index), stage)
        return post

    def wait(self, reqs) -> None:
        for r in reqs:
            if r.done():
                continue
            with self.cond:
                if not self.cond.wait_for(lambda: r.key in self.box, timeout=30):
                    raise TransportError(f"no message {r.key} within 30 s: the schedule deadlocked")
                r.fill(self.box.pop(r.key))


def test_exchange_sends_one_piece_while_receiving_another_between_two_members():
    import threading

    pieces = [(0, 10), (10, 20)]
    chunks = plan_chunks(pieces, 3)
    first, second = [c for c in chunks if c.piece == 0], [c for c in chunks if c.piece == 1]
    box = Mailbox()
    inputs = {"a": torch.arange(20, dtype=torch.float32), "b": 100 + torch.arange(20, dtype=torch.float32)}
    outs = {m: torch.zeros(20) for m in inputs}
    errors: list[BaseException] = []
    marks: dict[str, tuple[int, ...]] = {}

    def member(me: str, peer: str, send_chunks, recv_chunks) -> None:
        try:
            pl = StagingPipeline(CpuOps(), chunks, torch.float32, box.wait, slots=2)
            # ring reduce-scatter step: send my piece, receive the peer's and add my input
            pl.exchange(inputs[me], box.sender(me, peer), send_chunks, outs[me], box.receiver(me, peer), recv_chunks,
                        mark=4, mode=RecvMode.COMBINE, own=inputs[me])
            marks[me] = pl.reducer.marks.finished(mark=4)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=member, args=("a", "b", first, second)),
               threading.Thread(target=member, args=("b", "a", second, first))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    total = inputs["a"] + inputs["b"]
    assert torch.equal(outs["a"][10:], total[10:]) and torch.equal(outs["b"][:10], total[:10])
    assert marks == {"a": tuple(c.index for c in second), "b": tuple(c.index for c in first)}


def test_chunks_from_another_plan_are_refused():
    wire = Wire()
    pl = pipeline(wire, plan_chunks([(0, 6)], 3))
    with pytest.raises(ConfigError, match="not a chunk of this pipeline's plan"):
        pl.send(torch.zeros(6), wire.post_send, chunks=[StageChunk(0, 0, 0, 2)])
