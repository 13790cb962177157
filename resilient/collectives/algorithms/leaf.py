"""Leaf path for demoted members (stragglers), wrapped around the allreduce algorithm.

A member the coordinator demoted (``epoch.roles[m] == "demoted"``) stays out of the ring:
it sends its input to its tree parent (``members[plan["tree_parent"][i]]``, an active
member) and receives the final result from it. The ring (or recursive doubling for small
messages) runs over the *active* members only, so the straggler is off its per-step
critical path: it sends its input once instead of taking part in ``2(n-1)`` ring steps.

How the leaf's input gets everywhere without gating the ring (a slow member sends slowly,
so nothing may wait for its input before it has to):

* the ring over the active members starts at once on their own inputs;
* the leaf streams its input to its parent in sub-slices (``SUB_BYTES``); every leaf's
  stream is forwarded parent -> previous active -> ... around the active ring against
  the ring's direction (a pipelined chain on the links the ring leaves idle: every link
  carries it once), forwarding as data arrives, also while the ring runs (from the
  ledger's ``set`` hook, never blocking). Messages between two members match in posting
  order, so with 2 actives or recursive doubling (no idle direction) the chain runs
  after the inner algorithm instead;
* after the ring, each active adds every leaf's piece to the ring result (leaves in
  member order, so every member ends with identical bits) and the parent streams the
  final pieces to its leaves as they are done.

The op then costs about ``max(leaf's input at its own speed, ring + chain)`` plus a
short tail, instead of the slow member's speed on every one of ``2(n-1)`` ring steps.

Ledger: the op's ledger keeps bit order = the op's members (leaves included) and the
member's own input in ``inp``. The inner algorithm runs on a view of the ledger over the
active members whose mask updates are translated to the op's bits; a piece gets the
leaves' bits only when every leaf's data for it was added (between the piece's first addition and its mask update its mask is 0, "nothing usable", so an
abort never leaves a half-added piece described as anything). A leaf
holds nothing (mask 0) until all sub-slices of a result piece arrived (mask full). So at
any abort the masks describe ``out`` exactly and the recovery planner finishes the op from
them, whoever died: a leaf mid-stream (pieces with and without its bit exist; the planner
picks one contributor set), or a parent (its leaves still hold their inputs and take part
in recovery as survivors).

Failure behaviour: a transport error (peer died, epoch aborted the transport) propagates
after the inner ring's receives were settled into the ledger; the communicator then runs
recovery. Nothing here blocks past the transport's abort.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from resilient.collectives import tags
from resilient.collectives.algorithms.base import Algorithm, Capabilities, OpContext, index_order, tag
from resilient.collectives.algorithms.leaf_common import ActiveLedger, LeafRoute, items_of
from resilient.collectives.algorithms.leaf_deadline import run_deadline
from resilient.collectives.group import EpochLike
from resilient.coordinator.epoch import EpochPlan
from resilient.kernels import reduce_into

SPACE = tags.LEAF
__all__ = ["LeafPath", "LeafPlan", "deadline_of", "items_of", "leaf_assignment"]


def leaf_assignment(members: Sequence[str], ring: Sequence[str], roles: Mapping[str, str],
                    tree_parent: Sequence[Any]) -> dict[str, str]:
    """``{leaf: parent}`` for the demoted members among ``members`` (the op's members in
    ring order). ``ring``/``tree_parent``: the epoch's ring and ``plan["tree_parent"]``
    (indices into ``ring``). A leaf whose planned parent is not an active member of the op
    (it died, or the plan is malformed) gets ``actives[j % len(actives)]`` — deterministic,
    so every member computes the same map. ``{}`` when there is no leaf or no active
    member (then everyone stays in the ring)."""
    leaves = [m for m in members if roles.get(m) == "demoted"]
    actives = [m for m in members if roles.get(m) != "demoted"]
    if not leaves or not actives:
        return {}
    active_set = set(actives)
    pos = {m: i for i, m in enumerate(ring)}
    out: dict[str, str] = {}
    for j, m in enumerate(leaves):
        parent = None
        i = pos.get(m)
        if i is not None and i < len(tree_parent):
            try:
                k = int(tree_parent[i])
            except (TypeError, ValueError):
                k = -1
            if 0 <= k < len(ring) and ring[k] in active_set:
                parent = ring[k]
        out[m] = parent if parent is not None else actives[j % len(actives)]
    return out


class LeafPath(LeafRoute):
    """Runs ``inner`` (ring or recursive doubling, built for ``len(actives)`` members)
    over the active members' own inputs, and the leaf streams around it (see the module
    docstring)."""

    capabilities = Capabilities()
    final_order = staticmethod(index_order)

    def __init__(self, inner: Algorithm, leaves: Mapping[str, str], actives: Sequence[str],
                 deadline_s: float | None = None) -> None:
        super().__init__(inner, dict(leaves), list(actives), deadline_s)

    @classmethod
    def for_epoch(cls, members: Sequence[str], epoch: EpochLike) -> "LeafPlan | None":
        """The leaf plan for an op over ``members`` in ``epoch``, or None (no leaf). The
        epoch's ``plan.leaf_deadline_s`` (set by ``--straggler-policy deadline``)
        turns on the deadline mode (:mod:`.leaf_deadline`); every member reads the same
        epoch, so every member runs the same mode with the same value."""
        leaves = leaf_assignment(members, list(epoch.members), epoch.roles, epoch.plan.tree_parent)
        if not leaves:
            return None
        return LeafPlan(leaves, [m for m in members if m not in leaves], epoch.plan.leaf_deadline_s)

    def run(self, ctx: OpContext) -> None:
        L = ctx.ledger
        items = items_of(L.pieces, L.inp.element_size(), self.SUB_BYTES)
        if self.deadline_s is not None:
            run_deadline(self, ctx, items)
        elif L.members[L.me] in self.leaves:
            self._run_leaf(ctx, items)
        else:
            self._run_active(ctx, items)

    def _run_leaf(self, ctx: OpContext, items: list[tuple[int, int, int]]) -> None:
        L, tr = ctx.ledger, ctx.transport
        parent = self.leaves[L.members[L.me]]
        # Result sub-slices land straight in ``out``; a piece's mask turns full only when
        # all of them arrived (a partly received piece keeps mask 0: exact after an abort).
        results = [(q, tr.irecv(parent, L.out[s:e], ctx.seq, tag(1, k, SPACE), ctx.digest))
                   for k, (q, s, e) in enumerate(items)]
        if L.enabled:
            ctx.failpoint("leaf", 0.0)
        sends = [tr.isend(parent, L.inp[s:e], ctx.seq, tag(0, k, SPACE), ctx.digest)
                 for k, (q, s, e) in enumerate(items)]
        ctx.wait(sends)
        for i, (q, req) in enumerate(results):
            ctx.wait([req])
            if i + 1 == len(results) or results[i + 1][0] != q:
                L.set(q, L.full)

    def _run_active(self, ctx: OpContext, items: list[tuple[int, int, int]]) -> None:
        L, tr = ctx.ledger, ctx.transport
        me = L.members[L.me]
        index = {m: i for i, m in enumerate(L.members)}
        n_a = len(self.actives)
        ia = self.actives.index(me)
        # Messages between two members match in posting order, so the chain may share no
        # link with the inner algorithm while both run: with a ring of >= 3 it runs
        # against the ring's direction (links the ring leaves idle) *concurrently*;
        # otherwise (2 actives, recursive doubling) it runs after the inner algorithm.
        concurrent = self.inner.capabilities.forward_ring_only and n_a >= 3
        d = -1 if concurrent else 1
        nxt, prv = self.actives[(ia + d) % n_a], self.actives[(ia - d) % n_a]
        leaves = sorted(self.leaves, key=index.__getitem__)
        NL = len(leaves)
        mine = [l for l in leaves if self.leaves[l] == me]
        stage = {l: torch.empty_like(L.inp) for l in leaves}
        # Every leaf's input travels parent -> next -> ... around the actives (a chain),
        # in one canonical order per link: (item, leaf).
        entries: list[list[Any]] = []   # [item, leaf, request or None, forward?, hop]
        for k, (q, s, e) in enumerate(items):
            for l in leaves:
                hop = ((ia - self.actives.index(self.leaves[l])) * d) % n_a   # 0: the parent itself
                req = tr.irecv(l, stage[l][s:e], ctx.seq, tag(0, k, SPACE), ctx.digest) if hop == 0 else None
                entries.append([k, l, req, hop < n_a - 1, hop])

        def post_chain() -> None:
            for ent in entries:
                k, l, req, _fwd, hop = ent
                if req is None:
                    q, s, e = items[k]
                    ent[2] = tr.irecv(prv, stage[l][s:e], ctx.seq, tag(2, k * NL + leaves.index(l), SPACE), ctx.digest)

        sends: list[Any] = []
        cursor = [0]
        live = [concurrent]

        def pump() -> None:
            """Forward, in order, the leaf data that has arrived (never blocks)."""
            while live[0] and cursor[0] < len(entries) and entries[cursor[0]][2].done():
                k, l, _req, fwd, _hop = entries[cursor[0]]
                cursor[0] += 1
                if fwd:
                    q, s, e = items[k]
                    sends.append(tr.isend(nxt, stage[l][s:e], ctx.seq, tag(2, k * NL + leaves.index(l), SPACE),
                                          ctx.digest))

        if concurrent:
            post_chain()
        inner = ActiveLedger(L.seq, L.kind, tuple(self.actives), ia, L.epoch, L.digest, L.inp, L.out, L.pieces)
        inner.enabled = L.enabled
        inner.outer = L
        inner.bits = [1 << index[a] for a in self.actives]
        inner.pump = pump
        sub = OpContext(tr, inner, ctx.op, ctx.op_timeout, ctx.on_suspect, ctx.epoch)
        try:
            self.inner.run(sub)
        except BaseException:
            sub.settle()
            raise
        if not concurrent:
            post_chain()
            live[0] = True
        leaf_bits = sum(1 << index[l] for l in leaves)
        last_of = {q: k for k, (q, _s, _e) in enumerate(items)}
        i = 0
        for k, (q, s, e) in enumerate(items):
            # wait for every leaf's sub-slice k, forwarding as data comes ...
            while i < len(entries) and entries[i][0] <= k:
                ctx.wait([entries[i][2]])
                pump()
                i += 1
            # ... add it and stream the result on. While a piece is partly added its mask
            # says "nothing usable" (0), so an abort in between leaves the ledger exact.
            if k == 0 or items[k - 1][0] != q:
                done_mask = (L.masks[q] | leaf_bits) if L.enabled else 0
                L.set(q, 0)
            for l in leaves:
                reduce_into(L.out[s:e], stage[l][s:e], ctx.op)
            for l in mine:
                sends.append(tr.isend(l, L.out[s:e], ctx.seq, tag(1, k, SPACE), ctx.digest))
            if last_of[q] == k:
                L.set(q, done_mask)
        pump()
        ctx.wait(sends)


class LeafPlan:
    """Who is a leaf of whom for one op: ``ring_size`` = number of active members (what
    the inner algorithm and the piece layout are built for); :meth:`wrap` the inner
    algorithm."""

    def __init__(self, leaves: Mapping[str, str], actives: Sequence[str], deadline_s: float | None = None) -> None:
        self.leaves, self.actives, self.deadline_s = dict(leaves), list(actives), deadline_s

    @property
    def ring_size(self) -> int:
        return len(self.actives)

    def wrap(self, inner: Algorithm) -> LeafPath:
        return LeafPath(inner, self.leaves, self.actives, self.deadline_s)


def deadline_of(plan: Mapping[str, Any]) -> float | None:
    """The deadline mode's grace in seconds from an epoch plan's ``leaf_deadline_ms``
    (None: the plan carries none, or a value that is not a finite number >= 0 — the
    coordinator validates it, so a bad value here means a foreign writer; the lossless
    leaf path is the safe reading): :attr:`EpochPlan.leaf_deadline_s`."""
    return EpochPlan.of(plan).leaf_deadline_s
