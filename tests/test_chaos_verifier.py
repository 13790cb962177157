"""The verifying workload and the verifier (pure logic, no processes).

Correct results — including float sums accumulated in the dtype in a different order, the
way a ring does — pass; a wrong element, a wrong contributor set, AVG divided by the wrong
count, disagreeing members, a hang and a lost op are each caught (proof the checker can
fail)."""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

from resilient.chaos.scenario import parse_scenario
from resilient.chaos.verifier import FaultEvent, OpRecord, RunLog, verify
from resilient.chaos.workload import (DTYPES, REDUCE_OPS, Expected, OpSpec, compare, expected_output, make_input,
                                      op_spec_for)


def _scenario(mix: str, world: int = 4, ops: int = 4, op_timeout_s: float = 30):
    return parse_scenario(textwrap.dedent(f"""\
        name: unit
        world_size: {world}
        op_timeout_s: {op_timeout_s}
        workload:
          ops: {ops}
          mix: [{mix}]
        """), "unit.yaml")


def _ring_reduce(spec: OpSpec, seq: int, seed: int, contributors, start: int = 0) -> np.ndarray:
    """An honest 'implementation': accumulate in the dtype itself, in ring order from
    ``start`` (not the order the expected value uses)."""
    order = list(contributors[start:]) + list(contributors[:start])
    acc = make_input(order[0], seq, seed, spec).copy()
    for m in order[1:]:
        x = make_input(m, seq, seed, spec)
        if spec.op in ("sum", "avg"):
            acc = acc + x
        elif spec.op == "prod":
            acc = acc * x
        elif spec.op == "min":
            acc = np.minimum(acc, x)
        else:
            acc = np.maximum(acc, x)
    if spec.op == "avg":
        acc = (acc / np.array(len(order), dtype=acc.dtype)).astype(acc.dtype)
    return acc.astype(spec.dtype)


def _records(sc, seed: int, contributors, output_fn, members=None, t0: float = 0.0):
    out = []
    for seq in range(sc.workload.ops):
        spec = op_spec_for(seq, seed, sc.workload.mix)
        for m in (members if members is not None else contributors):
            out.append(OpRecord(member=m, seq=seq, start_s=t0 + seq, end_s=t0 + seq + 0.5,
                                contributors=tuple(contributors), output=output_fn(spec, seq, m)))
    return out


def test_kernels_reduce_op_names_match():
    from resilient.kernels.ops import ReduceOp

    assert set(REDUCE_OPS) == {o.value for o in ReduceOp}


def test_inputs_are_deterministic_and_distinct():
    spec = OpSpec("allreduce", "float32", 256, "sum")
    a = make_input(1, 7, 3, spec)
    assert a.dtype == np.float32 and a.shape == (256,)
    assert np.array_equal(a, make_input(1, 7, 3, spec))
    for other in (make_input(2, 7, 3, spec), make_input(1, 8, 3, spec), make_input(1, 7, 4, spec)):
        assert not np.array_equal(a, other)


def test_op_mix_choice_is_deterministic_and_uses_every_entry():
    mix = (OpSpec("allreduce", "int64", 8, "sum"), OpSpec("allgather", "int32", 8), OpSpec("barrier"))
    picks = [op_spec_for(seq, 5, mix) for seq in range(60)]
    assert picks == [op_spec_for(seq, 5, mix) for seq in range(60)]
    assert set(picks) == set(mix)


@pytest.mark.parametrize("dtype,op", [(d, o) for d in DTYPES for o in REDUCE_OPS
                                      if not (o == "avg" and not d.startswith("float"))])  # avg: floats only
def test_reordered_dtype_accumulation_passes(dtype, op):
    spec = OpSpec("allreduce", dtype, 4096, op)
    contributors = (0, 2, 3, 5, 6, 7)
    exp = expected_output(spec, 3, 11, contributors)
    for start in range(len(contributors)):
        assert compare(_ring_reduce(spec, 3, 11, contributors, start), exp, dtype) is None


def test_float_sum_in_a_different_order_really_differs_bitwise():
    """The float tolerance is needed: ring order changes the bits (so the test above
    checks the tolerance, not a trivially identical result)."""
    spec = OpSpec("allreduce", "float32", 4096, "sum")
    members = tuple(range(8))
    a, b = _ring_reduce(spec, 0, 0, members, 0), _ring_reduce(spec, 0, 0, members, 3)
    assert not np.array_equal(a, b)


def test_compare_catches_one_wrong_element_bitwise_and_in_tolerance():
    for dtype in ("int64", "float32"):
        spec = OpSpec("allreduce", dtype, 1000, "sum")
        exp = expected_output(spec, 0, 0, (0, 1, 2))
        good = _ring_reduce(spec, 0, 0, (0, 1, 2))
        bad = good.copy()
        bad[417] += 1
        assert compare(good, exp, dtype) is None
        m = compare(bad, exp, dtype)
        assert m is not None and m.index == 417 and "1 of 1000" in m.reason


def test_reduce_scatter_allgather_broadcast_expectations():
    rs = OpSpec("reduce_scatter", "int32", 100, "sum")
    full = expected_output(rs, 1, 2, (0, 1, 2)).value
    part = expected_output(rs, 1, 2, (0, 1, 2), (40, 60)).value
    assert np.array_equal(part, full[40:60])
    ag = OpSpec("allgather", "int32", 10)
    got = np.concatenate([make_input(m, 1, 2, ag) for m in (2, 0)])
    assert compare(got, expected_output(ag, 1, 2, (2, 0)), "int32") is None
    assert compare(got, expected_output(ag, 1, 2, (0, 2)), "int32") is not None
    bc = OpSpec("broadcast", "float32", 10, root=1)
    assert compare(make_input(1, 1, 2, bc), expected_output(bc, 1, 2, (1,)), "float32") is None
    # the root was lost before the op: the member broadcast from instead is the contributor
    assert compare(make_input(0, 1, 2, bc), expected_output(bc, 1, 2, (0,)), "float32") is None
    assert compare(make_input(1, 1, 2, bc), expected_output(bc, 1, 2, (0,)), "float32") is not None
    with pytest.raises(ValueError, match="exactly one"):
        expected_output(bc, 1, 2, (0, 1))


# ---- the verifier over whole runs -------------------------------------------------------

MIX = "{collective: allreduce, op: sum, dtype: int64, numel: 512}, {collective: allreduce, op: avg, dtype: float32, numel: 512}"


def _honest(seed, contributors):
    return lambda spec, seq, m: _ring_reduce(spec, seq, seed, contributors, start=m % len(contributors))


def test_correct_run_passes():
    sc = _scenario(MIX)
    run = RunLog(sc, seed=1, records=_records(sc, 1, (0, 1, 2, 3), _honest(1, (0, 1, 2, 3))))
    v = verify(run)
    assert v.passed, (v.wrong, v.hangs, v.lost)
    assert v.ops == 4 and v.results_checked == 16


def test_verifier_catches_a_wrong_element():
    sc = _scenario(MIX)
    honest = _honest(1, (0, 1, 2, 3))

    def corrupt(spec, seq, m):
        out = honest(spec, seq, m)
        if seq == 2 and m == 3:
            out[100] = out[100] + 5
        return out

    v = verify(RunLog(sc, seed=1, records=_records(sc, 1, (0, 1, 2, 3), corrupt)))
    assert not v.passed
    assert [(f.seq, f.member) for f in v.wrong] == [(2, 3)]
    assert "first at [100]" in v.wrong[0].reason


def test_verifier_catches_a_wrong_contributor_set():
    """The 'broken ledger': survivors reduce over {0,1,3} after member 2 died but report the
    original set {0,1,2,3} (contributor tracking disabled)."""
    sc = _scenario(MIX)
    survivors = (0, 1, 3)
    records = _records(sc, 1, (0, 1, 2, 3), _honest(1, survivors), members=survivors)
    faults = [FaultEvent("kill", 0.2, "member 2", victim=2)]
    v = verify(RunLog(sc, seed=1, records=records, faults=faults))
    assert not v.passed and len(v.wrong) == 12  # every op, every survivor
    assert all("over [0, 1, 2, 3]" in f.reason for f in v.wrong)
    # the same outputs with the honest contributor set pass
    ok = _records(sc, 1, survivors, _honest(1, survivors))
    assert verify(RunLog(sc, seed=1, records=ok, faults=faults)).passed


def test_verifier_catches_avg_divided_by_the_wrong_count():
    sc = _scenario("{collective: allreduce, op: avg, dtype: float32, numel: 512}")
    survivors = (0, 1, 3)

    def avg_over_world(spec, seq, m):  # sums the 3 survivors but divides by the original 4
        s = _ring_reduce(OpSpec(spec.collective, spec.dtype, spec.numel, "sum"), seq, 1, survivors)
        return (s / np.float32(4)).astype(np.float32)

    faults = [FaultEvent("kill", 0.2, "member 2", victim=2)]
    v = verify(RunLog(sc, seed=1, records=_records(sc, 1, survivors, avg_over_world), faults=faults))
    assert len(v.wrong) == 12 and not v.passed
    assert all("first at" in f.reason for f in v.wrong)
    honest = _records(sc, 1, survivors, _honest(1, survivors))
    assert verify(RunLog(sc, seed=1, records=honest, faults=faults)).passed


def test_verifier_catches_members_disagreeing_and_a_non_contributor_result():
    sc = _scenario("{collective: allreduce, op: sum, dtype: int64, numel: 64}", ops=1)
    spec = op_spec_for(0, 0, sc.workload.mix)
    full, part = (0, 1, 2, 3), (0, 1, 2)
    recs = [OpRecord(m, 0, 0.0, 0.1, part if m == 0 else full,
                     _ring_reduce(spec, 0, 0, part if m == 0 else full)) for m in full]
    v = verify(RunLog(sc, seed=0, records=recs))
    assert any("disagree" in f.reason for f in v.wrong)
    recs = [OpRecord(m, 0, 0.0, 0.1, part, _ring_reduce(spec, 0, 0, part)) for m in full]
    v = verify(RunLog(sc, seed=0, records=recs))
    assert [f.member for f in v.wrong] == [3] and "not in its contributor set" in v.wrong[0].reason


def test_hang_lost_and_excused_victims():
    sc = _scenario("{collective: allreduce, op: sum, dtype: int64, numel: 64}", ops=3, op_timeout_s=5)
    honest = _honest(0, (0, 1, 2, 3))
    recs = _records(sc, 0, (0, 1, 2, 3), honest)
    # member 1 never finishes op 2: a hang; member 2 has no record of op 1: lost
    recs = [r for r in recs if not (r.member == 2 and r.seq == 1)]
    for r in recs:
        if r.member == 1 and r.seq == 2:
            r.end_s, r.output = None, None
        if r.member == 0 and r.seq == 0:
            r.end_s = r.start_s + 6.0  # finished, but past op_timeout_s
    v = verify(RunLog(sc, seed=0, records=recs))
    assert {(f.seq, f.member) for f in v.hangs} == {(2, 1), (0, 0)}
    assert [(f.seq, f.member) for f in v.lost] == [(1, 2)]
    # the same unfinished ops by SIGKILL / SIGSTOP victims are expected, not hangs or lost
    faults = [FaultEvent("hang", 2.2, "member 1", victim=1), FaultEvent("kill", 0.9, "member 2", victim=2)]
    v = verify(RunLog(sc, seed=0, records=recs, faults=faults))
    assert [(f.seq, f.member) for f in v.hangs] == [(0, 0)] and not v.lost


def test_recovery_time_is_measured_from_the_fault():
    sc = _scenario("{collective: allreduce, op: sum, dtype: int64, numel: 64}", ops=4)
    recs = _records(sc, 0, (0, 1, 2), _honest(0, (0, 1, 2)))  # op k runs [k, k+0.5]
    v = verify(RunLog(sc, seed=0, records=recs, faults=[FaultEvent("kill", 2.25, "member 3", victim=3)]))
    assert v.passed and v.recoveries == [pytest.approx(0.25)] and v.faults == 1
    skipped = FaultEvent("netem", 1.0, "link 0-1", skipped="needs root")
    v = verify(RunLog(sc, seed=0, records=recs, faults=[skipped]))
    assert v.faults == 0 and v.recoveries == [] and v.skipped == ["netem link 0-1: needs root"]


def test_expected_is_a_plain_value_object():
    e = Expected(np.zeros(3, np.int32))
    assert compare(np.zeros(3, np.int32), e, "int32") is None
    assert "dtype" in compare(np.zeros(3, np.int64), e, "int32").reason
    assert "shape" in compare(np.zeros(4, np.int32), e, "int32").reason
    assert compare(None, e, "int32").reason == "no output reported"


def test_a_member_that_crashed_by_itself_is_not_excused():
    """Only fault victims are excused: a survivor that raised, or whose harness failed
    before any op, shows up as lost ops."""
    sc = _scenario("{collective: allreduce, op: sum, dtype: int64, numel: 64}", ops=2)
    recs = _records(sc, 0, (0, 1, 2, 3), _honest(0, (0, 1, 2, 3)))
    recs = [r for r in recs if r.member != 3]
    recs.append(OpRecord(3, 0, 0.0, None, error="RuntimeError: boom"))
    recs.append(OpRecord(2, -1, 0.0, None, error="ImportError: x"))
    v = verify(RunLog(sc, seed=0, records=recs))
    assert not v.passed and not v.hangs
    assert {(f.seq, f.member) for f in v.lost} == {(0, 3), (1, 3), (-1, 2)}


# ---- vacuous faults: a fault that hit no op is not a pass ---------------------------------

def test_a_fault_before_op_0_or_after_the_last_op_is_vacuous():
    sc = _scenario("{collective: allreduce, op: sum, dtype: int64, numel: 64}", ops=4)
    recs = _records(sc, 0, (0, 1, 2), _honest(0, (0, 1, 2)))  # op k runs [k, k+0.5]; ops span [0, 3.5]
    shift = _records(sc, 0, (0, 1, 2), _honest(0, (0, 1, 2)), t0=2.0)  # the same ops 2 s later
    early = verify(RunLog(sc, seed=0, records=shift, faults=[FaultEvent("kill", 1.0, "member 3", victim=3)]))
    assert not early.passed and (early.wrong, early.hangs, early.lost) == ([], [], [])
    assert len(early.vacuous) == 1 and "before op 0 started at 2.000s" in early.vacuous[0]
    late = verify(RunLog(sc, seed=0, records=recs, faults=[FaultEvent("kill", 9.0, "member 3", victim=3)]))
    assert not late.passed and "every op had ended by 3.500s" in late.vacuous[0]
    # a fault window that overlaps the ops (even one that started before op 0) is not vacuous
    window = FaultEvent("etcd_kill", 1.0, "etcd member 0", end_s=2.5)
    assert verify(RunLog(sc, seed=0, records=shift, faults=[window])).vacuous == []
    assert verify(RunLog(sc, seed=0, records=recs, faults=[FaultEvent("kill", 2.25, "member 3", victim=3)])).passed


def test_a_planned_fault_that_never_fired_is_vacuous_not_skipped():
    from resilient.chaos.report import render_table, summarize
    from resilient.chaos.verifier import NEVER_FIRED

    sc = _scenario("{collective: allreduce, op: sum, dtype: int64, numel: 64}", ops=2)
    recs = _records(sc, 0, (0, 1, 2, 3), _honest(0, (0, 1, 2, 3)))
    never = FaultEvent("kill", 30.0, "member 1", skipped=f"{NEVER_FIRED}: the victim did not reach op 9")
    v = verify(RunLog(sc, seed=0, records=recs, faults=[never]))
    assert not v.passed and v.skipped == [] and v.faults == 0
    assert v.vacuous == [f"kill member 1: {NEVER_FIRED}: the victim did not reach op 9"]
    s = summarize([v])
    assert s["vacuous"] == 1 and s["passed"] is False and any("vacuous fault" in f for f in s["findings"])
    assert "VACUOUS" in render_table([v]) and "FAIL" in render_table([v])


def test_reduce_scatter_shards_may_keep_a_superset_but_never_unrelated_sets():
    # a member whose shard was final before the kill keeps the full set; the shards that
    # recovery finished have the survivors' set: a chain of supersets is the contract,
    # two unrelated sets are a disagreement
    sc = _scenario("{collective: reduce_scatter, op: sum, dtype: float64, numel: 64}", ops=1)
    full, survivors, other = (0, 1, 2, 3), (0, 2, 3), (0, 1, 3)

    def rec(m, c):
        return OpRecord(m, 0, 0.0, 0.1, c, None, check="ok")

    v = verify(RunLog(sc, seed=0, records=[rec(0, full), rec(2, survivors), rec(3, survivors)],
                      faults=[FaultEvent("kill", 0.05, "member 1", victim=1)]))
    assert not any("disagree" in f.reason for f in v.wrong), v.wrong
    v = verify(RunLog(sc, seed=0, records=[rec(0, other), rec(2, survivors), rec(3, survivors)],
                      faults=[FaultEvent("kill", 0.05, "member 1", victim=1)]))
    assert any("disagree" in f.reason for f in v.wrong)


def test_data_lost_is_the_contracts_error_only_when_every_member_raised_it_for_a_killed_member():
    sc = _scenario("{collective: broadcast, dtype: int64, numel: 64, root: 0}", ops=1)
    err = "DataLost: broadcast #0: the root m0 was lost before any survivor got its data"
    kill0 = [FaultEvent("kill", 0.05, "member 0", victim=0)]

    def rec(m, error=err):
        return OpRecord(m, 0, 0.0, None, None, None, error=error)

    v = verify(RunLog(sc, seed=0, records=[rec(1), rec(2), rec(3)], faults=kill0))
    assert v.passed and not v.lost and [f.member for f in v.data_lost] == [1, 2, 3]
    # one member completed the op: the others' DataLost is a lost op, not the contract
    done = OpRecord(3, 0, 0.0, 0.1, (0,), None, check="ok")
    v = verify(RunLog(sc, seed=0, records=[rec(1), rec(2), done], faults=kill0))
    assert [f.member for f in v.lost] == [1, 2] and not v.data_lost
    # the member it names was not killed: lost
    v = verify(RunLog(sc, seed=0, records=[rec(1), rec(2), rec(3)], faults=[FaultEvent("kill", 0.05, "member 1", victim=1)]))
    assert {2, 3} <= {f.member for f in v.lost} and not v.data_lost and not v.passed
