"""torch's own distributed test suite (``DistributedTest._DistTestBase`` of the installed
wheel) pointed at the resilient backend: world size 3, a real etcd and coordinator, each
test's ranks forked by torch's MultiProcessTestCase and calling
``init_process_group("resilient", rank=r, world_size=3)``. Selection and the few skips,
each with its reason: tests/torch_suite_skips.txt. Every selected test must pass."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from collective_harness import coordinator

ROOT = Path(__file__).resolve().parents[1]
SKIPS = ROOT / "tests" / "torch_suite_skips.txt"

pytest.importorskip("expecttest", reason="torch's test suite needs expecttest (pip install -e '.[dev]')")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_torch_distributed_suite_on_resilient(etcd_session, job_name, tmp_path):
    out = tmp_path / "result.json"
    env = dict(os.environ, BACKEND="resilient", WORLD_SIZE="3", TEMP_DIR=str(tmp_path), PYTHONPATH=str(ROOT),
               RESILIENT_ETCD=etcd_session.endpoint_arg, RESILIENT_JOB=job_name, RESILIENT_LEASE_TTL="2",
               DISTRIBUTED_TESTS_DEFAULT_TIMEOUT="60", OMP_NUM_THREADS="1")
    for k in ("RESILIENT_MEMBER_ID", "RESILIENT_FAILPOINTS", "RANK"):
        env.pop(k, None)
    only = os.environ.get("RESILIENT_TORCH_SUITE_ONLY", "").split()
    with coordinator(etcd_session.endpoint_arg, job_name, ttl=2.0):
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "torch_suite" / "run.py"), str(SKIPS), str(out),
                               *only], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert out.exists(), proc.stderr[-5000:]
    res = json.loads(out.read_text())
    print(f"torch suite: {len(res['passed'])} passed, {len(res['failed'])} failed, {len(res['skipped'])} skipped")
    assert not res["failed"], "\n\n".join(f"{k}:\n{v}" for k, v in res["failed"].items())[-8000:]
    assert len(res["passed"]) >= (1 if only else 40), res
