"""Recursive doubling allreduce (small messages: log2(n) rounds of latency).

Members ``pof2..n-1`` (beyond the largest power of two) first fold their input into
member ``i - pof2`` and get the result back at the end. Each exchange is ``mine + theirs``
on one side and ``theirs + mine`` on the other — identical bits, since every reduce op is
commutative — so every member ends with the same result. One ledger piece whose mask is
the block of members folded in so far. Failure behaviour as in the ring.
"""
from __future__ import annotations

import torch

from resilient.collectives import tags
from resilient.collectives.algorithms.base import Capabilities, OpContext, index_order, tag
from resilient.collectives.staged import Incoming, Outgoing, StagedTransfers
from resilient.device import RecvMode
from resilient.kernels import reduce_into


def _block(q: int, k: int, pof2: int, n: int) -> int:
    """Mask held by core member ``q`` after ``k`` doubling steps (extras included)."""
    m = 0
    base = (q >> k) << k
    for c in range(base, base + (1 << k)):
        m |= 1 << c
        if c + pof2 < n:
            m |= 1 << (c + pof2)
    return m


class RecursiveDoubling:
    SPACE = tags.RECURSIVE_DOUBLING
    capabilities = Capabilities(staged=True)
    final_order = staticmethod(index_order)

    def run(self, ctx: OpContext) -> None:
        L, tr = ctx.ledger, ctx.transport
        n, p = len(ctx.members), ctx.me
        out, inp = L.view(0), L.input_view(0)
        if L.masks[0] == 0:
            out.copy_(inp)
            L.set(0, 1 << p)
        if n == 1:
            return
        pof2 = 1 << (n.bit_length() - 1)
        if L.stage_elems:
            self._run_staged(ctx, pof2)
            return
        staging = torch.empty_like(out)
        M = ctx.members
        if p >= pof2:
            ctx.failpoint("rd", 0.0)
            ctx.wait([tr.isend(M[p - pof2], out, ctx.seq, tag(0, 0, self.SPACE), ctx.digest)])
            req = tr.irecv(M[p - pof2], out, ctx.seq, tag(99, 0, self.SPACE), ctx.digest)
            entry = (req, 0, L.full)
            ctx.inflight.append(entry)
            ctx.wait([req])
            ctx.inflight.remove(entry)
            L.set(0, L.full)
            return
        if p + pof2 < n:
            ctx.wait([tr.irecv(M[p + pof2], staging, ctx.seq, tag(0, 0, self.SPACE), ctx.digest)])
            reduce_into(out, staging, ctx.op)
            L.set(0, L.masks[0] | 1 << (p + pof2))
        k, steps = 0, pof2.bit_length() - 1
        while (1 << k) < pof2:
            ctx.failpoint("rd", k / max(1, steps))
            partner = p ^ (1 << k)
            s = tr.isend(M[partner], out, ctx.seq, tag(1 + k, 0, self.SPACE), ctx.digest)
            r = tr.irecv(M[partner], staging, ctx.seq, tag(1 + k, 0, self.SPACE), ctx.digest)
            ctx.wait([s, r])
            reduce_into(out, staging, ctx.op)
            L.set(0, L.masks[0] | _block(partner, k, pof2, n))
            k += 1
        L.set(0, L.full)
        if p + pof2 < n:
            ctx.wait([tr.isend(M[p + pof2], out, ctx.seq, tag(99, 0, self.SPACE), ctx.digest)])

    def _run_staged(self, ctx: OpContext, pof2: int) -> None:
        """The same exchanges through host staging (:mod:`..staged`): a received chunk is
        accumulated into ``out`` via device scratch (``mine + theirs``, as above) and
        marked after the reduction; what is sent is a snapshot of ``out`` taken before
        the exchange, so a chunk reduced early never leaves in place of the old one."""
        L = ctx.ledger
        n, p, M, out, ops = len(ctx.members), ctx.me, ctx.members, L.view(0), L.ops
        staged = StagedTransfers(ctx, self.SPACE)
        if p >= pof2:
            ctx.failpoint("rd", 0.0)
            staged.step(0, send=Outgoing(M[p - pof2], out, [0]))
            staged.step(99, recv=Incoming(M[p - pof2], out, {0: L.full}))
            return
        if p + pof2 < n:
            staged.step(0, recv=Incoming(M[p + pof2], out, {0: L.masks[0] | 1 << (p + pof2)}, RecvMode.ACCUMULATE))
        snapshot = ops.empty(out.numel(), out.dtype)
        k, steps = 0, pof2.bit_length() - 1
        while (1 << k) < pof2:
            ctx.failpoint("rd", k / max(1, steps))
            partner = p ^ (1 << k)
            ops.copy(snapshot, out)
            staged.step(1 + k, Outgoing(M[partner], snapshot, [0]),
                        Incoming(M[partner], out, {0: L.masks[0] | _block(partner, k, pof2, n)}, RecvMode.ACCUMULATE))
            k += 1
        L.set(0, L.full)
        if p + pof2 < n:
            staged.step(99, send=Outgoing(M[p + pof2], out, [0]))
