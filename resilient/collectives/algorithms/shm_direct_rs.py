"""Direct shared-memory reduce-scatter for the members of one host (issue 16): no ring, no
per-chunk messages, and a member that dies after publishing its input stays a
contributor without any resend.

The machinery is the direct allreduce's (:class:`~.shm_direct.ShmDirect`: one memfd
segment per member mapped read-only by its peers, per-epoch sessions, tickets and
digests, futex bells, abort-aware waits, reads re-checked against the tickets). One op,
member ``p`` of ``n`` (the ledger's layout is the ring reduce-scatter's: chunk ``c`` is
member ``c``'s output, ``slices`` pieces each):

1. **in** — copy its input once into its own segment, all but its own chunk (nobody
   else reads that one), and that chunk into its output (its pieces' masks: itself
   alone), and publish the op's ticket in its ``W_IN`` word;
2. **rs** — once every peer's ``W_IN`` shows the op, reduce chunk ``p`` reading every
   member's chunk ``p`` straight from its segment, in cache-sized blocks in member-index
   order (the bits are the same whoever computes it), into its output; check every
   peer's ticket is still there; mark the chunk's pieces final over the full set;
   publish ``W_DONE``.

No member waits for anything after step 1, so a member SIGKILLed after publishing (in
the middle of its own reduction, say) does not stop the others: its input stays
readable in their mappings of its segment (a segment never shrinks; the kernel frees it
when the last mapping goes), every survivor finishes the op with the full set as
contributors, and the next op's membership change has nothing left to recover. A member
that dies before publishing leaves every survivor waiting for its ``W_IN``: the
transport's abort (the epoch without it) ends the wait, each survivor's own chunk holds
its own input, and the ordinary recovery (:mod:`..resume`) finishes each survivor's chunk
over the survivors from their kept inputs. A member that leaves the op by an error clears its ``W_IN``
first (a peer still waiting then fails its op and recovers too), and a SIGSTOPped
member that resumes after the survivors reused their areas fails the check of step 2
(``TransportError``) instead of delivering a torn chunk. Only a survivor that is
aborted before it saw every input while the others had already finished reports a
different set for its chunk (the survivors'): each member reports the contributors of
its own chunk, the reduce-scatter contract of docs/recovery.md.

Failpoints: phase ``rs`` at fraction 0 before the input is published, then at the
fractions of the own chunk reduced. Failure behaviour: as the direct allreduce's
(``TransportAborted`` from a wait after the abort, :class:`~resilient.errors.OpMismatch`
on every member for a descriptor digest that differs, ``TransportError`` for a peer
that gave the op up or moved past it, the ring reduce-scatter for an epoch or op the
segments cannot hold).
"""
from __future__ import annotations

from resilient.collectives import tags
from resilient.collectives.algorithms.base import OpContext
from resilient.collectives.algorithms.ring import RingReduceScatterAllgather
from resilient.collectives.algorithms.shm_direct import COUNTS, ShmDirect, _Session
from resilient.kernels.copy import copy_into
from resilient.transport.shm_segment import A_IN, W_DONE, area_word


class ShmDirectReduceScatter(ShmDirect):
    """The direct reduce-scatter (the module's docstring) over the per-member layout."""

    SPACE = tags.SHM_DIRECT_RS

    def final_order(self, n_members: int, index: int, n_pieces: int) -> list[int]:
        """Its own chunk's pieces (the only ones it makes final), then the rest in order."""
        if n_members < 2 or n_pieces % n_members:
            return list(range(n_pieces))
        S = n_pieces // n_members
        own = list(range(index * S, (index + 1) * S))
        return own + [q for q in range(n_pieces) if not index * S <= q < (index + 1) * S]

    def _ring(self, ctx: OpContext) -> None:
        RingReduceScatterAllgather(self.slices, shift=1, do_ag=False).run(ctx)

    def _direct(self, ctx: OpContext, sess: _Session) -> None:
        """Steps 1 and 2 of the module's docstring; the ring reduce-scatter on every member
        when one could not hold the op in its segment."""
        L, inp = ctx.ledger, ctx.ledger.inp
        own, nbytes, dtype = sess.own, inp.numel() * inp.element_size(), inp.dtype
        area, mine, theirs, fits = self._begin(ctx, sess, nbytes)
        failed = True
        try:
            a, b = self._chunk(ctx, ctx.me)
            if fits:   # every chunk but its own: member c reads only chunk c
                region = own.view(area * sess.stride, nbytes, dtype)
                copy_into(region[:a], inp[:a])
                copy_into(region[b:], inp[b:])
            # progress the recovery can finish from if a peer never publishes: its own chunk's
            # accumulator holds its own input (a rerun in a smaller epoch could not take the
            # caller's one-input-per-member list: GroupChanged)
            L.out[a:b].copy_(inp[a:b])
            self._mark(ctx, ctx.me, 1 << ctx.me)
            ctx.failpoint("rs", 0.0)
            self._publish(sess, area_word(area, A_IN), mine)
            mismatch = self._await_inputs(ctx, sess, area, theirs)
            if mismatch is not None:
                failed = False   # keep our words: every peer must see the mismatch too
                raise mismatch
            if not fits or not self._all_fit(sess, area):
                COUNTS.ring += 1
                self._mark(ctx, ctx.me, 0)   # the ring starts from nothing
                self._ring(ctx)
                failed = False
                return
            ins = [inp if q == ctx.me else self._view(ctx, q, sess.peers[q][0], area, nbytes, dtype)
                   for q in range(len(ctx.members))]
            self._mark(ctx, ctx.me, 0)   # the accumulator is being overwritten
            self._reduce_own(ctx, ins, None, "rs")
            self._check(ctx, sess, area_word(area, A_IN), theirs, sess.peers)
            self._mark(ctx, ctx.me, L.full)
            COUNTS.direct += 1
            failed = False
        finally:
            if failed:   # a member left behind must not finish from our area
                own.set(area_word(area, A_IN), 0)
            self._publish(sess, W_DONE, mine)
