"""resilient.connect(): a ready Communicator over a real etcd, coordinator and member
processes; close() and a failed connect leave nothing behind."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import textwrap
from pathlib import Path

import pytest

from collective_harness import coordinator
from cp_helpers import wait_until

ROOT = Path(__file__).resolve().parents[1]

MEMBER = textwrap.dedent('''
    import sys, torch, resilient
    etcd, job, mid, world = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    comm = resilient.connect(etcd, job, mid, world=world, timeout=60, ttl=2.0, op_timeout=30)
    t = torch.full((4,), float(int(mid[1:]) + 1))
    comm.allreduce(t)
    print("SUM", t.tolist(), comm.size, flush=True)
    fresh = comm.hand_over(comm.view, joining=False)   # both members, at the same point
    comm.close()                                       # handed over: keeps lease, transport, watcher
    t2 = torch.ones(2)
    fresh.allreduce(t2)
    print("AFTER", t2.tolist(), fresh.next_seq, flush=True)
    fresh.close()
    try:
        comm.allreduce(t)
    except resilient.ClosedError as exc:
        print("CLOSED", isinstance(exc, resilient.ConfigError), flush=True)
''')


@pytest.mark.slow
def test_connect_in_two_processes_allreduces_hands_over_and_close_revokes_every_lease(etcd_session, job_name,
                                                                                      tmp_path):
    """Two members connect and allreduce; each hands its transport/session/watcher over to
    a fresh Communicator (op seq restarts at 0) and closes the old one, which must keep the
    lease: the fresh ones still allreduce. Closing them leaves no member record."""
    from resilient.coordinator import Store, keys

    script = tmp_path / "member.py"
    script.write_text(MEMBER)
    with coordinator(etcd_session.endpoint_arg, job_name):
        procs = [subprocess.Popen([sys.executable, str(script), etcd_session.endpoint_arg, job_name, f"m{i}", "2"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                  env=dict(os.environ, PYTHONPATH=str(ROOT)))
                 for i in range(2)]
        try:
            outs = [p.communicate(timeout=120) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "SUM [3.0, 3.0, 3.0, 3.0] 2" in out, (out, err[-3000:])
        assert "AFTER [2.0, 2.0] 1" in out, (out, err[-3000:])
        assert "CLOSED True" in out, (out, err[-3000:])
    with Store(etcd_session.endpoint_arg) as store:   # close() left the group: no member record is left
        assert [kv.key for kv in store.get_prefix(keys.members(job_name))] == []


def test_a_connect_that_times_out_revokes_its_lease_and_raises_resilient_timeout(etcd_session, job_name):
    """No coordinator: no epoch ever holds the member. connect() registered it meanwhile
    (seen in etcd), then gives up after ``timeout`` and revokes the lease at once."""
    import resilient
    from resilient.coordinator import Store, keys

    with Store(etcd_session.endpoint_arg) as store:
        key = keys.member(job_name, "m0")
        seen = threading.Event()

        def watch() -> None:
            try:
                wait_until(lambda: store.get(key) is not None, 30, "the member record")
                seen.set()
            except AssertionError:
                pass

        th = threading.Thread(target=watch, daemon=True)
        th.start()
        with pytest.raises(resilient.ResilientTimeout, match="no epoch"):
            resilient.connect(etcd_session.endpoint_arg, job_name, "m0", world=2, timeout=1.0, ttl=30.0)
        th.join(35)
        assert seen.is_set(), "connect() never registered the member"
        assert store.get(key) is None   # revoked at once, not after the 30 s TTL


def test_connect_calls_on_registered_with_the_live_session_before_waiting_for_the_epoch(etcd_session, job_name):
    """``on_registered`` runs once the lease exists (the member record is in etcd) and
    before the epoch wait: with no coordinator the wait then times out, and the lease is
    revoked as for any failed connect."""
    import resilient
    from resilient.coordinator import Store, keys

    with Store(etcd_session.endpoint_arg) as store:
        key = keys.member(job_name, "m0")
        calls = []

        def registered(session) -> None:
            calls.append((session.member_id, session.lease_id, store.get(key) is not None))

        with pytest.raises(resilient.ResilientTimeout, match="no epoch"):
            resilient.connect(etcd_session.endpoint_arg, job_name, "m0", timeout=0.5, ttl=30.0,
                              on_registered=registered)
        assert len(calls) == 1 and calls[0][0] == "m0" and calls[0][1] and calls[0][2], calls
        assert store.get(key) is None
