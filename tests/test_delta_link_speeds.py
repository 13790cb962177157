"""Measured link speeds in delta epochs (coordinator/delta.py; docs/hierarchy.md "Link
classes and weighted shards"): a delta record carries the speeds that changed, every
reader derives the same weighted plan as a full-record reader, the plan hash covers the
link classes and shard weights, bad speed fields are refused on read; and a real
coordinator with ``delta_min_members`` lowered publishes measured speeds as delta
epochs on a real etcd."""
from __future__ import annotations

import json

import pytest

from resilient.coordinator import EpochWatcher, MemberInfo, keys
from resilient.coordinator.delta import (
    EpochDelta, EpochState, is_delta, load_snapshot, parse_delta, plan_digest, snapshot_ops, speed_changes,
)
from resilient.coordinator.epoch import Epoch, EpochPlan
from resilient.coordinator.planner import plan
from resilient.coordinator.store import Put
from resilient.errors import RecordError
from resilient.health_reporter import LINK_MIN_WINDOWS
from tests.test_link_speeds_plan import TO_MOVE, measured_job

#: 2 hosts x 2; local index 0 has the fast links
SPEEDS = {"a0": 2e8, "a1": 1e8, "b0": 2e8, "b1": 1e8}


def _infos(n_hosts: int = 2) -> dict[str, MemberInfo]:
    return {f"{h}{r}": MemberInfo(member_id=f"{h}{r}", host=h.upper(), local_rank=r, address=f"10.0.0.{i}:1", pid=1)
            for i, (h, r) in enumerate((h, r) for h in "abcd"[:n_hosts] for r in range(2))}


def _full_record(infos: dict[str, MemberInfo], speeds: dict[str, float], number: int) -> Epoch:
    """What the coordinator publishes below ``delta_min_members`` (service._write_pass)."""
    p = plan(infos.values(), link_speed=speeds)
    d = p.to_dict()
    d["link_bps"] = speeds
    e = Epoch(number=number, members=p.ring, infos={m: infos[m] for m in p.ring},
              roles=dict.fromkeys(p.ring, "active"), plan=EpochPlan.of(d), token="t")
    return Epoch.from_json(e.to_json())


def _delta(base: EpochState, number: int, speeds: dict[str, float], removed: tuple[str, ...] = ()) -> EpochDelta:
    """A delta record from ``base`` to ``speeds`` as the coordinator writes it, hash included."""
    set_bps, dropped = speed_changes(base.speeds, speeds, removed)
    d = EpochDelta(number=number, base=base.number, snapshot=base.number, removed=removed, link_bps=set_bps,
                   link_bps_dropped=dropped, token="t", size=len(base.infos) - len(removed))
    after = base.apply(d)
    return parse_delta(EpochDelta(**{**d.__dict__, "plan_hash": after.derive_hash()}).to_json())


def test_a_delta_reader_derives_the_full_readers_weighted_plan() -> None:
    infos = _infos()
    base = EpochState(3, infos, {}, {}, "t")            # planned without speeds
    d = _delta(base, 4, SPEEDS)
    assert d.link_bps == SPEEDS and is_delta(d.to_json())
    via_delta = base.apply(d).to_epoch(d)
    full = _full_record(infos, SPEEDS, 4)
    assert via_delta.members == full.members == ("a0", "a1", "b0", "b1")
    for field in ("shard_weights", "link_classes", "link_bps", "host_groups", "tree_parent"):
        assert via_delta.plan[field] == full.plan[field], field
    assert full.plan["shard_weights"] == [round(2 / 3, 6), round(1 / 3, 6)]
    # the speeds flip: only the changed ones travel, the ring re-orders each host fastest first
    flipped = {"a0": 2e8, "a1": 4e8, "b0": 2e8, "b1": 4e8}
    state = base.apply(d)
    d2 = _delta(state, 5, flipped)
    assert d2.link_bps == {"a1": 4e8, "b1": 4e8} and d2.link_bps_dropped == ()
    e2 = state.apply(d2).to_epoch(d2)
    f2 = _full_record(infos, flipped, 5)
    assert e2.members == f2.members == ("a1", "a0", "b1", "b0")
    assert e2.plan["link_classes"] == f2.plan["link_classes"] and e2.plan["shard_weights"] == f2.plan["shard_weights"]
    # a full record's state (the first delta after it) carries its speeds on
    assert EpochState.from_epoch(f2).speeds == flipped


def test_the_plan_hash_covers_the_speeds_and_a_diverged_reader_is_refused() -> None:
    infos = _infos()
    base = EpochState(3, infos, {}, {}, "t")
    d = _delta(base, 4, SPEEDS)
    p = plan(infos.values(), link_speed=SPEEDS)
    assert d.plan_hash == plan_digest(p) != plan_digest(plan(infos.values()))
    # a reader holding other speeds derives another plan: the hash says so
    other = EpochState(3, infos, {}, {}, "t", {"a0": 1e8, "a1": 2e8, "b0": 1e8, "b1": 2e8})
    with pytest.raises(RecordError, match="hashes to"):
        other.apply(EpochDelta(**{**d.__dict__, "link_bps": {}})).to_epoch(d)
    # a record whose speeds were altered fails its own hash
    tampered = EpochDelta(**{**d.__dict__, "link_bps": {**SPEEDS, "a1": 3e8}})
    with pytest.raises(RecordError, match="hashes to"):
        base.apply(tampered).to_epoch(tampered)


def test_removed_and_dropped_speeds_and_snapshots_keep_the_state() -> None:
    infos = _infos(3)
    speeds = {m: (2e8 if m.endswith("0") else 1e8) for m in infos}
    state = EpochState(3, infos, {}, {}, "t", speeds)
    # c0/c1 leave (their speeds with them), b1's measurement is gone
    new_speeds = {m: v for m, v in speeds.items() if m[0] != "c" and m != "b1"}
    d = _delta(state, 4, new_speeds, removed=("c0", "c1"))
    assert d.link_bps == {} and d.link_bps_dropped == ("b1",)
    after = state.apply(d)
    assert after.speeds == new_speeds
    e = after.to_epoch(d)
    assert "link_classes" not in e.plan and e.plan["link_bps"] == new_speeds   # incomplete: the planner ignores them
    assert d.plan_hash == plan_digest(plan(after.infos.values()))

    class Kv:
        def __init__(self, key: str, value: bytes) -> None:
            self.key, self.value = key, value

    class Snapshots:   # the two store reads load_snapshot makes, over snapshot_ops' puts
        def __init__(self, puts: list[Put]) -> None:
            self.kv = {p.key: p.value for p in puts}

        def get(self, key: str) -> Kv | None:
            return Kv(key, self.kv[key]) if key in self.kv else None

        def get_prefix(self, prefix: str) -> list[Kv]:
            return [Kv(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

    full = EpochState(4, infos, {}, {}, "t", speeds)
    chunks, meta = snapshot_ops("job", full, full.derive_hash())
    loaded = load_snapshot(Snapshots(chunks + [meta]), "job", 4)   # duck-typed: the two reads it makes
    assert loaded.speeds == speeds and loaded.derive_hash() == full.derive_hash()


@pytest.mark.parametrize("bad, why", [
    ({"link_bps": {"a0": -1.0}}, "link_bps"),
    ({"link_bps": {"a0": "fast"}}, "link_bps"),
    ({"link_bps": {"a 0": 1e8}}, "link_bps"),
    ({"link_bps": {"a0": float("inf")}}, None),
    ({"link_bps_dropped": ["a0", "a0"]}, "link_bps_dropped"),
    ({"link_bps": {"a0": 1e8}, "link_bps_dropped": ["a0"]}, "link_bps_dropped names members"),
])
def test_bad_speed_fields_of_a_delta_record_are_refused_on_read(bad: dict[str, object], why: str | None) -> None:
    good = json.loads(EpochDelta(number=4, base=3, snapshot=3, token="t", size=4).to_json())
    raw = json.dumps({**good, **bad}).encode().replace(b"Infinity", b"1e999")
    with pytest.raises(RecordError, match=why):
        parse_delta(raw, "k")


def test_a_speed_for_a_non_member_is_refused_on_apply() -> None:
    base = EpochState(3, _infos(), {}, {}, "t")
    with pytest.raises(RecordError, match="not members"):
        base.apply(EpochDelta(number=4, base=3, snapshot=3, link_bps={"z9": 1e8}, token="t", size=4))


def test_a_real_coordinator_publishes_measured_speeds_as_delta_epochs(etcd_session, job_name):
    with measured_job(etcd_session, job_name, delta_min_members=2, link_measure_interval=0.0) as (
            store, watcher, coord, reps):
        first = watcher.current()
        assert is_delta(store.get(keys.epoch(job_name)).value) and "link_bps" not in first.plan
        reps.windows(LINK_MIN_WINDOWS, SPEEDS)
        measured = watcher.wait_for(lambda e: "link_bps" in e.plan, 15)
        raw = store.get(keys.epoch_record(job_name, measured.number)).value
        rec = parse_delta(raw)
        assert is_delta(raw) and measured.cause == "health" and rec.link_bps == SPEEDS
        assert measured.plan["link_classes"] == [[2e8, ["a0", "b0"]], [1e8, ["a1", "b1"]]]
        assert measured.plan["shard_weights"] == [round(2 / 3, 6), round(1 / 3, 6)]
        # index 1's links become four times faster: one delta epoch carrying only what moved
        reps.windows(TO_MOVE, {"a0": 2e8, "a1": 4e8, "b0": 2e8, "b1": 4e8})
        moved = watcher.wait_for(lambda e: e.number > measured.number, 15)
        rec = parse_delta(store.get(keys.epoch_record(job_name, moved.number)).value)
        assert rec.link_bps == {"a1": 4e8, "b1": 4e8}
        assert moved.members == ("a1", "a0", "b1", "b0")
        assert moved.plan["link_classes"] == [[4e8, ["a1", "b1"]], [2e8, ["a0", "b0"]]]
        coord.wait_reconciles(3)
        assert watcher.current().number == moved.number   # no flapping
        late = EpochWatcher(store, job_name)               # a late reader resolves the chain
        try:
            got = late.wait_for(lambda e: e.number == moved.number, 15)
            assert got.members == moved.members and got.plan["shard_weights"] == moved.plan["shard_weights"]
        finally:
            late.close()
