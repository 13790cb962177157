"""The straggler policy at scale (coordinator/epoch_view.py): the incremental view of a
delta epoch answers every lookup the detector makes exactly as the full planner's epoch
does, and the policy's verdicts over either are the same."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.coordinator.delta import EpochDelta, EpochState
from resilient.coordinator.epoch_view import EpochIndex, StateView
from resilient.coordinator.health import StragglerPolicy, make_record
from resilient.coordinator.membership import MemberInfo
from resilient.coordinator.planner import _separate, plan
from resilient.coordinator.ring import plan_hash
from resilient.coordinator.straggler import StragglerConfig

#: one step: member index, remove it (else insert / re-role), demote it
Step = tuple[int, bool, bool]


def _info(i: int) -> MemberInfo:
    return MemberInfo(member_id=f"r{i:02d}", host=f"h{i // 4}", local_rank=i % 4, address=f"10.0.0.{i}:1",
                      labels={"rack": f"k{(i // 4) % 3}"}, pid=1)


def _step(state: EpochState, i: int, remove: bool, demote: bool) -> EpochState:
    """Apply one delta in place, as the coordinator does (the ring carried over)."""
    m = f"r{i:02d}"
    n = state.number + 1
    if remove and m in state.infos:
        d = EpochDelta(number=n, base=state.number, snapshot=0, removed=(m,))
    elif m in state.infos:
        d = EpochDelta(number=n, base=state.number, snapshot=0, roles={m: "demoted" if demote else "active"})
    else:
        d = EpochDelta(number=n, base=state.number, snapshot=0, added=(m,), infos={m: _info(i)},
                       roles={m: "demoted"} if demote else {})
    return state.apply(d, in_place=True)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.booleans(), st.booleans()), min_size=1, max_size=60),
       st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), max_size=4))
def test_state_view_answers_like_the_full_planner(steps: list[Step], pairs: list[tuple[int, int]]) -> None:
    """After any sequence of delta epochs, with or without avoided links, StateView
    (incremental ring, no planner run) gives the positions, neighbours, demoted set and
    leaf parents of the planner's full epoch, and the state derives its plan hash."""
    state = EpochState(0, {}, {}, {}, "t")
    state.ring_index()
    for i, remove, demote in steps:
        state = _step(state, i, remove, demote)
        avoid = sorted({tuple(sorted((f"r{a:02d}", f"r{b:02d}"))) for a, b in pairs if a != b
                        and f"r{a:02d}" in state.infos and f"r{b:02d}" in state.infos})
        state.extras = {"avoid": [list(p) for p in avoid]} if avoid else {}
        view = StateView(state, state.number)
        full_epoch = state.to_epoch(EpochDelta(number=state.number, base=state.number - 1, snapshot=0))
        full = EpochIndex(full_epoch)
        p = plan(state.infos.values(), state.demoted(), avoid=avoid)
        assert state.derive_hash() == plan_hash(p.ring, len(p.demoted), state.extras.get("avoid") or [])
        assert len(view) == len(full)
        assert view.demoted() == full.demoted()
        for m in sorted(state.infos):
            assert m in view
            assert view.position(m) == full.position(m), m
            assert view.successor(m) == full.successor(m), m
            assert view.predecessor(m) == full.predecessor(m), m
            assert view.leaf_parent(m) == full.leaf_parent(m), m
        assert "absent" not in view and view.successor("absent") is None and view.leaf_parent("absent") is None


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.booleans(), st.booleans()), min_size=6, max_size=40),
       st.sets(st.integers(0, 30), max_size=3))
def test_policy_verdicts_agree_on_the_view_and_the_full_epoch(steps: list[Step], slow: set[int]) -> None:
    """The straggler policy fed the incremental view reaches the same states, demotions,
    avoided links and scores as one fed the planner's full epoch, window after window."""
    state = EpochState(0, {}, {}, {}, "t")
    state.ring_index()
    for i, remove, demote in steps:
        state = _step(state, i, remove, demote)
    cfg = StragglerConfig(confirm_windows=2, release_windows=2)
    on_view, on_full = StragglerPolicy(cfg), StragglerPolicy(cfg)
    members = sorted(state.infos)
    slow_ids = {f"r{i:02d}" for i in slow}
    for w in range(8):
        now = 100.0 + w
        recs = {m: make_record(m, state.number, w, ops=10, window_s=1.0,
                               wait_s={} if m in slow_ids else {"x": 0.5}, at=now) for m in members}
        full = state.to_epoch(EpochDelta(number=state.number, base=state.number - 1, snapshot=0))
        a = on_view.evaluate(recs, StateView(state, state.number), now)
        b = on_full.evaluate(recs, full, now)
        assert (a.demoted, a.avoid, a.scores) == (b.demoted, b.avoid, b.scores)
    assert on_view.detector.events == on_full.detector.events


def _reference_separate(ids: list[str], healthy: int, avoid: set[frozenset[str]]) -> list[str]:
    """The planner's separation as it was before ring.separate, written as a plain search
    with a full recount per trial: repeatedly take the first swap that lowers the number
    of avoided edges — bad edges in ring order, for each the partners of its head nearest
    first (after before before), within the head's segment (healthy or demoted) — until
    none does (at most 2n swaps)."""
    n = len(ids)

    def bad_edges(order: list[int]) -> list[int]:
        return [i for i in range(n) if frozenset((ids[order[i]], ids[order[(i + 1) % n]])) in avoid]

    def swaps(i: int) -> list[tuple[int, int]]:
        j = (i + 1) % n
        seg = range(0, healthy) if j < healthy else range(healthy, n)
        return [(j, k) for d in range(1, n) for k in (j + d, j - d) if k in seg and k != i]

    def swapped(order: list[int], j: int, k: int) -> list[int]:
        out = list(order)
        out[j], out[k] = out[k], out[j]
        return out

    order = list(range(n))
    for _ in range(2 * n):
        bad = bad_edges(order)
        trials = (swapped(order, j, k) for i in bad for j, k in swaps(i))
        better = next((t for t in trials if len(bad_edges(t)) < len(bad)), None)
        if better is None:
            break
        order = better
    return [ids[x] for x in order]


@settings(max_examples=200, deadline=None)
@given(st.integers(4, 24), st.data())
def test_sparse_separation_is_the_planners_greedy(n: int, data: st.DataObject) -> None:
    """ring.separate's O(1)-per-trial swaps pick exactly the swaps of the full-recount
    greedy, whatever the ring, the demoted tail and the avoided pairs."""
    healthy = data.draw(st.integers(0, n))
    pairs = data.draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=6))
    ids = [f"m{i:02d}" for i in range(n)]
    avoid = {frozenset((ids[a], ids[b])) for a, b in pairs if a != b}
    keyed = [(f"{'1' if i >= healthy else '0'}", (0, i), m) for i, m in enumerate(ids)]
    got = [k[2] for k in _separate(keyed, healthy, avoid)]
    assert got == _reference_separate(ids, healthy, avoid)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 11), st.sampled_from([0.2, 0.5, 0.55, 0.9, 1.0]),
                                   st.integers(0, 3), st.booleans(), st.booleans()), max_size=6),
                min_size=1, max_size=40))
def test_fed_only_the_changed_records_the_detector_decides_as_when_it_reads_them_all(passes):
    """Each pass changes a few records (a new window, a summary's held one with its run,
    or the record gone); a detector told which members changed (as the coordinator's
    HealthCache tells it) reaches the same states, verdicts and events as one that looks
    at every record every pass."""
    from resilient.coordinator.straggler import StragglerDetector

    ring = [f"m{i:02d}" for i in range(12)]
    cfg = StragglerConfig(confirm_windows=2, release_windows=2)
    full, incremental = StragglerDetector(cfg), StragglerDetector(cfg)
    records: dict = {}
    seq = {m: 0 for m in ring}
    for p, changes in enumerate(passes):
        now = 100.0 + p
        changed = set()
        for i, busy, run, held, gone in changes:
            m = ring[i]
            changed.add(m)
            if gone:
                records.pop(m, None)
                continue
            seq[m] += max(1, run)
            rec = make_record(m, 1, seq[m], ops=10, window_s=1.0, wait_s={"p": 1.0 - busy}, at=now)
            if held:
                rec["run"] = run
            records[m] = rec
        a = full.update(dict(records), ring, 1, now)
        b = incremental.update(dict(records), ring, 1, now, changed=changed)
        assert (a.demoted, a.avoid, a.scores) == (b.demoted, b.avoid, b.scores)
    assert full.events == incremental.events


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.booleans(), st.booleans()), min_size=2, max_size=40),
       st.sets(st.integers(0, 30), min_size=1, max_size=4))
def test_the_coordinator_places_old_members_where_the_join_tree_does(steps, joiners):
    """The coordinator's position of an old member of a growing delta epoch (ring lookup
    less the joiners before it, service._old_positions) is its position in the join
    agreement's tree (join_agreement.old_members of the full epoch the members resolve)."""
    from types import SimpleNamespace

    from resilient.collectives.join_agreement import old_members
    from resilient.coordinator.service import _old_positions

    state = EpochState(0, {}, {}, {}, "t")
    state.ring_index()
    for i, remove, demote in steps:
        state = _step(state, i, remove, demote)
    added = {f"r{i:02d}" for i in joiners} & set(state.infos)
    full = state.to_epoch(EpochDelta(number=state.number, base=state.number - 1, snapshot=0, added=tuple(sorted(added))))
    want = {m: i for i, m in enumerate(old_members(full))}
    pub = SimpleNamespace(epoch=None, view=lambda: StateView(state, state.number))
    position = _old_positions(pub, added)   # type: ignore[arg-type]
    assert {m: position(m) for m in state.infos if position(m) is not None} == want
    assert all(position(m) is None for m in added) and position("absent") is None


def test_a_pass_without_an_epoch_keeps_what_the_detector_knows() -> None:
    """Summaries are written only when something changed, so the detector is fed each
    record once; a coordinator pass that has no epoch yet must not make it forget them.
    A policy given such a pass between its passes reaches the same verdicts and events as
    one that never had it, while afterwards only the slow member's record changes."""
    from resilient.coordinator.straggler import HealthRecords

    state = EpochState(0, {}, {}, {}, "t")
    state.ring_index()
    for i in range(12):
        state = _step(state, i, False, False)
    members = sorted(state.infos)
    slow = members[3]
    cfg = StragglerConfig(confirm_windows=2, release_windows=2)
    ref, gap = StragglerPolicy(cfg), StragglerPolicy(cfg)
    records = {m: make_record(m, state.number, 1, ops=10, window_s=1.0, wait_s={"x": 0.5}, at=100.0) for m in members}
    for p in range(10):
        now = 100.0 + p
        changed = set(members) if p == 0 else {slow}
        if p:
            records[slow] = make_record(slow, state.number, 1 + p, ops=10, window_s=1.0, wait_s={}, at=now)
        if p == 1:
            gap.evaluate(HealthRecords(dict(records), set()), None, now)   # no epoch: nothing consumed
        view = StateView(state, state.number)
        a = ref.evaluate(HealthRecords(dict(records), set(changed)), view, now)
        b = gap.evaluate(HealthRecords(dict(records), set(changed)), view, now)
        assert (a.demoted, a.avoid, a.scores) == (b.demoted, b.avoid, b.scores), p
    assert ref.detector.events == gap.detector.events
    assert any(slow in str(e) for e in ref.detector.events), "the slow member was never probed or demoted"
