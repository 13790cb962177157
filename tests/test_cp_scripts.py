"""`make demo` and `make bench` scripts of the control plane run and print what they claim
(the numbers themselves are judged by reading the bench output, not here)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_planner_bench_prints_one_json_line():
    out = run("bench/planner.py", "--members", "2000", "--runs", "3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["members"] == 2000 and result["plan_ms"] > 0


def test_control_plane_bench_prints_one_json_line():
    out = run("bench/control_plane.py", "--rounds", "1", timeout=240)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout
    result = json.loads(lines[0])
    assert result["members"] == 8
    assert result["epoch_after_revoke_ms"] > 0 and result["epoch_after_sigkill_ms"] > 0


def test_demo_shows_the_epoch_change_after_a_kill():
    out = run("examples/control_plane_demo.py", timeout=240)
    assert out.returncode == 0, out.stderr
    assert "epoch 1 published (initial)" in out.stdout
    assert "epoch 2 published (member_lost, removed worker1)" in out.stdout
    after = out.stdout.split("epoch 2 published", 1)[1]
    assert "ring: worker0 -> worker2 -> worker3" in after and "worker1 " not in after.split("ring:", 1)[1]
