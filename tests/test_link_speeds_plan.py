"""Measured link speeds reach the published plan (issue 16), against a real etcd: an
in-process coordinator, members registered on leases, health windows written by real
:class:`~resilient.health_reporter.HealthReporter` instances from transport counters.
The plan's link classes and shard weights follow the measured speeds, noise inside the
hysteresis band publishes no epoch, a change seen in fewer than half of the windows
publishes nothing, and a real change (most of the last windows) publishes exactly one."""
from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Iterator

from resilient.coordinator import EpochWatcher, MemberInfo, MemberSession, Store
from resilient.health_reporter import LINK_MIN_WINDOWS, LINK_WINDOWS, HealthReporter
from resilient.transport.base import TransportStats
from cp_helpers import CoordinatorThread

HOSTS = {"a0": "A", "a1": "A", "b0": "B", "b1": "B"}


class Reporters:
    """One reporter per member; :meth:`window` feeds each one second of frames received
    from every peer on the other host at the link's speed — the
    slower end's ``speed`` (a NIC each), times ``noise[receiver]`` — and writes the
    window as the reporter does."""

    def __init__(self, store: Store, job: str, sessions: dict[str, MemberSession]) -> None:
        self.clock = [0.0]
        self.stats = {m: TransportStats() for m in HOSTS}
        self.reps = {m: HealthReporter(store, job, m, s.lease_id, self.stats[m], interval=1.0,
                                       clock=lambda: self.clock[0]) for m, s in sessions.items()}

    def window(self, speed: dict[str, float], noise: dict[str, float] | None = None) -> None:
        self.clock[0] += 1.5
        for r, st in self.stats.items():
            for p in HOSTS:
                if HOSTS[p] != HOSTS[r]:
                    st.add_link(p, int(min(speed[p], speed[r]) * (noise or {}).get(r, 1.0)), 1.0)
            assert self.reps[r].op_done(1, 0.01)

    def windows(self, n: int, speed: dict[str, float]) -> None:
        for _ in range(n):
            self.window(speed)


#: windows of a new speed before the median of the last LINK_WINDOWS moves to it
TO_MOVE = LINK_WINDOWS // 2 + 1


@contextmanager
def measured_job(etcd_session, job_name: str, **config: object) -> Iterator[tuple[Store, EpochWatcher, CoordinatorThread, Reporters]]:
    """An in-process coordinator (``config`` on top of fast passes), the :data:`HOSTS`
    members registered on leases, an epoch watcher and their health reporters (made once
    the first epoch is seen); all closed afterwards."""
    store = Store(etcd_session.endpoints)
    coord = CoordinatorThread(etcd_session.endpoints, job_name, join_debounce=0.05, resync_interval=0.1, **config)
    sessions = {m: MemberSession.register(store, job_name, MemberInfo(
        member_id=m, host=h, local_rank=int(m[1]), address=f"127.0.0.1:{21000 + i}"), ttl=5.0)
        for i, (m, h) in enumerate(HOSTS.items())}
    watcher = EpochWatcher(store, job_name)
    try:
        watcher.wait_for(lambda e: len(e.members) == 4, 15)
        yield store, watcher, coord, Reporters(store, job_name, sessions)
    finally:
        watcher.close()
        coord.close()
        for s in sessions.values():
            s.close()
        store.close()


def test_published_plan_follows_measured_speeds_without_flapping(etcd_session, job_name):
    with measured_job(etcd_session, job_name) as (store, watcher, coord, reps):
        first = watcher.current()
        assert "link_bps" not in first.plan and "shard_weights" not in first.plan
        # local index 0 (a0, b0) has the fast links; a figure is reported once LINK_MIN_WINDOWS
        # windows measured the link
        reps.windows(LINK_MIN_WINDOWS, {"a0": 2e8, "a1": 1e8, "b0": 2e8, "b1": 1e8})
        measured = watcher.wait_for(lambda e: "link_bps" in e.plan, 15)
        assert measured.number == first.number + 1 and measured.cause == "health"
        assert measured.plan["link_bps"] == {"a0": 2e8, "a1": 1e8, "b0": 2e8, "b1": 1e8}
        assert measured.plan["link_classes"] == [[2e8, ["a0", "b0"]], [1e8, ["a1", "b1"]]]
        assert measured.plan["shard_weights"] == [round(2 / 3, 6), round(1 / 3, 6)]
        # ten windows of up to +-20 % noise (inside the 25 % band): no epoch
        wobble = itertools.cycle([0.82, 1.2, 0.9, 1.15, 1.05])
        for _ in range(10):
            reps.window({"a0": 2e8, "a1": 1e8, "b0": 2e8, "b1": 1e8}, {r: next(wobble) for r in HOSTS})
            coord.wait_reconciles(2)   # the pass after the write has read it
        assert watcher.current().number == measured.number
        # index 1's links become four times faster: the median of the last LINK_WINDOWS windows
        # moves when most of them say so, not before (a few windows are swings), and exactly
        # one new epoch follows, weights flipped
        for _ in range(TO_MOVE - 1):
            reps.window({"a0": 2e8, "a1": 4e8, "b0": 2e8, "b1": 4e8})
            coord.wait_reconciles(2)
        assert watcher.current().number == measured.number
        reps.window({"a0": 2e8, "a1": 4e8, "b0": 2e8, "b1": 4e8})
        moved = watcher.wait_for(lambda e: e.number > measured.number, 15)
        assert moved.plan["link_classes"] == [[4e8, ["a1", "b1"]], [2e8, ["a0", "b0"]]]
        assert moved.members == ("a1", "a0", "b1", "b0")   # each host ordered fastest first
        assert moved.plan["shard_weights"] == [round(2 / 3, 6), round(1 / 3, 6)]
        coord.wait_reconciles(3)
        assert watcher.current().number == moved.number == measured.number + 1
