"""The direct shared-memory allreduce's fault contract with real etcd, coordinator and
processes on one host: 4 members (shared memory between them, the default transport), a
member SIGKILLed halfway through reducing its chunk of a large op, another in the copy
phase of a small op (every member reduces everything), and every survivor's output of
every op checked exactly against the contributors it reports (all survivors reporting
the same set); nothing is left in /dev/shm."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from resilient.transport import shm_segment

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from collective_checks import check_allreduce  # noqa: E402
from collective_harness import Workers, coordinator  # noqa: E402


@pytest.fixture(autouse=True)
def _shm_direct_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct algorithm is opt-in (RESILIENT_SHM_DIRECT=1): these tests turn it on
    (inherited by member processes)."""
    monkeypatch.setenv("RESILIENT_SHM_DIRECT", "1")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180),
              pytest.mark.skipif(not shm_segment.supported(), reason="direct shared memory needs Linux on x86-64")]

TTL = 2.0
OPS = [{"k": "allreduce", "numel": 400_003, "dtype": "int64", "op": "sum"},    # 3.2 MB: chunk mode
       {"k": "allreduce", "numel": 400_003, "dtype": "int64", "op": "sum"},    # m1 dies reducing its chunk
       {"k": "allreduce", "numel": 100_003, "dtype": "float64", "op": "sum"},  # 800 KB: every-member mode, m3 dies
       {"k": "allreduce", "numel": 200_003, "dtype": "int64", "op": "max"}]    # the two survivors
FAILPOINTS = {"m1": "kill@op=1,phase=rs,frac=0.5", "m3": "kill@op=2,phase=ag,frac=0.5;kill@op=2,phase=recovery"}


def test_sigkill_mid_op_every_survivor_exact_and_nothing_left_in_dev_shm(etcd_session, job_name, tmp_path):
    dev_shm = set(os.listdir("/dev/shm"))
    with coordinator(etcd_session.endpoint_arg, job_name, ttl=TTL):
        w = Workers(etcd_session.endpoint_arg, job_name, 4, OPS, tmp_path, failpoints=FAILPOINTS, ttl=TTL)
        try:
            w.wait_done(list(w.procs), 120)
            for victim in FAILPOINTS:
                assert w.procs[victim].wait(10) == -9, f"{victim} was not killed at {FAILPOINTS[victim]}"
            survivors = ["m0", "m2"]
            contrib_of: dict[int, list[str]] = {}
            for mid in survivors:
                for seq, spec in enumerate(OPS):
                    contrib = check_allreduce(w, mid, seq, spec)
                    assert contrib_of.setdefault(seq, contrib) == contrib, (mid, seq, contrib, contrib_of[seq])
                # the epochs of 4 and of 2 members on one host select the direct path
                recs = w.records(mid)
                assert recs[0]["algorithm"] == recs[3]["algorithm"] == "ShmDirectAllreduce", (mid, recs[0], recs[3])
            assert contrib_of[0] == ["m0", "m1", "m2", "m3"]
            assert contrib_of[1] == ["m0", "m2", "m3"]   # m1's chunk was never reduced: the survivors' set
            assert set(survivors) <= set(contrib_of[2]) and "m1" not in contrib_of[2]
            assert contrib_of[3] == survivors
        finally:
            w.close()
    assert set(os.listdir("/dev/shm")) == dev_shm
