"""Epochs as deltas (coordinator/delta.py, ring.py, directory.py): the incremental ring
is the planner's ring, every reader derives the same plan hash, and a real coordinator
publishes small delta records that watchers and late joiners resolve on a real etcd."""
from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.coordinator import EpochWatcher, Store, keys
from resilient.coordinator.delta import EpochDelta, EpochState, is_delta, load_snapshot, parse_delta
from resilient.coordinator.directory import NodeRecord
from resilient.coordinator.epoch import read_epoch
from resilient.coordinator.membership import MemberInfo
from resilient.coordinator.planner import plan
from resilient.coordinator.ring import IncrementalRing, plan_hash
from resilient.errors import RecordError
from tests.cp_helpers import CoordinatorThread


def _info(i: int, racks: int = 3) -> MemberInfo:
    return MemberInfo(member_id=f"r{i}", host=f"h{i // 4}", local_rank=i % 4, address=f"10.0.0.{i % 250}:1",
                      labels={"rack": f"k{(i // 4) % racks}"}, pid=1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.booleans(), st.booleans()), max_size=80))
def test_incremental_ring_is_the_planners_ring(ops):
    """Any sequence of inserts, removals and demotions leaves the ring equal to plan()."""
    ring, present = IncrementalRing(), {}
    for i, remove, demoted in ops:
        if remove and i in present:
            ring.update(remove=[f"r{i}"])
            del present[i]
        else:
            ring.update(upsert=[(_info(i), demoted)])
            present[i] = demoted
        d = {f"r{k}" for k, v in present.items() if v}
        p = plan([_info(k) for k in present], d)
        assert ring.ring() == p.ring
        assert ring.hash() == plan_hash(p.ring, len(p.demoted))


def test_delta_apply_derives_the_full_plan_and_checks_the_hash():
    base = EpochState(3, {f"r{i}": _info(i) for i in range(12)}, {}, {}, "t")
    d = EpochDelta(number=4, base=3, snapshot=3, removed=("r4", "r5"), added=("r20",), infos={"r20": _info(20)},
                   roles={"r1": "demoted"}, token="tok", size=11)
    new = base.apply(d)
    p = plan(new.infos.values(), {"r1"})
    d = EpochDelta(**{**d.__dict__, "plan_hash": plan_hash(p.ring, 1)})
    e = new.to_epoch(d)
    assert e.members == p.ring and e.roles["r1"] == "demoted" and e.plan["tree_parent"] == list(p.parent)
    assert set(base.infos) == {f"r{i}" for i in range(12)}          # the base state is untouched
    assert parse_delta(d.to_json()) == d and is_delta(d.to_json())
    with pytest.raises(RecordError, match="hashes to"):
        new.to_epoch(EpochDelta(**{**d.__dict__, "plan_hash": "0" * 32}))
    with pytest.raises(RecordError, match="based on epoch"):
        new.apply(d)
    with pytest.raises(RecordError, match="does not hold"):
        base.apply(EpochDelta(number=4, base=3, snapshot=3, removed=("nobody",)))


def test_delta_record_rules():
    ok = EpochDelta(number=2, base=1, snapshot=1, added=("r1",), infos={"r1": _info(1)}).to_json()
    bad = json.loads(ok)
    bad["infos"] = {}
    with pytest.raises(RecordError, match="exactly the added"):
        parse_delta(json.dumps(bad).encode())
    bad = json.loads(ok)
    bad["base"] = 5
    with pytest.raises(RecordError, match="do not precede"):
        parse_delta(json.dumps(bad).encode())
    from resilient.coordinator.epoch import Epoch

    with pytest.raises(RecordError, match="read_epoch"):
        Epoch.from_json(ok)


def test_node_record_roundtrip_and_rules():
    rec = NodeRecord("n1", "host1", {"rack": "k1"}, (_info(0), _info(1)), 5.0)
    back = NodeRecord.from_json(rec.to_json(), "/resilient/j/nodes/n1")
    assert [r.member_id for r in back.ranks] == ["r0", "r1"]
    assert back.ranks[0].labels == {"rack": "k0"} and back.ranks[0].host == "h0"   # a rank's own win
    bare = NodeRecord("n1", "host1", {"rack": "k1"}, (MemberInfo("r0", host="host1"),))
    assert NodeRecord.from_json(bare.to_json()).ranks[0].labels == {"rack": "k1"}   # else the node's
    with pytest.raises(RecordError, match="not the key's"):
        NodeRecord.from_json(rec.to_json(), "/resilient/j/nodes/n2")
    twice = NodeRecord("n1", "h", {}, (_info(0), _info(0)))
    with pytest.raises(RecordError, match="twice"):
        NodeRecord.from_json(twice.to_json())


_ODD_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([2 ** 63 - 1, 2 ** 63, -(2 ** 63), 10 ** 400]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(["", "x", "n1", "x\n", "a" * 129, "b" * 256,
                                                                        "c" * 301, "-bad", "ok.id_1"]),
    st.lists(st.integers(0, 2), max_size=2), st.dictionaries(st.sampled_from(["rack", "a" * 256, "k"]),
                                                             st.one_of(st.text(max_size=3), st.integers()),
                                                             max_size=2))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["node", "host", "labels", "ttl", "ranks", "extra"]),
       st.sampled_from(["member_id", "local_rank", "address", "pid", "device", "state", "host", "labels", "extra"]),
       st.booleans(), _ODD_VALUES, st.sampled_from(["", "nan", "inf", "1e400", "deep", "dup", "latin1", "key"]))
def test_node_record_fast_parse_agrees_with_the_generic_parse(top, rank_field, in_rank, value, raw_edit):
    """NodeRecord.from_json parses the common form inline (directory._parse_common) and
    hands anything else to the generic parse: on any record (one field of a valid one set
    to an odd value, or the raw text altered) the inline parse gives the generic parse's
    record exactly (repr: field types too), or None where the generic parse refuses the
    record (from_json then raises the generic parse's RecordError)."""
    from resilient.coordinator.directory import _parse_common

    rec = NodeRecord("n1", "host1", {"rack": "k1"}, (_info(0), _info(1)), 5.0)
    key = "/resilient/j/nodes/n1"
    assert repr(_parse_common(rec.to_json(), key)) == repr(NodeRecord._from_json_generic(rec.to_json(), key))
    d = json.loads(rec.to_json())
    if in_rank:
        d["ranks"][1][rank_field] = value
    else:
        d[top] = value
    text = json.dumps(d)
    if raw_edit in ("nan", "inf", "1e400"):
        text = text.replace('"ttl": 5.0', '"ttl": ' + {"nan": "NaN", "inf": "Infinity", "1e400": "1e400"}[raw_edit])
    elif raw_edit == "deep":
        text = text.replace('"ttl":', '"extra": ' + "[" * 20 + "]" * 20 + ', "ttl":')
    elif raw_edit == "dup":
        text = text.replace('"r1"', '"r0"')
    elif raw_edit == "key":
        key = "/resilient/j/nodes/n2"
    raw = text.encode("latin-1" if raw_edit == "latin1" else "utf-8", "replace")
    if raw_edit == "latin1":
        raw = raw.replace(b"host1", b"host\xe9")
    fast = _parse_common(raw, key)
    try:
        slow = NodeRecord._from_json_generic(raw, key)
    except RecordError as exc:
        assert fast is None
        with pytest.raises(RecordError) as got:
            NodeRecord.from_json(raw, key)
        assert str(got.value) == str(exc)
    else:
        assert fast is None or repr(fast) == repr(slow)
        assert repr(NodeRecord.from_json(raw, key)) == repr(slow)


def _put_node(store: Store, job: str, node: int, ranks: int, ttl: float = 5.0) -> int:
    lease = store.grant(ttl)
    infos = tuple(MemberInfo(member_id=f"n{node}-r{r}", host=f"host{node}", local_rank=r,
                             address=f"127.0.0.1:{30000 + node * 8 + r}", labels={"rack": f"k{node % 2}"})
                  for r in range(ranks))
    store.put(keys.node(job, f"n{node}"), NodeRecord(f"n{node}", f"host{node}", {"rack": f"k{node % 2}"},
                                                     infos, ttl).to_json(), lease=lease)
    return lease


@contextmanager
def _delta_coordinator(etcd_session, job: str, join_debounce: float) -> Iterator[tuple[Store, EpochWatcher]]:
    """A store, an in-process coordinator publishing delta epochs from one member on, and
    an epoch watcher; all three closed afterwards."""
    store = Store(etcd_session.endpoints)
    coord = CoordinatorThread(etcd_session.endpoints, job, join_debounce=join_debounce, delta_min_members=1)
    watcher = EpochWatcher(store, job)
    try:
        yield store, watcher
    finally:
        watcher.close()
        coord.close()
        store.close()


def test_real_coordinator_publishes_deltas_and_late_readers_resolve_them(etcd_session, job_name):
    with _delta_coordinator(etcd_session, job_name, 0.2) as (store, watcher):
        leases = {n: _put_node(store, job_name, n, 4) for n in range(5)}
        first = watcher.wait_for(lambda e: len(e.members) == 20, 20)
        raw = store.get(keys.epoch(job_name)).value
        assert is_delta(raw) and parse_delta(raw).snapshot == first.number   # the first delta epoch is a snapshot
        assert load_snapshot(store, job_name, first.number).infos == first.infos
        # node loss: the agent marks the node departed and revokes its one lease
        store.put(keys.departed_of(job_name, "n2"), json.dumps({"lease": leases[2], "reason": "t",
                                                                "at": 1.0}).encode())
        store.revoke(leases[2])
        second = watcher.wait_for(lambda e: "n2-r0" not in e.members, 15)
        assert second.cause == "member_lost" and second.removed == tuple(f"n2-r{r}" for r in range(4))
        raw = store.get(keys.epoch(job_name)).value
        d = parse_delta(raw)
        assert d.base == first.number and d.snapshot == first.number and len(raw) < 2048
        assert second.members == plan(second.infos.values()).ring
        # a node joins: its infos travel in the delta
        _put_node(store, job_name, 7, 4)
        third = watcher.wait_for(lambda e: "n7-r3" in e.members, 15)
        assert third.added == tuple(f"n7-r{r}" for r in range(4)) and len(third.members) == 20
        # a late reader (no state) resolves snapshot + history to the same epoch
        late, _ = read_epoch(store, job_name)
        assert late.members == third.members and late.token == third.token and late.infos == third.infos
        # an altered snapshot chunk is refused, naming the cause
        store.put(keys.snapshot_chunk(job_name, first.number, 0), b"\x78\x9cjunk")
        with pytest.raises(RecordError, match="digest"):
            load_snapshot(store, job_name, first.number)


def test_snapshot_written_every_few_epochs_and_old_ones_deleted(etcd_session, job_name):
    from resilient.coordinator.delta import SNAPSHOT_EVERY

    with _delta_coordinator(etcd_session, job_name, 0.05) as (store, watcher):
        for n in range(2 * SNAPSHOT_EVERY + 2):
            _put_node(store, job_name, n, 2)
            watcher.wait_for(lambda e, n=n: f"n{n}-r1" in e.members, 15)
        metas = [kv.key for kv in store.get_prefix(keys.snapshots(job_name)) if kv.key.endswith("/meta")]
        assert 1 <= len(metas) <= 2, metas              # the newest and the one before
        newest = watcher.current()
        assert read_epoch(store, job_name)[0].members == newest.members


def test_directory_paged_load_sees_every_record_at_one_revision(etcd_session, job_name):
    from resilient.coordinator.directory import Directory, paged_snapshot
    from resilient.coordinator.membership import MemberSession

    store = Store(etcd_session.endpoints)
    sessions = []
    try:
        sessions = [MemberSession.register(store, job_name, _info(i), ttl=10) for i in range(7)]
        _put_node(store, job_name, 1, 3)
        store.put(keys.node(job_name, "n9"), b'{"node": "n9", "ranks": [{"member_id": "x\\n"}]}')   # malformed
        kvs, rev = paged_snapshot(store, keys.members(job_name), page=2)
        assert [kv.key for kv in kvs] == [keys.member(job_name, f"r{i}") for i in range(7)]
        d = Directory(job_name)
        changed, rev2 = d.load(store)
        assert rev2 >= rev and set(d.members) == {f"r{i}" for i in range(7)} | {f"n1-r{r}" for r in range(3)}
        assert changed == set(d.members) and d.node_of["n1-r2"] == "n1"
    finally:
        for s in sessions:
            s.close()
        store.close()


def test_directory_reload_reuses_unchanged_node_records_and_sees_changed_ones(etcd_session, job_name):
    """A reload parses only the node records whose mod revision moved: the others keep the
    very MemberInfo objects of the last parse (and count as unchanged); a rewritten record,
    a new one and a deleted one are seen. The paged read (no sort asked) keeps key order.
    Once the directory holds parses, a reload reads ``nodes/`` keys only and fetches just
    the records that moved (a full read when more than a quarter did)."""
    from resilient.coordinator.directory import Directory, paged_snapshot

    class Counting(Store):
        def __init__(self, endpoints: list[str]) -> None:
            super().__init__(endpoints)
            self.pages: list[tuple[str, bool]] = []

        def snapshot_page(self, prefix, start, limit, revision=0, keys_only=False):
            self.pages.append((start, keys_only))
            return super().snapshot_page(prefix, start, limit, revision, keys_only)

    store = Counting(etcd_session.endpoints)
    try:
        for n in range(9):
            _put_node(store, job_name, n, 2, ttl=60)
        kvs, _ = paged_snapshot(store, keys.nodes(job_name), page=2)
        assert [kv.key for kv in kvs] == sorted(kv.key for kv in kvs) and len(kvs) == 9
        d = Directory(job_name)
        d.load(store)
        before = dict(d.members)
        store.pages.clear()
        changed, _ = d.load(store)
        assert changed == set() and all(d.members[m][0] is before[m][0] for m in before)
        assert [k for _, k in store.pages] == [False, True]   # members/ in full, nodes/ keys only
        _put_node(store, job_name, 1, 3, ttl=60)         # rewritten: one rank more
        store.delete(keys.node(job_name, "n2"))
        _put_node(store, job_name, 9, 1, ttl=60)
        store.pages.clear()
        changed, _ = d.load(store)
        assert changed == {"n1-r0", "n1-r1", "n1-r2", "n2-r0", "n2-r1", "n9-r0"}
        assert sorted(start for start, k in store.pages[2:]) == [keys.node(job_name, "n1"), keys.node(job_name, "n9")]
        assert d.members["n1-r0"][0] is not before["n1-r0"][0] and d.members["n0-r0"][0] is before["n0-r0"][0]
        assert "n2-r0" not in d.members and d.node_of["n9-r0"] == "n9" and len(d.members) == 8 * 2 + 1 + 1
        for n in range(3, 7):                           # more than a quarter moved: one full read
            _put_node(store, job_name, n, 1, ttl=60)
        store.pages.clear()
        changed, _ = d.load(store)
        assert changed == {f"n{n}-r1" for n in range(3, 7)} | {f"n{n}-r0" for n in range(3, 7)}
        assert [k for _, k in store.pages] == [False, True, False]
    finally:
        store.close()
