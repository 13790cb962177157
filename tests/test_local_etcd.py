"""LocalEtcd: real etcd processes that never outlive the process that started them."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from resilient.coordinator.local_etcd import LocalEtcd
from resilient.errors import ConfigError


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); read its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_etcd_dies_when_its_starter_is_sigkilled(tmp_path):
    code = ("from resilient.coordinator.local_etcd import LocalEtcd; import time; "
            "e = LocalEtcd().start(); print(e.members[0].proc.pid, flush=True); time.sleep(120)")
    # the SIGKILLed starter cannot remove its etcd's data directory (~120 MB of WAL and
    # db): it goes under this test's tmp_path (TMPDIR), not /tmp, and pytest removes it
    starter = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                               env=dict(os.environ, TMPDIR=str(tmp_path)))
    try:
        etcd_pid = int(starter.stdout.readline())
        assert _alive(etcd_pid)
        starter.send_signal(signal.SIGKILL)
        starter.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(etcd_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        orphaned = _alive(etcd_pid)
        if orphaned:  # clean up what we caused before failing
            os.kill(etcd_pid, signal.SIGKILL)
        assert not orphaned, "etcd outlived the process that started it"
        left = list(tmp_path.glob("resilient-etcd-*"))
        assert len(left) == 1, left   # the data directory went where TMPDIR says
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
        for d in tmp_path.glob("resilient-etcd-*"):
            shutil.rmtree(d, ignore_errors=True)


def test_stop_ends_every_member_and_restart_reuses_ports():
    with LocalEtcd(size=3) as etcd:
        pids = [m.proc.pid for m in etcd.members]
        port = etcd.members[1].client_port
        etcd.kill(1)
        assert not etcd.members[1].running
        etcd.restart(1)
        assert etcd.members[1].running and etcd.members[1].client_port == port
        pids.append(etcd.members[1].proc.pid)
    assert not any(_alive(p) for p in pids)


def test_missing_binary_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ConfigError, match="apt-get install etcd-server"):
        LocalEtcd().start()
