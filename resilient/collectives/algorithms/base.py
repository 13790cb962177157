"""What every algorithm is and gets: the :class:`Algorithm` protocol (run, final order,
capabilities; its tag space comes from :mod:`resilient.collectives.tags`) and the
:class:`OpContext` it runs in.

Failure behaviour: :meth:`OpContext.wait` never gives up by itself (it reports peers it
waited on past ``op_timeout`` as suspects and keeps waiting; the transport's abort ends
it with a :class:`~resilient.errors.TransportError`); a peer found by a probe to be in
the same op with another descriptor ends it with :class:`~resilient.errors.OpMismatch`
(:mod:`resilient.collectives.op_context`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from resilient.collectives import failpoints
from resilient.collectives.ledger import Ledger
from resilient.collectives.op_context import wait_op
from resilient.collectives.tags import tag as tag   # re-exported: algorithms build their tags with it
from resilient.kernels import ReduceOp
from resilient.transport.base import Buffer, Request


class OpTransport(Protocol):
    """What an algorithm posts through (a :class:`~resilient.transport.base.Transport`
    or the retrying layer over one): see the transport interface for the semantics."""

    def isend(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request: ...

    def irecv(self, peer: str, buf: Buffer, op_seq: int, tag: int, digest: int = 0) -> Request: ...

    def wait(self, requests: Sequence[Request], timeout: float | None = None) -> bool: ...


@dataclass
class OpContext:
    """One op on one member: the transport, the ledger, the reduce op and a ``wait`` that
    reports peers we waited on past ``op_timeout`` as suspects (and keeps waiting: the
    coordinator decides, never one peer's word).

    ``inflight`` holds receives whose region is not final yet, as (request, piece,
    mask-if-complete): after an abort :meth:`settle` turns them into exact ledger state."""

    transport: OpTransport
    ledger: Ledger
    op: ReduceOp
    op_timeout: float | None
    on_suspect: Callable[[str, str], None]
    epoch: int
    inflight: list[tuple[Request, int, int]] = field(default_factory=list)

    @property
    def members(self) -> tuple[str, ...]:
        return self.ledger.members

    @property
    def me(self) -> int:
        return self.ledger.me

    @property
    def seq(self) -> int:
        return self.ledger.seq

    @property
    def digest(self) -> int:
        return self.ledger.digest

    def wait(self, reqs: Sequence[Request]) -> None:
        """Until every request of ``reqs`` is done: suspects reported past ``op_timeout``,
        the peers waited on probed past a short interval
        (:func:`~resilient.collectives.op_context.wait_op`)."""
        wait_op(self.transport, reqs, self.seq, self.op_timeout, self.on_suspect)

    def failpoint(self, phase: str, frac: float) -> None:
        if failpoints.ACTIVE:
            failpoints.check(self.seq, phase, frac, self.epoch)

    def settle(self) -> None:
        """After a failure: a receive that finished but was not reduced yet leaves the
        sender's accumulator in the region (mask given), one that may have been partly
        written leaves nothing usable (mask 0); an untouched one leaves the region as it
        was."""
        for req, piece, mask_if_done in self.inflight:
            if req.done():
                self.ledger.set(piece, mask_if_done)
            elif req.touched():
                self.ledger.set(piece, 0)
        self.inflight.clear()


@dataclass(frozen=True)
class Capabilities:
    """What a wrapper (the leaf path) may assume about an algorithm.

    ``forward_ring_only``: with 3 or more members it sends only to the next member in ring
    order, so the links in the other direction stay idle (a chain may use them at once).
    ``staged``: see the field."""

    forward_ring_only: bool = False
    #: runs its transfers through host staging when the ledger asks (``stage_elems > 0``:
    #: CUDA tensors, or ``staging=True``); algorithms without it refuse CUDA tensors
    staged: bool = False


class Algorithm(Protocol):
    """One collective algorithm over an :class:`OpContext` (one file per algorithm).

    ``run`` fills ``ctx.ledger`` (pieces and masks exact at every instant, so recovery can
    finish the op after any failure) and lets transport errors propagate after
    :meth:`OpContext.settle`; ``final_order`` is the order in which member ``index`` of
    ``n_members`` makes the ledger's pieces final (a leaf's result stream follows it)."""

    @property
    def capabilities(self) -> Capabilities: ...

    def run(self, ctx: OpContext) -> None: ...

    def final_order(self, n_members: int, index: int, n_pieces: int) -> list[int]: ...


def index_order(n_members: int, index: int, n_pieces: int) -> list[int]:
    """The default :meth:`Algorithm.final_order`: pieces in index order."""
    return list(range(n_pieces))


def finish_alone(ledger: Ledger) -> None:
    """A one-member reduction: every piece is this member's own input, final."""
    for q in range(len(ledger.pieces)):
        ledger.view(q).copy_(ledger.input_view(q))
        ledger.set(q, ledger.full)
