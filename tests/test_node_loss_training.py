"""Acceptance: node loss under elastic DDP training, two real ``resilient-run`` agents.

One etcd, one ``resilient coordinator`` started here, and two node agents
(``--rdzv-backend etcd --nnodes 1:2 --nproc-per-node 2``), each running examples/train.py
with ``--log-dir``, placed by the ``placement`` fixture — the only difference between the
two ways it runs:

- ``netns`` (root with working network namespaces, probed by
  :func:`resilient.chaos.netns.netns_unavailable_reason`): each agent and its workers run
  in their own namespace of a :class:`~resilient.chaos.netns.NetnsLab` (veth to a bridge),
  ``--local-addr`` is that namespace's IP; etcd listens on the bridge's host IP, the
  coordinator runs in the host namespace;
- ``loopback`` (elsewhere, or ``RESILIENT_TEST_NETNS=0``): the session etcd on 127.0.0.1
  and distinct ``--local-addr`` 127.0.0.2 / 127.0.0.3.

Either way the agent-hosted TCPStore and the workers' data-plane listeners bind on the
node's address (asserted through the members' addresses in etcd).
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
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from dataclasses import dataclass

import pytest

from launcher_util import ROOT, alive, private_tmpdir, wait_for
from resilient.chaos.netns import NetnsLab, netns_unavailable_reason
from resilient.coordinator import keys
from resilient.coordinator.directory import NodeRecord
from resilient.coordinator.local_etcd import LocalEtcd
from resilient.coordinator.membership import MemberInfo
from resilient.coordinator.store import Store

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


@dataclass
class Placement:
    """Where the two nodes live: ``addr[node]`` (its --local-addr), ``prefix[node]`` (the
    argv prefix that runs a command there: ``ip netns exec NS`` or nothing) and the etcd."""

    kind: str
    etcd: LocalEtcd
    addr: dict[str, str]
    prefix: dict[str, list[str]]


@pytest.fixture
def placement(request):
    """Each node in its own network namespace where root allows, else loopback."""
    if os.environ.get("RESILIENT_TEST_NETNS", "1") != "0" and netns_unavailable_reason() is None:
        with NetnsLab(2) as lab, LocalEtcd(host=lab.host_ip) as etcd:
            yield Placement("netns", etcd, {"a": lab.ips[0], "b": lab.ips[1]},
                            {"a": lab.exec_prefix(0), "b": lab.exec_prefix(1)})
    else:
        yield Placement("loopback", request.getfixturevalue("etcd_session"),
                        {"a": "127.0.0.2", "b": "127.0.0.3"}, {"a": [], "b": []})


class Proc:
    """A process in its own session with its output in a file; :meth:`kill` ends it by PID
    (``ip netns exec`` execs the command, so a prefixed command keeps its PID)."""

    def __init__(self, cmd: list[str], log_path: Path, extra_env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in kill()
        # a TMPDIR of its own, removed by kill(): a SIGKILLed agent (the node loss) cannot
        # remove its run directory (the channel socket) itself
        self._tmp = private_tmpdir()
        env = dict(os.environ, PYTHONPATH=ROOT, RESILIENT_LOG_LEVEL="INFO", TMPDIR=self._tmp, **(extra_env or {}))
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
        shutil.rmtree(self._tmp, ignore_errors=True)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("join_tree", ["0", "1"], ids=["joinseq-keys", "join-tree"])
def test_node_loss_survivors_continue_without_restart(placement, job_name, tmp_path, join_tree):
    # join-tree: node B's admission agreed along the tree (RESILIENT_JOIN_TREE=1); the
    # rebuild after it runs a fresh Communicator per rank on the same transports (it used
    # to hang in its first op, 2 runs of 3: docs/scale.md)
    etcd = placement.etcd
    procs: list[Proc] = []
    worker_pids: set[int] = set()
    dirs = {n: tmp_path / n for n in ("a", "b")}
    for d in dirs.values():
        d.mkdir()

    def agent(name: str) -> Proc:
        p = Proc(placement.prefix[name] + RUN + [
                        "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoint_arg, "--rdzv-id", job_name,
                        "--nnodes", "1:2", "--nproc-per-node", "2", "--local-addr", placement.addr[name],
                        "--lease-ttl", "2",
                        TRAIN, "--steps", str(STEPS), "--step-sleep", str(STEP_SLEEP), "--log-dir", str(dirs[name])],
                 tmp_path / f"agent-{name}.log", {"RESILIENT_JOIN_TREE": join_tree})
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
        procs.append(Proc(COORDINATOR + ["--etcd", etcd.endpoint_arg, "--job", job_name, "--min-members", "2",
                                         "--metrics-port", "-1", "--ttl", "2"], tmp_path / "coordinator.log"))
        a = agent("a")

        def a_training():
            running(a)
            recs = records("a")
            return len(recs) == 2 and all(r and r[-1]["step"] >= 2 for r in recs.values())

        wait_for(a_training, 60, "node A's two workers to train (MIN is 1: A does not wait for B)")
        a_pids = set(records("a"))
        b = agent("b")

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
        # each node's workers listen on that node's address (its namespace IP, or loopback alias)
        store = Store(etcd.endpoints)
        try:
            # the node agents' nodes/<node> records (resilient-run's default) and any members/ record
            infos = [MemberInfo.from_json(kv.value) for kv in store.get_prefix(keys.members(job_name))]
            infos += [r for kv in store.get_prefix(keys.nodes(job_name))
                      for r in NodeRecord.from_json(kv.value, kv.key).ranks]
            hosts = sorted(i.address.rsplit(":", 1)[0] for i in infos)
        finally:
            store.close()
        assert hosts == sorted([placement.addr["a"]] * 2 + [placement.addr["b"]] * 2), (placement.kind, hosts)
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
