"""RESILIENT_NODE_LEASE=1: one lease per node agent, the agent vouches for its ranks —
a killed worker leaves at once without touching its siblings, a SIGSTOPped (hung) one is
removed when its heartbeat goes stale. Real launcher, real workers, real etcd."""
from __future__ import annotations

import os
import signal

from resilient.coordinator import Store, keys
from tests.launcher_util import Launcher, wait_for
from tests.test_launcher_agent import WORKER, _etcd_args


def test_node_lease_shared_exit_and_hang_vouched_by_the_agent(etcd_session, job_name, tmp_path):
    store = Store(etcd_session.endpoints)
    stop = str(tmp_path / "stop")
    run = Launcher(_etcd_args(etcd_session, job_name, "--nproc-per-node", "3", "--lease-ttl", "2",
                              os.path.join(os.path.dirname(WORKER), "member_worker.py")),
                   str(tmp_path / "d"), {"STOP_FILE": stop, "RESILIENT_NODE_LEASE": "1"})
    stopped = None
    try:
        dumps = [run.dump(i) for i in range(3)]
        mkeys = [keys.member(job_name, d["RESILIENT_MEMBER_ID"]) for d in dumps]
        wait_for(lambda: all(store.get(k) for k in mkeys), 30, "all three members registered")
        leases = {store.get(k).lease for k in mkeys}
        assert len(leases) == 1 and leases == {int(dumps[0]["RESILIENT_LEASE_ID"])}   # one node lease
        node_lease = leases.pop()
        os.kill(int(dumps[2]["PID"]), signal.SIGKILL)                 # an exit: seen by the agent at once
        wait_for(lambda: store.get(mkeys[2]) is None, 30, "the killed worker's member key to go; log:\n" + run.output())
        marker = store.get(keys.departed_of(job_name, dumps[2]["RESILIENT_MEMBER_ID"]))
        assert marker is not None and b"signal 9" in marker.value
        assert store.get(mkeys[0]) is not None and store.lease_ttl(node_lease) is not None   # siblings stay
        stopped = int(dumps[1]["PID"])
        os.kill(stopped, signal.SIGSTOP)                              # a hang: only the heartbeat tells
        wait_for(lambda: store.get(mkeys[1]) is None, 30, "the hung worker to be vouched out")
        assert b"heartbeat stale" in store.get(keys.departed_of(job_name, dumps[1]["RESILIENT_MEMBER_ID"])).value
        assert store.get(mkeys[0]) is not None and store.lease_ttl(node_lease) is not None
        os.kill(stopped, signal.SIGCONT)
        stopped = None
        open(stop, "w").close()
        run.wait()
        wait_for(lambda: store.lease_ttl(node_lease) is None, 15, "the node lease revoked at the end")
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        run.close()
        store.close()
