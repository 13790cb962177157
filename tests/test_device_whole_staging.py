"""Whole-tensor host staging (resilient/device/whole.py): the CPU-only ops take CUDA tensors
through host copies of the whole tensors. Forced with ``RESILIENT_STAGING=1`` on CPU
tensors (the path CUDA tensors take; no GPU here), each op must go through the staging
wrapper (its copies are counted) and give exactly the unstaged result:

* the torch backend's composed ops (reduce, gather, scatter, all_to_all(_single), the
  coalesced forms) over the in-process thread engine;
* the leaf path of demoted members (real Communicators over real TCP, one thread each,
  the static in-memory view of tests/test_straggler_leaf.py);
* the exact compressed allreduce in real worker processes (real etcd, coordinator, TCP)
  with a SIGKILL in its ring: every survivor's result is bitwise the quantized sum over
  the contributors it reports (``tests/test_compression_procs.py``'s check)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from test_torch_backend_unit import run_ranks  # noqa: E402

from resilient.device.whole import COUNTS  # noqa: E402


def counted(fn: Any, n: int = 3) -> tuple[dict[int, Any], int, int]:
    """Run ``fn(rank, pg)`` on ``n`` ranks; returns the results and the whole-tensor copies
    (D2H, H2D) the ranks made together."""
    d0, h0 = COUNTS.d2h, COUNTS.h2d
    res = run_ranks(fn, n=n)
    return res, COUNTS.d2h - d0, COUNTS.h2d - h0


@pytest.fixture
def staged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESILIENT_STAGING", "1")


def test_without_forced_staging_cpu_tensors_are_not_copied():
    def fn(i, pg):
        r = torch.full((2,), float(i + 1))
        pg.reduce([r], dist.ReduceOptions()).wait()
        return r
    res, d2h, h2d = counted(fn)
    assert (d2h, h2d) == (0, 0) and res[0].tolist() == [6.0, 6.0]


def test_reduce_gather_scatter_stage_every_tensor_and_are_exact(staged):
    def reduce(i, pg):
        r = torch.full((2,), float(i + 1))
        o = dist.ReduceOptions(); o.rootRank = 1
        pg.reduce([r], o).wait()
        return r
    res, d2h, h2d = counted(reduce)
    assert (d2h, h2d) == (3, 3)                                   # one tensor per rank, in and back
    assert res[1].tolist() == [6.0, 6.0] and res[0].tolist() == [1.0, 1.0]

    def gather(i, pg):
        g = [torch.empty(2, dtype=torch.int8) for _ in range(3)] if i == 0 else []
        o = dist.GatherOptions(); o.rootRank = 0
        pg.gather([g] if i == 0 else [], [torch.full((2,), i, dtype=torch.int8)], o).wait()
        return g
    res, d2h, h2d = counted(gather)
    assert (d2h, h2d) == (3 + 3, 3)                               # 3 inputs + the root's 3 outputs
    assert [t.tolist() for t in res[0]] == [[0, 0], [1, 1], [2, 2]]

    def scatter(i, pg):
        sc = torch.empty(2, dtype=torch.int16)
        o = dist.ScatterOptions(); o.rootRank = 2
        ins = [[torch.full((2,), 10 * k, dtype=torch.int16) for k in range(3)]] if i == 2 else []
        pg.scatter([sc], ins, o).wait()
        return sc
    res, d2h, h2d = counted(scatter)
    assert (d2h, h2d) == (3 + 3, 3)                               # 3 outputs + the root's 3 inputs
    assert [res[i].tolist() for i in range(3)] == [[0, 0], [10, 10], [20, 20]]


def test_all_to_all_and_the_coalesced_forms_stage_and_are_exact(staged):
    def fn(i, pg):
        out = torch.empty(sum(j + i + 1 for j in range(3)))
        inp = torch.cat([torch.full((i + k + 1,), float(10 * i + k)) for k in range(3)])
        pg.alltoall_base(out, inp, [j + i + 1 for j in range(3)], [i + k + 1 for k in range(3)],
                         dist.AllToAllOptions()).wait()
        outs = [torch.empty(2) for _ in range(3)]
        pg.alltoall(outs, [torch.full((2,), float(10 * i + k)) for k in range(3)], dist.AllToAllOptions()).wait()
        co = [torch.ones(3), torch.ones(2, dtype=torch.int64)]
        pg.allreduce_coalesced(co, dist.AllreduceCoalescedOptions()).wait()
        gl = [[torch.empty(2) for _ in range(2)] for _ in range(3)]
        pg.allgather_coalesced(gl, [torch.full((2,), float(i)), torch.full((2,), float(-i))]).wait()
        gt = torch.empty(6)
        pg.all_gather_single_coalesced([gt], [torch.full((2,), float(i))]).wait()
        rs = torch.empty(2)
        pg.reduce_scatter_single_coalesced([rs], [torch.arange(6, dtype=torch.float32) + i],
                                           dist.ReduceScatterOptions()).wait()
        return out, outs, co, gl, gt, rs

    res, d2h, h2d = counted(fn)
    # per rank: a2a single 2 in + 1 back; a2a 6 + 3; coalesced 2 + 2; all_gather 8 + 6;
    # into-tensor 2 + 1; reduce-scatter 2 + 1
    assert (d2h, h2d) == (3 * (2 + 6 + 2 + 8 + 2 + 2), 3 * (1 + 3 + 2 + 6 + 1 + 1))
    for i in range(3):
        out, outs, co, gl, gt, rs = res[i]
        assert out.tolist() == [float(10 * j + i) for j in range(3) for _ in range(j + i + 1)]
        assert [o.tolist() for o in outs] == [[float(10 * j + i)] * 2 for j in range(3)]
        assert co[0].tolist() == [3.0] * 3 and co[1].tolist() == [3, 3]
        assert [[t.tolist() for t in gl[r]] for r in range(3)] == [[[float(r)] * 2, [float(-r)] * 2] for r in range(3)]
        assert gt.tolist() == [float(r) for r in range(3) for _ in range(2)]
        assert rs.tolist() == [3.0 * (2 * i) + 3, 3.0 * (2 * i + 1) + 3]


@pytest.mark.slow
def test_compressed_allreduce_staged_whole_with_a_sigkill_in_its_ring_is_exact(etcd_session, job_name, tmp_path):
    from collective_harness import Workers, coordinator
    from test_compression_procs import COMP, PLAIN, TTL, _check

    ops = [PLAIN, COMP, PLAIN]                  # comm seqs: 0 plain; 1 scales, 2 ring; 3 plain
    env = {"RESILIENT_STAGING": "1", "RESILIENT_TRANSPORT": "tcp"}
    with coordinator(etcd_session.endpoint_arg, job_name, ttl=TTL):
        w = Workers(etcd_session.endpoint_arg, job_name, 3, ops, tmp_path, env=env, ttl=TTL,
                    failpoints={"m2": "kill@op=2,phase=rs,frac=0.5"})
        try:
            w.wait_done(list(w.procs), 120)
            assert w.procs["m2"].wait(10) == -9
            survivors = ["m0", "m1"]
            contrib = _check(w, survivors, 1)
            assert set(survivors) <= set(contrib)
            for m in survivors:
                recs = w.records(m)
                assert recs[0]["whole_staged"] == 0 and recs[1]["whole_staged"] == 1, recs   # the codec's op only
                assert recs[2]["ok"] and recs[2]["whole_staged"] == 1, recs[2]   # the plain op after it: chunk-staged
        finally:
            w.close()


def test_the_leaf_path_of_demoted_members_runs_on_whole_host_copies_and_is_exact():
    """m3 and m4 demoted (the leaf path: tests/test_straggler_leaf.py's layout) with staging
    forced: every member's ledger goes to the host whole (input and output, each op), and
    every result is the exact reduction over all five members."""
    from static_group import Info, StaticEpoch, member_input, run_allreduces

    from resilient.transport.tcp import TcpTransport

    ids = [f"m{i}" for i in range(5)]
    trs = {m: TcpTransport(m, "leafjob") for m in ids}
    ep = StaticEpoch(1, tuple(ids), "tok", {m: Info(trs[m].address) for m in ids},
                     roles={m: ("demoted" if m in ("m3", "m4") else "active") for m in ids},
                     plan={"tree_parent": [-1, 0, 0, 1, 0]})
    d0 = COUNTS.d2h
    ops, numel = ["sum", "avg"], 10_001
    results = run_allreduces(ep, trs, ops, numel, close=trs.values(), small_bytes=1024, slice_bytes=4096,
                             staging=True)
    assert COUNTS.d2h - d0 == len(ids) * len(ops) * 2              # input and output of each member's ledger
    for seq, op in enumerate(ops):
        total = torch.stack([member_input(i, seq, numel) for i in range(5)]).sum(0)
        want = total if op == "sum" else total / 5
        for m in ids:
            out, contributors = results[m][seq]
            assert tuple(contributors) == tuple(ids) and torch.equal(out, want), (m, op)
