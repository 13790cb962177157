"""Epochs: the rank-side view of membership, and per-epoch data exchange.

An :class:`Epoch` is what the coordinator leader publishes at ``epoch`` (and keeps at
``epochs/<n>/epoch``): the number, the members in ring order, their infos, roles, the
planner's output, a random ``token`` that transport handshakes carry (stored in the epoch
record, so every member reads the same one), and why and when it was published.

* :class:`EpochWatcher` — follows ``epoch`` with a reconnecting watch and delivers every
  new epoch, in number order, to subscribers.
* Large jobs publish *delta* records (:mod:`.delta`, docs/scale.md): the watcher and
  :func:`read_epoch` resolve them against the state they hold, or the chunked snapshot
  plus the history, check the plan hash and hand out the same full :class:`Epoch`.
  :meth:`Epoch.from_json` parses the full form only.
* :class:`EpochData` — members put raw bytes under ``epochs/<n>/data/<name>/<member>``
  and wait for everyone's. Payloads are bytes (JSON, numpy buffers…), never pickle.

Failure behaviour: while etcd is unreachable the watcher keeps its last epoch and
reconnects by itself, resuming from the last revision it saw (so no epoch is missed); if
history was compacted meanwhile it re-reads ``epoch`` and subscribers get the newest one.
A malformed epoch record (:mod:`.records`) never reaches a subscriber: the watcher logs
it as an error, counts it and keeps its last good epoch until a valid one is published
(the coordinator publishes over a corrupt record, cause ``repaired``).
"""
from __future__ import annotations

import json
import logging
import threading
import time
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, TypeVar

from resilient.coordinator import keys, records
from resilient.coordinator.host_slots import slots_problem
from resilient.coordinator.membership import MemberInfo
from resilient.coordinator.store import Store, WatchEvent, WatchHandle
from resilient.errors import Cancelled, EpochChanged, RecordError, ResilientTimeout

log = logging.getLogger(__name__)
_R = TypeVar("_R")

#: Why an epoch was published (``Epoch.cause``).
#: ``repaired``: published over a malformed ``epoch`` record (:mod:`.service`).
CAUSES = ("initial", "member_lost", "lease_expired", "suspect_confirmed", "joined", "health", "evicted",
          "readmitted", "repaired")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True, eq=False)
class EpochPlan(Mapping[str, Any]):
    """The planner's output in an epoch, typed once when the epoch is built.

    The data plane reads the typed fields: ``tree_parent`` (an index into the ring per
    member, -1 for the root), ``host_groups`` (``(start, count)`` runs over the ring),
    ``demoted``, ``avoid`` (slow-link pairs), ``leaf_deadline_s`` (the deadline
    straggler policy's grace, None when off), ``shard_weights`` (None: uniform),
    ``host_slots`` (unequal hosts: per ``host_groups`` run the local index owning each
    cross-host slot, checked by :func:`~.host_slots.slots_problem`; None: slot = local
    index) and ``evicted`` (member -> its eviction record). As a read-only mapping it is also the
    validated JSON object (``plan["tree_parent"]``, ``plan.get("evicted")``), which
    :meth:`to_dict` returns for writing back.

    A record read from etcd was checked by :func:`check_plan` (a malformed one raises
    :class:`~resilient.errors.RecordError` there); :meth:`of` builds one from a plan the
    coordinator made in process and reads a field of the wrong shape as absent."""

    raw: dict[str, Any] = field(default_factory=dict)
    tree_parent: tuple[int, ...] = ()
    host_groups: tuple[tuple[int, int], ...] = ()
    demoted: tuple[str, ...] = ()
    avoid: tuple[tuple[str, str], ...] = ()
    leaf_deadline_s: float | None = None
    shard_weights: tuple[float, ...] | None = None
    evicted: dict[str, dict[str, Any]] = field(default_factory=dict)
    host_slots: tuple[tuple[int, ...], ...] | None = None

    @classmethod
    def of(cls, plan: "Mapping[str, Any] | None") -> "EpochPlan":
        """The typed plan of ``plan`` (an EpochPlan is returned as it is)."""
        if isinstance(plan, EpochPlan):
            return plan
        d: dict[str, Any] = dict(plan or {})
        tp = d.get("tree_parent")
        tree = tuple(int(v) for v in tp) if isinstance(tp, (list, tuple)) and all(_is_int(v) for v in tp) else ()
        hg = d.get("host_groups")
        groups = (tuple((int(r[0]), int(r[1])) for r in hg)
                  if isinstance(hg, (list, tuple)) and all(isinstance(r, (list, tuple)) and len(r) == 2
                                                          and all(_is_int(v) for v in r) for r in hg) else ())
        dm = d.get("demoted")
        demoted = tuple(str(m) for m in dm) if isinstance(dm, (list, tuple)) else ()
        av = d.get("avoid")
        avoid = (tuple((str(r[0]), str(r[1])) for r in av)
                 if isinstance(av, (list, tuple)) and all(isinstance(r, (list, tuple)) and len(r) == 2 for r in av)
                 else ())
        ms = d.get("leaf_deadline_ms")
        grace = (float(ms) / 1000.0 if isinstance(ms, (int, float)) and not isinstance(ms, bool)
                 and 0.0 <= float(ms) < math.inf else None)
        sw = d.get("shard_weights")
        weights: tuple[float, ...] | None = None
        if isinstance(sw, list) and sw and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in sw):
            vals = tuple(float(v) for v in sw)
            weights = vals if all(0.0 < v < math.inf for v in vals) else None
        ev = d.get("evicted")
        evicted = ({str(m): dict(e) for m, e in ev.items() if isinstance(e, Mapping)}
                   if isinstance(ev, Mapping) else {})
        hs = d.get("host_slots")
        slots = (tuple(tuple(s) for s in hs)
                 if hs is not None and slots_problem(hs, [c for _, c in groups]) is None else None)
        return cls(d, tree, groups, demoted, avoid, grace, weights, evicted, slots)

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)

    def to_dict(self) -> dict[str, Any]:
        """The plan as the JSON object of the epoch record."""
        return dict(self.raw)


@dataclass(frozen=True)
class Epoch:
    """One published membership epoch. Frozen; compare by ``number``. ``plan`` may be
    given as a plain mapping; it is held as an :class:`EpochPlan`."""

    number: int
    members: tuple[str, ...]
    infos: dict[str, MemberInfo] = field(default_factory=dict, compare=False)
    roles: dict[str, str] = field(default_factory=dict, compare=False)
    plan: EpochPlan = field(default_factory=EpochPlan, compare=False)
    token: str = ""
    cause: str = "initial"
    #: wall-clock time of the event that caused it (revoke, suspect report, or the moment
    #: the coordinator saw a lease expire / a member join) — ``published_at - trigger_at``
    #: is the detection latency
    trigger_at: float = 0.0
    published_at: float = 0.0
    leader: str = ""
    removed: tuple[str, ...] = ()
    added: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.plan, EpochPlan):
            object.__setattr__(self, "plan", EpochPlan.of(self.plan))

    @property
    def size(self) -> int:
        return len(self.members)

    def rank_of(self, member_id: str) -> int:
        """Index of ``member_id`` in the ring; ValueError if it is not a member."""
        return self.members.index(member_id)

    def to_json(self) -> bytes:
        d = {
            "number": self.number, "members": list(self.members),
            "infos": {m: i.to_dict() for m, i in self.infos.items()},
            "roles": self.roles, "plan": self.plan.to_dict(), "token": self.token, "cause": self.cause,
            "trigger_at": self.trigger_at, "published_at": self.published_at, "leader": self.leader,
            "removed": list(self.removed), "added": list(self.added),
        }
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, key: str = "") -> "Epoch":
        """Parse an epoch record under the :mod:`.records` rules: ``number`` an integer
        in [0, 2**63), ``members`` distinct valid ids, ``infos`` valid member records,
        ``roles`` id -> string, ``plan`` checked by :func:`check_plan`, times finite.
        Raises :class:`~resilient.errors.RecordError` (a StoreError) if it is malformed."""
        f = records.fields("epoch", raw, key)
        if f.has("form"):
            f.fail(f"a {f.str('form', '', max_len=16)!r} epoch record holds no member list: read it with "
                   "read_epoch() or an EpochWatcher, which resolve deltas (resilient.coordinator.delta)")
        infos = {}
        sub = f.obj("infos", {})
        if sub is not None:
            for m, i in sub.by_name():
                infos[m] = MemberInfo.from_dict(records.Fields("epoch", i, key, f"infos.{m}"))
        roles_f = f.obj("roles", {})
        roles = {}
        if roles_f is not None:
            for m, r in roles_f.by_name():
                if not isinstance(r, str) or len(r) > 32:
                    f.fail(f"roles.{m} = {r!r} is not a role name")
                roles[m] = r
        members = f.names("members", unique=True)
        return cls(
            number=f.int("number"), members=members, infos=infos, roles=roles,
            plan=EpochPlan.of(check_plan(f.obj("plan", {}), len(members))), token=f.str("token", "", max_len=256),
            cause=f.str("cause", "", max_len=64), trigger_at=f.float("trigger_at", 0.0),
            published_at=f.float("published_at", 0.0), leader=f.str("leader", "", max_len=256),
            removed=f.names("removed", ()), added=f.names("added", ()),
        )


def check_plan(f: "records.Fields | None", size: int) -> dict[str, Any]:
    """The epoch's ``plan`` with its known fields checked (``tree_parent``: one index in
    [-1, size) per member; ``host_groups``: [start, count] pairs; ``demoted``: ids;
    ``avoid``: [id, id] pairs; ``host_slots``: per ``host_groups`` run the owner of each
    slot (:func:`~.host_slots.slots_problem`); ``leaf_deadline_ms``: in [0, 600000];
    ``evicted``: id -> an :class:`~.eviction.Eviction`); other fields pass as they are
    (bounded JSON).
    Raises :class:`~resilient.errors.RecordError`."""
    if f is None:
        return {}
    plan = dict(f.d)
    if f.has("tree_parent"):
        parents = f.ints("tree_parent", lo=-1, hi=max(0, size - 1))
        if len(parents) != size:
            f.fail(f"plan.tree_parent has {len(parents)} entries for {size} members")
        plan["tree_parent"] = parents
    for name in ("host_groups", "avoid"):
        if f.has(name):
            for row in f.rows(name):
                ok = len(row) == 2 and (all(records.is_int(v) for v in row)
                                        if name == "host_groups" else
                                        all(records.is_id(v) for v in row))
                if not ok:
                    f.fail(f"plan.{name} holds {row!r}, not a pair of "
                           + ("integers" if name == "host_groups" else "member ids"))
    if f.has("host_slots"):
        runs = f.rows("host_groups", [])
        problem = slots_problem(f.rows("host_slots"), [r[1] if records.is_int(r[1]) else 0 for r in runs])
        if problem is not None:
            f.fail(f"plan.{problem}; the planner writes it for the host_groups runs "
                   "(coordinator/host_slots.py): republish the epoch from a current coordinator")
    if f.has("demoted"):
        plan["demoted"] = list(f.names("demoted"))
    if f.has("leaf_deadline_ms"):
        plan["leaf_deadline_ms"] = f.float("leaf_deadline_ms", lo=0.0, hi=600_000.0)
    ev = f.obj("evicted", {})
    if ev is not None:
        from resilient.coordinator.eviction import Eviction

        plan["evicted"] = {m: Eviction.from_dict(records.Fields("epoch", d, f.key, f"plan.evicted.{m}")).to_dict()
                           for m, d in ev.by_name()}
    return plan


def parse_epoch_number(raw: bytes, key: str = "") -> int:
    """Only the ``number`` of an epoch record (cheap; :class:`~resilient.errors.RecordError`)."""
    return int(records.fields("epoch", raw, key).int("number"))


def parse_any(store: Store, job: str, raw: bytes, key: str, have: "object | None" = None) -> tuple[Epoch, object]:
    """An epoch record of either form as ``(Epoch, delta state or None)``: a full record
    is parsed; a delta record (:mod:`.delta`) is resolved against ``have`` (the reader's
    :class:`~.delta.EpochState`, or None) or the snapshot plus history, and its plan
    hash checked. Raises :class:`~resilient.errors.RecordError`."""
    from resilient.coordinator import delta

    if not delta.is_delta(raw):
        return Epoch.from_json(raw, key), None
    d = delta.parse_delta(raw, key)
    have = have if isinstance(have, delta.EpochState) else None
    state = delta.resolve(store, job, d, have, key)
    if d.snapshot == d.number and not d.added and not d.removed and have is not None:
        # a snapshot epoch with a large change omits the lists: diff the states
        old, new = have.infos, state.infos
        changed = {m for m in old.keys() & new.keys() if old[m] != new[m]}
        d = replace(d, removed=tuple(sorted((old.keys() - new.keys()) | changed)),
                    added=tuple(sorted((new.keys() - old.keys()) | changed)))
    return state.to_epoch(d, key), state


def read_epoch(store: Store, job: str) -> tuple[Epoch | None, int]:
    """The current epoch (or None) and the mod revision of its key (0 if none).
    Raises :class:`~resilient.errors.RecordError` if the record is malformed (the
    error's ``key`` names it; :func:`read_epoch_lenient` skips it instead)."""
    kv = store.get(keys.epoch(job))
    if kv is None:
        return None, 0
    return parse_any(store, job, kv.value, kv.key)[0], kv.mod_revision


def read_epoch_lenient(store: Store, job: str) -> tuple[Epoch | None, int, "RecordError | None"]:
    """Like :func:`read_epoch`, but a malformed record is skipped (logged, counted):
    ``(None, its mod revision, the error)``."""
    kv = store.get(keys.epoch(job))
    if kv is None:
        return None, 0, None
    try:
        return parse_any(store, job, kv.value, kv.key)[0], kv.mod_revision, None
    except RecordError as exc:
        records.skip(exc, kv.key, logging.ERROR)
        return None, kv.mod_revision, exc


def latest_valid_history(store: Store, job: str) -> tuple[Epoch | None, int]:
    """The newest valid record under ``epochs/<n>/epoch`` (malformed ones skipped, or
    None) and the highest ``n`` of any key under ``epochs/`` (0 if none), valid or not:
    a number that a corrupt history record may hide is still accounted for."""
    prefix = keys.root(job) + "epochs/"
    best: Epoch | None = None
    highest = 0
    for kv in store.get_prefix(prefix):
        rest = kv.key[len(prefix):].split("/")
        if rest[0].isdigit() and len(rest[0]) < 19:    # < 10**18: a number the coordinator could have written
            highest = max(highest, int(rest[0]))
        if len(rest) != 2 or rest[1] != "epoch" or kv.value.startswith(b'{"form":'):
            continue   # data, or a delta record (repair publishes a snapshot epoch instead)
        try:
            e = Epoch.from_json(kv.value, kv.key)
        except RecordError as exc:
            records.skip(exc, kv.key)
            continue
        if rest[0] != str(e.number):
            records.skip(RecordError(f"bad epoch record at {kv.key}: its number is {e.number}", "epoch", kv.key))
            continue
        if best is None or e.number > best.number:
            best = e
    return best, highest


class EpochWatcher:
    """Follows the job's current epoch.

    ``current()`` returns the newest epoch seen (or None); ``wait_for(pred, timeout)``
    blocks until an epoch satisfies ``pred``; ``subscribe(cb)`` calls ``cb(epoch)`` for every
    newer epoch, in number order, from the watch thread (a subscriber that must not block
    the others should hand off to its own thread). Epochs are delivered one by one as etcd
    recorded them; only when history was compacted away does a subscriber jump straight to
    the newest. ``close()`` stops the watch.
    """

    def __init__(self, store: Store, job: str, watch: bool = True) -> None:
        self.store = store
        self.job = job
        self._key = keys.epoch(job)
        self._cond = threading.Condition()
        self._subs: list[Callable[[Epoch], None]] = []
        self._closed = False
        self._state: object = None    # the delta state of the current epoch (resilient.coordinator.delta)
        self._current: Epoch | None = None
        self._watch: WatchHandle | None = None
        #: etcd watches this watcher opened (0 while it is fed by a node agent)
        self.watches_opened = 0
        if watch:
            self.open_watch()

    def open_watch(self) -> None:
        """Read ``epoch`` and follow it with an etcd watch (done by the constructor unless
        ``watch=False``: a watcher fed by :meth:`feed`, e.g. from the node agent's relay,
        calls this when that source is gone). Idempotent."""
        with self._cond:
            if self._watch is not None or self._closed:
                return
        kv, revision = self.store.get_with_revision(self._key)
        if kv is not None:
            self.feed(kv.value, kv.mod_revision)
        handle = self.store.watch_key(self._key, revision + 1, self._on_events)
        with self._cond:
            self._watch, closed = handle, self._closed
            self.watches_opened += 1
        if closed:
            handle.cancel()

    def feed(self, raw: bytes, revision: int = 0) -> None:
        """Take one ``epoch`` record value from another source than this watcher's own
        watch (the node agent's relay): parsed and validated exactly like a watch event
        (a malformed one is skipped and logged; the last good epoch stays)."""
        epoch = self._parse(raw, revision)
        if epoch is not None:
            self._deliver(epoch)

    def _parse(self, raw: bytes, revision: int = 0) -> Epoch | None:
        """A malformed epoch record is skipped (logged as an error, counted): the worker
        keeps its last good epoch and waits for the coordinator to publish over it."""
        try:
            have = self._state
            if have is None and self._current is not None and raw[:16].startswith(b'{"form":'):
                from resilient.coordinator.delta import EpochState

                have = EpochState.from_epoch(self._current)   # the first delta after a full record
            epoch, state = parse_any(self.store, self.job, raw, self._key, have)
            if self._current is None or epoch.number > self._current.number:
                self._state = state
            return epoch
        except RecordError as exc:
            records.skip(exc, f"{self._key}@{revision}" if revision else self._key, logging.ERROR)
            return None

    def _on_events(self, events: list[WatchEvent]) -> None:
        for ev in events:
            epoch = None
            if ev.type == "resync":
                kv = self.store.get(self._key)
                if kv is not None:
                    epoch = self._parse(kv.value, kv.mod_revision)
            elif ev.type == "put" and ev.key == self._key:
                epoch = self._parse(ev.value, ev.mod_revision)
            if epoch is not None:
                self._deliver(epoch)

    def _deliver(self, epoch: Epoch) -> None:
        with self._cond:
            if self._current is not None and epoch.number <= self._current.number:
                return
            self._current = epoch
            subs = list(self._subs)
            self._cond.notify_all()
        for cb in subs:
            try:
                cb(epoch)
            except (Exception, Cancelled):  # a subscriber's failure never stops the others or the watch
                log.exception("epoch subscriber failed on epoch %d", epoch.number)

    def current(self) -> Epoch | None:
        with self._cond:
            return self._current

    def wait_for(self, pred: Callable[[Epoch], bool], timeout: float) -> Epoch:
        """The first epoch (current or later) with ``pred(epoch)`` true. Raises
        :class:`TimeoutError` naming the last epoch seen if none comes within ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._current is not None and pred(self._current):
                    return self._current
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    last = self._current
                    raise ResilientTimeout(
                        f"no epoch of job {self.job!r} matched within {timeout:.1f}s; last seen: "
                        + (f"epoch {last.number} members {list(last.members)}" if last else "none published")
                    )
                self._cond.wait(left)

    def subscribe(self, callback: Callable[[Epoch], None], replay: bool = False) -> Callable[[], None]:
        """Call ``callback(epoch)`` for every new epoch; with ``replay`` also at once with the
        current one (so nothing slips between ``current()`` and subscribing). Returns a
        function that unsubscribes."""
        with self._cond:
            self._subs.append(callback)
            current = self._current
        if replay and current is not None:
            callback(current)

        def unsubscribe() -> None:
            with self._cond:
                if callback in self._subs:
                    self._subs.remove(callback)

        return unsubscribe

    def close(self) -> None:
        with self._cond:
            self._closed = True
            handle = self._watch
            self._cond.notify_all()
        if handle is not None:
            handle.cancel()

    def __enter__(self) -> "EpochWatcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EpochData:
    """Per-epoch rendezvous data: ``put`` this member's bytes under a name, read or wait
    for every member's. Keys: ``epochs/<n>/data/<name>/<member_id>``; the coordinator
    deletes them :data:`~.keys.EPOCHS_KEPT` epochs later."""

    def __init__(self, store: Store, job: str, epoch_number: int) -> None:
        self.store = store
        self.job = job
        self.number = int(epoch_number)

    def put(self, member_id: str, name: str, payload: bytes) -> None:
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"EpochData payload must be bytes, got {type(payload).__name__}")
        self.store.put(keys.epoch_data_of(self.job, self.number, name, member_id), bytes(payload))

    def get_all(self, name: str) -> dict[str, bytes]:
        """Every member's ``name`` payload (read in pages of 1,000 keys)."""
        from resilient.coordinator.directory import paged_snapshot

        kvs, _ = paged_snapshot(self.store, keys.epoch_data(self.job, self.number, name))
        return {keys.last_segment(kv.key): kv.value for kv in kvs}

    def any(self, name: str) -> bool:
        """Whether some member has put ``name`` (one key-only read of one key)."""
        prefix = keys.epoch_data(self.job, self.number, name)
        kvs, _, _ = self.store.snapshot_page(prefix, prefix, 1, keys_only=True)
        return bool(kvs)

    def wait_all(self, name: str, member_ids: Iterable[str], timeout: float) -> dict[str, bytes]:
        """Wait until every one of ``member_ids`` has put ``name``; returns their payloads.

        Raises :class:`TimeoutError` naming the members still missing after ``timeout``
        seconds, and :class:`EpochChanged` (with the partial result) as soon as an epoch newer
        than this one is published — our choice: a newer epoch means a member we wait for
        may be gone, so the caller re-plans on the new epoch instead of waiting it out."""
        wanted = set(member_ids)

        def done(got: Mapping[str, bytes]) -> dict[str, bytes] | None:
            return {m: got[m] for m in wanted} if wanted <= got.keys() else None

        def missing(got: Mapping[str, bytes]) -> str:
            return f"still missing from {sorted(wanted - got.keys())}"

        return self.wait_until(name, done, timeout, missing, wanted)

    def wait_until(self, name: str, done: Callable[[Mapping[str, bytes]], _R | None], timeout: float,
                   missing: Callable[[Mapping[str, bytes]], str] = lambda got: "not complete",
                   wanted: Iterable[str] | None = None) -> _R:
        """Wait until ``done`` (called with every member's ``name`` payload seen so far,
        member id -> bytes, after each change) returns something other than None; returns
        that. ``done`` may raise (e.g. :class:`RecordError` for a malformed record): the
        wait ends with its exception. :class:`EpochChanged` as soon as a newer epoch is
        published (its partial result: the payloads of ``wanted``, default all seen), and
        :class:`ResilientTimeout` after ``timeout`` with ``missing(got)`` in its message."""
        from resilient.coordinator.directory import paged_snapshot

        prefix = keys.epoch_data(self.job, self.number, name)
        cond = threading.Condition()
        got: dict[str, bytes] = {}
        newer: list[int] = []
        kvs, rev = paged_snapshot(self.store, prefix)   # pages of 1,000 keys: under the response limit
        for kv in kvs:
            got[keys.last_segment(kv.key)] = kv.value
        ekey = keys.epoch(self.job)
        want = None if wanted is None else set(wanted)

        def partial() -> dict[str, bytes]:
            return dict(got) if want is None else {m: got[m] for m in want & got.keys()}

        def on_data(events: list[WatchEvent]) -> None:
            with cond:
                for ev in events:
                    if ev.type == "put":
                        got[keys.last_segment(ev.key)] = ev.value
                    elif ev.type == "resync":
                        for kv in paged_snapshot(self.store, prefix)[0]:
                            got[keys.last_segment(kv.key)] = kv.value
                cond.notify_all()

        def on_epoch(events: list[WatchEvent]) -> None:
            with cond:
                for ev in events:
                    if ev.type == "put" and ev.key == ekey:
                        try:
                            n = parse_epoch_number(ev.value, ekey)
                        except RecordError:
                            continue   # the epoch watcher logs and counts it
                        if n > self.number:
                            newer.append(n)
                cond.notify_all()

        result = done(got)
        if result is not None:
            return result
        current, erev, _ = read_epoch_lenient(self.store, self.job)
        if current is not None and current.number > self.number:
            raise EpochChanged(f"epoch {current.number} superseded epoch {self.number} while waiting for "
                               f"{name!r}", current.number, partial())
        w1 = self.store.watch_prefix(prefix, rev + 1, on_data)
        w2 = self.store.watch_key(ekey, max(erev, rev) + 1, on_epoch)
        deadline = time.monotonic() + timeout
        try:
            with cond:
                while True:
                    result = done(got)
                    if result is not None:
                        return result
                    if newer:
                        raise EpochChanged(
                            f"epoch {max(newer)} superseded epoch {self.number} while waiting for {name!r} "
                            f"({missing(got)})", max(newer), partial())
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ResilientTimeout(
                            f"epoch {self.number}: {name!r} {missing(got)} after {timeout:.1f}s "
                            f"(have {sorted(partial())})")
                    cond.wait(left)
        finally:
            w1.cancel()
            w2.cancel()
