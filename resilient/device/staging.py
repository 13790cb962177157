"""The host-staged data path's schedule: device chunks through pinned host slots.

One responsibility: the order in which a piece range of a device buffer is copied to
host staging slots and sent, or received into slots and copied (and reduced) back, and
the bookkeeping that keeps the ledger exact when the op is aborted half-way.

* :func:`plan_chunks` cuts the ledger's pieces into chunks of at most ``chunk_elems``
  elements; a chunk never straddles two pieces (a piece's mask is then exactly "every
  chunk of it is marked"). Chunk ``i`` owns progress-mark slot ``i``.
* :class:`StagingPipeline` owns ``slots`` host staging buffers per direction (pinned on
  CUDA) of the largest chunk's size. :meth:`~StagingPipeline.send`: D2H copies on the copy stream fill
  every free slot ahead, each slot's send is posted once its copy finished, and a slot is
  reused only after its send completed, so the copy of chunk ``k+1`` runs while chunk
  ``k`` is on the wire. :meth:`~StagingPipeline.recv`: receives are posted into every
  slot ahead (in chunk order, the order the peer sends), and as each completes its H2D
  copy is enqueued and the chunk is combined (:class:`RecvMode`); the slot is re-posted
  once its H2D copy finished. A received byte never touches device memory before its
  whole chunk arrived. :meth:`~StagingPipeline.exchange` runs a send and a receive
  together (a ring step: chunks of one piece to the next member while another piece's
  arrive from the previous one), its receives posted before its first send.
* Marks: a reduction's mark is written by the reducer after the reduction (on CUDA by the
  kernel itself); a COPY chunk's mark after its H2D copy completed. :meth:`~StagingPipeline.
  settle` turns marks plus "which chunks' device region was written" into per-piece
  :class:`PieceState` after an abort: COMPLETE (every chunk marked), UNTOUCHED (no chunk
  of it was written: the region is as before the op step) or LOST (partly written).

Failure behaviour: bad arguments raise :class:`~resilient.errors.ConfigError` before
anything is posted; a transport error from ``wait`` propagates unchanged, leaving the
marks and :attr:`StagingPipeline.written` exact for :meth:`~StagingPipeline.settle`;
posted requests are the caller's to cancel (its transport's abort).
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Callable, Generic, Iterator, Protocol, Sequence, TypeVar

import torch

from resilient.device.ops import CopyEvent, DeviceOps, check_flat
from resilient.errors import ConfigError
from resilient.kernels import ChunkReducer, ReduceOp


class Pending(Protocol):
    """A posted send or receive (what :class:`resilient.transport.base.Request` offers)."""

    def done(self) -> bool:
        ...


#: the request type of the transport in use (e.g. :class:`resilient.transport.base.Request`)
R = TypeVar("R", bound=Pending)
#: posts one transfer of a chunk through a host staging buffer; returns its request
Post = Callable[["StageChunk", torch.Tensor], R]
#: blocks until every request given is done (raises the transport's error otherwise),
#: e.g. :meth:`resilient.collectives.algorithms.base.OpContext.wait`
Wait = Callable[[Sequence[R]], None]


@dataclass(frozen=True)
class StageChunk:
    """Chunk ``index`` (its mark slot): elements ``[start, end)`` of piece ``piece``."""

    index: int
    piece: int
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


def plan_chunks(pieces: Sequence[tuple[int, int]], chunk_elems: int) -> tuple[StageChunk, ...]:
    """Chunks of at most ``chunk_elems`` elements covering every piece in order; empty
    pieces get no chunk. :class:`ConfigError` for ``chunk_elems < 1`` or a malformed piece."""
    if int(chunk_elems) < 1:
        raise ConfigError(f"chunk_elems must be >= 1, got {chunk_elems}: pass the staging slot size in elements")
    out: list[StageChunk] = []
    for p, (s, e) in enumerate(pieces):
        if not 0 <= s <= e:
            raise ConfigError(f"piece {p} is [{s}, {e}): pieces must be ranges with 0 <= start <= end")
        for a in range(s, e, int(chunk_elems)):
            out.append(StageChunk(len(out), p, a, min(e, a + int(chunk_elems))))
    return tuple(out)


class RecvMode(str, enum.Enum):
    """How a received chunk lands in the device buffer ``dst``."""

    COPY = "copy"              # dst <- received                       (all-gather, broadcast)
    ACCUMULATE = "accumulate"  # dst <- op(dst, received), via device scratch (recursive doubling, leaf)
    COMBINE = "combine"        # dst <- op(received, own): H2D into dst, then reduce own in (ring RS)


class PieceState(str, enum.Enum):
    COMPLETE = "complete"
    UNTOUCHED = "untouched"
    LOST = "lost"


@dataclass
class StagingStats:
    """What a pipeline did (for tests and logs)."""

    d2h: int = 0
    h2d: int = 0
    posted: int = 0
    max_slots_busy: int = 0
    overlapped_copies: int = 0     # copies enqueued while one of our transfers was in flight


class StagingPipeline(Generic[R]):
    """Moves the chunks of one op step through ``slots`` host staging buffers per
    direction; ``R`` is the transport's request type (``post`` returns one, ``wait``
    takes them)."""

    def __init__(self, ops: DeviceOps, chunks: Sequence[StageChunk], dtype: torch.dtype, wait: Wait[R],
                 slots: int = 2, reducer: ChunkReducer | None = None) -> None:
        if int(slots) < 1:
            raise ConfigError(f"a staging pipeline needs at least one slot, got slots={slots}")
        if not chunks:
            raise ConfigError("nothing to stage: plan_chunks() returned no chunk (every piece is empty)")
        self.ops, self.chunks, self.dtype, self.wait = ops, tuple(chunks), dtype, wait
        if any(c.index != i for i, c in enumerate(self.chunks)):
            raise ConfigError("chunks must be plan_chunks()'s output: chunk i has index i")
        self.slots = min(int(slots), len(self.chunks))
        self._slot_elems = max(c.numel for c in self.chunks)
        self._host: dict[str, list[torch.Tensor]] = {}    # "send"/"recv" -> its slots
        self.reducer = reducer if reducer is not None else ops.reducer(len(self.chunks))
        if self.reducer.n_chunks < len(self.chunks):
            raise ConfigError(f"the reducer has {self.reducer.n_chunks} mark slots for {len(self.chunks)} chunks")
        self._scratch: list[torch.Tensor] | None = None
        self.written: set[int] = set()   # chunks whose device region may have been written
        self.stats = StagingStats()
        self._inflight: list[R] = []

    # -- bookkeeping ------------------------------------------------------------------

    def _stage(self, direction: str, slot: int, chunk: StageChunk) -> torch.Tensor:
        host = self._host.get(direction)
        if host is None:
            host = self._host[direction] = [self.ops.host_buffer(self._slot_elems, self.dtype)
                                            for _ in range(self.slots)]
        return host[slot][:chunk.numel]

    def _select(self, chunks: Sequence[StageChunk] | None) -> deque[StageChunk]:
        if chunks is None:
            return deque(self.chunks)
        for c in chunks:
            if not 0 <= c.index < len(self.chunks) or self.chunks[c.index] != c:
                raise ConfigError(f"{c} is not a chunk of this pipeline's plan")
        return deque(chunks)

    def _busy(self, n: int) -> None:
        self.stats.max_slots_busy = max(self.stats.max_slots_busy, n)

    def _copied(self) -> None:
        if any(not r.done() for r in self._inflight):
            self.stats.overlapped_copies += 1

    def _post(self, post: Post[R], chunk: StageChunk, stage: torch.Tensor) -> R:
        req = post(chunk, stage)
        self._inflight.append(req)
        self.stats.posted += 1
        return req

    def _drive(self, steps: Sequence[Iterator[R]]) -> None:
        """Run step generators round-robin: each yields the request it must wait on next.
        While one wait blocks, the transport progresses every posted request, so the
        receives and sends of one exchange advance together."""
        live = [(g, r) for g in steps for r in (next(g, None),) if r is not None]
        while live:
            after = []
            for g, req in live:
                self.wait([req])
                self._inflight.remove(req)
                nxt = next(g, None)
                if nxt is not None:
                    after.append((g, nxt))
            live = after

    # -- the three entry points -----------------------------------------------------------

    def send(self, src: torch.Tensor, post: Post[R], chunks: Sequence[StageChunk] | None = None) -> None:
        """Send ``chunks`` (default: all, in order) of the flat device buffer ``src``
        through the send slots; returns when every send completed."""
        self._drive([self._send_steps(src, post, self._select(chunks))])

    def recv(self, dst: torch.Tensor, post: Post[R], mark: int, mode: RecvMode = RecvMode.COPY,
             op: ReduceOp | str = ReduceOp.SUM, own: torch.Tensor | None = None,
             chunks: Sequence[StageChunk] | None = None) -> None:
        """Receive ``chunks`` (default: all, in order) into the flat device buffer ``dst``,
        combined as ``mode`` says (``own``: the member's flat input, for COMBINE, indexed
        like ``dst``), marking each chunk with ``mark`` once it is final."""
        self._drive([self._recv_steps(dst, post, mark, mode, op, own, self._select(chunks))])

    def exchange(self, src: torch.Tensor, post_send: Post[R], send_chunks: Sequence[StageChunk],
                 dst: torch.Tensor, post_recv: Post[R], recv_chunks: Sequence[StageChunk], mark: int,
                 mode: RecvMode = RecvMode.COPY, op: ReduceOp | str = ReduceOp.SUM,
                 own: torch.Tensor | None = None) -> None:
        """One ring step: send ``send_chunks`` of ``src`` while receiving ``recv_chunks``
        into ``dst`` (as :meth:`recv`); the receives are posted before the first send."""
        self._drive([self._recv_steps(dst, post_recv, mark, mode, op, own, self._select(recv_chunks)),
                     self._send_steps(src, post_send, self._select(send_chunks))])

    # -- send steps -----------------------------------------------------------------------

    def _send_steps(self, src: torch.Tensor, post: Post[R], todo: deque[StageChunk]) -> Iterator[R]:
        """D2H copies fill every free slot ahead; the oldest finished copy is posted; a
        slot is reclaimed (yield: wait for its send) only when none is free."""
        check_flat(src, "the staged send's source")
        free: deque[int] = deque(range(self.slots))
        copying: deque[tuple[StageChunk, int, CopyEvent]] = deque()
        sending: deque[tuple[int, R]] = deque()
        while todo or copying:
            while free and todo:                          # copy ahead into every free slot
                chunk, slot = todo.popleft(), free.popleft()
                ev = self.ops.to_host(self._stage("send", slot, chunk), self.ops.view(src, chunk.start, chunk.end))
                self.stats.d2h += 1
                self._copied()
                copying.append((chunk, slot, ev))
                self._busy(len(copying) + len(sending))
            if copying:                                   # the oldest copy goes on the wire
                chunk, slot, ev = copying.popleft()
                ev.wait()
                sending.append((slot, self._post(post, chunk, self._stage("send", slot, chunk))))
            if not free and not copying and sending:      # reclaim the oldest slot
                slot, req = sending.popleft()
                yield req
                free.append(slot)
        while sending:
            yield sending.popleft()[1]

    # -- receive steps --------------------------------------------------------------------

    def _recv_steps(self, dst: torch.Tensor, post: Post[R], mark: int, mode: RecvMode, op: ReduceOp | str,
                    own: torch.Tensor | None, todo: deque[StageChunk]) -> Iterator[R]:
        """Receives posted into every slot ahead; each completed one (yield: wait for it)
        is landed on the device, and its slot re-posted once the H2D copy finished."""
        mode = RecvMode(mode)
        check_flat(dst, "the staged receive's destination")
        if mode is RecvMode.COMBINE:
            if own is None:
                raise ConfigError("RecvMode.COMBINE needs own=<this member's flat input>")
            check_flat(own, "the member's own input")
        if mode is RecvMode.ACCUMULATE and self._scratch is None:
            self._scratch = [self.ops.empty(self._slot_elems, self.dtype) for _ in range(self.slots)]
        posted: deque[tuple[StageChunk, int, R]] = deque()
        for slot in range(min(self.slots, len(todo))):    # post ahead into every slot
            chunk = todo.popleft()
            posted.append((chunk, slot, self._post(post, chunk, self._stage("recv", slot, chunk))))
        self._busy(len(posted))
        while posted:
            chunk, slot, req = posted.popleft()
            yield req
            ev = self._land(chunk, slot, dst, mark, mode, op, own)
            ev.wait()                                     # the slot's bytes are on the device
            if mode is RecvMode.COPY:
                self.reducer.marks.publish(chunk.index, mark)
            if todo:
                nxt = todo.popleft()
                posted.append((nxt, slot, self._post(post, nxt, self._stage("recv", slot, nxt))))

    def _land(self, chunk: StageChunk, slot: int, dst: torch.Tensor, mark: int, mode: RecvMode,
              op: ReduceOp | str, own: torch.Tensor | None) -> CopyEvent:
        """Enqueue the H2D copy of a received slot (and the reduction that consumes it)."""
        target = self.ops.view(dst, chunk.start, chunk.end)
        stage = self._stage("recv", slot, chunk)
        if mode is RecvMode.ACCUMULATE:
            assert self._scratch is not None
            scratch = self._scratch[slot][:chunk.numel]
            ev = self.ops.from_host(scratch, stage)
            self._count_h2d()
            self.written.add(chunk.index)
            self.ops.reduce(self.reducer, chunk.index, target, scratch, op, mark, after=ev)
            return ev
        self.written.add(chunk.index)
        ev = self.ops.from_host(target, stage)
        self._count_h2d()
        if mode is RecvMode.COMBINE:
            assert own is not None
            self.ops.reduce(self.reducer, chunk.index, target, self.ops.view(own, chunk.start, chunk.end),
                            op, mark, after=ev)
        return ev

    def _count_h2d(self) -> None:
        self.stats.h2d += 1
        self._copied()

    # -- after an abort -----------------------------------------------------------------

    def settle(self, mark: int) -> dict[int, PieceState]:
        """Per piece: COMPLETE (every chunk carries ``mark``), UNTOUCHED (no chunk's device
        region was written) or LOST. Reads marks only: never waits for the device."""
        finished = set(self.reducer.marks.finished(mark=mark))
        by_piece: dict[int, list[int]] = {}
        for c in self.chunks:
            by_piece.setdefault(c.piece, []).append(c.index)
        out: dict[int, PieceState] = {}
        for piece, idx in by_piece.items():
            if all(i in finished for i in idx):
                out[piece] = PieceState.COMPLETE
            elif not any(i in self.written for i in idx):
                out[piece] = PieceState.UNTOUCHED
            else:
                out[piece] = PieceState.LOST
        return out
