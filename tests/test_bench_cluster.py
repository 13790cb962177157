"""A benchmark driver (bench/_common.py's BenchCluster) stopped by SIGTERM leaves nothing
running: its members, its coordinator and its etcd are stopped and reaped on the way out
(Python's default SIGTERM would end the driver at once and orphan the coordinator)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigterm_to_a_bench_driver_stops_every_process_it_started():
    driver = subprocess.Popen([sys.executable, "bench/collectives.py", "--world", "2", "--sizes", "16M",
                               "--rounds", "1000"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
    seen: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + 120
        while True:   # etcd, the coordinator and both members are up
            for p in _tree(driver.pid):
                seen.setdefault(p.pid, p)
            cmds = [" ".join(p.cmdline()) for p in seen.values() if _alive(p)]
            if (any("coordinator" in c for c in cmds) and sum("--worker" in c for c in cmds) == 2
                    and any("etcd" in c.split()[0] for c in cmds)):
                break
            assert driver.poll() is None, driver.stderr.read() if driver.stderr else ""
            assert time.monotonic() < deadline, f"the bench's processes did not all start: {cmds}"
            time.sleep(0.2)
        driver.send_signal(signal.SIGTERM)
        rc = driver.wait(timeout=90)
        assert rc != 0   # interrupted, not a finished run
        left = [p for p in seen.values() if _alive(p)]
        assert not left, f"left running after SIGTERM: {[(p.pid, p.cmdline()) for p in left]}"
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        for p in seen.values():
            if _alive(p):
                os.kill(p.pid, signal.SIGKILL)
