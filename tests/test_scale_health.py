"""Hierarchical health (coordinator/node_health.py): rank windows go to the node's
aggregator, which writes one ``health/<node>`` summary when something changed, within the
job's write budget; read_health and the coordinator's HealthCache expand it for the
detector, which still probes and demotes a slow rank fed only by those summaries.

The write policy's tests are pure (a recording store, a fake clock); the summaries' way
through etcd uses a real etcd (no sleeps: waits on conditions)."""
from __future__ import annotations

import json
import random

import pytest

from launcher_util import wait_for
from resilient.coordinator import Store, keys
from resilient.coordinator.health import make_record, read_health
from resilient.coordinator.health_cache import HealthCache
from resilient.coordinator.node_health import NodeHealthAggregator, SummaryPolicy, parse_summary
from resilient.coordinator.store import Put
from resilient.coordinator.straggler import DEMOTED, PROBE, HealthRecord, StragglerConfig, StragglerDetector
from resilient.errors import ConfigError, RecordError
from resilient.health_reporter import HealthReporter
from resilient.transport.base import TransportStats


class Recorder:
    """The store as the aggregator uses it: ``put`` only, recorded."""

    def __init__(self) -> None:
        self.puts: list[tuple[str, bytes]] = []

    def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        self.puts.append((key, value))
        return len(self.puts)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _window(member: str, seq: int, busy: float, at: float, epoch: int = 1) -> HealthRecord:
    """A 1 s window of 10 ops, busy for ``busy`` of it, waiting on a peer the rest."""
    return make_record(member, epoch, seq, ops=10, window_s=1.0, wait_s={"p": 1.0 - busy}, at=at)


def _node(clock: Clock, nodes: int = 8, ranks: int = 8, name: str = "n0",
          policy: SummaryPolicy | None = None) -> tuple[NodeHealthAggregator, Recorder, list[str]]:
    rec = Recorder()
    agg = NodeHealthAggregator(rec, "j", name, None, policy, clock=clock, wall=clock,  # type: ignore[arg-type]
                               rng=random.Random(name))
    agg.set_job_size(nodes)
    return agg, rec, [f"{name}-g{r}" for r in range(ranks)]


def _round(agg: NodeHealthAggregator, members: list[str], seq: int, clock: Clock, busy: dict[str, float],
           noise: float = 0.0, rng: random.Random | None = None) -> int:
    """One window of every rank; returns the summaries written."""
    written = 0
    for m in members:
        b = busy.get(m, 0.5) + (rng.gauss(0.0, noise) if rng is not None else 0.0)
        written += agg.maybe_flush(_window(m, seq, min(1.0, max(0.0, b)), clock.t))
    return written + agg.tick()


def _settled(agg: NodeHealthAggregator, members: list[str], clock: Clock, windows: int, wait: float) -> None:
    """``windows`` healthy windows of every rank, then ``wait`` s and a tick: the node's
    first summary (a minor change) is written and its bucket refilled."""
    for seq in range(1, windows + 1):
        clock.t += 1.0
        _round(agg, members, seq, clock, {})
    clock.t += wait
    agg.tick()
    assert agg.writes == 1


def test_a_quiet_node_writes_its_first_summary_once_then_nothing():
    """A node whose ranks stay within the deadband writes its first summary (a minor
    change: at a random time within nodes / budget s) and nothing after it."""
    clock = Clock()
    agg, rec, members = _node(clock, nodes=50)             # spread: 50 nodes / 10 writes/s = 5 s
    rng = random.Random(1)
    for seq in range(1, 301):                              # 5 minutes of 1 s windows, noise far under 0.05
        clock.t += 1.0
        _round(agg, members, seq, clock, {}, noise=0.005, rng=rng)
        if seq == 6:
            assert agg.writes == 1                         # within the spread
    assert agg.writes == 1 and len(rec.puts) == 1
    body = json.loads(rec.puts[0][1])
    assert body["v"] == 3 and set(body["ranks"]) == set(members)


def test_a_rank_turning_slow_is_written_at_its_second_window_and_followed():
    """Significant: a rank whose local score moves by >= shift in two consecutive windows
    is written at once (the second), then every confirm_windows windows while followed;
    each summary's run tells how many windows it stands for."""
    clock = Clock()
    agg, rec, members = _node(clock, nodes=12_500)          # a token per 1,250 s: only the reserve helps
    _settled(agg, members, clock, 10, 2000.0)
    slow = members[5]
    at_write = []
    for seq in range(11, 40):
        clock.t += 1.0
        if _round(agg, members, seq, clock, {slow: 1.0}):
            at_write.append(seq)
    # the 2nd slow window, then follow-ups every 3 windows while the reserve lasts (burst - 1 = 4 tokens;
    # the next token comes 1,250 s later: its summary would carry the whole run)
    assert at_write == [12, 15, 18, 21]
    runs = [parse_summary(v)[slow]["run"] for _, v in rec.puts[1:]]
    assert runs == [2, 5, 8, 11]
    quiet = parse_summary(rec.puts[-1][1])[members[0]]
    assert quiet["run"] >= 20 and quiet["seq"] == 21        # the others: one long run


def test_one_window_off_is_not_written_at_once():
    """A single outlier window (noise) is not significant: nothing is written at once."""
    clock = Clock()
    agg, rec, members = _node(clock, nodes=12_500)
    _settled(agg, members, clock, 5, 2000.0)
    n = agg.writes
    clock.t += 1.0
    _round(agg, members, 6, clock, {members[2]: 0.9})      # one window far off ...
    for seq in range(7, 20):
        clock.t += 1.0
        _round(agg, members, seq, clock, {})               # ... then back
    assert agg.writes == n                                  # a minor change at most, spread over 1,250 s


def test_the_budget_bounds_the_job_s_writes_whatever_the_noise():
    """Every window crossing the thresholds (noise far beyond the deadband): the job's
    summaries stay within budget x time + burst per node, and no node writes twice
    within min_gap."""
    clock = Clock()
    nodes = 40
    policy = SummaryPolicy(budget=10.0, burst=5.0)
    aggs = [_node(clock, nodes=nodes, name=f"n{i}", policy=policy) for i in range(nodes)]
    rng = random.Random(7)
    t0 = clock.t
    for seq in range(1, 601):                               # 10 minutes
        clock.t += 1.0
        for agg, _, members in aggs:
            _round(agg, members, seq, clock, {m: rng.choice((0.2, 0.9)) for m in members})
    total = sum(a.writes for a, _, _ in aggs)
    assert total <= policy.budget * (clock.t - t0) + policy.burst * nodes
    assert total >= 0.8 * policy.budget * (clock.t - t0)    # and the budget is used, not starved
    assert all(a.deferred > 0 for a, _, _ in aggs)


def test_a_change_every_node_sees_is_spread_over_nodes_over_budget():
    """Every rank of every node shifts alike (a new training phase): not significant for
    any rank (the local scores do not move), a minor change for each node: the writes
    spread over about nodes / budget seconds instead of coming together."""
    clock = Clock()
    nodes = 200
    aggs = [_node(clock, nodes=nodes, name=f"n{i}") for i in range(nodes)]
    for seq in range(1, 4):
        clock.t += 1.0
        for agg, _, members in aggs:
            _round(agg, members, seq, clock, {})
    clock.t += 100.0
    for agg, _, _ in aggs:
        agg.tick()                                          # every first summary written; buckets refill
    clock.t += 1000.0
    first = [a.writes for a, _, _ in aggs]
    assert first == [1] * nodes
    times: list[float] = []
    for seq in range(4, 40):                                # the phase: busy 0.5 -> 0.8 on every rank
        clock.t += 1.0
        for agg, _, members in aggs:
            if _round(agg, members, seq, clock, {m: 0.8 for m in members}):
                times.append(clock.t)
    spread = nodes / SummaryPolicy().budget                 # 20 s
    per_second = {t: times.count(t) for t in times}
    assert nodes <= len(times) <= 2 * nodes                 # each node once or twice (the level moved on)
    assert max(times) - min(times) > spread / 2
    assert max(per_second.values()) <= 4 * SummaryPolicy().budget, per_second   # not every node at once


def test_a_rank_that_left_is_dropped_and_the_policy_validates():
    clock = Clock()
    agg, rec, members = _node(clock, nodes=1)
    _settled(agg, members, clock, 3, 5.0)
    agg.drop(members[3])
    clock.t += 5.0
    agg.tick()
    assert members[3] not in parse_summary(rec.puts[-1][1])
    with pytest.raises(ConfigError, match="health-write-budget"):
        SummaryPolicy(budget=0).validate()
    with pytest.raises(ConfigError, match="deadband"):
        SummaryPolicy(deadband=0.2, shift=0.1).validate()


@pytest.mark.parametrize("body, field", [
    ({"v": 3, "node": "n", "at": 1.0, "ranks": {"m": [1, 2, 0.1, 10, 1.0, 0.5]}}, "ranks.m"),
    ({"v": 3, "node": "n", "at": 1.0, "ranks": {"m": [1, -2, 0.1, 10, 1.0, 0.5, 1]}}, "seq"),
    ({"v": 3, "node": "n", "at": 1.0, "ranks": {"m": [1, 2, 0.1, 10, "x", 0.5, 1]}}, "window_s"),
    ({"v": 3, "node": "n", "at": 1.0, "ranks": {"m": [1, 2, 0.1, 10, 1.0, 0.5, 1, {"p": -1}]}}, "link_bps"),
    ({"v": 3, "node": "n", "at": 1.0, "ranks": {"bad id": [1, 2, 0.1, 10, 1.0, 0.5, 1]}}, "bad id"),
    ({"v": 3, "node": "n", "ranks": {}}, "at"),
])
def test_parse_summary_names_the_field_it_refuses(body, field):
    with pytest.raises(RecordError, match=field):
        parse_summary(json.dumps(body).encode(), "/k")


def test_held_windows_count_their_run_and_stay_current():
    """A summary's record (with ``run``) counts min(run, seq - last counted) windows and
    is current whatever its age; a per-rank record (no run) counts one and goes stale."""
    det = StragglerDetector(StragglerConfig(link_probe=False))
    ring = [f"m{i}" for i in range(8)]

    def recs(seq: int, run: int, at: float, slow_busy: float = 1.0) -> dict[str, HealthRecord]:
        out: dict[str, HealthRecord] = {}
        for m in ring:
            r = _window(m, seq, slow_busy if m == "m3" else 0.5, at)
            r["run"] = run
            out[m] = r
        return out

    det.update(recs(1, 1, 0.0), ring, 1, now=1.0)
    assert det.members["m3"].slow_run == 1
    det.update(recs(3, 5, 0.0), ring, 1, now=1000.0)       # 1000 s old, yet current; 2 new windows counted
    assert det.members["m3"].state == DEMOTED
    stale = {m: _window(m, 9, 1.0 if m == "m3" else 0.5, 0.0) for m in ring}   # no run: stale after stale_s
    det2 = StragglerDetector(StragglerConfig(link_probe=False))
    det2.update(stale, ring, 1, now=1000.0)
    assert "m3" not in det2.members


def test_summaries_through_etcd_feed_the_cache_and_the_detector_probes_then_demotes(etcd_session, job_name):
    """Four real aggregators write to etcd; the coordinator's HealthCache (one paged
    read, then a watch) hands the detector the changed records each pass; the slow rank
    is probed (its ring link avoided), then, on a ring without that link, demoted, with
    far fewer writes than one per node and second. read_health reads the same records
    back; a malformed summary is skipped."""
    store = Store(etcd_session.endpoints)
    cache = HealthCache(store, job_name)
    try:
        clock = Clock()
        tap = Tap(store)
        aggs = []
        for i in range(4):
            agg = NodeHealthAggregator(tap, job_name, f"n{i}", None, clock=clock, wall=clock,  # type: ignore[arg-type]
                                       rng=random.Random(i))
            agg.set_job_size(4)
            aggs.append((agg, [f"n{i}-g{r}" for r in range(4)]))
        ring = [m for _, ms in aggs for m in ms]
        slow = "n1-g2"
        det = StragglerDetector()
        epoch, states = 1, []
        for seq in range(1, 41):
            clock.t += 1.0
            for agg, members in aggs:
                for m in members:
                    agg.maybe_flush(_window(m, seq, 1.0 if m == slow and seq > 3 else 0.5, clock.t, epoch))
                agg.tick()
            want = tap.expanded()
            wait_for(lambda: cache.copy() == want, 30, "the cache to hold every summary written")
            det.update(cache.records(), ring, epoch, now=clock.t)
            st = det.members.get(slow)
            states.append(st.state if st is not None else "ok")
            if st is not None and st.state == PROBE and st.probe_edge and ring.index(slow) + 1 < len(ring) \
                    and ring[ring.index(slow) + 1] == st.probe_edge[1]:
                ring.remove(slow)                                   # the next epoch's ring avoids the link
                ring.insert((ring.index(st.probe_edge[1]) + len(ring) // 2) % len(ring), slow)
                epoch += 1
            if states[-1] == DEMOTED:
                break
        assert PROBE in states and states[-1] == DEMOTED, states
        assert sum(a.writes for a, _ in aggs) < 4 * len(states) / 3, [a.writes for a, _ in aggs]
        assert cache.reads == 1
        store.put(keys.health_of(job_name, "bad"), b'{"v":3,"node":"bad","at":1,"ranks":{"x":[1]}}')
        assert read_health(store, job_name) == tap.expanded()
    finally:
        cache.close()
        store.close()


class Tap:
    """A store that remembers the last value put under each key (what etcd holds)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.last: dict[str, bytes] = {}

    def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        rev = self.store.put(key, value, lease=lease)
        self.last[key] = value
        return rev

    def expanded(self) -> dict[str, HealthRecord]:
        out: dict[str, HealthRecord] = {}
        for key, value in self.last.items():
            out.update(parse_summary(value, key))
        return out


def test_read_health_is_paged_past_a_thousand_summaries(etcd_session, job_name):
    """read_health reads health/ in pages of 1,000 keys (one range of 12,500 summaries
    would pass gRPC's 4 MiB limit): 1,200 summaries, every rank read back."""
    store = Store(etcd_session.endpoints)
    try:
        for start in range(0, 1200, 100):
            ops = []
            for i in range(start, start + 100):
                body = {"v": 3, "node": f"n{i:04d}", "at": 10.0, "ranks": {f"n{i:04d}-g0": [1, 1, 0.5, 10, 1.0, 0.5, 1]}}
                ops.append(Put(keys.health_of(job_name, f"n{i:04d}"), json.dumps(body).encode()))
            store.txn([], ops)
        got = read_health(store, job_name)
        assert len(got) == 1200 and got["n0999-g0"]["run"] == 1 and got["n1199-g0"]["at"] == 9.5
    finally:
        store.close()


def test_the_reporter_sink_feeds_the_aggregator_not_etcd(etcd_session, job_name):
    """Through HealthReporter's sink, rank windows reach the node's aggregator: no
    per-rank key, one node summary."""
    store = Store(etcd_session.endpoints)
    try:
        clock = Clock()
        agg = NodeHealthAggregator(store, job_name, "node7", None, clock=clock, wall=clock)
        reps = [HealthReporter(store, job_name, f"r{i}", None, TransportStats(), interval=1.0,
                               clock=clock, sink=agg.maybe_flush) for i in range(4)]
        for _ in range(5):
            clock.t += 1.0
            for r in reps:
                r.op_done(1, 0.01)
        agg.tick()
        got = store.get_prefix(keys.health(job_name))
        assert [kv.key for kv in got] == [keys.health_of(job_name, "node7")]
        assert set(read_health(store, job_name)) == {"r0", "r1", "r2", "r3"}
    finally:
        store.close()
