"""A member that registers later is admitted at an op boundary: the group agrees on the op
sequence number at which the growing epoch takes effect (announced under
``epochs/<n>/data/joinseq/``), the joiner starts there, and every op after it includes
the joiner with exact results. Real etcd + coordinator + processes."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from collective_harness import Workers, coordinator  # noqa: E402
from inputs import expected  # noqa: E402

pytestmark = pytest.mark.slow

OPS = [
    {"k": "allreduce", "numel": 1000, "dtype": "int64", "op": "sum"},
    {"k": "allreduce", "numel": 300_001, "dtype": "float64", "op": "sum"},
    {"k": "allreduce", "numel": 1000, "dtype": "int64", "op": "sum"},
    {"k": "wait_world", "n": 4},
    {"k": "allreduce", "numel": 1000, "dtype": "int64", "op": "sum"},
    {"k": "allreduce", "numel": 300_001, "dtype": "int64", "op": "sum"},
    {"k": "allreduce", "numel": 70_001, "dtype": "float64", "op": "avg"},
]


def by_seq(w: Workers, mid: str) -> dict[int, dict]:
    return {r["seq"]: r for r in w.records(mid)}


def test_joiner_is_admitted_at_an_op_boundary(etcd_session, job_name, tmp_path):
    with coordinator(etcd_session.endpoint_arg, job_name):
        w = Workers(etcd_session.endpoint_arg, job_name, 3, OPS, tmp_path)
        try:
            deadline = time.monotonic() + 60
            while len(w.records("m0")) < 1:  # the group is running ops
                assert time.monotonic() < deadline, (tmp_path / "m0.stderr").read_text()[-3000:]
                time.sleep(0.02)
            w.start("m3", world=4, join=True)
            everyone = ["m0", "m1", "m2", "m3"]
            w.wait_done(everyone, 120)
            recs = {m: by_seq(w, m) for m in everyone}
            first = min(recs["m3"])  # the op seq the joiner started at
            assert 1 <= first <= 4, recs["m3"]
            for mid in everyone:
                for seq, spec in enumerate(OPS):
                    if mid == "m3" and seq < first:
                        assert seq not in recs[mid]
                        continue
                    rec = recs[mid][seq]
                    assert rec["ok"], rec
                    contrib = rec["contributors"]
                    # from the agreed op on, the joiner is in every op; before it, never
                    want = everyone if seq >= first else ["m0", "m1", "m2"]
                    if spec["k"] == "allreduce":
                        assert sorted(contrib) == want, (mid, seq, contrib)
                        exp = expected(spec["op"], [int(m[1:]) for m in contrib], seq, w.seed, spec["numel"], spec["dtype"])
                        got = w.output(mid, seq)
                        if spec["dtype"].startswith("int"):
                            np.testing.assert_array_equal(got, exp.numpy())
                        else:
                            np.testing.assert_allclose(got, exp.numpy(), rtol=1e-9, atol=1e-9)
                    else:
                        assert sorted(rec["members"]) == want, (mid, seq, rec)
            for seq in range(first, len(OPS)):
                if OPS[seq]["k"] == "allreduce":
                    ref = w.output("m0", seq)
                    for mid in everyone[1:]:
                        np.testing.assert_array_equal(w.output(mid, seq), ref)
        finally:
            w.close()
