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
PLAIN = {"k": "allreduce", "numel": 1000, "dtype": "float32", "op": "sum"}
COMP = {"k": "allreduce", "numel": NUMEL, "dtype": "float32", "op": "sum", "bits": 4, "bucket": BUCKET}
# worker op index -> comm op seqs: 0 plain (0); 1 compressed (1 scale, 2 ring); 2 plain (3);
# 3 compressed (4 scale, 5 ring); 4 plain (6); 5 compressed (7 scale, 8 ring); 6 plain (9)
OPS = [PLAIN, COMP, PLAIN, COMP, PLAIN, COMP, PLAIN]
#: one victim per phase: m2 in the first ring's reduce-scatter, m4 in the second op's
#: scale agreement (recursive doubling of 197 floats), m1 in the third ring's all-gather
KILLS = {"m2": "kill@op=2,phase=rs,frac=0.5", "m4": "kill@op=4,phase=rd,frac=0.4", "m1": "kill@op=8,phase=ag,frac=0.3"}


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


def test_sigkill_in_each_phase_keeps_every_result_exact(etcd_session, job_name, tmp_path):
    with coordinator(etcd_session.endpoint_arg, job_name, ttl=TTL):
        w = Workers(etcd_session.endpoint_arg, job_name, 5, OPS, tmp_path, failpoints=KILLS, ttl=TTL)
        try:
            w.wait_done(list(w.procs), 150)
            for v in KILLS:
                assert w.procs[v].wait(10) == -9, f"{v} was not killed: {KILLS[v]}"
            first = _check(w, ["m0", "m1", "m3", "m4"], 1)             # m2 died in the ring's reduce-scatter
            assert {"m0", "m1", "m3", "m4"} <= set(first)
            second = _check(w, ["m0", "m1", "m3"], 3)                  # m4 died agreeing the scales
            assert second == ["m0", "m1", "m3"]                        # it never quantized: not in the sum
            third = _check(w, ["m0", "m3"], 5)                         # m1 died in the all-gather
            assert {"m0", "m3"} <= set(third) <= {"m0", "m1", "m3"}
            for m in ("m0", "m3"):                                     # the plain ops between them ran in step
                assert all(w.records(m)[k]["ok"] for k in (0, 2, 4, 6))
        finally:
            w.close()
