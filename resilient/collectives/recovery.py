"""The recovery planner: ledger summaries in, a deterministic completion plan out.

Pure logic (no I/O, no clock, no randomness): every survivor runs :func:`plan_recovery`
on the same inputs — the op's original members, the new epoch's ring, and every
survivor's ledger summary exchanged through ``epochs/<n>/`` — and gets the same plan, so
no further agreement round is needed. The executor (:mod:`resilient.collectives.resume`)
carries the plan out over the transport and updates the ledger after every transfer; if
another member dies meanwhile, the survivors publish their *updated* ledgers in the newer
epoch and plan again — that is the recursion of docs/design.md §3.

Model
-----
An op's data is cut into *pieces* (chunks, or the pipelining slices of chunks). For each
piece every member holds at most one accumulator, described by its *contributor mask*: a
bitmask over the op's original members (bit ``i`` = ``members[i]``). A surviving member
can always contribute its own input (bit of itself) on top of what it holds, because
inputs are kept until the op completes (out of place).

Each piece has a *need*: the mask a final copy must have.

* reductions (allreduce, reduce_scatter): the target set ``T`` of the policy —
  ``default``: one ``T`` for the whole op: the full original set when every piece has a
  full copy on some survivor (a failure in the all-gather phase, or a survivor that had
  already finished the op), else the survivors; ``per_segment``: the same choice made per
  piece; ``strict``: the full set or :class:`~resilient.errors.CollectiveAborted`.
* copies (broadcast, allgather): the owner's bit; a piece whose owner died and that no
  survivor holds raises :class:`~resilient.errors.DataLost` naming the owner.

For a reduction piece the planner picks the held accumulator with the largest mask inside
``T``; when several survivors tie (a *restarted* piece: the dead member's chunk, or one
whose partial sums all contain it) the piece is placed after all the others, at the
start whose hops load the busiest link least (balanced recovery: the restarted chunk is
split across the survivors so no link carries more than its share; ties of load rotate
with the piece index). It then *chains* it along the new ring: each next member adds the
largest disjoint part it can (its own accumulator if disjoint and inside ``T``, plus its
input if not yet counted); members with nothing to add are skipped. When the mask equals
``T`` the piece is final and is forwarded along the new ring to every survivor that needs
it and lacks it. Transfers are grouped in *rounds* (hop ``r`` of every piece in round
``r``), so in a round each member sends and receives concurrently.

Cost at n = 4 with one death halfway through a phase, in piece-transfers relative to a
from-scratch allreduce among the survivors: about 0.85 in reduce-scatter and 0.2 in
all-gather (see ``tests/test_recovery_planner.py``), against docs/design.md §3's 0.8 and 0.2.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from resilient.errors import CollectiveAborted, ConfigError, DataLost


class Policy(str, enum.Enum):
    """What a reduction delivers when a member's contribution is lost (docs/design.md §3)."""

    DEFAULT = "default"          #: one contributor set for the whole op
    PER_SEGMENT = "per_segment"  #: each piece reports its own set
    STRICT = "strict"            #: full set or CollectiveAborted

    @classmethod
    def parse(cls, value: "Policy | str") -> "Policy":
        if isinstance(value, Policy):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ConfigError(f"unknown policy {value!r}; expected one of {[p.value for p in cls]}") from None


class PieceKind(str, enum.Enum):
    REDUCE = "reduce"  #: final = reduction over a contributor set
    COPY = "copy"      #: final = one owner's data (broadcast / allgather)


def bit(i: int) -> int:
    return 1 << i


def mask_of(indices: Iterable[int]) -> int:
    m = 0
    for i in indices:
        m |= 1 << i
    return m


def members_of(mask: int, members: Sequence[str]) -> list[str]:
    """Member ids of ``mask``, in the op's original order."""
    return [m for i, m in enumerate(members) if mask >> i & 1]


@dataclass(frozen=True)
class Transfer:
    """One point-to-point transfer of one piece in one round.

    ``src`` sends its accumulator of ``piece`` (mask ``sent``). ``dst`` then holds
    ``sent | add`` where ``add`` is what it reduces in locally: ``add_acc`` — its own
    accumulator (mask) if that is used — and ``add_input`` — its own input. For a final
    forwarded copy ``add`` is 0 and ``dst`` stores the data as received."""

    round: int
    piece: int
    src: str
    dst: str
    sent: int
    add_acc: int = 0
    add_input: bool = False

    def result_mask(self, dst_index: int) -> int:
        """The mask ``dst`` holds after this transfer."""
        return self.sent | self.add_acc | (bit(dst_index) if self.add_input else 0)


@dataclass(frozen=True)
class LocalStep:
    """Before round 0, ``member`` starts piece ``piece``'s chain locally: with
    ``use_acc`` it reduces its own input into its accumulator, else its accumulator is
    replaced by a copy of its input (the old one contained a lost member)."""

    piece: int
    member: str
    use_acc: bool = True


@dataclass
class RecoveryPlan:
    """The output of :func:`plan_recovery`.

    ``need[p]``: the mask piece ``p`` ends with (its reported contributor set);
    ``rounds[r]``: the transfers of round ``r``; ``prepare``: local input additions done
    before round 0; ``final_holders[p]``: survivors that hold piece ``p`` final at the end
    (every survivor in ``want`` of that piece is among them)."""

    need: list[int]
    rounds: list[list[Transfer]] = field(default_factory=list)
    prepare: list[LocalStep] = field(default_factory=list)
    final_holders: list[frozenset[str]] = field(default_factory=list)
    #: the whole plan's transfer count where ``rounds`` hold one survivor's slice only
    #: (:meth:`~.recovery_decision.Decision.plan_for`); None: ``rounds`` are the whole plan
    total_transfers: int | None = None

    def transfers(self) -> list[Transfer]:
        return [t for r in self.rounds for t in r]

    def transfer_count(self) -> int:
        """Transfers in the whole plan (also for a survivor's slice)."""
        return len(self.transfers()) if self.total_transfers is None else self.total_transfers

    def for_member(self, member: str) -> list[list[Transfer]]:
        """Per round, the transfers ``member`` takes part in (as src or dst)."""
        return [[t for t in r if member in (t.src, t.dst)] for r in self.rounds]

    @property
    def contributors(self) -> int:
        """The op's contributor mask when every piece has the same one (default and strict
        policies); raises ``ValueError`` under ``per_segment`` when they differ."""
        needs = set(self.need)
        if len(needs) > 1:
            raise ValueError("pieces have different contributor sets (per_segment policy)")
        return needs.pop() if needs else 0


def plan_recovery(
    members: Sequence[str],
    ring: Sequence[str],
    held: Mapping[str, Sequence[int]],
    *,
    kind: PieceKind = PieceKind.REDUCE,
    want: Sequence[frozenset[str] | None] | None = None,
    owners: Sequence[int] | None = None,
    policy: Policy | str = Policy.DEFAULT,
    has_input: Mapping[str, bool] | None = None,
    decided: Sequence[int | None] | None = None,
) -> RecoveryPlan:
    """Plan how the survivors finish an op.

    ``members``: the op's original members (mask bit order). ``ring``: the survivors in the
    new epoch's ring order (joiners that are not among ``members`` must not be passed).
    ``held[m][p]``: mask of the accumulator member ``m`` holds for piece ``p`` (0: none).
    ``want[p]``: survivors that must end with piece ``p`` (``None``: all of ``ring``; for
    reduce_scatter, the piece's owner). ``owners[p]`` (copies only): index in ``members``
    of the piece's owner. ``has_input[m]``: whether ``m`` still has its input (False for a
    member that had finished the op and kept only the result; default True).
    ``decided[p]``: the mask piece ``p`` was completed with by a survivor that already
    finished the op and holds it final (its retained result; ``None``: no such survivor);
    it overrides the policy's choice for that piece, so every
    member reports the same contributor set (a member still recovering after a second
    failure receives the finished copy instead of reducing over whoever is left).

    Raises :class:`CollectiveAborted` under ``strict`` when the full set is impossible,
    :class:`DataLost` when a copy piece exists nowhere, ``ValueError`` on inconsistent
    arguments (a caller bug).
    """
    policy = Policy.parse(policy)
    index = {m: i for i, m in enumerate(members)}
    if not ring:
        raise ValueError("plan_recovery: no survivors")
    for m in ring:
        if m not in index:
            raise ValueError(f"plan_recovery: survivor {m!r} is not a member of the op")
        if m not in held:
            raise ValueError(f"plan_recovery: no ledger summary from survivor {m!r}")
    n_pieces = len(held[ring[0]])
    if any(len(held[m]) != n_pieces for m in ring):
        raise ValueError("plan_recovery: ledger summaries disagree on the number of pieces")
    inputs = {m: (True if has_input is None else has_input.get(m, True)) for m in ring}
    wants: list[frozenset[str]] = []
    for p in range(n_pieces):
        w = None if want is None else want[p]
        wants.append(frozenset(ring) if w is None else w)
    full = mask_of(range(len(members)))
    survivors = mask_of(index[m] for m in ring if inputs[m])

    # 1. what each piece must end with
    if kind is PieceKind.COPY:
        if owners is None or len(owners) != n_pieces:
            raise ValueError("plan_recovery: copy pieces need one owner each")
        need = [bit(o) for o in owners]
        for p, o in enumerate(owners):
            if not any(held[m][p] & need[p] for m in ring):
                raise DataLost(
                    f"piece {p} of this op exists only on member {members[o]!r}, which was lost; "
                    "no survivor holds a copy"
                )
    else:
        if decided is not None and len(decided) != n_pieces:
            raise ValueError("plan_recovery: decided masks disagree with the number of pieces")
        fixed: list[int | None] = [None] * n_pieces if decided is None else list(decided)
        open_ = [p for p in range(n_pieces) if fixed[p] is None]
        has_full = {p: any(held[m][p] == full for m in ring) for p in open_}
        if policy is Policy.PER_SEGMENT:
            need = [full if has_full[p] else survivors for p in open_]
        else:
            t = full if all(has_full.values()) else survivors
            need = [t] * len(open_)
        chosen = dict(zip(open_, need))
        need = [chosen[p] if (f := fixed[p]) is None else f for p in range(n_pieces)]
        if policy is Policy.STRICT and any(t != full for t in need):
            lost = members_of(full & ~next(t for t in need if t != full), members)
            raise CollectiveAborted(
                f"strict policy: the op cannot include every member; lost contributions of {lost}"
            )

    plan = RecoveryPlan(need=need, final_holders=[frozenset()] * n_pieces)
    pos = {m: i for i, m in enumerate(ring)}
    hops_by_piece: list[list[Transfer]] = [[] for _ in range(n_pieces)]
    load = _Load()
    open_starts: list[tuple[int, list[str]]] = []  # reduction pieces with a choice of start

    cache: dict[tuple[tuple[int, ...], int, frozenset[str], str | None], tuple[list[Transfer], list[LocalStep], set[str]]] = {}

    def option(p: int, start: str | None) -> tuple[list[Transfer], list[LocalStep], set[str]]:
        """Piece ``p``'s hops, local steps and final holders when its chain starts at
        ``start`` (``None``: it is final somewhere already, forward only). Pieces in the
        same state (the slices of one chunk, mostly) share one computed template; its
        ``piece`` fields are those of the first such piece (see :func:`_as_piece`)."""
        key = (tuple(held[m][p] for m in ring), need[p], wants[p], start)
        tpl = cache.get(key)
        if tpl is None:
            tpl = cache[key] = _option(p, start)
        return tpl

    def _option(p: int, start: str | None) -> tuple[list[Transfer], list[LocalStep], set[str]]:
        t = need[p]
        hops: list[Transfer] = []
        prep: list[LocalStep] = []
        finals = [m for m in ring if held[m][p] == t]
        if start is not None:
            finals = [_chain(p, t, start, ring, pos, index, held, inputs, prep, hops)]
        elif not finals:  # copy piece: any holder of the owner's data
            finals = [m for m in ring if held[m][p] & t]
        have = _forward(p, t, ring, pos, set(finals), wants[p], base=len(hops), hops=hops)
        return hops, prep, have

    def commit(p: int, opt: tuple[list[Transfer], list[LocalStep], set[str]]) -> None:
        hops, prep, have = _as_piece(p, opt)
        hops_by_piece[p] = hops
        plan.prepare.extend(prep)
        plan.final_holders[p] = frozenset(have)
        load.add(hops)

    def aborted(p: int) -> CollectiveAborted:
        return CollectiveAborted(
            f"piece {p}: other members already finished this op over {members_of(need[p], members)}, but no "
            "survivor holds that result or the contributions to rebuild it; the op cannot be completed "
            "consistently")

    # 2. pieces with one way to finish first (already final somewhere, or a unique best
    # accumulator), then the pieces whose chain may start at several survivors (restarted
    # pieces): each at the start that loads the busiest link (then round-link, member) least, so a
    # restarted chunk is split across the survivors instead of piling on one link
    for p in range(n_pieces):
        start = None
        if kind is PieceKind.REDUCE and not any(held[m][p] == need[p] for m in ring):
            try:
                starts = _chain_starts(p, need[p], ring, pos, index, held, inputs)
            except AssertionError:
                if decided is None:
                    raise
                raise aborted(p) from None
            if len(starts) > 1:
                open_starts.append((p, starts))
                continue
            start = starts[0]
        try:
            commit(p, option(p, start))
        except AssertionError:
            if decided is None:
                raise
            raise aborted(p) from None
    for p, starts in open_starts:
        try:
            opts = [option(p, s) for s in _spread(starts, p)]
        except AssertionError:
            if decided is None:
                raise
            raise aborted(p) from None
        best = min(range(len(opts)), key=lambda i: (load.cost(opts[i][0]), i))
        commit(p, opts[best])

    n_rounds = max((h.round + 1 for hops in hops_by_piece for h in hops), default=0)
    plan.rounds = [[] for _ in range(n_rounds)]
    for hops in hops_by_piece:
        for h in hops:
            plan.rounds[h.round].append(h)
    for r in plan.rounds:
        r.sort(key=lambda h: (h.piece, pos[h.src]))
    return plan


def _as_piece(p: int, opt: tuple[list[Transfer], list[LocalStep], set[str]]
              ) -> tuple[list[Transfer], list[LocalStep], set[str]]:
    """A cached option template for piece ``p`` (its transfers and steps renumbered)."""
    hops, prep, have = opt
    if any(h.piece != p for h in hops) or any(s.piece != p for s in prep):
        hops = [Transfer(h.round, p, h.src, h.dst, h.sent, h.add_acc, h.add_input) for h in hops]
        prep = [LocalStep(p, s.member, s.use_acc) for s in prep]
    return hops, prep, have


def _start_mask(p: int, t: int, m: str, index: Mapping[str, int], held: Mapping[str, Sequence[int]],
                inputs: Mapping[str, bool]) -> int:
    """What ``m`` can start piece ``p``'s reduction to ``t`` with: its accumulator if it
    lies inside ``t``, plus its own input if that is in ``t`` and not counted yet (an
    unusable accumulator, one that contains a lost member, is replaced by the input)."""
    acc = held[m][p]
    usable = acc if acc and acc & ~t == 0 else 0
    if inputs[m] and t >> index[m] & 1 and not usable >> index[m] & 1:
        usable |= bit(index[m])
    return usable


def _chain_starts(p: int, t: int, ring: Sequence[str], pos: Mapping[str, int], index: Mapping[str, int],
                  held: Mapping[str, Sequence[int]], inputs: Mapping[str, bool]) -> list[str]:
    """The survivors that can start piece ``p``'s chain with the largest mask, in ring
    order rotated by the piece index (the first is the default start)."""
    scored = [(_start_mask(p, t, m, index, held, inputs).bit_count(), m) for m in ring]
    best = max(c for c, _ in scored)
    if best == 0:  # cannot happen: t contains at least one survivor with its input
        raise AssertionError(f"piece {p}: no survivor can start the reduction of {t:#x}")
    ties = sorted((m for c, m in scored if c == best), key=pos.__getitem__)
    k = p % len(ties)
    return ties[k:] + ties[:k]


#: at most this many starts are costed per restarted piece (spread over the ring), so
#: planning stays linear in the number of pieces at large worlds
MAX_STARTS = 8


def _spread(starts: list[str], p: int) -> list[str]:
    """Up to :data:`MAX_STARTS` of ``starts``, evenly spaced, the default start first."""
    if len(starts) <= MAX_STARTS:
        return starts
    return [starts[j * len(starts) // MAX_STARTS] for j in range(MAX_STARTS)]


class _Load:
    """Transfers planned so far, per link (a directed member pair: its bandwidth), per
    member (sends + receives: its CPU work) and per (round, link): what :meth:`cost`
    balances."""

    def __init__(self) -> None:
        self.link: dict[tuple[str, str], int] = {}
        self.member: dict[str, int] = {}
        self.rlink: dict[tuple[int, str, str], int] = {}

    def add(self, hops: Sequence[Transfer]) -> None:
        for h in hops:
            self.link[h.src, h.dst] = self.link.get((h.src, h.dst), 0) + 1
            self.member[h.src] = self.member.get(h.src, 0) + 1
            self.member[h.dst] = self.member.get(h.dst, 0) + 1
            self.rlink[h.round, h.src, h.dst] = self.rlink.get((h.round, h.src, h.dst), 0) + 1

    def cost(self, hops: Sequence[Transfer]) -> tuple[int, int, int]:
        """(busiest link, busiest link in one round, busiest member) if ``hops`` were added."""
        link: dict[tuple[str, str], int] = {}
        member: dict[str, int] = {}
        rlink: dict[tuple[int, str, str], int] = {}
        for h in hops:
            k = (h.src, h.dst)
            link[k] = link.get(k, self.link.get(k, 0)) + 1
            member[h.src] = member.get(h.src, self.member.get(h.src, 0)) + 1
            member[h.dst] = member.get(h.dst, self.member.get(h.dst, 0)) + 1
            r = (h.round, h.src, h.dst)
            rlink[r] = rlink.get(r, self.rlink.get(r, 0)) + 1
        return (max(link.values(), default=0), max(rlink.values(), default=0),
                max(member.values(), default=0))


def _chain(p: int, t: int, start: str, ring: Sequence[str], pos: Mapping[str, int], index: Mapping[str, int],
           held: Mapping[str, Sequence[int]], inputs: Mapping[str, bool], prepare: list[LocalStep],
           hops: list[Transfer]) -> str:
    """Reduce piece ``p`` up to mask ``t`` along the ring from ``start``; returns the final holder."""
    cur = _start_mask(p, t, start, index, held, inputs)
    acc = held[start][p]
    if cur != acc:
        usable = bool(acc) and acc & ~t == 0
        prepare.append(LocalStep(piece=p, member=start, use_acc=usable))
    holder, k = start, pos[start]
    for step in range(1, len(ring)):
        if cur == t:
            break
        y = ring[(k + step) % len(ring)]
        acc = held[y][p]
        add_acc = acc if acc and acc & cur == 0 and acc & ~t == 0 else 0
        add_input = inputs[y] and t >> index[y] & 1 and not (cur | add_acc) >> index[y] & 1
        if not add_acc and not add_input:
            continue
        hops.append(Transfer(round=len(hops), piece=p, src=holder, dst=y, sent=cur,
                             add_acc=add_acc, add_input=bool(add_input)))
        cur |= add_acc | (bit(index[y]) if add_input else 0)
        holder = y
    if cur != t:  # cannot happen: every member of t is a survivor with its input
        raise AssertionError(f"recovery plan for piece {p} ended at {cur:#x}, need {t:#x}")
    return holder


def _forward(p: int, t: int, ring: Sequence[str], pos: Mapping[str, int], have: set[str],
             want: frozenset[str], base: int, hops: list[Transfer]) -> set[str]:
    """Forward the final piece from its holders along the ring: on each arc between two
    holders, the members up to the last one that wants it receive it in turn (relays on
    the way included). Returns every holder at the end."""
    n = len(ring)
    received: set[str] = set()
    for h in sorted(have, key=pos.__getitem__):
        arc = []
        for step in range(1, n):
            y = ring[(pos[h] + step) % n]
            if y in have:
                break
            arc.append(y)
        last = max((i for i, y in enumerate(arc) if y in want), default=-1)
        src = h
        for i in range(last + 1):
            hops.append(Transfer(round=base + i, piece=p, src=src, dst=arc[i], sent=t))
            received.add(arc[i])
            src = arc[i]
    return have | received


def simulate(plan: RecoveryPlan, members: Sequence[str], held: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
    """Apply ``plan`` to the masks in ``held`` and return the masks every survivor ends
    with. Used by tests and by the chaos verifier to check a plan's contributor sets;
    raises ``AssertionError`` when a transfer sends something its source does not hold."""
    index = {m: i for i, m in enumerate(members)}
    state = {m: list(v) for m, v in held.items()}
    for s in plan.prepare:
        before = state[s.member][s.piece] if s.use_acc else 0
        state[s.member][s.piece] = before | bit(index[s.member])
    for rnd in plan.rounds:
        sent = [(t, state[t.src][t.piece]) for t in rnd]
        for t, have in sent:
            assert have == t.sent, f"{t}: source holds {have:#x}, plan sends {t.sent:#x}"
            if t.add_acc:
                assert state[t.dst][t.piece] == t.add_acc, f"{t}: destination holds {state[t.dst][t.piece]:#x}"
        for t, _ in sent:
            state[t.dst][t.piece] = t.result_mask(index[t.dst])
    return state
