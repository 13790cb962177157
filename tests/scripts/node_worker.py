"""Test worker for node-lease mode: ``resilient.connect()`` through the node agent
(RESILIENT_AGENT_SOCKET, set by resilient-run with RESILIENT_NODE_LEASE=1), with health
reports on; runs $OPS small allreduces $OP_GAP s apart (so the HealthReporter hands a
window to the agent), then rewrites $DUMP_DIR/<LOCAL_RANK>.<RESTART>.json whenever what it
sees changes — env, PID, the epoch it holds, its watcher's ``watches_opened``, the epochs
the agent relayed, whether its session is lost — until $STOP_FILE exists."""
import json
import os
import sys
import time

import torch

import resilient

env = os.environ
comm = resilient.connect(world=int(env["WORLD_SIZE"]), timeout=60, health_reports=True)
for _ in range(int(env.get("OPS", "0"))):
    comm.allreduce(torch.ones(4))
    time.sleep(float(env.get("OP_GAP", "0.1")))
base = os.path.join(env["DUMP_DIR"], f"{env['LOCAL_RANK']}.{env['TORCHELASTIC_RESTART_COUNT']}")
last = None
while not os.path.exists(env.get("STOP_FILE", "/nonexistent")):
    e = comm.watcher.current()
    state = {"epoch": e.number if e else None, "members": list(e.members) if e else [],
             "watches_opened": comm.watcher.watches_opened,
             "epochs_relayed": comm.session.epochs_relayed, "lost": comm.session.lost.is_set()}
    if state != last:
        with open(base + ".tmp", "w") as f:
            json.dump(dict(env, PID=str(os.getpid()), MEMBER=comm.member_id, **state), f)
        os.replace(base + ".tmp", base + ".json")
        last = state
    time.sleep(0.05)
comm.close()
sys.exit(0)
