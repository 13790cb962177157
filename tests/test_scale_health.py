"""Hierarchical health (coordinator/health.py NodeHealthAggregator): rank windows go to
the node's aggregator, one summary per node reaches etcd, read_health expands it for the
detector. Real etcd; a fake clock drives the windows (no sleeps)."""
from __future__ import annotations

from resilient.coordinator import Store, keys
from resilient.coordinator.health import NodeHealthAggregator, read_health
from resilient.health_reporter import HealthReporter
from resilient.transport.base import TransportStats


def test_node_summary_replaces_per_rank_writes_and_feeds_read_health(etcd_session, job_name):
    store = Store(etcd_session.endpoints)
    try:
        now = [0.0]
        agg = NodeHealthAggregator(store, job_name, "node7", None, interval=15.0, clock=lambda: now[0])
        reps = [HealthReporter(store, job_name, f"r{i}", None, TransportStats(), interval=1.0,
                               clock=lambda: now[0], sink=agg.maybe_flush) for i in range(4)]
        for _ in range(10):                       # 10 s of ops: 40 rank windows
            now[0] += 1.0
            for r in reps:
                r.op_done(1, 0.01)
        assert agg.writes == 0 and store.get_prefix(keys.health(job_name)) == []   # nothing per rank
        now[0] += 5.0
        for r in reps:
            r.op_done(1, 0.01)
        assert agg.writes == 1                    # the interval ran out: one node summary
        got = read_health(store, job_name)
        assert set(got) == {"r0", "r1", "r2", "r3"} and all(g["ops"] >= 1 for g in got.values())
        now[0] += 1.0
        reps[2].op_done(1, 0.5)                   # r2 turns slow: the summary goes at once
        assert agg.writes == 2 and read_health(store, job_name)["r2"]["op_s_p50"] == 0.5
        store.put(keys.health_of(job_name, "node8"), b'{"v":2,"node":"node8","ranks":{"bad id":{}}}')
        assert set(read_health(store, job_name)) == {"r0", "r1", "r2", "r3"}   # malformed summary skipped
    finally:
        store.close()
