"""A removal while an admission is pending (docs/recovery.md), with real processes, a real
etcd and coordinator, and a real SIGKILL: an old member dies the moment the joiner is in
an epoch. Whichever way the race goes — the joiner's op seq agreed before the removal
(every survivor then admits it at that seq, also one that had not adopted the growing
epoch yet) or not (the coordinator leaves the joiner out of the removal and adds it
again; the joiner waits for that) — every member ends with the same group: each op has
one contributor set at every member that ran it, its exact sum, and the joiner takes part
from its first op on, in both join modes."""
from __future__ import annotations

import signal
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

AR = {"k": "allreduce", "numel": 1000, "dtype": "int64", "op": "sum"}
# op 2: m0..m2 block in a barrier until m3 enters it, which m3 does once it has seen the
# joiner m4 in an epoch; op 5: every member waits for an epoch without m2 (so m2 dies
# before the end, after the race or, with the delay, after a settled admission); op 6:
# for the group to have 4 members again (the joiner back, when the coordinator had left it
# out of the removal)
OPS = [AR, AR, {"k": "barrier", "override": {"m3": {"k": "wait_member", "id": "m4"}}}, AR, AR,
       {"k": "wait_gone", "id": "m2"}, {"k": "wait_world", "n": 4}, AR, AR]


def _epoch_has(etcd_session, job: str, member: str, deadline_s: float = 60) -> None:
    from resilient.coordinator import Store, keys

    store = Store(etcd_session.endpoints)
    try:
        deadline = time.monotonic() + deadline_s
        while True:
            kv = store.get(keys.epoch(job))
            if kv is not None and member.encode() in kv.value:
                return
            assert time.monotonic() < deadline, f"no epoch with {member} within {deadline_s}s"
            time.sleep(0.002)
    finally:
        store.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tree", ["1", "0"], ids=["join-tree", "joinseq-keys"])
@pytest.mark.parametrize("delay", [0.0, 0.2])
def test_a_member_killed_while_a_joiner_is_admitted_leaves_one_group(etcd_session, job_name, tmp_path, tree, delay):
    with coordinator(etcd_session.endpoint_arg, job_name):
        w = Workers(etcd_session.endpoint_arg, job_name, 4, OPS, tmp_path, env={"RESILIENT_JOIN_TREE": tree})
        try:
            deadline = time.monotonic() + 60
            while len(w.records("m0")) < 2:
                assert time.monotonic() < deadline, (w.out / "m0.stderr").read_text()[-3000:]
                time.sleep(0.02)
            w.start("m4", world=5, join=True)
            _epoch_has(etcd_session, job_name, "m4")
            time.sleep(delay)
            w.procs["m2"].send_signal(signal.SIGKILL)
            alive = ["m0", "m1", "m3", "m4"]
            w.wait_done(alive, 150)
            for m in alive:
                assert w.procs[m].poll() is None or w.procs[m].returncode == 0, (m, (w.out / f"{m}.stderr").read_text()[-3000:])
            recs = {m: {r["seq"]: r for r in w.records(m)} for m in alive}
            for m in alive:
                assert max(recs[m]) == len(OPS) - 1, (m, sorted(recs[m]), (w.out / f"{m}.stderr").read_text()[-3000:])
            first = min(recs["m4"])
            m2_in: list[bool] = []   # per allreduce: m2 contributed (it may, until it dies)
            assert first >= 3, recs["m4"]   # m0..m2 had started op 2 when the joiner came
            for seq, spec in enumerate(OPS):
                ran = [m for m in alive if seq in recs[m]]
                for m in ran:
                    assert recs[m][seq]["ok"], (m, recs[m][seq])
                if spec["k"] != "allreduce":
                    continue
                sets = {m: sorted(recs[m][seq]["contributors"]) for m in ran}
                assert len({tuple(v) for v in sets.values()}) == 1, (seq, sets)   # one group
                contrib = next(iter(sets.values()))
                assert ("m4" in contrib) == (seq >= first), (seq, first, contrib)
                m2_in.append("m2" in contrib)
                exp = expected("sum", [int(m[1:]) for m in contrib], seq, w.seed, spec["numel"], spec["dtype"]).numpy()
                for m in ran:
                    np.testing.assert_array_equal(w.output(m, seq).astype(np.int64), exp)
            assert m2_in == sorted(m2_in, reverse=True), m2_in   # once gone, m2 never contributes again
            assert not m2_in[-1]
        finally:
            w.close()
