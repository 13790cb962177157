"""The DDP compression hook's two optional modes in real worker processes over the
resilient backend, with a real etcd and coordinator (the worker:
tests/workers/ddp_compress_worker.py, ``EF_MODE``); 3 ranks, no failure:

* ``ErrorFeedback(adaptive=True)``: the bits error feedback chooses per bucket from the
  previous step's aggregate and scales are the same on every member at every step, the
  op runs at the chosen width, and the width does change during the run (4 -> 8 bits);
* ``ErrorFeedback(switch="auto")``: the switch's agreed choice is the same on every member
  at every step, training goes through both arms (fp32 and q4, with error feedback's
  residual reset after an uncompressed step), the decisions are counted on the ranks'
  metrics (``resilient_compression_decisions_total{choice}``, read from the multiprocess
  files as the node agent's ``/metrics`` does) and logged.

In both, at every step the members' parameters are bitwise identical and every compressed
bucket is bitwise ``fl32(sum_{i in C} s*q_i) / |C|`` recomputed from the inputs the
contributors wrote."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from collective_harness import coordinator
from ddp_compress_records import by_step, floats, records, reference
from torch_proc_helpers import RankProcs, err_logs, wait_files, worker_env

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "ddp_compress_worker.py"
WORLD = 3

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _train(etcd: str, d: Path, mode: str, steps: int, extra_env: dict[str, str] | None = None) -> dict[int, list[dict[str, Any]]]:
    """``WORLD`` ranks train ``steps`` steps in ``EF_MODE=mode``; each step's records,
    after checking that every member ran every step with the same parameters, the same
    contributors (all) and the same bucket, exact where it was compressed."""
    job = f"ddpm-{mode}-{time.monotonic_ns() % 10**8}"
    env = {**worker_env(ROOT, etcd, job), "RESILIENT_LEASE_TTL": "6", "EF_MODE": mode, "EF_STEPS": str(steps),
           **(extra_env or {})}
    with coordinator(etcd, job, ttl=2.0), RankProcs(etcd, job) as ranks:
        procs = [ranks.start([sys.executable, str(WORKER), str(r), str(WORLD), str(d)], env=env, cwd=ROOT,
                             stderr=d / f"{r}.err") for r in range(WORLD)]
        wait_files(d, [f"member_{r}" for r in range(WORLD)], procs, 60)
        ids = [(d / f"member_{r}").read_text() for r in range(WORLD)]
        wait_files(d, [f"{m}.done" for m in ids], procs, 90)
        codes = ranks.wait(60)
    assert codes == [0] * WORLD, err_logs(d)
    steps_of = by_step(records(d))
    assert sorted(steps_of) == list(range(steps)), err_logs(d)
    for s, rs in steps_of.items():
        assert len(rs) == WORLD and len({r["params"] for r in rs}) == 1, f"step {s}: members' parameters differ"
        assert all(r["C"] == sorted(ids) and r["world"] == WORLD for r in rs), rs
        assert len({r["compressed"] for r in rs}) == 1 and len({tuple(r["buckets"]) for r in rs}) == 1
        ((key, b),) = rs[0]["buckets"].items()
        assert len({r["buckets"][key]["grads"] for r in rs}) == 1, f"step {s}: the bucket differs"
        if rs[0]["compressed"]:
            assert all(r["scales"] == rs[0]["scales"] and r["segs"] == rs[0]["segs"] for r in rs)
            assert torch.equal(floats(b["grads"]), reference(d, rs[0], key)), f"step {s}: not the exact mean"
    return steps_of


def test_adaptive_bits_change_and_every_member_chooses_the_same(etcd_session, tmp_path):
    steps_of = _train(etcd_session.endpoint_arg, tmp_path, "adaptive", 5)
    widths = []
    for s, rs in sorted(steps_of.items()):
        assert all(r["compressed"] for r in rs), s
        assert len({str(sorted(r["next_bits"].items())) for r in rs}) == 1, f"step {s}: members chose different bits"
        widths.append({k for _, _, k in rs[0]["segs"] if k != 32})
        if s > 0:   # the op ran at the width chosen after the previous step
            assert widths[-1] == set(steps_of[s - 1][0]["next_bits"].values()), (s, widths)
    assert widths[0] == {4} and {8} in widths, widths   # the width did change


def test_auto_switch_agrees_goes_through_both_arms_and_reports_its_decisions(etcd_session, tmp_path):
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    from resilient.metrics import prepare_multiprocess_dir, worker_env as metrics_env

    metrics = prepare_multiprocess_dir(tmp_path / "metrics")
    steps = 7
    steps_of = _train(etcd_session.endpoint_arg, tmp_path, "auto", steps, metrics_env(metrics))
    choices = []
    for s, rs in sorted(steps_of.items()):
        assert len({r["choice"] for r in rs}) == 1, f"step {s}: the members' arms differ"
        choices.append(rs[0]["choice"])
        assert rs[0]["compressed"] == (choices[-1] == "q4"), (s, rs[0]["choice"])
    # the probes (fp32, then q4), q4 chosen, fp32 probed again: both arms, both ways
    assert choices[:2] == ["fp32", "q4"] and "fp32" in choices[2:], choices
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=metrics)
    counts = {s.labels["choice"]: s.value for fam in registry.collect() for s in fam.samples
              if s.name == "resilient_compression_decisions_total" and s.value}
    assert counts == {"fp32": WORLD * choices.count("fp32"), "q4": WORLD * choices.count("q4")}, counts
    for r in range(WORLD):
        log = (tmp_path / f"{r}.err").read_text()
        assert "compression switch: fp32" in log and "compression switch: q4" in log, log[-2000:]
