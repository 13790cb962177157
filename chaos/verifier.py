"""The verifier: checks every op record of a chaos run against the contract.

The runner (or any harness) hands over a :class:`RunLog`: one :class:`OpRecord` per member
per op (its output, the contributor set the op reported, start/end times), the faults it
injected (:class:`FaultEvent`) and the epochs the coordinator published
(:class:`EpochEvent`). :func:`verify` recomputes every expected output independently
(:mod:`resilient.chaos.workload`) and returns a :class:`Verdict`:

- **wrong** — an output that differs from the reduction over its reported contributor set
  (bitwise for integers, reduction-order tolerance for floats); members that disagree on
  one op's contributor set; a member that delivered a reduction it is not a contributor
  of; a contributor that is not a member.
- **hangs** — an op a live member started and did not finish within ``op_timeout_s``.
- **lost** — an op a surviving member never completed (missing record or an error).
- **data lost** (reported, not a failure) — the contract's one allowed error: a
  broadcast/allgather whose piece existed only on a killed member raises ``DataLost``
  naming it (docs/design.md §3). Counted here, not as lost, only when the member it names was a
  kill victim and *no* non-excused member completed that op (all raised it, consistently).
- **vacuous** — an injected fault that did not overlap any op: its window (``time_s`` to
  ``end_s``) ends before the first op of the run started or begins after the last op
  ended; or a planned fault that never fired (``skipped`` starting with
  :data:`NEVER_FIRED`). The scenario did not test what it names, so the run fails.
- **recoveries** — for each injected fault, seconds from the fault until every surviving
  member finished the first op that completed after it.

Members that were fault victims (killed, stopped) or, after a network fault, that a
later epoch removed are *excused*: their unfinished ops are neither hangs nor lost, but every output they did
deliver is still checked. The verifier is pure: it never touches processes or etcd.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from resilient.chaos import kinds
from resilient.chaos.faults import ExpectedEffect
from resilient.chaos.scenario import Scenario
from resilient.chaos.workload import REDUCING, Expected, compare, expected_output, op_spec_for


#: Prefix of ``FaultEvent.skipped`` for a planned fault that never fired (vacuous).
NEVER_FIRED = "never fired"


@dataclass
class OpRecord:
    """What one member reports about one op.

    ``end_s`` is ``None`` when the op never returned; ``error`` is the exception class
    name when it raised. ``out_range`` is the ``[start, stop)`` slice of the reduced vector
    a ``reduce_scatter`` output holds. ``bytes_after_fault`` is what this member sent for
    the op after a failure interrupted it (``recovered`` ops only), for "work saved".
    ``check`` is set instead of ``output`` by a harness that compared the output in the
    member process itself (with :func:`resilient.chaos.workload.compare`, to avoid
    shipping large outputs): ``"ok"`` or the mismatch. ``control`` marks ops of the
    harness itself (stop votes): their completion is checked, not their value.
    """

    member: int
    seq: int
    start_s: float
    end_s: float | None
    contributors: tuple[int, ...] | None = None
    output: np.ndarray | None = None
    out_range: tuple[int, int] | None = None
    epoch: int | None = None
    error: str | None = None
    recovered: bool = False
    bytes_after_fault: int | None = None
    check: str | None = None
    control: bool = False


@dataclass
class FaultEvent:
    """A fault as injected: when (seconds since the workload started), on what, and
    until when (``end_s``: resume/restart/heal time, ``None`` if it lasted). ``skipped``
    holds the reason when it could not be injected here (e.g. netem without root)."""

    kind: str
    time_s: float
    target: str
    victim: int | None = None
    end_s: float | None = None
    skipped: str | None = None


def _effect(event: FaultEvent) -> ExpectedEffect:
    """What is expected of an event's fault kind (its
    :attr:`~resilient.chaos.faults.FaultKind.effect`); an unknown kind name excuses
    nothing and its recovery is timed."""
    kind = kinds.find(event.kind)
    return kind.effect if kind is not None else ExpectedEffect()


@dataclass
class EpochEvent:
    number: int
    time_s: float
    members: tuple[int, ...]


@dataclass
class RunLog:
    """Everything one seed of a scenario produced."""

    scenario: Scenario
    seed: int
    records: list[OpRecord] = field(default_factory=list)
    faults: list[FaultEvent] = field(default_factory=list)
    epochs: list[EpochEvent] = field(default_factory=list)
    ops_planned: int | None = None
    duration_s: float = 0.0
    ops_start_s: float | None = None  # when every member had started op 0 (time triggers' zero)


@dataclass(frozen=True)
class Finding:
    """One wrong result, hang or lost op, with a readable reason."""

    seq: int
    member: int | None
    reason: str

    def __str__(self) -> str:
        who = f"member {self.member}" if self.member is not None else "all members"
        return f"op {self.seq} ({who}): {self.reason}"


@dataclass
class Verdict:
    scenario: str
    seed: int
    ops: int = 0
    results_checked: int = 0
    faults: int = 0
    skipped: list[str] = field(default_factory=list)
    wrong: list[Finding] = field(default_factory=list)
    hangs: list[Finding] = field(default_factory=list)
    lost: list[Finding] = field(default_factory=list)
    data_lost: list[Finding] = field(default_factory=list)
    vacuous: list[str] = field(default_factory=list)
    recoveries: list[float] = field(default_factory=list)
    bytes_resent: int = 0
    bytes_restart: int = 0

    @property
    def passed(self) -> bool:
        """Every invariant held (no wrong result, no hang, no lost op) and every planned
        fault hit the workload (none vacuous)."""
        return not (self.wrong or self.hangs or self.lost or self.vacuous)


def verify(run: RunLog) -> Verdict:
    """Check every record of ``run``; see the module docstring for what is checked.
    Never raises for bad records: each problem becomes a finding in the verdict."""
    sc = run.scenario
    v = Verdict(scenario=sc.name, seed=run.seed)
    v.faults = sum(1 for f in run.faults if f.skipped is None)
    v.skipped = [f"{f.kind} {f.target}: {f.skipped}" for f in run.faults
                 if f.skipped and not f.skipped.startswith(NEVER_FIRED)]
    v.vacuous = _vacuous(run)
    excused = _excused_members(run)

    by_seq: dict[int, list[OpRecord]] = defaultdict(list)
    for r in run.records:
        by_seq[r.seq].append(r)

    for seq in sorted(by_seq):
        recs = by_seq[seq]
        if seq < 0:  # a harness that failed before any op
            v.lost += [Finding(seq, r.member, f"member harness failed: {r.error}") for r in recs]
            continue
        if sc.workload.mix:
            _check_values(run, seq, recs, v)
        data_lost = _data_lost_by_contract(run, recs, excused)
        for r in recs:
            if r.end_s is None or r.error is not None:
                if r.member in excused:
                    continue
                if r.error is not None:
                    (v.data_lost if data_lost else v.lost).append(Finding(seq, r.member, f"raised {r.error}"))
                else:
                    v.hangs.append(Finding(seq, r.member, f"started at {r.start_s:.3f}s and never finished"))
            elif r.end_s - r.start_s > sc.op_timeout_s:
                v.hangs.append(Finding(seq, r.member, f"took {r.end_s - r.start_s:.1f}s > op_timeout_s "
                                                      f"{sc.op_timeout_s:g}"))
    # lost: a survivor without a record for a planned op
    survivors = [m for m in range(sc.world_size) if m not in excused]
    planned = run.ops_planned
    if planned is None:
        done = [r.seq for r in run.records if r.member in survivors]
        planned = max(done) + 1 if done else 0
    for seq in range(planned):
        have = {r.member for r in by_seq.get(seq, ())}
        for m in survivors:
            if m not in have:
                v.lost.append(Finding(seq, m, "no record: the op never ran on this surviving member"))
    v.ops = len({r.seq for r in run.records if r.end_s is not None and r.error is None})
    v.recoveries = _recoveries(run, survivors)
    return v


def _data_lost_by_contract(run: RunLog, recs: Sequence[OpRecord], excused: set[int]) -> bool:
    """True when this op's failure is the contract's ``DataLost``: every non-excused
    member's record of it is a ``DataLost`` error naming the same member, and that member
    was killed by a fault (its piece existed nowhere else)."""
    killed = {f.victim for f in run.faults if f.skipped is None and _effect(f).victim_loses_data}
    named = set()
    for r in recs:
        if r.member in excused:
            continue
        if r.error is None or not r.error.startswith("DataLost"):
            return False
        found = re.findall(r"\bm(\d+)\b", r.error)
        if not found:
            return False
        named.add(int(found[0]))
    return len(named) == 1 and named <= killed


def _vacuous(run: RunLog) -> list[str]:
    """Faults that hit no op (see the module docstring), one readable line each."""
    out = [f"{f.kind} {f.target}: {f.skipped}" for f in run.faults
           if f.skipped and f.skipped.startswith(NEVER_FIRED)]
    injected = [f for f in run.faults if f.skipped is None]
    if not injected:
        return out
    starts = [r.start_s for r in run.records if r.seq >= 0]
    ends = [float("inf") if r.end_s is None else r.end_s for r in run.records if r.seq >= 0]
    if not starts:
        return out + [f"{f.kind} {f.target} at {f.time_s:.3f}s: did not overlap any op (no op ran)"
                      for f in injected]
    first, last = min(starts), max(ends)
    for f in injected:
        until = f.time_s if f.end_s is None else f.end_s
        if until < first:
            out.append(f"{f.kind} {f.target} at {f.time_s:.3f}s: did not overlap any op "
                       f"(it was over before op 0 started at {first:.3f}s)")
        elif f.time_s > last:
            out.append(f"{f.kind} {f.target} at {f.time_s:.3f}s: did not overlap any op "
                       f"(every op had ended by {last:.3f}s)")
    return out


def _excused_members(run: RunLog) -> set[int]:
    """Victims of kinds that excuse them (kill, hang), and — only when a fault that may
    legitimately get a live member evicted was injected (the network faults: slow,
    drop_link, partition, netem) — members a published epoch removed. Their unfinished
    ops are expected; everyone else is a survivor whose every op must complete (a member
    that crashed by itself is *not* excused). Each kind's
    :attr:`~resilient.chaos.faults.FaultKind.effect` says which it is."""
    out = {f.victim for f in run.faults if f.victim is not None and f.skipped is None
           and _effect(f).excuses_victim}
    if not any(f.skipped is None and _effect(f).may_evict for f in run.faults):
        return out
    seen: set[int] = set()
    for e in sorted(run.epochs, key=lambda e: e.number):
        seen.update(e.members)
        out.update(seen - set(e.members))
    return out


def _nested(sets: set[tuple[int, ...] | None]) -> bool:
    """reduce_scatter's output on a member is its own shard, and ``contributors`` is that
    shard's set: a member whose shard was final before a failure keeps the larger set,
    the shards finished by recovery have the survivors' set (the dead member's input to
    them is lost). So the sets may differ, but only as a chain of supersets; anything
    else (two unrelated sets) is a disagreement."""
    ordered = sorted((frozenset(x or ()) for x in sets), key=len)
    return all(a <= b for a, b in zip(ordered, ordered[1:]))


def _check_values(run: RunLog, seq: int, recs: Sequence[OpRecord], v: Verdict) -> None:
    sc = run.scenario
    spec = op_spec_for(seq, run.seed, sc.workload.mix)
    sets = {r.contributors for r in recs if r.end_s is not None and r.error is None}
    if len(sets) > 1 and not (spec.collective == "reduce_scatter" and _nested(sets)):
        shown = "; ".join(f"member {r.member}: {sorted(r.contributors or ())}" for r in recs if r.end_s is not None)
        v.wrong.append(Finding(seq, None, f"members disagree on the contributor set ({shown})"))
    cache: dict[tuple[tuple[int, ...], tuple[int, int] | None], Expected] = {}
    for r in recs:
        if r.end_s is None or r.error is not None:
            continue
        v.results_checked += 1
        if spec.collective == "barrier" or r.control:
            continue
        contributors = tuple(r.contributors or ())
        bad = [m for m in contributors if not 0 <= m < sc.world_size]
        if bad or len(set(contributors)) != len(contributors) or not contributors:
            v.wrong.append(Finding(seq, r.member, f"invalid contributor set {list(contributors)}"))
            continue
        if spec.collective in REDUCING or spec.collective == "allgather":
            if r.member not in contributors:
                v.wrong.append(Finding(seq, r.member, f"delivered a {spec.collective} result but is not in its "
                                                      f"contributor set {sorted(contributors)}"))
                continue
        if r.recovered and r.bytes_after_fault is not None:
            v.bytes_resent += r.bytes_after_fault
            if r.member == min(contributors):  # count each op's from-scratch cost once
                k = len(contributors)
                v.bytes_restart += 2 * (k - 1) * spec.numel * np.dtype(spec.dtype).itemsize
        if r.output is None and r.check is not None:
            if r.check != "ok":
                v.wrong.append(Finding(seq, r.member, f"{spec.collective}/{spec.op or '-'}/{spec.dtype} over "
                                                      f"{sorted(contributors)}: {r.check} (checked in the member)"))
            continue
        key = (contributors, r.out_range)
        try:
            if key not in cache:
                cache[key] = expected_output(spec, seq, run.seed, contributors, r.out_range)
        except ValueError as exc:
            v.wrong.append(Finding(seq, r.member, str(exc)))
            continue
        mismatch = compare(r.output, cache[key], spec.dtype)
        if mismatch is not None:
            detail = mismatch.reason
            if mismatch.index is not None:
                detail += f"; first at [{mismatch.index}]: got {mismatch.got!r}, expected {mismatch.want!r}"
            v.wrong.append(Finding(seq, r.member, f"{spec.collective}/{spec.op or '-'}/{spec.dtype} over "
                                                  f"{sorted(contributors)}: {detail}"))


def _recoveries(run: RunLog, survivors: Sequence[int]) -> list[float]:
    """For each injected fault whose kind's recovery is timed (not slow/netem, which
    degrade rather than fail): time until every survivor finished the first op that
    completed after the fault."""
    done: dict[int, list[float]] = defaultdict(list)
    for r in run.records:
        if r.member in survivors and r.end_s is not None and r.error is None:
            done[r.seq].append(r.end_s)
    out = []
    for f in run.faults:
        if f.skipped is not None or not _effect(f).recovery_timed:
            continue
        after = [seq for seq, ends in done.items() if max(ends) > f.time_s]
        if after:
            out.append(max(done[min(after)]) - f.time_s)
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """``q``-th percentile (linear interpolation), ``None`` for no values."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else None
