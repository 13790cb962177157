"""Coordinator acceptance tests against a real etcd, real processes and real signals."""
from __future__ import annotations

import json
import logging
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from resilient.coordinator import (EpochChanged, EpochData, EpochWatcher, MemberInfo, MemberSession, Store,
                                   report_suspect)
from resilient.coordinator import keys
from resilient.coordinator.membership import KEEPALIVE_FRACTION, revoke_member
from cp_helpers import CoordinatorThread, coordinator_proc, member_proc, resilient_cli, wait_until

log = logging.getLogger(__name__)


@pytest.fixture
def store(etcd_session):
    s = Store(etcd_session.endpoints)
    yield s
    s.close()


def register(store, job, n, ttl=5.0, prefix="m"):
    return [MemberSession.register(store, job, MemberInfo(member_id=f"{prefix}{i}", host=f"h{i % 2}",
                                                          local_rank=i // 2, address=f"127.0.0.1:{20000 + i}"),
                                   ttl=ttl) for i in range(n)]


def test_eight_members_one_epoch_then_revoke_yields_exactly_one_epoch(etcd_session, store, job_name):
    coord = CoordinatorThread(etcd_session.endpoints, job_name, join_debounce=0.5)
    watcher = EpochWatcher(store, job_name)
    seen = []
    watcher.subscribe(seen.append)
    sessions = register(store, job_name, 8)
    try:
        first = watcher.wait_for(lambda e: len(e.members) == 8, 15)
        assert first.number == 1 and first.cause == "initial"      # 8 joins batched into one epoch
        assert len(first.token) == 32 and set(first.infos) == set(first.members)
        victim = sessions[3]
        t0 = time.monotonic()
        revoke_member(store, job_name, victim.member_id, victim.lease_id)
        second = watcher.wait_for(lambda e: victim.member_id not in e.members, 10)
        latency_ms = (time.monotonic() - t0) * 1000
        log.info("revoke -> epoch published: %.1f ms (coordinator's own view: %.1f ms)", latency_ms,
                 (second.published_at - second.trigger_at) * 1000)
        print(f"revoke_to_epoch_ms={latency_ms:.1f}")
        assert second.number == 2 and second.cause == "member_lost" and second.removed == ("m3",)
        assert set(second.members) == {f"m{i}" for i in range(8)} - {"m3"}
        coord.wait_reconciles(2)                                      # nothing else follows
        assert [e.number for e in seen] == [1, 2] and watcher.current().number == 2
        assert store.get_prefix(keys.departed(job_name)) == []        # marker consumed
        assert coord.coordinator.metrics.detection_latency.labels(path="revoke")._sum.get() > 0
    finally:
        watcher.close()
        coord.close()
        for s in sessions:
            s.close()


def agree_admission(store, job: str, e) -> None:
    """What the members' data plane writes within milliseconds of a growing epoch ``e``:
    its join agreement's result. These tests register members without one, and the
    coordinator keeps a joiner through a removal only once the result is there
    (docs/recovery.md, "a removal while an admission is pending")."""
    from resilient.collectives.join_agreement import encode_agreed, old_members

    olds = old_members(e)
    if e.added and olds:
        EpochData(store, job, e.number).put(olds[0], "joinseq", encode_agreed(e.number, 0, len(olds)))


def test_member_lost_while_a_new_leaders_first_pass_runs_is_published_next_pass(etcd_session, store, job_name):
    """A watch event for a member the pass already had marked (the new leader's directory
    load marks everyone) must survive the pass: the next pass publishes the loss. (A set
    minus the pass's snapshot dropped it, and no epoch followed: CI saw it on takeover.)"""
    from resilient.coordinator import Coordinator, CoordinatorConfig

    first = CoordinatorThread(etcd_session.endpoints, job_name, join_debounce=0.05)
    sessions = register(store, job_name, 3)
    watcher = EpochWatcher(store, job_name)
    stop = threading.Event()
    coord_store = Store(etcd_session.endpoints)
    watches = []
    coord = None
    try:
        e1 = watcher.wait_for(lambda e: len(e.members) == 3, 15)
        agree_admission(store, job_name, e1)
        first.close()                                                   # resigns: the key is free
        coord = Coordinator(coord_store, job_name, "c-next", CoordinatorConfig(join_debounce=0.05))
        assert coord.election.campaign(stop)
        watches = coord.start_leading()
        check = coord._check_suspects
        calls = []

        def revoke_mid_pass(members):
            if not calls:   # after the pass took its snapshot, before it compares
                revoke_member(store, job_name, "m1", sessions[1].lease_id)
                wait_until(lambda: "m1" not in coord._dir.members, 10, "the delete event to be applied")
            calls.append(1)
            return check(members)

        coord._check_suspects = revoke_mid_pass
        assert coord._reconcile({}, {})[0] == "unchanged"               # it compared the entry from before
        assert coord._reconcile({}, {})[0] == "published"
        e2 = watcher.wait_for(lambda e: e.number > e1.number, 10)
        assert set(e2.members) == {"m0", "m2"} and e2.removed == ("m1",)
    finally:
        for w in watches:
            w.cancel()
        stop.set()
        if coord is not None:
            coord.election.resign()   # stops its lease keep-alive before the store closes
        watcher.close()
        first.close()
        coord_store.close()
        for s in sessions:
            s.close()


def test_joiner_is_admitted_in_the_next_epoch(etcd_session, store, job_name):
    coord = CoordinatorThread(etcd_session.endpoints, job_name, join_debounce=0.05)
    sessions = register(store, job_name, 2)
    watcher = EpochWatcher(store, job_name)
    try:
        e1 = watcher.wait_for(lambda e: len(e.members) == 2, 10)
        sessions += register(store, job_name, 1, prefix="late")
        e2 = watcher.wait_for(lambda e: "late0" in e.members, 10)
        assert e2.number == e1.number + 1 and e2.cause == "joined" and e2.added == ("late0",)
    finally:
        watcher.close()
        coord.close()
        for s in sessions:
            s.close()


def test_sigstopped_member_is_dropped_after_its_ttl_and_not_before(etcd_session, store, job_name):
    ttl = 2.0
    coord = CoordinatorThread(etcd_session.endpoints, job_name)
    procs = [member_proc(etcd_session.endpoint_arg, job_name, f"p{i}", ttl=ttl) for i in range(3)]
    watcher = EpochWatcher(store, job_name)
    try:
        for p in procs:
            p.wait_line(r"^READY", 30)
        watcher.wait_for(lambda e: len(e.members) == 3, 15)
        procs[1].signal(signal.SIGSTOP)
        t_stop = time.monotonic()
        epoch = watcher.wait_for(lambda e: "p1" not in e.members, ttl + 10)
        elapsed = time.monotonic() - t_stop
        log.info("SIGSTOP -> dropped after %.2fs (ttl %.1fs)", elapsed, ttl)
        # its last keep-alive was at most one keep-alive interval before the stop
        assert elapsed >= ttl * (1 - KEEPALIVE_FRACTION) - 0.05
        assert epoch.cause == "lease_expired" and set(epoch.members) == {"p0", "p2"}
        procs[1].signal(signal.SIGCONT)
        procs[1].wait_line(r"^LOST p1", 15)                          # it learns it is out
        assert procs[1].popen.wait(timeout=15) == 3
    finally:
        watcher.close()
        coord.close()
        for p in procs:
            p.stop()


def test_suspect_confirmed_by_lease_state_only(etcd_session, store, job_name):
    ttl = 6.0
    coord = CoordinatorThread(etcd_session.endpoints, job_name)
    procs = [member_proc(etcd_session.endpoint_arg, job_name, f"s{i}", ttl=ttl) for i in range(3)]
    watcher = EpochWatcher(store, job_name)
    try:
        for p in procs:
            p.wait_line(r"^READY", 30)
        e1 = watcher.wait_for(lambda e: len(e.members) == 3, 15)
        # A healthy member reported by one peer stays: its lease is fresh.
        report_suspect(store, job_name, "s0", "s2", "recv timeout")
        wait_until(lambda: store.get_prefix(keys.suspects(job_name)) == [], ttl + 10, "the suspicion to be dismissed")
        assert watcher.current().number == e1.number and "s2" in watcher.current().members
        # A hung member reported: confirmed once its lease has gone unrefreshed, before expiry.
        procs[1].signal(signal.SIGSTOP)
        t_stop = time.monotonic()
        report_suspect(store, job_name, "s0", "s1", "recv timeout")
        e2 = watcher.wait_for(lambda e: "s1" not in e.members, ttl + 10)
        log.info("suspect confirmed %.2fs after SIGSTOP (ttl %.0fs)", time.monotonic() - t_stop, ttl)
        assert e2.cause == "suspect_confirmed" and e2.number == e1.number + 1
        assert store.get(keys.member(job_name, "s1")) is None          # its lease was revoked
        with pytest.raises(Exception, match="itself"):
            report_suspect(store, job_name, "s0", "s0", "x")
    finally:
        watcher.close()
        coord.close()
        for p in procs:
            p.stop()


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def leader_flag(metrics_url: str) -> float:
    for line in scrape(metrics_url + "/metrics").splitlines():
        if line.startswith("resilient_coordinator_is_leader "):
            return float(line.split()[1])
    raise AssertionError("resilient_coordinator_is_leader missing")


def test_two_coordinators_one_leads_and_standby_takes_over_after_sigkill(etcd_session, store, job_name):
    ttl = 2.0
    numbers: list[int] = []
    ekey = keys.epoch(job_name)
    watch = store.watch_key(ekey, store.revision() + 1,
                            lambda evs: numbers.extend(json.loads(e.value)["number"] for e in evs if e.type == "put"))
    coords = {cid: coordinator_proc(etcd_session.endpoint_arg, job_name, cid, ttl) for cid in ("ca", "cb")}
    sessions = register(store, job_name, 4)
    try:
        urls = {cid: p.wait_line(r"metrics (http://\S+)", 30).group(1) for cid, p in coords.items()}
        watcher = EpochWatcher(store, job_name)
        watcher.wait_for(lambda e: len(e.members) == 4, 15)
        leader = wait_until(lambda: (store.get(keys.leader(job_name)) or None) and
                            store.get(keys.leader(job_name)).value.decode(), 10, "a leader")
        standby = "cb" if leader == "ca" else "ca"
        wait_until(lambda: leader_flag(urls[leader]) == 1.0 and leader_flag(urls[standby]) == 0.0, 10,
                   "exactly one coordinator reporting leadership")
        assert scrape(urls[leader] + "/healthz").startswith("ok leader")
        assert scrape(urls[standby] + "/healthz").startswith("ok standby")
        revoke_member(store, job_name, "m0", sessions[0].lease_id)
        watcher.wait_for(lambda e: "m0" not in e.members, 10)

        coords[leader].signal(signal.SIGKILL)
        t_kill = time.monotonic()
        wait_until(lambda: leader_flag(urls[standby]) == 1.0, ttl + 10, "the standby to lead")
        takeover = time.monotonic() - t_kill
        log.info("leader SIGKILLed -> standby leads after %.2fs (ttl %.1fs)", takeover, ttl)
        assert store.get(keys.leader(job_name)).value.decode() == standby
        revoke_member(store, job_name, "m1", sessions[1].lease_id)
        last = watcher.wait_for(lambda e: "m1" not in e.members, 10)
        assert last.leader == standby
        wait_until(lambda: len(numbers) >= last.number, 10, "all epoch writes seen")
        assert numbers == list(range(1, last.number + 1))            # strictly increasing, no dup, no gap
        assert "resilient_detection_latency_seconds_bucket" in scrape(urls[standby] + "/metrics")
        watcher.close()
    finally:
        watch.cancel()
        for p in coords.values():
            p.stop()
        for s in sessions:
            s.close()


def test_etcd_restart_under_running_coordinator(etcd, job_name):
    store = Store(etcd.endpoints, retry_timeout=30)
    coord = coordinator_proc(etcd.endpoint_arg, job_name, "c1", 5.0, "--etcd-timeout", "30")
    sessions = register(store, job_name, 3, ttl=10.0)
    try:
        coord.wait_line(r"metrics http://", 30)
        watcher = EpochWatcher(store, job_name)
        e1 = watcher.wait_for(lambda e: len(e.members) == 3, 15)
        watcher.close()
        etcd.kill(0)
        etcd.restart(0)
        # Changes right after the restart, likely before the coordinator's watch is back:
        revoke_member(store, job_name, "m1", sessions[1].lease_id)
        sessions += register(store, job_name, 1, ttl=10.0, prefix="new")
        watcher = EpochWatcher(store, job_name)
        final = watcher.wait_for(lambda e: set(e.members) == {"m0", "m2", "new0"}, 30)
        watcher.close()
        history = [json.loads(kv.value)["number"] for kv in store.get_prefix(f"{keys.root(job_name)}epochs/")]
        assert sorted(history) == list(range(1, final.number + 1))
        assert final.number in (e1.number + 1, e1.number + 2)
        assert coord.popen.poll() is None
    finally:
        coord.stop()
        for s in sessions:
            s.close()
        store.close()


def test_coordinator_wrong_endpoint_fails_clearly():
    out = resilient_cli("coordinator", "--etcd", "127.0.0.1:1", "--job", "j", "--etcd-timeout", "1",
                        "--metrics-port", "-1")
    assert out.returncode == 2
    assert "no endpoint of 127.0.0.1:1 answered" in out.stderr and "Traceback" not in out.stderr


def test_epoch_data_exchange(etcd_session, store, job_name):
    data = EpochData(store, job_name, 1)
    data.put("a", "addr", b"127.0.0.1:1")
    got = {}
    t = threading.Thread(target=lambda: got.update(data.wait_all("addr", ["a", "b"], 10)))
    t.start()
    EpochData(Store(etcd_session.endpoints), job_name, 1).put("b", "addr", b"\x00raw")
    t.join(15)
    assert got == {"a": b"127.0.0.1:1", "b": b"\x00raw"}
    assert data.get_all("addr") == got
    with pytest.raises(TimeoutError, match=r"missing from \['c'\]"):
        data.wait_all("addr", ["a", "c"], 0.3)
    with pytest.raises(TypeError):
        data.put("a", "x", "not bytes")


def test_epoch_data_wait_stops_on_a_newer_epoch(etcd_session, store, job_name):
    coord = CoordinatorThread(etcd_session.endpoints, job_name)
    sessions = register(store, job_name, 2)
    watcher = EpochWatcher(store, job_name)
    try:
        e1 = watcher.wait_for(lambda e: len(e.members) == 2, 10)
        EpochData(store, job_name, e1.number).put("m0", "ledger", b"x")
        threading.Timer(0.3, lambda: revoke_member(store, job_name, "m1", sessions[1].lease_id)).start()
        with pytest.raises(EpochChanged) as info:
            EpochData(store, job_name, e1.number).wait_all("ledger", ["m0", "m1"], 30)
        assert info.value.newest == e1.number + 1 and info.value.partial == {"m0": b"x"}
    finally:
        watcher.close()
        coord.close()
        for s in sessions:
            s.close()


def test_duplicate_member_id_is_refused(store, job_name):
    s = MemberSession.register(store, job_name, MemberInfo(member_id="dup"), ttl=5)
    try:
        with pytest.raises(Exception, match="already registered"):
            MemberSession.register(store, job_name, MemberInfo(member_id="dup"), ttl=5)
    finally:
        s.close()
    assert store.get(keys.member(job_name, "dup")) is None


def test_agent_lease_revocation_marks_session_lost(store, job_name):
    lease = store.grant(5)                                   # the node agent's lease
    s = MemberSession.register(store, job_name, MemberInfo(member_id="w0"), lease_id=lease)
    assert s.lease_id == lease and store.get(keys.member(job_name, "w0")).lease == lease
    revoke_member(store, job_name, "w0", lease, reason="exited")
    assert s.lost.wait(10)
    s.close()


def healthz(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_healthz_turns_503_while_etcd_is_down_and_recovers(etcd, job_name):
    coord = coordinator_proc(etcd.endpoint_arg, job_name, "ch", 2.0, "--etcd-timeout", "1")
    try:
        url = coord.wait_line(r"metrics (http://\S+)", 30).group(1)
        wait_until(lambda: healthz(url) == 200, 15, "/healthz 200")
        # /healthz answers 200 on a standby too; leadership is won a moment later
        wait_until(lambda: "resilient_coordinator_is_leader 1.0" in scrape(url + "/metrics"), 30,
                   "the only coordinator to lead")
        etcd.kill(0)
        wait_until(lambda: healthz(url) == 503, 30, "/healthz 503 with etcd down", interval=0.2)
        etcd.restart(0)
        wait_until(lambda: healthz(url) == 200, 30, "/healthz 200 after etcd is back", interval=0.2)
        assert coord.popen.poll() is None
    finally:
        coord.stop()
