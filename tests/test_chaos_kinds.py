"""The fault-kind registry: a kind is one class in one file. A tiny kind registered here,
in the test, is parsed (its fields, its checks, its trigger rule), exported to Chaos Mesh
(or rejected with an error naming the fault), injected through the runner's injector (a
real process, a real signal) and verified (its expected effect) — with no other file
knowing about it."""
from __future__ import annotations

import signal
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from resilient.chaos import kinds
from resilient.chaos.faults import MEMBER, ExpectedEffect, Fault, FaultKind, Injector, ParamSpec, ParseContext
from resilient.chaos.injection import FaultLog, RunInjector
from resilient.chaos.k8s import to_manifests
from resilient.chaos.mesh import MeshObject, Selectors
from resilient.chaos.scenario import parse_scenario
from resilient.chaos.supervision import Proc
from resilient.process_pool import ProcessPool, Spec
from resilient.chaos.verifier import FaultEvent, OpRecord, RunLog, verify
from resilient.chaos.workload import expected_output, op_spec_for
from resilient.errors import ScenarioError


class Stall(FaultKind):
    """SIGSTOP a member for ``for_s`` seconds; Chaos Mesh: 100 % loss for that long."""

    name = "stall"
    params = {"member": MEMBER, "for_s": ParamSpec("float", required=True, minimum=0, exclusive_min=True)}
    duration_param = "for_s"
    effect = ExpectedEffect(excuses_victim=True, recovery_timed=False)

    def check(self, params: dict[str, Any], ctx: ParseContext) -> dict[str, Any]:
        if ctx.world_size < 3:
            raise ctx.error("kind", "stall needs world_size >= 3")
        return params

    def inject(self, fault: Fault, ctx: Injector) -> None:
        member, now = fault.params["member"], ctx.now()
        ctx.signal_member(member, signal.SIGSTOP)
        ctx.injected(fault, now, victim=member, end_s=now + fault.params["for_s"])
        ctx.resume_later(member, fault.params["for_s"])

    def chaos_mesh(self, fault: Fault, sel: Selectors) -> list[MeshObject] | None:
        return [("NetworkChaos", {"action": "loss", "selector": sel.workers(fault.params["member"]),
                                  "loss": {"loss": "100"}, "duration": f"{fault.params['for_s']:g}s"})]


class Unexportable(Stall):
    name = "unexportable"

    def chaos_mesh(self, fault: Fault, sel: Selectors) -> list[MeshObject] | None:
        return None


def _yaml(kind: str, world: int = 4, extra: str = "for_s: 0.5", at: str = "{time_s: 0.2}", member: int = 3) -> str:
    return textwrap.dedent(f"""\
        name: t
        world_size: {world}
        workload:
          ops: 3
          mix:
            - {{collective: allreduce, op: sum, dtype: int64, numel: 16}}
        faults:
          - kind: {kind}
            member: {member}
            {extra}
            at: {at}
        """)


@pytest.fixture
def stall():
    with kinds.registered(Stall()) as kind:
        yield kind


def test_every_builtin_kind_is_one_class_in_a_file_of_its_name():
    builtin = kinds.builtin()
    assert {type(k).__module__.rsplit(".", 1)[1] for k in builtin} == {k.name for k in builtin}
    assert {"kill", "hang", "slow", "drop_link", "partition", "etcd_kill", "coordinator_kill", "netem"} \
        == {k.name for k in builtin}
    class Kill2(Stall):
        name = "kill"

    with pytest.raises(ValueError, match="'kill' is already registered"):
        kinds.register(Kill2())
    assert type(kinds.get("kill")).__name__ == "Kill" and "stall" not in kinds.names()


def test_a_kind_registered_in_a_test_is_parsed_with_its_fields_and_checks(stall):
    (f,) = parse_scenario(_yaml("stall"), "s.yaml").faults
    assert f.kind is stall and f.params == {"member": 3, "for_s": 0.5} and f.duration_s == 0.5
    assert f.describe() == "stall member 3 at t=0.2s (for_s=0.5)"
    with pytest.raises(ScenarioError, match=r"s\.yaml:8: faults\[0\]\.for_s: missing required field for stall"):
        parse_scenario(_yaml("stall", extra=""), "s.yaml")
    with pytest.raises(ScenarioError, match=r"s\.yaml:10: faults\[0\]\.for_s: must be > 0, got -1"):
        parse_scenario(_yaml("stall", extra="for_s: -1"), "s.yaml")
    with pytest.raises(ScenarioError, match=r"s\.yaml:8: faults\[0\]\.kind: stall needs world_size >= 3"):
        parse_scenario(_yaml("stall", world=2, member=1), "s.yaml")
    # no failpoint action: an op trigger is refused, naming the field
    with pytest.raises(ScenarioError, match=r"faults\[0\]\.at\.op: stall is injected from outside"):
        parse_scenario(_yaml("stall", at="{op: 1}"), "s.yaml")


def test_an_unregistered_kind_is_an_unknown_kind():
    with pytest.raises(ScenarioError, match=r"faults\[0\]\.kind: 'stall' is not one of .*kill"):
        parse_scenario(_yaml("stall"), "s.yaml")


def test_a_registered_kind_is_exported_to_chaos_mesh_or_rejected_naming_the_fault(stall):
    docs, failpoints = to_manifests(parse_scenario(_yaml("stall"), "s.yaml"), "ml", "r1", flat=True)
    assert failpoints == [] and [d["kind"] for d in docs] == ["NetworkChaos"]
    spec = docs[0]["spec"]
    assert spec["duration"] == "0.5s" and spec["selector"]["labelSelectors"][
        "batch.kubernetes.io/job-completion-index"] == "3"
    (wf,), _ = to_manifests(parse_scenario(_yaml("stall"), "s.yaml"), "ml", "r1")
    loss = [t for t in wf["spec"]["templates"] if t["templateType"] == "NetworkChaos"]
    assert len(loss) == 1 and loss[0]["deadline"] == "0.5s"
    with kinds.registered(Unexportable()):
        sc = parse_scenario(_yaml("unexportable"), "s.yaml")
        with pytest.raises(ScenarioError, match=r"^s\.yaml:8: faults\[0\]\.kind: unexportable has no Chaos Mesh "
                                                r"equivalent.*remove that fault"):
            to_manifests(sc, "ml")


def _run_without_member_3(sc, kind_name: str) -> RunLog:
    """Members 0-2 complete every op exactly over [0, 1, 2]; member 3 (the stall victim)
    stopped before op 0 and never recorded one."""
    recs = []
    for seq in range(sc.workload.ops):
        spec = op_spec_for(seq, 0, sc.workload.mix)
        value = expected_output(spec, seq, 0, (0, 1, 2)).value
        recs += [OpRecord(member=m, seq=seq, start_s=seq, end_s=seq + 0.5, contributors=(0, 1, 2),
                          output=np.array(value)) for m in (0, 1, 2)]
    return RunLog(sc, seed=0, records=recs, faults=[FaultEvent(kind_name, 0.2, "member 3", victim=3, end_s=0.7)])


def test_a_registered_kind_is_verified_by_its_expected_effect(stall):
    sc = parse_scenario(_yaml("stall"), "s.yaml")
    v = verify(_run_without_member_3(sc, "stall"))
    assert v.passed and v.faults == 1 and v.results_checked == 9
    assert v.recoveries == []  # recovery_timed=False
    # the same run, recorded for a kind whose effect excuses nobody: member 3's ops are lost
    class Strict(Stall):
        name = "strict"
        effect = ExpectedEffect()

    with kinds.registered(Strict()):
        v = verify(_run_without_member_3(sc, "strict"))
    assert not v.passed and {(f.seq, f.member) for f in v.lost} == {(0, 3), (1, 3), (2, 3)}
    assert len(v.recoveries) == 1


def test_a_registered_kind_is_injected_through_the_runners_injector(stall, tmp_path: Path):
    sc = parse_scenario(_yaml("stall", extra="for_s: 0.3"), "s.yaml")
    (fault,) = sc.faults
    log_path = tmp_path / "sleeper.log"
    pool = ProcessPool()
    proc = Proc("member-3", pool.start(Spec([sys.executable, "-c", "import time; time.sleep(60)"])), log_path)
    stop = threading.Event()
    log = FaultLog()
    # what this kind uses is real: a process and its signals, timers, the log (no etcd, no store)
    injector = RunInjector("oracle", 0.0, log, stop, tmp_path, {3: proc}, {}, None, None, "job", lambda cid: None)
    try:
        injector.inject(fault)
        (event,) = log.events()
        assert (event.kind, event.victim, event.skipped) == ("stall", 3, None)
        assert event.end_s == pytest.approx(event.time_s + 0.3)
        assert log.resuming() == {3} and log.fired(fault)
        deadline = _deadline(20)
        _wait_until(proc.stopped, deadline, "the member was never stopped")
        _wait_until(lambda: not log.resuming(), deadline, "the member was never resumed")  # after for_s
        _wait_until(lambda: not proc.stopped(), deadline, "the member is still stopped after its SIGCONT")
        assert proc.alive()
    finally:
        stop.set()
        pool.stop(grace=0)


def test_a_kind_whose_injection_raises_is_recorded_as_failed_not_lost(tmp_path: Path):
    class Broken(Stall):
        name = "broken"

        def inject(self, fault: Fault, ctx: Injector) -> None:
            raise RuntimeError("no such device")

    with kinds.registered(Broken()):
        (fault,) = parse_scenario(_yaml("broken"), "s.yaml").faults
    log = FaultLog()
    injector = RunInjector("oracle", 0.0, log, threading.Event(), tmp_path, {}, {}, None, None, "job", lambda cid: None)
    injector.inject(fault)
    (event,) = log.events()
    assert event.kind == "broken" and event.skipped == "injection failed: no such device"


def _deadline(seconds: float) -> float:
    return time.monotonic() + seconds


def _wait_until(cond, deadline: float, what: str) -> None:
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)
