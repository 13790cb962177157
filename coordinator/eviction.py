"""``--straggler-policy evict``: a confirmed slow member leaves the ring for a while.

Detection is the straggler detector's (:mod:`.straggler`, unchanged): a member it confirms
as a slow *member* (state ``demoted``, where ``demote`` would make it a leaf) is instead
**evicted**: the coordinator publishes an epoch without it (cause ``evicted``) while its
lease stays alive, and lists it in that epoch's ``plan["evicted"]`` =
``{member: {"at", "until", "hold_s", "count", "after_epoch"}}`` (wall seconds; every
epoch carries the current evictions, so the member and ``resilient status`` can read when
it may come back, and a new coordinator leader picks the book up from the epoch).

The evicted member's Communicator raises :class:`~resilient.errors.Evicted` at its next op
(or in its in-flight op, which the survivors finish by recovery exactly like a removal).
``comm.rejoin(timeout)`` writes ``readmit/<member>`` (on its lease, :func:`request_readmission`)
and waits. The coordinator re-admits it (cause ``readmitted``, through the joiner path: it
starts at the group's op seq) once the hold is over **and** it asked — so the survivors
never wait for a member that is not ready to take part. Back in, it is on probation: the
detector evaluates it afresh (windows from before its re-admission epoch are ignored); if
it is confirmed slow again within ``relapse_window_s`` of its re-admission it is evicted
again with the hold doubled (capped at ``max_hold_s``).

Guards: never more than ``(n-1)//2`` members evicted, ``n`` counting every live member
(the ring plus the evicted); a confirmed straggler that would exceed it is refused (back
to ``ok`` in the detector, logged) — under ``evict`` nobody is ever a leaf. A member
whose lease ends while evicted is forgotten.

:class:`EvictionBook` is pure (no I/O, ``now`` passed in, deterministic);
:class:`EvictPolicy` plugs it into the coordinator as a
:class:`~.health.StragglerPolicy`. Failure behaviour: malformed ``readmit/`` values or
``plan["evicted"]`` entries are ignored (logged); invalid settings raise
:class:`~resilient.errors.ConfigError`.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Collection, Container, Iterable, Mapping

from resilient.coordinator import keys, records
from resilient.coordinator.health import StragglerPolicy
from resilient.coordinator.policy import HealthPolicy, PolicyNeeds
from resilient.coordinator.straggler import OK, HealthRecord, ScoreRow, StragglerConfig, Verdict
from resilient.errors import ConfigError, RecordError

if TYPE_CHECKING:  # pragma: no cover
    from resilient.coordinator.epoch import Epoch
    from resilient.coordinator.epoch_view import EpochView
    from resilient.coordinator.store import Store

log = logging.getLogger(__name__)

EVICTED = "evicted"


# -- keys ----------------------------------------------------------------------------------

def readmit_prefix(job: str) -> str:
    """``/resilient/<job>/readmit/``: evicted members that asked to come back."""
    return keys.root(job) + "readmit/"


def readmit_key(job: str, member_id: str) -> str:
    return readmit_prefix(job) + keys.check_name("member id", member_id)


def request_readmission(store: "Store", job: str, member_id: str, seen_epoch: int, lease_id: int | None) -> None:
    """Ask to be re-admitted after an eviction: ``readmit/<member>`` = ``{"epoch":
    seen_epoch, "at"}`` on the member's lease (``seen_epoch``: the newest epoch it saw
    without itself; the coordinator accepts only a request newer than the eviction).
    Raises StoreError (LeaseExpired / StoreUnavailable) like any put."""
    body = json.dumps({"epoch": int(seen_epoch), "at": time.time()}, separators=(",", ":")).encode()
    store.put(readmit_key(job, member_id), body, lease=lease_id)


def read_requests(store: "Store", job: str) -> dict[str, int]:
    """member -> the epoch number its re-admission request answers (malformed: skipped)."""
    prefix = readmit_prefix(job)
    out: dict[str, int] = {}
    for kv in store.get_prefix(prefix):
        try:
            mid = kv.key[len(prefix):]
            if not records.is_id(mid):
                raise RecordError(f"bad readmit record at {kv.key}: the key does not end in a valid member id",
                                  "readmit", kv.key)
            out[mid] = parse_readmit(kv.value, kv.key)
        except RecordError as exc:
            records.skip(exc, kv.key)
    return out


def parse_readmit(raw: bytes, key: str = "") -> int:
    """The epoch number a ``readmit/<member>`` request answers (an integer in
    [0, 2**63)); :class:`~resilient.errors.RecordError` if the request is malformed."""
    return int(records.fields("readmit", raw, key).int("epoch"))


# -- the pure book -------------------------------------------------------------------------

@dataclass(frozen=True)
class EvictionConfig:
    """``hold_s``: seconds out after a first eviction; ``max_hold_s``: cap of the doubled
    hold; ``relapse_window_s``: confirmed slow again within this long after re-admission
    doubles the hold (later: back to ``hold_s``)."""

    hold_s: float = 30.0
    max_hold_s: float = 600.0
    relapse_window_s: float = 60.0

    def validate(self) -> None:
        for name in ("hold_s", "max_hold_s", "relapse_window_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"eviction {name} must be a number >= 0, got {v!r}; pass e.g. --evict-hold-s 30")
        if self.max_hold_s < self.hold_s:
            raise ConfigError(f"eviction max_hold_s ({self.max_hold_s}) must be >= hold_s ({self.hold_s})")


@dataclass
class Eviction:
    """One evicted member: evicted ``at``, may come back from ``until`` (wall seconds),
    ``hold_s`` = until - at, ``count``: evictions in a row (relapses + 1),
    ``after_epoch``: the epoch current when it was evicted (requests must be newer)."""

    at: float
    until: float
    hold_s: float
    count: int = 1
    after_epoch: int = 0

    def to_dict(self) -> dict[str, float | int]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, object] | records.Fields) -> Eviction:
        """Validate one ``plan["evicted"]`` entry (finite times, integer counts in
        [0, 2**63)); :class:`~resilient.errors.RecordError` if malformed."""
        f = d if isinstance(d, records.Fields) else records.Fields("eviction", d)
        return cls(at=f.float("at"), until=f.float("until"), hold_s=f.float("hold_s", lo=0.0),
                   count=f.int("count", 1), after_epoch=f.int("after_epoch", 0))


@dataclass
class _Back:
    at: float            # when it was released
    hold_s: float        # the hold it had served
    count: int
    epoch: int | None = None   # the first epoch that has it again (probation starts there)


class EvictionBook:
    """Who is evicted and until when; pure. Call :meth:`update` once per coordinator pass."""

    def __init__(self, config: EvictionConfig | None = None) -> None:
        self.config = config or EvictionConfig()
        self.config.validate()
        self.evicted: dict[str, Eviction] = {}
        self.back: dict[str, _Back] = {}
        self.events: list[tuple[float, str, str]] = []

    def update(self, confirmed: Iterable[str], alive: Collection[str], requests: Mapping[str, int],
               ring: Container[str], epoch: int, now: float) -> tuple[set[str], set[str], set[str]]:
        """``confirmed``: members of the ring the detector confirms slow; ``alive``: every
        live member (lease held: ring, evicted, joiners); ``requests``: member -> epoch
        its re-admission request answers; ``ring``/``epoch``: the current epoch's members
        and number. Returns (newly evicted, released now, refused — over the cap)."""
        c = self.config
        alive = set(alive)
        for m in [m for m in self.evicted if m not in alive]:
            del self.evicted[m]
            self.events.append((now, m, "forgotten: its lease ended while evicted"))
        for m in [m for m in self.back if m not in alive]:
            del self.back[m]
        for m, served in self.back.items():
            if served.epoch is None and m in ring:
                served.epoch = epoch
        released: set[str] = set()
        for m, ev in sorted(self.evicted.items()):
            req = requests.get(m)
            if now >= ev.until and req is not None and req > ev.after_epoch:
                released.add(m)
                self.back[m] = _Back(now, ev.hold_s, ev.count)
                self.events.append((now, m, f"re-admitted after {ev.hold_s:g} s (probation)"))
        for m in released:
            del self.evicted[m]
        fresh: set[str] = set()
        refused: set[str] = set()
        cap = max(0, (len(alive) - 1) // 2)
        for m in sorted(set(confirmed) - set(self.evicted)):
            if len(self.evicted) >= cap:
                refused.add(m)
                self.events.append((now, m, f"eviction refused: {len(self.evicted)} of {len(alive)} already out"))
                continue
            b = self.back.get(m)
            if b is not None and now - b.at <= c.relapse_window_s:
                hold, count = min(c.max_hold_s, max(2 * b.hold_s, c.hold_s)), b.count + 1
            else:
                hold, count = c.hold_s, 1
            self.evicted[m] = Eviction(at=now, until=now + hold, hold_s=hold, count=count, after_epoch=epoch)
            self.back.pop(m, None)
            fresh.add(m)
            self.events.append((now, m, f"evicted for {hold:g} s (eviction {count} in a row)"))
        return fresh, released, refused

    def probation_epoch(self, member: str) -> int | None:
        """The epoch from which a re-admitted member's health windows count (None: any)."""
        b = self.back.get(member)
        return None if b is None else b.epoch

    def seed(self, plan_evicted: Mapping[str, Mapping[str, object]], alive: Collection[str]) -> None:
        """A new leader: take the evictions published in the current epoch's plan."""
        for m, d in (plan_evicted or {}).items():
            if m in alive and m not in self.evicted:
                try:
                    self.evicted[m] = Eviction.from_dict(d)
                except RecordError as exc:
                    records.skip(exc)


# -- the coordinator's policy ----------------------------------------------------------------

class EvictPolicy(StragglerPolicy):
    """``--straggler-policy evict``: :class:`~.health.StragglerPolicy` detection, then
    :class:`EvictionBook`. The coordinator's :meth:`verdict` is :meth:`evaluate_alive`
    (it knows the live members and reads the requests: :attr:`needs`) and takes
    :attr:`evicted` out of the next epoch; the returned verdict never demotes (the
    evicted get state ``evicted`` in its scores)."""

    def __init__(self, config: StragglerConfig | None = None, eviction: EvictionConfig | None = None) -> None:
        super().__init__(config)
        self.book = EvictionBook(eviction)
        self._seeded = False

    @property
    def evicted(self) -> dict[str, Eviction]:
        return dict(self.book.evicted)

    @property
    def readmitted(self) -> set[str]:
        """Members evicted at some point and let back in (for the epoch's cause)."""
        return set(self.book.back)

    @property
    def needs(self) -> PolicyNeeds:
        return PolicyNeeds(health=True, epoch=True, readmit_requests=True, scores=True)

    def verdict(self, records: Mapping[str, HealthRecord], epoch: EpochView | None, alive: Collection[str],
                requests: Mapping[str, int]) -> Verdict:
        return self.evaluate_alive(records, epoch, alive, requests)

    def evaluate_alive(self, records: Mapping[str, HealthRecord], epoch: Epoch | EpochView | None,
                       alive: Collection[str], requests: Mapping[str, int], now: float | None = None) -> Verdict:
        from resilient.coordinator.epoch_view import view_of   # epoch.py reaches this module lazily

        now = time.time() if now is None else now
        view = None if epoch is None else view_of(epoch)
        if view is not None and not self._seeded:
            self._seeded = True
            seen = view.extras.get("evicted") or {}
            self.book.seed(seen if isinstance(seen, dict) else {}, alive)
        recs: dict[str, HealthRecord] = {}
        for m, r in records.items():   # probation: only windows of the re-admission epoch on
            since = self.book.probation_epoch(m)
            try:
                if since is not None and int(r.get("epoch", 0)) < since:
                    continue
            except (TypeError, ValueError, AttributeError):
                continue
            recs[m] = r
        v = super().evaluate(recs, view, now)
        ring: Container[str] = view if view is not None else ()
        _, _, refused = self.book.update(v.demoted, alive, requests, ring, view.number if view else 0, now)
        for m in refused:   # over the cap: not a leaf either, back to ok (like the detector's own cap)
            st = self.detector.members.get(m)
            if st is not None:
                st.state, st.slow_run, st.clear_run = OK, 0, 0
        scores: dict[str, ScoreRow] = {m: s for m, s in v.scores.items() if m not in refused}
        for m in refused:
            scores[m] = {**v.scores.get(m, ScoreRow()), "state": OK}
        for m, ev in self.book.evicted.items():
            scores[m] = {**(v.scores.get(m) or ScoreRow(score=None)), "state": EVICTED,
                         "until": round(ev.until, 3), "hold_s": ev.hold_s}
        return Verdict(demoted=frozenset(), avoid=v.avoid, scores=dict(sorted(scores.items())))


if TYPE_CHECKING:  # pragma: no cover - a static check that it implements the protocol
    _conforms: type[HealthPolicy] = EvictPolicy
