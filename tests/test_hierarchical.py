"""Hierarchical allreduce (resilient/collectives/algorithms/hierarchical.py): host groups
from the plan, weighted shard layout, and the data path with real Communicators over
real TCP transports on loopback (one thread per member, one static epoch: the control
plane and failures are tests/test_hierarchical_procs.py's). Results are checked exactly
(integer-valued float inputs), and the bytes each member sends across "hosts" are
checked against what the algorithm promises."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from resilient.collectives.algorithms.hierarchical import Layout, host_groups_of, shard_weights_of, weighted_split
from resilient.transport.tcp import TcpTransport

sys.path.insert(0, str(Path(__file__).resolve().parent))
from static_group import Info as _Info, StaticEpoch as _Epoch, member_input, run_allreduces  # noqa: E402

pytestmark = pytest.mark.timeout(90)


def _ep(ids, runs, roles=None, **plan):
    return _Epoch(1, tuple(ids), "tok", {}, roles=roles or {}, plan={"host_groups": runs, **plan})


# -- pure -------------------------------------------------------------------------------

def test_host_groups_follow_the_plans_runs_and_refuse_what_they_cannot_use():
    ids = ["a0", "a1", "b0", "b1"]
    assert host_groups_of(ids, _ep(ids, [[0, 2], [2, 2]])) == [["a0", "a1"], ["b0", "b1"]]
    # the op's members are a subset (one died): groups of unequal size -> flat ring
    assert host_groups_of(["a0", "b0", "b1"], _ep(ids, [[0, 2], [2, 2]])) is None
    assert host_groups_of(ids, _ep(ids, [[0, 4]])) is None                 # one host
    assert host_groups_of(ids, _ep(ids, [[0, 1], [1, 1], [2, 1], [3, 1]])) is None   # one member per host
    assert host_groups_of(ids, _ep(ids, [[0, 2], [2, 5]])) is None         # malformed run
    assert host_groups_of(ids, _ep(ids, [[0, 2], ["x", 2]])) is None
    assert host_groups_of(ids, _ep(ids, [[0, 2], [2, 2]], roles={"b1": "demoted"})) is None
    assert host_groups_of(ids, _Epoch(1, tuple(ids), "tok", {})) is None   # no plan


def test_shard_weights_are_used_only_when_well_formed():
    assert shard_weights_of(_ep([], [], shard_weights=[1, 2]), 2) == [1.0, 2.0]
    for bad in ([1], [1, 0], [1, "x"], "12", [1, float("inf")]):
        assert shard_weights_of(_ep([], [], shard_weights=bad), 2) is None


@pytest.mark.parametrize("n,w", [(10, [1, 2]), (7, [1, 1, 1]), (1000, [3, 1, 0.5]), (5, [1, 100])])
def test_weighted_split_covers_the_range_in_proportion(n, w):
    parts = weighted_split(n, w)
    assert parts[0][0] == 0 and parts[-1][1] == n and all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    for (s, e), x in zip(parts, w):
        assert abs((e - s) - n * x / sum(w)) <= 1.0


def test_layout_orders_pieces_shard_host_slice_and_refuses_empty_pieces():
    lay = Layout.make(100, 2, 2, 3, [1, 3])
    assert (lay.k, lay.H) == (2, 2) and len(lay.pieces) == 2 * 2 * lay.S
    assert lay.pieces[0][0] == 0 and lay.pieces[-1][1] == 100
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(lay.pieces, lay.pieces[1:]))
    assert lay.pieces[2 * lay.S - 1][1] == 25           # shard 0 is a quarter
    assert Layout.make(3, 2, 2, 1, None) is None        # a shard of 1 element cannot feed 2 hosts


# -- data path ---------------------------------------------------------------------------

def _run(hosts: int, k: int, numel: int, ops: list[str], weights=None, hierarchical=True):
    ids = [f"h{h}m{c}" for h in range(hosts) for c in range(k)]
    trs = {m: TcpTransport(m, "hierjob") for m in ids}
    plan = {"host_groups": [[h * k, k] for h in range(hosts)]}
    if weights:
        plan["shard_weights"] = weights
    ep = _Epoch(1, tuple(ids), "tok", {m: _Info(trs[m].address) for m in ids}, plan=plan)
    results = run_allreduces(ep, trs, ops, numel, close=trs.values(), small_bytes=1024, slice_bytes=8192,
                             hierarchical=hierarchical)
    host = {m: m.split("m")[0] for m in ids}
    cross = {m: sum(n for p, n in trs[m].stats.sent_by_peer.items() if host[p] != host[m]) for m in ids}
    return ids, results, cross


def _check(ids, results, ops, numel):
    for seq, op in enumerate(ops):
        xs = torch.stack([member_input(i, seq, numel).double() for i in range(len(ids))])
        exp = {"sum": xs.sum(0), "avg": xs.sum(0) / len(ids), "max": xs.max(0).values}[op]
        for m in ids:
            t, contrib = results[m][seq]
            assert contrib == tuple(ids), (m, seq, contrib)
            torch.testing.assert_close(t.double(), exp, rtol=0, atol=1e-3 if op == "avg" else 0)


@pytest.mark.parametrize("hosts,k,numel", [(2, 4, 40_003), (3, 2, 9_999), (2, 2, 64_000)])
def test_hierarchical_allreduce_is_exact_and_sends_one_kth_across_hosts(hosts, k, numel):
    ops = ["sum", "avg", "max"]
    ids, results, cross = _run(hosts, k, numel, ops)
    _check(ids, results, ops, numel)
    # every member carries its shard (1/k of the buffer) around a ring of `hosts`:
    # 2 (H-1)/H of the shard out across hosts per op
    per_op = 2 * (hosts - 1) / hosts * numel * 4 / k
    for m in ids:
        assert abs(cross[m] - len(ops) * per_op) <= len(ops) * 4 * hosts * 2, (m, cross[m], per_op)


def test_flat_ring_when_disabled_sends_everything_over_the_host_edges():
    ops = ["sum"]
    numel = 40_000
    ids, results, cross = _run(2, 4, numel, ops, hierarchical=False)
    _check(ids, results, ops, numel)
    edge = [m for m in ids if cross[m]]
    assert len(edge) == 2 and all(cross[m] == 2 * 7 * numel * 4 // 8 for m in edge), cross


def test_weighted_shards_are_exact_and_follow_the_weights():
    ops = ["sum", "max"]
    numel = 30_000
    ids, results, cross = _run(2, 2, numel, ops, weights=[1, 2])
    _check(ids, results, ops, numel)
    # local index 1 carries twice local index 0's bytes across hosts
    assert cross["h0m1"] == pytest.approx(2 * cross["h0m0"], rel=1e-3)


def _run_per_member(kind: str, hosts: int, k: int, m: int, hierarchical: bool = True):
    """Every member runs one reduce_scatter or allgather (chunks of ``m``) over a static
    epoch with ``hosts`` x ``k`` host groups; returns outputs and cross-host bytes sent."""
    import threading

    from resilient.collectives.communicator import Communicator
    from static_group import StaticView, run_members

    ids = [f"h{h}m{c}" for h in range(hosts) for c in range(k)]
    n = len(ids)
    trs = {x: TcpTransport(x, "hierjob") for x in ids}
    ep = _Epoch(1, tuple(ids), "tok", {x: _Info(trs[x].address) for x in ids},
                plan={"host_groups": [[h * k, k] for h in range(hosts)]})
    blobs: dict = {"lock": threading.Condition()}
    outs: dict = {}
    comms: dict = {}

    def member(x: str) -> None:
        i = ids.index(x)
        c = Communicator(StaticView(x, ep, blobs), trs[x], op_timeout=20, slice_bytes=4096, hierarchical=hierarchical)
        comms[x] = c
        if kind == "reduce_scatter":
            out = torch.empty(m)
            c.reduce_scatter(out, [member_input(i, 100 + j, m) for j in range(n)])
            outs[x] = out
        else:
            res = [torch.empty(m) for _ in range(n)]
            c.allgather(res, member_input(i, 7, m))
            outs[x] = res

    try:
        run_members(member, ids, 60)
    finally:
        for c in comms.values():
            c.close()
        for t in trs.values():
            t.close()
    host = {x: x.split("m")[0] for x in ids}
    cross = {x: sum(b for p, b in trs[x].stats.sent_by_peer.items() if host[p] != host[x]) for x in ids}
    return ids, outs, cross


@pytest.mark.parametrize("hosts,k,m", [(2, 3, 5_001), (3, 2, 2_000)])
def test_hierarchical_reduce_scatter_is_exact_and_sends_less_across_hosts(hosts, k, m):
    ids, outs, cross = _run_per_member("reduce_scatter", hosts, k, m)
    n = len(ids)
    for j, x in enumerate(ids):
        exp = sum(member_input(i, 100 + j, m).double() for i in range(n))
        torch.testing.assert_close(outs[x].double(), exp, rtol=0, atol=0)
    # each member sends (H-1)/H of its H chunks of index c across hosts: (H-1) chunks
    assert all(cross[x] == (hosts - 1) * m * 4 for x in ids), cross


@pytest.mark.parametrize("hosts,k,m", [(2, 3, 5_001), (3, 2, 2_000)])
def test_hierarchical_allgather_is_exact_and_sends_less_across_hosts(hosts, k, m):
    ids, outs, cross = _run_per_member("allgather", hosts, k, m)
    for x in ids:
        for i in range(len(ids)):
            torch.testing.assert_close(outs[x][i], member_input(i, 7, m), rtol=0, atol=0)
    assert all(cross[x] == (hosts - 1) * m * 4 for x in ids), cross
