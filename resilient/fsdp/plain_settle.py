"""Plain FSDP's step boundary: peer copy, commit, and the redo of a step a loss cut through.

Runs in a global optimizer step post-hook, inside the script's own ``optimizer.step()``
(:mod:`.patches`), on every member of a plain FSDP group (:mod:`.plain`):

1. **A vote**: each member judges whether the step must be redone — its reductions ran over
   different members, a reduce-scatter over every member lost one (the lost member's chunk
   exists nowhere), a reduction used the divide factors of another member count (members
   see a loss at different moments), or a member it hosts lacks a chunk.
2. **Copy and commit**: the orphans this member hosts step with their chunks; each member
   sends its packed shards and state, and its orphans', to its buddy, the next member
   present (:mod:`.peer_copy`), receives its predecessor's, and all commit with one SUM
   all-reduce of N + 1 int64: 1 where a member's copy arrived, and the redo votes. The step
   is committed when the all-reduce's contributors are the members present, every copy
   arrived and nobody voted to redo. The all-reduce's result is the same on every member,
   so all decide alike.
3. **Otherwise the step is redone**: every member puts its shards and optimizer state back
   to the last committed step, every reduction of the step is redone from its kept input as
   an all-reduce over the members present (FSDP's divide factors for that count: the
   pre-divide is undone and redone by powers of two, exactly), the script's optimizer steps
   again (this hook returns at once inside it), the orphans step from their committed
   state, and the copy and commit run again.

Failure behaviour: a loss before the first committed step, or of a member with its buddy
in one step, raises :class:`~resilient.errors.DataLost`; more than :data:`~.plain.MAX_ROUNDS` rounds raise
:class:`~resilient.errors.CollectiveError`. A reduction whose first try failed is redone.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import torch

from resilient.collectives import failpoints
from resilient.errors import CollectiveError, DataLost
from resilient.fsdp.peer_copy import Layout, exchange
from resilient.fsdp.plain import MAX_ROUNDS, PlainShards, Reduction

log = logging.getLogger(__name__)

__all__ = ["after_step"]


class _Changed(Exception):
    """The members present changed during a redo (the settle starts another round)."""

    def __init__(self, contributors: Sequence[str]) -> None:
        super().__init__(list(contributors))
        self.contributors = tuple(contributors)


def after_step(s: PlainShards, optimizer: Any) -> None:
    """Settle the step just taken (module docstring); a no-op for a reentrant call, a
    shadow optimizer, or an optimizer that holds none of the group's shards."""
    if s.in_settle or s.pg is None or s.disabled or getattr(optimizer, "_resilient_shadow", False):
        return
    mine = {id(fp.sharded_param) for fp in s.fsdp_params}
    if not any(id(p) in mine for g in optimizer.param_groups for p in g["params"]):
        return
    s.optimizer = optimizer
    s.in_settle = True
    try:
        _settle(s, optimizer)
    finally:
        s.in_settle = False


def _settle(s: PlainShards, optimizer: Any) -> None:
    with s._lock:
        reductions, s.reductions = s.reductions, []
    for r in reductions:
        try:
            r.work.wait()
        except CollectiveError as exc:
            log.warning("plain FSDP step %d: a reduction failed (%s); the step is redone", s.steps, exc)
    sets = [frozenset(_contributors(r)) for r in reductions]
    present = s.in_order(frozenset.intersection(*sets) if sets else s.committed_live)
    vote = _looks_dirty(s, reductions, sets, present)
    redo = False
    for _ in range(MAX_ROUNDS + 1):
        if redo:
            try:
                _redo(s, optimizer, reductions, present)
            except _Changed as changed:
                present = s.in_order(changed.contributors)
                continue
            redo, vote = False, False
        else:  # the orphans step before the copy: the host's copy carries them on
            _step_orphans(s, optimizer, reductions, present)
        committed, now, dirty = _copy_and_commit(s, present, vote)
        if committed and not dirty:
            for m in s.hosted(present):
                s.orphan(m).commit()
            s.steps += 1
            return
        present, redo = now, True
    raise CollectiveError(f"plain FSDP step {s.steps}: members kept being lost while the step was settled "
                          f"(present now {list(present)}); more than {MAX_ROUNDS} losses in one step")


def _looks_dirty(s: PlainShards, reductions: Sequence[Reduction], sets: Sequence[frozenset[str]],
                 present: Sequence[str]) -> bool:
    """This member's vote (the commit makes it everyone's): whether the step must be redone
    — its reductions ran over different members, a reduce-scatter over every member lost
    one (that member's chunk exists nowhere), a reduction's divide factors were those of
    another count (members saw the loss at different moments), or a hosted member's chunk
    is missing."""
    if len(set(sets)) > 1:
        return True
    hosted = s.hosted(present)
    for r, got in zip(reductions, sets):
        if getattr(r.work.handle, "delivered_first", False) and got != frozenset(s.members):
            return True
        if r.call.factors_for is not None and tuple(r.call.factors_for(len(got))[:2]) != (r.pre, r.post):
            return True
        if any(m not in r.orphan_chunks for m in hosted):
            return True
    return False


def _contributors(r: Reduction) -> tuple[str, ...]:
    try:
        return tuple(r.work.contributors)
    except Exception:  # noqa: BLE001 - a failed first try: redone in any case
        return ()


def _groups_of(s: PlainShards, optimizer: Any) -> list[int]:
    where = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    return [where.get(id(fp.sharded_param), 0) for fp in s.fsdp_params]


def _step_orphans(s: PlainShards, optimizer: Any, reductions: Sequence[Reduction], present: Sequence[str]) -> None:
    hosted = s.hosted(present)
    if not hosted:
        return
    s.check_hosts(present)
    groups = _groups_of(s, optimizer)
    for m in hosted:
        o = s.orphan(m)
        for r in reductions:
            raw = r.orphan_chunks.get(m)
            if raw is None:
                continue
            g = raw if r.post in (None, 1) else raw / r.post
            off = 0
            for i in r.call.indices:
                n = o.params[i].numel()
                o.grads[i] = g[off:off + n].clone()
                off += n
        o.step(optimizer, groups)


def _redo(s: PlainShards, optimizer: Any, reductions: Sequence[Reduction], present: Sequence[str]) -> None:
    """Back to the committed step, every reduction redone over ``present``, the step again."""
    from resilient.torch_backend.dtypes import for_reduce

    if s.own_copy is None or s.layout is None:
        raise DataLost(f"plain FSDP: a member was lost in step {s.steps}, before the first committed peer "
                       "copy; restore from a checkpoint")
    s.check_hosts(present)
    s.layout.restore(s.own_copy, s.fsdp_params, optimizer)
    hosted = s.hosted(present)
    for m in hosted:
        s.orphan(m).restore()
    for r in reductions:
        x = r.inp.detach().clone()
        new_pre, post = r.pre, r.post
        if r.call.factors_for is not None:  # FSDP's factors for the count present (powers of two: exact)
            new_pre, post = r.call.factors_for(len(present))[:2]
            if r.pre not in (None, 1):
                x.mul_(r.pre)
            if new_pre not in (None, 1):
                x.div_(new_pre)
        r.pre, r.post = new_pre, post
        wire, wop, wb = for_reduce(x, r.op, "reduce_scatter_tensor")
        h = s.pg.engine.allreduce(wire, wop)
        h.wait()
        if set(h.contributors) != set(present):
            raise _Changed(h.contributors)
        if wb is not None:
            wb()
        with torch.no_grad():
            r.output.view(-1).copy_(s.chunk(x, s.me))
            if post not in (None, 1):
                r.output.div_(post)
        r.orphan_chunks = {m: s.chunk(x, m).clone() for m in hosted}
    s.steps_redone += 1
    log.warning("plain FSDP step %d redone over %d members (lost: %s)", s.steps, len(present),
                [m for m in s.members if m not in present])
    optimizer.step()  # reentrant: after_step returns at once
    _step_orphans(s, optimizer, reductions, present)


def _copy_and_commit(s: PlainShards, present: Sequence[str], vote: bool) -> tuple[bool, tuple[str, ...], bool]:
    """Copy to the buddy and commit; returns (committed, the members present now, whether
    any member voted to redo the step)."""
    t0 = time.perf_counter()
    s.layout = layout = Layout.of(s.fsdp_params, s.optimizer, s.layout)
    payload = layout.pack(s.fsdp_params, s.optimizer, spare=s.spare_own,
                          orphans=[s.orphan(m) for m in s.hosted(present)])
    engine = s.pg.engine
    ok, received, pred, carried_in = True, None, None, []  # carried_in: the predecessor's orphans
    if len(present) > 1:
        i = present.index(s.me)
        buddy, pred = present[(i + 1) % len(present)], present[(i - 1) % len(present)]
        carried_in = s.hosted_by(pred, present)
        members = engine.world().members
        step = s.steps

        def at(frac: float) -> None:
            if failpoints.ACTIVE:
                failpoints.check(step, "peer_copy", frac)
        if buddy not in members or pred not in members:
            ok = False  # already gone: the commit below shows who is
        else:
            ok, received = exchange(engine, payload, members.index(buddy), members.index(pred),
                                    layout.nbytes * (1 + len(carried_in)), at, spare=s.spare_copy)
    flags = torch.zeros(s.logical_size + 1, dtype=torch.int64)  # a copy arrived, per member; redo votes
    flags[s.logical_rank] = 1 if ok else 0
    flags[-1] = 1 if vote else 0
    h = engine.allreduce(flags, "sum")
    h.wait()
    got = set(h.contributors)
    now = s.in_order(got)
    if got != set(present) or not all(int(flags[s.index[m]]) == 1 for m in present):
        log.warning("plain FSDP step %d not committed (members now %s); redoing it", s.steps, list(now))
        return False, now, True
    if int(flags[-1]) > 0:
        return True, now, True
    # the buffers of the step before become the spares (an orphan owns its own tensors)
    s.spare_own, s.own_copy = s.own_copy, payload
    s.spare_copy, s.copy_buf = s.copy_buf, received
    s.copies = {} if pred is None or received is None else layout.sections(received, [pred, *carried_in])
    s.carried.update({x: tuple(s.hosted_by(x, present)) for x in present})
    s.committed_live = tuple(present)
    s.copy_s.append(time.perf_counter() - t0)
    return True, now, False
