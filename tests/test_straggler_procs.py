"""Straggler mitigation end to end with real processes: a real etcd, the real
``resilient coordinator --straggler-policy demote`` and 4 member processes
(bench/straggler.py's member mode: TCP transport wrapped by the shaper, health reporter,
an exactness check of every op against its reported contributors).

m2 is slowed 3x through its shaping file; the coordinator probes, then demotes it (epoch
roles), the leaf path keeps every result exact with m2 among the contributors; then the
file is rewritten at runtime to remove the slowness and m2 is promoted back, with the
ring in the topology-optimal order (what the planner gives with nobody demoted and no
link avoided). Every process is ended by PID in ``Run.close``."""
from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import pytest

from resilient.coordinator.epoch import read_epoch
from resilient.coordinator.membership import MemberInfo
from resilient.coordinator.planner import plan

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("straggler_bench", ROOT / "bench" / "straggler.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _wait(pred, timeout: float, what: str, run) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hit = run.first_epoch(pred)
        if hit is not None:
            return hit
        time.sleep(0.1)
    raise AssertionError(f"no epoch where {what} within {timeout}s; epochs: "
                         f"{[(r['number'], r['cause'], r['roles'], r['avoid']) for r in run.epochs]}")


def test_slow_member_is_demoted_kept_exact_and_promoted_back_to_the_optimal_ring(etcd_session):
    bench = _bench()
    args = argparse.Namespace(world=4, numel=1 << 16, report_s=0.5, ops=0, keep=False)
    cap = "bw=20MB/s,ref_bw=20MB/s"
    specs = {f"m{i}": cap for i in range(4)}
    specs["m2"] = cap + ",slow=3x"
    run = bench.Run(",".join(etcd_session.endpoints), "demote", specs, args, 0.0)
    try:
        t0 = run.start()
        demoted = _wait(lambda r: r["roles"].get("m2") == "demoted", 40, "m2 is demoted", run)
        assert demoted["cause"] == "health"
        assert [m for m, v in demoted["roles"].items() if v == "demoted"] == ["m2"]   # nobody else
        assert demoted["members"][-1] == "m2"                                         # at the tail
        # let ops run on the leaf path for a while, then heal m2 at runtime
        n_demoted = demoted["number"]
        logs_dir = run.dir

        def ops_in(epoch_n: int) -> int:
            p = logs_dir / "m2.jsonl"
            return sum(1 for l in p.read_text().splitlines() if f'"epoch": {epoch_n}' in l) if p.exists() else 0

        deadline = time.monotonic() + 30
        while ops_in(n_demoted) < 10 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ops_in(n_demoted) >= 10, "no ops ran on the leaf path"
        (run.dir / "shape-m2").write_text(cap)
        healed_at = time.time()
        promoted = _wait(lambda r: r["number"] > n_demoted and r["roles"].get("m2") == "active", 40,
                         "m2 is promoted back", run)
        assert promoted["cause"] == "health"
        assert promoted["at"] >= healed_at
        infos = [MemberInfo(member_id=m, host="h") for m in promoted["members"]]
        optimal = list(plan(infos).ring)
        epoch, _ = read_epoch(run.store, run.job)
        assert list(epoch.members) == optimal == ["m0", "m1", "m2", "m3"]
        assert not epoch.plan.get("avoid") and all(v == "active" for v in epoch.roles.values())
        logs = run.stop()
    finally:
        run.close()
    # every op of every member exact over its contributors; on the leaf path m2 still counts
    assert all(r["ok"] for log in logs.values() for r in log), "a wrong result"
    assert all(len(log) == len(logs["m0"]) for log in logs.values())
    leaf_ops = [r for log in logs.values() for r in log if r["epoch"] == n_demoted]
    assert len(leaf_ops) >= 10 and all(sorted(r["contributors"]) == ["m0", "m1", "m2", "m3"] for r in leaf_ops)
    assert all(sorted(r["contributors"]) == ["m0", "m1", "m2", "m3"] for log in logs.values() for r in log)
    assert t0 < demoted["at"]
