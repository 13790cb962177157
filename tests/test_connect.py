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
    comm.close()
    try:
        comm.allreduce(t)
    except resilient.ClosedError as exc:
        print("CLOSED", isinstance(exc, resilient.ConfigError), flush=True)
''')


@pytest.mark.slow
def test_connect_in_two_processes_allreduces_and_close_revokes_every_lease(etcd_session, job_name, tmp_path):
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
