"""Where one compressed allreduce's time goes, per member and phase.

    sudo .venv/bin/python bench/compression_profile.py [--cap 100] [--size 64] [--bits 4] [--iters 5]
    .venv/bin/python bench/compression_profile.py --loopback --cap 0

4 members as in ``bench/compression.py`` (namespaces, htb egress cap; or loopback), one
torch thread each. Every member runs ``--iters`` compressed allreduces of ``--size`` MiB
with the codec stages, the scale agreement, the ring's receive waits and sends wrapped in
timers: wall seconds and the calling thread's CPU seconds (``time.thread_time``) per
phase. One JSON line per member: the median call's total and, per phase, wall / CPU
seconds and call count summed over that call (``op_thread_total``: the whole op body on
the op thread), the same for the first timed call (``first_call``, after one warm-up), each
call's wall seconds (``walls``) and the process's minor page faults per call (``faults``:
16 K per call means a fresh 64 MiB buffer). Timers cost a few microseconds per call (a few hundred calls per op).
Every process and namespace it starts is ended here.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _common import rank_worker_argparser  # noqa: E402
from _netcap import cap_egress, member_lab  # noqa: E402

from resilient.chaos.netns import NetnsLab  # noqa: E402
from resilient.process_pool import DEVNULL, PIPE, ProcessPool, Spec  # noqa: E402

PY = sys.executable
WORLD = 4

_acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*a: Any, **k: Any) -> Any:
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            e = _acc[name]
            e[0] += time.perf_counter() - w0
            e[1] += time.thread_time() - c0
            e[2] += 1
    return wrapper


def _instrument() -> None:
    from resilient.collectives import compressed
    from resilient.collectives.algorithms import base, quantized_ring
    from resilient.collectives.communicator import Communicator
    from resilient.transport.tcp import TcpTransport

    for name in ("bucket_maxima", "quantize", "dequantize"):
        setattr(compressed, name, _timed(name, getattr(compressed, name)))
    for name in ("pack", "pack_into", "unpack_add"):
        setattr(quantized_ring, name, _timed(name, getattr(quantized_ring, name)))
    Communicator.reduce_now = _timed("scale_agreement", Communicator.reduce_now)  # type: ignore[method-assign]
    QR = quantized_ring.QuantizedRing
    QR.run = _timed("ring", QR.run)  # type: ignore[method-assign]
    base.OpContext.wait = _timed("ring_wait", base.OpContext.wait)  # type: ignore[method-assign]
    TcpTransport.isend = _timed("isend", TcpTransport.isend)  # type: ignore[method-assign]
    TcpTransport.irecv = _timed("irecv", TcpTransport.irecv)  # type: ignore[method-assign]
    from resilient.collectives import compression_switch
    compression_switch.run_compressed = _timed("op_thread_total", compressed.run_compressed)


def worker(args: argparse.Namespace) -> int:
    import torch

    from resilient.collectives import Communicator
    from resilient.collectives.group import EtcdGroupView
    from resilient.coordinator import EpochWatcher, MemberInfo, MemberSession, Store
    from resilient.transport.tcp import TcpTransport

    torch.set_num_threads(1)
    _instrument()

    rank, mid = args.rank, f"m{args.rank}"
    store = Store(args.etcd)
    transport = TcpTransport(mid, args.job, host=args.ip)
    session = MemberSession.register(store, args.job, MemberInfo(member_id=mid, address=transport.address), ttl=10)
    watcher = EpochWatcher(store, args.job)
    watcher.wait_for(lambda e: len(e.members) == WORLD and mid in e.members, 60)
    comm = Communicator(EtcdGroupView(store, args.job, session, watcher), transport, op_timeout=120)
    numel = args.size << 18
    g = torch.Generator().manual_seed(rank * 7919 + numel)
    x = torch.randn(numel // 1024, 1024, generator=g)
    t = x.clone()
    comp = f"q{args.bits}"
    comm.allreduce(t)
    comm.allreduce(t.copy_(x), compression=comp)   # warm-up (buffers, connections)
    calls = []
    for _ in range(args.iters):
        _acc.clear()
        t.copy_(x)
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        w0 = time.perf_counter()
        comm.allreduce(t, compression=comp)
        wall = time.perf_counter() - w0
        calls.append({"wall": round(wall, 4), "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0,
                      "phases": {k: [round(v[0], 4), round(v[1], 4), v[2]] for k, v in _acc.items()}})
    med = sorted(calls, key=lambda c: c["wall"])[len(calls) // 2]
    print(json.dumps({"rank": rank, "walls": [c["wall"] for c in calls], "faults": [c["minor_faults"] for c in calls], "first_call": calls[0], "median_call": med,
                      "median_wall": statistics.median(c["wall"] for c in calls)}), flush=True)
    comm.close()
    session.close()
    watcher.close()
    transport.close()
    store.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = rank_worker_argparser(__doc__.splitlines()[0])
    ap.add_argument("--ip", default="", help=argparse.SUPPRESS)
    ap.add_argument("--cap", type=float, default=100.0, help="MB/s per member egress, 0 = uncapped")
    ap.add_argument("--size", type=int, default=64, help="MiB of float32")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--loopback", action="store_true", help="members on 127.0.0.1 (no root; --cap 0)")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    from resilient.coordinator.local_etcd import LocalEtcd

    if args.loopback and args.cap:
        ap.error("--loopback runs uncapped only: pass --cap 0")
    with member_lab(WORLD, args.loopback) as lab, LocalEtcd(host=lab.host_ip) as etcd:
        job = f"cprof-{uuid.uuid4().hex[:8]}"
        if isinstance(lab, NetnsLab):
            for i in range(WORLD):
                cap_egress(lab, i, args.cap)
        with ProcessPool() as pool:
            pool.start(Spec([PY, "-c", "import sys; from resilient.cli import main; sys.exit(main())", "coordinator",
                             "--etcd", etcd.endpoint_arg, "--job", job, "--ttl", "10", "--metrics-port", "-1",
                             "--log-level", "WARNING"], stdout=DEVNULL, stderr=DEVNULL, cwd=ROOT, name="coordinator"))
            procs = []
            for i in range(WORLD):
                cmd = [*lab.exec_prefix(i), PY, str(Path(__file__).resolve()), "--worker", "--rank", str(i),
                       "--ip", lab.ips[i], "--etcd", etcd.endpoint_arg, "--job", job, "--size", str(args.size),
                       "--bits", str(args.bits), "--iters", str(args.iters)]
                procs.append(pool.start(Spec(cmd, stdout=PIPE, stderr=PIPE, cwd=ROOT,
                                             env=dict(os.environ, PYTHONPATH=str(ROOT)), name=f"m{i}")).popen)
            for p in procs:
                out, err = p.communicate(timeout=600)
                if p.returncode != 0:
                    raise RuntimeError(f"worker failed ({p.returncode}): {err[-3000:]}")
                print(out.strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
