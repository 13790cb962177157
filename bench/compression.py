"""Compressed allreduce benchmark: 4 members in network namespaces, links capped with htb.

    sudo .venv/bin/python bench/compression.py [--caps 100,400,0] [--sizes 4,16,64] [--iters 3]

Each member runs in its own namespace of a :class:`resilient.chaos.netns.NetnsLab`; its
egress is capped by an ``htb`` root class at ``cap`` MB/s (0 = uncapped). Arms, side by
side in one run per cap: gloo fp32, gloo with torch's fp16-hook semantics (cast to fp16,
allreduce, cast back, divide), resilient fp32, resilient q8 / q4 (the exact compressed
allreduce), and resilient ``compression="auto"`` (the switch). Every compressed output is
checked bitwise (the second of two untimed warm-up calls per compressed arm), on every member, against ``fl32(sum_{i in C} s * q_i)`` recomputed from
all contributors' inputs with the agreed scales (``exact``). One JSON line per (cap, size):
``cap_mb_s`` (null uncapped), ``size_mib``, ``q4_vs_fp32``, ``q8_vs_fp32``,
``q4_vs_gloo_fp16``, ``switch_choice``, ``switch_loss`` (auto's time over the best arm's,
minus 1; timed after the switch's probes, in its steady state), ``switch_vs_fp32`` (auto
over plain resilient fp32, the two timed alternately call by call, ``max(paired_rounds,
iters * 64 / size)`` rounds (``--paired-rounds``, 15 by default: with 3 rounds the median of
two identical ops differed by up to 32 % at 64 MiB on this loaded 2-core machine); ``switch_vs_fp32_mean`` the same from mean times, which include the votes), ``switch_votes`` (votes held in those calls: one every ``revote_every`` = 64), ``switch_measured`` (per member, the seconds the switch's probes measured for fp32 and q4: it picks q4 only when every member measured q4 faster by its margin), ``exact``, and the median
seconds per arm.

Every member runs torch with one intra-op thread (``torch.set_num_threads(1)``, what
``resilient-run`` sets for several workers per node), for every arm alike.

``--loopback --caps 0`` runs the uncapped case without namespaces (no root): every
member on 127.0.0.1. Otherwise it needs root (namespaces, tc) and etcd; every process, namespace and the etcd it starts are
ended here. Figures depend on the machine's load: report ``/proc/loadavg`` with them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _common import rank_worker_argparser  # noqa: E402
from _netcap import MemberLab, cap_egress, member_lab  # noqa: E402

from resilient.chaos.netns import NetnsLab  # noqa: E402

if TYPE_CHECKING:
    import torch

    from resilient.collectives import Communicator
PY = sys.executable
WORLD = 4

from resilient.process_pool import DEVNULL, PIPE, ProcessPool, Spec  # noqa: E402 - after the path insert


def _input(rank: int, numel: int, step: int) -> torch.Tensor:
    import torch

    g = torch.Generator().manual_seed(rank * 7919 + numel + step)
    return torch.randn(numel // 1024, 1024, generator=g)


def _exact(comm: Communicator, out: torch.Tensor, contributors: Sequence[str], numel: int, step: int) -> bool:
    """``out`` == fl32(sum over contributors of s * q_i) with the agreed scales."""
    import torch

    from resilient.collectives.quantization import dequantize, quantize

    info = comm.last_compression
    segs, b, nb = info["segments"], info["bucket"], info["members_bound"]
    Q = torch.zeros(numel, dtype=torch.int32)
    for m in contributors:
        Q += quantize(_input(int(m[1:]), numel, step).reshape(-1), info["scales"], segs, b, nb)
    return bool(torch.equal(out.reshape(-1), dequantize(Q, info["scales"], segs, b)))


def _timed(fn: Callable[[], object], iters: int) -> float:
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from resilient.collectives import Communicator
    from resilient.collectives.group import EtcdGroupView
    from resilient.coordinator import EpochWatcher, MemberInfo, MemberSession, Store
    from resilient.transport.tcp import TcpTransport

    # one intra-op thread per member, as resilient-run (and torchrun) set for several
    # workers per node: 4 members share this machine's cores, for every arm alike
    torch.set_num_threads(1)
    rank, ip = args.rank, args.ip
    sizes = [int(s) for s in args.sizes.split(",")]
    res: dict[int, dict[str, Any]] = {s: {} for s in sizes}   # size -> arm -> seconds (and the switch's facts)
    os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
    dist.init_process_group("gloo", init_method=f"tcp://{args.ip0}:{args.gloo_port}", rank=rank, world_size=WORLD)
    for s in sizes:
        numel = s << 18
        x = _input(rank, numel, 0)
        t = x.clone()
        dist.all_reduce(t)  # warm-up (connections)

        def g32() -> None:
            t.copy_(x)
            dist.all_reduce(t)

        def g16() -> None:  # torch's fp16_compress_hook: cast, allreduce, cast back, divide
            h = x.to(torch.float16).div_(WORLD)
            dist.all_reduce(h)
            t.copy_(h)

        res[s]["gloo_fp32"] = _timed(g32, args.iters)
        res[s]["gloo_fp16"] = _timed(g16, args.iters)
    dist.destroy_process_group()

    store = Store(args.etcd)
    mid = f"m{rank}"
    transport = TcpTransport(mid, args.job, host=ip)
    session = MemberSession.register(store, args.job, MemberInfo(member_id=mid, address=transport.address), ttl=10)
    watcher = EpochWatcher(store, args.job)
    watcher.wait_for(lambda e: len(e.members) == WORLD and mid in e.members, 60)
    comm = Communicator(EtcdGroupView(store, args.job, session, watcher), transport, op_timeout=120)
    for s in sizes:
        numel = s << 18
        x = _input(rank, numel, 0)
        t = x.clone()
        comm.allreduce(t)  # warm-up
        exact = True
        for arm, comp in (("res_fp32", None), ("res_q8", "q8"), ("res_q4", "q4")):
            def run(comp: str | None = comp) -> None:
                t.copy_(x)
                comm.allreduce(t, compression=comp)
            if comp is not None:
                # two untimed calls first, the second checked bitwise: the first compressed
                # arm of a size faults in its q buffers (two: last_compression holds the
                # previous call's q), which cost q8 at 64 MiB up to 1 s per call
                run()
                w = comm.allreduce(t.copy_(x), compression=comp)
                exact &= _exact(comm, t, w.contributors, numel, 0)
            res[s][arm] = _timed(run, args.iters)
        choices = []

        def auto() -> None:
            t.copy_(x)
            comm.allreduce(t, compression="auto")
            choices.append(comm.compression_switch.last_choice)
        sw = comm.compression_switch
        for _ in range(8):   # the probes (fp32 measures the link, then q4 if the model predicts a gain)
            if sw is not None and sw.plans and not sw.needs_vote(numel * 4, 4, comm.admitted_at):
                break
            auto()
            sw = comm.compression_switch
        votes0 = sw.votes if sw is not None else 0
        # auto and plain fp32 alternate call by call, so a load change hits both alike;
        # max(paired_rounds, iters x (64 MiB / size)) rounds: a small op gets more (and its
        # share of the votes); a floor of rounds so that two medians of the same op agree
        fp32_t, auto_t = [], []
        for _ in range(max(args.paired_rounds, args.iters * max(1, 64 // s))):
            fp32_t.append(_timed(lambda: comm.allreduce(t.copy_(x)), 1))
            auto_t.append(_timed(auto, 1))
        res[s]["res_auto"] = statistics.median(auto_t)
        res[s]["res_fp32_paired"] = statistics.median(fp32_t)
        res[s]["res_auto_mean"], res[s]["res_fp32_paired_mean"] = statistics.mean(auto_t), statistics.mean(fp32_t)
        res[s]["switch_choice"] = choices[-1]
        sw = comm.compression_switch   # what its probes measured (size class of the op), per member
        c = (numel * 4).bit_length()
        res[s]["switch_measured"] = ({arm: round(sw.measured[(c, arm)], 4) for arm in ("fp32", "q4")
                                      if (c, arm) in sw.measured} if sw is not None else {})
        res[s]["switch_votes"] = (comm.compression_switch.votes - votes0) if comm.compression_switch else 0
        res[s]["exact"] = exact
    print(json.dumps({"rank": rank, "results": res}), flush=True)
    comm.close()
    session.close()
    watcher.close()
    transport.close()
    store.close()
    return 0


def run_cap(lab: MemberLab, etcd: str, mb_s: float, args: argparse.Namespace) -> list[dict[str, object]]:
    job = f"compress-{uuid.uuid4().hex[:8]}"
    if isinstance(lab, NetnsLab):
        for i in range(WORLD):
            cap_egress(lab, i, mb_s)
    with ProcessPool() as pool:   # every process stopped by PID on the way out
        pool.start(Spec([PY, "-c", "import sys; from resilient.cli import main; sys.exit(main())", "coordinator",
                         "--etcd", etcd, "--job", job, "--ttl", "10", "--metrics-port", "-1",
                         "--log-level", "WARNING"], stdout=DEVNULL, stderr=DEVNULL, cwd=ROOT, name="coordinator"))
        procs = []
        port = 29500 + int(uuid.uuid4().int % 1000)
        for i in range(WORLD):
            cmd = [*lab.exec_prefix(i), PY, str(Path(__file__).resolve()), "--worker", "--rank", str(i),
                   "--ip", lab.ips[i], "--ip0", lab.ips[0], "--ifname", lab.ns_veths[i], "--gloo-port", str(port),
                   "--etcd", etcd, "--job", job, "--sizes", args.sizes, "--iters", str(args.iters),
                   "--paired-rounds", str(args.paired_rounds)]
            procs.append(pool.start(Spec(cmd, stdout=PIPE, stderr=PIPE, cwd=ROOT,
                                         env=dict(os.environ, PYTHONPATH=str(ROOT)), name=f"m{i}")).popen)
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=args.timeout)
            if p.returncode != 0:
                raise RuntimeError(f"worker failed ({p.returncode}): {err[-3000:]}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
    lines = []
    for s in [int(x) for x in args.sizes.split(",")]:
        per = [o["results"][str(s)] for o in outs]
        t = {k: max(r[k] for r in per) for k in per[0] if k.startswith(("gloo", "res"))}  # slowest member
        best = min(t["res_fp32"], t["res_q4"])
        lines.append({"cap_mb_s": mb_s or None, "size_mib": s, "q4_vs_fp32": round(t["res_fp32"] / t["res_q4"], 3),
                      "q8_vs_fp32": round(t["res_fp32"] / t["res_q8"], 3),
                      "q4_vs_gloo_fp16": round(t["gloo_fp16"] / t["res_q4"], 3),
                      "switch_choice": per[0]["switch_choice"],
                      "switch_agreed": len({r["switch_choice"] for r in per}) == 1,
                      "switch_loss": round(t["res_auto"] / best - 1, 3),
                      "switch_vs_fp32": round(t["res_auto"] / t["res_fp32_paired"] - 1, 3),
                      "switch_vs_fp32_mean": round(t["res_auto_mean"] / t["res_fp32_paired_mean"] - 1, 3),
                      "switch_votes": max(r["switch_votes"] for r in per),
                      "switch_measured": [r.get("switch_measured") for r in per],
                      "exact": all(r["exact"] for r in per), "seconds": {k: round(v, 4) for k, v in t.items()}})
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = rank_worker_argparser(__doc__.splitlines()[0])
    ap.add_argument("--ip", default="", help=argparse.SUPPRESS)
    ap.add_argument("--ip0", default="", help=argparse.SUPPRESS)
    ap.add_argument("--ifname", default="", help=argparse.SUPPRESS)
    ap.add_argument("--gloo-port", type=int, default=29500, help=argparse.SUPPRESS)
    ap.add_argument("--caps", default="100,400,0", help="MB/s per member egress, 0 = uncapped")
    ap.add_argument("--sizes", default="4,16,64", help="MiB of float32 per allreduce")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--paired-rounds", type=int, default=15,
                    help="floor on the rounds of auto and plain fp32 timed alternately (switch_vs_fp32)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--loopback", action="store_true",
                    help="no namespaces (no root needed): members on 127.0.0.1, uncapped only (--caps 0)")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    from resilient.coordinator.local_etcd import LocalEtcd

    if args.loopback and any(float(c) for c in args.caps.split(",")):
        ap.error("--loopback runs uncapped only: pass --caps 0")
    with member_lab(WORLD, args.loopback) as lab, LocalEtcd(host=lab.host_ip) as etcd:
        for cap in [float(c) for c in args.caps.split(",")]:
            for line in run_cap(lab, etcd.endpoint_arg, cap, args):
                print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
