"""Hierarchical allreduce, measured in network namespaces with htb-capped host links.

    sudo python bench/hierarchy.py                        # both cases, one JSON line each
    sudo python bench/hierarchy.py --cases hosts --cap-mbit 80 --numel 2000000

Case ``hosts``: 8 members as 2 hosts x 4 — host ``i`` is network namespace ``i`` of a
:class:`~resilient.chaos.netns.NetnsLab`, its 4 member processes talk over the
namespace's loopback inside the host and over its veth across hosts; each veth's egress
is capped by an ``htb`` class at ``--cap-mbit``. The same float32 allreduce runs with
the flat host-ordered ring (``Communicator(hierarchical=False)``), the hierarchical
algorithm (the planner's ``host_groups`` from the members' host labels) — batches of
the two interleaved in one job — and torch.distributed ``gloo`` (8 processes, same
namespaces, ranks host-ordered). Output: ``{"case": "hosts", "hier_s", "flat_s",
"gloo_s", "ratio_vs_flat", "ratio_vs_gloo", ...}`` (seconds per op: the median over
batches of the slowest member's batch time / ops).

Case ``weighted``: 2 hosts x 2, one namespace per member, so each cross-host pair has
its own link: local index 0's pair capped at ``--cap-mbit`` (B), index 1's at 2B (htb
classes per destination; the intra-host pairs are uncapped). Hierarchical allreduce with
uniform shards (no declared speeds, coordinator ``--no-measure-links``) against weighted
shards from the *measured* link speeds, the coordinator's default path: each member's
health reporter puts ``link_bps`` in its windows (per peer: the bytes of its large
frames over the time they took to arrive, the median of the last windows), the
coordinator turns them into member speeds (``speeds_from_health``, hysteresis
``settle_speeds``), classes and the plan's ``shard_weights``. The weighted arm's members
declare nothing; they run allreduces until the epoch of their last op carries
``shard_weights`` (at most ``--warmup-max-ops``, else the case fails), then the timed
batches. ``--declared-speeds``: the old arm instead — ``link_bps`` labels B / 2B and
``--no-measure-links``. Output: ``{"case": "weighted", "uniform_s", "weighted_s",
"ratio_vs_uniform", "weights_from", "shard_weights", "planned_link_mbit",
"planned_link_classes", "warmup", "measured_link_classes"}`` — the planned speeds are
those the weights came from (Mbit/s), ``measured_link_classes`` what the windows say at
the end, ``warmup`` the ops and seconds until the weights came and the epoch before and
after the timed batches, ``replans`` every epoch from the weights' on (number, weights,
speeds): one entry when nothing re-planned during the timed batches.

Every output of every op is checked against the exact sum (integer-valued float32
inputs): ``wrong`` counts mismatches. Needs root (``ip netns``) and the htb qdisc;
otherwise prints ``{"error": ...}`` naming the cause and exits 2. Every process and
namespace made here is removed here (by PID / by the lab), also on errors.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from _common import BenchCluster, BenchError, emit, median, wait_go, worker_argparser  # noqa: E402

PY = sys.executable


# -- member processes ----------------------------------------------------------------------

def _input(index: int, numel: int):
    import torch

    return ((torch.arange(numel, dtype=torch.int64) % 251) * (index + 1)).to(torch.float32)


def _expected(world: int, numel: int):
    import torch

    return ((torch.arange(numel, dtype=torch.int64) % 251) * sum(range(1, world + 1))).to(torch.float32)


def _batch(mode: str, barrier: Any, allreduce: Any, index: int, args: argparse.Namespace, exp: Any) -> None:
    """One timed batch of ``args.ops`` allreduces after a barrier; emits its time and
    how many outputs were not the exact sum."""
    def within(what: str, fn: Any, *fa: Any) -> None:
        # a hang fails with a message: past --op-timeout every thread's stack goes to
        # stderr and the worker exits 3 (the driver raises BenchError with that tail)
        def expired() -> None:
            import faulthandler

            msg = f"{args.id}: {mode} {what} did not finish within {args.op_timeout}s\n"
            sys.stderr.write(msg)
            faulthandler.dump_traceback(all_threads=True)
            sys.stderr.write(msg)   # last too: the driver reports the stderr's tail
            sys.stderr.flush()
            os._exit(3)

        timer = threading.Timer(args.op_timeout, expired)
        timer.daemon = True
        timer.start()
        try:
            fn(*fa)
        finally:
            timer.cancel()

    within("barrier", barrier)
    t0, wrong = time.monotonic(), 0
    for i in range(args.ops):
        x = _input(index, args.numel)
        within(f"allreduce {i}", allreduce, x)
        wrong += int(not bool((x == exp).all()))
    emit("batch", mode=mode, seconds=time.monotonic() - t0, wrong=wrong)


def worker(args: argparse.Namespace) -> int:
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)   # `kill -USR1 <pid>`: every thread's stack to stderr
    index = int(args.id.lstrip("m"))
    exp = _expected(args.world, args.numel)
    if args.backend == "gloo":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=index, world_size=args.world)
        emit("ready")
        wait_go()
        for _ in range(args.rounds):
            _batch("gloo", dist.barrier, dist.all_reduce, index, args, exp)
        dist.barrier()
        dist.destroy_process_group()
        emit("done")
        wait_go()
        return 0

    from resilient.collectives import Communicator
    from resilient.collectives.group import EtcdGroupView
    from resilient.coordinator import EpochWatcher, MemberInfo, MemberSession
    from resilient.coordinator.etcd_access import open_store_from_env
    from resilient.health_reporter import HealthReporter
    from resilient.transport.tcp import TcpTransport

    store = open_store_from_env(args.etcd)
    transport = TcpTransport(args.id, args.job, host=args.bind)
    labels = json.loads(args.labels)
    session = MemberSession.register(store, args.job, MemberInfo(member_id=args.id, host=args.host_label,
                                                                 address=transport.address, labels=labels),
                                     ttl=10.0)   # its own lease: a slow start must not outlive a granted one
    watcher = EpochWatcher(store, args.job)
    watcher.wait_for(lambda e: len(e.members) == args.world and args.id in e.members, 120)
    reporter = HealthReporter(store, args.job, args.id, session.lease_id, transport.stats, interval=0.5)
    comm = Communicator(EtcdGroupView(store, args.job, session, watcher), transport, health_reporter=reporter)
    emit("ready", plan=watcher.current().plan.to_dict())   # the typed EpochPlan, as its JSON record
    wait_go()
    if args.warm_ops:
        _warm_up(comm, index, args, exp)
    for _ in range(args.rounds):
        for mode in args.modes.split(","):
            comm.hierarchical = mode != "flat"   # every member runs the same schedule
            _batch(mode, comm.barrier, comm.allreduce, index, args, exp)
    comm.barrier()
    emit("done")
    wait_go()
    comm.close(leave=True)
    return 0


def _warm_up(comm: Any, index: int, args: argparse.Namespace, exp: Any) -> None:
    """Allreduces (outputs checked) until the epoch they run in carries ``shard_weights``:
    the coordinator planned with the link speeds the health reporters measured. Every
    member ends at the same op: each reads the epoch of its last op, the same on every
    member (a re-plan is adopted at an op boundary the group agrees on). At most
    ``--warm-ops`` (the driver's ``--warmup-max-ops``); emits ``warm`` with the op count
    and the plan either way."""
    comm.barrier()   # from here every member's comm.epoch is the last op's
    t0, n, wrong = time.monotonic(), 0, 0
    while not comm.epoch.plan.shard_weights and n < args.warm_ops:
        x = _input(index, args.numel)
        comm.allreduce(x)
        wrong += int(not bool((x == exp).all()))
        n += 1
    emit("warm", ops=n, seconds=round(time.monotonic() - t0, 3), wrong=wrong, epoch=comm.epoch.number,
         plan=comm.epoch.plan.to_dict())


# -- driver --------------------------------------------------------------------------------

class NetnsCluster(BenchCluster):
    """:class:`BenchCluster` with etcd on the lab's bridge and member ``m<i>`` started
    inside namespace ``ns_of[m]`` with its own extra arguments."""

    join_debounce_ms = 300
    ready_timeout = 180.0

    def __init__(self, lab: Any, ns_of: dict[str, int], extra: dict[str, list[str]], env: dict[str, dict[str, str]],
                 job: str, world: int, coordinator_args: list[str] | None = None) -> None:
        super().__init__(__file__, world, job=job, ttl=10.0, env_for=lambda mid: env.get(mid, {}))
        self.lab, self.ns_of, self.extra = lab, ns_of, extra
        self.coordinator_args = list(coordinator_args or [])
        self.etcd_host = lab.host_ip

    def member_prefix(self, mid: str) -> list[str]:
        return list(self.lab.exec_prefix(self.ns_of[mid]))

    def member_args(self, mid: str) -> list[str]:
        return self.extra[mid]

    def run_batches(self, rounds: int, modes: list[str], warm: bool = False) -> dict[str, Any]:
        """Let the workers go; per mode the median over batches of the slowest member's
        batch time, and the total of wrong outputs. ``warm``: the workers warm up first
        (``--warmup-max-ops``); their ``warm`` reports come back under ``"warm"``."""
        mids = sorted(self.procs, key=lambda m: int(m[1:]))
        self.send(mids, "go")
        per: dict[str, list[float]] = {m: [] for m in modes}
        wrong = 0
        warmed = self.expect_all(mids, "warm", timeout=900) if warm else {}
        wrong += sum(w["wrong"] for w in warmed.values())
        for _ in range(rounds):
            for mode in modes:
                got = self.expect_all(mids, "batch", timeout=600)
                per[mode].append(max(g["seconds"] for g in got.values()))
                wrong += sum(g["wrong"] for g in got.values())
        self.expect_all(mids, "done", timeout=120)
        return {"batches": per, "wrong": wrong, "warm": warmed}


def _tc(lab: Any, i: int, *args: str) -> None:
    from resilient.chaos.netns import NetnsError

    cmd = [*lab.exec_prefix(i), "tc", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {res.stderr.strip()}")


def cap_egress(lab: Any, i: int, default_mbit: float, to: dict[int, float] | None = None) -> None:
    """htb on namespace ``i``'s veth: everything at ``default_mbit``, traffic to namespace
    ``j`` at ``to[j]`` Mbit/s (a class per destination, u32 filter on its IP)."""
    dev = lab.ns_veths[i]
    _tc(lab, i, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
    _tc(lab, i, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
        "rate", f"{default_mbit}mbit", "ceil", f"{default_mbit}mbit")
    for j, mbit in sorted((to or {}).items()):
        cls = f"1:{j + 2:x}"
        _tc(lab, i, "class", "add", "dev", dev, "parent", "1:", "classid", cls, "htb",
            "rate", f"{mbit}mbit", "ceil", f"{mbit}mbit")
        _tc(lab, i, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
            "match", "ip", "dst", f"{lab.ips[j]}/32", "flowid", cls)


def _common_args(a: argparse.Namespace, ops: int) -> list[str]:
    return ["--numel", str(a.numel), "--ops", str(ops), "--rounds", str(a.rounds), "--op-timeout", str(a.op_timeout)]


def case_hosts(a: argparse.Namespace) -> dict[str, Any]:
    from resilient.chaos.netns import NetnsLab
    from resilient.coordinator.local_etcd import free_port

    world, k = 8, 4
    with NetnsLab(2) as lab:
        for i in range(2):
            cap_egress(lab, i, a.cap_mbit)
        ns_of = {f"m{i}": i // k for i in range(world)}
        host = {m: f"host{'AB'[n]}" for m, n in ns_of.items()}
        extra = {m: [*_common_args(a, a.ops), "--bind", lab.ips[ns_of[m]], "--host-label", host[m],
                     "--modes", a.hosts_modes] for m in ns_of}
        with NetnsCluster(lab, ns_of, extra, {}, "hier-hosts", world) as cl:
            plan = cl.ready["m0"]["plan"]
            ours = cl.run_batches(a.rounds, a.hosts_modes.split(","))
        if not a.gloo:
            return {"case": "hosts", "cap_mbit": a.cap_mbit, "wrong": ours["wrong"], "batches": ours["batches"]}
        port = free_port()   # any port: namespace 0 has its own port space
        gextra = {m: [*_common_args(a, a.ops), "--backend", "gloo", "--master", f"{lab.ips[0]}:{port}"] for m in ns_of}
        genv = {m: {"GLOO_SOCKET_IFNAME": lab.ns_veths[ns_of[m]]} for m in ns_of}
        with NetnsCluster(lab, ns_of, gextra, genv, "hier-gloo", world) as cl:
            gloo = cl.run_batches(a.rounds, ["gloo"])
    hier_s = median(ours["batches"]["hier"]) / a.ops
    flat_s = median(ours["batches"]["flat"]) / a.ops
    gloo_s = median(gloo["batches"]["gloo"]) / a.ops
    return {"case": "hosts", "world": world, "hosts": 2, "per_host": k, "bytes": a.numel * 4, "cap_mbit": a.cap_mbit,
            "hier_s": round(hier_s, 4), "flat_s": round(flat_s, 4), "gloo_s": round(gloo_s, 4),
            "ratio_vs_flat": round(flat_s / hier_s, 3), "ratio_vs_gloo": round(gloo_s / hier_s, 3),
            "host_groups": plan.get("host_groups"), "wrong": ours["wrong"] + gloo["wrong"],
            "batches": {**ours["batches"], **gloo["batches"]}}


def case_weighted(a: argparse.Namespace) -> dict[str, Any]:
    from resilient.chaos.netns import NetnsLab
    from resilient.coordinator.epoch import read_epoch
    from resilient.coordinator.health import read_health
    from resilient.coordinator.link_classes import link_classes, speeds_from_health

    world = 4
    B = a.cap_mbit
    # namespace = member: m0, m1 on host A; m2, m3 on host B; local index 0 pair (m0, m2) at B, index 1 (m1, m3) at 2B
    host = {"m0": "hostA", "m1": "hostA", "m2": "hostB", "m3": "hostB"}
    ns_of = {m: int(m[1:]) for m in host}
    speed = {"m0": B, "m1": 2 * B, "m2": B, "m3": 2 * B}   # Mbit/s
    source = "declared" if a.declared_speeds else "measured"
    out: dict[str, Any] = {"case": "weighted", "world": world, "bytes": a.numel * 4, "cap_mbit": [B, 2 * B],
                           "weights_from": source}

    def mbit(bps: float) -> float:
        return round(bps * 8 / 1e6, 1)

    with NetnsLab(4) as lab:
        fast = 100 * B   # intra-host (and to etcd): effectively uncapped
        cap_egress(lab, 0, fast, {2: B, 3: B})
        cap_egress(lab, 1, fast, {3: 2 * B, 2: B})
        cap_egress(lab, 2, fast, {0: B, 1: B})
        cap_egress(lab, 3, fast, {1: 2 * B, 0: B})
        results = {}
        for mode in ("uniform", "weighted"):
            declared = mode == "weighted" and a.declared_speeds
            warm = mode == "weighted" and not a.declared_speeds
            labels = {m: ({"link_bps": str(speed[m] * 1e6 / 8)} if declared else {}) for m in host}
            extra = {m: [*_common_args(a, a.ops), "--bind", lab.ips[ns_of[m]], "--host-label", host[m],
                         "--modes", "hier", "--labels", json.dumps(labels[m]),
                         "--warm-ops", str(a.warmup_max_ops if warm else 0)] for m in host}
            # uniform: no labels and no measurement (with the coordinator's default, measured
            # link speeds, it would be weighted too); weighted: the default — the health
            # reporters' link_bps -> speeds_from_health -> settle_speeds -> the plan's
            # shard_weights — after a warm-up until the epoch carries them; or, with
            # --declared-speeds, link_bps labels and no measurement
            coord = [] if warm else ["--no-measure-links"]
            with NetnsCluster(lab, ns_of, extra, {}, f"hier-{mode}", world, coord) as cl:
                plan = cl.ready["m0"]["plan"]
                r = cl.run_batches(a.rounds, ["hier"], warm=warm)
                if mode == "weighted":
                    health = read_health(cl.store, cl.job)
                    classes = link_classes(speeds_from_health(health, host))
                    out["measured_link_classes"] = [[mbit(s), ids] for s, ids in classes]  # Mbit/s, at the end
                    last, _ = read_epoch(cl.store, cl.job)
                    if warm:
                        w = r["warm"]["m0"]
                        if not w["plan"].get("shard_weights"):
                            raise BenchError(f"no measured shard weights within --warmup-max-ops {a.warmup_max_ops} "
                                             f"ops ({w['seconds']} s); measured classes {out['measured_link_classes']}")
                        plan = w["plan"]
                        out["warmup"] = {"ops": w["ops"], "seconds": w["seconds"], "epoch": w["epoch"],
                                         "epoch_after": last.number if last else None}
                        # every re-plan from the weights' epoch on: [number, shard weights, speeds in Mbit/s]
                        out["replans"] = [[e.number, list(e.plan.shard_weights or ()),
                                           {m: mbit(v) for m, v in sorted((e.plan.get("link_bps") or {}).items())}]
                                          for e in _epochs(cl.store, cl.job) if e.number >= w["epoch"]]
                    out["shard_weights"] = plan.get("shard_weights")
                    out["planned_link_mbit"] = {m: mbit(v) for m, v in sorted((plan.get("link_bps") or {}).items())}
                    out["planned_link_classes"] = plan.get("link_classes")
            results[mode] = r
            out[f"{mode}_s"] = round(median(r["batches"]["hier"]) / a.ops, 4)
    out["ratio_vs_uniform"] = round(out["uniform_s"] / out["weighted_s"], 3)
    out["wrong"] = sum(r["wrong"] for r in results.values())
    out["batches"] = {m: r["batches"]["hier"] for m, r in results.items()}
    return out


def _epochs(store: Any, job: str) -> list[Any]:
    """Every published epoch record of ``job`` (kept as history), by number; malformed
    ones left out."""
    from resilient.coordinator import keys
    from resilient.coordinator.epoch import Epoch
    from resilient.errors import RecordError

    out = []
    for kv in store.get_prefix(keys.root(job) + "epochs/"):
        if kv.key.endswith("/epoch"):
            try:
                out.append(Epoch.from_json(kv.value, kv.key))
            except RecordError:
                continue
    return sorted(out, key=lambda e: e.number)


def _stop_on_signals() -> None:
    """SIGTERM like SIGINT: the first raises KeyboardInterrupt in the driver, so the
    ``with`` blocks stop the workers, the coordinator, etcd (by PID) and remove the
    namespaces and veths; later ones are ignored so that cleanup runs to its end."""
    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def main() -> int:
    ap = worker_argparser(__doc__)
    ap.add_argument("--cases", default="hosts,weighted")
    ap.add_argument("--cap-mbit", type=float, default=60.0, help="host link cap (weighted: B, the slow link)")
    ap.add_argument("--numel", type=int, default=1 << 21, help="float32 elements per allreduce (default 8 MiB)")
    ap.add_argument("--ops", type=int, default=3, help="allreduces per timed batch")
    ap.add_argument("--rounds", type=int, default=3, help="timed batches per mode")
    ap.add_argument("--op-timeout", type=float, default=120.0,
                    help="seconds one worker op (barrier or allreduce) may take; past it the worker dumps its "
                         "threads' stacks to stderr and exits, and the bench fails naming it")
    ap.add_argument("--hosts-modes", default="flat,hier",
                    help="case hosts: the modes to run (a subset of flat,hier; not both: no ratios)")
    ap.add_argument("--no-gloo", dest="gloo", action="store_false",
                    help="case hosts: skip the gloo run (and so the ratios)")
    ap.add_argument("--declared-speeds", action="store_true",
                    help="case weighted: the weighted arm's members declare link_bps labels (B, 2B) and the "
                         "coordinator does not measure; default: shard weights from the measured link speeds")
    ap.add_argument("--warmup-max-ops", type=int, default=60,
                    help="case weighted, measured: allreduces within which the coordinator must have published "
                         "measured shard weights (else the case fails saying so)")
    # worker side
    ap.add_argument("--world", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--backend", default="resilient", help=argparse.SUPPRESS)
    ap.add_argument("--master", default="", help=argparse.SUPPRESS)
    ap.add_argument("--bind", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--host-label", default="", help=argparse.SUPPRESS)
    ap.add_argument("--labels", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--modes", default="hier", help=argparse.SUPPRESS)
    ap.add_argument("--warm-ops", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    from resilient.chaos.netns import netns_unavailable_reason, qdisc_unavailable_reason

    why = netns_unavailable_reason() or qdisc_unavailable_reason("htb")
    if why is not None:
        print(json.dumps({"error": why}))
        return 2
    _stop_on_signals()
    rc = 0
    for case in a.cases.split(","):
        try:
            res = {"hosts": case_hosts, "weighted": case_weighted}[case](a)
        except (BenchError, KeyError) as exc:
            res, rc = {"case": case, "error": str(exc)}, 1
        except KeyboardInterrupt:   # SIGINT / SIGTERM: the with-blocks above stopped everything
            print(json.dumps({"case": case, "error": "interrupted (SIGINT/SIGTERM); workers, etcd, "
                              "coordinator and namespaces removed"}), flush=True)
            return 130
        res["loadavg"] = open("/proc/loadavg").read().split()[:3]
        print(json.dumps(res), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
