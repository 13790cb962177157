"""--nnodes MIN:MAX through etcd: agents on loopback form one job, late nodes join up to
MAX, a SIGKILLed node (agent + workers) frees its slot while the others keep running."""
from __future__ import annotations

import json
import os
import signal

import pytest

from launcher_util import SCRIPTS, Launcher, alive, wait_for
from resilient.coordinator.store import Store
from resilient.launcher.rendezvous import slots_prefix

WORKER = os.path.join(SCRIPTS, "worker.py")
pytestmark = pytest.mark.slow


def test_nodes_wait_for_min_admit_up_to_max_and_survive_node_loss(etcd_session, job_name, tmp_path):
    store = Store(etcd_session.endpoints)
    stop = str(tmp_path / "stop")
    args = ["--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint",
            etcd_session.endpoint_arg, "--rdzv-id", job_name, "--lease-ttl", "2", "--local-addr", "127.0.0.1"]
    agents: list[Launcher] = []

    def start(name: str, *extra: str) -> Launcher:
        a = Launcher([*args, *extra, WORKER], str(tmp_path / name), {"STOP_FILE": stop})
        agents.append(a)
        return a

    def slots() -> dict[int, dict]:
        pre = slots_prefix(job_name)
        return {int(kv.key[len(pre):]): json.loads(kv.value) for kv in store.get_prefix(pre)}

    try:
        a = start("a")
        wait_for(lambda: 0 in slots(), 60, "agent a to register its node")
        # MIN is 2: a's worker must not start yet
        assert a.proc.poll() is None and not os.path.exists(os.path.join(a.dump_dir, "0.0.json"))
        b = start("b")
        wa, wb = a.dump(0), b.dump(0)
        assert {wa["GROUP_RANK"], wb["GROUP_RANK"]} == {"0", "1"}
        assert {wa["RANK"], wb["RANK"]} == {"0", "1"}
        for w in (wa, wb):
            assert (w["GROUP_WORLD_SIZE"], w["WORLD_SIZE"], w["RESILIENT_JOINER"]) == ("2", "2", "0")
        assert (wa["MASTER_ADDR"], wa["MASTER_PORT"]) == (wb["MASTER_ADDR"], wb["MASTER_PORT"])
        assert wa["MASTER_ADDR"] == "127.0.0.1"
        # a third node is admitted (MAX 3) as a joiner
        c = start("c")
        wc = c.dump(0)
        assert (wc["GROUP_RANK"], wc["RESILIENT_JOINER"], wc["RANK"]) == ("2", "1", "2")
        # a fourth is refused with a clear error once its join timeout passes
        d = start("d", "--rdzv-conf", "join_timeout=1")
        assert d.wait() == 1
        assert "already has --nnodes max=3 nodes" in d.output()
        # node loss: SIGKILL agent b and its worker
        b_agent = b.proc.pid
        os.kill(b_agent, signal.SIGKILL)
        os.kill(int(wb["PID"]), signal.SIGKILL)
        b.proc.wait(timeout=10)
        lost = int(wb["GROUP_RANK"])
        wait_for(lambda: lost not in slots(), 30, "the lost node's slot to expire with its lease")
        wait_for(lambda: store.lease_ttl(int(wb["RESILIENT_LEASE_ID"])) is None, 30, "the lost worker's lease to expire")
        # the other nodes' workers never restarted
        for agent, w in ((a, wa), (c, wc)):
            assert agent.proc.poll() is None and alive(int(w["PID"]))
            assert not os.path.exists(os.path.join(agent.dump_dir, "0.1.json"))
        # a replacement node takes the freed slot, as a joiner
        e = start("e")
        we = e.dump(0)
        assert (we["GROUP_RANK"], we["RESILIENT_JOINER"]) == (str(lost), "1")
        open(stop, "w").close()
        for agent in (a, c, e):
            assert agent.wait() == 0, agent.output()
        wait_for(lambda: not slots(), 10, "every node slot to be released on clean exit")
    finally:
        for agent in agents:
            agent.close()
        store.close()
