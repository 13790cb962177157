"""``--straggler-policy evict`` (coordinator/eviction.py, resilient/collectives/eviction.py).

Pure tests of the eviction book and the policy (no I/O, ``now`` passed in), the CLI
flags and the evicted member's error; then the policy inside the real coordinator against
a real etcd (members with real leases writing health records, as in
test_straggler_coordinator.py): evicted -> status -> re-admitted after the hold only once
it asked -> evicted again on a relapse with the hold doubled. The real-process test
(Communicator, Evicted, rejoin) is in test_straggler_procs.py.
"""
from __future__ import annotations

import pytest

from resilient.coordinator.epoch import Epoch
from resilient.coordinator.eviction import (
    EVICTED, EvictionBook, EvictionConfig, EvictPolicy, read_requests, request_readmission,
)
from resilient.coordinator.straggler import OK, StragglerConfig
from resilient.errors import ConfigError, Evicted, RemovedFromGroup

IDS = ["m0", "m1", "m2", "m3", "m4"]


# -- the book --------------------------------------------------------------------------------

def test_confirmed_member_is_evicted_for_the_hold_and_readmitted_only_after_it_and_once_it_asked():
    book = EvictionBook(EvictionConfig(hold_s=10, max_hold_s=100, relapse_window_s=30))
    fresh, released, refused = book.update({"m2"}, IDS, {}, IDS, epoch=4, now=100.0)
    assert (fresh, released, refused) == ({"m2"}, set(), set())
    ev = book.evicted["m2"]
    assert (ev.at, ev.until, ev.hold_s, ev.count, ev.after_epoch) == (100.0, 110.0, 10, 1, 4)
    ring = [m for m in IDS if m != "m2"]
    # asked, but the hold is not over
    assert book.update((), IDS, {"m2": 5}, ring, 5, 109.9)[1] == set()
    # hold over, but no request: stays out (the survivors never wait for a member not ready)
    assert book.update((), IDS, {}, ring, 5, 120.0)[1] == set()
    # a request older than the eviction (answers epoch <= 4) does not count
    assert book.update((), IDS, {"m2": 4}, ring, 5, 121.0)[1] == set()
    assert book.update((), IDS, {"m2": 5}, ring, 5, 122.0)[1] == {"m2"}
    assert "m2" not in book.evicted and book.probation_epoch("m2") is None
    book.update((), IDS, {}, IDS, 6, 123.0)     # the first epoch that has it again
    assert book.probation_epoch("m2") == 6


def test_a_relapse_within_the_window_doubles_the_hold_up_to_the_cap_and_a_late_one_does_not():
    book = EvictionBook(EvictionConfig(hold_s=10, max_hold_s=25, relapse_window_s=30))
    ring = [m for m in IDS if m != "m1"]
    t, n = 0.0, 1

    def cycle(expected_hold: float, count: int, healthy_for: float = 5.0) -> None:
        nonlocal t, n
        book.update({"m1"}, IDS, {}, IDS, n, t)
        ev = book.evicted["m1"]
        assert (ev.hold_s, ev.count) == (expected_hold, count)
        t += ev.hold_s
        n += 1
        assert book.update((), IDS, {"m1": n}, ring, n, t)[1] == {"m1"}
        n += 1
        book.update((), IDS, {}, IDS, n, t)
        t += healthy_for

    cycle(10, 1)
    cycle(20, 2)        # relapse 5 s after re-admission: doubled
    cycle(25, 3)        # doubled again, capped
    cycle(25, 4, healthy_for=31)
    cycle(10, 1)        # confirmed slow 31 s after re-admission: a fresh start


def test_never_more_than_n_minus_1_over_2_members_out_and_a_dead_evicted_member_is_forgotten():
    book = EvictionBook(EvictionConfig(hold_s=10))
    fresh, _, refused = book.update({"m0", "m1", "m2"}, IDS, {}, IDS, 1, 0.0)
    assert fresh == {"m0", "m1"} and refused == {"m2"}            # 5 members: at most 2 out
    # m0's lease ends while evicted: forgotten, which frees a slot
    alive = [m for m in IDS if m != "m0"]
    fresh, _, refused = book.update({"m2"}, alive, {}, ["m2", "m3", "m4"], 2, 1.0)
    assert "m0" not in book.evicted and fresh == set() and refused == {"m2"}   # 4 alive: 1 out
    assert EvictionBook().update({"m0"}, ["m0", "m1"], {}, ["m0", "m1"], 1, 0.0)[2] == {"m0"}  # never the last
    assert EvictionBook().update({"m0"}, ["m0", "m1", "m2"], {}, ["m0", "m1", "m2"], 1, 0.0)[0] == {"m0"}


def test_eviction_config_is_validated():
    for bad in (dict(hold_s=-1), dict(hold_s=float("nan")), dict(hold_s=10, max_hold_s=5), dict(relapse_window_s=-1)):
        with pytest.raises(ConfigError, match="eviction"):
            EvictionBook(EvictionConfig(**bad))


# -- the policy (detector + book) --------------------------------------------------------------

def _epoch(number: int, members, plan=None) -> Epoch:
    return Epoch(number=number, members=tuple(members), roles={m: "active" for m in members}, plan=plan or {})


def _records(members, slow: set, seq: int, epoch: int, at: float) -> dict:
    """One window per member: ``slow`` members busy 60 % of each op, the others 5 %."""
    return {m: {"seq": seq, "epoch": epoch, "at": at, "ops": 20, "window_s": 1.0,
                "wait_s": {"x": 1.0 - (0.6 if m in slow else 0.05)}} for m in members}


def test_policy_evicts_instead_of_demoting_keeps_probation_and_reports_state():
    policy = EvictPolicy(StragglerConfig(link_probe=False, confirm_windows=3), EvictionConfig(hold_s=5))
    e = _epoch(1, IDS)
    t = 1000.0
    v = None
    for k in range(3):
        t += 1
        v = policy.evaluate_alive(_records(IDS, {"m3"}, k, 1, t), e, IDS, {}, now=t)
    assert v.demoted == frozenset()                         # never a leaf under evict
    assert set(policy.evicted) == {"m3"} and v.scores["m3"]["state"] == EVICTED
    assert v.scores["m3"]["until"] == pytest.approx(t + 5)
    e2 = _epoch(2, [m for m in IDS if m != "m3"], {"evicted": {"m3": policy.evicted["m3"].to_dict()}})
    t += 6
    policy.evaluate_alive(_records(e2.members, set(), 10, 2, t), e2, IDS, {"m3": 2}, now=t)
    assert "m3" not in policy.evicted and "m3" in policy.readmitted
    # back in epoch 3, on probation: its stale window from epoch 2 (a slow one) is ignored,
    # windows of epoch 3 count
    e3 = _epoch(3, IDS)
    for k in range(3):
        t += 1
        recs = _records(IDS, set(), 20 + k, 3, t)
        recs["m3"] = {**_records(["m3"], {"m3"}, 20 + k, 2, t)["m3"]}
        v = policy.evaluate_alive(recs, e3, IDS, {}, now=t)
    assert not policy.evicted and v.scores.get("m3", {}).get("state") in (None, OK)
    for k in range(3):                                      # slow again within the window: hold doubled
        t += 1
        v = policy.evaluate_alive(_records(IDS, {"m3"}, 30 + k, 3, t), e3, IDS, {}, now=t)
    assert policy.evicted["m3"].hold_s == 10 and policy.evicted["m3"].count == 2


def test_policy_refuses_past_the_cap_without_making_a_leaf_and_a_new_leader_keeps_the_book():
    members = ["m0", "m1", "m2", "m3"]
    policy = EvictPolicy(StragglerConfig(link_probe=False, confirm_windows=2), EvictionConfig(hold_s=50))
    seeded = _epoch(7, ["m0", "m2", "m3"], {"evicted": {"m1": {"at": 1.0, "until": 51.0, "hold_s": 50.0, "count": 1,
                                                         "after_epoch": 6}}})
    # a new leader: m1 is already out (from the published plan); m2 confirmed slow is refused
    # (4 alive: at most 1 out), stays in the ring and is not demoted either
    t = 10.0
    v = None
    for k in range(2):
        t += 1
        v = policy.evaluate_alive(_records(members, {"m2"}, k, 7, t), seeded, members, {}, now=t)
    assert set(policy.evicted) == {"m1"} and policy.evicted["m1"].until == 51.0
    assert v.demoted == frozenset() and v.scores["m2"]["state"] == OK
    assert policy.detector.members["m2"].state == OK


def test_cli_evict_policy_and_hold_flag():
    import argparse

    from resilient.cli import coordinator as cli

    ap = argparse.ArgumentParser()
    cli.add_arguments(ap)
    base = ["--etcd", "127.0.0.1:1", "--job", "j"]
    p = cli.health_policy_from_args(ap.parse_args(base + ["--straggler-policy", "evict"]))
    assert isinstance(p, EvictPolicy) and p.book.config.hold_s == 30.0 and p.leaf_deadline_ms is None
    p = cli.health_policy_from_args(ap.parse_args(base + ["--straggler-policy", "evict", "--evict-hold-s", "2.5"]))
    assert p.book.config.hold_s == 2.5
    p = cli.health_policy_from_args(ap.parse_args(base + ["--straggler-policy", "evict", "--evict-hold-s", "900"]))
    assert p.book.config.max_hold_s == 900
    with pytest.raises(ConfigError, match="--straggler-policy evict"):
        cli.health_policy_from_args(ap.parse_args(base + ["--evict-hold-s", "5"]))
    with pytest.raises(ConfigError, match="--evict-hold-s"):
        cli.health_policy_from_args(ap.parse_args(base + ["--straggler-policy", "evict", "--evict-hold-s", "-1"]))


def test_the_evicted_member_gets_evicted_naming_the_readmission_time_and_how_to_come_back():
    from resilient.collectives.eviction import removed_error

    e = _epoch(9, ["m0", "m1"], {"evicted": {"m2": {"at": 1.0, "until": 4e9, "hold_s": 30.0}}})
    err = removed_error("m2", e, "plain")
    assert isinstance(err, Evicted) and isinstance(err, RemovedFromGroup)
    assert (err.epoch, err.readmit_at, err.hold_s) == (9, 4e9, 30.0)
    msg = str(err)
    assert "evicted" in msg and "straggler" in msg and "epoch 9" in msg and "rejoin" in msg and "hold 30 s" in msg
    plain = removed_error("m3", e, "plain")
    assert type(plain) is RemovedFromGroup and str(plain) == "plain"
    import resilient

    assert resilient.Evicted is Evicted


# -- inside the real coordinator, real etcd ---------------------------------------------------

@pytest.mark.timeout(120)
def test_coordinator_evicts_readmits_on_request_and_doubles_the_hold_on_relapse(etcd_session, job_name):
    from contextlib import closing

    from test_straggler_coordinator import running_coordinator

    from cp_helpers import wait_until
    from resilient.cli.status import collect
    from resilient.coordinator import MemberInfo, Store
    from resilient.coordinator.health import read_scores
    from resilient.coordinator.planner import plan

    infos = [MemberInfo(member_id=f"m{i}", host=f"h{i // 2}", local_rank=i % 2, address=f"127.0.0.1:{23000 + i}")
             for i in range(5)]
    optimal = plan(infos).ring
    hold = 1.0
    policy = EvictPolicy(StragglerConfig(confirm_windows=3, release_windows=4), EvictionConfig(hold_s=hold))
    with closing(Store(etcd_session.endpoints)) as store, \
            running_coordinator(etcd_session, store, job_name, "c-evict", policy, infos) as run:
        coord, watcher, feeder, sessions, seen = run.coord, run.watcher, run.feeder, run.sessions, run.seen
        watcher.wait_for(lambda e: len(e.members) == 5, 15)
        victim = optimal[2]
        vsession = sessions[[i.member_id for i in infos].index(victim)]
        feeder.slow = {victim}
        out = watcher.wait_for(lambda e: victim not in e.members, 30)
        assert out.cause == "evicted" and out.removed == (victim,)
        assert set(out.roles.values()) == {"active"}                 # nobody demoted under evict
        ev = out.plan["evicted"][victim]
        assert ev["hold_s"] == hold and ev["count"] == 1 and ev["until"] == pytest.approx(ev["at"] + hold)
        assert vsession.lease_id and not vsession.lost.is_set()      # its lease stays alive
        rows = {r["id"]: r for r in collect(store, job_name)["members"]}
        assert rows[victim]["state"] == "evicted" and rows[victim]["evicted_until"] == ev["until"]
        wait_until(lambda: read_scores(store, job_name).get("members", {}).get(victim, {}).get("state") == EVICTED,
                   10, "scores say evicted")
        # past the hold but never asked: it stays out (resyncs every 0.2 s see the hold over)
        import time

        wait_until(lambda: time.time() > ev["until"], 10, "the hold is over")
        n = coord.reconciles
        wait_until(lambda: coord.reconciles >= n + 3, 10, "three more reconcile passes")
        assert victim not in watcher.current().members
        request_readmission(store, job_name, victim, out.number, vsession.lease_id)
        assert read_requests(store, job_name) == {victim: out.number}
        back = watcher.wait_for(lambda e: victim in e.members, 15)
        assert back.cause == "readmitted" and back.added == (victim,) and "evicted" not in back.plan
        assert back.members == optimal and back.published_at >= ev["until"]
        # still slow: confirmed again on probation -> evicted again with the hold doubled
        again = watcher.wait_for(lambda e: e.number > back.number and victim not in e.members, 30)
        assert again.cause == "evicted"
        ev2 = again.plan["evicted"][victim]
        assert ev2["hold_s"] == 2 * hold and ev2["count"] == 2
        # healed, asks again: re-admitted and stays in
        feeder.slow = set()
        request_readmission(store, job_name, victim, again.number, vsession.lease_id)
        back2 = watcher.wait_for(lambda e: e.number > again.number and victim in e.members, 15)
        assert back2.cause == "readmitted" and back2.members == optimal
        seq = feeder.seq
        wait_until(lambda: feeder.seq >= seq + 10, 15, "10 more health windows")
        assert watcher.current().number == back2.number
        assert not feeder.errors
        causes = [e.cause for e in seen if e.number > out.number - 1]
        assert causes.count("evicted") == 2 and causes.count("readmitted") == 2
