"""Straggler policy inside the real coordinator, against a real etcd: members (real leases,
registered as workers do) write health records as the rank-side reporter would; the test
checks the epochs the coordinator publishes — probe, demotion, promotion back to the
topology-optimal ring — and what ``resilient status`` shows."""
from __future__ import annotations

import re

import threading
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from resilient.coordinator import EpochWatcher, MemberInfo, MemberSession, Store
from resilient.coordinator.health import StragglerPolicy, make_record, read_scores, write_health
from resilient.coordinator.planner import plan
from resilient.coordinator.service import Coordinator, CoordinatorConfig
from resilient.coordinator.straggler import StragglerConfig
from cp_helpers import wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def store(etcd_session):
    s = Store(etcd_session.endpoints)
    yield s
    s.close()


class Feeder:
    """Writes one health window per member every ``period`` seconds: ``slow`` members
    spend 60 % of each op busy (their peers wait on them), the others 5 %."""

    def __init__(self, store, job, sessions, watcher, period=0.15) -> None:
        self.store, self.job, self.sessions, self.watcher = store, job, sessions, watcher
        self.slow: set[str] = set()
        self.period = period
        self.seq = 0
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stop.wait(self.period):
                self.seq += 1
                epoch = self.watcher.current()
                number = epoch.number if epoch else 0
                for s in self.sessions:
                    busy = 0.6 if s.member_id in self.slow else 0.05
                    ops, window = 20, 1.0
                    rec = make_record(s.member_id, number, self.seq, ops, window, {"peer": window * (1 - busy)})
                    write_health(self.store, self.job, s.member_id, rec, s.lease_id)
        except BaseException as exc:  # surfaced by the test
            self.errors.append(exc)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


@contextmanager
def running_coordinator(etcd_session, store, job: str, cid: str, policy, infos):
    """A real Coordinator (its own etcd client, a thread) under ``policy``, the members
    registered with leases, an epoch watcher recording every epoch in ``seen`` and a
    :class:`Feeder` writing their health windows. Everything is stopped on exit."""
    cstore = Store(etcd_session.endpoints)
    coord = Coordinator(cstore, job, cid, CoordinatorConfig(join_debounce=0.2, resync_interval=0.2),
                        health_policy=policy)
    stop = threading.Event()
    thread = threading.Thread(target=coord.run, args=(stop,), daemon=True)
    thread.start()
    sessions = [MemberSession.register(store, job, info, ttl=5.0) for info in infos]
    watcher = EpochWatcher(store, job)
    seen: list = []
    watcher.subscribe(seen.append)
    feeder = Feeder(store, job, sessions, watcher)
    try:
        yield SimpleNamespace(coord=coord, watcher=watcher, feeder=feeder, sessions=sessions, seen=seen)
    finally:
        feeder.close()
        watcher.close()
        for s in sessions:
            s.close()
        stop.set()
        thread.join(timeout=15)
        cstore.close()


def test_slow_member_is_demoted_then_promoted_back_to_the_optimal_ring(etcd_session, store, job_name):
    infos = [MemberInfo(member_id=f"m{i}", host=f"h{i // 2}", local_rank=i % 2, address=f"127.0.0.1:{21000 + i}")
             for i in range(5)]
    optimal = plan(infos).ring
    policy = StragglerPolicy(StragglerConfig(confirm_windows=3, release_windows=4))
    with running_coordinator(etcd_session, store, job_name, "c-straggler", policy, infos) as run:
        coord, watcher, feeder, seen = run.coord, run.watcher, run.feeder, run.seen
        first = watcher.wait_for(lambda e: len(e.members) == 5, 15)
        assert first.members == optimal
        victim = optimal[1]
        feeder.slow = {victim}
        probe = watcher.wait_for(lambda e: e.plan.get("avoid"), 20)
        assert probe.cause == "health"
        assert set(probe.roles.values()) == {"active"}
        (a, b), = probe.plan["avoid"]
        assert victim in (a, b)
        i = probe.members.index(a)
        assert b not in (probe.members[i - 1], probe.members[(i + 1) % 5])   # not ring neighbours
        demoted = watcher.wait_for(lambda e: e.roles.get(victim) == "demoted", 20)
        assert demoted.members[-1] == victim and demoted.plan["demoted"] == [victim]
        assert not demoted.plan.get("avoid")
        status = wait_until(lambda: (s := read_scores(store, job_name)).get("members", {}).get(victim, {})
                            .get("state") == "demoted" and s, 10, "scores published")
        assert status["members"][victim]["score"] > 0.1
        from resilient.cli.status import collect
        row = {r["id"]: r for r in collect(store, job_name)["members"]}[victim]
        assert row["state"] == "demoted" and row["straggler_state"] == "demoted" and row["straggler_score"] > 0.1
        # the coordinator's /metrics carries the same scores (issue 8)
        text = coord.metrics.render().decode()
        score = re.search(r'^resilient_straggler_score{stat="max"} ([0-9.e+-]+)$', text, re.M)
        assert score is not None and float(score.group(1)) > 0.1, text

        n_before = len(seen)
        feeder.slow = set()
        back = watcher.wait_for(lambda e: e.number > demoted.number and set(e.roles.values()) == {"active"}, 20)
        assert back.members == optimal and not back.plan.get("avoid")
        # Stays put: more healthy windows publish nothing new (no flapping).
        seq = feeder.seq
        wait_until(lambda: feeder.seq >= seq + 8, 10, "8 more health windows")
        assert watcher.current().number == back.number
        assert [e.cause for e in seen[n_before:]] == ["health"]
        assert not feeder.errors


def test_deadline_policy_publishes_its_deadline_in_every_demoting_epochs_plan(etcd_session, store, job_name):
    """``--straggler-policy deadline``: the same detection; the epoch that demotes carries
    ``plan["leaf_deadline_ms"]`` (so every member applies the same value), the epoch that
    promotes back does not (no leaf: nothing to apply). Bad values are refused up front."""
    from resilient.errors import ConfigError

    for bad in (-1, float("nan"), "x", 1e9):
        with pytest.raises(ConfigError, match="leaf deadline"):
            StragglerPolicy(StragglerConfig(), leaf_deadline_ms=bad)
    infos = [MemberInfo(member_id=f"m{i}", host="h", local_rank=i, address=f"127.0.0.1:{22000 + i}")
             for i in range(4)]
    policy = StragglerPolicy(StragglerConfig(confirm_windows=3, release_windows=4), leaf_deadline_ms=25)
    with running_coordinator(etcd_session, store, job_name, "c-deadline", policy, infos) as run:
        watcher, feeder = run.watcher, run.feeder
        first = watcher.wait_for(lambda e: len(e.members) == 4, 15)
        assert "leaf_deadline_ms" not in first.plan
        feeder.slow = {"m1"}
        demoted = watcher.wait_for(lambda e: e.roles.get("m1") == "demoted", 30)
        assert demoted.plan["leaf_deadline_ms"] == 25.0
        feeder.slow = set()
        back = watcher.wait_for(lambda e: e.number > demoted.number and set(e.roles.values()) == {"active"}, 30)
        assert "leaf_deadline_ms" not in back.plan
        assert not feeder.errors
