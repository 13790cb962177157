"""Control-plane latency on loopback: ``python bench/control_plane.py`` prints one JSON line.

A real local etcd, a real coordinator process (``resilient coordinator``) and 8 real
member processes whose leases this script grants, as the node agent does. Each round:

* ``epoch_after_revoke_ms``: revoke one member's lease (``revoke_member``) → the epoch
  without it is seen by an :class:`EpochWatcher` here;
* ``epoch_after_sigkill_ms``: SIGKILL another member process; this script (its "agent")
  sees the exit, revokes its lease → the epoch without it is seen.

Both are medians over ``--rounds`` rounds (two fresh members rejoin between rounds);
the per-round values are listed too.
"""
from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time

from resilient.coordinator import EpochWatcher, LocalEtcd, Store
from resilient.coordinator.membership import revoke_member
from resilient.launcher.lease_reaper import LeaseReaper
from resilient.process_pool import DEVNULL, PIPE, Child, ProcessPool, Spec


def spawn_member(pool: ProcessPool, endpoints: str, job: str, mid: str, lease: int) -> Child:
    p = pool.start(Spec([sys.executable, "-m", "resilient.coordinator.member_process", "--etcd", endpoints,
                         "--job", job, "--id", mid, "--lease-id", str(lease)], stdout=PIPE, stderr=DEVNULL, name=mid))
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line.startswith("READY"):
        pool.signal(p, signal.SIGKILL)
        raise RuntimeError(f"member {mid} did not start: {line!r}")
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ttl", type=float, default=5.0, help="member lease TTL, seconds")
    args = ap.parse_args()
    job = "bench"
    procs: dict[str, Child] = {}
    leases: dict[str, int] = {}
    with LocalEtcd() as etcd, ProcessPool() as pool:   # every process stopped by PID on the way out
        store = Store(etcd.endpoints)
        reaper = LeaseReaper(job, store=store)
        try:
            pool.start(Spec([sys.executable, "-c", "import sys; from resilient.cli import main; sys.exit(main())",
                             "coordinator", "--etcd", etcd.endpoint_arg, "--job", job, "--metrics-port", "-1",
                             "--log-level", "WARNING", "--join-debounce-ms", "100"], stdout=DEVNULL, name="coordinator"))
            watcher = EpochWatcher(store, job)
            counter = [0]

            def add_member() -> None:
                mid = f"m{counter[0]}"
                counter[0] += 1
                leases[mid] = store.grant(args.ttl)
                procs[mid] = spawn_member(pool, etcd.endpoint_arg, job, mid, leases[mid])

            for _ in range(args.members):
                add_member()
            revoke_ms, kill_ms = [], []
            for _ in range(args.rounds):
                watcher.wait_for(lambda e: set(e.members) == set(procs), 60)
                # 1. revoke
                victim = sorted(procs)[0]
                t0 = time.perf_counter()
                revoke_member(store, job, victim, leases[victim], reason="bench")
                watcher.wait_for(lambda e: victim not in e.members, 10)
                revoke_ms.append((time.perf_counter() - t0) * 1000)
                pool.wait(10, [procs.pop(victim)])   # it notices it lost its lease and exits
                # 2. SIGKILL, then the agent (this process) revokes on seeing the exit
                victim = sorted(procs)[0]
                proc = procs.pop(victim)
                watch_exit = reaper.watch(proc, victim, leases[victim])
                t0 = time.perf_counter()
                pool.signal(proc, signal.SIGKILL)
                watcher.wait_for(lambda e: victim not in e.members, 10)
                kill_ms.append((time.perf_counter() - t0) * 1000)
                watch_exit.join()
                add_member()
                add_member()
            print(json.dumps({
                "members": args.members,
                "epoch_after_revoke_ms": round(statistics.median(revoke_ms), 1),
                "epoch_after_sigkill_ms": round(statistics.median(kill_ms), 1),
                "revoke_ms_each": [round(x, 1) for x in revoke_ms],
                "sigkill_ms_each": [round(x, 1) for x in kill_ms],
                "rounds": args.rounds,
            }))
            watcher.close()
        finally:
            pool.stop(grace=0, sig=signal.SIGKILL, children=list(procs.values()))
            store.close()


if __name__ == "__main__":
    main()
