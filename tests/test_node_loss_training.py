"""Acceptance: node loss under elastic DDP training, two real ``resilient-run`` agents.

One etcd (the session fixture), one ``resilient coordinator`` started here, and two node
agents (``--rdzv-backend etcd --nnodes 1:2 --nproc-per-node 2``) on loopback with distinct
``--local-addr`` (127.0.0.2 / 127.0.0.3: the agent-hosted TCPStore and the workers'
data-plane listeners bind there), each running examples/train.py with ``--log-dir``.
Node A starts alone (MIN is 1: it does not wait); node B is admitted later (MAX is 2) as a
joiner and synced. Once all four workers train in one world of 4, agent B and its two
workers are SIGKILLed by PID (node loss: nobody revokes their leases, they expire).

Asserted: node A's workers keep their PIDs and never restart (no second log file, every
record ``restart == 0``, no restart in agent A's log); they continue in a newer epoch with
world 2; at every step every member that logged it has bitwise identical parameters;
training completes and agent A exits 0."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launcher_util import ROOT, alive, wait_for

TRAIN = os.path.join(ROOT, "examples", "train.py")
RUN = [sys.executable, "-c", "import sys; from resilient.launcher.cli import main; sys.exit(main())"]
COORDINATOR = [sys.executable, "-c", "import sys; from resilient.cli import main; sys.exit(main(sys.argv[1:]))",
               "coordinator"]
STEPS = 200
STEP_SLEEP = 0.1  # >= 20 s of training: room for node B to start, join and be killed mid-run
pytestmark = pytest.mark.slow


def read_records(log_dir: Path) -> dict[int, list[dict]]:
    """Per worker PID, its per-step JSON records (event lines and a line cut by a kill skipped)."""
    out: dict[int, list[dict]] = {}
    for f in log_dir.glob("*.jsonl"):
        recs = []
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "event" not in rec:
                recs.append(rec)
        out[int(f.stem)] = recs
    return out


class Proc:
    """A process in its own session with its output in a file; :meth:`kill` ends it by PID."""

    def __init__(self, cmd: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in kill()
        env = dict(os.environ, PYTHONPATH=ROOT, RESILIENT_LOG_LEVEL="INFO")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


@pytest.mark.timeout(180)
def test_node_loss_survivors_continue_without_restart(etcd_session, job_name, tmp_path):
    procs: list[Proc] = []
    worker_pids: set[int] = set()
    dirs = {n: tmp_path / n for n in ("a", "b")}
    for d in dirs.values():
        d.mkdir()

    def agent(name: str, addr: str) -> Proc:
        p = Proc(RUN + ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_session.endpoint_arg, "--rdzv-id", job_name,
                        "--nnodes", "1:2", "--nproc-per-node", "2", "--local-addr", addr, "--lease-ttl", "2",
                        TRAIN, "--steps", str(STEPS), "--step-sleep", str(STEP_SLEEP), "--log-dir", str(dirs[name])],
                 tmp_path / f"agent-{name}.log")
        procs.append(p)
        return p

    def records(name: str) -> dict[int, list[dict]]:
        recs = read_records(dirs[name])
        worker_pids.update(recs)
        return recs

    def running(*agents: Proc) -> None:
        for p in agents:
            assert p.proc.poll() is None, f"an agent exited early (rc {p.proc.returncode}):\n{p.output()[-4000:]}"

    try:
        procs.append(Proc(COORDINATOR + ["--etcd", etcd_session.endpoint_arg, "--job", job_name, "--min-members", "2",
                                         "--metrics-port", "-1", "--ttl", "2"], tmp_path / "coordinator.log"))
        a = agent("a", "127.0.0.2")

        def a_training():
            running(a)
            recs = records("a")
            return len(recs) == 2 and all(r and r[-1]["step"] >= 2 for r in recs.values())

        wait_for(a_training, 60, "node A's two workers to train (MIN is 1: A does not wait for B)")
        a_pids = set(records("a"))
        b = agent("b", "127.0.0.3")

        def world_of_4():
            running(a, b)
            ra, rb = records("a"), records("b")
            if len(rb) != 2:
                return False
            # a step trained by all four, and B's workers have done a few steps in that world
            by_step: dict[int, set[int]] = {}
            for pid, recs in {**ra, **rb}.items():
                for r in recs:
                    if r["world"] == 4:
                        by_step.setdefault(r["step"], set()).add(pid)
            full = [s for s, pids in by_step.items() if len(pids) == 4]
            return len(full) >= 3 and max(full)

        joint_step = wait_for(world_of_4, 60, "both nodes' workers to train in one world of 4")
        b_pids = set(records("b"))
        assert not b_pids & a_pids
        # node loss: agent B and its workers, SIGKILLed by PID (workers run in their own sessions)
        os.kill(b.proc.pid, signal.SIGKILL)
        for pid in b_pids:
            os.kill(pid, signal.SIGKILL)
        b.proc.wait(timeout=10)
        wait_for(lambda: not any(alive(p) for p in b_pids), 10, "node B's workers to die")
        killed_after = max(r["step"] for recs in records("b").values() for r in recs)
        assert killed_after < STEPS - 1, "node B was killed after training ended: raise STEPS"

        try:
            rc = a.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent A did not finish within 120 s:\n{a.output()[-4000:]}") from None
        a_out = a.output()
        assert rc == 0, a_out[-4000:]
    finally:
        for p in reversed(procs):
            p.kill()
        for pid in worker_pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)

    ra, rb = records("a"), records("b")
    # A's workers never restarted: the same two PIDs logged from first step to last
    assert set(ra) == a_pids and len(a_pids) == 2, (set(ra), a_pids)
    assert all(r["restart"] == 0 for recs in ra.values() for r in recs)
    assert "restart 1" not in a_out and "restarting" not in a_out.lower(), a_out[-4000:]
    # the joint world: B's workers were admitted as joiners into a world of 4
    assert all(r["world"] == 4 for recs in rb.values() for r in recs), rb
    a_members = {r["member"] for recs in ra.values() for r in recs}
    assert len(a_members) == 2, a_members
    epoch4 = max(r["epoch"] for recs in ra.values() for r in recs if r["world"] == 4)
    # A continued past the loss in a newer epoch with world 2, to the last step
    for pid, recs in ra.items():
        steps = [r["step"] for r in recs]
        assert steps == list(range(steps[0], steps[-1] + 1)), f"worker {pid} skipped or repeated steps"
        assert steps[-1] == STEPS - 1, (pid, steps[-1])
        after = [r for r in recs if r["step"] > killed_after + 5]
        assert after and all(r["world"] == 2 and r["epoch"] > epoch4 for r in after), after[:3]
        assert all(set(r["contributors"]) == a_members for r in after), after[:3]
    # bitwise identical parameters across every member that logged a step
    by_step: dict[int, list[dict]] = {}
    for recs in (*ra.values(), *rb.values()):
        for r in recs:
            by_step.setdefault(r["step"], []).append(r)
    for s, recs in by_step.items():
        assert len({r["params_sha"] for r in recs}) == 1, (s, recs)
    assert joint_step <= killed_after
