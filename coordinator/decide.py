"""The coordinator's decision: from what one pass read to what it should publish.

:func:`decide` is pure — no I/O, no clock (``now`` is in the :class:`Snapshot`), no
randomness — so every rule of a pass is testable without etcd: who is removed and added
(a member that restarted under the same id counts as both), the join debounce (joins
alone wait for ``joins_due``), re-admissions held back from an epoch that also removes
members, evictions, the repair of a malformed ``epoch`` record, the measured link speeds
the plan uses (:func:`.link_classes.settle_speeds`: hysteresis against the speeds the
current epoch was planned with, so measurement noise publishes nothing), and the cause
and trigger of the epoch (what ``resilient status`` and the detection-latency metric show). The
service (:mod:`.service`) reads the snapshot, confirms suspects, asks the health policy
(:mod:`.policy`) and then writes what the :class:`Decision` says.

Cost: proportional to the members changed since the last pass (``Snapshot.dirty``), except
on a full pass, which compares the whole directory with the epoch. ``Snapshot.alive`` may
be the coordinator's live directory on a partial pass: it is only looked up then, never
iterated or copied (a snapshot with ``measured_speeds`` must hold a copy: the speeds'
coverage is checked over every live member).

Failure behaviour: none of its own; it trusts the snapshot (every record in it was
validated when read) and never raises on well-typed input.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from resilient.coordinator.link_classes import SPEED_BAND, declared_speeds, settle_speeds
from resilient.coordinator.membership import MemberInfo
from resilient.coordinator.policy import EvictionEntry

#: a directory entry: the member's info and its lease id
Entry = tuple[MemberInfo, int]
#: what a pass does: nothing, nothing yet (joins wait for their debounce), or publish
Outcome = Literal["unchanged", "joins_deferred", "publish"]


class Gauges(NamedTuple):
    """Member counts for the ``resilient_members{state}`` gauges: live, joining, demoted."""

    alive: int = 0
    joining: int = 0
    demoted: int = 0


@dataclass(frozen=True)
class EpochFacts:
    """What a pass compares against: the current epoch's ``number``, ``members``,
    ``demoted`` members, ``infos``, avoided links (``avoid``, sorted [a, b] pairs) and
    ``evicted`` member ids (its ``plan["evicted"]``), the measured ``link_speeds`` it was
    planned with (its ``plan["link_bps"]``). References, not copies."""

    number: int
    members: Set[str]
    demoted: Set[str]
    infos: Mapping[str, MemberInfo]
    avoid: Sequence[Sequence[str]] = ()
    evicted: Collection[str] = ()
    link_speeds: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class HealthOutcome:
    """The health policy's answer for this pass, filtered to live members: ``demoted``
    ids, links to ``avoid`` (sorted [a, b] pairs), the policy's current evictions, the
    members it ``readmitted`` and its ``leaf_deadline_ms`` (None: lossless leaves)."""

    demoted: Set[str] = frozenset()
    avoid: Sequence[Sequence[str]] = ()
    evicted: Mapping[str, EvictionEntry] = field(default_factory=dict)
    readmitted: Set[str] = frozenset()
    leaf_deadline_ms: float | None = None


@dataclass(frozen=True)
class Snapshot:
    """Everything one pass read. ``published``: the current epoch (None before the
    first, or when the record is malformed and no valid history is left); ``corrupt``:
    the ``epoch`` key holds a malformed record (``epoch_revision`` its mod revision,
    ``history_top`` the highest ``epochs/<n>/`` number); ``full``: compare the whole
    directory (else only ``dirty`` ids and those the policy may have changed);
    ``alive``: directory entries less the confirmed suspects; ``confirmed``: suspect ->
    earliest report (wall s); ``departed``: member or node id -> (marker key, wall time
    of the revoke); ``node_of``: member -> its node record's id; ``bad_markers`` and
    ``consumed`` (suspect reports): keys to delete; ``lost_seen``/``join_seen``: member
    -> wall time the watch saw it go/come; ``joins_due``: the join debounce ran out;
    ``min_members``: needed before the first epoch; ``now``: wall time of the pass;
    ``measured_speeds``: member -> cross-host bytes/s from the health windows
    (:func:`.link_classes.speeds_from_health`; None: not measured, the plan uses declared
    labels only), settled with hysteresis ``speed_band``; ``admitting``: the members the
    published epoch added whose admission has no agreed op seq in etcd yet (an epoch that
    removes someone leaves them out: docs/recovery.md)."""

    published: EpochFacts | None
    alive: Mapping[str, Entry]
    full: bool = True
    dirty: Set[str] = frozenset()
    corrupt: bool = False
    epoch_revision: int = 0
    history_top: int = 0
    confirmed: Mapping[str, float] = field(default_factory=dict)
    departed: Mapping[str, tuple[str, float]] = field(default_factory=dict)
    node_of: Mapping[str, str] = field(default_factory=dict)
    bad_markers: Sequence[str] = ()
    consumed: Sequence[str] = ()
    health: HealthOutcome = HealthOutcome()
    lost_seen: Mapping[str, float] = field(default_factory=dict)
    join_seen: Mapping[str, float] = field(default_factory=dict)
    joins_due: bool = True
    min_members: int = 1
    now: float = 0.0
    measured_speeds: Mapping[str, float] | None = None
    speed_band: float = SPEED_BAND
    admitting: Set[str] = frozenset()


@dataclass(frozen=True)
class Decision:
    """What to write. ``outcome`` ``publish``: epoch ``number`` of ``members`` (the
    directory entries in it), ``demoted`` ones as leaves, ``avoid`` links, ``removed`` /
    ``added`` ids, ``cause``, detection ``path`` (metric label; None: not a detection),
    ``trigger`` (wall time of the event), plan ``extras``, the measured ``link_speeds``
    to plan with (also in ``extras["link_bps"]``); ``held_back``: members left
    out this time that must stay due (a re-admission waits for the next epoch).
    ``cleanup``: keys to delete whatever the outcome (stale ``departed/`` markers,
    malformed ones, consumed suspect reports). ``gauges``: member counts before the
    hold-back."""

    outcome: Outcome
    cleanup: tuple[str, ...] = ()
    number: int = 0
    members: Mapping[str, Entry] = field(default_factory=dict)
    demoted: Set[str] = frozenset()
    avoid: Sequence[Sequence[str]] = ()
    removed: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    cause: str = ""
    path: str | None = None
    trigger: float = 0.0
    extras: dict[str, object] = field(default_factory=dict)
    held_back: Set[str] = frozenset()
    gauges: Gauges = Gauges()
    link_speeds: Mapping[str, float] = field(default_factory=dict)


def repair_number(history_top: int, corrupt_revision: int) -> int:
    """The number of the epoch published over a malformed ``epoch`` record.

    It must exceed every number a rank may have adopted. Ranks adopt only epochs
    the coordinator published, and every publish writes ``epochs/<n>/epoch`` in the
    same transaction (the newest :data:`~.keys.EPOCHS_KEPT` are kept), so the
    highest ``n`` under ``epochs/`` plus one is safe — taken from the key names, so
    a history record that is itself corrupt still counts — and keeps the numbers
    consecutive. Why not always the revision floor below: it would make the numbers
    jump on every repair and leave the older history keys behind (only epoch
    ``n - EPOCHS_KEPT`` is deleted when ``n`` is published). If the history is
    gone, the floor is the corrupt record's mod revision: each publish was its own
    etcd transaction, so every number published before (epoch n was written at a
    revision > n) is below it; the jump is harmless (ranks only need the numbers
    to increase)."""
    if history_top > 0:
        return history_top + 1
    return max(1, corrupt_revision)


def classify(s: Snapshot, removed: tuple[str, ...], added: tuple[str, ...],
             evicted: Collection[str]) -> tuple[str, str | None, float]:
    """(cause, detection path, trigger wall time) of an epoch that removes ``removed``
    and adds ``added``, first match wins: a confirmed suspect; a revoke (a ``departed/``
    marker of the member or its node); an eviction; a lease expiry; a re-admission; a
    join (``initial`` for the first epoch); a repair; else a health change (roles,
    avoided links or link speeds only)."""
    now, pub = s.now, s.published
    lost_by_revoke = [d for d in (departed_at(s, m) for m in removed) if d]
    if s.confirmed.keys() & set(removed):
        return "suspect_confirmed", "suspect", min(s.confirmed[m] for m in removed if m in s.confirmed)
    if removed and lost_by_revoke:
        return "member_lost", "revoke", min(d[1] for d in lost_by_revoke)
    if removed and set(removed) <= set(evicted):
        return "evicted", None, now
    if removed:
        return "lease_expired", "lease_expiry", min(s.lost_seen.get(m, now) for m in removed)
    if added and pub is not None and set(added) <= s.health.readmitted:
        return "readmitted", None, now
    if added and not s.corrupt:
        return ("initial" if pub is None else "joined"), "join", min(s.join_seen.get(m, now) for m in added)
    if s.corrupt:
        return "repaired", None, now
    return "health", None, now


def departed_at(s: Snapshot, member: str) -> tuple[str, float] | None:
    """The ``departed/`` marker (key, wall time) of ``member`` or of its node, if any."""
    got = s.departed.get(member)
    if got is None and member in s.node_of:
        got = s.departed.get(s.node_of[member])
    return got


def decide(s: Snapshot) -> Decision:
    """The next step for snapshot ``s`` (see the module docstring and :class:`Decision`)."""
    pub = s.published
    alive = s.alive
    h = s.health
    # --straggler-policy evict: evicted members keep their lease but are out of the epoch
    evicted = {m: ev for m, ev in h.evicted.items() if m in alive}
    if evicted:
        alive = {m: v for m, v in dict(alive).items() if m not in evicted}
    avoid = [list(p) for p in h.avoid if p[0] in alive and p[1] in alive]
    current: Set[str] = pub.members if pub is not None else frozenset()
    old_demoted: Set[str] = pub.demoted if pub is not None else frozenset()
    old_infos: Mapping[str, MemberInfo] = pub.infos if pub is not None else {}
    # A member that restarted under the same id (new lease, pid or address) before we
    # noticed its exit counts as removed and added again.
    if s.full or pub is None:
        removed_set = set(current - alive.keys())
        added_set = set(alive.keys() - current)
        check: Collection[str] = current & alive.keys()
    else:
        # plus whoever the policy may have let back in (eviction ended, re-admission)
        look = set(s.dirty) | s.confirmed.keys() | evicted.keys() | set(pub.evicted) | set(h.readmitted)
        removed_set = {m for m in look if m in current and m not in alive}
        added_set = {m for m in look if m in alive and m not in current}
        check = {m for m in look if m in current and m in alive}
    # (``is`` first: an unchanged entry holds the very info the epoch holds, and a frozen
    # dataclass's == builds two tuples of its fields: 100,000 of them on a full pass)
    replaced = {m for m in check if (info := alive[m][0]) is not (old := old_infos.get(m)) and info != old}
    demoted = set(h.demoted)
    demoted_changed = (demoted & current) != old_demoted
    old_avoid = [list(p) for p in pub.avoid] if pub is not None else []
    cleanup = tuple([k for m, (k, _) in s.departed.items() if m not in alive] + list(s.bad_markers)
                    + list(s.consumed))
    gauges = Gauges(len(alive), len(added_set), len(demoted & current))
    speeds, speeds_changed = _link_speeds(s, alive)

    if (pub is None and len(alive) < s.min_members) or (
            not s.corrupt and pub is not None and not removed_set and not added_set and not replaced
            and not demoted_changed and avoid == old_avoid and not speeds_changed):
        return Decision("unchanged", cleanup, gauges=gauges)

    removed = tuple(sorted(removed_set | replaced))
    added = tuple(sorted(added_set | replaced))
    back = set(added) & h.readmitted
    if removed and set(removed) <= evicted.keys():   # an eviction: joiners wait for the next epoch too
        back = set(added) - replaced
    if back and removed:   # a re-admission waits for the next epoch: joiners cannot follow one that also removes
        alive = {m: v for m, v in dict(alive).items() if m not in back}
        added = tuple(m for m in added if m not in back)
    # A removal while the published epoch's admission is pending (its op seq not agreed in
    # etcd): its joiners leave with the removed, and a later pass adds them again. Whether
    # a member had adopted that epoch or not, the joiners are then out of its group, and
    # every member agrees; kept, they would be in the group of some survivors only.
    cancelled = {m for m in s.admitting if m in current and m in alive} if removed else set()
    if cancelled:
        alive = {m: v for m, v in dict(alive).items() if m not in cancelled}
        removed = tuple(sorted(set(removed) | cancelled))
    if not s.corrupt and added and not removed and not s.joins_due and (pub is None or not demoted_changed):
        return Decision("joins_deferred", cleanup, gauges=gauges)
    cause, path, trigger = classify(s, removed, added, evicted.keys())

    extras: dict[str, object] = {}
    if avoid:
        extras["avoid"] = avoid
    if demoted and h.leaf_deadline_ms is not None:   # --straggler-policy deadline: every member applies it
        extras["leaf_deadline_ms"] = h.leaf_deadline_ms
    if evicted:   # read by the evicted member (Evicted message), status and a new leader
        extras["evicted"] = {m: ev.to_dict() for m, ev in sorted(evicted.items())}
    speeds = {m: v for m, v in speeds.items() if m in alive}   # a held-back member is not planned
    if speeds:   # what the plan was made with: the next pass's hysteresis reference
        extras["link_bps"] = speeds
    number = (pub.number if pub else 0) + 1 if not s.corrupt else repair_number(s.history_top, s.epoch_revision)
    return Decision("publish", cleanup, number=number, members=alive, demoted=demoted, avoid=avoid,
                    removed=removed, added=added, cause=cause, path=path, trigger=trigger, extras=extras,
                    held_back=frozenset(added_set | back | cancelled), gauges=gauges, link_speeds=speeds)


def _link_speeds(s: Snapshot, alive: Mapping[str, Entry]) -> tuple[dict[str, float], bool]:
    """(the link speeds to plan with, whether they change the plan's inputs). Settled
    against the published ones (:func:`.link_classes.settle_speeds`); a change counts only
    when the new or the old speeds (with declared labels) cover every live member: the
    planner ignores incomplete speeds, so publishing for them would change nothing."""
    if s.measured_speeds is None:
        return {}, False
    old = s.published.link_speeds if s.published is not None else {}
    new = settle_speeds(old, s.measured_speeds, alive, s.speed_band)
    if new == {m: v for m, v in old.items() if m in alive}:
        return new, False
    declared = declared_speeds(info for info, _ in alive.values())

    def covers(x: Mapping[str, float]) -> bool:
        return all(m in x or m in declared for m in alive)

    return new, covers(new) or covers(old)

