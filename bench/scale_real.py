"""``bench/scale.py --real-etcd``: node leases against a real local etcd (see scale.py).

The parent starts etcd and ``--client-processes`` children; child ``i`` grants its share
of the node leases, writes each node's record on its lease (paced: 32 puts per
transaction, then a pause as long as the write, and no new batch while more than an eighth of its leases have a refresh unanswered) and keeps every lease alive over one
:class:`~resilient.coordinator.lease_mux.LeaseMux` (8 streams; each lease granted :func:`~resilient.coordinator.liveness.node_lease_ttl` of the
liveness bound ``--ttl``). A real :class:`~resilient.coordinator.service.Coordinator` (delta epochs) runs in
the parent. After ``--hold`` seconds without a lost lease, child 0 stops refreshing one
node; the parent measures when the epoch without that node's ranks is published.
Children print ``READY <regrants> <sent> <lost in registration> <seconds>``, ``LOST <id>``
when a lease goes, ``COUNT <tag> <sent> <answered>`` when asked, and ``DONE <json>`` at
the end. A child that cannot register (a batch's leases gone five times running) exits
non-zero and the parent raises.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable, TypeVar

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from resilient.coordinator import keys  # noqa: E402
from resilient.coordinator.directory import NodeRecord  # noqa: E402
from resilient.coordinator.membership import MemberInfo  # noqa: E402
from resilient.coordinator.store import Put, Store  # noqa: E402

JOB = "scale-real"
T = TypeVar("T")
if TYPE_CHECKING:
    from resilient.coordinator.service import Coordinator, CoordinatorConfig
    from resilient.coordinator.store import WatchEvent


def node_record(idx: int, gpn: int, ttl: float) -> tuple[str, bytes]:
    node = f"n{idx:05d}"
    labels = {"rack": f"rack{idx // 32:04d}"}
    infos = tuple(MemberInfo(member_id=f"{node}-g{r}", host=node, local_rank=r, address=f"10.0.{idx % 250}.1:{29500 + r}",
                             labels=labels, pid=1000 + r) for r in range(gpn))
    return node, NodeRecord(node, node, labels, infos, ttl).to_json()


#: node records per registration transaction (and leases granted per paced batch): ~80 KB
REGISTER_BATCH = 32
#: keep-alive streams per client's LeaseMux: completions of several streams share an event-loop wake-up
STREAMS_PER_CLIENT = 8
#: grants in flight at once per client: etcd batches concurrent proposals into one raft round;
#: more threads only queue on the GIL in front of the LeaseMux's event loop
GRANTS_IN_FLIGHT = 2


def child(args: argparse.Namespace) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from tenacity import Retrying, retry_if_exception_type, stop_after_attempt

    from resilient.coordinator.lease_mux import LeaseMux
    from resilient.coordinator.liveness import node_lease_ttl
    from resilient.errors import LeaseExpired

    # the registration threads and the LeaseMux's loop hand the GIL back and forth; at the default
    # 5 ms switch interval each hand-off can stall the keep-alive writes behind a busy thread
    sys.setswitchinterval(0.0005)
    store = Store(args.etcd)
    mux = LeaseMux(store, streams=args.streams)
    granted = node_lease_ttl(args.ttl)   # the lease TTL for the liveness bound --ttl
    lost: list[int] = []
    mux_lock = threading.Lock()

    def on_lost(lid: int) -> None:
        with mux_lock:
            lost.append(lid)
        print(f"LOST {lid:x}", flush=True)

    leases: dict[str, int] = {}
    regrants = 0
    pool = ThreadPoolExecutor(GRANTS_IN_FLIGHT)

    def grant_and_keep(node: str) -> None:
        lid = store.grant(granted)      # transient etcd errors: retried inside Store (tenacity)
        mux.add(lid, granted, on_lost)  # first refresh within a third of the TTL
        leases[node] = lid

    def write(batch: list[tuple[str, bytes]]) -> None:
        """One transaction for the batch's records; a lease found gone (it expired before a
        refresh reached an overloaded etcd) is granted again and counted (``regrants``)."""
        nonlocal regrants
        try:
            store.txn([], [Put(keys.node(JOB, n), b, leases[n]) for n, b in batch])
        except LeaseExpired:
            for n, _b in batch:
                if store.lease_ttl(leases[n]) is None:
                    mux.remove(leases[n])
                    grant_and_keep(n)
                    regrants += 1
            raise

    def settle() -> None:
        """Wait (10 s at most) until etcd has answered all but an eighth of the refreshes
        sent: registering more while its answers fall behind only makes every lease's
        refresh later (the node agents of a real job would be backing off likewise)."""
        deadline = time.monotonic() + 10
        while mux.sent - mux.received > max(64, len(leases) // 8) and time.monotonic() < deadline:
            time.sleep(0.05)

    t0 = time.monotonic()
    for lo in range(args.lo, args.hi, REGISTER_BATCH):
        settle()
        batch = [node_record(idx, args.gpus_per_node, args.ttl) for idx in range(lo, min(args.hi, lo + REGISTER_BATCH))]
        list(pool.map(grant_and_keep, [n for n, _b in batch]))   # paced: one batch of grants, then its records
        t_w = time.monotonic()
        for attempt in Retrying(retry=retry_if_exception_type(LeaseExpired), stop=stop_after_attempt(5), reraise=True):
            with attempt:
                write(batch)
        # paced: wait as long as the write took. etcd 3.4 answers a keep-alive only once its
        # apply loop has caught up (LeaseRenew waits for the applied index), so registration
        # writes back to back stall every refresh behind them and fresh 4 s leases expire
        time.sleep(min(1.0, time.monotonic() - t_w))
    # a lease lost after its batch was written (its record went with it): grant and write
    # again, until a round loses none (at most 10 rounds)
    lost_before = 0
    for _round in range(10):
        by_lease = {lid: n for n, lid in leases.items()}
        with mux_lock:
            lost_before += len(lost)
            again = [by_lease[lid] for lid in lost if lid in by_lease]
            lost.clear()     # from READY on, every loss counts (leases_lost)
        if not again:
            break
        for i in range(0, len(again), REGISTER_BATCH):
            settle()
            chunk = again[i:i + REGISTER_BATCH]
            list(pool.map(grant_and_keep, chunk))
            regrants += len(chunk)
            for attempt in Retrying(retry=retry_if_exception_type(LeaseExpired), stop=stop_after_attempt(5),
                                    reraise=True):
                with attempt:
                    write([node_record(int(n[1:]), args.gpus_per_node, args.ttl) for n in chunk])
    pool.shutdown()
    print(f"READY {regrants} {mux.sent} {lost_before} {time.monotonic() - t0:.2f}", flush=True)
    timeline: list[list[float]] = []
    sampling = threading.Event()

    def sample() -> None:   # every 0.5 s: what etcd answered, how late, and what was lost (diagnostics)
        while not sampling.wait(0.5):
            answer_lag, send_lag = mux.take_lags()
            timeline.append([round(time.time(), 2), mux.sent, mux.received, mux.lost_by_etcd, mux.lost_unanswered,
                             round(answer_lag * 1000), round(send_lag * 1000), mux.reconnects])

    threading.Thread(target=sample, daemon=True).start()
    for line in sys.stdin:
        cmd = line.split()
        if cmd and cmd[0] == "STOP":
            lid = leases[cmd[1]]
            # when etcd may drop it: its last answered refresh's send + the TTL (wall clock)
            until = mux._safe_until.get(lid, time.monotonic())
            mux.remove(lid)
            print(f"STOPPED {cmd[1]} {time.time()} {time.time() - time.monotonic() + until}", flush=True)
        elif cmd and cmd[0] == "COUNT":
            print(f"COUNT {cmd[1]} {mux.sent} {mux.received}", flush=True)
        elif cmd and cmd[0] == "END":
            break
    sampling.set()
    print("DONE " + json.dumps({"sent": mux.sent, "received": mux.received, "lost_after_ready": len(lost),
                                "lost_by_etcd": mux.lost_by_etcd, "lost_unanswered": mux.lost_unanswered,
                                "reconnects": mux.reconnects, "leases": len(leases), "batches": mux.batches,
                                "timeline": timeline}),
          flush=True)
    mux.close()
    store.close()


class _Child:
    def __init__(self, cmd: list[str]) -> None:
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.first_lost_at: float | None = None     # monotonic time of the first LOST line
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.p.stdout:
            if line.startswith("LOST") and self.first_lost_at is None:
                self.first_lost_at = time.monotonic()
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


class _CpuMeter:
    """CPU used by etcd, each client and this process (the coordinator) between laps, as
    fractions of one core (psutil; a process that exited reads as its last sample)."""

    def __init__(self, etcd_pid: int, client_pids: list[int]) -> None:
        import psutil

        self._procs = {"etcd": psutil.Process(etcd_pid), "parent": psutil.Process()}
        self._procs.update({f"client{i}": psutil.Process(pid) for i, pid in enumerate(client_pids)})
        self._last = {name: self._cpu(p) for name, p in self._procs.items()}
        self._t = time.monotonic()

    @staticmethod
    def _cpu(p: "psutil.Process") -> float:
        t = p.cpu_times()
        return t.user + t.system

    def sample_every(self, period: float, stop: threading.Event) -> list[list[float]]:
        """Start a thread appending ``[wall time, cpu of each process (names: self.names)]``
        every ``period`` s until ``stop``; returns the list it fills."""
        rows: list[list[float]] = []

        def run() -> None:
            last = {name: self._cpu(p) for name, p in self._procs.items()}
            t = time.monotonic()
            while not stop.wait(period):
                try:
                    cur = {name: self._cpu(p) for name, p in self._procs.items()}
                except Exception:   # a process exited
                    return
                now = time.monotonic()
                rows.append([round(time.time(), 2)] + [round((cur[n] - last[n]) / (now - t), 2) for n in self.names])
                last, t = cur, now

        threading.Thread(target=run, daemon=True).start()
        return rows

    @property
    def names(self) -> list[str]:
        return list(self._procs)

    def lap(self) -> dict[str, float]:
        now = time.monotonic()
        dt = max(1e-6, now - self._t)
        cur = {name: self._cpu(p) for name, p in self._procs.items()}
        out = {name: round((cur[name] - self._last[name]) / dt, 3) for name in cur}
        out["seconds"] = round(dt, 1)
        self._last, self._t = cur, now
        return out


def _timed_coordinator(store: Store, config: "CoordinatorConfig", events: list[list[object]]) -> "Coordinator":
    """The real coordinator, with the wall time and duration of its directory reloads,
    snapshot writes, passes and store calls over 10 ms, and the node deletes it saw, appended
    to ``events`` as ``[start, what, seconds]`` (diagnostics: ``--timeline``)."""
    from resilient.coordinator.service import Coordinator

    def timed(name: str, f: "Callable[..., T]", always: bool = True) -> "Callable[..., T]":
        def g(*a: object, **k: object) -> T:
            t, t0 = time.time(), time.monotonic()
            try:
                return f(*a, **k)
            finally:
                dt = time.monotonic() - t0
                if always or dt > 0.01:
                    events.append([round(t, 3), name, round(dt, 3)])
        return g

    class Timed(Coordinator):
        def _on_member_events(self, evs: "list[WatchEvent]") -> None:
            for ev in evs:
                if ev.type == "delete":
                    events.append([round(time.time(), 3), "delete " + keys.last_segment(ev.key), 0.0])
            super()._on_member_events(evs)

    c = Timed(store, JOB, "coord-real", config)
    c._reload = timed("reload", c._reload)                        # type: ignore[method-assign]
    c._write_snapshot = timed("snapshot", c._write_snapshot)      # type: ignore[method-assign]
    c._reconcile = timed("pass", c._reconcile, always=False)      # type: ignore[method-assign]
    for name in ("snapshot_page", "put", "txn", "get", "get_prefix"):
        setattr(store, name, timed(name, getattr(store, name), always=False))
    return c


def _etcd_slow_lines(log_path: str) -> list[str]:
    """etcd's warnings of slow requests and applies (``took too long``), as logged."""
    try:
        with open(log_path, errors="replace") as f:
            return [line.strip()[:300] for line in f if "too long" in line or "lease" in line.lower()][-400:]
    except OSError:
        return []


def _counts(children: list[_Child], tag: str) -> list[tuple[int, int]]:
    """Each client's keep-alives sent and answered so far (its ``COUNT`` reply)."""
    for c in children:
        c.send(f"COUNT {tag}")
    return [tuple(int(x) for x in c.wait_for(f"COUNT {tag} ", 60).split()[2:4]) for c in children]


def run_real(args: argparse.Namespace) -> dict:
    from resilient.coordinator import LocalEtcd
    from resilient.coordinator.delta import is_delta, parse_delta
    from resilient.coordinator.service import Coordinator, CoordinatorConfig

    from resilient.coordinator.liveness import node_lease_ttl

    from resilient.coordinator.lease_mux import TICK, interval_ticks

    granted = node_lease_ttl(args.ttl)
    every = interval_ticks(granted) * TICK
    out: dict = {"nodes": args.nodes, "client_processes": args.client_processes, "node_lease_ttl_s": granted,
                 "keepalive_interval_s": round(every, 3), "keepalives_scheduled_per_s": round(args.nodes / every),
                 # a refresh may come this much later than due (beyond a third of the TTL) with no lease at risk
                 "keepalive_margin_s": round(granted - every - granted / 3, 3)}
    before = not args.coordinator_after_ready
    out["coordinator_start"] = "before registration" if before else "after ready"
    with LocalEtcd() as etcd:
        children: list[_Child] = []
        stop = threading.Event()
        coord_thread: threading.Thread | None = None
        coord_events: list[list[object]] = []
        store = Store(etcd.endpoints)

        def start_coordinator(min_members: int) -> "Coordinator":
            """The real coordinator in a thread of this process. Started before registration
            (the default, as in a deployment: it builds its directory from the watch as the
            nodes register), its first epoch waits for every rank (``min_members``), as a
            job's first epoch waits for its minimum size."""
            nonlocal coord_thread
            config = CoordinatorConfig(ttl=args.ttl, delta_min_members=1, min_members=min_members)
            c = (_timed_coordinator(store, config, coord_events) if args.timeline
                 else Coordinator(store, JOB, "coord-real", config))
            coord_thread = threading.Thread(target=c.run, args=(stop,), daemon=True)
            coord_thread.start()
            return c

        try:
            if before:
                coord = start_coordinator(args.nodes * args.gpus_per_node)
            per = -(-args.nodes // args.client_processes)
            t0 = time.monotonic()
            for i in range(args.client_processes):
                lo, hi = i * per, min(args.nodes, (i + 1) * per)
                children.append(_Child([sys.executable, os.path.abspath(__file__), "--etcd", etcd.endpoint_arg,
                                        "--lo", str(lo), "--hi", str(hi), "--ttl", str(args.ttl),
                                        "--gpus-per-node", str(args.gpus_per_node)]))
            cpu = _CpuMeter(etcd.members[0].proc.pid, [c.p.pid for c in children])
            cpu_rows = cpu.sample_every(0.5, stop) if args.timeline else []
            ready_at = []
            for c in children:
                c.wait_for("READY", 900)
                ready_at.append(next(i for i, line in enumerate(c.lines) if line.startswith("READY")))
            ready = [c.lines[i].split() for c, i in zip(children, ready_at)]
            out["registration_regrants"] = sum(int(r[1]) for r in ready)
            out["leases_lost_in_registration"] = sum(int(r[3]) for r in ready)
            out["register_s"] = round(time.monotonic() - t0, 1)
            out["register_s_per_client"] = [float(r[4]) for r in ready]
            t_all_ready = time.monotonic()
            for c in children:
                c.first_lost_at = None     # from here on: when (if) the first lease goes, per client
            if not before:
                coord = start_coordinator(1)
            out["t_all_ready"] = time.time()
            deadline = time.monotonic() + 600
            while not coord.published and time.monotonic() < deadline:
                time.sleep(0.2)
            out["first_epoch_s_after_ready"] = round(time.monotonic() - t_all_ready, 1)
            first = store.get(keys.epoch(JOB))
            out["initial_epoch_delta"] = bool(first and is_delta(first.value))
            out["initial_members"] = parse_delta(first.value).size if first else 0
            t_ready = time.monotonic()
            out["register_cpu"] = cpu.lap()
            before = _counts(children, "hold-start")
            time.sleep(args.hold)
            after = _counts(children, "hold-end")
            out["hold_cpu"] = cpu.lap()
            held = time.monotonic() - t_ready
            out["keepalives_per_s"] = round(sum(a[0] - b[0] for a, b in zip(after, before)) / held)
            out["keepalive_answers_per_s"] = round(sum(a[1] - b[1] for a, b in zip(after, before)) / held)
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
                            result.update(at=time.time(), bytes=len(ev.value), number=d.number, cause=d.cause,
                                          published_at=d.published_at)
                            seen.set()

            w = store.watch_key(ekey, None, on_epoch)
            t_stop = time.time()
            children[0].send(f"STOP {victim}")
            published = seen.wait(args.ttl * 4 + 10)
            w.cancel()
            for c in children:
                c.send("END")
            stats = [json.loads(c.wait_for("DONE", 60)[5:]) for c in children]
            stopped = children[0].wait_for("STOPPED", 5).split()
            out["victim_stopped_at"], out["victim_expires_at"] = float(stopped[2]), float(stopped[3])
            out["epoch_published_at"] = result.get("published_at")
            out["epoch_seen_at"] = result.get("at")
            if args.timeline:
                with open(args.timeline, "w") as f:
                    json.dump({"out": out, "cpu_names": cpu.names, "cpu": cpu_rows, "coordinator": coord_events,
                               "clients": [st.pop("timeline") for st in stats],
                               "etcd_log": _etcd_slow_lines(etcd.members[0].log_path)}, f)
            for st in stats:
                st.pop("timeline", None)
            out["lost_by_etcd"] = sum(st["lost_by_etcd"] for st in stats)
            out["lost_unanswered"] = sum(st["lost_unanswered"] for st in stats)
            out["first_loss_s_after_ready"] = [None if c.first_lost_at is None else
                                               round(c.first_lost_at - t_all_ready, 1) for c in children]
            out.update(leases_lost=lost_during_hold, epoch_published=published,
                       publish_ms=round((result["at"] - t_stop) * 1000, 1) if published else None,
                       epoch_bytes=result.get("bytes"), keepalives_sent=sum(s["sent"] for s in stats),
                       stream_reconnects=sum(s["reconnects"] for s in stats))
        finally:
            stop.set()
            if coord_thread is not None:
                coord_thread.join(timeout=10)
            store.close()
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
    ap.add_argument("--streams", type=int, default=STREAMS_PER_CLIENT)
    child(ap.parse_args())
