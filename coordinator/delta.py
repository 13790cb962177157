"""Epochs as deltas, and chunked snapshots (docs/scale.md).

At scale the ``epoch`` record cannot carry every member (at 100,000 ranks the full form
is ~32 MB; etcd refuses requests above 1.5 MiB). A **delta epoch record** carries only
the change against its ``base`` (the previous epoch): the ids ``removed`` and ``added``,
the infos of the added, role changes, the plan inputs that are not membership (avoided
links, leaf deadline, evictions: small), the measured link speeds that changed
(``link_bps``: member -> bytes/s, new or moved past the hysteresis band;
``link_bps_dropped``: ids whose speed is gone; a removed member's speed goes with it),
the ``token``, ``size`` and the plan hash (:func:`plan_digest`: the
:func:`~.ring.plan_hash` of ring, demoted tail and avoided links, plus the link classes
and shard weights when the speeds make any). Every member derives the same plan from the state
it already holds plus the delta (the planner is pure) and checks the hash; a mismatch is
a :class:`~resilient.errors.RecordError` and the reader falls back to the snapshot.

A **snapshot** of the whole state after epoch ``s`` lives under ``snapshots/<s>/``:
``meta`` (number, chunk count, sha256 of the chunks, plan hash) and ``<i>`` chunks of
zlib-compressed JSON, each at most :data:`CHUNK_MEMBERS` members (a few tens of KB) with
their roles and link speeds.
Every delta record names the newest snapshot (``snapshot``); a reader that has no state,
or whose state is older than that snapshot, loads the snapshot and applies the deltas
``epochs/<s+1..n>/epoch`` (history is kept for :data:`~.keys.EPOCHS_KEPT` epochs and a
snapshot is written at least every :data:`SNAPSHOT_EVERY` epochs, so the chain is always
there). A record with ``snapshot == number`` is a snapshot epoch: its state is the
snapshot itself.

Failure behaviour: every record and chunk passes :mod:`.records` (a chunk's decompressed
size is bounded before it is parsed); a missing link of the chain, a chunk whose digest
differs or a plan whose hash differs raises :class:`~resilient.errors.RecordError` naming
the key, and nothing of the reader's state changes.
"""
from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Sequence

from resilient.coordinator import keys, records
from resilient.coordinator.link_classes import parse_speeds
from resilient.coordinator.membership import MemberInfo
from resilient.coordinator.planner import Plan, plan
from resilient.coordinator.ring import IncrementalRing, plan_hash, separate
from resilient.coordinator.store import Put, Store
from resilient.errors import RecordError

if TYPE_CHECKING:   # pragma: no cover
    from resilient.coordinator.epoch import Epoch

#: the ``form`` field of a delta epoch record
DELTA_FORM = "delta"
#: members per snapshot chunk (each chunk is one etcd key, well under the request limit)
CHUNK_MEMBERS = 2048
#: a snapshot is written at least every this many epochs (< keys.EPOCHS_KEPT)
SNAPSHOT_EVERY = 4
#: largest decompressed chunk accepted
MAX_CHUNK_BYTES = records.MAX_RECORD_BYTES
#: plan fields that are inputs, not derived from the ring (carried whole in every delta)
EXTRA_FIELDS = ("avoid", "leaf_deadline_ms", "evicted")
#: the plan field of the measured link speeds (one per member: carried as changes)
SPEEDS_FIELD = "link_bps"
#: the smallest link speed a record may carry (bytes/s)
MIN_SPEED = 1.0

#: Those plan fields of an epoch: the plan's own JSON values, as :func:`~.epoch.check_plan`
#: validated them (the plan is a JSON object: ``dict[str, Any]``, like ``EpochPlan.raw``).
PlanExtras = dict[str, Any]


@dataclass(frozen=True)
class EpochDelta:
    """One delta epoch record (see the module docstring)."""

    number: int
    base: int
    snapshot: int
    removed: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    infos: dict[str, MemberInfo] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    extras: PlanExtras = field(default_factory=dict)
    #: link speeds set by this epoch (new, or moved past the band) and ids whose speed is dropped
    link_bps: dict[str, float] = field(default_factory=dict)
    link_bps_dropped: tuple[str, ...] = ()
    token: str = ""
    size: int = 0
    plan_hash: str = ""
    cause: str = ""
    trigger_at: float = 0.0
    published_at: float = 0.0
    leader: str = ""

    def to_json(self) -> bytes:
        return json.dumps({
            "form": DELTA_FORM, "number": self.number, "base": self.base, "snapshot": self.snapshot,
            "removed": list(self.removed), "added": list(self.added),
            "infos": {m: i.to_dict() for m, i in self.infos.items()}, "roles": self.roles,
            "extras": self.extras, "link_bps": self.link_bps, "link_bps_dropped": list(self.link_bps_dropped),
            "token": self.token, "size": self.size, "plan_hash": self.plan_hash,
            "cause": self.cause, "trigger_at": self.trigger_at, "published_at": self.published_at,
            "leader": self.leader,
        }, separators=(",", ":")).encode()

    @classmethod
    def from_fields(cls, f: records.Fields) -> "EpochDelta":
        """Parse (the :mod:`.records` rules); :class:`RecordError` if malformed."""
        number = f.int("number")
        infos = {}
        sub = f.obj("infos", {})
        if sub is not None:
            for m, i in sub.by_name():
                infos[m] = MemberInfo.from_dict(records.Fields("epoch", i, f.key, f"infos.{m}"))
                if infos[m].member_id != m:
                    f.fail(f"infos.{m} describes member {infos[m].member_id!r}")
        roles = f.str_map("roles", {}, max_len=32)
        added = f.names("added", (), unique=True)
        snapshot = f.int("snapshot", 0)
        if set(infos) != (set() if snapshot == number else set(added)):
            f.fail("infos must describe exactly the added members (none in a snapshot epoch)")
        ex = f.obj("extras", {})
        extras = {}
        if ex is not None:
            from resilient.coordinator.epoch import check_plan

            extras = {k: v for k, v in check_plan(ex, 0).items() if k in EXTRA_FIELDS}
        base = f.int("base")
        if base >= number and number > 0 or snapshot > number:
            f.fail(f"base {base} / snapshot {snapshot} do not precede number {number}")
        speeds = f.float_map("link_bps", {}, lo=MIN_SPEED)
        dropped = f.names("link_bps_dropped", (), unique=True)
        if set(dropped) & speeds.keys():
            f.fail("link_bps_dropped names members whose speed link_bps sets")
        return cls(
            number=number, base=base, snapshot=snapshot, removed=f.names("removed", (), unique=True),
            added=added, infos=infos, roles=roles, extras=extras, link_bps=speeds, link_bps_dropped=dropped,
            token=f.str("token", "", max_len=256),
            size=f.int("size", 0), plan_hash=f.str("plan_hash", "", max_len=64), cause=f.str("cause", "", max_len=64),
            trigger_at=f.float("trigger_at", 0.0), published_at=f.float("published_at", 0.0),
            leader=f.str("leader", "", max_len=256))


def is_delta(raw: bytes) -> bool:
    """Cheap test of the record's form (a full record never contains this marker first)."""
    return raw[:32].startswith(b'{"form":"delta"')


def epoch_size(raw: bytes) -> int | None:
    """The member count of an ``epoch`` record in either form (a delta's ``size``, a full
    record's ``members``), or None when the record does not parse as one (its readers
    validate it and report why)."""
    try:
        if is_delta(raw):
            return parse_delta(raw).size
        f = records.fields("epoch", raw)
        return len(f.names("members"))
    except RecordError:
        return None


def parse_delta(raw: bytes, key: str = "") -> EpochDelta:
    f = records.fields("epoch", raw, key)
    if f.str("form", "") != DELTA_FORM:
        f.fail("not a delta epoch record (no form: delta)")
    return EpochDelta.from_fields(f)


class EpochState:
    """The membership state a delta applies to: infos of every member, roles that are not
    ``active``, plan extras, the measured link speeds the plan was made with (``speeds``)
    and the ring kept incrementally. ``apply`` returns a new state (the old one is
    untouched, unless ``in_place``: then it is emptied) or raises :class:`RecordError`."""

    def __init__(self, number: int = 0, infos: dict[str, MemberInfo] | None = None,
                 roles: dict[str, str] | None = None, extras: PlanExtras | None = None, token: str = "",
                 speeds: Mapping[str, float] | None = None) -> None:
        self.number = number
        self.infos: dict[str, MemberInfo] = dict(infos or {})
        self.roles: dict[str, str] = {m: r for m, r in (roles or {}).items() if r != "active"}
        self.extras: PlanExtras = dict(extras or {})
        self.token = token
        self.speeds: dict[str, float] = {m: v for m, v in (speeds or {}).items() if m in self.infos}
        self._ring: IncrementalRing | None = None

    @classmethod
    def from_epoch(cls, e: "Epoch") -> "EpochState":
        return cls(e.number, e.infos, e.roles, {k: v for k, v in e.plan.items() if k in EXTRA_FIELDS}, e.token,
                   parse_speeds(e.plan.get(SPEEDS_FIELD)))

    def ring_index(self) -> IncrementalRing:
        if self._ring is None:
            roles = self.roles
            self._ring = IncrementalRing.of((i, roles.get(m) == "demoted") for m, i in self.infos.items())
        return self._ring

    def apply(self, d: EpochDelta, key: str = "", in_place: bool = False) -> "EpochState":
        if d.base != self.number:
            raise RecordError(f"bad epoch record at {key}: delta {d.number} is based on epoch {d.base}, "
                              f"the reader holds {self.number}", "epoch", key)
        missing = [m for m in d.removed if m not in self.infos]
        if missing:
            raise RecordError(f"bad epoch record at {key}: removes {missing[:4]} that epoch {self.number} "
                              "does not hold", "epoch", key)
        if in_place:   # the caller owns this state (the coordinator): no O(N) copy
            new = EpochState.__new__(EpochState)
            new.number, new.infos, new.roles, new.extras, new.token = d.number, self.infos, self.roles, dict(
                d.extras), d.token
            new.speeds = self.speeds
            new._ring = None
            self.infos, self.roles, self.speeds = {}, {}, {}
        else:
            new = EpochState(d.number, self.infos, self.roles, d.extras, d.token, self.speeds)
        for m in d.removed:
            del new.infos[m]
            new.roles.pop(m, None)
            new.speeds.pop(m, None)
        new.infos.update(d.infos)
        for m in d.link_bps_dropped:
            new.speeds.pop(m, None)
        unknown = [m for m in d.link_bps if m not in new.infos]
        if unknown:
            raise RecordError(f"bad epoch record at {key}: link_bps sets the speed of {unknown[:4]}, not members "
                              f"of epoch {d.number}", "epoch", key)
        new.speeds.update(d.link_bps)
        for m, r in d.roles.items():
            if r == "active":
                new.roles.pop(m, None)
            else:
                new.roles[m] = r
        for m in [m for m in new.roles if m not in new.infos]:
            del new.roles[m]
        if self._ring is not None:   # carry the ring over: O(change)
            ring, self._ring = self._ring, None
            changed = set(d.removed) | set(d.infos) | set(d.roles)
            ring.update(remove=[m for m in changed if m in ring],
                        upsert=[(new.infos[m], new.roles.get(m) == "demoted") for m in changed if m in new.infos])
            new._ring = ring
        return new

    def derive_hash(self) -> str:
        """The plan hash this state yields (:func:`plan_digest`), from the incremental ring
        (with avoided links, the planner's separation applied to it: :meth:`avoid_moves`):
        no planner run — except with link speeds, which order each host by link class
        and weigh the shards: then one planner run (O(N log N))."""
        avoid = self.extras.get("avoid") or []
        if self.speeds:
            return plan_digest(self.plan(), avoid)
        ring = self.ring_index()
        if not avoid:
            return ring.hash()
        return ring.hash(avoid, self.avoid_moves())

    def avoid_moves(self) -> dict[int, int]:
        """The planner's link separation on this state's ring, as sparse moves
        (:func:`.ring.separate`: {final position: sorted position}); empty without
        avoided links. Cost: O(moves · log N), not O(N)."""
        pairs = {frozenset(p) for p in (self.extras.get("avoid") or []) if len(set(p)) == 2}
        ring = self.ring_index()
        return separate(len(ring), len(ring) - ring.demoted_count, pairs, ring.at, ring.position)

    def demoted(self) -> set[str]:
        return {m for m, r in self.roles.items() if r == "demoted"}

    def plan(self) -> Plan:
        """The planner's plan for this state: its members, demoted ones, avoided links and
        link speeds (exactly the inputs a full-record epoch is planned with)."""
        avoid = self.extras.get("avoid") or []
        return plan(self.infos.values(), self.demoted(), avoid=[tuple(a) for a in avoid],
                    link_speed=self.speeds or None)

    def to_epoch(self, d: EpochDelta, key: str = "") -> "Epoch":
        """The full :class:`~.epoch.Epoch` for delta ``d`` (its metadata) on this state;
        runs the planner and checks the hash (:class:`RecordError` on a mismatch)."""
        from resilient.coordinator.epoch import Epoch, EpochPlan

        avoid = self.extras.get("avoid") or []
        p = self.plan()
        got = plan_digest(p, avoid)
        if d.plan_hash and got != d.plan_hash:
            raise RecordError(f"bad epoch record at {key}: the derived plan hashes to {got}, the record says "
                              f"{d.plan_hash} (diverged state; reload the snapshot)", "epoch", key)
        plan_dict = p.to_dict()
        plan_dict.update(self.extras)
        if self.speeds:   # what the plan was made with, as a full record has it
            plan_dict[SPEEDS_FIELD] = dict(self.speeds)
        return Epoch(number=d.number, members=p.ring, infos=self.infos,
                     roles={m: self.roles.get(m, "active") for m in p.ring}, plan=EpochPlan.of(plan_dict), token=d.token,
                     cause=d.cause, trigger_at=d.trigger_at, published_at=d.published_at, leader=d.leader,
                     removed=d.removed, added=d.added)


def plan_digest(p: Plan, avoid: Iterable[Sequence[str]] = ()) -> str:
    """The plan hash a delta record carries for plan ``p``: :func:`~.ring.plan_hash` of its
    ring, demoted tail and ``avoid`` links; when link speeds gave it link classes, the
    classes, shard weights and host slots are hashed in too (a reader whose speeds differ
    derives another plan, and the hash says so)."""
    h = plan_hash(p.ring, len(p.demoted), avoid)
    if not p.link_classes:
        return h
    links = [h, [[c, list(ids)] for c, ids in p.link_classes], list(p.shard_weights or ()),
             [list(s) for s in p.host_slots or ()]]
    return hashlib.sha256(json.dumps(links, separators=(",", ":")).encode()).hexdigest()[:len(h)]


def speed_changes(old: Mapping[str, float], new: Mapping[str, float],
                  removed: tuple[str, ...] = ()) -> tuple[dict[str, float], tuple[str, ...]]:
    """What a delta record carries to move a reader from speeds ``old`` to ``new`` (its
    ``link_bps`` and ``link_bps_dropped``): the speeds that are new or differ, and the ids
    whose speed is gone (members in ``removed`` lose theirs with the member)."""
    gone = set(removed)
    changed = {m: v for m, v in new.items() if old.get(m) != v}
    dropped = tuple(sorted(m for m in old if m not in new and m not in gone))
    return changed, dropped


# -- snapshots --------------------------------------------------------------------------


def _record(i: MemberInfo) -> dict[str, object]:
    """:meth:`MemberInfo.to_dict`'s object (same keys, same order) without its copy of the
    labels: for an encoder that only reads it. Built per chunk and dropped with it."""
    return {"member_id": i.member_id, "host": i.host, "local_rank": i.local_rank, "device": i.device,
            "address": i.address, "labels": i.labels, "pid": i.pid, "state": i.state, "ttl": i.ttl}


def snapshot_chunks(job: str, state: EpochState) -> Iterator[Put]:
    """The chunk puts of a snapshot of ``state``, encoded one at a time (2,048 members
    each: the caller may pace its writes between them), in order."""
    ids = sorted(state.infos)
    for n, i in enumerate(range(0, max(1, len(ids)), CHUNK_MEMBERS)):
        part = ids[i:i + CHUNK_MEMBERS]
        body = json.dumps({"infos": [_record(state.infos[m]) for m in part],
                           "roles": {m: state.roles[m] for m in part if m in state.roles},
                           "link_bps": {m: state.speeds[m] for m in part if m in state.speeds}},
                          separators=(",", ":")).encode()
        yield Put(keys.snapshot_chunk(job, state.number, n), zlib.compress(body, 6))


def snapshot_meta(job: str, state: EpochState, phash: str, chunks: Sequence[bytes]) -> Put:
    """The meta put of a snapshot of ``state`` whose chunk values are ``chunks``."""
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    meta = json.dumps({"number": state.number, "chunks": len(chunks), "sha256": h.hexdigest(), "plan_hash": phash,
                       "extras": state.extras, "token": state.token, "size": len(state.infos)},
                      separators=(",", ":")).encode()
    return Put(keys.snapshot_meta(job, state.number), meta)


def snapshot_ops(job: str, state: EpochState, phash: str) -> tuple[list[Put], Put]:
    """(chunk puts, the meta put) for a snapshot of ``state``. The chunks are written
    first (plain puts: each under the request limit); the meta goes in the epoch's txn."""
    puts = list(snapshot_chunks(job, state))
    return puts, snapshot_meta(job, state, phash, [p.value for p in puts])


def load_snapshot(store: Store, job: str, number: int) -> EpochState:
    """The state saved under ``snapshots/<number>/``; :class:`RecordError` if it is
    missing, incomplete, altered (digest) or malformed."""
    mkey = keys.snapshot_meta(job, number)
    kv = store.get(mkey)
    if kv is None:
        raise RecordError(f"bad epoch record: snapshot {number} ({mkey}) is missing", "epoch", mkey)
    f = records.fields("epoch", kv.value, mkey)
    count = f.int("chunks", hi=100_000)
    if f.int("number") != number:
        f.fail(f"the meta of snapshot {number} says number {f.int('number')}")
    from resilient.coordinator.epoch import check_plan

    ex = f.obj("extras", {})
    extras = {k: v for k, v in check_plan(ex, 0).items() if k in EXTRA_FIELDS} if ex is not None else {}
    by_key = {c.key: c.value for c in store.get_prefix(keys.snapshot(job, number)) if c.key != mkey}
    blobs = []
    for i in range(count):
        ck = keys.snapshot_chunk(job, number, i)
        if ck not in by_key:
            f.fail(f"chunk {ck} of {count} is missing")
        blobs.append(by_key[ck])
    if hashlib.sha256(b"".join(blobs)).hexdigest() != f.str("sha256", max_len=64):
        f.fail("its chunks do not match the digest in the meta (altered or from another snapshot)")
    infos: dict[str, MemberInfo] = {}
    roles: dict[str, str] = {}
    speeds: dict[str, float] = {}
    for i, blob in enumerate(blobs):
        ck = keys.snapshot_chunk(job, number, i)
        try:
            d = zlib.decompressobj()
            raw = d.decompress(blob, MAX_CHUNK_BYTES)
            if d.unconsumed_tail:
                raise RecordError(f"bad epoch record at {ck}: decompresses past {MAX_CHUNK_BYTES} bytes",
                                  "epoch", ck)
        except zlib.error as exc:
            raise RecordError(f"bad epoch record at {ck}: not zlib data ({exc})", "epoch", ck) from None
        cf = records.fields("epoch", raw, ck)
        for j, item in enumerate(cf.items("infos")):
            info = MemberInfo.from_dict(records.Fields("epoch", item, ck, f"infos[{j}]"))
            infos[info.member_id] = info
        roles.update(cf.str_map("roles", {}, max_len=32))
        speeds.update(cf.float_map("link_bps", {}, lo=MIN_SPEED))
    if len(infos) != f.int("size", len(infos)):
        f.fail(f"holds {len(infos)} members, its meta says {f.int('size')}")
    if not speeds.keys() <= infos.keys():
        f.fail(f"its chunks give link speeds of {sorted(speeds.keys() - infos.keys())[:4]}, not members of it")
    state = EpochState(number, infos, roles, extras, f.str("token", "", max_len=256), speeds)
    want = f.str("plan_hash", "", max_len=64)
    if want and state.derive_hash() != want:
        f.fail("its members do not yield the plan hash in the meta")
    return state


def resolve(store: Store, job: str, d: EpochDelta, have: EpochState | None, key: str = "") -> EpochState:
    """The state after delta ``d``: from ``have`` when it is ``d``'s base, else from the
    newest snapshot plus the history deltas. :class:`RecordError` if the chain is broken."""
    if d.snapshot == d.number:
        return load_snapshot(store, job, d.number)
    if have is not None and have.number == d.base:
        return have.apply(d, key)
    if have is not None and d.snapshot <= have.number < d.number:
        state = have
    else:
        state = _history_state(store, job, d.snapshot)
    for n in range(state.number + 1, d.number):
        hk = keys.epoch_record(job, n)
        kv = store.get(hk)
        if kv is None:
            raise RecordError(f"bad epoch record at {key}: history record {hk} is missing", "epoch", hk)
        state = state.apply(parse_delta(kv.value, hk), hk)
    return state.apply(d, key)


def _history_state(store: Store, job: str, number: int) -> EpochState:
    """The state of epoch ``number``: its snapshot, or (the first delta follows a full
    record) the full record kept in history."""
    try:
        return load_snapshot(store, job, number)
    except RecordError:
        kv = store.get(keys.epoch_record(job, number))
        if kv is None or is_delta(kv.value):
            raise
        from resilient.coordinator.epoch import Epoch

        return EpochState.from_epoch(Epoch.from_json(kv.value, kv.key))
