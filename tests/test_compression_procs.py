"""The exact compressed allreduce with real etcd + coordinator + member processes and a
failpoint SIGKILL in each phase: the scale agreement (recursive doubling of the bucket
maxima), the integer ring's reduce-scatter and its all-gather. Every survivor's output is
checked bitwise against ``fl32(sum_{i in C} s * q_i)`` recomputed here from the inputs of
the reported contributors ``C``, with the scales recomputed from the reported scale
contributors; all survivors must agree on ``C`` and on the bits."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from collective_harness import Workers, coordinator  # noqa: E402
from inputs import make_input  # noqa: E402
from resilient.collectives.quantization import Segment, bucket_maxima, dequantize, quantize, scales  # noqa: E402

pytestmark = pytest.mark.slow

TTL = 2.0
NUMEL, BUCKET = 200_000, 1024
# comm op seqs: 0 = plain, 1 = scale (MAX, recursive doubling), 2 = integer ring, 3 = plain
OPS = [{"k": "allreduce", "numel": 1000, "dtype": "float32", "op": "sum"},
       {"k": "allreduce", "numel": NUMEL, "dtype": "float32", "op": "sum", "bits": 4, "bucket": BUCKET},
       {"k": "allreduce", "numel": 1000, "dtype": "float32", "op": "sum"}]


def _expected(seed: int, contrib: list[str], scale_contrib: list[str], bound: int, bits: int, seq: int,
              op: str) -> tuple[np.ndarray, np.ndarray]:
    segs = [Segment(0, NUMEL, bits)]
    xs = {m: make_input(int(m[1:]), seq, seed, NUMEL, "float32") for m in set(contrib) | set(scale_contrib)}
    m = torch.stack([bucket_maxima(xs[k], segs, BUCKET) for k in scale_contrib]).amax(0)
    sc = scales(m, segs, BUCKET, bound)
    Q = sum(quantize(xs[k], sc, segs, BUCKET, bound).to(torch.int64) for k in contrib).to(torch.int32)
    out = dequantize(Q, sc, segs, BUCKET)
    if op == "avg":
        out = out / len(contrib)
    return out.numpy(), sc.numpy()


def _check(w: Workers, survivors: list[str], seq: int, op: str = "sum") -> list[str]:
    recs = {m: w.records(m)[seq] for m in survivors}
    for m, r in recs.items():
        assert r["ok"], (m, r)
    contrib = recs[survivors[0]]["contributors"]
    info = recs[survivors[0]]["compression"]
    assert all(r["contributors"] == contrib for r in recs.values()), recs
    assert all(r["compression"]["scale_contributors"] == info["scale_contributors"] for r in recs.values()), recs
    exp, sc = _expected(w.seed, contrib, info["scale_contributors"], info["members_bound"], 4, seq, op)
    for m in survivors:
        np.testing.assert_array_equal(np.load(w.out / f"{m}.{seq}.scales.npy"), sc)
        np.testing.assert_array_equal(w.output(m, seq), exp)
    return contrib


def _run(etcd_session, job, tmp_path, fps: dict[str, str]):
    with coordinator(etcd_session.endpoint_arg, job, ttl=TTL):
        w = Workers(etcd_session.endpoint_arg, job, 4, OPS, tmp_path, failpoints=fps, ttl=TTL)
        try:
            victims = list(fps)
            survivors = [m for m in w.procs if m not in victims]
            w.wait_done(list(w.procs), 120)
            for v in victims:
                assert w.procs[v].wait(10) == -9, f"{v} was not killed: {fps[v]}"
            return w, survivors
        except BaseException:
            w.close()
            raise


def test_compressed_allreduce_without_failure_is_exact(etcd_session, job_name, tmp_path):
    w, survivors = _run(etcd_session, job_name, tmp_path, {})
    try:
        assert _check(w, survivors, 1) == ["m0", "m1", "m2", "m3"]
        for m in survivors:  # the plain op after it ran at the right sequence number
            assert w.records(m)[2]["ok"]
    finally:
        w.close()


@pytest.mark.parametrize("fp", ["kill@op=1,phase=rd,frac=0.4", "kill@op=2,phase=rs,frac=0.5",
                                "kill@op=2,phase=ag,frac=0.3"], ids=["scale", "ring-rs", "ring-ag"])
def test_sigkill_in_each_phase_keeps_the_result_exact(etcd_session, job_name, tmp_path, fp):
    w, survivors = _run(etcd_session, job_name, tmp_path, {"m2": fp})
    try:
        contrib = _check(w, survivors, 1)
        assert set(survivors) <= set(contrib)
        if "phase=rd" in fp:  # died before quantizing: it cannot be in the integer sum
            assert "m2" not in contrib
        for m in survivors:
            assert w.records(m)[2]["ok"]
    finally:
        w.close()
