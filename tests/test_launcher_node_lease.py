"""The node agent (resilient-run's default) with the real launcher: one lease and one
``nodes/<node>`` record per node agent; ranks join, learn epochs and report health through the agent's local
channel (no etcd watch, member key or keep-alive of their own); a SIGKILLed rank is
published as an epoch without it and without touching its siblings; a SIGSTOPped rank is
removed by the agent when its beats stop. Real etcd, coordinator, launcher, workers and
signals."""
from __future__ import annotations

import json
import os
import signal

from cp_helpers import CoordinatorThread
from launcher_util import SCRIPTS, Launcher, read_dump, wait_for
from resilient.coordinator import Store, keys
from resilient.coordinator.directory import NodeRecord
from resilient.coordinator.epoch import read_epoch
from test_launcher_agent import _etcd_args

WORKER = os.path.join(SCRIPTS, "node_worker.py")


def test_node_record_epoch_relay_health_exit_and_hang(etcd_session, job_name, tmp_path):
    store = Store(etcd_session.endpoints)
    coord = CoordinatorThread(etcd_session.endpoints, job_name, min_members=4)
    stop = str(tmp_path / "stop")
    run = Launcher(_etcd_args(etcd_session, job_name, "--nproc-per-node", "4", "--lease-ttl", "2",
                              "--node-health-interval", "0.5", WORKER),
                   str(tmp_path / "d"), {"STOP_FILE": stop, "OPS": "15", "OP_GAP": "0.1"})
    stopped = None

    def dump(lr: int) -> dict:
        return read_dump(run.dump_dir, lr, 0) or {}

    def epoch_members() -> list[str]:
        e, _ = read_epoch(store, job_name)
        return sorted(e.members) if e else []

    try:
        d = [run.dump(i, timeout=90) for i in range(4)]
        ids = [x["MEMBER"] for x in d]
        wait_for(lambda: all(dump(i).get("members") and len(dump(i)["members"]) == 4 for i in range(4)), 60,
                 "every rank to hold the 4-member epoch; log:\n" + run.output())
        for i in range(4):   # the epoch reached every rank through the agent, not an etcd watch of its own
            assert dump(i)["watches_opened"] == 0 and dump(i)["epochs_relayed"] >= 1, dump(i)
        assert store.get_prefix(keys.members(job_name)) == []          # no per-rank member records
        (node_kv,) = store.get_prefix(keys.nodes(job_name))            # one node record, on the node lease
        node = NodeRecord.from_json(node_kv.value, node_kv.key)
        assert sorted(r.member_id for r in node.ranks) == sorted(ids)
        assert store.lease_ttl(node_kv.lease) is not None
        for x in d:   # each worker's own lease (for a worker that registers itself) is revoked once it joined
            assert int(x["RESILIENT_LEASE_ID"]) != node_kv.lease
            wait_for(lambda x=x: store.lease_ttl(int(x["RESILIENT_LEASE_ID"])) is None, 15,
                     "the spare lease revoked")
        assert all(r.address for r in node.ranks)                      # each rank's listener, from its hello
        # hierarchical health: the ranks' windows arrive as one health/<node> summary, no per-rank key
        summary = wait_for(lambda: store.get(keys.health_of(job_name, node.node)), 30, "the node's health summary")
        body = json.loads(summary.value)
        assert body["v"] == 3 and set(body["ranks"]) <= set(ids) and body["ranks"]
        assert [kv.key for kv in store.get_prefix(keys.health(job_name))] == [summary.key]

        first = dump(0)["epoch"]
        os.kill(int(d[3]["PID"]), signal.SIGKILL)                     # an exit: seen by the agent at once
        wait_for(lambda: epoch_members() == sorted(ids[:3]), 30, "an epoch without the killed rank; log:\n"
                 + run.output())
        e, _ = read_epoch(store, job_name)
        # member_lost: the coordinator found the agent's departed/ marker (revoke path, not an expiry)
        assert e.removed == (ids[3],) and e.cause == "member_lost"     # the siblings were not touched
        assert f"(signal 9): removed member {ids[3]}" in run.output()
        wait_for(lambda: all(dump(i).get("epoch") == e.number for i in range(3)), 30, "the relay of that epoch")
        assert all(dump(i)["watches_opened"] == 0 and dump(i)["epoch"] > first for i in range(3))

        stopped = int(d[2]["PID"])
        os.kill(stopped, signal.SIGSTOP)                              # a hang: only the missing beats tell
        wait_for(lambda: epoch_members() == sorted(ids[:2]), 30, "an epoch without the hung rank; log:\n"
                 + run.output())
        e, _ = read_epoch(store, job_name)
        assert e.removed == (ids[2],) and e.cause == "member_lost"
        assert f"(heartbeat stale for more than 2s): removed member {ids[2]}" in run.output()
        node = NodeRecord.from_json(store.get(node_kv.key).value, node_kv.key)
        assert sorted(r.member_id for r in node.ranks) == sorted(ids[:2])
        os.kill(stopped, signal.SIGCONT)
        stopped = None
        wait_for(lambda: dump(2).get("lost"), 30, "the hung rank to be told it was removed")
        assert not dump(0)["lost"] and not dump(1)["lost"]
        open(stop, "w").close()
        run.wait()
        wait_for(lambda: store.lease_ttl(node_kv.lease) is None, 15, "the node lease revoked at the end")
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        run.close()
        coord.close()
        store.close()
