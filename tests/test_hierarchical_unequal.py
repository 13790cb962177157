"""Hierarchical allreduce over hosts of unequal size (issue 16): the plan's ``host_slots``
is checked once when the epoch is parsed (a bad one is a RecordError), the op's groups
and slots follow it, the layout cuts ``K`` shards, and the data path (real Communicators
over real TCP transports on loopback, one thread per member, one static epoch) is exact
and sends each slot's shard across hosts on its owners' ring. Failures at each level
with real processes are in tests/test_hierarchical_procs.py (its last test)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from resilient.collectives.algorithms import select
from resilient.collectives.algorithms.hierarchical import HierarchicalAllreduce, Layout, host_groups_of, hosts_of
from resilient.coordinator.epoch import Epoch, EpochPlan
from resilient.coordinator.host_slots import host_slots, slot_weights, slots_problem
from resilient.errors import RecordError
from resilient.transport.tcp import TcpTransport

sys.path.insert(0, str(Path(__file__).resolve().parent))
from static_group import Info as _Info, StaticEpoch as _Epoch, member_input, run_allreduces  # noqa: E402

pytestmark = pytest.mark.timeout(90)

IDS = ["a0", "a1", "a2", "b0", "b1"]          # 3 + 2
RUNS = [[0, 3], [3, 2]]
SLOTS = [[0, 1, 2], [0, 1, 0]]                 # host_slots([3, 2 members])


def _ep(ids=IDS, runs=RUNS, roles=None, **plan):
    return _Epoch(1, tuple(ids), "tok", {}, roles=roles or {}, plan={"host_groups": runs, **plan})


# -- the plan: host_slots checked once ----------------------------------------------------

def test_planner_slots_pass_the_check_and_bad_ones_name_what_is_wrong():
    assert host_slots([IDS[:3], IDS[3:]]) == SLOTS
    assert slots_problem(SLOTS, [3, 2]) is None
    assert slots_problem([[0, 1, 2, 3], [0, 1, 2, 0]], [4, 3]) is None
    bad = {
        "one list per": ([[0, 1, 2]], [3, 2]),                     # a run without its list
        "same length": ([[0, 1, 2], [0, 1]], [3, 2]),              # lists of different K
        "outside [0, 2)": ([[0, 1, 2], [0, 2, 1]], [3, 2]),        # an index host 1 does not have
        "without a slot": ([[0, 1, 2], [0, 0, 0]], [3, 2]),        # local index 1 of host 1 owns nothing
        "not in [1,": ([[], []], [3, 2]),
    }
    for want, (slots, counts) in bad.items():
        problem = slots_problem(slots, counts)
        assert problem is not None and want in problem, (slots, problem)
    assert "outside" in (slots_problem([[0, 1, True], [0, 1, 0]], [3, 2]) or "")   # a bool is no index


def _record(plan: dict) -> bytes:
    return json.dumps({"number": 3, "members": IDS, "plan": plan}).encode()


def test_epoch_parse_types_host_slots_and_rejects_a_bad_table():
    ep = Epoch.from_json(_record({"host_groups": RUNS, "host_slots": SLOTS}), "epoch")
    assert ep.plan.host_slots == ((0, 1, 2), (0, 1, 0))
    assert Epoch.from_json(_record({"host_groups": RUNS}), "epoch").plan.host_slots is None
    for bad in ([[0, 1, 2], [0, 1, 2]], [[0, 1, 2]], "x", [[0, 1, 2], [0, "1", 0]]):
        with pytest.raises(RecordError, match="host_slots"):
            Epoch.from_json(_record({"host_groups": RUNS, "host_slots": bad}), "epoch")
    # a plan made in process reads a bad table as absent (the flat ring), never half of it
    assert EpochPlan.of({"host_groups": RUNS, "host_slots": [[0, 1, 2], [0, 1, 2]]}).host_slots is None


# -- the op's hosts and layout ----------------------------------------------------------------

def test_unequal_hosts_are_used_only_with_slots_for_exactly_those_hosts():
    hosts = hosts_of(IDS, _ep(host_slots=SLOTS))
    assert hosts is not None and hosts.groups == [IDS[:3], IDS[3:]] and hosts.K == 3
    assert [hosts.owned(1, j) for j in range(2)] == [[0, 2], [1]]
    assert [hosts.ring(c) for c in range(3)] == [["a0", "b0"], ["a1", "b1"], ["a2", "b0"]]
    assert host_groups_of(IDS, _ep(host_slots=SLOTS)) == [IDS[:3], IDS[3:]]
    assert hosts_of(IDS, _ep()) is None                                  # no slots: flat ring
    # a member of the op gone since the plan (a1): its host is no longer the planned run
    assert hosts_of(["a0", "a2", "b0", "b1"], _ep(host_slots=SLOTS)).slots == [[0, 1], [0, 1]]  # now equal
    assert hosts_of(["a0", "a1", "a2", "b0"], _ep(host_slots=SLOTS)) is None                # 3 + 1 unplanned
    assert hosts_of(IDS, _ep(host_slots=SLOTS, roles={"b1": "demoted"})) is None
    # 2 + 1: a host of one member owns every slot
    two_one = hosts_of(["a0", "a1", "b0"], _ep(["a0", "a1", "b0"], [[0, 2], [2, 1]], host_slots=[[0, 1], [0, 0]]))
    assert two_one is not None and two_one.owned(1, 0) == [0, 1]


def test_select_cuts_k_shards_by_the_slot_weights():
    ep = _ep(host_slots=SLOTS, shard_weights=[0.25, 0.25, 0.5])
    pieces, algo = select.allreduce(IDS, ep, 12_000, 4, select.Sizing(small_bytes=1024))
    assert isinstance(algo, HierarchicalAllreduce) and algo.layout.k == 3 and algo.layout.H == 2
    lay = Layout.make(12_000, 3, 2, algo.layout.S, [0.25, 0.25, 0.5])
    assert lay is not None and pieces == lay.pieces
    HS = 2 * lay.S
    assert pieces[2 * HS][0] == 6_000 and pieces[-1][1] == 12_000      # shard 2 is half the buffer
    # reduce_scatter / allgather keep requiring equal hosts (chunks are the members' outputs)
    assert type(select.per_member("allgather", IDS, ep, 5, 100, 4, select.Sizing()).algorithm).__name__ == \
        "RingReduceScatterAllgather"


# -- data path ---------------------------------------------------------------------------

def _run(sizes: list[int], numel: int, ops: list[str], weights=None):
    ids = [f"h{h}m{c}" for h, k in enumerate(sizes) for c in range(k)]
    groups = [[f"h{h}m{c}" for c in range(k)] for h, k in enumerate(sizes)]
    starts = [sum(sizes[:h]) for h in range(len(sizes))]
    plan = {"host_groups": [[s, k] for s, k in zip(starts, sizes)], "host_slots": host_slots(groups)}
    if weights:
        plan["shard_weights"] = weights
    trs = {m: TcpTransport(m, "hierjob") for m in ids}
    ep = _Epoch(1, tuple(ids), "tok", {m: _Info(trs[m].address) for m in ids}, plan=plan)
    assert ep.plan.host_slots is not None
    results = run_allreduces(ep, trs, ops, numel, close=trs.values(), small_bytes=1024, slice_bytes=8192)
    host = {m: m.split("m")[0] for m in ids}
    cross = {m: sum(n for p, n in trs[m].stats.sent_by_peer.items() if host[p] != host[m]) for m in ids}
    return ids, ep, results, cross


def _check(ids, results, ops, numel):
    for seq, op in enumerate(ops):
        xs = torch.stack([member_input(i, seq, numel).double() for i in range(len(ids))])
        exp = {"sum": xs.sum(0), "max": xs.max(0).values}[op]
        for m in ids:
            t, contrib = results[m][seq]
            assert contrib == tuple(ids), (m, seq, contrib)
            torch.testing.assert_close(t.double(), exp, rtol=0, atol=0)


@pytest.mark.parametrize("sizes,numel", [([3, 2], 30_001), ([4, 3], 40_003), ([2, 1], 9_999), ([2, 3, 2], 12_000)])
def test_unequal_hosts_allreduce_is_exact_and_each_slot_crosses_on_its_owners_ring(sizes, numel):
    ops = ["sum", "max"]
    ids, ep, results, cross = _run(sizes, numel, ops)
    _check(ids, results, ops, numel)
    hosts = hosts_of(ids, ep)
    assert hosts is not None
    _, algo = select.allreduce(ids, ep, numel, 4, select.Sizing(small_bytes=1024, slice_bytes=8192))
    assert isinstance(algo, HierarchicalAllreduce)
    lay = algo.layout
    H = len(sizes)
    for h, g in enumerate(hosts.groups):
        for j, m in enumerate(g):
            # per owned slot c: 2 (H-1)/H of shard c out across hosts (the ring's sub-shards)
            shard_elems = [lay.pieces[(c + 1) * H * lay.S - 1][1] - lay.pieces[c * H * lay.S][0]
                           for c in hosts.owned(h, j)]
            per_op = sum(2 * (H - 1) / H * e * 4 for e in shard_elems)
            assert abs(cross[m] - len(ops) * per_op) <= len(ops) * 4 * H * 2 * len(shard_elems), (m, cross[m], per_op)


def test_unequal_hosts_with_slot_weights_follow_them():
    ops = ["sum"]
    numel = 24_000
    groups = [["h0m0", "h0m1", "h0m2"], ["h1m0", "h1m1"]]
    weights = slot_weights(groups, SLOTS, dict.fromkeys(groups[0] + groups[1], 1.0))   # the planner's, equal links
    assert weights == [0.25, 0.5, 0.25]
    ids, _, results, cross = _run([3, 2], numel, ops, weights=weights)
    _check(ids, results, ops, numel)
    # h1m0 owns slots 0 and 2 (a quarter each), h1m1 slot 1 (a half): equal bytes across hosts
    assert cross["h1m0"] == pytest.approx(cross["h1m1"], rel=1e-3)
    assert cross["h0m1"] == pytest.approx(2 * cross["h0m0"], rel=1e-3)
