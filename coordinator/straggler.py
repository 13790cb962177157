"""Straggler detection: pure, robust statistics over the members' health windows.

Input: every member's latest health record (:mod:`.health`), one *window* each (a few
hundred ms to seconds of ops): ``ops`` in the window, ``window_s`` wall seconds, and
``wait_s`` {peer: seconds spent blocked on receives from that peer}. From a window the
detector derives

* ``op_s   = window_s / ops`` — the member's period per op, and
* ``busy_s = (window_s - sum(wait_s)) / ops`` — seconds per op it was *not* waiting on a
  peer: its own compute/reduce, its own (slow) sends, and any lateness between ops.

In a synchronous collective every member shares one period, so the member that gates it
(a straggler) is the one that waits *least*: its ``busy_s`` stands out, while every other
member's extra time shows up as waiting. Per window the detector scores each member:

    excess = busy_s - median(busy_s of all fresh members)
    score  = excess / median(op_s)          (fraction of an op it costs everybody)

and calls the window *slow* when ``excess > max(mad_k * MAD, shift * median(op_s))``
(MAD: scaled median absolute deviation across members; ``shift`` 10 %, Falcon/Greyhound
style) and *clear* when ``score < release_shift`` (5 %). Between the two is a hysteresis
band that changes nothing.

States per member, each transition needing a run of consecutive windows:

``ok`` --confirm_windows slow--> ``probe`` (its link to its ring successor is avoided)
  ``probe`` --confirm_windows slow, new ring--> ``demoted`` (slow with other peers too:
  a slow *member*; the link avoidance is dropped)
  ``probe`` --confirm_windows clear, new ring--> ``ok`` + that link recorded slow (a slow
  *link*: both ends are fine with other peers)
``demoted`` --release_windows clear--> ``ok`` (promoted back; the planner restores the
topology-optimal order). A member demoted again within ``redemote_window_s`` of its
promotion needs twice as many clear windows as last time (up to
``max_release_windows``): on the leaf path a member that is *late* (not slow) stops
costing the others and reads "clear", so without this it would flap between the ring and
the leaf every few seconds.

Why the probe: in a ring a member sends to exactly one peer, so "slow member" and "slow
link to its successor" look the same in one ring order; re-pairing it is the cheapest
experiment that tells them apart, and is itself the mitigation for a slow link. With fewer
than ``min_members_for_links`` members every pair is adjacent in some ring anyway, so the
detector demotes directly. An avoided link is kept for ``link_hold_s`` and then tried
again (it cannot be observed while unused); a still-slow link is detected anew.

Parents of demoted leaves are exempt from new suspicion (the leaf duty — receiving its
input, sending it the result — is extra busy time that is not theirs). Guards: never more than ``(n-1)//2`` members demoted (if half the group looks slow the
reference is wrong, not the members); windows older than ``stale_s`` or from an epoch
before the ring change being probed are ignored; a member that leaves loses its state.

Pure: no I/O, no clock (``now`` is passed in), deterministic. Failure behaviour: malformed
records (missing fields, zero ops, negative numbers) are skipped for that member — it then
keeps its state — and never raise.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, KeysView, Set as AbstractSet
from dataclasses import dataclass, field
from typing import Collection, Mapping, Protocol, Sequence, TypedDict

import numpy as np

from resilient.errors import ConfigError

OK, PROBE, DEMOTED = "ok", "probe", "demoted"


class HealthRecord(TypedDict, total=False):
    """One member's health window, as :func:`.health.parse_health` validated it (the
    format is in :mod:`.health`); every field may be absent. Other fields pass through."""

    v: int
    member: str
    epoch: int
    seq: int
    at: float
    ops: int
    window_s: float
    wait_s: dict[str, float]
    op_s_p50: float
    op_s_max: float
    shaping: str
    run: int        # a node summary's: windows this one stands for (coordinator/node_health.py)


class HealthRecords(Mapping[str, HealthRecord]):
    """Every member's latest record (read-only), plus ``changed``: the members whose
    record changed or went since the previous pass (None: not known, so the detector
    looks at every record). The coordinator builds one per pass from its
    :class:`~.health_cache.HealthCache` (a subclass that looks records up in the cache,
    copying them all only if iterated); the detector then costs O(changed) a pass."""

    def __init__(self, data: Mapping[str, HealthRecord], changed: AbstractSet[str] | None) -> None:
        self._data = data
        self.changed = changed

    def __getitem__(self, member: str) -> HealthRecord:
        return self._data[member]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class ScoreRow(TypedDict, total=False):
    """A member's row in a :class:`Verdict`'s scores (and the ``straggler`` record):
    ``score``, ``state`` (ok | probe | demoted | evicted); ``until``/``hold_s`` while
    evicted."""

    score: float | None
    state: str
    until: float
    hold_s: float


@dataclass(frozen=True)
class StragglerConfig:
    """Tunables (see the module docstring). ``shift``/``release_shift`` are fractions of
    the median op period; ``mad_k`` scales the robust spread; windows counts are
    consecutive windows of one member. At scale: the verdict's scores list every member
    up to ``scores_all_up_to`` tracked, beyond it those in probe or demoted and the
    ``scores_top`` highest (the ``straggler`` record stays small); fed the changed
    records only, the medians are recomputed once ``stats_change`` of the windows changed
    or they are ``stats_max_age`` s old."""

    shift: float = 0.10
    release_shift: float = 0.05
    mad_k: float = 4.0
    confirm_windows: int = 3
    release_windows: int = 5
    min_ops: int = 3
    min_members: int = 3
    min_members_for_links: int = 4
    link_hold_s: float = 60.0
    stale_s: float = 10.0
    link_probe: bool = True
    redemote_window_s: float = 60.0
    max_release_windows: int = 80
    scores_all_up_to: int = 1024
    scores_top: int = 64
    stats_max_age: float = 30.0
    stats_change: float = 0.01

    def validate(self) -> None:
        if not 0 < self.release_shift < self.shift:
            raise ConfigError(f"straggler thresholds need 0 < release_shift ({self.release_shift}) "
                              f"< shift ({self.shift}): the gap is the hysteresis band")
        for name in ("confirm_windows", "release_windows", "min_ops"):
            if getattr(self, name) < 1:
                raise ConfigError(f"straggler {name} must be >= 1, got {getattr(self, name)}")
        if self.min_members < 3:
            raise ConfigError(f"straggler min_members must be >= 3 (a median needs a majority), got {self.min_members}")
        if self.mad_k < 0 or self.link_hold_s < 0 or self.stale_s <= 0:
            raise ConfigError("straggler mad_k and link_hold_s must be >= 0 and stale_s > 0")
        if self.scores_all_up_to < 0 or self.scores_top < 0 or self.stats_max_age < 0 or self.stats_change < 0:
            raise ConfigError("straggler scores_all_up_to, scores_top, stats_max_age and stats_change must be >= 0")
        if self.redemote_window_s < 0 or self.max_release_windows < self.release_windows:
            raise ConfigError(f"straggler redemote_window_s must be >= 0 and max_release_windows "
                              f"({self.max_release_windows}) >= release_windows ({self.release_windows})")


@dataclass(slots=True)
class MemberState:
    state: str = OK
    slow_run: int = 0
    clear_run: int = 0
    score: float = 0.0
    last_seq: object = None
    last_window: int | None = None     # seq of the last held window counted
    probe_edge: tuple[str, str] | None = None
    probe_epoch: int = 0
    since: float = 0.0
    release_windows: int = 0           # clear windows this demotion needs (0: the config's)
    promoted_at: float | None = None   # when it was last promoted back


@dataclass(frozen=True)
class Verdict:
    """What the coordinator acts on: ``demoted`` members (leaf positions), ``avoid``
    links (unordered pairs that must not be ring neighbours), and per member
    ``{"score": float, "state": ok|probe|demoted}`` for status and metrics."""

    demoted: frozenset[str]
    avoid: frozenset[tuple[str, str]]
    scores: dict[str, ScoreRow] = field(default_factory=dict, compare=False)


class RingNeighbours(Protocol):
    """The ring order as the detector looks it up: membership, positions, neighbours
    (``None`` for an id not in the ring; ``position`` raises :class:`KeyError`)."""

    def __len__(self) -> int: ...

    def __contains__(self, member: object) -> bool: ...

    def position(self, member: str) -> int: ...

    def successor(self, member: str) -> str | None: ...

    def predecessor(self, member: str) -> str | None: ...


class ListRing:
    """:class:`RingNeighbours` of a plain sequence of ids (indexed once: O(N))."""

    def __init__(self, ring: Sequence[str]) -> None:
        self._ring = tuple(ring)
        self._pos = {m: i for i, m in enumerate(self._ring)}

    def __len__(self) -> int:
        return len(self._ring)

    def __contains__(self, member: object) -> bool:
        return member in self._pos

    def member_ids(self) -> KeysView[str]:
        """The ring's ids as a set (for set arithmetic in C)."""
        return self._pos.keys()

    def position(self, member: str) -> int:
        return self._pos[member]

    def successor(self, member: str) -> str | None:
        i = self._pos.get(member)
        return None if i is None else self._ring[(i + 1) % len(self._ring)]

    def predecessor(self, member: str) -> str | None:
        i = self._pos.get(member)
        return None if i is None else self._ring[i - 1]

    def at(self, index: int) -> str:
        """The id at ring ``index``."""
        return self._ring[index]


def window_features(record: HealthRecord) -> tuple[float, float, int] | None:
    """``(busy_s, op_s, ops)`` of one health record's window, or None if unusable."""
    try:
        ops = int(record["ops"])
        window_s = float(record["window_s"])
        waits = record.get("wait_s") or {}
        wait = sum(float(v) for v in waits.values())
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if ops <= 0 or not math.isfinite(window_s) or window_s <= 0 or wait < 0:
        return None
    busy = max(0.0, window_s - wait)
    return busy / ops, window_s / ops, ops


def median(xs: Sequence[float]) -> float:
    """The median of ``xs`` (the mean of the two middle values for an even count)."""
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


def _np_median(a: np.ndarray) -> float:
    """The median of a non-empty float array, as :func:`median` computes it."""
    n = len(a)
    k = n // 2
    if n % 2:
        return float(np.partition(a, [k])[k])
    p = np.partition(a, [k - 1, k])
    return 0.5 * (float(p[k - 1]) + float(p[k]))


class _Population:
    """The usable windows the medians are taken over: one slot per member in numpy
    arrays (busy_s, op_s, at, held), O(1) to set or drop a member, the statistics O(N)
    in C."""

    def __init__(self) -> None:
        self.slot: dict[str, int] = {}
        self.names: list[str | None] = []
        self._free: list[int] = []
        self.busy = np.zeros(0)
        self.op = np.zeros(0)
        self.at = np.zeros(0)
        self.used = np.zeros(0, dtype=bool)
        self.held = np.zeros(0, dtype=bool)
        self.changes = 0   # sets and drops so far

    def _grow(self) -> None:
        n = len(self.names)
        new = max(64, 2 * n)
        self.busy, self.op, self.at = (np.concatenate([a, np.zeros(new - n)]) for a in (self.busy, self.op, self.at))
        self.used, self.held = (np.concatenate([a, np.zeros(new - n, dtype=bool)]) for a in (self.used, self.held))
        self.names.extend([None] * (new - n))
        self._free.extend(range(new - 1, n - 1, -1))

    def set_many(self, windows: Mapping[str, tuple[float, float, float, bool]]) -> None:
        """Set each member's ``(busy_s, op_s, at, held)`` (one array write per field)."""
        if not windows:
            return
        idx = []
        for member in windows:
            i = self.slot.get(member)
            if i is None:
                if not self._free:
                    self._grow()
                i = self._free.pop()
                self.slot[member], self.names[i] = i, member
            idx.append(i)
        cols = list(zip(*windows.values()))
        self.busy[idx], self.op[idx], self.at[idx], self.held[idx] = cols[0], cols[1], cols[2], cols[3]
        self.used[idx] = True
        self.changes += len(idx)

    def drop(self, member: str) -> None:
        i = self.slot.pop(member, None)
        if i is not None:
            self.used[i], self.names[i] = False, None
            self._free.append(i)
            self.changes += 1

    def fresh(self, now: float, stale_s: float) -> np.ndarray:
        """Mask of the slots whose window counts now: held, or closed within ``stale_s``."""
        return self.used & (self.held | ((now - self.at) <= stale_s))


class StragglerDetector:
    """Stateful detector; call :meth:`update` with the latest records on every pass (a
    record's window counts once, keyed by its ``seq``; a record with ``run`` (a node
    summary's, :mod:`.node_health`) counts for up to ``run`` windows: those since the
    last one counted, by ``seq``, at most ``max_release_windows``, and it is current
    whatever its age — it is withdrawn with its node)."""

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config or StragglerConfig()
        self.config.validate()
        self.members: dict[str, MemberState] = {}
        self.links: dict[tuple[str, str], float] = {}   # confirmed slow link -> time confirmed
        self.events: list[tuple[float, str, str]] = []   # (now, member or link, what) — for logs/tests
        self._pop = _Population()
        self._flagged: set[str] = set()    # members that were put in probe or demoted (pruned lazily)
        self._epoch: int | None = None
        self._now = 0.0
        #: (now, windows, population changes, stats) of the last computed statistics
        self._stats_cache: tuple[float, int, int, tuple[float, float, float] | None] | None = None
        self._top_cache: list[str] | None = None
        self._uncounted: set[str] = set()   # fresh windows seen while there were no statistics

    # -- public -----------------------------------------------------------------------

    def seed(self, member: str, state: MemberState) -> None:
        """Set ``member``'s state from outside (a new leader keeps published demotions)."""
        self.members[member] = state
        if state.state != OK:
            self._flagged.add(member)

    def update(self, records: Mapping[str, HealthRecord], ring: Sequence[str] | RingNeighbours, epoch: int,
               now: float, exempt: Collection[str] = (), changed: AbstractSet[str] | None = None) -> Verdict:
        """Consume new windows of the members in ``ring`` (the current epoch's ring
        order as a sequence, or looked up through :class:`RingNeighbours`; ``epoch`` its
        number) and return the verdict. ``now``: wall seconds, compared with records'
        ``at``. ``exempt``: members serving demoted leaves (their tree parents): their
        extra busy time is the leaf duty, so they are scored but never newly suspected
        while it lasts. ``changed``: the members whose record changed or went since the
        previous call (default: ``records.changed`` of a :class:`HealthRecords`, else
        unknown: every record is looked at). Cost: O(changed · log N) plus, when a
        window is new, the medians in C over the N windows; O(N) on a call without
        ``changed``. With ``changed``, a member that left the ring is forgotten when its
        record changes or goes (its node's next summary, or the node's lease), or at
        once if it was in probe or demoted."""
        c = self.config
        self._now = now
        view: RingNeighbours = ListRing(ring) if isinstance(ring, Sequence) else ring
        n = len(view)
        if changed is None and isinstance(records, HealthRecords):
            changed = records.changed
        if changed is None:   # nothing known of what changed: every record, every member rechecked
            self._sweep(view)
        for link in [l for l in self.links if l[0] not in view or l[1] not in view]:
            del self.links[link]
        for link, since in list(self.links.items()):
            if now - since >= c.link_hold_s:
                del self.links[link]
                self.events.append((now, f"{link[0]}-{link[1]}", "link retried"))
        pop = self._pop
        look = (records.keys() | pop.slot.keys()) if changed is None else changed
        stepping: list[str] = []
        if changed is not None and epoch != self._epoch:   # members that left: those flagged, at once
            for m in [m for m in self._flagged if m not in view]:
                self.members.pop(m, None)
        self._epoch = epoch
        ids = getattr(view, "member_ids", None)
        in_view: Callable[[object], bool] = ids().__contains__ if callable(ids) else view.__contains__
        fresh: dict[str, tuple[float, float, float, bool]] = {}
        for m in look:
            if not in_view(m):   # left the ring (its node's next summary, or its lease, drops the record)
                self.members.pop(m, None)
                pop.drop(m)
                continue
            rec = records.get(m)
            f = window_features(rec) if rec is not None else None
            try:
                at = float(rec.get("at", 0.0)) if rec is not None else 0.0
            except (TypeError, ValueError):
                f = None
            if f is None or f[2] < c.min_ops:
                pop.drop(m)
                continue
            held = "run" in rec  # type: ignore[operator]  # rec is set when f is
            fresh[m] = (f[0], f[1], at, held)
            if held or now - at <= c.stale_s:
                stepping.append(m)
        pop.set_many(fresh)
        if changed is not None:   # windows not counted yet (no statistics then) are due as well
            for m in self._uncounted - fresh.keys():
                i = pop.slot.get(m)
                if i is not None and (bool(pop.held[i]) or now - float(pop.at[i]) <= c.stale_s):
                    stepping.append(m)
        stats = self._stats(now, exact=changed is None) if stepping else None
        if stats is None:
            self._uncounted.update(stepping)
        else:
            self._uncounted.clear()
            med_busy, med_op, slow_bar = stats
            for m in sorted(stepping, key=view.position):   # ring order
                st = self.members.setdefault(m, MemberState(since=now))
                rec = records[m]
                windows = self._new_windows(st, rec)
                if not windows:
                    continue
                excess = (fresh[m][0] if m in fresh else float(pop.busy[pop.slot[m]])) - med_busy
                st.score = excess / med_op if med_op > 0 else 0.0
                if st.state == OK and not excess > slow_bar:   # k windows that change nothing but the runs
                    windows = 1 if windows == 1 else self._clear_in_ok(st, windows, st.score < c.release_shift)
                for _ in range(windows):
                    if st.state == PROBE:
                        # Only windows measured on a ring without the probed edge say anything.
                        if self._has_edge(st.probe_edge, view):
                            break
                        st.probe_epoch = st.probe_epoch or epoch
                        try:
                            if int(rec.get("epoch", 0)) < st.probe_epoch:
                                break
                        except (TypeError, ValueError):
                            break
                    slow = excess > slow_bar and not (m in exempt and st.state == OK)
                    self._step(m, st, slow, st.score < c.release_shift, view, n, epoch, now)
        self._enforce_cap(n, now)
        return self.verdict()

    def _stats(self, now: float, exact: bool) -> tuple[float, float, float] | None:
        """``(median busy_s, median op_s, slow bar)`` over the fresh windows (None: fewer
        than ``min_members``). Unless ``exact``, the last ones are reused while fewer than
        ``stats_change`` of the windows changed and they are under ``stats_max_age`` s old
        (a median over N windows moves at most between the 50 -/+ 100 x ``stats_change``
        percentiles meanwhile)."""
        c, pop = self.config, self._pop
        cached = self._stats_cache
        if not exact and cached is not None:
            at, size, changes, stats = cached
            if now - at < c.stats_max_age and pop.changes - changes < max(1.0, c.stats_change * size):
                return stats
        mask = pop.fresh(now, c.stale_s)
        size = int(mask.sum())
        stats = None
        if size >= c.min_members:
            busy_all = pop.busy[mask]
            med_busy = _np_median(busy_all)
            med_op = _np_median(pop.op[mask])
            mad = 1.4826 * _np_median(np.abs(busy_all - med_busy))
            stats = (med_busy, med_op, max(c.mad_k * mad, c.shift * med_op))
        self._stats_cache = (now, size, pop.changes, stats)
        self._top_cache = None
        return stats

    def verdict(self) -> Verdict:
        flagged = self._flagged_now()
        demoted = frozenset(m for m in flagged if self.members[m].state == DEMOTED)
        avoid = set(self.links)
        for m in flagged:
            s = self.members[m]
            if s.state == PROBE and s.probe_edge:
                avoid.add(_pair(*s.probe_edge))
        c = self.config
        if len(self.members) <= c.scores_all_up_to:
            listed: Collection[str] = self.members.keys()
        else:   # at scale: every member not ok, and the highest scores
            listed = flagged | {m for m in self._top(c.scores_top) if m in self.members}
        scores: dict[str, ScoreRow] = {m: {"score": round(self.members[m].score, 4), "state": self.members[m].state}
                                       for m in sorted(listed)}
        return Verdict(demoted=demoted, avoid=frozenset(avoid), scores=scores)

    def _flagged_now(self) -> set[str]:
        """The members in probe or demoted (the flagged set, pruned of the rest)."""
        self._flagged = {m for m in self._flagged if (s := self.members.get(m)) is not None and s.state != OK}
        return set(self._flagged)

    def _top(self, k: int) -> list[str]:
        """The ``k`` members with the largest busy time (the highest scores), as of the
        statistics last computed (recomputed with them)."""
        if self._top_cache is None:
            self._top_cache = self._top_now(k)
        return self._top_cache

    def _top_now(self, k: int) -> list[str]:
        pop = self._pop
        idx = np.flatnonzero(pop.fresh(self._now, self.config.stale_s))
        if k <= 0 or not len(idx):
            return []
        if len(idx) > k:
            idx = idx[np.argpartition(-pop.busy[idx], k - 1)[:k]]
        return [name for i in idx if (name := pop.names[int(i)]) is not None]

    @staticmethod
    def _clear_in_ok(st: MemberState, windows: int, clear: bool) -> int:
        """``windows - 1`` of the ``windows`` not-slow windows of a member in state ok,
        applied at once (each would reset its slow run and extend or reset its clear
        run, nothing else); the last one is left to :meth:`_step`. Returns 1."""
        st.slow_run = 0
        st.clear_run = st.clear_run + windows - 1 if clear else 0
        return 1

    def _new_windows(self, st: MemberState, rec: HealthRecord) -> int:
        """How many windows ``rec`` adds for its member (0: already counted)."""
        if "run" not in rec:
            ident: object = (rec.get("epoch"), rec.get("seq"), rec.get("at"))
            if ident == st.last_seq:
                return 0
            st.last_seq = ident
            return 1
        ident = (rec.get("epoch"), rec.get("seq"))
        if ident == st.last_seq:
            return 0
        st.last_seq = ident
        try:
            seq, run = int(rec.get("seq", 0)), int(rec.get("run", 1))
        except (TypeError, ValueError):
            return 1
        prev, st.last_window = st.last_window, seq
        k = run if prev is None or seq <= prev else min(run, seq - prev)
        return max(1, min(k, self.config.max_release_windows))

    def _sweep(self, view: RingNeighbours) -> None:
        """Forget the members that left the ring (O(tracked), in C where the view can
        hand over its id set)."""
        ids = getattr(view, "member_ids", None)
        if callable(ids):
            keep = ids()
            gone: list[str] = list(self.members.keys() - keep)
            gone_pop: list[str] = list(self._pop.slot.keys() - keep)
        else:
            gone = [m for m in self.members if m not in view]
            gone_pop = [m for m in self._pop.slot if m not in view]
        for m in gone:
            del self.members[m]
        for m in gone_pop:
            self._pop.drop(m)

    # -- internals --------------------------------------------------------------------

    @staticmethod
    def _has_edge(edge: tuple[str, str] | None, ring: RingNeighbours) -> bool:
        if edge is None:
            return False
        a, b = edge
        return ring.successor(a) == b or ring.predecessor(a) == b

    def _step(self, m: str, st: MemberState, slow: bool, clear: bool, ring: RingNeighbours,
              n: int, epoch: int, now: float) -> None:
        c = self.config
        st.slow_run = st.slow_run + 1 if slow else 0
        st.clear_run = st.clear_run + 1 if clear else 0
        if st.state == OK and st.slow_run >= c.confirm_windows:
            self._flagged.add(m)
            nxt = ring.successor(m)
            if c.link_probe and n >= c.min_members_for_links and nxt and nxt != m:
                st.state, st.probe_edge, st.probe_epoch = PROBE, (m, nxt), 0
                self.events.append((now, m, f"probe: slow; avoiding link {m}-{nxt}"))
            else:
                st.state = DEMOTED
                self._hold(st, now)
                self.events.append((now, m, "demoted: slow member"))
            st.slow_run = st.clear_run = 0
            st.since = now
        elif st.state == PROBE and st.slow_run >= c.confirm_windows:
            st.state, st.probe_edge = DEMOTED, None
            self._hold(st, now)
            st.slow_run = st.clear_run = 0
            st.since = now
            self.events.append((now, m, "demoted: slow with other peers too (slow member)"))
        elif st.state == PROBE and st.clear_run >= c.confirm_windows:
            assert st.probe_edge is not None
            link = _pair(*st.probe_edge)
            self.links[link] = now
            self.events.append((now, f"{link[0]}-{link[1]}", "slow link confirmed"))
            st.state, st.probe_edge = OK, None
            st.slow_run = st.clear_run = 0
            st.since = now
        elif st.state == DEMOTED and st.clear_run >= (st.release_windows or c.release_windows):
            st.state = OK
            st.slow_run = st.clear_run = 0
            st.since = st.promoted_at = now
            self.events.append((now, m, "promoted: healthy again"))

    def _hold(self, st: MemberState, now: float) -> None:
        """Clear windows the new demotion needs: doubled after a recent promotion."""
        c = self.config
        if st.promoted_at is not None and now - st.promoted_at < c.redemote_window_s:
            st.release_windows = min(c.max_release_windows, 2 * (st.release_windows or c.release_windows))
        else:
            st.release_windows = c.release_windows

    def _enforce_cap(self, n: int, now: float) -> None:
        cap = max(0, (n - 1) // 2)
        demoted = sorted((self.members[m].since, m) for m in self._flagged_now() if self.members[m].state == DEMOTED)
        for _, m in demoted[cap:]:   # keep the earliest; undo the rest
            st = self.members[m]
            st.state, st.slow_run, st.clear_run = OK, 0, 0
            self.events.append((now, m, "demotion refused: too many members look slow"))
