"""Real processes: two members call different collectives at one op number with no data
between them (broadcasts from two different roots: each waits for the other), which
waited forever before op probes. Both must raise ``InputMismatch`` from the probe
(``resilient/collectives/op_context.py``), long before the 30 s op timeout, and the next
op must be exact on both. Real etcd, coordinator, processes and links."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from collective_checks import check_allreduce  # noqa: E402
from collective_harness import Workers, coordinator  # noqa: E402


@pytest.mark.timeout(120)
def test_broadcasts_from_different_roots_raise_input_mismatch_on_both(etcd_session, job_name, tmp_path):
    ops = [
        {"k": "allreduce", "numel": 1000, "dtype": "int64"},
        {"k": "broadcast", "numel": 1000, "dtype": "int64", "root": 0, "override": {"m0": {"root": 1}}},
        {"k": "allreduce", "numel": 1000, "dtype": "int64"},
    ]
    with coordinator(etcd_session.endpoint_arg, job_name):
        # the members' default transport: shared memory between them (tests/test_transport_probe.py
        # runs the probe over every transport)
        w = Workers(etcd_session.endpoint_arg, job_name, 2, ops, tmp_path)
        try:
            w.wait_done(list(w.procs), 90)
            for mid in w.procs:
                recs = w.records(mid)
                assert len(recs) == 3, (mid, recs)
                assert not recs[1]["ok"] and recs[1]["error"].startswith("InputMismatch"), (mid, recs[1])
                # the probe ended it, not the op timeout (30 s; past it a wait only reports suspects)
                assert recs[1]["seconds"] < 30, (mid, recs[1])
                for seq in (0, 2):
                    assert check_allreduce(w, mid, seq, ops[seq]) == sorted(w.procs)
        finally:
            w.close()
