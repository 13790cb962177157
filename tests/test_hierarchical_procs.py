"""The hierarchical allreduce's fault contract with real etcd, coordinator and processes:
2 or 3 members on each of 2 emulated hosts (``MemberInfo.host`` from RESILIENT_TEST_HOST, all on
loopback), SIGKILL / SIGSTOP by failpoint at each level — an intra-host member in the
host reduce-scatter, a host leader (local rank 0) in the cross-host ring, a whole host
at mixed phases; SIGSTOP of a host leader, of a non-leader (in its host's reduce-scatter,
in the cross-host all-gather) and of a whole host, found by lease expiry, the stopped
members failing with RemovedFromGroup after SIGCONT — and every survivor's output
of every op checked exactly against the contributors it reports; and hosts of unequal
size (3 + 2, the plan's ``host_slots``) with a kill in the cross-host ring. A victim that died by
its failpoint proves the op ran the hierarchical algorithm (the failpoint phases
``intra_rs`` / ``cross_rs`` / ``cross_ag`` / ``intra_ag`` exist nowhere else)."""
from __future__ import annotations

import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from collective_harness import Workers, coordinator  # noqa: E402
from inputs import expected  # noqa: E402

pytestmark = pytest.mark.slow

TTL = 2.0
#: op 1 is large (hierarchical); op 2 runs over what is left (flat ring: hosts of unequal size, or one host)
OPS = [{"k": "allreduce", "numel": 1000, "dtype": "int64", "op": "sum"},
       {"k": "allreduce", "numel": 200_003, "dtype": "int64", "op": "sum"},
       {"k": "allreduce", "numel": 100_000, "dtype": "int64", "op": "sum"}]


def hosts(k: int) -> dict[str, str]:
    """2 emulated hosts of ``k``: m0..m{k-1} on hostA (m0 its leader), the rest on hostB."""
    return {f"m{i}": ("hostA" if i < k else "hostB") for i in range(2 * k)}


#: a victim that may already be in the recovery of an earlier death when its point comes
#: dies at that recovery's first round instead (still in the same op)
OR_RECOVERY = ";kill@op=1,phase=recovery"
CASES = {
    # an intra-host member (not the leader) dies halfway through its host's reduce-scatter
    "intra-member": (3, {"m1": "kill@op=1,phase=intra_rs,frac=0.5"}),
    # host leader (local rank 0 of host B) dies in the cross-host reduce-scatter
    "host-leader-cross-rs": (2, {"m2": "kill@op=1,phase=cross_rs"}),
    # host leader of host A dies in the cross-host all-gather
    "host-leader-cross-ag": (2, {"m0": "kill@op=1,phase=cross_ag"}),
    # a whole host goes, its members at different levels
    "whole-host": (2, {"m2": "kill@op=1,phase=intra_rs", "m3": "kill@op=1,phase=intra_ag" + OR_RECOVERY}),
}


def _check_survivors(w: Workers, survivors: list[str], ops: list[dict] = OPS) -> dict[int, list[str]]:
    contrib_of: dict[int, list[str]] = {}
    for mid in survivors:
        recs = {r["seq"]: r for r in w.records(mid)}
        for seq, spec in enumerate(ops):
            rec = recs[seq]
            assert rec["ok"], (mid, rec)
            contrib = rec["contributors"]
            assert contrib_of.setdefault(seq, contrib) == contrib, (mid, seq, contrib, contrib_of[seq])
            exp = expected("sum", [int(m[1:]) for m in contrib], seq, w.seed, spec["numel"], spec["dtype"])
            np.testing.assert_array_equal(w.output(mid, seq), exp.numpy())
    return contrib_of


def _kill_case(etcd: str, job: str, tmp: Path, case: str) -> None:
    k, fps = CASES[case]
    tmp.mkdir()
    with coordinator(etcd, job, ttl=TTL):
        w = Workers(etcd, job, 2 * k, OPS, tmp, failpoints=fps, ttl=TTL, hosts=hosts(k))
        try:
            survivors = [m for m in w.procs if m not in fps]
            w.wait_done(list(w.procs), 120)
            for v in fps:
                assert w.procs[v].wait(10) == -9, f"{case}: {v} was not killed at {fps[v]}"
            try:
                contrib = _check_survivors(w, survivors)
            except AssertionError as exc:   # every member's log (transport warnings: dropped links) with it
                tails = "\n".join(f"--- {m}\n" + (tmp / f"{m}.stderr").read_text()[-1500:] for m in sorted(w.procs))
                raise AssertionError(f"{case}: {exc}\n{tails}") from exc
            assert contrib[0] == sorted(w.procs), (case, contrib)
            assert set(survivors) <= set(contrib[1]), (case, contrib)
            assert contrib[2] == survivors, (case, contrib)
        finally:
            w.close()


#: the cases two by two: each test runs both side by side (own job and coordinator each;
#: their lease-expiry waits overlap)
CASE_PAIRS = [tuple(list(CASES)[i:i + 2]) for i in range(0, len(CASES), 2)]


@pytest.mark.parametrize("cases", CASE_PAIRS, ids=["+".join(p) for p in CASE_PAIRS])
def test_kill_at_each_level_every_survivor_exact(etcd_session, job_name, tmp_path, cases):
    with ThreadPoolExecutor(len(cases)) as ex:
        runs = [ex.submit(_kill_case, etcd_session.endpoint_arg, f"{job_name}-{i}", tmp_path / case, case)
                for i, case in enumerate(cases)]
        for f in runs:
            f.result()


def test_stopped_host_leader_is_removed_and_survivors_exact(etcd_session, job_name, tmp_path):
    victim = "m2"   # host B's leader
    with coordinator(etcd_session.endpoint_arg, job_name, ttl=TTL):
        w = Workers(etcd_session.endpoint_arg, job_name, 4, OPS, tmp_path, ttl=TTL, hosts=hosts(2),
                    failpoints={victim: "stop@op=1,phase=intra_ag"})
        try:
            survivors = [m for m in w.procs if m != victim]
            w.wait_done(survivors, 120)
            contrib = _check_survivors(w, survivors)
            assert contrib[2] == survivors
            os.kill(w.procs[victim].pid, signal.SIGCONT)
            assert w.procs[victim].wait(60) == 4   # RemovedFromGroup: it contributes to nothing later
            assert not (tmp_path / f"{victim}.2.npy").exists()
        finally:
            w.close()


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state ``T`` in /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _stop_case(etcd: str, job: str, tmp: Path, k: int, fps: dict[str, str]) -> None:
    """Every victim SIGSTOPs itself by failpoint inside op 1 (hierarchical): the
    coordinator removes it by lease expiry, every survivor's output of every op is exact
    over the contributors it reports (all reporting the same), op 2 runs over the
    survivors only. Then SIGCONT: a victim never delivers a wrong result — it leaves with
    RemovedFromGroup (exit 4), any op it did finish is exact over the contributors it
    reports, and it writes nothing for op 2."""
    everyone = sorted(hosts(k))
    survivors = [m for m in everyone if m not in fps]
    with coordinator(etcd, job, ttl=TTL):
        w = Workers(etcd, job, 2 * k, OPS, tmp, ttl=TTL, hosts=hosts(k), failpoints=fps)
        try:
            w.wait_done(survivors, 120)
            for v in fps:   # the failpoint fired: stopped (not finished, not dead)
                assert w.procs[v].poll() is None and _stopped(w.procs[v].pid), f"{v} did not stop at {fps[v]}"
            try:
                contrib = _check_survivors(w, survivors)
            except AssertionError as exc:   # every member's log with it
                tails = "\n".join(f"--- {m}\n" + (tmp / f"{m}.stderr").read_text()[-1500:] for m in everyone)
                raise AssertionError(f"{exc}\n{tails}") from exc
            assert contrib[0] == everyone and set(survivors) <= set(contrib[1]) and contrib[2] == survivors, contrib
            for v in fps:
                os.kill(w.procs[v].pid, signal.SIGCONT)
            for v in fps:
                assert w.procs[v].wait(60) == 4, f"{v}: {(tmp / f'{v}.stderr').read_text()[-1500:]}"
                for rec in w.records(v):   # op 1 may finish after SIGCONT (exact), op 2 never does
                    assert (rec["ok"] and rec["seq"] < 2) or rec["error"].startswith("RemovedFromGroup"), (v, rec)
                    if rec["ok"]:
                        spec = OPS[rec["seq"]]
                        exp = expected("sum", [int(m[1:]) for m in rec["contributors"]], rec["seq"], w.seed,
                                       spec["numel"], spec["dtype"])
                        np.testing.assert_array_equal(w.output(v, rec["seq"]), exp.numpy())
                assert not (tmp / f"{v}.2.npy").exists(), v
        finally:
            w.close()


def test_stopped_whole_host_is_removed_and_survivors_exact(etcd_session, job_name, tmp_path):
    """Host B's two members stop inside op 1 at different levels: its leader in the
    cross-host reduce-scatter, the other at the start of its host's all-gather (or, if the
    epoch removing its leader aborts it first, in the recovery)."""
    _stop_case(etcd_session.endpoint_arg, job_name, tmp_path, 2,
               {"m2": "stop@op=1,phase=cross_rs", "m3": "stop@op=1,phase=intra_ag;stop@op=1,phase=recovery"})


@pytest.mark.parametrize("victim,fp", [("m1", "stop@op=1,phase=intra_rs"), ("m3", "stop@op=1,phase=cross_ag")],
                         ids=["host-reduce-scatter", "cross-host-all-gather"])
def test_stopped_non_leader_is_removed_and_survivors_exact(etcd_session, job_name, tmp_path, victim, fp):
    """A member that is not its host's leader (local rank 1) stops inside op 1: in its
    host's reduce-scatter (a shared-memory peer of its host's leader), or in the cross-host
    all-gather (the ring of local index 1)."""
    _stop_case(etcd_session.endpoint_arg, job_name, tmp_path, 2, {victim: fp})


RS_AG_OPS = [{"k": "barrier"},
             {"k": "reduce_scatter", "numel": 200_003, "dtype": "int64", "op": "sum"},
             {"k": "allgather", "numel": 200_003, "dtype": "int64"},
             {"k": "barrier"}]   # members that finished op 2 serve its recovery from their next op


@pytest.mark.parametrize("victim,fp", [("m2", "kill@op=1,phase=cross_rs"), ("m0", "kill@op=2,phase=intra_ag")],
                         ids=["reduce_scatter-leader-cross", "allgather-leader-intra"])
def test_reduce_scatter_and_allgather_with_a_kill_exact(etcd_session, job_name, tmp_path, victim, fp):
    everyone = [f"m{i}" for i in range(4)]
    survivors = [m for m in everyone if m != victim]
    op = int(fp.split("op=")[1].split(",")[0])
    with coordinator(etcd_session.endpoint_arg, job_name, ttl=TTL):
        w = Workers(etcd_session.endpoint_arg, job_name, 4, RS_AG_OPS, tmp_path, failpoints={victim: fp}, ttl=TTL,
                    hosts=hosts(2))
        try:
            w.wait_done(everyone, 120)
            assert w.procs[victim].wait(10) == -9, f"{victim} was not killed at {fp}"
            for mid in survivors:
                recs = {r["seq"]: r for r in w.records(mid)}
                for seq in (1, 2):
                    rec = recs[seq]
                    if not rec["ok"]:
                        # the killed op may only lose the victim's own piece (DataLost naming it);
                        # an op sized for the old group before the new epoch: GroupChanged
                        lost = seq == op and rec["error"].startswith("DataLost") and victim in rec["error"]
                        shrank = seq > op and rec["error"].startswith("GroupChanged")
                        assert lost or shrank, (mid, rec)
                        continue
                    got = w.output(mid, seq)
                    if seq == 1:
                        contrib = rec["contributors"]
                        c = rec["members"].index(mid) if seq > op else everyone.index(mid)
                        exp = sum(expected("sum", [int(m[1:])], seq * 100 + c, w.seed, 200_003, "int64")
                                  for m in contrib)
                        np.testing.assert_array_equal(got, exp.numpy())
                        assert contrib in (survivors, everyone), (mid, contrib)
                    else:
                        members = everyone if seq <= op else survivors
                        exp = np.stack([expected("sum", [int(m[1:])], seq, w.seed, 200_003, "int64").numpy()
                                        for m in members])
                        np.testing.assert_array_equal(got, exp)
        finally:
            w.close()


#: unequal hosts, 3 + 2: host A (m0..m2) links over shared memory; host B's workers run
#: with RESILIENT_SHM=0 (plain TCP addresses), so every link touching them is TCP
UNEQUAL_HOSTS = {"m0": "hostA", "m1": "hostA", "m2": "hostA", "m3": "hostB", "m4": "hostB"}
UNEQUAL_OPS = [{"k": "allreduce", "numel": 120_001, "dtype": "int64", "op": "sum"},
               {"k": "allreduce", "numel": 120_001, "dtype": "int64", "op": "sum"},
               {"k": "allreduce", "numel": 60_000, "dtype": "int64", "op": "sum"}]


def test_unequal_hosts_exact_and_a_kill_in_the_cross_ring_every_survivor_exact(etcd_session, job_name, tmp_path):
    """Op 0 runs the hierarchical algorithm over the plan's ``host_slots`` (the worker
    records the algorithm the epoch selects when its op's ledger has exactly that
    layout) and is exact over everyone. In op 1 host B's local index 0, which owns two of
    the three cross-host slots (``host_slots`` [[0, 1, 2], [0, 1, 0]]), is SIGKILLed in
    the cross-host all-gather: every survivor is exact over the contributors it reports,
    all report the same set, and op 2 runs hierarchical again over 3 + 1."""
    victim = "m3"
    shm_off = {m: {"RESILIENT_SHM": "0"} for m, h in UNEQUAL_HOSTS.items() if h == "hostB"}
    with coordinator(etcd_session.endpoint_arg, job_name, ttl=TTL):
        w = Workers(etcd_session.endpoint_arg, job_name, 5, UNEQUAL_OPS, tmp_path, ttl=TTL, hosts=UNEQUAL_HOSTS,
                    member_env=shm_off, failpoints={victim: "kill@op=1,phase=cross_ag"})
        try:
            survivors = [m for m in sorted(w.procs) if m != victim]
            w.wait_done(list(w.procs), 120)
            assert w.procs[victim].wait(10) == -9, f"{victim} was not killed in op 1's cross-host ring"
            contrib = _check_survivors(w, survivors, UNEQUAL_OPS)
            for mid in survivors:
                recs = {r["seq"]: r for r in w.records(mid)}
                assert recs[0]["algorithm"] == "HierarchicalAllreduce", (mid, recs[0])   # 3 + 2 by host_slots
                assert recs[2]["algorithm"] == "HierarchicalAllreduce", (mid, recs[2])   # 3 + 1 after the kill
            assert contrib[0] == sorted(w.procs)
            assert set(survivors) <= set(contrib[1])
            assert contrib[2] == survivors
        finally:
            w.close()
