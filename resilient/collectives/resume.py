"""Recovery execution: ledger-driven completion of an op after a membership change.

Protocol (every survivor, on first seeing an epoch that removed a member of its op — in
the middle of an op after the transport was aborted, or at the start of the next op):

1. configure the transport for the new epoch; publish a *status* under
   ``epochs/<n>/data/ledger/<me>``: JSON summaries of the in-flight op's ledger and of
   the last completed op (kept privately, with its final result);
2. wait for every survivor's status (``EpochChanged`` -> start again on the newer epoch,
   with the ledger as it is now: that is the recursion);
3. the op to finish is the smallest in-flight sequence number ``k`` among survivors
   (members are at most one op apart). Members already in ``k+1`` help with their
   retained result of ``k`` and then redo ``k+1`` from their inputs in the new epoch
   (nobody can have finished it). If no survivor holds any progress on ``k`` it is
   simply rerun in the new epoch;
4. everyone computes the same plan with :func:`~.recovery.plan_recovery` and executes
   it round by round (sends and receives of a round concurrently), updating the ledger
   after each transfer. A failure during execution goes back to 1.
"""
from __future__ import annotations

import torch

from resilient.collectives.algorithms.base import OpContext, tag
from resilient.collectives.ledger import Ledger
from resilient.collectives.recovery import PieceKind, Policy, RecoveryPlan, plan_recovery
from resilient.kernels import reduce_into

SPACE = 3


def build_plan(ledger: Ledger, ring: list[str], statuses: dict[str, dict], policy: Policy) -> RecoveryPlan:
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
        if summ is None or list(summ["members"]) != list(ledger.members) or summ["n_pieces"] != len(ledger.pieces):
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


def execute_plan(ctx: OpContext, plan: RecoveryPlan) -> None:
    """Carry out this member's part of ``plan``; the ledger is exact after every round."""
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
    for r, rnd in enumerate(plan.rounds):
        ctx.failpoint("recovery", r / max(1, len(plan.rounds)))
        sends, recvs = [], []
        for t in rnd:
            if t.src == me:
                sends.append(tr.isend(t.dst, L.view(t.piece), ctx.seq, tag(r, t.piece, SPACE), ctx.digest))
            if t.dst == me:
                stage = torch.empty_like(L.view(t.piece))
                recvs.append((tr.irecv(t.src, stage, ctx.seq, tag(r, t.piece, SPACE), ctx.digest), stage, t))
        ctx.wait(sends + [x[0] for x in recvs])
        for _, stage, t in recvs:
            v = L.view(t.piece)
            if t.add_acc:
                reduce_into(v, stage, ctx.op)
            else:
                v.copy_(stage)
            if t.add_input:
                reduce_into(v, L.input_view(t.piece), ctx.op)
            L.set(t.piece, t.result_mask(L.me))
