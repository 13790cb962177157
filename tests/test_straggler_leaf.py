"""The leaf path (resilient/collectives/algorithms/leaf.py): demoted members send their
input to their tree parent and get the result back, the ring runs over the active members.

Pure parts (assignment, orders) are tested directly; the data path runs real
Communicators over real TCP transports on loopback, one thread per member, with an
in-memory group view holding one static epoch (the control plane is not under test
here: tests/test_straggler_procs.py runs the whole thing with real processes and etcd).
Results are checked exactly (integer-valued float inputs)."""
from __future__ import annotations


import pytest
import torch

from resilient.collectives.algorithms.leaf import LeafPath, items_of, leaf_assignment
from resilient.transport.tcp import TcpTransport

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from static_group import Info as _Info, StaticEpoch as _Epoch, member_input, run_allreduces, run_members  # noqa: E402

pytestmark = pytest.mark.timeout(90)


# -- pure -------------------------------------------------------------------------------

def test_assignment_uses_the_plans_tree_parent_and_falls_back_deterministically():
    ring = ["a", "b", "c", "d", "e"]
    roles = {"d": "demoted", "e": "demoted"}
    assert leaf_assignment(ring, ring, roles, [-1, 0, 0, 0, 1]) == {"d": "a", "e": "b"}
    # e's planned parent b is not in the op (died): first fallback active by index
    assert leaf_assignment(["a", "c", "d", "e"], ring, roles, [-1, 0, 0, 0, 1]) == {"d": "a", "e": "c"}
    # a planned parent that is itself demoted is refused
    assert leaf_assignment(ring, ring, roles, [-1, 0, 0, 4, 1]) == {"d": "a", "e": "b"}
    # no leaf, or nobody active: no leaf path
    assert leaf_assignment(ring, ring, {}, [-1, 0, 0, 1, 1]) == {}
    assert leaf_assignment(["d", "e"], ring, roles, [-1, 0, 0, 0, 1]) == {}
    # malformed plan: still a valid map
    assert leaf_assignment(ring, ring, roles, ["x"]) == {"d": "a", "e": "b"}


def test_items_cut_every_piece_into_sub_slices_covering_it_exactly():
    pieces = [(0, 10), (10, 11), (11, 40)]
    its = items_of(pieces, 4, 16)            # 4 elements per sub-slice
    assert [(q, a, b) for q, a, b in its if q == 1] == [(1, 10, 11)]
    for q, (s, e) in enumerate(pieces):
        mine = [(a, b) for p, a, b in its if p == q]
        assert mine[0][0] == s and mine[-1][1] == e
        assert all(x[1] == y[0] for x, y in zip(mine, mine[1:]))
        assert all(0 < b - a <= 4 for a, b in mine)


# -- data path ---------------------------------------------------------------------------

_inp = member_input


def _run(world: int, demoted: set[str], tree_parent: list[int], numel: int, ops: list[str],
         small_bytes: int = 64 << 10, slice_bytes: int = 1 << 20):
    ids = [f"m{i}" for i in range(world)]
    trs = {m: TcpTransport(m, "leafjob") for m in ids}
    ep = _Epoch(1, tuple(ids), "tok", {m: _Info(trs[m].address) for m in ids},
                roles={m: ("demoted" if m in demoted else "active") for m in ids},
                plan={"tree_parent": tree_parent})
    results = run_allreduces(ep, trs, ops, numel, close=trs.values(), small_bytes=small_bytes,
                             slice_bytes=slice_bytes)
    sent = {m: {p: n for p, n in trs[m].stats.sent_by_peer.items() if n} for m in ids}
    return ids, results, sent


@pytest.mark.parametrize("numel,slice_bytes", [(10_001, 4096), (257, 1 << 20), (3, 1 << 20)])
def test_leaf_results_are_exact_and_include_the_leaf(numel, slice_bytes):
    # m4 demoted under m0 (ring over m0..m3), m3 demoted under m1: two leaves, two parents
    ops = ["sum", "avg", "max"]
    ids, results, sent = _run(5, {"m3", "m4"}, [-1, 0, 0, 1, 0], numel, ops, small_bytes=1024,
                              slice_bytes=slice_bytes)
    # the leaves talk to their parents only, exactly their input once per op
    assert sent["m4"] == {"m0": 4 * numel * len(ops)} and sent["m3"] == {"m1": 4 * numel * len(ops)}
    assert sent["m2"].keys() <= {"m0", "m1"}
    for seq, op in enumerate(ops):
        stack = torch.stack([_inp(i, seq, numel) for i in range(5)])
        want = {"sum": stack.sum(0), "avg": stack.sum(0) / 5, "max": stack.max(0).values}[op]
        for m in ids:
            out, contributors = results[m][seq]
            assert tuple(contributors) == tuple(ids), (m, contributors)
            assert torch.equal(out, want), (m, op, (out - want).abs().max())


def test_one_active_member_serves_every_leaf():
    ids, results, _ = _run(3, {"m1", "m2"}, [-1, 0, 0], 5000, ["sum"], small_bytes=1024, slice_bytes=2048)
    want = torch.stack([_inp(i, 0, 5000) for i in range(3)]).sum(0)
    for m in ids:
        assert torch.equal(results[m][0][0], want)
        assert tuple(results[m][0][1]) == tuple(ids)


def test_for_epoch_builds_the_ring_over_active_members_only():
    ep = _Epoch(3, ("a", "b", "c", "d"), "t", {}, roles={"d": "demoted"}, plan={"tree_parent": [-1, 0, 0, 1]})
    lp = LeafPath.for_epoch(["a", "b", "c", "d"], ep)
    assert lp is not None and lp.ring_size == 3 and lp.leaves == {"d": "b"}
    assert LeafPath.for_epoch(["a", "b", "c"], ep) is None


@pytest.mark.parametrize("numel", [6000, 2])
def test_two_active_members_chain_after_the_ring(numel):
    # 2 actives: the ring uses both directions of their link, so the leaves' data follows it
    ids, results, sent = _run(4, {"m2", "m3"}, [-1, 0, 0, 1], numel, ["sum", "min"], small_bytes=1024,
                              slice_bytes=4096)
    for seq, op in enumerate(["sum", "min"]):
        stack = torch.stack([_inp(i, seq, numel) for i in range(4)])
        want = stack.sum(0) if op == "sum" else stack.min(0).values
        for m in ids:
            assert torch.equal(results[m][seq][0], want) and tuple(results[m][seq][1]) == tuple(ids)
    assert sent["m2"].keys() == {"m0"} and sent["m3"].keys() == {"m1"}


class _AbortAfter:
    """Delegates to a real transport; the ``k``-th send of this member aborts every
    member's transport (as an epoch that removes someone does)."""

    def __init__(self, inner, k: int, everyone: list) -> None:
        self.inner, self.k, self.everyone, self.n = inner, k, everyone, 0

    def isend(self, *a, **kw):
        self.n += 1
        if self.n == self.k:
            for t in self.everyone:
                t.abort("test: member lost")
        return self.inner.isend(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("who,k", [("m4", 3), ("m4", 25), ("m0", 5), ("m0", 30), ("m1", 12), ("m2", 20)])
def test_masks_describe_out_exactly_whenever_the_op_is_aborted(who, k):
    """Abort the leaf-path allreduce at many points (a leaf's, a parent's, a plain active's
    k-th send): on every member, every piece whose mask is non-zero holds exactly the sum
    of the inputs of the members in the mask — what the recovery planner relies on."""
    from resilient.collectives.algorithms.base import OpContext
    from resilient.collectives.ledger import Ledger, split
    from resilient.errors import TransportAborted, TransportError
    from resilient.kernels import ReduceOp

    ids = [f"m{i}" for i in range(5)]
    leaves = {"m3": "m1", "m4": "m0"}
    actives = ["m0", "m1", "m2"]
    numel, S = 200_000, 2
    trs = {m: TcpTransport(m, "leafabort") for m in ids}
    addrs = {m: trs[m].address for m in ids}
    for t in trs.values():
        t.configure(1, "tok", addrs)
    tr = dict(trs)
    tr[who] = _AbortAfter(trs[who], k, list(trs.values()))
    pieces = [(s0 + a, s0 + b) for (s0, e0) in split(numel, 3) for (a, b) in split(e0 - s0, S)]
    inputs = {m: _inp(i, 0, numel) for i, m in enumerate(ids)}
    ledgers: dict = {}
    errors: list = []

    def member(m: str) -> None:
        L = Ledger(0, "allreduce", tuple(ids), ids.index(m), 1, 7, inputs[m].clone(), torch.zeros(numel), pieces)
        ledgers[m] = L
        ctx = OpContext(tr[m], L, ReduceOp.SUM, 20, lambda *a: None, 1)
        algo = LeafPath(__import__("resilient.collectives.algorithms.ring", fromlist=["x"]).RingReduceScatterAllgather(S),
                        leaves, actives)
        try:
            algo.run(ctx)
        except (TransportError, TransportAborted):  # as the communicator's op loop
            ctx.settle()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    try:
        run_members(member, ids, 30, "a member hung after the abort")
    finally:
        for t in trs.values():
            t.close()
    assert not errors, errors
    nonzero = 0
    for m, L in ledgers.items():
        for q, mask in enumerate(L.masks):
            if mask:
                nonzero += 1
                s, e = pieces[q]
                want = sum(inputs[ids[b]][s:e] for b in range(5) if mask >> b & 1)
                assert torch.equal(L.out[s:e], want), (m, q, bin(mask))
    assert tr[who].n >= k   # the abort really happened at the k-th send
