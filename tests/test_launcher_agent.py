"""The node agent with real processes, a real etcd and real signals."""
from __future__ import annotations

import os
import re
import signal

import pytest

from launcher_util import SCRIPTS, Launcher, alive, wait_for
from resilient.coordinator import keys
from resilient.coordinator.etcd_access import open_store_from_env
from resilient.coordinator.store import Store

WORKER = os.path.join(SCRIPTS, "worker.py")
pytestmark = pytest.mark.slow


@pytest.fixture
def store(etcd_session):
    s = Store(etcd_session.endpoints)
    yield s
    s.close()


def _etcd_args(etcd, job, *more):
    return ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoint_arg, "--rdzv-id", job, *more]


def test_killed_worker_lease_revoked_at_once_and_only_it_restarts(etcd_session, store, job_name, tmp_path):
    stop = str(tmp_path / "stop")
    # Lease TTL 60 s: a lease gone within seconds of the kill was revoked, not expired.
    run = Launcher(_etcd_args(etcd_session, job_name, "--nproc-per-node", "2", "--max-restarts", "1",
                              "--lease-ttl", "60", WORKER), str(tmp_path / "d"), {"STOP_FILE": stop})
    try:
        w0, w1 = run.dump(0), run.dump(1)
        lease0, lease1 = int(w0["RESILIENT_LEASE_ID"]), int(w1["RESILIENT_LEASE_ID"])
        assert store.lease_ttl(lease0) is not None and store.lease_ttl(lease1) is not None
        os.kill(int(w1["PID"]), signal.SIGKILL)
        wait_for(lambda: store.lease_ttl(lease1) is None, 10, "the killed worker's lease to be revoked")
        departed = store.get(keys.departed_of(job_name, w1["RESILIENT_MEMBER_ID"]))
        assert departed is not None and b"signal 9" in departed.value
        r1 = run.dump(1, restart=1)
        assert r1["TORCHELASTIC_RESTART_COUNT"] == "1" and r1["RESILIENT_JOINER"] == "1"
        assert r1["RANK"] == "1" and r1["PID"] != w1["PID"]
        assert int(r1["RESILIENT_LEASE_ID"]) != lease1 and store.lease_ttl(int(r1["RESILIENT_LEASE_ID"]))
        assert r1["RESILIENT_MEMBER_ID"] != w1["RESILIENT_MEMBER_ID"]
        # the sibling never restarted: same process, lease untouched, no second dump
        assert alive(int(w0["PID"])) and store.lease_ttl(lease0) is not None
        assert not os.path.exists(os.path.join(run.dump_dir, "0.1.json"))
        open(stop, "w").close()
        assert run.wait() == 0, run.output()
        # clean exit: every lease the agent granted is gone
        assert store.lease_ttl(lease0) is None and store.lease_ttl(int(r1["RESILIENT_LEASE_ID"])) is None
    finally:
        run.close()


@pytest.mark.parametrize("how", ["flag", "PET_FAIL_FAST", "RESILIENT_FAIL_FAST"])
def test_fail_fast_restores_torchruns_stop_everything(etcd_session, job_name, tmp_path, how):
    """--fail-fast (or its env spellings): restarts exhausted -> siblings SIGTERMed, exit 1,
    torchrun's failure summary."""
    flags, env = (["--fail-fast"], {}) if how == "flag" else ([], {how: "1"})
    run = Launcher(_etcd_args(etcd_session, job_name, "--nproc-per-node", "2", "--max-restarts", "1", *flags, WORKER),
                   str(tmp_path / "d"), {"FAIL_LOCAL_RANK": "1", "FAIL_CODE": "7", **env})
    try:
        w0 = run.dump(0)
        run.dump(1, 0)
        run.dump(1, 1)  # restarted once, then fails again
        rc = run.wait()
        out = run.output()
        assert rc == 1, out
        assert "FAILED" in out and "rank      : 1 (local_rank: 1)" in out and "exitcode  : 7" in out
        # the sibling was stopped with SIGTERM, not left running
        assert not alive(int(w0["PID"]))
        with open(os.path.join(run.dump_dir, "0.0.signal")) as f:
            assert f.read() == str(int(signal.SIGTERM))
    finally:
        run.close()


def _survivor_alive_then_stop(run: Launcher, survivor: dict, stop: str) -> tuple[int, str]:
    """Assert the survivor and the agent still run, let the survivor finish; (rc, output)."""
    assert alive(int(survivor["PID"])) and run.proc.poll() is None
    open(stop, "w").close()
    rc = run.wait()
    return rc, run.output()


def test_default_error_exit_leaves_siblings_running_and_fails_the_job(etcd_session, job_name, tmp_path):
    """Default: a worker that exits with an error code (no restarts left) does not stop its
    sibling; the job's exit code is still 1 (a worker failed with an error) and the summary
    names it."""
    stop = str(tmp_path / "stop")
    run = Launcher(_etcd_args(etcd_session, job_name, "--nproc-per-node", "2", WORKER), str(tmp_path / "d"),
                   {"FAIL_LOCAL_RANK": "1", "FAIL_CODE": "7", "STOP_FILE": stop})
    try:
        w0 = run.dump(0)
        run.dump(1, 0)
        wait_for(lambda: "the other workers go on without it" in run.output(), 30, "the agent to see the failure")
        rc, out = _survivor_alive_then_stop(run, w0, stop)
        assert rc == 1, out
        assert "job FAILED (exit code 1)" in out and "exited with code 7" in out
        assert "failed with an error code: local ranks [1]" in out
        assert not os.path.exists(os.path.join(run.dump_dir, "0.0.signal"))  # never signalled
    finally:
        run.close()


def test_default_sigkilled_worker_survivor_finishes_exit_0_with_summary(tmp_path):
    """Default flags, --standalone (real coordinator): a SIGKILLed worker is not restarted, the
    survivor keeps running and finishes, the job exits 0 and the summary names the dead
    worker, the signal and the epoch that removed it."""
    stop = str(tmp_path / "stop")
    run = Launcher(["--standalone", "--nproc-per-node", "2", os.path.join(SCRIPTS, "member_worker.py")],
                   str(tmp_path / "d"), {"STOP_FILE": stop})
    try:
        w0, w1 = run.dump(0), run.dump(1)
        s = open_store_from_env(w0["RESILIENT_ETCD"], w0)   # the standalone etcd has auth on: the workers' credentials
        try:
            job = w0["RESILIENT_JOB"]

            def removed_in():
                kv = s.get(keys.epoch(job))
                from resilient.coordinator.epoch import Epoch

                e = Epoch.from_json(kv.value) if kv else None
                return e.number if e and w1["RESILIENT_MEMBER_ID"] in e.removed else None

            wait_for(lambda: s.get(keys.epoch(job)) is not None, 30, "the initial epoch")
            os.kill(int(w1["PID"]), signal.SIGKILL)
            shrank = wait_for(removed_in, 30, "an epoch removing the killed worker")
        finally:
            s.close()
        rc, out = _survivor_alive_then_stop(run, w0, stop)
        assert rc == 0, out
        assert "job FINISHED (exit code 0)" in out and "killed by SIGKILL" in out
        assert f"member    : {w1['RESILIENT_MEMBER_ID']}" in out and f"shrank in : epoch {shrank}" in out
        assert "rank      : 1 (local_rank: 1, restart 0" in out and "not restarted" in out
    finally:
        run.close()


def test_default_every_worker_killed_exits_1(etcd_session, job_name, tmp_path):
    run = Launcher(_etcd_args(etcd_session, job_name, "--nproc-per-node", "2", WORKER), str(tmp_path / "d"))
    try:
        ws = [run.dump(0), run.dump(1)]
        for w in ws:
            os.kill(int(w["PID"]), signal.SIGKILL)
        rc = run.wait()
        out = run.output()
        assert rc == 1, out
        assert "no worker finished" in out and out.count("killed by SIGKILL") == 2
    finally:
        run.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_agent_is_forwarded_and_everything_stops(etcd_session, store, job_name, tmp_path, sig):
    run = Launcher(_etcd_args(etcd_session, job_name, "--nproc-per-node", "2", "--lease-ttl", "60", WORKER),
                   str(tmp_path / "d"))
    try:
        ws = [run.dump(0), run.dump(1)]
        run.proc.send_signal(sig)
        assert run.wait() == 128 + sig, run.output()
        for lr, w in enumerate(ws):
            with open(os.path.join(run.dump_dir, f"{lr}.0.signal")) as f:
                assert f.read() == str(int(sig))
            assert not alive(int(w["PID"]))
            assert store.lease_ttl(int(w["RESILIENT_LEASE_ID"])) is None
    finally:
        run.close()


def test_wrong_etcd_endpoint_fails_fast_with_clear_error(tmp_path):
    from resilient.coordinator.local_etcd import free_port

    run = Launcher(["--rdzv-backend", "etcd", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                    "--rdzv-conf", "etcd_timeout=2", WORKER], str(tmp_path / "d"))
    try:
        rc = run.wait(timeout=60)
        out = run.output()
        assert rc == 1, out
        assert "resilient-run: error:" in out and "answered within" in out
        assert not os.path.exists(os.path.join(run.dump_dir, "0.0.json"))  # no worker started
    finally:
        run.close()


def test_registered_worker_owns_its_keepalive_so_sigstop_expires_its_lease(etcd_session, store, job_name, tmp_path):
    """After the worker's MemberSession registered on the agent's lease, the agent stops
    refreshing it: a SIGSTOPped worker loses its membership by lease expiry (TTL 2 s) while
    its running sibling keeps its own. Under the default node agent too: a worker that
    registers itself (no channel) is on a lease of its own, never on the node lease that
    nobody would check for it."""
    stop = str(tmp_path / "stop")
    run = Launcher(_etcd_args(etcd_session, job_name, "--nproc-per-node", "2", "--lease-ttl", "2",
                              os.path.join(os.path.dirname(WORKER), "member_worker.py")),
                   str(tmp_path / "d"), {"STOP_FILE": stop})
    stopped = None
    try:
        w0, w1 = run.dump(0), run.dump(1)
        key1 = keys.member(job_name, w1["RESILIENT_MEMBER_ID"])
        assert store.get(key1).lease == int(w1["RESILIENT_LEASE_ID"])
        assert w1["RESILIENT_AGENT_SOCKET"] and w0["RESILIENT_LEASE_ID"] != w1["RESILIENT_LEASE_ID"]  # node agent on
        wait_for(lambda: f"member {w1['RESILIENT_MEMBER_ID']} registered itself on its own lease" in run.output(),
                 30, "the agent to hand the self-registered worker's lease over to it")
        node_lease = re.search(r"node lease ([0-9a-f]+) \(TTL", run.output())
        assert node_lease and store.lease_ttl(int(node_lease.group(1), 16)) is not None   # the node's own, alive
        stopped = int(w1["PID"])
        os.kill(stopped, signal.SIGSTOP)
        wait_for(lambda: store.get(key1) is None, 30, "the stopped worker's member key to expire")
        assert store.lease_ttl(int(w1["RESILIENT_LEASE_ID"])) is None
        assert store.get(keys.member(job_name, w0["RESILIENT_MEMBER_ID"])) is not None  # sibling alive
        assert run.proc.poll() is None  # the agent saw no exit: detection was the lease's
        os.kill(stopped, signal.SIGCONT)
        stopped = None
        open(stop, "w").close()
        run.wait()
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        run.close()
