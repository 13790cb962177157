"""Node health summaries (docs/scale.md, "Hierarchical health"): a node agent collects its
ranks' health windows and writes one ``health/<node>`` summary **when something
changed**, within a write budget shared by the whole job.

A summary (version 3) holds each rank's latest window in compact form::

    {"v": 3, "node": "n7", "at": 1718000000.0,          # wall time of the write
     "ranks": {"n7-g0": [epoch, seq, age_s, ops, window_s, wait_s, run], ...}}

``age_s``: how long before ``at`` the window closed; ``wait_s``: the window's seconds
blocked on receives, summed over peers (all the detector uses of them); ``run``: how
many of the rank's windows, ending with this one, stayed within :attr:`SummaryPolicy.
deadband` of the first of them and in one epoch — the straggler detector counts that
many windows (``coordinator/straggler.py``), so a summary written seconds after the
windows it stands for loses none of them. An eighth element, when present, is the
window's ``link_bps`` ({peer: bytes/s}). :func:`parse_summary` validates a summary
and expands it into per-member records (``run`` set), which the detector treats as
current while the summary exists: it lives on the node lease, so it goes with the node.

**When a summary is written** (:class:`SummaryPolicy`). Each rank window is scored
against its node: ``local = (busy_s - node median busy_s) / node median op_s`` (the
detector's score, with the node's ranks as the reference; ``busy_s``/``op_s`` as in
:func:`~.straggler.window_features`), and the node has a *level*, its median
``busy_s / op_s``. Writes are paid from the node's token bucket: ``burst`` tokens,
refilled at ``budget / nodes`` per second, where ``nodes`` is the job's node count (the
agent learns it from the epochs it relays, :meth:`NodeHealthAggregator.set_job_size`).
Two kinds of change:

* **significant**: a rank's local score moved by at least ``shift`` (default 0.10, the
  detector's slow shift) from the one last written (a rank never written counts from
  0), in two consecutive windows within ``deadband`` of each other (one window that far
  off is noise far more often than a straggler: at 100,000 ranks a window a second, a
  window beyond 3.3 standard deviations comes about 100 times a second). The summary is written
  at once, with any token: a rank that turns slow is written at its second slow window
  (the detector acts on three), and likewise when it recovers. A rank whose written
  score moved by ``shift`` (by this or any other write) is then *followed* for
  ``follow_windows`` windows: written again whenever it has ``confirm_windows`` windows
  unwritten, so the detector's consecutive-window rules (probe, demote, release) advance
  as they would with every window;
* **minor**: a rank's local score moved by ``deadband`` (0.05, the detector's release
  shift) and that is not significant, the node's level moved by ``deadband``, a link speed
  left the ``link_band`` around the one last written, a rank left, or the node's first
  summary. Written at a random time within the next ``nodes / budget`` seconds, and only
  from a full bucket: the ``burst - 1`` tokens below it stay for significant changes.

The bucket starts full. A job's first summaries are minor changes, so they reach etcd
spread over the first ``nodes / budget`` seconds, at about ``budget`` writes/s, not from
every node together; so do the minor writes after a change every node sees at once (a
new phase of the training loop, network congestion). No two summaries of a node come
within ``min_gap`` seconds. A due summary that finds no token waits for one; ``run`` keeps the windows it
stands for. So the job's summaries stay at or under ``budget`` writes/s on average
whatever the windows do (none while nothing changes), a node writes at most ``burst``
in a burst, and a rank turning slow is written at once unless its node spent its
reserve on significant changes within the last ``(burst - 1) * nodes / budget`` s.

Failure behaviour: :meth:`NodeHealthAggregator.add` never raises (a window without a
valid member id is dropped and logged); :meth:`~NodeHealthAggregator.flush` and the
calls that may flush raise what the store raises and keep the summary due (the next
window or :meth:`~NodeHealthAggregator.tick` tries again); :func:`parse_summary` raises
:class:`~resilient.errors.RecordError` naming the field.
"""
from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

from resilient.coordinator import keys, records
from resilient.coordinator.link_classes import LINK_LABEL, SPEED_BAND
from resilient.coordinator.store import Store
from resilient.coordinator.straggler import HealthRecord, median, window_features
from resilient.errors import ConfigError

log = logging.getLogger(__name__)

#: version of a node summary record
SUMMARY_VERSION = 3
#: fields of a rank's row in a summary, in order (an optional eighth: ``link_bps``)
ROW_FIELDS = ("epoch", "seq", "age_s", "ops", "window_s", "wait_s", "run")
#: largest ``run`` a summary carries (the detector counts at most its own caps)
MAX_RUN = 1 << 20


@dataclass(frozen=True)
class SummaryPolicy:
    """When a node writes its summary (see the module docstring). ``budget``: summary
    writes per second for the whole job; ``burst``: a node's token bucket; ``min_gap``:
    seconds between two summaries of one node; ``shift``/``deadband``: a change of a
    rank's local score that is significant / minor (fractions of an op period;
    ``deadband`` also for the node's level); ``confirm_windows``/``follow_windows``: a
    followed rank's summary is written every ``confirm_windows`` windows, for
    ``follow_windows`` windows after its change; ``link_band``: a relative change of a
    measured link speed that counts."""

    budget: float = 10.0
    burst: float = 5.0
    min_gap: float = 1.0
    shift: float = 0.10
    deadband: float = 0.05
    confirm_windows: int = 3
    follow_windows: int = 12
    link_band: float = SPEED_BAND

    def validate(self) -> None:
        """Raise :class:`~resilient.errors.ConfigError` naming a value out of range."""
        if not (math.isfinite(self.budget) and self.budget > 0):
            raise ConfigError(f"--health-write-budget must be > 0 writes/s, got {self.budget}")
        if not (math.isfinite(self.burst) and self.burst >= 1):
            raise ConfigError(f"health write burst must be >= 1, got {self.burst}")
        if not (math.isfinite(self.min_gap) and self.min_gap >= 0):
            raise ConfigError(f"--node-health-interval must be >= 0 seconds, got {self.min_gap}")
        if not 0 < self.deadband <= self.shift < 1 or not 0 < self.link_band <= 10:
            raise ConfigError(f"health thresholds need 0 < deadband ({self.deadband}) <= shift ({self.shift}) "
                              f"< 1 and a link band in (0, 10] (got {self.link_band})")
        if self.confirm_windows < 1 or self.follow_windows < 0:
            raise ConfigError(f"confirm_windows must be >= 1 and follow_windows >= 0, got "
                              f"{self.confirm_windows} and {self.follow_windows}")


class _Rank:
    """One rank's latest window and what the policy knows of it."""

    __slots__ = ("window", "feat", "score", "run", "anchor", "written", "links_written", "unwritten", "follow")

    def __init__(self, window: HealthRecord) -> None:
        self.window = window
        self.feat: tuple[float, float] | None = None   # (busy_s, op_s) of a usable window
        self.score: float | None = None                # local score of the latest window
        self.run = 0
        #: (local score, node level, epoch) of the run's first window
        self.anchor: tuple[float, float, object] | None = None
        self.written: float | None = None              # local score last written (None: never)
        self.links_written: dict[str, float] = {}
        self.unwritten = 0                             # windows since the last write
        self.follow = 0                                # windows left to follow


class NodeHealthAggregator:
    """The node agent's health aggregator (see the module docstring). ``clock``:
    monotonic seconds (the policy's timing); ``wall``: wall seconds (the summary's ``at``);
    ``rng``: the minor writes' random delays (default: seeded by the node id). ``writes`` counts summaries written; ``deferred`` counts the checks
    that found a summary due but no token for it."""

    def __init__(self, store: Store, job: str, node: str, lease_id: int | None,
                 policy: SummaryPolicy | None = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, rng: random.Random | None = None) -> None:
        self.store, self.job, self.node, self.lease_id = store, job, keys.check_name("node id", node), lease_id
        self.policy = policy or SummaryPolicy()
        self.policy.validate()
        self._clock, self._wall = clock, wall
        self._rng = rng or random.Random(node)
        self._ranks: dict[str, _Rank] = {}
        self._nodes = 1
        self._tokens = self.policy.burst
        self._refilled = clock()
        self._last_write = -math.inf
        self._level_written: float | None = None
        self._urgent = False
        self._minor_at: float | None = None    # when a minor change becomes due
        self.writes = 0
        self.deferred = 0

    # -- the job's size -------------------------------------------------------------------

    def set_job_size(self, nodes: int) -> None:
        """The job's node count (from the epochs; at least 1): the node's share of the
        budget is ``budget / nodes`` writes/s, a minor write's delay up to ``nodes /
        budget`` s."""
        self._refill()
        self._nodes = max(1, int(nodes))

    @property
    def spread(self) -> float:
        """Seconds over which minor writes are spread (``nodes / budget``)."""
        return self._nodes / self.policy.budget

    def _refill(self) -> None:
        now = self._clock()
        rate = self.policy.budget / self._nodes
        self._tokens = min(self.policy.burst, self._tokens + max(0.0, now - self._refilled) * rate)
        self._refilled = now

    # -- windows --------------------------------------------------------------------------

    def add(self, record: HealthRecord) -> bool:
        """Take one rank window; True if the summary is due now (token and gap allowing)."""
        member = record.get("member")
        st = self._ranks.get(member) if isinstance(member, str) else None
        if st is None:   # a rank not seen yet: its id is checked once
            if not isinstance(member, str) or not records.is_id(member):
                log.warning("node %s: dropped a health window without a valid member id", self.node)
                return False
            st = self._ranks[member] = _Rank(record)
        p = self.policy
        st.window = record
        st.unwritten += 1
        f = window_features(record)
        st.feat = (f[0], f[1]) if f is not None else None
        med = self._medians()
        if st.feat is None or med is None:
            st.score, st.run, st.anchor = None, 0, None
        else:
            score = (st.feat[0] - med[0]) / med[1] if med[1] > 0 else 0.0
            level = med[0] / med[1] if med[1] > 0 else 0.0
            st.score = score
            epoch = record.get("epoch")
            a = st.anchor
            if a is None or abs(score - a[0]) > p.deadband or abs(level - a[1]) > p.deadband or epoch != a[2]:
                a, st.run = (score, level, epoch), 1
                st.anchor = a
            else:
                st.run = min(MAX_RUN, st.run + 1)
            ref = st.written if st.written is not None else 0.0
            moved = abs(score - ref)
            if moved >= p.shift and st.run >= 2 and abs(a[0] - ref) >= p.shift:   # it persists
                self._urgent = True
                st.follow = p.follow_windows
            elif st.follow > 0:
                st.follow -= 1
                if st.unwritten >= p.confirm_windows:
                    self._urgent = True
            elif moved >= p.deadband:
                self._minor()
            if self._level_written is None or abs(level - self._level_written) >= p.deadband:
                self._minor()
        if self._links_moved(st):
            self._minor()
        return self._due()

    def _medians(self) -> tuple[float, float] | None:
        feats = [r.feat for r in self._ranks.values() if r.feat is not None]
        if not feats:
            return None
        return median([x[0] for x in feats]), median([x[1] for x in feats])

    def _links_moved(self, st: _Rank) -> bool:
        rates = st.window.get(LINK_LABEL)
        if not isinstance(rates, Mapping):
            return False
        band = 1.0 + self.policy.link_band
        for peer, v in rates.items():
            old = st.links_written.get(peer)
            if isinstance(v, (int, float)) and v > 0 and (old is None or not old / band <= v <= old * band):
                return True
        return False

    def _minor(self) -> None:
        if self._minor_at is None:
            self._minor_at = self._clock() + self._rng.uniform(0.0, self.spread)

    def drop(self, member: str) -> None:
        """Forget a rank that left the node (a minor change: its window goes from the
        next summary)."""
        if self._ranks.pop(member, None) is not None:
            self._minor()

    # -- writing --------------------------------------------------------------------------

    def _due(self) -> bool:
        """Whether a summary should be written now (a change, a token for it, the gap)."""
        now = self._clock()
        minor = self._minor_at is not None and now >= self._minor_at
        if not (self._urgent or minor) or now - self._last_write < self.policy.min_gap:
            return False
        self._refill()
        if self._tokens >= (1.0 if self._urgent else self.policy.burst - 1e-9):   # minor: a full bucket
            return True
        self.deferred += 1
        return False

    def maybe_flush(self, record: HealthRecord) -> bool:
        """``add`` and, when due, ``flush``; True if a summary was written."""
        if self.add(record):
            self.flush()
            return True
        return False

    def tick(self) -> bool:
        """Write the summary if it is due by now (a minor change's time came, a token
        arrived); True if written. The agent calls this between windows."""
        if self._due():
            self.flush()
            return True
        return False

    def summary(self) -> dict[str, object]:
        """The summary as :meth:`flush` would write it now."""
        at = round(self._wall(), 3)
        ranks: dict[str, list[object]] = {}
        for m, st in self._ranks.items():
            w = st.window
            waits = w.get("wait_s") or {}
            row: list[object] = [int(w.get("epoch", 0)), int(w.get("seq", 0)),
                                 round(max(0.0, at - float(w.get("at", at))), 3), int(w.get("ops", 0)),
                                 round(float(w.get("window_s", 0.0)), 6),
                                 round(sum(float(v) for v in waits.values()), 6), st.run]
            links = w.get(LINK_LABEL)
            if isinstance(links, Mapping) and links:
                row.append(dict(links))
            ranks[m] = row
        return {"v": SUMMARY_VERSION, "node": self.node, "at": at, "ranks": ranks}

    def flush(self) -> None:
        """Write the summary now (one put on the node lease) and take a token. Raises
        what the store raises; the summary then stays due."""
        body = json.dumps(self.summary(), separators=(",", ":")).encode()
        self.store.put(keys.health_of(self.job, self.node), body, lease=self.lease_id)
        self._refill()
        self._tokens = max(0.0, self._tokens - 1.0)
        self._last_write = self._clock()
        self.writes += 1
        med = self._medians()
        if med is not None:
            self._level_written = med[0] / med[1] if med[1] > 0 else 0.0
        for st in self._ranks.values():
            if st.score is not None:
                if abs(st.score - (st.written if st.written is not None else 0.0)) >= self.policy.shift:
                    st.follow = self.policy.follow_windows   # a large change written (by any write): follow it
                st.written = st.score
            rates = st.window.get(LINK_LABEL)
            st.links_written = {str(k): float(v) for k, v in rates.items()} if isinstance(rates, Mapping) else {}
            st.unwritten = 0
        self._urgent, self._minor_at = False, None


def parse_summary(raw: bytes, key: str = "") -> dict[str, HealthRecord]:
    """Validate a version-3 summary and expand it into per-member records (``v`` 1,
    ``member``, ``epoch``, ``seq``, ``at`` (the summary's ``at`` less the row's age),
    ``ops``, ``window_s``, ``wait_s`` as ``{"*": total}``, ``run``, and ``link_bps`` when
    present). Rules: ``node`` an id, ``at`` a finite number >= 0, each rank an id mapped
    to a list of 7 or 8 elements — ``epoch``, ``seq``, ``ops``, ``run`` integers in
    [0, 2**63) (``run`` at most :data:`MAX_RUN`), ``age_s``, ``window_s``, ``wait_s``
    finite numbers >= 0, the eighth an id -> finite number >= 0 map. Raises
    :class:`~resilient.errors.RecordError` naming the field."""
    return summary_records(records.fields("health", raw, key), key)


def summary_records(f: records.Fields, key: str = "") -> dict[str, HealthRecord]:
    """:func:`parse_summary` of a record already loaded as :class:`~.records.Fields`."""
    if f.int("v") != SUMMARY_VERSION:
        f.fail(f"field 'v' is {f.d.get('v')!r}, not {SUMMARY_VERSION} (a node summary)")
    f.name("node")
    at = f.float("at", lo=0.0)
    ranks = f.obj("ranks")
    out: dict[str, HealthRecord] = {}
    for member, row in ranks.by_name():
        if not isinstance(row, list) or len(row) not in (len(ROW_FIELDS), len(ROW_FIELDS) + 1):
            f.fail(f"ranks.{member} is not a list of {len(ROW_FIELDS)} or {len(ROW_FIELDS) + 1} elements "
                   f"({', '.join(ROW_FIELDS)}[, link_bps])")
        named = records.Fields("health", dict(zip(ROW_FIELDS, row)), key, f"ranks.{member}")
        rec: dict[str, object] = {
            "v": 1, "member": member, "epoch": named.int("epoch"), "seq": named.int("seq"),
            "at": round(at - named.float("age_s", lo=0.0), 3), "ops": named.int("ops"),
            "window_s": named.float("window_s", lo=0.0), "wait_s": {"*": named.float("wait_s", lo=0.0)},
            "run": named.int("run", hi=MAX_RUN)}
        if len(row) > len(ROW_FIELDS):
            rec[LINK_LABEL] = records.Fields("health", {LINK_LABEL: row[-1]}, key, f"ranks.{member}").float_map(
                LINK_LABEL, lo=0.0)
        out[member] = cast(HealthRecord, rec)   # every field was checked above
    return out
