"""Pipelined ring reduce-scatter + all-gather over *integers* with a packed wire
(the exact compressed allreduce; ``docs/compression.md``).

The ledger is an integer one: ``inp`` holds this member's quantized input ``q`` (int32),
``out`` the int32 accumulators, exactly like the float ring (:mod:`.ring`): member ``p``
holds for chunk ``c`` the integer partial over the ring arc ``[c..p]`` and the masks say
so. Integer addition is associative, so any recovery plan over these accumulators
(:mod:`resilient.collectives.resume`, which sums int32 pieces as it sums floats) yields
the same bits as the ring itself.

What differs from the float ring is only the wire: a partial over ``k`` contributors
travels at :func:`~resilient.collectives.quantization.wire_bits` (packed 2/4 bits for a
single input, then int8 / int16 / int32). Receives land in private wire buffers, are
unpacked and added to this member's input into ``out`` and only then is the piece's mask
set; an all-gather receive is forwarded as received (already at the final width). A
receive interrupted by an abort therefore never touches ``out``: the masks stay exact
without :meth:`OpContext.settle` having to clear anything.

Pieces are chunk-major (``piece = chunk * per_chunk + j``) and each piece has its own
``bits`` (segments of different widths, e.g. fixed-point 32-bit for 1-D parameters).
Failure behaviour: any transport error propagates (the communicator recovers from the
ledger); a failpoint fires at the same progress marks as the float ring (``rs``/``ag``).
"""
from __future__ import annotations

import torch

from resilient.collectives import tags
from resilient.collectives.algorithms.base import Capabilities, OpContext, finish_alone, index_order, tag
from resilient.collectives.quantization import pack, unpack_add, wire_bits, wire_nbytes
from resilient.transport.base import Request

#: a posted receive: (request, piece, wire buffer, wire bits, phase, mask once unpacked)
_Posted = tuple[Request, int, torch.Tensor, int, str, int]


class QuantizedRing:
    SPACE = tags.QUANTIZED_RING
    capabilities = Capabilities()
    final_order = staticmethod(index_order)

    def __init__(self, piece_bits: list[int], per_chunk: int, members_bound: int) -> None:
        self.piece_bits, self.per_chunk, self.members_bound = piece_bits, per_chunk, members_bound

    def _width(self, piece: int, k: int) -> int:
        return wire_bits(self.piece_bits[piece], k, self.members_bound)

    def run(self, ctx: OpContext) -> None:
        L, tr = ctx.ledger, ctx.transport
        n, p, S = len(ctx.members), ctx.me, self.per_chunk
        if n == 1:
            finish_alone(L)
            return
        nxt, prv = ctx.members[(p + 1) % n], ctx.members[(p - 1) % n]
        full = L.full
        # (phase, chunk sent, chunk received, step, contributors in what is sent)
        steps = [("rs", (p - s) % n, (p - s - 1) % n, s, s + 1) for s in range(n - 1)]
        steps += [("ag", (p + 1 - t) % n, (p - t) % n, t, n) for t in range(n - 1)]
        posted: list[list[_Posted]] = []
        for idx, (phase, _sc, rc, s, k) in enumerate(steps):
            if phase == "rs":
                arc = 0
                for i in range(s + 2):
                    arc |= 1 << ((p - i) % n)
                done_mask = full if s == n - 2 else arc
            else:
                done_mask = full
            cur: list[_Posted] = []
            for j in range(S):
                pc = rc * S + j
                a, b = L.pieces[pc]
                w = self._width(pc, k)
                wire = torch.empty(wire_nbytes(b - a, w), dtype=torch.uint8)
                req = tr.irecv(prv, wire, ctx.seq, tag(idx, j, self.SPACE), ctx.digest)
                cur.append((req, pc, wire, w, phase, done_mask))
            posted.append(cur)
        keep: list[torch.Tensor] = []  # wire buffers of sends in flight
        sends: list[Request] = []
        prev: list[_Posted] | None = None
        for idx, (phase, sc, _rc, _s, k) in enumerate(steps):
            for j in range(S):
                ps = sc * S + j
                if prev is None:
                    wire = pack(L.input_view(ps), self._width(ps, k))
                else:
                    got = self._complete(ctx, prev[j])
                    wire = got if phase == "ag" and steps[idx - 1][0] == "ag" else pack(L.view(ps), self._width(ps, k))
                if L.enabled:
                    ctx.failpoint(phase, self._frac(idx, j, S, n))
                keep.append(wire)
                sends.append(tr.isend(nxt, wire, ctx.seq, tag(idx, j, self.SPACE), ctx.digest))
            prev = posted[idx]
        assert prev is not None   # n >= 2: at least one step
        for j in range(S):
            self._complete(ctx, prev[j])
        ctx.wait(sends)

    @staticmethod
    def _frac(idx: int, j: int, S: int, n: int) -> float:
        per_phase = (n - 1) * S
        return ((idx * S + j) % per_phase) / per_phase

    @staticmethod
    def _complete(ctx: OpContext, entry: _Posted) -> torch.Tensor:
        """Wait for one receive, unpack it into ``out`` (adding this member's input in
        reduce-scatter), set the piece's mask; returns the wire buffer."""
        req, piece, wire, w, phase, done_mask = entry
        ctx.wait([req])
        L = ctx.ledger
        a, b = L.pieces[piece]
        unpack_add(wire, b - a, w, L.view(piece), L.input_view(piece) if phase == "rs" else None)
        L.set(piece, done_mask)
        return wire
