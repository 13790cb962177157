"""Pipelined ring reduce-scatter + all-gather (large messages).

Chunk ``c`` (of ``n``) starts at ring position ``c + shift``; at reduce-scatter step ``s``
member ``p`` sends chunk ``p-s-shift`` and receives chunk ``p-s-1-shift``, which it
reduces with its own input; at all-gather step ``t`` it forwards the final chunk it got
last. Every chunk is cut into ``slices`` pieces and the loop is pipelined: all receives are
posted before the first send (each lands in place when it arrives), each slice of step
``s-1`` is reduced as soon as it arrived (torch releases the GIL in ``add_``) and sent on
at once, so reduction overlaps transfer. Receives go straight into the output region.
``chunks`` (optional) names the pieces of each of the ``n`` chunks explicitly, of any
sizes (the hierarchical allreduce's owned-shard sets on a host of unequal size); by
default chunk ``c`` is pieces ``[c*slices, (c+1)*slices)``.

Ledger: member ``p`` holds for chunk ``c`` the partial over the ring arc ``[c+shift..p]``;
after its last reduce-scatter step the chunk it holds is final; an all-gather receive
makes its region final. Failure behaviour: any transport error propagates after
:meth:`OpContext.settle`; the communicator then runs recovery from the ledger.
"""
from __future__ import annotations

from typing import Sequence

from resilient.collectives import tags
from resilient.collectives.algorithms.base import Capabilities, OpContext, finish_alone, tag
from resilient.collectives.staged import Incoming, Outgoing, StagedTransfers
from resilient.device import RecvMode
from resilient.errors import ConfigError
from resilient.kernels import reduce_into
from resilient.transport.base import Request


#: a posted receive: ((request, piece, sender's mask), phase, mask once reduced)
_Posted = tuple[tuple[Request, int, int], str, int]


class RingReduceScatterAllgather:
    SPACE = tags.RING
    capabilities = Capabilities(forward_ring_only=True, staged=True)

    def __init__(self, slices: int, shift: int = 0, do_rs: bool = True, do_ag: bool = True,
                 chunks: Sequence[Sequence[int]] | None = None) -> None:
        self.slices, self.shift, self.do_rs, self.do_ag = slices, shift, do_rs, do_ag
        self.chunks = [list(c) for c in chunks] if chunks is not None else None

    def final_order(self, n_members: int, index: int, n_pieces: int) -> list[int]:
        """Its last reduce-scatter chunk, then the all-gather chunks (slices in order);
        index order for a one-phase ring or a layout that is not ``n_members`` chunks."""
        if not (n_members >= 2 and self.do_rs and self.do_ag and n_pieces % n_members == 0):
            return list(range(n_pieces))
        S, sh = n_pieces // n_members, self.shift
        chunks = [(index + 1 - sh) % n_members] + [(index - sh - t) % n_members for t in range(n_members - 1)]
        return [c * S + j for c in chunks for j in range(S)]

    def run(self, ctx: OpContext) -> None:
        L, tr = ctx.ledger, ctx.transport
        n, p, S, sh = len(ctx.members), ctx.me, self.slices, self.shift
        if n == 1:
            if self.do_rs:
                finish_alone(L)
            return
        nxt, prv = ctx.members[(p + 1) % n], ctx.members[(p - 1) % n]
        full = L.full
        steps = []
        if self.do_rs:
            steps += [("rs", (p - s - sh) % n, (p - s - 1 - sh) % n, s) for s in range(n - 1)]
        if self.do_ag:
            steps += [("ag", (p + 1 - sh - t) % n, (p - sh - t) % n, t) for t in range(n - 1)]
        # Every receive of the op is posted up front, in the order the peer sends: a slice
        # that arrives early lands in place instead of in an unexpected-message buffer
        # (an allocation and a copy per slice). Each reduce-scatter step receives into its
        # own chunk; an all-gather receive targets a chunk this member sent on during
        # reduce-scatter, and its bytes can only arrive after that send completed (the
        # final value includes what it carried), so posting early never overwrites a
        # buffer in flight.
        masks = [self._masks(phase, s, p, n, full) for phase, _, _, s in steps]
        if L.stage_elems:
            if self.chunks is not None:
                raise ConfigError("the staged ring cuts equal chunks (no explicit chunks)")
            self._run_staged(ctx, steps, masks, nxt, prv)
            return
        chunk = self.chunks or [[c * S + j for j in range(S)] for c in range(n)]
        # failpoint progress: pieces sent before each step within its phase, of the phase's total
        before, total = [], {"rs": 0, "ag": 0}
        for phase, sc, _, _ in steps:
            before.append(total[phase])
            total[phase] += len(chunk[sc])
        posted: list[list[_Posted]] = []
        for idx, (phase, sc, rc, s) in enumerate(steps):
            done_mask, sender_mask = masks[idx]
            cur: list[_Posted] = []
            for j, pc in enumerate(chunk[rc]):
                req = tr.irecv(prv, L.buf(pc), ctx.seq, tag(idx, j, self.SPACE), ctx.digest)
                entry = (req, pc, sender_mask)
                ctx.inflight.append(entry)
                cur.append((entry, phase, done_mask))
            posted.append(cur)
        prev: list[_Posted] | None = None
        sends: list[Request] = []
        for idx, (phase, sc, rc, s) in enumerate(steps):
            # the chunk sent at step s is the one received at step s-1 (same pieces)
            for j, ps in enumerate(chunk[sc]):
                if prev is None:
                    buf = L.input_buf(ps) if phase == "rs" else L.buf(ps)
                else:
                    self._complete(ctx, *prev[j])
                    buf = L.buf(ps)
                if ctx.ledger.enabled:
                    ctx.failpoint(phase, (before[idx] + j) / total[phase])
                sends.append(tr.isend(nxt, buf, ctx.seq, tag(idx, j, self.SPACE), ctx.digest))
            prev = posted[idx]
        assert prev is not None   # n >= 2: at least one step
        for last in prev:
            self._complete(ctx, *last)
        ctx.wait(sends)

    @staticmethod
    def _masks(phase: str, s: int, p: int, n: int, full: int) -> tuple[int, int]:
        """(mask once the step's receive is reduced, the sender's mask) of step ``s``."""
        if phase != "rs":
            return full, full
        arc = 0
        for i in range(s + 2):
            arc |= 1 << ((p - i) % n)
        return (full if s == n - 2 else arc), arc & ~(1 << p)

    def _run_staged(self, ctx: OpContext, steps: list[tuple[str, int, int, int]], masks: list[tuple[int, int]],
                    nxt: str, prv: str) -> None:
        """The host-staged ring (:mod:`..staged`): one exchange per step, chunks of the
        sent chunk to ``nxt`` while those of the received one arrive from ``prv``; a
        reduce-scatter chunk is combined with this member's input (the mark follows the
        reduction), an all-gather chunk copied. Same values, same ledger masks."""
        L, S, n = ctx.ledger, self.slices, len(ctx.members)
        if L.inp_offset is not None and self.do_rs:
            raise ConfigError("the staged ring reduces with an input indexed like its output (no inp_offset)")
        staged = StagedTransfers(ctx, self.SPACE)
        for idx, (phase, sc, rc, s) in enumerate(steps):
            src = L.inp if phase == "rs" and idx == 0 else L.out
            if ctx.ledger.enabled:
                ctx.failpoint(phase, self._frac(idx, 0, S, n))
            mode = RecvMode.COMBINE if phase == "rs" else RecvMode.COPY
            staged.step(idx, Outgoing(nxt, src, [sc * S + j for j in range(S)]),
                        Incoming(prv, L.out, {rc * S + j: masks[idx][0] for j in range(S)}, mode,
                                 L.inp if phase == "rs" else None))

    def _frac(self, idx: int, j: int, S: int, n: int) -> float:
        per_phase = (n - 1) * S
        k = idx * S + j
        return (k % per_phase) / per_phase

    @staticmethod
    def _complete(ctx: OpContext, entry: tuple[Request, int, int], phase: str, done_mask: int) -> None:
        req, piece, _ = entry
        ctx.wait([req])
        L = ctx.ledger
        if phase == "rs":
            reduce_into(L.view(piece), L.input_view(piece), ctx.op)
        L.set(piece, done_mask)
        ctx.inflight.remove(entry)
