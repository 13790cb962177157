"""The coordinator's in-memory member directory, kept from watches (docs/scale.md).

Members appear in two forms, both parsed through :mod:`.records`:

* ``members/<id>``: one rank on its own lease (:class:`~.membership.MemberSession`);
* ``nodes/<node>``: one **node record** on the node agent's single lease, vouching for
  all its local ranks (:class:`NodeRecord`). The node's ranks live and die with it.

:class:`Directory` holds ``{member id: (MemberInfo, lease)}``. ``apply(events)`` folds
watch events in and returns the ids that changed, so the coordinator's cost per event is
proportional to the change, not to the job. :meth:`Directory.load` re-reads both prefixes
in pages (:func:`paged_snapshot`, :data:`PAGE` keys per request: under etcd's 4 MiB
response limit whatever the job size).

Failure behaviour: a malformed record is skipped (logged and counted under its kind,
``member`` or ``node``) and its previous content is dropped — the member counts as gone
until a valid record is written, exactly as :func:`~.membership.read_members` treats it.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Iterable

from resilient.coordinator import keys, records
from resilient.coordinator.membership import MemberInfo
from resilient.coordinator.store import KV, Store, WatchEvent
from resilient.errors import RecordError

#: keys per range request of a resync (a member record is ~300 B: ~300 KB per page)
PAGE = 1000


@dataclass(frozen=True)
class NodeRecord:
    """``nodes/<node>``: the node agent's ranks, on the agent's lease."""

    node: str
    host: str
    labels: dict[str, str]
    ranks: tuple[MemberInfo, ...]
    ttl: float = 0.0

    def to_json(self) -> bytes:
        """The record; a rank's ``host`` and ``labels`` are written only where they differ
        from the node's (``labels``: the rank's own entries beyond the node's)."""
        ranks: list[dict[str, object]] = []
        for r in self.ranks:
            d: dict[str, object] = {"member_id": r.member_id, "local_rank": r.local_rank, "address": r.address,
                                    "pid": r.pid, "device": r.device, "state": r.state}
            if r.host != self.host:
                d["host"] = r.host
            own = {k: v for k, v in r.labels.items() if self.labels.get(k) != v}
            if own:
                d["labels"] = own
            ranks.append(d)
        return json.dumps({"node": self.node, "host": self.host, "labels": self.labels, "ttl": self.ttl,
                           "ranks": ranks}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, key: str = "") -> "NodeRecord":
        """Parse; :class:`RecordError` if malformed or the key's node id differs.

        A record of the form :meth:`to_json` writes is parsed by :func:`_parse_common`,
        which applies the same rules inline (4x cheaper: the generic :class:`~.records.Fields`
        getters were most of the coordinator's CPU from a 12,500-node registration to its
        first epoch); anything else (an unknown field, a broken rule, not JSON) goes through
        the generic parse, which names the rule broken. Both give equal records
        (``tests/test_scale_delta.py``)."""
        rec = _parse_common(raw, key)
        return rec if rec is not None else cls._from_json_generic(raw, key)

    @classmethod
    def _from_json_generic(cls, raw: bytes, key: str = "") -> "NodeRecord":
        """:meth:`from_json` through the generic :mod:`.records` getters."""
        f = records.fields("node", raw, key)
        node, host = f.name("node"), f.str("host", "", max_len=255)
        labels = f.str_map("labels", {}, max_len=255)
        ttl = f.float("ttl", 0.0, lo=0.0)
        ranks = []
        for i, r in enumerate(f.items("ranks")):
            rf = records.Fields("node", r, key, f"ranks[{i}]")
            own = rf.str_map("labels", {}, max_len=255)
            ranks.append(MemberInfo(member_id=rf.name("member_id"), host=rf.str("host", host, max_len=255),
                                    local_rank=rf.int("local_rank", 0), device=rf.str("device", "cpu", max_len=64),
                                    address=rf.str("address", "", max_len=300),
                                    labels={**labels, **own} if own else labels,
                                    pid=rf.int("pid", 0), state=rf.str("state", "joining", max_len=32), ttl=ttl))
        if key and keys.last_segment(key) != node:
            f.fail(f"its node is {node!r}, not the key's")
        if len({r.member_id for r in ranks}) != len(ranks):
            f.fail("lists a rank twice")
        return cls(node, host, labels, tuple(ranks), ttl)


_NODE_FIELDS = frozenset(("node", "host", "labels", "ttl", "ranks"))
_RANK_FIELDS = frozenset(("member_id", "local_rank", "address", "pid", "device", "state", "host", "labels"))
_is_name = keys.NAME_PATTERN.fullmatch


def _str_map(v: object) -> dict[str, str] | None:
    """``v`` if it is a JSON object of string -> string, each at most 255 characters (the
    rule :meth:`NodeRecord._from_json_generic` applies to ``labels``), else None."""
    if type(v) is not dict or len(v) > records.MAX_ITEMS:
        return None
    for k, x in v.items():
        if len(k) > 255 or type(x) is not str or len(x) > 255:
            return None
    return v


def _parse_common(raw: object, key: str) -> NodeRecord | None:
    """``raw`` parsed as a node record when it has the shape :meth:`NodeRecord.to_json`
    writes and breaks none of the generic parse's rules (:mod:`.records`: size, strict
    UTF-8 and JSON, ids, string lengths, integers in [0, MAX_INT], a finite ``ttl`` >= 0,
    the key's node id, no rank twice); None for anything else, which the caller hands to
    the generic parse (it gives the same record or the error naming the rule). Only known
    fields are accepted here, all scalars or string maps, so the nesting-depth rule holds
    by construction. Never raises."""
    if type(raw) is not bytes or len(raw) > records.MAX_RECORD_BYTES:
        return None
    try:
        d = json.loads(raw.decode("utf-8"), parse_constant=records.reject_constant)
    except Exception:   # not UTF-8, not JSON, NaN, too deep, too many digits: the generic parse says which
        return None
    if type(d) is not dict or not d.keys() <= _NODE_FIELDS:
        return None
    node, host, labels, ttl, ranks = d.get("node"), d.get("host"), d.get("labels"), d.get("ttl"), d.get("ranks")
    if type(node) is not str or not _is_name(node) or (key and key.rsplit("/", 1)[-1] != node):
        return None
    if host is None:
        host = ""
    elif type(host) is not str or len(host) > 255:
        return None
    if labels is None:
        labels = {}
    elif _str_map(labels) is None:
        return None
    if ttl is None:
        ttl = 0.0
    elif type(ttl) is float:
        if not 0.0 <= ttl < math.inf:
            return None
    elif type(ttl) is int and 0 <= ttl <= records.MAX_INT:
        ttl = float(ttl)
    else:
        return None
    if ranks is None:
        ranks = ()
    elif type(ranks) is not list or len(ranks) > records.MAX_ITEMS:
        return None
    out: list[MemberInfo] = []
    seen: set[str] = set()
    of = MemberInfo.of_checked
    big = records.MAX_INT
    for r in ranks:
        if type(r) is not dict or not r.keys() <= _RANK_FIELDS:
            return None
        mid = r.get("member_id")
        if type(mid) is not str or not _is_name(mid) or mid in seen:
            return None
        seen.add(mid)
        rh, lr, dev, addr = r.get("host"), r.get("local_rank"), r.get("device"), r.get("address")
        own, pid, state = r.get("labels"), r.get("pid"), r.get("state")
        if rh is None:
            rh = host
        elif type(rh) is not str or len(rh) > 255:
            return None
        if lr is None:
            lr = 0
        elif type(lr) is not int or not 0 <= lr <= big:
            return None
        if dev is None:
            dev = "cpu"
        elif type(dev) is not str or len(dev) > 64:
            return None
        if addr is None:
            addr = ""
        elif type(addr) is not str or len(addr) > 300:
            return None
        if pid is None:
            pid = 0
        elif type(pid) is not int or not 0 <= pid <= big:
            return None
        if state is None:
            state = "joining"
        elif type(state) is not str or len(state) > 32:
            return None
        if own is None:
            lab = labels
        elif _str_map(own) is None:
            return None
        else:
            lab = {**labels, **own} if own else labels
        out.append(of(mid, rh, lr, dev, addr, lab, pid, state, ttl))
    return NodeRecord(node, host, labels, tuple(out), ttl)


def paged_snapshot(store: Store, prefix: str, page: int = PAGE, revision: int = 0,
                   paced: bool = False, keys_only: bool = False) -> tuple[list[KV], int]:
    """Every key under ``prefix`` at one revision (``revision``, or 0: now), read ``page``
    keys per request (:meth:`Store.snapshot_page`). ``paced``: after each page, wait as
    long as it took (at most 1 s), so that a large read leaves etcd half its time for the
    keep-alives it answers meanwhile (a full read of 12,500 node records, 12 MB, is 13
    pages). ``keys_only``: the values are left out (``b""``). Failure behaviour: the
    store's errors propagate (:class:`~resilient.errors.StoreError`)."""
    out: list[KV] = []
    start, rev = prefix, revision
    while True:
        t0 = time.monotonic()
        kvs, rev, more = store.snapshot_page(prefix, start, page, rev, keys_only)
        out += kvs
        if not more or not kvs:
            return out, rev
        start = kvs[-1].key + "\0"
        if paced:
            time.sleep(min(1.0, time.monotonic() - t0))


def read_node(store: Store, job: str, node: str) -> NodeRecord | None:
    """``nodes/<node>`` parsed and validated, or None when the key is gone (the record
    lives on the node's lease, so it vanishes when that lease is revoked or expires).
    Failure behaviour: a malformed record is skipped (logged and counted under ``node``,
    :func:`~.records.skip`) and reads as None — its ranks count as gone, as in
    :class:`Directory`; the store's errors propagate (:class:`~resilient.errors.StoreError`)."""
    key = keys.node(job, node)
    kv = store.get(key)
    if kv is None:
        return None
    try:
        return NodeRecord.from_json(kv.value, key)
    except RecordError as exc:
        records.skip(exc, key)
        return None


def rank_nodes(store: Store, job: str) -> dict[str, str]:
    """``{rank id: node id}`` for every rank of every live node record (read in pages,
    :func:`paged_snapshot`: ~1 KB per node). Failure behaviour: a malformed record is
    skipped (logged and counted, :func:`~.records.skip`) and its ranks are absent; the
    store's errors propagate (:class:`~resilient.errors.StoreError`)."""
    kvs, _ = paged_snapshot(store, keys.nodes(job))
    out: dict[str, str] = {}
    for kv in kvs:
        try:
            rec = NodeRecord.from_json(kv.value, kv.key)
        except RecordError as exc:
            records.skip(exc, kv.key)
            continue
        for info in rec.ranks:
            out.setdefault(info.member_id, rec.node)   # a rank claimed twice: the first record keeps it
    return out


class Directory:
    """Members by id, from ``members/`` and ``nodes/`` records (see the module docstring)."""

    def __init__(self, job: str) -> None:
        self.job = job
        self._mp, self._np = keys.members(job), keys.nodes(job)
        self.members: dict[str, tuple[MemberInfo, int]] = {}
        self._node_ranks: dict[str, tuple[str, ...]] = {}
        #: rank id -> the node whose record held it last (kept after the node is gone, so a
        #: ``departed/<node>`` marker can name the cause of its ranks' removal)
        self.node_of: dict[str, str] = {}
        self.loaded = False
        #: bumped on every change (readers cache copies by it)
        self.version = 0
        #: node key -> (mod revision, the record parsed at it): a reload does not parse a
        #: record again that has not changed since (at 12,500 nodes the parse was most of a
        #: reload's CPU: 1.4 s of 100,000 ranks)
        self._parsed: dict[str, tuple[int, NodeRecord]] = {}

    def load(self, store: Store) -> tuple[set[str], int]:
        """Re-read both prefixes (paged); returns (ids whose entry changed, revision). The
        node records are read as :meth:`_read_nodes` says: only those changed since their
        last parse, once most are held."""
        mkvs, rev = paged_snapshot(store, self._mp, paced=True)
        nkvs = self._read_nodes(store, rev)   # the same revision: no event falls between
        old = self.members
        self.members, self._node_ranks = {}, {}
        parsed, self._parsed = self._parsed, {}
        for kv in mkvs:
            self._put(kv.key, kv.value, kv.lease)
        for kv in nkvs:
            hit = parsed.get(kv.key)
            self._put(kv.key, kv.value, kv.lease, kv.mod_revision,
                      hit[1] if hit is not None and hit[0] == kv.mod_revision else None)
        self.loaded = True
        self.version += 1
        changed = {m for m in old.keys() | self.members.keys() if old.get(m) != self.members.get(m)}
        return changed, rev

    def _read_nodes(self, store: Store, rev: int) -> list[KV]:
        """Every ``nodes/`` record at revision ``rev``. Once this directory holds parses
        (:attr:`_parsed`, kept from the watch and the last reload), the prefix is read keys
        only (paged: ~60 B a key instead of ~1 KB a record) and only the records whose mod
        revision moved since their parse are read with their value (one request each);
        the others come back with ``b""`` as value and :meth:`load` reuses their parse. When
        more than a quarter of them moved, or nothing is held yet, one paged read of
        everything instead. (That full read, 12 MB at 12,500 nodes, was for etcd to send
        and the coordinator to decode on every reload.) Failure behaviour: the store's
        errors propagate (:class:`~resilient.errors.StoreError`)."""
        if not self._parsed:
            return paged_snapshot(store, self._np, revision=rev, paced=True)[0]
        heads, _ = paged_snapshot(store, self._np, revision=rev, paced=True, keys_only=True)
        parsed = self._parsed
        stale = {kv.key for kv in heads if (hit := parsed.get(kv.key)) is None or hit[0] != kv.mod_revision}
        if 4 * len(stale) > len(heads):
            return paged_snapshot(store, self._np, revision=rev, paced=True)[0]
        fresh: dict[str, KV] = {}
        for key in stale:
            got, _, _ = store.snapshot_page(key, key, 1, rev)   # [key, key's prefix end): key comes first
            if got and got[0].key == key:
                fresh[key] = got[0]
        return [fresh.get(kv.key, kv) for kv in heads if kv.key in fresh or kv.key not in stale]

    def apply(self, events: Iterable[WatchEvent]) -> set[str]:
        """Fold watch events in; the ids whose entry changed. A ``resync`` event is not
        handled here (the caller calls :meth:`load`)."""
        changed: set[str] = set()
        for ev in events:
            if ev.type == "put":
                changed |= self._put(ev.key, ev.value, ev.lease, ev.mod_revision)
            elif ev.type == "delete":
                changed |= self._delete(ev.key)
        if changed:
            self.version += 1
        return changed

    def _delete(self, key: str) -> set[str]:
        if key.startswith(self._np):
            self._parsed.pop(key, None)
            ids = self._node_ranks.pop(keys.last_segment(key), ())
        else:
            ids = (key[len(self._mp):],)
        gone = {m for m in ids if self.members.pop(m, None) is not None}
        return gone

    def _put(self, key: str, value: bytes, lease: int, mod_revision: int = 0,
             parsed: NodeRecord | None = None) -> set[str]:
        """Fold one record in; ``parsed``: the node record already parsed from this very
        value (same key and mod revision), not parsed again."""
        changed = self._delete(key)
        try:
            if key.startswith(self._np):
                rec = parsed if parsed is not None else NodeRecord.from_json(value, key)
                if mod_revision:
                    self._parsed[key] = (mod_revision, rec)
                ids = []
                for info in rec.ranks:
                    if info.member_id in self.members:   # a rank claimed twice: the first record keeps it
                        records.skip(RecordError(f"bad node record at {key}: rank {info.member_id} is already "
                                                 "registered elsewhere", "node", key))
                        continue
                    self.members[info.member_id] = (info, lease)
                    self.node_of[info.member_id] = rec.node
                    ids.append(info.member_id)
                self._node_ranks[rec.node] = tuple(ids)
                return changed | set(ids)
            info = MemberInfo.from_json(value, key)
            mid = key[len(self._mp):]
            if mid != info.member_id:
                raise RecordError(f"bad member record at {key}: its member_id is {info.member_id!r}, not the key's",
                                  "member", key)
        except RecordError as exc:
            records.skip(exc, key)
            return changed
        self.members[mid] = (info, lease)
        return changed | {mid}
