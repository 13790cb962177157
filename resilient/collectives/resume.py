"""Recovery execution: ledger-driven completion of an op after a membership change.

Protocol (every survivor, on first seeing an epoch that removed a member of its op — in
the middle of an op after the transport was aborted, or at the start of the next op):

1. configure the transport for the new epoch; publish a *status* under
   ``epochs/<n>/data/ledger/<me>``: JSON summaries of the in-flight op's ledger and of
   the last completed op (kept privately, with its final result);
2. exchange statuses (:mod:`.status_exchange`; ``EpochChanged`` -> start again on the
   newer epoch, with the ledger as it is now: that is the recursion): up to 16 survivors
   every survivor gets every other's; beyond, they go up a tree to one planner, which
   sends each survivor only its decision (:mod:`.recovery_decision`);
3. the op to finish is the smallest in-flight sequence number ``k`` among survivors
   (members are at most one op apart). Members already in ``k+1`` help with their
   retained result of ``k`` and then redo ``k+1`` from their inputs in the new epoch
   (nobody can have finished it). If no survivor holds any progress on ``k`` it is
   simply rerun in the new epoch;
4. everyone computes the same plan with :func:`~.recovery.plan_recovery` (or receives
   its own part of the planner's: the transfers it sends or receives, its local steps)
   and executes it round by round (sends and receives of a round concurrently),
   updating the ledger after each transfer. A failure during execution goes back to 1.

Device buffers (a CUDA op: ``ledger.ops`` is not the CPU's): the transports move host
bytes only, so every transfer goes through a host buffer of ``ledger.ops`` (a send's
piece is copied to it first; a receive lands in it and is copied, or reduced through
device scratch, into the piece once complete: the region is never partly written, so such
receives need no ``ctx.inflight`` entry).
"""
from __future__ import annotations

import time
from typing import Any

import torch

from resilient.collectives import tags
from resilient.collectives.algorithms.base import OpContext, tag
from resilient.collectives.ledger import Ledger
from resilient.collectives.recovery import PieceKind, Policy, RecoveryPlan, Transfer, plan_recovery
from resilient.kernels import reduce_into
from resilient.transport.base import Request

SPACE = tags.RECOVERY

#: a posted receive: (request, staging buffer or None, transfer, its ctx.inflight entry or None)
_Recv = tuple[Request, torch.Tensor | None, Transfer, tuple[Request, int, int] | None]


def build_plan(ledger: Ledger, ring: list[str], statuses: dict[str, dict[str, Any]], policy: Policy) -> RecoveryPlan:
    """The same deterministic plan on every survivor, from the exchanged statuses."""
    seq = ledger.seq
    held: dict[str, list[int]] = {}
    has_input: dict[str, bool] = {}
    decided: list[int | None] | None = None  # the contributor sets of members that already finished the op
    index = {m: i for i, m in enumerate(ledger.members)}
    for m in ring:
        st = statuses[m]
        summ = None
        for key in ("inflight", "retained"):
            s = st.get(key)
            if s is not None and s["seq"] == seq:
                summ = s
                break
        if (summ is None or summ["n_members"] != len(ledger.members) or summ["members_sha"] != ledger.members_digest()
                or summ["n_pieces"] != len(ledger.pieces)):
            # a member that started this op fresh in the new epoch (or whose layout
            # differs) holds nothing usable but its input
            held[m] = [0] * len(ledger.pieces)
            has_input[m] = True
        else:
            held[m] = [int(x) for x in summ["masks"]]
            has_input[m] = bool(summ["has_input"])
            if summ.get("done") and summ.get("need") is not None and len(summ["need"]) == len(ledger.pieces):
                # pieces it holds final fix the op's contributor set there (reduce_scatter:
                # only its own chunk is final; the rest stays the policy's choice)
                decided = decided or [None] * len(ledger.pieces)
                for p, (t, mk) in enumerate(zip(summ["need"], held[m])):
                    if decided[p] is None and int(t) == mk:
                        decided[p] = int(t)
    want = None
    if ledger.want is not None:
        want = [frozenset([ledger.members[w]]) & frozenset(ring) if w is not None else None for w in ledger.want]
    return plan_recovery(
        ledger.members, [m for m in ring if m in index], held,
        kind=ledger.piece_kind, want=want, owners=ledger.owners, policy=policy, has_input=has_input,
        decided=decided)


def execute_plan(ctx: OpContext, plan: RecoveryPlan) -> dict[str, float]:
    """See :func:`_execute`; on any failure the ledger is settled (exact) before it propagates."""
    try:
        return _execute(ctx, plan)
    except BaseException:
        ctx.settle()
        raise


def _execute(ctx: OpContext, plan: RecoveryPlan) -> dict[str, float]:
    """Carry out this member's part of ``plan``; the ledger is exact after every transfer.

    Pipelined like the ring: every receive of the plan is posted before the first wait;
    each receive of round ``r`` is reduced as soon as it arrived (overlapping
    the others still in flight), and a round-``r+1`` send of that piece leaves at once —
    in plan order per destination, because a connection matches frames to receives in
    posting order. A piece is never modified by this member while a send of it is in
    flight; data that must be reduced with this member's accumulator lands in pooled
    staging buffers, everything else straight in the region (see ``post_recvs``), and a
    receive in progress is in ``ctx.inflight``, so after an abort :meth:`OpContext.settle`
    leaves every mask describing ``out`` exactly.
    Failure behaviour: a transport error propagates (the caller re-plans from the ledger);
    nothing here blocks past the transport's abort. Returns seconds spent waiting for
    receives, for sends, and reducing (diagnostics for ``Communicator.last_recovery``)."""
    stats = {"wait_recv_s": 0.0, "wait_send_s": 0.0, "reduce_s": 0.0}
    L, tr, me = ctx.ledger, ctx.transport, ctx.ledger.members[ctx.ledger.me]
    for step in plan.prepare:
        if step.member != me:
            continue
        v = L.view(step.piece)
        if step.use_acc and L.masks[step.piece]:
            reduce_into(v, L.input_view(step.piece), ctx.op)
            L.set(step.piece, L.masks[step.piece] | 1 << L.me)
        else:
            v.copy_(L.input_view(step.piece))
            L.set(step.piece, 1 << L.me)
    rounds = plan.rounds
    if not rounds:
        return stats
    pool: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
    in_flight: dict[int, list[Request]] = {}  # piece -> its sends not yet known complete
    all_sends: list[Request] = []

    ops = L.ops
    on_host = ops.device.type == "cpu"
    kept: list[torch.Tensor] = []  # host copies of device pieces being sent (alive until the sends completed)

    def stage_for(v: torch.Tensor) -> torch.Tensor:
        free = pool.get((v.numel(), v.dtype))
        return free.pop() if free else ops.host_buffer(v.numel(), v.dtype)

    def land(v: torch.Tensor, stage: torch.Tensor, reduce: bool) -> None:
        """A received host buffer into device piece ``v`` (reduced into it when ``reduce``)."""
        if reduce:
            scratch = ops.empty(v.numel(), v.dtype)
            ops.from_host(scratch, stage).wait()
            reduce_into(v, scratch, ctx.op)
        else:
            ops.from_host(v, stage).wait()

    def post_recvs(r: int) -> list[_Recv]:
        """Round ``r``'s receives. A transfer that does not reduce into this member's
        accumulator (a final copy, or one that adds only this member's input) lands
        straight in the piece's region: nothing there is needed any more, and no send of
        it can still be in flight (a chain visits a member once, and a final copy can only
        arrive after every send that went into it completed). It is tracked in
        ``ctx.inflight`` so :meth:`OpContext.settle` keeps the mask exact after an abort.
        One that adds this member's accumulator lands in a pooled staging buffer."""
        out: list[_Recv] = []
        for t in rounds[r]:
            if t.dst != me:
                continue
            if t.add_acc or not on_host:
                stage = stage_for(L.view(t.piece))
                out.append((tr.irecv(t.src, stage, ctx.seq, tag(r, t.piece, SPACE), ctx.digest), stage, t, None))
            else:
                req = tr.irecv(t.src, L.buf(t.piece), ctx.seq, tag(r, t.piece, SPACE), ctx.digest)
                entry = (req, t.piece, t.sent)
                ctx.inflight.append(entry)
                out.append((req, None, t, entry))
        return out

    def post_send(r: int, t: Transfer) -> None:
        buf = L.buf(t.piece)
        if not on_host:
            buf = ops.host_buffer(L.view(t.piece).numel(), L.out.dtype)
            ops.to_host(buf, L.view(t.piece)).wait()
            kept.append(buf)
        req = tr.isend(t.dst, buf, ctx.seq, tag(r, t.piece, SPACE), ctx.digest)
        in_flight.setdefault(t.piece, []).append(req)
        all_sends.append(req)

    def my_sends(r: int) -> dict[str, list[Transfer]]:
        """Round ``r``'s sends of this member, per destination, in plan order."""
        out: dict[str, list[Transfer]] = {}
        for t in rounds[r] if r < len(rounds) else ():
            if t.src == me:
                out.setdefault(t.dst, []).append(t)
        return out

    # Every receive of the plan is posted up front, in (round, plan order) — the order in
    # which each peer sends to this member — so data that arrives early lands in place
    # (staging: at most one buffer per piece, a chain visits a member once).
    posted = [post_recvs(r) for r in range(len(rounds))]
    early = my_sends(0)  # this round's sends not yet posted (next round's, inside the loop)
    for r in range(len(rounds)):
        ctx.failpoint("recovery", r / len(rounds))
        for dst_queue in early.values():  # the rest of this round's sends, still in plan order
            for t in dst_queue:
                post_send(r, t)
        recvs = posted[r]
        early = my_sends(r + 1)
        pending: dict[int, int] = {}  # piece -> receives of this round still to reduce into it
        for _, _, t, _ in recvs:
            pending[t.piece] = pending.get(t.piece, 0) + 1
        for req, stage, t, entry in recvs:
            t0 = time.perf_counter()
            ctx.wait([req])
            t1 = time.perf_counter()
            sends = in_flight.pop(t.piece, None)
            if sends:
                ctx.wait(sends)  # the piece is about to change: its outgoing copies must be out
            t2 = time.perf_counter()
            v = L.view(t.piece)
            if stage is not None:
                if on_host:
                    reduce_into(v, stage, ctx.op)
                else:
                    land(v, stage, bool(t.add_acc))
                pool.setdefault((stage.numel(), stage.dtype), []).append(stage)
            if t.add_input:
                reduce_into(v, L.input_view(t.piece), ctx.op)
            L.set(t.piece, t.result_mask(L.me))
            if entry is not None:
                ctx.inflight.remove(entry)
            t3 = time.perf_counter()
            stats["wait_recv_s"] += t1 - t0
            stats["wait_send_s"] += t2 - t1
            stats["reduce_s"] += t3 - t2
            pending[t.piece] -= 1
            for dst, queue in early.items():  # next round's sends whose pieces are final for it
                while queue and not pending.get(queue[0].piece):
                    post_send(r + 1, queue.pop(0))
        # a round-r+1 send of a piece this round does not touch may still be queued behind
        # one that is: the loop at the top of the next round posts them in order
    t0 = time.perf_counter()
    ctx.wait(all_sends)
    stats["wait_send_s"] += time.perf_counter() - t0
    return stats
