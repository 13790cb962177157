"""Acceptance: elastic DDP training under ``resilient-run --standalone`` (real etcd,
coordinator, worker processes, sockets) with one worker SIGKILLed at a random step.

Asserted: training completes; at every step, every member that logged it has bitwise
identical parameters (``params_sha``); the loss keeps decreasing; the killed worker is
restarted as a joiner (``--max-restarts 1``), is synced from a healthy member before its
first step (its parameters then equal the survivors') and trains on in the world of 4."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = [sys.executable, "-c", "import sys; from resilient.launcher.cli import main; sys.exit(main())"]


def read_logs(d: Path, events: dict | None = None) -> dict[int, list[dict]]:
    events = {} if events is None else events
    out: dict[int, list[dict]] = {}
    for f in d.glob("*.jsonl"):
        recs = []
        for line in f.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:
                pass  # a line cut by the kill
        out[int(f.stem)] = [r for r in recs if "event" not in r]
        events.setdefault(int(f.stem), []).extend(r for r in recs if "event" in r)
    return out


def wait_until(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ddp_4_workers_one_sigkilled_at_random_step(tmp_path):
    steps = 60  # at least; training goes on until the restarted worker is back (--min-final-world 4)
    kill_step = random.Random().randint(8, 25)
    agent = subprocess.Popen(
        RUN + ["--standalone", "--nproc-per-node", "4", "--max-restarts", "1", "--lease-ttl", "3",
               str(ROOT / "examples" / "train.py"), "--steps", str(steps), "--step-sleep", "0.05", "--min-final-world", "4",
               "--log-dir", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        def victim():
            assert agent.poll() is None, f"resilient-run exited early: {agent.stdout.read()[-4000:]}"
            logs = read_logs(tmp_path)
            for pid, recs in logs.items():
                if recs and recs[-1]["rank"] == 2 and recs[-1]["step"] >= kill_step:
                    return pid
            return None

        pid = wait_until(victim, 120, f"rank 2 to reach step {kill_step}")
        os.kill(pid, signal.SIGKILL)
        out, _ = agent.communicate(timeout=180)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGTERM)
            agent.wait(30)
    events: dict[int, list[dict]] = {}
    logs = read_logs(tmp_path, events)
    by_step: dict[int, list[dict]] = {}
    for pid_, recs in logs.items():
        for r in recs:
            by_step.setdefault(r["step"], []).append(r)
    # training completed: every step was logged, the last by at least the 3 survivors
    last = max(by_step)
    assert last >= steps - 1 and sorted(by_step) == list(range(last + 1)), (sorted(by_step), out[-4000:])
    assert len({r["pid"] for r in by_step[last]}) == 4, out[-4000:]  # 3 survivors + the joiner trained
    # bitwise identical replicas after every step (survivors and, once synced, the joiner)
    for s, recs in by_step.items():
        assert len({r["params_sha"] for r in recs}) == 1, (s, recs)
    # the world shrank after the kill: survivors report 3 members right after it
    assert all(r["world"] == 3 for r in by_step[kill_step + 3] if r["restart"] == 0), by_step[kill_step + 3]
    # loss keeps decreasing (mean over members, first vs last 10 steps)
    mean = {s: sum(r["loss"] for r in recs) / len(recs) for s, recs in by_step.items()}
    assert sum(mean[s] for s in range(last - 9, last + 1)) < 0.7 * sum(mean[s] for s in range(10))
    # the killed worker came back as a joiner (restart count 1) and matched the survivors
    joiner = [r for recs in logs.values() for r in recs if r["restart"] == 1]
    assert joiner, "the restarted worker never took part"
    assert agent.returncode == 0, out[-4000:]
    # synced before taking part: its parameters right after sync() equal the survivors'
    # after the step before its first one
    synced = [e for evs in events.values() for e in evs if e["event"] == "synced" and e["restart"] == 1]
    assert len(synced) == 1, events
    s0 = synced[0]["step"]
    assert synced[0]["params_sha"] == by_step[s0 - 1][0]["params_sha"]
    assert "stream_s" in synced[0]["sync_phases"], synced  # streamed over the side channel, not broadcast
    assert min(r["step"] for r in joiner) == s0 and all(r["world"] == 4 for r in joiner)
