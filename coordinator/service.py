"""The coordinator: leader-elected, it turns membership changes into epochs.

Any number of coordinators may run for one job; one leads (:mod:`.election`), the others
wait to take over. The leader:

1. watches ``members/`` and ``suspects/`` (reconnecting watches, resumed from the last
   revision, so nothing is missed across an etcd restart) and also re-reads everything
   every ``resync_interval`` seconds as a safety net;
2. on a change, waits a short debounce (``debounce``, tens of ms, for losses and
   suspicions; ``join_debounce`` for joins, so 8 workers starting together yield one
   epoch) and then **reconciles**: reads members, the current epoch, suspect reports
   (judged by the :class:`~.policy.LivenessPolicy`), ``departed/`` markers and the
   :class:`~.policy.HealthPolicy`'s verdict and the link speeds the health reporters
   measured (:func:`.link_classes.speeds_from_health`) into a :class:`~.decide.Snapshot`, lets the
   pure :func:`.decide.decide` say what to publish — deterministic given the member set
   and health: the ring and tree come from :func:`.planner.plan` — and
3. publishes it with one transaction that compares the ``epoch`` key's mod revision
   (CAS on epoch n) **and** the ``leader`` key's create revision (we still lead). A
   deposed leader's transaction fails; it steps down without writing anything. A failed
   CAS with leadership intact (a retried write that had applied) just reconciles again,
   so numbers stay consecutive, with no duplicate and none skipped, across handovers.

Suspect reports are confirmed against lease state: only if the suspect's lease has gone
unrefreshed for at least two keep-alive intervals (or is gone) is it removed (its lease is
revoked). A suspect whose lease stays fresh for its TTL is dismissed.

Failure behaviour: etcd unreachable → the loop logs, keeps its leadership claim (etcd will
judge it by the lease on return) and retries; ``/healthz`` turns 503 after
``retry_timeout`` without a successful read. Malformed records (:mod:`.records`) are
skipped, logged and counted (``resilient_bad_records_total{kind}``); a malformed
``epoch`` record is published over (cause ``repaired``, numbered after the highest
``epochs/<n>/``, see :meth:`Coordinator._repair_number`) and ``/healthz`` names it.
Any other failure of a pass is logged and retried; when passes keep failing, ``/healthz``
turns 503 naming the exception instead of blaming etcd. The leader lease expiring (process hung) →
another coordinator takes over after about one ``ttl``; SIGTERM → resign at once.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import threading
import time
from collections.abc import Collection, Mapping
from resilient.coordinator import keys, records
from resilient.coordinator.delta import (
    CHUNK_MEMBERS, SNAPSHOT_EVERY, SPEEDS_FIELD, EpochDelta, EpochState, is_delta, parse_delta, resolve, snapshot_chunks, snapshot_meta, speed_changes,
)
from resilient.coordinator.decide import Decision, Entry, EpochFacts, HealthOutcome, Snapshot, decide
from resilient.coordinator.directory import Directory
from resilient.coordinator.election import LeaderElection
from resilient.coordinator.epoch import Epoch, EpochData, EpochPlan, latest_valid_history
from resilient.coordinator.epoch_view import EpochView
from resilient.coordinator.eviction import read_requests
from resilient.coordinator.health import no_demotion, write_scores
from resilient.coordinator.health_cache import HealthCache
from resilient.coordinator.link_classes import parse_speeds, speeds_from_health
from resilient.coordinator.liveness import LeaseLiveness
from resilient.coordinator.metrics import CoordinatorMetrics
from resilient.coordinator.planner import plan
from resilient.coordinator.policy import HealthPolicy, LivenessPolicy, SuspectCase
from resilient.coordinator.shares import SharePublisher
from resilient.coordinator.store import Compare, Delete, Put, Store, WatchEvent, WatchHandle
from resilient.coordinator.straggler import HealthRecord, HealthRecords
from resilient.errors import RecordError, StoreError, StoreUnavailable
# the pass state lives in pass_state.py; CoordinatorConfig and the rest stay importable from here
from resilient.coordinator.pass_state import (  # noqa: F401 - re-exported
    CoordinatorConfig, _DirtyMarks, _hosts_named, _old_positions, _PassRead, _Pending, _Published, _still_alive,
    collector_paused, default_coordinator_id,
)

__all__ = ["Coordinator", "CoordinatorConfig", "RELOAD_DUTY", "collector_paused", "default_coordinator_id"]

log = logging.getLogger(__name__)

#: the most of its time the coordinator spends in periodic directory reloads (see _reload)
RELOAD_DUTY = 0.05


class Coordinator:
    """One coordinator process's logic. ``run(stop)`` blocks until ``stop`` is set."""

    def __init__(self, store: Store, job: str, coordinator_id: str | None = None,
                 config: CoordinatorConfig | None = None,
                 health_policy: HealthPolicy = no_demotion,
                 metrics: CoordinatorMetrics | None = None,
                 liveness_policy: LivenessPolicy | None = None) -> None:
        self.store = store
        self.job = keys.check_name("job name", job)
        self.id = keys.check_name("coordinator id", coordinator_id or default_coordinator_id())
        self.config = config or CoordinatorConfig()
        self.config.validate()
        #: whom to demote, evict or re-admit (coordinator/policy.py)
        self.health_policy: HealthPolicy = health_policy
        #: when a suspected member is dead (coordinator/liveness.py)
        self.liveness_policy: LivenessPolicy = liveness_policy or LeaseLiveness()
        self.metrics = metrics or CoordinatorMetrics()
        self.election = LeaderElection(store, job, self.id, self.config.ttl)
        self._cond = threading.Condition()
        self._pending = _Pending()
        self._last_ok = time.monotonic()
        self._running = False
        self.published: list[int] = []   # epoch numbers this process published
        self.reconciles = 0                # completed reconcile passes (tests wait on it)
        self._last_scores: tuple[dict[str, str], float] = ({}, 0.0)
        #: what is wrong with the job's records, for /healthz and logs (None: nothing)
        self._epoch_problem: str | None = None
        #: the last reconcile failure that was not etcd being unreachable
        self._last_error: str | None = None
        #: speed-weighted batch shares, published after each pass (coordinator/shares.py)
        self.shares = SharePublisher(store, self.job)
        self._dir = Directory(self.job)
        #: member ids whose directory entry changed since they were last reconciled
        self._dirty = _DirtyMarks()
        self._full_pass = True         # next pass compares the whole directory with the epoch
        self._measured_at = -math.inf  # monotonic time link speeds were last read from health/
        #: the ``health/`` records, kept from a watch (opened on first use; one per term)
        self._health = HealthCache(store, self.job)
        #: the last health verdict (a membership pass publishes with it, _read_pass)
        self._health_last: HealthOutcome | None = None
        self._reload_due = True        # next pass re-reads the directory (paged)
        self._pub: _Published | None = None
        self._admitted_epoch = -1   # the newest epoch whose admission is known agreed (_admitting)
        self._members_copy: tuple[int, dict[str, Entry]] = (-1, {})
        self._next_reload = 0.0
        #: ops of the last publishing transaction (bench/scale.py counts writes)
        self.last_publish_ops = 0
        self.snapshots_written = 0

    # -- public ---------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        return self.election.is_leader

    def healthy(self) -> tuple[bool, str]:
        if not self._running:
            return False, "coordinator loop not running"
        age = time.monotonic() - max(self._last_ok, self.election.last_contact)
        if age > max(self.store.retry_timeout, 3 * self.config.resync_interval) + 1:
            if self._last_error:
                return False, f"reconcile failing for {age:.0f}s: {self._last_error}"
            return False, f"no successful etcd read for {age:.0f}s"
        state = "ok leader" if self.is_leader else "ok standby"
        return True, f"{state}; {self._epoch_problem}" if self._epoch_problem else state

    def run(self, stop: threading.Event) -> None:
        """Campaign, lead, and campaign again after losing leadership, until ``stop``;
        then resign so a standby takes over at once. etcd becoming unreachable as a term
        begins (the directory's first load is not inside a pass's retry) ends that term,
        not the process: the coordinator steps down and campaigns again."""
        self._running = True
        try:
            while not stop.is_set():
                if not self.election.campaign(stop):
                    break
                self._last_ok = time.monotonic()
                self.metrics.is_leader.set(1)
                try:
                    self._lead(stop)
                except StoreUnavailable as exc:
                    log.warning("coordinator %s: etcd unreachable while taking over, campaigning again: %s",
                                self.id, exc)
                    stop.wait(0.5)
                finally:
                    self.metrics.is_leader.set(0)
                    if not stop.is_set():
                        self.election.step_down()
        finally:
            self.election.resign()
            self._running = False

    # -- leading --------------------------------------------------------------------------

    def _on_member_events(self, events: list[WatchEvent]) -> None:
        """Fold ``members/`` and ``nodes/`` events into the directory: O(change)."""
        now_wall, now = time.time(), time.monotonic()
        with self._cond:
            p = self._pending
            for ev in events:
                if ev.type == "resync":   # history compacted: re-read everything next pass
                    self._reload_due = True
                    p.urgent_at = p.urgent_at or now
                    continue
                changed = self._dir.apply([ev])
                self._dirty.mark(changed)
                for mid in changed:
                    if mid not in self._dir.members:
                        p.lost_seen.setdefault(mid, now_wall)
                        p.urgent_at = p.urgent_at or now
                    elif ev.create_revision == ev.mod_revision or self._pub is None or mid not in self._pub.members:
                        p.join_seen.setdefault(mid, now_wall)
                        p.lost_seen.pop(mid, None)
                if ev.type == "put" and changed & self._dir.members.keys():
                    p.join_first = p.join_first or now
                    p.join_last = now
            self._cond.notify_all()

    def _on_suspect_events(self, events: list[WatchEvent]) -> None:
        with self._cond:
            if any(ev.type != "delete" for ev in events):
                self._pending.urgent_at = self._pending.urgent_at or time.monotonic()
                self._cond.notify_all()

    def _due(self, now: float) -> float | None:
        """Monotonic time at which the pending changes should be reconciled, or None."""
        p, c = self._pending, self.config
        due = []
        if p.urgent_at is not None:
            due.append(p.urgent_at + c.debounce)
        if p.join_first is not None and p.join_last is not None:
            due.append(min(p.join_last + c.join_debounce, p.join_first + 4 * c.join_debounce))
        return min(due) if due else None

    def _reload(self) -> int:
        """Re-read the directory (paged) under the lock; returns the read's revision. The
        next periodic one is due after ``reload_interval`` or, if longer, after
        ``1 / RELOAD_DUTY`` times as long as this one took (a loss seen during a reload is
        published after it, so reloads are kept to a small share of the time)."""
        t0 = time.monotonic()
        with self._cond, collector_paused():
            changed, rev = self._dir.load(self.store)
            self._dirty.mark(changed)
            self._reload_due = False
            self._full_pass = True
            # a pass waits for a reload: at most RELOAD_DUTY of the time goes to them
            # (12,500 nodes read in 6-10 s at load 17: every 2-3 min instead of every 30 s)
            took = time.monotonic() - t0
            self._next_reload = time.monotonic() + max(self.config.reload_interval, took / RELOAD_DUTY)
        return rev

    def start_leading(self) -> list[WatchHandle]:
        """Load the directory and open the watches (returns their handles); the state of
        a previous term is dropped (another leader may have published meanwhile)."""
        self._pub = None
        self._admitted_epoch = -1   # the newest epoch whose admission is known agreed (_admitting)
        self._dir = Directory(self.job)
        self._dirty = _DirtyMarks()
        self._members_copy = (-1, {})   # keyed by the new directory's versions, which restart
        self._health.close()            # read afresh: a new term's first pass sees every record
        self._health_last = None
        rev = self._reload()
        return [
            self.store.watch_prefix(keys.members(self.job), rev + 1, self._on_member_events),
            self.store.watch_prefix(keys.nodes(self.job), rev + 1, self._on_member_events),
            self.store.watch_prefix(keys.suspects(self.job), rev + 1, self._on_suspect_events),
        ]

    def _lead(self, stop: threading.Event) -> None:
        watches = self.start_leading()
        next_resync = 0.0
        suspects_pending = False
        try:
            while not stop.is_set():
                if self.election.lost.is_set():
                    log.warning("coordinator %s: lost leadership", self.id)
                    return
                now = time.monotonic()
                with self._cond:
                    due = self._due(now)
                    wake = next_resync if due is None else min(due, next_resync)
                    if suspects_pending:
                        wake = min(wake, now + self.config.suspect_interval)
                    if wake > now:
                        self._cond.wait(min(wake - now, 0.5))
                        continue
                    p = self._pending
                    joins_due = p.join_first is not None and p.join_last is not None and min(
                        p.join_last + self.config.join_debounce, p.join_first + 4 * self.config.join_debounce) <= now
                    lost_seen, join_seen = dict(p.lost_seen), dict(p.join_seen)
                    self._pending = _Pending()
                    if not joins_due and p.join_first is not None:  # keep waiting for them
                        self._pending.join_first, self._pending.join_last = p.join_first, p.join_last
                        self._pending.join_seen = dict(p.join_seen)
                try:
                    if self._reload_due or time.monotonic() >= self._next_reload:
                        self._reload()
                    outcome, suspects_pending = self._reconcile(lost_seen, join_seen, joins_due)
                    self._last_ok = time.monotonic()
                    self._last_error = None
                    self.reconciles += 1
                    self.shares.after_pass(self._pub.members if self._pub is not None else None)
                except Exception as exc:   # never die on one pass: etcd down, or a record we did not foresee
                    if isinstance(exc, StoreUnavailable):
                        self._last_error = None
                        log.warning("coordinator %s: reconcile failed, retrying: %s", self.id, exc)
                    else:
                        self._last_error = f"{type(exc).__name__}: {exc}"
                        log.error("coordinator %s: reconcile failed, retrying: %s", self.id, self._last_error,
                                  exc_info=not isinstance(exc, StoreError))
                    with self._cond:  # keep what we saw for the retry
                        for k, v in lost_seen.items():
                            self._pending.lost_seen.setdefault(k, v)
                        for k, v in join_seen.items():
                            self._pending.join_seen.setdefault(k, v)
                        self._pending.urgent_at = self._pending.urgent_at or time.monotonic()
                    stop.wait(0.2)
                    continue
                if outcome == "deposed":
                    return
                if outcome == "joins_deferred":  # found by a resync: debounce them like events
                    with self._cond:
                        t = time.monotonic()
                        self._pending.join_first = self._pending.join_first or t
                        self._pending.join_last = self._pending.join_last or t
                if outcome == "retry":
                    with self._cond:
                        self._pending.urgent_at = time.monotonic() - self.config.debounce
                    continue
                next_resync = time.monotonic() + self.config.resync_interval
        finally:
            for w in watches:
                w.cancel()
            self._health.close()
            self.shares.stop()   # its rate watch: a standby keeps none open

    def _check_suspects(self, members: Mapping[str, Entry]) -> tuple[dict[str, float], list[str], bool]:
        """Judge the suspect reports (:attr:`liveness_policy`); a confirmed suspect's lease
        is revoked here. Returns (confirmed suspect -> earliest report time, report keys
        to delete, still pending)."""
        confirmed: dict[str, float] = {}
        consumed: list[str] = []
        pending = False
        reports: dict[str, list[tuple[str, float]]] = {}
        for kv in self.store.get_prefix(keys.suspects(self.job)):
            parts = kv.key[len(keys.suspects(self.job)):].split("/")
            try:
                if len(parts) != 2 or any(not records.is_id(p) for p in parts):
                    raise RecordError(f"bad suspect record at {kv.key}: the key is not suspects/<id>/<id>",
                                      "suspect", kv.key)
                at = records.timestamp("suspect", kv.value, kv.key)
            except RecordError as exc:   # a malformed report confirms nothing: dropped
                records.skip(exc, kv.key)
                consumed.append(kv.key)
                continue
            reports.setdefault(parts[0], []).append((kv.key, at))
        now = time.time()
        for suspect, items in reports.items():
            first = min(at for _, at in items)
            entry = members.get(suspect)
            lease = self.store.lease_ttl(entry[1]) if entry else None
            if entry is None or lease is None:
                consumed += [k for k, _ in items]    # gone anyway: its removal has its own cause
                continue
            remaining, granted = lease
            ruling = self.liveness_policy.judge(SuspectCase(first, remaining, granted, now))
            if ruling == "confirm":
                log.warning("suspect %s confirmed: lease unrefreshed (%.0fs of %.0fs left); revoking",
                            suspect, remaining, granted)
                self.store.revoke(entry[1])
                confirmed[suspect] = first
                consumed += [k for k, _ in items]
            elif ruling == "dismiss":
                log.info("suspect %s dismissed: its lease kept being refreshed", suspect)
                consumed += [k for k, _ in items]
            else:
                pending = True
        return confirmed, consumed, pending

    def _read_departed(self) -> tuple[dict[str, tuple[str, float]], list[str]]:
        """``departed/`` markers: (member or node id -> (key, wall time), malformed keys)."""
        departed: dict[str, tuple[str, float]] = {}
        bad_markers: list[str] = []
        for kv in self.store.get_prefix(keys.departed(self.job)):
            try:
                at = records.timestamp("departed", kv.value, kv.key)
            except RecordError as exc:   # no cause or timing from it; deleted with the stale markers
                records.skip(exc, kv.key)
                bad_markers.append(kv.key)
                continue
            departed[keys.last_segment(kv.key)] = (kv.key, at)
        return departed, bad_markers

    def _read_published(self) -> tuple["_Published | None", int, "RecordError | None", int]:
        """The current epoch as ``(published, mod revision, corruption, history top)``.
        One get of the small ``epoch`` key per pass; the record is parsed (and a delta
        resolved) only when it is not the one this coordinator holds."""
        kv = self.store.get(keys.epoch(self.job))
        if kv is None:
            self._pub = None
            return None, 0, None, 0
        pub = self._pub
        if pub is not None and (kv.mod_revision == pub.revision or (pub.revision == 0 and kv.value == pub.body)):
            pub.revision = kv.mod_revision
            return pub, kv.mod_revision, None, 0
        try:
            if is_delta(kv.value):
                d = parse_delta(kv.value, kv.key)
                have = pub.state if pub is not None else None
                state = resolve(self.store, self.job, d, have, kv.key)
                self._pub = _Published(d.number, set(state.infos), state, "delta", d.snapshot, kv.value,
                                       kv.mod_revision, None, d)
            else:
                e = Epoch.from_json(kv.value, kv.key)
                self._pub = _Published(e.number, set(e.members), EpochState.from_epoch(e), "full", 0, kv.value,
                                       kv.mod_revision, e)
        except RecordError as exc:
            records.skip(exc, kv.key, logging.ERROR)
            epoch, history_top = latest_valid_history(self.store, self.job)
            self._pub = None if epoch is None else _Published(
                epoch.number, set(epoch.members), EpochState.from_epoch(epoch), "full", 0, b"", -1, epoch)
            self._epoch_problem = (f"the epoch key holds a malformed epoch record (revision {kv.mod_revision}): "
                                   f"{exc}")
            return self._pub, kv.mod_revision, exc, history_top
        self._full_pass = True   # a state we did not publish ourselves: compare everything
        return self._pub, kv.mod_revision, None, 0

    def _reconcile(self, lost_seen: dict[str, float], join_seen: dict[str, float],
                   joins_due: bool = True) -> tuple[str, bool]:
        """One pass: read (:meth:`_read_pass`), decide (:func:`.decide.decide`, pure),
        write (:meth:`_write_pass`). Publishes the next epoch if the member set (or
        roles) changed; joins alone wait until ``joins_due`` (their debounce ran out).
        Returns (``"published"`` | ``"unchanged"`` | ``"joins_deferred"`` | ``"retry"`` |
        ``"deposed"``, suspects pending).

        Cost: proportional to the members changed since the last pass (the directory is
        kept from the watch), except on a full pass (after a reload or when the epoch
        was not published by this process), which compares the whole directory."""
        with collector_paused():
            read = self._read_pass(lost_seen, join_seen, joins_due)
            return self._write_pass(read, decide(read.snapshot))

    def _read_pass(self, lost_seen: Mapping[str, float], join_seen: Mapping[str, float],
                   joins_due: bool) -> _PassRead:
        """Everything a pass decides on. Confirmed suspects' leases are revoked here
        (:meth:`_check_suspects`); the health policy is asked (:meth:`_health_verdict`)."""
        pub, erev, corrupt, history_top = self._read_published()
        needs = self.health_policy.needs
        with self._cond:
            marks = self._dirty.snapshot()
            full = self._full_pass or pub is None or corrupt is not None
            members: Mapping[str, Entry] = self._dir.members
            # the evict policy iterates the live members: it gets a stable copy (the
            # straggler policy only looks members up, and reads the epoch by lookup)
            if full or len(members) < self.config.delta_min_members or needs.readmit_requests:
                if self._members_copy[0] != self._dir.version:   # copied once per change, not per pass
                    self._members_copy = (self._dir.version, dict(members))
                members = self._members_copy[1]
            # else: the live dict, only looked up below (dict() copies are atomic under the GIL)
            node_of = self._dir.node_of
        confirmed, consumed, suspects_pending = self._check_suspects(members)
        alive = members if not confirmed else {m: v for m, v in dict(members).items() if m not in confirmed}
        # only a policy that asks for it reads the epoch: by lookup (epoch_view.py), no planner run
        epoch_view = pub.view() if pub is not None and needs.epoch else None
        departed, bad_markers = self._read_departed()
        # measured link speeds, in either epoch form (a delta record carries the speeds that
        # changed, coordinator/delta.py); at scale the O(linked members) measurement is rate-limited
        now = time.monotonic()
        measure = self.config.measure_links and (len(members) < self.config.delta_min_members or
                                                 now - self._measured_at >= self.config.link_measure_interval)
        if measure:
            self._measured_at = now
        # health records from the watched cache: the detector gets the members changed
        # since the last pass, link measurement the records that carry speeds. A pass for a
        # membership change publishes with the previous pass's health verdict: the records
        # that came meanwhile go to the next pass (within resync_interval), so an epoch's
        # CPU does not grow with the health traffic
        if (lost_seen or join_seen or marks or confirmed or departed) and self._health_last is not None:
            health = _still_alive(self._health_last, alive)
        else:
            # no epoch yet: the records stay in the cache, changed, for the first pass with one
            records: Mapping[str, HealthRecord] = \
                self._health.records() if needs.health and epoch_view is not None else {}
            health = self._health_last = self._health_verdict(epoch_view, alive.keys(), records)
        linked = self._health.linked() if measure else {}
        measured = speeds_from_health(linked, _hosts_named(linked, alive)) if measure else None
        facts = None
        if pub is not None:
            self.metrics.epoch.set(pub.number)
            extras = pub.state.extras
            speeds = pub.state.speeds   # the speeds it was planned with, in either form
            facts = EpochFacts(pub.number, pub.members, pub.state.demoted(), pub.state.infos,
                               [list(p) for p in (extras.get("avoid") or [])], set(extras.get("evicted") or {}),
                               speeds)
        admitting = self._admitting(pub) if pub is not None else frozenset()
        snapshot = Snapshot(
            admitting=admitting,
            published=facts, alive=alive, full=full, dirty=marks.keys(), corrupt=corrupt is not None,
            epoch_revision=erev, history_top=history_top, confirmed=confirmed, departed=departed,
            node_of=node_of, bad_markers=bad_markers, consumed=consumed, health=health, lost_seen=lost_seen,
            join_seen=join_seen, joins_due=joins_due, min_members=self.config.min_members, now=time.time(),
            measured_speeds=measured, speed_band=self.config.link_band)
        return _PassRead(snapshot, pub, erev, corrupt, marks, full, suspects_pending)

    def _admitting(self, pub: _Published) -> frozenset[str]:
        """The members ``pub`` added whose admission has no agreed op seq in etcd yet: an
        epoch that removes someone leaves them out (:func:`.decide.decide`; docs/recovery.md,
        "a removal while an admission is pending"). One read of ``pub``'s ``joinseq`` keys
        per pass until the result is there (then remembered: it never goes away); none for
        an epoch that added nobody, had nobody before it, or added only members without a
        data-plane address (they take part in no collective, so no agreement comes)."""
        from resilient.collectives.join_agreement import BLOB, admission_complete

        if self._admitted_epoch == pub.number:
            return frozenset()
        added = set(pub.epoch.added if pub.epoch is not None else (pub.delta.added if pub.delta is not None else ()))
        n_olds = len(pub.members) - len(added & pub.members) if added else 0   # O(added), not O(members)
        if n_olds <= 0:
            self._admitted_epoch = pub.number
            return frozenset()
        # only joiners with a data-plane address take part in collectives (a member
        # registered without one, e.g. `member_process`, has no join agreement to wait for)
        infos = pub.state.infos
        joiners = frozenset(m for m in added if (info := infos.get(m)) is not None and info.address)
        if not joiners:
            self._admitted_epoch = pub.number
            return frozenset()
        got = EpochData(self.store, self.job, pub.number).get_all(BLOB)
        if got and admission_complete(got, _old_positions(pub, added), n_olds, pub.number):
            self._admitted_epoch = pub.number
            return frozenset()
        return joiners

    def _write_pass(self, read: _PassRead, d: Decision) -> tuple[str, bool]:
        """Carry out decision ``d``: delete its cleanup keys and, for ``publish``, write the
        epoch by compare-and-swap on the ``epoch`` key and the leader key (see the module
        docstring). Store errors propagate (the loop retries the pass)."""
        pub, erev, corrupt, marks = read.pub, read.erev, read.corrupt, read.marks
        self._update_member_gauges(*d.gauges)
        cleanup = [Delete(k) for k in d.cleanup]
        if d.outcome != "publish":
            if cleanup:
                self.store.txn([self.election.leader_compare()], cleanup)
            if d.outcome == "unchanged":
                with self._cond:
                    self._dirty.consume(marks)
                    self._full_pass = self._full_pass and not read.full
                if pub is not None and pub.form == "delta" and pub.number - pub.snapshot >= SNAPSHOT_EVERY:
                    self._write_snapshot(pub)
            return d.outcome, read.suspects_pending

        alive, removed, added, number = d.members, d.removed, d.added, d.number
        demoted = set(d.demoted)
        token = secrets.token_hex(16)
        ops: list[Put | Delete] = []
        if len(alive) >= self.config.delta_min_members:
            published = self._delta_epoch(pub, corrupt, alive, removed, added, demoted, d.extras, number, token,
                                          d.cause, d.trigger, ops)
        else:
            p = plan([info for info, _ in alive.values()], demoted, avoid=[(a[0], a[1]) for a in d.avoid],
                     link_speed=d.link_speeds)
            plan_dict = p.to_dict()
            plan_dict.update(d.extras)
            new = Epoch(
                number=number, members=p.ring, infos={m: alive[m][0] for m in p.ring},
                roles={m: ("demoted" if m in demoted else "active") for m in p.ring},
                plan=EpochPlan.of(plan_dict), token=token, cause=d.cause, trigger_at=d.trigger,
                published_at=time.time(), leader=self.id, removed=removed, added=added,
            )
            body = new.to_json()
            published = _Published(number, set(p.ring), EpochState.from_epoch(new), "full", 0, body, 0, new)
        body = published.body
        ops[:0] = [Put(keys.epoch(self.job), body), Put(keys.epoch_record(self.job, number), body)]
        if number - keys.EPOCHS_KEPT > 0:
            ops.append(Delete(keys.epochs(self.job, number - keys.EPOCHS_KEPT), prefix=True))
        ops += cleanup
        epoch_cmp = (Compare(keys.epoch(self.job), "create", "==", 0) if erev == 0
                     else Compare(keys.epoch(self.job), "mod", "==", erev))
        if not self.store.txn([epoch_cmp, self.election.leader_compare()], ops):
            kv = self.store.get(keys.leader(self.job))
            self._pub = None
            if kv is None or kv.create_revision != self.election.leader_revision:
                log.warning("coordinator %s: deposed (leader key is %s); not publishing",
                            self.id, kv.value.decode() if kv else "gone")
                return "deposed", read.suspects_pending
            return "retry", read.suspects_pending
        self.last_publish_ops = len(ops)
        self._pub = published
        with self._cond:
            self._dirty.consume(marks)
            # members held back this time (a re-admission waits for the next epoch) stay due
            self._dirty.mark({m for m in d.held_back if m not in published.members})
            if read.full:
                self._full_pass = False
        self.published.append(number)
        if corrupt is not None:
            log.error("coordinator %s published epoch %d over the malformed epoch record (revision %d)",
                      self.id, number, erev)
            self._epoch_problem = (f"published epoch {number} over a malformed epoch record (revision {erev}): "
                                   f"{corrupt}")
        self.metrics.epochs_published.inc()
        self.metrics.epoch.set(number)
        latency = time.time() - d.trigger
        if d.path is not None and d.trigger:
            self.metrics.detection_latency.labels(path=d.path).observe(max(0.0, latency))
        self._update_member_gauges(len(alive), 0, len(demoted & published.members))
        log.info("coordinator %s published epoch %d (%s, %.1f ms after the trigger): %d members, "
                 "removed %s, added %s", self.id, number, d.cause, latency * 1000, len(published.members),
                 list(removed)[:16], list(added)[:16])
        return "published", read.suspects_pending

    def _write_snapshot(self, pub: _Published) -> None:
        """Snapshot the current delta epoch's state (chunk puts, then the meta) so that the
        next delta names it; the snapshot before the previous one is deleted. Runs on an
        idle pass: O(N), but every :data:`~.delta.SNAPSHOT_EVERY` epochs only; the chunk
        puts are paced (a pause as long as each put), as the directory's reload is."""
        ops: list[Put | Delete] = [self._put_snapshot(pub.state, pub.delta.plan_hash if pub.delta else "")]
        if pub.snapshot:
            ops.append(Delete(keys.snapshots(self.job), range_end=keys.snapshot(self.job, pub.snapshot)))
        if self.store.txn([self.election.leader_compare()], ops):
            pub.snapshot = pub.number
            self.snapshots_written += 1

    def _put_snapshot(self, state: EpochState, phash: str) -> Put:
        """Write the chunks of a snapshot of ``state`` (plain puts, each under the request
        limit) and return its meta put (the caller's transaction writes it: until then no
        reader looks at the chunks). Paced: each chunk is encoded and put, then a pause as
        long as both took (at most 1 s), so the snapshot takes at most half of a core and
        etcd, whose 3.4 answers a keep-alive only once it has applied the writes before it,
        applies each put between keep-alives (at 100,000 members: 49 chunks, ~2.5 MB).
        Store errors propagate."""
        values: list[bytes] = []
        chunks = snapshot_chunks(self.job, state)
        while True:
            t0 = time.monotonic()
            put = next(chunks, None)   # encoded now
            if put is None:
                return snapshot_meta(self.job, state, phash, values)
            self.store.put(put.key, put.value)
            values.append(put.value)
            time.sleep(min(1.0, time.monotonic() - t0))

    def _delta_epoch(self, pub: _Published | None, corrupt: RecordError | None,
                     alive: Mapping[str, Entry], removed: tuple[str, ...], added: tuple[str, ...],
                     demoted: set[str], extras: dict[str, object], number: int, token: str, cause: str,
                     trigger: float, ops: list[Put | Delete]) -> _Published:
        """Build the delta record (and, when due, a snapshot) for epoch ``number``;
        appends the snapshot's ops to ``ops``. Cost: O(change · log N) plus one copy of
        the infos dict, except for snapshot epochs (O(N))."""
        old_demoted = pub.state.demoted() if pub is not None else set()
        new_demoted = demoted & alive.keys()
        role_changes = {m: ("demoted" if m in new_demoted else "active")
                        for m in (new_demoted ^ old_demoted) if m in alive}
        role_changes.update({m: "demoted" for m in added if m in new_demoted})
        # periodic snapshots are written by an idle pass (_write_snapshot), off the publish path;
        # one is written inline only when the chain would outgrow the kept history
        base = pub.number if pub is not None and corrupt is None else 0
        extras = dict(extras)
        speeds = parse_speeds(extras.pop(SPEEDS_FIELD, None))   # carried as changes, not whole
        chained = pub is not None and corrupt is None and pub.state.number == base
        set_bps, dropped_bps = speed_changes(pub.state.speeds if chained and pub is not None else {}, speeds, removed)
        snap = (pub is None or corrupt is not None or pub.form != "delta"
                or number - pub.snapshot >= keys.EPOCHS_KEPT - 2 or len(added) > CHUNK_MEMBERS
                or len(set_bps) + len(dropped_bps) > CHUNK_MEMBERS)   # many speeds moved: the snapshot has them
        d = EpochDelta(number=number, base=base, snapshot=number if snap or pub is None else pub.snapshot, removed=removed,
                       added=added, infos={m: alive[m][0] for m in added}, roles=role_changes, extras=extras,
                       link_bps=set_bps, link_bps_dropped=dropped_bps,
                       token=token, size=len(alive), cause=cause, trigger_at=trigger, published_at=time.time(),
                       leader=self.id)
        if chained and pub is not None:
            self._pub = None   # its state is consumed below: a failing pass re-reads the epoch
            state = pub.state.apply(d, in_place=True)
        else:
            state = EpochState(number, {m: v[0] for m, v in dict(alive).items()},
                               {m: "demoted" for m in new_demoted}, extras, token, speeds)
        phash = state.derive_hash()
        if snap:
            ops.append(self._put_snapshot(state, phash))   # unreferenced until the txn writes its meta
            if pub is not None and pub.snapshot:   # keep the previous snapshot for readers mid-way
                ops.append(Delete(keys.snapshots(self.job), range_end=keys.snapshot(self.job, pub.snapshot)))
            d = dataclasses.replace(d, infos={}, link_bps={}, link_bps_dropped=())   # readers load the snapshot
            if len(d.added) + len(d.removed) > CHUNK_MEMBERS // 4:   # readers diff their state with the snapshot
                d = dataclasses.replace(d, added=(), removed=())
        d = dataclasses.replace(d, plan_hash=phash)
        if snap or pub is None:
            members = set(state.infos)
        else:
            members = pub.members   # updated in place, as the state
            members.difference_update(removed)
            members.update(added)
        return _Published(number, members, state, "delta", d.snapshot, d.to_json(), 0, None, d)

    def _health_verdict(self, epoch: EpochView | None, alive: Collection[str],
                        health: Mapping[str, HealthRecord]) -> HealthOutcome:
        """The health policy's answer for this pass (:class:`~.decide.HealthOutcome`),
        filtered to ``alive``: demoted members and links to avoid as sorted [a, b] pairs,
        plus its evictions, re-admissions and leaf deadline. It is given the ``health``
        records (read by the caller when :attr:`~.policy.HealthPolicy.needs` says so, else
        empty) and reads the re-admission requests it needs; a policy whose ``needs.scores`` is set has its
        scores published to ``straggler`` when they change state, or every 5 s. A failing
        policy demotes nobody (logged) rather than stopping the coordinator; store errors
        propagate."""
        policy = self.health_policy
        needs = policy.needs
        demoted: set[str] = set()
        avoid: list[list[str]] = []
        try:
            requests = read_requests(self.store, self.job) if needs.readmit_requests else {}
            verdict = policy.verdict(health, epoch, alive, requests)
            if needs.scores:
                states = {m: s["state"] for m, s in verdict.scores.items()}
                self.metrics.set_straggler_scores(
                    {m: s.get("score", 0.0) or 0.0 for m, s in verdict.scores.items() if m in alive})
                if states != self._last_scores[0] or time.monotonic() - self._last_scores[1] > 5.0:
                    write_scores(self.store, self.job, verdict)
                    self._last_scores = (states, time.monotonic())
            demoted = {m for m in verdict.demoted if m in alive}
            avoid = [list(p) for p in sorted(verdict.avoid) if p[0] in alive and p[1] in alive]
        except StoreError:
            self._requeue_health(health)
            raise
        except Exception:
            log.exception("coordinator %s: health policy failed; demoting nobody this pass", self.id)
            self._requeue_health(health)
            demoted, avoid = set(), []
        return HealthOutcome(demoted, avoid, policy.evicted, policy.readmitted, policy.leaf_deadline_ms)

    def _requeue_health(self, health: Mapping[str, HealthRecord]) -> None:
        """A failed pass hands the changed members it took back to the cache: their
        records (written only on change) would otherwise not reach the detector again."""
        if isinstance(health, HealthRecords) and health.changed is not None:
            self._health.requeue(health.changed)

    def _update_member_gauges(self, alive: int, joining: int, demoted: int) -> None:
        self.metrics.members.labels(state="joining").set(joining)
        self.metrics.members.labels(state="demoted").set(demoted)
        self.metrics.members.labels(state="active").set(alive - joining - demoted)
