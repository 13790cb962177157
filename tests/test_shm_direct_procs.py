"""The direct shared-memory allreduce's and reduce-scatter's fault contract with real etcd, coordinator and
processes on one host: 5 members (shared memory between them, the default transport), a
member SIGKILLed halfway through reducing its chunk of a large op (after publishing its
input: it stays a contributor, the survivors reduce its chunk from its segment, no
recovery), another in the copy phase of a small op (every member reduces everything), a
third SIGSTOPped reducing its chunk (the same, once its lease expires), and every
survivor's output of every op checked exactly against the contributors it
reports (all survivors reporting the same set); at the end each survivor maps only the
segments of the last op's members (its own and the other survivor's: the dead and the
removed members' segments were unmapped when the next epoch's first direct op began)."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

from resilient.transport import shm_segment

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from collective_checks import check_allreduce  # noqa: E402
from collective_harness import Workers, coordinator  # noqa: E402
from inputs import expected  # noqa: E402


@pytest.fixture(autouse=True)
def _shm_direct_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct algorithm is the default (RESILIENT_SHM_DIRECT=1): these tests set it
    explicitly (inherited by member processes), whatever the caller's environment says."""
    monkeypatch.setenv("RESILIENT_SHM_DIRECT", "1")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180),
              pytest.mark.skipif(not shm_segment.supported(), reason="direct shared memory needs Linux on x86-64")]

TTL = 2.0
OPS = [{"k": "allreduce", "numel": 400_003, "dtype": "int64", "op": "sum"},    # 3.2 MB: chunk mode
       {"k": "allreduce", "numel": 400_003, "dtype": "int64", "op": "sum"},    # m1 dies reducing its chunk
       {"k": "allreduce", "numel": 100_003, "dtype": "float64", "op": "sum"},  # 800 KB: every-member mode, m3 dies
       {"k": "barrier"},                                                        # the epoch without m3
       {"k": "allreduce", "numel": 400_003, "dtype": "int64", "op": "sum"},    # m4 stopped reducing its chunk
       {"k": "allreduce", "numel": 200_003, "dtype": "int64", "op": "max"}]    # the two survivors
FAILPOINTS = {"m1": "kill@op=1,phase=rs,frac=0.5", "m3": "kill@op=2,phase=ag,frac=0.5;kill@op=2,phase=recovery",
              "m4": "stop@op=4,phase=rs,frac=0.5"}
AR = [seq for seq, spec in enumerate(OPS) if spec["k"] == "allreduce"]


def _segments_mapped(pid: int) -> set[int]:
    """The direct algorithms' segments (memfds named ``resilient-shmd``) process ``pid``
    maps, by inode."""
    out = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/memfd:resilient-shmd "):
                out.add(int(fields[4]))
    return out


def _check_only_survivors_mapped(w: Workers, survivors: list[str]) -> None:
    """Every survivor maps one segment per member of the last op (the survivors): its
    own and the others'; a dead or removed member's segment is no longer mapped."""
    for mid in survivors:
        assert len(_segments_mapped(w.procs[mid].pid)) == len(survivors), \
            (mid, _segments_mapped(w.procs[mid].pid))


def test_sigkill_mid_op_every_survivor_exact_and_only_survivors_segments_mapped(etcd_session, job_name, tmp_path):
    """Members killed or stopped after publishing their input stay contributors (the
    survivors reduce their chunks from their segments, no recovery); the stopped one,
    resumed after the survivors went on, never delivers a torn result; the survivors
    end up mapping only each other's segments. (Nothing new in /dev/shm: a guard against
    named segments only, a memfd never appears there.)"""
    dev_shm = set(os.listdir("/dev/shm"))
    with coordinator(etcd_session.endpoint_arg, job_name, ttl=TTL):
        w = Workers(etcd_session.endpoint_arg, job_name, 5, OPS, tmp_path, failpoints=FAILPOINTS, ttl=TTL)
        try:
            survivors = ["m0", "m2"]
            w.wait_done(survivors, 120)
            _check_only_survivors_mapped(w, survivors)
            os.kill(w.procs["m4"].pid, signal.SIGCONT)
            w.wait_done(["m4"], 60)
            for victim in ("m1", "m3"):
                assert w.procs[victim].wait(10) == -9, f"{victim} was not killed at {FAILPOINTS[victim]}"
            contrib_of: dict[int, list[str]] = {}
            for mid in survivors:
                for seq in AR:
                    contrib = check_allreduce(w, mid, seq, OPS[seq])
                    assert contrib_of.setdefault(seq, contrib) == contrib, (mid, seq, contrib, contrib_of[seq])
                # the epochs of 5, 4, 3 and 2 members on one host select the direct path
                recs = w.records(mid)
                assert all(recs[seq]["algorithm"] == "ShmDirectAllreduce" for seq in AR), (mid, recs)
                # m1 and m4 had published their inputs: their chunks were reduced from their segments
                assert recs[1]["recovery"] is None and recs[4]["recovery"] is None, (recs[1], recs[4])
            assert contrib_of[0] == contrib_of[1] == ["m0", "m1", "m2", "m3", "m4"]
            assert set(survivors) <= set(contrib_of[2]) and "m1" not in contrib_of[2]
            assert contrib_of[4] == ["m0", "m2", "m4"]
            assert contrib_of[5] == survivors
            # the resumed m4: removed; an op it delivered is exact over what it reports
            assert w.procs["m4"].wait(30) == 4
            for rec in w.records("m4"):
                if rec["ok"] and rec["seq"] in AR:
                    check_allreduce(w, "m4", rec["seq"], OPS[rec["seq"]])
        finally:
            w.close()
    assert set(os.listdir("/dev/shm")) == dev_shm


# -- the direct reduce-scatter (algorithms/shm_direct_rs.py) --------------------------------

RS = {"k": "reduce_scatter", "numel": 60_001, "dtype": "int64", "op": "sum"}   # 5 x 480 KB per member
RS_OPS = [RS,                                    # 5 members
          RS,                                    # m1 dies halfway through reducing its chunk (after publishing)
          {"k": "barrier"},                      # the epoch without m1
          RS,                                    # m3 dies before publishing its input
          {**RS, "dtype": "float64"},            # m4 is SIGSTOPped reducing its chunk (after publishing)
          RS,                                    # m0, m2 wait for m4 until its lease expires
          {**RS, "op": "max"}]                   # m0, m2 (new session: the areas m4 read are reused)
RS_FAILPOINTS = {"m1": "kill@op=1,phase=rs,frac=0.5", "m3": "kill@op=3,phase=rs,frac=0",
                 "m4": "stop@op=4,phase=rs,frac=0.5"}


def _check_rs(w: Workers, mid: str, seq: int, spec: dict) -> list[str]:
    """Op ``seq`` succeeded on ``mid`` with its chunk reduced exactly over the contributors it reports."""
    rec = w.records(mid)[seq]
    assert rec["ok"], rec
    c = rec["chunk"]
    assert rec["op_members"][c] == mid, rec
    exp = expected("sum" if spec["op"] == "sum" else spec["op"], [int(m[1:]) for m in rec["contributors"]],
                   seq * 100 + c, w.seed, spec["numel"], spec["dtype"])
    np.testing.assert_array_equal(w.output(mid, seq), exp.numpy().astype(w.output(mid, seq).dtype))
    return list(rec["contributors"])


def test_reduce_scatter_kills_before_and_after_publishing_and_a_stopped_member(etcd_session, job_name, tmp_path):
    """A member killed after publishing its input stays a contributor (its segment is still
    readable: no recovery, no resend); one killed before publishing is left out; a SIGSTOPped
    one is evicted and, resumed, fails instead of delivering a torn chunk. Every survivor
    exact over the set it reports, all the same; the survivors end up mapping only each
    other's segments."""
    dev_shm = set(os.listdir("/dev/shm"))
    with coordinator(etcd_session.endpoint_arg, job_name, ttl=TTL):
        w = Workers(etcd_session.endpoint_arg, job_name, 5, RS_OPS, tmp_path, failpoints=RS_FAILPOINTS, ttl=TTL)
        try:
            survivors = ["m0", "m2"]
            w.wait_done(survivors, 120)
            _check_only_survivors_mapped(w, survivors)
            os.kill(w.procs["m4"].pid, signal.SIGCONT)
            w.wait_done(["m4"], 60)
            for victim in ("m1", "m3"):
                assert w.procs[victim].wait(10) == -9, f"{victim} was not killed at {RS_FAILPOINTS[victim]}"
            contrib_of: dict[int, list[str]] = {}
            for mid in survivors:
                for seq, spec in enumerate(RS_OPS):
                    if spec["k"] == "reduce_scatter":
                        contrib = _check_rs(w, mid, seq, spec)
                        assert contrib_of.setdefault(seq, contrib) == contrib, (mid, seq, contrib, contrib_of[seq])
                recs = w.records(mid)
                assert recs[0]["algorithm"] == recs[6]["algorithm"] == "ShmDirectReduceScatter", (mid, recs[0], recs[6])
                assert recs[1]["recovery"] is None, recs[1]   # m1's death did not touch op 1
            assert contrib_of[0] == contrib_of[1] == ["m0", "m1", "m2", "m3", "m4"]
            assert contrib_of[3] == ["m0", "m2", "m4"]
            assert contrib_of[4] == ["m0", "m2", "m4"]    # m4 had published: still a contributor
            assert contrib_of[5] == contrib_of[6] == survivors
            # the resumed m4: removed; an op it delivered is exact over what it reports
            assert w.procs["m4"].wait(30) == 4
            for rec in w.records("m4"):
                if rec["ok"] and RS_OPS[rec["seq"]]["k"] == "reduce_scatter":
                    _check_rs(w, "m4", rec["seq"], RS_OPS[rec["seq"]])
        finally:
            w.close()
    assert set(os.listdir("/dev/shm")) == dev_shm
