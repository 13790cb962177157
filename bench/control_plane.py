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
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

from resilient.coordinator import EpochWatcher, LocalEtcd, Store
from resilient.coordinator.membership import revoke_member


def spawn_member(endpoints: str, job: str, mid: str, lease: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "resilient.coordinator.member_process", "--etcd", endpoints,
                          "--job", job, "--id", mid, "--lease-id", str(lease)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    line = p.stdout.readline()
    if not line.startswith("READY"):
        p.kill()
        raise RuntimeError(f"member {mid} did not start: {line!r}")
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ttl", type=float, default=5.0, help="member lease TTL, seconds")
    args = ap.parse_args()
    job = "bench"
    procs: dict[str, subprocess.Popen] = {}
    leases: dict[str, int] = {}
    coord = None
    with LocalEtcd() as etcd:
        store = Store(etcd.endpoints)
        try:
            coord = subprocess.Popen(
                [sys.executable, "-c", "import sys; from resilient.cli import main; sys.exit(main())",
                 "coordinator", "--etcd", etcd.endpoint_arg, "--job", job, "--metrics-port", "-1",
                 "--log-level", "WARNING", "--join-debounce-ms", "100"],
                stdout=subprocess.DEVNULL, start_new_session=True)
            watcher = EpochWatcher(store, job)
            counter = [0]

            def add_member() -> None:
                mid = f"m{counter[0]}"
                counter[0] += 1
                leases[mid] = store.grant(args.ttl)
                procs[mid] = spawn_member(etcd.endpoint_arg, job, mid, leases[mid])

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
                procs.pop(victim).wait(timeout=10)   # it notices it lost its lease and exits
                # 2. SIGKILL, then the agent (this process) revokes on seeing the exit
                victim = sorted(procs)[0]
                proc = procs.pop(victim)

                def agent(p: subprocess.Popen = proc, mid: str = victim) -> None:
                    p.wait()
                    revoke_member(store, job, mid, leases[mid], reason="exited")

                watch_exit = threading.Thread(target=agent)
                watch_exit.start()
                t0 = time.perf_counter()
                os.kill(proc.pid, signal.SIGKILL)
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
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                p.wait()
            if coord is not None:
                if coord.poll() is None:
                    coord.terminate()
                try:
                    coord.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    coord.kill()
                    coord.wait()
            store.close()


if __name__ == "__main__":
    main()
