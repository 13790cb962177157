"""RateCache's bookkeeping (coordinator/shares.py): one paged read, then the watch's
events; stale events ignored; a compaction or the resync interval re-reads. Over the
in-memory SimStore (bench/sim_store.py): pure logic, no etcd (the real-etcd path is
tests/test_shares.py)."""
from __future__ import annotations

import json

from bench.scale import as_store
from bench.sim_store import Clock, SimStore
from resilient.coordinator import shares as sh
from resilient.coordinator.store import WatchEvent

JOB = "j"


def _rate(member: str, v: float) -> bytes:
    return json.dumps({"member": member, "samples_per_s": v}).encode()


def test_rates_come_from_one_read_then_the_watch() -> None:
    clock = Clock()
    sim = SimStore(clock)
    store = as_store(sim)
    now = [0.0]
    cache = sh.RateCache(store, JOB, resync_interval=60.0, clock=lambda: now[0])
    sh.write_rate(store, JOB, "a", 100.0, None)
    assert cache.rates() == {"a": 100.0} and cache.reads == 1
    sh.write_rate(store, JOB, "b", 50.0, None)             # through the watch
    sim.put(sh.rate_key(JOB, "a"), _rate("a", 120.0))
    assert cache.rates() == {"a": 120.0, "b": 50.0} and cache.reads == 1
    sim.put(sh.rate_key(JOB, "b"), b"{not json")           # malformed: b's old rate is forgotten
    sim.delete(sh.rate_key(JOB, "a"))
    assert cache.rates() == {} and cache.reads == 1
    # an event at or below the last read's revision is stale: ignored
    cache._on_events([WatchEvent("put", sh.rate_key(JOB, "z"), _rate("z", 9.0), mod_revision=1)])
    assert cache.rates() == {}
    sh.write_rate(store, JOB, "c", 10.0, None)
    cache._on_events([WatchEvent("resync", "", b"", 0)])   # compacted history: re-read
    assert cache.rates() == {"c": 10.0} and cache.reads == 2
    now[0] = 61.0                                           # the resync interval
    assert cache.rates() == {"c": 10.0} and cache.reads == 3
    cache.close()
    sh.write_rate(store, JOB, "d", 1.0, None)              # no watch after close
    assert cache.copy() == {} and cache.rates() == {"c": 10.0, "d": 1.0} and cache.reads == 4
    cache.close()


def test_changed_ids_handed_back_are_changed_again() -> None:
    """A consumer whose pass failed hands the changed ids it took back (the coordinator
    does so for the health cache: a summary is written only on change, so a lost id would
    never reach the detector again); they are then in the next take, once."""
    sim = SimStore(Clock())
    store = as_store(sim)
    cache = sh.RateCache(store, JOB, resync_interval=60.0, clock=lambda: 0.0)
    sh.write_rate(store, JOB, "a", 1.0, None)
    sh.write_rate(store, JOB, "b", 2.0, None)
    assert cache.rates() == {"a": 1.0, "b": 2.0}
    assert cache.take_changed() == {"a", "b"} and cache.take_changed() == set()
    cache.requeue({"a"})
    assert cache.take_changed() == {"a"} and cache.take_changed() == set()
    cache.close()


def test_a_watch_event_during_a_re_read_is_not_lost(monkeypatch) -> None:
    """A re-read pins the revision of its first page; a record written while it runs
    reaches the cache through the watch, and the read's older value of that key must not
    replace it (nor bring back a key deleted meanwhile)."""
    from resilient.coordinator import prefix_cache

    sim = SimStore(Clock())
    store = as_store(sim)
    now = [0.0]
    cache = sh.RateCache(store, JOB, resync_interval=60.0, clock=lambda: now[0])
    sh.write_rate(store, JOB, "a", 1.0, None)
    sh.write_rate(store, JOB, "b", 2.0, None)
    assert cache.rates() == {"a": 1.0, "b": 2.0} and cache.reads == 1
    real = prefix_cache.paged_snapshot

    def snapshot_then_writes(st, prefix):   # the watch delivers these while the read parses
        got = real(st, prefix)
        sh.write_rate(store, JOB, "a", 5.0, None)
        sim.delete(sh.rate_key(JOB, "b"))
        return got

    monkeypatch.setattr(prefix_cache, "paged_snapshot", snapshot_then_writes)
    now[0] = 61.0   # the resync interval: the next call re-reads
    assert cache.rates() == {"a": 5.0} and cache.reads == 2
    monkeypatch.setattr(prefix_cache, "paged_snapshot", real)
    now[0] = 122.0
    assert cache.rates() == {"a": 5.0} and cache.reads == 3
    cache.close()
