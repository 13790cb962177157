"""--standalone starts a real etcd and coordinator and stops both (by PID) on every exit."""
from __future__ import annotations

import os
import signal
import socket

import pytest

from launcher_util import SCRIPTS, Launcher, alive, wait_for

WORKER = os.path.join(SCRIPTS, "worker.py")
pytestmark = pytest.mark.slow


def _children(pid: int) -> dict[int, str]:
    """Direct children of ``pid`` and their command lines."""
    out: dict[int, str] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            for child in f.read().split():
                try:
                    with open(f"/proc/{child}/cmdline", "rb") as c:
                        out[int(child)] = c.read().replace(b"\0", b" ").decode()
                except OSError:
                    pass
    return out


def _connectable(endpoint: str) -> bool:
    host, _, port = endpoint.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.mark.parametrize("how", ["workers-finish", "sigterm"])
def test_standalone_starts_and_cleans_up_etcd_and_coordinator(tmp_path, how):
    stop = str(tmp_path / "stop")
    run = Launcher(["--standalone", "--nproc-per-node", "2", WORKER], str(tmp_path / "d"), {"STOP_FILE": stop})
    try:
        w0, w1 = run.dump(0), run.dump(1)
        endpoint = w0["RESILIENT_ETCD"]
        assert _connectable(endpoint)
        kids = _children(run.proc.pid)
        etcd = [p for p, cmd in kids.items() if cmd.split()[0].endswith("etcd")]
        coord = [p for p, cmd in kids.items() if " coordinator --etcd " in cmd and w0["RESILIENT_JOB"] in cmd]
        assert len(etcd) == 1 and len(coord) == 1, kids
        with open(f"/proc/{etcd[0]}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
        data_dir = args[args.index(b"--data-dir") + 1].decode()
        assert os.path.isdir(data_dir)
        if how == "sigterm":
            run.proc.send_signal(signal.SIGTERM)
            assert run.wait() == 128 + signal.SIGTERM, run.output()
        else:
            open(stop, "w").close()
            assert run.wait() == 0, run.output()
        for pid in [*etcd, *coord, int(w0["PID"]), int(w1["PID"])]:
            assert not alive(pid), f"pid {pid} still running after resilient-run exited"
        assert not _connectable(endpoint)
        assert not os.path.exists(data_dir)
    finally:
        run.close()


def test_a_sigkilled_agent_takes_its_standalone_etcd_and_coordinator_along(tmp_path):
    """SIGKILL leaves the agent no chance to clean up: the coordinator and etcd it started
    still end (parent-death signal), so no control plane outlives its job."""
    stop = str(tmp_path / "stop")
    run = Launcher(["--standalone", "--nproc-per-node", "1", WORKER], str(tmp_path / "d"), {"STOP_FILE": stop})
    worker = None
    try:
        w0 = run.dump(0)
        worker = int(w0["PID"])
        kids = _children(run.proc.pid)
        plane = [p for p, cmd in kids.items()
                 if cmd.split()[0].endswith("etcd") or (" coordinator --etcd " in cmd and w0["RESILIENT_JOB"] in cmd)]
        assert len(plane) == 2, kids
        run.proc.send_signal(signal.SIGKILL)
        assert run.wait() == -signal.SIGKILL
        for pid in plane:
            wait_for(lambda: not alive(pid), 30, f"pid {pid} of the standalone control plane to end")
    finally:
        if worker is not None and alive(worker):   # the worker was started by this test's agent
            os.kill(worker, signal.SIGKILL)
        run.close()
