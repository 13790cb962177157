"""Unit tests of the torch backend's translation logic (process group -> engine), on the
in-process thread engine (pure logic: no sockets; the multi-process tests are in
test_torch_backend_procs.py)."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

import resilient  # noqa: F401 - registers the backend
from resilient.errors import ConfigError, RemovedFromGroup
from resilient.torch_backend import set_engine_factory
from resilient.torch_backend.inproc import InProcWorld
from resilient.torch_backend.process_group import ResilientProcessGroup, UnsupportedOperation
from resilient.live_world import World

MEMBERS = ["m0", "m1", "m2", "m3"]


def run_ranks(fn, n=4, world=None):
    """Run fn(rank, pg) on n threads over one InProcWorld; returns results by rank."""
    w = world or InProcWorld(MEMBERS[:n])
    pgs = [ResilientProcessGroup(w.engine(m), i, n) for i, m in enumerate(MEMBERS[:n])]
    out: dict[int, object] = {}
    errors: list[BaseException] = []

    def body(i):
        try:
            out[i] = fn(i, pgs[i])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a rank thread hung"
    if errors:
        raise errors[0]
    return out


def ar_opts(op):
    o = dist.AllreduceOptions()
    o.reduceOp = op
    return o


@pytest.mark.parametrize("op,expect", [(dist.ReduceOp.SUM, 10.0), (dist.ReduceOp.AVG, 2.5), (dist.ReduceOp.MIN, 1.0),
                                       (dist.ReduceOp.MAX, 4.0), (dist.ReduceOp.PRODUCT, 24.0)])
def test_allreduce_ops(op, expect):
    def fn(i, pg):
        t = torch.full((5,), float(i + 1))
        w = pg.allreduce([t], ar_opts(op))
        w.wait()
        return t, w.contributors

    res = run_ranks(fn)
    for t, contrib in res.values():
        assert torch.equal(t, torch.full((5,), expect))
        assert contrib == tuple(MEMBERS)


def test_broadcast_allgather_reduce_scatter_barrier():
    def fn(i, pg):
        b = torch.full((3,), float(i))
        bo = dist.BroadcastOptions()
        bo.rootRank = 2
        pg.broadcast([b], bo).wait()
        outs = [torch.zeros(2) for _ in range(4)]
        pg.allgather([outs], [torch.full((2,), float(i))]).wait()
        single = torch.zeros(8)
        pg.all_gather_single(single, torch.full((2,), float(i))).wait()
        rs_out = torch.zeros(2)
        pg.reduce_scatter_single(rs_out, torch.arange(8, dtype=torch.float32) + i, dist.ReduceScatterOptions()).wait()
        pg.barrier().wait()
        return b, outs, single, rs_out

    res = run_ranks(fn)
    for i, (b, outs, single, rs_out) in res.items():
        assert torch.equal(b, torch.full((3,), 2.0))
        assert [o[0].item() for o in outs] == [0.0, 1.0, 2.0, 3.0]
        assert torch.equal(single, torch.tensor([0., 0, 1, 1, 2, 2, 3, 3]))
        # rank i gets chunk i of the sum over ranks of (arange(8) + r): 4 * arange + 6
        assert torch.equal(rs_out, 4 * torch.arange(2 * i, 2 * i + 2, dtype=torch.float32) + 6)


def test_send_recv():
    def fn(i, pg):
        if i == 0:
            pg.send([torch.tensor([7.0, 8.0])], 3, 5).wait()
        if i == 3:
            t = torch.zeros(2)
            pg.recv([t], 0, 5).wait()
            return t
        return None

    assert torch.equal(run_ranks(fn)[3], torch.tensor([7.0, 8.0]))


def test_async_work_future_and_contributors_after_member_death():
    w = InProcWorld(MEMBERS)
    victim_ready = threading.Event()

    def fn(i, pg):
        if i == 3:  # never deposits: dies while the op is in flight
            victim_ready.set()
            return None
        t = torch.full((4,), float(i + 1))
        work = pg.allreduce([t], ar_opts(dist.ReduceOp.AVG))
        if i == 0:
            victim_ready.wait(10)
            w.kill("m3")
        fut = work.get_future()
        fut.wait()
        return t, work.contributors, work.is_completed()

    res = run_ranks(fn, world=w)
    for i in range(3):
        t, contrib, done = res[i]
        assert contrib == ("m0", "m1", "m2") and done
        assert torch.equal(t, torch.full((4,), 2.0))  # (1+2+3)/3: the mean over the contributors


@pytest.mark.parametrize("call,name", [
    (lambda pg, t: pg.allreduce([t], ar_opts(dist.ReduceOp.BAND)), "BAND on torch.float32"),
    (lambda pg, t: pg.allreduce([t.to(torch.complex64)], ar_opts(dist.ReduceOp.MAX)), "MAX on torch.complex64"),
    (lambda pg, t: pg.allreduce([t.bool()], ar_opts(dist.ReduceOp.AVG)), "AVG on torch.bool"),
    (lambda pg, t: pg.allreduce([t, t], ar_opts(dist.ReduceOp.SUM)), "2 tensors"),
    (lambda pg, t: pg.allreduce([t.to("meta")], ar_opts(dist.ReduceOp.SUM)), "meta tensor"),
])
def test_unsupported_ops_name_the_op(call, name):
    pg = ResilientProcessGroup(InProcWorld(["m0"]).engine("m0"), 0, 1)
    with pytest.raises(UnsupportedOperation, match=name) as info:
        call(pg, torch.zeros(2))
    assert "resilient" in str(info.value)


def test_rank_and_size_are_live_after_membership_changes():
    w = InProcWorld(MEMBERS)
    pg2 = ResilientProcessGroup(w.engine("m2"), 2, 4)
    assert (pg2.rank(), pg2.size()) == (2, 4)
    w.kill("m1")
    assert (pg2.rank(), pg2.size()) == (1, 3)  # moved down by one, world shrank
    w.join("m9", at_seq=0)
    assert (pg2.rank(), pg2.size()) == (1, 4)
    w.kill("m2")
    with pytest.raises(RemovedFromGroup, match="m2"):
        pg2.rank()


def test_world_from_members():
    v = World.from_members("b", 7, ["a", "b", "c"])
    assert (v.rank, v.size, v.epoch, v.rank_of("c")) == (1, 3, 7, 2)
    with pytest.raises(RemovedFromGroup):
        World.from_members("z", 7, ["a"])


def test_init_process_group_registers_and_dist_api_reports_live_world():
    """``dist.init_process_group("resilient")`` after ``import resilient``: the dist API
    dispatches to our group, and get_rank/get_world_size follow membership changes."""
    from resilient.live_world import world

    w = InProcWorld(["solo"])
    set_engine_factory(lambda **kw: w.engine("solo"))
    try:
        dist.init_process_group("resilient", store=dist.HashStore(), rank=0, world_size=1)
        assert dist.get_backend() == "resilient"
        t = torch.tensor([3.0])
        dist.all_reduce(t)
        assert t.item() == 3.0
        work = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)
        work.wait()
        assert work.contributors == ("solo",)
        out = torch.zeros(1)
        dist.all_gather_into_tensor(out, torch.tensor([5.0]))
        assert out.item() == 5.0
        got = torch.zeros(1)
        dist.all_to_all_single(got, torch.tensor([7.0]))
        assert got.item() == 7.0
        w.join("other", at_seq=10**6)  # admitted: the live world grows at once
        assert (dist.get_rank(), dist.get_world_size()) == (0, 2)
        assert world().members == ("solo", "other") and world().epoch == 2
    finally:
        set_engine_factory(None)
        if dist.is_initialized():
            dist.destroy_process_group()
        from resilient import live_world as world_mod

        world_mod.install(None)
    with pytest.raises(ConfigError, match="init_process_group"):
        world()


ALL_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_every_dtype_copies_and_reductions_over_threads(dtype):
    """Byte-packed copies are exact for every dtype; reductions follow torch/gloo semantics
    (narrow ints wrap, bool SUM = OR / PRODUCT = AND, bitwise ops bit by bit)."""
    def val(i):
        x = torch.tensor([1, 2, 100, 127]) + i
        return (x % 2 == 0) if dtype == torch.bool else x.to(dtype)

    def fn(i, pg):
        b = val(i)
        pg.broadcast([b], None).wait()
        outs = [torch.empty(4, dtype=dtype) for _ in range(3)]
        pg.allgather([outs], [val(i)]).wait()
        s = val(i)
        pg.allreduce([s], ar_opts(dist.ReduceOp.SUM)).wait()
        bits = val(i)
        if not (dtype.is_floating_point or dtype.is_complex):
            pg.allreduce([bits], ar_opts(dist.ReduceOp.BXOR)).wait()
        return b, outs, s, bits

    res = run_ranks(fn, n=3)
    wide = torch.stack([val(i).to(torch.complex128 if dtype.is_complex else torch.float64
                                  if dtype.is_floating_point else torch.int64) for i in range(3)])
    for i in range(3):
        b, outs, s, bits = res[i]
        assert torch.equal(b, val(0))
        assert all(torch.equal(o, val(r)) for r, o in enumerate(outs))
        if dtype == torch.bool:
            assert torch.equal(s, wide.max(0).values != 0)  # logical OR
        else:
            assert torch.equal(s, wide.sum(0).to(dtype))  # int8 127*3 wraps like int8 arithmetic
        if not (dtype.is_floating_point or dtype.is_complex):
            want = wide[0] ^ wide[1] ^ wide[2]
            assert torch.equal(bits, (want != 0) if dtype == torch.bool else want.to(dtype))


def test_composed_ops_over_threads():
    """reduce/gather/scatter/all_to_all(uneven)/coalesced composed from the engine's ops."""
    def fn(i, pg):
        r = torch.full((2,), float(i + 1))
        o = dist.ReduceOptions(); o.rootRank = 1; o.reduceOp = dist.ReduceOp.SUM
        pg.reduce([r], o).wait()
        g = [torch.empty(2, dtype=torch.int8) for _ in range(3)] if i == 0 else []
        go = dist.GatherOptions(); go.rootRank = 0
        pg.gather([g] if i == 0 else [], [torch.full((2,), i, dtype=torch.int8)], go).wait()
        sc = torch.empty(2, dtype=torch.int16)
        so = dist.ScatterOptions(); so.rootRank = 2
        ins = [[torch.full((2,), 10 * k, dtype=torch.int16) for k in range(3)]] if i == 2 else []
        pg.scatter([sc], ins, so).wait()
        a2a_out = torch.empty(sum(j + i + 1 for j in range(3)))
        a2a_in = torch.cat([torch.full((i + k + 1,), float(10 * i + k)) for k in range(3)])
        pg.alltoall_base(a2a_out, a2a_in, [j + i + 1 for j in range(3)], [i + k + 1 for k in range(3)],
                         dist.AllToAllOptions()).wait()
        own = torch.empty(2)
        w_recv = pg.recv([own], i, 5)  # a receive from oneself posted before the send
        pg.send([torch.full((2,), float(i))], i, 5).wait()
        w_recv.wait()
        assert own.tolist() == [float(i)] * 2
        co = [torch.ones(3), torch.ones(2, dtype=torch.int64)]
        pg.allreduce_coalesced(co, dist.AllreduceCoalescedOptions()).wait()
        return r, g, sc, a2a_out, co

    res = run_ranks(fn, n=3)
    assert torch.equal(res[1][0], torch.full((2,), 6.0)) and torch.equal(res[0][0], torch.full((2,), 1.0))
    assert [t.tolist() for t in res[0][1]] == [[0, 0], [1, 1], [2, 2]]
    for i in range(3):
        _, _, sc, a2a, co = res[i]
        assert sc.tolist() == [10 * i] * 2
        assert a2a.tolist() == [float(10 * j + i) for j in range(3) for _ in range(j + i + 1)]
        assert co[0].tolist() == [3.0] * 3 and co[1].tolist() == [3, 3]


def test_engine_of_reaches_a_resilient_groups_engine_and_only_that():
    from resilient.torch_backend import engine_of

    eng = InProcWorld(["m0"]).engine("m0")
    pg = ResilientProcessGroup(eng, 0, 1)
    assert engine_of(pg) is eng
    assert engine_of(None) is None and engine_of(object()) is None
    assert engine_of(dist.ProcessGroup(0, 1)) is None  # a plain (C++) group of another backend
    with pytest.raises(RuntimeError, match="name not set"):  # torch's own answer before it names the group
        pg.group_name
    pg._set_group_name("g7")
    assert pg.group_name == "g7"


def test_in_process_engine_admits_joiners_itself_and_the_op_log_forwards_the_elastic_calls(tmp_path):
    from resilient.torch_backend.op_log import OpLogEngine

    eng = InProcWorld(["m0"]).engine("m0")
    assert (eng.admits_by_rebuild, eng.admitted, eng.comm, eng.pending_joiners(), eng.job_done()) == \
        (False, True, None, False, False)
    eng.mark_done()  # nothing to record: its world takes no late joiners
    for call in (lambda e: e.rebuild(1), lambda e: e.announce_ready(), lambda e: e.wait_admitted()):
        with pytest.raises(UnsupportedOperation, match="in-process engine"):
            call(eng)
    logged = OpLogEngine(eng, str(tmp_path / "ops.jsonl"))
    try:
        assert (logged.member_id, logged.admits_by_rebuild, logged.admitted, logged.comm) == ("m0", False, True, None)
        assert (logged.pending_joiners(), logged.job_done()) == (False, False)
        with pytest.raises(UnsupportedOperation, match="rebuild"):
            logged.rebuild(1)
    finally:
        logged.close()
