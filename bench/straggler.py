"""Straggler mitigation, measured: the same allreduce workload with mitigation off and on.

    python bench/straggler.py --world 5                  # cases a, b, c, c': one JSON line each
    python bench/straggler.py --world 5 --cases late,late-deadline   # c with demote, then with deadline
    python bench/straggler.py --world 5 --jitter --ops 2000   # noise only: must demote nobody

Real processes: a local etcd, one ``resilient coordinator`` (``--straggler-policy off`` or
``demote``) and ``--world`` member processes (this file with ``--worker``), each with a
TCP transport wrapped by the shaper (``RESILIENT_SHAPING_FILE``) and a health reporter.
Every member's links are capped at ``--bw`` (so the network, not the shared CPUs, is what
the ring waits on); member ``m2`` is the victim:

(a) ``slow``: ``slow=3x`` — every send of m2 takes 3x (``ref_bw`` = the cap);
(b) ``link``: ``link=m3:3x`` — only m2's link to its ring successor m3 is slow;
(c) ``late``: m2 starts every op ``--late-ms`` late (a fixed delay per op);
(c') ``late-deadline``: the same, with ``--straggler-policy deadline`` as the "on" policy
     (``--leaf-deadline-ms``): ops finish without m2's input when it is late.
(a') ``slow-evict``: case (a) with ``--straggler-policy evict`` as the "on" policy
     (``--evict-hold-s``): m2 is taken out of the epoch (it gets ``Evicted`` and calls
     ``comm.rejoin()``), re-admitted after the hold, evicted again while still slow.

Output per case: ``{"case", "throughput_off", "throughput_on", "speedup", "detect_s",
"false_demotions", ...}``. ``throughput_on`` is ops/s after the mitigation epoch (1 s of
settling skipped), ``throughput_on_total`` over the whole run including detection;
``detect_s``: seconds from the start of the workload to the epoch that mitigates (a, c:
m2 demoted; b: the m2-m3 link avoided). ``wrong`` counts outputs that differ from the
exact sum over the op's reported contributors (every op of every member is checked);
``leaf_contributors_ok``: every op after the demotion still counted m2 (demote);
``leaf_excluded_ops``: the fraction of ops after the demotion that finished without m2
(deadline; evict: while it is out), ``evictions`` / ``readmissions`` (epochs with that
cause), ``recovered_ops`` (op results finished by recovery), ``contributors_agree``: every member reported the same contributors for
every op (the leaf included).

Inputs are integer-valued float32 (exact sums). Every process started here is ended here,
by PID. Failure behaviour: a member that does not come up or finish within its deadline
makes the bench print what it has with ``"error"`` and exit 1.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PY = sys.executable

from resilient.process_pool import DEVNULL, ProcessPool, Spec  # noqa: E402 - after the path insert
VICTIM = "m2"


# -- member process ------------------------------------------------------------------------

def _base(index: int, numel: int):
    import torch

    return ((torch.arange(numel, dtype=torch.int64) % 251) * (index + 1)).to(torch.float32)


def worker(args: argparse.Namespace) -> int:
    import torch

    from resilient.collectives import Communicator
    from resilient.collectives.group import EtcdGroupView
    from resilient.coordinator import EpochWatcher, MemberInfo, MemberSession, Store
    from resilient.errors import Evicted, ResilientError
    from resilient.health_reporter import HealthReporter
    from resilient.transport.shaping import shaped_from_env
    from resilient.transport.tcp import TcpTransport

    out = Path(args.out)
    index = int(args.id.lstrip("m"))
    ids = [f"m{i}" for i in range(args.world)]
    base = {m: _base(i, args.numel) for i, m in enumerate(ids)}
    store = Store(args.etcd)
    transport = shaped_from_env(TcpTransport(args.id, args.job))
    session = MemberSession.register(store, args.job, MemberInfo(member_id=args.id, address=transport.address), ttl=5.0)
    watcher = EpochWatcher(store, args.job)
    watcher.wait_for(lambda e: len(e.members) == args.world and args.id in e.members, 60)
    comm = Communicator(EtcdGroupView(store, args.job, session, watcher), transport, op_timeout=30)
    reporter = HealthReporter(store, args.job, args.id, session.lease_id, transport.stats, interval=args.report_s,
                              min_ops=3)
    (out / f"READY-{args.id}").write_text(str(os.getpid()))
    while not (out / "go").exists():
        time.sleep(0.01)
    stop = out / "stop"
    x = torch.empty(args.numel + 1, dtype=torch.float32)
    late = args.late_ms / 1000.0 if args.id == VICTIM else 0.0
    seq = 0
    events = open(out / f"{args.id}.events.jsonl", "w")
    with open(out / f"{args.id}.jsonl", "w") as log:
        while True:
            x[:args.numel] = base[args.id] + (seq % 97)
            x[args.numel] = 1.0 if (stop.exists() or (args.ops and seq + 1 >= args.ops)) else 0.0
            if late:
                time.sleep(late)
            t0 = time.monotonic()
            try:
                work = comm.allreduce(x, "sum")
            except Evicted as exc:   # --straggler-policy evict: out for a while, then rejoin
                events.write(json.dumps({"event": "evicted", "seq": seq, "t": time.time(), "epoch": exc.epoch,
                                         "in_flight": comm.next_seq > seq, "readmit_at": exc.readmit_at,
                                         "hold_s": exc.hold_s, "message": str(exc)}) + "\n")
                events.flush()
                comm = _rejoin(comm, stop)
                if comm is None:      # told to stop while out
                    break
                seq = comm.next_seq
                # fresh windows: the time spent out is not busy time of this member
                reporter = HealthReporter(store, args.job, args.id, session.lease_id, transport.stats,
                                          interval=args.report_s, min_ops=3)
                events.write(json.dumps({"event": "rejoined", "seq": seq, "t": time.time(),
                                         "epoch": comm.epoch.number}) + "\n")
                events.flush()
                continue
            except ResilientError:
                if stop.exists():     # the others left while this member was re-admitted: done
                    break
                raise
            dt = time.monotonic() - t0
            contributors = tuple(work.contributors)
            want = sum(base[m] for m in contributors) + len(contributors) * (seq % 97)
            ok = bool(torch.equal(x[:args.numel], want))
            e = watcher.current()
            reporter.op_done(e.number if e else 0, dt)
            rec = comm.last_recovery is not None and comm.last_recovery.seq == seq   # finished by recovery (a removal mid-op)
            log.write(json.dumps({"seq": seq, "t": time.time(), "dt": round(dt, 6), "ok": ok,
                                  "contributors": list(contributors), "epoch": e.number if e else 0,
                                  "recovered": rec}) + "\n")
            seq += 1
            if x[args.numel] > 0:
                break
    events.close()
    (out / f"done-{args.id}").write_text(str(seq))
    comm.close()
    session.close()
    watcher.close()
    transport.close()
    store.close()
    return 0


def _rejoin(comm, stop: Path):
    """``comm.rejoin()`` in 1 s steps until re-admitted (the new Communicator) or told to
    stop (None)."""
    from resilient.errors import ResilientError

    from resilient.errors import StoreError

    while True:
        try:
            return comm.rejoin(timeout=1.0)
        except (TimeoutError, StoreError):   # not yet / the epoch moved on while joining: ask again
            if stop.exists():
                return None
        except ResilientError:
            if stop.exists():
                return None
            raise


# -- driver --------------------------------------------------------------------------------

class Run:
    """One job: coordinator + members, shaped per ``specs`` (member -> shaping text)."""

    def __init__(self, etcd: str, policy: str, specs: dict[str, str], args: argparse.Namespace, late_ms: float,
                 leaf_deadline_ms: float | None = None, evict_hold_s: float | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="straggler-"))
        self.job = f"strag-{uuid.uuid4().hex[:8]}"
        self.etcd, self.args = etcd, args
        self.pool = ProcessPool()   # the coordinator and the members, ended by PID in close()
        self.epochs: list[dict] = []
        self.pool.start(Spec(
            [PY, "-c", "import sys; from resilient.cli import main; sys.exit(main())", "coordinator", "--etcd", etcd,
             "--job", self.job, "--ttl", "3", "--metrics-port", "-1", "--log-level", "WARNING",
             "--straggler-policy", policy]
            + (["--leaf-deadline-ms", str(leaf_deadline_ms)] if policy == "deadline" and leaf_deadline_ms is not None
               else [])
            + (["--evict-hold-s", str(evict_hold_s)] if policy == "evict" and evict_hold_s is not None else []),
            stdout=DEVNULL, stderr=self.dir / "coordinator.stderr", cwd=ROOT, name="coordinator"))
        for i in range(args.world):
            mid = f"m{i}"
            spec = self.dir / f"shape-{mid}"
            spec.write_text(specs.get(mid, ""))
            env = dict(os.environ, PYTHONPATH=str(ROOT), RESILIENT_SHAPING_FILE=str(spec))
            env.pop("RESILIENT_SHAPING", None)
            self.pool.start(Spec(
                [PY, str(Path(__file__).resolve()), "--worker", "--etcd", etcd, "--job", self.job, "--id", mid,
                 "--world", str(args.world), "--numel", str(args.numel), "--out", str(self.dir),
                 "--late-ms", str(late_ms), "--report-s", str(args.report_s), "--ops", str(args.ops)],
                stdout=DEVNULL, stderr=self.dir / f"{mid}.stderr", cwd=ROOT, env=env, name=mid))

    @property
    def procs(self) -> list:
        """The coordinator, then the members m0, m1, ... (ProcessPool children)."""
        return self.pool.children

    def _wait_files(self, prefix: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            have = [f"m{i}" for i in range(self.args.world) if (self.dir / f"{prefix}-m{i}").exists()]
            if len(have) == self.args.world:
                return
            dead = [p.pid for p in self.procs if p.returncode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                tails = {p.name: p.read_text()[-1500:] for p in self.dir.glob("*.stderr")}
                raise RuntimeError(f"members not {prefix} (have {have}, exited {dead}): {tails}")
            time.sleep(0.05)

    def start(self) -> float:
        from resilient.coordinator import EpochWatcher, Store

        self.store = Store(self.etcd)
        self.watcher = EpochWatcher(self.store, self.job)
        self.watcher.subscribe(self._on_epoch)
        self._wait_files("READY", 90)
        e = self.watcher.current()
        if e is not None:
            self._on_epoch(e)
        self.t0 = time.time()
        (self.dir / "go").write_text(str(self.t0))
        return self.t0

    def _on_epoch(self, e) -> None:
        if any(r["number"] == e.number for r in self.epochs):
            return
        self.epochs.append({"number": e.number, "at": time.time(), "published_at": e.published_at,
                            "cause": e.cause, "members": list(e.members), "roles": dict(e.roles),
                            "avoid": [list(p) for p in (e.plan.get("avoid") or [])],
                            "evicted": dict(e.plan.get("evicted") or {})})

    def first_epoch(self, pred) -> dict | None:
        for r in sorted(self.epochs, key=lambda r: r["number"]):
            if pred(r):
                return r
        return None

    def stop(self, timeout: float = 120) -> dict[str, list[dict]]:
        (self.dir / "stop").write_text("1")
        self._wait_files("done", timeout)
        logs = {}
        for i in range(self.args.world):
            p = self.dir / f"m{i}.jsonl"
            logs[f"m{i}"] = [json.loads(l) for l in p.read_text().splitlines() if l.strip()]
        return logs

    def wait_ops_done(self, timeout: float) -> dict[str, list[dict]]:
        self._wait_files("done", timeout)
        return {f"m{i}": [json.loads(l) for l in (self.dir / f"m{i}.jsonl").read_text().splitlines() if l.strip()]
                for i in range(self.args.world)}

    def close(self) -> None:
        self.pool.stop(grace=10)   # ours, by PID: SIGTERM, SIGKILL 10 s later
        try:
            self.watcher.close()
            self.store.close()
        except Exception:  # noqa: BLE001 - best effort
            pass
        if not self.args.keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def _rate(log: list[dict], t_from: float, t_to: float | None = None) -> float | None:
    ts = [r["t"] for r in log if r["t"] >= t_from and (t_to is None or r["t"] <= t_to)]
    if len(ts) < 3:
        return None
    return (len(ts) - 1) / (ts[-1] - ts[0])


def _wrong(logs: dict[str, list[dict]]) -> int:
    return sum(1 for log in logs.values() for r in log if not r["ok"])


def run_case(etcd: str, case: str, args: argparse.Namespace) -> dict:
    cap = f"bw={args.bw},ref_bw={args.bw}"
    specs = {f"m{i}": cap for i in range(args.world)}
    late_ms = 0.0
    if case in ("slow", "slow-evict"):
        specs[VICTIM] = cap + ",slow=3x"
    elif case == "link":
        specs[VICTIM] = cap + ",link=m3:3x"
    elif case in ("late", "late-deadline"):
        late_ms = args.late_ms
    on_policy = {"late-deadline": "deadline", "slow-evict": "evict"}.get(case, "demote")
    result: dict = {"case": case, "policy_on": on_policy}
    # mitigation off
    run = Run(etcd, "off", specs, args, late_ms)
    try:
        t0 = run.start()
        time.sleep(args.seconds)
        logs = run.stop()
        off = _rate(logs["m0"], t0 + args.warmup_s)
        wrong = _wrong(logs)
        ops_off = len(logs["m0"])
    finally:
        run.close()
    # mitigation on
    if case == "link":
        def mitigated(r):
            return ["m2", "m3"] in r["avoid"]
    elif on_policy == "evict":
        def mitigated(r):
            return r["cause"] == "evicted" and VICTIM not in r["members"]
    else:
        def mitigated(r):
            return r["roles"].get(VICTIM) == "demoted"
    run = Run(etcd, on_policy, specs, args, late_ms, getattr(args, "leaf_deadline_ms", None),
              getattr(args, "evict_hold_s", None))
    try:
        t0 = run.start()
        deadline = time.monotonic() + args.detect_timeout
        while run.first_epoch(mitigated) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        hit = run.first_epoch(mitigated)
        time.sleep(args.seconds)
        from resilient.coordinator.health import read_scores

        scores = read_scores(run.store, run.job).get("members", {})
        logs = run.stop()
        t_end = max(r["t"] for r in logs["m0"])
        on = _rate(logs["m0"], hit["at"] + args.warmup_s) if hit else None
        on_total = _rate(logs["m0"], t0)
        wrong += _wrong(logs)
        demoted_ever = {m for r in run.epochs for m, role in r["roles"].items() if role == "demoted"}
        demoted_ever |= {m for i, r in enumerate(run.epochs) if r["cause"] == "evicted"
                         for m in (set(run.epochs[i - 1]["members"]) - set(r["members"]) if i else ())}
        false = sorted(demoted_ever - ({VICTIM} if case != "link" else set()))
        leaf_ok = excluded = None
        if hit and case != "link":
            after = [r for log in logs.values() for r in log if r["epoch"] >= hit["number"]]
            leaf_ok = bool(after) and all(VICTIM in r["contributors"] for r in after)
            excluded = round(sum(VICTIM not in r["contributors"] for r in after) / len(after), 3) if after else None
        by_seq: dict[int, set] = {}
        for log in logs.values():
            for r in log:
                by_seq.setdefault(r["seq"], set()).add(tuple(r["contributors"]))
        agree = all(len(v) == 1 for v in by_seq.values())
        result.update({
            "throughput_off": round(off, 2) if off else None,
            "throughput_on": round(on, 2) if on else None,
            "speedup": round(on / off, 3) if on and off else None,
            "detect_s": round(hit["at"] - t0, 2) if hit else None,
            "false_demotions": len(false),
            "throughput_on_total": round(on_total, 2) if on_total else None,
            "wrong": wrong, "ops_off": ops_off, "ops_on": len(logs["m0"]),
            "exact": wrong == 0, "leaf_contributors_ok": leaf_ok, "leaf_excluded_ops": excluded,
            "contributors_agree": agree,
            "evictions": sum(1 for r in run.epochs if r["cause"] == "evicted"),
            "readmissions": sum(1 for r in run.epochs if r["cause"] == "readmitted"),
            "recovered_ops": sum(1 for log in logs.values() for r in log if r.get("recovered")),
            "epochs_on": [{"n": r["number"], "t": round(r["at"] - t0, 2), "cause": r["cause"],
                           "demoted": sorted(m for m, v in r["roles"].items() if v == "demoted"),
                           "avoid": r["avoid"]} for r in run.epochs],
            "wrongly_demoted": false, "run_s_on": round(t_end - t0, 1), "scores_at_end": scores,
        })
    finally:
        run.close()
    result.update({"world": args.world, "numel": args.numel, "bw": args.bw,
                   "late_ms": late_ms if case in ("late", "late-deadline") else None,
                   "leaf_deadline_ms": getattr(args, "leaf_deadline_ms", None) if on_policy == "deadline" else None,
                   "evict_hold_s": getattr(args, "evict_hold_s", None) if on_policy == "evict" else None})
    return result


def run_jitter(etcd: str, args: argparse.Namespace) -> dict:
    specs = {f"m{i}": f"bw={args.bw},ref_bw={args.bw},jitter=30%" for i in range(args.world)}
    run = Run(etcd, "demote", specs, args, 0.0)
    try:
        t0 = run.start()
        logs = run.wait_ops_done(args.jitter_timeout)
        demoted = sorted({m for r in run.epochs for m, role in r["roles"].items() if role == "demoted"})
        health = [r for r in run.epochs if r["cause"] == "health"]
        return {"case": "jitter", "ops": len(logs["m0"]), "seconds": round(max(r["t"] for r in logs["m0"]) - t0, 1),
                "demotions": len(demoted), "demoted": demoted, "health_epochs": len(health),
                "avoided_links": sorted({tuple(p) for r in run.epochs for p in r["avoid"]}),
                "wrong": _wrong(logs), "exact": _wrong(logs) == 0, "world": args.world, "numel": args.numel}
    finally:
        run.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=5)
    ap.add_argument("--numel", type=int, default=1 << 18, help="float32 elements per allreduce (default 262144 = 1 MiB)")
    ap.add_argument("--bw", default="20MB/s", help="per-link bandwidth cap of every member (default 20MB/s)")
    ap.add_argument("--seconds", type=float, default=8.0, help="measured seconds per run (after detection when on)")
    ap.add_argument("--warmup-s", type=float, default=1.0)
    ap.add_argument("--late-ms", type=float, default=40.0, help="case c: the victim's delay per op")
    ap.add_argument("--report-s", type=float, default=0.5, help="health window seconds")
    ap.add_argument("--detect-timeout", type=float, default=30.0)
    ap.add_argument("--cases", default="slow,link,late,late-deadline",
                    help="comma-separated: slow, link, late, late-deadline, slow-evict (default: the first four)")
    ap.add_argument("--evict-hold-s", type=float, default=None,
                    help="slow-evict: the coordinator's --evict-hold-s (default: its own, 30)")
    ap.add_argument("--leaf-deadline-ms", type=float, default=None,
                    help="late-deadline: the coordinator's --leaf-deadline-ms (default: its own, 10)")
    ap.add_argument("--jitter", action="store_true", help="noise only (jitter=30%% on every member), --ops ops")
    ap.add_argument("--ops", type=int, default=0, help="with --jitter: ops to run (default 2000)")
    ap.add_argument("--jitter-timeout", type=float, default=600.0)
    ap.add_argument("--keep", action="store_true", help="keep the run folders (logs)")
    # member mode
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--etcd", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--id", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.world < 4:
        ap.error("--world must be >= 4 (the slow-link probe needs a ring where m2-m3 can be avoided)")
    from resilient.coordinator.local_etcd import LocalEtcd

    rc = 0
    with LocalEtcd() as etcd:
        ep = etcd.endpoint_arg
        if args.jitter:
            args.ops = args.ops or 2000
            res = run_jitter(ep, args)
            print(json.dumps(res), flush=True)
            rc = 0 if res["demotions"] == 0 and res["exact"] else 1
        else:
            args.ops = 0
            for case in [c.strip() for c in args.cases.split(",") if c.strip()]:
                try:
                    res = run_case(ep, case, args)
                except Exception as exc:  # report, keep going
                    res = {"case": case, "error": str(exc)[:2000]}
                    rc = 1
                print(json.dumps(res), flush=True)
                if res.get("wrong") or res.get("contributors_agree") is False:
                    rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
