"""The leaf path's deadline mode (resilient/collectives/algorithms/leaf_deadline.py,
``--straggler-policy deadline``): a leaf whose input is complete when its parent decides is
included exactly as in the lossless path; one whose input is not is left out of that op,
and every member — the leaf too — reports ``contributors`` without it.

"Late" and "on time" are made deterministic, never by timing luck:

* a *late* leaf (:class:`_LateLeaf`) posts no input frame of op ``k`` until its parent
  has sent its decision for op ``k`` (seen by :class:`_Watch` on the parent's transport),
  with a deadline of 0 ms: the parent cannot have its input;
* an *on-time* leaf's parent (:class:`_Watch` with ``hold_for``) does not progress its
  own transport until that leaf's whole input of the op has arrived, so its ring (and
  with it the deadline) ends after the input is in — even with a deadline of 0 ms.

Data path: real Communicators over real TCP transports on loopback, one thread per
member, an in-memory group view with one static epoch (tests/test_straggler_leaf.py's
harness; the control plane is tested in test_straggler_procs.py with real processes).
Inputs are integer-valued floats, so every result is compared exactly."""
from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from resilient.collectives.algorithms.base import OpContext
from resilient.collectives.algorithms.leaf import LeafPath, deadline_of
from resilient.collectives.algorithms.leaf_deadline import SPACE, T_DECISION, T_INPUT
from resilient.collectives.algorithms.recursive_doubling import RecursiveDoubling
from resilient.collectives.algorithms.ring import RingReduceScatterAllgather
from resilient.collectives.ledger import Ledger, split
from resilient.errors import TransportAborted, TransportError
from resilient.kernels import ReduceOp
from resilient.transport.tcp import TcpTransport

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from static_group import Info as _Info, StaticEpoch as _Epoch, member_input, run_allreduces, run_members  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _step(tg: int) -> int:
    return (tg >> 28) & ((1 << 28) - 1) if (tg >> 56) == SPACE else -1


# -- pure -------------------------------------------------------------------------------

def test_the_plan_value_is_read_strictly():
    assert deadline_of({"leaf_deadline_ms": 10}) == 0.01
    assert deadline_of({"leaf_deadline_ms": 0}) == 0.0
    for bad in ({}, {"leaf_deadline_ms": None}, {"leaf_deadline_ms": -1}, {"leaf_deadline_ms": "x"},
                {"leaf_deadline_ms": float("nan")}, {"leaf_deadline_ms": float("inf")}, {"leaf_deadline_ms": True}):
        assert deadline_of(bad) is None, bad   # lossless leaf path: the safe reading


def test_final_order_is_the_order_the_ring_finalises_pieces():
    """Run the real ring over 4 in-process members and record when each piece's mask
    turns full on every member: it is final_order's order."""
    n, S, numel = 4, 3, 1200
    trs = [TcpTransport(f"r{i}", "order") for i in range(n)]
    addrs = {f"r{i}": t.address for i, t in enumerate(trs)}
    for t in trs:
        t.configure(1, "tok", addrs)
    pieces = [(s0 + a, s0 + b) for (s0, e0) in split(numel, n) for (a, b) in split(e0 - s0, S)]
    seen: dict[int, list[int]] = {i: [] for i in range(n)}

    class Rec(Ledger):
        def set(self, p, mask):
            super().set(p, mask)
            if mask == self.full and p not in seen[self.me]:
                seen[self.me].append(p)

    def member(i: int) -> None:
        L = Rec(0, "allreduce", tuple(addrs), i, 1, 3, torch.ones(numel), torch.zeros(numel), list(pieces))
        RingReduceScatterAllgather(S).run(OpContext(trs[i], L, ReduceOp.SUM, 20, lambda *a: None, 1))

    try:
        run_members(member, range(n), 30)
    finally:
        for t in trs:
            t.close()
    for i in range(n):
        assert seen[i] == RingReduceScatterAllgather(S).final_order(n, i, len(pieces)), i
    assert RecursiveDoubling().final_order(3, 1, 4) == [0, 1, 2, 3]


# -- harness ------------------------------------------------------------------------------

class _Decisions:
    """Which (parent, leaf, op seq) decisions were sent; a condition to wait on them."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.sent: set[tuple[str, int]] = set()   # (leaf, seq)

    def note(self, leaf: str, seq: int) -> None:
        with self.cond:
            self.sent.add((leaf, seq))
            self.cond.notify_all()


class _Watch:
    """A parent's transport: notes every decision frame it sends to a leaf; with
    ``hold_for`` (leaves) every ``wait`` or ``isend`` first completes those leaves' input
    receives of the op, so the parent's ring — and its deadline — end after that input is
    in."""

    def __init__(self, inner, decisions: _Decisions, hold_for: set[str] = frozenset()) -> None:
        self.inner, self.decisions, self.hold_for = inner, decisions, set(hold_for)
        self.held: list = []

    def _hold(self, raising: bool = True) -> None:
        if self.held:
            held, self.held = self.held, []
            try:
                self.inner.wait(held)
            except (TransportError, TransportAborted):
                if raising:
                    raise   # (isend never raises, as a real transport's: the next wait does)

    def isend(self, peer, buf, seq, tg, digest=0):
        self._hold(raising=False)    # (a lone active posts its result stream before it ever waits)
        req = self.inner.isend(peer, buf, seq, tg, digest)
        if _step(tg) == T_DECISION:
            self.decisions.note(peer, seq)
        return req

    def irecv(self, peer, buf, seq, tg, digest=0):
        req = self.inner.irecv(peer, buf, seq, tg, digest)
        if peer in self.hold_for and _step(tg) == T_INPUT:
            self.held.append(req)
        return req

    def wait(self, reqs, timeout=None):
        self._hold()
        return self.inner.wait(reqs, timeout)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _Deferred:
    def __init__(self, args) -> None:
        self.args, self.inner = args, None
        self.peer, self.nbytes = args[0], 0

    def done(self):
        return self.inner is not None and self.inner.done()

    @property
    def error(self):
        return self.inner.error if self.inner is not None else None

    def touched(self):
        return self.inner is not None and self.inner.touched()


class _LateLeaf:
    """A leaf's transport: its input frames of op ``k`` go out only after its parent
    sent the decision of op ``k`` (so they are late, deterministically); they do go out
    then, as a late member's would."""

    def __init__(self, inner, me: str, decisions: _Decisions) -> None:
        self.inner, self.me, self.decisions = inner, me, decisions
        self.deferred: list[_Deferred] = []
        self.late_frames = 0

    def isend(self, peer, buf, seq, tg, digest=0):
        if _step(tg) == T_INPUT:
            r = _Deferred((peer, buf, seq, tg, digest))
            self.deferred.append(r)
            return r
        return self.inner.isend(peer, buf, seq, tg, digest)

    def _release(self) -> None:
        while self.deferred:
            r = self.deferred[0]
            with self.decisions.cond:
                while (self.me, r.args[2]) not in self.decisions.sent:
                    if self.inner.aborted:
                        raise TransportAborted("test: aborted while the leaf was late")
                    self.decisions.cond.wait(0.02)
            self.deferred.pop(0)
            r.inner = self.inner.isend(*r.args)
            self.late_frames += 1

    def wait(self, reqs, timeout=None):
        if any(isinstance(r, _Deferred) and r.inner is None for r in reqs):
            self._release()
        return self.inner.wait([r.inner if isinstance(r, _Deferred) else r for r in reqs], timeout)

    def __getattr__(self, name):
        return getattr(self.inner, name)


_inp = member_input


def _run(world: int, leaves: dict[str, str], ops: list[str], numel: int, deadline_ms: float,
         late: set[str] = frozenset(), on_time: set[str] = frozenset(), small_bytes: int = 1024,
         slice_bytes: int = 4096):
    """``leaves``: leaf -> parent (the plan's tree_parent is built from it)."""
    ids = [f"m{i}" for i in range(world)]
    trs = {m: TcpTransport(m, "deadlinejob") for m in ids}
    decisions = _Decisions()
    wrapped: dict[str, Any] = dict(trs)
    parents = set(leaves.values())
    for p in parents:
        wrapped[p] = _Watch(trs[p], decisions, {l for l, q in leaves.items() if q == p and l in on_time})
    for l in late:
        wrapped[l] = _LateLeaf(trs[l], l, decisions)
    tree = [-1] * world
    for l, p in leaves.items():
        tree[ids.index(l)] = ids.index(p)
    ep = _Epoch(1, tuple(ids), "tok", {m: _Info(trs[m].address) for m in ids},
                roles={m: ("demoted" if m in leaves else "active") for m in ids},
                plan={"tree_parent": tree, "leaf_deadline_ms": deadline_ms})
    results = run_allreduces(ep, wrapped, ops, numel, close=trs.values(), timeout=90, small_bytes=small_bytes,
                             slice_bytes=slice_bytes)
    return ids, results, wrapped


def _want(op: str, ids: list[str], contributors: tuple, seq: int, numel: int) -> torch.Tensor:
    stack = torch.stack([_inp(ids.index(m), seq, numel) for m in contributors])
    return {"sum": stack.sum(0), "avg": stack.sum(0) / len(contributors), "max": stack.max(0).values,
            "min": stack.min(0).values}[op]


# -- data path ------------------------------------------------------------------------------

@pytest.mark.parametrize("numel", [10_001, 200])    # ring over the actives / recursive doubling
def test_a_late_leaf_is_left_out_and_every_member_says_so(numel):
    ops = ["sum", "avg", "max", "sum"]
    ids, results, wrapped = _run(5, {"m4": "m0"}, ops, numel, deadline_ms=0, late={"m4"})
    without = ("m0", "m1", "m2", "m3")
    for seq, op in enumerate(ops):
        want = _want(op, ids, without, seq, numel)
        for m in ids:
            out, contributors = results[m][seq]
            assert contributors == without, (m, seq, contributors)       # the leaf too: never silent
            assert torch.equal(out, want), (m, op, (out - want).abs().max())
    # the late input was sent every op (and discarded): no later op ever added it
    assert wrapped["m4"].late_frames >= len(ops)


@pytest.mark.parametrize("numel,world,actives", [(10_001, 5, 3), (6000, 4, 2), (5000, 3, 1), (200, 5, 3)])
def test_an_on_time_leaf_is_included_exactly_even_with_a_zero_deadline(numel, world, actives):
    # ring of 3 (chain concurrent), ring of 2 (chain after), one active serving both
    # leaves (no chain), recursive doubling (chain after)
    ids = [f"m{i}" for i in range(world)]
    leaf_ids = ids[actives:]
    leaves = {l: ids[j % actives] for j, l in enumerate(leaf_ids)}
    on_time = set(leaf_ids)
    ops = ["sum", "avg", "min"]
    ids, results, _ = _run(world, leaves, ops, numel, deadline_ms=0, on_time=on_time)
    for seq, op in enumerate(ops):
        want = _want(op, ids, tuple(ids), seq, numel)
        for m in ids:
            out, contributors = results[m][seq]
            assert contributors == tuple(ids), (m, contributors)
            assert torch.equal(out, want), (m, op)


def test_a_generous_deadline_includes_every_leaf():
    """No test hooks: with a 60 s deadline the parents simply wait for the leaves' input
    (and return as soon as it is complete)."""
    ids, results, _ = _run(5, {"m3": "m1", "m4": "m0"}, ["sum", "max"], 10_001, deadline_ms=60_000)
    for seq, op in enumerate(["sum", "max"]):
        want = _want(op, ids, tuple(ids), seq, 10_001)
        for m in ids:
            assert results[m][seq][1] == tuple(ids) and torch.equal(results[m][seq][0], want)


def test_one_late_and_one_on_time_leaf_under_different_parents():
    """m4 (under m0) is late, m3 (under m1) is on time: both parents decide alone, the
    chain carries both decisions, everyone — both leaves included — reports {m0..m3}; the
    late leaf gets the final result from its parent (another leaf is in it)."""
    ops = ["sum", "avg", "sum"]
    ids, results, _ = _run(5, {"m3": "m1", "m4": "m0"}, ops, 10_001, deadline_ms=0, late={"m4"},
                           on_time={"m3"})
    want_set = ("m0", "m1", "m2", "m3")
    for seq, op in enumerate(ops):
        want = _want(op, ids, want_set, seq, 10_001)
        for m in ids:
            out, contributors = results[m][seq]
            assert contributors == want_set, (m, seq, contributors)
            assert torch.equal(out, want), (m, op)


class _AbortAfter:
    """The ``k``-th send of this member aborts every member's transport (as an epoch that
    removes someone does)."""

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


@pytest.mark.parametrize("late", [True, False])
@pytest.mark.parametrize("who,k", [("m4", 3), ("m4", 7), ("m3", 10), ("m3", 25), ("m0", 5), ("m0", 20), ("m0", 38),
                                   ("m1", 12), ("m1", 36), ("m2", 4), ("m2", 8)])
def test_masks_describe_out_exactly_whenever_a_deadline_op_is_aborted(who, k, late):
    """Abort a deadline-mode op at many points (leaf m4 late under m0, or both leaves on
    time): on every member, every non-zero mask is exactly the sum of its members' inputs
    — the recovery planner's premise — whether the leaf was being left out or added."""
    ids = [f"m{i}" for i in range(5)]
    leaves = {"m3": "m1", "m4": "m0"}
    actives = ["m0", "m1", "m2"]
    # 6 pieces of ~130 KB, 30 sub-slices: every member sends at least its ring's 8 frames,
    # an on-time leaf 30 inputs (a late one at least WINDOW = 8), a parent 8 + 30 results +
    # 1 decision — so every k below is reached
    numel, S = 200_000, 2
    trs = {m: TcpTransport(m, "deadlineabort") for m in ids}
    addrs = {m: trs[m].address for m in ids}
    for t in trs.values():
        t.configure(1, "tok", addrs)
    decisions = _Decisions()
    tr: dict[str, Any] = dict(trs)
    tr["m0"] = _Watch(trs["m0"], decisions)
    tr["m1"] = _Watch(trs["m1"], decisions, set() if late else {"m3"})
    if late:
        tr["m4"] = _LateLeaf(trs["m4"], "m4", decisions)
    else:
        tr["m0"].hold_for = {"m4"}
    tr[who] = _AbortAfter(tr[who], k, list(trs.values()))
    pieces = [(s0 + a, s0 + b) for (s0, e0) in split(numel, 3) for (a, b) in split(e0 - s0, S)]
    inputs = {m: _inp(i, 0, numel) for i, m in enumerate(ids)}
    ledgers: dict = {}
    errors: list = []

    def member(m: str) -> None:
        L = Ledger(0, "allreduce", tuple(ids), ids.index(m), 1, 7, inputs[m].clone(), torch.zeros(numel), pieces)
        ledgers[m] = L
        ctx = OpContext(tr[m], L, ReduceOp.SUM, 20, lambda *a: None, 1)
        algo = LeafPath(RingReduceScatterAllgather(S), leaves, actives, deadline_s=0.0)
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
    for m, L in ledgers.items():
        for q, mask in enumerate(L.masks):
            if mask:
                s, e = pieces[q]
                want = sum(inputs[ids[b]][s:e] for b in range(5) if mask >> b & 1)
                assert torch.equal(L.out[s:e], want), (m, q, bin(mask))
    assert tr[who].n >= k   # the abort really happened at the k-th send
