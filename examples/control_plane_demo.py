"""The control plane, live, in about 10 seconds (`make demo` runs the training demo).

Starts a real local etcd and a real coordinator process, starts 4 member processes
(this script plays the node agent: it grants their leases), shows ``resilient status``,
SIGKILLs one member, revokes its lease on seeing it exit (as ``resilient-run`` will) and
shows the new epoch with ``resilient status``. Nothing is simulated; everything it starts
is stopped by PID at the end.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from resilient.coordinator import EpochWatcher, LocalEtcd, Store
from resilient.coordinator.membership import revoke_member

CLI = [sys.executable, "-c", "import sys; from resilient.cli import main; sys.exit(main())"]
JOB = "demo"


def say(msg: str) -> None:
    print(f"\n== {msg}", flush=True)


def status(endpoints: str) -> None:
    subprocess.run(CLI + ["status", "--etcd", endpoints, "--job", JOB], check=True)


def main() -> int:
    procs: dict[str, subprocess.Popen] = {}
    coord = None
    t_start = time.monotonic()
    with LocalEtcd() as etcd:
        store = Store(etcd.endpoints)
        try:
            say(f"etcd running at {etcd.endpoint_arg} (pid {etcd.members[0].proc.pid})")
            coord = subprocess.Popen(CLI + ["coordinator", "--etcd", etcd.endpoint_arg, "--job", JOB,
                                            "--metrics-port", "0", "--metrics-host", "127.0.0.1",
                                            # the first epoch waits for all four (a worker
                                            # starting after the join debounce would
                                            # otherwise join in an epoch of its own)
                                            "--min-members", "4", "--log-level", "WARNING"],
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
            print(coord.stdout.readline().strip(), f"(pid {coord.pid})")
            leases = {}
            for i in range(4):
                mid = f"worker{i}"
                leases[mid] = store.grant(5)
                procs[mid] = subprocess.Popen(
                    [sys.executable, "-m", "resilient.coordinator.member_process", "--etcd", etcd.endpoint_arg,
                     "--job", JOB, "--id", mid, "--lease-id", str(leases[mid]), "--host", f"node-{'ab'[i // 2]}",
                     "--local-rank", str(i % 2), "--address", f"127.0.0.1:{29600 + i}"],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
            for mid, p in procs.items():
                line = p.stdout.readline().split()
                print(f"member {mid} registered: pid {line[3]}, lease {int(line[2]):x}")
            watcher = EpochWatcher(store, JOB)
            first = watcher.wait_for(lambda e: len(e.members) == 4, 20)
            say(f"epoch {first.number} published ({first.cause}); resilient status:")
            status(etcd.endpoint_arg)

            victim = "worker1"
            say(f"SIGKILL {victim} (pid {procs[victim].pid}); the agent revokes its lease when it sees the exit")
            t0 = time.monotonic()
            os.kill(procs[victim].pid, signal.SIGKILL)
            procs[victim].wait()
            revoke_member(store, JOB, victim, leases[victim], reason="exited (SIGKILL)")
            second = watcher.wait_for(lambda e: victim not in e.members, 10)
            ms = (time.monotonic() - t0) * 1000
            say(f"epoch {second.number} published ({second.cause}, removed {', '.join(second.removed)}) "
                f"{ms:.0f} ms after the kill; resilient status:")
            status(etcd.endpoint_arg)
            watcher.close()
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.terminate()
                p.wait()
            if coord is not None:
                coord.terminate()
                coord.wait(timeout=10)
            store.close()
    say(f"done in {time.monotonic() - t_start:.1f} s; etcd, coordinator and members stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
