"""Pipelined chain broadcast: root -> root+1 -> ... -> root-1 along the ring, in slices
(each link carries the data once; slice ``j+1`` travels while slice ``j`` is forwarded).
Copy pieces owned by the root: a member's mask for a slice is the root's bit once the
slice arrived. Followed by the caller's tiny barrier, so every member depends on every
other (input mismatches reach every rank; members stay at most one op apart)."""
from __future__ import annotations

import torch

from resilient.collectives import tags
from resilient.collectives.algorithms.base import Capabilities, OpContext, index_order, tag
from resilient.collectives.algorithms.recursive_doubling import RecursiveDoubling
from resilient.collectives.ledger import Ledger
from resilient.collectives.staged import Incoming, Outgoing, StagedTransfers
from resilient.kernels import ReduceOp


class ChainBroadcast:
    SPACE = tags.CHAIN
    capabilities = Capabilities(staged=True)
    final_order = staticmethod(index_order)

    def __init__(self, root: int, slices: int) -> None:
        self.root, self.slices = root, slices

    def run(self, ctx: OpContext) -> None:
        L, tr = ctx.ledger, ctx.transport
        n, p, r = len(ctx.members), ctx.me, self.root
        rb = 1 << r
        if p == r:
            for q in range(len(L.pieces)):
                L.view(q).copy_(L.input_view(q))
                L.set(q, rb)
        if n == 1:
            return
        pos = (p - r) % n
        nxt = ctx.members[(p + 1) % n] if pos < n - 1 else None
        prv = ctx.members[(p - 1) % n] if pos > 0 else None
        if L.stage_elems:
            self._run_staged(ctx, prv, nxt)
            return
        sends, recvs = [], []
        if prv is not None:
            for q in range(len(L.pieces)):
                req = tr.irecv(prv, L.view(q), ctx.seq, tag(0, q, self.SPACE), ctx.digest)
                entry = (req, q, rb)
                ctx.inflight.append(entry)
                recvs.append(entry)
        for q in range(len(L.pieces)):
            if prv is not None:
                entry = recvs[q]
                ctx.wait([entry[0]])
                L.set(q, rb)
                ctx.inflight.remove(entry)
            ctx.failpoint("chain", q / max(1, len(L.pieces)))
            if nxt is not None:
                sends.append(tr.isend(nxt, L.view(q), ctx.seq, tag(0, q, self.SPACE), ctx.digest))
        ctx.wait(sends)

    def _run_staged(self, ctx: OpContext, prv: str | None, nxt: str | None) -> None:
        """Store-and-forward per slice through host staging (:mod:`..staged`): slice
        ``q`` is received (copied, marked), then sent on while the sender already streams
        slice ``q+1`` (its frames wait in the transport until posted)."""
        L, rb = ctx.ledger, 1 << self.root
        staged = StagedTransfers(ctx, self.SPACE)
        for q in range(len(L.pieces)):
            if prv is not None:
                staged.step(0, recv=Incoming(prv, L.out, {q: rb}))
            ctx.failpoint("chain", q / max(1, len(L.pieces)))
            if nxt is not None:
                staged.step(0, send=Outgoing(nxt, L.out, [q]))


class ChainBroadcastWithBarrier:
    """Chain broadcast, then a one-element recursive-doubling barrier in the same op."""

    SPACE = tags.CHAIN
    capabilities = Capabilities(staged=True)
    final_order = staticmethod(index_order)

    def __init__(self, root: int, slices: int) -> None:
        self.chain = ChainBroadcast(root, slices)

    def run(self, ctx: OpContext) -> None:
        self.chain.run(ctx)
        L = ctx.ledger
        token = Ledger(ctx.seq, "barrier", L.members, L.me, L.epoch, L.digest, torch.zeros(1, dtype=torch.int32),
                       torch.zeros(1, dtype=torch.int32), [(0, 1)])
        sub = OpContext(ctx.transport, token, ReduceOp.SUM, ctx.op_timeout, ctx.on_suspect, ctx.epoch)
        RecursiveDoubling().run(sub)
