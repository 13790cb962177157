"""Test worker: registers as a member on the lease its agent granted (RESILIENT_LEASE_ID),
writes its environment plus PID to $DUMP_DIR/<LOCAL_RANK>.<RESTART_COUNT>.json, then keeps
its lease alive (MemberSession) until $STOP_FILE exists."""
import json
import os
import sys
import time

from resilient.coordinator.membership import MemberInfo, MemberSession
from resilient.coordinator.etcd_access import open_store_from_env

env = os.environ
store = open_store_from_env(env["RESILIENT_ETCD"])  # RESILIENT_ETCD_* TLS/credentials too
session = MemberSession.register(
    store, env["RESILIENT_JOB"], MemberInfo(env["RESILIENT_MEMBER_ID"], local_rank=int(env["LOCAL_RANK"])),
    ttl=float(env["RESILIENT_LEASE_TTL"]), lease_id=int(env["RESILIENT_LEASE_ID"]),
)
base = os.path.join(env["DUMP_DIR"], f"{env['LOCAL_RANK']}.{env['TORCHELASTIC_RESTART_COUNT']}")
with open(base + ".tmp", "w") as f:
    json.dump(dict(env, PID=str(os.getpid())), f)
os.replace(base + ".tmp", base + ".json")
while not os.path.exists(env.get("STOP_FILE", "/nonexistent")):
    time.sleep(0.05)
session.close(revoke=False)
sys.exit(0)
