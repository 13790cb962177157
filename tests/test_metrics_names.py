"""Rank-side metrics: Prometheus naming rules, bounded labels, buckets, and the node agent's
multiprocess /metrics served for real worker processes (one of them SIGKILLed)."""
from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from resilient import metrics
from resilient.errors import ConfigError

from cp_helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "helm" / "resilient" / "dashboards" / "resilient.json"

#: Families the coordinator serves (owned by resilient.coordinator.metrics).
COORDINATOR_FAMILIES = {
    "resilient_coordinator_members": "gauge",
    "resilient_epochs_published": "counter",
    "resilient_epoch": "gauge",
    "resilient_coordinator_is_leader": "gauge",
    "resilient_detection_latency_seconds": "histogram",
    "resilient_straggler_score": "gauge",
    "resilient_bad_records": "counter",
}
#: Label names that would carry unbounded values (REFERENCE.md: no run ids, tensor names…).
UNBOUNDED_LABELS = {"rank", "member", "member_id", "pid", "job", "job_id", "run_id", "host",
                    "hostname", "tensor", "name", "peer", "epoch", "address", "seq"}
BOUNDED_LABELS = {"op": metrics.COLLECTIVE_OPS, "cause": metrics.RECOVERY_CAUSES,
                  "method": metrics.ETCD_METHODS, "choice": metrics.COMPRESSION_CHOICES}
UNITS = ("_seconds", "_bytes", "_info", "_ratio")


def exposed_families() -> dict:
    reg = CollectorRegistry()
    metrics.RankMetrics(reg)
    return {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}


def check_family(name: str, mtype: str, sample_names: set[str], labels: set[str]) -> None:
    assert name.startswith("resilient_"), f"{name}: every family is under resilient_"
    assert re.fullmatch(r"[a-z][a-z0-9_]*", name), f"{name}: snake_case"
    if mtype == "counter":
        assert sample_names & {f"{name}_total"}, f"{name}: counters are exposed as {name}_total"
        assert not name.endswith("_total")
    else:
        assert not any(s.endswith("_total") for s in sample_names), f"{name}: only counters end _total"
    if mtype == "histogram":
        assert name.endswith("_seconds") or name.endswith("_bytes"), f"{name}: histogram of a base unit"
    for bad in ("_milliseconds", "_ms", "_kb", "_mb", "_minutes"):
        assert bad not in name, f"{name}: use base units (seconds, bytes)"
    assert not labels & UNBOUNDED_LABELS, f"{name}: unbounded labels {labels & UNBOUNDED_LABELS}"


def test_rank_families_follow_prometheus_naming():
    fams = exposed_families()
    assert set(fams) >= {
        "resilient_collective_duration_seconds", "resilient_collective_bytes", "resilient_recoveries",
        "resilient_recovery_duration_seconds", "resilient_recovery_resent_bytes",
        "resilient_recovery_saved_bytes", "resilient_rank_epoch", "resilient_world_size",
        "resilient_peer_wait_seconds", "resilient_etcd_request_duration_seconds", "resilient_etcd_retries",
    }
    for name, fam in fams.items():
        sample_names = {s.name for s in fam.samples}
        labels = {k for s in fam.samples for k in s.labels} - {"le", "version"}
        check_family(name, fam.type, sample_names, labels)
        for label in labels:
            assert label in BOUNDED_LABELS, f"{name}: label {label!r} has no bounded value set"
            values = {s.labels[label] for s in fam.samples}
            assert values == set(BOUNDED_LABELS[label]), f"{name}: children pre-created for every {label}"
        if fam.type in ("counter", "gauge", "histogram") and name != "resilient_build":
            assert any(u in name for u in UNITS) or fam.type != "histogram"


def test_check_family_catches_rule_breaks():
    """Proof the naming checker can fail."""
    with pytest.raises(AssertionError):
        check_family("collective_seconds", "histogram", set(), set())
    with pytest.raises(AssertionError):
        check_family("resilient_recoveries", "counter", {"resilient_recoveries"}, set())
    with pytest.raises(AssertionError):
        check_family("resilient_latency_ms", "histogram", set(), set())
    with pytest.raises(AssertionError):
        check_family("resilient_collective_duration_seconds", "histogram", set(), {"rank"})


def test_buckets_are_exponential_and_reach_minutes():
    for buckets in (metrics.RECOVERY_BUCKETS, metrics.COLLECTIVE_BUCKETS, metrics.WAIT_BUCKETS):
        ratios = {round(b / a, 3) for a, b in zip(buckets, buckets[1:])}
        assert len(ratios) == 1 and ratios.pop() > 1
    assert metrics.RECOVERY_BUCKETS[0] <= 0.01 and metrics.RECOVERY_BUCKETS[-1] >= 600
    assert metrics.COLLECTIVE_BUCKETS[-1] >= 60
    with pytest.raises(ConfigError, match="factor > 1"):
        metrics.exponential_buckets(1, 1, 3)


def test_label_values_outside_the_bounded_set_are_rejected():
    m = metrics.RankMetrics(CollectorRegistry())
    with pytest.raises(metrics.MetricLabelError, match=r"op='all_reduce'.*allreduce, broadcast"):
        m.record_collective("all_reduce", 0.1, 10)
    with pytest.raises(metrics.MetricLabelError, match="RECOVERY_CAUSES"):
        m.record_recovery("rank 3 died", 1.0, 0, 0)
    with pytest.raises(metrics.MetricLabelError, match="method='range'"):
        m.record_etcd_request("range", 0.01)
    with pytest.raises(ConfigError, match="resent_bytes=-1"):
        m.record_recovery("member_lost", 1.0, -1, 0)


def test_recording_updates_the_families():
    reg = CollectorRegistry()
    m = metrics.RankMetrics(reg)
    m.record_collective("allreduce", 0.5, 4096)
    m.record_recovery("lease_expired", 90.0, 100, 700)
    m.record_etcd_request("txn", 0.002, retries=2)
    m.set_epoch(4, 7)
    assert reg.get_sample_value("resilient_collective_bytes_total", {"op": "allreduce"}) == 4096
    assert reg.get_sample_value("resilient_collective_duration_seconds_count", {"op": "allreduce"}) == 1
    assert reg.get_sample_value("resilient_recoveries_total", {"cause": "lease_expired"}) == 1
    # 90 s lands in a finite bucket (default buckets would put it only in +Inf).
    assert reg.get_sample_value("resilient_recovery_duration_seconds_bucket", {"le": "163.84"}) == 1
    assert reg.get_sample_value("resilient_recovery_duration_seconds_bucket", {"le": "81.92"}) == 0
    assert reg.get_sample_value("resilient_recovery_saved_bytes_total") == 700
    assert reg.get_sample_value("resilient_etcd_retries_total", {"method": "txn"}) == 2
    assert reg.get_sample_value("resilient_rank_epoch") == 4
    assert reg.get_sample_value("resilient_world_size") == 7


def test_coordinator_families_follow_the_rules():
    """resilient.coordinator.metrics (owned by the control plane) obeys the same rules."""
    mod = pytest.importorskip("resilient.coordinator.metrics")
    reg = mod.CoordinatorMetrics().registry
    found = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    assert set(found) >= set(COORDINATOR_FAMILIES), f"missing {set(COORDINATOR_FAMILIES) - set(found)}"
    for name, fam in found.items():
        if name in COORDINATOR_FAMILIES:
            assert fam.type == COORDINATOR_FAMILIES[name], f"{name} is a {fam.type}"
        check_family(name, fam.type, {s.name for s in fam.samples},
                     {k for s in fam.samples for k in s.labels} - {"le"})


def test_dashboard_queries_only_known_metrics():
    known: set[str] = set()
    for name, fam in exposed_families().items():
        known |= {s.name for s in fam.samples}
    for name, mtype in COORDINATOR_FAMILIES.items():
        known |= {f"{name}_total"} if mtype == "counter" else (
            {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if mtype == "histogram" else {name})
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"]]
    used = {m for e in exprs for m in re.findall(r"\bresilient_[a-z0-9_]+", e)}
    assert used, "the dashboard queries no resilient metric"
    assert used <= known, f"dashboard queries unknown metrics: {sorted(used - known)}"
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("membership", "recover", "latency", "bandwidth"):
        assert topic in titles, f"dashboard lacks a {topic} panel"


# -- node agent: multiprocess mode with real processes --------------------------------------

WORKER = """
import sys
from resilient.metrics import rank_metrics
m = rank_metrics()
epoch, world = int(sys.argv[1]), int(sys.argv[2])
m.set_epoch(epoch, world)
m.record_collective("allreduce", 0.01, 1000)
m.record_recovery("member_lost", 2.0, 100, 300)
print("ready", flush=True)
sys.stdin.read()   # stay alive until the test closes stdin or kills us
"""


def _wait_ready(proc: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        r, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if r:
            line = proc.stdout.readline()
            assert line.strip() == "ready", f"worker {proc.pid} said {line!r}; stderr: {proc.stderr.read()}"
            return
    raise AssertionError(f"worker {proc.pid} not ready before the deadline")


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_node_agent_serves_all_workers_and_drops_dead_gauges(tmp_path):
    mdir = metrics.prepare_multiprocess_dir(tmp_path / "prom")
    (Path(mdir) / "counter_999999.db").write_bytes(b"")  # stale file from an earlier run
    mdir = metrics.prepare_multiprocess_dir(mdir)
    assert not list(Path(mdir).glob("*.db")), "stale files are removed"
    env = {**os.environ, **metrics.worker_env(mdir)}
    procs: list[subprocess.Popen] = []
    server = metrics.serve_node_metrics(mdir, port=0, addr="127.0.0.1")
    try:
        for epoch in (7, 3):
            procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(epoch), "4"], env=env,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + 60
        for p in procs:
            _wait_ready(p, deadline)

        s = _scrape(server.port)
        assert s[("resilient_recoveries_total", (("cause", "member_lost"),))] == 2
        assert s[("resilient_collective_bytes_total", (("op", "allreduce"),))] == 2000
        assert s[("resilient_collective_duration_seconds_count", (("op", "allreduce"),))] == 2
        assert s[("resilient_recovery_saved_bytes_total", ())] == 600
        assert s[("resilient_rank_epoch", ())] == 7  # livemax over the two workers
        assert s[("resilient_world_size", ())] == 4

        victim = procs[0]
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(timeout=30) == -signal.SIGKILL
        metrics.mark_worker_dead(victim.pid, mdir)

        s = _scrape(server.port)
        assert s[("resilient_rank_epoch", ())] == 3, "the dead worker's live gauge is gone"
        assert s[("resilient_recoveries_total", (("cause", "member_lost"),))] == 2, "counters never go back"
    finally:
        server.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
            for stream in (p.stdin, p.stdout, p.stderr):
                stream.close()


def test_serve_node_metrics_errors_name_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="prepare_multiprocess_dir"):
        metrics.serve_node_metrics(tmp_path / "missing", port=0, addr="127.0.0.1")
    mdir = metrics.prepare_multiprocess_dir(tmp_path / "prom")
    with metrics.serve_node_metrics(mdir, port=0, addr="127.0.0.1") as first:
        with pytest.raises(ConfigError, match=f"127.0.0.1:{first.port}.*--metrics-port"):
            metrics.serve_node_metrics(mdir, port=first.port, addr="127.0.0.1")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        metrics.prepare_multiprocess_dir(tmp_path / "file")


def test_node_agent_metrics_idle_connections_hold_a_bounded_number_of_threads(tmp_path):
    """200 idle connections to a node agent's /metrics: at most MAX_HTTP_THREADS handler
    threads, the rest answered 503 at once, and a scrape still succeeds."""
    import socket
    import threading

    from http_probe import mark_refused
    from resilient.coordinator.metrics import MAX_HTTP_THREADS

    mdir = metrics.prepare_multiprocess_dir(tmp_path / "prom")
    conns: list[socket.socket] = []
    with metrics.serve_node_metrics(mdir, port=0, addr="127.0.0.1") as server:
        baseline = threading.active_count()
        try:
            for _ in range(200):
                conns.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
            refused: set[int] = set()
            peak = baseline
            deadline = time.monotonic() + 30
            while len(refused) < 200 - MAX_HTTP_THREADS:
                assert time.monotonic() < deadline, f"only {len(refused)} connections answered 503"
                peak = max(peak, threading.active_count())
                mark_refused(conns, refused)
                time.sleep(0.01)
            assert peak <= baseline + MAX_HTTP_THREADS, (baseline, peak)
        finally:
            for c in conns:
                c.close()
        # Served again once the idle connections are gone: their handler threads see EOF
        # and give their slots back, which takes a moment after the close (a scrape made at
        # once can still meet 8 busy slots and be answered 503, as CI saw).
        served: list[dict] = []

        def scraped() -> bool:
            try:
                served.append(_scrape(server.port))
            except urllib.error.HTTPError as e:
                assert e.code == 503, e
                return False
            return True

        wait_until(scraped, 30, "a scrape served (200) after the idle connections closed")
