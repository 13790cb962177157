"""Hierarchical allreduce over host groups (issue 16), written against the ledger.

With ``H`` hosts of ``k`` members each (the op's members grouped by the planner's
``host_groups``; unequal sizes: below), one allreduce runs in three phases, each a
pipelined ring (:class:`~.ring.RingReduceScatterAllgather`) over a subgroup:

1. ``intra_rs``: reduce-scatter inside each host: local rank ``c`` ends with shard ``c``
   of the buffer reduced over its host;
2. ``cross_rs`` / ``cross_ag``: allreduce of shard ``c`` across hosts, between the ``H``
   members with local index ``c`` (a ring of ``H``: every host sends ``1/k`` of the
   buffer per member over its NIC, and the phase has ``2(H-1)`` steps);
3. ``intra_ag``: all-gather of the final shards inside each host.

Cross-host bytes per host: ``2(H-1)/H`` of the buffer in all (against ``2(n-1)/n`` of it
through *one* member's link for the flat host-ordered ring, whose cross-host edges carry
the whole ring's traffic); latency steps ``2(k-1) + 2(H-1)``.

Unequal hosts (4 + 3, or 3 + 2 after a death): the plan's ``host_slots``
(:mod:`resilient.coordinator.host_slots`, checked when the epoch is parsed) names, per
host, the local index owning each of ``K`` (the largest host's size) cross-host *slots*.
The buffer is cut into ``K`` shards; phase 1 on host ``h`` is a reduce-scatter over its
``k_h`` members whose ring chunk ``j`` is the union of the shards ``j`` owns; phase 2
runs, for each owned slot ``c`` in ascending order, the cross-host ring of slot ``c``'s
owners (a member owning two slots runs two rings, one after the other: every member
takes them in the same order, so two rings between one pair never cross); phase 3 is
the inverse all-gather. Equal hosts are the case ``K = k``, slot ``c`` = local index ``c``.

Weighted shards: ``weights`` (one per slot, the planner's ``shard_weights``) size
shard ``c`` in proportion to ``weights[c]``: slot ``c``'s cross-host ring then
carries a share of the bytes proportional to its link speed, so a slow link class does
not gate the op (every member reads the same epoch plan, so every member cuts the same
layout).

Ledger: the op's ledger keeps the usual pieces (shard ``c`` x host sub-shard ``h`` x
pipelining slice) and bit order = the op's members. Each phase runs the ring on a view of
the ledger (:class:`_PhaseLedger`) whose members are the phase's subgroup and whose mask
updates are translated to the op's bits: in phase 1 sub-bit ``j`` is host member ``j``;
in phase 2 sub-bit ``h`` is every member of host ``h`` (what member ``(h, c)`` holds
after phase 1); phase 3 only ever sets "final" (the op's full mask) or 0. Phase 2's ring
input is a copy of the member's phase-1 shard (the region itself is overwritten by
receives), the op's own input stays untouched in ``inp``. So at any abort the masks
describe ``out`` exactly and the ordinary recovery (:mod:`..resume`) finishes the op over
a reported contributor set, whichever level died (an intra-host member, a host leader,
a whole host).

Failure behaviour: a transport error in any phase settles that phase's in-flight
receives into the ledger and propagates; the communicator then recovers from the ledger.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from resilient.collectives import failpoints
from resilient.collectives.algorithms.base import Capabilities, OpContext, index_order
from resilient.collectives.algorithms.ring import RingReduceScatterAllgather
from resilient.collectives.group import EpochLike
from resilient.collectives.ledger import Ledger

#: failpoint phase names of the three levels
PHASES = ("intra_rs", "cross_rs", "cross_ag", "intra_ag")


@dataclass(frozen=True)
class Hosts:
    """The op's members by host and the cross-host slots: ``groups[h]`` (ring order),
    ``slots[h][c]`` the local index on host ``h`` owning slot ``c`` of ``K``. Equal hosts:
    ``K = k`` and slot ``c`` is local index ``c``; unequal hosts: the plan's ``host_slots``."""

    groups: list[list[str]]
    slots: list[list[int]]

    @property
    def K(self) -> int:
        return len(self.slots[0])

    def owned(self, h: int, j: int) -> list[int]:
        """The slots owned by local index ``j`` of host ``h``, ascending."""
        return [c for c, o in enumerate(self.slots[h]) if o == j]

    def ring(self, c: int) -> list[str]:
        """The cross-host ring of slot ``c``: its owner on every host, in host order."""
        return [g[own[c]] for g, own in zip(self.groups, self.slots)]


def hosts_of(members: Sequence[str], epoch: EpochLike) -> Hosts | None:
    """The op's ``members`` grouped by host from ``epoch.plan["host_groups"]`` (runs of
    ``(start, count)`` over ``epoch.members``), in ring order, with their slots; ``None``
    when the plan has no usable grouping (missing or malformed runs, a member of the op
    in no run, fewer than 2 hosts, demoted members; hosts of different sizes unless the
    plan's validated ``host_slots`` covers them, i.e. every host of the op is its whole
    run; equal hosts of one member): the caller then uses the flat ring.
    Deterministic: every member reads the same epoch."""
    runs = epoch.plan.host_groups
    ring = list(epoch.members)
    if not runs:
        return None
    if any(epoch.roles.get(m) == "demoted" for m in members):
        return None
    gid: dict[str, int] = {}
    for g, (start, count) in enumerate(runs):
        if start < 0 or count < 1 or start + count > len(ring):
            return None
        for m in ring[start:start + count]:
            gid[m] = g
    by_run: dict[int, list[str]] = {}
    for m in members:
        if m not in gid:
            return None
        by_run.setdefault(gid[m], []).append(m)
    used = sorted(by_run)
    out = [by_run[g] for g in used]
    sizes = {len(g) for g in out}
    if len(out) < 2:
        return None
    if len(sizes) == 1:
        k = sizes.pop()
        return Hosts(out, [list(range(k)) for _ in out]) if k >= 2 else None
    table = epoch.plan.host_slots
    if table is None or any(len(by_run[g]) != runs[g][1] for g in used):
        return None   # unequal hosts without slots for exactly these hosts: flat ring
    return Hosts(out, [list(table[g]) for g in used])


def host_groups_of(members: Sequence[str], epoch: EpochLike) -> list[list[str]] | None:
    """The host groups of :func:`hosts_of` (None where it gives None)."""
    hosts = hosts_of(members, epoch)
    return hosts.groups if hosts is not None else None


def shard_weights_of(epoch: EpochLike, k: int) -> list[float] | None:
    """The plan's ``shard_weights`` when it has ``k`` positive finite numbers, else None
    (uniform shards)."""
    w = epoch.plan.shard_weights
    return list(w) if w is not None and len(w) == k else None


def weighted_split(n: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """``len(weights)`` consecutive [start, end) ranges covering ``range(n)``, sized in
    proportion to ``weights`` (integer cut points from the cumulative sums: the same on
    every member for the same inputs)."""
    total = float(sum(weights))
    cuts, acc = [0], 0.0
    for w in weights[:-1]:
        acc += w
        cuts.append(min(n, max(cuts[-1], int(n * acc / total))))
    cuts.append(n)
    return list(zip(cuts[:-1], cuts[1:]))


@dataclass(frozen=True)
class Layout:
    """The piece layout of one hierarchical op: ``k`` shards (one per cross-host slot),
    ``pieces`` (element ranges, index ``(c * H + h) * S + j`` for shard ``c``, host
    sub-shard ``h``, slice ``j``)."""

    k: int
    H: int
    S: int
    pieces: list[tuple[int, int]]

    @classmethod
    def make(cls, numel: int, k: int, H: int, slices: int, weights: Sequence[float] | None) -> "Layout | None":
        """None when some piece would be empty (a buffer too small to split this way)."""
        from resilient.collectives.ledger import split

        shards = weighted_split(numel, weights) if weights else split(numel, k)
        smallest = min(e - s for s, e in shards)
        if smallest < H:
            return None
        S = max(1, min(slices, smallest // H))
        pieces = [(s0 + a + x, s0 + a + y)
                  for (s0, e0) in shards for (a, b) in split(e0 - s0, H) for (x, y) in split(b - a, S)]
        return cls(k, H, S, pieces)


class _PhaseLedger(Ledger):
    """The op's ledger as one phase's ring sees it: ``members`` = the phase's subgroup,
    ``pieces`` = a subset of the op's pieces (``index`` maps them back); every ``set`` is
    translated (``translate``: sub-mask -> op mask) and mirrored into the op's ledger."""

    outer: Ledger
    index: list[int]
    translate: Callable[[int], int]

    def set(self, p: int, mask: int) -> None:
        super().set(p, mask)
        self.outer.set(self.index[p], self.translate(mask))


@dataclass
class _PhaseContext(OpContext):
    """A phase's context: failpoints are named ``<level>_<rs|ag>`` (``intra_rs`` ...)."""

    level: str = ""

    def failpoint(self, phase: str, frac: float) -> None:
        if failpoints.ACTIVE:
            failpoints.check(self.seq, f"{self.level}_{phase}", frac, self.epoch)


class HierarchicalAllreduce:
    """See the module docstring. ``hosts``: the op's members by host (ring order inside
    each host) and their slots (:func:`hosts_of`); ``layout``: from :meth:`Layout.make`
    with ``k = hosts.K`` shards and ``H = len(hosts.groups)``."""

    capabilities = Capabilities()
    final_order = staticmethod(index_order)

    def __init__(self, hosts: Hosts, layout: Layout) -> None:
        self.hosts = hosts
        self.groups = hosts.groups
        self.layout = layout

    def run(self, ctx: OpContext) -> None:
        L = ctx.ledger
        H, S = self.layout.H, self.layout.S
        bit = {m: 1 << i for i, m in enumerate(L.members)}
        me = L.members[L.me]
        h = next(i for i, g in enumerate(self.groups) if me in g)
        host = self.groups[h]
        host_bits = [bit[m] for m in host]
        host_mask = [sum(bit[m] for m in g) for g in self.groups]
        everything = list(range(len(L.pieces)))
        shard = [list(range(c * H * S, (c + 1) * H * S)) for c in range(self.layout.k)]
        # ring chunk j on this host = the pieces of the shards local index j owns
        chunks = [[q for c in self.hosts.owned(h, j) for q in shard[c]] for j in range(len(host))]

        # 1. reduce-scatter inside the host: local index j ends with its owned shards over its host
        self._phase(ctx, "intra", host, everything, _translator(host_bits), L.inp, None,
                    RingReduceScatterAllgather(H * S, shift=1, do_ag=False, chunks=chunks))
        # 2. allreduce of each owned shard c across hosts, on the ring of slot c's owners
        #    (ascending c on every member: two rings between one pair run in the same order)
        for c in self.hosts.owned(h, host.index(me)):
            mine = shard[c]
            lo = L.pieces[mine[0]][0]
            stage = L.out[lo:L.pieces[mine[-1]][1]].clone()   # the ring's input: the host partial
            self._phase(ctx, "cross", self.hosts.ring(c), mine, _translator(host_mask), stage,
                        [L.pieces[q][0] - lo for q in mine], RingReduceScatterAllgather(S))
        # 3. all-gather of the final shards inside the host
        full = L.full
        self._phase(ctx, "intra", host, everything, lambda m: full if m else 0, L.inp, None,
                    RingReduceScatterAllgather(H * S, shift=1, do_rs=False, chunks=chunks))

    @staticmethod
    def _phase(ctx: OpContext, level: str, members: list[str], index: list[int], translate: Callable[[int], int],
               inp: Any, inp_offset: list[int] | None, ring: RingReduceScatterAllgather) -> None:
        L = ctx.ledger
        sub = _PhaseLedger(L.seq, L.kind, tuple(members), members.index(L.members[L.me]), L.epoch, L.digest, inp, L.out,
                           [L.pieces[q] for q in index], inp_offset=inp_offset,
                           masks=[0] * len(index), enabled=L.enabled)
        sub.outer, sub.index, sub.translate = L, index, translate
        sctx = _PhaseContext(ctx.transport, sub, ctx.op, ctx.op_timeout, ctx.on_suspect, ctx.epoch, level=level)
        try:
            ring.run(sctx)
        except BaseException:
            sctx.settle()   # in-flight receives -> exact masks, mirrored into the op's ledger
            raise


def select(members: Sequence[str], epoch: EpochLike, numel: int, elem_bytes: int,
           slices_for: Callable[[int], int]) -> "tuple[list[tuple[int, int]], HierarchicalAllreduce] | None":
    """The pieces and algorithm of a hierarchical allreduce over ``members`` in ``epoch``,
    or None when the epoch's plan does not group them into >= 2 hosts (:func:`hosts_of`:
    equal hosts of >= 2, or unequal ones with the plan's ``host_slots``) or the buffer is
    too small to cut. ``slices_for(bytes)``: pipelining slices for one cross-host
    sub-shard of that size (the communicator's ``_slices``)."""
    hosts = hosts_of(members, epoch)
    if hosts is None:
        return None
    K, H = hosts.K, len(hosts.groups)
    weights = shard_weights_of(epoch, K)
    layout = Layout.make(numel, K, H, slices_for(max(1, numel * elem_bytes // (K * H))), weights)
    if layout is None:
        return None
    return layout.pieces, HierarchicalAllreduce(hosts, layout)


# -- reduce_scatter / allgather: one output chunk per member ----------------------------------

@dataclass(frozen=True)
class ChunkLayout:
    """Pieces of a per-member op (chunk ``i`` of ``m`` elements belongs to member ``i``),
    ordered local index ``c``, host ``h``, slice ``j`` (the chunk of member ``(h, c)``);
    ``owner[p]``: the member index of piece ``p``'s chunk, ``offset[p]``: its start inside
    that chunk."""

    groups: list[list[str]]
    S: int
    pieces: list[tuple[int, int]]
    owner: list[int]
    offset: list[int]

    @classmethod
    def make(cls, members: Sequence[str], groups: Sequence[Sequence[str]], m: int, slices: int) -> "ChunkLayout":
        from resilient.collectives.ledger import split

        idx = {x: i for i, x in enumerate(members)}
        cuts = split(m, slices)
        pieces, owner, offset = [], [], []
        for c in range(len(groups[0])):
            for g in groups:
                i = idx[g[c]]
                for a, b in cuts:
                    pieces.append((i * m + a, i * m + b))
                    owner.append(i)
                    offset.append(a)
        return cls([list(g) for g in groups], slices, pieces, owner, offset)


class _PerMemberHierarchy:
    """Shared by :class:`HierarchicalReduceScatter` / :class:`HierarchicalAllgather`: the
    member's host, local index and the op's mask helpers."""

    capabilities = Capabilities()
    final_order = staticmethod(index_order)

    def __init__(self, layout: ChunkLayout) -> None:
        self.layout = layout

    def _where(self, L: Ledger) -> tuple[list[str], int, int, int]:
        groups = self.layout.groups
        me = L.members[L.me]
        h = next(i for i, g in enumerate(groups) if me in g)
        return groups[h], h, groups[h].index(me), len(groups) * self.layout.S


class HierarchicalReduceScatter(_PerMemberHierarchy):
    """reduce_scatter in two levels: (1) ``intra_rs``: inside each host, local rank ``c``
    collects the host's sum of the chunks of every host's local-``c`` member; (2)
    ``cross_rs``: those ``H`` members reduce-scatter them across hosts, each ending with
    its own chunk over everyone. Cross-host bytes per member ``(H-1)/H`` of its ``H``
    chunks instead of the flat ring's ``(n-1)`` chunks over the host edge. Masks
    translated as in :class:`HierarchicalAllreduce`, so recovery is the ordinary one."""

    def run(self, ctx: OpContext) -> None:
        L = ctx.ledger
        host, h, c, HS = self._where(L)
        bit = {m: 1 << i for i, m in enumerate(L.members)}
        host_mask = [sum(bit[m] for m in g) for g in self.layout.groups]
        _phase = HierarchicalAllreduce._phase
        _phase(ctx, "intra", host, list(range(len(L.pieces))), _translator([bit[m] for m in host]), L.inp, None,
               RingReduceScatterAllgather(HS, shift=1, do_ag=False))
        mine = list(range(c * HS, (c + 1) * HS))
        stage, offs = _gather(L, mine)
        _phase(ctx, "cross", [g[c] for g in self.layout.groups], mine, _translator(host_mask), stage, offs,
               RingReduceScatterAllgather(self.layout.S, shift=1, do_ag=False))


class HierarchicalAllgather(_PerMemberHierarchy):
    """allgather in two levels: (1) ``cross_ag``: the members with local index ``c``
    all-gather their chunks across hosts; (2) ``intra_ag``: inside each host, local rank
    ``c`` passes on the ``H`` chunks of index ``c``. Each member sends ``H-1`` chunks
    across hosts (the flat ring sends ``n-1`` over each host edge). Copy pieces: a
    received piece is final (the op's full mask), as in the flat ring."""

    def run(self, ctx: OpContext) -> None:
        L = ctx.ledger
        host, h, c, HS = self._where(L)
        full = L.full
        final = lambda mask: full if mask else 0   # noqa: E731
        _phase = HierarchicalAllreduce._phase
        mine = list(range(c * HS, (c + 1) * HS))
        offs = L.inp_offset
        assert offs is not None   # an allgather ledger carries its input offsets
        _phase(ctx, "cross", [g[c] for g in self.layout.groups], mine, final, L.inp, [offs[q] for q in mine],
               RingReduceScatterAllgather(self.layout.S, shift=1, do_rs=False))
        _phase(ctx, "intra", host, list(range(len(L.pieces))), final, L.inp, L.inp_offset,
               RingReduceScatterAllgather(HS, shift=1, do_rs=False))


def _translator(parts: list[int]) -> Callable[[int], int]:
    """Sub-mask -> op mask: sub-bit ``j`` stands for the op bits ``parts[j]``."""
    def tr(mask: int) -> int:
        out = 0
        for j, b in enumerate(parts):
            if mask >> j & 1:
                out |= b
        return out
    return tr


def _gather(L: Ledger, index: list[int]) -> tuple[Any, list[int]]:
    """A private copy of ``out`` over the pieces ``index`` (one after the other) and each
    piece's offset in it: a phase's ring input."""
    import torch

    stage = torch.cat([L.view(q) for q in index]) if index else L.out[:0].clone()
    offs, at = [], 0
    for q in index:
        offs.append(at)
        at += L.pieces[q][1] - L.pieces[q][0]
    return stage, offs


def select_per_member(kind: str, members: Sequence[str], epoch: EpochLike, m: int,
                      slices: int) -> "tuple[ChunkLayout, Any] | None":
    """Layout and algorithm of a hierarchical ``reduce_scatter`` / ``allgather`` with
    chunks of ``m`` elements, or None (no usable host grouping, see
    :func:`host_groups_of`; or chunks too small to slice)."""
    groups = host_groups_of(members, epoch)
    if groups is None or m < 1 or len({len(g) for g in groups}) != 1:
        return None   # unequal hosts: the chunks are the members' own outputs, one per member
    layout = ChunkLayout.make(members, groups, m, max(1, min(slices, m)))
    algo = HierarchicalReduceScatter(layout) if kind == "reduce_scatter" else HierarchicalAllgather(layout)
    return layout, algo
