"""Speed-weighted batch shares (resilient.coordinator.shares): the pure rules, then the
real path: members' rates in a real etcd, a real coordinator leader publishing shares."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings, strategies as st

from resilient.coordinator import EpochWatcher, MemberInfo, MemberSession, Store
from resilient.coordinator import shares as sh
from resilient.errors import ConfigError, RecordError
from cp_helpers import CoordinatorThread, wait_until


def test_shares_follow_speed_and_missing_rates_get_the_mean():
    s = sh.compute_shares({"a": 100.0, "b": 100.0, "c": 100.0, "d": 50.0}, ["a", "b", "c", "d"])
    assert s == pytest.approx({"a": 2 / 7, "b": 2 / 7, "c": 2 / 7, "d": 1 / 7})
    s = sh.compute_shares({"a": 30.0, "b": 10.0}, ["a", "b", "new"])
    assert s == pytest.approx({"a": 0.5, "b": 1 / 6, "new": 1 / 3})


def test_hysteresis_keeps_shares_until_one_moves_enough_or_the_members_change():
    prev = sh.compute_shares({"a": 100.0, "b": 50.0}, ["a", "b"])
    assert sh.compute_shares({"a": 104.0, "b": 48.0}, ["a", "b"], prev, hysteresis=0.1) is None
    moved = sh.compute_shares({"a": 100.0, "b": 80.0}, ["a", "b"], prev, hysteresis=0.1)
    assert moved is not None and moved["b"] > prev["b"] * 1.1
    assert sh.compute_shares({"a": 100.0, "b": 50.0}, ["a", "b", "c"], prev) is not None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.01, 1000.0), min_size=1, max_size=12), st.integers(0, 500))
def test_batch_sizes_sum_to_the_batch_give_everyone_one_and_take_the_shortest_step(weights, extra):
    order = [f"m{i}" for i in range(len(weights))]
    shares = dict(zip(order, weights))
    batch = len(order) + extra
    sizes = sh.batch_sizes(shares, order, batch)
    assert sum(sizes) == batch and min(sizes) >= 1
    total = sum(weights)
    # one each, then the spare by largest remainder (the rule before): never a shorter step
    exact = [extra * w / total for w in weights]
    old = [1 + math.floor(e) for e in exact]
    for i in sorted(range(len(old)), key=lambda i: (-(exact[i] - math.floor(exact[i])), i))[:batch - sum(old)]:
        old[i] += 1
    assert max(n / w for n, w in zip(sizes, weights)) <= max(n / w for n, w in zip(old, weights)) * (1 + 1e-12)
    # the shortest step: no sample can move from one member to another and lower max(size / share)
    step = max(n / w for n, w in zip(sizes, weights))
    for i, (n, w) in enumerate(zip(sizes, weights)):
        if n > 1 and n / w >= step * (1 - 1e-12):
            assert all((m + 1) / v >= step * (1 - 1e-12) for j, (m, v) in enumerate(zip(sizes, weights)) if j != i)
    assert sizes == sh.batch_sizes(dict(reversed(list(shares.items()))), order, batch)  # deterministic


def test_batch_sizes_do_not_round_a_slow_member_up_into_the_longest_step():
    # largest-remainder rounding of these measured shares gave 16/15/16/9: the slow member's
    # 9 samples at half speed are 18 fast samples of step time, 16/16/16/8 is 16
    order = ["m0", "m1", "m2", "m3"]
    assert sh.batch_sizes(dict(zip(order, [0.2855, 0.2816, 0.285, 0.1478])), order, 56) == [16, 16, 16, 8]


def test_batch_sizes_refuse_bad_arguments():
    with pytest.raises(ConfigError, match="no members"):
        sh.batch_sizes({}, [], 8)
    with pytest.raises(ConfigError, match="smaller than"):
        sh.batch_sizes({"a": 1.0, "b": 1.0}, ["a", "b"], 1)
    with pytest.raises(ConfigError, match="finite number > 0"):
        sh.write_rate(None, "job", "a", float("nan"), None)  # type: ignore[arg-type]


@pytest.mark.parametrize("raw, cause", [
    (b'{"version": 1, "members": {}}', "at least one"),
    (b'{"version": 1, "members": {"a": 0.5, "b": 0.2}}', "sum to"),
    (b'{"version": 1, "members": {"a": -1.0, "b": 2.0}}', "finite"),
    (b'{"version": "1", "members": {"a": 1.0}}', "version"),
    (b'{"version": 1, "members": {"../x": 1.0}}', "id"),
    (b"\x80not json", "UTF-8"),
])
def test_malformed_shares_records_are_refused_with_the_cause(raw, cause):
    with pytest.raises(RecordError, match=cause):
        sh.parse_shares(raw, "/resilient/j/shares")


def test_a_rate_record_must_name_its_own_key():
    good = json.dumps({"v": 1, "member": "a", "samples_per_s": 5.0, "at": 1.0}).encode()
    assert sh.parse_rate(good, "/resilient/j/rates/a") == ("a", 5.0)
    with pytest.raises(RecordError, match="sits under"):
        sh.parse_rate(good, "/resilient/j/rates/b")
    with pytest.raises(RecordError, match="> 0"):
        sh.parse_rate(json.dumps({"member": "a", "samples_per_s": 0.0}).encode(), "/resilient/j/rates/a")


def test_the_leader_publishes_shares_from_real_rates(etcd_session, job_name):
    """Real etcd, an in-process coordinator leader, two registered members: no record until
    a rate exists; shares after the rates; hysteresis keeps the version; a bad rate record is
    skipped; when a member leaves, shares for the rest."""
    store = Store(etcd_session.endpoints)
    coord = CoordinatorThread(etcd_session.endpoints, job_name, join_debounce=0.05, resync_interval=0.2)
    try:
        a, b = (MemberSession.register(store, job_name, MemberInfo(member_id=m), ttl=5) for m in ("a", "b"))
        EpochWatcher(store, job_name).wait_for(lambda e: set(e.members) == {"a", "b"}, 20)
        coord.wait_reconciles(2)
        assert sh.read_shares(store, job_name) is None  # no rates: uniform batches, nothing written
        sh.write_rate(store, job_name, "a", 200.0, a.lease_id)
        sh.write_rate(store, job_name, "b", 100.0, b.lease_id)
        rec = wait_until(lambda: (r := sh.read_shares(store, job_name)) and r["members"].get("b", 0) < 0.4 and r,
                         20, "shares from both rates")
        assert rec["members"] == pytest.approx({"a": 2 / 3, "b": 1 / 3})
        store.put(sh.rate_key(job_name, "zz"), b'{"member": "other", "samples_per_s": 1}')  # skipped
        sh.write_rate(store, job_name, "b", 104.0, b.lease_id)  # within hysteresis
        coord.wait_reconciles(3)
        assert sh.read_shares(store, job_name)["version"] == rec["version"]
        b.close(revoke=True, reason="test")
        rec2 = wait_until(lambda: (r := sh.read_shares(store, job_name)) and list(r["members"]) == ["a"] and r,
                          20, "shares without b")
        assert rec2["members"] == {"a": 1.0} and rec2["version"] > rec["version"]
        a.close(revoke=True, reason="test")
    finally:
        coord.close()
        store.close()


class _CountingStore(Store):
    """A real etcd Store that records the keys and prefixes it is asked to read."""

    def __init__(self, endpoints) -> None:
        super().__init__(endpoints)
        self.reads: list[str] = []
        self.watches: list[str] = []

    def get(self, key, *a, **kw):
        self.reads.append(key)
        return super().get(key, *a, **kw)

    def get_prefix(self, prefix, *a, **kw):
        self.reads.append(prefix)
        return super().get_prefix(prefix, *a, **kw)

    def snapshot_page(self, prefix, *a, **kw):
        self.reads.append(prefix)
        return super().snapshot_page(prefix, *a, **kw)

    def watch_prefix(self, prefix, *a, **kw):
        self.watches.append(prefix)
        return super().watch_prefix(prefix, *a, **kw)


def test_the_publisher_keeps_rates_from_a_watch_not_a_read_per_pass(etcd_session, job_name):
    """Real etcd, a real coordinator leader, members reporting rates: the share
    publisher reads ``rates/`` once (paged) and opens one watch on it; over further
    passes it reads nothing (neither ``rates/`` nor the epoch: its members come from the
    coordinator's memory), and a changed rate reaches the shares through the watch."""
    from resilient.coordinator import keys

    store = Store(etcd_session.endpoints)
    coord = CoordinatorThread(etcd_session.endpoints, job_name, join_debounce=0.05, resync_interval=0.1)
    counting = _CountingStore(etcd_session.endpoints)
    pub = coord.coordinator.shares
    pub.store = pub.rate_cache.store = counting
    sessions: list[MemberSession] = []
    try:
        for m in ("a", "b"):
            sessions.append(MemberSession.register(store, job_name, MemberInfo(member_id=m), ttl=5))
        a, b = sessions
        EpochWatcher(store, job_name).wait_for(lambda e: set(e.members) == {"a", "b"}, 20)
        sh.write_rate(store, job_name, "a", 200.0, a.lease_id)
        sh.write_rate(store, job_name, "b", 100.0, b.lease_id)
        rec = wait_until(lambda: (r := sh.read_shares(store, job_name)) and r["members"].get("b", 1) < 0.4 and r,
                         20, "shares from both rates")
        assert rec["members"] == pytest.approx({"a": 2 / 3, "b": 1 / 3})
        assert counting.watches == [sh.rates_prefix(job_name)]
        assert pub.rate_cache.reads == 1
        counting.reads.clear()
        coord.wait_reconciles(5)
        assert counting.reads == []            # five passes, no read at all
        sh.write_rate(store, job_name, "b", 200.0, b.lease_id)   # seen through the watch
        rec2 = wait_until(lambda: (r := sh.read_shares(store, job_name)) and r["version"] > rec["version"] and r,
                          20, "shares after b's new rate")
        assert rec2["members"] == pytest.approx({"a": 0.5, "b": 0.5})
        assert not any(r.startswith(keys.epoch(job_name)) or r == sh.rates_prefix(job_name) for r in counting.reads)
        assert pub.rate_cache.reads == 1 and counting.watches == [sh.rates_prefix(job_name)]
    finally:
        for m in sessions:
            m.close(revoke=True, reason="test")
        coord.close()
        counting.close()
        store.close()
