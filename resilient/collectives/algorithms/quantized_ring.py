"""Pipelined ring reduce-scatter + all-gather over *integers* with a packed wire
(the exact compressed allreduce; ``docs/compression.md``).

The ledger is an integer one: ``inp`` holds this member's quantized input ``q`` (int32),
``out`` the int32 accumulators, exactly like the float ring (:mod:`.ring`): member ``p``
holds for chunk ``c`` the integer partial over the ring arc ``[c..p]`` and the masks say
so. Integer addition is associative, so any recovery plan over these accumulators
(:mod:`resilient.collectives.resume`, which sums int32 pieces as it sums floats) yields
the same bits as the ring itself.

What differs from the float ring is only the wire: a partial over ``k`` contributors
travels at :func:`~resilient.collectives.quantization.wire_bits` (the narrowest width
that holds it: 4, 5, 6, 6 bits at 4 bits and 4 members). Receives land in private wire
buffers, are unpacked and added to this member's input into ``out`` and only then is the
piece's mask set; a reduce-scatter receive is unpacked, added and packed for the next
send in one call (:func:`~resilient.collectives.quantization.unpack_add_pack`); an
all-gather receive is forwarded as received (already at the final width), before it is
unpacked. A receive interrupted by an abort therefore never touches ``out``: the masks
stay exact without :meth:`OpContext.settle` having to clear anything.

Pieces are chunk-major (``piece = chunk * per_chunk + j``) and a piece may span several
segments of different ``bits`` (e.g. fixed-point 32-bit for 1-D parameters between weight
matrices): its *parts*. One piece is one message: its parts are packed one after another
into one wire buffer, each at its own width and at a 4-byte aligned offset
(:func:`wire_plan`), so the message count is ``per_chunk`` per chunk and step whatever the
number of segments (one message per segment cost more in per-message overhead than the
bytes it carried).
Failure behaviour: any transport error propagates (the communicator recovers from the
ledger); a failpoint fires at the same progress marks as the float ring (``rs``/``ag``).
"""
from __future__ import annotations

from typing import Callable

import torch

from resilient.collectives import tags
from resilient.collectives.algorithms.base import Capabilities, OpContext, finish_alone, index_order, tag
from resilient.collectives.quantization import pack, pack_into, unpack_add_pack, wire_bits, wire_nbytes
from resilient.transport.base import Request

#: a piece's wire: ((start, end, width, byte offset) per part, total bytes)
Plan = tuple[tuple[tuple[int, int, int, int], ...], int]
#: a posted receive: (request, piece, wire buffer, plan, phase, mask once unpacked)
_Posted = tuple[Request, int, torch.Tensor, Plan, str, int]


def wire_plan(parts: tuple[tuple[int, int, int], ...], k: int, members: int) -> Plan:
    """Where each part of a piece goes in its wire at ``k`` contributors: parts follow one
    another, each starting at a multiple of 4 bytes (so a 16/32-bit part is an aligned
    view); the last one is not padded (a one-part piece's wire is exactly
    :func:`wire_nbytes`)."""
    out, off = [], 0
    for a, b, bits in parts:
        off = -(-off // 4) * 4
        w = wire_bits(bits, k, members)
        out.append((a, b, w, off))
        off += wire_nbytes(b - a, w)
    return tuple(out), off


class QuantizedRing:
    SPACE = tags.QUANTIZED_RING
    capabilities = Capabilities()
    final_order = staticmethod(index_order)

    def __init__(self, piece_parts: list[tuple[tuple[int, int, int], ...]], per_chunk: int,
                 members_bound: int, on_final: Callable[[int], None] | None = None) -> None:
        """``on_final(piece)``: called once a piece's sum in ``out`` is final (after the
        last reduce-scatter step for this member's chunk, after each all-gather receive),
        right after the send it feeds is posted — the caller dequantizes it while later
        slices are on the wire. Not called for pieces a recovery finishes."""
        self.piece_parts, self.per_chunk, self.members_bound = piece_parts, per_chunk, members_bound
        self.on_final = on_final
        #: the run ended without an error (no recovery touched ``out`` after on_final)
        self.finished = False

    def _plan(self, piece: int, k: int) -> Plan:
        return wire_plan(self.piece_parts[piece], k, self.members_bound)

    @staticmethod
    def _pack(q: torch.Tensor, plan: Plan) -> torch.Tensor:
        """The wire of one piece (``q``: its int32 values)."""
        parts, total = plan
        if len(parts) == 1:
            return pack(q, parts[0][2])   # no copy at all for a 32-bit piece
        wire = torch.empty(total, dtype=torch.uint8)
        for a, b, w, off in parts:
            pack_into(q[a:b], w, wire[off:off + wire_nbytes(b - a, w)])
        return wire

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
                plan = self._plan(pc, k)
                wire = torch.empty(plan[1], dtype=torch.uint8)
                req = tr.irecv(prv, wire, ctx.seq, tag(idx, j, self.SPACE), ctx.digest)
                cur.append((req, pc, wire, plan, phase, done_mask))
            posted.append(cur)
        keep: list[torch.Tensor] = []  # wire buffers of sends in flight
        sends: list[Request] = []
        prev: list[_Posted] | None = None
        final = self.on_final
        for idx, (phase, sc, _rc, _s, k) in enumerate(steps):
            forward = phase == "ag" and steps[idx - 1][0] == "ag"
            for j in range(S):
                ps = sc * S + j
                got = None if prev is None else prev[j]
                if got is None:
                    wire = self._pack(L.input_view(ps), self._plan(ps, k))   # a lazy input: quantized here
                elif forward:   # an all-gather receive goes on as received; unpacked after the send
                    ctx.wait([got[0]])
                    wire = got[2]
                else:   # the piece received last step is the one sent now: unpack, add, pack in one call
                    wire = self._complete(ctx, got, self._plan(ps, k))
                if L.enabled:
                    ctx.failpoint(phase, self._frac(idx, j, S, n))
                keep.append(wire)
                sends.append(tr.isend(nxt, wire, ctx.seq, tag(idx, j, self.SPACE), ctx.digest))
                if forward and got is not None:
                    self._complete(ctx, got, waited=True)
                if final is not None and phase == "ag":
                    final(ps)   # final since the receive just completed (or the last reduce-scatter step)
            if prev is None and L.fill_input is not None:
                # the first sends are on the wire: write the rest of a lazy input now, in the
                # order the reduce-scatter adds it, before waiting for anything
                for s in range(n - 1):
                    for j in range(S):
                        L.input_view(((p - s - 1) % n) * S + j)
            prev = posted[idx]
        assert prev is not None   # n >= 2: at least one step
        for j in range(S):
            self._complete(ctx, prev[j])
            if final is not None:
                final(prev[j][1])
        ctx.wait(sends)
        self.finished = True

    @staticmethod
    def _frac(idx: int, j: int, S: int, n: int) -> float:
        per_phase = (n - 1) * S
        return ((idx * S + j) % per_phase) / per_phase

    @staticmethod
    def _complete(ctx: OpContext, entry: _Posted, send: Plan | None = None, waited: bool = False) -> torch.Tensor:
        """Wait for one receive, unpack it into ``out`` (adding this member's input in
        reduce-scatter), set the piece's mask; returns the wire buffer, or with ``send``
        the piece's sum packed at that plan in the same pass (a single 32-bit part: a view
        of ``out``, no copy). ``waited``: the receive is known complete."""
        req, piece, wire, plan, phase, done_mask = entry
        if not waited:
            ctx.wait([req])
        L = ctx.ledger
        out, inp = L.view(piece), (L.input_view(piece) if phase == "rs" else None)
        parts_o = None if send is None or (len(send[0]) == 1 and send[0][0][2] == 32) else send[0]
        dst = None if parts_o is None or send is None else torch.empty(send[1], dtype=torch.uint8)
        for i, (a, b, w, off) in enumerate(plan[0]):
            to, wo = None, 0
            if dst is not None and parts_o is not None:
                _a, _b, wo, oo = parts_o[i]
                to = dst[oo:oo + wire_nbytes(b - a, wo)]
            unpack_add_pack(wire[off:off + wire_nbytes(b - a, w)], b - a, w, out[a:b],
                            None if inp is None else inp[a:b], to, wo)
        L.set(piece, done_mask)
        if send is None:
            return wire
        return dst if dst is not None else pack(out, 32)
