"""The node agent serves one /metrics for all its workers (prometheus-client multiprocess
mode): real `resilient-run`, real training workers on the resilient backend, a real scrape."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from resilient.coordinator.local_etcd import free_port

ROOT = Path(__file__).resolve().parents[1]


def _scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            return r.read().decode()
    except OSError:
        return ""


def _value(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_resilient_run_metrics_port_serves_every_workers_collectives(tmp_path):
    port = free_port()
    launcher = Path(sys.executable).parent / "resilient-run"
    agent = subprocess.Popen(
        [str(launcher), "--standalone", "--nproc-per-node", "2", "--metrics-port", str(port),
         str(ROOT / "examples" / "train.py"), "--steps", "400", "--step-sleep", "0.05"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, RESILIENT_LOG_LEVEL="WARNING"),
    )
    try:
        deadline = time.monotonic() + 120
        text = ""
        while time.monotonic() < deadline and agent.poll() is None:
            text = _scrape(port)
            # both workers' gradient allreduces, summed by the multiprocess collector
            if _value(text, "resilient_collective_duration_seconds_count", '{op="allreduce"}') >= 20:
                break
            time.sleep(0.2)
        assert agent.poll() is None, agent.stdout.read()[-3000:]
        count = _value(text, "resilient_collective_duration_seconds_count", '{op="allreduce"}')
        assert count >= 20, text[-2000:]
        assert _value(text, "resilient_collective_bytes_total", '{op="allreduce"}') > 0
        # one series per live worker pid for the gauges (multiprocess "all" mode) or a
        # max/liveall aggregate: either way the world size both workers see is 2
        sizes = [float(v) for v in re.findall(r"^resilient_world_size(?:\{[^}]*\})? ([0-9.]+)$", text, re.M)]
        assert sizes and set(sizes) == {2.0}, sizes
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
