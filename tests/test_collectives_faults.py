"""Failure cases of the resumable collectives with real etcd + coordinator + processes and
failpoint SIGKILLs (tests/workers/collective_worker.py): two failures in one op, a
failure during recovery, broadcast/allgather/reduce_scatter with a kill mid-op, the strict
policy. Kill points are random per run but seeded (the seed is printed; rerun with
RESILIENT_TEST_SEED=<seed>). A killed worker's lease is revoked by the harness the moment
it exits (the node agent's fast path), so every survivor must finish the op well within
the detection bound."""
from __future__ import annotations

import inspect
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from collective_harness import Workers, coordinator  # noqa: E402
from resilient.collectives.communicator import Communicator  # noqa: E402
from inputs import expected, make_input  # noqa: E402

pytestmark = pytest.mark.slow

TTL = 2.0
#: revoke -> epoch -> abort -> ledger exchange -> finish, generously on a loaded 2-core box
DETECTION_BOUND_S = TTL + 8.0


@pytest.fixture
def rng(request) -> random.Random:
    seed = int(os.environ.get("RESILIENT_TEST_SEED", random.randrange(1 << 30)))
    print(f"\n{request.node.name}: kill-point seed {seed} (RESILIENT_TEST_SEED={seed} to rerun)")
    return random.Random(seed)


def idx(mid: str) -> int:
    return int(mid[1:])


def assert_allreduce_exact(w: Workers, mid: str, seq: int, spec: dict) -> list[str]:
    rec = w.records(mid)[seq]
    assert rec["ok"], (mid, rec)
    contrib = rec["contributors"]
    exp = expected(spec.get("op", "sum"), [idx(m) for m in contrib], seq, w.seed, spec["numel"], spec["dtype"])
    np.testing.assert_array_equal(w.output(mid, seq), exp.numpy())
    return contrib


# kill points fire at the first progress mark >= frac, and frac <= 0.6 here: ring marks are
# step/(n-1) (one slice per chunk here, marks up to 0.67 or more); chain (broadcast) marks are
# slice/slices, so a broadcast must span more than 3 of the communicator's default slices
SLICE_BYTES = inspect.signature(Communicator).parameters["slice_bytes"].default
BCAST_NUMEL = 3 * SLICE_BYTES // 8 + 1000   # int64: 4 slices, marks 0, .25, .5, .75
BIG = {"k": "allreduce", "numel": 600_000, "dtype": "int64", "op": "sum"}
OPS = [{"k": "allreduce", "numel": 1000, "dtype": "int64", "op": "sum"}, BIG,
       {"k": "allreduce", "numel": 1000, "dtype": "int64", "op": "sum"}]


#: the ledger summaries' tree beyond direct_max survivors, at a size tests afford: every
#: survivor sends its summary up a binary tree to the planner (the first survivor) and
#: receives only its own slice of the plan; no etcd copy from the start, so the tree is the
#: path that delivers (etcd stays the fallback after 10 s)
TREE = {"RESILIENT_LEDGER_DIRECT_MAX": "1", "RESILIENT_LEDGER_TREE_FANOUT": "2", "RESILIENT_LEDGER_ETCD_MAX": "0"}


def assert_planned_by_the_tree(w: Workers, survivors: list[str], seq: int) -> None:
    """Every survivor that finished op ``seq`` by recovery got its plan from the planner."""
    recs = [w.records(m)[seq].get("recovery") for m in survivors]
    assert any(recs), "no survivor recovered the op"
    assert all(r["plan_from"] == "planner" for r in recs if r), recs


def assert_survivors_exact_and_alike(w: Workers, survivors: list[str], contrib_ok) -> None:
    """Every survivor's every op exact, with ``contrib_ok(seq, contrib)`` true of its
    contributors; op 1 (the one with the faults) done within two detection bounds and
    bitwise the same on every survivor."""
    for mid in survivors:
        for seq, spec in enumerate(OPS):
            contrib = assert_allreduce_exact(w, mid, seq, spec)
            assert contrib_ok(seq, contrib), (mid, seq, contrib)
        assert w.records(mid)[1]["seconds"] < 2 * DETECTION_BOUND_S
    ref = w.output(survivors[0], 1)
    for mid in survivors[1:]:
        np.testing.assert_array_equal(w.output(mid, 1), ref)


def run(etcd_session, job, tmp_path, world, fps, ops=OPS, policy="default", env=None):
    with coordinator(etcd_session.endpoint_arg, job, ttl=TTL):
        w = Workers(etcd_session.endpoint_arg, job, world, ops, tmp_path, failpoints=fps, ttl=TTL, policy=policy,
                    env=env)
        try:
            victims = [m for m in fps if "kill" in fps[m]]
            survivors = [m for m in w.procs if m not in victims]
            w.wait_done(list(w.procs), 120)
            for v in victims:
                assert w.procs[v].wait(10) == -9, f"{v} was not killed: {fps[v]}"
            return w, survivors
        except BaseException:
            w.close()
            raise


@pytest.mark.usefixtures("ring_on_one_host")
@pytest.mark.parametrize("world,victims,tree", [(5, ("m1", "m3"), True), (4, ("m0", "m1"), False)],
                         ids=["non-adjacent-5-tree", "adjacent-4"])
def test_two_failures_in_one_op(etcd_session, job_name, tmp_path, rng, world, victims, tree):
    # Whichever victim reaches its point second may already be in the recovery of the
    # first death (its reduce-scatter was cut short): it then dies at that recovery's
    # first round instead — still two failures in one op.
    fps = {v: f"kill@op=1,phase=rs,frac={rng.uniform(0.05, 0.6):.2f};kill@op=1,phase=recovery" for v in victims}
    w, survivors = run(etcd_session, job_name, tmp_path, world, fps, env=TREE if tree else None)
    try:
        if tree:
            assert_planned_by_the_tree(w, survivors, 1)
        for mid in survivors:
            for seq, spec in enumerate(OPS):
                contrib = assert_allreduce_exact(w, mid, seq, spec)
                if seq >= 1:  # reduce-scatter failures: exact over the survivors
                    assert contrib == survivors, (mid, seq, contrib)
            assert w.records(mid)[1]["seconds"] < DETECTION_BOUND_S, w.records(mid)[1]
        for seq in range(len(OPS)):
            ref = w.output(survivors[0], seq)
            for mid in survivors[1:]:
                np.testing.assert_array_equal(w.output(mid, seq), ref)
    finally:
        w.close()


@pytest.mark.usefixtures("ring_on_one_host")
@pytest.mark.parametrize("tree", [False, True], ids=["direct", "tree"])
def test_failure_during_recovery(etcd_session, job_name, tmp_path, rng, tree):
    """m2 dies in op 1, then m0 in that op's recovery (in tree mode m0 is the planner of
    the first recovery: the survivors plan again, with m1 as the planner)."""
    fps = {"m2": f"kill@op=1,phase={rng.choice(['rs', 'ag'])},frac={rng.uniform(0.05, 0.6):.2f}",
           "m0": "kill@op=1,phase=recovery"}
    w, survivors = run(etcd_session, job_name, tmp_path, 5, fps, env=TREE if tree else None)
    try:
        if tree:
            assert_planned_by_the_tree(w, survivors, 1)
        assert_survivors_exact_and_alike(
            w, survivors, lambda seq, contrib: "m2" not in contrib or seq == 0 or "ag" in fps["m2"])
    finally:
        w.close()


@pytest.mark.usefixtures("ring_on_one_host")
def test_the_planner_killed_holding_every_summary(etcd_session, job_name, tmp_path, rng):
    """Tree mode: m2 dies in op 1; m0, the planner of that recovery, dies once it holds
    every survivor's summary, before any decision left it. The survivors waiting for their
    decisions start over in the epoch without m0, m1 plans, and the op ends exact over
    the three survivors."""
    fps = {"m2": f"kill@op=1,phase=rs,frac={rng.uniform(0.05, 0.6):.2f}", "m0": "kill@op=1,phase=plan"}
    w, survivors = run(etcd_session, job_name, tmp_path, 5, fps, env=TREE)
    try:
        assert survivors == ["m1", "m3", "m4"]
        assert_planned_by_the_tree(w, survivors, 1)
        assert_survivors_exact_and_alike(w, survivors, lambda seq, contrib: seq == 0 or contrib == survivors)
    finally:
        w.close()


@pytest.mark.parametrize("world", [5])  # the direct (no tree) recovery: tests/test_collectives_multiproc.py
def test_allgather_reduce_scatter_broadcast_with_a_kill(etcd_session, job_name, tmp_path, rng, world):
    """op 1 allgather (kill in its ring), op 2 reduce_scatter, op 3 broadcast; the victim
    dies in one of them; the survivors plan through the tree (one planner, a slice each)."""
    ops = [{"k": "barrier"},
           {"k": "allgather", "numel": 200_003, "dtype": "int64"},
           {"k": "reduce_scatter", "numel": 200_003, "dtype": "int64", "op": "sum"},
           {"k": "broadcast", "numel": BCAST_NUMEL, "dtype": "int64", "root": 0}]
    victim = f"m{rng.randrange(1, world)}"
    op, phase = rng.choice([(1, "ag"), (2, "rs"), (3, "chain")])
    fps = {victim: f"kill@op={op},phase={phase},frac={rng.uniform(0.05, 0.6):.2f}"}
    w, survivors = run(etcd_session, job_name, tmp_path, world, fps, ops=ops, env=TREE if world == 5 else None)
    try:
        everyone = [f"m{i}" for i in range(world)]
        for mid in survivors:
            recs = {r["seq"]: r for r in w.records(mid)}
            for seq in range(1, 4):
                rec = recs[seq]
                if not rec["ok"]:
                    # the op the victim died in may fail only as DataLost naming it; the next
                    # allgather/reduce_scatter, whose inputs a member sized for the old group
                    # before it saw the new epoch, fails on every member with a clear error
                    shrank = seq == op + 1 and rec["error"].startswith("GroupChanged")
                    lost = seq == op and rec["error"].startswith("DataLost") and victim in rec["error"]
                    assert shrank or lost, (mid, rec, fps)
                    continue
                got = w.output(mid, seq)
                if seq == 1:
                    members = everyone if seq <= op else survivors
                    exp = np.stack([make_input(idx(m), seq, w.seed, 200_003, "int64").numpy() for m in members])
                    np.testing.assert_array_equal(got, exp)
                elif seq == 2:
                    contrib = rec["contributors"]
                    c = rec["members"].index(mid) if seq > op else everyone.index(mid)
                    exp = sum(make_input(idx(m), seq * 100 + c, w.seed, 200_003, "int64") for m in contrib)
                    np.testing.assert_array_equal(got, exp.numpy())
                    if seq > op or seq < op:
                        assert contrib == (survivors if seq > op else everyone), (mid, contrib, fps)
                    else:  # killed in this op: a chunk already fully reduced keeps everyone (exact, reported)
                        assert contrib in (survivors, everyone), (mid, contrib, fps)
                else:
                    np.testing.assert_array_equal(got, make_input(0, seq, w.seed, BCAST_NUMEL, "int64").numpy())
    finally:
        w.close()


@pytest.mark.usefixtures("ring_on_one_host")
def test_strict_policy_aborts_on_every_survivor(etcd_session, job_name, tmp_path, rng):
    """The strict policy's CollectiveAborted reaches every survivor from the planner too
    (tree mode: the planner's failure to plan is in every survivor's decision)."""
    fps = {"m1": f"kill@op=1,phase=rs,frac={rng.uniform(0.05, 0.6):.2f}"}
    w, survivors = run(etcd_session, job_name, tmp_path, 4, fps, policy="strict", env=TREE)
    try:
        for mid in survivors:
            recs = w.records(mid)
            assert recs[1]["ok"] is False and recs[1]["error"].startswith("CollectiveAborted"), (mid, recs[1])
            assert assert_allreduce_exact(w, mid, 2, OPS[2]) == survivors  # usable for the next op
    finally:
        w.close()
