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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from collective_harness import coordinator

ROOT = Path(__file__).resolve().parents[1]
SKIPS = ROOT / "tests" / "torch_suite_skips.txt"

pytest.importorskip("expecttest", reason="torch's test suite needs expecttest (pip install -e '.[dev]')")


def _suite(etcd: str, job: str, tmp: Path, world: int, names: list[str], shard: str = "") -> dict:
    tmp.mkdir()
    out = tmp / "result.json"
    env = dict(os.environ, BACKEND="resilient", WORLD_SIZE=str(world), TEMP_DIR=str(tmp), PYTHONPATH=str(ROOT),
               RESILIENT_ETCD=etcd, RESILIENT_JOB=job, RESILIENT_LEASE_TTL="2",
               DISTRIBUTED_TESTS_DEFAULT_TIMEOUT="60", OMP_NUM_THREADS="1", RESILIENT_TORCH_SUITE_SHARD=shard)
    for k in ("RESILIENT_MEMBER_ID", "RESILIENT_FAILPOINTS", "RANK"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "torch_suite" / "run.py"), str(SKIPS), str(out),
                           *names], env=env, cwd=tmp, capture_output=True, text=True, timeout=1500)
    assert out.exists(), proc.stderr[-5000:]
    res = json.loads(out.read_text())
    print(f"torch suite, world size {world} {shard}: {len(res['passed'])} passed, {len(res['failed'])} failed, "
          f"{len(res['skipped'])} skipped")
    assert not res["failed"], "\n\n".join(f"{k}:\n{v}" for k, v in res["failed"].items())[-8000:]
    return res


def _sharded(etcd: str, job: str, tmp: Path, world: int, names: list[str], shards: int = 2) -> dict:
    """The selection in ``shards`` shards side by side, each with its own job and coordinator
    (one run leaves a core idle most of the time: the ranks wait on each other), merged."""
    def one(i: int) -> dict:
        with coordinator(etcd, f"{job}-{i}", ttl=2.0):
            return _suite(etcd, f"{job}-{i}", tmp / f"shard{i}", world, names, f"{i}/{shards}")

    tmp.mkdir()
    with ThreadPoolExecutor(shards) as ex:
        parts = list(ex.map(one, range(shards)))
    return {k: ([n for p in parts for n in p[k]] if k == "passed" else {n: v for p in parts for n, v in p[k].items()})
            for k in ("passed", "failed", "skipped")}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_torch_distributed_suite_on_resilient(etcd_session, job_name, tmp_path):
    only = os.environ.get("RESILIENT_TORCH_SUITE_ONLY", "").split()
    etcd = etcd_session.endpoint_arg
    res = _sharded(etcd, job_name, tmp_path / "w3", 3, only)
    assert len(res["passed"]) >= (1 if only else 50), res
    small = sorted(k for k, v in res["skipped"].items() if "small world size" in v)
    if small:
        big = _sharded(etcd, f"{job_name}-w8", tmp_path / "w8", 8, small)
        assert sorted(big["passed"]) == small, big
