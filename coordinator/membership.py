"""Membership: a member is registered under ``members/<id>`` on its lease and is alive
exactly while that lease is.

* :class:`MemberInfo` — what a member says about itself (JSON in etcd, never pickle).
* :class:`MemberSession` — registration plus a keep-alive **daemon thread** refreshing the
  lease every ``ttl / 3`` seconds. SIGSTOP freezes the thread with the process, so a
  stopped (hung) process is dropped when its lease expires, after ``ttl`` seconds.
* :func:`revoke_member` — what a node agent calls when its worker process exits: it leaves
  a ``departed/`` marker (so the coordinator can tell a revoke from an expiry and measure
  detection latency) and revokes the lease, which deletes the member key at once.
* :func:`report_suspect` — a peer's suspicion; the coordinator confirms it against the
  suspect's lease state, never on one peer's word.

Failure behaviour: if etcd is unreachable the keep-alive thread keeps trying (etcd
extends every lease by its TTL when it comes back, so a short outage loses nobody); when
etcd answers that the lease is gone, :attr:`MemberSession.lost` is set and the ``on_lost``
callbacks run once, in the keep-alive thread.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, TypedDict

from resilient.coordinator import keys, records
from resilient.coordinator.store import Store
from resilient.errors import ConfigError, LeaseExpired, RecordError, StoreError, StoreUnavailable

log = logging.getLogger(__name__)

#: Keep-alives are sent every ``ttl * KEEPALIVE_FRACTION`` seconds.
KEEPALIVE_FRACTION = 1.0 / 3.0
#: A failed keep-alive is retried after this many seconds.
KEEPALIVE_RETRY_S = 0.05
#: Set to ``agent`` by a node agent that keeps one node lease for all its ranks
#: (``RESILIENT_NODE_LEASE=1``, docs/scale.md): the member then sends no keep-alive of its
#: own but touches :data:`HEARTBEAT_ENV`'s file, which the agent checks (a hung rank).
LEASE_KEEPER_ENV = "RESILIENT_LEASE_KEEPER"
HEARTBEAT_ENV = "RESILIENT_HEARTBEAT_FILE"


class MemberRecord(TypedDict):
    """:class:`MemberInfo` as the JSON object stored in etcd (:meth:`MemberInfo.to_dict`)."""

    member_id: str
    host: str
    local_rank: int
    device: str
    address: str
    labels: dict[str, str]
    pid: int
    state: str
    ttl: float


@dataclass(frozen=True)
class MemberInfo:
    """A member's self-description. ``address`` is its transport listener ``host:port``;
    ``labels`` are topology labels (e.g. ``rack``, ``switch``) used by the planner."""

    member_id: str
    host: str = field(default_factory=socket.gethostname)
    local_rank: int = 0
    device: str = "cpu"
    address: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    pid: int = field(default_factory=os.getpid)
    state: str = "joining"
    ttl: float = 0.0

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def to_dict(self) -> MemberRecord:
        return MemberRecord(member_id=self.member_id, host=self.host, local_rank=self.local_rank,
                            device=self.device, address=self.address, labels=dict(self.labels), pid=self.pid,
                            state=self.state, ttl=self.ttl)

    @classmethod
    def of_checked(cls, member_id: str, host: str, local_rank: int, device: str, address: str,
                   labels: dict[str, str], pid: int, state: str, ttl: float) -> "MemberInfo":
        """An instance from fields a parser has already validated (the node-record parse,
        :mod:`.directory`), equal to ``MemberInfo(...)`` of the same fields, built a quarter
        cheaper (the dataclass ``__init__``'s defaults and checks skipped; 100,000 of them
        per load of a 12,500-node job). The attributes are set one by one, as ``__init__``
        does, so the instance keeps its values inline (no ``__dict__`` object: one object
        fewer per member for the garbage collector to scan). No check is made here: never
        pass it unvalidated input."""
        self = object.__new__(cls)
        setattr_ = object.__setattr__
        setattr_(self, "member_id", member_id)
        setattr_(self, "host", host)
        setattr_(self, "local_rank", local_rank)
        setattr_(self, "device", device)
        setattr_(self, "address", address)
        setattr_(self, "labels", labels)
        setattr_(self, "pid", pid)
        setattr_(self, "state", state)
        setattr_(self, "ttl", ttl)
        return self

    @classmethod
    def from_dict(cls, d: object, key: str = "", where: str = "") -> "MemberInfo":
        """Validate one member record's object (:mod:`.records` rules: ``member_id`` a
        valid id, ``pid``/``local_rank`` integers in [0, 2**63), ``ttl`` finite, strings
        bounded, ``labels`` string -> string); :class:`~resilient.errors.RecordError` if not."""
        f = d if isinstance(d, records.Fields) else records.Fields("member", d, key, where)
        return cls(
            member_id=f.name("member_id"), host=f.str("host", "", max_len=255),
            local_rank=f.int("local_rank", 0), device=f.str("device", "cpu", max_len=64),
            address=f.str("address", "", max_len=300),
            labels=f.str_map("labels", {}, max_len=255),
            pid=f.int("pid", 0), state=f.str("state", "joining", max_len=32),
            ttl=f.float("ttl", 0.0, lo=0.0),
        )

    @classmethod
    def from_json(cls, raw: bytes, key: str = "") -> "MemberInfo":
        """Parse a ``members/<id>`` value; :class:`~resilient.errors.RecordError` if malformed."""
        return cls.from_dict(records.load("member", raw, key), key)


class MemberSession:
    """A registered member: its lease, kept alive by a daemon thread.

    Use :meth:`register`; ``member_id``, ``lease_id``, ``ttl``, ``lost`` (a
    :class:`threading.Event` set when the lease is gone) and :meth:`close`.
    """

    def __init__(self, store: Store, job: str, info: MemberInfo, lease_id: int, ttl: float,
                 owns_lease: bool) -> None:
        self.store = store
        self.job = job
        self.info = info
        self.member_id = info.member_id
        self.lease_id = lease_id
        self.ttl = ttl
        self.owns_lease = owns_lease
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._on_lost: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        #: the node agent keeps the (shared) lease; this member only heartbeats locally
        self.heartbeat_file = (os.environ.get(HEARTBEAT_ENV) if not owns_lease
                               and os.environ.get(LEASE_KEEPER_ENV) == "agent" else None)
        if self.heartbeat_file:
            self._thread = threading.Thread(target=self._heartbeat_loop, args=(self.heartbeat_file,),
                                            name=f"keepalive:{self.member_id}", daemon=True)
        else:
            self._thread = threading.Thread(target=self._keepalive_loop, name=f"keepalive:{self.member_id}",
                                            daemon=True)
        self._thread.start()

    @classmethod
    def register(cls, store: Store, job: str, info: MemberInfo, ttl: float = 5.0,
                 lease_id: int | None = None) -> "MemberSession":
        """Register ``info`` under ``members/<id>`` on a lease and start keeping it alive.

        ``lease_id`` given: attach to that lease (granted by the node agent, which revokes
        it the moment this process exits); otherwise grant one of ``ttl`` seconds.
        Raises :class:`ConfigError` if a live member already holds this id,
        :class:`LeaseExpired` if ``lease_id`` is already gone, :class:`StoreUnavailable`
        if etcd cannot be reached.
        """
        if ttl <= 0:
            raise ConfigError(f"member lease ttl must be > 0 seconds, got {ttl}")
        key = keys.member(job, info.member_id)
        owns = lease_id is None
        if lease_id is None:
            lease_id = store.grant(ttl)
        else:
            left = store.lease_ttl(lease_id)
            if left is None:
                raise LeaseExpired(f"lease {lease_id:x} given for member {info.member_id} is already gone")
            ttl = left[1]
        info = replace(info, labels=dict(info.labels), state="joining", ttl=float(ttl))
        payload = info.to_json()
        while True:
            if store.create(key, payload, lease=lease_id):
                break
            existing = store.get(key)
            if existing is None:
                continue  # it expired between create and get: try again
            if existing.lease == lease_id:
                store.put(key, payload, lease=lease_id)
                break
            if owns:
                store.revoke(lease_id)
            raise ConfigError(
                f"member id {info.member_id!r} is already registered in job {job!r} by a live "
                f"member (lease {existing.lease:x}); give each member a unique id, or wait for "
                f"the old one's lease to expire"
            )
        return cls(store, job, info, lease_id, float(ttl), owns)

    def on_lost(self, callback: Callable[[], None]) -> None:
        """Run ``callback()`` once when the lease is found gone (at once if it already is)."""
        with self._lock:
            if not self.lost.is_set():
                self._on_lost.append(callback)
                return
        callback()

    def _keepalive_loop(self) -> None:
        """A keep-alive every ``ttl/3``; one that fails (etcd slow or unreachable) is
        retried within :data:`KEEPALIVE_RETRY_S`, not an interval later, so a loaded etcd
        costs the lease only when it stays unanswered for the rest of the TTL."""
        interval = max(0.1, self.ttl * KEEPALIVE_FRACTION)
        wait = interval
        while not self._stop.wait(wait):
            try:
                self.store.keepalive(self.lease_id, budget=interval)
                wait = interval
            except LeaseExpired:
                self._mark_lost()
                return
            except StoreError as exc:  # StoreUnavailable, or an unexpected etcd answer
                if wait == interval:   # the first failure of a streak is logged
                    log.warning("member %s: keep-alive failed, retrying: %s", self.member_id, exc)
                wait = min(interval, KEEPALIVE_RETRY_S)

    def _heartbeat_loop(self, heartbeat_file: str) -> None:
        """Agent-kept lease: touch ``heartbeat_file`` every interval (SIGSTOP freezes it:
        the agent then removes this member), and notice the member key going (the agent
        vouched us out, or the node lease is gone)."""
        interval = max(0.1, self.ttl * KEEPALIVE_FRACTION)
        key = keys.member(self.job, self.member_id)
        while True:
            try:
                with open(heartbeat_file, "a"):
                    os.utime(heartbeat_file, None)
            except OSError as exc:
                log.warning("member %s: cannot touch heartbeat file %s: %s", self.member_id, heartbeat_file, exc)
            if self._stop.wait(interval):
                return
            try:
                kv = self.store.get(key)
            except StoreError as exc:
                log.warning("member %s: membership check failed, retrying: %s", self.member_id, exc)
                continue
            if kv is None or kv.lease != self.lease_id:
                self._mark_lost()
                return

    def _mark_lost(self, closing: bool = False) -> None:
        with self._lock:
            if self.lost.is_set():
                return
            self.lost.set()
            callbacks, self._on_lost = self._on_lost, []
        if not closing:
            log.warning("member %s: lease %x is gone; no longer a member", self.member_id, self.lease_id)
        for cb in callbacks:
            try:
                cb()
            except Exception:
                log.exception("on_lost callback failed")

    def close(self, revoke: bool = True, reason: str = "closed") -> None:
        """Stop keeping the lease alive; with ``revoke`` also revoke it now (the member
        leaves at once, marked departed with ``reason``), otherwise it expires after its
        TTL. Safe to call twice; never raises for an unreachable etcd (logs it)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if revoke and not self.lost.is_set():
            try:
                if self.heartbeat_file:   # the lease is the node's: leave alone, siblings stay
                    depart_member(self.store, self.job, self.member_id, reason)
                else:
                    revoke_member(self.store, self.job, self.member_id, self.lease_id, reason)
            except StoreError as exc:
                log.warning("member %s: could not revoke lease on close: %s", self.member_id, exc)
            self._mark_lost(closing=True)

    def __enter__(self) -> "MemberSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def revoke_member(store: Store, job: str, member_id: str, lease_id: int, reason: str = "exited") -> bool:
    """Mark ``member_id`` departed (``departed/<id>``: lease, reason, wall time) and revoke
    its lease, deleting its keys at once. The coordinator reports the epoch's cause as
    ``member_lost`` (detection path ``revoke``). Returns False if the lease was already
    gone. Raises :class:`StoreUnavailable` if etcd cannot be reached."""
    marker = json.dumps({"lease": lease_id, "reason": reason, "at": time.time()}).encode()
    store.put(keys.departed_of(job, member_id), marker)
    return store.revoke(lease_id)


def depart_member(store: Store, job: str, member_id: str, reason: str = "exited", lease_id: int = 0) -> None:
    """Remove one member that shares its node's lease: ``departed/<id>`` and the delete
    of ``members/<id>`` in one transaction (its siblings on the lease stay). The
    coordinator reports ``member_lost`` (path ``revoke``). :class:`StoreUnavailable` if
    etcd cannot be reached."""
    from resilient.coordinator.store import Delete, Put

    marker = json.dumps({"lease": lease_id, "reason": reason, "at": time.time()}).encode()
    store.txn([], [Put(keys.departed_of(job, member_id), marker), Delete(keys.member(job, member_id))])


def report_suspect(store: Store, job: str, reporter_id: str, suspect_id: str, reason: str) -> None:
    """Report that ``suspect_id`` looks dead or hung to ``reporter_id`` (e.g. a peer waited
    past ``op_timeout``). The coordinator confirms it only if the suspect's lease has also
    stopped being refreshed (or is gone); a suspect whose lease is fresh stays a member.
    Raises :class:`ConfigError` when a member reports itself."""
    if reporter_id == suspect_id:
        raise ConfigError(f"member {reporter_id!r} cannot report itself as suspect")
    record = json.dumps({"reporter": reporter_id, "reason": str(reason), "at": time.time()}).encode()
    store.put(keys.suspect(job, suspect_id, reporter_id), record)


def read_members(store: Store, job: str) -> tuple[dict[str, tuple[MemberInfo, int]], int]:
    """Every registered member: ``{id: (info, lease_id)}`` and the read's revision.
    Malformed records (:mod:`.records`), keys that are not ``members/<valid id>`` and
    records whose ``member_id`` is not their key's are skipped: logged and counted in
    ``resilient_bad_records_total{kind="member"}``."""
    prefix = keys.members(job)
    kvs, rev = store.snapshot(prefix)
    out: dict[str, tuple[MemberInfo, int]] = {}
    for kv in kvs:
        try:
            info = MemberInfo.from_json(kv.value, kv.key)
            mid = kv.key[len(prefix):]
            if mid != info.member_id:
                raise RecordError(f"bad member record at {kv.key}: its member_id is {info.member_id!r}, "
                                  "not the key's", "member", kv.key)
        except RecordError as exc:
            records.skip(exc, kv.key)
            continue
        out[mid] = (info, kv.lease)
    return out, rev
