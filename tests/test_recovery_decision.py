"""The planner's decisions (resilient/collectives/recovery_decision.py): beyond
``direct_max`` survivors each survivor learns the round's facts and its slice of the plan
from one planner instead of every summary. Property: for any summaries, every survivor's
decoded decision gives exactly what it would have derived from all of them — the same
facts, the same need, the plan's transfers it takes part in (in plan order, same rounds),
its local steps — or the same planner error. Malformed decisions raise CollectiveError.
The tree that carries them over real transports: tests/test_status_exchange.py and
tests/test_collectives_faults.py (killed members, tree mode)."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

from resilient.collectives.ledger import Ledger, decode_status, encode_status, split
from resilient.collectives.recovery import PieceKind, Policy
from resilient.collectives.recovery_decision import (RoundFacts, decode_decision, facts_of, fatal_decisions,
                                                     op_policy, plan_decisions)
from resilient.collectives.resume import build_plan
from resilient.errors import CollectiveAborted, CollectiveError, DataLost


def _ledger(members, me, n_pieces, seq=1, kind=PieceKind.REDUCE, masks=None, done=False):
    numel = n_pieces * 2
    L = Ledger(seq, "allreduce" if kind is PieceKind.REDUCE else "allgather", tuple(members), me, 1, 7,
               torch.zeros(numel), torch.zeros(numel), [(2 * p, 2 * p + 2) for p in range(n_pieces)],
               piece_kind=kind, owners=[p % len(members) for p in range(n_pieces)] if kind is PieceKind.COPY else None)
    L.masks = list(masks) if masks is not None else [0] * n_pieces
    L.done = done
    if done:
        L.need = [L.full] * n_pieces
    return L


@st.composite
def scenarios(draw):
    n = draw(st.integers(3, 7))
    members = [f"m{i}" for i in range(n)]
    dead = draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n - 2))
    survivors = [m for i, m in enumerate(members) if i not in dead]
    kind = draw(st.sampled_from([PieceKind.REDUCE, PieceKind.COPY]))
    n_pieces = n * draw(st.integers(1, 2))
    full = (1 << n) - 1
    ledgers, statuses = {}, {}
    for m in survivors:
        i = members.index(m)
        how = draw(st.sampled_from(["inflight", "inflight", "fresh", "retained"]))
        if kind is PieceKind.COPY:
            masks = [draw(st.sampled_from([0, 1 << (p % n)])) for p in range(n_pieces)]
        else:
            masks = [draw(st.integers(0, full)) | (1 << i) if draw(st.booleans()) else 0 for _ in range(n_pieces)]
        L = _ledger(members, i, n_pieces, kind=kind, masks=masks)
        ledgers[m] = L
        if how == "inflight":
            raw = encode_status(m, L, None)
        elif how == "fresh":   # started the op fresh over the survivors: another layout
            raw = encode_status(m, _ledger(survivors, survivors.index(m), n_pieces, kind=kind), None)
        else:                  # already in op 2: op 1 is its retained, finished ledger
            done = _ledger(members, i, n_pieces, kind=kind, masks=[full] * n_pieces, done=True)
            ledgers[m] = done
            raw = encode_status(m, _ledger(members, i, n_pieces, seq=2, kind=kind), done)
        statuses[m] = decode_status(raw)
    policy = draw(st.sampled_from(list(Policy)))
    return survivors, statuses, ledgers, policy


def _outcome(fn):
    try:
        return fn(), None
    except (CollectiveError, ValueError, AssertionError) as exc:
        return None, exc


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_every_survivor_s_decision_is_its_part_of_the_plan_it_would_have_built(sc):
    survivors, statuses, ledgers, policy = sc
    planner = survivors[0]
    decisions = plan_decisions(survivors, statuses, [ledgers[planner]], policy, build_plan)
    assert set(decisions) == set(survivors)
    facts = facts_of(statuses)
    for m in survivors:
        d = decode_decision(decisions[m], m)
        assert (d.facts.lowest, d.facts.next_min) == (facts.lowest, facts.next_min)
        if facts.lowest is not None:
            assert d.facts.progressed(facts.lowest) == facts.progressed(facts.lowest)
            assert d.facts.not_started(facts.lowest) == facts.not_started(facts.lowest)
        if facts.lowest != ledgers[planner].seq:
            continue   # the planner holds no ledger of that op: nothing to compare
        full, err = _outcome(lambda: build_plan(ledgers[planner], survivors, statuses,
                                                op_policy(statuses, facts.lowest, policy)))
        mine, err2 = _outcome(lambda: d.plan_for(ledgers[m]))
        if err is not None:
            expected = type(err) if isinstance(err, (CollectiveAborted, DataLost)) else CollectiveError
            assert type(err2) is expected, (err, err2)
            assert str(err) in str(err2)
            continue
        assert err2 is None, err2
        assert mine.need == full.need
        assert len(mine.rounds) == len(full.rounds)
        for r, transfers in enumerate(full.rounds):
            assert mine.rounds[r] == [t for t in transfers if m in (t.src, t.dst)]
        assert mine.prepare == [s for s in full.prepare if s.member == m]
        assert mine.transfer_count() == len(full.transfers())


def test_the_facts_are_what_the_recovery_loop_derived_from_the_summaries():
    members = ["a", "b", "c"]
    L1 = _ledger(members, 0, 3, masks=[1, 0, 0])
    L2 = _ledger(members, 1, 3, seq=2)
    st_ = {"a": decode_status(encode_status("a", L1, None)),
           "b": decode_status(encode_status("b", L2, _ledger(members, 1, 3, masks=[7, 7, 7], done=True))),
           "c": decode_status(encode_status("c", None, None, next_seq=1))}
    f = facts_of(st_)
    assert f == RoundFacts(lowest=1, next_min=1, progress=frozenset({1}))
    assert f.not_started(1) and not f.not_started(0)
    assert f.progressed(1) and not f.progressed(2)


def _one_decision(policy=Policy.DEFAULT):
    members = ["a", "b", "c", "d"]
    survivors = ["a", "b", "d"]
    statuses = {m: decode_status(encode_status(m, _ledger(members, members.index(m), 8,
                                                          masks=[1 << members.index(m) | 1 << 2] * 8), None))
                for m in survivors}
    L = _ledger(members, 0, 8)
    return members, survivors, statuses, L, plan_decisions(survivors, statuses, [L], policy, build_plan)


def test_strict_policy_aborts_on_every_survivor_through_the_decision():
    members, survivors, statuses, L, decisions = _one_decision(Policy.STRICT)
    for m in survivors:
        with pytest.raises(CollectiveAborted):
            decode_decision(decisions[m], m).plan_for(_ledger(members, members.index(m), 8))


def test_a_decision_for_another_layout_is_refused():
    members, survivors, statuses, L, decisions = _one_decision()
    d = decode_decision(decisions["b"], "b")
    with pytest.raises(CollectiveError, match="differs"):
        d.plan_for(_ledger(["a", "b", "d"], 1, 8))          # another member order
    with pytest.raises(CollectiveError, match="differs"):
        d.plan_for(_ledger(members, 1, 4))                  # another piece count
    with pytest.raises(CollectiveError, match="addressed to 'b'"):
        decode_decision(decisions["b"], "d")


def test_a_fatal_decision_raises_on_every_survivor():
    for m, raw in fatal_decisions(["a", "b"], "the ledger summary of b: field 'seq' is str").items():
        with pytest.raises(CollectiveError, match="field 'seq' is str"):
            decode_decision(raw, m)


def test_the_decision_does_not_grow_with_the_plan_of_others():
    """A survivor's decision holds its own transfers, not the whole plan's: at 16 members
    with one dead, each receives well under the whole plan's transfers."""
    n = 16
    members = [f"m{i}" for i in range(n)]
    survivors = members[1:]
    statuses = {m: decode_status(encode_status(m, _ledger(members, i, n, masks=[1 << i] * n), None))
                for i, m in enumerate(members) if m in survivors}
    decisions = plan_decisions(survivors, statuses, [_ledger(members, 1, n)], Policy.DEFAULT, build_plan)
    full = build_plan(_ledger(members, 1, n), survivors, statuses, Policy.DEFAULT)
    for m in survivors:
        moves = json.loads(decisions[m])["plan"]["moves"]
        assert len(moves) == sum(1 for t in full.transfers() if m in (t.src, t.dst))
        assert len(moves) < len(full.transfers()) / 4


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-5, 1 << 40) | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=5),
                     max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(["lowest", "next_min", "progress", "error", "plan", "v", "member"]), value=_JSON,
       sub=st.sampled_from([None, "seq", "n_members", "members_sha", "n_pieces", "rounds", "transfers",
                            "need_table", "need_runs", "moves", "prepare"]))
def test_a_malformed_decision_raises_collective_error_only(field, value, sub):
    """Any field replaced by any JSON value: a CollectiveError naming the problem, or a
    decision that still validates (never another exception, never a plan with indices out
    of range)."""
    members, survivors, statuses, L, decisions = _one_decision()
    obj = json.loads(decisions["b"])
    if sub is not None and field == "plan":
        obj["plan"][sub] = value
    else:
        obj[field] = value
    try:
        d = decode_decision(json.dumps(obj).encode(), "b")
    except CollectiveError:
        return
    try:
        plan = d.plan_for(_ledger(members, 1, 8))
    except CollectiveError:
        return
    for t in plan.transfers():
        assert t.src in members and t.dst in members and 0 <= t.piece < 8


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_bytes_raise_collective_error(raw):
    with pytest.raises(CollectiveError):
        decode_decision(raw, "b")


def test_the_planner_plans_under_the_op_s_policy_not_its_own():
    """A survivor in the op puts the op's policy in its summary; a planner that is past
    the op (or between ops) plans it under that policy, not the default it has."""
    members = ["a", "b", "c", "d"]
    survivors = ["a", "b", "d"]
    statuses = {m: decode_status(encode_status(m, _ledger(members, members.index(m), 8,
                                                          masks=[1 << members.index(m) | 1 << 2] * 8), None,
                                               policy="strict"))
                for m in survivors}
    decisions = plan_decisions(survivors, statuses, [_ledger(members, 0, 8)], Policy.DEFAULT, build_plan)
    with pytest.raises(CollectiveAborted):
        decode_decision(decisions["b"], "b").plan_for(_ledger(members, 1, 8))
    with pytest.raises(CollectiveError, match="policy"):
        decode_status(encode_status("a", _ledger(members, 0, 8), None, policy="lenient"))


def test_any_planner_failure_reaches_every_survivor():
    members, survivors, statuses, L, _ = _one_decision()

    def broken(*a):
        raise KeyError("masks")

    for m, raw in plan_decisions(survivors, statuses, [L], Policy.DEFAULT, broken).items():
        with pytest.raises(CollectiveError, match="KeyError"):
            decode_decision(raw, m).plan_for(_ledger(members, members.index(m), 8))


def test_deeply_nested_json_is_a_collective_error():
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(CollectiveError):
        decode_decision(deep, "b")
    with pytest.raises(CollectiveError):
        decode_status(deep)
