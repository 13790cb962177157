"""The join agreement over the data plane with real processes, a real etcd and coordinator
(resilient/collectives/join_agreement.py, EpochTracker): a growing epoch is agreed while
old members are blocked inside an op, with one ``joinseq`` key in etcd under the tree
agreement (``RESILIENT_JOIN_TREE=1``, the default), one per old member without it, and the
same result when the tree stalls (a member that sends no tree message and writes its own
key at once) and the agreement completes through covering records around it."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from collective_harness import Workers, coordinator  # noqa: E402

pytestmark = pytest.mark.slow

AR = {"k": "allreduce", "numel": 1000, "dtype": "int64", "op": "sum"}


def _first_ops(w: Workers, mid: str, n: int, deadline_s: float = 60) -> None:
    deadline = time.monotonic() + deadline_s
    while len(w.records(mid)) < n:
        assert time.monotonic() < deadline, (w.out / f"{mid}.stderr").read_text()[-3000:]
        time.sleep(0.02)


def _joinseq_keys(etcd_session, job: str) -> dict[int, dict[str, bytes]]:
    """epoch number -> member -> its ``joinseq`` key's value, for the epochs that have one."""
    from resilient.coordinator import EpochData, Store

    store = Store(etcd_session.endpoints)
    try:
        return {n: got for n in range(0, 40) if (got := EpochData(store, job, n).get_all("joinseq"))}
    finally:
        store.close()


@pytest.mark.parametrize("tree", ["1", "0", "stalled"])
def test_growing_epoch_is_agreed_while_old_members_are_blocked_in_an_op(etcd_session, job_name, tmp_path, tree):
    # stalled: m2, a leaf of the tree, runs without it (RESILIENT_JOIN_TREE=0: it sends no
    # tree message and writes its own key at once); the others see that key and fall back,
    # without waiting out their stall (set to 60 s so that a wait would fail the test)
    # op 2: m0 and m1 enter a barrier and block in it, waiting for m2, which enters it only
    # once the joiner is in the job: the agreement must run while their op threads are in it
    ops = [AR, AR, {"k": "barrier", "override": {"m2": {"k": "wait_world", "n": 4}}}, AR, AR]
    with coordinator(etcd_session.endpoint_arg, job_name):
        env = {"RESILIENT_JOIN_TREE": "0" if tree == "0" else "1", "RESILIENT_JOIN_TREE_STALL": "60"}
        w = Workers(etcd_session.endpoint_arg, job_name, 3, ops, tmp_path, env=env,
                    member_env={"m2": {"RESILIENT_JOIN_TREE": "0"}} if tree == "stalled" else None)
        try:
            _first_ops(w, "m0", 2)
            w.start("m3", world=4, join=True)
            everyone = ["m0", "m1", "m2", "m3"]
            # stalled: a member that waited out its 60 s stall misses this 45 s deadline
            w.wait_done(everyone, 45 if tree == "stalled" else 120)
            recs = {m: {r["seq"]: r for r in w.records(m)} for m in everyone}
            assert min(recs["m3"]) == 3, recs["m3"]  # m0 and m1 had started op 2: the largest seq wins
            for m in everyone:
                for seq, rec in recs[m].items():
                    assert rec["ok"], (m, rec)
                    if ops[seq]["k"] == "allreduce":
                        assert sorted(rec["contributors"]) == (everyone if seq >= 3 else everyone[:3]), (m, rec)
            for seq in (3, 4):
                for m in everyone[1:]:
                    np.testing.assert_array_equal(w.output(m, seq), w.output("m0", seq))
        finally:
            w.close()
    from resilient.collectives.join_agreement import parse_entry

    keys = _joinseq_keys(etcd_session, job_name)
    assert keys, "no joinseq key was written"
    if tree == "1":
        assert all(len(v) == 1 for v in keys.values()), keys  # one key per growing epoch: the tree's root
    elif tree == "0":   # one per old member of the growing epoch
        assert any(sorted(v) == ["m0", "m1", "m2"] for v in keys.values()), keys
    else:   # m2's own key, and covering records of tree members around it (the root's at least)
        n = max(n for n, v in keys.items() if "m2" in v)   # the epoch that added m3 (the last growing one)
        got = keys[n]
        assert "m0" in got and parse_entry(got["m2"], n, 3).kind == "own", keys
        assert all(parse_entry(v, n, 3).kind == "cover" for m, v in got.items() if m != "m2"), keys

