"""The host-staged data path (the one CUDA tensors take) forced on CPU tensors with
``RESILIENT_STAGING=1``: real worker processes, a real etcd + coordinator, shared memory
(every op kind) and TCP (allreduce with a real SIGKILL). The device-generic path is the
one that runs (every op reports the transfers it posted through the staging pipeline)
and its results are exact: identical to the reduction over the contributors each
survivor reports, computed here independently."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from collective_harness import Workers, coordinator  # noqa: E402
from inputs import make_input  # noqa: E402
from collective_checks import (  # noqa: E402
    assert_agree, check_allreduce, check_fault_free_run, kill_ops, survivors_of_kill,
)

pytestmark = pytest.mark.slow

STAGED = {"RESILIENT_STAGING": "1"}                              # transport auto: shared memory here
STAGED_TCP = {"RESILIENT_STAGING": "1", "RESILIENT_TRANSPORT": "tcp"}

OPS = [
    {"k": "allreduce", "numel": 300_001, "dtype": "float64", "op": "sum"},   # ring
    {"k": "allreduce", "numel": 1000, "dtype": "int64", "op": "sum"},        # recursive doubling
    {"k": "broadcast", "numel": 200_000, "dtype": "float32", "root": 1},     # chain
    {"k": "allgather", "numel": 10_001, "dtype": "int64"},                  # ring, all-gather only
    {"k": "reduce_scatter", "numel": 10_001, "dtype": "int64", "op": "sum"},  # ring, reduce-scatter only
    {"k": "allreduce", "numel": 0, "dtype": "float32", "op": "sum"},          # nothing to stage
]


def test_staged_path_runs_every_op_exactly(etcd_session, job_name, tmp_path):
    world = 3
    with coordinator(etcd_session.endpoint_arg, job_name):
        w = Workers(etcd_session.endpoint_arg, job_name, world, OPS, tmp_path, env=STAGED)
        try:
            recs = check_fault_free_run(w, OPS)   # exact everywhere, allreduce results bitwise equal
            for mid, rs in recs.items():
                for seq, (spec, rec) in enumerate(zip(OPS, rs)):
                    if spec["numel"]:
                        assert rec["staged_posts"], (mid, seq, rec)   # moved through the staging pipeline
        finally:
            w.close()


KILL_OPS = [*kill_ops(400_000),
            {"k": "broadcast", "numel": 50_000, "dtype": "float32", "root": 0}]   # staged chain in the new epoch


def test_staged_sigkill_mid_allreduce_every_survivor_exact(etcd_session, job_name, tmp_path):
    world, victim = 4, "m2"
    with coordinator(etcd_session.endpoint_arg, job_name):
        w = Workers(etcd_session.endpoint_arg, job_name, world, KILL_OPS, tmp_path, env=STAGED_TCP,
                    failpoints={victim: "kill@op=1,phase=rs,frac=0.5"})
        try:
            all_recs = survivors_of_kill(w, victim)
            survivors = list(all_recs)
            for mid, recs in all_recs.items():
                assert recs[0]["staged_posts"] and recs[2]["staged_posts"] and recs[3]["staged_posts"], recs
                bcast = KILL_OPS[3]
                exp = make_input(0, 3, w.seed, bcast["numel"], bcast["dtype"]).numpy()   # m0: rank 0
                np.testing.assert_array_equal(w.output(mid, 3), exp)
                for seq, spec in enumerate(KILL_OPS[:3]):
                    contrib = check_allreduce(w, mid, seq, spec)
                    if seq >= 1:   # killed in reduce-scatter: the exact reduction over the survivors
                        assert contrib == survivors, (mid, seq, contrib)
            assert any(w.records(m)[1]["recovery"] is not None for m in survivors)
            assert_agree(w, survivors, list(range(len(KILL_OPS))))
        finally:
            w.close()
