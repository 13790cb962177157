"""The coordinator's pass state: its configuration, the records one pass reads and the
epoch it last published, the members whose records changed since, and the garbage-collector
pause around its O(N) steps. :class:`~resilient.coordinator.service.Coordinator` owns the
loop that fills and uses them (this module has no etcd I/O of its own).

Failure behaviour: :meth:`CoordinatorConfig.validate` raises
:class:`~resilient.errors.ConfigError` naming the setting; the rest are plain records.
"""
from __future__ import annotations

import bisect
import gc
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Set
from contextlib import contextmanager
from dataclasses import dataclass, field
from resilient.coordinator import keys, records
from resilient.coordinator.delta import EpochDelta, EpochState
from resilient.coordinator.decide import Entry, HealthOutcome, Snapshot, decide
from resilient.coordinator.epoch import Epoch
from resilient.coordinator.epoch_view import EpochIndex, EpochView, StateView
from resilient.coordinator.health_cache import HealthCache
from resilient.coordinator.link_classes import LINK_LABEL, SPEED_BAND
from resilient.coordinator.planner import plan
from resilient.coordinator.straggler import HealthRecord
from resilient.errors import ConfigError, RecordError


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for one step of the coordinator's (a pass,
    a directory reload, a snapshot), then resumed as it was. Such a step at scale builds
    O(N) objects that either live on (the directory, the epoch's state) or are freed by
    reference counting when it ends (records being encoded, sets of ids); a collection in
    between only rescans the whole heap: at 12,500 nodes, 100,000 members, the first
    epoch's pass set off 4-6 full collections of 0.1-0.36 s each, more than the pass's
    own work (docs/scale.md). Nothing is lost: what the step leaves is collected after it.
    The switch is process-wide (another thread's allocations meanwhile wait for the next
    collection too); if the collector was already off it stays off."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclass
class CoordinatorConfig:
    """Tunables. ``ttl``: leader lease seconds (takeover time after a leader dies);
    ``debounce``: seconds to wait after a loss/suspicion before publishing; ``join_debounce``:
    after a join (restarted by each further join, at most 4x); ``min_members``: members
    needed before the first epoch; ``resync_interval``: period of a reconcile pass without
    events (it reads only the small ``epoch``, ``suspects/`` and ``departed/`` keys: the
    member directory is kept from the watch); ``reload_interval``: period of a full, paged
    re-read of ``members/`` and ``nodes/`` (a safety net); ``delta_min_members``: from this
    many members on, epochs are published as deltas with chunked snapshots
    (:mod:`.delta`; below it, as one full record); ``measure_links``: plan with the
    cross-host link speeds the health reporters measure (``link_bps`` in the ``health/``
    records; a delta epoch carries the speeds that changed), changed only when a
    measurement leaves the band ``link_band`` around the published speed
    (:func:`.link_classes.settle_speeds`); ``link_measure_interval``: from
    ``delta_min_members`` on, link speeds are measured at most this often (from the
    records that carry them, kept with the others from a watch on ``health/``,
    :class:`.health_cache.HealthCache`; below it, every pass)."""

    ttl: float = 5.0
    debounce: float = 0.02
    join_debounce: float = 0.25
    min_members: int = 1
    resync_interval: float = 1.0
    suspect_interval: float = 0.25
    reload_interval: float = 30.0
    delta_min_members: int = 1024
    measure_links: bool = True
    link_band: float = SPEED_BAND
    link_measure_interval: float = 5.0

    def validate(self) -> None:
        for name, value in (("ttl", self.ttl), ("resync_interval", self.resync_interval),
                            ("suspect_interval", self.suspect_interval), ("reload_interval", self.reload_interval)):
            if value <= 0:
                raise ConfigError(f"coordinator {name} must be > 0, got {value}")
        for name, value in (("debounce", self.debounce), ("join_debounce", self.join_debounce)):
            if value < 0:
                raise ConfigError(f"coordinator {name} must be >= 0, got {value}")
        if self.link_measure_interval < 0:
            raise ConfigError(f"coordinator link_measure_interval must be >= 0, got {self.link_measure_interval}")
        if not 0 < self.link_band <= 10:
            raise ConfigError(f"coordinator link_band must be in (0, 10] (0.25: a 25 % change), got {self.link_band}")
        if self.min_members < 1:
            raise ConfigError(f"--min-members must be >= 1, got {self.min_members}")


def _old_positions(pub: "_Published", added: Set[str]) -> Callable[[str], int | None]:
    """An old member's position among the old members of ``pub`` in its order (what the
    join agreement's tree is built on), None for any other id: from the full record's
    member list, or by lookup on the delta state's ring (O(log N) each: the ring's order
    is the epoch's, property-tested in tests/test_scale_straggler.py)."""
    if pub.epoch is not None:
        index = {m: i for i, m in enumerate(m for m in pub.epoch.members if m not in added)}
        return index.get
    view = pub.view()
    before = sorted(view.position(m) for m in added if m in view)   # the joiners' ring positions

    def position(m: str) -> int | None:
        if m in added or m not in view:
            return None
        p = view.position(m)
        return p - bisect.bisect_left(before, p)
    return position


def _still_alive(h: HealthOutcome, alive: Mapping[str, Entry]) -> HealthOutcome:
    """A health verdict with the members no longer alive left out of its demotions and
    avoided links (its evictions and re-admissions are the policy's, kept as they are)."""
    return HealthOutcome({m for m in h.demoted if m in alive}, [p for p in h.avoid if p[0] in alive and p[1] in alive],
                         h.evicted, h.readmitted, h.leaf_deadline_ms)


def _hosts_named(records: Mapping[str, HealthRecord], alive: Mapping[str, Entry]) -> dict[str, str]:
    """The host of every live member a health record names (its writer and the peers it
    measured): O(records), not O(members) (``alive`` may be the live directory: looked up)."""
    names = set(records)
    for rec in records.values():
        rates = rec.get(LINK_LABEL) if isinstance(rec, Mapping) else None
        if isinstance(rates, Mapping):
            names.update(k for k in rates if isinstance(k, str))
    hosts: dict[str, str] = {}
    for m in names:
        entry = alive.get(m)
        if entry is not None:
            hosts[m] = entry[0].host
    return hosts


@dataclass
class _Pending:
    urgent_at: float | None = None      # monotonic time of the first unhandled loss/suspicion
    join_first: float | None = None
    join_last: float | None = None
    lost_seen: dict[str, float] = field(default_factory=dict)   # member -> wall time the delete was seen
    join_seen: dict[str, float] = field(default_factory=dict)


@dataclass
class _Published:
    """What the coordinator knows of the current epoch (kept between passes)."""

    number: int
    members: set[str]
    state: EpochState
    form: str                      # "full" | "delta"
    snapshot: int = 0
    body: bytes = b""              # the record as written (matched against the key)
    revision: int = 0              # mod revision of the epoch key, once read back
    epoch: Epoch | None = None     # the full Epoch when known (full form, or derived)
    delta: EpochDelta | None = None
    _view: EpochIndex | None = None

    def full_epoch(self) -> Epoch:
        """The full :class:`~.epoch.Epoch` (derived from the delta once, when needed); a
        delta that no longer yields its plan hash raises :class:`RecordError`."""
        if self.epoch is None:
            if self.delta is None:   # not reached: a full-form record always carries its Epoch
                raise RecordError(f"epoch {self.number} is held without its record", "epoch")
            self.epoch = self.state.to_epoch(self.delta)
        return self.epoch

    def view(self) -> EpochView:
        """The epoch as a health policy reads it (:mod:`.epoch_view`): the incremental
        ring of a delta epoch (O(avoided links · log N) to build); a full record indexed
        once (cached)."""
        if self.form == "delta":
            return StateView(self.state, self.number)   # the state changes in place: never cached
        if self._view is None:
            self._view = EpochIndex(self.full_epoch())
        return self._view


@dataclass(frozen=True)
class _PassRead:
    """What :meth:`Coordinator._read_pass` hands to :meth:`Coordinator._write_pass`: the
    snapshot :func:`.decide.decide` judges, plus the write side's own context."""

    snapshot: Snapshot
    pub: _Published | None
    erev: int                      # mod revision of the epoch key (0: absent)
    corrupt: RecordError | None    # the epoch key holds a malformed record
    marks: dict[str, int]          # the dirty marks this pass consumes when done
    full: bool
    suspects_pending: bool


class _DirtyMarks:
    """Member ids whose directory entry changed since they were last reconciled.

    A pass works from a :meth:`snapshot` and consumes it when done; an id
    marked again meanwhile (its watch event landed mid-pass) stays marked, so the next
    pass sees the change. (A plain set minus the snapshot would drop it: the id was
    already in the snapshot, and the pass compared the entry from before the event.)"""

    def __init__(self) -> None:
        self._marks: dict[str, int] = {}
        self._seq = 0

    def mark(self, ids: Iterable[str]) -> None:
        for m in ids:
            self._seq += 1
            self._marks[m] = self._seq

    def snapshot(self) -> dict[str, int]:
        return dict(self._marks)

    def consume(self, snapshot: dict[str, int]) -> None:
        for m, seq in snapshot.items():
            if self._marks.get(m) == seq:
                del self._marks[m]

    def __len__(self) -> int:
        return len(self._marks)


def default_coordinator_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}".replace("_", "-")[:100]
