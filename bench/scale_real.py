"""``bench/scale.py --real-etcd``: node leases against a real local etcd (see scale.py).

The parent starts etcd and ``--client-processes`` children; child ``i`` grants its share
of the node leases, writes each node's record on its lease (batched: 64 puts per
transaction) and keeps every lease alive over one :class:`~resilient.coordinator.lease_mux.LeaseMux`
stream (each lease granted :func:`~resilient.coordinator.liveness.node_lease_ttl` of the
liveness bound ``--ttl``). A real :class:`~resilient.coordinator.service.Coordinator` (delta epochs) runs in
the parent. After ``--hold`` seconds without a lost lease, child 0 stops refreshing one
node; the parent measures when the epoch without that node's ranks is published.
Children print ``READY``, ``LOST <n>`` when a lease goes, and ``DONE <json>`` at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from resilient.coordinator import keys  # noqa: E402
from resilient.coordinator.directory import NodeRecord  # noqa: E402
from resilient.coordinator.membership import MemberInfo  # noqa: E402
from resilient.coordinator.store import Put, Store  # noqa: E402

JOB = "scale-real"


def node_record(idx: int, gpn: int, ttl: float) -> tuple[str, bytes]:
    node = f"n{idx:05d}"
    labels = {"rack": f"rack{idx // 32:04d}"}
    infos = tuple(MemberInfo(member_id=f"{node}-g{r}", host=node, local_rank=r, address=f"10.0.{idx % 250}.1:{29500 + r}",
                             labels=labels, pid=1000 + r) for r in range(gpn))
    return node, NodeRecord(node, node, labels, infos, ttl).to_json()


def child(args: argparse.Namespace) -> None:
    from resilient.coordinator.lease_mux import LeaseMux

    from resilient.coordinator.liveness import node_lease_ttl

    store = Store(args.etcd)
    mux = LeaseMux(store)
    granted = node_lease_ttl(args.ttl)   # the lease TTL for the liveness bound --ttl
    lost = []
    mux_lock = threading.Lock()

    def on_lost(lid: int) -> None:
        with mux_lock:
            lost.append(lid)
        print(f"LOST {lid:x}", flush=True)

    from resilient.errors import LeaseExpired

    leases: dict[str, int] = {}
    regrants = 0

    def register(batch: list[tuple[str, bytes]]) -> None:
        """Write a batch of node records; a lease that expired before its first refresh
        reached an overloaded etcd is granted again (counted: ``regrants``)."""
        nonlocal regrants
        for _ in range(5):
            try:
                store.txn([], [Put(keys.node(JOB, n), b, leases[n]) for n, b in batch])
                return
            except LeaseExpired:
                for n, _b in batch:
                    if store.lease_ttl(leases[n]) is None:
                        mux.remove(leases[n])
                        leases[n] = store.grant(granted)
                        mux.add(leases[n], granted, on_lost)
                        regrants += 1
        raise RuntimeError("could not register a batch of node records in 5 tries")

    batch: list[tuple[str, bytes]] = []
    for idx in range(args.lo, args.hi):
        lid = store.grant(granted)
        mux.add(lid, granted, on_lost)
        node, body = node_record(idx, args.gpus_per_node, args.ttl)
        leases[node] = lid
        batch.append((node, body))
        if len(batch) == 64:
            register(batch)
            batch = []
    if batch:
        register(batch)
    with mux_lock:
        lost.clear()     # losses before READY were re-granted above; from here on they count
    print(f"READY {regrants} {mux.sent}", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd and cmd[0] == "STOP":
            mux.remove(leases[cmd[1]])
            print(f"STOPPED {cmd[1]} {time.time()}", flush=True)
        elif cmd and cmd[0] == "END":
            break
    print("DONE " + json.dumps({"sent": mux.sent, "received": mux.received, "lost_after_ready": len(lost),
                                "reconnects": mux.reconnects, "leases": len(leases)}), flush=True)
    mux.close()
    store.close()


class _Child:
    def __init__(self, cmd: list[str]) -> None:
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.p.stdout:
            self.lines.append(line.strip())

    def send(self, text: str) -> None:
        self.p.stdin.write(text + "\n")
        self.p.stdin.flush()

    def wait_for(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.startswith(prefix):
                    return line
            if self.p.poll() is not None:
                raise RuntimeError(f"client exited {self.p.returncode} before {prefix!r}")
            time.sleep(0.05)
        raise TimeoutError(f"no {prefix!r} from a client within {timeout}s")


def run_real(args: argparse.Namespace) -> dict:
    from resilient.coordinator import LocalEtcd
    from resilient.coordinator.delta import is_delta, parse_delta
    from resilient.coordinator.service import Coordinator, CoordinatorConfig

    from resilient.coordinator.liveness import node_lease_ttl

    out: dict = {"nodes": args.nodes, "client_processes": args.client_processes,
                 "node_lease_ttl_s": node_lease_ttl(args.ttl)}
    with LocalEtcd() as etcd:
        children: list[_Child] = []
        stop = threading.Event()
        coord_thread = None
        try:
            per = -(-args.nodes // args.client_processes)
            t0 = time.monotonic()
            for i in range(args.client_processes):
                lo, hi = i * per, min(args.nodes, (i + 1) * per)
                children.append(_Child([sys.executable, os.path.abspath(__file__), "--etcd", etcd.endpoint_arg,
                                        "--lo", str(lo), "--hi", str(hi), "--ttl", str(args.ttl),
                                        "--gpus-per-node", str(args.gpus_per_node)]))
            ready_at = []
            for c in children:
                c.wait_for("READY", 900)
                ready_at.append(next(i for i, line in enumerate(c.lines) if line.startswith("READY")))
            out["registration_regrants"] = sum(int(c.lines[i].split()[1]) for c, i in zip(children, ready_at))
            out["register_s"] = round(time.monotonic() - t0, 1)
            store = Store(etcd.endpoints)
            coord = Coordinator(store, JOB, "coord-real", CoordinatorConfig(ttl=args.ttl, delta_min_members=1))
            coord_thread = threading.Thread(target=coord.run, args=(stop,), daemon=True)
            coord_thread.start()
            deadline = time.monotonic() + 600
            while not coord.published and time.monotonic() < deadline:
                time.sleep(0.2)
            first = store.get(keys.epoch(JOB))
            out["initial_epoch_delta"] = bool(first and is_delta(first.value))
            out["initial_members"] = parse_delta(first.value).size if first else 0
            t_ready = time.monotonic()
            time.sleep(args.hold)
            lost_during_hold = sum(1 for c, i in zip(children, ready_at) for line in c.lines[i:]
                                   if line.startswith("LOST"))
            victim = "n00001"
            seen = threading.Event()
            result: dict = {}
            ekey = keys.epoch(JOB)

            def on_epoch(evs) -> None:
                for ev in evs:
                    if ev.type == "put" and ev.key == ekey and is_delta(ev.value):
                        d = parse_delta(ev.value)
                        if f"{victim}-g0" in d.removed:
                            result.update(at=time.time(), bytes=len(ev.value), number=d.number, cause=d.cause)
                            seen.set()

            w = store.watch_key(ekey, None, on_epoch)
            t_stop = time.time()
            children[0].send(f"STOP {victim}")
            published = seen.wait(args.ttl * 4 + 10)
            w.cancel()
            for c in children:
                c.send("END")
            stats = [json.loads(c.wait_for("DONE", 60)[5:]) for c in children]
            t_end = time.monotonic()
            out.update(leases_lost=lost_during_hold, epoch_published=published,
                       publish_ms=round((result["at"] - t_stop) * 1000, 1) if published else None,
                       epoch_bytes=result.get("bytes"), keepalives_sent=sum(s["sent"] for s in stats),
                       keepalives_per_s=round(sum(s["sent"] - int(c.lines[i].split()[2]) for s, c, i in
                                                  zip(stats, children, ready_at)) / max(1.0, t_end - t_ready), 0),
                       stream_reconnects=sum(s["reconnects"] for s in stats))
            stop.set()
            coord_thread.join(timeout=10)
            store.close()
        finally:
            stop.set()
            if coord_thread is not None:
                coord_thread.join(timeout=10)
            for c in children:
                if c.p.poll() is None:
                    c.p.terminate()
                    try:
                        c.p.wait(10)
                    except subprocess.TimeoutExpired:
                        c.p.kill()
    out["loadavg"] = open("/proc/loadavg").read().split()[:3]
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--etcd", required=True)
    ap.add_argument("--lo", type=int, required=True)
    ap.add_argument("--hi", type=int, required=True)
    ap.add_argument("--ttl", type=float, default=5.0)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    child(ap.parse_args())
