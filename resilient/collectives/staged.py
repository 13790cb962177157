"""The host-staged transfers of one op: ledger pieces through a :class:`StagingPipeline`.

One responsibility: run one algorithm step (send some pieces to a peer, receive some
pieces from a peer, or both at once) through host staging slots
(:mod:`resilient.device.staging`) and keep the ledger exact. It is used by the ring,
recursive doubling and the chain broadcast when the op's ledger says
``stage_elems > 0``: always for CUDA tensors (the TCP/shared-memory transports move host
bytes only), and for CPU tensors when ``Communicator(staging=True)`` /
``RESILIENT_STAGING=1`` forces the path (that is how it is tested without a GPU: with
:class:`~resilient.device.CpuOps` it computes bitwise what the direct path computes).

Every chunk of step ``s`` travels under ``tag(s, chunk.index, space)`` and is marked
``s + 1`` once final, so a step's marks never mix with another's.

Failure behaviour: a transport error propagates after the step's received pieces are
settled from the marks (:meth:`StagingPipeline.settle`): COMPLETE -> the step's mask,
LOST (partly written) -> 0, UNTOUCHED -> unchanged. Posted requests are cancelled by the
transport's abort, as on the direct path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from resilient.collectives.algorithms.base import OpContext, tag
from resilient.device import PieceState, RecvMode, StageChunk, StagingPipeline, plan_chunks
from resilient.transport.base import Request

#: staging slots per direction (D2H of chunk k+1 overlaps the send of chunk k)
SLOTS = 2


@dataclass(frozen=True)
class Outgoing:
    """Send ``pieces`` of the flat buffer ``src`` (indexed like the ledger's ``out``) to ``peer``."""

    peer: str
    src: torch.Tensor
    pieces: Sequence[int]


@dataclass(frozen=True)
class Incoming:
    """Receive ``pieces`` from ``peer`` into the flat buffer ``dst`` (as ``mode`` says;
    ``own``: the flat input COMBINE reduces in); piece ``p``'s mask becomes ``masks[p]``
    once it is final."""

    peer: str
    dst: torch.Tensor
    masks: dict[int, int]
    mode: RecvMode = RecvMode.COPY
    own: torch.Tensor | None = None


class StagedTransfers:
    """The staging pipeline of one op over its ledger's pieces (one per algorithm run)."""

    def __init__(self, ctx: OpContext, space: int) -> None:
        L = ctx.ledger
        self.ctx, self.space = ctx, space
        self.chunks = plan_chunks(L.pieces, L.stage_elems)
        self._of_piece: dict[int, list[StageChunk]] = {}
        for c in self.chunks:
            self._of_piece.setdefault(c.piece, []).append(c)
        self.pipe: StagingPipeline[Request] | None = (
            StagingPipeline(L.ops, self.chunks, L.out.dtype, ctx.wait, slots=SLOTS) if self.chunks else None)

    def _chunks(self, pieces: Sequence[int]) -> list[StageChunk]:
        return [c for p in pieces for c in self._of_piece.get(p, ())]

    def step(self, step: int, send: Outgoing | None = None, recv: Incoming | None = None) -> None:
        """Run one step (both directions at once when both are given; the receives are
        posted first). Returns when every transfer completed and the received pieces'
        masks are set."""
        L, pipe = self.ctx.ledger, self.pipe
        mark = step + 1
        if pipe is not None:
            pipe.written.clear()
            before = pipe.stats.posted
            try:
                self._run(pipe, step, mark, send, recv)
            except BaseException:
                if recv is not None:
                    states = pipe.settle(mark)
                    for p, mask in recv.masks.items():
                        st = states.get(p)
                        if st is PieceState.COMPLETE:
                            L.set(p, mask)
                        elif st is PieceState.LOST:
                            L.set(p, 0)
                raise
            finally:
                L.staged_posts += pipe.stats.posted - before
        if recv is not None:
            for p, mask in recv.masks.items():
                L.set(p, mask)

    def _run(self, pipe: StagingPipeline[Request], step: int, mark: int, send: Outgoing | None,
             recv: Incoming | None) -> None:
        ctx = self.ctx
        tr, seq, dg, space = ctx.transport, ctx.seq, ctx.digest, self.space

        def poster(peer: str, sending: bool) -> Callable[[StageChunk, torch.Tensor], Request]:
            def post(chunk: StageChunk, stage: torch.Tensor) -> Request:
                t = tag(step, chunk.index, space)
                return tr.isend(peer, stage, seq, t, dg) if sending else tr.irecv(peer, stage, seq, t, dg)
            return post

        if send is not None and recv is not None:
            pipe.exchange(send.src, poster(send.peer, True), self._chunks(send.pieces),
                          recv.dst, poster(recv.peer, False), self._chunks(sorted(recv.masks)), mark,
                          mode=recv.mode, op=ctx.op, own=recv.own)
        elif send is not None:
            pipe.send(send.src, poster(send.peer, True), self._chunks(send.pieces))
        elif recv is not None:
            pipe.recv(recv.dst, poster(recv.peer, False), mark, mode=recv.mode, op=ctx.op, own=recv.own,
                      chunks=self._chunks(sorted(recv.masks)))
