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
from dataclasses import dataclass, field
from typing import Collection, Mapping, Protocol, Sequence, TypedDict

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
    consecutive windows of one member."""

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
        if self.redemote_window_s < 0 or self.max_release_windows < self.release_windows:
            raise ConfigError(f"straggler redemote_window_s must be >= 0 and max_release_windows "
                              f"({self.max_release_windows}) >= release_windows ({self.release_windows})")


@dataclass
class MemberState:
    state: str = OK
    slow_run: int = 0
    clear_run: int = 0
    score: float = 0.0
    last_seq: object = None
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


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


class StragglerDetector:
    """Stateful detector; call :meth:`update` with the latest records on every pass (a
    record's window counts once, keyed by its ``seq``)."""

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config or StragglerConfig()
        self.config.validate()
        self.members: dict[str, MemberState] = {}
        self.links: dict[tuple[str, str], float] = {}   # confirmed slow link -> time confirmed
        self.events: list[tuple[float, str, str]] = []   # (now, member or link, what) — for logs/tests

    # -- public -----------------------------------------------------------------------

    def update(self, records: Mapping[str, HealthRecord], ring: Sequence[str] | RingNeighbours, epoch: int,
               now: float, exempt: Collection[str] = ()) -> Verdict:
        """Consume new windows of the members in ``ring`` (the current epoch's ring
        order as a sequence, or looked up through :class:`RingNeighbours`; ``epoch`` its
        number) and return the verdict. ``now``: wall seconds, compared with records'
        ``at``. ``exempt``: members serving demoted leaves (their tree parents): their
        extra busy time is the leaf duty, so they are scored but never newly suspected
        while it lasts. Cost: O((records + tracked members) · log N) with a
        :class:`RingNeighbours` ring, independent of the ring's size otherwise."""
        c = self.config
        view: RingNeighbours = ListRing(ring) if isinstance(ring, Sequence) else ring
        n = len(view)
        for gone in [m for m in self.members if m not in view]:
            del self.members[gone]
        for link in [l for l in self.links if l[0] not in view or l[1] not in view]:
            del self.links[link]
        for link, since in list(self.links.items()):
            if now - since >= c.link_hold_s:
                del self.links[link]
                self.events.append((now, f"{link[0]}-{link[1]}", "link retried"))
        feats: dict[str, tuple[float, float, int]] = {}
        for m in sorted((m for m in records if m in view), key=view.position):   # ring order
            rec = records[m]
            try:
                at = float(rec.get("at", 0.0))
            except (TypeError, ValueError):
                continue
            f = window_features(rec)
            if f is None or f[2] < c.min_ops or now - at > c.stale_s:
                continue
            feats[m] = f
        if len(feats) >= c.min_members:
            med_busy = _median([f[0] for f in feats.values()])
            med_op = _median([f[1] for f in feats.values()])
            mad = 1.4826 * _median([abs(f[0] - med_busy) for f in feats.values()])
            slow_bar = max(c.mad_k * mad, c.shift * med_op)
            for m, (busy, _op, _ops) in feats.items():
                st = self.members.setdefault(m, MemberState(since=now))
                rec = records[m]
                seq = (rec.get("epoch"), rec.get("seq"), rec.get("at"))
                if seq == st.last_seq:
                    continue
                st.last_seq = seq
                excess = busy - med_busy
                st.score = excess / med_op if med_op > 0 else 0.0
                if st.state == PROBE:
                    # Only windows measured on a ring without the probed edge say anything.
                    if self._has_edge(st.probe_edge, view):
                        continue
                    st.probe_epoch = st.probe_epoch or epoch
                    try:
                        if int(rec.get("epoch", 0)) < st.probe_epoch:
                            continue
                    except (TypeError, ValueError):
                        continue
                slow = excess > slow_bar and not (m in exempt and st.state == OK)
                self._step(m, st, slow, st.score < c.release_shift, view, n, epoch, now)
        self._enforce_cap(n, now)
        return self.verdict()

    def verdict(self) -> Verdict:
        demoted = frozenset(m for m, s in self.members.items() if s.state == DEMOTED)
        avoid = set(self.links)
        for s in self.members.values():
            if s.state == PROBE and s.probe_edge:
                avoid.add(_pair(*s.probe_edge))
        scores: dict[str, ScoreRow] = {m: {"score": round(s.score, 4), "state": s.state}
                                       for m, s in sorted(self.members.items())}
        return Verdict(demoted=demoted, avoid=frozenset(avoid), scores=scores)

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
        demoted = sorted((s.since, m) for m, s in self.members.items() if s.state == DEMOTED)
        for _, m in demoted[cap:]:   # keep the earliest; undo the rest
            st = self.members[m]
            st.state, st.slow_run, st.clear_run = OK, 0, 0
            self.events.append((now, m, "demotion refused: too many members look slow"))
