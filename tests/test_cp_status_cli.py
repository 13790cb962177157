"""`resilient status` against a real etcd and coordinator: table and JSON."""
from __future__ import annotations

import json

from resilient.coordinator import EpochWatcher, MemberInfo, MemberSession, Store
from resilient.coordinator.membership import revoke_member
from cp_helpers import CoordinatorThread, resilient_cli


def test_status_reports_members_states_epoch_ring_and_leader(etcd_session, job_name):
    store = Store(etcd_session.endpoints)
    coord = CoordinatorThread(etcd_session.endpoints, job_name, cid="coord-1", join_debounce=0.05)
    sessions = [MemberSession.register(store, job_name, MemberInfo(member_id=f"m{i}", host=f"h{i}",
                                                                   address=f"127.0.0.1:{3000 + i}"), ttl=10)
                for i in range(3)]
    watcher = EpochWatcher(store, job_name)
    try:
        epoch = watcher.wait_for(lambda e: len(e.members) == 3, 15)
        coord.close()                    # freeze the epoch so the states below stay put
        revoke_member(store, job_name, "m2", sessions[2].lease_id)
        sessions.append(MemberSession.register(store, job_name, MemberInfo(member_id="late", host="h9"), ttl=10))

        out = resilient_cli("status", "--etcd", etcd_session.endpoint_arg, "--job", job_name, "--json")
        assert out.returncode == 0, out.stderr
        status = json.loads(out.stdout)
        assert status["leader"] is None                       # the coordinator resigned on stop
        assert status["epoch"]["number"] == epoch.number and status["epoch"]["members"] == list(epoch.members)
        states = {m["id"]: m["state"] for m in status["members"]}
        assert states == {"m0": "active", "m1": "active", "m2": "lost", "late": "joining"}
        lease_left = {m["id"]: m["lease_left_s"] for m in status["members"]}
        assert 0 < lease_left["m0"] <= 10 and lease_left["m2"] is None
        assert {m["id"]: m["address"] for m in status["members"]}["m1"] == "127.0.0.1:3001"

        table = resilient_cli("status", "--etcd", etcd_session.endpoint_arg, "--job", job_name)
        assert table.returncode == 0, table.stderr
        assert f"epoch {epoch.number} ({epoch.cause}" in table.stdout   # initial, or joined if m0 came first
        assert "ring: " + " -> ".join(epoch.members) in table.stdout
        assert any(line.split()[:4] == ["late", "h9", "0", "joining"] for line in table.stdout.splitlines())
    finally:
        watcher.close()
        coord.close()
        for s in sessions:
            s.close()
        store.close()


def test_status_leader_is_shown(etcd_session, job_name):
    coord = CoordinatorThread(etcd_session.endpoints, job_name, cid="coord-x")
    try:
        coord.wait_reconciles(1)
        out = resilient_cli("status", "--etcd", etcd_session.endpoint_arg, "--job", job_name)
        assert out.returncode == 0, out.stderr
        assert "leader: coord-x" in out.stdout and "epoch: none published yet" in out.stdout
        assert "(no members registered)" in out.stdout
    finally:
        coord.close()


def test_status_without_etcd_flag_says_how_to_fix(monkeypatch):
    monkeypatch.delenv("RESILIENT_ETCD", raising=False)
    out = resilient_cli("status", "--job", "j")
    assert out.returncode == 2 and "pass --etcd" in out.stderr


def test_status_bad_job_name_is_a_clear_error():
    out = resilient_cli("status", "--etcd", "127.0.0.1:1", "--job", "bad/name")
    assert out.returncode == 2 and "invalid job name" in out.stderr


def test_status_and_coordinator_cli_import_nothing_heavy():
    import subprocess
    import sys

    code = ("import sys, argparse; import resilient.cli.status as s, resilient.cli.coordinator as c; "
            "s.add_arguments(argparse.ArgumentParser()); c.add_arguments(argparse.ArgumentParser()); "
            "print('torch' in sys.modules, 'pyetcd' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr
