"""Regression (issue 3): a second kill while the survivors recover an op must not split
the op's contributor set.

Member m1 dies in op 1's reduce-scatter; the survivors recover op 1 in epoch 2; m3 dies in
its recovery round. Members that had already finished op 1 (they hold it as *retained* and
moved on to op 2) and members still recovering it then plan op 1 again in epoch 3. The
finished members' result is the op's result: the planner must deliver that copy to the
members still recovering (``decided`` masks), not reduce op 1 again over whoever still has
its input (which gave a member its own input alone)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from resilient.collectives.recovery import PieceKind, mask_of, members_of, plan_recovery, simulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from collective_harness import Workers, coordinator  # noqa: E402
from inputs import expected  # noqa: E402

MEMBERS = ["m0", "m1", "m2", "m3", "m4"]


def test_planner_hands_the_finished_result_to_a_member_still_recovering():
    """Pure logic: m0 and m2 finished the op over {m0,m2,m3,m4} (no input kept), m3 is now
    dead too, m4 holds partial accumulators. Everyone must end with {m0,m2,m3,m4}."""
    T = mask_of([0, 2, 3, 4])
    n_pieces = 5
    held = {"m0": [T] * n_pieces, "m2": [T] * n_pieces,
            "m4": [mask_of([4]), mask_of([3, 4]), 0, mask_of([1, 4]), mask_of([0, 1, 4])]}
    ring = ["m0", "m2", "m4"]
    has_input = {"m0": False, "m2": False, "m4": True}
    plan = plan_recovery(MEMBERS, ring, held, kind=PieceKind.REDUCE, has_input=has_input,
                         decided=[T] * n_pieces)
    assert plan.need == [T] * n_pieces
    end = simulate(plan, MEMBERS, held)
    assert end["m4"] == [T] * n_pieces
    assert members_of(plan.contributors, MEMBERS) == ["m0", "m2", "m3", "m4"]
    # without the decided masks the policy would pick the members that still have input:
    legacy = plan_recovery(MEMBERS, ring, held, kind=PieceKind.REDUCE, has_input=has_input)
    assert legacy.need == [mask_of([4])] * n_pieces


BIG = {"k": "allreduce", "numel": 65536, "dtype": "int64", "op": "sum"}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.usefixtures("ring_on_one_host")
def test_kill_during_recovery_keeps_one_contributor_set(etcd_session, job_name, tmp_path):
    ops = [BIG] * 4
    fps = {"m1": "kill@op=1,phase=rs,frac=0.5", "m3": "kill@op=1,phase=recovery,frac=0.5"}
    with coordinator(etcd_session.endpoint_arg, job_name, ttl=2.0):
        w = Workers(etcd_session.endpoint_arg, job_name, 5, ops, tmp_path, failpoints=fps, ttl=2.0)
        try:
            w.wait_done(list(w.procs), 120)
            assert w.procs["m1"].wait(10) == -9 and w.procs["m3"].wait(10) == -9, "a failpoint did not fire"
            survivors = ["m0", "m2", "m4"]
            for seq, spec in enumerate(ops):
                sets = {}
                for mid in survivors:
                    rec = w.records(mid)[seq]
                    assert rec["ok"], (mid, rec)
                    sets[mid] = rec["contributors"]
                    exp = expected("sum", [int(m[1:]) for m in rec["contributors"]], seq, w.seed, spec["numel"], "int64")
                    np.testing.assert_array_equal(w.output(mid, seq), exp.numpy(), err_msg=f"{mid} op {seq}")
                assert len({tuple(s) for s in sets.values()}) == 1, f"op {seq}: contributor sets differ: {sets}"
                if seq == 1:
                    assert "m1" not in sets["m0"], sets
                if seq >= 2:
                    assert sets["m0"] == survivors, sets
        finally:
            w.close()
