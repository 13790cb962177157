"""An abort that lands while the ring's op thread lags behind its posted receives (pure
logic: an in-memory transport, no sockets).

The ring posts every receive of the op up front, so bytes from the previous member can
land while the op thread is still reducing earlier steps. When the epoch that removes a
member aborts the transport, :meth:`OpContext.settle` must turn every receive that
finished but was not reduced yet into ledger state (the sender's accumulator; a full
copy for an all-gather receive): that is what the ledger status published for recovery
says, and a full copy of the dead member's chunk on a survivor is what lets recovery
keep the full contributor set (bench/recovery.py, ``phase: ag``). The abort is a
:class:`~resilient.errors.TransportAborted`, a cancellation signal (not a
``TransportError``): it must still reach the caller through the ring untouched."""
from __future__ import annotations

from typing import Sequence

import pytest
import torch

from resilient.collectives.algorithms.base import OpContext
from resilient.collectives.algorithms.ring import RingReduceScatterAllgather
from resilient.collectives.ledger import Ledger, decode_status, encode_status, split
from resilient.errors import TransportAborted
from resilient.kernels import ReduceOp
from resilient.transport.base import Buffer, Request

N, ME, S = 4, 3, 2           # member m3; m2 (its predecessor) is the one that died
MEMBERS = tuple(f"m{i}" for i in range(N))
CHUNK = 6                    # elements per chunk (S slices of 3)


class _Req(Request):
    def __init__(self, peer: str, arrived: bool) -> None:
        self.peer, self.nbytes, self.op_seq = peer, 0, 1
        self._arrived = arrived

    def done(self) -> bool:
        return self._arrived

    @property
    def error(self) -> BaseException | None:
        return None

    def touched(self) -> bool:
        return self._arrived


class _LaggingTransport:
    """Receives of ring steps ``< arrived_steps`` have landed (filled with ``step + 1``);
    the ``abort_at``-th wait (1-based) and every later one raise TransportAborted, as the
    retrying layer does once the transport is aborted, finished requests or not."""

    def __init__(self, arrived_steps: int, abort_at: int) -> None:
        self.arrived_steps, self.abort_at, self.waits = arrived_steps, abort_at, 0

    def isend(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request:
        return _Req(peer, True)

    def irecv(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request:
        step = (tag >> 28) & ((1 << 28) - 1)
        arrived = step < self.arrived_steps
        if arrived:
            torch.frombuffer(buf, dtype=torch.float32).fill_(float(step + 1))
        return _Req(peer, arrived)

    def wait(self, requests: Sequence[Request], timeout: float | None = None) -> bool:
        self.waits += 1
        if self.waits >= self.abort_at:
            raise TransportAborted("epoch 2 removed ['m2']")
        return all(r.done() for r in requests)


def _ledger() -> Ledger:
    numel = N * CHUNK
    pieces = [(s0 + a, s0 + b) for (s0, e0) in split(numel, N) for (a, b) in split(e0 - s0, S)]
    inp = torch.full((numel,), 10.0)
    return Ledger(1, "allreduce", MEMBERS, ME, 1, 0, inp, torch.zeros(numel), pieces)


def _piece(chunk: int, j: int) -> int:
    return chunk * S + j


def test_receives_landed_before_the_abort_are_in_the_published_status() -> None:
    # m3's receives, in the order m2 sends: rs0 -> chunk 2, rs1 -> chunk 1, rs2 -> chunk 0,
    # ag0 -> chunk 3 (m2's fully reduced chunk). All of them landed; the op thread reduced
    # rs0's first slice and was aborted waiting on the second one.
    L = _ledger()
    tr = _LaggingTransport(arrived_steps=4, abort_at=2)
    ctx = OpContext(tr, L, ReduceOp.SUM, None, lambda peer, why: None, 1)
    with pytest.raises(TransportAborted):
        RingReduceScatterAllgather(S).run(ctx)
    ctx.settle()
    assert not ctx.inflight
    bit = {m: 1 << i for i, m in enumerate(MEMBERS)}
    # rs0 slice 0 reduced with m3's input: m2's and m3's contributions
    assert L.masks[_piece(2, 0)] == bit["m2"] | bit["m3"]
    assert torch.equal(L.view(_piece(2, 0)), torch.full((3,), 1.0 + 10.0))
    # landed, not reduced: the sender's accumulator, which excludes m3
    assert L.masks[_piece(2, 1)] == bit["m2"]
    assert [L.masks[_piece(1, j)] for j in range(S)] == [bit["m1"] | bit["m2"]] * S
    assert [L.masks[_piece(0, j)] for j in range(S)] == [bit["m0"] | bit["m1"] | bit["m2"]] * S
    # the all-gather copy of the dead member's chunk is complete: a full copy survives
    assert [L.masks[_piece(3, j)] for j in range(S)] == [L.full] * S
    assert torch.equal(L.view(_piece(3, 0)), torch.full((3,), 4.0))
    status = decode_status(encode_status("m3", L, None))
    assert status["inflight"]["masks"] == L.masks


def test_receives_that_never_landed_leave_their_region_as_it_was() -> None:
    # only rs0 landed; the abort comes at the first wait of rs1's data
    L = _ledger()
    tr = _LaggingTransport(arrived_steps=1, abort_at=S + 1)
    ctx = OpContext(tr, L, ReduceOp.SUM, None, lambda peer, why: None, 1)
    with pytest.raises(TransportAborted):
        RingReduceScatterAllgather(S).run(ctx)
    ctx.settle()
    assert [L.masks[_piece(2, j)] for j in range(S)] == [0b1100] * S   # rs0 reduced
    assert all(L.masks[_piece(c, j)] == 0 for c in (0, 1, 3) for j in range(S))
