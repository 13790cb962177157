"""torch's own distributed test suite (``DistributedTest._DistTestBase`` of the installed
wheel) pointed at the resilient backend: a real etcd and coordinator, each test's ranks
forked by torch's MultiProcessTestCase and calling
``init_process_group("resilient", rank=r, world_size=n)``. World size 3 for the selection;
then the tests torch skipped there for a small world (its subgroup tests want 8) again at
world size 8. Selection and the few skips, each with its reason:
tests/torch_suite_skips.txt. Every test that runs must pass."""
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


def _suite(etcd: str, job: str, tmp: Path, world: int, names: list[str]) -> dict:
    tmp.mkdir()
    out = tmp / "result.json"
    env = dict(os.environ, BACKEND="resilient", WORLD_SIZE=str(world), TEMP_DIR=str(tmp), PYTHONPATH=str(ROOT),
               RESILIENT_ETCD=etcd, RESILIENT_JOB=job, RESILIENT_LEASE_TTL="2",
               DISTRIBUTED_TESTS_DEFAULT_TIMEOUT="60", OMP_NUM_THREADS="1")
    for k in ("RESILIENT_MEMBER_ID", "RESILIENT_FAILPOINTS", "RANK"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "torch_suite" / "run.py"), str(SKIPS), str(out),
                           *names], env=env, cwd=tmp, capture_output=True, text=True, timeout=1500)
    assert out.exists(), proc.stderr[-5000:]
    res = json.loads(out.read_text())
    print(f"torch suite, world size {world}: {len(res['passed'])} passed, {len(res['failed'])} failed, "
          f"{len(res['skipped'])} skipped")
    assert not res["failed"], "\n\n".join(f"{k}:\n{v}" for k, v in res["failed"].items())[-8000:]
    return res


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_torch_distributed_suite_on_resilient(etcd_session, job_name, tmp_path):
    only = os.environ.get("RESILIENT_TORCH_SUITE_ONLY", "").split()
    with coordinator(etcd_session.endpoint_arg, job_name, ttl=2.0):
        res = _suite(etcd_session.endpoint_arg, job_name, tmp_path / "w3", 3, only)
        assert len(res["passed"]) >= (1 if only else 50), res
        small = sorted(k for k, v in res["skipped"].items() if "small world size" in v)
        if small:
            big = _suite(etcd_session.endpoint_arg, job_name, tmp_path / "w8", 8, small)
            assert sorted(big["passed"]) == small, big
