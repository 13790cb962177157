"""The hierarchical allreduce over hosts of unequal size with real etcd, coordinator and
processes: 3 + 2 members on 2 emulated hosts (``MemberInfo.host`` from
RESILIENT_TEST_HOST, all on loopback). Host A's members link to each other over shared
memory, everything else goes over TCP (host B's workers run with ``RESILIENT_SHM=0``, so
they publish plain TCP addresses and every link touching them is TCP).

Op 0 runs the hierarchical algorithm over the plan's ``host_slots`` (each worker records
the algorithm the epoch selects when its op's ledger has exactly that layout) and is
exact over everyone. In op 1 host B's first member, which owns two of the three
cross-host slots, is SIGKILLed by failpoint in the cross-host all-gather (a phase only
the hierarchical algorithm has): every survivor is exact over the contributors it
reports, all report the same set, and op 2 runs hierarchical again over 3 + 1."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from collective_harness import Workers, coordinator  # noqa: E402
from inputs import expected  # noqa: E402

pytestmark = pytest.mark.slow

TTL = 2.0
OPS = [{"k": "allreduce", "numel": 120_001, "dtype": "int64", "op": "sum"},
       {"k": "allreduce", "numel": 120_001, "dtype": "int64", "op": "sum"},
       {"k": "allreduce", "numel": 60_000, "dtype": "int64", "op": "sum"}]
HOSTS = {"m0": "hostA", "m1": "hostA", "m2": "hostA", "m3": "hostB", "m4": "hostB"}
VICTIM = "m3"   # host B's local index 0: slots 0 and 2 of 3 (host_slots [[0, 1, 2], [0, 1, 0]])


def test_unequal_hosts_exact_and_a_kill_in_the_cross_ring_every_survivor_exact(etcd_session, job_name, tmp_path):
    shm_off = {m: {"RESILIENT_SHM": "0"} for m, h in HOSTS.items() if h == "hostB"}
    with coordinator(etcd_session.endpoint_arg, job_name, ttl=TTL):
        w = Workers(etcd_session.endpoint_arg, job_name, 5, OPS, tmp_path, ttl=TTL, hosts=HOSTS,
                    member_env=shm_off, failpoints={VICTIM: "kill@op=1,phase=cross_ag"})
        try:
            survivors = [m for m in sorted(w.procs) if m != VICTIM]
            w.wait_done(list(w.procs), 120)
            assert w.procs[VICTIM].wait(10) == -9, f"{VICTIM} was not killed in op 1's cross-host ring"
            contrib_of: dict[int, list[str]] = {}
            for mid in survivors:
                recs = {r["seq"]: r for r in w.records(mid)}
                for seq, spec in enumerate(OPS):
                    rec = recs[seq]
                    assert rec["ok"], (mid, rec)
                    contrib = rec["contributors"]
                    assert contrib_of.setdefault(seq, contrib) == contrib, (mid, seq, contrib, contrib_of[seq])
                    exp = expected("sum", [int(m[1:]) for m in contrib], seq, w.seed, spec["numel"], spec["dtype"])
                    np.testing.assert_array_equal(w.output(mid, seq), exp.numpy())
                assert recs[0]["algorithm"] == "HierarchicalAllreduce", (mid, recs[0])   # 3 + 2 by host_slots
                assert recs[2]["algorithm"] == "HierarchicalAllreduce", (mid, recs[2])   # 3 + 1 after the kill
            assert contrib_of[0] == sorted(w.procs)
            assert set(survivors) <= set(contrib_of[1])
            assert contrib_of[2] == survivors
        finally:
            w.close()
