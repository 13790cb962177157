"""The chaos runner end to end: real etcd, real coordinator processes, real member
processes, real SIGKILL/SIGSTOP/SIGCONT — with the `oracle` member backend (members
compute results without collectives), so these tests prove the runner, the injection and
the verifier pipeline on their own; the same scenarios against the real collectives
(the default `resilient` backend) are in tests/test_chaos_real.py.

Every test checks that each process the runner started is gone afterwards."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from resilient.chaos.runner import ChaosRunner
from resilient.chaos.scenario import find_scenario, parse_scenario
from resilient.chaos.verifier import verify

pytestmark = pytest.mark.slow


def _scenario(tmp_path, text: str):
    path = tmp_path / "scenario.yaml"
    path.write_text(textwrap.dedent(text))
    return parse_scenario(path.read_text(), str(path))


def _run(scenario, seed=0, tmp_path=None, worker_args=(), **kwargs):
    runner = ChaosRunner(scenario, seed, tmp_path / f"wd{seed}" if tmp_path else None, backend="oracle",
                         worker_args=worker_args, **kwargs)
    log = runner.run()
    procs = list(runner.workers.values()) + list(runner.coordinators.values())
    assert all(p.popen.poll() is not None for p in procs), "the runner left a process behind"
    assert not any(m.running for m in runner.etcd.members), "the runner left etcd running"
    return runner, log


@pytest.mark.parametrize("seed", [0, 1])
def test_op_triggered_kill_is_injected_and_verified(tmp_path, seed):
    runner, log = _run(find_scenario("kill-reduce-scatter"), seed, tmp_path=tmp_path)
    assert runner.workers[1].popen.returncode == -9  # the victim SIGKILLed itself at op 3
    (fault,) = log.faults
    assert (fault.kind, fault.victim, fault.skipped) == ("kill", 1, None)
    victim_ops = {r.seq: r for r in log.records if r.member == 1}
    assert max(victim_ops) == 3 and victim_ops[3].end_s is None  # started op 3, never finished
    assert [e.members for e in log.epochs[:2]] == [(0, 1, 2, 3), (0, 2, 3)]  # revoked at once
    v = verify(log)
    assert v.passed and v.ops == 8 and v.faults == 1
    assert len(v.recoveries) == 1 and v.recoveries[0] >= 0


def test_timed_hang_stops_and_resumes_the_member(tmp_path):
    sc = _scenario(tmp_path, """\
        name: hang-short
        world_size: 3
        lease_ttl_s: 5
        workload:
          ops: 30
          mix: [{collective: allreduce, op: sum, dtype: int32, numel: 64}]
        faults:
          - {kind: hang, member: 2, at: {time_s: 0.3}, resume_after_s: 0.6}
        """)
    runner, log = _run(sc, tmp_path=tmp_path, worker_args=["--pace-s", "0.05"])
    (fault,) = log.faults
    assert (fault.kind, fault.victim) == ("hang", 2) and fault.end_s == pytest.approx(fault.time_s + 0.6)
    ops = sorted((r for r in log.records if r.member == 2), key=lambda r: r.seq)
    assert len(ops) == 30 and all(r.end_s is not None for r in ops)  # resumed and finished everything
    # Really stopped: the member's timeline (each op's start and end) has exactly one gap of
    # 0.5 s or more, and it spans the fault. The stop may land inside an op (that op lasts
    # the pause) or between one op's end and the next op's start; both are the same pause.
    stamps = [t for r in ops for t in (r.start_s, r.end_s)]
    assert stamps == sorted(stamps)
    gaps = [(a, b) for a, b in zip(stamps, stamps[1:]) if b - a >= 0.5]
    assert len(gaps) == 1 and gaps[0][0] <= fault.time_s <= gaps[0][1], (gaps, fault.time_s)
    assert runner.workers[2].popen.returncode == 0
    assert verify(log).passed


def test_time_triggers_count_from_the_moment_every_member_started_op_0(tmp_path):
    sc = _scenario(tmp_path, """\
        name: kill-at-zero
        world_size: 3
        workload:
          ops: 40
          mix: [{collective: allreduce, op: sum, dtype: int32, numel: 64}]
        faults:
          - {kind: kill, member: 2, at: {time_s: 0}}
        """)
    runner, log = _run(sc, tmp_path=tmp_path, worker_args=["--pace-s", "0.05"])
    op0 = {r.member: r.start_s for r in log.records if r.seq == 0}
    assert sorted(op0) == [0, 1, 2]  # the victim too had started op 0 before the fault
    assert log.ops_start_s == pytest.approx(max(op0.values()))
    (fault,) = log.faults
    assert fault.kind == "kill" and fault.skipped is None and fault.time_s >= log.ops_start_s
    assert runner.workers[2].popen.returncode == -9
    v = verify(log)
    assert v.passed and v.vacuous == [] and v.faults == 1


def test_a_timed_fault_that_hit_no_op_fails_the_run(tmp_path):
    """The workload ends long before the fault's time: the fault never fires, and the
    run is reported as vacuous (exit 1), never as a pass."""
    path = tmp_path / "late.yaml"
    path.write_text(textwrap.dedent("""\
        name: late-fault
        world_size: 3
        workload:
          ops: 5
          mix: [{collective: allreduce, op: sum, dtype: int64, numel: 64}]
        faults:
          - {kind: kill, member: 1, at: {time_s: 600}}
        """))
    cmd = [sys.executable, "-c", "import sys; from resilient.cli import main; sys.exit(main())", "chaos", "run",
           str(path), "--seeds", "1", "--backend", "oracle"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "VACUOUS" in p.stdout and "the run ended before t=600s" in p.stdout
    final = json.loads(p.stdout.strip().splitlines()[-1])
    assert final["vacuous"] == 1 and final["passed"] is False and final["wrong"] == final["hangs"] == 0


def test_a_member_lost_before_op_0_restarts_the_seed_not_fails_the_scenario(tmp_path, capfd):
    """Start-up is not under test: a member that leaves before every member started op 0
    (here the test hook makes one exit) is a StartFailed; run_scenario starts the seed again."""
    from resilient.chaos.runner import StartFailed, run_scenario

    sc = find_scenario("kill-reduce-scatter")
    flag = tmp_path / "failed-once"
    with pytest.raises(StartFailed, match=r"member \d exited \(code 3\) before every member had started op 0"):
        run_scenario(sc, 0, tmp_path / "a", backend="oracle", worker_args=["--fail-start-once", str(flag)],
                     start_attempts=1)
    flag.unlink()
    log = run_scenario(sc, 0, tmp_path / "b", backend="oracle", worker_args=["--fail-start-once", str(flag)])
    assert "start-up failed, starting the seed again (1/3)" in capfd.readouterr().err
    v = verify(log)
    assert v.passed and v.ops == 8 and v.faults == 1


def test_broken_contributor_reporting_fails_the_run(tmp_path):
    """Proof the pipeline can fail: members that report a wrong contributor set."""
    _, log = _run(find_scenario("kill-all-gather"), tmp_path=tmp_path, worker_args=["--oracle-bug", "contributors"])
    v = verify(log)
    assert not v.passed and len(v.wrong) >= 3 * 6  # every survivor, every op from op 1 on
    # members 0..2 (2 until it was killed) delivered values that are not the reduction over
    # the set they reported; member 3 delivered a result it reported itself outside of
    assert {f.member for f in v.wrong if "checked in the member" in f.reason} == {0, 1, 2}
    assert {f.member for f in v.wrong if "not in its contributor set" in f.reason} == {3}


def test_coordinator_leader_loss_standby_publishes_the_next_epoch(tmp_path):
    sc = _scenario(tmp_path, """\
        name: leader-short
        world_size: 3
        coordinators: 2
        lease_ttl_s: 1
        workload:
          duration_s: 3
          mix: [{collective: allreduce, op: sum, dtype: int64, numel: 64}]
        faults:
          - {kind: coordinator_kill, target: leader, at: {time_s: 0.5}}
          - {kind: kill, member: 1, at: {time_s: 1.0}}
        """)
    runner, log = _run(sc, tmp_path=tmp_path, worker_args=["--pace-s", "0.05"])
    leader_kill, member_kill = log.faults
    assert leader_kill.kind == "coordinator_kill" and leader_kill.skipped is None
    killed = leader_kill.target.split()[1]
    assert runner.coordinators[killed].popen.returncode == -9
    later = [e for e in log.epochs if e.time_s > member_kill.time_s]
    assert later and 1 not in later[0].members  # published by the standby
    assert verify(log).passed


def test_etcd_member_loss_with_restart(tmp_path):
    sc = _scenario(tmp_path, """\
        name: etcd-short
        world_size: 3
        etcd_members: 3
        workload:
          duration_s: 2.5
          mix: [{collective: allreduce, op: sum, dtype: int64, numel: 64}]
        faults:
          - {kind: etcd_kill, etcd_member: 0, at: {time_s: 0.5}, restart_after_s: 1.0}
          - {kind: kill, member: 2, at: {time_s: 1.0}}
        """)
    # the workload ends only once an epoch without member 2 was published (60 s at most):
    # under load the control plane may take longer than the 2.5 s workload to get there
    without_2 = lambda r: any(2 not in e.members for e in r.epochs)  # noqa: E731
    runner, log = _run(sc, tmp_path=tmp_path, worker_args=["--pace-s", "0.05"], end_condition=without_2)
    etcd_fault = log.faults[0]
    assert etcd_fault.kind == "etcd_kill" and etcd_fault.skipped is None and etcd_fault.end_s == pytest.approx(
        etcd_fault.time_s + 1.0)
    assert any(2 not in e.members for e in log.epochs)  # the control plane kept working on 2 of 3
    assert verify(log).passed


def test_cli_run_with_oracle_backend_prints_final_json_and_writes_reports(tmp_path):
    cmd = [sys.executable, "-c", "import sys; from resilient.cli import main; sys.exit(main())", "chaos", "run",
           "kill-all-gather", "--seeds", "2", "--backend", "oracle", "--json", str(tmp_path / "out.json"),
           "--report", str(tmp_path / "rep")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    final = json.loads(p.stdout.strip().splitlines()[-1])
    assert {"ops", "faults", "wrong", "hangs", "recovery_p50_s", "recovery_p99_s"} <= set(final)
    assert final["wrong"] == 0 and final["hangs"] == 0 and final["faults"] == 2 and final["ops"] == 16
    assert json.loads((tmp_path / "out.json").read_text()) == final
    assert sorted(x.name for x in (tmp_path / "rep").iterdir()) == [
        "summary.json", "table.txt", "timeline-seed0.png", "timeline-seed1.png"]


def test_cli_skips_a_root_scenario_without_root(monkeypatch, capsys):
    from resilient.cli import main

    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert main(["chaos", "run", "netem"]) == 3
    assert "SKIPPED: scenario 'netem' needs root" in capsys.readouterr().err


def test_cli_run_where_no_fault_could_be_injected_is_skipped_not_passed(tmp_path):
    path = tmp_path / "drop.yaml"
    path.write_text(textwrap.dedent("""\
        name: drop-short
        world_size: 3
        workload:
          duration_s: 0.6
          mix: [{collective: allreduce, op: sum, dtype: int64, numel: 64}]
        faults:
          - {kind: drop_link, link: [0, 1], duration_s: 0.2, at: {time_s: 0.1}}
        """))
    cmd = [sys.executable, "-c", "import sys; from resilient.cli import main; sys.exit(main())", "chaos", "run",
           str(path), "--seeds", "1", "--backend", "oracle"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "no fault of 'drop-short' could be injected here" in p.stderr
    final = json.loads(p.stdout.strip().splitlines()[-1])
    assert final["faults"] == 0 and final["skipped"] and "link" in final["skipped"][0]


def _processes_mentioning(text: str) -> list[int]:
    import os

    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def test_sigterm_to_a_run_stops_every_process_it_started(tmp_path):
    import os
    import signal
    import time

    workdir = tmp_path / "wd"
    cmd = [sys.executable, "-c", "import sys; from resilient.cli import main; sys.exit(main())", "chaos", "run",
           "slow-member", "--seeds", "1", "--backend", "oracle", "--workdir", str(workdir)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (workdir / "seed0" / "go").exists():  # every member is up and running
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.05)
        workers = [pid for pid in _processes_mentioning(str(workdir)) if pid != p.pid]
        assert len(workers) == 4
        with open(f"/proc/{workers[0]}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        job, etcd = argv[argv.index("--job") + 1], argv[argv.index("--etcd") + 1]
        assert len(_processes_mentioning(job)) == 5  # 4 members + the coordinator
        assert len(_processes_mentioning(etcd)) >= 5  # ... and etcd itself
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 130
    finally:
        if p.poll() is None:  # graceful first, so the runner still stops what it started
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    for text in (str(workdir), job, etcd):
        assert _processes_mentioning(text) == [], f"left behind: processes mentioning {text}"
