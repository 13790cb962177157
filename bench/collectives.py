"""Allreduce bandwidth: resilient's ring vs torch's gloo, in the same processes.

    python bench/collectives.py --world 4 --sizes 64K,1M,16M,64M [--rounds 10] [--transport auto|tcp]

Starts a real etcd, a real coordinator and ``--world`` member processes. Each member
joins the job (a :class:`~resilient.collectives.Communicator` over the transport
``--transport`` names: ``auto``, the default, is shared memory between these same-host
members (:mod:`resilient.transport.hybrid`); ``tcp`` is TCP only) and
also ``dist.init_process_group("gloo")`` (a TCPStore hosted by member 0), both with
``torch.set_num_threads(1)``. For every size, each round times gloo's ``all_reduce``, then
ours with the ledger on and off (``Communicator.ledger_enabled``, toggled on every member
between ops), in both orders within every round (gloo, on, off, gloo, off, on, each timing
half of ``iters``: a position effect cannot bias the ledger pair); every timing
starts after a gloo barrier and runs back-to-back float32 SUM allreduces. A
round's time per op is the slowest member's. One JSON line per size::

    {"size_bytes", "transport", "busbw_resilient", "busbw_gloo", "ratio_vs_gloo", "ledger_overhead", ...}

busbw = 2(n-1)/n * size / time (NCCL tests' definition) in bytes/s from the median round;
``cpu_per_op_*_s`` = median process CPU seconds (all threads, user+sys) per op on one member
(on a machine with fewer cores than members, busbw is bounded by this);
``ledger_overhead`` = median over rounds of t(ledger on) / t(ledger off) - 1;
``ledger_overhead_paired`` = the same from extra rounds of ``max(PAIRED_MIN, iters)`` ops in which
every member switches the ledger on and off at every op (the sum of the on-ops' times
over the off-ops', the slowest member's of each; a change of load between two timings
cannot land on one side).
Failure behaviour: a member that dies or hangs makes the run fail with its stderr tail.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import BenchCluster, busbw, emit, join, median, parse_size, wait_go, worker_argparser  # noqa: E402

VARIANTS = ("gloo", "ledger_on", "ledger_off")
#: ops per paired round at least (4 a side: with one a side, at 64 MiB, a round's ratio was
#: one op's wall time over another's, and the median swung by +-0.08 between runs)
PAIRED_MIN = 8


def iters_for(size: int) -> int:
    """Back-to-back ops per timing: ~64 MiB of payload per timing, 1..64 ops."""
    return max(1, min(64, (64 << 20) // max(1, size)))


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    kw = {"slice_bytes": args.slice_bytes} if args.slice_bytes else {}
    if args.small_bytes:
        kw["small_bytes"] = args.small_bytes
    comm, _, _, index = join(args, **kw)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.gloo_port}", rank=index,
                            world_size=args.world)
    emit("ready")
    while True:
        cmd = wait_go()
        if cmd == "quit":
            break
        spec = json.loads(cmd)
        size, rounds = spec["size"], spec["rounds"]
        numel = size // 4
        x = torch.ones(numel, dtype=torch.float32)
        k = iters_for(size)

        def run(variant: str, iters: int) -> tuple[float, float]:
            """(wall seconds, this process's CPU seconds, all threads) for ``iters`` ops."""
            if variant != "gloo":
                comm.ledger_enabled = variant == "ledger_on"
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(iters):
                if variant == "gloo":
                    dist.all_reduce(x)
                else:
                    comm.allreduce(x)
            return time.perf_counter() - t0, time.process_time() - c0

        def run_paired(r: int, iters: int) -> tuple[float, float]:
            """``iters`` ops with the ledger on and off in turn (every member switches at
            the same op: by its parity): (seconds of the ops with it on, with it off)."""
            dist.barrier()
            acc = [0.0, 0.0]
            for i in range(iters):
                on = (i + r) % 2 == 0
                comm.ledger_enabled = on
                t0 = time.perf_counter()
                comm.allreduce(x)
                acc[0 if on else 1] += time.perf_counter() - t0
            return acc[0], acc[1]

        for v in VARIANTS:  # warm-up: connections, allocator, page faults
            run(v, min(k, 2))
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
        half = max(1, k // 2)
        for r in range(rounds):
            # Both orders in every round (gloo, on, off, gloo, off, on; half the ops
            # each): on and off are adjacent, each follows gloo once and the other once,
            # so a position effect (the run right after gloo's) cancels in every round
            # whatever the number of rounds; the first half's order alternates by round.
            first, second = ("ledger_on", "ledger_off") if r % 2 == 0 else ("ledger_off", "ledger_on")
            acc = {v: [0.0, 0.0] for v in VARIANTS}
            for v in ("gloo", first, second, "gloo", second, first):
                wall, c = run(v, half)
                acc[v][0] += wall
                acc[v][1] += c
            for v in VARIANTS:
                times[v].append(acc[v][0] / (2 * half))
                cpu[v].append(acc[v][1] / (2 * half))
        paired = [run_paired(r, max(PAIRED_MIN, k)) for r in range(rounds)]
        comm.ledger_enabled = True
        emit("times", size=size, iters=2 * half, times=times, cpu=cpu, paired=paired)
    dist.destroy_process_group()
    comm.close()  # leaves the group, then closes the transport, the session and the store


def main() -> None:
    ap = worker_argparser(__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--sizes", default="64K,1M,16M,64M", help="comma-separated message sizes (K/M/G suffixes)")
    ap.add_argument("--rounds", type=int, default=10, help="alternating rounds per size (medians are reported)")
    ap.add_argument("--slice-bytes", type=int, default=0,
                    help="override the communicator's pipelining slice size (default: its own)")
    ap.add_argument("--small-bytes", type=int, default=0,
                    help="override the size up to which recursive doubling is used (default: the communicator's)")
    ap.add_argument("--transport", choices=("auto", "tcp"), default="auto",
                    help="members' transport: auto = shared memory on one host (the shm arm), tcp = TCP only")
    ap.add_argument("--shm-direct", choices=("1", "0"), default="1",
                    help="with --transport auto: 1 = allreduce through the direct shared-memory algorithm "
                         "(RESILIENT_SHM_DIRECT=1), 0 = the ring over shared-memory links")
    ap.add_argument("--gloo-port", type=int, default=0, help=argparse_hidden())
    args = ap.parse_args()
    if args.worker:
        worker(args)
        os._exit(0)
    if args.world < 2:
        raise SystemExit("--world must be >= 2")
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    from resilient.coordinator.local_etcd import free_port

    port = free_port()
    os.environ["RESILIENT_TRANSPORT"] = args.transport  # inherited by the member processes
    os.environ["RESILIENT_SHM_DIRECT"] = args.shm_direct
    with BenchCluster(os.path.abspath(__file__), args.world, job="bench-collectives",
                      worker_args=["--gloo-port", str(port), "--slice-bytes", str(args.slice_bytes),
                                   "--small-bytes", str(args.small_bytes)]) as cl:
        mids = sorted(cl.procs)
        for size in sizes:
            size -= size % 4
            cl.send(mids, json.dumps({"size": size, "rounds": args.rounds}))
            res = cl.expect_all(mids, "times", timeout=600)
            per_round = {v: [max(res[m]["times"][v][r] for m in mids) for r in range(args.rounds)] for v in VARIANTS}
            t_ours, t_gloo = median(per_round["ledger_on"]), median(per_round["gloo"])
            overhead = median([on / off - 1 for on, off in zip(per_round["ledger_on"], per_round["ledger_off"])])
            paired = [max(res[m]["paired"][r][0] for m in mids) / max(res[m]["paired"][r][1] for m in mids) - 1
                      for r in range(args.rounds)]
            bw_ours, bw_gloo = busbw(size, t_ours, args.world), busbw(size, t_gloo, args.world)
            print(json.dumps({
                "size_bytes": size, "transport": args.transport, "shm_direct": args.shm_direct == "1", "busbw_resilient": round(bw_ours), "busbw_gloo": round(bw_gloo),
                "ratio_vs_gloo": round(bw_ours / bw_gloo, 3), "ledger_overhead": round(overhead, 4),
                "ledger_overhead_paired": round(median(paired), 4),
                "world": args.world, "rounds": args.rounds, "iters_per_round": res[mids[0]]["iters"],
                "t_resilient_s": t_ours, "t_gloo_s": t_gloo, "t_ledger_off_s": median(per_round["ledger_off"]),
                "cpu_per_op_resilient_s": median([c for m in mids for c in res[m]["cpu"]["ledger_on"]]),
                "cpu_per_op_gloo_s": median([c for m in mids for c in res[m]["cpu"]["gloo"]]),
                "load_avg_1m": os.getloadavg()[0],
            }), flush=True)
        cl.send(mids, "quit")


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
